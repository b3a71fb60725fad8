"""Prompt/response pairs for supervised fine-tuning (``objective=sft``; LLaDA, Nie et al. 2025, sec. 2.3).

A JSONL file with ``data.prompt_field`` / ``data.response_field`` per line becomes rows of ``data.seq_len``
tokens ``[prompt, response, EOS, EOS, ...]``: the response gets one EOS and is padded with EOS to the window
(LLaDA pads with |EOS| and trains on them, so the model learns to end its answer). With
``data.chat_template=true`` the prompt is the tokenizer's ``apply_chat_template`` of one user turn (with the
generation prompt). Pairs longer than the window keep the end of the prompt and cut the response (one notice
counts them: :func:`truncation_notice`).

With ``data.sft_packing=true`` several pairs share a window (greedy, in file order; a pair never straddles two
windows): each pair is ``[prompt, response, EOS]``, the last pair of a window is padded with EOS to the window, and
every token carries its pair's index (``doc_ids``) and whether it is prompt (``prompt_mask``). With
``data.intra_document_attention=true`` the pairs of a window do not attend to each other (the objective's
:class:`difflm.model.masks.DocumentMask`), so packing changes the compute per pair, not what each pair sees.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from difflm.data.batch import TokenBatch
from difflm.data.documents import DocFormat, data_notice, empty_text_error, read_jsonl, resolve_sources, text_value
from difflm.data.tokenizer import TokenizerInfo, encode_text
from difflm.errors import DifflmError


class SFTPairs:
    """Tokenized rows: ``tokens`` [N, seq_len] int64 with ``prompt_lengths`` [N] int64 (one pair a row), or, for
    packed rows, ``prompt_mask`` [N, seq_len] bool and ``doc_ids`` [N, seq_len] int64 (the pair of each token;
    None: the pairs of a row may attend to each other).

    :meth:`get` has the API of :class:`difflm.data.windows.PackedWindows` but returns a :class:`TokenBatch`
    (which slices like the token tensor), so the trainer fetches batches the same way.
    """

    def __init__(self, tokens: np.ndarray, prompt_lengths: np.ndarray | None = None,
                 prompt_mask: np.ndarray | None = None, doc_ids: np.ndarray | None = None,
                 pair_ids: np.ndarray | None = None):
        self.tokens, self.prompt_lengths, self.prompt_mask, self.doc_ids = tokens, prompt_lengths, prompt_mask, doc_ids
        self.pair_ids = doc_ids if pair_ids is None else pair_ids  # the pair of each token (per-pair normaliser)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, sl: slice) -> "SFTPairs":
        """The rows ``sl`` (e.g. the train / valid split)."""
        pick = (lambda a: None if a is None else a[sl])  # noqa: E731
        return SFTPairs(self.tokens[sl], pick(self.prompt_lengths), pick(self.prompt_mask), pick(self.doc_ids),
                        pick(self.pair_ids))

    def get(self, indices: Sequence[int]) -> TokenBatch:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"pair index out of range [0, {len(self)})")
        take = (lambda a: None if a is None else torch.from_numpy(a[idx]))  # noqa: E731
        return TokenBatch(torch.from_numpy(self.tokens[idx]), take(self.prompt_lengths), take(self.doc_ids),
                          take(self.prompt_mask), take(self.pair_ids))


def read_pairs(cfg) -> list[tuple[str, str]]:
    """(prompt, response) strings of every ``.jsonl`` file of ``data.path``.

    Raises: DifflmError for a non-JSONL source, bad JSON, bytes that are not ``data.encoding`` text, a missing
    field (naming data.prompt_field / data.response_field) or an empty response.
    """
    pairs = []
    fmt = DocFormat.of(cfg)
    for path in resolve_sources(cfg.path):
        if not path.endswith(".jsonl"):
            raise DifflmError(f"data.path: {path} is not .jsonl: objective=sft runs train and evaluate on "
                              f"prompt/response pairs, one JSON record a line with the fields data.prompt_field="
                              f"{cfg.prompt_field!r} and data.response_field={cfg.response_field!r}: set data.path to "
                              "such a .jsonl file (plain text trains with objective=mdlm)")
        for where, rec in read_jsonl(path, fmt):
            for key in ("prompt_field", "response_field"):
                if not isinstance(rec, dict) or cfg[key] not in rec:
                    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                    raise DifflmError(f"data.{key}={cfg[key]!r} not found in {where} (keys: {keys}): "
                                      f"set data.{key} to one of them")
            pair = tuple(text_value(rec[cfg[key]], f"data.{key}", cfg[key], where, null=None)
                         for key in ("prompt_field", "response_field"))
            if not pair[1].strip():
                raise DifflmError(empty_text_error("data.response_field", cfg.response_field, where,
                                                   "the pair would teach the model to stop at once"))
            pairs.append(pair)
    return pairs


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as one user turn of ``tokenizer``'s chat template, with the generation prompt.

    ``apply_chat_template(tokenize=True)`` returns a list of ids in transformers 4.x and a ``BatchEncoding``
    (a dict with ``input_ids``) in 5.x; both (and a batch of one) give the same flat list of ints here. A prompt that
    contains special-token text (e.g. a literal ``<|endoftext|>``) keeps it as text: the template is rendered around a
    placeholder, its own parts encoded with their special tokens and the prompt as plain text
    (:func:`difflm.data.tokenizer.encode_text`).
    Raises: DifflmError (naming ``data.chat_template``) without a template or for an output that holds no ids.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DifflmError("data.chat_template=true but data.tokenizer has no chat template: set data.chat_template=false")
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) + list(tokenizer.get_added_vocab())
                if t.strip() and t in prompt]
    if specials:
        placeholder = "\x00difflm-prompt\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": placeholder}], add_generation_prompt=True,
                                             tokenize=False)
        if text.count(placeholder) == 1:
            before, after = text.split(placeholder)
            piece = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"] if t else []  # noqa: E731
            return piece(before) + encode_text(tokenizer, prompt) + piece(after)
    return template_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` under ``tokenizer``'s chat template (``apply_chat_template(tokenize=True)``), as a
    flat list of ints whatever transformers returns (a list in 4.x, a ``BatchEncoding`` in 5.x, a batch of one).
    Raises: DifflmError naming ``data.chat_template`` for an output that holds no ids."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers 5: BatchEncoding / dict
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):  # a batch of one conversation
        out = list(out[0])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise DifflmError(f"data.chat_template=true: the tokenizer's apply_chat_template returned {type(out).__name__} "
                          f"{str(out)[:80]}, not token ids: set data.chat_template=false or fix the tokenizer's template")
    return out


def full_pair_ids(tok: TokenizerInfo, prompt: str, response: str, chat_template: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + EOS) of one pair, uncut. Prompt and response text are encoded with
    :meth:`TokenizerInfo.encode` (special-token text in them stays text)."""
    p = chat_prompt_ids(tok.tokenizer, prompt) if chat_template else tok.encode(prompt)
    return p, tok.encode(response) + [tok.eos_id]


def cut_pair(p: list[int], r: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """(prompt, response) cut to ``seq_len`` tokens in all: the end of the prompt is kept, and at least one response
    token."""
    p = p[-(seq_len - 1):] if len(p) >= seq_len else p  # keep at least one response token
    return p, r[:seq_len - len(p)]


def truncation_notice(pairs: list[tuple[list[int], list[int]]], seq_len: int) -> str | None:
    """The notice for the uncut (prompt ids, response ids + EOS) ``pairs`` that :func:`cut_pair` cuts at ``seq_len``,
    or None when every pair fits: how many are cut (their response loses its end and the EOS that teaches the model
    to stop), how many have a prompt that fills the window (only one response token is left: a pair never loses its
    whole response), the longest pair, and the fix (raise ``data.seq_len``)."""
    lengths = [len(p) + len(r) for p, r in pairs]
    cut = sum(n > seq_len for n in lengths)
    if not cut:
        return None
    no_room = sum(len(p) >= seq_len - 1 and len(p) + len(r) > seq_len for p, r in pairs)
    longest = max(lengths)
    text = (f"data.seq_len={seq_len} cuts {cut:,} of {len(pairs):,} prompt/response pairs ({cut / len(pairs):.1%}): "
            "their responses lose their end, the EOS that teaches the model to stop included")
    if no_room:
        text += (f"; in {no_room:,} of them the prompt alone fills the window, so they keep the end of the prompt and "
                 "a single response token")
    return text + (f". The longest pair has {longest:,} tokens: raise data.seq_len (data.seq_len={longest} keeps every "
                   "pair whole) or remove the long pairs from the file")


def tokenize_pair(tok: TokenizerInfo, prompt: str, response: str, seq_len: int, chat_template: bool) -> tuple[list[int], int]:
    """(``seq_len`` token ids, prompt length) of one pair, as :func:`load_pairs` makes each row (cut with
    :func:`cut_pair`, padded with :func:`pad_pair`); see the module docstring."""
    return pad_pair(*cut_pair(*full_pair_ids(tok, prompt, response, chat_template), seq_len), seq_len, tok.eos_id)


def pad_pair(p: list[int], r: list[int], seq_len: int, eos_id: int) -> tuple[list[int], int]:
    """(``seq_len`` token ids, prompt length) of a cut pair: prompt, response, EOS padding to the window."""
    ids = p + r
    return ids + [eos_id] * (seq_len - len(ids)), len(p)


def pack_pairs(pairs: list[tuple[list[int], list[int]]], seq_len: int, eos_id: int) -> SFTPairs:
    """Pack (prompt ids, response ids) pairs greedily into ``seq_len`` rows (see the module docstring): tokens,
    prompt mask and the pair index of every token (each row's last pair owns the EOS padding)."""
    return pack_sequences([(p + r, [True] * len(p) + [False] * len(r)) for p, r in pairs], seq_len, eos_id)


def pack_sequences(seqs: list[tuple[list[int], list[bool]]], seq_len: int, eos_id: int) -> SFTPairs:
    """Pack (token ids, prompt mask) samples (pairs or conversations, each at most ``seq_len`` tokens) greedily into
    ``seq_len`` rows, in order, none split: tokens, prompt mask and the sample index of every token (each row's last
    sample owns the EOS padding, which carries loss as a response's padding does)."""
    rows, masks, docs = [], [], []
    row, mask, doc = [], [], []

    def close():
        pad = seq_len - len(row)
        rows.append(row + [eos_id] * pad)
        masks.append(mask + [False] * pad)
        docs.append(doc + [doc[-1]] * pad)

    for k, (ids, is_prompt) in enumerate(seqs):
        if row and len(row) + len(ids) > seq_len:
            close()
            row, mask, doc = [], [], []
        row += ids
        mask += is_prompt
        doc += [k] * len(ids)
    if row:
        close()
    return SFTPairs(np.asarray(rows, dtype=np.int64), prompt_mask=np.asarray(masks, dtype=bool),
                    doc_ids=np.asarray(docs, dtype=np.int64))


def load_pairs(cfg, tok: TokenizerInfo) -> SFTPairs:
    """Every pair of ``data.path`` (``cfg``: ``path``, ``prompt_field``, ``response_field``, ``seq_len``,
    ``chat_template``, optional ``sft_packing`` / ``intra_document_attention``), tokenized into ``seq_len`` rows:
    one pair a row, or packed (:func:`pack_pairs`; document ids kept for intra-document attention).
    Pairs longer than ``seq_len`` are cut (:func:`cut_pair`) and counted in one notice on stderr.
    Multi-turn conversations (``data.messages_field``) load through
    :func:`difflm.data.datasets.load_sft_samples` instead.
    Raises: DifflmError for a file without pairs."""
    pairs = read_pairs(cfg)
    if not pairs:
        raise DifflmError(f"data.path={cfg.path!r} holds no prompt/response pairs")
    full = [full_pair_ids(tok, p, r, cfg.chat_template) for p, r in pairs]
    if (notice := truncation_notice(full, cfg.seq_len)) is not None:  # a cut was silent before: say so once
        data_notice(notice)
    cut = [cut_pair(p, r, cfg.seq_len) for p, r in full]
    if cfg.get("sft_packing", False):
        packed = pack_pairs(cut, cfg.seq_len, tok.eos_id)
        if not cfg.get("intra_document_attention", False):
            packed.doc_ids = None  # the pairs attend to each other; pair_ids keep the per-pair loss normaliser
        return packed
    rows = [pad_pair(p, r, cfg.seq_len, tok.eos_id) for p, r in cut]
    return SFTPairs(np.asarray([ids for ids, _ in rows], dtype=np.int64), np.asarray([n for _, n in rows], dtype=np.int64))
