"""Block-size schedules for block diffusion: phases of (steps, block_size).

LLaDA 2.0 (inclusionAI, 2025, "LLaDA2.0: Scaling Up Diffusion Language Models to 100B", sec. 3, "Warmup-Stable-Decay")
converts an AR model by growing the BD3-LM block size in a warmup (block 1 is next-token prediction, then 4, 32, 64,
...), training full-sequence MDLM in a stable phase (block = sequence length: BD3-LM's block_size = L limit), then
shrinking the block again in a decay phase to the block size the model will decode with. ``objective.block_schedule``
lists the phases ``[[steps, block_size], ...]``; the last phase's block size holds after the schedule ends.
"""
from __future__ import annotations

from typing import Sequence

from difflm.errors import DifflmError


def block_size_at(phases: Sequence[Sequence[int]], step: int) -> int:
    """The block size of training step ``step`` (0-based) under ``phases`` = [[steps, block_size], ...].

    Raises: DifflmError for an empty schedule or a phase that is not two positive integers.
    """
    check_block_schedule(phases)
    end = 0
    for steps, size in phases:
        end += int(steps)
        if step < end:
            return int(size)
    return int(phases[-1][1])


def check_block_schedule(phases, seq_len: int | None = None) -> None:
    """Raise a one-line DifflmError unless every phase is [steps >= 1, block_size >= 1] and each block size divides
    ``seq_len`` (when given)."""
    if not phases:
        raise DifflmError("objective.block_schedule is empty: give phases [[steps, block_size], ...] or null")
    for phase in phases:
        if len(phase) != 2 or int(phase[0]) < 1 or int(phase[1]) < 1:
            raise DifflmError(f"objective.block_schedule phase {list(phase)} must be [steps >= 1, block_size >= 1]")
        if seq_len is not None and seq_len % int(phase[1]) != 0:
            raise DifflmError(f"objective.block_schedule block size {phase[1]} does not divide data.seq_len={seq_len}: "
                              f"use divisors of the sequence length (data.seq_len itself is full-sequence MDLM)")
