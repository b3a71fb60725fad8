"""Text corpus -> tokenized, cached Megatron .bin/.idx dataset."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from typing import Iterator

import numpy as np
from tqdm import tqdm

from difflm.checkpoint.manifest import file_sha256
from difflm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, token_dtype
from difflm.data.tokenizer import TokenizerInfo
from difflm.errors import DifflmError

FORMAT_VERSION = 1  # bump when document splitting or the on-disk layout changes
BATCH_DOCS = 1000
EXTS = (".txt", ".jsonl")


def resolve_sources(path: str) -> list[str]:
    """``data.path`` (file, directory or glob) -> sorted list of .txt/.jsonl files.

    Raises:
        DifflmError: the path does not exist, the glob matches nothing, or there are no .txt/.jsonl files.
    """
    fix = "point data.path at a .txt/.jsonl file, a directory or a glob"
    p = os.path.expanduser(path)
    if os.path.isfile(p):
        if not p.endswith(EXTS):
            raise DifflmError(f"data.path={path!r} is not a .txt or .jsonl file: {fix}")
        return [os.path.abspath(p)]
    if os.path.isdir(p):
        files = sorted(
            os.path.join(root, f) for root, _, names in os.walk(p) for f in names if f.endswith(EXTS)
        )
        if not files:
            raise DifflmError(f"data.path={path!r} is a directory with no .txt or .jsonl files under it: {fix}")
        return [os.path.abspath(f) for f in files]
    if glob.has_magic(p):
        matched = sorted(glob.glob(p, recursive=True))
        files = [os.path.abspath(f) for f in matched if os.path.isfile(f) and f.endswith(EXTS)]
        if not files:
            what = "matches nothing" if not matched else "matches no .txt or .jsonl files"
            raise DifflmError(f"data.path={path!r} {what}: {fix}")
        return files
    raise DifflmError(f"data.path={path!r} does not exist: {fix}")


def tokenizer_fingerprint(tok: TokenizerInfo) -> str:
    """sha256 of the tokenizer's class and full definition (vocab, merges, normalizer, ...)."""
    t = tok.tokenizer
    backend = getattr(t, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(t.get_vocab().items()))
    return hashlib.sha256(f"{type(t).__module__}.{type(t).__qualname__}\n{body}".encode()).hexdigest()


def _split_txt(path: str, sep: str | None) -> Iterator[str]:
    """Documents of a .txt file: text between lines equal to ``sep`` (or the whole file), stripped."""
    with open(path, encoding="utf-8") as f:  # text mode: CRLF -> LF
        if sep is None:
            yield f.read().strip()
            return
        buf: list[str] = []
        for line in f:
            if line.strip() == sep:
                yield "".join(buf).strip()
                buf = []
            else:
                buf.append(line)
        yield "".join(buf).strip()


def read_jsonl(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed record) of every non-empty line of a JSONL file.

    Raises: DifflmError naming ``data.path`` and the line for invalid JSON.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DifflmError(f"data.path: {path}:{lineno} is not valid JSON ({e}): fix or remove that line") from None


def _split_jsonl(path: str, field: str) -> Iterator[str]:
    for lineno, rec in read_jsonl(path):
        if not isinstance(rec, dict) or field not in rec:
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise DifflmError(
                f"data.text_field={field!r} not found in {path}:{lineno} (keys: {keys}): set data.text_field to one of them"
            )
        yield str(rec[field]).strip()


def _file_docs(files: list[str], cfg) -> Iterator[str]:
    for path in files:
        if path.endswith(".jsonl"):
            yield from _split_jsonl(path, cfg.text_field)
        else:
            yield from _split_txt(path, cfg.doc_separator)


def _load_hf(cfg):
    """Load ``cfg.hf_dataset`` (saved directory or hub name), split ``cfg.hf_split``."""
    import datasets

    name = cfg.hf_dataset
    try:
        if os.path.isdir(os.path.expanduser(name)):
            ds = datasets.load_from_disk(os.path.expanduser(name))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.hf_split]
        else:
            ds = datasets.load_dataset(name, split=cfg.hf_split)
    except Exception as e:  # noqa: BLE001
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise DifflmError(
            f"data.hf_dataset={name!r} (split data.hf_split={cfg.hf_split!r}) could not be loaded ({reason}): "
            "give a save_to_disk directory or a datasets hub name"
        ) from None
    if cfg.text_field not in ds.column_names:
        raise DifflmError(
            f"data.text_field={cfg.text_field!r} is not a column of data.hf_dataset={name!r} "
            f"(columns: {ds.column_names}): set data.text_field to one of them"
        )
    return ds


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    buf: list[str] = []
    for d in docs:
        if d:  # empty documents are skipped
            buf.append(d)
            if len(buf) == n:
                yield buf
                buf = []
    if buf:
        yield buf


def tokenize_corpus(cfg, tok: TokenizerInfo, cache_dir: str) -> IndexedDataset:
    """Tokenize ``cfg.path`` / ``cfg.hf_dataset`` into ``<cache_dir>/<key>.bin/.idx`` (reused if present).

    The key hashes the format version, every source file (path, size, sha256 of bytes) or the
    HF dataset fingerprint, the tokenizer definition, ``text_field`` and ``doc_separator``.
    Tokens are stored as uint16 when ``tok.padded_vocab_size`` <= 65535, else int32. No EOS is
    stored; :func:`difflm.data.windows.build_windows` inserts it.

    Raises:
        DifflmError: bad ``data.path``/``data.hf_dataset``/``data.text_field``, or an empty corpus.
    """
    key_parts: list = [FORMAT_VERSION, tokenizer_fingerprint(tok), cfg.text_field, cfg.doc_separator]
    if cfg.hf_dataset:
        hf = _load_hf(cfg)
        key_parts += ["hf", cfg.hf_dataset, cfg.hf_split, getattr(hf, "_fingerprint", None)]
        docs: Iterator[str] = (str(t).strip() for t in hf[cfg.text_field])
        total = len(hf)
        source = f"data.hf_dataset={cfg.hf_dataset!r}"
    else:
        files = resolve_sources(cfg.path)
        key_parts += [[f, os.path.getsize(f), file_sha256(f)] for f in files]
        docs = _file_docs(files, cfg)
        total = None
        source = f"data.path={cfg.path!r}"
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:32]
    prefix = os.path.join(cache_dir, key)
    if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
        if cfg.num_proc and cfg.num_proc > 0:
            # only effective before the Rust thread pool first starts; harmless otherwise
            os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.num_proc))
        builder = IndexedDatasetBuilder(prefix, token_dtype(tok.padded_vocab_size))
        bar = tqdm(total=total, desc="tokenizing", unit="doc", disable=not sys.stderr.isatty())
        for batch in _batches(docs, BATCH_DOCS):
            for ids in tok.tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
                if ids:
                    builder.add_document(np.asarray(ids))
            bar.update(len(batch))
        bar.close()
        builder.finalize()
    ds = IndexedDataset(prefix)
    if len(ds) == 0 or ds.num_tokens == 0:
        raise DifflmError(f"{source} gives an empty corpus after tokenization: point it at non-empty text")
    return ds
