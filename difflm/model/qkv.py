"""Queries, keys and values from the fused QKV projection: split into heads, QK-norm, RoPE, as one fused kernel.

Between the QKV GEMM and the attention kernel sit only memory-bound steps: the split into heads, RMSNorm of queries
and keys (``model.qk_norm``), the rotary embedding and the copies that make q / k / v dense for the attention
kernel. Run one by one they read and write the activations about ten times forward and backward (on an H200 at
``model=1.7b``, S = 4096, ~125 ms of a 1.6 s step went to those norms, RoPE kernels, strided copies and the
backward's concatenation). :func:`qkv_heads` writes them as one function; on CUDA, while training, it runs through
``torch.compile`` (``model.fused_qkv=true``), which fuses the forward into one pass that writes dense q, k and v and
the backward into one pass that writes the gradient of the QKV output. Both kernel sets use it, so the torch and
Transformer Engine models compute the same values.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from difflm.errors import DifflmError
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


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_qkv_heads, dynamic=False, fullgraph=True)


def _plain(*tensors) -> bool:
    return all(t is None or type(t) in (torch.Tensor, nn.Parameter) for t in tensors)


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
        fused: run the compiled kernel on CUDA while gradients are on (training); the eager composition otherwise
            (evaluation and sampling, whose shapes vary from call to call, and the CPU), which computes the same.
    Raises: DifflmError naming ``model.fused_qkv`` when torch.compile cannot build the kernel (no Triton).
    Returns: q [B, S, H, D], k and v [B, S, H_kv, D], each contiguous (what the attention kernels read without a
        copy), in ``qkv``'s dtype. The norm and the rotation are computed in float32 (the norm's output rounded to the
        compute dtype first, as an unfused norm module returns it).
    """
    cos, sin = rope
    q_weight = None if q_norm is None else q_norm.weight
    k_weight = None if k_norm is None else k_norm.weight
    if not _plain(q_weight, k_weight):  # DTensor TP: the norm modules carry the layout (SequenceParallel hooks)
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        q, k = apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
        return q.contiguous(), k.contiguous(), v.contiguous()
    eps = 0.0 if q_norm is None else float(q_norm.eps)
    args = (qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)
    if (fused and qkv.is_cuda and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and _plain(qkv, cos, sin)):
        try:
            return _compiled()(*args)
        except Exception as err:  # noqa: BLE001 - an Inductor/Triton failure: name the switch that avoids it
            if isinstance(err, DifflmError) or "BackendCompilerFailed" not in type(err).__name__:
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DifflmError(f"model.fused_qkv=true compiles the QKV split/QK-norm/RoPE with torch.compile, which "
                              f"failed here ({first}): set model.fused_qkv=false") from err
    return _qkv_heads(*args)


__all__ = ["qkv_heads", "split_heads"]
