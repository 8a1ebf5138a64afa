"""The run's exported backbone, and each distillation student, as an MLflow Model a serving stack can take.

A `pyfunc` whose `predict` takes a batch of images and returns their embeddings: the class token and the mean
patch token (`cls`, `mean_patch`, float32 (N, D) each), the vectors `launch/embed.py` writes for the same images
(the same eval transform, normalisation and forward). Its input is what a decoder gives: uint8 RGB (N, H, W, 3)
of any size for a set of encoded images (resized and centre-cropped as the run's evaluation does), and for an
array set (pixels.py) the set's own dtype, (N, H, W, C). Each model folder holds the weights, the transform's
settings (`served.json`), this package's code (`code/pipeline`: the loader and the model classes), a signature,
an input example and its pip requirements pinned to the versions that trained it.

At the end of a run with tracking on and `tracking.log_model`, rank 0 writes RUN_DIR/mlflow/model (and
RUN_DIR/mlflow/students/<name> for a distillation); the tracker's thread uploads each as the run's artifact
`model` (`students/<name>`) and, with `tracking.register: NAME`, registers it as a new version of NAME (a
student: NAME-<student>), its description the run's last k-NN figures. `launch/sync_mlflow.py` does the same for
what a job could not send. docs/tracking.md shows the serving.

    mlflow models serve -m models:/NAME/1 --env-manager local -p 5001
    curl -X POST -H 'Content-Type: application/json' localhost:5001/invocations -d '{"inputs": [...]}'
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.tracking.sync import say

FOLDER = "mlflow"  # RUN_DIR/mlflow/: the model folders before they are uploaded
SETTINGS = "served.json"
TRANSFORM_KEYS = ("mean", "std", "interpolation", "crop_pct")  # all the eval transform reads of data.*
PACKAGES = ("torch", "torchvision", "timm", "safetensors", "numpy", "pillow", "pyyaml")


def _python_model() -> Any:
    import mlflow.pyfunc

    # MLflow asks, at the class's definition, for type hints on predict to infer a schema (and forces the warning
    # on inside); this model states its signature instead, so that line is dropped, and only it.
    shown = warnings.showwarning

    def others(message: Any, *args: Any, **kwargs: Any) -> None:
        if "type hints to the `predict` method" not in str(message):
            shown(message, *args, **kwargs)

    warnings.showwarning = others
    try:
        class EmbeddingModel(mlflow.pyfunc.PythonModel):
            """Images in, embeddings out: see the module's docstring."""

            def load_context(self, context):  # noqa: ANN001, ANN201 - MLflow reads type hints as a schema
                self.backbone, self.settings = load(Path(context.artifacts["weights"]),
                                                    Path(context.artifacts["settings"]))

            def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201, ARG002 - MLflow's signature
                return embed_images(self.backbone, self.settings, np.asarray(model_input))
    finally:
        warnings.showwarning = shown
    return EmbeddingModel()


def load(weights: Path, settings: Path) -> tuple[Any, dict[str, Any]]:
    """The backbone of a served model's weights, with its transform's settings."""
    from pipeline.run.backbone import load_backbone

    found = json.loads(settings.read_text())
    backbone = load_backbone(weights)
    data = dataclasses.replace(backbone.data, **{k: tuple(v) if isinstance(v, list) else v
                                                 for k, v in found["data"].items()})
    return dataclasses.replace(backbone, data=data), found


def embed_images(backbone: Any, settings: dict[str, Any], images: np.ndarray) -> dict[str, np.ndarray]:
    """{"cls", "mean_patch"} of a batch: each image as launch/embed.py reads a decoded sample."""
    import torch
    from PIL import Image

    from pipeline.data.transforms import BatchNormalizer, eval_transform
    from pipeline.eval.features import embedding
    from pipeline.model.variants import pair

    channels, array = settings["channels"], settings["array"]
    if images.ndim == 3 and channels == 1:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] != channels:
        raise ValueError(f"expected a batch of images (N, H, W, {channels}); got shape {tuple(images.shape)}")
    model, size = backbone.model, pair(backbone.kwargs["img_size"])
    transform, normalize = eval_transform(backbone.data, size), BatchNormalizer(backbone.data.mean, backbone.data.std)
    batch = torch.empty(len(images), channels, *size)
    for i, image in enumerate(images):
        # An encoded image is decoded to RGB (tario.decode_image); an array member stays an array in its dtype.
        x = transform(np.ascontiguousarray(image) if array else Image.fromarray(image.astype(np.uint8), "RGB"))
        normalize(x, out=batch[i])
    with torch.no_grad():
        feats = embedding(model.forward_features(batch), model)
    return {"cls": feats[:, :model.embed_dim].numpy(), "mean_patch": feats[:, model.embed_dim:].numpy()}


def served_settings(backbone: Any, data_path: str) -> dict[str, Any]:
    """What the model's transform needs from the run's data: its data.* as launch/embed.py resolves them on the
    run's set (an array set's mean/std from dataset.json), whether its images are arrays, their channels and dtype."""
    from pipeline.data.pixels import ARRAY_MEMBER, set_channels
    from pipeline.run.embed import reading_config

    cfg, info = reading_config(backbone, data_path, "tracking.log_model")
    array = info.image_format == ARRAY_MEMBER
    return {"format": "vit-pipeline-served", "version": 1,
            "data": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()
                     if k in TRANSFORM_KEYS},
            "array": array, "channels": set_channels(info) if array else 3,
            "dtype": info.pixels.get("dtype", "uint8") if array else "uint8"}


def save_served_model(weights: Path, data_path: str, folder: Path) -> Path:
    """An MLflow Model of `weights` (a run's model.safetensors or a student's) in `folder` (replaced)."""
    import mlflow.pyfunc
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    from pipeline.model.variants import pair
    from pipeline.run.backbone import load_backbone

    backbone = load_backbone(weights)
    settings = served_settings(backbone, data_path)
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staged = folder.parent / f".{folder.name}-settings"
    staged.mkdir(parents=True, exist_ok=True)
    (staged / SETTINGS).write_text(json.dumps(settings, indent=1))
    dim, channels, dtype = backbone.model.embed_dim, settings["channels"], np.dtype(settings["dtype"])
    signature = ModelSignature(
        inputs=Schema([TensorSpec(dtype, (-1, -1, -1, channels))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, dim), "cls"),
                        TensorSpec(np.dtype(np.float32), (-1, dim), "mean_patch")]))
    h, w = pair(backbone.kwargs["img_size"])
    example = np.full((2, h, w, channels), 128, dtype)  # a grey batch at the model's own size
    mlflow.pyfunc.save_model(str(folder), python_model=_python_model(), signature=signature, input_example=example,
                             artifacts={"weights": str(weights), "settings": str(staged / SETTINGS)},
                             code_paths=[str(Path(__file__).resolve().parents[1])], pip_requirements=requirements())
    shutil.rmtree(staged)
    return folder


def requirements() -> list[str]:
    """The packages the model's code imports, at the versions installed here (no inference: it would load the
    model in a subprocess)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            continue
    return out


def knn_description(run_dir: Path, student: str | None) -> str:
    """The run's last k-NN figures, for a registered version's description: a student's own (eval/.../<name>/
    knn_top1) where it has them, else the run's."""
    from pipeline.run.export import last_evaluation

    found = {k: v for k, v in last_evaluation(run_dir).items() if k.endswith("knn_top1") and "teacher" not in k}
    if student is not None and any(f"/{student}/" in k for k in found):
        found = {k: v for k, v in found.items() if f"/{student}/" in k}
    figures = ", ".join(f"{k} {100 * v:.2f}%" for k, v in sorted(found.items())) or "no k-NN evaluation logged"
    return f"{run_dir.resolve().name}{f', student {student}' if student else ''}: {figures}"


def log_served_models(tracker: Any, run_dir: Path, data_path: str, students: list[str], register: str | None) -> None:
    """Rank 0 at the end of a run: the backbone's model and each student's, written under RUN_DIR/mlflow and
    handed to the tracker (uploaded, and registered as `register` / `register`-<student>). One line, never an
    error, when a model cannot be made: the run's weights are exported already."""
    todo = [(run_dir / "model.safetensors", "model", None),
            *((run_dir / "students" / s / "model.safetensors", f"students/{s}", s) for s in students)]
    for weights, artifact_path, student in todo:
        try:
            folder = save_served_model(weights, data_path, run_dir / FOLDER / artifact_path)
        except Exception as e:  # noqa: BLE001 - the weights are exported; a model for serving is a convenience
            say(f"no MLflow Model of {weights}: {type(e).__name__}: {e}", err=True)
            continue
        name = None if register is None else register if student is None else f"{register}-{student}"
        tracker.log_model(folder, artifact_path, name, knn_description(run_dir, student))


def log_exports(tracker: Any, cfg: Any, run_dir: Path) -> None:
    """Rank 0 at the end of a run: model.safetensors as an artifact (a path tag with tracking.log_model=false) and,
    with tracking on and tracking.log_model, the MLflow Models of `log_served_models`."""
    tracker.log_artifact(run_dir / "model.safetensors")
    if not (cfg.tracking.enabled and cfg.tracking.log_model):
        if cfg.tracking.register:
            say(f"tracking.register={cfg.tracking.register}: nothing registered, as tracking.enabled="
                f"{cfg.tracking.enabled} and tracking.log_model={cfg.tracking.log_model} log no model", err=True)
        return
    students = [s.name for s in cfg.distill.students] if cfg.model.objective == "distill" else []
    data_path = cfg.data.sources[0].path if cfg.data.sources else cfg.data.path
    log_served_models(tracker, run_dir, data_path, students, cfg.tracking.register)
