"""Rotary position embedding (Su et al. 2021, RoFormer, eq. 34), "rotate-half" layout as in GPT-NeoX/Llama/TE.

One set of angles per forward (:func:`rope_angles`, from the positions of the tokens); both kernel sets turn them into
cos/sin tables (:func:`rope_tables`) that :func:`apply_rope` or the fused QKV kernels (:mod:`difflm.model.qkv`) read.

Partial rotary (``model.partial_rotary_factor`` f < 1, the name of transformers' configs; Ling/Bailing-MoE-V2 and
LLaDA 2.0 release f = 0.5): only the first ``R = rotary_dim(D, f)`` dims of each head rotate, rotate-half within that
slice (pairs i and i + R/2), at frequencies ``base ** (-2i / R)``; dims R..D pass unchanged (transformers'
``_compute_default_rope_parameters`` and Llama-style ``apply_rotary_pos_emb`` with ``rotary_dim = cos.shape[-1]``).
The angle tables are then [.., R] wide and :func:`apply_rope` rotates as many dims as they hold.
"""
from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, base: float, device) -> torch.Tensor:
    """``base ** (-2i / head_dim)`` for i < head_dim / 2 (RoFormer eq. 15), [head_dim / 2] float32."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rotary_dim(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """R = ``int(head_dim * partial_rotary_factor)``, the rotated dims of a head (transformers' truncation).

    Raises: ValueError naming ``model.partial_rotary_factor`` unless 0 < R <= head_dim and R is even."""
    r = int(head_dim * float(partial_rotary_factor))
    if not (0 < r <= head_dim and r % 2 == 0):
        raise ValueError(f"model.partial_rotary_factor={partial_rotary_factor} gives {r} rotary dims of head dim "
                         f"{head_dim}: pick a factor in (0, 1] that makes head_dim * factor a positive even integer")
    return r


def rope_angles(positions: torch.Tensor, head_dim: int, base: float,
                partial_rotary_factor: float = 1.0) -> torch.Tensor:
    """Rotation angles of ``positions`` ([S] or [B, S] int): [S, R] or [B, S, R] float32 (R = :func:`rotary_dim`,
    D without partial rotary), the R/2 frequencies repeated for the two halves (rotate-half layout)."""
    r = rotary_dim(head_dim, partial_rotary_factor)
    angles = positions.to(torch.float32)[..., None] * inverse_frequencies(r, base, positions.device)
    return torch.cat([angles, angles], dim=-1)


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device,
                 partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables of positions ``0..seq_len-1``, each [seq_len, R] float32 (R = :func:`rotary_dim`)."""
    angles = rope_angles(torch.arange(seq_len, device=device), head_dim, base, partial_rotary_factor)
    return angles.cos(), angles.sin()


def rope_cos_sin_at(position_ids: torch.Tensor, head_dim: int, base: float,
                    partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin at explicit positions: ``position_ids`` [S] or [B, S] int -> [S, R] or [B, 1, S, R] float32.

    Equal to rows of :func:`rope_cos_sin` (same float32 arithmetic); the [B, 1, S, D] form broadcasts over heads
    in :func:`apply_rope` for [B, H, S, D] inputs.
    """
    angles = rope_angles(position_ids, head_dim, base, partial_rotary_factor)
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

    Any layout, as long as ``cos``/``sin`` broadcast against ``x`` ([..., D]; see :func:`rope_tables`). Tables of
    R < D dims (partial rotary) rotate ``x[..., :R]`` and pass ``x[..., R:]`` through unchanged.
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)
