"""Rotary position embedding (Su et al. 2021, RoFormer, eq. 34), "rotate-half" layout as in GPT-NeoX/Llama/TE.

One set of angles per forward (:func:`rope_angles`, from the positions of the tokens); each kernel set turns them into
what its kernel takes: cos/sin tables for :func:`apply_rope` (:func:`rope_tables`), or Transformer Engine's fused
kernel's ``freqs`` (:mod:`difflm.model.te_kernels`). Both rotate identically.
"""
from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, base: float, device) -> torch.Tensor:
    """``base ** (-2i / head_dim)`` for i < head_dim / 2 (RoFormer eq. 15), [head_dim / 2] float32."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """Rotation angles of ``positions`` ([S] or [B, S] int): [S, D] or [B, S, D] float32, the D/2 frequencies repeated
    for the two halves (rotate-half layout)."""
    angles = positions.to(torch.float32)[..., None] * inverse_frequencies(head_dim, base, positions.device)
    return torch.cat([angles, angles], dim=-1)


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables of positions ``0..seq_len-1``, each [seq_len, head_dim] float32."""
    angles = rope_angles(torch.arange(seq_len, device=device), head_dim, base)
    return angles.cos(), angles.sin()


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin at explicit positions: ``position_ids`` [S] or [B, S] int -> [S, D] or [B, 1, S, D] float32.

    Equal to rows of :func:`rope_cos_sin` (same float32 arithmetic); the [B, 1, S, D] form broadcasts over heads
    in :func:`apply_rope` for [B, H, S, D] inputs.
    """
    angles = rope_angles(position_ids, head_dim, base)
    cos, sin = angles.cos(), angles.sin()
    if position_ids.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def rope_tables(angles: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``angles`` ([S, D] or [B, S, D]) shaped to broadcast against ``layout`` tensors:
    ``bshd`` [B, S, H, D] or ``sbhd`` [S, B, H, D]."""
    cos, sin = angles.cos(), angles.sin()
    if layout == "sbhd":
        shape = (cos.shape[0], 1, 1, cos.shape[-1]) if cos.dim() == 2 else None
        if shape is None:  # [B, S, D] -> [S, B, 1, D]
            return cos.transpose(0, 1)[:, :, None], sin.transpose(0, 1)[:, :, None]
        return cos.view(shape), sin.view(shape)
    return cos[..., None, :], sin[..., None, :]  # [S, 1, D] or [B, S, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by position: ``x * cos + rotate_half(x) * sin`` in float32, returned in x's dtype.

    Any layout, as long as ``cos``/``sin`` broadcast against ``x`` ([..., D]; see :func:`rope_tables`).
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
