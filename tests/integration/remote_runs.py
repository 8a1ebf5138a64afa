"""What the remote-data tests share (test_data_http.py, test_data_s3.py): the tiny run's overrides, torchrun
launches, the one local-disk reference run, and the check that a node cache holds only good copies.

A helper module rather than fixtures in a test module: pytest imports each test module under its own
name, so state kept in one (the reference weights) is not seen by another that imports it again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.runs import ROOT, TINY, WORKERS, env, free_port, weights

CONFIG = "configs/pretrain/demo.yaml"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def overrides(data: Path | str, run_dir: Path, cache: Path) -> list[str]:
    """One epoch (16 steps of 16) of the 256 train samples, fp32 and no clipping: bit-comparable weights."""
    return [*TINY, WORKERS, f"data.path={data}", f"run.dir={run_dir}", f"data.cache_dir={cache}", "train.steps=16",
            "train.global_batch_size=16", "train.micro_batch_size=8", "deepspeed.bf16=false",
            "deepspeed.zero_stage=1", "train.grad_clip=0", "train.eval_every=0", "train.ckpt_every=0"]


def torchrun(nnodes: int, node_rank: int, nproc: int, port: int, args: list[str],
             extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [TORCHRUN, "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(ROOT / "launch/pretrain.py"),
            "--config", CONFIG, *args]
    return subprocess.Popen(argv, cwd=ROOT, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


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


_LOCAL: dict[str, dict] = {}  # the one local run of the session (see reference_weights)


def reference_weights(shards: Path, tmp_path_factory) -> dict:
    """1 node x 2 ranks from local disk: the weights every remote run must end with. make_shards writes
    the same synthetic shards byte for byte wherever it writes them, so one run serves every module."""
    if "weights" not in _LOCAL:
        out = tmp_path_factory.mktemp("local")
        finish([torchrun(1, 0, 2, free_port(), overrides(shards, out / "one_node", out / "cache_local"))])
        _LOCAL["weights"] = weights(out / "one_node")
    return _LOCAL["weights"]


def remote_dataset(shards: Path, base_url: str, out: Path) -> Path:
    """A dataset.json in `out` naming the train shards at `base_url` (val stays on local disk)."""
    info = json.loads((shards / "dataset.json").read_text())
    for s in info["splits"]["train"]["shards"]:
        s["name"] = f"{base_url}/{s['name']}"
    for s in info["splits"]["val"]["shards"]:
        s["name"] = str(shards / s["name"])
    out.mkdir()
    (out / "dataset.json").write_text(json.dumps(info))
    return out


def assert_cache_holds_only_good_copies(cache: Path, shards: Path, base_url: str) -> None:
    from pipeline.data.cache import cache_name

    names = {cache_name(f"{base_url}/{p.name}"): p for p in shards.glob("*.tar")}
    for copy in cache.glob("*.tar"):
        assert copy.read_bytes() == names[copy.name].read_bytes(), f"bad copy of {names[copy.name]} in the cache"
    assert not [p for p in cache.iterdir() if ".tmp" in p.name or p.suffix == ".raw"]
