"""Attention masks: dense boolean masks for SDPA and the equivalent FlexAttention ``BlockMask``.

Convention everywhere: ``True`` = the query may attend to the key (``F.scaled_dot_product_attention``'s
boolean ``attn_mask`` and FlexAttention's ``mask_mod``). Dense masks are ``[B | 1, 1, S_q, S_kv]`` bool.

* :func:`block_causal_mask` - BD3-LM's training mask over ``[x_t ; x_0]`` (Arriola et al. 2025,
  "Block Diffusion", sec. 3.2 / their ``block_diff_mask``), or with ``clean_causal`` Megatron-Bridge's
  ``sbd_block_diff`` mask, whose clean half attends causally.
* :func:`block_causal_inference_mask` - the same pattern over one (clean prefix + noisy block) sequence;
  :func:`causal_prefix_inference_mask` - its ``clean_causal`` counterpart.
* :func:`document_mask` - block-diagonal mask of packed documents (intra-document attention).
* :func:`key_padding_mask` - padded batches: every query sees the real keys (and itself).
* :func:`to_block_mask` - any dense mask as a ``BlockMask`` (for ``model.attention_backend=flex``).

Structured masks describe a pattern instead of spelling it out, so each attention kernel can take it in its own
form (:func:`difflm.model.attention.prepare_mask`): a dense tensor for SDPA, a ``BlockMask`` for FlexAttention, or
the cumulative document lengths (``cu_seqlens``) of the variable-length kernels of Transformer Engine and
FlashAttention, which never see a mask at all:

* :class:`DocumentMask` - packed documents (intra-document attention), bidirectional or causal.
* :class:`BlockDiffusionMask` - BD3-LM's training mask over ``[x_t ; x_0]``, optionally within documents.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from difflm.errors import DifflmError

# FlexAttention's sparse block size. ``create_block_mask`` defaults to 128; the kernel must be called with a
# BlockMask built for the *same* Q/KV lengths and block size, so we always pass it explicitly.
FLEX_BLOCK_SIZE = 128


def block_causal_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu",
                      clean_causal: bool = False) -> torch.Tensor:
    """BD3-LM training mask over the ``2 L`` tokens ``[x_t ; x_0]``, ``[1, 1, 2L, 2L]`` bool.

    With ``b(i) = (i mod L) // block_size`` the block of position i and ``noisy(i) = i < L``:

    * noisy -> noisy: same block only (block-diagonal, ``M_BD``),
    * noisy -> clean: strictly earlier blocks (offset block-causal, ``M_OBC``),
    * clean -> clean: same or earlier blocks (block-causal, ``M_BC``); with ``clean_causal`` the same or earlier
      positions (fully causal, ``M_FC``), so the clean half's logit at i is a next-token prediction from x_0^{<=i},
    * clean -> noisy: never.

    Arriola et al. 2025, eq. 8-9 and Fig. 3 (the ``block_diff_mask`` of kuleshov-group/bd3lms); ``clean_causal``:
    the ``sbd_block_diff`` mask of NVIDIA Megatron-Bridge's NemotronLabsDiffusion (``M_BD | M_OBC | M_FC``).
    Raises: DifflmError when ``block_size`` does not divide ``seq_len`` (names ``objective.block_size``).
    """
    _check_blocks(seq_len, block_size)
    idx = torch.arange(2 * seq_len, device=device)
    return _block_causal_rule(idx[:, None], idx[None, :], seq_len, block_size, clean_causal)[None, None]


def _block_causal_rule(q_idx, kv_idx, seq_len: int, block_size: int, clean_causal: bool = False):
    """The rule of :func:`block_causal_mask` on index tensors (shared with the FlexAttention ``mask_mod``)."""
    q_noisy, kv_noisy = q_idx < seq_len, kv_idx < seq_len
    q_block = torch.where(q_noisy, q_idx, q_idx - seq_len) // block_size
    kv_block = torch.where(kv_noisy, kv_idx, kv_idx - seq_len) // block_size
    diagonal = q_noisy & kv_noisy & (q_block == kv_block)
    offset_causal = q_noisy & ~kv_noisy & (q_block > kv_block)
    earlier = (q_idx >= kv_idx) if clean_causal else (q_block >= kv_block)  # both clean: same offset
    causal = ~q_noisy & ~kv_noisy & earlier
    return diagonal | offset_causal | causal


def block_causal_block_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu",
                            clean_causal: bool = False):
    """:func:`block_causal_mask` as a FlexAttention ``BlockMask`` built from its ``mask_mod``, no dense tensor.

    ``BLOCK_SIZE`` is passed explicitly (:data:`FLEX_BLOCK_SIZE`, capped to the padded length): the mask
    is only valid for a ``flex_attention`` call over the same ``2L x 2L`` lengths.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _check_blocks(seq_len, block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return _block_causal_rule(q_idx, kv_idx, seq_len, block_size, clean_causal)

    n = 2 * seq_len
    return create_block_mask(mask_mod, None, None, n, n, device=str(device), BLOCK_SIZE=FLEX_BLOCK_SIZE)


def block_causal_inference_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Block-causal mask over one sequence of ``seq_len`` tokens, ``[1, 1, S, S]`` bool: block(q) >= block(kv).

    At sampling time a BD3-LM sees clean blocks followed by the one noisy block being denoised; this mask
    gives every position exactly the context it had in training (the noisy block sees itself and the clean
    blocks before it; clean blocks see themselves and earlier blocks). ``seq_len`` need not be a multiple
    of ``block_size`` (the last block may be partial).
    """
    idx = torch.arange(seq_len, device=device) // block_size
    return (idx[:, None] >= idx[None, :])[None, None]


def causal_prefix_inference_mask(seq_len: int, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sampling mask of a model trained with a causal clean half, ``[1, 1, S, S]`` bool: positions before ``start``
    (the finished clean blocks) attend causally, positions from ``start`` on (the noisy block being denoised) see the
    whole prefix and each other: each position's training context under ``block_causal_mask(clean_causal=True)``,
    the order of Megatron-Bridge's ``generate_dllm`` (causal prefill of the prefix, a bidirectional block over it).
    """
    idx = torch.arange(seq_len, device=device)
    return ((idx[:, None] >= idx[None, :]) | (idx[:, None] >= start))[None, None]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the packed document of each token, ``[B, S]`` int64: the number of EOS strictly before it.

    An EOS belongs to the document it ends.
    """
    is_eos = (tokens == eos_id).long()
    return torch.cumsum(is_eos, dim=1) - is_eos


def document_mask(doc_ids: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Intra-document attention for packed windows, ``[B, 1, S, S]`` bool (block-diagonal per row).

    Args:
        doc_ids: ``[B, S]`` int64 from :func:`document_ids`.
        causal: also require ``q >= kv`` (the AR baseline).
    """
    mask = doc_ids[:, :, None] == doc_ids[:, None, :]
    if causal:
        s = doc_ids.shape[1]
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return mask[:, None]


def padded_row_spans(valid: torch.Tensor, refusal: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths), each [B] int64: where each row's real tokens begin and how many there are, for ``valid``
    [B, S] bool (True = real token) of rows padded on one side (left or right) only.

    Block diffusion places its blocks at absolute positions of each unpadded row, so a row whose real tokens are
    not contiguous has no such layout. Raises: DifflmError(``refusal``, the caller's words) for such a row."""
    lengths, starts = valid.sum(dim=1), valid.long().argmax(dim=1)
    span = torch.arange(valid.shape[1], device=valid.device)[None]
    if not bool((valid == ((span >= starts[:, None]) & (span < (starts + lengths)[:, None]))).all()):
        raise DifflmError(refusal)
    return starts, lengths


def key_padding_mask(valid: torch.Tensor, causal: bool = False, query_rows: Optional[slice] = None) -> torch.Tensor:
    """Attention mask of a padded batch, ``[B, 1, S_q, S]`` bool.

    Every query attends to the real keys (``valid`` [B, S] bool, True = real token) and always to itself, so
    padded rows never see an all-``False`` row (SDPA would return NaN there). ``query_rows`` keeps only
    those query rows (a cached forward over a span of the sequence).
    """
    b, s = valid.shape
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    mask = valid[:, None, :] | eye[None]
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    mask = mask[:, None]
    return mask if query_rows is None else mask[:, :, query_rows]


def to_block_mask(dense: torch.Tensor):
    """A dense ``[B | 1, 1, S_q, S_kv]`` bool mask as a FlexAttention ``BlockMask`` (mask_mod = a lookup).

    Raises: DifflmError when ``dense`` is not a 4-D bool tensor.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if dense.dim() != 4 or dense.dtype != torch.bool:
        raise DifflmError(f"attn_mask must be a [B|1, 1, S_q, S_kv] bool tensor, got {tuple(dense.shape)} {dense.dtype}")
    bsz, _, s_q, s_kv = dense.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b if bsz > 1 else 0, 0, q_idx, kv_idx]

    return create_block_mask(mask_mod, bsz if bsz > 1 else None, None, s_q, s_kv, device=str(dense.device),
                             BLOCK_SIZE=FLEX_BLOCK_SIZE)


@dataclass
class DocumentMask:
    """Intra-document attention of packed windows: query i sees key j iff they belong to the same document of the
    same row (and j <= i when ``causal``, the AR baseline).

    Attributes:
        doc_ids: [B, S] int64 document index of each token (:func:`document_ids`).
        causal: add the causal constraint.
        cu_seqlens: [N + 1] int32 cumulative lengths of the N documents of the flattened ``B * S`` tokens (every row
            starts a new document), for the variable-length kernels (TE ``qkv_format="thd"``, FlashAttention's
            ``flash_attn_varlen_func``); computed where ``doc_ids`` lives when first needed, so a mask built on the
            CPU carries it to the GPU without a host-device sync.
        max_seqlen: the longest document, in tokens.
    """

    doc_ids: torch.Tensor
    causal: bool = False
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(``cu_seqlens`` [N + 1] int32, ``max_seqlen``) of the documents, row-major over ``[B, S]``."""
        if self.cu_seqlens is None:
            ids = self.doc_ids
            b, s = ids.shape
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            first = torch.nonzero(starts.flatten()).flatten()
            cu = torch.cat([first, torch.tensor([b * s], device=ids.device)]).to(torch.int32)
            self.cu_seqlens, self.max_seqlen = cu, int((cu[1:] - cu[:-1]).max())
        return self.cu_seqlens, self.max_seqlen

    def to(self, device) -> "DocumentMask":
        """The mask on ``device``; ``cu_seqlens`` is computed first (on the source device) and moved along."""
        cu, longest = self.varlen()
        return DocumentMask(to_device(self.doc_ids, device), self.causal, to_device(cu, device), longest)

    def dense(self) -> torch.Tensor:
        """[B, 1, S, S] bool (:func:`document_mask`)."""
        return document_mask(self.doc_ids, self.causal)

    def block_mask(self):
        """The FlexAttention ``BlockMask`` of the same pattern, built from a ``mask_mod`` (no dense tensor)."""
        from torch.nn.attention.flex_attention import create_block_mask

        ids, causal = self.doc_ids, self.causal
        b, s = ids.shape

        def mask_mod(bi, h, q_idx, kv_idx):
            same = ids[bi, q_idx] == ids[bi, kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        return create_block_mask(mask_mod, b, None, s, s, device=str(ids.device), BLOCK_SIZE=FLEX_BLOCK_SIZE)


@dataclass
class BlockDiffusionMask:
    """BD3-LM's training mask over the ``2 L`` tokens ``[x_t ; x_0]`` (:func:`block_causal_mask`), within documents
    when ``doc_ids`` [B, L] is given (packed windows: both halves keep their tokens' documents).

    ``device`` is where the dense or block form is built (``doc_ids``' device when given). ``clean_causal``: the
    clean half attends causally instead of block-causally (``objective.clean_attention=causal``).
    Raises: DifflmError when ``block_size`` does not divide ``seq_len``.
    """

    seq_len: int
    block_size: int
    doc_ids: Optional[torch.Tensor] = None
    device: torch.device = torch.device("cpu")
    clean_causal: bool = False

    def __post_init__(self):
        _check_blocks(self.seq_len, self.block_size)
        if self.doc_ids is not None:
            self.device = self.doc_ids.device

    def to(self, device) -> "BlockDiffusionMask":
        ids = None if self.doc_ids is None else to_device(self.doc_ids, device)
        return BlockDiffusionMask(self.seq_len, self.block_size, ids, torch.device(device), self.clean_causal)

    def dense(self) -> torch.Tensor:
        """[1 | B, 1, 2L, 2L] bool."""
        mask = block_causal_mask(self.seq_len, self.block_size, self.device, self.clean_causal)
        if self.doc_ids is not None:
            doc = torch.cat([self.doc_ids, self.doc_ids], dim=1)
            mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
        return mask

    def block_mask(self):
        """The FlexAttention ``BlockMask`` (from the ``mask_mod``; cached per length, block size and device when the
        mask has no documents, since it is then the same for every step)."""
        if self.doc_ids is None:
            return _cached_block_causal_block_mask(self.seq_len, self.block_size, str(self.device), self.clean_causal)
        from torch.nn.attention.flex_attention import create_block_mask

        ids, length, size, clean_causal = self.doc_ids, self.seq_len, self.block_size, self.clean_causal
        b = ids.shape[0]

        def mask_mod(bi, h, q_idx, kv_idx):
            qd = ids[bi, torch.where(q_idx < length, q_idx, q_idx - length)]
            kd = ids[bi, torch.where(kv_idx < length, kv_idx, kv_idx - length)]
            return _block_causal_rule(q_idx, kv_idx, length, size, clean_causal) & (qd == kd)

        n = 2 * length
        return create_block_mask(mask_mod, b, None, n, n, device=str(ids.device), BLOCK_SIZE=FLEX_BLOCK_SIZE)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor bound for a GPU goes through pinned memory so that the copy is asynchronous
    (a copy from pageable memory waits for the device's queued work)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _cached_block_causal_block_mask(seq_len: int, block_size: int, device: str, clean_causal: bool):
    return block_causal_block_mask(seq_len, block_size, device, clean_causal)


def _check_blocks(seq_len: int, block_size: int) -> None:
    if block_size < 1 or seq_len % block_size != 0:
        raise DifflmError(f"objective.block_size={block_size} must be >= 1 and divide the sequence length {seq_len}")


__all__ = ["BlockDiffusionMask", "DocumentMask", "FLEX_BLOCK_SIZE", "block_causal_block_mask", "block_causal_inference_mask", "block_causal_mask",
           "causal_prefix_inference_mask", "document_ids", "document_mask", "key_padding_mask", "to_block_mask"]
