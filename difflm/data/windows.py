"""Packed training windows and the deterministic global batch order."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from difflm.data.indexed_dataset import IndexedDataset
from difflm.data.tokenizer import TokenizerInfo
from difflm.errors import DifflmError


def packed_stream(ds: IndexedDataset, eos_id: int) -> np.ndarray:
    """All documents of ``ds`` joined with ``eos_id`` after each: 1-D array, ds.tokens' dtype
    widened if needed to hold eos_id, length ``ds.num_tokens + len(ds)``."""
    lengths = ds.document_lengths.astype(np.int64)
    dtype = np.promote_types(ds.dtype, np.min_scalar_type(eos_id))
    out = np.empty(int(lengths.sum()) + len(lengths), dtype=dtype)
    eos_pos = np.cumsum(lengths + 1) - 1
    is_tok = np.ones(len(out), dtype=bool)
    is_tok[eos_pos] = False
    # documents are contiguous in .bin, so one vectorised scatter packs everything
    out[is_tok] = ds.tokens[: int(lengths.sum())]
    out[eos_pos] = eos_id
    return out


class PackedWindows:
    """Documents joined into one token stream with EOS after each document, cut into
    non-overlapping windows of seq_len tokens (the last partial window dropped)."""

    def __init__(self, stream: np.ndarray, seq_len: int, doc_eos_id: int | None = None):
        """stream: 1-D token ids (any integer dtype); seq_len >= 1. With ``doc_eos_id`` (intra-document
        attention) :meth:`get` returns a :class:`difflm.data.batch.TokenBatch` with each token's document id."""
        if seq_len < 1:
            raise DifflmError(f"data.seq_len={seq_len} must be >= 1")
        n = len(stream) // seq_len
        self.seq_len, self.doc_eos_id = seq_len, doc_eos_id
        self.windows = np.asarray(stream)[: n * seq_len].reshape(n, seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def get(self, indices: Sequence[int]) -> torch.Tensor:
        """Windows at ``indices`` as a LongTensor [len(indices), seq_len] (int64). IndexError if out of range."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        tokens = torch.from_numpy(self.windows[idx].astype(np.int64))
        if self.doc_eos_id is None:
            return tokens
        from difflm.data.batch import TokenBatch
        from difflm.model.masks import document_ids

        return TokenBatch(tokens, doc_ids=document_ids(tokens, self.doc_eos_id))


def build_windows(ds: IndexedDataset, eos_id: int, seq_len: int, valid_fraction: float,
                  intra_document: bool = False) -> tuple[PackedWindows, PackedWindows]:
    """Split the packed stream of ``ds`` into (train, valid) windows.

    Valid = the last ``round(valid_fraction * n)`` windows (at least 1 when valid_fraction > 0),
    train = the windows before them; they are disjoint.

    Raises:
        DifflmError: valid_fraction outside [0, 1) (names data.valid_fraction); seq_len < 1, fewer
            than 2 windows, or no train window left (names data.seq_len and the corpus size).
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise DifflmError(f"data.valid_fraction={valid_fraction} must be in [0, 1): e.g. 0.05")
    if seq_len < 1:
        raise DifflmError(f"data.seq_len={seq_len} must be >= 1")
    stream = packed_stream(ds, eos_id)
    n = len(stream) // seq_len
    n_valid = max(1, round(valid_fraction * n)) if valid_fraction > 0 else 0
    if n < 2 or n - n_valid < 1:
        raise DifflmError(
            f"data.seq_len={seq_len} leaves {n} window(s) from a corpus of {len(stream)} tokens "
            f"({n_valid} needed for validation): lower data.seq_len or use a larger corpus"
        )
    cut = (n - n_valid) * seq_len
    doc = eos_id if intra_document else None
    return PackedWindows(stream[:cut], seq_len, doc), PackedWindows(stream[cut : n * seq_len], seq_len, doc)


class GlobalBatchSampler:
    """Deterministic, layout-independent order: global sample g = step*global_batch_size + j is
    window perm_e[g % n] with e = g // n and perm_e = a permutation seeded by (seed, e) (numpy
    Generator(PCG64) seeded with [seed, e]). The position is fully given by the step, so resume
    is exact."""

    def __init__(self, num_windows: int, global_batch_size: int, seed: int):
        """Raises DifflmError if num_windows < 1, global_batch_size < 1 or seed < 0."""
        if num_windows < 1:
            raise DifflmError(f"num_windows={num_windows}: the training set has no windows; lower data.seq_len")
        if global_batch_size < 1:
            raise DifflmError(f"global_batch_size={global_batch_size} must be >= 1")
        if seed < 0:
            raise DifflmError(f"seed={seed} must be >= 0 (it seeds numpy's PCG64)")
        self.num_windows, self.global_batch_size, self.seed = int(num_windows), int(global_batch_size), int(seed)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:  # a step spans at most a few epochs; keep memory bounded
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.num_windows).astype(np.int64)
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Window indices [global_batch_size] int64 for 0-based ``step``."""
        n = self.num_windows
        g = step * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        epochs = g // n
        out = np.empty_like(g)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[g[sel] % n]
        return out

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
        for key in ("num_windows", "seed", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise DifflmError(
                    f"{key} changed since the checkpoint ({state[key]} -> {getattr(self, key)}): the data or batch "
                    "changed since the checkpoint; restore the original data/batch/seed config or start a new run"
                )


def build_datasets(cfg, tok: TokenizerInfo, cache_dir: str) -> tuple[PackedWindows, PackedWindows]:
    """tokenize_corpus + build_windows for a DataConfig: returns (train, valid) windows."""
    from difflm.data.preprocess import tokenize_corpus

    if not 0.0 <= cfg.valid_fraction < 1.0:  # fail before a possibly long tokenization
        raise DifflmError(f"data.valid_fraction={cfg.valid_fraction} must be in [0, 1): e.g. 0.05")
    if getattr(cfg, "prompt_field", None) is not None:  # objective=sft: prompt/response pairs
        from difflm.data.sft import build_sft_datasets

        return build_sft_datasets(cfg, tok)
    ds = tokenize_corpus(cfg, tok, cache_dir)
    return build_windows(ds, tok.eos_id, cfg.seq_len, cfg.valid_fraction, getattr(cfg, "intra_document_attention", False))
