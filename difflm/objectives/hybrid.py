"""Hybrid AR + diffusion loss for AR-to-diffusion adaptation (NVIDIA Megatron-Bridge ``diffusion/recipes/*/
ar_to_dlm.py``: block-diffusion CE on x_t with weight 0.3 plus next-token CE on the clean copy x_0 with weight 1.0,
block size 64).

    L = w_diff * L_diffusion(x_t) + w_ar * (1 / N_ar) sum_j -log p_theta(x_0^{j+1} | x_0^{<=j})   (causal attention)

The weights are the recipe's ``dlm_loss_weight = 0.3`` and ``ar_loss_weight = 1.0`` (its NemotronLabsDiffusion model
provider). The recipe takes both terms from one forward of ``[x_t ; x_0]`` whose clean half attends fully causally
(its ``sbd_block_diff`` mask): the clean half's logit at position j is the next-token prediction of x_0^{j+1}. Two
ways here, chosen by ``objective.clean_attention``:

* ``causal`` (the recipe; ``objective=bd3lm`` only): the same single forward. The noisy half keeps BD3-LM's mask, the
  clean half attends causally (:class:`difflm.model.masks.BlockDiffusionMask` with ``clean_causal``), and
  :func:`add_clean_half_ar` puts the next-token targets and AR weights on the clean half of the batch.
* ``block_causal`` (BD3-LM's clean half; mdlm, whose batch has no clean half, always takes this way): a second forward
  of the same model over the clean tokens under a causal mask, the batch's ``aux`` (:func:`clean_ar_batch`); the
  trainer adds its loss to the diffusion loss of the same micro-batch.

Both give the AR term the same value: a clean position that attends causally to clean positions only computes what
a causal forward over x_0 alone computes (same tokens, same RoPE positions 0..L-1).
"""
from __future__ import annotations

import torch

from difflm.model.masks import DocumentMask
from difflm.objectives.base import NoisedBatch


def ar_token_scale(norm: str, rows: int, seq_len: int, diffusion_rows: int, diffusion_tokens: float) -> float:
    """Factor on each AR token's weight that turns the step's sum into ``weight`` times the AR mean.

    The step's normaliser counts the diffusion rows only: ``norm=token`` scales each AR token by
    ``diffusion_tokens / N_ar`` (the diffusion loss tokens of the micro-batch over its ``rows * (seq_len - 1)``
    predictions), ``norm=sequence`` by ``diffusion_rows / rows`` (each AR row's sum is then divided by its own
    ``seq_len - 1``). Every micro-batch of a step has the same ratio (equal-length windows), so this is exact.
    """
    if norm == "token":
        return diffusion_tokens / float(rows * (seq_len - 1))
    return diffusion_rows / rows


def clean_ar_batch(tokens: torch.Tensor, doc_ids, weight: float, norm: str, diffusion_rows: int,
                   diffusion_tokens: float) -> NoisedBatch:
    """Next-token batch of the clean ``tokens`` [B, L] with a causal mask (within ``doc_ids`` [B, L] when given),
    each prediction weighted ``weight * ar_token_scale(...)`` (the second forward of ``clean_attention=block_causal``)."""
    b, s = tokens.shape
    loss_mask = torch.ones(b, s, dtype=torch.bool)
    loss_mask[:, -1] = False
    scale = ar_token_scale(norm, b, s, diffusion_rows, diffusion_tokens)
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


def add_clean_half_ar(batch: NoisedBatch, weight: float, norm: str, diffusion_rows: int, diffusion_tokens: float,
                      share: float = 1.0) -> NoisedBatch:
    """``batch`` (BD3-LM's ``[x_t ; x_0]`` rows [R, 2L] under a causal clean half) with the AR term on its clean half:
    position L + j predicts x_0^{j+1} for j < L - 1, weight ``share * weight * ar_token_scale(...)``.

    Args:
        weight: ``objective.ar_loss_weight``.
        diffusion_rows, diffusion_tokens: the step normaliser's count of the B samples (B rows, their loss tokens).
        share: each row's share of its sample (1/2 for complementary pairs, whose 2B rows hold the same clean half).
    Under ``norm=sequence`` the weighted CE divides a row by its ``num_tokens`` (the diffusion count L), so the AR
    weights carry ``num_tokens / (L - 1)`` to divide the AR sum by its own L - 1 predictions.
    """
    rows, two_l = batch.input_ids.shape
    length = two_l // 2
    clean = batch.input_ids[:, length:]
    samples = round(rows * share)
    scale = share * weight * ar_token_scale(norm, samples, length, diffusion_rows, diffusion_tokens)
    ar_mask = torch.ones(rows, length, dtype=torch.bool)
    ar_mask[:, -1] = False
    per_row = torch.full((rows, 1), scale)
    if norm == "sequence":
        per_row = per_row * batch.num_tokens[:, None] / (length - 1)
    batch.targets = torch.cat([batch.targets[:, :length], torch.roll(clean, shifts=-1, dims=1)], dim=1)
    batch.loss_mask = torch.cat([batch.loss_mask[:, :length], ar_mask], dim=1)
    batch.weights = torch.cat([batch.weights[:, :length], ar_mask.float() * per_row], dim=1).float()
    batch.loss_index = None
    return batch
