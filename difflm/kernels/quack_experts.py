"""The MoE experts on quack's variable-length grouped GEMMs (``model.moe.fused_experts=true``): the same arithmetic as
:class:`difflm.model.grouped_experts.GroupedSwiGLUMainGrad` with its memory-bound passes moved into GEMM epilogues.

* fc1 with SwiGLU in its epilogue (quack ``gemm_gated`` over ``cu_seqlens_m``: one group of rows per expert,
  the batched weight [E, d, 2f]), writing the pre-activation for the backward and the activation for fc2;
* fc2's input gradient with SwiGLU's derivative in its epilogue (``gemm_dgated``), which also recomputes the
  activation for fc2's weight gradient;
* both weight gradients accumulated into the FP32 ``main_grad`` by the GEMM itself (``gemm_add_inplace`` over
  ``cu_seqlens_k``: out = A^T B + out per expert), where the unfused path writes a BF16 gradient and adds it in a
  second, memory-bound kernel.

The fc1 weight keeps [gate; up] halves; quack's gated epilogues pair neighbouring columns and read that layout
through ``concat_layout``, as :mod:`difflm.kernels.quack_mlp` does for the dense MLP (the same four layouts).
Hopper / Blackwell only (quack's CuTe DSL kernels); the checks are
:func:`difflm.kernels.quack_mlp.quack_unavailable_reason`.
"""
from __future__ import annotations

import torch

from difflm.kernels.quack_mlp import FC1_DGRAD, FC1_FWD, FC1_WGRAD_INTO


def row_groups(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` [E] rows per expert -> cu_seqlens [E + 1] int32 (0, then the running sums): quack's groups."""
    return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


def add_weight_grad(master: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cu: torch.Tensor,
                    concat_layout: tuple | None = None, tuned: bool = False) -> None:
    """``master.main_grad[e] += a_e^T b_e`` for the row groups e of ``cu`` [E + 1] int32 (a [R, m], b [R, n] BF16;
    ``main_grad`` [E, m, n] FP32): an expert GEMM's weight gradient, accumulated by quack's ``gemm_add_inplace`` over
    ``cu_seqlens_k`` (out = A^T B + out per group, the FP32 output read and written in the epilogue). Nothing when
    ``master`` is frozen. ``concat_layout`` names a [gate; up] operand, as in quack's gated GEMMs; ``tuned``: quack's
    autotuned tiles (else its default ones)."""
    if master.requires_grad:
        from quack.gemm_interface import gemm_add_inplace

        gemm_add_inplace(a.T, b, master.main_grad, cu_seqlens_k=cu, tuned=tuned, concat_layout=concat_layout)


class QuackGroupedSwiGLU(torch.autograd.Function):
    """Forward: x [R, d] BF16 rows sorted by expert; ``cu`` [E + 1] int32 (:func:`row_groups`); the FP32 masters
    ``fc1_weight`` [E, 2f, d], ``fc2_weight`` [E, d, f] (gradients added into their ``main_grad``; none returned);
    ``w1``, ``w2`` their BF16 copies (cast once per step); ``tuned``: quack's autotuned tiles for every GEMM of the
    forward and its backward (:func:`difflm.kernels.quack_mlp.tuned_call`), else its default ones. -> [R, d] BF16.
    Backward: ``dy`` [R, d] -> dx [R, d]; ``dW2_e += dy_e^T a_e``, ``dW1_e += dh_e^T x_e`` in the GEMMs' epilogues."""

    @staticmethod
    def forward(ctx, x, cu, fc1_weight, fc2_weight, w1, w2, tuned=False):
        from quack.gemm_interface import gemm, gemm_gated

        preact, postact = gemm_gated(x, w1.transpose(-2, -1), activation="swiglu", cu_seqlens_m=cu,
                                     store_preact=True, tuned=tuned, concat_layout=FC1_FWD)
        y = gemm(postact, w2.transpose(-2, -1), cu_seqlens_m=cu, tuned=tuned)
        ctx.save_for_backward(x, preact, cu, w1, w2)
        ctx.masters, ctx.tuned = (fc1_weight, fc2_weight), tuned
        return y

    @staticmethod
    def backward(ctx, dy):
        from quack.gemm_interface import gemm, gemm_dgated

        x, preact, cu, w1, w2 = ctx.saved_tensors
        (fc1_weight, fc2_weight), tuned = ctx.masters, ctx.tuned
        dy = dy.contiguous().to(torch.bfloat16)
        dpreact, postact = gemm_dgated(dy, w2, preact, activation="swiglu", cu_seqlens_m=cu, tuned=tuned)
        add_weight_grad(fc2_weight, dy, postact, cu, tuned=tuned)
        dx = gemm(dpreact, w1, cu_seqlens_m=cu, tuned=tuned, concat_layout=FC1_DGRAD) if ctx.needs_input_grad[0] \
            else None
        add_weight_grad(fc1_weight, dpreact, x, cu, concat_layout=FC1_WGRAD_INTO, tuned=tuned)
        return dx, None, None, None, None, None, None


__all__ = ["QuackGroupedSwiGLU", "add_weight_grad", "row_groups"]
