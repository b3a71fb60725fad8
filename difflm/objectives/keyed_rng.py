"""Keyed randomness: every random draw is a function of a key such as (seed, step, sample), never of a stream.

A sample's diffusion time and mask therefore come out the same however the global batch is split over
micro-batches, data-parallel ranks or a resumed run. Keys are mixed with NumPy's ``SeedSequence``
(NumPy docs, "Parallel Random Number Generation"), which is designed for exactly this.

Every draw names its stream (what the numbers are used for), and the words given to ``SeedSequence`` have one
fixed layout: ``[stream, number of fields, field_0 (2 words), ..., field_{MAX_FIELDS-1} (2 words)]``, unused
fields 0. Two different (stream, fields) pairs therefore never give the same words, so no two uses can draw the
same numbers. (``SeedSequence`` zero-pads short entropy and splits large ints into a variable number of 32-bit
words: keys of bare ints of different lengths, such as (seed, 0, 2) and (seed, 0, 2, 0), would collide.)
"""
from __future__ import annotations

import numpy as np
import torch

# Streams: the fixed first word of every key. The fields each stream takes are listed beside it.
STREAM_T = 0          # diffusion time of one sample (or one BD3-LM block): (*noise key, unit)
STREAM_BATCH_T = 1    # the shared u of antithetic t over a global batch: (*noise key)
STREAM_MASK = 2       # the Bernoulli mask row of one sample: (*noise key, sample)
STREAM_LENGTH = 3     # the random-length coin and length of a step: (seed, step)
STREAM_EVAL_T = 4     # the NELBO estimate's per-sequence (or per-block) u: (seed, unit)
STREAM_EVAL_MASK = 5  # the NELBO estimate's mask row of one draw: (seed, draw, sample)
NUM_STREAMS = 6

MAX_FIELDS = 6
_WORD = 1 << 32


def key_words(stream: int, *fields: int) -> np.ndarray:
    """The fixed-length uint32 words of a key (see the module docstring), ``[2 + 2 * MAX_FIELDS]``.

    Raises: ValueError for an unknown stream, more than :data:`MAX_FIELDS` fields, or a field outside [0, 2**64).
    """
    if not 0 <= int(stream) < NUM_STREAMS:
        raise ValueError(f"unknown random stream {stream}")
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"a random key takes at most {MAX_FIELDS} fields, got {len(fields)}: {fields}")
    words = np.zeros(2 + 2 * MAX_FIELDS, dtype=np.uint32)
    words[0], words[1] = int(stream), len(fields)
    for j, f in enumerate(fields):
        f = int(f)
        if not 0 <= f < _WORD * _WORD:
            raise ValueError(f"random key field {f} must be in [0, 2**64) (seeds and ids are non-negative)")
        words[2 + 2 * j], words[3 + 2 * j] = f % _WORD, f // _WORD
    return words


def key_seed(stream: int, *fields: int) -> int:
    """A 63-bit seed mixed from ``stream`` and non-negative integer ``fields`` (:func:`key_words`)."""
    return int(np.random.SeedSequence(key_words(stream, *fields)).generate_state(1, np.uint64)[0] >> 1)


def keyed_generator(stream: int, *fields: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from the key (see :func:`key_seed`)."""
    return torch.Generator().manual_seed(key_seed(stream, *fields))


def keyed_uniform(stream: int, *fields: int) -> float:
    """One U[0, 1) draw for the key."""
    return float(torch.rand((), generator=keyed_generator(stream, *fields)))
