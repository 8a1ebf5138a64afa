"""The Docker image, built from docker/Dockerfile and trained in: `bash docker/build_cpu_image.sh`, then
shards and a 20-step 2-rank DeepSpeed run inside the image, as its unprivileged user.

No Docker engine or registry here: buildah builds the real Dockerfile on a debootstrapped CPU base
(docker/cpu-base.Dockerfile, torch as constraints.txt pins it) and `buildah run --isolation chroot`
runs commands in the image's file system (`podman run` cannot start a container in this sandbox).
Skips with one line where buildah, podman or debootstrap are missing (tests/container/install_podman.sh,
called by `make test`, installs them as root). Cold, about 30 minutes on 2 busy cores (debootstrap, a
CUDA torch from PyPI, the dependencies, DeepSpeed's JIT op); with only code changed, about 4 minutes
(the COPY layers and the run). Measurements: docker/README.md.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest

from pipeline.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/vit-pipeline:cpu"
BASE_IMAGE = "localhost/vit-pipeline-base:cpu"
WORKDIR = "workspace/vit-pipeline"   # the Dockerfile's WORKDIR, relative to the image's root
USER_UID = 1000                      # the Dockerfile's default USER_UID
RUN_DIR = "runs/demo-pretrain"       # configs/pretrain/demo.yaml's run.dir
WORK = Path(os.environ.get("VIT_PIPELINE_IMAGE_WORK", "/var/tmp/vit-pipeline-image"))  # build_cpu_image.sh's
EXTENSIONS = "/tmp/torch_extensions"  # where the test mounts a host cache of DeepSpeed's JIT-built ops


def _missing_tools() -> list[str]:
    return [t for t in ("buildah", "podman", "debootstrap")
            if not shutil.which(t) and not os.access(f"/usr/sbin/{t}", os.X_OK)]


if os.geteuid() != 0 or _missing_tools():
    why = f"missing {' '.join(_missing_tools())}" if _missing_tools() else "not root"
    if os.environ.get("VIT_PIPELINE_REQUIRE_IMAGE") == "1":
        raise RuntimeError(f"image test: {why} (VIT_PIPELINE_REQUIRE_IMAGE=1)")
    pytest.skip(f"image test: {why} (bash tests/container/install_podman.sh installs buildah, podman, "
                "debootstrap as root)", allow_module_level=True)

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:4])} ... exited {proc.returncode}\n"
                    f"--- stdout (tail)\n{proc.stdout[-6000:]}\n--- stderr (tail)\n{proc.stderr[-6000:]}")
    return proc


class Container:
    """A working container of an image (`buildah from`): commands run in it, its files read from the host."""

    def __init__(self, image: str, volumes: tuple[str, ...] = ()):
        self.name = f"vit-pipeline-test-{uuid.uuid4().hex[:8]}"
        self.volumes = [arg for v in volumes for arg in ("-v", v)]
        _run(["buildah", "from", "--name", self.name, image], timeout=300)
        self.root = Path(_run(["buildah", "mount", self.name], timeout=60).stdout.strip())

    def sh(self, script: str, timeout: float = 600) -> str:
        """Run `bash -c script` in the container as the image's user, in its WORKDIR, with its ENV."""
        return _run(["buildah", "run", "--isolation", "chroot", *self.volumes, self.name, "--", "bash", "-c", script],
                    timeout=timeout).stdout

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.name], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def image() -> str:
    """Build (or, from buildah's layer cache, rebuild what changed) the image; the build's timings go to the log."""
    proc = _run(["bash", str(ROOT / "docker" / "build_cpu_image.sh")], timeout=3000, cwd=ROOT)
    print(proc.stderr)
    return IMAGE


def _extensions_cache() -> str:
    """A host directory for the image user's torch extensions: DeepSpeed JIT-compiles its CPU all-reduce
    at the first 2-rank run (25 s on idle cores, minutes on busy ones); this test's first run on a new
    base compiles it, later runs reuse it. Keyed by the base image and DeepSpeed's version."""
    base_id = _run(["podman", "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE], timeout=60).stdout.strip()
    ds = [line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
          if line.startswith("deepspeed==")][0]
    cache = WORK / "torch_extensions" / f"{base_id[:12]}-ds{ds}"
    cache.mkdir(parents=True, exist_ok=True)
    os.chown(cache, USER_UID, USER_UID)
    return f"{cache}:{EXTENSIONS}"


@pytest.fixture(scope="module")
def container(image):
    box = Container(image, volumes=(_extensions_cache(),))
    yield box
    box.remove()


def test_image_keeps_the_base_torch(image, container):
    """docker/Dockerfile installs everything with `-c constraints.txt` against the base's torch: pip
    must keep that torch (one torch, the base's file), not download a second one."""
    def torch_listed(box: Container) -> list[dict]:
        listed = json.loads(box.sh("python -m pip list --format=json 2>/dev/null"))
        return [p for p in listed if p["name"].lower() == "torch"]

    torches = torch_listed(container)
    assert len(torches) == 1, torches
    base = Container(BASE_IMAGE)
    try:
        base_torches = torch_listed(base)
        version, base_version = (box.sh("python -c 'import torch; print(torch.__version__)'").strip()
                                 for box in (container, base))
        site = container.sh("python -c 'import torch, os; print(os.path.dirname(torch.__file__))'").strip()
        base_site = base.sh("python -c 'import torch, os; print(os.path.dirname(torch.__file__))'").strip()
        assert site == base_site, (site, base_site)
        # A reinstall of the same version would write the files again, in the dependency layer.
        for rel in ("__init__.py", "version.py", "lib/libtorch_cpu.so"):
            ours, theirs = (r / site.lstrip("/") / rel for r in (container.root, base.root))
            assert ours.stat().st_mtime_ns == theirs.stat().st_mtime_ns, f"torch/{rel} rewritten on top of the base"
    finally:
        base.remove()
    assert torches == base_torches and version == base_version, (torches, base_torches, version, base_version)
    pinned = [line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line.startswith("torch==")]
    assert base_version.split("+")[0] == pinned[0], (base_version, pinned)


def test_demo_trains_inside_the_image(image, container):
    """Shards and a 20-step 2-rank pretraining run under the image's entry point, as the image's user,
    with the image's Python, write the run directory and the MLflow store inside the image's WORKDIR."""
    out = container.sh("id -u; pwd; command -v python deepspeed")
    who = out.split()
    assert len(who) == 4, f"unexpected output: {out!r}"
    assert who[0] == str(USER_UID), f"runs as uid {who[0]}, not the image's unprivileged user"
    assert who[1] == f"/{WORKDIR}", who
    assert who[2] == who[3].rsplit("/", 1)[0] + "/python" and not who[2].startswith(f"/{WORKDIR}"), who

    container.sh("python launch/make_shards.py --source digits --out data/digits --no-progress")
    # Through the image's entry point, as `docker run IMAGE deepspeed ...` starts it (buildah run does not).
    entrypoint = json.loads(_run(["podman", "image", "inspect", "--format", "{{json .Config.Entrypoint}}", image],
                                 timeout=60).stdout)
    assert entrypoint == ["python", "-m", "pipeline.supervise"], entrypoint
    out = container.sh(f"export TORCH_EXTENSIONS_DIR={EXTENSIONS}; OMP_NUM_THREADS=1 {shlex.join(entrypoint)} "
                       f"deepspeed --num_gpus 2 --master_port {free_port()} "
                       "launch/pretrain.py --config configs/pretrain/demo.yaml train.steps=20 2>&1",
                       timeout=900)
    (WORK / "test-run.log").write_text(out)   # the run's output, for a look afterwards

    work = container.root / WORKDIR
    run = work / RUN_DIR
    assert (work / "data/digits/dataset.json").is_file()
    for name in ("config.yaml", "model.safetensors", "metrics.jsonl", "checkpoints/latest"):
        assert (run / name).is_file(), f"{RUN_DIR}/{name} missing; run output tail:\n{out[-3000:]}"
        assert (run / name).stat().st_uid == USER_UID, f"{name} not written by the image's user"
    assert (run / "model.safetensors").stat().st_size > 100_000
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 20, steps

    db = work / "mlflow.db"
    assert db.is_file(), f"no MLflow store in the image's WORKDIR; run output tail:\n{out[-3000:]}"
    with sqlite3.connect(db) as con:
        runs = con.execute("SELECT run_uuid, status FROM runs").fetchall()
        assert [status for _, status in runs] == ["FINISHED"], runs
        logged = con.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (runs[0][0],)).fetchone()[0]
    assert logged > 0
    assert any((work / "mlruns").rglob("config.yaml")), "MLflow artifacts (the run's config) missing"


MOUNTED_CHECKOUT = """
import runpy, sys
sys.argv = ["launch/make_shards.py", "--source", "synthetic", "--out", "/tmp/shards", "--num-samples", "64",
            "--num-classes", "4", "--size", "16", "--no-progress"]
try:
    runpy.run_path("launch/make_shards.py", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print(sys.executable, sys.modules["pipeline.data.shards"].__file__)
"""


def test_image_python_runs_a_mounted_checkout(image):
    """enroot/pyxis (--container-mounts=$PWD:$PWD --container-workdir=$PWD, as the calling user) and
    Apptainer run the image's Python on the submitted checkout (docker/README.md): launch/*.py must
    import that checkout's pipeline, not the copy in the image."""
    owner = ROOT.stat()
    box = Container(image, volumes=(f"{ROOT}:{ROOT}:ro",))
    try:
        out = _run(["buildah", "run", "--isolation", "chroot", "--user", f"{owner.st_uid}:{owner.st_gid}",
                    "--workingdir", str(ROOT), *box.volumes, box.name, "--", "python", "-c", MOUNTED_CHECKOUT],
                   timeout=600).stdout
        assert (box.root / "tmp/shards/dataset.json").is_file(), out
    finally:
        box.remove()
    python, module = out.split()[-2:]
    assert python == "/opt/venv/bin/python", python   # the image's (docker/cpu-base.Dockerfile's venv)
    assert module == str(ROOT / "pipeline/data/shards.py"), module
