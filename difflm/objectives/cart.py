"""CART: context-adaptive token-level noise rescheduling (Dream 7B; Ye et al. 2025, "Dream 7B: Diffusion Large
Language Models", sec. 2, eq. 3).

Dream replaces the NELBO weight 1/t of a masked token n by how much clean context surrounds it:

    w(t, x_t, n) = 1/2 * sum_{i=1}^{L} 1[x_t^i != MASK] * Geo(p, |n - i| - 1),   Geo(p, k) = (1 - p)^k p,

so a masked token next to clean tokens weighs about p/2 per neighbour and one far from any context weighs
little; ``p`` (``objective.cart_p``) sets how fast the weight decays with distance.
"""
from __future__ import annotations

import torch


def cart_weights(masked: torch.Tensor, p: float, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """w(t, x_t, n) of every position: [B, S] float32 from the masked positions ``masked`` [B, S] bool.

    Computed for every n (the objective keeps it at masked positions only); a masked n never counts itself
    (its own indicator is 0). ``doc_ids`` [B, S] int64 (packed windows under intra-document attention: documents are
    runs of equal ids) limits the sum to n's own document, the context the model sees: with F_n the sum over all
    i < n, the part of it before n's document start s is (1 - p)^(n - s) F_s (and likewise after its end).
    Cost O(B S^2) as two [B, S] x [S, S] products.
    """
    b, s = masked.shape
    pos = torch.arange(s, dtype=torch.float64)
    dist = pos[:, None] - pos[None, :]  # [S, S]: n - i
    r = 1.0 - p
    before = torch.where(dist >= 1, p * r ** (dist - 1).clamp(min=0), torch.zeros((), dtype=torch.float64))
    clean = (~masked).double()
    left = clean @ before.T  # F_n: the clean tokens i < n
    right = clean @ before  # the clean tokens i > n
    if doc_ids is not None:
        idx = torch.arange(s).expand(b, s)
        new = torch.ones(b, s, dtype=torch.bool)
        new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        start = torch.where(new, idx, torch.zeros((), dtype=torch.long)).cummax(dim=1).values
        last = torch.ones(b, s, dtype=torch.bool)
        last[:, :-1] = new[:, 1:]
        end = torch.where(last, idx, torch.full((), s - 1)).flip(1).cummin(dim=1).values.flip(1)
        left = left - r ** (idx - start).double() * left.gather(1, start)
        right = right - r ** (end - idx).double() * right.gather(1, end)
    return (0.5 * (left + right)).float()
