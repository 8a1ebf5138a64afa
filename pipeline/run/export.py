"""Exports people load without this project (launch/export_weights.py --format timm | onnx).

timm: a folder that `timm.create_model("local-dir:FOLDER", pretrained=True)` builds and loads as it ran here
(a VisionTransformer as timm's VisionTransformer, a DINOv3ViT as timm's DINOv3 class, eva.py's Eva):

    FOLDER/config.json          timm's layout: architecture (a timm ViT entry point), model_args (every
                                constructor argument that decides the weights), pretrained_cfg (input size,
                                mean/std, interpolation, crop_pct: the run's eval transform), num_classes
    FOLDER/model.safetensors    the weights in timm's names (ours are timm's: docs/model.md)
    FOLDER/README.md            the model card: source run and checkpoint, data and its digest, the recipe,
                                the run's last evaluation figures, how to load it

onnx: FOLDER/model.onnx, the feature extractor (outputs `cls` and `mean_patch`, (batch, D) each, and `logits`
where the model has a classifier), the batch dimension dynamic (and the height and width for a DINOv3 ViT, whose
RoPE has no table), checked against PyTorch with ONNX Runtime before it is kept (`check_onnx`), at the trained
size and, for a DINOv3 ViT, another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import DataConfig
from pipeline.data import dataset_info_of
from pipeline.eval.features import embedding
from pipeline.model.dinov3 import DINOv3ViT
from pipeline.model.timm_backbone import TimmBackbone
from pipeline.model.variants import pair
from pipeline.model.vit import VisionTransformer, architecture
from pipeline.model.weights import WeightsError, save_weights
from pipeline.run.backbone import Backbone

ONNX_TOLERANCE = 1e-4  # the largest |ONNX Runtime - PyTorch| allowed on the check batch
# timm entry points whose defaults the model_args then override: the MLP is the one thing model_args cannot
# say in JSON (a class), so the entry point carries it.
TIMM_ENTRY = {"mlp": "vit_base_patch16_224", "swiglu": "vit_giant_patch14_dinov2"}
TIMM_DINOV3_ENTRY = {"mlp": "vit_small_patch16_dinov3", "swiglu": "vit_small_plus_patch16_dinov3"}


def timm_config(backbone: Backbone) -> dict[str, Any]:
    """timm's config.json for the backbone (what `load_model_config_from_path` reads): a VisionTransformer as
    timm's vision_transformer.py, a DINOv3ViT as timm's DINOv3 models (eva.py's `vit_*_patch16_dinov3`)."""
    if isinstance(backbone.model, DINOv3ViT):
        return _timm_dinov3_config(backbone)
    if isinstance(backbone.model, TimmBackbone):  # a distillation's timm student: timm's own model and arguments
        m = backbone.model
        return {"architecture": m.timm_model, "num_classes": 0, "num_features": m.embed_dim,
                "model_args": m.timm_kwargs, "pretrained_cfg": {
                    **_pretrained_cfg(backbone, m.img_size, False, 0),
                    **{k: v for k, v in m.model.pretrained_cfg.items() if k in ("first_conv", "classifier")}}}
    k = {**architecture(VisionTransformer, backbone.kwargs), **backbone.kwargs}  # the constructor's defaults filled in
    if k.get("representation_size"):
        raise WeightsError(f"{backbone.source}: a pre-logits layer (model.representation_size) has no timm "
                           f"equivalent in VisionTransformer's arguments; export --format safetensors instead")
    if k.get("stem", "patch") != "patch":
        raise WeightsError(f"{backbone.source}: a convolutional stem (model.stem: conv) has no equivalent in timm's "
                           f"VisionTransformer; export --format onnx or safetensors instead")
    if k.get("reg_tokens") and not k.get("no_embed_class"):
        raise WeightsError(f"{backbone.source}: registers with a position row for the class token are Meta's layout, "
                           f"not timm's; export --format safetensors instead")
    h, w = pair(k["img_size"])
    args = {"img_size": [h, w], "patch_size": k["patch_size"], "embed_dim": k["embed_dim"], "depth": k["depth"],
            "num_heads": k["num_heads"], "mlp_ratio": k["mlp_ratio"], "qkv_bias": k["qkv_bias"],
            "class_token": True, "global_pool": k["global_pool"], "init_values": k.get("init_values"),
            "reg_tokens": k.get("reg_tokens", 0), "no_embed_class": bool(k.get("no_embed_class")),
            "dynamic_img_size": bool(k.get("dynamic_img_size")), "num_classes": k["num_classes"],
            "in_chans": k.get("in_chans", 3)}  # an array set's channels (docs/data.md): timm builds its patch embedding
    return {"architecture": TIMM_ENTRY[k.get("mlp_layer") or "mlp"], "num_classes": k["num_classes"],
            "num_features": k["embed_dim"], "model_args": args,
            "pretrained_cfg": _pretrained_cfg(backbone, (h, w), not args["dynamic_img_size"], k["num_classes"])}


def _timm_dinov3_config(backbone: Backbone) -> dict[str, Any]:
    """timm's DINOv3 entry point for the MLP (GELU or SwiGLU: the one thing model_args cannot say), its
    defaults overridden by every argument that decides the weights. What timm's Eva cannot express (RoPE
    periods from min/max, other coordinate normalisations, another LayerNorm eps) is refused in one line."""
    k = architecture(DINOv3ViT, backbone.kwargs)
    unsaid = {"rope_min_period": None, "rope_max_period": None, "rope_normalize_coords": "separate", "norm_eps": 1e-5}
    differ = [f"{key}={k[key]}" for key, value in unsaid.items() if k[key] != value]
    if differ or k["rope_temperature"] is None:
        raise WeightsError(f"{backbone.source}: {', '.join(differ) or 'rope_temperature=None'} has no equivalent in "
                           f"timm's DINOv3 ViT (eva.py: RoPE base periods, 'separate' coordinates, LayerNorm eps "
                           f"1e-5); export --format safetensors or onnx instead")
    h, w = pair(k["img_size"])
    swiglu = k["mlp_layer"] == "swiglu"
    args = {"img_size": [h, w], "patch_size": k["patch_size"], "embed_dim": k["embed_dim"], "depth": k["depth"],
            "num_heads": k["num_heads"], "mlp_ratio": k["mlp_ratio"], "qkv_bias": k["qkv_bias"],
            "init_values": k["init_values"], "num_reg_tokens": k["reg_tokens"], "rope_temperature": k["rope_temperature"],
            "global_pool": k["global_pool"], "num_classes": k["num_classes"], "in_chans": k.get("in_chans", 3),
            # timm's Eva packs SwiGLU's gate and value into one fc1 unless it aligns (or scales): rounding to a
            # multiple of 1 keeps the width and gives the separate fc1_g/fc1_x our weights have.
            **({"swiglu_align_to": k["swiglu_align_to"] or 1} if swiglu else {})}
    return {"architecture": TIMM_DINOV3_ENTRY[k["mlp_layer"]], "num_classes": k["num_classes"],
            "num_features": k["embed_dim"], "model_args": args,
            "pretrained_cfg": _pretrained_cfg(backbone, (h, w), False, k["num_classes"])}


def _pretrained_cfg(backbone: Backbone, size: tuple[int, int], fixed: bool, classes: int) -> dict[str, Any]:
    """The run's eval transform as timm's data config reads it (resolve_data_config)."""
    data = backbone.data
    channels = backbone.kwargs.get("in_chans", 3)  # an array set's (docs/data.md); timm's data config says it
    return {"input_size": [channels, *size], "fixed_input_size": fixed, "interpolation": data.interpolation,
            "crop_pct": data.crop_pct, "crop_mode": "center", "mean": list(data.mean), "std": list(data.std),
            "num_classes": classes, "first_conv": "patch_embed.proj", "classifier": "head",
            "license": "see the model card (README.md)"}


def check_folder(folder: Path, names: tuple[str, ...], force: bool = False) -> None:
    """An output folder is new or empty; with `force` (--force) it may hold what this export writes, which is
    replaced: else one line."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise WeightsError(f"{folder} exists and is not a folder: give a new or empty folder as --out")
    others = sorted(p.name for p in folder.iterdir() if p.name not in names)
    ours = sorted(p.name for p in folder.iterdir() if p.name in names)
    if others:
        raise WeightsError(f"{folder} exists and holds other files ({', '.join(others[:3])}): give a new or empty "
                           f"folder as --out")
    if ours and not force:
        raise WeightsError(f"{folder} holds an export already ({', '.join(ours)}): --force replaces it, or give a "
                           f"new --out")


def export_timm(backbone: Backbone, folder: Path, force: bool = False) -> list[Path]:
    names = ("config.json", "model.safetensors", "README.md")
    check_folder(folder, names, force)
    config = timm_config(backbone)
    folder.mkdir(parents=True, exist_ok=True)
    model = backbone.model.model if isinstance(backbone.model, TimmBackbone) else backbone.model  # timm's names
    save_weights(model.state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(backbone, config, folder.name))
    return [folder / n for n in names]


def data_digest(path: str) -> str:
    """sha256 over dataset.json's per-shard digests of every split (16 hex), or what is known without them."""
    info = dataset_info_of(DataConfig(path=path))
    digests = {name: split.shard_sha256 for name, split in sorted(info.splits.items())}
    if not any(d for ds in digests.values() for d in ds):
        return "unknown (dataset.json has no shard digests)"
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]


def last_evaluation(run_dir: Path) -> dict[str, float]:
    """The run's last logged value of every eval/ metric (RUN_DIR/metrics.jsonl), {} without one."""
    found: dict[str, float] = {}
    path = run_dir / "metrics.jsonl"
    if run_dir.is_dir() and path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            for key, value in (row.get("metrics") or {}).items():
                if key.startswith("eval/") and isinstance(value, (int, float)):
                    found[key] = float(value)
    return found


def model_card(backbone: Backbone, config: dict[str, Any], folder: str) -> str:
    cfg, args = backbone.config, config["model_args"]
    lines = [f"# {backbone.source.name}", "",
             f"A Vision Transformer exported by vit-pipeline's `launch/export_weights.py --format timm` from "
             f"`{backbone.source}` ({backbone.tag or 'its export'}).", "", "## Load it", "", "```python",
             "import timm", f'model = timm.create_model("local-dir:{folder}", pretrained=True)  # this folder\'s path',
             "cfg = timm.data.resolve_data_config({}, model=model)", "transform = timm.data.create_transform(**cfg)",
             "features = model.forward_features(transform(image).unsqueeze(0))  # (1, tokens, D): [:, 0] the class token",
             "```", "", "## Model", "",
             (f"timm's `{config['architecture']}` (arguments {args}), width {config['num_features']}, "
              f"input {config['pretrained_cfg']['input_size'][1]}x{config['pretrained_cfg']['input_size'][2]}, no "
              f"classifier (a backbone)" if isinstance(backbone.model, TimmBackbone) else
              f"{'DINOv3 ViT (RoPE)' if 'num_reg_tokens' in args else 'ViT'}, patch {args['patch_size']}, width "
              f"{args['embed_dim']}, depth {args['depth']}, {args['num_heads']} heads, input {args['img_size'][0]}x"
              f"{args['img_size'][1]}, {args.get('reg_tokens', args.get('num_reg_tokens'))} registers, "
              f"{'a ' + str(args['num_classes']) + '-class head' if args['num_classes'] else 'no classifier (a backbone)'}")
             + f"; normalisation mean {config['pretrained_cfg']['mean']}, std {config['pretrained_cfg']['std']}.", ""]
    if cfg is not None:
        t = cfg.train
        lines += ["## How it was trained", "",
                  f"- objective: `{cfg.model.objective}` (docs/objectives.md); variant `{cfg.model.variant}`",
                  f"- data: `{cfg.data.path}`, split `{cfg.data.train_split}`, digest {_digest_or_unknown(cfg.data.path)} "
                  f"(sha256 over dataset.json's shard digests)",
                  f"- {t.steps} steps of {t.global_batch_size or 'micro x accumulation x ranks'} images, {t.optimizer} "
                  f"lr {t.lr:g} ({t.schedule}, warm-up {t.warmup_steps}), weight decay {t.weight_decay:g}, seed {t.seed}",
                  "- the whole recipe: `config.yaml` of the run", ""]
        figures = last_evaluation(backbone.source)
        if figures:
            lines += ["## Evaluation (the run's last)", "", "| metric | value |", "| --- | --- |"]
            lines += [f"| `{k}` | {v:.4f} |" for k, v in sorted(figures.items())]
            lines += [""]
    return "\n".join(lines)


def _digest_or_unknown(path: str) -> str:
    try:
        return data_digest(path)
    except Exception as e:  # noqa: BLE001 - the card says why rather than failing the export
        return f"unknown ({type(e).__name__})"


class _Features(nn.Module):
    """What model.onnx computes: the class token and mean patch token after the final norm (and the logits)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens = self.model.forward_features(images)
        feats = embedding(tokens, self.model)  # what evaluate.py judges and embed.py writes
        out = (feats[:, :self.model.embed_dim], feats[:, self.model.embed_dim:])
        return (*out, self.model.forward_head(tokens)) if self.model.num_classes else out


def onnx_sizes(model: nn.Module, img_size: int | tuple[int, int]) -> list[tuple[int, int]]:
    """The input sizes the ONNX graph is checked at: the trained one, and for a model without a position table
    (RoPE: DINOv3ViT, whose graph takes any grid) another, non-square one."""
    h, w = pair(img_size)
    if hasattr(model, "pos_embed") or not hasattr(model, "patch_embed"):  # a learned table (resized in Python: the
        # traced graph keeps the trained grid), or a timm student (checked where it was trained)
        return [(h, w)]
    p = model.patch_embed.patch_size
    return [(h, w), (h + 2 * p[0], w + p[1])]


def export_onnx(backbone: Backbone, folder: Path, check_batch: int = 3, force: bool = False) -> tuple[list[Path], float]:
    """model.onnx and the largest difference from PyTorch on random batches at each of `onnx_sizes`
    (WeightsError past ONNX_TOLERANCE). The batch is dynamic; the height and width too for a RoPE model."""
    check_folder(folder, ("model.onnx",), force)
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = _Features(backbone.model).eval()
    sizes = onnx_sizes(backbone.model, backbone.kwargs["img_size"])
    outputs = ["cls", "mean_patch", *(["logits"] if backbone.model.num_classes else [])]
    dynamic = {0: "batch", **({2: "height", 3: "width"} if len(sizes) > 1 else {})}
    path = folder / "model.onnx"
    channels = backbone.kwargs.get("in_chans", 3)  # the input is (batch, C, H, W): an array set's C channels
    torch.onnx.export(wrapper, (torch.randn(2, channels, *sizes[0]),), str(path), input_names=["images"],
                      output_names=outputs, dynamo=False, opset_version=17,
                      dynamic_axes={"images": dynamic, **{o: {0: "batch"} for o in outputs}})
    generator = torch.Generator().manual_seed(0)
    worst = max(check_onnx(wrapper, path, torch.randn(check_batch, channels, *size, generator=generator))
                for size in sizes)
    if worst > ONNX_TOLERANCE:
        path.unlink()
        raise WeightsError(f"{path}: ONNX Runtime's outputs differ from PyTorch's by {worst:.2e} "
                           f"(> {ONNX_TOLERANCE:g}); not kept")
    return [path], worst


def check_onnx(wrapper: nn.Module, path: Path, images: torch.Tensor) -> float:
    """The largest |ONNX Runtime - PyTorch| over every output, on `images` (a batch size the export never saw)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        want = wrapper(images)
    return max(float((torch.from_numpy(g) - x).abs().max()) for g, x in zip(got, want))
