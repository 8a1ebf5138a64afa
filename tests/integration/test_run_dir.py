"""The run directory as an operator meets it: a lost `latest`, a truncated checkpoint, two jobs on one
directory, a full disk. The tiny model, 1 rank, a checkpoint every 5 steps; the runs in this process
(runs.run_here) but for the jobs that must be processes of their own (the lock's holder, killed; a fine-tune
signalled before its requeue)."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from pipeline.train.checkpoint import check_tag, newest_complete_tag
from tests.integration.runs import ROOT, TINY, command, env, run_here

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"


def base(shards, run_dir, steps):
    return [*TINY, f"data.path={shards}", f"run.dir={run_dir}", f"train.steps={steps}", "train.ckpt_every=5",
            "train.keep_last=2", "train.eval_every=0", "train.log_every=1"]


def tags(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def one_line_error(out) -> str:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """A finished 20-step run: complete tags step_0000010, step_0000015 and step_0000020 (keep_last=3)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    out = run_here("pretrain.py", CONFIG, [*base(shards, run_dir, 20), "train.keep_last=3"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert tags(run_dir) == ["step_0000010", "step_0000015", "step_0000020"]
    for tag in tags(run_dir):
        assert check_tag(run_dir / "checkpoints" / tag) is None
        assert (run_dir / "checkpoints" / tag / "complete.json").is_file()
    return run_dir


def test_lost_latest_resumes_from_the_newest_complete_tag_and_deletes_nothing_newer(shards, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / "checkpoints" / "latest").unlink()  # a sync that skips small files, a hand cleanup
    out = run_here("pretrain.py", CONFIG, base(shards, run_dir, 22))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_0000020'} at step 20" in out.stdout
    assert tags(run_dir) == ["step_0000020", "step_0000022"]  # keep_last=2: 10 and 15 pruned, nothing newer
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000022"


def test_truncated_and_unloadable_tags_are_skipped_by_name_and_an_older_one_resumes(shards, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest, second = run_dir / "checkpoints" / "step_0000020", run_dir / "checkpoints" / "step_0000015"
    states = newest / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])  # a node died mid-copy
    state = newest / "trainer_state.json"
    state.write_text(state.read_text()[: len(state.read_text()) // 2])  # and a quota cut this one short
    states = second / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[-512:] = bytes(512)  # same size, zip directory garbled: only loading can tell
    states.write_bytes(bytes(data))
    out = run_here("pretrain.py", CONFIG, base(shards, run_dir, 20))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resume: skipping {newest}: " in out.stdout and "complete.json recorded" in out.stdout, out.stdout
    assert f"resume: DeepSpeed could not load {second}" in out.stdout, out.stdout[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_0000010'} at step 10" in out.stdout
    traces = list((run_dir / "errors").glob("load-*.txt"))
    assert traces and "Traceback" in traces[0].read_text()  # DeepSpeed's, in full, beside the one line
    assert check_tag(newest) is None  # step 20 written again, whole
    assert json.loads((newest / "trainer_state.json").read_text())["step"] == 20


def test_a_fresh_start_among_checkpoints_it_cannot_use_is_refused(shards, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    for tag in tags(run_dir):
        (run_dir / "checkpoints" / tag / "complete.json").unlink()
    out = run_here("pretrain.py", CONFIG, base(shards, run_dir, 20))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    line = one_line_error(out)
    assert "holds checkpoints but none is complete" in line and "step_0000020: no complete.json" in line
    assert tags(run_dir) == ["step_0000010", "step_0000015", "step_0000020"]  # nothing deleted


class _Payload:
    """Unpickled, it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_tag_whose_pickles_carry_code_is_refused_on_resume_and_the_code_never_runs(shards, trained, tmp_path):
    """Someone with write access to the run directory swaps a tag's file for a pickle carrying code and
    records its size in complete.json: DeepSpeed would unpickle it with weights_only=False on resume."""
    import torch

    run_dir, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(trained, run_dir)
    newest = run_dir / "checkpoints" / "step_0000020"
    torch.save({"module": _Payload(marker)}, newest / "mp_rank_00_model_states.pt")
    record = json.loads((newest / "complete.json").read_text())
    record["files"]["mp_rank_00_model_states.pt"] = (newest / "mp_rank_00_model_states.pt").stat().st_size
    (newest / "complete.json").write_text(json.dumps(record))
    out = run_here("pretrain.py", CONFIG, base(shards, run_dir, 22))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    line = one_line_error(out)
    assert f"{newest} is not resumed: " in line and "could run code from the file" in line, line
    assert "posix.system" in line, line
    assert not marker.exists()
    assert tags(run_dir) == ["step_0000010", "step_0000015", "step_0000020"]  # nothing older tried, nothing deleted


def test_a_second_job_on_the_same_run_dir_stops_and_a_dead_holder_does_not_block(shards, tmp_path):
    run_dir = tmp_path / "run"
    overrides = base(shards, run_dir, 400)
    first = subprocess.Popen(command("pretrain.py", CONFIG, overrides, 1), cwd=ROOT, env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # training has started: the first job holds the lock
            if "step 2/400" in line:
                break
        second = run_here("pretrain.py", CONFIG, overrides)
        assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
        line = one_line_error(second)
        assert f"{run_dir} is being written by another job" in line and f"pid {first.pid}" in line, line
        assert first.poll() is None  # the first job trains on, untouched
        for line in first.stdout:  # until its checkpoint at step 5 is written
            if "step 6/400" in line:
                break
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock, as on an OOM kill
        first.wait()
    step = int(newest_complete_tag(run_dir).split("_")[1])  # 5, or later if it ran on while the second job started
    third = run_here("pretrain.py", CONFIG, base(shards, run_dir, step + 2))  # the requeue
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert f"at step {step}\n" in third.stdout


def _mount_tmpfs(path, size) -> bool:
    path.mkdir(parents=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_stays(shards, trained, tmp_path):
    tag_bytes = sum(p.stat().st_size for p in (trained / "checkpoints" / "step_0000015").rglob("*"))
    disk = tmp_path / "disk"
    # Room for one checkpoint and the logs, not for a second checkpoint.
    if not _mount_tmpfs(disk, f"{int(tag_bytes * 1.6) // 1024}k"):
        pytest.skip("mount -t tmpfs failed (a container without CAP_SYS_ADMIN)")
    try:
        run_dir = disk / "run"
        t0 = time.monotonic()
        out = run_here("pretrain.py", CONFIG, base(shards, run_dir, 20))
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
        line = one_line_error(out)
        assert "no space left" in line and str(run_dir / "checkpoints") in line and "MiB" in line, line
        assert f"the previous checkpoint {run_dir / 'checkpoints' / 'step_0000005'} is intact" in line, line
        assert tags(run_dir) == ["step_0000005"] and check_tag(run_dir / "checkpoints" / "step_0000005") is None
        print(f"full disk reported in {time.monotonic() - t0:.0f} s: {line}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_requeued_finetune_keeps_the_source_recorded_at_its_first_start(shards, tmp_path):
    """RES=... sbatch slurm/finetune.sh without FROM: the first start takes the newest finished pretraining
    run in runs/; a requeue after a newer (other architecture) run finished must keep the first one."""
    runs = tmp_path / "runs"  # the launcher looks for runs/ in the working directory
    older = runs / "pre-a"
    pre = run_here("pretrain.py", str(ROOT / CONFIG), base(shards, older, 2), cwd=tmp_path)
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
    ft_dir = runs / "vit-finetune-1234"  # RUN_DIR as slurm/finetune.sh passes it
    ft = [*TINY, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=400", "train.ckpt_every=0",
          "train.eval_every=0", "train.log_every=1"]
    argv = command("finetune.py", str(ROOT / "configs/finetune/demo.yaml"), ft, 1, ["--res", "16"])
    first = subprocess.Popen(argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in first.stdout:
        lines.append(line)
        if "step 3/400" in line:
            first.send_signal(signal.SIGUSR1)  # Slurm's warning before the time limit
    assert first.wait(timeout=300) == 75, "".join(lines[-40:])
    assert "--from runs/pre-a: the newest finished pretraining run" in "".join(lines)

    newer = runs / "pre-b"  # meanwhile another pretraining run finished, with another width
    shutil.copytree(older, newer)
    cfg = (newer / "config.yaml").read_text().replace("embed_dim: 32", "embed_dim: 48")
    (newer / "config.yaml").write_text(cfg)
    os.utime(newer / "model.safetensors", (time.time() + 60, time.time() + 60))

    shutil.rmtree(older)  # and the source itself moved away: the requeue needs only its own checkpoint
    again = run_here("finetune.py", str(ROOT / "configs/finetune/demo.yaml"), [*ft, "train.steps=6"], ["--res", "16"],
                     cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"--from {older.resolve()}: recorded in {ft_dir}/config.yaml" in again.stdout, again.stdout[-3000:]
    assert "resumed from" in again.stdout and "pre-b" not in again.stdout
