"""torch.compile (train.compile) changes how the model is computed, so its numerics are tested here:
the compiled ViT gives eager's logits and gradients, and DeepSpeed's engine.compile() (what the
trainer calls) trains like the eager engine at ZeRO-0 and ZeRO-1 on CPU.

Inductor compiles C++ kernels on CPU: the first run of this file takes ~30-70 s on 2 cores (later runs
hit torch's compile cache and take seconds).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.vit import build_vit

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)


@pytest.mark.slow
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_compiled_vit_matches_eager_logits_and_gradients(device: str):
    torch.manual_seed(0)
    eager = build_vit("vit_ti16", **TINY).train().to(device)
    # fullgraph: no graph breaks, so on a GPU the whole forward and backward are Inductor kernels.
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
    x, y = torch.randn(4, 3, 32, 32, device=device), torch.randint(0, 10, (4,), device=device)
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start on a small box
        out_c = compiled(x)
        F.cross_entropy(out_c, y).backward()
    out_e = eager(x)
    F.cross_entropy(out_e, y).backward()
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-4)
    compiled_params = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        q = compiled_params["_orig_mod." + name] if "_orig_mod." + name in compiled_params else compiled_params[name]
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(out_c, torch.zeros_like(out_c))


ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, ".")
    from benchmarks.common import BenchSpec, synthetic_batch
    from benchmarks.engine import build_engine, init_single_process
    from pipeline.objectives.supervised.objective import loss_fn
    init_single_process()
    tiny = ["model.patch_size=8", "model.embed_dim=64", "model.depth=2", "model.num_heads=2"]
    out = {}
    for stage in (0, 1):
        for compiled in (False, True):
            spec = BenchSpec("vit_ti16", 32, 4, "fp32", compile=compiled, num_classes=10)
            engine = build_engine(spec, stage, tiny)
            x, y = synthetic_batch(spec, torch.device("cpu"))
            losses = []
            for _ in range(3):
                loss = loss_fn(engine(x).float(), y, 0.0)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[f"zero{stage}_{'compiled' if compiled else 'eager'}"] = losses
            out[f"zero{stage}_{'compiled' if compiled else 'eager'}_flag"] = bool(getattr(engine, "is_compiled", False))
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_deepspeed_engine_compile_trains_like_eager_at_zero0_and_zero1():
    # A process group of its own, in a child process: the test process stays un-initialised.
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    for stage in (0, 1):
        assert out[f"zero{stage}_compiled_flag"] and not out[f"zero{stage}_eager_flag"]
        eager, compiled = out[f"zero{stage}_eager"], out[f"zero{stage}_compiled"]
        assert eager[-1] < eager[0]  # it trains
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=1e-4, rtol=1e-4)
