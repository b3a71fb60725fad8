"""AR-to-diffusion adaptation: options composed onto the ``mdlm``, ``sft`` and ``bd3lm`` objectives.

Each option is one ``objective.*`` key (docs/adaptation.md); :func:`adapts` says whether any is set, and
:class:`AdaptedObjective` wraps the base objective to apply them. Every random draw stays keyed
(:mod:`difflm.objectives.keyed_rng`): the step is the second field of the trainer's noise key (seed, step).

* ``attention_anneal_steps``: causal -> bidirectional attention (:mod:`difflm.objectives.attention_anneal`).
* ``block_schedule``: bd3lm's block size per phase (:mod:`difflm.objectives.block_schedule`).
* ``complementary_masks``: each row under M and ~M (:mod:`difflm.objectives.complementary`).
* ``weighting=cart``: Dream's context-adaptive weights (:mod:`difflm.objectives.cart`).
* ``ar_loss_weight`` / ``diffusion_loss_weight``: the hybrid loss (:mod:`difflm.objectives.hybrid`); under
  ``clean_attention=causal`` its AR term is on the clean half of bd3lm's batch, else a second forward.
* ``t_lo`` / ``t_hi``: t ~ U(t_lo, t_hi) in training (:func:`truncate_t`).

Evaluation (``eval_noise``) keeps the model's target: full t range, bidirectional attention, the final block size
``objective.block_size``, NELBO weights 1/p and no AR term, so ``val_nelbo`` stays the diffusion bound. Complementary
masks pair rows in training only: each half weighs 1/2, so the step's normaliser stays the base objective's.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch

from difflm.data.batch import split_batch
from difflm.objectives.attention_anneal import anneal_mask
from difflm.objectives.base import NoisedBatch
from difflm.objectives.block_schedule import block_size_at
from difflm.objectives.cart import cart_weights
from difflm.objectives.complementary import cat_batches, complement_weight
from difflm.objectives.hybrid import add_clean_half_ar, clean_ar_batch
from difflm.objectives.keyed_rng import STREAM_EVAL_MASK, STREAM_EVAL_T, keyed_uniforms
from difflm.objectives.mdlm import draw_mask, noise_batch, sample_t


def adapts(cfg) -> bool:
    """True when ``cfg`` (the ``objective`` config) sets any adaptation option away from its default."""
    g = cfg.get
    return bool(g("attention_anneal_steps", 0) or g("block_schedule") or g("complementary_masks", False)
                or g("weighting", "nelbo") != "nelbo" or g("ar_loss_weight", 0.0) or g("diffusion_loss_weight", 1.0) != 1.0
                or g("t_lo", 0.0) != 0.0 or g("t_hi", 1.0) != 1.0)


def truncate_t(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """t ~ U(lo, hi) from t ~ U(0, 1): lo + (hi - lo) t (any shape; keeps antithetic / stratified structure)."""
    return lo + (hi - lo) * t


class AdaptedObjective:
    """A base diffusion objective (``MDLMObjective``, ``SFTObjective`` or ``BD3LMObjective``) with the adaptation
    options of its config applied; the same interface (``causal``, ``num_tokens``, ``noise``, ``eval_noise``)."""

    def __init__(self, base):
        self.base, self.cfg, self.mask_id = base, base.cfg, base.mask_id
        self.causal = base.causal
        self.blocks = hasattr(base, "block_size")
        self.pair = bool(self.cfg.get("complementary_masks", False))

    def num_tokens(self, tokens) -> torch.Tensor:
        """The base objective's normaliser of each row of ``tokens``, [B] float32 (complementary pairs weigh 1/2 each,
        so they need no other normaliser)."""
        return self.base.num_tokens(tokens)

    def _base_at(self, step: int):
        """The base objective at ``step``: a copy with the scheduled block size under ``block_schedule``."""
        phases = self.cfg.get("block_schedule")
        if not self.blocks or not phases:
            return self.base
        size = block_size_at(phases, step)
        if size == self.base.block_size:
            return self.base
        base = copy.copy(self.base)
        base.block_size = size
        return base

    def _draw(self, base, length: int, sample_ids, key, global_batch_size: int, t_sampling, eval_draw):
        """(t, mask prob p, mask [B, L] bool): t [B] (per block [B, nb] for bd3lm), as the base objective draws them,
        with t truncated in training. ``eval_draw``: (draw, num_draws, seed) for evaluation, else None."""
        ids = [int(i) for i in sample_ids]
        nb = base._blocks(length) if self.blocks else 1
        units = [i * nb + j for i in ids for j in range(nb)]
        if eval_draw is None:
            t = sample_t(units, key=key, global_batch_size=global_batch_size * nb,
                         mode=t_sampling or self.cfg.t_sampling)
            t = truncate_t(t, float(self.cfg.get("t_lo", 0.0)), float(self.cfg.get("t_hi", 1.0)))
            mask_key, stream = key, None
        else:
            draw, num_draws, seed = eval_draw
            u = torch.from_numpy(keyed_uniforms(STREAM_EVAL_T, seed, np.asarray(units, dtype=np.int64))[:, 0])
            t = ((u + draw / num_draws) % 1.0).float()
            mask_key, stream = (seed, draw), STREAM_EVAL_MASK
        if self.blocks:
            t = t.view(len(ids), nb)
        p, _ = base.schedule(t)
        p_pos = p.repeat_interleave(base.block_size, dim=1) if self.blocks else p
        extra = {} if stream is None else {"stream": stream}
        return t, p, draw_mask(p_pos, length, ids, mask_key, **extra)

    def _assemble(self, base, tokens, t, mask) -> NoisedBatch:
        """The base objective's batch for clean ``tokens`` (tensor or TokenBatch), t and a drawn ``mask``."""
        raw, extras = split_batch(tokens)
        if self.blocks:
            return base.build(raw, t, mask, extras)
        _, w = base.schedule(t)
        batch = base._finish(noise_batch(raw, t, mask, self.mask_id, self.cfg.eps, w), extras)
        return base._restrict(batch, tokens) if hasattr(base, "_restrict") else batch

    def _complement(self, base, tokens, t, p, mask) -> NoisedBatch:
        """The batch of the complementary mask ~M, each masked token weighted 1 / max(1 - p, eps)."""
        batch = self._assemble(base, tokens, t, ~mask)
        length = mask.shape[1]
        w = complement_weight(p, self.cfg.eps)
        w_pos = w.repeat_interleave(base.block_size, dim=1) if self.blocks else w[:, None].expand(-1, length)
        if self.blocks:  # [x_t ; x_0]: the loss lives in the noisy half
            w_pos = torch.cat([w_pos, torch.zeros_like(w_pos)], dim=1)
        batch.weights = torch.where(batch.loss_mask, w_pos, torch.zeros(())).float()
        return batch

    def _noised(self, tokens, sample_ids, key, global_batch_size, t_sampling, eval_draw) -> NoisedBatch:
        step = int(key[1]) if eval_draw is None and len(key) > 1 else 0
        base = self.base if eval_draw is not None else self._base_at(step)
        raw, extras = split_batch(tokens)
        t, p, mask = self._draw(base, raw.shape[1], sample_ids, key, global_batch_size, t_sampling, eval_draw)
        batch = self._assemble(base, tokens, t, mask)
        if eval_draw is not None:
            return batch
        if self.pair:
            batch = cat_batches(batch, self._complement(base, tokens, t, p, mask))
        if self.cfg.get("weighting", "nelbo") == "cart":
            docs = None if extras is None or extras.doc_ids is None else \
                extras.doc_ids.repeat(batch.input_ids.shape[0] // raw.shape[0], 1)  # the context attention allows
            w = cart_weights(batch.input_ids == self.mask_id, float(self.cfg.cart_p), docs)
            batch.weights = torch.where(batch.loss_mask, w, torch.zeros(()))
        share = 0.5 if self.pair else 1.0  # complementary rows: the mean of the two estimates, each row weighs 1/2
        batch.weights = batch.weights * (share * float(self.cfg.get("diffusion_loss_weight", 1.0)))
        if hasattr(base, "per_pair") and self.cfg.get("loss_norm", "token") == "sequence":
            batch = base.per_pair(batch, tokens)  # packed sft pairs: 1 / N_pair, as the base objective trains
        n_anneal = int(self.cfg.get("attention_anneal_steps", 0))
        if n_anneal > 0:
            batch.attn_mask = anneal_mask(batch.input_ids.shape[1], step, n_anneal, int(key[0]))
        w_ar = float(self.cfg.get("ar_loss_weight", 0.0))
        if w_ar > 0:
            n = self.base.num_tokens(tokens)  # what the step's normaliser counts for these samples
            if getattr(base, "clean_causal", False):  # the recipe's one forward: AR CE on the causal clean half
                return add_clean_half_ar(batch, w_ar, self.cfg.loss_norm, n.numel(), float(n.sum()),
                                         share=0.5 if self.pair else 1.0)
            batch.aux = clean_ar_batch(raw, None if extras is None else extras.doc_ids, w_ar, self.cfg.loss_norm,
                                       n.numel(), float(n.sum()))
        return batch

    def noise(self, tokens, sample_ids: Sequence[int], key: tuple[int, ...], global_batch_size: int,
              t_sampling: str | None = None) -> NoisedBatch:
        """The base objective's noised batch with the adaptation options of step ``key[1]`` applied."""
        return self._noised(tokens, sample_ids, key, global_batch_size, t_sampling, None)

    def eval_noise(self, tokens, sample_ids: Sequence[int], draw: int, num_draws: int, seed: int) -> NoisedBatch:
        """The base objective's evaluation draw (the diffusion NELBO; see the module docstring)."""
        return self._noised(tokens, sample_ids, (seed,), len(sample_ids), None, (draw, num_draws, seed))
