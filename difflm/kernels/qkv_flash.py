"""QKV heads and FlashAttention 4 as one autograd function, so the value heads are never copied.

Between the QKV GEMM and the attention kernel :func:`difflm.model.qkv.qkv_heads` writes dense q, k and v, and in the
backward copies the attention kernel's q, k and v gradients into the QKV gradient. The value heads pass through
unchanged both ways, so those copies are pure traffic: a third of the forward kernel's and of the backward kernel's
(at ``model=1.7b``, S = 4096, micro-batch 8, ~270 MB each way per layer and micro-batch). FlashAttention 4 reads
q / k / v with any 16-byte-aligned strides and writes its gradients into buffers it is given
(``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, the functions its own ``FlashAttnFunc``
calls), so here

* forward: the Triton kernel writes q and k; v is the strided view of the QKV output's value slots
  (:func:`difflm.model.qkv.head_slots`); FA4 attends over them and returns the output and the log-sum-exp;
* backward: FA4 writes dk and dv (and dq without grouped-query attention) straight into the QKV gradient's slots;
  the Triton kernel then turns dq / dk into the projection's gradient in place (QK-norm and RoPE backward) and
  leaves the value slots as FA4 wrote them.

The values are those of ``qkv_heads`` followed by ``attend(..., backend="flash")`` (the same kernels on the same
inputs). Used by :class:`difflm.model.transformer.Attention` for ``model.attention_backend=flash`` with FA4, no mask
and no KV cache, on CUDA (:func:`fused_qkv_flash_applies`); everything else takes the two-call path.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from difflm.kernels.qkv_layout import head_slots
from difflm.model.attention import flash_attn_module
from difflm.model.loss_rows import add_at_rows
from difflm.model.qkv import plain_tensors, qk_norm_scales, triton_runs


@functools.lru_cache(maxsize=None)
def fa4_interface():
    """``flash_attn.cute.interface`` when it is FlashAttention 4 with gradient buffers (``dq``/``dk``/``dv`` arguments
    of ``_flash_attn_bwd``) and an LSE output; None otherwise (older or other FlashAttention: the two-call path)."""
    found = flash_attn_module()
    if found is None or found[1] != 4:
        return None
    try:
        from flash_attn.cute import interface
        fwd = inspect.signature(interface._flash_attn_fwd).parameters
        bwd = inspect.signature(interface._flash_attn_bwd).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if not {"return_lse", "causal"} <= set(fwd) or not {"dq", "dk", "dv", "causal"} <= set(bwd):
        return None
    return interface


# FA4 takes its Hopper forward tile from FlashAttention 3's table, tuned on an H100 SXM: 128 x 128 with P.V read from
# registers for heads of 97-128. On the H200, 192 x 128 with P.V from shared memory ran 1.4 % faster at model=1.7b
# (B 8, S 4096, H 16, D 128, bidirectional, with GEMMs between calls: scripts/flash_tiles.py, docs/performance.md
# the sweep of scripts/flash_tiles.py); FA4's own table already picks 192-row tiles for heads of 64 and fewer.
SM90_FORWARD_TILES = {"tile_mn": (192, 128), "mma_pv_is_rs": False}


def forward_tiles(q: torch.Tensor, causal: bool) -> dict:
    """FA4 forward keyword arguments overriding its tile for ``q`` (a [.., H, D] CUDA tensor): :data:`SM90_FORWARD_TILES`
    on a Hopper GPU (compute capability 9.x) for bidirectional attention with D in 97-128, when this FA4 takes them;
    empty (FA4's own table) otherwise."""
    if causal or not 96 < q.shape[-1] <= 128 or not q.is_cuda:
        return {}
    if torch.cuda.get_device_capability(q.device)[0] != 9 or not _takes_tiles():
        return {}
    return SM90_FORWARD_TILES


@functools.lru_cache(maxsize=None)
def _takes_tiles() -> bool:
    return {"tile_mn", "mma_pv_is_rs"} <= set(inspect.signature(fa4_interface()._flash_attn_fwd).parameters)


class _QKVFlashAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D)) v of the q, k, v that :func:`difflm.model.qkv.qkv_heads` makes from ``qkv``; with
    ``rows`` (index [R], cu_seqlens_q [B + 1]) only the queries at those rows, through FA4's variable-length
    interface (the keys and values of every position, one sequence each)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, causal, index,
                cu_seqlens_q, cu_seqlens_k):
        from difflm.kernels import qkv_triton

        q, k, v = qkv_triton.forward(qkv, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim,
                                     dense_v=False)
        varlen = {}
        if index is not None:
            seq_len = qkv.shape[1]
            q, k, v = q.flatten(0, 1).index_select(0, index), k.flatten(0, 1), v.flatten(0, 1)
            varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=seq_len,
                          max_seqlen_k=seq_len)
        out, lse = fa4_interface()._flash_attn_fwd(q, k, v, causal=causal, return_lse=True, **varlen,
                                                   **forward_tiles(q, causal))[:2]
        ctx.save_for_backward(qkv, cos, sin, q_weight, k_weight, q, k, out, lse, index)
        ctx.dims = (eps, num_heads, num_kv_heads, head_dim)
        ctx.causal, ctx.varlen = causal, varlen
        return out

    @staticmethod
    @once_differentiable  # FA4's backward is not differentiable again: refuse create_graph=True loudly
    def backward(ctx, dout):
        from difflm.kernels import qkv_triton

        qkv, cos, sin, q_weight, k_weight, q, k, out, lse, index = ctx.saved_tensors
        eps, num_heads, num_kv_heads, head_dim = ctx.dims
        dqkv = torch.empty_like(qkv)
        dq_slot, dk_slot, dv_slot = head_slots(dqkv, num_heads, num_kv_heads, head_dim)
        v = head_slots(qkv, num_heads, num_kv_heads, head_dim)[2]
        if index is None:
            dq, dk, dv = fa4_interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, causal=ctx.causal,
                                                          dq=dq_slot, dk=dk_slot, dv=dv_slot)[:3]
        else:  # the rows' query gradients, scattered into zeros: the other rows' queries fed nothing
            dq_rows = fa4_interface()._flash_attn_bwd(q, k, v.flatten(0, 1), out, dout.contiguous(), lse,
                                                      causal=ctx.causal, dk=dk_slot.flatten(0, 1),
                                                      dv=dv_slot.flatten(0, 1), **ctx.varlen)[0]
            batch, seq_len = qkv.shape[:2]  # with GQA the query heads have no single slot: a dense [B, S, H, D]
            dq = dq_slot.zero_() if dq_slot is not None else dq_rows.new_zeros(batch, seq_len, *dq_rows.shape[1:])
            add_at_rows(dq, index, dq_rows)  # summed: the padding's zero rows must not overwrite the last loss row
            dk, dv = dk_slot, dv_slot
        dqkv, dq_weight, dk_weight = qkv_triton.backward(dq, dk, dv, qkv, cos, sin, q_weight, k_weight, eps,
                                                         num_heads, num_kv_heads, head_dim, dqkv=dqkv)
        return dqkv, None, None, dq_weight, dk_weight, None, None, None, None, None, None, None, None


def fused_qkv_flash_applies(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], q_norm: Optional[nn.Module],
                            k_norm: Optional[nn.Module], *, backend: str, layout: str, fused: bool, attn_mask,
                            kv_cache, head_dim: int) -> bool:
    """Whether :func:`qkv_flash_attention` serves this attention call.

    Args:
        qkv: the fused QKV projection's output; a bf16/fp16 tensor [B, S, C] that the Triton kernels take
            (:func:`difflm.model.qkv.triton_runs`: ``model.fused_qkv``, plain CUDA tensors, not in ``torch.compile``).
        rope: the (cos, sin) tables; q_norm, k_norm: the QK-norm modules (None without ``model.qk_norm``), whose
            weights must be plain tensors (DTensor tensor parallelism takes the two-call path).
        backend: ``model.attention_backend``; only ``flash`` with FlashAttention 4 (:func:`fa4_interface`).
        layout: the kernel set's activation layout; only batch-first ``bshd`` (not TE's sequence-parallel ``sbhd``).
        attn_mask, kv_cache: both must be None (masks and KV-cached sampling take the two-call path).
        head_dim: D; a multiple of 8, so every head slot of the QKV output is 16-byte aligned for FA4.
    Raises: DifflmError naming ``model.fused_qkv`` when the Triton kernels would run and Triton is not installed."""
    q_weight, k_weight, _ = qk_norm_scales(q_norm, k_norm)
    return (backend == "flash" and layout == "bshd" and attn_mask is None and kv_cache is None
            and head_dim % 8 == 0 and qkv.dtype in (torch.bfloat16, torch.float16)
            and rope[0].shape[-1] == head_dim  # partial rotary: the two-call path (the kernels rotate whole heads)
            and plain_tensors(q_weight, k_weight) and triton_runs(qkv, *rope, fused)
            and fa4_interface() is not None)


def qkv_flash_attention(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                        num_kv_heads: int, head_dim: int, q_norm: Optional[nn.Module], k_norm: Optional[nn.Module],
                        causal: bool, rows=None) -> torch.Tensor:
    """Attention output [B, S, H, D] (contiguous, ``qkv``'s dtype) from the fused QKV projection ``qkv``
    [B, S, (H + 2 H_kv) D]: softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, eq. 1) of the q, k, v that
    :func:`difflm.model.qkv.qkv_heads` makes (QK-norm, RoPE). With ``rows`` (a
    :class:`difflm.model.loss_rows.LossRows`; bidirectional only) the output is [R, H, D] for the queries at those
    rows, each attending to its own sequence's keys and values.

    Args:
        qkv: bf16/fp16 CUDA tensor, this rank's heads in Megatron-LM's grouping (:func:`difflm.model.qkv.split_heads`).
        rope: (cos, sin) float32 tables broadcasting against [B, S, H, D].
        num_heads, num_kv_heads, head_dim: H, H_kv (dividing H: grouped-query attention) and D (a multiple of 8).
        q_norm, k_norm: the QK-norm modules (``weight`` [D] and ``eps``, as :func:`difflm.model.qkv.qkv_heads` takes
            them), or None without ``model.qk_norm``.
        causal: the AR mask; False for diffusion.
    Differentiable once in ``qkv`` and the norm scales. The caller checks :func:`fused_qkv_flash_applies` first;
    what FA4 itself cannot run (a GPU or head size it does not support) fails inside FA4, as ``attend`` does.
    Raises: ValueError for ``rows`` with ``causal``.
    """
    cos, sin = rope
    q_weight, k_weight, eps = qk_norm_scales(q_norm, k_norm)
    if rows is not None and causal:
        raise ValueError("qkv_flash_attention: rows are for bidirectional attention (a causal query needs its "
                         "position in the sequence)")
    varlen = (None, None, None) if rows is None else (rows.index, rows.cu_seqlens_q, rows.cu_seqlens_k)
    return _QKVFlashAttention.apply(qkv.contiguous(), cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads,
                                    head_dim, causal, *varlen)


__all__ = ["SM90_FORWARD_TILES", "fa4_interface", "forward_tiles", "fused_qkv_flash_applies", "qkv_flash_attention"]
