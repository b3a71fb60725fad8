"""Tokenizer loading: a Hugging Face tokenizer plus the ids the model needs (EOS, MASK, padded vocab)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from difflm.errors import DifflmError


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and the special ids derived from it.

    Attributes:
        tokenizer: the ``transformers`` tokenizer.
        eos_id: ``tokenizer.eos_token_id`` (appended after every document).
        mask_id: ``tokenizer.mask_token_id`` if set, else ``len(tokenizer)`` (first free id, as MegaDLMs).
        padded_vocab_size: smallest multiple of ``vocab_multiple`` holding every id incl. ``mask_id``.
    """

    tokenizer: Any
    eos_id: int
    mask_id: int
    padded_vocab_size: int

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
    ``trust_remote_code`` is never set.

    Raises:
        DifflmError: the tokenizer cannot be loaded, has no EOS token, its mask token is also another special
            token (eos, bos, pad, unk, ...), or vocab_multiple < 1.
    """
    from transformers import AutoTokenizer

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
    try:
        # trust_remote_code=False: never run a repository's code, and never prompt for it (a difflm export's
        # config.json names its own modeling code, which the tokenizer does not need)
        tok = AutoTokenizer.from_pretrained(path if local else name_or_path, local_files_only=local or offline,
                                            trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any loading failure becomes one user-facing line
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        hint = "set HF_HUB_OFFLINE=0 or download it to a local directory" if offline and not local else "check the name/files"
        raise DifflmError(
            f"{key}={name_or_path!r} could not be loaded ({reason}): give a local directory with "
            f"tokenizer.json or a hub name; {'offline: ' if offline else ''}{hint}"
        ) from None
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
    return TokenizerInfo(tokenizer=tok, eos_id=int(tok.eos_token_id), mask_id=int(mask_id), padded_vocab_size=int(padded))
