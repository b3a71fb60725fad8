"""Post-training data: prompts with reference answers (GRPO) and ``prompt, chosen, rejected`` triples (DPO), from
JSONL files (``data.path``) or a Hugging Face dataset (``data.hf_dataset``: a hub name or a ``save_to_disk``
directory, split ``data.hf_split``). Text is tokenized as SFT's pairs are (:func:`difflm.data.sft.full_pair_ids`:
optional chat template, responses end in EOS). The first ``data.eval_records`` records are held out.
"""
from __future__ import annotations

import os
from typing import Optional

from difflm.data.documents import DocFormat, empty_text_error, read_jsonl, resolve_sources, \
    text_value
from difflm.data.sft import full_pair_ids
from difflm.errors import DifflmError


# the record fields that hold a response or an answer, and what an empty one would do to the run
RESPONSE_FIELDS = {
    "answer_field": "the reward compares every completion with it",
    "chosen_field": "an empty response scores its EOS only",
    "rejected_field": "an empty response scores its EOS only",
}


def read_records(cfg, fields: tuple[str, ...]) -> list[dict]:
    """Records of ``data.path`` (every .jsonl file) or ``data.hf_dataset``, each a dict of the config's ``fields``
    (names of ``data.*_field`` keys) by their key name.

    Raises: DifflmError naming the ``data.*`` key that is unset, a missing field, a non-string value, an empty
    answer or response (:data:`RESPONSE_FIELDS`), or a source without records.
    """
    rows = []
    if cfg.hf_dataset:
        import datasets

        local = os.path.expanduser(cfg.hf_dataset)
        try:
            ds = datasets.load_from_disk(local) if os.path.isdir(local) else \
                datasets.load_dataset(cfg.hf_dataset, split=cfg.hf_split)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; one line names the key
            raise DifflmError(f"data.hf_dataset={cfg.hf_dataset!r} cannot be loaded "
                              f"({type(e).__name__}: {e})") from None
        if isinstance(ds, datasets.DatasetDict):  # a save_to_disk DatasetDict: its split, or the ones it has
            if cfg.hf_split not in ds:
                raise DifflmError(f"data.hf_split={cfg.hf_split!r} is not a split of data.hf_dataset="
                                  f"{cfg.hf_dataset!r}: set data.hf_split to one of {sorted(ds)}")
            ds = ds[cfg.hf_split]
        rows = [(f"{cfg.hf_dataset}[{i}]", dict(r)) for i, r in enumerate(ds)]
    elif cfg.path:
        for path in resolve_sources(cfg.path):
            if not path.endswith(".jsonl"):
                raise DifflmError(f"data.path: {path} is not .jsonl: difflm-rl reads one JSON record a line with the "
                                  f"fields {', '.join(f'data.{k}' for k in fields)}: convert the file to JSONL "
                                  "or set data.hf_dataset")
            rows.extend(read_jsonl(path, DocFormat()))
    else:
        raise DifflmError("set data.path (JSONL records) or data.hf_dataset")
    out = []
    for where, rec in rows:
        if not isinstance(rec, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(rec), "a number")
            raise DifflmError(f"{where} is {kind}, not a record: difflm-rl reads one JSON object a line with the "
                              f"fields {', '.join(f'data.{k}={cfg[k]!r}' for k in fields if cfg[k] is not None)}: "
                              "fix or remove that line")
        item = {}
        for key in fields:
            name = cfg[key]
            if name is None:
                continue
            if name not in rec:
                raise DifflmError(f"data.{key}={name!r} not found in {where} (keys: {sorted(rec)}): set data.{key}")
            item[key] = text_value(rec[name], f"data.{key}", name, where, null=None)
            if key in RESPONSE_FIELDS and not item[key].strip():
                raise DifflmError(empty_text_error(f"data.{key}", name, where, RESPONSE_FIELDS[key]))
        out.append(item)
    if not out:
        source = f"data.hf_dataset={cfg.hf_dataset!r}" if cfg.hf_dataset else f"data.path={cfg.path!r}"
        raise DifflmError(f"{source} holds no records: point it at JSONL records with the fields "
                          f"{', '.join(f'data.{k}={cfg[k]!r}' for k in fields if cfg[k] is not None)}")
    if len(out) <= cfg.eval_records:
        raise DifflmError(f"data holds {len(out)} records, not more than data.eval_records={cfg.eval_records}: "
                          "lower data.eval_records or add records")
    return out


def prompt_text(cfg, record: dict) -> str:
    """The prompt of a record through ``data.prompt_template`` (``{prompt}`` is replaced by the record's prompt)."""
    return cfg.prompt_template.replace("{prompt}", record["prompt_field"])


def full_prompt_ids(tok, cfg, record: dict) -> list[int]:
    """The record's prompt ids, uncut."""
    return full_pair_ids(tok, prompt_text(cfg, record), "", cfg.chat_template)[0]


def tokenize_prompt(tok, cfg, record: dict) -> list[int]:
    """Prompt ids, the last ``data.max_prompt_tokens`` kept."""
    return full_prompt_ids(tok, cfg, record)[-cfg.max_prompt_tokens:]


def full_preference_ids(tok, cfg, record: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids + EOS, rejected ids + EOS) of a preference record, uncut."""
    p, chosen = full_pair_ids(tok, prompt_text(cfg, record), record["chosen_field"], cfg.chat_template)
    _, rejected = full_pair_ids(tok, prompt_text(cfg, record), record["rejected_field"], cfg.chat_template)
    return p, chosen, rejected


def tokenize_preference(tok, cfg, record: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids + EOS, rejected ids + EOS), the prompt's last ``data.max_prompt_tokens`` kept and
    the responses cut to ``data.max_response_tokens``."""
    p, chosen, rejected = full_preference_ids(tok, cfg, record)
    n = cfg.max_response_tokens
    return p[-cfg.max_prompt_tokens:], chosen[:n], rejected[:n]


def cut_notice(cfg, prompt_lengths: list[int], response_lengths: Optional[list[int]] = None) -> Optional[str]:
    """The notice for records that ``data.max_prompt_tokens`` / ``data.max_response_tokens`` cut (their uncut token
    counts: one prompt a record; for DPO the chosen and the rejected response, EOS included), or None when all
    fit: how many are cut, what they lose (a prompt its start; a response its end, the EOS that tells the model to
    stop included), the longest, and the key to raise. As difflm-train's SFT notice
    (:func:`difflm.data.sft.truncation_notice`)."""
    parts = []
    for key, lengths, what, loss in (
            ("max_prompt_tokens", prompt_lengths, "prompts", "their start is dropped, the end kept"),
            ("max_response_tokens", response_lengths or [], "chosen / rejected responses",
             "they lose their end, the EOS that tells the model to stop included")):
        limit, cut = int(cfg[key]), sum(n > int(cfg[key]) for n in lengths)
        if cut:
            parts.append(f"data.{key}={limit} cuts {cut:,} of {len(lengths):,} {what} ({loss}; the longest has "
                         f"{max(lengths):,} tokens: data.{key}={max(lengths)} keeps every one whole)")
    return "difflm: notice: " + "; ".join(parts) if parts else None


def answer_of(record: dict) -> Optional[str]:
    """The record's reference answer (``data.answer_field``), or None."""
    return record.get("answer_field")


__all__ = ["RESPONSE_FIELDS", "answer_of", "cut_notice", "full_preference_ids", "full_prompt_ids", "prompt_text",
           "read_records", "tokenize_preference", "tokenize_prompt"]
