"""Cross-entropy per loss position: the one place the objectives turn logits into -log p(target).

On CUDA with Transformer Engine installed, and ``model.fused_cross_entropy`` on (the default), this is TE's fused
Triton kernel (``transformer_engine.pytorch.cross_entropy.parallel_cross_entropy``, the one Megatron-LM uses): the
forward reads the BF16 logits once, keeps a copy for the backward and two FP32 statistics per row (max and sum of
exponentials), the backward writes the gradient, ``softmax - onehot`` times the upstream gradient, into that copy.
FP32 logits [N, V] are never materialised. With ``consume_logits`` (the training steps, whose logits feed the loss
and nothing else) TE's ``overwrite_input`` skips that copy: the backward writes the gradient into the logits
themselves, which hold it, not logits, after ``backward()`` (one [N, V] BF16 write and its memory less per
micro-batch: ~1.6 GB at ``model=1.7b``, micro-batch 8, S = 4096). Autograd refuses a second use of overwritten
logits (their version counter moves), so a mistaken reuse fails loudly instead of reading a gradient.
The unfused path, ``F.cross_entropy(logits.float())``, writes and reads FP32 [N, V] tensors about ten times per
micro-batch: at ``model=125m`` (V = 50304, 16 k loss rows per 32 k-token micro-batch) that is ~30 GB of memory
traffic per micro-batch. Measured: 1.12x on the 125m step, 1.015x at 350m and 1.7B (docs/performance.md). A
vocab-parallel head (``vocab_group``) keeps :func:`difflm.parallel.vocab_parallel.vocab_parallel_cross_entropy`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _te_cross_entropy() -> Optional[Callable]:
    """TE's ``parallel_cross_entropy``, or None where Transformer Engine cannot be imported."""
    from difflm.training.precision import te_import_error

    if te_import_error() is not None:
        return None
    try:
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
    except ImportError:  # a TE without the fused kernel (or the CPU stand-in)
        return None
    return parallel_cross_entropy


def fused_cross_entropy_available(logits: torch.Tensor) -> bool:
    """Whether :func:`token_cross_entropy` can run TE's fused kernel on ``logits``: CUDA, BF16 or FP32, at least
    one row, and Transformer Engine importable."""
    return (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float32) and logits.dim() == 2
            and logits.shape[0] > 0 and _te_cross_entropy() is not None)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_group=None,
                        fused: bool = True, consume_logits: bool = False) -> torch.Tensor:
    """-log softmax(logits)[target] per row, computed in FP32.

    Args:
        logits: [N, V] (BF16 / FP32 / FP16), or this rank's [N, V/tp] vocabulary slice with ``vocab_group``.
        targets: [N] int64 token ids (-100 rows give 0, as ``F.cross_entropy``'s ``ignore_index``).
        vocab_group: the tensor-parallel group of a vocab-parallel head
            (:func:`difflm.parallel.vocab_parallel.vocab_parallel_cross_entropy`, collective over the group).
        fused: use TE's fused kernel where :func:`fused_cross_entropy_available` (``model.fused_cross_entropy``).
        consume_logits: the caller never reads ``logits`` after the backward, so the fused kernel may write their
            gradient into them (module docstring); contiguous logits only, ignored elsewhere.
    Returns: [N] FP32. Fused and unfused agree to FP32 rounding (``tests/test_cross_entropy.py``).
    """
    if vocab_group is not None:
        from difflm.parallel.vocab_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, targets, vocab_group)
    if fused and fused_cross_entropy_available(logits):
        overwrite = {"overwrite_input": True} if consume_logits and logits.is_contiguous() else {}
        return _te_cross_entropy()(logits.unsqueeze(0), targets, **overwrite).view(-1)
    return F.cross_entropy(logits.float(), targets, reduction="none")


__all__ = ["fused_cross_entropy_available", "token_cross_entropy"]
