"""One attention call, several kernels (``model.attention_backend``).

:func:`attend` computes softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, eq. 1) with grouped-query
attention (Ainslie et al. 2023: each KV head serves ``H / H_kv`` query heads), bidirectional for
masked diffusion or causal for the AR baseline, through:

* ``sdpa``:  ``torch.nn.functional.scaled_dot_product_attention``; PyTorch picks cuDNN / flash /
  memory-efficient / math kernels (PyTorch docs, "torch.nn.attention.sdpa_kernel").
* ``te``:    Transformer Engine's ``te.DotProductAttention`` (cuDNN fused attention or TE's flash path),
  ``attn_mask_type="no_mask"`` (diffusion) or ``"causal"`` (AR). CUDA only.
* ``flash``: FlashAttention 4 (``flash_attn.cute``), 3 (``flash_attn_interface``) or 2 (``flash_attn``),
  the first importable. CUDA only, bf16/fp16 only.
* ``flex``:  ``torch.nn.attention.flex_attention``, compiled (CUDA for training; on CPU PyTorch runs its
  eager reference, forward only).

Every backend computes the same function; :func:`attention_unavailable_reason` says why one cannot run.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from difflm.errors import DifflmError
from difflm.training.precision import te_import_error

ATTENTION_BACKENDS = ("sdpa", "te", "flash", "flex")
_FLASH_MODULES = (("flash_attn.cute", 4), ("flash_attn_interface", 3), ("flash_attn", 2))


@functools.lru_cache(maxsize=None)
def flash_attn_func() -> Optional[tuple[Callable, int]]:
    """(``flash_attn_func``, major version) of the newest importable FlashAttention, or None."""
    for module, version in _FLASH_MODULES:
        try:
            fn = getattr(importlib.import_module(module), "flash_attn_func")
        except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA extension
            continue
        return fn, version
    return None


def attention_unavailable_reason(backend: str, device: torch.device, precision: str = "bf16") -> Optional[str]:
    """Why ``model.attention_backend=backend`` cannot run on ``device`` at ``precision``; None when it can."""
    if backend not in ATTENTION_BACKENDS:
        return f"model.attention_backend={backend!r} is not one of: {', '.join(ATTENTION_BACKENDS)}"
    if backend == "sdpa":
        return None
    if backend == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            return (f"model.attention_backend=flex needs torch>=2.5 (this is {torch.__version__}): "
                    "upgrade PyTorch or use model.attention_backend=sdpa")
        if device.type != "cuda":
            return (f"model.attention_backend=flex trains on CUDA only (PyTorch has no FlexAttention backward on "
                    f"{device.type}): use model.attention_backend=sdpa")
        return None
    if device.type != "cuda":
        return (f"model.attention_backend={backend} runs CUDA kernels only and this run is on {device.type}: "
                "use model.attention_backend=sdpa (or flex)")
    if backend == "te":
        error = te_import_error()
        if error is not None:
            return (f"model.attention_backend=te needs Transformer Engine, which could not be imported ({error}): "
                    "pip install 'difflm[te]' on a CUDA machine, or use model.attention_backend=sdpa")
        return None
    # flash
    if flash_attn_func() is None:
        return ("model.attention_backend=flash needs FlashAttention (flash_attn.cute, flash_attn_interface or "
                "flash_attn): pip install 'difflm[flash]', or use model.attention_backend=sdpa")
    if precision not in ("bf16", "fp16", "fp8"):
        return (f"model.attention_backend=flash runs in bf16/fp16 only and precision={precision}: "
                "use precision=bf16 or model.attention_backend=sdpa")
    return None


def _check(backend: str, device: torch.device) -> None:
    reason = attention_unavailable_reason(backend, device)
    if reason is not None:
        raise DifflmError(reason)


# ------------------------------------------------------------------ kernels (bhsd = [B, H, S, D])
def _sdpa(q, k, v, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


@torch.compiler.disable  # an opaque kernel call: a graph break, not traced by dynamo
def _flash(q, k, v, causal: bool) -> torch.Tensor:
    found = flash_attn_func()
    if found is None or q.device.type != "cuda":
        _check("flash", q.device)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise DifflmError(f"model.attention_backend=flash runs in bf16/fp16 and got {q.dtype} inputs: "
                          "use precision=bf16 or model.attention_backend=sdpa")
    fn, _ = found
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)  # takes bshd
    if isinstance(out, tuple):  # FA3/FA4 return (out, lse)
        out = out[0]
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _te_core(num_heads: int, num_kv_heads: int, head_dim: int, causal: bool):
    import transformer_engine.pytorch as te

    return te.DotProductAttention(num_attention_heads=num_heads, kv_channels=head_dim, num_gqa_groups=num_kv_heads,
                                  qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask")


@torch.compiler.disable
def _te(q, k, v, causal: bool) -> torch.Tensor:
    if q.device.type != "cuda":
        _check("te", q.device)
    b, h, s, d = q.shape
    core = _te_core(h, k.shape[1], d, causal)
    # TE infers the layout from strides and reads transposed views as if they were dense bshd: copy.
    out = core(*(t.transpose(1, 2).contiguous() for t in (q, k, v)))  # [B, S, H * D]
    return out.view(b, s, h, d).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.lru_cache(maxsize=64)
def _causal_block_mask(seq_len: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal_mask, None, None, seq_len, seq_len, device=device)


def _flex(q, k, v, causal: bool) -> torch.Tensor:
    block_mask = _causal_block_mask(q.shape[2], str(q.device)) if causal else None
    fn = _flex_fn(q.device.type == "cuda")
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


_KERNELS = {"sdpa": _sdpa, "te": _te, "flash": _flash, "flex": _flex}


def _masked(q, k, v, attn_mask, backend: str) -> torch.Tensor:
    """Attention under an explicit mask (bhsd): dense bool for ``sdpa``, FlexAttention ``BlockMask`` for ``flex``."""
    from torch.nn.attention.flex_attention import BlockMask

    gqa = k.shape[1] != q.shape[1]
    if backend == "sdpa":
        if isinstance(attn_mask, BlockMask):
            raise DifflmError("model.attention_backend=sdpa takes a dense bool attn_mask, not a FlexAttention "
                              "BlockMask: use model.attention_backend=flex or pass a dense mask")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
    if backend == "flex":
        if not isinstance(attn_mask, BlockMask):
            from difflm.model.masks import to_block_mask

            attn_mask = to_block_mask(attn_mask)
        return _flex_fn(q.device.type == "cuda")(q, k, v, block_mask=attn_mask, enable_gqa=gqa)
    raise DifflmError(f"model.attention_backend={backend} cannot take an attention mask (block-causal, document or "
                      "padding masks): use model.attention_backend=sdpa or flex")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, backend: str = "sdpa",
           layout: str = "bhsd", attn_mask=None) -> torch.Tensor:
    """Scaled dot-product attention through ``backend``.

    Args:
        q: [B, H, S, D] (``layout="bhsd"``) or [B, S, H, D] (``"bshd"``), in the compute dtype.
        k, v: same layout with H_kv heads; H_kv divides H (grouped-query attention).
        causal: AR mask when True, full bidirectional attention (diffusion) when False.
        backend: one of :data:`ATTENTION_BACKENDS`.
        attn_mask: optional explicit mask that replaces ``causal``: a dense bool [B | 1, 1, S_q, S_kv] tensor
            (True = attend; ``sdpa``, or ``flex`` after conversion) or a FlexAttention ``BlockMask`` (``flex``).
    Returns: the attention output in q's layout and dtype, [B, H, S, D] or [B, S, H, D].
    Raises: DifflmError when the backend is unknown or cannot run here, or cannot take ``attn_mask``
        (``te``, ``flash``).
    """
    kernel = _KERNELS.get(backend)
    if kernel is None:
        _check(backend, q.device)
    if attn_mask is not None:
        if layout == "bshd":
            return _masked(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, backend).transpose(1, 2)
        return _masked(q, k, v, attn_mask, backend)
    if layout == "bshd":
        return kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)
    return kernel(q, k, v, causal)


__all__ = ["ATTENTION_BACKENDS", "attend", "attention_unavailable_reason", "flash_attn_func"]
