#!/usr/bin/env bash
# `make demo`: the whole pipeline on the built-in handwritten digits (scikit-learn, 1,797 real images),
# CPU only: shards -> DeepSpeed pretraining (2 ranks, ZeRO-1, fp32) -> fine-tuning at twice the
# resolution -> both runs in MLflow. A few minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEEPSPEED=${DEEPSPEED:-.venv/bin/deepspeed}
RANKS=${RANKS:-2}        # processes; on CPU they share the cores (gloo backend)
PRE=runs/demo-pretrain
FT=runs/demo-finetune
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank: 2 ranks on 2 cores, no oversubscription
start=$(date +%s)

if [ ! -f data/digits/dataset.json ]; then
  "$PY" launch/make_shards.py --source digits --out data/digits --no-progress
fi
# A demo starts from scratch each time (a real run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT"

# A free port each time: DeepSpeed's default 29500 may belong to another job on this machine.
free_port() { "$PY" -c 'from pipeline.dist import free_port; print(free_port())'; }
"$DEEPSPEED" --num_gpus "$RANKS" --master_port "$(free_port)" launch/pretrain.py --config configs/pretrain/demo.yaml \
  run.dir="$PRE"
"$DEEPSPEED" --num_gpus "$RANKS" --master_port "$(free_port)" launch/finetune.py --config configs/finetune/demo.yaml \
  --from "$PRE" --res 64 run.dir="$FT"

"$PY" - "$PRE" "$FT" "$start" <<'PYEOF'
import json, sys, time
from pathlib import Path
from pipeline.tracking import tracking_uri, ui_hint

def top1(run_dir):
    evals = [json.loads(l)["metrics"] for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m["eval/top1"] for m in evals if "eval/top1" in m][-1]

pre, ft = top1(sys.argv[1]), top1(sys.argv[2])
print(f"\npretrain  (32 px) top-1: {100 * pre:.1f}%   {sys.argv[1]}")
print(f"fine-tune (64 px) top-1: {100 * ft:.1f}%   {sys.argv[2]}")
print(f"demo took {time.time() - float(sys.argv[3]):.0f} s")
print(f"compare the runs: {ui_hint(tracking_uri())}")
PYEOF
