"""Hybrid AR + diffusion loss for AR-to-diffusion adaptation (NVIDIA Megatron-Bridge ``diffusion/recipes/*/
ar_to_dlm.py``: block-diffusion CE on x_t with weight 0.3 plus next-token CE on the clean copy x_0 with weight 1.0,
block size 64).

    L = w_diff * L_diffusion(x_t) + w_ar * (1 / N_ar) sum_j -log p_theta(x_0^{j+1} | x_0^{<=j})   (causal attention)

The AR term runs as a second forward of the same model over the clean tokens under a causal mask (the batch's
``aux``); the trainer adds its loss to the diffusion loss of the same micro-batch. The weights are the recipe's
``dlm_loss_weight = 0.3`` and ``ar_loss_weight = 1.0`` (its NemotronLabsDiffusion model provider). The recipe takes
both terms from one forward of ``[x_t ; x_0]`` whose clean half attends fully causally; here the diffusion forward
keeps BD3-LM's block-causal clean half, the mask that evaluation and block-by-block sampling use.
"""
from __future__ import annotations

import torch

from difflm.model.masks import DocumentMask
from difflm.objectives.base import NoisedBatch


def clean_ar_batch(tokens: torch.Tensor, doc_ids, weight: float, norm: str, diffusion_rows: int,
                   diffusion_tokens: float) -> NoisedBatch:
    """Next-token batch of the clean ``tokens`` [B, L] with a causal mask (within ``doc_ids`` [B, L] when given).

    The step's normaliser counts the diffusion rows only, so the weights rescale the AR sum to ``weight`` times the
    AR mean: ``norm=token`` scales each AR token by ``diffusion_tokens / N_ar`` (the diffusion loss tokens of the
    micro-batch over its B (L - 1) predictions), ``norm=sequence`` by ``diffusion_rows / B`` (each AR row is divided
    by its own L - 1). Every micro-batch of a step has the same ratio (equal-length windows), so this is exact.
    """
    b, s = tokens.shape
    loss_mask = torch.ones(b, s, dtype=torch.bool)
    loss_mask[:, -1] = False
    n_ar = float(b * (s - 1))
    scale = diffusion_tokens / n_ar if norm == "token" else diffusion_rows / b
    ids = torch.zeros_like(tokens) if doc_ids is None else doc_ids
    return NoisedBatch(
        input_ids=tokens,
        targets=torch.roll(tokens, shifts=-1, dims=1),
        loss_mask=loss_mask,
        weights=loss_mask.float() * float(weight * scale),
        t=torch.zeros(b),
        num_tokens=torch.full((b,), float(s - 1)),
        attn_mask=DocumentMask(ids, causal=True),
    )
