"""Left-to-right decoding for ``ar`` (causal) models.

Plain ancestral sampling of an autoregressive model, p(x) = prod_i p(x_i | x_<i)
(e.g. Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), with
greedy decoding at temperature 0 and temperature-scaled softmax sampling otherwise.
v0 has no KV cache: every step re-runs the model on the whole prefix.
"""

from __future__ import annotations

from typing import Sequence

import torch

from difflm.sampling.diffusion import (
    GenerationConfigError,
    LogitsFn,
    apply_forbid,
    check_logits,
    check_prompt,
)


@torch.no_grad()
def autoregressive_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    *,
    length: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forbid_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Generate ``length`` tokens after ``prompt``, one at a time, left to right.

    Each step calls ``logits_fn`` on the whole prefix ``[B, P + t]`` and reads the last
    position's logits (``forbid_ids`` set to ``-inf``): the argmax at temperature 0, else a
    sample from ``softmax(logits / temperature)`` drawn with ``generator``.

    Args:
        logits_fn: ``x [B, S] int64 -> logits [B, S, V] float`` (causal model).
        prompt: ``[B, P]`` int64, ``P >= 1``.
        length: tokens to generate (``gen.length``).
        temperature: >= 0 (``gen.temperature``).
        generator: source of all randomness; the same seed reproduces the output.
        forbid_ids: token ids never emitted.
    Returns:
        ``[B, P + length]`` int64; the first ``P`` columns are ``prompt``.
    Raises:
        ValueError: bad ``gen.length``/``gen.temperature`` (:class:`GenerationConfigError`),
            an empty or non-int64 prompt, bad ``forbid_ids``, or logits of the wrong shape.
    """
    check_prompt(prompt)
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token (e.g. BOS) for left-to-right decoding")
    if length < 1:
        raise GenerationConfigError(f"gen.length={length} must be >= 1")
    if not temperature >= 0:
        raise GenerationConfigError(f"gen.temperature={temperature} must be >= 0")

    x = prompt
    for _ in range(length):
        logits = logits_fn(x)
        check_logits(logits, x)
        last = apply_forbid(logits[:, -1, :], forbid_ids).float()  # [B, V]
        if temperature == 0:
            nxt = last.argmax(dim=-1)
        else:
            probs = torch.softmax(last / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        x = torch.cat([x, nxt.unsqueeze(1)], dim=1)
    return x
