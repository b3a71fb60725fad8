"""The last block at the loss positions only (``model.last_block_loss_rows``).

A masked-diffusion loss reads the logits of the masked positions only, so the LM head runs on those rows
(:meth:`difflm.model.transformer.Transformer.head`). The same holds one block earlier: the last block's output at an
unmasked position feeds nothing. Its keys and values are needed at every position (every query attends to them),
but its queries, attention output, output projection, residual adds and MLP only at the loss rows. Running them
there and nowhere else gives the same logits and the same gradients (up to the summation order of other GEMM
shapes) for about half the last block's work at the mean masking rate of 1/2: one block in ``num_layers`` (~1.5 % of
a ``model=1.7b`` step, ~4 % at ``model=125m``).

:class:`LossRows` carries the rows through the block: the flattened-token index, padded to a multiple of
:data:`ROWS_MULTIPLE` by repeating its last row (TE's FP8 GEMMs take whole 32-row tiles; a repeated row's output is
dropped before the head, so its gradient is zero and it changes nothing), and the per-sequence offsets that
FlashAttention's variable-length interface takes for the queries. Nothing here reads a device value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from difflm.model.te_kernels import FP8_ROWS_MULTIPLE

ROWS_MULTIPLE = FP8_ROWS_MULTIPLE  # TE's FP8 GEMMs take whole 32-row tiles


@dataclass(frozen=True)
class LossRows:
    """The rows of a ``[B, S, d]`` residual stream that the last block computes.

    Attributes:
        index: [R] int64, positions in the flattened ``B * S`` tokens, ascending: the ``count`` loss rows, then the
            last of them repeated up to R, a multiple of :data:`ROWS_MULTIPLE`.
        count: N, how many rows carry loss (a host int: the length of the index the loss was given).
        inverse: [N] int64, where each row of the given index sits in ``index`` (the given order is restored by
            :meth:`in_given_order`; an ascending index, as the objectives give, maps to itself).
        cu_seqlens_q: [B + 1] int32, where each sequence's rows start in ``index`` (FlashAttention varlen queries).
        cu_seqlens_k: [B + 1] int32, where each whole sequence starts in the flattened keys and values: 0, S, 2 S, ...
        batch, seq_len: B and S.
    """

    index: torch.Tensor
    count: int
    inverse: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    batch: int
    seq_len: int

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` [B, S, ...] (batch-first) as [R, ...]."""
        return x.flatten(0, 1).index_select(0, self.index)

    def in_given_order(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, ...] computed at ``index`` -> [N, ...] in the order of the index the rows were built from."""
        return rows.index_select(0, self.inverse)


def loss_rows(logits_mask: Optional[torch.Tensor], batch: int, seq_len: int) -> Optional[LossRows]:
    """:class:`LossRows` for a model call whose ``logits_mask`` is the [N] int64 index of the loss rows in the
    flattened ``batch * seq_len`` tokens (``NoisedBatch.loss_index``: row-major, ascending; any order is taken and
    sorted, and :meth:`LossRows.in_given_order` puts the results back); None when there is no
    such index (a boolean mask, whose count the host does not know, or none), when it is empty, or when the padded
    rows would not be fewer than the ``batch * seq_len`` tokens (then the full block costs no more)."""
    if logits_mask is None or logits_mask.dtype == torch.bool or logits_mask.dim() != 1:
        return None
    count = int(logits_mask.shape[0])
    padded = -(-count // ROWS_MULTIPLE) * ROWS_MULTIPLE
    if count == 0 or padded >= batch * seq_len:
        return None
    index, order = torch.sort(logits_mask)  # each sequence's rows together, for FA4's varlen queries
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(count, device=order.device))
    if padded > count:
        index = torch.cat([index, index[-1:].expand(padded - count)])
    starts = torch.arange(0, (batch + 1) * seq_len, seq_len, device=index.device, dtype=index.dtype)
    cu = torch.searchsorted(index, starts).to(torch.int32)  # sorted index: no device-to-host copy
    return LossRows(index=index, count=count, inverse=inverse, cu_seqlens_q=cu, cu_seqlens_k=starts.to(torch.int32),
                    batch=batch, seq_len=seq_len)


def add_at_rows(into: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The adjoint of :meth:`LossRows.select`, for an autograd function that holds the index: adds [R, ...] ``rows``
    (e.g. gradients at the rows) into ``into`` [B, S, ...] (batch-first; a strided view is fine) at the flattened
    positions ``index`` ([R] int64, :attr:`LossRows.index`), in place, and returns ``into``, as autograd's gradient of
    ``index_select`` does. The padding rows repeat the last loss row, so that position gets the sum of its copies:
    the real row's value plus the padding's (zero where their outputs feed nothing). A copy instead of the sum
    (``index_copy_``) keeps one of the duplicates, on CUDA in no fixed order, and can drop the real row's."""
    into.flatten(0, 1).index_add_(0, index, rows)
    return into


__all__ = ["LossRows", "ROWS_MULTIPLE", "add_at_rows", "loss_rows"]
