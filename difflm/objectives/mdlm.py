"""Masked (absorbing-state) diffusion: the MDLM / LLaDA training objective.

For a clean sequence x_0 of length L, draw t ~ U(0, 1), mask every token independently with probability
p = (1 - eps) t + eps, and predict the clean tokens at the masked positions. The loss

    L(theta) = E_t E_{x_t} [ (1 / (p L)) * sum_{i : x_t^i = MASK} -log p_theta(x_0^i | x_t) ]

is LLaDA's eq. 3 (Nie et al. 2025, "Large Language Diffusion Models") and, for the linear schedule
alpha_t = 1 - t, the continuous-time NELBO of MDLM (Sahoo et al. 2024, eq. 10/11): an upper bound on
the negative log-likelihood per token. ``eps`` keeps p away from 0 (and the weight 1/p bounded).
"""
from __future__ import annotations

from typing import Sequence

import torch

from difflm.objectives.base import NoisedBatch
from difflm.objectives.keyed_rng import STREAM_BATCH_T, STREAM_EVAL, keyed_generator, keyed_uniform


def mask_prob(t: torch.Tensor, eps: float) -> torch.Tensor:
    """p = (1 - eps) * t + eps (LLaDA eq. 3's masking rate with MDLM's eps floor). t [B] -> p [B]."""
    return (1.0 - eps) * t + eps


def sample_t(sample_ids: Sequence[int], *, key: tuple[int, ...], global_batch_size: int, mode: str) -> torch.Tensor:
    """Diffusion time of each sample, [B] float32 in [0, 1), a function of (key, sample id) only.

    Modes (``objective.t_sampling``):
      * ``iid``: independent U(0, 1) per sample (LLaDA).
      * ``antithetic``: MDLM's low-discrepancy sampler (Sahoo et al. 2024, sec. 3.5 / Kingma et al. 2021,
        VDM appendix): one shared u, t_i = (u + i / G) mod 1 over the G samples of the global batch.
      * ``stratified``: t_i = (i + u_i) / G, one independent draw per stratum.
    Raises: ValueError for an unknown mode.
    """
    ids = torch.as_tensor(list(sample_ids), dtype=torch.float64)
    if mode == "iid":
        return torch.tensor([keyed_uniform(*key, int(i)) for i in ids.tolist()], dtype=torch.float32)
    if mode == "antithetic":
        u = keyed_uniform(*key, STREAM_BATCH_T)
        return ((u + ids / global_batch_size) % 1.0).float()
    if mode == "stratified":
        u = torch.tensor([keyed_uniform(*key, int(i)) for i in ids.tolist()], dtype=torch.float64)
        return ((ids + u) / global_batch_size).float()
    raise ValueError(f"objective.t_sampling={mode!r} is not one of iid, antithetic, stratified")


def draw_mask(p: torch.Tensor, seq_len: int, sample_ids: Sequence[int], key: tuple[int, ...]) -> torch.Tensor:
    """Bernoulli(p_i) mask per position, [B, seq_len] bool; row i depends only on (key, sample_ids[i])."""
    rows = [torch.rand(seq_len, generator=keyed_generator(*key, int(i), 1)) for i in sample_ids]
    return torch.stack(rows) < p[:, None]


def noise_batch(tokens: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, mask_id: int, eps: float) -> NoisedBatch:
    """Apply an absorbing-state corruption given t [B] and a mask [B, S] (see module docstring)."""
    p = mask_prob(t, eps)
    weights = torch.where(mask, 1.0 / p[:, None], torch.zeros((), dtype=torch.float32))
    length = torch.full((tokens.shape[0],), float(tokens.shape[1]))
    return NoisedBatch(
        input_ids=torch.where(mask, torch.full_like(tokens, mask_id), tokens),
        targets=tokens,
        loss_mask=mask,
        weights=weights.float(),
        t=t.float(),
        num_tokens=length,
    )


class MDLMObjective:
    """Masked-diffusion objective with keyed noise; bidirectional attention (``causal = False``).

    Args:
        cfg: the ``objective`` config (``eps``, ``t_sampling``, ``loss_norm``, ...).
        mask_id: id of the [MASK] token.
    """

    causal = False

    def __init__(self, cfg, mask_id: int):
        self.cfg, self.mask_id = cfg, mask_id

    def noise(self, tokens: torch.Tensor, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        """Noise ``tokens`` [B, S] (CPU int64). ``key`` is e.g. (seed, STREAM_TRAIN, step)."""
        t = sample_t(sample_ids, key=key, global_batch_size=global_batch_size, mode=t_sampling or self.cfg.t_sampling)
        mask = draw_mask(mask_prob(t, self.cfg.eps), tokens.shape[1], sample_ids, key)
        return noise_batch(tokens, t, mask, self.mask_id, self.cfg.eps)

    def eval_noise(self, tokens: torch.Tensor, sample_ids: Sequence[int], draw: int, num_draws: int,
                   seed: int) -> NoisedBatch:
        """Draw ``draw`` of ``num_draws`` for the NELBO estimate of fixed validation sequences.

        Per sequence i the draws are antithetic: t_{i,d} = (u_i + d / num_draws) mod 1 with u_i keyed by
        (seed, i), so the K draws stratify [0, 1) and the estimate's variance falls faster than with iid t.
        Everything is keyed, so every evaluation of a run sees the same noise and curves are comparable.
        """
        u = torch.tensor([keyed_uniform(seed, STREAM_EVAL, int(i)) for i in sample_ids], dtype=torch.float64)
        t = ((u + draw / num_draws) % 1.0).float()
        mask = draw_mask(mask_prob(t, self.cfg.eps), tokens.shape[1], sample_ids, (seed, STREAM_EVAL, draw))
        return noise_batch(tokens, t, mask, self.mask_id, self.cfg.eps)
