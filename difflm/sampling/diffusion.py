"""Masked-diffusion sampling: the LLaDA sampler with semi-autoregressive blocks, remasking policies,
classifier-free guidance, top-k / top-p, padded batches and Fast-dLLM's parallel decoding and KV cache.

Sources:
* Nie et al. 2025, "Large Language Diffusion Models" (arXiv:2502.09992), Algorithm 4 (random remasking),
  Algorithm 5 (low-confidence remasking), semi-autoregressive blocks and classifier-free guidance
  (App. B.3, ``cfg_scale``: ``un + (s + 1)(cond - un)``, unconditional = prompt masked), as in the reference
  ``generate.py`` of https://github.com/ML-GSAI/LLaDA.
* ``margin`` (top-1 minus top-2 probability; Kim et al. 2025, "Train for the Worst, Plan for the Best")
  and ``entropy`` (lowest predictive entropy first; Ye et al. 2025, Dream ``alg=entropy``).
* Wu et al. 2025, "Fast-dLLM" (arXiv:2505.22618): confidence-threshold parallel unmasking (sec. 3.3, every
  masked token of the block whose confidence exceeds ``threshold``, at least one per step) and the
  block-level ``prefix`` / ``dual`` KV cache (sec. 3.1-3.2, :mod:`difflm.model.kv_cache`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from difflm.errors import DifflmError

LogitsFn = Callable[..., torch.Tensor]
"""x ``[B, S]`` int64 -> logits ``[B, S, V]`` float. Called as ``logits_fn(x)``, or with keyword arguments
``attn_mask``, ``position_ids``, ``kv_cache`` (those of :meth:`difflm.model.transformer.Transformer.forward`)
for padded prompts or a KV cache."""

REMASKING = ("low_confidence", "random", "margin", "entropy")
CACHES = ("none", "prefix", "dual")


class GenerationConfigError(DifflmError, ValueError):
    """A bad ``gen.*`` setting (a ``ValueError`` that the CLI prints as one line)."""


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens to unmask at each of ``steps`` steps (LLaDA ``get_num_transfer_tokens``).

    LLaDA's linear schedule unmasks the same expected number of tokens per step, so the
    masked count is split as evenly as possible and the remainder goes to the first steps.

    Args:
        mask_count: ``[B]`` int64, number of masked positions per row.
        steps: number of steps (>= 1).
    Returns:
        ``[B, steps]`` int64; each row sums to ``mask_count``.
    """
    base = mask_count.long().unsqueeze(1) // steps
    remainder = mask_count.long().unsqueeze(1) % steps
    step_idx = torch.arange(steps, device=mask_count.device).unsqueeze(0)
    return base + (step_idx < remainder).long()


def gumbel_argmax(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Sample ``argmax`` of ``logits`` with Gumbel noise at ``temperature`` (0 = plain argmax).

    LLaDA's ``add_gumbel_noise`` computes ``exp(l) / (-log u) ** T`` in float64
    (low-precision Gumbel-max hurts generation, arXiv:2409.02908). Its argmax equals that of
    ``l - T * log(-log u) = l + T * g`` with ``g ~ Gumbel(0, 1)``, i.e. a sample from
    ``softmax(l / T)`` (Gumbel-max trick); we use this log-space form, still in float64,
    so large logits cannot overflow ``exp``.

    Args:
        logits: ``[..., V]`` float.
        temperature: >= 0.
        generator: source of the uniform noise.
    Returns:
        ``[...]`` int64 token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return (logits - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2020, eq. 3); the rest become ``-inf``. ``[..., V]`` -> same shape.

    ``top_k=0`` and ``top_p=1`` are off. The most likely token is always kept.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits.float(), dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - torch.softmax(sorted_logits.float(), dim=-1)) >= top_p  # mass before it reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_forbid(logits: torch.Tensor, forbid_ids: Sequence[int]) -> torch.Tensor:
    """Return ``logits`` (``[..., V]``) with the ``forbid_ids`` columns set to ``-inf``.

    Raises:
        ValueError: an id outside ``[0, V)``, or every id forbidden.
    """
    if not forbid_ids:
        return logits
    vocab = logits.shape[-1]
    ids = sorted(set(int(i) for i in forbid_ids))
    if ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"forbid_ids={ids} must lie in [0, {vocab}) (the logits' vocabulary size)")
    if len(ids) == vocab:
        raise ValueError(f"forbid_ids forbids all {vocab} tokens: nothing left to sample")
    logits = logits.clone()
    logits[..., ids] = float("-inf")
    return logits


def check_logits(logits: torch.Tensor, x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``logits`` is a floating ``[B, S, V]`` tensor for ``x`` ``[B, S]``."""
    if logits.dim() != 3 or logits.shape[:2] != x.shape or not logits.is_floating_point():
        raise ValueError(
            f"logits_fn returned {tuple(logits.shape)} {logits.dtype}; expected float [B, S, V] "
            f"with [B, S] = {tuple(x.shape)}"
        )


def check_prompt(prompt: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``prompt`` is a ``[B, P]`` int64 tensor."""
    if prompt.dim() != 2 or prompt.dtype != torch.long:
        raise ValueError(f"prompt must be [B, P] int64, got {tuple(prompt.shape)} {prompt.dtype}")


def check_common(remasking: str, temperature: float, top_k: int, top_p: float, cfg_scale: float,
                 threshold: Optional[float], cache: str) -> None:
    """Check the ``gen.*`` settings shared by the masked-diffusion samplers (GenerationConfigError naming the key)."""
    if remasking not in REMASKING:
        raise GenerationConfigError(f"gen.remasking={remasking!r} must be one of {REMASKING}")
    if not temperature >= 0:
        raise GenerationConfigError(f"gen.temperature={temperature} must be >= 0")
    if top_k < 0:
        raise GenerationConfigError(f"gen.top_k={top_k} must be >= 0 (0 = off)")
    if not 0.0 < top_p <= 1.0:
        raise GenerationConfigError(f"gen.top_p={top_p} must be in (0, 1] (1 = off)")
    if not cfg_scale >= 0:
        raise GenerationConfigError(f"gen.cfg_scale={cfg_scale} must be >= 0 (0 = off)")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise GenerationConfigError(f"gen.threshold={threshold} must be in (0, 1] or null")
    if cache not in CACHES:
        raise GenerationConfigError(f"gen.cache={cache!r} must be one of {CACHES}")


def _validate(length: int, steps: int, block_length: int, remasking: str, temperature: float) -> int:
    """Check the ``gen.*`` settings; return the number of blocks."""
    if length < 1:
        raise GenerationConfigError(f"gen.length={length} must be >= 1")
    if block_length < 1:
        raise GenerationConfigError(f"gen.block_length={block_length} must be >= 1")
    if length % block_length != 0:
        raise GenerationConfigError(
            f"gen.length={length} must be a multiple of gen.block_length={block_length}"
        )
    num_blocks = length // block_length
    if steps < num_blocks:
        raise GenerationConfigError(
            f"gen.steps={steps} must be >= the number of blocks "
            f"gen.length/gen.block_length={num_blocks}"
        )
    if steps % num_blocks != 0:
        raise GenerationConfigError(
            f"gen.steps={steps} must be a multiple of the number of blocks "
            f"gen.length/gen.block_length={num_blocks}"
        )
    if steps > length:
        raise GenerationConfigError(
            f"gen.steps={steps} must be <= gen.length={length} (at least one token per step)"
        )
    check_common(remasking, temperature, 0, 1.0, 0.0, None, "none")
    return num_blocks


def propose(logits: torch.Tensor, remasking: str, temperature: float, generator: torch.Generator | None,
            top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens and their confidence for ``logits`` ``[B, N, V]`` (forbidden ids already ``-inf``).

    ``x0 = gumbel_argmax(filter_top_k_top_p(logits), temperature)``; with ``probs = softmax`` of the filtered,
    noise-free logits the confidence (higher = unmask first) is ``probs[x0]`` (``low_confidence``),
    ``probs_top1 - probs_top2`` (``margin``), minus the entropy of ``probs`` (``entropy``) or ``U[0, 1)``
    (``random``). Returns ``(x0 [B, N] int64, confidence [B, N] float64)``.
    """
    logits = filter_top_k_top_p(logits, top_k, top_p)
    x0 = gumbel_argmax(logits, temperature, generator)
    if remasking == "random":
        return x0, torch.rand(x0.shape, generator=generator, dtype=torch.float64, device=x0.device)
    probs = torch.softmax(logits.float(), dim=-1)
    if remasking == "low_confidence":
        confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    elif remasking == "margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    else:  # entropy
        confidence = -torch.special.entr(probs).sum(dim=-1)
    return x0, confidence.double()


def select_transfer(confidence: torch.Tensor, candidates: torch.Tensor, count: Optional[torch.Tensor],
                    threshold: Optional[float] = None) -> torch.Tensor:
    """Which candidates to unmask this step, ``[B, N]`` bool.

    Without ``threshold`` the ``count[b]`` most confident candidates of row b (ties to the leftmost). With
    ``threshold`` (Fast-dLLM) every candidate whose confidence is >= threshold, and at least the most
    confident one (``remasking=low_confidence`` makes the confidence a probability).
    """
    confidence = confidence.masked_fill(~candidates, float("-inf"))
    order = torch.sort(confidence, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(confidence.shape[1], device=confidence.device).unsqueeze(0)
    if threshold is None:
        keep = ranks < count.unsqueeze(1)
        return torch.zeros_like(candidates).scatter(1, order, keep) & candidates
    first = torch.zeros_like(candidates).scatter(1, order, (ranks == 0).expand_as(order))
    return (first | (confidence >= threshold)) & candidates


class _Forward:
    """Calls ``logits_fn`` for one batch: padding masks, classifier-free guidance and the KV cache in one place.

    Returns the (guided) logits of positions ``[start, end)`` only, ``[B, end - start, V]``.
    """

    def __init__(self, logits_fn, prompt_len: int, total_len: int, mask_id: int, prompt_mask, cfg_scale: float,
                 cache: str, forbid_ids, device):
        from difflm.model.masks import key_padding_mask

        self.fn, self.prompt_len, self.mask_id = logits_fn, prompt_len, mask_id
        self.cfg_scale, self.cache_mode, self.forbid_ids = cfg_scale, cache, forbid_ids
        self.nfe = 0
        self.attn_mask = self.position_ids = None
        self.prompt_mask = prompt_mask
        if prompt_mask is not None:
            b = prompt_mask.shape[0]
            valid = torch.cat([prompt_mask.bool(), torch.ones(b, total_len - prompt_len, dtype=torch.bool,
                                                                device=device)], dim=1)
            self.position_ids = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            self.attn_mask = key_padding_mask(valid)
        if cfg_scale > 0 and self.attn_mask is not None:
            self.attn_mask = torch.cat([self.attn_mask, self.attn_mask])
            self.position_ids = torch.cat([self.position_ids, self.position_ids])
        self.cache = None
        if cache != "none":
            from difflm.model.kv_cache import KVCache

            self.cache = KVCache()

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg_scale <= 0:
            return x
        un = x.clone()
        real = slice(0, self.prompt_len)
        if self.prompt_mask is None:
            un[:, real] = self.mask_id
        else:
            un[:, real] = torch.where(self.prompt_mask.bool(), torch.full_like(un[:, real], self.mask_id), un[:, real])
        return torch.cat([x, un])

    def __call__(self, x: torch.Tensor, start: int, end: int, first_of_block: bool) -> torch.Tensor:
        xin = self._inputs(x)
        kw = {}
        if self.cache is None or first_of_block:
            if self.attn_mask is not None:
                kw = {"attn_mask": self.attn_mask, "position_ids": self.position_ids}
            if self.cache is not None:
                kw["kv_cache"] = self.cache.write()
            logits = self.fn(xin, **kw)
            check_logits(logits, xin)
            logits = logits[:, start:end]
        else:
            a, b = start, (x.shape[1] if self.cache_mode == "prefix" else end)
            if self.attn_mask is not None:
                kw = {"attn_mask": self.attn_mask[:, :, a:b], "position_ids": self.position_ids[:, a:b]}
            else:
                kw = {"position_ids": torch.arange(a, b, device=x.device)}
            logits = self.fn(xin[:, a:b], kv_cache=self.cache.read(a, b), **kw)
            check_logits(logits, xin[:, a:b])
            logits = logits[:, : end - start]
        self.nfe += 1
        if self.cfg_scale > 0:
            cond, un = logits.chunk(2)
            logits = un + (self.cfg_scale + 1.0) * (cond - un)
        return apply_forbid(logits, self.forbid_ids)


@torch.no_grad()
def diffusion_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    length: int,
    steps: int,
    block_length: int,
    remasking: str = "low_confidence",
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forbid_ids: Sequence[int] = (),
    top_k: int = 0,
    top_p: float = 1.0,
    cfg_scale: float = 0.0,
    threshold: Optional[float] = None,
    cache: str = "none",
    prompt_mask: Optional[torch.Tensor] = None,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """Generate ``length`` tokens after ``prompt`` with LLaDA's masked-diffusion sampler.

    Nie et al. 2025 (arXiv:2502.09992), Algorithms 4-5 with semi-autoregressive blocks;
    reference ``generate.py`` of ML-GSAI/LLaDA. Starting from
    ``x = [prompt, mask_id * length]``, the generated part is split into
    ``length // block_length`` blocks decoded left to right, ``steps // num_blocks`` steps
    each. At each step the block's logits (``forbid_ids`` at ``-inf``, guided when ``cfg_scale > 0``) give
    candidates and confidences (:func:`propose`); the ``k`` most confident masked positions of each row
    take their candidate, ``k`` following :func:`num_transfer_tokens` (or, with ``threshold``, every
    position above it and at least one: Fast-dLLM; a block then takes as many steps as it needs).
    Ties in confidence go to the leftmost position. The prompt is never changed, even if it contains
    ``mask_id``.

    Args:
        logits_fn: see :data:`LogitsFn`; called with ``attn_mask``/``position_ids``/``kv_cache`` keywords only
            when ``prompt_mask`` or ``cache`` is given.
        prompt: ``[B, P]`` int64 (padded rows: see ``prompt_mask``).
        mask_id: the mask token id.
        length: tokens to generate (``gen.length``).
        steps: total denoising steps (``gen.steps``); one ``logits_fn`` call each (without ``threshold``).
        block_length: semi-autoregressive block size (``gen.block_length``).
        remasking: one of :data:`REMASKING` (``gen.remasking``).
        temperature: Gumbel-noise temperature, 0 = greedy (``gen.temperature``).
        generator: source of all randomness; the same seed reproduces the output.
        forbid_ids: token ids never emitted (e.g. ``mask_id``, padded-vocab rows).
        top_k, top_p: ``gen.top_k`` / ``gen.top_p`` filters (:func:`filter_top_k_top_p`).
        cfg_scale: ``gen.cfg_scale``; the unconditional input has the (real) prompt tokens masked.
        threshold: ``gen.threshold`` (Fast-dLLM parallel decoding), None = fixed schedule.
        cache: ``gen.cache``: ``none``, ``prefix`` or ``dual`` (Fast-dLLM; approximate for bidirectional models).
        prompt_mask: ``[B, P]`` bool, True at real prompt tokens, for batches of prompts of different lengths,
            left- or right-padded: pad keys are masked out of attention and RoPE positions skip them, so each
            row is generated as if alone.
        stats: if given, ``stats["nfe"]`` receives the number of model calls.
    Returns:
        ``[B, P + length]`` int64, with no ``mask_id`` in the generated part unless the
        model can only emit it (forbid it to be sure).
    Raises:
        ValueError: a bad ``gen.*`` setting (:class:`GenerationConfigError`, naming the key),
            a bad prompt, bad ``forbid_ids``, or logits of the wrong shape.
    """
    check_prompt(prompt)
    num_blocks = _validate(length, steps, block_length, remasking, temperature)
    check_common(remasking, temperature, top_k, top_p, cfg_scale, threshold, cache)
    if prompt_mask is not None and prompt_mask.shape != prompt.shape:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} must have the prompt's shape {tuple(prompt.shape)}")
    steps_per_block = steps // num_blocks
    batch, prompt_len = prompt.shape
    total = prompt_len + length
    forward = _Forward(logits_fn, prompt_len, total, mask_id, prompt_mask, cfg_scale, cache, forbid_ids,
                       prompt.device)

    gen = torch.full((batch, length), mask_id, dtype=torch.long, device=prompt.device)
    x = torch.cat([prompt, gen], dim=1)

    for block in range(num_blocks):
        start = prompt_len + block * block_length
        end = start + block_length
        schedule = num_transfer_tokens((x[:, start:end] == mask_id).sum(dim=1), steps_per_block)
        step = 0
        while (x[:, start:end] == mask_id).any() if threshold is not None else step < steps_per_block:
            candidates = x[:, start:end] == mask_id  # [B, N]
            logits = forward(x, start, end, first_of_block=step == 0)
            x0, confidence = propose(logits, remasking, temperature, generator, top_k, top_p)
            count = schedule[:, min(step, steps_per_block - 1)]
            transfer = select_transfer(confidence, candidates, count, threshold)
            x[:, start:end] = torch.where(transfer, x0, x[:, start:end])
            step += 1
    if stats is not None:
        stats["nfe"] = forward.nfe
    return x
