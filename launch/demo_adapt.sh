#!/usr/bin/env bash
# `make demo-adapt`: a model pretrained on one domain, adapted on a second without its labels (`--init`,
# docs/adapt.md), judged by k-NN on the second domain's labels. CPU only. Both domains are scikit-learn's digits
# (nothing is downloaded): the source domain as they are (light ink on dark), the second `digits:shifted`,
# the same images inverted (dark on light) and turned 90 degrees (launch/make_shards.py --source digits:shifted).
#   1. the source: configs/pretrain/dino_demo.yaml on the digits without labels, 200 steps
#   2. configs/pretrain/dinov2_adapt_demo.yaml from its teacher (--init) on the shifted digits without labels,
#      three ways: as configured (frozen backbone, its warm-up, the anchor), without the freeze and warm-up,
#      without the anchor; each judged at step 0 (the source itself) and after, on the shifted digits' labels
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
SRC=runs/demo-adapt-source
start=$(date +%s)

shards --source digits --no-labels --out data/digits-unlabelled
shards --source digits --out data/digits
shards --source digits:shifted --no-labels --out data/digits-shifted-unlabelled
shards --source digits:shifted --out data/digits-shifted
# A demo starts from scratch each time (a run dir with a checkpoint would resume instead).
rm -rf "$SRC" runs/demo-adapt-full runs/demo-adapt-no-warmup runs/demo-adapt-no-anchor

ranks launch/pretrain.py --config configs/pretrain/dino_demo.yaml data.path=data/digits-unlabelled \
  eval.sets.digits=data/digits train.steps=200 train.eval_every=200 train.ckpt_every=200 run.dir="$SRC"
adapt() {  # adapt NAME OVERRIDES...
  ranks launch/pretrain.py --config configs/pretrain/dinov2_adapt_demo.yaml --init "$SRC/model.safetensors" \
    run.dir="runs/demo-adapt-$1" "${@:2}"
}
adapt full
adapt no-warmup adapt.freeze_backbone_steps=0 adapt.backbone_warmup_steps=0
adapt no-anchor adapt.anchor=0

# The step-0 figure of a run is the source's own (eval_init.json); the last, the adapted teacher's.
first() { "$PY" -c 'import json,sys; print(f"{100 * json.load(open(sys.argv[1]))[sys.argv[2]]:.1f}")' "$@"; }
echo
echo "k-NN top-1 (k=20) on the shifted digits' validation split, its training split the neighbours:"
echo "  the source (its own domain, the digits: $(last_metric "$SRC" eval/digits/knn_top1 pct)%)   $(first runs/demo-adapt-full/eval_init.json eval/shifted/knn_top1)%"
echo "  adapted: freeze + warm-up + anchor    $(last_metric runs/demo-adapt-full eval/shifted/knn_top1 pct)%   runs/demo-adapt-full"
echo "  adapted without the freeze/warm-up    $(last_metric runs/demo-adapt-no-warmup eval/shifted/knn_top1 pct)%   runs/demo-adapt-no-warmup"
echo "  adapted without the anchor            $(last_metric runs/demo-adapt-no-anchor eval/shifted/knn_top1 pct)%   runs/demo-adapt-no-anchor"
echo "demo-adapt took $(( $(date +%s) - start )) s"
