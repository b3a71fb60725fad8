"""Keyed randomness: every random draw is a function of a key such as (seed, step, sample), never of a stream.

A sample's diffusion time and mask therefore come out the same however the global batch is split over
micro-batches, data-parallel ranks or a resumed run. Keys are mixed with NumPy's ``SeedSequence``
(NumPy docs, "Parallel Random Number Generation"), which is designed for exactly this.
"""
from __future__ import annotations

import numpy as np
import torch

# Stream ids keep independent uses of the same (seed, step) apart.
STREAM_TRAIN = 0
STREAM_EVAL = 1
STREAM_LENGTH = 2
STREAM_BATCH_T = 3


def key_seed(*key: int) -> int:
    """A 63-bit seed mixed from non-negative integers ``key``."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] >> 1)


def keyed_generator(*key: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``key`` (see :func:`key_seed`)."""
    return torch.Generator().manual_seed(key_seed(*key))


def keyed_uniform(*key: int) -> float:
    """One U[0, 1) draw for ``key``."""
    return float(torch.rand((), generator=keyed_generator(*key)))
