"""What every log-likelihood estimator shares: keyed noise and the per-position log-probabilities of one forward.

An estimator takes a logits function (the policy, its frozen reference, or an enumerable test model), clean
sequences ``x`` [B, S] int64 (prompt and completion), the completion positions [B, S] bool and a noise key, and
returns per-position terms [B, S] float32, zero off the completion, whose row sums estimate the completion's
log-likelihood given the prompt. The noise is a function of (key, sample id) only (:mod:`difflm.objectives.keyed_rng`),
so the policy, the rollout-time ("old") policy and the reference see the same t and masks whenever they are given
the same key: the ratio and the KL of GRPO and VRPO's score differences compare like with like.

Block-diffusion runs (``bd3lm``) score with a logits function that also reads the clean sequence and has blocks
(:class:`difflm.posttrain.forward.BlockLogitsFn`: ``takes_clean``, ``blocks``, ``num_blocks``): :func:`target_logprobs`
hands it the clean rows with the noised ones, and the estimators draw their t once per block of each sample (the
noise unit of every position, :func:`noise_units`), as BD3-LM's training draws one t per block; a plain logits
function (mdlm, sft) has one unit per sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from difflm.objectives.keyed_rng import STREAM_LOGLIK_MASK, STREAM_LOGLIK_T, keyed_uniforms

LogitsFn = Callable[..., torch.Tensor]
"""x [B, S] int64 -> logits [B, S, V] float (the model's forward; the caller closes over padding masks); with a
true attribute ``takes_clean`` it is called ``fn(noisy, clean)`` with the clean rows [B, S] int64 too."""


@dataclass(frozen=True)
class EstimateKey:
    """The noise key of one estimate: e.g. (seed, step, inner iteration). Two estimates with equal keys and sample
    ids draw the same t and masks."""

    fields: tuple[int, ...]

    def __post_init__(self):
        if len(self.fields) > 4:
            raise ValueError(f"an estimate key takes at most 4 fields (draw and sample are added), got {self.fields}")


def sample_uniforms(key: EstimateKey, sample_ids: Sequence[int], n: int = 1) -> torch.Tensor:
    """U[0, 1) numbers [B, n] float64 for each sample (the estimate's t draws), keyed by (key, sample id)."""
    ids = np.asarray(list(sample_ids), dtype=np.int64)
    return torch.from_numpy(keyed_uniforms(STREAM_LOGLIK_T, *key.fields, ids, n=n))


def mask_uniforms(key: EstimateKey, draw: int, sample_ids: Sequence[int], seq_len: int) -> torch.Tensor:
    """U[0, 1) numbers [B, seq_len] float64 per position for mask draw ``draw``, keyed by (key, draw, sample id)."""
    ids = np.asarray(list(sample_ids), dtype=np.int64)
    return torch.from_numpy(keyed_uniforms(STREAM_LOGLIK_MASK, *key.fields, int(draw), ids, n=seq_len))


def noise_units(logits_fn: LogitsFn, x: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
    """(n, units): the number n of t draws per sample and the draw each position of ``x`` [B, S] takes, [B, S] int64 in
    [0, n) (the block of each position: ``logits_fn.blocks`` repeated over the row copies of ``x``; 0 at padding), or
    (1, None) for a logits function without blocks (one t per sample, broadcast as [B, 1])."""
    blocks = getattr(logits_fn, "blocks", None)
    if blocks is None:
        return 1, None
    k = x.shape[0] // blocks.shape[0]
    return int(logits_fn.num_blocks), blocks.repeat(k, 1).clamp(min=0).to(x.device)


def at_positions(t: torch.Tensor, units: Optional[torch.Tensor]) -> torch.Tensor:
    """Each position's t from the per-unit ``t`` [B, n]: [B, S] gathered at ``units``, or ``t`` itself [B, 1] when
    ``units`` is None (:func:`noise_units`)."""
    return t if units is None else t.gather(1, units)


def target_logprobs(logits_fn: LogitsFn, noisy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """log p_theta(x^i | noisy) at every position, [B, S] float32 (log-softmax in FP32 of one forward of ``noisy``;
    a logits function with ``takes_clean`` reads the clean ``x`` too: BD3-LM's ``[x_t ; x_0]``)."""
    logits = logits_fn(noisy, x) if getattr(logits_fn, "takes_clean", False) else logits_fn(noisy)
    if logits.dim() != 3 or logits.shape[:2] != x.shape:
        raise ValueError(f"logits_fn returned {tuple(logits.shape)}; expected [B, S, V] with [B, S] = {tuple(x.shape)}")
    return -F.cross_entropy(logits.float().flatten(0, 1), x.flatten(), reduction="none").view(x.shape)


def check_inputs(x: torch.Tensor, completion: torch.Tensor, prompt: Optional[torch.Tensor]) -> torch.Tensor:
    """The real prompt positions [B, S] bool (``prompt``, or every non-completion position); ValueError on shapes."""
    if x.dim() != 2 or completion.shape != x.shape or completion.dtype != torch.bool:
        raise ValueError(f"x {tuple(x.shape)} must be [B, S] and completion a bool mask of the same shape, got "
                         f"{tuple(completion.shape)} {completion.dtype}")
    if prompt is None:
        return ~completion
    if prompt.shape != x.shape or prompt.dtype != torch.bool or bool((prompt & completion).any()):
        raise ValueError("prompt must be a [B, S] bool mask disjoint from completion")
    return prompt


__all__ = ["EstimateKey", "LogitsFn", "at_positions", "check_inputs", "mask_uniforms", "noise_units", "sample_uniforms",
           "target_logprobs"]
