"""Where the query, key and value heads sit in the fused QKV projection's output (Megatron-LM's grouping: per KV
head, its ``H / H_kv`` query heads, then its key and its value), read by the eager path
(:mod:`difflm.model.qkv`) and the Triton and FlashAttention kernels of this package."""
from __future__ import annotations

import torch


def head_slots(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Strided views (no copy) of the head slots of ``qkv`` [A0, A1, (H + 2 H_kv) D] (Megatron-LM's grouping, as
    :func:`difflm.model.qkv.split_heads`): (q [A0, A1, H, D] or None, k [A0, A1, H_kv, D], v [A0, A1, H_kv, D]). The query heads of
    a row are one strided run only without grouped-query attention (H = H_kv); with it q is None."""
    lead = qkv.shape[:-1]
    group = num_heads // num_kv_heads
    grouped = qkv.view(*lead, num_kv_heads, group + 2, head_dim)
    return (grouped[..., 0, :] if group == 1 else None), grouped[..., group, :], grouped[..., group + 1, :]


__all__ = ["head_slots"]
