"""Megatron-LM ``MMapIndexedDataset`` (.bin/.idx) writer and memory-mapped reader.

.idx layout (little endian): magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version (1), ``<B`` dtype code,
``<Q`` sequence count, ``<Q`` document-index count (= documents + 1, as Megatron writes
``len(document_indices)``), int32 sizes[seq], int64 pointers[seq] (byte offsets into .bin),
int64 document_indices[doc + 1]. .bin holds the raw tokens. Here one sequence = one document.
"""
from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np

from difflm.errors import DifflmError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


class IndexedDatasetBuilder:
    """Streams documents into ``<prefix>.bin``/``.idx``.

    Writes to temporary names and ``os.replace``s them in :meth:`finalize` (.idx last), so a
    crash never leaves a half-written dataset under the final name.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"unsupported dtype {self.dtype}")
        self._tmp = f".tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin" + self._tmp, "wb")
        self._sizes: list[int] = []

    def add_document(self, ids: np.ndarray | Sequence[int]) -> None:
        """Append one document (1-D token ids). Raises ValueError if an id does not fit the dtype."""
        arr = np.asarray(ids)
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"token id out of range for {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def finalize(self) -> None:
        """Write the index and atomically move both files to their final names."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        idx_tmp = self.prefix + ".idx" + self._tmp
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")  # last: .idx present <=> dataset complete


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin``/``.idx``.

    ``len(ds)`` = number of documents; ``ds[i]`` = 1-D np.ndarray of document i (a memmap view
    when the document is one sequence); ``ds.num_tokens``; ``ds.tokens`` = the whole .bin;
    ``ds.document_lengths`` = int64 [num_docs].

    Raises:
        DifflmError: the files are missing or the index is not a Megatron MMapIndexedDataset.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        if not (os.path.exists(idx_path) and os.path.exists(bin_path)):
            raise DifflmError(f"indexed dataset {prefix!r}: {idx_path} or {bin_path} missing: delete the cache and re-run")
        with open(idx_path, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != MAGIC:
            raise DifflmError(f"indexed dataset {idx_path!r} is not a Megatron .idx file: delete it and re-run")
        version, code, n_seq, n_doc_idx = struct.unpack("<QBQQ", head[9:])
        if version != VERSION or code not in DTYPE_CODES:
            raise DifflmError(f"indexed dataset {idx_path!r}: unsupported version {version} / dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        off = len(head)
        self.sizes = np.memmap(idx_path, np.int32, "r", off, (n_seq,))
        off += 4 * n_seq
        self.pointers = np.memmap(idx_path, np.int64, "r", off, (n_seq,))
        off += 8 * n_seq
        self.document_indices = np.array(np.memmap(idx_path, np.int64, "r", off, (n_doc_idx,)))
        nbytes = os.path.getsize(bin_path)
        # np.memmap refuses empty files; an empty corpus is reported by the caller
        self.tokens = (np.memmap(bin_path, self.dtype, "r") if nbytes else np.zeros(0, self.dtype))
        seq_ends = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        self.document_lengths = seq_ends[self.document_indices[1:]] - seq_ends[self.document_indices[:-1]]
        self._doc_start = seq_ends[self.document_indices[:-1]]

    def __len__(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens over all documents."""
        return int(self.document_lengths.sum())

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range [0, {n})")
        i %= n
        start = int(self._doc_start[i])
        # pointers are cumulative, so a document's sequences are contiguous in .bin
        return self.tokens[start:start + int(self.document_lengths[i])]
