"""Errors an operator can cause: one line, exit 2 (usage) or 1, nothing half-done left behind."""

import socket
import subprocess

import pytest
import yaml

from pipeline.config import save_config
from pipeline.objectives import load_config
from tests.integration.runs import DEEPSPEED, ROOT, TINY, env, run_here

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"
FT_CONFIG = "configs/finetune/demo.yaml"


def one_line_error(out) -> str:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def test_an_unknown_variant_is_one_line_before_distributed_init(shards, tmp_path):
    run_dir = tmp_path / "run"
    out = run_here("pretrain.py", CONFIG, [*TINY, f"data.path={shards}", f"run.dir={run_dir}", "model.variant=vit_x99"])
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    line = one_line_error(out)
    assert "model.variant='vit_x99'" in line and "vit_b16" in line and "vit_h14" in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize("name", ["weights.safetensors", "weights.pth"])
def test_from_a_text_file_says_what_the_file_is(shards, tmp_path, name):
    fake = tmp_path / name
    fake.write_text("model weights are on the shared drive\n")
    run_dir = tmp_path / "run"
    out = run_here("finetune.py", FT_CONFIG, [*TINY, f"data.path={shards}", f"run.dir={run_dir}"],
                   extra=["--from", str(fake), "--res", "16"])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # a source that cannot be used, as every launcher
    line = one_line_error(out)
    assert f"--from '{fake}' is not a weights file: it is a text file" in line, line
    assert "run code" not in line
    assert not run_dir.exists()


def test_an_architecture_override_the_source_decides_is_refused(shards, tmp_path):
    source = tmp_path / "pretrained"
    source.mkdir()
    save_config(load_config(ROOT / CONFIG, [*TINY, f"data.path={shards}"]), source / "config.yaml")
    (source / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # never read: refused first
    out = run_here("finetune.py", FT_CONFIG, [*TINY, f"data.path={shards}", f"run.dir={tmp_path / 'ft'}",
                                              "model.embed_dim=96"], extra=["--from", str(source)])
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    line = one_line_error(out)
    assert "model.embed_dim=96 on the command line" in line and "model.embed_dim=32" in line, line
    assert yaml.safe_load((source / "config.yaml").read_text())["model"]["embed_dim"] == 32


def test_a_taken_master_port_names_master_port(shards, tmp_path):
    with socket.socket() as taken:  # another job's rendezvous store
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), str(ROOT / "launch/pretrain.py"),
                "--config", CONFIG, *TINY, f"data.path={shards}", f"run.dir={tmp_path / 'run'}"]
        out = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors and f"port {port}" in errors[0] and "--master_port" in errors[0], out.stderr[-3000:]
    assert "EADDRINUSE" not in out.stderr and "DistNetworkError" not in out.stderr
