"""Block-level key/value cache for masked-diffusion decoding (Fast-dLLM, Wu et al. 2025, sec. 3.1-3.2).

A bidirectional model has no exact KV cache: every token's K/V depends on every other token. Fast-dLLM
observes that K/V barely change while one block is denoised, so it caches them per block:

* ``prefix``: at the start of each block, one full forward writes every layer's K/V; the following steps
  run only ``x[:, start:]`` (the block and the masked suffix) against the cached prefix K/V.
* ``dual``:   the same full forward, then the steps run only ``x[:, start:end]`` (the block) against the
  cached prefix *and* suffix K/V.

For a block-causal model (BD3-LM) the prefix cache is exact: clean blocks never attend to later blocks.

Usage with :meth:`difflm.model.transformer.Transformer.forward` (``kv_cache=`` argument)::

    cache = KVCache()
    cache.write()                       # next forward stores the K/V of every position it sees
    model(x, kv_cache=cache)
    cache.read(start, end)              # next forward runs x[:, start:end] only; the cached K/V outside
    model(x[:, start:end], position_ids=torch.arange(start, end), kv_cache=cache)  # [start, end) are reused

Every tensor is ``[B, S, H_kv, D]`` (the attention's ``bshd`` layout, whatever the kernel set); batch rows are
independent, so the cache is correct for B > 1.

A model with ``model.shift_logits`` gives position i the logits of the hidden state at i - 1, which a forward over
``[start, end)`` does not compute for i = start: read ``(start - 1, end)`` and drop the first row, as the samplers
do (:mod:`difflm.sampling`).
"""
from __future__ import annotations

from typing import Optional

import torch

from difflm.errors import DifflmError

SEQ_DIM = 1  # cached tensors are [B, S, H_kv, D]


class KVCache:
    """Per-layer cached K/V of one batch, with a mode set before each forward.

    Modes:
        ``write``: the forward sees the whole sequence; each layer stores its K/V and attends as usual.
        ``read(start, end)``: the forward sees positions ``[start, end)`` only; each layer attends over
            ``cat(K[:, :start], k_new, K[:, end:])`` along the sequence. With ``commit=True`` that concatenation replaces
            the stored K/V (e.g. append a finished BD3-LM block, whose K/V are final).
    """

    def __init__(self) -> None:
        self.keys: list[Optional[torch.Tensor]] = []
        self.values: list[Optional[torch.Tensor]] = []
        self.mode = "write"
        self.start = self.end = 0
        self.commit = False

    def write(self) -> "KVCache":
        self.mode = "write"
        return self

    def read(self, start: int, end: int, commit: bool = False) -> "KVCache":
        if not self.keys:
            raise DifflmError("KVCache.read before any write: run one forward with cache.write() first")
        self.mode, self.start, self.end, self.commit = "read", int(start), int(end), commit
        return self

    def layer(self, index: int) -> "LayerKV":
        while len(self.keys) <= index:
            self.keys.append(None)
            self.values.append(None)
        return LayerKV(self, index)

    @property
    def length(self) -> int:
        """Number of cached positions (0 before the first write)."""
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[SEQ_DIM]


class LayerKV:
    """The view of one layer on a :class:`KVCache`; :meth:`update` is called by the attention module."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V to attend over, given this forward's ``k, v`` ``[B, S_new, H_kv, D]`` (after RoPE)."""
        c, i = self.cache, self.index
        if c.mode == "write":
            c.keys[i], c.values[i] = k, v
            return k, v
        old_k, old_v = c.keys[i], c.values[i]
        if old_k is None:
            raise DifflmError("KVCache.read: this layer has no cached K/V; run a forward with cache.write() first")
        if k.shape[SEQ_DIM] != c.end - c.start:
            raise DifflmError(f"KVCache.read({c.start}, {c.end}) expects {c.end - c.start} new positions, "
                              f"got {k.shape[SEQ_DIM]}")
        full_k = torch.cat([old_k[:, : c.start], k, old_k[:, c.end:]], dim=SEQ_DIM)
        full_v = torch.cat([old_v[:, : c.start], v, old_v[:, c.end:]], dim=SEQ_DIM)
        if c.commit:
            c.keys[i], c.values[i] = full_k, full_v
        return full_k, full_v


__all__ = ["KVCache", "LayerKV"]
