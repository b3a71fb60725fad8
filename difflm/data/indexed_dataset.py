"""Megatron-LM ``MMapIndexedDataset`` (.bin/.idx) writer and memory-mapped reader.

.idx layout (little endian): magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version (1), ``<B`` dtype code,
``<Q`` sequence count, ``<Q`` document-index count (= documents + 1, as Megatron writes
``len(document_indices)``), int32 sizes[seq], int64 pointers[seq] (byte offsets into .bin),
int64 document_indices[doc + 1]. .bin holds the raw tokens. Here one sequence = one document.
"""
from __future__ import annotations

import contextlib
import glob
import os
import socket
import struct
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from difflm.errors import DifflmError

MAGIC = b"MMIDIDX\x00\x00"
# what fixes a damaged .bin/.idx pair, whichever tool wrote it
REBUILD = ("shards of difflm-preprocess: re-run the same difflm-preprocess command (it rewrites damaged shards); a "
           "training run's token cache (under data.cache_dir): delete that cache directory and re-run the training")
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


STALE_AFTER_S = 600.0  # a temporary file untouched this long, of a dead process on this host, is removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(prefix: str, now: float | None = None) -> list[str]:
    """Delete ``<prefix>.bin|.idx.tmp-<host>-<pid>`` files left by a builder that was killed (``kill -9``, OOM, power
    loss) and returns their paths. Only files written from this host by a process that no longer runs and untouched
    for :data:`STALE_AFTER_S` seconds go: a cache directory on a shared filesystem may hold another host's (or another
    PID namespace's) builder in progress, and a pid alone cannot tell."""
    host, now = socket.gethostname(), time.time() if now is None else now
    removed = []
    for path in glob.glob(glob.escape(prefix) + ".*.tmp-*"):
        owner = path.rsplit(".tmp-", 1)[1]
        name, _, pid = owner.rpartition("-")
        if name != host or not pid.isdigit() or _process_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            if now - os.path.getmtime(path) >= STALE_AFTER_S:
                os.remove(path)
                removed.append(path)
    return removed


class IndexedDatasetBuilder:
    """Streams documents into ``<prefix>.bin``/``.idx``.

    Writes to temporary names (``.tmp-<host>-<pid>`` appended), fsyncs them and ``os.replace``s them in
    :meth:`finalize` (.idx last), so a crash (or power loss) never leaves a half-written dataset under the final
    name; the temporaries a killed builder leaves are removed by the next builder of the same prefix on that host
    (:func:`remove_stale_temporaries`).
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"unsupported dtype {self.dtype}")
        self._tmp = f".tmp-{socket.gethostname()}-{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        remove_stale_temporaries(prefix)
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

    def abort(self) -> None:
        """Close and delete the temporary files (after an error); nothing under the final names is touched."""
        self._bin.close()
        for suffix in (".bin", ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.prefix + suffix + self._tmp)

    def finalize(self) -> None:
        """Write the index, fsync both files and atomically move them to their final names (.idx last)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
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
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")  # last: .idx present <=> dataset complete
        fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, fsynced and renamed over it (the
    directory fsynced too): a reader sees the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(str(path.parent))


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames in it survive a power loss (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
            raise DifflmError(f"indexed dataset {prefix!r}: {idx_path} or {bin_path} missing: {REBUILD}")
        with open(idx_path, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != MAGIC:
            raise DifflmError(f"indexed dataset {idx_path!r} is not a Megatron .idx file: {REBUILD}")
        version, code, n_seq, n_doc_idx = struct.unpack("<QBQQ", head[9:])
        if version != VERSION or code not in DTYPE_CODES:
            raise DifflmError(f"indexed dataset {idx_path!r}: unsupported version {version} / dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        off = len(head)
        expected = off + 12 * n_seq + 8 * n_doc_idx
        if os.path.getsize(idx_path) != expected:
            raise DifflmError(f"indexed dataset {idx_path!r} is truncated or corrupt ({os.path.getsize(idx_path)} bytes, "
                              f"its header says {expected}): {REBUILD}")
        # the index is read, not mapped: a memory map holds a file descriptor for its lifetime, and a corpus of
        # thousands of shards would then hold two per shard (the pointers are not needed: documents are contiguous)
        sizes = np.fromfile(idx_path, np.int32, n_seq, offset=off)
        self.document_indices = np.fromfile(idx_path, np.int64, n_doc_idx, offset=off + 12 * n_seq)
        nbytes = os.path.getsize(bin_path)
        if nbytes != int(sizes.sum(dtype=np.int64)) * self.dtype.itemsize:
            raise DifflmError(f"indexed dataset {bin_path!r} has {nbytes} bytes, its index says "
                              f"{int(sizes.sum(dtype=np.int64)) * self.dtype.itemsize}: it is truncated or "
                              f"corrupt: {REBUILD}")
        # np.memmap refuses empty files; an empty corpus is reported by the caller. The one file descriptor a
        # dataset holds: :func:`difflm.data.shards.open_shards` makes room for one per shard.
        self.tokens = (np.memmap(bin_path, self.dtype, "r") if nbytes else np.zeros(0, self.dtype))
        seq_ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
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
