#!/usr/bin/env python
"""Export a run's checkpoint as consolidated fp32 weights (timm key names), without training.

    python launch/export_weights.py runs/vit_b16_i21k                       # latest -> RUN_DIR/model.safetensors
    python launch/export_weights.py runs/vit_b16_i21k --tag step_0050000 --out b16_50k.safetensors

Works for every ZeRO stage and any number of ranks the run had; runs on CPU. The trainer does this
itself at the end of a run; this is for a run that is still going or was stopped.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.model.weights import save_weights  # noqa: E402
from pipeline.train.checkpoint import CheckpointError, consolidate, latest_tag  # noqa: E402
from pipeline.train.ds_compat import DeepSpeedFailed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tag", help="checkpoint tag, e.g. step_0050000 (default: the newest complete one)")
    parser.add_argument("--out", type=Path, help="output file (default: RUN_DIR/model.safetensors)")
    args = parser.parse_args(argv)
    try:
        tag = args.tag or latest_tag(args.run_dir)
        state = consolidate(args.run_dir, tag)
    except (FileNotFoundError, ValueError, CheckpointError, DeepSpeedFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = args.out or args.run_dir / "model.safetensors"
    save_weights(state, out, metadata={"step": tag.split("_")[-1] if tag else ""})
    print(f"wrote {out}: {len(state)} tensors from {args.run_dir}/checkpoints/{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
