"""What the mixture tests share (test_elastic.py, test_data_s3.py): a 2-source data set (scikit-learn's digits at
32 px and a small synthetic set at 16 px, 0.7 / 0.3 of every global batch), the tiny run's overrides, and the
one uninterrupted reference run of the session, on 1 rank with a checkpoint every 4 steps and the sample ids
it trained on (tests/integration/record_ids.py).

A helper module rather than fixtures in a test module: pytest imports each test module under its own name,
so state kept in one (the reference run) is not seen by another that imports it again.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.integration.runs import PYTHON, ROOT, TINY, make_synthetic_shards, run, weights

CONFIG = "configs/pretrain/demo.yaml"
RECORD = "../tests/integration/record_ids.py"  # run() takes it relative to launch/
STEPS = 8
_DATA: dict[str, Path] = {}
_REFERENCE: dict[str, object] = {}


def mixture_data(tmp_path_factory) -> tuple[Path, Path]:
    """(digits, synth): 1,438 train and 359 val digits in shards of 200; 48 train and 12 val synthetic
    images in shards of 8 (the small source wraps its epoch within a few steps)."""
    if not _DATA:
        out = tmp_path_factory.mktemp("mixture")
        subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", "digits", "--out",
                        str(out / "digits"), "--max-samples-per-shard", "200", "--no-progress"], check=True, cwd=ROOT)
        _DATA["digits"] = out / "digits"
        _DATA["synth"] = make_synthetic_shards(out / "synth", samples=60, per_shard=8)
    return _DATA["digits"], _DATA["synth"]


def sources(digits: Path | str, synth: Path | str, weights: tuple[float, float] = (0.7, 0.3)) -> str:
    return (f"data.sources=[{{name: digits, path: '{digits}', weight: {weights[0]}}}, "
            f"{{name: synth, path: '{synth}', weight: {weights[1]}}}]")


def overrides(run_dir: Path, data: str, workers: int = 1, steps: int = STEPS) -> list[str]:
    """fp32 at ZeRO-0 (which sums the clip norm alike on 1 and 2 ranks): bit-comparable weights on any layout and
    through a resume on another world size; a checkpoint every 4 steps, all kept."""
    return [*TINY, data, f"run.dir={run_dir}", f"train.steps={steps}", "train.global_batch_size=16",
            "train.micro_batch_size=8", "deepspeed.bf16=false", "deepspeed.zero_stage=0",
            f"data.num_workers={workers}", "train.eval_every=0", "train.ckpt_every=4", "train.keep_last=5",
            "data.cache_dir=" + str(run_dir.parent / f"{run_dir.name}-cache")]


def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run: 1 rank, 1 worker, 2 micro batches a step; its run dir and weights."""
    if not _REFERENCE:
        digits, synth = mixture_data(tmp_path_factory)
        run_dir = tmp_path_factory.mktemp("mixref") / "run"
        ids = run_dir.parent / "ids"
        ids.mkdir()
        res = run(RECORD, CONFIG, overrides(run_dir, sources(digits, synth)), ranks=1,
                  extra_env={"RECORD_IDS": str(ids)})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        _REFERENCE.update(run_dir=run_dir, weights=weights(run_dir))
    return _REFERENCE["run_dir"], _REFERENCE["weights"]


def recorded_ids(folder: Path) -> dict[int, list[int]]:
    """Global position of each micro batch's first sample -> its sample ids, over every rank's file."""
    out: dict[int, list[int]] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["positions"][0]] = rec["ids"]
    return out


def sample_keys(paths: list[Path], ids: list[int]) -> list[tuple[str, str]]:
    """(source folder name, '<shard>:<index in shard>') of each global id of a mixture of `paths` (in its
    order), from the sources' dataset.json alone."""
    keys: list[tuple[str, str]] = []
    for path in paths:
        info = json.loads((path / "dataset.json").read_text())
        keys += [(path.name, f"{e['name']}:{k}") for e in info["splits"]["train"]["shards"]
                 for k in range(e["num_samples"])]
    return [keys[i] for i in ids]
