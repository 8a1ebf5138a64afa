"""Shared command-line handling of launch/pretrain.py and launch/finetune.py."""

from __future__ import annotations

import argparse
import sys

from pipeline.config import ConfigError, load_or_exit
from pipeline.train.preemption import install_signal_handlers


def parse_args(kind: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"launch/{kind}.py", description=f"{kind} a Vision Transformer")
    parser.add_argument("--config", required=True, help="YAML run config (configs/...)")
    if kind == "finetune":
        parser.add_argument("--from", dest="source", help="run directory, .safetensors, or timm .pth/.bin")
        parser.add_argument("--res", help="fine-tuning resolution: 384 or 384x512 (height x width)")
    # The DeepSpeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=3e-4")
    return parser.parse_args(argv)


def parse_res(text: str) -> int | list[int]:
    """'384' -> 384, '384x512' -> [384, 512]."""
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts, default=0) <= 0:
        print(f"error: --res '{text}': expected a size like 384 or 384x512", file=sys.stderr)
        raise SystemExit(2)
    return parts[0] if len(parts) == 1 else parts


def run(kind: str, args: argparse.Namespace) -> int:
    install_signal_handlers()  # before anything slow (the launch scripts already did; idempotent)
    overrides = [*args.overrides, f"run.kind={kind}"]
    prepare = None
    if kind == "finetune":
        if args.source:
            overrides.append(f"finetune.source={args.source}")
        if args.res:
            res = parse_res(args.res)
            overrides.append(f"model.img_size={res}")
    cfg = load_or_exit(args.config, overrides)
    # Imported after the config is read: a typo is reported at once, not after DeepSpeed's import.
    from pipeline.data import BadDataError, DataError
    from pipeline.model.weights import WeightsError
    from pipeline.train.trainer import TrainError, fit

    try:
        if kind == "finetune":
            from pipeline.train.finetune import prepare_finetune

            cfg, prepare = prepare_finetune(cfg)
        return fit(cfg, prepare)
    except ConfigError as e:  # e.g. fine-tuning without --from
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except (DataError, BadDataError, WeightsError, TrainError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        _shutdown()


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
