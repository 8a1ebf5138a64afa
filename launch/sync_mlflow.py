"""Send a run directory's metrics, params, tags and artifacts to MLflow: what a job could not send live.

    python launch/sync_mlflow.py runs/vit_b16                 # to $MLFLOW_TRACKING_URI or ./mlflow.db
    python launch/sync_mlflow.py runs/* --uri http://mlflow.example.org:5000

The run is created on that tracking URI if it has never seen it, and continued otherwise. Progress
per URI is kept in RUN_DIR/mlflow_sync.json, so running it again (or after the job resumed and
logged more) sends only what is new: no metric point is sent twice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from pipeline.tracking import sync_run_dir
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.tracking import sync_run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    args = parser.parse_args(argv)
    failed = 0
    for run_dir in args.run_dirs:
        try:
            done = sync_run_dir(run_dir, args.uri)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        except Exception as e:  # noqa: BLE001 - server down, auth refused: one line, go on with the next
            print(f"error: {run_dir}: could not sync ({type(e).__name__}: {' '.join(str(e).split())[:300]})",
                  file=sys.stderr)
            failed += 1
            continue
        how = "created" if done["created"] else "updated"
        print(f"{run_dir}: run {done['run_id']} {how} at {done['uri']}: sent {done['metrics']} metric points, "
              f"{done['params']} params, {done['artifacts']} artifacts"
              + (f"; {done['skipped_lines']} damaged lines of metrics.jsonl not sent (named above)"
                 if done["skipped_lines"] else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
