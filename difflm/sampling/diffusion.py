"""Masked-diffusion sampling: the LLaDA sampler with semi-autoregressive blocks.

Source: Nie et al. 2025, "Large Language Diffusion Models" (arXiv:2502.09992),
Algorithm 4 (reverse process, random remasking) and Algorithm 5 (low-confidence
remasking) with semi-autoregressive blocks, as implemented in the reference
``generate.py`` of https://github.com/ML-GSAI/LLaDA (classifier-free guidance left out).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from difflm.errors import DifflmError

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""x ``[B, S]`` int64 -> logits ``[B, S, V]`` float."""

REMASKING = ("low_confidence", "random")


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
    if remasking not in REMASKING:
        raise GenerationConfigError(f"gen.remasking={remasking!r} must be one of {REMASKING}")
    if not temperature >= 0:
        raise GenerationConfigError(f"gen.temperature={temperature} must be >= 0")
    return num_blocks


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
) -> torch.Tensor:
    """Generate ``length`` tokens after ``prompt`` with LLaDA's masked-diffusion sampler.

    Nie et al. 2025 (arXiv:2502.09992), Algorithms 4-5 with semi-autoregressive blocks;
    reference ``generate.py`` of ML-GSAI/LLaDA. Starting from
    ``x = [prompt, mask_id * length]``, the generated part is split into
    ``length // block_length`` blocks decoded left to right, ``steps // num_blocks`` steps
    each. At each step: ``logits = logits_fn(x)``; ``forbid_ids`` get ``-inf``;
    ``x0 = gumbel_argmax(logits, temperature)``; confidence is ``softmax(logits)[x0]``
    (noise-free logits) for ``low_confidence`` or ``U[0, 1)`` for ``random``, and ``-inf``
    at positions outside the current block or not masked; the ``k`` most confident
    positions of each row take their ``x0``, ``k`` following :func:`num_transfer_tokens`.
    Ties in confidence go to the leftmost position. The prompt is never changed, even if
    it contains ``mask_id``.

    Args:
        logits_fn: ``x [B, S] int64 -> logits [B, S, V] float``, ``S = P + length``.
        prompt: ``[B, P]`` int64.
        mask_id: the mask token id.
        length: tokens to generate (``gen.length``).
        steps: total denoising steps (``gen.steps``); one ``logits_fn`` call each.
        block_length: semi-autoregressive block size (``gen.block_length``).
        remasking: ``"low_confidence"`` or ``"random"`` (``gen.remasking``).
        temperature: Gumbel-noise temperature, 0 = greedy (``gen.temperature``).
        generator: source of all randomness; the same seed reproduces the output.
        forbid_ids: token ids never emitted (e.g. ``mask_id``, padded-vocab rows).
    Returns:
        ``[B, P + length]`` int64, with no ``mask_id`` in the generated part unless the
        model can only emit it (forbid it to be sure).
    Raises:
        ValueError: a bad ``gen.*`` setting (:class:`GenerationConfigError`, naming the key),
            a bad prompt, bad ``forbid_ids``, or logits of the wrong shape.
    """
    check_prompt(prompt)
    num_blocks = _validate(length, steps, block_length, remasking, temperature)
    steps_per_block = steps // num_blocks
    batch, prompt_len = prompt.shape

    gen = torch.full((batch, length), mask_id, dtype=torch.long, device=prompt.device)
    x = torch.cat([prompt, gen], dim=1)
    positions = torch.arange(x.shape[1], device=x.device)

    for block in range(num_blocks):
        start = prompt_len + block * block_length
        end = start + block_length
        in_block = (positions >= start) & (positions < end)  # [S]
        schedule = num_transfer_tokens((x[:, start:end] == mask_id).sum(dim=1), steps_per_block)
        for step in range(steps_per_block):
            candidates = (x == mask_id) & in_block  # [B, S]
            logits = logits_fn(x)
            check_logits(logits, x)
            logits = apply_forbid(logits, forbid_ids)
            x0 = gumbel_argmax(logits, temperature, generator)  # [B, S]
            if remasking == "low_confidence":
                probs = torch.softmax(logits.float(), dim=-1)
                confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1).double()
            else:
                confidence = torch.rand(
                    x.shape, generator=generator, dtype=torch.float64, device=x.device
                )
            confidence = confidence.masked_fill(~candidates, float("-inf"))
            # Top-k per row with per-row k: rank positions by confidence (stable => ties to
            # the left) and keep the first k ranks.
            order = torch.sort(confidence, dim=1, descending=True, stable=True).indices
            keep = positions.unsqueeze(0) < schedule[:, step : step + 1]  # [B, S] by rank
            transfer = torch.zeros_like(candidates).scatter(1, order, keep) & candidates
            x = torch.where(transfer, x0, x)
    return x
