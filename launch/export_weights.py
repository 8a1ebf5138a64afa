#!/usr/bin/env python
"""Export a run's checkpoint as consolidated fp32 weights (timm key names), without training.

    python launch/export_weights.py runs/vit_b16_i21k --out b16.safetensors  # the newest checkpoint -> a file
    python launch/export_weights.py runs/vit_b16_i21k --tag step_0050000 --out b16_50k.safetensors
    python launch/export_weights.py dinov2_vitb14_reg4_pretrain.pth      # Meta's file -> timm names, .safetensors
    python launch/export_weights.py runs/demo-dino-pretrain --format timm    # a folder timm.create_model loads
    python launch/export_weights.py runs/demo-pretrain --format onnx --out demo-onnx  # model.onnx, checked

Works for every ZeRO stage and any number of ranks the run had; runs on CPU. The trainer does this
itself at the end of a run (RUN_DIR/model.safetensors, which this replaces only with --force); this is for a run
that is still going or was stopped. It writes what the run
exports, as its objective reads it from the checkpoint (`Objective.weights_from_checkpoint`): the model's
weights, or a DINOv2 or DINOv3 run's teacher backbone (not DeepSpeed's module there, the student). Given one of
Meta's DINOv2 or DINOv3 backbone files (or timm's DINOv3) instead of a run directory, it writes the same weights
under timm's names and layout (timm's vit_*_patch14[_reg4]_dinov2 and vit_*_patch16_dinov3 load them;
mask_token, used in training only, is left out).

--format timm writes a folder that `timm.create_model("local-dir:FOLDER", pretrained=True)` loads (config.json
with timm's pretrained_cfg, model.safetensors, a model card README.md); --format onnx writes model.onnx (class
token and mean patch token, and logits where there is a classifier; dynamic batch), checked against PyTorch
with ONNX Runtime (docs/evaluation.md). Both take the run's backbone as launch/evaluate.py does (--tag: that
checkpoint); --out is a new or empty folder (default: RUN_DIR/timm, RUN_DIR/onnx, or beside the file). Nothing
this call did not write is replaced without --force. Exit codes: 0 done, 1 bad input (one line naming it;
--debug: the traceback), 2 bad arguments.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import add_launcher_arguments, one_line_errors, set_debug  # noqa: E402
from pipeline.model.timm_backbone import TimmBackbone  # noqa: E402
from pipeline.model.vit import architecture  # noqa: E402
from pipeline.model.weights import WeightsError, save_weights  # noqa: E402
from pipeline.objectives import load_config  # noqa: E402
from pipeline.run.finetune import objective_of_run  # noqa: E402
from pipeline.train.checkpoint import (  # noqa: E402
    CheckpointError,
    TrainerState,
    checkpoint_dir,
    newest_complete_tag,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory, or a weights file (Meta's DINOv2 or DINOv3, "
                                                   "timm's DINOv3, ours)")
    parser.add_argument("--tag", help="checkpoint tag, e.g. step_0050000 (default: the newest complete one)")
    parser.add_argument("--out", type=Path, help="output file (default: RUN_DIR/model.safetensors), or folder")
    parser.add_argument("--format", choices=("safetensors", "timm", "onnx"), default="safetensors",
                        help="safetensors (default), timm (a folder timm loads) or onnx (model.onnx, checked)")
    parser.add_argument("--force", action="store_true", help="replace what --out (or the default) holds already")
    add_launcher_arguments(parser)
    args = parser.parse_args(argv)
    set_debug(args)
    return one_line_errors(lambda: export(args), str(args.run_dir))


def export(args: argparse.Namespace) -> int:
    if args.format != "safetensors":
        return export_for_others(args)
    if args.run_dir.is_file():
        return export_file(args.run_dir, args.out or args.run_dir.with_suffix(".safetensors"), args.force)
    out = args.out or args.run_dir / "model.safetensors"
    refuse_to_replace(out, args.force, "the run's own export (its trainer wrote it at the end)"
                      if args.out is None else "")
    tag = args.tag or newest_complete_tag(args.run_dir)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir(args.run_dir)} has no complete checkpoint")
    recorded = args.run_dir / "config.yaml"
    cfg = load_config(recorded) if recorded.is_file() else None
    objective = objective_of_run(cfg)
    state = objective.weights_from_checkpoint(args.run_dir, tag, cfg)
    # What the weights are, in the metadata (as the trainer's export): the model as the run built it.
    built = TrainerState.read(checkpoint_dir(args.run_dir) / tag).model
    arch = objective.exported_architecture(built) if cfg is not None else {}
    save_weights(state, out, metadata={"step": tag.split("_")[-1], **{k: str(v) for k, v in arch.items()}})
    print(f"wrote {out}: {len(state)} tensors ({objective.checkpoint_weights}) from {args.run_dir}/checkpoints/{tag}")
    return 0


def refuse_to_replace(out: Path, force: bool, what: str = "") -> None:
    """A file this call did not write is replaced only with --force."""
    if out.exists() and not force:
        raise WeightsError(f"{out} exists{f' ({what})' if what else ''}: --force replaces it, or give --out a new "
                           f"file")


def export_file(path: Path, out: Path, force: bool) -> int:
    """A weights file (Meta's DINOv2 or DINOv3 backbone, timm's DINOv3) -> safetensors in timm's names, its
    architecture in the file's metadata, as a run's model.safetensors has it."""
    from pipeline.run.backbone import load_backbone

    refuse_to_replace(out, force)
    backbone = load_backbone(path, flag="")
    if isinstance(backbone.model, TimmBackbone):  # a distillation's timm student: timm's names, its model said
        save_weights(backbone.model.model.state_dict(), out, metadata=backbone.model.metadata())
        print(f"wrote {out}: timm's {backbone.model.timm_model} {backbone.model.timm_kwargs} from {path}")
        return 0
    arch = architecture(type(backbone.model), backbone.kwargs)
    state = backbone.model.state_dict()
    save_weights(state, out, metadata={k: str(v) for k, v in arch.items()})
    shown = ("patch_size", "embed_dim", "depth", "num_heads", "reg_tokens", "mlp_layer")
    print(f"wrote {out}: {len(state)} tensors from {path} ({type(backbone.model).__name__}, "
          f"{', '.join(f'{k}={arch[k]}' for k in shown)})")
    return 0


def export_for_others(args: argparse.Namespace) -> int:
    """--format timm | onnx: the backbone of the run (or file) as a folder others load."""
    from pipeline.run.backbone import load_backbone
    from pipeline.run.export import export_onnx, export_timm

    source = args.run_dir
    out = args.out or (source / args.format if source.is_dir() else source.with_name(f"{source.stem}-{args.format}"))
    backbone = load_backbone(source, args.tag, flag="")
    if args.format == "timm":
        written = export_timm(backbone, out, args.force)
        note = 'timm.create_model("local-dir:' + str(out) + '", pretrained=True)'
    else:
        written, worst = export_onnx(backbone, out, force=args.force)
        note = f"ONNX Runtime within {worst:.1e} of PyTorch"
    print(f"wrote {', '.join(str(p) for p in written)} from {source}" + (f" ({args.tag})" if args.tag else "")
          + f"; {note}")
    return 0


if __name__ == "__main__":
    from pipeline.signals import exit_without_teardown

    exit_without_teardown(main())  # after the atexit handlers; without the teardown of torch's modules
