"""Typed run configuration: one YAML file plus dotted command-line overrides.

    cfg = load_config("configs/pretrain/demo.yaml", ["train.lr=3e-4", "model.depth=6"])

Every section is a dataclass and every field has a docstring (the string literal after it, read by `pipeline.typed_yaml.describe`
for docs/configuration.md). Loading is strict: an unknown key, a value of the wrong type or a missing file raises `ConfigError`
(one line naming the file/key and what was expected; the launchers print ``error: ...`` and exit 2).

What can be derived is never written twice: the accumulation steps are ``global_batch_size / (micro_batch_size x world_size)``
(see `pipeline.derived.resolve_batch`), DeepSpeed's ``train_batch_size`` is the global batch, the data resolution the model's ``img_size``.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.model_config import ModelConfig  # noqa: F401 (the model section, re-exported)
from pipeline.source_config import MixtureConfig, check_sources
from pipeline.typed_yaml import ConfigError, from_tree, parse_override, read_tree, set_dotted

# ----------------------------------------------------------------------------- sections


@dataclass
class DataConfig(MixtureConfig):  # data.sources and data.allow_mix_change: pipeline/source_config.py
    path: str = "data/digits"
    """Folder holding dataset.json and the shards (written by launch/make_shards.py); not read when data.sources is set."""
    train_split: str = "train"
    """Split name in dataset.json to train on."""
    val_split: str = "val"
    """Split name in dataset.json to evaluate on."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    partitions: int | None = None
    """Partitions of the train split (Streaming's canonical nodes): sets of whole shards fixed for the run; every step takes global batch / partitions samples from each, and with N nodes, N dividing the partitions, a node reads only its partitions' shards. Must divide train.global_batch_size. None: the largest power of two up to 512 that divides the global batch and keeps the partitions' sample counts within 2% of each other (docs/data.md)."""
    shuffle_span: int = 262144
    """Shuffle span in samples, per partition: each pass over a partition permutes its shards and spreads every shard's samples over this many (the whole partition when it is smaller). A node's cache holds about span / shard size shards of each of its partitions (docs/data.md)."""
    cache_dir: str | None = None
    """Where shards without random access (pipe:, http(s), s3, .tar.gz) are copied, uncompressed, and where the sample index of shards without one is built, once per machine; None: <system temp>/vit-pipeline-shards-<uid>."""
    cache_limit_gb: float = 50.0
    """Size bound of data.cache_dir; the least recently used copies are deleted beyond it. Too small for what this node's partitions need at once (their shuffle span) is an error before training that names the size needed."""
    fetch_ahead: bool = True
    """Copy the shards each rank reads next into data.cache_dir in the background (remote shards only), within the rank's share of data.cache_limit_gb, so that a step does not wait for a download (docs/data.md)."""
    retry_attempts: int = 10
    """Remote shards (http(s), s3): attempts per byte range before the run stops. A transient fault (5xx, 429, S3 throttling, a reset connection, a body cut short, no byte for data.read_timeout_s) is retried from the first missing byte (an HTTP Range), with exponential backoff and jitter; a 403, a 404 or a copy whose size or sha256 differs from dataset.json stops the run at once with one line naming the URL (docs/data.md, Object storage)."""
    retry_time_s: float = 900.0
    """Remote shards: the most seconds one shard's download may take, retries and waits included, before the run stops naming the URL."""
    retry_backoff_s: float = 1.0
    """Remote shards: the wait after a first failure; it doubles with each further failure (at most 60 s), each wait drawn between half and all of it."""
    read_timeout_s: float = 60.0
    """Remote shards: seconds to connect, and seconds without a byte from a transfer under way, before the attempt counts as failed and is retried (a stalled server is not waited on forever)."""
    range_mb: float = 64.0
    """Remote shards: a shard larger than this (dataset.json's bytes) is fetched in ranges of this many MiB, data.range_parallel at once."""
    range_parallel: int = 4
    """Remote shards: ranged GETs in flight at once for one large shard (1: one stream)."""
    scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop area range."""
    ratio: tuple[float, float] = (0.75, 1.3333333333333333)
    """RandomResizedCrop aspect-ratio range."""
    hflip: float = 0.5
    """Probability of a horizontal flip (set 0 for digits and text)."""
    auto_augment: str | None = None
    """timm auto-augment policy string, e.g. 'rand-m9-mstd0.5-inc1'; None for none."""
    interpolation: str = "bicubic"
    """Resize interpolation for train and eval transforms."""
    crop_pct: float = 0.875
    """Eval: resize to img_size / crop_pct, then center crop img_size."""
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    """Normalisation mean per channel, in [0, 1] for 8-bit RGB (the paper's ViTs use 0.5), in the pixels' own units for array sets; None: dataset.json's `mean` (docs/data.md)."""
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    """Normalisation standard deviation per channel (units as data.mean); None: dataset.json's `std`."""
    mixup: float = 0.0
    """Mixup alpha (0 disables)."""
    cutmix: float = 0.0
    """CutMix alpha (0 disables)."""
    label_smoothing: float = 0.0
    """Label smoothing for the cross-entropy loss (also used by Mixup/CutMix targets)."""
    max_bad_fraction: float = 0.01
    """Stop the run when more than this fraction of samples read so far (by a rank, or one of its workers) were bad (after 100 samples)."""
    label_key: str = "cls"
    """Where a sample's integer label is: a member extension ('cls', 'txt') or 'json:FIELD' for a field of the .json member (img2dataset-style shards; plain 'json' reads the field 'label')."""
    color_jitter: float | None = None
    """Train: colour-jitter strength for brightness, contrast and saturation (None: off; timm disables it when auto_augment is set)."""
    mixup_prob: float = 1.0
    """Probability of applying Mixup or CutMix to a batch (when mixup or cutmix > 0)."""
    mixup_switch_prob: float = 0.5
    """Probability of CutMix instead of Mixup when both are enabled."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker prepares ahead."""
    max_image_pixels: int = 89478485
    """An image with more pixels (width x height, read from its header) is a bad sample (kind oversized_image) and is never decoded: a few KB of PNG can decode to gigabytes in a loader worker. The default is PIL's own warning threshold (docs/data.md, Trust)."""
    allow_pipe_shards: bool = False
    """Run the shell commands that `pipe:` shard names in dataset.json are (webdataset's convention); only for a data set whose author you trust. Off: such a data set is refused before training, naming the shard; webdataset's own WDS_SECURE=1 refuses them even when on (docs/data.md, Trust)."""
    decode_device: Literal["cpu", "cuda"] = "cpu"
    """cuda: workers only read bytes and draw the crop/flip; the trainer decodes the batch with nvjpeg (torchvision.io.decode_jpeg(device='cuda')), crops, resizes and normalises it on the GPU. For when the CPU cannot keep up. JPEG shards only."""


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train for (training is measured in steps, not epochs)."""
    global_batch_size: int | None = None
    """Images per optimizer step over all ranks: the unit of training (the samples of step t depend on it, not on the layout). None: micro_batch_size x grad_accum_steps (or 1) x world size."""
    micro_batch_size: int = 64
    """Images per rank per forward/backward."""
    grad_accum_steps: int | None = None
    """Micro batches accumulated per optimizer step; derived as global_batch_size / (micro_batch_size x world size). Set it only without global_batch_size, or to the same value."""
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    """Optimizer; 'adam' is Adam with decoupled weight decay as in the ViT paper's pretraining."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.05
    """Decoupled weight decay; never applied to norms and biases, nor to what the model's no_weight_decay() names."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    momentum: float = 0.9
    """SGD momentum."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, down to min_lr at `steps`."""
    layer_decay: float | None = None
    """Layer-wise LR decay (BEiT/DeiT fine-tuning): block i gets lr x decay ** (depth + 1 - layer_id); None disables."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    seed: int = 0
    """Seed for model init, data order and augmentation."""
    log_every: int = 10
    """Log training figures every N steps."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    ckpt_every: int = 0
    """Save a checkpoint every N steps (0: only at the end and on preemption)."""
    ckpt_every_s: float = 0.0
    """Also save one when this many seconds of training have passed since the last (0: off). The ranks agree at a step boundary (with the preemption check), so every rank saves the same step; bounds the steps an elastic restart loses."""
    keep_last: int = 2
    """Keep the newest K checkpoints (a universal conversion made on resume, RUN_DIR/universal/, is removed at the next checkpoint)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of M (0: none)."""
    max_nonfinite_steps: int = 5
    """Stop (exit 3, saving nothing) after this many non-finite ones in a row: with train.check_finite, micro batches whose loss is not finite, each skipped on every rank and replaced by the next (a completed optimizer step starts the count again); without it, optimizer steps whose gradient norm is not finite, seen at the next log step."""
    peak_flops: float | None = None
    """Peak bf16 FLOP/s of one device for MFU; None looks the GPU up in a table (no MFU on CPU)."""
    compile: bool = False
    """torch.compile the model (GPU performance; off by default on CPU)."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    """torch.compile's mode with train.compile: 'default', or 'max-autotune-no-cudagraphs' (Inductor tries its Triton matmul templates, which can take the bias and GELU into the matmul's epilogue instead of a pass of their own: docs/performance.md; compiling takes minutes longer), or 'max-autotune' (the same with CUDA graphs)."""
    check_finite: bool = False
    """Check each micro batch's loss on all ranks before backward: a non-finite one is skipped and replaced by the next (one host read per micro batch, and DeepSpeed's bf16 overflow check stays on, another). Off (the default), a step reads nothing on the host: one whose gradient norm is not finite is taken with zero gradients on the device (AdamW's moments decay, weight decay applies), counted there and read at log steps (docs/performance.md, Host reads)."""
    eval_batch_size: int | None = None
    """Images per rank per eval forward; None uses micro_batch_size."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the model's weights with this decay (timm's ModelEmaV3; e.g. 0.9998), in float32, updated after every optimizer step: evaluated beside the model at every evaluation (its metrics with an _ema suffix, eval/top1_ema) and exported to model.safetensors in place of the raw weights, which the checkpoints keep (docs/training.md, Model EMA). None: no EMA. Not with model.objective 'dinov2', whose teacher is the EMA."""
    ema_warmup: bool = False
    """Warm the EMA's decay up (timm's use_warmup): t steps after the first averaging step, min(train.ema_decay, 1 - (1 + t / ema_warmup_gamma) ** -ema_warmup_power), at least train.ema_min_decay."""
    ema_warmup_gamma: float = 1.0
    """timm's warmup_gamma: the warm-up's time scale in steps."""
    ema_warmup_power: float = 0.6666666666666666
    """timm's warmup_power (2/3: decay 0.999 at about 31.6k steps; 3/4 for shorter runs: at about 10k)."""
    ema_min_decay: float = 0.0
    """timm's min_decay: the warm-up's decay is at least this."""
    ema_update_after_step: int = 0
    """timm's update_after_step: the EMA copies the model (decay 0) through step ema_update_after_step + 1 and averages from the next."""


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 1
    """ZeRO stage 0-3 (3 partitions parameters and builds the model inside deepspeed.zero.Init)."""
    bf16: bool = True
    """Train in bfloat16 with fp32 master weights."""
    offload_optimizer: bool = False
    """ZeRO-Offload: keep optimizer states on CPU and step them there with DeepSpeed's CPU Adam (stage >= 1; adam/adamw only; built on first use)."""
    offload_params: bool = False
    """ZeRO-Infinity: keep parameters on CPU (stage 3 only)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed config keys merged last (for options this file does not model)."""


@dataclass
class DistConfig:
    timeout_s: float = 300.0
    """A rank that makes no progress (a micro batch, an eval batch, a save) for this long ends the job with exit 76, one line naming its rank, step and phase, and every thread's stack in RUN_DIR/errors/; a loader's start (its workers' first batches) is given at least 120 s; a rank whose reader is still retrying storage within data.retry_time_s is waited on, on every node (docs/training.md), and the process group's own timeout covers that wait and a minute more. Raise it where one save, export or evaluation batch takes longer."""


@dataclass
class TrackingConfig:
    enabled: bool = True
    """Log to MLflow (rank 0 only)."""
    experiment: str = "vit-pipeline"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; None uses the run directory's name."""
    log_model: bool = True
    """Upload model.safetensors as an artifact at the end, and the backbone (and each distillation student) as an MLflow Model that serves embeddings (turn off for huge models: the path is tagged instead)."""
    register: str | None = None
    """Register the run's MLflow Model in the Model Registry as a new version of this name (a student: NAME-<student>), its description the run's last k-NN; docs/tracking.md."""
    system_metrics: bool = True
    """Log CPU/memory/GPU usage through MLflow's system metrics."""
    timeout_s: float = 5.0
    """Upper bound on one call to the tracking server, and on the waits at start and at finish; what did not get through is sent later (metrics.jsonl is the record)."""
    retry_s: float = 30.0
    """After a failed call, wait this long before trying the tracking server again; meanwhile metrics pile up in metrics.jsonl and are sent on reconnect."""
    upload_timeout_s: float = 300.0
    """How long finish() waits for artifact uploads (model.safetensors) still in flight; what is left is sent by launch/sync_mlflow.py RUN_DIR."""
    system_metrics_interval_s: float = 10.0
    """Seconds between samples of MLflow's system metrics (system/cpu_utilization_percentage, ...)."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory: config.yaml, checkpoints/, metrics.jsonl, model.safetensors. An existing checkpoint here resumes."""
    kind: Literal["pretrain", "finetune"] = "pretrain"
    """What this run is; set by the launcher."""
    remote: str | None = None
    """s3://BUCKET/PREFIX to mirror the run to: every complete checkpoint tag (in the background, its complete.json last), then config.yaml, metrics.jsonl and model.safetensors; a start whose run.dir is behind the bucket restores its newest complete tag first; one job per prefix (a remote lock). docs/training.md, Runs in a bucket."""


@dataclass
class FinetuneConfig:
    source: str | None = None
    """Weights to start from (--from): a run directory, or a weights file (safetensors or torch.save, told by its bytes) in our layout, timm's, Meta's MAE pretraining checkpoint's or Meta's DINOv2 backbone's, told by its keys (docs/training.md, Fine-tuning)."""
    source_img_size: int | tuple[int, int] | None = None
    """Resolution the source was trained at (read from the source's config.yaml when it has one)."""
    probe: bool = False
    """Linear probing (--probe; MAE's other measure): the encoder frozen, a BatchNorm without affine (eps 1e-6) before the linear head (MAE's main_linprobe.py); ZeRO 0-2."""
    head_init: Literal["zero", "model"] = "zero"
    """The new classifier's start: 'zero' (the paper's, Sec. 3.2: weight and bias 0, every logit 0 at the first step) or 'model' (drawn as the ViT's own init draws it for a run from scratch with the same train.seed: trunc-normal 0.02, zero bias; the fine-tune then starts as that run does but for the pretrained weights). --probe has a head of its own."""
    fresh_patch_embed: bool = False
    """The patch projection drawn by the model's init, the rest loaded: what a source of other channels than 3 needs for a set of other channels than its own (RGB weights adapt to any channel count without it: timm's adapt_input_conv; docs/data.md)."""


Check = tuple[str, bool, str]  # (dotted key, does it hold, what was expected): one of `validate`'s checks


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The Vision Transformer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Shards, augmentation and bad-data policy."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, schedule, logging and checkpoint cadence."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """Distribution and precision."""
    dist: DistConfig = field(default_factory=DistConfig)
    """The process group: how long a rank may wait."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run directory."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Fine-tuning source (ignored by pretraining)."""

    def section_checks(self) -> list[Check]:
        """`validate`'s checks beyond the core sections': none here. A run config with the objectives'
        sections (pipeline.objectives.ObjectivesConfig) adds each objective's."""
        return []


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                schema: type[Config] = Config) -> Config:
    """Read a YAML config (or start from defaults), apply `key=value` overrides, validate strictly. `schema`:
    the core sections (Config), or a run config with the objectives' sections too (what
    pipeline.objectives.load_config reads)."""
    if path is None:
        return config_from_tree({}, overrides, "config", schema)
    return config_from_tree(read_tree(path), overrides, str(path), schema)


def config_from_tree(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), where: str = "config",
                     schema: type[Config] = Config) -> Config:
    """`load_config` of a tree already read (it is not changed): overrides applied, typed, validated."""
    tree = copy.deepcopy(tree)
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    cfg = from_tree(schema, tree, where)
    validate(cfg, where)
    return cfg


class ConfigFiles:
    """The config files one command reads, each read once (a fine-tune's own --config, its run directory's
    config.yaml on a restart, its source's config.yaml), by resolved path; configs are built from the trees."""

    def __init__(self, schema: type[Config] = Config) -> None:
        self.schema = schema
        self._trees: dict[Path, dict[str, Any]] = {}

    def tree(self, path: str | Path) -> dict[str, Any]:
        key = Path(path).resolve()
        if key not in self._trees:
            self._trees[key] = read_tree(path)
        return self._trees[key]

    def load(self, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        return config_from_tree(self.tree(path), overrides, str(path), self.schema)


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...], where: str = "command line") -> Config:
    """`cfg` with `key=value` overrides applied, checked as strictly as a loaded file (a config built
    as data, e.g. the fine-tune recipe on a source run's config, then the user's overrides)."""
    tree = to_dict(cfg)
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    cfg = from_tree(type(cfg), tree, where)
    validate(cfg, where)
    return cfg


def validate(cfg: Config, where: str = "config") -> None:
    """Value checks the types cannot express; each names the key and the allowed range."""
    checks = [
        ("deepspeed.zero_stage", cfg.deepspeed.zero_stage in (0, 1, 2, 3), "0, 1, 2 or 3"),
        ("deepspeed.offload_params", not cfg.deepspeed.offload_params or cfg.deepspeed.zero_stage == 3,
         "false unless deepspeed.zero_stage is 3"),
        ("deepspeed.offload_optimizer", not cfg.deepspeed.offload_optimizer or cfg.deepspeed.zero_stage >= 1,
         "false unless deepspeed.zero_stage >= 1"),
        ("deepspeed.offload_optimizer", not cfg.deepspeed.offload_optimizer or cfg.train.optimizer != "sgd",
         "false with train.optimizer 'sgd' (ZeRO-Offload steps on the CPU with DeepSpeed's CPU Adam)"),
        ("dist.timeout_s", cfg.dist.timeout_s > 0, "> 0 (seconds)"),
        ("train.steps", cfg.train.steps > 0, "> 0"),
        ("train.micro_batch_size", cfg.train.micro_batch_size > 0, "> 0"),
        ("train.grad_accum_steps", cfg.train.grad_accum_steps is None or cfg.train.grad_accum_steps > 0, "> 0"),
        ("train.global_batch_size", cfg.train.global_batch_size is None or cfg.train.global_batch_size > 0, "> 0"),
        ("train.seed", cfg.train.seed >= 0, ">= 0"),
        ("train.lr", cfg.train.lr >= 0, ">= 0"),
        ("train.warmup_steps", cfg.train.warmup_steps >= 0, ">= 0"),
        ("train.log_every", cfg.train.log_every > 0, "> 0"),
        ("train.ckpt_every_s", cfg.train.ckpt_every_s >= 0, ">= 0 (seconds)"),
        ("train.layer_decay", cfg.train.layer_decay is None or 0 < cfg.train.layer_decay <= 1, "in (0, 1] or null"),
        ("train.max_nonfinite_steps", cfg.train.max_nonfinite_steps > 0, "> 0"),
        ("train.ema_decay", cfg.train.ema_decay is None or 0 <= cfg.train.ema_decay <= 1, "in [0, 1] or null"),
        ("train.ema_min_decay", 0 <= cfg.train.ema_min_decay <= 1, "in [0, 1]"),
        ("train.ema_warmup_gamma", cfg.train.ema_warmup_gamma > 0, "> 0 (steps)"),
        ("train.ema_warmup_power", cfg.train.ema_warmup_power > 0, "> 0"),
        ("train.ema_update_after_step", cfg.train.ema_update_after_step >= 0, ">= 0"),
        ("data.max_bad_fraction", 0 <= cfg.data.max_bad_fraction <= 1, "between 0 and 1"),
        ("data.num_workers", cfg.data.num_workers >= 0, ">= 0"),
        ("data.partitions", cfg.data.partitions is None or cfg.data.partitions > 0, "> 0 or null"),
        ("data.shuffle_span", cfg.data.shuffle_span > 0, "> 0"),
        ("data.max_image_pixels", cfg.data.max_image_pixels > 0, "> 0"),
        ("data.retry_attempts", cfg.data.retry_attempts >= 1, ">= 1"),
        ("data.retry_time_s", cfg.data.retry_time_s > 0, "> 0 (seconds)"),
        ("data.retry_backoff_s", cfg.data.retry_backoff_s >= 0, ">= 0 (seconds)"),
        ("data.read_timeout_s", cfg.data.read_timeout_s > 0, "> 0 (seconds)"),
        ("data.range_mb", cfg.data.range_mb > 0, "> 0 (MiB)"),
        ("data.range_parallel", cfg.data.range_parallel >= 1, ">= 1"),
        ("run.remote", cfg.run.remote is None or (cfg.run.remote.startswith("s3://") and len(cfg.run.remote) > 5),
         "s3://BUCKET/PREFIX or null"),
        ("data.decode_device", cfg.data.decode_device == "cpu" or (
            cfg.data.auto_augment is None and cfg.data.color_jitter is None),
         "'cpu' when data.auto_augment or data.color_jitter is set (the GPU decode does crop, flip and "
         "normalisation only)"),
        ("data.interpolation", cfg.data.decode_device == "cpu" or cfg.data.interpolation in ("bilinear", "bicubic"),
         "'bilinear' or 'bicubic' when data.decode_device is 'cuda'"),
        ("model.drop_rate", 0 <= cfg.model.drop_rate < 1, "in [0, 1)"),
        ("model.drop_path_rate", 0 <= cfg.model.drop_path_rate < 1, "in [0, 1)"),
        *cfg.section_checks(),
    ]
    for key, ok, expected in checks:
        if not ok:
            value = operator.attrgetter(key)(cfg)
            raise ConfigError(f"{where}: key '{key}' must be {expected}, got {value!r}")
    check_sources(cfg.data, where)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML, JSON and MLflow."""
    def plain(v: Any) -> Any:
        return ([plain(x) for x in v] if isinstance(v, tuple) else
                {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v)
    return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def load_or_exit(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                 schema: type[Config] = Config) -> Config:
    """`load_config` for launchers: a user error prints one line and exits with code 2."""
    try:
        return load_config(path, overrides, schema)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
