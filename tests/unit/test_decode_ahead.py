"""data.decode_device=cuda with the next micro batch's decode started as this one is handed out (pipeline/data/
decode_ahead.py), run with the decoder on the CPU: the same pixels, the same position and counts at every step
boundary, and a seek or resume that drops the batch taken ahead, as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.data import build_train_loader
from tests.unit import test_gpu_decode
from tests.unit.test_gpu_decode import IMG, cfg_for

jpegs = test_gpu_decode.jpegs  # the GPU-decode tests' shards fixture, shared


def loader_for(path: Path, ahead: bool, **kw):
    loader = build_train_loader(cfg_for(path, decode_device="cuda", **kw), IMG, 6, seed=2)
    loader.decode_ahead_on = torch.device("cpu") if ahead else None
    return loader


def batches(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor, int, bool]]:
    """n micro batches on the device, each with the loader's position after it and whether it came decoded."""
    out, it = [], iter(loader)
    for _ in range(n):
        raw, targets = next(it)
        came_decoded = "decoded" in raw
        x, y = loader.to_device(raw, targets, "cpu")
        out.append((x, y, loader.position, came_decoded))
    return out


@pytest.mark.parametrize("mixup", [False, True])
def test_decoding_ahead_hands_out_the_same_batches_and_positions(jpegs: Path, mixup: bool) -> None:
    kw = dict(mixup=0.8, cutmix=1.0) if mixup else {}
    plain, ahead = batches(loader_for(jpegs, False, **kw), 6), batches(loader_for(jpegs, True, **kw), 6)
    for (xa, ya, pa, da), (xb, yb, pb, _) in zip(plain, ahead):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and pa == pb
        assert not da
    # The first batch is decoded when moved to the device; every later one was started a batch ahead.
    assert [d for *_, d in ahead] == [False] + [True] * 5


def test_a_checkpoint_between_taking_ahead_and_handing_out_resumes_exactly(jpegs: Path) -> None:
    full = batches(loader_for(jpegs, False), 7)
    first = loader_for(jpegs, True)
    head = batches(first, 3)  # the 4th micro batch is taken ahead now, not handed out
    state = first.state_dict()
    assert state["position"] == 3 * 6  # what was handed out, not what was taken
    first.seek_step(3)  # the trainer's seek at the step boundary: a no-op, the batch taken ahead stays
    more = batches(first, 1)
    second = loader_for(jpegs, True)
    second.load_state_dict(state)  # a resume: starts at the position, nothing taken ahead
    tail = batches(second, 4)
    for (xa, ya, *_), (xb, yb, *_) in zip(full, head + tail):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(more[0][0], full[3][0])
