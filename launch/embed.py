#!/usr/bin/env python
"""Write every sample's features (class token, mean patch token; patch tokens on request) as Parquet.

    python launch/embed.py --from runs/demo-dino-pretrain --data data/digits --out embeddings/digits
    torchrun --nproc_per_node 8 launch/embed.py --from runs/vit_b16 --step 50000 --data s3://b/imgs --out s3://b/emb

One part per input shard, OUT/<split>/part-NNNNN.parquet, with columns key (<split>/<the sample's key in its
shard>: unique), split, source (the file make_shards made the sample from, or null), label (null where there is
none), cls and mean_patch (float32[D] each), patch_tokens (float32[N*D], with --patch-tokens);
OUT/_embeddings.json says what was embedded. pandas, polars, DuckDB or pyarrow read it:
`pd.read_parquet("OUT")`, `np.stack(df.cls)`. Every sample exactly once on any number of ranks; killed and
started again with the same command, it writes only the parts that are missing (docs/evaluation.md).
--from, --step: as launch/evaluate.py. Exit codes: 0 done, 1 bad input (one line naming it; --debug: the traceback), 2 bad arguments.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True, type=local_path, help="a run directory or a weights file")
    parser.add_argument("--step", type=int, help="the run's checkpoint of this step (default: its export)")
    parser.add_argument("--data", required=True, help="shards with dataset.json (labels not needed)")
    parser.add_argument("--out", required=True, help="an empty or new folder, or s3://BUCKET/PREFIX")
    parser.add_argument("--splits", default=None, help="comma-separated splits (default: every split)")
    parser.add_argument("--patch-tokens", action="store_true", help="also every patch token (N x D per sample)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward (default 64)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    add_normalisation_arguments(parser)
    add_launcher_arguments(parser)
    args = parser.parse_args(argv)
    set_debug(args)
    return one_line_errors(lambda: run(args), f"--from {args.source}")


def run(args: argparse.Namespace) -> int:
    import torch

    from pipeline.config import DataConfig
    from pipeline.data import dataset_info_of
    from pipeline.dist import detect_env, init_distributed
    from pipeline.model.weights import WeightsError
    from pipeline.run.backbone import load_backbone, normalised, tag_of_step
    from pipeline.run.embed import embed

    env = init_distributed() if detect_env().world_size > 1 else detect_env()
    device = torch.device(f"cuda:{env.local_rank}" if torch.cuda.is_available() else "cpu")
    if args.step is not None and not args.source.is_dir():
        raise WeightsError(f"--step needs a run directory; {args.source} is not one")
    tag = tag_of_step(args.source, args.step) if args.step is not None else None
    backbone = normalised(load_backbone(args.source, tag), args.mean, args.std)
    splits = (args.splits.split(",") if args.splits
              else sorted(dataset_info_of(DataConfig(path=args.data)).splits))
    counts = embed(backbone, args.data, splits, args.out, env, device, args.batch_size, args.patch_tokens,
                   args.workers)
    if env.is_main:
        print(f"wrote {counts['written_all']} embeddings of {', '.join(splits)} to {args.out} "
              f"({counts['bad_all']} samples without a readable image left out; parts already there kept)", flush=True)
    return 0


if __name__ == "__main__":
    from pipeline.signals import exit_without_teardown

    exit_without_teardown(main())  # after the atexit handlers; without the teardown of torch's modules
