"""Text corpus -> tokenized, cached Megatron .bin/.idx dataset (the in-trainer path; ``difflm-preprocess`` writes
the same tokens into shards, :mod:`difflm.data.shards`)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from difflm.checkpoint.manifest import file_sha256
from difflm.data.corpus_check import CorpusCheck
from difflm.data.documents import (DocFormat, Piece, data_notice, iter_documents, kind_of, load_hf, read_jsonl,
                                   resolve_sources)
from difflm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, remove_stale_temporaries, token_dtype
from difflm.data.tokenizer import TokenizerInfo
from difflm.errors import DifflmError

# bump when document splitting, tokenization or the on-disk layout changes (old caches are then rebuilt)
# 2: special-token text inside documents is plain text (split_special_tokens); parquet; data.encoding
# 3: a UTF-8 byte-order mark at the start of a .txt/.jsonl file is not text
FORMAT_VERSION = 3
BATCH_DOCS = 1000

__all__ = ["tokenize_corpus", "tokenized_batches", "resolve_sources", "read_jsonl", "FORMAT_VERSION"]


def tokenized_batches(tok: TokenizerInfo, docs: Iterable[str], batch_docs: int = BATCH_DOCS
                      ) -> Iterator[tuple[list[np.ndarray], int, int]]:
    """Tokenize documents in batches: per batch (token arrays of its non-empty documents, documents read, characters
    read). Empty documents (and documents that tokenize to nothing) are dropped; no EOS is added.

    The one tokenization of corpus text: the in-trainer cache and every ``difflm-preprocess`` worker call it, so
    both write the same tokens (:meth:`TokenizerInfo.encode`: special-token text is plain text).
    """
    buf: list[str] = []
    read = chars = 0

    def flush():
        ids = tok.encode(buf) if buf else []
        return [np.asarray(x) for x in ids if x], read, chars

    for d in docs:
        read += 1
        chars += len(d)
        if d:
            buf.append(d)
            if len(buf) == batch_docs:
                yield flush()
                buf, read, chars = [], 0, 0
    if buf or read:
        yield flush()


def tokenize_corpus(cfg, tok: TokenizerInfo, cache_dir: str) -> IndexedDataset:
    """Tokenize ``cfg.path`` / ``cfg.hf_dataset`` into ``<cache_dir>/<key>.bin/.idx`` (reused if present).

    The key hashes the format version, every source file (format, size and sha256 of bytes, not its path) or the
    HF dataset fingerprint, the tokenizer definition, ``text_field``, ``doc_separator`` and ``encoding``.
    Documents come from :func:`difflm.data.documents.iter_documents` and are tokenized by
    :func:`tokenized_batches` (special-token text stays text), as in ``difflm-preprocess``.
    Tokens are stored as uint16 when ``tok.padded_vocab_size`` <= 65535, else int32. No EOS is
    stored; :func:`difflm.data.windows.build_windows` inserts it.

    Raises:
        DifflmError: bad ``data.path``/``data.hf_dataset``/``data.text_field``/``data.encoding``, a file that is
            not text in ``data.encoding``, or an empty corpus.
    """
    fmt = DocFormat.of(cfg)
    key_parts: list = [FORMAT_VERSION, tok.fingerprint, cfg.text_field, cfg.doc_separator, fmt.encoding]
    hf = None
    if cfg.hf_dataset:
        hf = load_hf(cfg.hf_dataset, cfg.hf_split, fmt)
        key_parts += ["hf", cfg.hf_dataset, cfg.hf_split, getattr(hf, "_fingerprint", None)]
        pieces = [Piece(cfg.hf_dataset, 0, None, "hf")]
        total = len(hf)
        source = f"data.hf_dataset={cfg.hf_dataset!r}"
    else:
        files = resolve_sources(cfg.path)
        # by content and format (the suffix says how a file is read), not path: a moved corpus hits the cache
        key_parts += [[kind_of(f), os.path.getsize(f), file_sha256(f)] for f in files]
        pieces = [Piece(f, 0, None, kind_of(f)) for f in files]
        total = None
        source = f"data.path={cfg.path!r}"
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:32]
    prefix = os.path.join(cache_dir, key)
    remove_stale_temporaries(prefix)  # a killed earlier build's partial copy, also when the cache is complete now
    if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
        if cfg.num_proc and cfg.num_proc > 0:
            # only effective before the Rust thread pool first starts; harmless otherwise
            os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.num_proc))
        builder = IndexedDatasetBuilder(prefix, token_dtype(tok.padded_vocab_size))
        bar = tqdm(total=total, desc="tokenizing", unit="doc", disable=not sys.stderr.isatty())
        check = CorpusCheck()
        try:
            for piece in pieces:
                docs = check.scan(iter_documents(piece, fmt, hf), fmt.doc_separator if piece.kind == "txt" else None)
                for arrays, read, _ in tokenized_batches(tok, docs):
                    for ids in arrays:
                        builder.add_document(ids)
                    bar.update(read)
        except BaseException:
            builder.abort()
            raise
        bar.close()
        builder.finalize()
        if (notice := check.notice(source, separator=fmt.doc_separator)) is not None:  # once, when tokenized
            data_notice(notice)
    ds = IndexedDataset(prefix)
    if len(ds) == 0 or ds.num_tokens == 0:
        raise DifflmError(f"{source} gives an empty corpus after tokenization: point it at non-empty text")
    return ds
