"""Multi-turn conversations for supervised fine-tuning (``objective=sft`` with ``data.messages_field``).

Each line of a JSONL file holds a list of turns under ``data.messages_field`` (the conversational format of TRL
and dllm: ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``). A conversation is one
SFT sample whose loss is on the assistant turns only: every other token is prompt (never masked, no loss, as the
prompt of LLaDA's eq. 5; Nie et al. 2025, sec. 2.3), and the response length N of ``objective.loss_norm=sequence``
counts the assistant tokens (with the row's EOS padding, as for a pair).

Token layout:

* ``data.chat_template=true``: the tokenizer's ``apply_chat_template``. The tokens of assistant turn i are those the
  template adds from ``messages[:i]`` with the generation prompt to ``messages[:i + 1]`` (the answer and the
  template's own end-of-turn tokens, which teach the model to end its turn); turns after the last assistant turn
  carry no loss and are left out. A template that does not render a conversation as a prefix of its continuation is
  refused in one line.
* ``data.chat_template=false`` (plain format): each turn is ``"<role>: <content>\\n"``; for an assistant turn the
  header ``"assistant: "`` is prompt and the content is followed by EOS instead of the newline, and content + EOS are
  the loss tokens.

Conversations longer than ``data.seq_len`` keep their beginning (one notice counts them); a conversation without an
assistant turn has no loss token and is skipped (one notice). With ``data.sft_packing=true`` conversations are packed
as pairs are (:func:`difflm.data.sft.pack_sequences`).
"""
from __future__ import annotations

import numpy as np

from difflm.data.documents import DocFormat, data_notice, read_jsonl, resolve_sources, text_value
from difflm.data.sft import SFTPairs, pack_sequences, template_ids
from difflm.data.tokenizer import TokenizerInfo
from difflm.errors import DifflmError

ASSISTANT = "assistant"


def read_conversations(cfg) -> list[list[dict]]:
    """The conversations (lists of ``{"role", "content"}`` turns) of every ``.jsonl`` file of ``data.path``.

    Raises: DifflmError naming ``data.messages_field`` and the line for a missing field, a value that is not a list
    of turns, a turn whose role or content is not text, or an assistant turn without content."""
    key = "data.messages_field"
    field = cfg.messages_field
    out = []
    for path in resolve_sources(cfg.path):
        if not path.endswith(".jsonl"):
            raise DifflmError(f"data.path: {path} is not .jsonl: {key}={field!r} reads conversations, one JSON "
                              "record a line holding a list of {role, content} turns: set data.path to such a .jsonl "
                              "file")
        for where, rec in read_jsonl(path, DocFormat.of(cfg)):
            if not isinstance(rec, dict) or field not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise DifflmError(f"{key}={field!r} not found in {where} (keys: {keys}): set {key} to one of them")
            turns = rec[field]
            if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
                raise DifflmError(f"{key}={field!r} is not a list of {{role, content}} turns in {where}: give each "
                                  "line a list such as [{\"role\": \"user\", \"content\": \"...\"}, ...]")
            conv = []
            for n, turn in enumerate(turns):
                spot = f"{where} turn {n}"
                role = text_value(turn.get("role"), f"{key}[].role", field, spot, null=None)
                content = text_value(turn.get("content"), f"{key}[].content", field, spot, null=None)
                if role == ASSISTANT and not content.strip():
                    raise DifflmError(f"{key}={field!r}: the assistant turn in {spot} is empty (its only loss token "
                                      "would teach the model to end the turn at once): fill it in or remove that "
                                      "record")
                conv.append({"role": role, "content": content})
            out.append(conv)
    return out


def plain_ids(tok: TokenizerInfo, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(token ids, prompt mask) of ``messages`` in the plain format (module docstring)."""
    ids, prompt = [], []
    for turn in messages:
        if turn["role"] == ASSISTANT:
            header = tok.encode(f"{ASSISTANT}: ")
            answer = tok.encode(turn["content"]) + [tok.eos_id]
            ids += header + answer
            prompt += [True] * len(header) + [False] * len(answer)
        else:
            text = tok.encode(f"{turn['role']}: {turn['content']}\n")
            ids += text
            prompt += [True] * len(text)
    return ids, prompt


def templated_ids(tok: TokenizerInfo, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(token ids, prompt mask) of ``messages`` under the tokenizer's chat template (module docstring).

    Raises: DifflmError (naming ``data.chat_template``) without a template, or when the template's rendering of the
    conversation up to an assistant turn is not a prefix of its rendering with that turn."""
    tokenizer = tok.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise DifflmError("data.chat_template=true but data.tokenizer has no chat template: set data.chat_template=false")
    ids: list[int] = []
    prompt: list[bool] = []
    for i, turn in enumerate(messages):
        if turn["role"] != ASSISTANT:
            continue
        before = template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = template_ids(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if before[:len(ids)] != ids or through[:len(before)] != before or len(through) == len(before):
            raise DifflmError("data.chat_template=true: the tokenizer's chat template does not render a conversation as "
                              "a prefix of its continuation, so the assistant turns cannot be told apart: set "
                              "data.chat_template=false (plain 'role: content' turns) or fix the template")
        prompt += [True] * (len(before) - len(ids)) + [False] * (len(through) - len(before))
        ids = list(through)
    return ids, prompt


def load_conversations(cfg, tok: TokenizerInfo) -> SFTPairs:
    """Every conversation of ``data.path`` (``cfg``: ``path``, ``messages_field``, ``seq_len``, ``chat_template``,
    optional ``sft_packing`` / ``intra_document_attention``) as ``seq_len`` rows with a prompt mask: one conversation
    a row (EOS padding carries loss, as for pairs) or packed.
    Raises: DifflmError for a file without a conversation that has an assistant turn."""
    seqs, skipped, cut, n = [], 0, 0, cfg.seq_len
    for conv in read_conversations(cfg):
        ids, prompt = (templated_ids if cfg.chat_template else plain_ids)(tok, conv)
        if all(prompt):
            skipped += 1
            continue
        if len(ids) > n:
            cut += 1
            ids, prompt = ids[:n], prompt[:n]
        seqs.append((ids, prompt))
    total = len(seqs) + skipped
    if skipped:
        data_notice(f"{skipped:,} of {total:,} conversations in data.path={cfg.path!r} have no assistant turn (role "
                    f"'{ASSISTANT}'), hence nothing to learn, and are skipped")
    if cut:
        data_notice(f"data.seq_len={n} cuts {cut:,} of {total:,} conversations, which lose their end: raise "
                    "data.seq_len or split the long conversations")
    if not seqs:
        raise DifflmError(f"data.path={cfg.path!r} holds no conversation with an assistant turn under "
                          f"data.messages_field={cfg.messages_field!r}")
    if cfg.get("sft_packing", False):
        packed = pack_sequences(seqs, n, tok.eos_id)
        if not cfg.get("intra_document_attention", False):
            packed.doc_ids = None  # the conversations attend to each other; pair_ids keep the per-sample normaliser
        return packed
    tokens = np.asarray([ids + [tok.eos_id] * (n - len(ids)) for ids, _ in seqs], dtype=np.int64)
    mask = np.asarray([prompt + [False] * (n - len(prompt)) for _, prompt in seqs], dtype=bool)
    return SFTPairs(tokens, prompt_mask=mask)


__all__ = ["load_conversations", "plain_ids", "read_conversations", "templated_ids"]
