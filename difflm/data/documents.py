"""Documents of a corpus: which files a path names, how each file splits into documents, and how a file is cut
into pieces of whole documents for parallel tokenization.

One reader serves every consumer (the in-trainer cache :func:`difflm.data.preprocess.tokenize_corpus`,
``difflm-preprocess``, ``difflm-eval``, SFT pairs), so they all see the same documents:

* ``.txt``: the text between lines equal to ``doc_separator`` (the whole file when it is null), stripped;
  universal newlines as Python's text mode (CRLF and CR become LF).
* ``.jsonl``: the ``text_field`` of every non-empty line.
* ``.parquet``: the ``text_field`` column.
* a ``datasets`` name or ``save_to_disk`` directory: the ``text_field`` column of split ``hf_split``.

Text is decoded with ``encoding`` (strict): a file that is not valid text ends in one line naming the file, the
byte and its offset. A UTF-8 byte-order mark (EF BB BF) at the start of a .txt/.jsonl file is a marker, not text,
and is dropped, as Python's ``utf-8-sig`` codec does (Unicode 15, sec. 23.8: in UTF-8 the BOM only signals the
encoding). Empty documents are kept here and dropped by the tokenizer step.
"""
from __future__ import annotations

import codecs
import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

from difflm.errors import DifflmError

EXTS = (".txt", ".jsonl", ".parquet")


def data_notice(message: str) -> None:
    """Print a notice about what the data code did to the user's data (rank 0 only, on stderr: ``difflm-eval``'s
    stdout is its JSON result)."""
    import sys

    from difflm.parallel.distributed import is_rank0

    if is_rank0():
        print(f"difflm: notice: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DocFormat:
    """How files split into documents (the ``data.*`` keys of the same names). ``key`` names the config key of
    the path in error messages (``data.path``, ``input``)."""

    text_field: str = "text"
    doc_separator: Optional[str] = "<|endoftext|>"
    encoding: str = "utf-8"
    key: str = "data.path"

    def name(self, option: str) -> str:
        """How the command spells option ``option`` in messages: ``data.text_field`` beside ``data.path``, the bare
        ``text_field`` beside difflm-preprocess's ``input``."""
        return self.key.rsplit(".", 1)[0] + "." + option if "." in self.key else option

    @classmethod
    def of(cls, cfg, key: str = "data.path") -> "DocFormat":
        """The format of a DataConfig-like node (keys it lacks take the defaults; checks the encoding)."""
        enc = getattr(cfg, "encoding", None) or "utf-8"
        check_encoding(enc, cls(key=key).name("encoding"))
        sep = getattr(cfg, "doc_separator", cls.doc_separator)
        check_doc_separator(sep, cls(key=key).name("doc_separator"))
        return cls(getattr(cfg, "text_field", cls.text_field), sep, enc, key)


@dataclass(frozen=True)
class Piece:
    """A run of whole documents of one source: bytes ``[start, end)`` of a .txt/.jsonl file, row groups
    ``[start, end)`` of a .parquet file, or rows ``[start, end)`` of a ``datasets`` dataset (``kind='hf'``,
    ``source`` = its name or directory). ``end=None`` = to the end."""

    source: str
    start: int = 0
    end: Optional[int] = None
    kind: str = "txt"  # txt | jsonl | parquet | hf


def check_doc_separator(sep: Optional[str], key: str = "data.doc_separator") -> None:
    """Raise DifflmError for a separator no line can equal: lines are compared with their surrounding whitespace
    stripped, so one with spaces at its ends (``' ###'``) or a line break would match none, and every .txt file would
    be read as one document without a word. None (whole files) and ``''`` (blank lines) are separators."""
    if sep is None or sep == sep.strip():
        return
    if "\n" in sep or "\r" in sep:
        raise DifflmError(f"{key}={sep!r} holds a line break, but a separator is one line of its own: give that "
                          "line's text alone")
    raise DifflmError(f"{key}={sep!r} has whitespace at its ends, but lines are compared with theirs stripped, so no "
                      f"line would match and each .txt file would be one document: give {key}={sep.strip()!r}")


def check_encoding(encoding: str, key: str = "data.encoding") -> None:
    """Raise DifflmError unless ``encoding`` is a known codec that reads ASCII bytes as ASCII (UTF-8, utf-8-sig,
    Latin-1, cp1252, ...; not UTF-16/32: files are split into lines as bytes at 0x0A)."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise DifflmError(f"{key}={encoding!r} is not a known text encoding: e.g. utf-8 or latin-1") from None
    try:
        compatible = b"ab\ncd".decode(encoding) == "ab\ncd"
    except UnicodeDecodeError:
        compatible = False
    if not compatible:
        raise DifflmError(f"{key}={encoding!r} is not ASCII-compatible (newline is not one 0x0A byte): "
                          "convert the files to UTF-8 (iconv -t utf-8)")


def kind_of(path: str) -> str:
    return os.path.splitext(path)[1].lstrip(".")


def resolve_sources(path: str, key: str = "data.path") -> list[str]:
    """A file, directory or glob -> sorted absolute .txt/.jsonl/.parquet files (a directory: recursively, links to
    folders followed, :func:`_corpus_files`).

    Raises:
        DifflmError: the path does not exist, the glob matches nothing, there are no corpus files, or one of them is a
            symbolic link to nothing.
    """
    fix = f"point {key} at a .txt/.jsonl/.parquet file, a directory or a glob"
    what = "no .txt, .jsonl or .parquet"
    p = os.path.expanduser(path)
    if os.path.isfile(p):
        if not p.endswith(EXTS):
            raise DifflmError(f"{key}={path!r} is not a .txt, .jsonl or .parquet file: {fix}")
        return [os.path.abspath(p)]
    if os.path.isdir(p):
        files = sorted(_corpus_files(p))
        if not files:
            raise DifflmError(f"{key}={path!r} is a directory with {what} files under it: {fix}")
        return [_readable(os.path.abspath(f), path, key) for f in files]
    if glob.has_magic(p):
        matched = sorted(glob.glob(p, recursive=True))
        files = [_readable(os.path.abspath(f), path, key) for f in matched
                 if f.endswith(EXTS) and (os.path.isfile(f) or os.path.islink(f))]
        if not files:
            raise DifflmError(f"{key}={path!r} {'matches nothing' if not matched else f'matches {what} files'}: {fix}")
        return files
    raise DifflmError(f"{key}={path!r} does not exist: {fix}")


def _corpus_files(root: str) -> Iterator[str]:
    """The .txt/.jsonl/.parquet files under directory ``root``, symbolic links to folders followed (as a ``**`` glob
    follows them); a folder reached twice (two links to it, or a link to a folder above it) is read once, under the
    first of its paths in sorted order."""
    seen = set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders.sort()
        yield from (os.path.join(folder, f) for f in names if f.endswith(EXTS))


def _readable(file: str, path: str, key: str) -> str:
    """``file`` (a corpus file that ``path`` names) when it is a readable file; a symbolic link to nothing is one
    error line naming it."""
    if not os.path.isfile(file):
        raise DifflmError(f"{key}={path!r}: {file} is a symbolic link to {os.path.realpath(file)}, which does not "
                          "exist: fix or remove the link")
    return file


# ---------------------------------------------------------------- decoding
def not_text_error(path: str, encoding: str, data: bytes, base: int, err: UnicodeDecodeError, key: str) -> DifflmError:
    """The one-line error for bytes of ``path`` that ``encoding`` cannot decode (``data`` starts at file offset
    ``base``; ``err`` came from decoding ``data``)."""
    bad, offset = data[err.start], base + err.start
    name = codecs.lookup(encoding).name
    shown = "UTF-8" if name == "utf-8" else name
    enc_key = key.rsplit(".", 1)[0] + ".encoding" if "." in key else "encoding"
    return DifflmError(f"{key}: {path} is not {shown} text (byte 0x{bad:02x} at offset {offset}): convert it to UTF-8 "
                       f"(e.g. iconv -f latin1 -t utf-8) or set {enc_key} to its encoding (e.g. {enc_key}=latin-1)")


UTF8_BOM = codecs.BOM_UTF8


def _decode(path: str, data: bytes, base: int, fmt: DocFormat) -> str:
    """``data`` (file bytes from offset ``base``) as text; a UTF-8 byte-order mark at offset 0 is dropped."""
    if base == 0 and data.startswith(UTF8_BOM) and codecs.lookup(fmt.encoding).name in ("utf-8", "utf-8-sig"):
        data, base = data[len(UTF8_BOM):], len(UTF8_BOM)
    try:
        return data.decode(fmt.encoding)
    except UnicodeDecodeError as err:
        raise not_text_error(path, fmt.encoding, data, base, err, fmt.key) from None


def _byte_lines(path: str, start: int, end: Optional[int]) -> Iterator[tuple[int, bytes]]:
    """(file offset, raw line incl. its b"\\n") of the lines starting in ``[start, end)``."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for line in f:
            if end is not None and pos >= end:
                return
            yield pos, line
            pos += len(line)


def _universal(text: str) -> str:
    """Python text mode's universal newlines: CRLF and lone CR become LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _lf_lines(text: str) -> list[str]:
    """``text`` split after every LF (only LF, as text mode's line iteration), each line keeping its LF."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _txt_documents(piece: Piece, fmt: DocFormat) -> Iterator[str]:
    path, sep = piece.source, fmt.doc_separator
    if sep is None:  # the whole file is one document (pieces of a separator-less file are whole files)
        with open(path, "rb") as f:
            f.seek(piece.start)
            data = f.read() if piece.end is None else f.read(piece.end - piece.start)
        yield _universal(_decode(path, data, piece.start, fmt)).strip()
        return
    buf: list[str] = []
    for pos, raw in _byte_lines(path, piece.start, piece.end):
        text = _decode(path, raw, pos, fmt)
        for line in _lf_lines(_universal(text)) if "\r" in text else (text,):
            if line.strip() == sep:
                yield "".join(buf).strip()
                buf = []
            else:
                buf.append(line)
    yield "".join(buf).strip()


def read_jsonl(path: str, fmt: DocFormat = DocFormat(), start: int = 0, end: Optional[int] = None
               ) -> Iterator[tuple[str, object]]:
    """(where, parsed record) of every non-empty line of a JSONL file whose line starts in bytes ``[start, end)``;
    ``where`` is ``path:line`` (line numbers when reading from the start, else ``path@byte``).

    Raises: DifflmError naming ``fmt.key`` and the line for invalid JSON or undecodable bytes.
    """
    for lineno, (pos, raw) in enumerate(_byte_lines(path, start, end), 1):
        line = _decode(path, raw, pos, fmt)
        if not line.strip():
            continue
        where = f"{path}:{lineno}" if start == 0 else f"{path}@byte{pos}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise DifflmError(f"{fmt.key}: {where} is not valid JSON ({e}): fix or remove that line") from None


def field_error(fmt: DocFormat, where: str, rec) -> DifflmError:
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    field = fmt.name("text_field")
    return DifflmError(f"{field}={fmt.text_field!r} not found in {where} (keys: {keys}): set {field} to one of them")


def text_value(value, field: str, setting, where, null: str = "") -> str:
    """The text of one record's field: a string as it is, null (JSON ``null``, a missing parquet / datasets value)
    as ``null`` (an empty document, which yields no tokens, as every format reads it).

    Args: ``field`` the config key (e.g. ``data.text_field``), ``setting`` its value, ``where`` the record's place
    (a string, or a callable giving it: built only for the error).
    Raises: DifflmError for any other value (a number, list or object is not text, and ``str()`` of it would train
    on its Python spelling); with ``null=None``, also for null."""
    if isinstance(value, str):
        return value
    if value is None and null is not None:
        return null
    where = where() if callable(where) else where
    what = "null" if value is None else f"a value of type {type(value).__name__} ({str(value)[:40]!r})"
    raise DifflmError(f"{field}={setting!r} is {what} in {where}, not text: point {field} at a text field or fix "
                      "that record")


def empty_text_error(field: str, setting, where, why: str) -> str:
    """The one-line refusal of a record whose response or reference answer (config key ``field`` = ``setting``) is
    empty text, at ``where`` (the record's place), with ``why`` an empty one is refused."""
    return (f"{field}={setting!r} is empty in {where} ({why}): fill in or remove that record, or point {field} at the "
            "field that holds the text")


def _jsonl_documents(piece: Piece, fmt: DocFormat) -> Iterator[str]:
    for where, rec in read_jsonl(piece.source, fmt, piece.start, piece.end):
        if not isinstance(rec, dict) or fmt.text_field not in rec:
            raise field_error(fmt, where, rec)
        yield text_value(rec[fmt.text_field], fmt.name("text_field"), fmt.text_field, where).strip()


def _parquet_file(path: str, fmt: DocFormat):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file is one user-facing line
        raise DifflmError(f"{fmt.key}: {path} is not a readable parquet file ({type(e).__name__}: {e})") from None
    names = pf.schema_arrow.names
    if fmt.text_field not in names:
        field = fmt.name("text_field")
        raise DifflmError(f"{field}={fmt.text_field!r} is not a column of {path} (columns: {names}): set {field} to "
                          "one of them")
    return pf


def _parquet_documents(piece: Piece, fmt: DocFormat) -> Iterator[str]:
    pf = _parquet_file(piece.source, fmt)
    end = pf.num_row_groups if piece.end is None else piece.end
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    for batch in pf.iter_batches(row_groups=list(range(piece.start, end)), columns=[fmt.text_field]):
        for value in batch.column(0).to_pylist():
            yield text_value(value, fmt.name("text_field"), fmt.text_field,
                             lambda: f"{piece.source} row {row}").strip()
            row += 1


def load_hf(name: str, split: str, fmt: DocFormat):
    """Load a ``datasets`` save_to_disk directory or hub name, split ``split``.

    Raises: DifflmError when it cannot be loaded or has no ``fmt.text_field`` column.
    """
    import datasets

    try:
        if os.path.isdir(os.path.expanduser(name)):
            ds = datasets.load_from_disk(os.path.expanduser(name))
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise DifflmError(f"{fmt.name('hf_dataset')}={name!r} (split {fmt.name('hf_split')}={split!r}) could not be "
                          f"loaded ({reason}): give a save_to_disk directory or a datasets hub name") from None
    if isinstance(ds, datasets.DatasetDict):  # a save_to_disk DatasetDict: its split, or the ones it has
        if split not in ds:
            raise DifflmError(f"{fmt.name('hf_split')}={split!r} is not a split of {fmt.name('hf_dataset')}={name!r}: "
                              f"set {fmt.name('hf_split')} to one of {sorted(ds)}")
        ds = ds[split]
    if fmt.text_field not in ds.column_names:
        field = fmt.name("text_field")
        raise DifflmError(f"{field}={fmt.text_field!r} is not a column of {fmt.name('hf_dataset')}={name!r} "
                          f"(columns: {ds.column_names}): set {field} to one of them")
    return ds


def _hf_documents(ds, piece: Piece, fmt: DocFormat, rows: int = 1000) -> Iterator[str]:
    end = len(ds) if piece.end is None else piece.end
    for i in range(piece.start, end, rows):
        for j, value in enumerate(ds[i:min(end, i + rows)][fmt.text_field]):
            yield text_value(value, fmt.name("text_field"), fmt.text_field,
                             lambda: f"{fmt.name('hf_dataset')}={piece.source!r} row {i + j}").strip()


def iter_documents(piece: Piece, fmt: DocFormat, hf=None) -> Iterator[str]:
    """The documents of one piece, in order (stripped; empty ones included). ``hf``: the loaded dataset of an
    ``hf`` piece (loaded from ``piece.source`` when None, split ``train``)."""
    if piece.kind == "hf":
        return _hf_documents(hf if hf is not None else load_hf(piece.source, "train", fmt), piece, fmt)
    return {"txt": _txt_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}[piece.kind](piece, fmt)


# ---------------------------------------------------------------- pieces
def _next_boundary(f, target: int, sep: Optional[bytes]) -> Optional[int]:
    """The first document boundary at or after byte ``target``: a line start (JSONL) or the start of the line
    after a separator line (.txt). None at the end of the file."""
    f.seek(max(target - 1, 0))
    if target > 0 and f.read(1) != b"\n":
        f.readline()  # finish the line ``target`` falls in
    while True:
        if sep is None:
            pos = f.tell()
            return pos if f.readline() else None
        line = f.readline()
        if not line:
            return None
        if line.strip() == sep:
            return f.tell()


def file_pieces(path: str, fmt: DocFormat, target_bytes: int) -> list[Piece]:
    """Cut one file into pieces of about ``target_bytes`` bytes (parquet: of row groups by their compressed
    size), each made of whole documents; their documents, in order, are the file's. A .txt without
    ``doc_separator`` is one document, hence one piece."""
    kind = kind_of(path)
    if kind == "parquet":
        meta = _parquet_file(path, fmt).metadata
        pieces, start, size = [], 0, 0
        for g in range(meta.num_row_groups):
            size += meta.row_group(g).total_byte_size
            if size >= target_bytes or g == meta.num_row_groups - 1:
                pieces.append(Piece(path, start, g + 1, kind))
                start, size = g + 1, 0
        return pieces or [Piece(path, 0, 0, kind)]
    total = os.path.getsize(path)
    if kind == "txt" and fmt.doc_separator is None:
        return [Piece(path, 0, total, kind)]
    sep = None if kind == "jsonl" else fmt.doc_separator.encode(fmt.encoding)
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + target_bytes < total:
            b = _next_boundary(f, bounds[-1] + target_bytes, sep)
            if b is None or b >= total:
                break
            bounds.append(b)
    bounds.append(total)
    return [Piece(path, a, b, kind) for a, b in zip(bounds[:-1], bounds[1:])]


def hf_pieces(ds, name: str, target_bytes: int) -> list[Piece]:
    """Row ranges of about ``target_bytes`` (by the Arrow table's size) of a loaded ``datasets`` dataset."""
    n = len(ds)
    nbytes = getattr(getattr(ds, "data", None), "nbytes", 0) or n
    rows = max(1, int(target_bytes * n / max(nbytes, 1)))
    return [Piece(name, a, min(n, a + rows), "hf") for a in range(0, n, rows)] or [Piece(name, 0, 0, "hf")]


__all__ = ["EXTS", "DocFormat", "Piece", "kind_of", "resolve_sources", "read_jsonl", "iter_documents", "file_pieces",
           "hf_pieces", "load_hf", "check_doc_separator", "check_encoding", "not_text_error", "empty_text_error"]
