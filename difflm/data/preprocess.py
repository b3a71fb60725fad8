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
# characters per tokenizer call: a transformers tokenizer holds about 700 bytes per token of its output at once
# (ids, offsets, token strings), so a call is kept near 2^20 characters (~0.2 GB), however long a document is
BATCH_CHARS = 1 << 20
PIECE_CHARS = 1 << 18  # a document longer than BATCH_CHARS is tokenized in pieces of about this many characters
CUT_CONTEXT = 1000  # characters each side of a cut whose tokens are compared with and without the cut

__all__ = ["tokenize_corpus", "tokenized_batches", "resolve_sources", "read_jsonl", "FORMAT_VERSION"]


def tokenized_batches(tok: TokenizerInfo, docs: Iterable[str], batch_docs: int = BATCH_DOCS
                      ) -> Iterator[tuple[list[np.ndarray], int, int]]:
    """Tokenize documents in batches: per batch (token arrays of its non-empty documents, documents read, characters
    read). Empty documents (and documents that tokenize to nothing) are dropped; no EOS is added. A batch is at most
    ``batch_docs`` documents and about :data:`BATCH_CHARS` characters; a longer document is a batch of its own,
    tokenized in pieces (:func:`encode_long`), so memory stays bounded on any corpus.

    The one tokenization of corpus text: the in-trainer cache and every ``difflm-preprocess`` worker call it, so
    both write the same tokens (:meth:`TokenizerInfo.encode`: special-token text is plain text).
    """
    buf: list[str] = []
    read = chars = 0

    def flush():
        ids = tok.encode(buf) if buf else []
        return [np.asarray(x) for x in ids if x], read, chars

    for d in docs:
        if len(d) > BATCH_CHARS:
            if buf:
                yield flush()
                buf, read, chars = [], 0, 0
            ids = encode_long(tok, d)
            yield ([ids] if len(ids) else []), read + 1, chars + len(d)
            buf, read, chars = [], 0, 0
            continue
        read += 1
        chars += len(d)
        if d:
            buf.append(d)
            if len(buf) == batch_docs or chars >= BATCH_CHARS:
                yield flush()
                buf, read, chars = [], 0, 0
    if buf or read:
        yield flush()


def encode_long(tok: TokenizerInfo, doc: str) -> np.ndarray:
    """The token ids of one long document (int64), tokenized in pieces of about :data:`PIECE_CHARS` characters, at
    most :data:`BATCH_CHARS` per tokenizer call, so memory does not grow with the document.

    The ids are those of the whole document: a piece ends only where the tokens of the :data:`CUT_CONTEXT`
    characters each side, tokenized apart, equal their tokens tokenized together (a pre-tokenizer boundary, such as
    a line start or a space before a word with GPT-2's and GPT-NeoX's byte-level BPE). Where no such place is found
    (a tokenizer that adds a prefix to every text, e.g. SentencePiece's), the rest is tokenized in one call.
    """
    cuts, pos = [0], 0
    while len(doc) - pos > BATCH_CHARS:
        cut = _safe_cut(tok, doc, pos + PIECE_CHARS // 2, pos + PIECE_CHARS)
        if cut is None:
            break
        cuts.append(pos := cut)
    cuts.append(len(doc))
    out, group, size = [], [], 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        group.append(doc[a:b])
        size += b - a
        if size >= BATCH_CHARS - PIECE_CHARS or b == len(doc):
            out.extend(np.asarray(x, dtype=np.int64) for x in tok.encode(group))
            group, size = [], 0
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _safe_cut(tok: TokenizerInfo, doc: str, lo: int, hi: int, tries: int = 4) -> int | None:
    """A position in ``(lo, hi]`` of ``doc`` where cutting leaves its tokens unchanged (see :func:`encode_long`):
    the start of a line, else a space, checked from ``hi`` back, ``tries`` of each; None when none passes."""
    for find in (lambda end: doc.rfind("\n", lo, end - 1) + 1, lambda end: doc.rfind(" ", lo + 1, end)):
        end = hi + 1
        for _ in range(tries):
            cut = find(end)
            if cut <= lo:
                break
            left, right = doc[max(0, cut - CUT_CONTEXT):cut], doc[cut:cut + CUT_CONTEXT]
            a, b, both = tok.encode([left, right, left + right])
            if a + b == both:
                return cut
            end = cut
    return None


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
