"""Runs mirrored to a bucket (run.remote, pipeline/train/mirror.py) against a real S3 server (SeaweedFS on
loopback): complete tags only, complete.json last; a fresh run directory restores the newest complete tag,
checked against the recorded sizes and digests; retention in the bucket; the remote lock; an upload killed
with SIGKILL halfway leaves no tag that looks complete, and restore takes the previous one."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline.train import checkpoint as ckpt
from pipeline.train import mirror
from pipeline.train.lock import RunDirLocked
from tests.integration.runs import ROOT
from tests.integration.s3server import SeaweedS3, weed_or_skip

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _weed() -> None:
    weed_or_skip()  # first, before any fixture trains or writes: skip, or fail with VIT_PIPELINE_REQUIRE_S3=1
BUCKET = "runs"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with SeaweedS3(tmp_path_factory.mktemp("s3")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())  # the standard chain, as a run would have it
        yield server
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fake_tag(run_dir: Path, step: int, mib: int = 1) -> str:
    """A complete tag as save_checkpoint leaves it: files, then complete.json with their sizes."""
    tag = ckpt.tag_for(step)
    d = ckpt.checkpoint_dir(run_dir) / tag
    (d / "zero").mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(os.urandom(mib << 20))
    (d / "zero" / "optim_states.pt").write_bytes(os.urandom(1000 + step))
    (d / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    (d / ckpt.COMPLETE_FILE).write_text(json.dumps({"tag": tag, "files": ckpt._tag_files(d)}))
    return tag


def keys(s3: SeaweedS3, prefix: str) -> set[str]:
    out = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:] for o in out}


def test_complete_tags_go_up_and_a_fresh_run_dir_restores_the_newest(s3: SeaweedS3, tmp_path: Path) -> None:
    remote = f"s3://{BUCKET}/a"
    run = tmp_path / "run"
    m = mirror.Mirror(remote, run)
    for step in (10, 20):
        m.tag(fake_tag(run, step))
    m.wait()
    assert m.mirrored == ["step_0000010", "step_0000020"]
    assert f"checkpoints/step_0000020/{ckpt.COMPLETE_FILE}" in keys(s3, "a")
    # a fresh node: the newest tag comes down, byte for byte, complete for resume
    fresh = tmp_path / "fresh"
    assert mirror.restore(remote, fresh) == "step_0000020"
    for name in ckpt._tag_files(ckpt.checkpoint_dir(run) / "step_0000020"):
        assert (ckpt.checkpoint_dir(fresh) / "step_0000020" / name).read_bytes() == \
            (ckpt.checkpoint_dir(run) / "step_0000020" / name).read_bytes()
    assert ckpt.newest_complete_tag(fresh) == "step_0000020"
    assert mirror.restore(remote, fresh) is None  # as new as the bucket: nothing to do
    # retention: the run directory pruned step 10; the next upload prunes it in the bucket too
    import shutil
    shutil.rmtree(ckpt.checkpoint_dir(run) / "step_0000010")
    m.tag(fake_tag(run, 30))
    m.wait()
    # (SeaweedFS may still list the emptied folder as a common prefix: count objects)
    assert {k.split("/")[1] for k in keys(s3, "a") if k.startswith("checkpoints/")} == {"step_0000020",
                                                                                        "step_0000030"}


def test_a_restored_file_that_differs_from_its_record_is_refused(s3: SeaweedS3, tmp_path: Path) -> None:
    from pipeline.remote.storage import RetryPolicy, StorageError

    remote = f"s3://{BUCKET}/b"
    m = mirror.Mirror(remote, tmp_path / "run")
    m.tag(fake_tag(tmp_path / "run", 5, mib=0))
    m.wait()
    key = "b/checkpoints/step_0000005/zero/optim_states.pt"
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=os.urandom(1005))  # same size, other bytes
    with pytest.raises(StorageError, match="sha256"):
        mirror.restore(remote, tmp_path / "fresh", RetryPolicy(attempts=2, total_s=10, backoff_s=0.01))
    assert ckpt.newest_complete_tag(tmp_path / "fresh") is None  # nothing half restored under a tag's name


@pytest.mark.parametrize("name", ["ABSOLUTE", "../../escaped.pth"])
def test_a_complete_json_naming_a_file_outside_the_tag_is_refused_and_nothing_is_written(
        s3: SeaweedS3, tmp_path: Path, name: str) -> None:
    """Whoever can write the prefix edits a tag's complete.json to name a file outside the run directory (an
    absolute path; a climb with '..'), the object there holding their bytes: the start is refused with one
    line naming that complete.json, and nothing lands outside the run directory, or in it under the tag."""
    remote = f"s3://{BUCKET}/names{len(name)}"
    prefix = remote.split("/", 3)[3]
    m = mirror.Mirror(remote, tmp_path / "writer")
    m.tag(fake_tag(tmp_path / "writer", 7, mib=0))
    m.wait()
    run = tmp_path / "node" / "run"
    target = tmp_path / "node" / "owned.pth" if name == "ABSOLUTE" else run / "checkpoints" / "step_0000007" / name
    name = str(target) if name == "ABSOLUTE" else name
    base = f"{prefix}/checkpoints/step_0000007/"
    record = json.loads(s3.client().get_object(Bucket=BUCKET, Key=base + ckpt.COMPLETE_FILE)["Body"].read())
    payload = b"import os; os.system('touch /tmp/pwned')\n"
    record["files"][name] = len(payload)
    record["sha256"][name] = __import__("hashlib").sha256(payload).hexdigest()
    try:  # AWS S3 keeps '..' in a key as it is; SeaweedFS refuses such a key (the name is refused first anyway)
        s3.client().put_object(Bucket=BUCKET, Key=base + name.lstrip("/"), Body=payload)
    except Exception:  # noqa: BLE001
        assert ".." in name
    s3.client().put_object(Bucket=BUCKET, Key=base + ckpt.COMPLETE_FILE, Body=json.dumps(record).encode())
    run.mkdir(parents=True)
    with pytest.raises(mirror.RemoteError) as e:
        mirror.restore(remote, run)
    assert str(e.value).startswith(f"{remote}/checkpoints/step_0000007/{ckpt.COMPLETE_FILE}: the name "), e.value
    assert "\n" not in str(e.value)
    assert not target.resolve().exists()
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "node").rglob("*")) == [Path("node/run")]


def test_a_listed_folder_that_is_not_a_tag_is_neither_restored_nor_a_traceback(s3: SeaweedS3, tmp_path: Path) -> None:
    """'step_²' passes str.isdigit() and not int(): a listing is data; only step_ + ASCII digits is a tag."""
    remote = f"s3://{BUCKET}/listing"
    m = mirror.Mirror(remote, tmp_path / "writer")
    m.tag(fake_tag(tmp_path / "writer", 3, mib=0))
    m.wait()
    s3.client().put_object(Bucket=BUCKET, Key=f"listing/checkpoints/step_\u00b2/{ckpt.COMPLETE_FILE}", Body=b"{}")
    assert mirror.remote_tags(BUCKET, "listing") == ["step_0000003"]
    assert mirror.restore(remote, tmp_path / "fresh") == "step_0000003"


def complete_tags(s3: SeaweedS3, prefix: str) -> list[str]:
    """Tags the bucket holds complete at this moment: complete.json there, and every file it names."""
    listed = keys(s3, prefix)
    found = []
    for key in sorted(k for k in listed if k.endswith("/" + ckpt.COMPLETE_FILE)):
        tag = key.split("/")[1]
        try:
            record = json.loads(s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read())
        except Exception:  # noqa: BLE001 - deleted since the LIST (the bucket's retention)
            continue
        if all(f"checkpoints/{tag}/{name}" in listed for name in record["files"]):
            found.append(tag)
    return found


@pytest.fixture
def proxied(s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch):
    """The mirror's uploads through a fault proxy (its plan and throttle set by the test)."""
    from tests.integration.faults import FaultServer

    with FaultServer(upstream=s3.url) as proxy:
        monkeypatch.setattr(mirror, "_client", lambda: s3.client(endpoint=proxy.url, purpose="read"))  # (as mirror._client)
        yield proxy


def test_a_failed_upload_is_retried_and_only_a_current_failure_is_kept(proxied, s3: SeaweedS3,
                                                                       tmp_path: Path, capfd) -> None:
    """PUTs refused for a while with a 408 (a tag's file once, config.yaml twice after its complete.json): the
    tag goes up at later attempts, counted once, and nothing failed remains. A tag whose uploads keep failing
    past data.retry_time_s is given up, and its failure is the current one until the next tag goes up: then
    none is (the bucket holds the newer state). A 403 (a policy that denies the PUT) is not retried at all."""
    from pipeline.remote import RetryPolicy

    run = tmp_path / "run"
    m = mirror.Mirror(f"s3://{BUCKET}/retry", run, policy=RetryPolicy(backoff_s=0.05, total_s=1.5))
    refused = {"/step_0000001/": 1, "/config.yaml": 2}  # PUTs of a path holding KEY refused VALUE times
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text("{}")

    def plan(n: int, method: str, path: str) -> str | None:
        hit = next((k for k, left in refused.items() if k in path and left and method == "PUT"), None)
        if hit:
            refused[hit] -= 1
        return "408" if hit else None

    proxied.plan = plan
    m.tag(fake_tag(run, 1, mib=0))
    m.wait()
    said = capfd.readouterr().err
    assert m.mirrored == ["step_0000001"] and m.failure is None, said
    assert said.count("uploading step_0000001 failed: ") == 3 and said.count("(RequestTimeout)") == 3, said
    proxied.plan = lambda n, method, path: "408" if "step_0000002" in path else None
    m.tag(fake_tag(run, 2, mib=0))
    m.wait()
    assert m.mirrored == ["step_0000001"] and "uploading step_0000002 failed" in (m.failure or ""), m.failure
    assert "gave up after" in capfd.readouterr().err
    proxied.plan = lambda n, method, path: "403" if "step_0000003" in path else None
    puts = len(proxied.log)
    m.tag(fake_tag(run, 3, mib=0))
    m.wait()
    assert len(proxied.log) == puts + 1 and "uploading step_0000003 failed" in (m.failure or ""), proxied.log[puts:]
    said = capfd.readouterr().err
    assert "not retried: the store gives this answer (HTTP 403" in said and "; retry " not in said, said
    proxied.plan = lambda n, method, path: None
    m.tag(fake_tag(run, 4, mib=0))
    m.wait()
    assert m.mirrored == ["step_0000001", "step_0000004"] and m.failure is None, m.failure
    assert complete_tags(s3, "retry")[-1] == "step_0000004"


def test_the_last_tags_pruning_is_retried_until_the_bucket_keeps_what_the_run_keeps(proxied, s3: SeaweedS3,
                                                                                     tmp_path: Path, capfd) -> None:
    """A DELETE refused with a 408 when the last tag's retention runs in the bucket (a store just back from an outage):
    no newer tag will prune again, so the end of the run (its files' upload) retries it, and the bucket ends
    holding the run directory's tags only (before: the old tag stayed in the bucket for good)."""
    import shutil

    from pipeline.remote import RetryPolicy

    run = tmp_path / "run"
    m = mirror.Mirror(f"s3://{BUCKET}/prune", run, policy=RetryPolicy(backoff_s=0.05, total_s=30))
    m.tag(fake_tag(run, 10, mib=0))
    m.wait()
    refused = [2]  # the DELETEs of step 10 refused: at tag 20's pruning, then once more at the end's

    def plan(n: int, method: str, path: str) -> str | None:
        if method == "DELETE" and "/step_0000010/" in path and refused[0]:
            refused[0] -= 1
            return "408"
        return None

    proxied.plan = plan
    fake_tag(run, 20, mib=0)
    shutil.rmtree(ckpt.checkpoint_dir(run) / "step_0000010")  # the run directory's retention (keep_last=1)
    m.tag("step_0000020")
    m.files()
    m.wait()
    said = capfd.readouterr().err
    assert "pruning the bucket's tags older than step_0000020 failed" in said, said
    assert m.failure is None and refused == [0], (m.failure, refused)
    assert complete_tags(s3, "prune") == ["step_0000020"]
    assert not any(k.startswith("checkpoints/step_0000010/") for k in keys(s3, "prune")), keys(s3, "prune")


def test_a_bucket_that_refuses_every_delete_ends_the_run_at_once_with_one_warning(
        s3: SeaweedS3, tmp_path: Path, capfd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket policy without s3:DeleteObject (every DELETE answered 403), through the hooks the trainer calls
    (start, saved with the local retention at train.keep_last=1, final_files, drain, raise_unless_up): the
    pruning refused is said once and counted, never retried; the end waits for nothing but the uploads (before:
    the refusal retried for data.retry_time_s, then exit 1); the bucket holds the last tag and the run's files
    as the run directory does; the lock, whose DELETE is refused too, is left as an ended lease that the next
    start takes over at once (before: the next start refused for up to 10 minutes)."""
    from types import SimpleNamespace

    from pipeline.config import DataConfig
    from pipeline.train import remote_lock
    from tests.integration.faults import FaultServer

    with FaultServer(upstream=s3.url, plan=lambda n, method, path: "403" if method == "DELETE" else None) as proxy:
        monkeypatch.setattr(mirror, "_client", lambda: s3.client(endpoint=proxy.url, purpose="read"))  # (as mirror._client)
        monkeypatch.setattr(remote_lock, "client", lambda: s3.client(endpoint=proxy.url, purpose="write"))
        run, remote = tmp_path / "run", f"s3://{BUCKET}/worm"
        cfg = SimpleNamespace(run=SimpleNamespace(remote=remote), data=DataConfig(retry_time_s=120))
        mirror.start(cfg, run)
        for step in (1, 2, 3):
            tag = fake_tag(run, step, mib=0)
            ckpt.prune(ckpt.checkpoint_dir(run), keep_last=1, keep_every=0, current=tag, protect=mirror.protected(run))
            mirror.saved(run, tag)
            mirror._active[str(run.resolve())][1].wait()  # each tag up before the next save: the same tags pruned
        for name in mirror.RUN_FILES:
            (run / name).write_bytes(os.urandom(100))
        mirror.final_files(run)
        t0 = time.monotonic()
        prunes = mirror.metrics(run)["mirror/prunes_refused"]
        assert mirror.drain(run, timeout_s=60) is True
        mirror.raise_unless_up(run, True)  # the bucket holds the final state: no error
        ended = time.monotonic() - t0
        deletes = [r for r in proxy.log if r[1] == "DELETE"]
        nxt = mirror.RemoteLock(remote)
        nxt.take()  # the ended lease: at once
        nxt.release()
        with pytest.raises(Exception) as refused:  # what botocore raises for it: its modeled AccessDenied class
            s3.client(endpoint=proxy.url).delete_object(Bucket=BUCKET, Key="worm/lock.json")
    said = capfd.readouterr().err
    from pipeline.remote.s3 import refusal

    assert type(refused.value).__name__ == "AccessDenied" and refusal(refused.value) == "HTTP 403 AccessDenied"
    assert ended < 30 and said.count("pruning refused") == 1 and "; retry " not in said, (ended, said)
    assert prunes >= 1 and len(deletes) <= 5, (prunes, deletes)  # one refused DELETE per pruning and lock release
    last = ckpt.checkpoint_dir(run) / "step_0000003"
    assert ckpt.all_tags(run) == ["step_0000003"] and "step_0000003" in complete_tags(s3, "worm")
    for f in [*last.rglob("*"), *(run / n for n in mirror.RUN_FILES)]:
        if f.is_file() and f.name != ckpt.COMPLETE_FILE:
            key = f"worm/{f.relative_to(run).as_posix()}"
            assert s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read() == f.read_bytes(), key


def test_a_lock_json_that_is_not_a_lock_says_what_it_is_and_how_to_clear_it(s3: SeaweedS3) -> None:
    s3.client().put_object(Bucket=BUCKET, Key=f"broken/{mirror.LOCK_OBJECT}", Body=b'{"host": "a", "pid"')
    with pytest.raises(mirror.RemoteError) as e:
        mirror.RemoteLock(f"s3://{BUCKET}/broken").take()
    msg = str(e.value)
    assert "\n" not in msg and f"s3://{BUCKET}/broken/{mirror.LOCK_OBJECT} cannot be read as a lock" in msg, msg
    assert f"delete it (aws s3 rm s3://{BUCKET}/broken/{mirror.LOCK_OBJECT})" in msg, msg


def test_a_complete_json_claiming_more_bytes_than_its_object_is_refused_before_anything_is_allocated(
        s3: SeaweedS3, tmp_path: Path) -> None:
    """A record that claims 10^15 bytes for a file (before: a sparse file of that apparent size, then 'File too
    large' naming nothing): one line naming the file and both sizes; the run directory stays empty."""
    remote = f"s3://{BUCKET}/claims"
    m = mirror.Mirror(remote, tmp_path / "writer")
    m.tag(fake_tag(tmp_path / "writer", 4, mib=0))
    m.wait()
    key = f"claims/checkpoints/step_0000004/{ckpt.COMPLETE_FILE}"
    record = json.loads(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    record["files"]["zero/optim_states.pt"] = 10**15
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(record).encode())
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(mirror.RemoteError) as e:
        mirror.restore(remote, run)
    msg = str(e.value)
    assert "'zero/optim_states.pt' is 1000000000000000 bytes" in msg and "is 1004;" in msg and "\n" not in msg, msg
    assert list(run.iterdir()) == []


def test_on_a_slow_link_the_bucket_holds_a_complete_tag_from_the_first_on(proxied, s3: SeaweedS3,
                                                                          tmp_path: Path) -> None:
    """Uploads at 1 MiB/s, a 1 MiB tag saved every 0.3 s, train.keep_last=1: the tag being uploaded is kept
    locally (Mirror.protected), so the first tag goes up whole and from then on the bucket always holds a
    complete tag (without: each upload is pruned under it, and the bucket never holds one)."""
    proxied.throttle_bps = 1 << 20
    run = tmp_path / "run"
    m = mirror.Mirror(f"s3://{BUCKET}/slow", run)
    seen: list[list[str]] = []  # the bucket's complete tags after each save
    step = 0
    while sum(map(bool, seen)) < 3 and step < 40:  # on until 3 saves after the first tag is up (load-proof)
        step += 1
        tag = fake_tag(run, step)
        ckpt.prune(ckpt.checkpoint_dir(run), keep_last=1, keep_every=0, current=tag, protect=m.protected())
        m.tag(tag)
        assert len(ckpt.all_tags(run)) <= 2  # train.keep_last, and the tag being uploaded
        time.sleep(0.3)
        seen.append(complete_tags(s3, "slow"))
    m.wait()
    first = next((i for i, tags in enumerate(seen) if tags), len(seen))
    assert m.mirrored[0] == "step_0000001" and seen[first:] and all(seen[first:]), (seen, m.mirrored)


def end_lease(s3: SeaweedS3, key: str) -> None:
    """The lock object at `key` as a job killed more than its lease ago left it: its lease end in the past.
    (Not a short lease and a sleep: a PUT to the store took 5 s on the 2-core machine under load, longer
    than a 2 s test lease, which then ended before the lock was even taken.)"""
    record = json.loads(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps({**record, "expires": time.time() - 1}).encode())


def test_one_job_per_prefix_and_an_ended_lease_is_taken_over(s3: SeaweedS3) -> None:
    remote = f"s3://{BUCKET}/c"
    first = mirror.RemoteLock(remote, lease_s=60.0, renew_s=0.5)
    first.take()
    with pytest.raises(RunDirLocked, match=f"pid {os.getpid()}"):
        mirror.RemoteLock(remote).take()
    first._stop.set()  # a job killed without releasing: no renewals
    first._thread.join()
    end_lease(s3, f"c/{mirror.LOCK_OBJECT}")
    second = mirror.RemoteLock(remote, lease_s=60.0, renew_s=0.2)
    second.take()  # the ended lease, taken over
    third = mirror.RemoteLock(remote)
    with pytest.raises(RunDirLocked):
        third.take()
    second.release()
    third.take()
    third.release()


def test_a_requeue_of_the_same_slurm_job_takes_its_own_lock_over_at_once(s3: SeaweedS3, capfd,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease still running, held by this Slurm job's previous attempt (a requeue keeps SLURM_JOB_ID), is
    taken over at once; the same lease held by another job is refused."""
    remote = f"s3://{BUCKET}/g"
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    first = mirror.RemoteLock(remote)  # its 10-minute lease runs on
    first.take()
    first._stop.set()  # the previous attempt, killed without releasing: no renewals
    first._thread.join()
    monkeypatch.setenv("SLURM_JOB_ID", "778")
    with pytest.raises(RunDirLocked, match="Slurm job 777"):
        mirror.RemoteLock(remote).take()
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    t0 = time.monotonic()
    capfd.readouterr()
    requeued = mirror.RemoteLock(remote)
    requeued.take()
    assert time.monotonic() - t0 < 30  # at once: not the lease's 600 s
    said = capfd.readouterr().err  # the lease had not ended: the line says why it was taken
    assert "(an earlier attempt of this Slurm job, 777: a requeue takes its own lock at once)" in said, said
    holder = json.loads(s3.client().get_object(Bucket=BUCKET, Key=f"g/{mirror.LOCK_OBJECT}")["Body"].read())
    assert holder["slurm_job_id"] == "777" and holder["expires"] > time.time() + 500
    requeued.release()
    assert mirror.LOCK_OBJECT not in keys(s3, "g")


def test_a_job_that_lost_the_lock_stops_uploading(s3: SeaweedS3, tmp_path: Path, capfd) -> None:
    """A job whose renewals stalled (a frozen node) past its lease, which another job then took over,
    learns so at its next renewal (a conditional PUT that fails) and uploads nothing more: the prefix is
    the other job's now. Nor does it remove the other job's lock when it ends."""
    import threading

    remote = f"s3://{BUCKET}/h"
    run = tmp_path / "run"
    late = mirror.RemoteLock(remote, lease_s=60.0, renew_s=0.1)
    thawed = threading.Event()
    put = late._put
    late._put = lambda **condition: (thawed.wait() if "IfMatch" in condition else None, put(**condition))[1]
    late.take()  # its renewals now wait for `thawed`: the job is frozen as far as the lock goes
    m = mirror.Mirror(remote, run, lock=late)
    m.tag(fake_tag(run, 1, mib=0))
    m.wait()
    assert f"checkpoints/step_0000001/{ckpt.COMPLETE_FILE}" in keys(s3, "h")  # uploads while it holds the lock
    end_lease(s3, f"h/{mirror.LOCK_OBJECT}")  # frozen for longer than its lease
    other = mirror.RemoteLock(remote, lease_s=60.0, renew_s=30.0)
    other.take()
    thawed.set()
    deadline = time.monotonic() + 30
    while not late.lost and time.monotonic() < deadline:  # its pending renewal, at once
        time.sleep(0.05)
    assert late.lost, "the renewal after the takeover did not notice it"
    assert "lost the lock on s3://runs/h: another job took it over; this job's uploads stop" in capfd.readouterr().err
    (run / "config.yaml").write_text("run: {}\n")
    m.tag(fake_tag(run, 2, mib=0))
    m.files()
    m.wait()
    up = keys(s3, "h")
    assert not any(k.startswith("checkpoints/step_0000002/") for k in up) and "config.yaml" not in up, up
    late.release()  # leaves the other job's lock in place
    holder = json.loads(s3.client().get_object(Bucket=BUCKET, Key=f"h/{mirror.LOCK_OBJECT}")["Body"].read())
    assert holder["expires"] > time.time() + 30
    other.release()


def test_a_bucket_the_store_refuses_is_one_line_naming_run_remote(s3: SeaweedS3, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pipeline.config import DataConfig

    cfg = SimpleNamespace(run=SimpleNamespace(remote="s3://b/x"), data=DataConfig())  # a name S3 refuses
    with pytest.raises(mirror.RemoteError, match=r"^run.remote s3://b/x: cannot create x/lock.json: .*InvalidBucketName") as e:
        mirror.start(cfg, tmp_path / "run")
    assert "\n" not in str(e.value)


def test_drain_waits_in_rounds_then_releases_the_lock(s3: SeaweedS3, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted stop polls drain() (each round an all-reduce in the trainer): False while an upload
    runs, True once it is done, and only then is the remote lock gone."""
    from types import SimpleNamespace

    from pipeline.config import DataConfig

    run = tmp_path / "run"
    cfg = SimpleNamespace(run=SimpleNamespace(remote=f"s3://{BUCKET}/f"), data=DataConfig())
    mirror.start(cfg, run)
    real = mirror.Mirror._upload_tag
    monkeypatch.setattr(mirror.Mirror, "_upload_tag", lambda self, tag, done: (time.sleep(1.5), real(self, tag, done)))
    mirror.saved(run, fake_tag(run, 1, mib=0))
    assert mirror.drain(run, timeout_s=0.2) is False
    assert mirror.LOCK_OBJECT in keys(s3, "f")
    assert mirror.drain(run, timeout_s=30) is True
    up = keys(s3, "f")
    assert f"checkpoints/step_0000001/{ckpt.COMPLETE_FILE}" in up and mirror.LOCK_OBJECT not in up, up
    assert mirror.drain(run, timeout_s=0) is True  # nothing left: the trainer's next round ends the wait


KILLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from pipeline.train import mirror
    real = mirror._client

    class Killing:
        calls = 0
        def __getattr__(self, name):
            return getattr(real(), name)
        def upload_file(self, *a, **k):
            Killing.calls += 1
            if Killing.calls == 2:  # the tag's second file: SIGKILL, as an OOM killer or a node loss would
                os.kill(os.getpid(), signal.SIGKILL)
            return real().upload_file(*a, **k)

    mirror._client = lambda: Killing()
    m = mirror.Mirror(sys.argv[1], Path(sys.argv[2]))
    m.tag(sys.argv[3])
    m.wait()
""")


def test_an_upload_killed_halfway_never_looks_complete_and_restore_takes_the_previous(
        s3: SeaweedS3, tmp_path: Path) -> None:
    remote = f"s3://{BUCKET}/d"
    run = tmp_path / "run"
    m = mirror.Mirror(remote, run)
    m.tag(fake_tag(run, 100))
    m.wait()
    tag = fake_tag(run, 200, mib=4)
    p = subprocess.run([sys.executable, "-c", KILLER, remote, str(run), tag], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    up = keys(s3, "d")
    assert any(k.startswith("checkpoints/step_0000200/") for k in up), up  # it was killed mid-tag...
    assert f"checkpoints/step_0000200/{ckpt.COMPLETE_FILE}" not in up  # ...and the tag is not complete
    assert mirror.restore(remote, tmp_path / "fresh") == "step_0000100"


# Long enough for several of the uploader's attempts (waits 0.5-1, 1-2, 2-4 s from data.retry_backoff_s=1,
# jittered), each refused: the run must outlive the store's absence, not one blip that botocore's own retries
# absorb. (15 s until the suite's time was cut: the later attempts only waited longer.)
OUTAGE_S = 10


@contextlib.contextmanager
def outage_once_saved(s3: SeaweedS3, run_dir: Path, tag: str, seconds: float = OUTAGE_S):
    """Once `tag` is complete in `run_dir` (saved, its upload starting), stop the store (connections refused)
    for `seconds`, with the run's ranks held (SIGSTOP) until it is down: every upload after that tag's meets
    the outage, however fast the run ends (stopping the store takes up to 3 s). The time it stopped is
    appended to the list this yields."""
    import psutil

    ended, stopped = threading.Event(), []
    done = ckpt.checkpoint_dir(run_dir) / tag / ckpt.COMPLETE_FILE

    def ranks() -> list[psutil.Process]:  # torchrun's workers of this run (the agent's cmdline names it too)
        mine = [p for p in psutil.Process().children(recursive=True) if f"run.dir={run_dir}" in " ".join(p.cmdline())]
        agents = {p.pid for p in mine if "torchrun" in " ".join(p.cmdline()[:2])}
        return [p for p in mine if p.ppid() in agents]

    def outage() -> None:
        while not done.is_file():
            if ended.wait(0.02):
                return
        held = ranks()
        for p in held:
            p.suspend()
        try:
            s3.stop()
            stopped.append(time.monotonic())
        finally:
            for p in held:
                p.resume()
        try:
            time.sleep(seconds)
        finally:
            s3.start()

    thread = threading.Thread(target=outage)
    thread.start()
    try:
        yield stopped
    finally:
        ended.set()
        thread.join()


def assert_bucket_holds(s3: SeaweedS3, prefix: str, run_dir: Path, said: str = "") -> None:
    """The bucket holds exactly the run directory's tags, each file byte for byte (complete.json: its own
    files plus their digests), and the run's files (`said`: the run's output, shown on a failure)."""
    local = {f.relative_to(run_dir).as_posix() for f in (run_dir / "checkpoints").glob("step_*/**/*") if f.is_file()}
    local |= set(mirror.RUN_FILES)
    assert keys(s3, prefix) == local, (sorted(keys(s3, prefix) ^ local), said[-4000:])
    for name in local:
        got = s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read()
        if name.endswith(ckpt.COMPLETE_FILE):
            assert json.loads(got)["files"] == json.loads((run_dir / name).read_text())["files"], name
        else:
            assert got == (run_dir / name).read_bytes(), name


@pytest.mark.dist
def test_a_stopped_run_whose_run_dir_is_lost_resumes_from_the_bucket_through_an_outage(s3: SeaweedS3, shards,
                                                                                        supervised_reference,
                                                                                        tmp_path: Path) -> None:
    """Stopped with SIGUSR1, its run directory deleted, started again: restored from the bucket, the
    uninterrupted run's weights (the session's `supervised_reference`). The store is stopped (connections
    refused) for OUTAGE_S (10 s) once the resumed run's first tag is saved: the uploads retry through it, the
    run exits 0 with no traceback on either rank, and the bucket ends holding exactly the run directory
    (before: exit 1 with the first upload error)."""
    import shutil

    from tests.integration.runs import assert_same_weights, run, run_and_signal, supervised, weights

    config = "configs/pretrain/demo.yaml"

    def args(run_dir: Path, remote: str) -> list[str]:
        return [*supervised(shards, run_dir, 1), f"run.remote={remote}"]

    ref_dir, _ = supervised_reference
    remote = f"s3://{BUCKET}/e2e"
    run_dir = tmp_path / "run"
    code, out = run_and_signal("pretrain.py", config, args(run_dir, remote), when="step 4/24",
                               launcher="deepspeed")
    assert code == 75, out[-3000:]
    stopped = (run_dir / "checkpoints" / "latest").read_text().strip()
    # the stop waited for its checkpoint's upload, and released the lock
    up = keys(s3, "e2e")
    assert f"checkpoints/{stopped}/{ckpt.COMPLETE_FILE}" in up and mirror.LOCK_OBJECT not in up, (up, out[-3000:])
    shutil.rmtree(run_dir)  # a fresh node
    with outage_once_saved(s3, run_dir, "step_0000016") as outage:
        resumed = run("pretrain.py", config, args(run_dir, remote))
    said = resumed.stdout + resumed.stderr
    assert outage and resumed.returncode == 0 and "Traceback" not in said, said[-4000:]
    assert f"restored {stopped} from {remote}" in resumed.stderr and "resumed from" in resumed.stdout
    assert "retry 2 in" in resumed.stderr, resumed.stderr[-3000:]  # the outage was met (attempts refused), and outlived
    assert_same_weights(weights(ref_dir), weights(run_dir))
    assert_bucket_holds(s3, "e2e", run_dir, said)  # no lock.json either: released


@pytest.mark.dist
def test_mlflow_with_its_artifact_root_in_the_bucket(s3: SeaweedS3, shards, tmp_path: Path) -> None:
    """MLflow's artifacts on s3:// (an experiment whose artifact location is in the bucket; the client
    reaches the store through MLFLOW_S3_ENDPOINT_URL and the AWS variables): the run's weights and config
    land in the bucket and MLflow lists them."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import recorded_run_id
    from tests.integration.runs import TINY, run

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store)
    client.create_experiment("bucket-artifacts", artifact_location=f"s3://{BUCKET}/mlflow")
    run_dir = tmp_path / "run"
    out = run("pretrain.py", "configs/pretrain/demo.yaml",
              [*TINY, f"data.path={shards}", f"run.dir={run_dir}", "train.steps=4", "train.eval_every=0",
               "tracking.enabled=true", "tracking.experiment=bucket-artifacts", "tracking.system_metrics=false"],
              ranks=1, extra_env={"MLFLOW_TRACKING_URI": store, "MLFLOW_S3_ENDPOINT_URL": s3.url})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_id = recorded_run_id(run_dir, store)
    listed = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.safetensors", "config.yaml"} <= listed, listed
    in_bucket = keys(s3, "mlflow")
    assert any(k.endswith(f"{run_id}/artifacts/model.safetensors") for k in in_bucket), in_bucket
