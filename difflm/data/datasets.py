"""The windows a run reads and the sampler over them: a blend of corpora (:mod:`difflm.data.blend`), prompt/response
pairs (:mod:`difflm.data.sft`) or one corpus packed into windows (:mod:`difflm.data.windows`)."""
from __future__ import annotations

from difflm.data.blend import BlendedWindows, build_blend
from difflm.data.conversations import load_conversations
from difflm.data.sft import SFTPairs, load_pairs
from difflm.data.tokenizer import TokenizerInfo
from difflm.data.windows import GlobalBatchSampler, build_windows, token_datasets
from difflm.errors import DifflmError


def load_sft_samples(cfg, tok: TokenizerInfo) -> SFTPairs:
    """The SFT samples of ``data.path``: multi-turn conversations with ``data.messages_field``
    (:func:`difflm.data.conversations.load_conversations`), else prompt/response pairs
    (:func:`difflm.data.sft.load_pairs`), tokenized into ``data.seq_len`` rows."""
    if cfg.get("messages_field") is not None:
        return load_conversations(cfg, tok)
    return load_pairs(cfg, tok)


def build_sft_datasets(cfg, tok: TokenizerInfo) -> tuple[SFTPairs, SFTPairs]:
    """(train, valid) pairs; valid = the last ``data.valid_fraction`` of the pairs (at least one if > 0).

    Raises: DifflmError for an empty file or when no training pair is left.
    """
    pairs = load_sft_samples(cfg, tok)
    n_valid = max(1, round(cfg.valid_fraction * len(pairs))) if cfg.valid_fraction > 0 else 0
    if len(pairs) - n_valid < 1:
        raise DifflmError(f"data.path={cfg.path!r} has {len(pairs)} pair(s) and data.valid_fraction={cfg.valid_fraction} "
                          "leaves none for training: add pairs or lower data.valid_fraction")
    cut = len(pairs) - n_valid
    return pairs.rows(slice(0, cut)), pairs.rows(slice(cut, None))


def build_sampler(train_set, global_batch_size: int, seed: int):
    """The keyed sampler of a training set: :class:`difflm.data.blend.BlendedSampler` for a ``data.blend``, else
    :class:`difflm.data.windows.GlobalBatchSampler`. Both give ``indices(step)``, ``report(step)``,
    ``state_dict``/``check_state``."""
    if isinstance(train_set, BlendedWindows):
        return train_set.sampler(global_batch_size, seed)
    return GlobalBatchSampler(len(train_set), global_batch_size, seed)


def build_datasets(cfg, tok: TokenizerInfo, cache_dir: str):
    """(train, valid) windows of a DataConfig: ``data.blend`` (:mod:`difflm.data.blend`), prompt/response pairs
    (``objective=sft``), or ``data.path`` / ``data.hf_dataset`` (shards of ``difflm-preprocess`` read directly,
    text tokenized into the cache; :func:`difflm.data.windows.token_datasets`)."""
    if not 0.0 <= cfg.valid_fraction < 1.0:  # fail before a possibly long tokenization
        raise DifflmError(f"data.valid_fraction={cfg.valid_fraction} must be in [0, 1): e.g. 0.05")
    blend = getattr(cfg, "blend", None)
    if getattr(cfg, "prompt_field", None) is not None or getattr(cfg, "messages_field", None) is not None:  # sft
        if blend:
            raise DifflmError("data.blend is not supported with objective=sft (data.prompt_field): "
                              "give the pairs in data.path and set data.blend=[]")
        if getattr(cfg, "max_train_tokens", None) is not None:
            raise DifflmError("data.max_train_tokens is not supported with objective=sft (data.prompt_field): every "
                              "pair is a window of its own, so cut the pairs file instead and set "
                              "data.max_train_tokens=null")
        return build_sft_datasets(cfg, tok)
    if blend:
        return build_blend(cfg, tok, cache_dir)
    return build_windows(token_datasets(cfg, tok, cache_dir), tok.eos_id, cfg.seq_len, cfg.valid_fraction,
                         getattr(cfg, "intra_document_attention", False), getattr(cfg, "max_train_tokens", None),
                         vocab_size=tok.padded_vocab_size, mask_id=tok.mask_id)


__all__ = ["build_datasets", "build_sampler", "build_sft_datasets", "load_sft_samples"]
