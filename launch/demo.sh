#!/usr/bin/env bash
# `make demo`: the whole pipeline on the built-in handwritten digits (scikit-learn, 1,797 real images),
# CPU only: shards -> DeepSpeed pretraining (2 ranks, ZeRO-1, fp32) -> fine-tuning at twice the
# resolution -> both runs in MLflow. A few minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
PRE=runs/demo-pretrain
FT=runs/demo-finetune
start=$(date +%s)

shards --source digits --out data/digits
# A demo starts from scratch each time (a real run dir with a checkpoint would resume instead).
rm -rf "$PRE" "$FT"

ranks launch/pretrain.py --config configs/pretrain/demo.yaml run.dir="$PRE"
ranks launch/finetune.py --config configs/finetune/demo.yaml --from "$PRE" --res 64 run.dir="$FT"

echo
echo "pretrain  (32 px) top-1: $(last_metric "$PRE" eval/top1 pct)%   $PRE"
echo "fine-tune (64 px) top-1: $(last_metric "$FT" eval/top1 pct)%   $FT"
echo "demo took $(( $(date +%s) - start )) s"
echo "judge every checkpoint: $PY launch/evaluate.py --from $PRE --all-steps --data data/digits"
echo "compare the runs: $(ui_hint)"
