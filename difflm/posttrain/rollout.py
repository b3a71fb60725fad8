"""Group rollouts: G completions per prompt from difflm's own samplers, and the padded batch the estimators read.

The prompts of a step are left-padded to one length (``prompt_mask``) and each repeated G times; one call of
:func:`difflm.generate.generate_ids` samples every completion with the run's ``gen.*`` settings (LLaDA
low-confidence / random / margin / entropy remasking, Fast-dLLM threshold decoding and prefix / dual KV cache,
top-k / top-p, classifier-free guidance; BD3-LM block sampling for ``bd3lm`` runs, whose blocks sit at absolute
positions: the rows of each prompt length are sampled together, unpadded). Each row has its own
generator, seeded by a keyed hash of (seed, step, sample) (:mod:`difflm.objectives.keyed_rng`; the sampler's
per-row noise, :func:`difflm.sampling.diffusion.uniform`): a resumed run draws the same rollouts at the same step
without storing any generator state, and a data-parallel rank draws its share of the step's samples as one process
draws them.

A completion runs up to and including its first EOS; the EOS padding after it stays in the sequence as clean
context (LLaDA pads answers with EOS) but carries no loss.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from difflm.model.masks import key_padding_mask
from difflm.objectives.keyed_rng import STREAM_ROLLOUT, key_hash


@dataclass
class Rollouts:
    """One step's rollouts.

    Attributes:
        x: [B, P + L] int64, left-padded prompt then completion (B = prompts * group_size, grouped consecutively).
        valid: [B, P + L] bool, False at prompt padding.
        prompt: [B, P + L] bool, real prompt tokens.
        completion: [B, P + L] bool, completion tokens up to and including the first EOS (the loss positions).
        texts: the decoded completions (up to the first EOS).
        nfe: model calls of the sampler; seconds: its wall time.
    """

    x: torch.Tensor
    valid: torch.Tensor
    prompt: torch.Tensor
    completion: torch.Tensor
    texts: list
    nfe: int
    seconds: float

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[B] int64 completion tokens per row."""
        return self.completion.sum(dim=1)


def rollout_seed(seed: int, step: int, sample: int) -> int:
    """The generator seed of rollout sample ``sample`` (its row in the step's batch, counted over every rank) at
    ``step``: a keyed hash of (seed, step, sample), below 2**63."""
    return int(key_hash(STREAM_ROLLOUT, seed, step, sample)) & (2**63 - 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [B, P] int64 left-padded with ``pad_id`` and their mask [B, P] bool (True at real tokens); P is the
    longest prompt's length, or ``width`` when larger (a data-parallel rank pads to the whole step's longest)."""
    width = max(width, max(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = True
    return ids, mask


def completion_mask(generated: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, L] bool: positions up to and including the first ``eos_id`` of each row (all of a row without one)."""
    is_eos = generated == eos_id
    before = (is_eos.long().cumsum(dim=1) - is_eos.long()) == 0  # no EOS strictly before this position
    return before


def padded_logits_fn(model, valid: torch.Tensor, autocast=None):
    """``logits_fn(x)`` for the estimators over rows laid out as ``valid`` [B, S] (repeated k times when x has k B
    rows): padding keys masked out, RoPE positions skipping them; FP32 logits [kB, S, V]."""
    padded = not bool(valid.all())
    attn = key_padding_mask(valid) if padded else None
    pos = (valid.long().cumsum(dim=1) - 1).clamp(min=0) if padded else None

    def logits_fn(x: torch.Tensor) -> torch.Tensor:
        k = x.shape[0] // valid.shape[0]
        kw = {} if not padded else {"attn_mask": attn.repeat(k, 1, 1, 1), "position_ids": pos.repeat(k, 1)}
        if autocast is None:
            return model(x, **kw).float()
        with autocast():
            return model(x, **kw).float()

    return logits_fn


@torch.no_grad()
def group_rollouts(model, tok, prompt_ids: Sequence[Sequence[int]], group_size: int, gen, *, seed: int, step: int,
                   precision: str = "fp32", objective=None, device=None, first_sample: int = 0,
                   width: int = 0) -> Rollouts:
    """``group_size`` completions of each prompt with the run's sampler (module docstring).

    Args:
        model: the policy (switched to eval mode for sampling and back).
        tok: :class:`difflm.data.tokenizer.TokenizerInfo` (EOS, mask id, decoding).
        prompt_ids: token ids of each prompt.
        gen: the ``gen`` config (its ``seed`` is not read: each row has its own generator).
        objective: the run's ``objective`` config (``bd3lm`` samples block by block).
        first_sample: the step-wide sample number of the first row (a data-parallel rank's share starts there): row
            r is sample ``first_sample + r``, drawn from the generator seeded by :func:`rollout_seed` of it, so a
            sample's completion is the same whichever rank, and whichever other rows, it is drawn with.
        width: the prompts' padded width (:func:`left_pad`): the step's longest prompt, so that every rank's rows
            are the one-process batch's rows.
    Returns: :class:`Rollouts`.
    """
    from omegaconf import OmegaConf

    from difflm.generate import generate_ids

    device = device or next(model.parameters()).device
    repeated = [list(p) for p in prompt_ids for _ in range(group_size)]
    ids, mask = left_pad(repeated, tok.eos_id, width)
    ids, mask = ids.to(device), mask.to(device)
    if not OmegaConf.is_config(gen):
        gen = OmegaConf.create(dict(gen))
    generators = [torch.Generator(device=device).manual_seed(rollout_seed(seed, step, first_sample + r))
                  for r in range(len(repeated))]
    was_training = model.training
    model.eval()
    stats: dict = {}
    start = time.perf_counter()
    try:
        generated = generate_ids(model, tok, ids, gen, causal=False, precision=precision, objective=objective,
                                 prompt_mask=None if bool(mask.all()) else mask, stats=stats, generator=generators)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    comp = completion_mask(generated, tok.eos_id)
    b, p = ids.shape
    x = torch.cat([ids, generated], dim=1)
    valid = torch.cat([mask, torch.ones_like(generated, dtype=torch.bool)], dim=1)
    prompt = torch.cat([mask, torch.zeros_like(generated, dtype=torch.bool)], dim=1)
    completion = torch.cat([torch.zeros_like(mask), comp], dim=1)
    texts = [tok.decode([t for t, c in zip(row.tolist(), crow.tolist()) if c and t != tok.eos_id])
             for row, crow in zip(generated.cpu(), comp.cpu())]
    return Rollouts(x, valid, prompt, completion, texts, int(stats.get("nfe", 0)), seconds)


__all__ = ["Rollouts", "completion_mask", "group_rollouts", "left_pad", "padded_logits_fn", "rollout_seed"]
