"""The token embedding with its weight gradient added in place into FP32 ``main_grad``, as the TE kernel set's linear
layers do (:func:`difflm.model.te_kernels.accumulate_into_grad`).

``nn.Embedding`` under autocast gathers FP32 rows, which the residual stream then casts to the compute dtype
(:meth:`difflm.model.te_kernels.TEKernels.enter`). Its backward casts the BF16 gradient to FP32, zero-fills a dense
[V, d] FP32 gradient, sums the rows into it, and autograd adds that to ``.grad`` at every micro-batch after the
first: at ``model=1.7b`` (V = 50,304, d = 2,048, two micro-batches of 32 k tokens) ~2.5 GB of memory traffic a step
for a gradient with at most 32 k rows of content. :class:`Embedding`, once its weight accumulates in ``main_grad``,
gathers from the weight cast to the compute dtype once per optimizer step
(:func:`difflm.model.te_kernels.weights_cast_once_per_step`; the same values: rounding then gathering equals
gathering then rounding) and adds the rows' gradients into ``main_grad`` with ``index_add_``. On CUDA those are
atomic FP32 adds, so the summation order of a token repeated in a micro-batch varies between runs (as in FA4's
backward); the sums agree to FP32 rounding.

Everywhere else (no ``main_grad``: the torch kernel set, FSDP2, pipeline stages; forwards without gradients or
outside autocast) it is ``nn.Embedding``; the parameter is ``weight`` [V, d] either way, so checkpoints do not
change.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from difflm.kernels.main_grad import weights_cast_once_per_step


class _GatherIntoMainGrad(torch.autograd.Function):
    """``table[ids]``, whose gradient is added into ``weight.main_grad`` (returns no gradient for ``weight``)."""

    @staticmethod
    def forward(ctx, ids, weight, table):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype))
        return None, None, None


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose training forwards under autocast, once the weight accumulates its gradient in
    ``main_grad`` (module docstring), gather from the weight cast once per step and add the gradient in place.

    Input: [...] int64 token ids; output [..., d] in the autocast dtype on that path, else ``nn.Embedding``'s (the
    weight's dtype). ``is_first_microbatch``: TE's micro-batch flag, which the FP8 pre-hook of
    :func:`difflm.model.te_kernels.accumulate_into_grad` hands every such module; unused (the cast is keyed by
    optimizer steps already)."""

    def forward(self, ids: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        w = self.weight
        device_type = ids.device.type
        if (getattr(w, "accumulates_in_main_grad", False) and getattr(w, "main_grad", None) is not None
                and torch.is_grad_enabled() and w.requires_grad and type(w) is nn.Parameter
                and torch.is_autocast_enabled(device_type) and self.padding_idx is None and self.max_norm is None):
            (table,) = weights_cast_once_per_step(self, [w], torch.get_autocast_dtype(device_type))
            return _GatherIntoMainGrad.apply(ids, w, table)
        return super().forward(ids)


__all__ = ["Embedding"]
