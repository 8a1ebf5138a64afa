import pytest
import torch
from timm.layers import resample_abs_pos_embed

from pipeline.model.pos_embed import resize_pos_embed


@pytest.mark.parametrize("old,new", [((14, 14), (24, 24)), ((14, 14), (7, 7)), ((12, 16), (24, 32)), ((14, 14), (24, 32)),
                                     ((8, 6), (5, 9))])
def test_matches_timm(old, new):
    torch.manual_seed(0)
    pe = torch.randn(1, 1 + old[0] * old[1], 32)
    ours = resize_pos_embed(pe, new, num_prefix_tokens=1, old_grid=old)
    theirs = resample_abs_pos_embed(pe, list(new), old_size=list(old), num_prefix_tokens=1)
    assert ours.shape == (1, 1 + new[0] * new[1], 32)
    torch.testing.assert_close(ours, theirs)
    assert torch.equal(ours[:, :1], pe[:, :1])  # class token kept as it is


def test_identity_when_grid_unchanged():
    pe = torch.randn(1, 1 + 9 * 12, 8)
    assert resize_pos_embed(pe, (9, 12), old_grid=(9, 12)) is pe


def test_dtype_restored_and_square_inferred():
    pe = torch.randn(1, 1 + 16, 8).bfloat16()
    out = resize_pos_embed(pe, (8, 8))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 65, 8)


def test_non_square_without_old_grid_is_an_error():
    with pytest.raises(ValueError, match="old_grid"):
        resize_pos_embed(torch.randn(1, 1 + 12, 4), (6, 6))
