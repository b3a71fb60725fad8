"""Queries, keys and values from the fused QKV projection: split into heads, QK-norm, RoPE, as one fused kernel.

Between the QKV GEMM and the attention kernel sit only memory-bound steps: the split into heads, RMSNorm of queries
and keys (``model.qk_norm``), the rotary embedding and the copies that make q / k / v dense for the attention
kernel. Run one by one they read and write the activations about ten times forward and backward (on an H200 at
``model=1.7b``, S = 4096, ~125 ms of a 1.6 s step went to those norms, RoPE kernels, strided copies and the
backward's concatenation). :func:`qkv_heads` writes them as one function; on CUDA (``model.fused_qkv=true``) it runs
as two Triton kernels (:mod:`difflm.kernels.qkv_triton`): one pass forward that writes dense q, k and v, one pass
backward that writes the gradient of the QKV output and the norm scales' partial sums. Both kernel sets use it, so
the torch and Transformer Engine models compute the same values; inside blocks compiled by ``model.compile`` the
eager composition is traced instead, for Inductor to fuse with its neighbours.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from difflm.errors import DifflmError
from difflm.kernels.qkv_layout import head_slots  # noqa: F401  (the layout, also read from here)
from difflm.model.layers import rms_norm
from difflm.model.rope import apply_rope


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of q [..., H, D], k and v [..., H_kv, D] in the fused QKV output ``qkv`` [..., (H + 2 H_kv) D], whose rows
    are grouped per KV head (H / H_kv query heads, then the key head, then the value head: Megatron-LM's layout,
    see :mod:`difflm.model.transformer`)."""
    lead = qkv.shape[:-1]
    group = num_heads // num_kv_heads
    grouped = qkv.view(*lead, num_kv_heads, group + 2, head_dim)
    q, k, v = grouped.split([group, 1, 1], dim=-2)
    return (q.reshape(*lead, num_heads, head_dim), k.reshape(*lead, num_kv_heads, head_dim),
            v.reshape(*lead, num_kv_heads, head_dim))


def _qkv_heads(qkv, cos, sin, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
    q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.contiguous(), k.contiguous(), v.contiguous()


class _QKVHeadsTriton(torch.autograd.Function):
    """:func:`qkv_heads` through the Triton kernels of :mod:`difflm.kernels.qkv_triton` (one pass each way)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        from difflm.kernels import qkv_triton

        q, k, v = qkv_triton.forward(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
        ctx.save_for_backward(qkv, cos, sin, q_weight, k_weight)
        ctx.dims = (eps, num_heads, num_kv_heads, head_dim)
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        from difflm.kernels import qkv_triton

        qkv, cos, sin, q_weight, k_weight = ctx.saved_tensors
        dqkv, dq_weight, dk_weight = qkv_triton.backward(gq, gk, gv, qkv, cos, sin, q_weight, k_weight, *ctx.dims)
        return dqkv, None, None, dq_weight, dk_weight, None, None, None, None


def qkv_heads_triton(qkv, cos, sin, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
    """The fused path of :func:`qkv_heads` (``qkv`` [A0, A1, C] contiguous, any device Triton runs on: CUDA, or the CPU
    under ``TRITON_INTERPRET=1``); differentiable in ``qkv`` and the norm scales."""
    return _QKVHeadsTriton.apply(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)


def plain_tensors(*tensors) -> bool:
    """Whether every tensor is None or a plain tensor / parameter (not a DTensor or another subclass)."""
    return all(t is None or type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


def qk_norm_scales(q_norm: Optional[nn.Module], k_norm: Optional[nn.Module]):
    """(q_weight, k_weight, eps) the kernels read from the QK-norm modules: their ``weight`` [D] and the RMSNorm
    epsilon, or (None, None, 0.0) without ``model.qk_norm``."""
    if q_norm is None:
        return None, None, 0.0
    return q_norm.weight, k_norm.weight, float(q_norm.eps)


def triton_runs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> bool:
    """Whether the Triton kernels take this call: ``model.fused_qkv``, a plain 3-D CUDA ``qkv`` with plain RoPE
    tables, outside ``torch.compile`` (which traces the eager composition instead).
    Raises: DifflmError naming ``model.fused_qkv`` when they would and Triton is not installed."""
    if not (fused and qkv.is_cuda and not torch.compiler.is_compiling() and plain_tensors(qkv, cos, sin)
            and qkv.dim() == 3):
        return False
    try:
        import triton  # noqa: F401 - shipped with PyTorch's CUDA builds
    except ImportError as err:
        raise DifflmError("model.fused_qkv=true runs the QKV split/QK-norm/RoPE as Triton kernels and Triton is "
                          "not installed: pip install triton, or set model.fused_qkv=false") from err
    return True


def qkv_heads(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
              head_dim: int, q_norm: Optional[nn.Module] = None, k_norm: Optional[nn.Module] = None,
              fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense q, k, v of one attention layer from its fused QKV projection.

    Args:
        qkv: [B, S, (H + 2 H_kv) D] (or [S, B, ...] sequence-first) in the compute dtype, this rank's heads.
        rope: (cos, sin) float32 tables broadcasting against [B, S, H, D] (:func:`difflm.model.rope.rope_tables`).
        num_heads, num_kv_heads, head_dim: H, H_kv (H_kv divides H: grouped-query attention) and D.
        q_norm, k_norm: the QK-norm modules (anything with ``weight`` [D] and ``eps``: RMSNorm, Henry et al. 2020 /
            Dehghani et al. 2023 ``x / rms(x) * weight`` per head), or None without ``model.qk_norm``. Their
            weights are read directly, unless they are DTensors (torch tensor parallelism): then the modules run,
            with the layout hooks they carry.
        fused: run the Triton kernels on CUDA (training, evaluation and sampling alike); the eager composition
            otherwise (the CPU, DTensor inputs, inside ``torch.compile``, partial rotary tables narrower than D:
            the kernels rotate whole heads), which computes the same.
    Raises: DifflmError naming ``model.fused_qkv`` when Triton is not installed.
    Returns: q [B, S, H, D], k and v [B, S, H_kv, D], each contiguous (what the attention kernels read without a
        copy), in ``qkv``'s dtype. The norm and the rotation are computed in float32 (the norm's output rounded to the
        compute dtype first, as an unfused norm module returns it).
    """
    cos, sin = rope
    q_weight, k_weight, eps = qk_norm_scales(q_norm, k_norm)
    if not plain_tensors(q_weight, k_weight):  # DTensor TP: the norm modules carry the layout (SequenceParallel hooks)
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        q, k = apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
        return q.contiguous(), k.contiguous(), v.contiguous()
    args = (qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
    if cos.shape[-1] == head_dim and triton_runs(qkv, cos, sin, fused):  # partial rotary: the eager path
        return qkv_heads_triton(qkv.contiguous(), *args[1:])
    return _qkv_heads(*args)


__all__ = ["head_slots", "plain_tensors", "qk_norm_scales", "qkv_heads", "split_heads", "triton_runs"]
