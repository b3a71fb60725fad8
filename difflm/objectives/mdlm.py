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

import numpy as np
import torch

from difflm.data.batch import split_batch
from difflm.model.masks import DocumentMask
from difflm.objectives.base import NoisedBatch
from difflm.objectives.keyed_rng import STREAM_BATCH_T, STREAM_EVAL_MASK, STREAM_EVAL_T, STREAM_MASK, STREAM_T, \
    keyed_uniform, keyed_uniforms
from difflm.objectives.schedules import mask_prob_and_weight


def mask_prob(t: torch.Tensor, eps: float) -> torch.Tensor:
    """p = (1 - eps) * t + eps (LLaDA eq. 3's masking rate with MDLM's eps floor). t [B] -> p [B]."""
    return (1.0 - eps) * t + eps


def sample_t(sample_ids: Sequence[int], *, key: tuple[int, ...], global_batch_size: int, mode: str) -> torch.Tensor:
    """Diffusion time of each sample, [B] float32 in [0, 1), a function of (key, sample id) only.

    ``key`` is the step's noise key, e.g. (seed, step); draws use the streams ``STREAM_T`` / ``STREAM_BATCH_T``.

    Modes (``objective.t_sampling``):
      * ``iid``: independent U(0, 1) per sample (LLaDA).
      * ``antithetic``: MDLM's low-discrepancy sampler (Sahoo et al. 2024, sec. 3.5 / Kingma et al. 2021,
        VDM appendix): one shared u, t_i = (u + i / G) mod 1 over the G samples of the global batch.
      * ``stratified``: t_i = (i + u_i) / G, one independent draw per stratum.
    Raises: ValueError for an unknown mode.
    """
    ids = np.asarray(list(sample_ids), dtype=np.int64)
    if mode == "iid":
        return torch.from_numpy(keyed_uniforms(STREAM_T, *key, ids)[:, 0]).float()
    if mode == "antithetic":
        u = keyed_uniform(STREAM_BATCH_T, *key)
        return torch.from_numpy((u + ids / global_batch_size) % 1.0).float()
    if mode == "stratified":
        u = keyed_uniforms(STREAM_T, *key, ids)[:, 0]
        return torch.from_numpy((ids + u) / global_batch_size).float()
    raise ValueError(f"objective.t_sampling={mode!r} is not one of iid, antithetic, stratified")


def draw_mask(p: torch.Tensor, seq_len: int, sample_ids: Sequence[int], key: tuple[int, ...],
              stream: int = STREAM_MASK) -> torch.Tensor:
    """Bernoulli(p_i) mask per position, [B, seq_len] bool; row i depends only on (stream, key, sample_ids[i]).

    ``p`` is [B] (one probability per row) or [B, seq_len] (per position, e.g. BD3-LM's per-block p)."""
    u = torch.from_numpy(keyed_uniforms(stream, *key, np.asarray(list(sample_ids), dtype=np.int64), n=seq_len))
    return u < (p if p.dim() == 2 else p[:, None]).double()


def noise_batch(tokens: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, mask_id: int, eps: float,
                weight: torch.Tensor | None = None) -> NoisedBatch:
    """Apply an absorbing-state corruption given t [B] and a mask [B, S] (see module docstring).

    ``weight`` [B] (or [B, S]) float32 is the NELBO weight of a masked token (default 1 / p: the linear
    schedule; :func:`difflm.objectives.schedules.mask_prob_and_weight` for the others).
    """
    if weight is None:
        weight = 1.0 / mask_prob(t, eps)
    if weight.dim() == 1:
        weight = weight[:, None]
    weights = torch.where(mask, weight, torch.zeros((), dtype=torch.float32))
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

    def schedule(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask probability, NELBO weight) at t under ``objective.schedule`` (default ``linear``)."""
        return mask_prob_and_weight(t, getattr(self.cfg, "schedule", "linear") or "linear", self.cfg.eps)

    def num_tokens(self, tokens) -> torch.Tensor:
        """The loss normaliser of each row of ``tokens`` [B, S] (tensor or TokenBatch): its length S, [B] float32.

        The same value as the ``num_tokens`` of :meth:`noise`'s batch, available before noising, so the trainer
        can count the loss tokens of a whole global batch (:func:`difflm.objectives.base.loss_normaliser`) first.
        """
        tokens, _ = split_batch(tokens)
        return torch.full((tokens.shape[0],), float(tokens.shape[1]))

    def _finish(self, batch: NoisedBatch, extras) -> NoisedBatch:
        """Add the intra-document mask of packed windows (``data.intra_document_attention``)."""
        if extras is not None and extras.doc_ids is not None:
            batch.attn_mask = DocumentMask(extras.doc_ids)
        return batch

    def noise(self, tokens, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        """Noise ``tokens`` [B, S] (CPU int64, or a :class:`difflm.data.batch.TokenBatch`). ``key`` is the step's
        noise key, (seed, step) in the trainer (:mod:`difflm.objectives.keyed_rng`)."""
        tokens, extras = split_batch(tokens)
        t = sample_t(sample_ids, key=key, global_batch_size=global_batch_size, mode=t_sampling or self.cfg.t_sampling)
        p, w = self.schedule(t)
        mask = draw_mask(p, tokens.shape[1], sample_ids, key)
        return self._finish(noise_batch(tokens, t, mask, self.mask_id, self.cfg.eps, w), extras)

    def eval_noise(self, tokens, sample_ids: Sequence[int], draw: int, num_draws: int,
                   seed: int) -> NoisedBatch:
        """Draw ``draw`` of ``num_draws`` for the NELBO estimate of fixed validation sequences.

        Per sequence i the draws are antithetic: t_{i,d} = (u_i + d / num_draws) mod 1 with u_i keyed by
        (seed, i), so the K draws stratify [0, 1) and the estimate's variance falls faster than with iid t.
        Everything is keyed, so every evaluation of a run sees the same noise and curves are comparable.
        """
        tokens, extras = split_batch(tokens)
        u = torch.from_numpy(keyed_uniforms(STREAM_EVAL_T, seed, np.asarray(list(sample_ids), dtype=np.int64))[:, 0])
        t = ((u + draw / num_draws) % 1.0).float()
        p, w = self.schedule(t)
        mask = draw_mask(p, tokens.shape[1], sample_ids, (seed, draw), STREAM_EVAL_MASK)
        return self._finish(noise_batch(tokens, t, mask, self.mask_id, self.cfg.eps, w), extras)
