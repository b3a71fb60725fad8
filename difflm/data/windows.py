"""Packed training windows and the deterministic global batch order."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from difflm.data.documents import data_notice
from difflm.data.indexed_dataset import IndexedDataset
from difflm.data.tokenizer import TokenizerInfo
from difflm.errors import DifflmError


class PackedStream:
    """The documents of one or more :class:`IndexedDataset` s, in order, each followed by ``eos_id``: one virtual 1-D
    token stream of length ``sum(num_tokens + documents)``. Nothing is materialised: a slice reads the
    memory-mapped .bin files, so a corpus of any size costs only its document-length arrays in memory.

    ``stream[a:b]`` -> 1-D np.ndarray of ``self.dtype`` (the shards' dtype widened to hold ``eos_id``).

    With ``vocab_size`` (the model's embedding rows) every read is checked: a token id outside ``[0, vocab_size)``
    or equal to ``mask_id`` (which no text tokenizes to) raises DifflmError naming the shard and the id. Shards made
    by other tools carry no record of their tokenizer; this is what stops ids of another tokenizer from indexing
    past the embedding (an IndexError on CPU, a device-side assert on a GPU) or reading as masks.
    """

    def __init__(self, datasets: IndexedDataset | Sequence[IndexedDataset], eos_id: int,
                 vocab_size: int | None = None, mask_id: int | None = None):
        self.parts = [datasets] if isinstance(datasets, IndexedDataset) else list(datasets)
        self.eos_id = int(eos_id)
        self.vocab_size, self.mask_id = vocab_size, mask_id
        # packed end (exclusive) of every document within its part: its tokens, then one EOS
        self._ends = [np.cumsum(ds.document_lengths.astype(np.int64) + 1) for ds in self.parts]
        sizes = [int(e[-1]) if len(e) else 0 for e in self._ends]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        dtype = np.result_type(*[ds.dtype for ds in self.parts]) if self.parts else np.dtype(np.int64)
        self.dtype = np.promote_types(dtype, np.min_scalar_type(self.eos_id))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("PackedStream supports slices only")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("PackedStream slices take step 1")
        out = np.empty(max(stop - start, 0), self.dtype)
        at = 0
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[k + 1]))
            if end > start:
                chunk = self._read(k, start - int(self._starts[k]), end - int(self._starts[k]))
                out[at:at + len(chunk)] = chunk
                at += len(chunk)
            start = end
            k += 1
        return out

    def _read(self, k: int, a: int, b: int) -> np.ndarray:
        """Packed positions [a, b) of part k: the raw tokens in order, EOS at each document's end."""
        ends, tokens = self._ends[k], self.parts[k].tokens
        pos = np.arange(a, b, dtype=np.int64)
        doc = np.searchsorted(ends, pos, side="right")  # document of each position = EOS tokens before it
        is_eos = pos == ends[doc] - 1
        out = np.empty(b - a, self.dtype)
        out[is_eos] = self.eos_id
        keep = ~is_eos
        if keep.any():
            first = int((pos - doc)[keep][0])  # documents are contiguous in .bin: raw index = position - EOS before
            raw = tokens[first:first + int(keep.sum())]
            if self.vocab_size is not None:
                self._check_ids(k, raw)
            out[keep] = raw
        return out

    def _check_ids(self, k: int, raw: np.ndarray) -> None:
        """Raise DifflmError when ``raw`` (tokens of part ``k``) holds an id the model cannot or must not read."""
        low, high = int(raw.min()), int(raw.max())
        bad, why = None, ""
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            why = f"outside the {self.vocab_size:,} ids of data.tokenizer's vocabulary (the model's embedding rows)"
        elif self.mask_id is not None and high >= self.mask_id and bool((raw == self.mask_id).any()):
            bad, why = self.mask_id, "data.tokenizer's mask id, which no text tokenizes to"
        if bad is not None:
            raise DifflmError(f"{self.parts[k].prefix}.bin holds token id {bad}, {why}: it was tokenized with another "
                              "tokenizer; set data.tokenizer to the one that made it, or tokenize the text again "
                              "with data.tokenizer (difflm-preprocess tokenizer=...)")


def packed_stream(ds: IndexedDataset, eos_id: int) -> np.ndarray:
    """All documents of ``ds`` joined with ``eos_id`` after each, materialised (see :class:`PackedStream`)."""
    return PackedStream(ds, eos_id)[:]


class PackedWindows:
    """Documents joined into one token stream with EOS after each document, cut into
    non-overlapping windows of seq_len tokens (the last partial window dropped)."""

    def __init__(self, stream, seq_len: int, doc_eos_id: int | None = None, first: int = 0,
                 count: int | None = None):
        """stream: 1-D token ids (an integer np.ndarray or a :class:`PackedStream`); seq_len >= 1. The windows are
        ``count`` windows starting at window ``first`` of the stream (default: all). With ``doc_eos_id``
        (intra-document attention) :meth:`get` returns a :class:`difflm.data.batch.TokenBatch` with each token's
        document id."""
        if seq_len < 1:
            raise DifflmError(f"data.seq_len={seq_len} must be >= 1")
        n = len(stream) // seq_len - first
        self.stream, self.seq_len, self.doc_eos_id, self.first = stream, seq_len, doc_eos_id, first
        self.count = n if count is None else min(count, n)

    def __len__(self) -> int:
        return self.count

    def get(self, indices: Sequence[int]) -> torch.Tensor:
        """Windows at ``indices`` as a LongTensor [len(indices), seq_len] (int64). IndexError if out of range."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        S = self.seq_len
        rows = [np.asarray(self.stream[(self.first + i) * S:(self.first + i + 1) * S], dtype=np.int64) for i in idx]
        tokens = torch.from_numpy(np.stack(rows) if rows else np.zeros((0, S), np.int64))
        if self.doc_eos_id is None:
            return tokens
        from difflm.data.batch import TokenBatch
        from difflm.model.masks import document_ids

        return TokenBatch(tokens, doc_ids=document_ids(tokens, self.doc_eos_id))


def build_windows(ds: IndexedDataset | Sequence[IndexedDataset], eos_id: int, seq_len: int, valid_fraction: float,
                  intra_document: bool = False, max_train_tokens: int | None = None, corpus: str = "the corpus",
                  vocab_size: int | None = None, mask_id: int | None = None) -> tuple[PackedWindows, PackedWindows]:
    """Split the packed stream of ``ds`` (one dataset or shards in order) into (train, valid) windows.

    Valid = the last ``round(valid_fraction * n)`` windows (at least 1 when valid_fraction > 0),
    train = the windows before them (the first ``max_train_tokens // seq_len`` of them when set: a budget of
    unique training tokens); they are disjoint. Documents longer than a window continue in the next one (nothing is
    cut); the last partial window (under ``seq_len`` tokens) is dropped, with a notice when that is at least
    :data:`TAIL_NOTICE_FRACTION` of the corpus (:func:`tail_notice`; ``corpus`` names it there). With
    ``vocab_size``, every window read is checked for ids of another tokenizer (:class:`PackedStream`), the first
    :data:`CHECK_AT_START` tokens here, before the run starts.

    Raises:
        DifflmError: valid_fraction outside [0, 1) (names data.valid_fraction); seq_len < 1, fewer
            than 2 windows, or no train window left (names data.seq_len and the corpus size);
            ``max_train_tokens`` below one window or above the training windows (names data.max_train_tokens);
            a token id of another tokenizer in the first :data:`CHECK_AT_START` tokens.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise DifflmError(f"data.valid_fraction={valid_fraction} must be in [0, 1): e.g. 0.05")
    if seq_len < 1:
        raise DifflmError(f"data.seq_len={seq_len} must be >= 1")
    stream = PackedStream(ds, eos_id, vocab_size, mask_id)
    stream[:CHECK_AT_START]  # ids of another tokenizer show at once: say so before the run, not at its first step
    n = len(stream) // seq_len
    n_valid = max(1, round(valid_fraction * n)) if valid_fraction > 0 else 0
    if n < 2 or n - n_valid < 1:
        raise DifflmError(
            f"data.seq_len={seq_len} leaves {n} window(s) from a corpus of {len(stream)} tokens "
            f"({n_valid} needed for validation): lower data.seq_len or use a larger corpus"
        )
    if (notice := tail_notice(len(stream), seq_len, corpus)) is not None:
        data_notice(notice)
    n_train = n - n_valid
    if max_train_tokens is not None:
        budget = int(max_train_tokens) // seq_len
        if budget < 1 or budget > n_train:
            raise DifflmError(f"data.max_train_tokens={max_train_tokens} gives {budget} window(s) of data.seq_len="
                              f"{seq_len}, but the corpus has {n_train} training windows ({n_train * seq_len} tokens): "
                              "choose a budget between one window and the training tokens, or null for all")
        n_train = budget
    doc = eos_id if intra_document else None
    return PackedWindows(stream, seq_len, doc, 0, n_train), PackedWindows(stream, seq_len, doc, n - n_valid, n_valid)


CHECK_AT_START = 1 << 20  # tokens read (and checked for the tokenizer's ids) when the windows are built

# the dropped tail is under one window: worth a word only when it is a visible share of a small corpus
TAIL_NOTICE_FRACTION = 0.01


def tail_notice(num_tokens: int, seq_len: int, corpus: str = "the corpus") -> str | None:
    """The notice for the tokens after the last full window of ``seq_len`` in a stream of ``num_tokens``, or None
    when they are under :data:`TAIL_NOTICE_FRACTION` of it (a large corpus loses less than one window)."""
    tail = num_tokens % seq_len
    if num_tokens == 0 or tail / num_tokens < TAIL_NOTICE_FRACTION:
        return None
    return (f"data.seq_len={seq_len} packs the {num_tokens:,} tokens of {corpus} into {num_tokens // seq_len:,} "
            f"windows and drops the last {tail:,} tokens ({tail / num_tokens:.1%}), too few for a window: lower "
            "data.seq_len or add text to use them")


class EpochOrder:
    """Keyed epoch-wise order of ``n`` items: item number k (0-based, counting across epochs) is ``perm_e[k % n]``
    with ``e = k // n`` and ``perm_e`` a permutation drawn by numpy's PCG64 seeded with ``[*key, e]``. Every item
    comes once per epoch; any k is computed directly, so the order is a pure function of (key, k)."""

    def __init__(self, n: int, key: Sequence[int]):
        self.n, self.key = int(n), [int(x) for x in key]
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:  # a step spans at most a few epochs; keep memory bounded
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.Generator(np.random.PCG64([*self.key, epoch]))
            self._perms[epoch] = rng.permutation(self.n).astype(np.int64)
        return self._perms[epoch]

    def at(self, k: np.ndarray) -> np.ndarray:
        """Items number ``k`` (int64 array) -> item indices in [0, n), int64."""
        k = np.asarray(k, dtype=np.int64)
        epochs = k // self.n
        out = np.empty_like(k)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[k[sel] % self.n]
        return out


class GlobalBatchSampler:
    """Deterministic, layout-independent order: global sample g = step*global_batch_size + j is
    window perm_e[g % n] with e = g // n and perm_e = a permutation seeded by (seed, e) (numpy
    Generator(PCG64) seeded with [seed, e]; :class:`EpochOrder`). The position is fully given by the step, so
    resume is exact. A blend of corpora has its own sampler (:class:`difflm.data.blend.BlendedSampler`)."""

    def __init__(self, num_windows: int, global_batch_size: int, seed: int):
        """Raises DifflmError if num_windows < 1, global_batch_size < 1 or seed < 0."""
        check_sampler_args(num_windows, global_batch_size, seed)
        self.num_windows, self.global_batch_size, self.seed = int(num_windows), int(global_batch_size), int(seed)
        self._order = EpochOrder(self.num_windows, [self.seed])

    def indices(self, step: int) -> np.ndarray:
        """Window indices [global_batch_size] int64 for 0-based ``step``."""
        return self._order.at(step * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64))

    def report(self, step: int) -> dict:
        """Metrics of the data consumed before ``step``: ``data_epochs`` (passes over the training windows)."""
        return {"data_epochs": step * self.global_batch_size / self.num_windows}

    def state_dict(self, step: int) -> dict:
        """What a checkpoint stores to check a resume: consumed samples and the order's inputs."""
        return {
            "consumed_samples": step * self.global_batch_size,
            "num_windows": self.num_windows,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
        }

    def check_state(self, state: dict) -> None:
        """Raise DifflmError if num_windows/seed/global_batch_size differ from a checkpoint's state."""
        check_state_keys(self, self.state_dict(0), state)


def check_sampler_args(num_windows: int, global_batch_size: int, seed: int) -> None:
    if num_windows < 1:
        raise DifflmError(f"num_windows={num_windows}: the training set has no windows; lower data.seq_len")
    if global_batch_size < 1:
        raise DifflmError(f"global_batch_size={global_batch_size} must be >= 1")
    if seed < 0:
        raise DifflmError(f"seed={seed} must be >= 0 (it seeds numpy's PCG64)")


# the settings behind each order input of a sampler's state: what a resume that changed it has to restore
STATE_KEY_SETTINGS = {
    "num_windows": "the training windows: data.path / data.blend, data.seq_len, data.valid_fraction, "
                   "data.max_train_tokens, data.doc_separator or the tokenizer",
    "seed": "train.seed",
    "global_batch_size": "train.global_batch_size",
    "blend": "data.blend (its sources, weights and their windows)",
}


def check_state_keys(sampler, mine: dict, state: dict) -> None:
    """Raise DifflmError naming the first order input (not ``consumed_samples``) that differs from a checkpoint's,
    and the settings that make it (:data:`STATE_KEY_SETTINGS`)."""
    for key, value in mine.items():
        if key != "consumed_samples" and key in state and state[key] != value:
            made_by = STATE_KEY_SETTINGS.get(key, "the data settings")
            raise DifflmError(
                f"{key} changed since the checkpoint ({state[key]} -> {value}), set by {made_by}: the resumed run "
                "would read other data in another order; restore those settings as the checkpoint's config.yaml has "
                "them, or start a new run.dir (from these weights: difflm-export, then difflm-import the export; or "
                "lora=... on them)"
            )


def token_datasets(cfg, tok: TokenizerInfo, cache_dir: str) -> list[IndexedDataset]:
    """The tokenized corpus of ``cfg.path`` / ``cfg.hf_dataset`` as .bin/.idx datasets in order: the shards when
    the path names ``difflm-preprocess`` output or other Megatron .bin/.idx files
    (:func:`difflm.data.shards.find_shards`), else the in-trainer cache of the text
    (:func:`difflm.data.preprocess.tokenize_corpus`)."""
    from difflm.data.preprocess import tokenize_corpus
    from difflm.data.shards import find_shards, open_shards

    prefixes = None if getattr(cfg, "hf_dataset", None) else find_shards(cfg.path, tok)
    if prefixes is not None:
        return open_shards(prefixes, cfg.path)
    return [tokenize_corpus(cfg, tok, cache_dir)]
