#!/usr/bin/env bash
# `make demo-dinov3`: DINOv3's three stages on the built-in digits without their labels, then fine-tunes with
# 10% of the labels from the last stage's teacher at the stages' resolution and at 2x, beside the same
# fine-tune from random weights (docs/dinov3.md quotes one run). CPU only.
#   1. shards: data/digits-unlabelled, data/digits and data/digits-10pct, as demo-dino's
#   2. the baseline: configs/finetune/mae_demo.yaml from random weights (launch/pretrain.py), as demo-dino's
#   3. stage 1, pretraining (configs/pretrain/dinov3_demo.yaml); stage 2, Gram anchoring, and stage 3, the
#      high-resolution stage, each continuing the one before (launch/pretrain.py --from); each judged at its
#      evaluations on the labelled digits (eval.sets: the teacher's k-NN top-1)
#   4. the fine-tune from stage 3's teacher backbone at 32 px and at 64 px (RoPE: no position table to
#      resize), its new head drawn as the baseline's is (finetune.head_init=model)
#   5. the k-NN of stage 1's ViT at its random initialisation (one step at learning rate 0: the weights as
#      drawn), the floor the stages must clear
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
PRE=runs/demo-dinov3-pretrain
GRAM=runs/demo-dinov3-gram
HIGHRES=runs/demo-dinov3-highres
FT=runs/demo-dinov3-finetune
FT2X=runs/demo-dinov3-finetune-64px
SCRATCH=runs/demo-dinov3-scratch
RANDOM_INIT=runs/demo-dinov3-random
start=$(date +%s)

label_free_shards
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$GRAM" "$HIGHRES" "$FT" "$FT2X" "$SCRATCH" "$RANDOM_INIT"
DATA=(data.path=data/digits-unlabelled eval.sets.digits=data/digits)

ranks launch/pretrain.py --config configs/finetune/mae_demo.yaml run.dir="$SCRATCH"
ranks launch/pretrain.py --config configs/pretrain/dinov3_demo.yaml "${DATA[@]}" run.dir="$PRE"
ranks launch/pretrain.py --config configs/pretrain/dinov3_demo_gram.yaml --from "$PRE" "${DATA[@]}" run.dir="$GRAM"
ranks launch/pretrain.py --config configs/pretrain/dinov3_demo_highres.yaml --from "$GRAM" "${DATA[@]}" \
  run.dir="$HIGHRES"
ranks launch/finetune.py --config configs/finetune/mae_demo.yaml --from "$HIGHRES" --res 32 \
  finetune.head_init=model run.dir="$FT"
ranks launch/finetune.py --config configs/finetune/mae_demo.yaml --from "$HIGHRES" --res 64 \
  finetune.head_init=model run.dir="$FT2X"
# AdamW's step and its decoupled decay both scale with the lr: at 0 the exported teacher is the drawn ViT.
ranks launch/pretrain.py --config configs/pretrain/dinov3_demo.yaml "${DATA[@]}" train.steps=1 train.lr=0 \
  train.warmup_steps=0 run.dir="$RANDOM_INIT"

knn() { last_metric "$1" eval/digits/knn_top1 pct; }
echo
echo "DINOv3 on the digits, no labels: the teacher's k-NN top-1 on the labelled digits at the end of each stage"
echo "  1. pretraining, 32 px:                           $(knn "$PRE")%   $PRE (effective rank $(last_metric "$PRE" eval/effective_rank))"
echo "  2. Gram anchoring, Gram teacher at 64 px:        $(knn "$GRAM")%   $GRAM"
echo "  3. high resolution, 48 and 64 px crops:          $(knn "$HIGHRES")%   $HIGHRES (effective rank $(last_metric "$HIGHRES" eval/effective_rank))"
echo "  stage 1's ViT, random weights:                   $(knn "$RANDOM_INIT")%   $RANDOM_INIT (effective rank $(last_metric "$RANDOM_INIT" eval/effective_rank))"
echo "10% of the labels:"
echo "  fine-tuned from stage 3's teacher at 32 px:      top-1 $(last_metric "$FT" eval/top1 pct)%   $FT"
echo "  fine-tuned from stage 3's teacher at 64 px (2x): top-1 $(last_metric "$FT2X" eval/top1 pct)%   $FT2X"
echo "  from random weights at 32 px:                    top-1 $(last_metric "$SCRATCH" eval/top1 pct)%   $SCRATCH"
echo "demo-dinov3 took $(( $(date +%s) - start )) s"
echo "judge every checkpoint: $PY launch/evaluate.py --from $PRE --all-steps --data data/digits"
echo "compare the runs: $(ui_hint)"
