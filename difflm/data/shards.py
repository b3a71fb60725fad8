"""Pretokenized corpora: ``difflm-preprocess`` writes Megatron .bin/.idx shards once, ``data.path`` reads them.

The counterpart of Megatron-LM's ``tools/preprocess_data.py``. Layout of an output directory::

    shard_00000.bin / .idx   documents of consecutive pieces of the input (whole documents, no EOS stored:
    shard_00001.bin / .idx   the loader inserts one after every document, as for the in-trainer cache)
    manifest.json            format, tokenizer (name, sha256 of its definition), settings, every source
                             (path, size, sha256; or the datasets fingerprint) and every shard (its pieces,
                             documents, tokens); ``complete`` is true once every shard is written

* The input is cut into pieces of about ``shard_mb`` MB of whole documents (:func:`difflm.data.documents.file_pieces`),
  and consecutive pieces smaller than that (small files, the ends of files) are joined into shards of about
  ``shard_mb`` (:func:`group_pieces`), so a corpus of many small files makes few shards; they are tokenized by
  ``workers`` processes with :func:`difflm.data.preprocess.tokenized_batches`
  (the in-trainer path's function, so the tokens are the same).
* A shard is written under a temporary name, fsynced and renamed (.bin, then .idx): a crash never leaves a shard
  that looks complete. A rerun with the same inputs and settings skips the finished shards and writes the rest;
  different inputs or settings are refused unless ``overwrite=true``. Inputs and tokenizer are compared by content
  (:func:`content_view`), not by the paths they were read from.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Optional

from difflm.cli import writable_output
from difflm.data.corpus_check import CorpusCheck
from difflm.data.documents import (DocFormat, Piece, data_notice, file_pieces, hf_pieces, iter_documents, load_hf,
                                   resolve_sources)
from difflm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, token_dtype, write_text_atomic
from difflm.data.tokenizer import TokenizerInfo, tokenizer_reference
from difflm import strict_json
from difflm.errors import DifflmError

MANIFEST = "manifest.json"
FORMAT, VERSION = "difflm-preprocess", 2  # 2: a shard holds a list of pieces
KILL_ENV = "DIFFLM_PREPROCESS_KILL_AT_SHARD"  # test hook: SIGKILL the process writing this shard, mid-write


# ---------------------------------------------------------------- reading shards (data.path)
def read_manifest(path: str) -> Optional[dict]:
    """The manifest of an output directory, or None when it has none (or it is not difflm-preprocess's)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        m = json.loads(Path(file).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


class OtherTokenizerShards(DifflmError):
    """``difflm-preprocess`` output made with another tokenizer than the run's. Carries ``path`` and the output's
    ``manifest``, so a command whose fix differs (``difflm-eval``, which has no ``data.tokenizer`` key) can word its
    own message from the same check."""

    def __init__(self, message: str, path: str, manifest: dict):
        super().__init__(message)
        self.path, self.manifest = path, manifest


def find_shards(path: str, tok: Optional[TokenizerInfo] = None, key: str = "data.path") -> Optional[list[str]]:
    """The .bin/.idx prefixes that ``path`` names, in order, or None when it names text files.

    ``path`` may be a ``difflm-preprocess`` output directory (its manifest's shards; refused while incomplete or
    when made with another tokenizer than ``tok``), a directory of Megatron ``*.idx``/``*.bin`` pairs (sorted), a
    glob of them, one ``.idx``/``.bin`` file, or a prefix with both files (shards picked out of a ``difflm-preprocess``
    output are refused as the output is).

    Raises: DifflmError for an incomplete output or a path that mixes shards and text files;
        :class:`OtherTokenizerShards` (a DifflmError) for output made with another tokenizer than ``tok``.
    """

    p = os.path.expanduser(path)
    if os.path.isdir(p):
        m = read_manifest(p)
        if m is not None:
            _check_manifest(m, path, tok, key)
            return [os.path.join(p, s["name"]) for s in m["shards"]]
        found = sorted(glob.glob(os.path.join(glob.escape(p), "*.idx")))
        if found:
            texts = [f for f in os.listdir(p) if f.endswith((".txt", ".jsonl", ".parquet"))]
            if texts:
                raise DifflmError(f"{key}={path!r} holds both .bin/.idx shards and text files ({texts[0]}, ...): "
                                  "point it at a directory of one kind, or at a glob")
            return [f[:-4] for f in found]
        return None
    shards = None
    if os.path.isfile(p) and p.endswith((".idx", ".bin")):
        shards = [p[:-4]]
    elif os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin"):
        shards = [p]
    elif glob.has_magic(p):
        matched = sorted(glob.glob(p, recursive=True))
        shards = sorted({f[:-4] for f in matched if f.endswith((".idx", ".bin"))})
        if shards and len(shards) * 2 < len([f for f in matched if os.path.isfile(f)]):
            raise DifflmError(f"{key}={path!r} matches both .bin/.idx shards and other files: narrow the glob")
    for folder in sorted({os.path.dirname(s) for s in shards or []}):  # shards picked out of difflm-preprocess output
        if (m := read_manifest(folder)) is not None:
            _check_manifest(m, path, tok, key)
    return shards or None


def _check_manifest(m: dict, path: str, tok: Optional[TokenizerInfo], key: str) -> None:
    """Refuse the shards of a ``difflm-preprocess`` manifest ``m`` (named by ``path``, or picked out of its folder)
    while it is incomplete or when they were made with another tokenizer than ``tok``."""
    if not m.get("complete"):
        raise DifflmError(f"{key}={path!r}: difflm-preprocess has not finished writing it (manifest.json says "
                          "incomplete): rerun the same difflm-preprocess command to resume")
    if tok is not None and m["tokenizer"]["fingerprint"] != tok.fingerprint:
        raise OtherTokenizerShards(f"{key}={path!r} was tokenized with another tokenizer "
                                   f"({m['tokenizer']['name']}) than data.tokenizer: set data.tokenizer to "
                                   "that tokenizer, or rerun difflm-preprocess with tokenizer=<data.tokenizer>",
                                   path, m)


OPEN_FILE_HEADROOM = 1024  # file descriptors left for the rest of a run (checkpoints, sockets, NCCL) beside shards


def make_room_for_open_files(count: int) -> None:
    """Raise this process's soft limit of open files (``ulimit -n``, often 1024) towards its hard limit when
    ``count`` more files, plus :data:`OPEN_FILE_HEADROOM`, would not fit: each open shard holds one (its memory map),
    as Megatron-LM's and PyTorch's loaders hold theirs. No-op where the limit cannot be read."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    want = in_use + count + OPEN_FILE_HEADROOM
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    except (ValueError, OSError):
        pass  # opening says what to do if it runs out


def open_shards(prefixes: list[str], path: str, key: str = "data.path") -> list[IndexedDataset]:
    """Open shards (memory-mapped, one open file each: :func:`make_room_for_open_files`). Raises DifflmError naming
    ``key`` for a missing or corrupt shard, when they hold no tokens, or when the open-file limit cannot hold them."""
    import errno

    make_room_for_open_files(len(prefixes))
    out = []
    for prefix in prefixes:
        try:
            out.append(IndexedDataset(prefix))
        except DifflmError as err:
            raise DifflmError(f"{key}={path!r}: {err}") from None
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise DifflmError(f"{key}={path!r} has {len(prefixes):,} shards, one open file each, and this process may "
                              f"not open more files after {len(out):,} of them: raise the limit (ulimit -n "
                              f"{len(prefixes) + OPEN_FILE_HEADROOM + 64}) or merge them into fewer, larger shards "
                              "(difflm-preprocess shard_mb=)") from None
    if not out or sum(ds.num_tokens for ds in out) == 0:
        raise DifflmError(f"{key}={path!r} holds no tokens: point it at non-empty shards")
    return out


def shard_complete(prefix: str) -> bool:
    """True when ``prefix``.bin/.idx exist and agree (an interrupted write never passes: .idx is renamed last)."""
    if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
        return False
    try:
        IndexedDataset(prefix)
    except DifflmError:
        return False
    return True


# ---------------------------------------------------------------- workers
_TOK: Optional[TokenizerInfo] = None
_REPORT: Optional[Callable] = None
_HF: dict = {}


def _init_worker(tokenizer: str, queue, threads: int) -> None:
    """Pool initializer: tokenizer threads first (before the Rust pool starts), then the tokenizer (inherited when
    the worker was forked)."""
    global _TOK, _REPORT
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    if _TOK is None:
        from difflm.data.tokenizer import build_tokenizer

        _TOK = build_tokenizer(tokenizer)
    _REPORT = queue.put


def piece_bytes(piece: Piece, hf=None) -> int:
    """About how many input bytes a piece holds (for the progress bar)."""
    if piece.kind in ("txt", "jsonl"):
        return int(piece.end) - int(piece.start)
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(piece.source).metadata
        return sum(meta.row_group(g).total_byte_size for g in range(piece.start, piece.end))
    n = len(hf) if hf is not None else 1
    per_row = (getattr(getattr(hf, "data", None), "nbytes", 0) or n) / max(n, 1)
    return int((piece.end - piece.start) * per_row)


def group_pieces(pieces: list[Piece], sizes: list[int], target: int) -> list[list[Piece]]:
    """Consecutive ``pieces`` (of ``sizes`` bytes) joined into groups, one shard each: a group takes pieces until it
    holds at least ``target`` bytes (the last group may hold less), so small files share a shard, and a shard holds
    less than ``target`` plus its last piece (:func:`difflm.data.documents.file_pieces` cuts large files into pieces
    of about ``target``: a large file's first piece joins the small files before it)."""
    groups, size = [], 0
    for piece, n in zip(pieces, sizes):
        if not groups or size >= target:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += n
    return groups


def _piece_entry(p: Piece) -> dict:
    return {"source": p.source, "kind": p.kind, "start": p.start, "end": p.end}


def _pieces_texts(pieces: list[Piece], fmt: DocFormat, hf_split: str, check: CorpusCheck):
    """The documents of ``pieces`` in order, counted by ``check`` piece by piece."""
    for piece in pieces:
        hf = None
        if piece.kind == "hf":
            if (piece.source, hf_split) not in _HF:
                _HF[(piece.source, hf_split)] = load_hf(piece.source, hf_split, fmt)
            hf = _HF[(piece.source, hf_split)]
        yield from check.scan(iter_documents(piece, fmt, hf), fmt.doc_separator if piece.kind == "txt" else None)


def write_shard(index: int, pieces: list[Piece], prefix: str, fmt: DocFormat, hf_split: str, dtype: str,
                size: int) -> dict:
    """Tokenize consecutive pieces into ``prefix``.bin/.idx (atomic); reports (documents, tokens, bytes) as it goes.
    Returns {"documents", "tokens", "check"} (the pieces' :class:`~difflm.data.corpus_check.CorpusCheck` counts)."""
    from difflm.data.preprocess import tokenized_batches

    kill = os.environ.get(KILL_ENV)
    builder = IndexedDatasetBuilder(prefix, dtype)
    docs = tokens = reported = 0
    check = CorpusCheck()
    try:
        texts = _pieces_texts(pieces, fmt, hf_split, check)
        for arrays, read, chars in tokenized_batches(_TOK, texts):
            n_tok = 0
            for ids in arrays:
                builder.add_document(ids)
                n_tok += len(ids)
            docs += len(arrays)
            tokens += n_tok
            step = max(0, min(size, reported + chars) - reported)
            reported += step
            if _REPORT is not None:
                _REPORT((len(arrays), n_tok, step))
            if kill is not None and int(kill) == index:  # test hook: die with a half-written shard on disk
                builder._bin.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    except BaseException:
        builder.abort()
        raise
    builder.finalize()
    if _REPORT is not None and size > reported:
        _REPORT((0, 0, size - reported))
    return {"documents": docs, "tokens": tokens, "check": check.as_dict()}


# ---------------------------------------------------------------- difflm-preprocess
def _write_json(path: Path, obj: dict) -> None:
    write_text_atomic(path, strict_json.dumps(obj, indent=1) + "\n")


def _shard_files(out: Path) -> list[Path]:
    return [f for f in out.iterdir() if f.name.startswith("shard_")]


class _Progress:
    """A tqdm bar over input bytes with documents and tokens/s, or a line every 30 s when stderr is not a terminal."""

    def __init__(self, total_bytes: int, enabled: bool):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not enabled,
                        mininterval=0.5 if tty else 30.0, file=sys.stderr, dynamic_ncols=tty)
        self.docs = self.tokens = 0
        self.start = time.perf_counter()

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.docs:,} docs, {rate:,.0f} tok/s", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()


def empty_input_error(cfg) -> DifflmError:
    """The in-trainer path's empty-corpus line (:func:`difflm.data.preprocess.tokenize_corpus`), naming ``input=``
    or ``hf_dataset=``."""
    source = f"input={cfg.input!r}" if cfg.input is not None else f"hf_dataset={cfg.hf_dataset!r}"
    return DifflmError(f"{source} gives an empty corpus after tokenization: point it at non-empty text")


def holds_text(pieces: list[Piece], fmt: DocFormat, hf=None) -> bool:
    """True when ``pieces`` hold a non-empty document (the scan ends at the first one, so a corpus is read only up
    to it). Nothing is tokenized here: the parent must not start the tokenizer's thread pool before it forks."""
    return any(doc for piece in pieces for doc in iter_documents(piece, fmt, hf))


def run_preprocess(cfg) -> dict:
    """``difflm-preprocess``: tokenize ``cfg.input`` / ``cfg.hf_dataset`` into shards under ``cfg.output``.

    Args:
        cfg: a :class:`difflm.config.schema.PreprocessConfig` node.

    Returns: a summary dict (shards, skipped, documents, tokens, seconds, tokens_per_s, output, tokenizer).

    Raises:
        DifflmError: bad input/output/tokenizer/encoding/text_field, an output that cannot be written or holds
            other data, an input that holds no text (refused before a manifest is written), a worker that died.
            Messages name the keys of difflm-preprocess (``tokenizer=``, ``text_field=``), not ``data.*``.
    """
    from difflm.data.preprocess import FORMAT_VERSION
    from difflm.data.tokenizer import build_tokenizer

    global _TOK, _REPORT
    started = time.perf_counter()
    if (cfg.input is None) == (cfg.hf_dataset is None):
        raise DifflmError("give exactly one of input=<file, directory or glob> and hf_dataset=<name or directory>")
    if not cfg.shard_mb > 0:
        raise DifflmError(f"shard_mb={cfg.shard_mb} must be > 0 (input megabytes per shard, e.g. 256)")
    if cfg.workers < 0:
        raise DifflmError(f"workers={cfg.workers} must be >= 0 (0 = one per CPU core)")
    out = writable_output("output", cfg.output, directory=True)  # before the tokenizer loads and the input is read
    fmt = DocFormat.of(cfg, key="input")
    tok = build_tokenizer(cfg.tokenizer, key="tokenizer")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = cfg.workers or cores
    target = int(cfg.shard_mb * 1e6)
    pool = queue = None
    if workers > 1:
        import multiprocessing as mp

        # fork: workers inherit the loaded tokenizer and imports (datasets.map forks too); the parent has not encoded
        # yet, so no tokenizer thread pool is inherited. spawn where fork does not exist.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        queue = ctx.Queue()
        threads = max(1, cores // workers)
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=(cfg.tokenizer, queue, threads))
    _TOK = tok  # the workers' tokenizer: inherited by forked workers, used in-process with workers=1
    try:
        hf = None
        if cfg.hf_dataset:
            hf = load_hf(cfg.hf_dataset, cfg.hf_split, fmt)
            _HF[(cfg.hf_dataset, cfg.hf_split)] = hf
            sources = [{"hf_dataset": cfg.hf_dataset, "split": cfg.hf_split, "rows": len(hf),
                        "fingerprint": getattr(hf, "_fingerprint", None)}]
            pieces = hf_pieces(hf, cfg.hf_dataset, target)
        else:
            from difflm.checkpoint.manifest import file_sha256

            files = resolve_sources(cfg.input, key="input")
            hashes = list(pool.map(file_sha256, files)) if pool else [file_sha256(f) for f in files]
            sources = [{"path": f, "size": os.path.getsize(f), "sha256": h} for f, h in zip(files, hashes)]
            pieces = [p for f in files for p in file_pieces(f, fmt, target)]
        if not holds_text(pieces, fmt, hf):  # before a manifest: data.path would refuse it only at training
            raise empty_input_error(cfg)
        # hf_pieces are cut to shard_mb already; file pieces of small files (and the ends of files) are joined
        groups = [[p] for p in pieces] if hf is not None else group_pieces(pieces, [piece_bytes(p) for p in pieces],
                                                                            target)
        dtype = token_dtype(tok.padded_vocab_size)
        plan = {
            "format": FORMAT, "version": VERSION, "tokenization_version": FORMAT_VERSION,
            "tokenizer": {"name": tokenizer_reference(cfg.tokenizer), "fingerprint": tok.fingerprint,
                          "eos_id": tok.eos_id, "vocab_size": len(tok.tokenizer), "dtype": dtype.name},
            "settings": {"text_field": cfg.text_field, "doc_separator": cfg.doc_separator, "encoding": fmt.encoding,
                         "split_special_tokens": True, "eos": "inserted after every document when read",
                         "shard_mb": cfg.shard_mb},
            "sources": sources,
            "shards": [{"name": f"shard_{i:05d}", "pieces": [_piece_entry(p) for p in group]}
                       for i, group in enumerate(groups)],
        }
        plan_key = content_key(plan)
        try:
            _prepare_output(out, plan, plan_key, cfg)
            _write_json(out / MANIFEST, {**plan, "plan_key": plan_key, "complete": False})
        except OSError as err:  # e.g. an existing directory without write permission
            raise DifflmError(f"output={cfg.output!r} cannot be written ({err.strerror or type(err).__name__}: "
                              f"{err.filename or out}): choose a folder you can write in") from None
        for f in _shard_files(out):  # temporary files of an interrupted run
            if ".tmp" in f.name:
                f.unlink()
        prefixes = [str(out / s["name"]) for s in plan["shards"]]
        todo = [i for i, prefix in enumerate(prefixes) if not shard_complete(prefix)]
        sizes = {i: sum(piece_bytes(p, hf) for p in groups[i]) for i in todo}
        progress = _Progress(sum(sizes.values()), cfg.progress_bar)
        tokenize_start = time.perf_counter()
        check = CorpusCheck()
        try:
            if pool is None:
                _REPORT = lambda report: progress.update(*report)  # noqa: E731
                for i in todo:
                    result = write_shard(i, groups[i], prefixes[i], fmt, cfg.hf_split, dtype.name, sizes[i])
                    check.merge(result["check"])
            else:
                for result in _run_pool(pool, queue, progress, [(i, groups[i], prefixes[i], fmt, cfg.hf_split,
                                                                 dtype.name, sizes[i]) for i in todo]):
                    check.merge(result["check"])
        finally:
            progress.close()
        source = f"input={cfg.input!r}" if cfg.get("input") else f"hf_dataset={cfg.get('hf_dataset')!r}"
        if (notice := check.notice(source, "doc_separator", fmt.doc_separator)) is not None:
            data_notice(notice)
        tokenize_s = time.perf_counter() - tokenize_start
    finally:
        _TOK, _REPORT = None, None
        _HF.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    shards, new_tokens = [], progress.tokens
    for s, prefix in zip(plan["shards"], prefixes):
        ds = IndexedDataset(prefix)
        shards.append({**s, "documents": len(ds), "tokens": ds.num_tokens})
    documents, tokens = sum(s["documents"] for s in shards), sum(s["tokens"] for s in shards)
    if tokens == 0:  # text the tokenizer maps to nothing: remove the shards and manifest (all this plan's files)
        for f in _shard_files(out):
            f.unlink()
        (out / MANIFEST).unlink()
        raise empty_input_error(cfg)
    _write_json(out / MANIFEST, {**plan, "shards": shards, "plan_key": plan_key, "complete": True,
                                 "documents": documents, "tokens": tokens})
    seconds = time.perf_counter() - started
    return {"output": str(out), "shards": len(shards), "skipped": len(shards) - len(todo), "documents": documents,
            "tokens": tokens, "new_tokens": new_tokens, "seconds": seconds, "tokenize_seconds": tokenize_s,
            "tokens_per_s": new_tokens / max(tokenize_s, 1e-9), "workers": workers,
            "tokenizer": tokenizer_reference(cfg.tokenizer)}


def content_view(plan: dict) -> dict:
    """What a preprocess plan tokenizes, without where it was read from: the tokenizer by its definition (not the
    name or path it was loaded by), the sources by size and sha256 (or the datasets fingerprint), the shards by
    their source's position. A byte-identical tokenizer or input at another path resumes the same output."""
    sources = plan.get("sources", [])
    names = {}
    for s in sources:
        names.setdefault(s.get("path", s.get("hf_dataset")), len(names))
    view = {k: v for k, v in plan.items() if k not in ("version", "tokenizer", "sources", "shards", "plan_key",
                                                       "complete", "documents", "tokens")}
    view["tokenizer"] = {k: v for k, v in plan.get("tokenizer", {}).items() if k != "name"}
    view["sources"] = [{k: v for k, v in s.items() if k != "path" and not (k == "hf_dataset" and s.get("fingerprint"))}
                       for s in sources]
    # version 1 wrote one piece per shard as the shard's own keys: the same shards as a list of that one piece
    view["shards"] = []
    for s in plan.get("shards", []):
        pieces = s.get("pieces", [{k: s.get(k) for k in ("source", "kind", "start", "end")}])
        view["shards"].append({"name": s.get("name"), "pieces": [
            {**{k: v for k, v in p.items() if k != "source"}, "source": names.get(p.get("source"), p.get("source"))}
            for p in pieces]})
    return view


def content_key(plan: dict) -> str:
    """sha256 of :func:`content_view` of ``plan``: equal for two runs that would write the same shards."""
    return hashlib.sha256(json.dumps(content_view(plan), sort_keys=True).encode()).hexdigest()


def _prepare_output(out: Path, plan: dict, plan_key: str, cfg) -> None:
    """Check that ``out`` is empty, or holds this plan's shards (resume), or, with ``overwrite``, old shards to remove.
    Never deletes files that difflm-preprocess did not write."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    old = read_manifest(str(out))
    if old is None:
        if any(out.iterdir()):
            raise DifflmError(f"output={cfg.output!r} is not empty and holds no difflm-preprocess manifest: give a new "
                              "or empty directory")
        return
    if content_key(old) == plan_key:
        return  # resume (also of a manifest written before its plan_key was a content key)
    failed_start = not old.get("complete") and not any(shard_complete(str(out / s["name"])) for s in old["shards"])
    if not (cfg.overwrite or failed_start):  # a start that failed before its first shard holds nothing to keep
        before, now = content_view(old), content_view(plan)
        changed = [k for k in ("tokenizer", "settings", "sources") if before.get(k) != now[k]]
        if not changed and old.get("complete") and old.get("version") != VERSION:
            raise DifflmError(f"output={cfg.output!r} holds this input's tokens, written by an earlier "
                              f"difflm-preprocess with another shard layout (manifest version {old.get('version')}): "
                              "train on it as it is, or set overwrite=true to write it again")
        changed = changed or ["shards"]
        raise DifflmError(f"output={cfg.output!r} holds shards of other {'/'.join(changed)} (see its manifest.json): "
                          "choose a new output directory, or set overwrite=true to replace them")
    others = [f.name for f in out.iterdir() if f.name != MANIFEST and not f.name.startswith("shard_")]
    if others:
        raise DifflmError(f"output={cfg.output!r} also holds files difflm-preprocess did not write ({others[0]}, ...): "
                          "overwrite=true only replaces its own shards; give a new directory")
    for f in _shard_files(out):
        f.unlink()
    (out / MANIFEST).unlink()


def _run_pool(pool: ProcessPoolExecutor, queue, progress: _Progress, tasks: list[tuple]) -> list[dict]:
    """Run ``write_shard`` tasks on the pool, feeding the workers' reports to the progress bar; their results."""
    import queue as queue_mod

    def drain():
        while True:
            try:
                progress.update(*queue.get_nowait())
            except queue_mod.Empty:
                return

    pending = {pool.submit(write_shard, *task): task[0] for task in tasks}
    results = []
    try:
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            drain()
            for f in done:
                index = pending.pop(f)
                try:
                    results.append(f.result())
                except BrokenProcessPool:
                    raise DifflmError(f"a worker process died while writing shard_{index:05d} (killed, or out of "
                                      "memory: lower workers=); finished shards are kept: rerun the same command "
                                      "to resume") from None
        time.sleep(0.05)
        drain()
    finally:
        for f in pending:
            f.cancel()
    return results
