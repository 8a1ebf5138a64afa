#!/usr/bin/env python
"""Judge a run (or a weights file) on a labelled shard set: DINOv2's k-NN and linear probe on frozen features.

    python launch/evaluate.py --from runs/demo-mae-pretrain --data data/digits               # its export
    python launch/evaluate.py --from runs/demo-dino-pretrain --all-steps --data data/digits  # every checkpoint
    python launch/evaluate.py --from runs/demo-pretrain --step 200 --data data/digits --protocol knn
    torchrun --nproc_per_node 2 launch/evaluate.py --from dinov2_vits14_pretrain.pth --data s3://bucket/flowers

--from: a run directory (its model.safetensors, else its newest complete checkpoint; --step N that step's
checkpoint; --all-steps every complete checkpoint) or a weights file (ours, Meta's DINOv2 or MAE release
files). --data: labelled shards with a train and a val split (a folder, s3:// or http(s)://). Prints one table
(checkpoint x protocol x accuracy) and logs each checkpoint's figures as an MLflow run nested under the
source run; with several checkpoints also one run of accuracy against pretraining step (a chart and a PNG).
The protocols (docs/evaluation.md): k-NN as DINOv2's eval/knn.py (cosine on L2-normalised class tokens,
k 10/20/100, T 0.07, the train split as memory); linear as its eval/linear.py (a grid of learning rates on the
class token and mean patch token, chosen on 10% of the train split held out), on features computed once.
Exit codes: 0 done, 1 bad input (one line naming it; --debug: the traceback), 2 bad arguments.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.errors import (  # noqa: E402
    add_launcher_arguments,
    add_normalisation_arguments,
    local_path,
    one_line_errors,
    set_debug,
)

PROTOCOLS = ("knn", "linear")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True, type=local_path, help="a run directory or a weights file")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the run's checkpoint of this step (it must be complete)")
    which.add_argument("--all-steps", action="store_true", help="every complete checkpoint of the run, oldest first")
    parser.add_argument("--data", required=True, help="labelled shards (dataset.json with a train and a val split)")
    parser.add_argument("--protocol", default="knn,linear", help="comma-separated: knn, linear (default: both)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per rank per forward (default 64)")
    parser.add_argument("--train-split", default="train", help="the split the k-NN memory and the probe learn from")
    parser.add_argument("--val-split", default="val", help="the split that is scored")
    parser.add_argument("--name", help="the set's name in metric names (default: the run's eval.sets name for "
                                       "--data when it has one, so the curves meet in MLflow; else the --data "
                                       "folder's name)")
    parser.add_argument("--no-mlflow", action="store_true", help="print the table only")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="also write the figures to FILE: a list of {checkpoint, step, metrics} (what a "
                             "script reads; launch/bench.py quality does)")
    add_normalisation_arguments(parser)
    add_launcher_arguments(parser)
    args = parser.parse_args(argv)
    set_debug(args)
    args.protocols = tuple(p.strip() for p in args.protocol.split(",") if p.strip())
    unknown = [p for p in args.protocols if p not in PROTOCOLS]
    if unknown or not args.protocols:
        parser.error(f"--protocol {args.protocol}: expected a comma-separated list of {', '.join(PROTOCOLS)} "
                     f"(a fine-tune is launch/finetune.py --from RUN --res N [--probe])")
    if (args.step is not None or args.all_steps) and not args.source.is_dir():
        parser.error(f"--step and --all-steps need a run directory; {args.source} is not one")
    args.name = args.name or run_set_name(args.source, args.data) or Path(args.data.rstrip("/")).name
    return args


def run_set_name(source: Path, data: str) -> str | None:
    """The name the source run gave `data` in its eval.sets (its config.yaml, read as YAML: before torch),
    None when it has none: evaluate.py then logs under the run's metric names (eval/<name>/knn_top1)."""
    import yaml

    config = (source if source.is_dir() else source.parent) / "config.yaml"
    try:
        sets = (yaml.safe_load(config.read_text()) or {}).get("eval", {}).get("sets") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None

    def same(path: str) -> bool:
        if "://" in path or "://" in data:
            return path.rstrip("/") == data.rstrip("/")
        return Path(path).expanduser().resolve() == Path(data).expanduser().resolve()

    found = [name for name, path in sets.items() if isinstance(path, str) and same(path)] if isinstance(sets, dict) else []
    return found[0] if found else None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return one_line_errors(lambda: evaluate(args), f"--from {args.source}")


def evaluate(args: argparse.Namespace) -> int:
    import torch

    from pipeline.dist import detect_env, init_distributed
    from pipeline.model.weights import WeightsError
    from pipeline.run.backbone import complete_tags, load_backbone, normalised, tag_of_step
    from pipeline.run.judge import Judge, table

    env = init_distributed() if detect_env().world_size > 1 else detect_env()
    device = torch.device(f"cuda:{env.local_rank}" if torch.cuda.is_available() else "cpu")
    if args.all_steps:
        tags = complete_tags(args.source)
        if not tags:
            raise WeightsError(f"{args.source}: no complete checkpoint in {args.source / 'checkpoints'}")
    else:
        tags = [tag_of_step(args.source, args.step) if args.step is not None else None]
    rows, results, judge = [], [], None
    for tag in tags:
        backbone = normalised(load_backbone(args.source, tag), args.mean, args.std)
        judge = judge or Judge(args.data, backbone, env, args.batch_size, args.protocols, args.train_split,
                               args.val_split)
        name = f"step {backbone.step}" if backbone.step is not None else backbone.source.name
        found, metrics = judge.judge(backbone, device, name)
        rows += found
        results.append((name, backbone.step, metrics))
        if env.is_main:
            print(f"{name}: " + " | ".join(f"{r.protocol} {100 * r.top1:.2f}%" for r in found), flush=True)
    if env.is_main:
        print(f"\n{args.name} ({args.data}), {args.val_split} split:\n{table(rows)}", flush=True)
        if args.json:
            import json

            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([{"checkpoint": name, "step": step, "metrics": metrics}
                                             for name, step, metrics in results], indent=1) + "\n")
        if not args.no_mlflow:
            from pipeline.tracking.evaluations import log_evaluations, params_of

            try:
                log_evaluations(args.source.resolve(), args.name, results, params_of(args))
            except Exception as e:  # noqa: BLE001 - the figures are printed; a store that fails costs a line
                print(f"warning: MLflow: {type(e).__name__}: {e}; the table above is the result", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from pipeline.signals import exit_without_teardown

    exit_without_teardown(main())  # after the atexit handlers; without the teardown of torch's modules
