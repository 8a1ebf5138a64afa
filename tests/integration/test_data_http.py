"""Data at cluster scale, end to end: train shards over HTTP on 2 nodes fetch each shard once, and train
the same weights as 1 node x 2 ranks from local disk (issue 17's Done-when)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.integration.runs import (
    ROOT,
    TINY,
    assert_same_weights,
    env,
    free_port,
    make_synthetic_shards,
    weights,
)

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


class CountingServer(ThreadingHTTPServer):
    """Serves a folder; `sent` counts the body bytes of every response."""

    daemon_threads = True

    def __init__(self, folder: Path):
        self.sent = 0
        self.lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(folder), **k)

            def copyfile(self, source, outputfile):  # the body: count what goes out
                while chunk := source.read(1 << 16):
                    outputfile.write(chunk)
                    with server.lock:
                        server.sent += len(chunk)

            def log_message(self, *a):  # quiet
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # 256 train samples in 8 shards of 32: 8 partitions, 4 per node on 2 nodes.
    return make_synthetic_shards(tmp_path_factory.mktemp("data") / "synthetic", samples=320, per_shard=32)


def overrides(data: Path, run_dir: Path, cache: Path) -> list[str]:
    return [*TINY, f"data.path={data}", f"run.dir={run_dir}", f"data.cache_dir={cache}", "train.steps=16",
            "train.global_batch_size=16", "train.micro_batch_size=8", "deepspeed.bf16=false",
            "deepspeed.zero_stage=1", "train.grad_clip=0", "train.eval_every=0", "train.ckpt_every=0"]


def torchrun(nnodes: int, node_rank: int, nproc: int, port: int, args: list[str]) -> subprocess.Popen:
    argv = [TORCHRUN, "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(ROOT / "launch/pretrain.py"),
            "--config", CONFIG, *args]
    return subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 900) -> None:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def test_two_nodes_fetch_each_http_shard_once_and_train_the_one_node_weights(shards: Path, tmp_path: Path) -> None:
    server = CountingServer(shards)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        info = json.loads((shards / "dataset.json").read_text())
        train = info["splits"]["train"]["shards"]
        assert len(train) == 8 and {s["num_samples"] for s in train} == {32}
        train_bytes = sum(s["bytes"] for s in train)
        for s in train:  # over HTTP; val stays on local disk
            s["name"] = f"http://127.0.0.1:{server.server_address[1]}/{s['name']}"
        for s in info["splits"]["val"]["shards"]:
            s["name"] = str(shards / s["name"])
        remote = tmp_path / "remote"
        remote.mkdir()
        (remote / "dataset.json").write_text(json.dumps(info))

        port = free_port()
        finish([torchrun(2, i, 1, port, overrides(remote, tmp_path / "two_nodes", tmp_path / f"cache{i}"))
                for i in range(2)])
        fetched = server.sent
        finish([torchrun(1, 0, 2, free_port(), overrides(shards, tmp_path / "one_node", tmp_path / "cache_local"))])
        assert server.sent == fetched  # the local run read nothing over HTTP
    finally:
        server.shutdown()
    print(f"2 nodes fetched {fetched} bytes over HTTP for {train_bytes} bytes of train shards "
          f"({fetched / train_bytes:.3f}x)")
    assert train_bytes <= fetched <= 1.05 * train_bytes
    # each node's cache holds its own 4 shards (partitions 0-3 on node 0, 4-7 on node 1), nothing else
    copies = [sorted(p.name for p in (tmp_path / f"cache{i}").glob("*.tar")) for i in range(2)]
    assert [len(c) for c in copies] == [4, 4] and not set(copies[0]) & set(copies[1])
    # the same samples on the same ranks, one epoch (16 steps of 16): bit-identical weights in fp32
    assert_same_weights(weights(tmp_path / "two_nodes"), weights(tmp_path / "one_node"))
