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

