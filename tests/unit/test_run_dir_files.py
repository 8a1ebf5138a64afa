"""The run directory's files without training: completion records, retention, the lock, exit codes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.exit_codes import ExitCode
from pipeline.train import checkpoint as ckpt
from pipeline.train.lock import RunDirLocked, lock_run_dir

ROOT = Path(__file__).resolve().parents[2]


def make_tag(run_dir: Path, step: int, complete: bool = True) -> Path:
    tag_dir = ckpt.checkpoint_dir(run_dir) / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    (tag_dir / "trainer_state.json").write_text("{}")
    if complete:
        (tag_dir / ckpt.COMPLETE_FILE).write_text(json.dumps({"files": ckpt._tag_files(tag_dir)}))
    return tag_dir


def test_a_tag_is_complete_only_with_its_record_and_every_file_at_its_size(tmp_path):
    tag = make_tag(tmp_path, 5)
    assert ckpt.check_tag(tag) is None
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 50)
    assert ckpt.check_tag(tag) == "mp_rank_00_model_states.pt is 50 bytes, complete.json recorded 105"
    (tag / "mp_rank_00_model_states.pt").unlink()
    assert ckpt.check_tag(tag) == "mp_rank_00_model_states.pt is missing"
    assert ckpt.check_tag(make_tag(tmp_path, 6, complete=False)) == "no complete.json (its save did not finish)"
    (tag / ckpt.COMPLETE_FILE).write_text('{"files": {"a": 1')
    assert "unreadable" in ckpt.check_tag(tag)


def test_latest_tag_never_reads_the_latest_file(tmp_path):
    make_tag(tmp_path, 5)
    make_tag(tmp_path, 10)
    make_tag(tmp_path, 15, complete=False)  # being written, or its job died
    (ckpt.checkpoint_dir(tmp_path) / "latest").write_text("step_0000099\n")
    assert ckpt.newest_complete_tag(tmp_path) == "step_0000010"
    (ckpt.checkpoint_dir(tmp_path) / "latest").unlink()
    assert ckpt.newest_complete_tag(tmp_path) == "step_0000010"


def test_prune_keeps_the_newest_older_tags_and_never_touches_newer_ones(tmp_path):
    for step in (5, 10, 15, 25, 30):
        make_tag(tmp_path, step)
    make_tag(tmp_path, 12, complete=False)
    make_tag(tmp_path, 20)  # the tag being saved
    ckpt.prune(ckpt.checkpoint_dir(tmp_path), keep_last=2, keep_every=10, current="step_0000020")
    left = sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).glob("step_*"))
    # 15: newest older; 10: keep_every; 20: current; 25, 30: newer than the save (another start wrote them).
    assert left == ["step_0000010", "step_0000015", "step_0000020", "step_0000025", "step_0000030"]


def test_a_truncated_trainer_state_names_its_file(tmp_path):
    tag = tmp_path / "step_0000005"
    tag.mkdir()
    (tag / "trainer_state.json").write_text('{"step": 5, "world_si')
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(tag / "trainer_state.json"))):
        ckpt.TrainerState.read(tag)


HOLD = """
import sys, time
from pipeline.train.lock import lock_run_dir
lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_the_lock_names_its_holder_and_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "4242"})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLocked, match=rf"{tmp_path} is being written by another job .*pid {holder.pid}, "
                                               r"Slurm job 4242"):
            lock_run_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert lock_run_dir(tmp_path)["pid"]  # the kernel dropped the dead holder's lock


def test_slurm_scripts_use_the_exit_codes_of_the_enum():
    for script in ("slurm/pretrain.sh", "slurm/finetune.sh"):
        text = (ROOT / script).read_text()
        codes = dict(re.findall(r"^(\w+)_EXIT_CODE=(\d+)", text, re.M))
        assert codes, script
        for name, value in codes.items():
            assert ExitCode[name] == int(value), f"{script}: {name}_EXIT_CODE={value}, ExitCode.{name}={ExitCode[name]}"
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"exit [1-9][0-9]*\b", code), f"{script}: a literal exit code"
