"""Attention masks: dense boolean masks for SDPA and the equivalent FlexAttention ``BlockMask``.

Convention everywhere: ``True`` = the query may attend to the key (``F.scaled_dot_product_attention``'s
boolean ``attn_mask`` and FlexAttention's ``mask_mod``). Dense masks are ``[B | 1, 1, S_q, S_kv]`` bool.

* :func:`block_causal_mask` - BD3-LM's training mask over ``[x_t ; x_0]`` (Arriola et al. 2025,
  "Block Diffusion", sec. 3.2 / their ``block_diff_mask``).
* :func:`block_causal_inference_mask` - the same pattern over one (clean prefix + noisy block) sequence.
* :func:`document_mask` - block-diagonal mask of packed documents (intra-document attention).
* :func:`key_padding_mask` - padded batches: every query sees the real keys (and itself).
* :func:`to_block_mask` - any dense mask as a ``BlockMask`` (for ``model.attention_backend=flex``).
"""
from __future__ import annotations

from typing import Optional

import torch

from difflm.errors import DifflmError

# FlexAttention's sparse block size. ``create_block_mask`` defaults to 128; the kernel must be called with a
# BlockMask built for the *same* Q/KV lengths and block size, so we always pass it explicitly.
FLEX_BLOCK_SIZE = 128


def block_causal_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """BD3-LM training mask over the ``2 L`` tokens ``[x_t ; x_0]``, ``[1, 1, 2L, 2L]`` bool.

    With ``b(i) = (i mod L) // block_size`` the block of position i and ``noisy(i) = i < L``:

    * noisy -> noisy: same block only (block-diagonal, ``M_BD``),
    * noisy -> clean: strictly earlier blocks (offset block-causal, ``M_OBC``),
    * clean -> clean: same or earlier blocks (block-causal, ``M_BC``),
    * clean -> noisy: never.

    Arriola et al. 2025, eq. 8-9 and Fig. 3 (the ``block_diff_mask`` of kuleshov-group/bd3lms).
    Raises: DifflmError when ``block_size`` does not divide ``seq_len`` (names ``objective.block_size``).
    """
    _check_blocks(seq_len, block_size)
    idx = torch.arange(2 * seq_len, device=device)
    return _block_causal_rule(idx[:, None], idx[None, :], seq_len, block_size)[None, None]


def _block_causal_rule(q_idx, kv_idx, seq_len: int, block_size: int):
    """The rule of :func:`block_causal_mask` on index tensors (shared with the FlexAttention ``mask_mod``)."""
    q_noisy, kv_noisy = q_idx < seq_len, kv_idx < seq_len
    q_block = torch.where(q_noisy, q_idx, q_idx - seq_len) // block_size
    kv_block = torch.where(kv_noisy, kv_idx, kv_idx - seq_len) // block_size
    diagonal = q_noisy & kv_noisy & (q_block == kv_block)
    offset_causal = q_noisy & ~kv_noisy & (q_block > kv_block)
    causal = ~q_noisy & ~kv_noisy & (q_block >= kv_block)
    return diagonal | offset_causal | causal


def block_causal_block_mask(seq_len: int, block_size: int, device: torch.device | str = "cpu"):
    """:func:`block_causal_mask` as a FlexAttention ``BlockMask`` built from its ``mask_mod``, no dense tensor.

    ``BLOCK_SIZE`` is passed explicitly (:data:`FLEX_BLOCK_SIZE`, capped to the padded length): the mask
    is only valid for a ``flex_attention`` call over the same ``2L x 2L`` lengths.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _check_blocks(seq_len, block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return _block_causal_rule(q_idx, kv_idx, seq_len, block_size)

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


def _check_blocks(seq_len: int, block_size: int) -> None:
    if block_size < 1 or seq_len % block_size != 0:
        raise DifflmError(f"objective.block_size={block_size} must be >= 1 and divide the sequence length {seq_len}")


__all__ = ["FLEX_BLOCK_SIZE", "block_causal_block_mask", "block_causal_inference_mask", "block_causal_mask",
           "document_ids", "document_mask", "key_padding_mask", "to_block_mask"]
