"""A token batch with per-sample extras, for datasets whose windows carry more than token ids.

Plain packed windows are a ``[B, S]`` int64 tensor. SFT pairs also need each sample's prompt length, and
packed windows with intra-document attention need each token's document id. :class:`TokenBatch` carries
them and slices like the tensor (``batch[:, :n]``), so the trainer's batch fetching stays
``dataset.get(indices)[:, :seq_len]`` for every dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class TokenBatch:
    """Attributes:
        tokens: [B, S] int64.
        prompt_lengths: [B] int64 or None: the first ``prompt_lengths[b]`` tokens of row b are the prompt (SFT).
        doc_ids: [B, S] int64 or None: packed-document index of each token (intra-document attention).
        prompt_mask: [B, S] bool or None: True at prompt tokens, for rows that pack several prompt/response pairs
            (``data.sft_packing``); replaces ``prompt_lengths``.
        pair_ids: [B, S] int64 or None: the prompt/response pair of each token in packed SFT rows (whether or not
            the pairs are kept apart in attention, which ``doc_ids`` decides): what the per-pair loss normaliser
            (``objective.loss_norm=sequence``) counts over.
    """

    tokens: torch.Tensor
    prompt_lengths: Optional[torch.Tensor] = None
    doc_ids: Optional[torch.Tensor] = None
    prompt_mask: Optional[torch.Tensor] = None
    pair_ids: Optional[torch.Tensor] = None

    def response_mask(self) -> Optional[torch.Tensor]:
        """[B, S] bool, True at the response tokens (everything but the prompts), or None for plain text."""
        if self.prompt_mask is not None:
            return ~self.prompt_mask
        if self.prompt_lengths is not None:
            return torch.arange(self.tokens.shape[1])[None, :] >= self.prompt_lengths[:, None]
        return None

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def __getitem__(self, key) -> "TokenBatch":
        """Slice rows/columns like the token tensor: ``batch[:, :n]`` (prompt lengths are clipped to n)."""
        tokens = self.tokens[key]
        rows = key[0] if isinstance(key, tuple) else key
        lengths = None
        if self.prompt_lengths is not None:
            lengths = self.prompt_lengths[rows].clamp(max=tokens.shape[1])
        doc_ids = None if self.doc_ids is None else self.doc_ids[key]
        prompt_mask = None if self.prompt_mask is None else self.prompt_mask[key]
        pair_ids = None if self.pair_ids is None else self.pair_ids[key]
        return TokenBatch(tokens, lengths, doc_ids, prompt_mask, pair_ids)


def split_batch(batch: Union[torch.Tensor, TokenBatch]) -> tuple[torch.Tensor, Optional[TokenBatch]]:
    """(tokens [B, S], the TokenBatch or None) for a plain tensor or a :class:`TokenBatch`."""
    if isinstance(batch, TokenBatch):
        return batch.tokens, batch
    return batch, None
