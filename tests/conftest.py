import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Keep DeepSpeed from probing for accelerators and compilers it will not find on a CPU box.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds CPU Adam (ZeRO-Offload) into this cache: one per checkout, as the Makefile sets it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
