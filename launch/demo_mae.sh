#!/usr/bin/env bash
# `make demo-mae`: MAE on the built-in digits without their labels, then the same fine-tune with 10% of
# the labels from the MAE encoder and from random weights (docs/mae.md quotes one run). CPU only.
#   1. shards: data/digits-unlabelled (the 1,797 images without labels), data/digits (the same with labels)
#      and data/digits-10pct (143 labelled training images, val whole)
#   2. the baseline: configs/finetune/mae_demo.yaml from random weights (launch/pretrain.py)
#   3. MAE pretraining on data/digits-unlabelled, judged at every evaluation on the labelled digits (eval.sets:
#      k-NN top-1 as its progress measure, docs/evaluation.md)
#   4. the same fine-tune from the MAE encoder (launch/finetune.py --from)
# The MAE run is trained after the baseline so that it is the newest finished pretraining run:
# `deepspeed launch/finetune.py --res 64 data.path=data/digits` afterwards fine-tunes it with MAE's own recipe
# (on the labelled digits: the run's own data has no labels).
#
# `bash launch/demo_mae.sh uint16` (`make demo-mae-16bit`): the same on the digits as single-channel 16-bit
# arrays (make_shards --dtype uint16: the 17 grey levels x 65535/16; data/digits16*, runs/demo-mae16-*), each run
# normalised by its set's dataset.json statistics (data.mean/std null), its model of 1 input channel.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
DTYPE=${1:-uint8}
case "$DTYPE" in
  uint8) TAG=""; PIXELS=() ;;
  uint16) TAG=16; PIXELS=(data.mean=null data.std=null) ;;
  *) echo "error: launch/demo_mae.sh [uint8|uint16], got '$DTYPE'" >&2; exit 2 ;;
esac
PRE=runs/demo-mae$TAG-pretrain
FT=runs/demo-mae$TAG-finetune
SCRATCH=runs/demo-mae$TAG-scratch
start=$(date +%s)

label_free_shards "$DTYPE"
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT" "$SCRATCH"

ranks launch/pretrain.py --config configs/finetune/mae_demo.yaml data.path="data/digits$TAG-10pct" \
  "${PIXELS[@]}" run.dir="$SCRATCH"
ranks launch/pretrain.py --config configs/pretrain/mae_demo.yaml data.path="data/digits$TAG-unlabelled" \
  eval.sets.digits="data/digits$TAG" "${PIXELS[@]}" run.dir="$PRE"
ranks launch/finetune.py --config configs/finetune/mae_demo.yaml --from "$PRE" --res 32 \
  data.path="data/digits$TAG-10pct" "${PIXELS[@]}" run.dir="$FT"

echo
echo "MAE pretraining, no labels: reconstruction loss $(last_metric "$PRE" eval/recon_loss), k-NN top-1 $(last_metric "$PRE" eval/digits/knn_top1 pct)%   $PRE"
echo "10% of the labels, fine-tuned from MAE:     top-1 $(last_metric "$FT" eval/top1 pct)%   $FT"
echo "10% of the labels, from random weights:     top-1 $(last_metric "$SCRATCH" eval/top1 pct)%   $SCRATCH"
echo "demo-mae ($DTYPE) took $(( $(date +%s) - start )) s"
echo "judge every checkpoint: $PY launch/evaluate.py --from $PRE --all-steps --data data/digits$TAG"
echo "compare the runs: $(ui_hint)"
