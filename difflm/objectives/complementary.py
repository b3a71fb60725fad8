"""Complementary masks: every sequence is trained under a mask M and under its complement ~M in the same step
(Fast-dLLM v2, Wu et al. 2025, sec. 3.2 "complementary masking"; LLaDA 2.0's SFT; DiffuCoder's coupled sampling,
Gong et al. 2025, sec. 4.2).

With M ~ Bernoulli(p) per token, ~M ~ Bernoulli(1 - p), so each half is an unbiased NELBO estimate with its own
weight: 1/p on M's masked tokens and 1/(1 - p) on ~M's (floored at ``eps`` like p itself). Every token of the
sequence is masked, and trained on, in exactly one of the two rows. The pair doubles the rows of a micro-batch.
"""
from __future__ import annotations

import torch

from difflm.model.masks import BlockDiffusionMask, DocumentMask
from difflm.objectives.base import NoisedBatch


def complement_weight(p: torch.Tensor, eps: float) -> torch.Tensor:
    """The NELBO weight of a token masked with probability 1 - p: 1 / max(1 - p, eps). p: any shape, float."""
    return 1.0 / (1.0 - p).clamp(min=eps)


def _cat_mask(a, b):
    """The attention masks of two stacked batches (None, shared structured masks, or per-row ones)."""
    if a is None and b is None:
        return None
    if isinstance(a, DocumentMask):
        return DocumentMask(torch.cat([a.doc_ids, b.doc_ids]), causal=a.causal)
    if isinstance(a, BlockDiffusionMask):
        if a.doc_ids is None:
            return a
        return BlockDiffusionMask(a.seq_len, a.block_size, torch.cat([a.doc_ids, b.doc_ids]), clean_causal=a.clean_causal)
    if isinstance(a, torch.Tensor) and a.shape[0] == 1 and torch.equal(a, b):
        return a
    return torch.cat([a, b])


def cat_batches(a: NoisedBatch, b: NoisedBatch) -> NoisedBatch:
    """The rows of ``a`` followed by those of ``b`` (same sequence length), as one NoisedBatch of B_a + B_b rows."""
    rows = {k: torch.cat([getattr(a, k), getattr(b, k)]) for k in
            ("input_ids", "targets", "loss_mask", "weights", "t", "num_tokens")}
    positions = a.position_ids
    if positions is not None and positions.dim() == 2:
        positions = torch.cat([a.position_ids, b.position_ids])
    return NoisedBatch(**rows, attn_mask=_cat_mask(a.attn_mask, b.attn_mask), position_ids=positions)
