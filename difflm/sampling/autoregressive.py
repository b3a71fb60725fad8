"""Left-to-right decoding for ``ar`` (causal) models.

Plain ancestral sampling of an autoregressive model, p(x) = prod_i p(x_i | x_<i)
(e.g. Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), with
greedy decoding at temperature 0 and temperature-scaled softmax sampling otherwise.
No KV cache: every step re-runs the model on the whole prefix.
"""

from __future__ import annotations

from typing import Optional

import torch

from difflm.sampling.diffusion import LogitsFn, apply_forbid, check_logits, check_prompt, filter_top_k_top_p
from difflm.sampling.options import GenerationConfigError, GenerationOptions


@torch.no_grad()
def autoregressive_generate(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    opts: GenerationOptions,
    *,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prompt_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Generate ``opts.length`` tokens after ``prompt``, one at a time, left to right.

    Each step calls ``logits_fn`` on the whole prefix ``[B, P + t]`` and reads the last
    position's logits (``forbid_ids`` set to ``-inf``): the argmax at temperature 0, else a
    sample from ``softmax(logits / temperature)`` (float64, as the diffusion samplers' Gumbel noise) drawn with
    ``generator``.

    Args:
        logits_fn: ``x [B, S] int64 -> logits [B, S, V] float`` (causal model).
        prompt: ``[B, P]`` int64, ``P >= 1``.
        opts: the settings (:class:`GenerationOptions`); reads ``length``, ``temperature``, ``top_k``/``top_p``
            (filters before sampling, 0 / 1 = off) and ``forbid_ids``.
        generator: source of all randomness; the same seed reproduces the output. A list of one generator per row:
            each row samples from its own, as it would alone (``torch.multinomial`` of its [1, V] probabilities).
        prompt_mask: [B, P] bool, True at real tokens of left- or right-padded prompts; pads are masked out of
            attention and skipped by the RoPE positions (``logits_fn`` then gets ``attn_mask``/``position_ids``).
    Returns:
        ``[B, P + length]`` int64; the first ``P`` columns are ``prompt``.
    Raises:
        GenerationConfigError: ``opts.infill`` (left-to-right decoding cannot fill positions inside the prompt).
        ValueError: an empty or non-int64 prompt, bad ``forbid_ids``, or logits of the wrong shape.
    """
    check_prompt(prompt)
    if opts.infill:
        raise GenerationConfigError("infilling (mask tokens inside the prompt) needs a diffusion sampler: an "
                                    "objective=ar run decodes left to right; drop the mask placeholders")
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token (e.g. BOS) for left-to-right decoding")
    temperature, forbid_ids = opts.temperature, opts.forbid_ids

    x = prompt
    valid = None if prompt_mask is None else prompt_mask.bool()
    for _ in range(opts.length):
        if valid is None:
            logits = logits_fn(x)
        else:
            from difflm.model.masks import key_padding_mask

            logits = logits_fn(x, attn_mask=key_padding_mask(valid, causal=True),
                               position_ids=(valid.long().cumsum(dim=1) - 1).clamp(min=0))
            check_logits(logits, x)
            # the prediction comes from each row's last real token (right padding: before the pads)
            last_real = x.shape[1] - 1 - valid.flip(1).long().argmax(dim=1)
            logits = logits[torch.arange(x.shape[0], device=x.device), last_real][:, None]
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if valid is None:
            check_logits(logits, x)
        last = apply_forbid(logits[:, -1, :], forbid_ids).float()  # [B, V]
        last = filter_top_k_top_p(last, opts.top_k, opts.top_p, temperature)  # the nucleus of softmax(last / T)
        if temperature == 0:
            nxt = last.argmax(dim=-1)
        else:
            probs = torch.softmax(last.double() / temperature, dim=-1)  # float64: a float32 T above 3.4e38 is inf
            if generator is None or isinstance(generator, torch.Generator):
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            else:
                if len(generator) != probs.shape[0]:
                    raise ValueError(f"{len(generator)} per-row generators for {probs.shape[0]} rows")
                nxt = torch.cat([torch.multinomial(probs[b:b + 1], 1, generator=g)
                                 for b, g in enumerate(generator)]).flatten()
        x = torch.cat([x, nxt.unsqueeze(1)], dim=1)
    return x
