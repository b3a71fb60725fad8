"""Tokenizer loading: a Hugging Face tokenizer plus the ids the model needs (EOS, MASK, padded vocab)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from difflm.errors import DifflmError


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer and the special ids derived from it.

    Attributes:
        eos_id: ``tokenizer.eos_token_id`` (appended after every document).
        mask_id: ``tokenizer.mask_token_id`` if set, else ``len(tokenizer)`` (first free id, as MegaDLMs).
        padded_vocab_size: smallest multiple of ``vocab_multiple`` holding every id incl. ``mask_id``.
        fingerprint: sha256 of the tokenizer's class and full definition (:func:`definition_fingerprint`), the
            tokenizer part of the token caches' keys.
        load: returns the ``transformers`` tokenizer; :attr:`tokenizer` calls it once, on first use.
    """

    eos_id: int
    mask_id: int
    padded_vocab_size: int
    fingerprint: str
    load: Callable[[], Any] = field(repr=False, compare=False)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The ``transformers`` tokenizer, loaded on first use (a run whose tokens are cached never needs it)."""
        return self.load()

    def decode(self, ids: Iterable[int]) -> str:
        """Decode token ids (list, np.ndarray or torch tensor, 1-D) to text.

        Mask ids and padding ids (>= len(tokenizer)) are skipped, since the tokenizer cannot
        decode them; whitespace is not "cleaned up", so decode(encode(text)) == text.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        n = len(self.tokenizer)
        kept = [int(i) for i in ids if int(i) != self.mask_id and 0 <= int(i) < n]
        return self.tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, texts: str | list[str]) -> list[int] | list[list[int]]:
        """Token ids of user text (one string or a batch), without BOS/EOS.

        Special-token text inside the text is read as plain text (``split_special_tokens=True``): a document that
        contains the literal ``<|endoftext|>`` or the mask token's text never yields the EOS or mask id. Documents
        are split by ``data.doc_separator`` before they get here, and EOS is inserted between them as an id.
        The one encoding of text for every data path (corpus caches, ``difflm-preprocess``, SFT, ``difflm-eval``).
        """
        return encode_text(self.tokenizer, texts)


def encode_text(tokenizer: Any, texts: str | list[str]) -> list[int] | list[list[int]]:
    """:meth:`TokenizerInfo.encode` for a bare ``transformers`` tokenizer."""
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.path.isabs(name)


def tokenizer_reference(name_or_path: str) -> str:
    """How to name a tokenizer to a later command, from any directory: a local directory as its absolute path
    (``tokenizers/gpt2`` from one directory is a hub name from another), a hub name as it is."""
    path = os.path.expanduser(name_or_path)
    return os.path.abspath(path) if os.path.isdir(path) else name_or_path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def missing_tokenizer_files(directory: str) -> str | None:
    """None when ``directory`` holds a tokenizer vocabulary file (:data:`TOKENIZER_FILES`, or ``*.tiktoken``),
    else a message naming the files looked for (vocab.json also needs merges.txt)."""
    names = set(os.listdir(directory))
    if "vocab.json" in names and "merges.txt" not in names and "tokenizer.json" not in names:
        return f"{directory} has vocab.json but no merges.txt (BPE needs both, or a tokenizer.json)"
    if names & set(TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names):
        return None
    return f"{directory} has none of the tokenizer files {', '.join(TOKENIZER_FILES)}"


def special_roles_of(tok, token_id: int) -> list[str]:
    """The special-token roles other than ``mask_token`` that ``token_id`` holds in ``tok`` (e.g. ``["eos_token"]``),
    from ``tok.special_tokens_map`` (named roles and lists of extra special tokens)."""
    roles = []
    for role, value in tok.special_tokens_map.items():
        if role == "mask_token":
            continue
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and tok.convert_tokens_to_ids(str(token)) == token_id:
                roles.append(role)
                break
    return roles


# special-token texts that usually end a text, for the eos_token the fix suggests
_EOS_LIKE = re.compile(r"endoftext|end_of_text|eos|^</s>$|<\|end\|>|im_end|eot", re.IGNORECASE)


def missing_eos_message(tok, name_or_path: str, directory: str | None, key: str = "data.tokenizer") -> str:
    """The error for a tokenizer without an EOS token, with the fix: the ``eos_token`` entry of
    ``tokenizer_config.json`` (which a bare ``tokenizer.json`` lacks: it lists special tokens but not their roles),
    naming the file to add or edit in the local ``directory`` and a token of the tokenizer to put there."""
    specials = [t.content for _, t in sorted(getattr(tok, "added_tokens_decoder", {}).items()) if t.special]
    guess = next((t for t in specials if _EOS_LIKE.search(t)), specials[0] if specials else None)
    entry = json.dumps({"eos_token": guess if guess is not None else "<the token that ends a text>"})
    known = f" (its special tokens: {', '.join(specials[:8])})" if specials else ""
    head = f"{key}={name_or_path!r} has no eos token, which difflm puts after every document"
    if directory is None:  # a hub tokenizer: its files are not the user's to edit
        return (f"{head}: use a tokenizer that defines eos_token, or save this one to a directory "
                f"(tokenizer.save_pretrained(dir)), add {entry} to dir/tokenizer_config.json{known} and set {key}=dir")
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(config):
        return (f"{head}: {directory} has a tokenizer but no tokenizer_config.json, which names the special tokens' "
                f"roles; add {config} holding {entry}{known}")
    value = json.dumps(guess if guess is not None else "<the token that ends a text>")
    return f"{head}: {config} sets no eos_token; add \"eos_token\": {value} to it{known}"


def build_tokenizer(name_or_path: str, vocab_multiple: int = 128, key: str = "data.tokenizer") -> TokenizerInfo:
    """Load ``data.tokenizer`` (local directory or hub name) and derive EOS/MASK/padded vocab.

    Local directories and ``HF_HUB_OFFLINE=1`` load with ``local_files_only=True`` (nothing is downloaded);
    ``trust_remote_code`` is never set. A local directory's ids, once derived and checked, are kept in
    :func:`tokenizer_cache_dir` under a key of its files: a later call with the same files returns them and leaves the
    tokenizer to load on first use of :attr:`TokenizerInfo.tokenizer` (a training run with its tokens cached never
    imports ``transformers``).

    Raises:
        DifflmError: the tokenizer cannot be loaded, has no EOS token, its mask token is also another special
            token (eos, bos, pad, unk, ...), or vocab_multiple < 1.
    """
    if vocab_multiple < 1:
        raise DifflmError(f"vocab_multiple={vocab_multiple} must be >= 1")
    path = os.path.expanduser(name_or_path)
    if _looks_like_path(name_or_path) and not os.path.isdir(path):
        raise DifflmError(
            f"{key}={name_or_path!r} is not a directory: give a local directory with tokenizer.json or a hub name"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")
    local = os.path.isdir(path)
    if local and (missing := missing_tokenizer_files(path)) is not None:
        raise DifflmError(f"{key}={name_or_path!r} cannot be loaded: {missing}; save one there with "
                          "tokenizer.save_pretrained(dir) or give a hub name")
    load = functools.partial(_load_tokenizer, name_or_path, path if local else name_or_path, local, offline, key)
    record = _ids_record(path, vocab_multiple) if local else None
    if record is not None and (ids := _read_ids(record)) is not None:
        return TokenizerInfo(**ids, load=load)  # checked when first built: the tokenizer loads on first use
    tok = load()
    if tok.eos_token_id is None:
        raise DifflmError(missing_eos_message(tok, name_or_path, path if local else None, key))
    n = len(tok)
    mask_id = tok.mask_token_id if tok.mask_token_id is not None else n
    clash = special_roles_of(tok, mask_id)
    if clash:
        raise DifflmError(
            f"{key}={name_or_path!r} sets mask_token {tok.mask_token!r} (id {mask_id}), which is also its "
            f"{' and '.join(clash)}: the mask must be a token of its own (the sampler never emits the mask id, so a "
            f"mask equal to eos could never end a text); remove mask_token from its tokenizer_config.json (difflm then "
            f"uses the first free id, {n}) or set it to an unused token"
        )
    needed = max(n, mask_id + 1)
    padded = -(-needed // vocab_multiple) * vocab_multiple
    ids = dict(eos_id=int(tok.eos_token_id), mask_id=int(mask_id), padded_vocab_size=int(padded),
               fingerprint=definition_fingerprint(tok))
    if record is not None:
        _write_ids(record, ids)
    info = TokenizerInfo(**ids, load=load)
    info.__dict__["tokenizer"] = tok  # already loaded: what the cached property would hold
    return info


def _load_tokenizer(name_or_path: str, source: str, local: bool, offline: bool, key: str):
    """``AutoTokenizer.from_pretrained`` of a local directory or hub name, any failure one DifflmError line."""
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False: never run a repository's code, and never prompt for it (a difflm export's
        # config.json names its own modeling code, which the tokenizer does not need)
        return AutoTokenizer.from_pretrained(source, local_files_only=local or offline, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any loading failure becomes one user-facing line
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        hint = "set HF_HUB_OFFLINE=0 or download it to a local directory" if offline and not local else "check the name/files"
        raise DifflmError(
            f"{key}={name_or_path!r} could not be loaded ({reason}): give a local directory with "
            f"tokenizer.json or a hub name; {'offline: ' if offline else ''}{hint}"
        ) from None


def definition_fingerprint(tokenizer) -> str:
    """sha256 of a ``transformers`` tokenizer's class and full definition (vocab, merges, normalizer, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}\n{body}".encode()).hexdigest()


# A local tokenizer's derived ids, kept so that a later process (every rank, every relaunch) need not import
# transformers and parse the tokenizer to learn them: keyed by the directory's files (contents; name, size and mtime
# for files over _HASHED_BYTES, such as a model's weights beside it), the transformers and tokenizers versions and
# vocab_multiple, so any change to what AutoTokenizer would load is a new key.
_HASHED_BYTES = 64 * 2**20


def difflm_cache_dir(name: str) -> str:
    """Folder ``name`` of difflm's per-user cache: ``$DIFFLM_CACHE_DIR/<name>``, else ``$XDG_CACHE_HOME/difflm/<name>``
    (``~/.cache/difflm/<name>``; the XDG Base Directory Specification's cache home)."""
    root = os.environ.get("DIFFLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "difflm")
    return os.path.join(root, name)


def tokenizer_cache_dir() -> str:
    """Where the derived ids of local tokenizers are kept: :func:`difflm_cache_dir` ``("tokenizers")``."""
    return difflm_cache_dir("tokenizers")


def _ids_record(directory: str, vocab_multiple: int) -> str | None:
    """The record file of ``directory``'s tokenizer ids at ``vocab_multiple``, or None when it cannot be keyed."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    try:
        h.update(json.dumps([version("transformers"), version("tokenizers"), int(vocab_multiple)]).encode())
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if not entry.is_file():
                continue
            stat = entry.stat()
            h.update(f"\0{entry.name}\0{stat.st_size}\0".encode())
            if stat.st_size > _HASHED_BYTES:
                h.update(str(stat.st_mtime_ns).encode())
            else:
                with open(entry.path, "rb") as f:
                    h.update(f.read())
    except (OSError, PackageNotFoundError):
        return None
    return os.path.join(tokenizer_cache_dir(), h.hexdigest()[:32] + ".json")


def _read_ids(record: str) -> dict | None:
    try:
        with open(record) as f:
            ids = json.load(f)
        return {k: (str(ids[k]) if k == "fingerprint" else int(ids[k]))
                for k in ("eos_id", "mask_id", "padded_vocab_size", "fingerprint")}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: load the tokenizer and write it again


def _write_ids(record: str, ids: dict) -> None:
    """Write the record atomically (:func:`difflm.data.indexed_dataset.write_text_atomic`); a cache that cannot be
    written is skipped."""
    from difflm.data.indexed_dataset import write_text_atomic

    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        write_text_atomic(record, json.dumps(ids))
    except OSError:
        pass  # the ids are derived again next time
