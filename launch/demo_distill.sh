#!/usr/bin/env bash
# `make demo-distill`: the DINOv3 demo's teacher distilled into a smaller DINOv3 ViT and a small timm CNN on one
# teacher forward, on the built-in digits without their labels, judged by k-NN on the digits' labels against the
# teacher and against the same ViT trained by DINOv3 from scratch for the same steps (docs/distill.md quotes a
# run). CPU only.
#   1. shards: data/digits-unlabelled, data/digits and data/digits-10pct, as demo-dinov3's
#   2. the teacher: configs/pretrain/dinov3_demo.yaml, shortened to $TEACHER_STEPS steps (96 wide, 4 blocks)
#   3. the students: configs/pretrain/distill_demo.yaml with two students for $STEPS steps: a DINOv3 ViT 64 wide
#      (4 blocks, 2 heads) and timm's test_resnet (0.37M parameters) at output_stride 8 (a 4x4 map at 32 px)
#   4. the baseline: the same 64-wide ViT by DINOv3 from scratch for $STEPS steps (dinov3_demo.yaml, narrower)
#   5. each judged by launch/evaluate.py's k-NN (k=20, class token or pooled feature) on data/digits
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
TEACHER_STEPS=${TEACHER_STEPS:-300}
STEPS=${STEPS:-300}
TEACHER=runs/demo-distill-teacher
DISTILL=runs/demo-distill
SCRATCH=runs/demo-distill-scratch
start=$(date +%s)

label_free_shards
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$TEACHER" "$DISTILL" "$SCRATCH"
NARROW=(model.embed_dim=64 model.num_heads=2)
SHORT=(train.eval_every=0 "train.ckpt_every=$STEPS")

ranks launch/pretrain.py --config configs/pretrain/dinov3_demo.yaml data.path=data/digits-unlabelled \
  train.steps="$TEACHER_STEPS" train.eval_every=0 train.ckpt_every="$TEACHER_STEPS" run.dir="$TEACHER"
ranks launch/pretrain.py --config configs/pretrain/distill_demo.yaml distill.teacher="$TEACHER" \
  'distill.students=[{name: vit, model: {variant: dinov3_vits16, embed_dim: 64, num_heads: 2}}, {name: cnn, timm: test_resnet, kwargs: {output_stride: 8}}]' \
  train.grad_clip=0.0 train.steps="$STEPS" train.warmup_steps=$((STEPS / 10)) "${SHORT[@]}" run.dir="$DISTILL"
ranks launch/pretrain.py --config configs/pretrain/dinov3_demo.yaml data.path=data/digits-unlabelled "${NARROW[@]}" \
  train.steps="$STEPS" "${SHORT[@]}" run.dir="$SCRATCH"

knn() { "$PY" launch/evaluate.py --from "$1" --data data/digits --protocol knn --no-mlflow | awk '$2 == "k-NN" && $3 == "k=20" {print $4}'; }
echo
echo "Distillation on the digits, no labels in training: k-NN top-1 (k=20) on the 359 labelled validation digits"
echo "  the teacher, DINOv3 demo $TEACHER_STEPS steps (96 wide):              $(knn "$TEACHER")   $TEACHER"
echo "  the ViT (64 wide), distilled $STEPS steps:                    $(knn "$DISTILL/students/vit/model.safetensors")   $DISTILL/students/vit"
echo "  the same ViT, DINOv3 from scratch $STEPS steps:               $(knn "$SCRATCH")   $SCRATCH"
echo "  timm's test_resnet (0.37M), distilled $STEPS steps:           $(knn "$DISTILL/students/cnn/model.safetensors")   $DISTILL/students/cnn"
echo "demo-distill took $(( $(date +%s) - start )) s"
echo "compare the runs: $(ui_hint)"
