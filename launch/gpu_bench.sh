#!/usr/bin/env bash
# The GPU figures inside one short lease of a GPU machine that has PyTorch (torchvision, timm) but no
# package index: install the wheels `launch/offline_wheels.sh` wrote to .whl/, then run the parts of
# `launch/bench.py` in order of value, each its own process and its own CSV row. After each part the
# CSV and the log are copied to DEST, so whatever finished is there even if the lease ends mid-part.
# A part starts only while its estimated time still fits in BUDGET_S, and is stopped at its own cap or
# at the budget, whichever comes first (a hung part costs its cap, not the lease).
#
#     bash launch/gpu_bench.sh [DEST] [BUDGET_S]      # defaults: $OUT or results/gpu_bench, 540
#     SMOKE=1 bash launch/gpu_bench.sh /tmp/gb 900    # the same parts on the CPU with tiny models
#     PARTS="l16-training correctness" bash launch/gpu_bench.sh   # only these parts (names below)
#
# DEST receives benchmarks.csv (the whole file; the new rows are the GPU's) and gpu_bench.log; merge the
# rows into results/benchmarks.csv here and render docs/benchmarks.md (docs/performance.md, "GPU").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
DEST=${1:-${OUT:-results/gpu_bench}}
BUDGET_S=${2:-540}
SMOKE=${SMOKE:-}
PARTS=${PARTS:-}
mkdir -p "$DEST"
LOG="$DEST/gpu_bench.log"
START=$(date +%s)
export PYTHONUNBUFFERED=1
exec > >(tee -a "$LOG") 2>&1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

if [ -z "$SMOKE" ] && compgen -G ".whl/*.whl" >/dev/null; then  # the lease's wheels: not for the CPU smoke
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_bench.sh: installing .whl/*.whl failed"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "== $(date -Is) budget ${BUDGET_S} s, $(nproc) cores"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null
python3 -c 'import sys, torch, timm, deepspeed, webdataset; print("python", sys.version.split()[0], "torch", torch.__version__,
"timm", timm.__version__, "deepspeed", deepspeed.__version__, "cuda", torch.cuda.is_available())' 2>&1 | grep -v "^\[" \
  || { echo "gpu_bench.sh: the imports failed: nothing would run"; exit 2; }

declare -a SUMMARY=()
# The smoke's rows (CPU figures of tiny models) go to DEST alone; a GPU run's to results/benchmarks.csv, copied.
declare -a CSV=()
[ -n "$SMOKE" ] && CSV=(--csv "$DEST/benchmarks.csv")
# part NAME ESTIMATE_S CAP_S ARGS...: `launch/bench.py ARGS` if ESTIMATE_S still fits, stopped after CAP_S
# or at the budget.
part() {
  local name=$1 estimate=$2 cap=$3 rc t0 limit
  shift 3
  if [ -n "$PARTS" ] && [[ " $PARTS " != *" $name "* ]]; then
    return
  fi
  if [ "$(left)" -lt "$estimate" ]; then
    echo "== $name: skipped, $(left) s left of the budget, about $estimate s needed"
    SUMMARY+=("$name: skipped")
    return
  fi
  echo "== $name: launch/bench.py $* ($(left) s left)"
  t0=$(date +%s)
  limit=$(left)
  [ "$cap" -gt 0 ] && [ "$cap" -lt "$limit" ] && limit=$cap
  timeout --signal=INT --kill-after=10 "$limit" python3 launch/bench.py "${CSV[@]}" "$@"
  rc=$?
  [ -n "$SMOKE" ] || cp results/benchmarks.csv "$DEST/benchmarks.csv"
  SUMMARY+=("$name: exit $rc after $(($(date +%s) - t0)) s")
}

if [ -n "$SMOKE" ]; then
  # Every part's code at CPU-cheap sizes (tests/integration/test_gpu_bench_smoke.py runs this): tiny models,
  # the eager arms only (compiling each arm on a CPU costs 20-60 s; tests/unit/test_compile.py covers compiling).
  part b16-training 0 0 gpu --smoke --parts training --arms "plain eager,zero1 eager" --budget-s 3600
  part dino-step 0 0 dino --dino-tiny --dino-windows 1 --dino-profile
  part dinov3-step 0 0 dino --dino-recipe dinov3 --dino-tiny --dino-windows 1 --dino-profile
  part correctness 0 0 gpu --smoke --parts correctness
  part b16-e2e 0 0 gpu --smoke --parts e2e
  part mae-step 0 0 mae --mae-variant vit_ti16 --mae-res 32 --mae-windows 1
else
  # (1) B/16@224: every arm, the largest micro batch, the profiles. Arms stop starting at --budget-s,
  # leaving the profile and the parts after it their time.
  part b16-training 150 330 gpu --models vit_b16@224 --parts training --budget-s 240
  # (1b) The same step through Inductor's max-autotune (the bias and GELU in the matmuls' epilogues), with the
  # matmul patch embedding: minutes of autotuning, so a part of its own.
  part b16-autotune 150 300 gpu --models vit_b16@224 --parts training --budget-s 60 --arms "zero1 compiled matmul-patch max-autotune"
  # (2) DINOv2's multi-crop ViT-L/14 step and (3) DINOv3's ViT-L/16 step (2 x 256 + 8 x 112, 262,144 and
  # 98,304 prototypes), each profiled: what their gap to the supervised step is made of.
  part dino-l14-step 90 180 dino --dino-variant vit_l14 --dino-batch 64 --dino-profile
  part dinov3-l16-step 90 180 dino --dino-recipe dinov3 --dino-variant dinov3_vitl16 --dino-batch 64 --dino-profile
  # (4) The checks that have never run on a GPU: bf16 against fp32 loss curves, nvjpeg against PIL.
  part correctness 90 180 gpu --parts correctness
  # (5) End to end from JPEG shards, CPU decode and nvjpeg, at ZeRO-1 compiled.
  part b16-e2e 120 240 gpu --models vit_b16@224 --parts e2e
  # (6) L/16@224, B/16@384, MAE's B/16 step.
  part l16-training 150 300 gpu --models vit_l16@224 --parts training --budget-s 200
  part b16-384-training 150 300 gpu --models vit_b16@384 --parts training --budget-s 200
  part mae-b16-step 60 120 mae
fi
echo "== done after $(($(date +%s) - START)) s"
printf '%s\n' "${SUMMARY[@]}"
