import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Keep DeepSpeed from probing for accelerators and compilers it will not find on a CPU box.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds CPU Adam (ZeRO-Offload) into this cache: one per checkout, as the Makefile sets it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))

# Markers whose tests share one machine-wide resource and so must run in one pytest-xdist worker:
# the local Slurm cluster (one slurmctld, fixed node names) and the image build (one buildah store).
_ONE_WORKER_MARKERS = ("slurm", "container")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` (make test), keep each shared resource in one worker.

    Session fixtures are per worker under xdist: two workers would each start a Slurm cluster on the
    same ports, or build the image into the same store. A group sends all of its tests to one worker,
    which starts the resource once. Without xdist the mark does nothing.
    """
    for item in items:
        for name in _ONE_WORKER_MARKERS:
            if item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.xdist_group(name))
                break

@pytest.fixture(autouse=True)
def _no_leftover_shm_buffers():
    """Remove DeepSpeed CPU all-reduce buffers a test's runs left behind (69 MB of RAM per rank each).

    pipeline.dist unlinks them once every rank has mapped them; a rank killed before that point
    (a timeout, a signal during startup) leaves its file, and a few hundred of those fill the machine.
    Only files no live process maps are removed: a new file may belong to another job on this machine
    that is still starting (its peers wait for the file; deleting it would hang them).
    """
    from tests.integration.runs import leaked_shm_buffers, shm_buffers

    before = shm_buffers()
    yield
    for path in leaked_shm_buffers(before):
        Path(path).unlink(missing_ok=True)


def pytest_collection_finish(session):
    """In an xdist worker under --dist loadgroup: stop at once if the groups did not take. pytest-xdist marks a
    grouped test by appending @GROUP to its node id, which pytest 9.2 ignores (pytest-dev/pytest-xdist#1386):
    the tests would then run spread over the workers, two Slurm clusters and two image builds at a time."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:  # printed here: xdist reports a worker's exception as an INTERNALERROR without its message
        message = (f"pytest-xdist's --dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}) with pytest "
                   f"{pytest.__version__}: install the pytest of constraints.txt")
        print(f"\nERROR: {message}", file=sys.stderr, flush=True)
        raise pytest.UsageError(message)
