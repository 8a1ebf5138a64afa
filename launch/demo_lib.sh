# shellcheck shell=bash
# Sourced by launch/demo.sh and launch/demo_mae.sh (from the repository root): the interpreter, the
# launcher, and what both demos do the same way.
PY=${PY:-.venv/bin/python}
DEEPSPEED=${DEEPSPEED:-.venv/bin/deepspeed}
RANKS=${RANKS:-2}        # processes; on CPU they share the cores (gloo backend)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank: 2 ranks on 2 cores, no oversubscription

# make_shards.py ARGS... --out DIR, unless DIR already holds a data set.
shards() {
  local out=${*: -1}
  [ -f "$out/dataset.json" ] || "$PY" launch/make_shards.py --no-progress "$@"
}

# The label-free demos' data: the digits without labels (pretraining), with them (eval.sets, 1,438 training and
# 359 validation images), and 10% of the training labels (143 images, the fine-tunes).
# `label_free_shards uint16`: the same images as single-channel 16-bit arrays, in data/digits16*.
label_free_shards() {
  local dtype=${1:-uint8} tag=""
  [ "$dtype" = uint8 ] || tag=16
  shards --source digits --dtype "$dtype" --no-labels --out "data/digits$tag-unlabelled"
  shards --source digits --dtype "$dtype" --out "data/digits$tag"
  shards --source digits --dtype "$dtype" --train-fraction 0.1 --out "data/digits$tag-10pct"
}

# deepspeed on $RANKS processes, on a free port each time: the default 29500 may belong to another job here.
ranks() {
  "$DEEPSPEED" --num_gpus "$RANKS" --master_port "$("$PY" -c 'from pipeline.dist import free_port; print(free_port())')" "$@"
}

# The last value of metric KEY in RUN_DIR/metrics.jsonl: `last_metric RUN_DIR KEY [pct]` (pct: x 100, one decimal).
last_metric() {
  "$PY" - "$@" <<'PYEOF'
import json, sys
from pathlib import Path
run_dir, key, *pct = sys.argv[1:]
rows = (json.loads(line)["metrics"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
value = [m[key] for m in rows if key in m][-1]
print(f"{100 * value:.1f}" if pct else f"{value:.3f}")
PYEOF
}

# Where to look at the runs (the tracking URI the runs used).
ui_hint() {
  "$PY" -c 'from pipeline.tracking import tracking_uri, ui_hint; print(ui_hint(tracking_uri()))'
}
