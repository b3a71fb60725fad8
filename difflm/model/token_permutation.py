"""Token permutation of the MoE layer: the T k routed slots of T tokens sorted by expert (permute) and put back in
token order (unpermute), each as one gather forward and one gather backward.

Indexing ``h[order // k]`` and ``y[inverse]`` through autograd gives the same values, but its backward is
``index_put_(accumulate=True)``, which on CUDA sorts the indices again and sums the duplicates with atomics or a
segmented loop. Here the index maps are known both ways (``order`` and its inverse permutation), so both backwards
are gathers too: ``permute``'s gradient is the slot gradients gathered back into token order and summed over the k
slots of each token (one reduction, FP32 accumulation for BF16 inputs); ``unpermute``'s is a gather by ``order``.
Megatron-LM's ``moe_utils.permute`` / ``unpermute`` and torchtitan's ``_permute`` / ``_unpermute`` make the same
split; these stay in PyTorch (no fused kernel) and run on every device.
"""
from __future__ import annotations

import functools

import torch


class SlotOrder:
    """The T k slots of ``expert_ids`` [T, k] int64 sorted by expert (stable: token order inside an expert).

    Attributes:
        order: [T k] int64, slot ids (t k + j) by expert; slots of id E (dropped by capacity) sort last.
        inverse: [T k] int64, the position of each slot in ``order`` (``order[inverse] = arange``).
        top_k: k.
    """

    def __init__(self, expert_ids: torch.Tensor):
        flat = expert_ids.flatten()
        self.order = torch.argsort(flat, stable=True)
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(flat.numel(), device=flat.device)
        self.top_k = expert_ids.shape[1]

    def permute(self, h: torch.Tensor, kept: int) -> torch.Tensor:
        """h [T, d] -> [kept, d]: the token of each of the first ``kept`` sorted slots (``h[order[:kept] // k]``).
        The gradient of the dropped slots (``order[kept:]``) is zero."""
        return _Permute.apply(h, self, kept)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """y [kept, d] expert outputs in sorted-slot order, ``weights`` [T, k] gating weights -> [T, d] in y's dtype:
        ``sum_j weights[t, j] y[inverse[t k + j]]``, the dropped slots adding nothing. On CUDA one Triton kernel each
        way (:mod:`difflm.kernels.moe_combine`: FP32 weights and sums, no [T, k, d] copy); elsewhere, and inside
        ``torch.compile``, or with ``fused=False`` (``model.moe.fused_combine``), :meth:`unpermute` and a batched
        GEMM with the weights in y's dtype."""
        if fused and y.is_cuda and not torch.compiler.is_compiling() and _triton_imports():
            return _Combine.apply(y.contiguous(), weights.contiguous(), self)
        return torch.bmm(weights.unsqueeze(1).to(y.dtype), self.unpermute(y)).squeeze(1)

    def unpermute(self, y: torch.Tensor) -> torch.Tensor:
        """y [kept, d] expert outputs in sorted-slot order -> [T, k, d] in token order, zero rows for the dropped
        slots (``cat(y, zeros)[inverse]``)."""
        return _Unpermute.apply(y, self)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, slots: SlotOrder, kept: int) -> torch.Tensor:
        ctx.slots, ctx.tokens = slots, h.shape[0]
        return h[slots.order[:kept] // slots.top_k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots, t = ctx.slots, ctx.tokens
        dropped = slots.order.numel() - grad.shape[0]
        if dropped:
            grad = torch.cat([grad, grad.new_zeros(dropped, grad.shape[1])])
        per_slot = grad[slots.inverse].view(t, slots.top_k, -1)  # [T, k, d] in token order
        return per_slot.sum(dim=1, dtype=torch.float32).to(grad.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
        ctx.slots, ctx.kept = slots, y.shape[0]
        dropped = slots.order.numel() - y.shape[0]
        if dropped:
            y = torch.cat([y, y.new_zeros(dropped, y.shape[1])])
        return y[slots.inverse].view(-1, slots.top_k, y.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots = ctx.slots
        return grad.reshape(-1, grad.shape[-1])[slots.order[:ctx.kept]], None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, slots: SlotOrder) -> torch.Tensor:
        from difflm.kernels import moe_combine

        ctx.save_for_backward(y, weights)
        ctx.slots = slots
        return moe_combine.forward(y, slots.inverse, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from difflm.kernels import moe_combine

        y, weights = ctx.saved_tensors
        dy, dw = moe_combine.backward(grad.contiguous(), y, ctx.slots.inverse, weights)
        return dy, dw, None


@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    """Whether Triton (shipped with PyTorch's CUDA builds) imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["SlotOrder"]
