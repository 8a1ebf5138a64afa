"""Position embeddings at a new resolution (fine-tuning at 384 turns a 14x14 grid into 24x24)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def resize_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: tuple[int, int] | list[int],
    num_prefix_tokens: int = 1,
    old_grid: tuple[int, int] | list[int] | None = None,
) -> torch.Tensor:
    """Resize (1, prefix + h*w, D) position embeddings to (1, prefix + H*W, D).

    The prefix (class token) embeddings are kept as they are; the grid is resized in 2-D, bicubic
    with antialias (which matters when shrinking), in float32 because interpolate has no
    bf16/fp16 bicubic on every device; the input dtype is restored. `old_grid` is required for a
    non-square source (the token count alone cannot tell 12x16 from 16x12); a square one is
    inferred. The same grid in and out returns the input unchanged.
    """
    new_grid = (int(new_grid[0]), int(new_grid[1]))
    num_grid_tokens = pos_embed.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = int(round(num_grid_tokens ** 0.5))
        if side * side != num_grid_tokens:
            raise ValueError(f"position embedding has {num_grid_tokens} grid tokens, not a square; pass old_grid")
        old_grid = (side, side)
    old_grid = (int(old_grid[0]), int(old_grid[1]))
    if old_grid[0] * old_grid[1] != num_grid_tokens:
        raise ValueError(f"old_grid {old_grid} does not match {num_grid_tokens} grid tokens")
    if old_grid == new_grid:
        return pos_embed

    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = pos_embed.shape[-1]
    grid = grid.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)  # (1, D, h, w)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", antialias=True, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
