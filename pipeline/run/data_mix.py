"""A mixture's record in the run directory (data.sources): RUN_DIR/data_mix.jsonl holds one line per mix the
run trained with, from its first step; a resume that changed the mix (data.allow_mix_change) adds its line,
says so, and tags the MLflow run with the step (the changed weights themselves reach MLflow as params, a
changed one as tag param_override.data.sources.<name>.weight)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.dist import say

MIX_FILE = "data_mix.jsonl"


def record_mix(run_dir: Path, tracker: Any, loader: Any, step: int) -> None:
    """Rank 0, once the run is restored at `step`: the first mix of a fresh run, or the change a resume made."""
    history = loader.stream.history
    if history is None:
        return
    period = history.periods[-1]
    line = {"step": period.step, "weights": dict(period.weights), "blocks": period.blocks}
    if loader.mix_change is not None:
        change = loader.mix_change
        with open(run_dir / MIX_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({**line, "changes": change["changes"]}) + "\n")
        tracker.set_tags({f"data.mix_change.step_{change['step']}": "; ".join(change["changes"])})
        say(f"data: the mix changed at step {change['step']} ({'; '.join(change['changes'])}): the new mix applies "
            f"from this step, every source continuing where it was (data.allow_mix_change); recorded in "
            f"{run_dir / MIX_FILE}")
    elif step == 0:
        (run_dir / MIX_FILE).write_text(json.dumps(line) + "\n")
    shares = ", ".join(f"{name} {w:.4g}" for name, w in period.weights)
    say(f"data: {len(period.weights)} sources at {shares} of every global batch; {period.blocks} blocks")
