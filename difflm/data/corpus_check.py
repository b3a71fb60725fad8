"""What the tokenization pass sees of a corpus that a preprocessing pipeline left in a shape difflm would read wrong.

The one pass over every document (the trainer's cache, each ``difflm-preprocess`` shard) counts, at no extra read:

* documents with NUL bytes: a UTF-16 file (ASCII in UTF-16 is valid UTF-8 with a NUL after every character) or
  binary data read as text;
* documents with carriage returns left in their text (JSONL / parquet / datasets text from CRLF files: ``.txt``
  files are read with universal newlines), which the tokenizer keeps as ``\\r`` tokens;
* ``.txt`` documents holding ``data.doc_separator`` inside a line: only a line that is the separator alone splits
  documents, so ``doc one<|endoftext|>doc two`` is one document with the separator as plain text;
* empty documents (null or blank text, two separators in a row), which are skipped: a notice when at least
  :data:`EMPTY_NOTICE_FRACTION` of the documents are empty (the one a trailing separator leaves is not counted).

:meth:`CorpusCheck.notice` says all of it in one line naming the source and the fix.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Optional

EMPTY_NOTICE_FRACTION = 0.1


@dataclass
class CorpusCheck:
    """Counts of the shapes above over the documents seen (:meth:`scan`); add two with :meth:`merge`."""

    documents: int = 0
    empty: int = 0
    nul: int = 0
    cr: int = 0
    inline_separator: int = 0

    def scan(self, docs: Iterable[str], separator: Optional[str] = None) -> Iterator[str]:
        """``docs`` unchanged, counted on the way; ``separator``: the ``.txt`` separator to look for inside them. An
        empty last document (what a separator at the end of a file or piece leaves) is not counted."""
        last_empty = False
        for doc in docs:
            self.documents += 1
            last_empty = not doc
            if not doc:
                self.empty += 1
            else:
                self.nul += "\x00" in doc
                self.cr += "\r" in doc
                self.inline_separator += bool(separator) and separator in doc
            yield doc
        if last_empty:
            self.documents -= 1
            self.empty -= 1

    def merge(self, other: "CorpusCheck | dict") -> "CorpusCheck":
        """This check plus ``other`` (a check or its :meth:`as_dict`, e.g. from a worker process)."""
        other = other if isinstance(other, dict) else other.as_dict()
        for key, value in other.items():
            setattr(self, key, getattr(self, key) + int(value))
        return self

    def as_dict(self) -> dict:
        return asdict(self)

    def notice(self, source: str, separator_key: str = "data.doc_separator",
               separator: Optional[str] = None) -> Optional[str]:
        """One line about what was found in ``source`` (e.g. ``data.path='corpus/'``), with the fix, or None."""
        n, parts = self.documents, []
        if self.nul:
            parts.append(f"{self.nul:,} of {n:,} documents hold NUL bytes (a UTF-16 file or binary data read as text?): "
                         "convert the files to UTF-8 (iconv -f utf-16 -t utf-8) or remove those bytes")
        if self.inline_separator:
            parts.append(f"{self.inline_separator:,} documents hold {separator_key}={separator!r} inside a line, where "
                         "it does not split documents (only a line that is the separator alone does): put the "
                         "separator on a line of its own")
        if self.cr:
            parts.append(f"{self.cr:,} documents hold carriage returns (\\r), which are tokenized as text: normalise "
                         "their line endings to \\n (e.g. text.replace('\\r\\n', '\\n')) before training")
        if self.empty and n and self.empty >= EMPTY_NOTICE_FRACTION * n:
            parts.append(f"{self.empty:,} of {n:,} documents are empty (null or blank text, or separators in a row) "
                         "and are skipped: check the text field and the separator")
        return f"{source}: " + "; ".join(parts) if parts else None


__all__ = ["EMPTY_NOTICE_FRACTION", "CorpusCheck"]
