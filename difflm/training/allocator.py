"""The CUDA caching allocator's mode for training: expandable segments (``train.expandable_segments``).

Masked diffusion gives every micro-batch a different number of loss rows (the masked positions), so the LM head's
logits and their gradient, ``[N_masked, V]`` BF16, change size every micro-batch. With PyTorch's default allocator
those sizes fragment the cached segments and the allocator keeps asking CUDA for new ones (``cudaMalloc`` /
``cudaFree``, which synchronise): on an H200 at ``model=1.7b``, FP8, S = 2048, micro-batch 4 (a step bound by the
host's kernel launches) the trainer ran 54.4 k tokens/s with the default allocator and 60.1 k with expandable
segments (the next call on the same machine), against 62.0 k for ``scripts/benchmark.py``, whose pre-drawn batches
repeat their sizes (docs/performance.md). Expandable segments grow one mapping per stream in place instead (PyTorch docs, "CUDA
semantics: Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). The trainer, the benchmark's rows and the loading of
a trained run (``difflm-eval``, ``difflm-generate``, the lm-eval harness: the run's own setting) apply it.
"""
from __future__ import annotations

import os

import torch

SETTING = "expandable_segments:True"


def use_expandable_segments(enabled: bool, device: torch.device) -> bool:
    """Switch this process's CUDA caching allocator to expandable segments for the allocations that follow.

    Args:
        enabled: ``train.expandable_segments``.
        device: the run's device; nothing changes off CUDA.
    Returns: True when the setting was applied. False when disabled, off CUDA, or when the environment already has
    ``PYTORCH_CUDA_ALLOC_CONF`` (the user's own allocator settings win, whatever they say).
    """
    if not enabled or device.type != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return False
    # torch.cuda.memory._set_allocator_settings applies PYTORCH_CUDA_ALLOC_CONF's syntax at run time (the variable
    # itself is read once, when CUDA starts, which may have happened already: process-group set-up, a prior run).
    torch.cuda.memory._set_allocator_settings(SETTING)
    return True


__all__ = ["SETTING", "use_expandable_segments"]
