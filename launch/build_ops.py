"""Build DeepSpeed's C++ ops for this machine ahead of the first run: `python launch/build_ops.py`.

DeepSpeed JIT-builds them on first use into TORCH_EXTENSIONS_DIR (the Makefile points it into
.venv): CPU Adam for ZeRO-Offload (43 s on 2 idle cores) and, on a CPU-only machine, the
shared-memory all-reduce (24 s). `make venv` runs this once, so a compiler problem shows (as a
warning) at install time and no training or test run pays for (or is killed in the middle of) a
build, which would leave a lock file that every later run waits on. Equivalent to DeepSpeed's `DS_BUILD_CPU_ADAM=1 pip install`.
"""

import argparse
import time

from deepspeed.accelerator import get_accelerator

USED_BY = {"CPUAdamBuilder": "deepspeed.offload_optimizer=true",
           "ShareMemCommBuilder": "every CPU run under the deepspeed launcher"}


def main() -> None:
    accel = get_accelerator()
    names = ["CPUAdamBuilder"] + (["ShareMemCommBuilder"] if accel.device_name() == "cpu" else [])
    for name in names:
        t0 = time.perf_counter()
        builder = accel.create_op_builder(name)
        if builder is None:
            print(f"build_ops: {name}: not available for accelerator {accel.device_name()!r}, skipped")
            continue
        try:
            builder.load(verbose=False)
        except Exception as e:  # a compiler problem: say so, keep the install (runs without the op still work)
            print(f"build_ops: WARNING: building {builder.NAME} failed ({type(e).__name__}: {e}); DeepSpeed "
                  f"will try again where it is used ({USED_BY[name]}) and fail the same way")
            continue
        print(f"build_ops: {builder.NAME} ready ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
