"""Rotary position embedding (Su et al. 2021, RoFormer, eq. 34), "rotate-half" layout as in GPT-NeoX/Llama/TE."""
from __future__ import annotations

import torch


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables, each [seq_len, head_dim] float32.

    Frequency of pair i is ``base ** (-2i / head_dim)`` (RoFormer eq. 15).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by position; cos/sin [S, D] float32. Returns x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin at explicit positions: ``position_ids`` [S] or [B, S] int -> [S, D] or [B, 1, S, D] float32.

    Equal to rows of :func:`rope_cos_sin` (same float32 arithmetic); the [B, 1, S, D] form broadcasts over heads
    in :func:`apply_rope`.
    """
    device = position_ids.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if position_ids.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin
