#!/usr/bin/env bash
# `make demo-mae`: MAE on the built-in digits without their labels, then the same fine-tune with 10% of
# the labels from the MAE encoder and from random weights (docs/mae.md quotes one run). CPU only.
#   1. shards: data/digits (all 1,438 training images) and data/digits-10pct (143 of them, val whole)
#   2. the baseline: configs/finetune/mae_demo.yaml from random weights (launch/pretrain.py)
#   3. MAE pretraining on data/digits, labels unused (k-NN top-1 on val as its progress measure)
#   4. the same fine-tune from the MAE encoder (launch/finetune.py --from)
# The MAE run is trained after the baseline so that it is the newest finished pretraining run: a bare
# `deepspeed launch/finetune.py --res 64` afterwards fine-tunes it with MAE's own recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEEPSPEED=${DEEPSPEED:-.venv/bin/deepspeed}
RANKS=${RANKS:-2}        # processes; on CPU they share the cores (gloo backend)
PRE=runs/demo-mae-pretrain
FT=runs/demo-mae-finetune
SCRATCH=runs/demo-mae-scratch
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank: 2 ranks on 2 cores, no oversubscription
start=$(date +%s)

[ -f data/digits/dataset.json ] || "$PY" launch/make_shards.py --source digits --out data/digits --no-progress
[ -f data/digits-10pct/dataset.json ] ||
  "$PY" launch/make_shards.py --source digits --out data/digits-10pct --train-fraction 0.1 --no-progress
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT" "$SCRATCH"

free_port() { "$PY" -c 'from pipeline.dist import free_port; print(free_port())'; }
"$DEEPSPEED" --num_gpus "$RANKS" --master_port "$(free_port)" launch/pretrain.py \
  --config configs/finetune/mae_demo.yaml run.dir="$SCRATCH"
"$DEEPSPEED" --num_gpus "$RANKS" --master_port "$(free_port)" launch/pretrain.py \
  --config configs/pretrain/mae_demo.yaml run.dir="$PRE"
"$DEEPSPEED" --num_gpus "$RANKS" --master_port "$(free_port)" launch/finetune.py \
  --config configs/finetune/mae_demo.yaml --from "$PRE" --res 32 run.dir="$FT"

"$PY" - "$PRE" "$FT" "$SCRATCH" "$start" <<'PYEOF'
import json, sys, time
from pathlib import Path
from pipeline.tracking import tracking_uri, ui_hint

def last(run_dir, key):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [m[key] for m in (json.loads(line)["metrics"] for line in lines) if key in m][-1]

pre, ft, scratch, start = sys.argv[1:]
print(f"\nMAE pretraining, no labels: reconstruction loss {last(pre, 'eval/recon_loss'):.3f}, "
      f"k-NN top-1 {100 * last(pre, 'eval/knn_top1'):.1f}%   {pre}")
print(f"10% of the labels, fine-tuned from MAE:     top-1 {100 * last(ft, 'eval/top1'):.1f}%   {ft}")
print(f"10% of the labels, from random weights:     top-1 {100 * last(scratch, 'eval/top1'):.1f}%   {scratch}")
print(f"demo-mae took {time.time() - float(start):.0f} s")
print(f"compare the runs: {ui_hint(tracking_uri())}")
PYEOF
