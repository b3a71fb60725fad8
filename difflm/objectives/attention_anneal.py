"""Attention-mask annealing from causal to bidirectional (DiffuLLaMA; Gong et al. 2025, "Scaling Diffusion Language
Models via Adaptation from Autoregressive Models", sec. 3.2 "Attention mask annealing").

An AR checkpoint has only ever attended to the past. During the first ``N`` steps of adaptation each query keeps
its causal keys and additionally sees every future key independently with probability

    r(s) = min(1, (s + 1) / N)                                      (their linear annealing ratio)

at training step s, so the mask grows from causal (r ~ 0) to fully bidirectional (r = 1, after which no mask is
passed and the plain bidirectional kernels run). One mask per step, shared by every row of the global batch (as in
their implementation); its random part is keyed by (seed, step, query) on the stream
:data:`~difflm.objectives.keyed_rng.STREAM_ANNEAL`, so every data-parallel layout and every resume draws the same mask.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from difflm.objectives.keyed_rng import STREAM_ANNEAL, keyed_uniforms


def anneal_ratio(step: int, anneal_steps: int) -> float:
    """r(s) = min(1, (s + 1) / N): the probability that a query sees a given future key at step ``step``.
    ``anneal_steps`` N <= 0 means no annealing (1.0)."""
    if anneal_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / anneal_steps)


def anneal_mask(seq_len: int, step: int, anneal_steps: int, seed: int) -> Optional[torch.Tensor]:
    """The attention mask of step ``step``: [1, 1, S, S] bool (True = attend), query i sees key j iff j <= i or
    u(seed, step, i)_j < r(s); None once r(s) = 1 (full bidirectional attention)."""
    r = anneal_ratio(step, anneal_steps)
    if r >= 1.0:
        return None
    u = torch.from_numpy(keyed_uniforms(STREAM_ANNEAL, seed, step, np.arange(seq_len, dtype=np.int64), n=seq_len))
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (causal | (u < r))[None, None]
