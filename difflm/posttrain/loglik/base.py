"""What every log-likelihood estimator shares: keyed noise and the per-position log-probabilities of one forward.

An estimator takes a logits function (the policy, its frozen reference, or an enumerable test model), clean
sequences ``x`` [B, S] int64 (prompt and completion), the completion positions [B, S] bool and a noise key, and
returns per-position terms [B, S] float32, zero off the completion, whose row sums estimate the completion's
log-likelihood given the prompt. The noise is a function of (key, sample id) only (:mod:`difflm.objectives.keyed_rng`),
so the policy, the rollout-time ("old") policy and the reference see the same t and masks whenever they are given
the same key: the ratio and the KL of GRPO and VRPO's score differences compare like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from difflm.objectives.keyed_rng import STREAM_LOGLIK_MASK, STREAM_LOGLIK_T, keyed_uniforms

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""x [B, S] int64 -> logits [B, S, V] float (the model's forward; the caller closes over padding masks)."""


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


def target_logprobs(logits_fn: LogitsFn, noisy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """log p_theta(x^i | noisy) at every position, [B, S] float32 (log-softmax in FP32 of one forward of ``noisy``)."""
    logits = logits_fn(noisy)
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


__all__ = ["EstimateKey", "LogitsFn", "check_inputs", "mask_uniforms", "sample_uniforms", "target_logprobs"]
