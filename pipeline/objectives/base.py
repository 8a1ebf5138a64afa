"""The Objective interface: what differs between training recipes, behind one set of hooks.

The trainer (pipeline/run/trainer.py) names no objective. It asks the objective, in this order:

    objective = build_objective(cfg, info)            # the class registered under model.objective
    kwargs = objective.model_kwargs()                 # checked against a checkpoint before anything is built
    model = objective.build_model(kwargs)             # under deepspeed.zero.Init with ZeRO-3
    objective.build_companions(model, kwargs, init)   # a teacher: float32, partitioned as the model
    view = objective.train_view(kwargs)               # the train loader's view: data, per-batch extras, samples
    loaders = objective.build_eval(env, img_size, eval_batch)   # its evaluation loaders (progress for the watchdog)
    ... every optimizer step:
        objective.before_step(engine, step)           # schedules that write into the optimizer's groups
        ... every micro batch: loss = objective.loss(engine, images, targets, extras)
        objective.after_step(engine, step + 1)        # a teacher's EMA, the centres
    ... at eval steps:      result = objective.evaluate(engine, dtype, run_dir, step)
                            objective.judged_features(engine)    # what eval.sets judges (reference_features: at step 0)
    objective.state_dict() / load_state_dict()        # its own state, saved with every checkpoint
    ... at the end:         objective.exported_weights(engine)   # what model.safetensors holds
                            objective.extra_exports(engine)      # files beside it (a distillation's students)

The trainer reads nothing else of an objective: what a hook needs later (its eval loaders, a teacher) the
objective keeps for itself.

A new objective is a folder here of the recipes' one shape (<name>/objective.py with the subclass,
<name>/config.py with its config section and its `Recipe`) and one line in `pipeline.objectives.RECIPES`
(docs/objectives.md walks through it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pipeline.config import Config, DataConfig
from pipeline.dist import DistEnv
from pipeline.eval.features import embedding
from pipeline.model.vit import architecture
from pipeline.train.checkpoint import consolidate, full_fp32_state_dict

#: What `Objective.features` gives: within, a function of a batch of images -> embedding rows.
FeaturesContext = AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]


@dataclass
class TrainView:
    """The train loader's view of the data, as one objective sees it (`Objective.train_view`)."""

    data: DataConfig
    """The data config the train loader reads (e.g. labels not read: `pipeline.data.label_free`)."""
    per_batch: Callable[[range], np.ndarray] | None = None
    """A picklable function of a micro batch's global sample positions, run in the loader workers; its result
    reaches `loss` as `extras` (MAE's mask noise). None: no extras."""
    sample: Callable[[Any, int, int], tuple[torch.Tensor, ...]] | None = None
    """A picklable function (PIL image, the sample's augmentation seed, its optimizer step) -> normalised float
    tensors (and masks), run in the loader workers in place of the train transform; `loss` then gets the micro
    batch's images as a tuple, each part stacked over the samples (DINOv2's global and local crops). Every
    random draw must come from the seed, or from the step for what every sample of a step shares (DINOv3's
    crop sizes), so that a sample's views are the same on any layout. None: the train transform (one image
    per sample)."""


@dataclass
class EvalResult:
    """What one evaluation gives the trainer: metrics to log, the line to print, files to upload (path and
    the MLflow artifact folder it goes to)."""

    metrics: dict[str, float]
    line: str
    artifacts: list[tuple[Path, str | None]] = field(default_factory=list)


class Objective:
    """One training recipe. Subclasses set `model_class` and implement `model_kwargs`, `loss`, `evaluate`
    and `flops_per_image`; the other hooks have defaults that do nothing."""

    model_class: ClassVar[type[nn.Module]]

    def __init__(self, cfg: Config, info: Any):
        self.cfg, self.info = cfg, info  # info: the data set's dataset.json (pipeline.data.DatasetInfo)
        # How a resumed run reads its --init source again into a module of the backbone's structure, said as the
        # str: set by the run that has one (pipeline/run/init_source.py's reload_source; the objectives are a
        # layer below it); an anchor that is stored in no checkpoint needs it (adapt.anchor).
        self.read_source: Callable[[nn.Module, str], None] | None = None

    # -- the model(s)
    def model_kwargs(self) -> dict[str, Any]:
        """The model's resolved constructor arguments (recorded in each checkpoint, compared on resume)."""
        raise NotImplementedError

    def build_model(self, model_kwargs: dict[str, Any]) -> nn.Module:
        """The trained model (the one DeepSpeed wraps)."""
        return self.model_class(**model_kwargs)

    def build_companions(self, model: nn.Module, model_kwargs: dict[str, Any],
                         init: Callable[[], AbstractContextManager[Any]]) -> None:
        """Build the models that are not trained but follow `model` (a teacher), keep them on `self` and save
        them through `state_dict`. `model` is built (and any fine-tune source loaded into it), not yet wrapped
        by DeepSpeed. Build each inside `with init():`: float32 whatever the run's bf16/fp16, and under ZeRO-3
        partitioned as `model` is (deepspeed.zero.Init), so that an EMA of it runs on each rank's own shard
        (pipeline/train/ema.py). By default there are none."""

    def build_all(self, model_kwargs: dict[str, Any]) -> nn.Module:
        """`build_model` then `build_companions`, outside DeepSpeed (benchmarks, tests); returns the model."""
        model = self.build_model(model_kwargs)
        self.build_companions(model, model_kwargs, nullcontext)
        return model

    # -- the data
    def train_view(self, model_kwargs: dict[str, Any]) -> TrainView:  # noqa: ARG002 - a recipe's view may need them
        """The train loader's view of the data (`TrainView`): by default data.* as written, labels read, the
        train transform, no extras."""
        return TrainView(self.cfg.data)

    def build_eval(self, env: DistEnv, img_size: tuple[int, int], batch: int) -> list[Any]:
        """Build the evaluation loaders and keep what `evaluate` needs; return every loader (the trainer
        counts their batches as progress for the watchdog)."""
        raise NotImplementedError

    # -- a step
    def before_step(self, engine: Any, step: int) -> None:
        """Before each optimizer step (`step`: the steps done), ahead of its first micro batch: a schedule
        that writes into the optimizer's param groups (DINOv2's weight decay, its frozen prototypes' lr).
        The trainer's lr schedule has set every group's lr after the previous step."""
    def step_targets(self) -> bool:
        """Whether the targets of a micro batch depend on the whole step's global batch (DINO's
        Sinkhorn-Knopp): then, with accumulation, the trainer draws the step's micro batches first and hands
        them to `begin_step` before the first forward."""
        return False

    def begin_step(self, engine: Any, micro_batches: list[Any]) -> None:
        """This rank's micro batches of the step (`images` as `loss` takes them, in order), before the first
        `loss` of the step; only where `step_targets()` and the step has more than one. Collective if the
        objective's targets are."""

    def loss(self, engine: Any, images: torch.Tensor, targets: torch.Tensor,
             extras: torch.Tensor | None) -> torch.Tensor:
        """The float32 scalar loss of one micro batch (forward only; the trainer runs backward)."""
        raise NotImplementedError

    def after_step(self, engine: Any, step: int) -> None:
        """After each optimizer step (`step` is the number of steps done): a teacher's EMA update, say."""

    def train_metrics(self) -> dict[str, torch.Tensor]:
        """At each log step, on every rank: the objective's own figures (each loss term, say) as 0-d tensors,
        this rank's mean over its micro batches since the last call, which it forgets. The trainer averages
        them over the ranks and logs them as train/<name>. Same names on every rank; none by default."""
        return {}

    def lr_metrics(self, groups: list[dict[str, Any]]) -> dict[str, float]:  # noqa: ARG002 - the overrides' signature
        """At each log step: learning rates of the objective's own, beside train/lr (the run's schedule), from the
        optimizer's parameter groups; logged as train/<name>. None by default."""
        return {}

    # -- evaluation, cost, state
    def evaluate(self, engine: Any, dtype: torch.dtype, run_dir: Path | None, step: int) -> EvalResult:
        """Collective: every rank runs the same number of forward passes. `run_dir` is set on rank 0 only."""
        raise NotImplementedError

    def flops_per_image(self, model_kwargs: dict[str, Any]) -> float:
        """Forward FLOPs per training image (MFU counts 3x for forward + backward)."""
        raise NotImplementedError

    #: The keyword that makes the trained model's forward give its tokens after the final norm (`features`).
    features_kwargs: ClassVar[dict[str, bool]] = {"features": True}

    @contextmanager
    def features(self, engine: Any) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """The run's features, what eval.sets judges: within, a function of a batch of images on the device ->
        `pipeline.eval.features.embedding` rows (class token, mean patch token; float32). Collective under
        ZeRO-3: every rank calls it as often. By default the trained model's, in eval mode, through its forward
        (`features_kwargs`: ZeRO-3's hooks gather the weights); an objective whose product is another model (a
        teacher) gives that one's."""
        model = engine.module if hasattr(engine, "module") else engine
        dtype, was = next(model.parameters()).dtype, model.training
        model.eval()
        try:
            yield lambda images: embedding(engine(images.to(dtype), **self.features_kwargs), model)
        finally:
            model.train(was)

    def judged_features(self, engine: Any) -> dict[str, FeaturesContext]:
        """What eval.sets judges at each evaluation: name -> a `features` context. By default the run's own
        features under '' (logged as eval/<set>/...); an objective with several products names each (a
        distillation's students: eval/<student>/<set>/...)."""
        return {"": self.features(engine)}

    def reference_features(self, engine: Any) -> dict[str, FeaturesContext]:  # noqa: ARG002 - the interface
        """Models that training does not change, judged by eval.sets once, at step 0 (eval/<name>/<set>/...), the
        figures the run's read against: name -> a `features` context (a distillation's teacher). None by default."""
        return {}

    def model_names(self) -> dict[str, str]:
        """What each trained model is (its variant, or a timm model's name), by the name it is judged under
        (`judged_features`): the start line says them, model.safetensors' metadata (`variant`) the first's. By
        default the run's model.variant, under ''."""
        return {"": self.cfg.model.variant}

    def model_flops(self, model_kwargs: dict[str, Any]) -> dict[str, float]:  # noqa: ARG002 - the interface
        """The forward FLOPs per image of each model the run judges, by name (a distillation's students and its
        teacher), logged at each start as perf/<name>/flops_per_image. None by default (the run's own is MFU's)."""
        return {}

    def exported_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """Collective. The fp32 weights the run exports (model.safetensors, what fine-tuning starts from):
        by default the trained model's; an objective whose product is another model (a teacher) gives that."""
        return full_fp32_state_dict(engine)

    def extra_exports(self, engine: Any) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:  # noqa: ARG002 - the interface
        """Collective. Files the run exports beside model.safetensors: path under the run directory -> (fp32
        weights, safetensors metadata); a distillation's students/<name>/model.safetensors. None by default."""
        return {}

    @classmethod
    def exported_architecture(cls, model_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The architecture of what `exported_weights` gives (its model's ARCH_KEYS, as built), recorded in
        model.safetensors' metadata: by default the trained model's."""
        return architecture(cls.model_class, model_kwargs)

    #: What `weights_from_checkpoint` gives, for the log of a fine-tune from a run stopped before its export.
    checkpoint_weights: ClassVar[str] = "the trained model's weights (DeepSpeed's, consolidated to fp32)"

    @classmethod
    def weights_from_checkpoint(cls, run_dir: Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:  # noqa: ARG003 - the interface (DINOv2's reads cfg)
        """What `exported_weights` would have given at checkpoint `tag` of `run_dir` (a run stopped before its
        export: preempted, crashed, still going), read from the files on disk without an engine, on any ZeRO
        stage and world size. `cfg`: that run's config.yaml. By default the trained model's weights."""
        return consolidate(run_dir, tag)

    def state_dict(self) -> dict[str, Any]:
        """The objective's own state (a teacher, running centers), saved with every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (an empty dict for a checkpoint that has none)."""

    def _source_reader(self) -> Callable[[nn.Module, str], None]:
        if self.read_source is None:  # a run with adapt.anchor has adapt.init, and the trainer sets it
            raise RuntimeError("adapt.anchor: the run gave the objective no reader of adapt.init (read_source)")
        return self.read_source
