"""Masked-diffusion sampling: the LLaDA sampler with semi-autoregressive blocks, remasking policies,
classifier-free guidance, top-k / top-p, padded batches and Fast-dLLM's parallel decoding and KV cache.

Sources:
* Nie et al. 2025, "Large Language Diffusion Models" (arXiv:2502.09992), Algorithm 4 (random remasking),
  Algorithm 5 (low-confidence remasking), semi-autoregressive blocks and classifier-free guidance
  (App. B.3, ``cfg_scale``: ``un + (s + 1)(cond - un)``, unconditional = prompt masked), as in the reference
  ``generate.py`` of https://github.com/ML-GSAI/LLaDA.
* ``margin`` (top-1 minus top-2 probability; Kim et al. 2025, "Train for the Worst, Plan for the Best")
  and ``entropy`` (lowest predictive entropy first; Ye et al. 2025, Dream ``alg=entropy``).
* ``remasking=remdm``: Wang et al. 2025, "Remasking Discrete Diffusion Models with Inference-Time Scaling"
  (arXiv:2503.00307), :mod:`difflm.sampling.remdm`.
* Wu et al. 2025, "Fast-dLLM" (arXiv:2505.22618): confidence-threshold parallel unmasking (sec. 3.3, every
  masked token of the block whose confidence exceeds ``threshold``, at least one per step) and the
  block-level ``prefix`` / ``dual`` KV cache (sec. 3.1-3.2, :mod:`difflm.model.kv_cache`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

# CACHES, REMASKING and GenerationConfigError are re-exported for callers of this module
from difflm.sampling.options import CACHES, REMASKING, REMDM, GenerationConfigError, GenerationOptions  # noqa: F401
from difflm.sampling.options import check_read_settings, run_block_size
from difflm.sampling.remdm import remdm_remask

LogitsFn = Callable[..., torch.Tensor]
"""x ``[B, S]`` int64 -> logits ``[B, S, V]`` float. Called as ``logits_fn(x)``, or with keyword arguments
``attn_mask``, ``position_ids``, ``kv_cache`` (those of :meth:`difflm.model.transformer.Transformer.forward`)
for padded prompts or a KV cache."""


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


def uniform(shape: Sequence[int], generator, device, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """U[0, 1) float64 numbers of ``shape`` ``[B, ...]`` from ``generator``: one ``torch.Generator`` (or None) for
    the whole tensor, or a list of B generators, one per row, so that a row's numbers do not depend on the rows
    sampled with it (post-training rollouts keyed per sample, :mod:`difflm.posttrain.rollout`). With a list,
    ``rows`` ([B] bool) leaves the rows that have nothing to decode undrawn (zeros), so each row's generator
    advances once per step in which that row decodes, whatever the other rows need."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(tuple(shape), generator=generator, dtype=torch.float64, device=device)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} per-row generators for {shape[0]} rows")
    out = torch.zeros(tuple(shape), dtype=torch.float64, device=device)
    active = [True] * shape[0] if rows is None else rows.tolist()
    for b, (g, on) in enumerate(zip(generator, active)):
        if on:
            out[b] = torch.rand(tuple(shape[1:]), generator=g, dtype=torch.float64, device=device)
    return out


def gumbel_argmax(
    logits: torch.Tensor, temperature: float, generator=None, rows: Optional[torch.Tensor] = None
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
        generator: source of the uniform noise (one generator, or one per row: :func:`uniform`).
        rows: with per-row generators, the rows that draw (:func:`uniform`).
    Returns:
        ``[...]`` int64 token ids.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.to(torch.float64)
    u = uniform(logits.shape, generator, logits.device, rows)
    return (logits - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                       temperature: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability under ``softmax(logits /
    temperature)`` reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020, eq. 3); the rest become ``-inf``.
    ``[..., V]`` -> same shape.

    ``top_k=0`` and ``top_p=1`` are off. The most likely token is always kept. The nucleus is that of the
    temperature-scaled distribution the token is drawn from, as in transformers' ``generate`` (its
    ``TemperatureLogitsWarper`` runs before ``TopKLogitsWarper`` and ``TopPLogitsWarper``) and Dream's
    ``sample_tokens``; ``temperature=0`` (greedy) keeps the argmax whatever the filter.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        scale = temperature if temperature > 0 else 1.0
        probs = torch.softmax(sorted_logits.double() / scale, dim=-1)  # float64 as the confidences (see propose)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before it reaches top_p
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


def consistent_setting(length: int, steps: int, block_length: int) -> str:
    """The nearest ``gen.length gen.block_length gen.steps`` that :func:`_validate` accepts, keeping ``length``:
    the block is kept when it divides the length (else one block of the whole length), and the steps are the
    largest multiple of the block count not above ``min(steps, length)`` (at least one per block)."""
    block = block_length if 0 < block_length <= length and length % block_length == 0 else length
    blocks = length // block
    fitted = max(blocks, min(steps, length) // blocks * blocks)
    return f"gen.length={length} gen.block_length={block} gen.steps={fitted}"


def _validate(opts: GenerationOptions) -> int:
    """Check the LLaDA sampler's block and step settings; return the number of blocks.

    Raises: GenerationConfigError naming the key, with a consistent setting of all three keys
    (:func:`consistent_setting`), since changing one (e.g. only ``gen.length``) often breaks another.
    """
    length, steps, block_length = opts.length, opts.steps, opts.block_length
    fix = f"; e.g. {consistent_setting(length, steps, block_length)}"
    if length % block_length != 0:
        raise GenerationConfigError(f"gen.length={length} must be a multiple of gen.block_length={block_length}{fix}")
    num_blocks = length // block_length
    if steps < num_blocks:
        raise GenerationConfigError(f"gen.steps={steps} must be >= the number of blocks, {num_blocks} (gen.length="
                                    f"{length} / gen.block_length={block_length}){fix}")
    if steps % num_blocks != 0:
        raise GenerationConfigError(f"gen.steps={steps} must be a multiple of the number of blocks, {num_blocks} "
                                    f"(gen.length={length} / gen.block_length={block_length}){fix}")
    if steps > length:
        raise GenerationConfigError(f"gen.steps={steps} must be <= gen.length={length} (at least one token per step)"
                                    f"{fix}")
    return num_blocks


def check_sampler_settings(opts: GenerationOptions, objective: Optional[str]) -> None:
    """The settings check of the sampler a run of ``objective`` (its name) samples with: ``ar`` left-to-right decoding
    (:meth:`GenerationOptions.check_autoregressive`), ``bd3lm`` block diffusion
    (:meth:`GenerationOptions.check_block_diffusion`), any other objective the LLaDA sampler's block and step counts
    (:func:`_validate`). Raises: GenerationConfigError naming the key."""
    if objective == "ar":
        opts.check_autoregressive()
    elif objective == "bd3lm":
        opts.check_block_diffusion()
    else:
        _validate(opts)


def check_generation_config(gen, objective, typed: Iterable[str] = ()) -> GenerationOptions:
    """Every check of a ``gen`` config that needs no model, for a run whose objective config is ``objective``
    (anything with ``name``, and ``block_size`` for ``bd3lm``): the keys the caller typed (``typed``) that the other
    settings leave unread (:func:`difflm.sampling.options.check_read_settings`), the value ranges
    (:class:`GenerationOptions`) and the block and step counts of the run's sampler
    (:func:`check_sampler_settings`) and ``gen.seed`` (:func:`difflm.objectives.keyed_rng.check_seed`). Returns
    the options (mask id 0: not a model's).

    Raises: GenerationConfigError naming the key and the fix."""
    from difflm.errors import DifflmError
    from difflm.objectives.keyed_rng import check_seed

    if gen.get("seed") is not None:
        try:
            check_seed(gen.get("seed"), "gen.seed", generator_only=True)
        except DifflmError as err:
            raise GenerationConfigError(str(err)) from None
    name = getattr(objective, "name", None)
    check_read_settings(gen, typed, causal=name == "ar")
    opts = GenerationOptions.from_config(gen, mask_id=0, block_size=run_block_size(objective))
    check_sampler_settings(opts, name)
    return opts


def propose(logits: torch.Tensor, remasking: str, temperature: float, generator,
            top_k: int = 0, top_p: float = 1.0, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate tokens and their confidence for ``logits`` ``[B, N, V]`` (forbidden ids already ``-inf``).

    ``x0 = gumbel_argmax(filter_top_k_top_p(logits, temperature=temperature), temperature)``; with
    ``probs = softmax(logits)`` (the model's
    distribution, noise-free and *not* filtered) the confidence (higher = unmask first) is ``probs[x0]``
    (``low_confidence``), ``probs_top1 - probs_top2`` (``margin``), minus the entropy of ``probs``
    (``entropy``) or ``U[0, 1)`` (``random``). Returns ``(x0 [B, N] int64, confidence [B, N] float64)``.

    Two choices keep positions of different confidence from tying (ties go to the leftmost position):
    ``probs`` are float64, as in LLaDA's reference ``generate.py`` (``F.softmax(logits.to(torch.float64))``;
    in float32 a token whose logit leads by more than ~17 nats gets probability exactly 1.0, float64 separates
    leads up to ~36); and the top-k / top-p filters only restrict which token is proposed: the confidence of a
    filtered distribution would be exactly 1 wherever the nucleus is one token (Dream's ``sample_tokens``
    computes it after filtering; difflm does not).
    """
    x0 = gumbel_argmax(filter_top_k_top_p(logits, top_k, top_p, temperature), temperature, generator, rows)
    if remasking == "random":
        return x0, uniform(x0.shape, generator, x0.device, rows)
    probs = torch.softmax(logits.double(), dim=-1)
    if remasking == "low_confidence":
        confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    elif remasking == "margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[..., 0] - top2[..., 1]
    else:  # entropy
        confidence = -torch.special.entr(probs).sum(dim=-1)
    return x0, confidence


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


def logits_source(valid: torch.Tensor, shift_logits: bool) -> torch.Tensor:
    """Which output row of ``logits_fn`` holds each position's prediction, ``[B, S]`` int64.

    ``valid`` [B, S] bool marks real tokens (False at prompt padding). Without ``shift_logits`` position i's
    prediction is output row i. A shifting model (``model.shift_logits``, Dream, Ye et al. 2025) writes the
    state of position j - 1 into output row j, and position i must be predicted from the state of the last
    *real* position before it, p(i); that state sits in output row p(i) + 1 (= i unless padding lies between).
    Positions with no real position before them keep row i (position 0 keeps its own state, as the model does).
    """
    b, s = valid.shape
    pos = torch.arange(s, device=valid.device).expand(b, s)
    if not shift_logits:
        return pos.clone()
    last_real = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(dim=1).values  # last real index <= i
    prev_real = torch.cat([torch.full_like(pos[:, :1], -1), last_real[:, :-1]], dim=1)  # last real index < i
    return torch.where(prev_real >= 0, prev_real + 1, pos)


class _Forward:
    """Calls ``logits_fn`` for one batch: padding masks, classifier-free guidance, shifted logits and the KV cache
    in one place.

    Returns the (guided) logits of positions ``[start, end)`` only, ``[B, end - start, V]``, equal to those of
    the unpadded, uncached forward (exactly so where nothing changed since the cache was written).
    """

    def __init__(self, logits_fn, prompt_len: int, total_len: int, opts: GenerationOptions, prompt_mask, device):
        from difflm.model.masks import key_padding_mask

        self.fn, self.prompt_len, self.mask_id = logits_fn, prompt_len, opts.mask_id
        self.cfg_scale, self.cache_mode, self.forbid_ids = opts.cfg_scale, opts.cache, opts.forbid_ids
        self.shift = opts.shift_logits
        self.nfe = 0
        self.attn_mask = self.position_ids = None
        self.prompt_mask = prompt_mask
        b = prompt_mask.shape[0] if prompt_mask is not None else 1
        valid = torch.ones(b, total_len, dtype=torch.bool, device=device)
        if prompt_mask is not None:
            valid[:, :prompt_len] = prompt_mask.bool()
            self.position_ids = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            self.attn_mask = key_padding_mask(valid)
        self.src = logits_source(valid, self.shift)  # [B | 1, S]
        self.cfg_on = self.cfg_scale > 0  # rows [x; x with the prompt masked]
        if self.cfg_on and self.attn_mask is not None:
            self.attn_mask = torch.cat([self.attn_mask, self.attn_mask])
            self.position_ids = torch.cat([self.position_ids, self.position_ids])
            self.src = torch.cat([self.src, self.src])
        self.cache = None
        if opts.cache != "none":
            from difflm.model.kv_cache import KVCache

            self.cache = KVCache()

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cfg_on:
            return x
        un = x.clone()
        real = slice(0, self.prompt_len)
        if self.prompt_mask is None:
            un[:, real] = self.mask_id
        else:
            un[:, real] = torch.where(self.prompt_mask.bool(), torch.full_like(un[:, real], self.mask_id), un[:, real])
        return torch.cat([x, un])

    def _rows(self, logits: torch.Tensor, start: int, end: int, offset: int) -> torch.Tensor:
        """Output rows of positions [start, end) from ``logits`` that begin at absolute position ``offset``."""
        if not self.shift:
            return logits[:, start - offset:end - offset]
        idx = (self.src[:, start:end] - offset).expand(logits.shape[0], -1)
        return torch.take_along_dim(logits, idx[..., None], dim=1)

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
            logits = self._rows(logits, start, end, 0)
        else:
            # the span runs from the first position whose state a prediction needs (under shift_logits the
            # last real position before ``start``: a span forward computes no state outside itself)
            a = start if not self.shift else max(0, int(self.src[:, start].min()) - 1)
            b = x.shape[1] if self.cache_mode == "prefix" else end
            if self.attn_mask is not None:
                kw = {"attn_mask": self.attn_mask[:, :, a:b], "position_ids": self.position_ids[:, a:b]}
            else:
                kw = {"position_ids": torch.arange(a, b, device=x.device)}
            logits = self.fn(xin[:, a:b], kv_cache=self.cache.read(a, b), **kw)
            check_logits(logits, xin[:, a:b])
            logits = self._rows(logits, start, end, a)
        self.nfe += 1
        if self.cfg_on:
            cond, un = logits.chunk(2)
            logits = un + (self.cfg_scale + 1.0) * (cond - un)
        return apply_forbid(logits, self.forbid_ids)


def check_shift_prompt(prompt_len: int, prompt_mask: Optional[torch.Tensor], shift_logits: bool) -> None:
    """Under ``shift_logits`` a padded row needs a real prompt token: the first generated token is predicted from
    the state of the last real token before it (ValueError otherwise)."""
    if shift_logits and prompt_mask is not None and prompt_len > 0 and not bool(prompt_mask.any(dim=1).all()):
        raise ValueError("with model.shift_logits every prompt row needs at least one real token (prompt_mask "
                         "has an all-padding row): the first generated token is predicted from the one before it")


@torch.no_grad()
def diffusion_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    opts: GenerationOptions,
    *,
    generator: torch.Generator | None = None,
    prompt_mask: Optional[torch.Tensor] = None,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """Generate ``opts.length`` tokens after ``prompt`` with LLaDA's masked-diffusion sampler.

    Nie et al. 2025 (arXiv:2502.09992), Algorithms 4-5 with semi-autoregressive blocks;
    reference ``generate.py`` of ML-GSAI/LLaDA. Starting from
    ``x = [prompt, mask_id * length]``, the generated part is split into
    ``length // block_length`` blocks decoded left to right, ``steps // num_blocks`` steps
    each. At each step the block's logits (``forbid_ids`` at ``-inf``, guided when ``cfg_scale > 0``) give
    candidates and confidences (:func:`propose`); the ``k`` most confident masked positions of each row
    take their candidate, ``k`` following :func:`num_transfer_tokens` (or, with ``threshold``, every
    position above it and at least one: Fast-dLLM; a block then takes as many steps as it needs).
    ``remasking=remdm``: ``low_confidence`` unmasking, and each step also remasks ``round(sigma_t * n)`` of the
    block's ``n`` decoded tokens and unmasks as many more (ReMDM, Wang et al. 2025, arXiv:2503.00307, sec. 3's
    posterior q_sigma(z_s | z_t, x) in count form, :mod:`difflm.sampling.remdm`); ``remdm_sigma=0`` is
    ``low_confidence`` exactly.
    Ties in confidence go to the leftmost position. The prompt is never changed, even if it contains
    ``mask_id``, unless ``opts.infill``: then the prompt's ``mask_id`` positions are sampled with the first block
    (its region starts at the first masked prompt position, and its transfer schedule counts them), and the given
    prompt tokens stay.

    Args:
        logits_fn: see :data:`LogitsFn`; called with ``attn_mask``/``position_ids``/``kv_cache`` keywords only
            when ``prompt_mask`` or ``opts.cache`` is given.
        prompt: ``[B, P]`` int64 (padded rows: see ``prompt_mask``).
        opts: the settings (:class:`GenerationOptions`): ``mask_id``, ``length``, ``steps``, ``block_length``,
            ``remasking``, ``temperature``, ``top_k``/``top_p``, ``cfg_scale`` (the unconditional input has the
            real prompt tokens masked), ``threshold`` (Fast-dLLM parallel decoding), ``cache`` (``none``,
            ``prefix`` or ``dual``, Fast-dLLM; approximate for bidirectional models), ``forbid_ids`` and
            ``shift_logits``.
        generator: source of all randomness; the same seed reproduces the output. A list of B generators draws
            each row's noise from its own (:func:`uniform`): a row's output then does not depend on the rows
            sampled with it (up to floating-point rounding of the batched forward).
        prompt_mask: ``[B, P]`` bool, True at real prompt tokens, for batches of prompts of different lengths,
            left- or right-padded: pad keys are masked out of attention and RoPE positions skip them, so each
            row is generated as if alone (under ``shift_logits`` too).
        stats: if given, ``stats["nfe"]`` receives the number of model calls.
    Returns:
        ``[B, P + length]`` int64, with no ``mask_id`` in the generated part unless the
        model can only emit it (forbid it to be sure).
    Raises:
        ValueError: a bad ``gen.*`` setting (:class:`GenerationConfigError`, naming the key),
            a bad prompt or prompt mask, bad ``forbid_ids``, or logits of the wrong shape.
    """
    check_prompt(prompt)
    num_blocks = _validate(opts)
    if prompt_mask is not None and prompt_mask.shape != prompt.shape:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} must have the prompt's shape {tuple(prompt.shape)}")
    mask_id, threshold, block_length = opts.mask_id, opts.threshold, opts.block_length
    steps_per_block = opts.steps // num_blocks
    batch, prompt_len = prompt.shape
    check_shift_prompt(prompt_len, prompt_mask, opts.shift_logits)
    total = prompt_len + opts.length
    forward = _Forward(logits_fn, prompt_len, total, opts, prompt_mask, prompt.device)

    gen = torch.full((batch, opts.length), mask_id, dtype=torch.long, device=prompt.device)
    x = torch.cat([prompt, gen], dim=1)

    first_masked = prompt_len  # infilling: block 0 also covers the masked prompt positions
    if opts.infill and (prompt == mask_id).any():
        first_masked = int((prompt == mask_id).any(dim=0).nonzero()[0])
    remdm = opts.remasking == REMDM
    rule = "low_confidence" if remdm else opts.remasking
    for block in range(num_blocks):
        start = prompt_len + block * block_length
        end = start + block_length
        if block == 0:
            start = first_masked
        to_decode = x[:, start:end] == mask_id  # [B, N]: what this block's steps decode
        schedule = num_transfer_tokens(to_decode.sum(dim=1), steps_per_block)
        decoded_confidence = torch.zeros(to_decode.shape, dtype=torch.float64, device=x.device)
        step = 0
        while (x[:, start:end] == mask_id).any() if threshold is not None else step < steps_per_block:
            candidates = x[:, start:end] == mask_id  # [B, N]
            logits = forward(x, start, end, first_of_block=step == 0)
            x0, confidence = propose(logits, rule, opts.temperature, generator, opts.top_k, opts.top_p,
                                     rows=candidates.any(dim=1))
            count = schedule[:, min(step, steps_per_block - 1)]
            if remdm:  # ReMDM (count form): remask r decoded tokens, unmask k + r
                remask, count = remdm_remask(to_decode & ~candidates, decoded_confidence, candidates.sum(dim=1),
                                             count, to_decode.sum(dim=1), opts.remdm_sigma, opts.remdm_schedule)
            transfer = select_transfer(confidence, candidates, count, threshold)
            x[:, start:end] = torch.where(transfer, x0, x[:, start:end])
            if remdm:
                decoded_confidence = torch.where(transfer, confidence, decoded_confidence)
                x[:, start:end] = x[:, start:end].masked_fill(remask, mask_id)
            step += 1
    if stats is not None:
        stats["nfe"] = forward.nfe
    return x
