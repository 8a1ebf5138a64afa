#!/usr/bin/env bash
# `make demo-dino`: DINOv2 on the built-in digits without their labels, then the same fine-tune with 10%
# of the labels from the DINO teacher's backbone and from random weights (docs/dino.md quotes one run),
# beside MAE's fine-tune when `make demo-mae` has left one. CPU only.
#   1. shards: data/digits-unlabelled, data/digits and data/digits-10pct, as demo-mae's
#   2. the baseline: configs/finetune/mae_demo.yaml from random weights (launch/pretrain.py), as demo-mae's
#   3. DINOv2 pretraining on data/digits-unlabelled, judged at every evaluation on the labelled digits
#      (eval.sets: the teacher's k-NN top-1 as its progress measure, docs/evaluation.md)
#   4. the same fine-tune from the teacher's backbone (launch/finetune.py --from), its new head drawn as the
#      baseline's is (finetune.head_init=model): the two runs differ in the backbone's starting weights only
#   5. the k-NN of the same ViT at its random initialisation (one step at learning rate 0: the weights as drawn),
#      the floor the pretraining must clear
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
PRE=runs/demo-dino-pretrain
FT=runs/demo-dino-finetune
SCRATCH=runs/demo-dino-scratch
RANDOM_INIT=runs/demo-dino-random
MAE_FT=runs/demo-mae-finetune
start=$(date +%s)

label_free_shards
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT" "$SCRATCH" "$RANDOM_INIT"

ranks launch/pretrain.py --config configs/finetune/mae_demo.yaml run.dir="$SCRATCH"
ranks launch/pretrain.py --config configs/pretrain/dino_demo.yaml data.path=data/digits-unlabelled \
  eval.sets.digits=data/digits run.dir="$PRE"
ranks launch/finetune.py --config configs/finetune/mae_demo.yaml --from "$PRE" --res 32 finetune.head_init=model \
  run.dir="$FT"
# AdamW's step and its decoupled decay both scale with the lr: at 0 the exported teacher is the drawn ViT.
ranks launch/pretrain.py --config configs/pretrain/dino_demo.yaml data.path=data/digits-unlabelled \
  eval.sets.digits=data/digits train.steps=1 train.lr=0 train.min_lr=0 train.warmup_steps=0 run.dir="$RANDOM_INIT"

echo
echo "DINOv2 pretraining, no labels: teacher k-NN top-1 $(last_metric "$PRE" eval/digits/knn_top1 pct)%   $PRE (PCA images: $PRE/pca/)"
echo "the same ViT, random weights:  teacher k-NN top-1 $(last_metric "$RANDOM_INIT" eval/digits/knn_top1 pct)%   $RANDOM_INIT"
echo "10% of the labels, fine-tuned from DINOv2: top-1 $(last_metric "$FT" eval/top1 pct)%   $FT (the baseline's head init)"
if [ -f "$MAE_FT/metrics.jsonl" ]; then
  echo "10% of the labels, fine-tuned from MAE:    top-1 $(last_metric "$MAE_FT" eval/top1 pct)%   $MAE_FT (make demo-mae: a zero head)"
else
  echo "10% of the labels, fine-tuned from MAE:    run make demo-mae for this row"
fi
echo "10% of the labels, from random weights:    top-1 $(last_metric "$SCRATCH" eval/top1 pct)%   $SCRATCH"
echo "demo-dino took $(( $(date +%s) - start )) s"
echo "judge every checkpoint: $PY launch/evaluate.py --from $PRE --all-steps --data data/digits"
echo "compare the runs: $(ui_hint)"
