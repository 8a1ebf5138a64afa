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
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
PRE=runs/demo-mae-pretrain
FT=runs/demo-mae-finetune
SCRATCH=runs/demo-mae-scratch
start=$(date +%s)

shards --source digits --out data/digits
shards --source digits --train-fraction 0.1 --out data/digits-10pct
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT" "$SCRATCH"

ranks launch/pretrain.py --config configs/finetune/mae_demo.yaml run.dir="$SCRATCH"
ranks launch/pretrain.py --config configs/pretrain/mae_demo.yaml run.dir="$PRE"
ranks launch/finetune.py --config configs/finetune/mae_demo.yaml --from "$PRE" --res 32 run.dir="$FT"

echo
echo "MAE pretraining, no labels: reconstruction loss $(last_metric "$PRE" eval/recon_loss), k-NN top-1 $(last_metric "$PRE" eval/knn_top1 pct)%   $PRE"
echo "10% of the labels, fine-tuned from MAE:     top-1 $(last_metric "$FT" eval/top1 pct)%   $FT"
echo "10% of the labels, from random weights:     top-1 $(last_metric "$SCRATCH" eval/top1 pct)%   $SCRATCH"
echo "demo-mae took $(( $(date +%s) - start )) s"
echo "compare the runs: $(ui_hint)"
