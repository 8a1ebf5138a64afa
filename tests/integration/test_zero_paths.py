"""The ZeRO paths a cluster run takes: optimizer offload (stages 1-3) and parameter offload (stage 3).

ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's CPU Adam (JIT-built into
TORCH_EXTENSIONS_DIR on first use: minutes on a loaded 2-core machine, hence the timeouts). Each path
trains a few fp32 steps on one rank and must end where plain ZeRO-1 with torch's AdamW ends.
"""

import pytest

from tests.integration.runs import TINY, run_here, weights

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/demo.yaml"


def few_steps(shards, run_dir, *extra):
    return [*TINY, f"data.path={shards}", f"run.dir={run_dir}", "deepspeed.bf16=false", "train.steps=4",
            "train.ckpt_every=0", "train.eval_every=0", "train.log_every=1", *extra]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("zero1")
    out = run_here("pretrain.py", CONFIG, few_steps(shards, run_dir, "deepspeed.zero_stage=1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return weights(run_dir)


@pytest.mark.parametrize("stage, params", [(1, False), (2, False), (3, False), (3, True)])
def test_offload_trains_like_zero1(shards, reference, tmp_path, stage, params):
    extra = [f"deepspeed.zero_stage={stage}", "deepspeed.offload_optimizer=true", f"deepspeed.offload_params={params}"]
    out = run_here("pretrain.py", CONFIG, few_steps(shards, tmp_path, *extra))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = weights(tmp_path)
    diff = max((got[k] - reference[k]).abs().max().item() for k in reference)
    assert diff < 1e-4, f"offload at ZeRO-{stage} ends {diff:.2e} away from ZeRO-1"
