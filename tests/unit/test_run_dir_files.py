"""The run directory's files without training: completion records, retention, the lock, exit codes."""

import json
import re
import shutil
import subprocess
import sys
import time
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


@pytest.mark.parametrize("var,holder_id,my_id,same", [
    ("TORCHELASTIC_RUN_ID", "elastic-7", "elastic-7", True),  # a worker-group restart
    ("TORCHELASTIC_RUN_ID", "none", "none", False),  # torchrun's default id: shared by unrelated jobs
    ("SLURM_JOB_ID", "4242", "4242", True),  # a requeue of the same Slurm job
    ("SLURM_JOB_ID", "4242", "4243", False),  # another Slurm job
], ids=["torchrun-restart", "torchrun-default-id", "slurm-requeue", "slurm-other-job"])
def test_this_jobs_previous_attempt_is_waited_for_another_job_is_not(tmp_path, monkeypatch, var, holder_id, my_id,
                                                                     same):
    """A held lock whose holder carries our Slurm job id (a requeue) or our torchrun run id (a worker-group
    restart) is our own previous attempt, still exiting: we wait for it to go. torchrun's default id "none"
    and another Slurm job's id are another job: refused at once."""
    import threading

    import pipeline.train.lock as lock

    for v in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, my_id)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(ROOT), var: holder_id})
    try:
        assert holder.stdout.readline().strip() == "locked"
        if not same:
            t0 = time.monotonic()
            with pytest.raises(RunDirLocked, match=rf"pid {holder.pid}, "):
                lock_run_dir(tmp_path)
            assert time.monotonic() - t0 < lock.SAME_JOB_WAIT_S / 10  # at once: no wait (the wait is 120 s)
            return
        # The old attempt exits 0.5 s into our wait (a torchrun agent stops its workers before restarting them;
        # Slurm ends a requeued job's steps), before our second try: we get the lock once it is gone, not before.
        killed: list[float] = []
        threading.Timer(0.5, lambda: (killed.append(time.monotonic()), holder.kill())).start()
        monkeypatch.setattr(lock, "SAME_JOB_WAIT_S", 30.0)
        got = lock_run_dir(tmp_path)
        assert killed and time.monotonic() >= killed[0]
        assert got[var.lower()] == my_id and got["pid"] != holder.pid
    finally:
        holder.kill()
        holder.wait()
        lock._held.pop(str(tmp_path.resolve()), None)


def test_a_failed_start_removes_only_what_its_lock_made(tmp_path):
    """A start refused after the lock (a bad --from) leaves no run directory; a directory that existed, or
    that the start wrote into, stays with its lock."""
    import os

    import pipeline.train.lock as lock

    fresh = tmp_path / "runs" / "ft"  # runs/ does not exist either
    lock_run_dir(fresh)
    lock.remove_if_unused(fresh)
    assert not (tmp_path / "runs").exists() and str(fresh.resolve()) not in lock._held  # released
    lock_run_dir(fresh)  # a corrected start takes it again
    (fresh / "config.yaml").write_text("run: {}\n")  # the start wrote: a run directory
    lock.remove_if_unused(fresh)
    assert sorted(p.name for p in fresh.iterdir()) == ["config.yaml", "lock"]
    os.close(lock._held.pop(str(fresh.resolve())))

    existing = tmp_path / "mine"
    existing.mkdir()
    lock_run_dir(existing)
    lock.remove_if_unused(existing)
    assert (existing / "lock").is_file()
    os.close(lock._held.pop(str(existing.resolve())))


def test_a_lock_on_a_removed_lock_file_is_not_taken_as_held(tmp_path):
    """remove_if_unused unlinks the file while still holding it: a job that opened it just before locks an
    orphan, which lock_run_dir notices (and then locks the file at the path)."""
    import os

    from pipeline.train.lock import _is_at_path

    path = tmp_path / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert _is_at_path(fd, path)
        os.unlink(path)
        assert not _is_at_path(fd, path)
        path.write_text("")  # another job's new lock file
        assert not _is_at_path(fd, path)
    finally:
        os.close(fd)


def test_slurm_scripts_use_the_exit_codes_of_the_enum():
    for script in ("slurm/pretrain.sh", "slurm/finetune.sh"):
        text = (ROOT / script).read_text()
        codes = dict(re.findall(r"^(\w+)_EXIT_CODE=(\d+)", text, re.M))
        assert codes, script
        for name, value in codes.items():
            assert ExitCode[name] == int(value), f"{script}: {name}_EXIT_CODE={value}, ExitCode.{name}={ExitCode[name]}"
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"exit [1-9][0-9]*\b", code), f"{script}: a literal exit code"


def test_universal_conversion_once_per_tag_and_a_racing_converter_loses_cleanly(tmp_path, monkeypatch):
    """The second resume on a tag reuses its conversion; a converter that finishes second (another attempt
    converted the same tag meanwhile) drops its own copy and returns the winner's."""
    make_tag(tmp_path, 100)
    calls = []

    def fake_convert(source, out, run_dir=None):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "mine").write_text(out.name)
        if len(calls) == 2:  # the racing attempt lands its conversion while this one runs
            winner = ckpt.universal_dir(tmp_path) / "step_0000100"
            winner.mkdir()
            (winner / "converted").write_text("step_0000100\n")

    monkeypatch.setattr(ckpt.ds_compat, "convert_to_universal", fake_convert)
    out = ckpt.convert_to_universal(tmp_path, "step_0000100")
    assert (out / "converted").is_file() and (out / ckpt.STATE_FILE).is_file()
    assert ckpt.convert_to_universal(tmp_path, "step_0000100") == out and len(calls) == 1  # reused
    shutil.rmtree(out)  # the next attempt converts again, and meets a racing converter
    assert ckpt.convert_to_universal(tmp_path, "step_0000100") == out and len(calls) == 2
    assert not (out / "mine").exists()  # the winner's copy stands
    assert [p.name for p in ckpt.universal_dir(tmp_path).iterdir()] == ["step_0000100"]  # the loser's folder is gone
