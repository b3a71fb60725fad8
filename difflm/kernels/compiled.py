"""Regions of eager PyTorch code compiled by ``torch.compile`` (Inductor) on the GPU: the elementwise ops, gathers and
row reductions of a small function fused into a few generated Triton kernels, where eager PyTorch issues one kernel
per op. Used where a step is bound by the host issuing many small kernels: the FP8 experts' quantisation and padding
(:mod:`difflm.model.grouped_experts`)."""
from __future__ import annotations

import functools

import torch


def fused_on_gpu(fn):
    """``fn`` run as one ``torch.compile``d region when its first argument is a CUDA tensor, eager elsewhere (the CPU
    runs the same function op by op, so CPU tests check the arithmetic and GPU tests hold the compiled region to it).

    For functions whose shapes are fixed for a run: each compiles once per shape (``dynamic=False``). Inductor computes
    a region in FP32 without rounding its intermediates to the inputs' dtype, so values may differ from the eager ops
    by that rounding. Inside ``model.compile`` the block's own compile traces ``fn``. The eager function stays
    reachable as ``.eager``."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if not args[0].is_cuda or torch.compiler.is_compiling():  # inside model.compile: traced with the block
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        return compiled(*args)

    call.eager = fn
    return call


__all__ = ["fused_on_gpu"]
