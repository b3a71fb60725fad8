"""CART: context-adaptive token-level noise rescheduling (Dream 7B; Ye et al. 2025, "Dream 7B: Diffusion Large
Language Models", sec. 2, eq. 3).

Dream replaces the NELBO weight 1/t of a masked token n by how much clean context surrounds it:

    w(t, x_t, n) = 1/2 * sum_{i=1}^{L} 1[x_t^i != MASK] * Geo(p, |n - i| - 1),   Geo(p, k) = (1 - p)^k p,

so a masked token next to clean tokens weighs about p/2 per neighbour and one far from any context weighs
little; ``p`` (``objective.cart_p``) sets how fast the weight decays with distance.
"""
from __future__ import annotations

import torch


def cart_weights(masked: torch.Tensor, p: float) -> torch.Tensor:
    """w(t, x_t, n) of every position: [B, S] float32 from the masked positions ``masked`` [B, S] bool.

    Computed for every n (the objective keeps it at masked positions only); a masked n never counts itself
    (its own indicator is 0). Cost O(B S^2) as one [B, S] x [S, S] product.
    """
    s = masked.shape[1]
    pos = torch.arange(s, dtype=torch.float64)
    dist = (pos[:, None] - pos[None, :]).abs()  # [S, S]: |n - i|
    geo = torch.where(dist >= 1, p * (1.0 - p) ** (dist - 1).clamp(min=0), torch.zeros((), dtype=torch.float64))
    clean = (~masked).double()
    return (0.5 * clean @ geo.T).float()
