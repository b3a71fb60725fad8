"""Data mixtures (``data.blend``): several corpora, each training sample drawn from one of them with fixed weights.

The counterpart of Megatron-LM's ``--data-path 0.3 a 0.7 b`` (``BlendedDataset``), keyed like
:class:`difflm.data.windows.GlobalBatchSampler` so that the order is a pure function of (seed, step): a resume
is exact and every parallel layout sees the same windows.

* Source of global sample g: the Weyl sequence ``u_g = (x0 + g * A) mod 2**64`` with ``A / 2**64`` the golden
  ratio's fractional part, cut by the cumulative weights (``x0`` keyed by the seed). Its discrepancy is
  O(log N / N) (Kuipers & Niederreiter, *Uniform Distribution of Sequences*, 1974, ch. 1 sec. 3 and ch. 2 sec. 3),
  so every run of N consecutive samples holds each source within about log(N)/N of its weight: a deterministic
  interleave like Megatron's greedy blending index, computable at any step without the samples before it.
* Within source i, its k-th sample (k = the number of earlier samples of source i) is window
  ``perm_{i,e}[k mod n_i]``, ``e = k div n_i``, a permutation keyed by (seed, source i, e) (:class:`EpochOrder`):
  each source passes over all its windows once per epoch of its own.

Validation: each source keeps its own validation windows; the trainer reports ``val_nelbo/<name>`` per source and
``val_nelbo`` as their weighted mean (:meth:`BlendedWindows.sources`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from difflm.config.schema import blend_entries
from difflm.data.tokenizer import TokenizerInfo
from difflm.data.windows import EpochOrder, build_windows, check_sampler_args, check_state_keys, token_datasets
from difflm.errors import DifflmError

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # round(2**64 * (sqrt(5) - 1) / 2), odd: the Weyl step
TAG_SOURCE, TAG_WINDOW = 0x626C6E64, 0x626C6E77  # "blnd", "blnw": domain tags of the blend's keyed streams
BLOCK = 1 << 16  # samples per block of cached per-source counts


class BlendedWindows:
    """The windows of several sources, concatenated: flat index ``offsets[i] + w`` is window w of source i.

    ``get`` has the API of :class:`difflm.data.windows.PackedWindows`; ``sources`` lists (name, weight, windows).
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float], parts: Sequence):
        self.names, self.weights, self.parts = list(names), [float(w) for w in weights], list(parts)
        self.sizes = np.asarray([len(p) for p in self.parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def sources(self) -> list[tuple[str, float, object]]:
        return list(zip(self.names, self.weights, self.parts))

    def get(self, indices: Sequence[int]):
        """Windows at flat ``indices`` as [len(indices), seq_len] int64 (a TokenBatch with intra-document ids)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        src = np.searchsorted(self.offsets, idx, side="right") - 1
        rows: list = [None] * len(idx)
        for i in np.unique(src):
            sel = np.nonzero(src == i)[0]
            got = self.parts[i].get(idx[sel] - self.offsets[i])
            for j, r in zip(sel, range(len(sel))):
                rows[j] = got[r:r + 1]
        if not rows:
            return self.parts[0].get([])
        first = rows[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(rows)
        from difflm.data.batch import TokenBatch

        return TokenBatch(torch.cat([r.tokens for r in rows]), doc_ids=torch.cat([r.doc_ids for r in rows]))

    def sampler(self, global_batch_size: int, seed: int) -> "BlendedSampler":
        return BlendedSampler(self.sizes, self.weights, self.names, global_batch_size, seed)


class BlendedSampler:
    """Keyed order over a :class:`BlendedWindows` (see the module docstring); API of GlobalBatchSampler.

    Args:
        sizes: training windows per source (each >= 1). weights: > 0, normalised to sum 1.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], names: Sequence[str], global_batch_size: int,
                 seed: int):
        check_sampler_args(int(min(sizes)), global_batch_size, seed)
        w = np.asarray(weights, dtype=np.float64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.weights, self.names = (w / w.sum()).tolist(), list(names)
        self.num_windows, self.global_batch_size, self.seed = int(self.sizes.sum()), int(global_batch_size), int(seed)
        cum = np.cumsum(w / w.sum())[:-1]
        # source i covers [T_{i-1}, T_i) of [0, 2**64); float64 -> uint64 via Python ints (exact)
        self._thresholds = np.asarray([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)
        self._x0 = np.random.SeedSequence([self.seed, TAG_SOURCE]).generate_state(1, np.uint64)[0]
        self._orders = [EpochOrder(n, [self.seed, TAG_WINDOW, i]) for i, n in enumerate(self.sizes)]
        self._block_start_counts: dict[int, np.ndarray] = {0: np.zeros(len(self.sizes), np.int64)}

    def source_of(self, g: np.ndarray) -> np.ndarray:
        """Source index of global samples ``g`` (int64 array) -> int64 array."""
        u = self._x0 + np.asarray(g, dtype=np.uint64) * GOLDEN  # uint64 arithmetic wraps mod 2**64 (exact)
        return np.searchsorted(self._thresholds, u, side="right").astype(np.int64)

    def _counts_at_block(self, b: int) -> np.ndarray:
        """Samples per source among global samples [0, b * BLOCK)."""
        known = max(k for k in self._block_start_counts if k <= b)
        counts = self._block_start_counts[known].copy()
        m = len(self.sizes)
        for k in range(known, b):
            src = self.source_of(np.arange(k * BLOCK, (k + 1) * BLOCK, dtype=np.int64))
            counts += np.bincount(src, minlength=m)
            self._block_start_counts[k + 1] = counts.copy()
        return counts

    def consumed(self, g_end: int) -> np.ndarray:
        """Samples drawn from each source among global samples [0, g_end), int64 [num_sources]."""
        b = g_end // BLOCK
        counts = self._counts_at_block(b).copy()
        src = self.source_of(np.arange(b * BLOCK, g_end, dtype=np.int64))
        return counts + np.bincount(src, minlength=len(self.sizes))

    def indices(self, step: int) -> np.ndarray:
        """Flat window indices [global_batch_size] int64 for 0-based ``step``."""
        g0 = step * self.global_batch_size
        g = g0 + np.arange(self.global_batch_size, dtype=np.int64)
        base = self.consumed(g0)
        src = self.source_of(g)
        onehot = src[:, None] == np.arange(len(self.sizes))[None, :]
        k = base[src] + (np.cumsum(onehot, axis=0) - onehot)[np.arange(len(g)), src]  # earlier samples of the source
        out = np.empty_like(g)
        for i in np.unique(src):
            sel = src == i
            out[sel] = self.offsets[i] + self._orders[i].at(k[sel])
        return out

    def report(self, step: int) -> dict:
        """Metrics of the data consumed before ``step``: per source, its share of the samples (``data_share/<name>``)
        and its passes over its training windows (``data_epochs/<name>``)."""
        g = step * self.global_batch_size
        counts = self.consumed(g)
        out = {}
        for name, c, n in zip(self.names, counts, self.sizes):
            out[f"data_share/{name}"] = float(c) / g if g else 0.0
            out[f"data_epochs/{name}"] = float(c) / float(n)
        return out

    def state_dict(self, step: int) -> dict:
        return {"consumed_samples": step * self.global_batch_size, "num_windows": self.num_windows, "seed": self.seed,
                "global_batch_size": self.global_batch_size,
                "blend": {"names": self.names, "weights": self.weights, "windows": self.sizes.tolist()}}

    def check_state(self, state: dict) -> None:
        """Raise DifflmError if the order's inputs (windows, seed, batch, blend names/weights) changed."""
        check_state_keys(self, self.state_dict(0), state)


def _with(cfg, **kw):
    """A copy of a DataConfig (dataclass or OmegaConf node) with some keys replaced."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, **kw)
    out = cfg.copy()
    for k, v in kw.items():
        out[k] = v
    return out


def check_blend_sources(entries: Sequence[tuple[str, str, float]], tok: TokenizerInfo) -> None:
    """Every source of :func:`blend_entries` names shards of ``tok`` or corpus files, checked before the first
    source is tokenized, so a mistyped later path ends the run at once rather than after the earlier sources.

    Raises: DifflmError naming the source and ``data.blend[i].path``."""
    from difflm.data.documents import resolve_sources
    from difflm.data.shards import find_shards

    for i, (name, path, _) in enumerate(entries):
        key = f"data.blend[{i}].path"
        try:
            if find_shards(path, tok, key=key) is None:
                resolve_sources(path, key=key)
        except DifflmError as err:
            raise DifflmError(f"data.blend source {name!r} ({path}): {err}") from None


def build_blend(cfg, tok: TokenizerInfo, cache_dir: str) -> tuple[BlendedWindows, BlendedWindows]:
    """(train, valid) :class:`BlendedWindows` of ``cfg.blend``: each source read like ``data.path`` (shards or
    text, with the other ``data.*`` keys) and split into its own train/valid windows. Prints the sources (rank 0)."""
    from difflm.parallel.distributed import is_rank0

    if getattr(cfg, "max_train_tokens", None) is not None:
        raise DifflmError("data.max_train_tokens is not supported with data.blend: set data.max_train_tokens=null")
    entries = blend_entries(cfg.blend)
    check_blend_sources(entries, tok)
    names, weights, trains, valids = [], [], [], []
    for i, (name, path, weight) in enumerate(entries):
        try:
            parts = token_datasets(_with(cfg, path=path, hf_dataset=None, blend=[]), tok, cache_dir)
            train, valid = build_windows(parts, tok.eos_id, cfg.seq_len, cfg.valid_fraction,
                                         getattr(cfg, "intra_document_attention", False),
                                         corpus=f"data.blend source {name!r}", vocab_size=tok.padded_vocab_size,
                                         mask_id=tok.mask_id)
        except DifflmError as err:  # the source is read as data.path would be: name the key the user set
            raise DifflmError(f"data.blend source {name!r} ({path}): "
                              f"{str(err).replace('data.path', f'data.blend[{i}].path')}") from None
        names.append(name)
        weights.append(weight)
        trains.append(train)
        valids.append(valid)
    total = sum(weights)
    if is_rank0():
        for name, w, tr, va in zip(names, weights, trains, valids):
            print(f"data.blend: {name}: weight {w / total:.4f}, {len(tr)} train / {len(va)} valid windows "
                  f"of {cfg.seq_len} tokens", flush=True)
    return BlendedWindows(names, weights, trains), BlendedWindows(names, weights, valids)
