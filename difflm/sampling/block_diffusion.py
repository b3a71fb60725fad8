"""Block-wise sampling of a BD3-LM (Arriola et al. 2025, "Block Diffusion", Algorithm 2).

Blocks of ``block_size`` tokens are aligned to absolute positions, as in training (block j covers positions
``[j * block_size, (j + 1) * block_size)``); the block that holds the end of the prompt is completed first.
Each block starts fully masked (except prompt tokens inside it) and is denoised with the masked-diffusion
step of :mod:`difflm.sampling.diffusion` (remasking policy, ``steps_per_block`` steps or a Fast-dLLM
``threshold``) under the block-causal mask, which gives every position exactly its training context.

With ``cache=True`` finished blocks are encoded once into a :class:`difflm.model.kv_cache.KVCache` and each
step runs only the current block. Because clean blocks never attend to later blocks this is exact: the
cached and uncached paths compute the same function (Arriola et al. 2025, sec. 3.3, "KV caching").
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from difflm.model.kv_cache import KVCache
from difflm.model.masks import block_causal_inference_mask
from difflm.sampling.diffusion import (
    GenerationConfigError,
    LogitsFn,
    apply_forbid,
    check_common,
    check_logits,
    check_prompt,
    num_transfer_tokens,
    propose,
    select_transfer,
)


@torch.no_grad()
def block_diffusion_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    length: int,
    block_size: int,
    steps_per_block: int,
    remasking: str = "low_confidence",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forbid_ids: Sequence[int] = (),
    top_k: int = 0,
    top_p: float = 1.0,
    threshold: Optional[float] = None,
    cache: bool = False,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """Generate ``length`` tokens after ``prompt`` [B, P] int64 with a block-diffusion model.

    Args:
        logits_fn: called as ``logits_fn(x, attn_mask=..., position_ids=..., kv_cache=...)`` (the keywords of
            :meth:`difflm.model.transformer.Transformer.forward`); returns ``[B, S, V]``.
        block_size: the model's ``objective.block_size``.
        steps_per_block: denoising steps per block (capped by the tokens to generate in it).
        threshold: Fast-dLLM confidence threshold (None: ``steps_per_block`` fixed steps).
        cache: exact KV cache of finished blocks.
        stats: if given, ``stats["nfe"]`` receives the number of model calls (cache updates included).
        Other arguments as :func:`difflm.sampling.diffusion.diffusion_generate`.
    Returns: ``[B, P + length]`` int64.
    Raises: GenerationConfigError (a ValueError) for a bad ``gen.*`` setting; ValueError for a bad prompt.
    """
    check_prompt(prompt)
    check_common(remasking, temperature, top_k, top_p, 0.0, threshold, "none")
    if length < 1:
        raise GenerationConfigError(f"gen.length={length} must be >= 1")
    if steps_per_block < 1:
        raise GenerationConfigError(f"gen.steps={steps_per_block} must give >= 1 step per block")
    if block_size < 1:
        raise GenerationConfigError(f"objective.block_size={block_size} must be >= 1")
    batch, prompt_len = prompt.shape
    total = prompt_len + length
    device = prompt.device
    full_mask = block_causal_inference_mask(total, block_size, device)
    kv = KVCache() if cache else None
    committed = 0  # positions whose K/V are in the cache
    x = torch.cat([prompt, torch.full((batch, length), mask_id, dtype=torch.long, device=device)], dim=1)
    nfe = 0
    pos = prompt_len
    while pos < total:
        block_start = pos // block_size * block_size
        end = min(block_start + block_size, total)
        if kv is not None and committed < block_start:  # encode the finished clean blocks once
            rows = slice(committed, block_start)
            kw = {"attn_mask": full_mask[:, :, rows, :block_start], "position_ids": torch.arange(committed, block_start, device=device)}
            if committed == 0:
                logits_fn(x[:, :block_start], attn_mask=full_mask[:, :, :block_start, :block_start], kv_cache=kv.write())
            else:
                logits_fn(x[:, rows], kv_cache=kv.read(committed, block_start, commit=True), **kw)
            committed = block_start
            nfe += 1
        n_steps = min(steps_per_block, end - pos)
        schedule = num_transfer_tokens(torch.full((batch,), end - pos, device=device), n_steps)
        step = 0
        while (x[:, pos:end] == mask_id).any() if threshold is not None else step < n_steps:
            if kv is not None and committed > 0:
                logits = logits_fn(x[:, block_start:end], attn_mask=full_mask[:, :, block_start:end, :end],
                                   position_ids=torch.arange(block_start, end, device=device),
                                   kv_cache=kv.read(block_start, end))
                check_logits(logits, x[:, block_start:end])
                logits = logits[:, pos - block_start:]
            else:
                logits = logits_fn(x[:, :end], attn_mask=full_mask[:, :, :end, :end])
                check_logits(logits, x[:, :end])
                logits = logits[:, pos:end]
            nfe += 1
            logits = apply_forbid(logits, forbid_ids)
            x0, confidence = propose(logits, remasking, temperature, generator, top_k, top_p)
            candidates = x[:, pos:end] == mask_id
            transfer = select_transfer(confidence, candidates, schedule[:, min(step, n_steps - 1)], threshold)
            x[:, pos:end] = torch.where(transfer, x0, x[:, pos:end])
            step += 1
        pos = end
    if stats is not None:
        stats["nfe"] = nfe
    return x
