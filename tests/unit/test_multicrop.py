"""pipeline.data.multicrop: a sample's crops and iBOT mask come from its own seed only, so they are the same
in another process (another layout, another worker count) and whatever ran before; other seeds differ."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.multicrop import MultiCrop, MultiCropConfig, block_mask

CFG = MultiCropConfig(global_crops_size=56, local_crops_size=28, local_crops_number=3)


def _image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (80, 64, 3), dtype=np.uint8))


def _crops(seed):
    out = MultiCrop(CFG)(_image(), seed)
    return torch.stack([c.flatten() for c in out["global_crops"]]), torch.stack([c.flatten() for c in out["local_crops"]])


def test_shapes_and_seed_alone_decides():
    out = MultiCrop(CFG)(_image(), 7)
    assert [tuple(c.shape) for c in out["global_crops"]] == [(3, 56, 56)] * 2
    assert [tuple(c.shape) for c in out["local_crops"]] == [(3, 28, 28)] * 3
    state = torch.get_rng_state()
    first = _crops(7)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not touched
    torch.manual_seed(123)  # nor read: another global state, the same crops
    second = _crops(7)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    other = _crops(8)
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    # Within a sample the crops differ from each other (independent draws from one generator).
    assert not torch.equal(first[0][0], first[0][1]) and not torch.equal(first[1][0], first[1][1])


@pytest.mark.slow
def test_same_crops_and_masks_in_another_process(tmp_path):
    """Another interpreter with another thread count and another history: bit-identical crops and masks."""
    code = (
        "import torch, sys; torch.set_num_threads(1); torch.manual_seed(99); torch.rand(5)\n"
        "sys.path.insert(0, 'tests/unit'); import test_multicrop as t\n"
        "from pipeline.data.multicrop import block_mask\n"
        f"torch.save({{'crops': t._crops(7), 'mask': block_mask(7, (16, 16))}}, {str(tmp_path / 'o.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    theirs = torch.load(tmp_path / "o.pt")
    mine = _crops(7)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs["crops"]))
    assert torch.equal(block_mask(7, (16, 16)), theirs["mask"])


def test_block_mask_semantics():
    masks = [block_mask(s, (16, 16)) for s in range(200)]
    masked = [m for m in masks if m.any()]
    assert 70 <= len(masked) <= 130  # mask_probability 0.5
    ratios = torch.tensor([m.float().mean() for m in masked])
    # Target ratio uniform in 0.1-0.5, reached unless no block fits; a block may not exceed what is left.
    assert ratios.min() >= 0.1 - 1 / 256 and ratios.max() <= 0.5 + 1 / 256
    assert ratios.max() - ratios.min() > 0.2
    assert len({tuple(m.flatten().tolist()) for m in masked}) == len(masked)  # seeds give different masks
    assert torch.equal(block_mask(3, (16, 16)), block_mask(3, (16, 16)))
    assert not block_mask(0, (16, 16), mask_probability=0.0).any()


def test_each_photometric_step_applies_where_configured():
    """Every draw is made whatever applies, so switching one step on changes only the crops it is for."""
    from dataclasses import replace

    plain = replace(CFG, color_jitter_p=0.0, greyscale_p=0.0, blur_p=(0.0, 0.0, 0.0), solarize_p=0.0)
    base = MultiCrop(plain)(_image(), 5)

    def tv(x):  # total variation: blur lowers it
        return (x[..., 1:, :] - x[..., :-1, :]).abs().mean()

    blurred = MultiCrop(replace(plain, blur_p=(1.0, 0.0, 1.0)))(_image(), 5)
    assert tv(blurred["global_crops"][0]) < tv(base["global_crops"][0])
    assert torch.equal(blurred["global_crops"][1], base["global_crops"][1])
    assert all(tv(b) < tv(a) for a, b in zip(base["local_crops"], blurred["local_crops"]))
    solarized = MultiCrop(replace(plain, solarize_p=1.0))(_image(), 5)  # the second global crop only
    assert torch.equal(solarized["global_crops"][0], base["global_crops"][0])
    assert not torch.equal(solarized["global_crops"][1], base["global_crops"][1])
    assert all(torch.equal(a, b) for a, b in zip(base["local_crops"], solarized["local_crops"]))
    grey = MultiCrop(replace(plain, greyscale_p=1.0))(_image(), 5)["global_crops"][0]
    std = torch.tensor(CFG.std).view(3, 1, 1)
    mean = torch.tensor(CFG.mean).view(3, 1, 1)
    pixels = grey * std + mean
    torch.testing.assert_close(pixels[0], pixels[1], atol=1e-6, rtol=0)
    assert MultiCropConfig().blur_p == (0.0, 0.9, 0.5)  # what Meta's code applies (module docstring)
