"""Keyed randomness: every random draw is a function of a key such as (seed, step, sample), never of a stream.

A sample's diffusion time and mask therefore come out the same however the global batch is split over
micro-batches, data-parallel ranks or a resumed run.

Counter-based generation (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"): a key is hashed to
64 bits, and the n-th number of the key is the SplitMix64 output of ``hash + (n + 1) * gamma`` (Steele, Lea & Flood
2014, "Fast splittable pseudorandom number generators", sec. 3: the golden-ratio gamma and the MurmurHash3-style
finaliser), taken to [0, 1) with 53 bits. Any number of any key is computed directly, vectorised over keys and
counters (one NumPy expression for a whole micro-batch's masks, no generator objects), on any host with the same
bits.

Every draw names its stream (what the numbers are used for), and a key has one fixed layout: ``[stream, number of
fields, field_0, ..., field_{MAX_FIELDS-1}]`` (64-bit words, unused fields 0), hashed word by word. Two different
(stream, fields) pairs therefore never hash the same words, so no two uses draw the same numbers (a collision of the
64-bit hash aside).
"""
from __future__ import annotations

from typing import Union

import numpy as np

from difflm.errors import DifflmError

# Streams: the fixed first word of every key. The fields each stream takes are listed beside it.
STREAM_T = 0          # diffusion time of one sample (or one BD3-LM block): (*noise key, unit)
STREAM_BATCH_T = 1    # the shared u of antithetic t over a global batch: (*noise key)
STREAM_MASK = 2       # the Bernoulli mask row of one sample: (*noise key, sample)
STREAM_LENGTH = 3     # the random-length coin and length of a step: (seed, step)
STREAM_EVAL_T = 4     # the NELBO estimate's per-sequence (or per-block) u: (seed, unit)
STREAM_EVAL_MASK = 5  # the NELBO estimate's mask row of one draw: (seed, draw, sample)
STREAM_LOGLIK_T = 6   # a post-training log-likelihood estimate's t of one sample: (*estimate key, sample)
STREAM_LOGLIK_MASK = 7  # its mask row of one draw: (*estimate key, draw, sample)
STREAM_ROLLOUT = 8    # the seed of one rollout sample's sampler generator: (seed, step, sample)
STREAM_ANNEAL = 9     # the annealed attention mask of a step, one row of keys per query: (seed, step, query)
NUM_STREAMS = 10

MAX_FIELDS = 6
_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: SplitMix64's increment
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
Field = Union[int, np.ndarray]


SEED_LIMIT = 2**63  # seeds are keys of every draw and seed torch's and NumPy's generators: int64-sized


def check_seed(value, key: str, generator_only: bool = False) -> int:
    """``value`` of the seed setting ``key`` as an int, checked before any work: in [0, 2**63) for a seed that keys
    random draws (``train.seed``, ``eval.seed``, the harness's ``seed``: :func:`key_hash` takes no negative field and
    torch's generators take at most 64 bits); with ``generator_only`` (``gen.seed``, which only seeds a
    ``torch.Generator``) in ``torch.Generator.manual_seed``'s range [-2**63, 2**64).

    Raises: DifflmError naming the key and the range."""
    low, high, span, why = ((-2**63, 2**64, "[-2**63, 2**64)", "it seeds torch's generator") if generator_only
                            else (0, SEED_LIMIT, "[0, 2**63)", "it keys every random draw"))
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= int(value) < high:
        raise DifflmError(f"{key}={value} must be an integer in {span} ({why}): e.g. {key}=0")
    return int(value)


def _finalise(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``z + gamma`` (uint64, wrapping arithmetic), elementwise."""
    z = z + _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _field(f: Field) -> np.ndarray:
    a = np.asarray(f)
    if a.dtype.kind not in "iu":
        raise ValueError(f"random key field {f!r} must be an integer (seeds, steps and ids are non-negative ints)")
    if a.size and a.min() < 0:
        raise ValueError(f"random key field {f!r} must be in [0, 2**64) (seeds and ids are non-negative)")
    return a.astype(np.uint64)


def key_hash(stream: int, *fields: Field) -> np.ndarray:
    """The 64-bit hash of a key (see the module docstring), uint64 with the broadcast shape of the fields (a field may
    be a 1-D array of ids: one key per entry).

    Raises: ValueError for an unknown stream, more than :data:`MAX_FIELDS` fields, or a field outside [0, 2**64).
    """
    if not 0 <= int(stream) < NUM_STREAMS:
        raise ValueError(f"unknown random stream {stream}")
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"a random key takes at most {MAX_FIELDS} fields, got {len(fields)}: {fields}")
    for f in fields:
        if isinstance(f, int) and not 0 <= f < 2**64:
            raise ValueError(f"random key field {f} must be in [0, 2**64) (seeds and ids are non-negative)")
    words = [np.uint64(stream), np.uint64(len(fields)), *map(_field, fields)]
    words += [np.uint64(0)] * (MAX_FIELDS - len(fields))
    h = np.zeros(np.broadcast_shapes(*(np.shape(w) for w in words)), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for w in words:
            h = _finalise(h ^ w)
    return h


def keyed_uniforms(stream: int, *fields: Field, n: int = 1) -> np.ndarray:
    """The first ``n`` U[0, 1) numbers of each key, float64 ``[*key shape, n]``."""
    h = key_hash(stream, *fields)[..., None]
    counters = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _finalise(h + counters * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def keyed_uniform(stream: int, *fields: int) -> float:
    """One U[0, 1) draw for the key (the key's first number)."""
    return float(keyed_uniforms(stream, *fields)[..., 0])
