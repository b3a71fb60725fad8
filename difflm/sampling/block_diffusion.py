"""Block-wise sampling of a BD3-LM (Arriola et al. 2025, "Block Diffusion", Algorithm 2).

Blocks of ``block_size`` tokens are aligned to absolute positions, as in training (block j covers positions
``[j * block_size, (j + 1) * block_size)``); the block that holds the end of the prompt is completed first.
Each block starts fully masked (except prompt tokens inside it) and is denoised with the masked-diffusion
step of :mod:`difflm.sampling.diffusion` (remasking policy, :func:`steps_per_block` steps or a Fast-dLLM
``threshold``) under the block-causal mask, which gives every position exactly its training context.

With ``gen.cache`` other than ``none`` finished blocks are encoded once into a
:class:`difflm.model.kv_cache.KVCache` and each step runs only the current block (from the position before it
under ``model.shift_logits``). Because clean blocks never attend to later blocks this is exact: the cached and
uncached paths compute the same function (Arriola et al. 2025, sec. 3.3, "KV caching").

A model trained with a causal clean half (``objective.clean_attention=causal``, ``opts.causal_prefix``) samples under
:func:`~difflm.model.masks.causal_prefix_inference_mask`: finished blocks attend causally, the block being denoised
sees them and itself (Megatron-Bridge's ``generate_dllm``); finished blocks still never attend to later positions, so
the cache stays exact.
"""
from __future__ import annotations

from typing import Optional

import torch

from difflm.model.kv_cache import KVCache
from difflm.model.masks import block_causal_inference_mask, causal_prefix_inference_mask
from difflm.sampling.diffusion import (
    LogitsFn,
    apply_forbid,
    check_logits,
    check_prompt,
    num_transfer_tokens,
    propose,
    select_transfer,
)
from difflm.sampling.options import REMDM, GenerationConfigError, GenerationOptions
from difflm.sampling.remdm import remdm_remask


def steps_per_block(opts: GenerationOptions) -> int:
    """``gen.steps`` spread over the ``gen.length / objective.block_size`` blocks: ``max(1, steps * block_size //
    length)`` denoising steps per block."""
    return max(1, opts.steps * opts.block_size // opts.length)


@torch.no_grad()
def block_diffusion_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    opts: GenerationOptions,
    *,
    generator: torch.Generator | None = None,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """Generate ``opts.length`` tokens after ``prompt`` [B, P] int64 with a block-diffusion model.

    Args:
        logits_fn: called as ``logits_fn(x, attn_mask=..., position_ids=..., kv_cache=...)`` (the keywords of
            :meth:`difflm.model.transformer.Transformer.forward`); returns ``[B, S, V]``.
        opts: the settings (:class:`GenerationOptions`); reads ``block_size`` (the model's
            ``objective.block_size``, required), ``length``, ``steps`` (:func:`steps_per_block` per block, capped
            by the tokens to generate in it), ``remasking``, ``temperature``, ``top_k``/``top_p``, ``threshold``
            (Fast-dLLM; None: fixed steps), ``cache`` (anything but ``none``: the exact KV cache of finished
            blocks), ``forbid_ids`` and ``shift_logits``. ``cfg_scale`` must be 0. ``infill``: the prompt's
            ``mask_id`` positions are sampled too, block by block from the block of the first one (each block's
            given tokens kept, its schedule counting only its masked positions). ``remasking=remdm``: ReMDM's
            remasking of the block's decoded tokens (:mod:`difflm.sampling.remdm`).
        generator: source of all randomness.
        stats: if given, ``stats["nfe"]`` receives the number of model calls (cache updates included).
    Returns: ``[B, P + length]`` int64.
    Raises: GenerationConfigError (a ValueError) for a bad ``gen.*`` setting; ValueError for a bad prompt.
    """
    check_prompt(prompt)
    if opts.block_size is None:
        raise GenerationConfigError("block_diffusion_generate needs GenerationOptions.block_size "
                                    "(the bd3lm run's objective.block_size)")
    if opts.cfg_scale > 0:
        raise GenerationConfigError(f"gen.cfg_scale={opts.cfg_scale}: classifier-free guidance is not implemented "
                                    "for objective=bd3lm runs: set gen.cfg_scale=0")
    mask_id, block_size, threshold = opts.mask_id, opts.block_size, opts.threshold
    per_block = steps_per_block(opts)
    remdm = opts.remasking == REMDM
    rule = "low_confidence" if remdm else opts.remasking
    batch, prompt_len = prompt.shape
    total = prompt_len + opts.length
    device = prompt.device
    full_mask = block_causal_inference_mask(total, block_size, device)
    kv = KVCache() if opts.cache != "none" else None
    committed = 0  # positions whose K/V are in the cache
    x = torch.cat([prompt, torch.full((batch, opts.length), mask_id, dtype=torch.long, device=device)], dim=1)
    nfe = 0
    pos = prompt_len
    if opts.infill and (prompt == mask_id).any():  # from the block of the first masked prompt position
        pos = int((prompt == mask_id).any(dim=0).nonzero()[0]) // block_size * block_size
    while pos < total:
        block_start = pos // block_size * block_size
        end = min(block_start + block_size, total)
        if opts.causal_prefix:  # the current block is the noisy one: causal before it
            full_mask = causal_prefix_inference_mask(total, block_start, device)
        if opts.infill:  # the whole block: its masked prompt positions are sampled, its given tokens kept
            pos = block_start
        masked = (x[:, pos:end] == mask_id).sum(dim=1)
        if not bool(masked.any()):  # a prompt block with nothing to fill
            pos = end
            continue
        if kv is not None and committed < block_start:  # encode the finished clean blocks once
            rows = slice(committed, block_start)
            kw = {"attn_mask": full_mask[:, :, rows, :block_start], "position_ids": torch.arange(committed, block_start, device=device)}
            if committed == 0:
                logits_fn(x[:, :block_start], attn_mask=full_mask[:, :, :block_start, :block_start], kv_cache=kv.write())
            else:
                logits_fn(x[:, rows], kv_cache=kv.read(committed, block_start, commit=True), **kw)
            committed = block_start
            nfe += 1
        n_steps = min(per_block, int(masked.max()))
        schedule = num_transfer_tokens(masked, n_steps)
        to_decode = x[:, pos:end] == mask_id
        decoded_confidence = torch.zeros(to_decode.shape, dtype=torch.float64, device=device)
        step = 0
        while (x[:, pos:end] == mask_id).any() if threshold is not None else step < n_steps:
            if kv is not None and committed > 0:
                # a shifting model predicts pos from the state at pos - 1: the span starts there (its K/V are
                # recomputed from the same clean tokens, so the cache stays exact)
                a = block_start - 1 if opts.shift_logits and pos == block_start else block_start
                logits = logits_fn(x[:, a:end], attn_mask=full_mask[:, :, a:end, :end],
                                   position_ids=torch.arange(a, end, device=device), kv_cache=kv.read(a, end))
                check_logits(logits, x[:, a:end])
                logits = logits[:, pos - a:]
            else:
                logits = logits_fn(x[:, :end], attn_mask=full_mask[:, :, :end, :end])
                check_logits(logits, x[:, :end])
                logits = logits[:, pos:end]
            nfe += 1
            logits = apply_forbid(logits, opts.forbid_ids)
            x0, confidence = propose(logits, rule, opts.temperature, generator, opts.top_k, opts.top_p)
            candidates = x[:, pos:end] == mask_id
            count = schedule[:, min(step, n_steps - 1)]
            if remdm:  # ReMDM (count form): remask r decoded tokens of the block, unmask k + r
                remask, count = remdm_remask(to_decode & ~candidates, decoded_confidence, candidates.sum(dim=1),
                                             count, masked, opts.remdm_sigma, opts.remdm_schedule)
            transfer = select_transfer(confidence, candidates, count, threshold)
            x[:, pos:end] = torch.where(transfer, x0, x[:, pos:end])
            if remdm:
                decoded_confidence = torch.where(transfer, confidence, decoded_confidence)
                x[:, pos:end] = x[:, pos:end].masked_fill(remask, mask_id)
            step += 1
        pos = end
    if stats is not None:
        stats["nfe"] = nfe
    return x
