"""One attention call, several kernels (``model.attention_backend``), each saying what it can take.

:func:`attend` computes softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, eq. 1) with grouped-query attention
(Ainslie et al. 2023: each KV head serves ``H / H_kv`` query heads), bidirectional for masked diffusion or causal
for the AR baseline, optionally under a mask, through:

* ``sdpa``:  ``torch.nn.functional.scaled_dot_product_attention``; PyTorch picks cuDNN / flash /
  memory-efficient / math kernels (PyTorch docs, "torch.nn.attention.sdpa_kernel"). Without a mask on Hopper and
  newer GPUs cuDNN's fused attention goes first (:func:`sdpa_priority`): PyTorch's own order puts its
  FlashAttention-2 kernel first, which runs at about half cuDNN's speed there.
* ``te``:    Transformer Engine's ``te.DotProductAttention`` (cuDNN fused attention), ``no_mask`` / ``causal``,
  packed documents as ``qkv_format="thd"`` with ``cu_seqlens`` (TE docs, DotProductAttention, "cu_seqlens note").
  CUDA only. Under ``model.backend=te`` each layer owns its module (``attention.core``: FP8 attention, context
  parallelism); otherwise one module per shape is shared.
* ``flash``: FlashAttention 4 (``flash_attn.cute``), 3 (``flash_attn_interface``) or 2 (``flash_attn``), the first
  importable; packed documents through ``flash_attn_varlen_func``. CUDA only, bf16/fp16 only.
* ``flex``:  ``torch.nn.attention.flex_attention`` with a ``BlockMask`` (compiled on CUDA; on CPU PyTorch runs its
  eager reference, forward only).

Masks (:mod:`difflm.model.masks`) come as a dense bool tensor, a FlexAttention ``BlockMask``, or a structured
:class:`~difflm.model.masks.DocumentMask` / :class:`~difflm.model.masks.BlockDiffusionMask`, which
:func:`prepare_mask` turns into each kernel's own form once per forward. What a kernel cannot take is refused with
one line naming ``model.attention_backend`` and the backends that can (:data:`CAPABILITIES`); nothing falls back
silently.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from difflm.errors import DifflmError
from difflm.model.masks import BlockDiffusionMask, DocumentMask
from difflm.training.precision import te_import_error

ATTENTION_BACKENDS = ("sdpa", "te", "flash", "flex")
_FLASH_MODULES = (("flash_attn.cute", 4), ("flash_attn_interface", 3), ("flash_attn", 2))


@dataclass(frozen=True)
class Capabilities:
    """What one attention kernel takes besides plain bidirectional / causal attention over equal lengths.

    Attributes:
        dense_mask: a dense bool ``[B | 1, 1, S_q, S_kv]`` mask (padded batches, cached block sampling).
        block_mask: a FlexAttention ``BlockMask``.
        block_diffusion: BD3-LM's block-causal mask over ``[x_t ; x_0]`` (``objective=bd3lm``).
        documents: packed documents that must not attend to each other (``data.intra_document_attention``).
        kv_cache: queries and keys of different lengths (KV-cached sampling).
        cpu: runs on the CPU.
    """

    dense_mask: bool
    block_mask: bool
    block_diffusion: bool
    documents: bool
    kv_cache: bool
    cpu: bool


CAPABILITIES = {
    "sdpa": Capabilities(dense_mask=True, block_mask=False, block_diffusion=True, documents=True, kv_cache=True,
                         cpu=True),
    "flex": Capabilities(dense_mask=True, block_mask=True, block_diffusion=True, documents=True, kv_cache=True,
                         cpu=True),
    "te": Capabilities(dense_mask=False, block_mask=False, block_diffusion=False, documents=True, kv_cache=True,
                       cpu=False),
    "flash": Capabilities(dense_mask=False, block_mask=False, block_diffusion=False, documents=True, kv_cache=True,
                          cpu=False),
}

_FEATURES = {  # capability -> how users meet it, for the refusal message
    "dense_mask": "a dense attention mask (padded prompts, cached or exact block sampling)",
    "block_mask": "a FlexAttention BlockMask",
    "block_diffusion": "the block-diffusion mask (objective=bd3lm)",
    "documents": "packed documents (data.intra_document_attention)",
}


def backends_with(feature: str) -> list[str]:
    """The attention backends that take ``feature`` (a :class:`Capabilities` field)."""
    return [name for name, caps in CAPABILITIES.items() if getattr(caps, feature)]


def refuse(backend: str, feature: str) -> DifflmError:
    """The one-line refusal of ``feature`` by ``backend``."""
    able = " or ".join(backends_with(feature))
    return DifflmError(f"model.attention_backend={backend} cannot take {_FEATURES[feature]}: "
                       f"use model.attention_backend={able}")


@functools.lru_cache(maxsize=None)
def flash_attn_module() -> Optional[tuple[object, int]]:
    """(module, major version) of the newest importable FlashAttention (4: ``flash_attn.cute``), or None."""
    for module, version in _FLASH_MODULES:
        try:
            found = importlib.import_module(module)
            getattr(found, "flash_attn_func")
        except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA extension
            continue
        return found, version
    return None


def flash_attn_func() -> Optional[tuple[Callable, int]]:
    """(``flash_attn_func``, major version) of the newest importable FlashAttention, or None."""
    found = flash_attn_module()
    return None if found is None else (found[0].flash_attn_func, found[1])


def attention_unavailable_reason(backend: str, device: torch.device, precision: str = "bf16", *,
                                 training: bool = True, key: str = "model.attention_backend") -> Optional[str]:
    """Why attention ``backend`` cannot run on ``device`` at ``precision``; None when it can.

    Args:
        training: False for forward-only runs (``difflm-eval``, ``difflm-generate``), where FlexAttention also runs on
            the CPU (PyTorch's eager reference; it has no CPU backward).
        key: the setting the message names (``kernels.attention_backend`` when the user overrode a run's kernels).
    """
    if backend not in ATTENTION_BACKENDS:
        return f"{key}={backend!r} is not one of: {', '.join(ATTENTION_BACKENDS)}"
    if backend == "sdpa":
        return None
    if backend == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            return (f"{key}=flex needs torch>=2.5 (this is {torch.__version__}): "
                    f"upgrade PyTorch or use {key}=sdpa")
        if device.type != "cuda" and training:
            return (f"{key}=flex trains on CUDA only (PyTorch has no FlexAttention backward on "
                    f"{device.type}): use {key}=sdpa")
        return None
    if device.type != "cuda":
        also = "" if training else " (or flex)"
        return (f"{key}={backend} runs CUDA kernels only and this run is on {device.type}: "
                f"use {key}=sdpa{also}")
    if backend == "te":
        error = te_import_error()
        if error is not None:
            return (f"{key}=te needs Transformer Engine, which could not be imported ({error}): "
                    f"pip install 'transformer-engine[pytorch]' on a CUDA machine, or use {key}=sdpa")
        return None
    # flash
    if flash_attn_module() is None:
        return (f"{key}=flash needs FlashAttention (flash_attn.cute, flash_attn_interface or "
                f"flash_attn): pip install flash-attn, or use {key}=sdpa")
    if precision not in ("bf16", "fp16", "fp8"):
        return (f"{key}=flash runs in bf16/fp16 only and precision={precision}: "
                f"use precision=bf16 or {key}=sdpa")
    return None


def _check(backend: str, device: torch.device) -> None:
    reason = attention_unavailable_reason(backend, device)
    if reason is not None:
        raise DifflmError(reason)


# ------------------------------------------------------------------ masks in each kernel's form
def prepare_mask(attn_mask, backend: str):
    """``attn_mask`` in the form ``backend`` takes (call once per forward; idempotent):

    * ``sdpa``: a dense bool tensor (structured masks are spelled out);
    * ``flex``: a ``BlockMask`` (dense masks converted, structured ones built from their ``mask_mod``);
    * ``te`` / ``flash``: a :class:`DocumentMask` (its ``cu_seqlens``), nothing else.

    Raises: DifflmError naming the backends that can take the mask when ``backend`` cannot.
    """
    if attn_mask is None:
        return None
    caps = CAPABILITIES[backend]
    if isinstance(attn_mask, DocumentMask):
        if backend == "sdpa":
            return attn_mask.dense()
        if backend == "flex":
            return attn_mask.block_mask()
        attn_mask.varlen()
        return attn_mask
    if isinstance(attn_mask, BlockDiffusionMask):
        if not caps.block_diffusion:
            raise refuse(backend, "block_diffusion")
        return attn_mask.dense() if backend == "sdpa" else attn_mask.block_mask()
    if isinstance(attn_mask, torch.Tensor):
        if not caps.dense_mask:
            raise refuse(backend, "dense_mask")
        if backend == "flex":
            from difflm.model.masks import to_block_mask

            return to_block_mask(attn_mask)
        return attn_mask
    if not caps.block_mask:  # a FlexAttention BlockMask
        raise refuse(backend, "block_mask")
    return attn_mask


# ------------------------------------------------------------------ kernels: (q, k, v) in ``layout`` (bshd | sbhd)
def _to_bhsd(layout: str, *ts):
    dims = (1, 2) if layout == "bshd" else None
    if dims is None:  # sbhd -> bhsd
        return tuple(t.permute(1, 2, 0, 3) for t in ts)
    return tuple(t.transpose(*dims) for t in ts)


def _from_bhsd(layout: str, out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2) if layout == "bshd" else out.permute(2, 0, 1, 3)


def _to_bshd(layout: str, *ts):
    return ts if layout == "bshd" else tuple(t.transpose(0, 1) for t in ts)


@functools.lru_cache(maxsize=None)
def sdpa_priority(device_index: int) -> Optional[tuple]:
    """The SDPA kernel order ``attention_backend=sdpa`` sets for unmasked attention on CUDA device ``device_index``.

    On compute capability 9.0 and newer (H100, H200, B200) with cuDNN present: cuDNN's fused attention, then
    FlashAttention-2, memory-efficient, math. PyTorch's default order there starts with FlashAttention-2, which
    lacks the Hopper tensor-core instructions: on an H200 at ``model=1.7b``'s attention shape (B 4, S 4096, 16 heads
    of 128, bidirectional, BF16) forward + backward took 6.9 ms against cuDNN's 3.9 ms
    (``scripts/attention_speed.py``, docs/performance.md). A kernel that cannot take the call (head size, GQA) passes
    it to the next in the order, as PyTorch's dispatcher does; kernels switched off (``torch.backends.cuda``,
    ``sdpa_kernel``) stay off. Returns None (PyTorch's own order) on older GPUs.
    """
    from torch.nn.attention import SDPBackend

    if torch.cuda.get_device_capability(device_index)[0] < 9 or not torch.backends.cudnn.is_available():
        return None
    return (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


_SDPA_ENABLED = {"CUDNN_ATTENTION": torch.backends.cuda.cudnn_sdp_enabled,
                 "FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled,
                 "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled,
                 "MATH": torch.backends.cuda.math_sdp_enabled}


def _sdpa_context(q: torch.Tensor, k: torch.Tensor, causal: bool, mask):
    """``sdpa_kernel`` with :func:`sdpa_priority`'s order for unmasked CUDA calls, else a no-op. Masked calls keep
    PyTorch's order (its memory-efficient kernel takes dense masks), and so do causal calls with fewer queries than
    keys (KV-cached decoding), where kernels differ in how they align the causal mask. q, k: [B, H, S, D]."""
    if mask is None and q.is_cuda and not (causal and q.shape[2] != k.shape[2]):
        order = sdpa_priority(q.device.index if q.device.index is not None else torch.cuda.current_device())
        if order is not None:
            from torch.nn.attention import sdpa_kernel

            enabled = [b for b in order if _SDPA_ENABLED[b.name]()]  # a user's own sdpa_kernel choice stands
            if enabled:
                return sdpa_kernel(enabled, set_priority=True)
    return contextlib.nullcontext()


def _sdpa(q, k, v, layout: str, causal: bool, mask, core) -> torch.Tensor:
    q, k, v = _to_bhsd(layout, q, k, v)
    with _sdpa_context(q, k, causal, mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return _from_bhsd(layout, out)


@functools.lru_cache(maxsize=None)
def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@functools.lru_cache(maxsize=64)
def _causal_block_mask(q_len: int, kv_len: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal_mask, None, None, q_len, kv_len, device=device)


def _flex(q, k, v, layout: str, causal: bool, mask, core) -> torch.Tensor:
    q, k, v = _to_bhsd(layout, q, k, v)
    if mask is None and causal:
        mask = _causal_block_mask(q.shape[2], k.shape[2], str(q.device))
    out = _flex_fn(q.device.type == "cuda")(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return _from_bhsd(layout, out)


def _flat_tokens(*ts):
    """[B, S, H, D] -> [B * S, H, D] (the ``thd`` layout of variable-length kernels)."""
    return tuple(t.reshape(-1, *t.shape[2:]) for t in ts)


def _flash(q, k, v, layout: str, causal: bool, mask, core) -> torch.Tensor:
    found = flash_attn_module()
    if found is None or q.device.type != "cuda":
        _check("flash", q.device)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise DifflmError(f"model.attention_backend=flash runs in bf16/fp16 and got {q.dtype} inputs: "
                          "use precision=bf16 or model.attention_backend=sdpa")
    module, _ = found
    q, k, v = _to_bshd(layout, q, k, v)
    if isinstance(mask, DocumentMask):
        cu, longest = mask.varlen()
        b, s = q.shape[:2]
        out = module.flash_attn_varlen_func(*_flat_tokens(q, k, v), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                            max_seqlen_q=longest, max_seqlen_k=longest, causal=mask.causal)
        out = (out[0] if isinstance(out, tuple) else out).view(b, s, *q.shape[2:])
    else:
        out = module.flash_attn_func(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out  # FA3/FA4 may return (out, lse)
    return _to_bshd(layout, out)[0]


@functools.lru_cache(maxsize=None)
def _shared_te_core(num_heads: int, num_kv_heads: int, head_dim: int, causal: bool):
    import transformer_engine.pytorch as te

    return te.DotProductAttention(num_attention_heads=num_heads, kv_channels=head_dim, num_gqa_groups=num_kv_heads,
                                  qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask")


def _te(q, k, v, layout: str, causal: bool, mask, core) -> torch.Tensor:
    if q.device.type != "cuda":
        _check("te", q.device)
    shape = q.shape
    if core is None:
        core = _shared_te_core(shape[2], k.shape[2], shape[3], causal)
    if isinstance(mask, DocumentMask):
        q, k, v = _to_bshd(layout, q, k, v)
        cu, longest = mask.varlen()
        out = core(*(t.contiguous() for t in _flat_tokens(q, k, v)), qkv_format="thd",
                   attn_mask_type="padding_causal" if mask.causal else "padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                   max_seqlen_q=longest, max_seqlen_kv=longest)
        return _to_bshd(layout, out.view(q.shape))[0]
    # TE infers the layout from strides and reads strided views as if they were dense: copy those.
    out = core(*(t if t.is_contiguous() else t.contiguous() for t in (q, k, v)), qkv_format=layout)
    return out.view(shape)


_KERNELS = {"sdpa": _sdpa, "te": _te, "flash": _flash, "flex": _flex}
_OPAQUE = {"te": None, "flash": None}  # opaque kernel calls: a graph break under torch.compile, not traced by dynamo


def opaque_kernel(backend: str) -> Optional[Callable]:
    """The kernel :func:`attend` calls for ``backend`` (None for an unknown one): ``te`` / ``flash`` wrapped in
    ``torch.compiler.disable``, the wrapper made once, when a model that uses it is built
    (:class:`difflm.model.transformer.Attention`) rather than at import: the decorator imports torch._dynamo (most of
    a second of a process's start-up), and only CUDA runs call these. Made before any ``torch.compile`` traces the
    model, so dynamo meets a disabled function, never the wrapping."""
    if backend not in _OPAQUE:
        return _KERNELS.get(backend)
    if _OPAQUE[backend] is None:
        _OPAQUE[backend] = torch.compiler.disable(_KERNELS[backend])
    return _OPAQUE[backend]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, backend: str = "sdpa",
           layout: str = "bhsd", attn_mask=None, core=None) -> torch.Tensor:
    """Scaled dot-product attention through ``backend``.

    Args:
        q: [B, H, S_q, D] (``layout="bhsd"``), [B, S_q, H, D] (``"bshd"``) or [S_q, B, H, D] (``"sbhd"``), in the
            compute dtype.
        k, v: same layout with H_kv heads and S_kv positions; H_kv divides H (grouped-query attention); S_kv != S_q
            for KV-cached decoding.
        causal: AR mask when True (and no ``attn_mask``), full bidirectional attention (diffusion) when False.
        backend: one of :data:`ATTENTION_BACKENDS`.
        attn_mask: None, a dense bool [B | 1, 1, S_q, S_kv] tensor (True = attend), a FlexAttention ``BlockMask``, or
            a structured mask of :mod:`difflm.model.masks`; replaces ``causal`` (see :func:`prepare_mask`).
        core: the layer's own ``te.DotProductAttention`` (``backend="te"`` under ``model.backend=te``), or None.
    Returns: the attention output in q's layout and dtype.
    Raises: DifflmError when the backend is unknown or cannot run here, or cannot take ``attn_mask``.
    """
    kernel = opaque_kernel(backend)
    if kernel is None:
        _check(backend, q.device)
    mask = prepare_mask(attn_mask, backend)
    causal = causal and attn_mask is None
    if layout == "bhsd":
        return kernel(*(t.transpose(1, 2) for t in (q, k, v)), "bshd", causal, mask, core).transpose(1, 2)
    return kernel(q, k, v, layout, causal, mask, core)


__all__ = ["ATTENTION_BACKENDS", "CAPABILITIES", "Capabilities", "attend", "attention_unavailable_reason",
           "backends_with", "flash_attn_func", "flash_attn_module", "opaque_kernel", "prepare_mask", "refuse",
           "sdpa_priority"]
