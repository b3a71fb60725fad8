"""DiffuCoder's coupled complementary-mask estimate (``estimator=coupled``).

Gong et al. 2025, "DiffuCoder: Understanding and Improving Masked Diffusion Models for Code Generation"
(arXiv:2506.20639), sec. 4.2 ("Coupled-GRPO"), coupled-sampling estimate: draw t ~ U[t_min, t_max] (the paper:
[0.2, 0.8]) and one uniform u_i per completion token; the mask A = {i : u_i < t} and its complement
B = {i : u_i >= t} each give one forward pass, so every completion token is predicted exactly once, and

    log pi(o | q) ~ (1/2) [ sum_{i in A} (1/t) log f_theta(o^i | q, o_A)
                          + sum_{i in B} (1/(1-t)) log f_theta(o^i | q, o_B) ],

the mean of two one-sample ELBO estimates (LLaDA's ELBO term at t and at 1 - t) whose masks are antithetic. The
per-token term of token i is its half of the pair. Compared with one random mask, every token is scored and the
two halves' errors are negatively correlated, which lowers the variance (measured in tests/test_posttrain_loglik.py).
DiffuCoder's public trainer also averages in the fully masked pass; ``full_mask_weight`` > 0 adds it the same
way, term = (1 - w) * coupled + w * full-mask (their code: w = 1/2; the paper: w = 0).

On a ``bd3lm`` run (a logits function with blocks, :class:`difflm.posttrain.forward.BlockLogitsFn`) each forward is
BD3-LM's ``[x_t ; x_0]`` forward, so token i of block b is predicted from its noised block and the clean blocks
before it, and t is drawn once per block (t_b ~ U[t_min, t_max], as training draws one t per block): A and B are
complementary within every block, each block's two halves are the coupled pair of that block's ELBO term, and the
row sum estimates the sum of the per-block terms, BD3-LM's NELBO (Arriola et al. 2025, eq. 6/7) restricted to
t in [t_min, t_max]. The full-mask pass masks every completion block: each block predicted from the clean blocks
before it alone.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from difflm.posttrain.loglik.base import EstimateKey, LogitsFn, at_positions, check_inputs, mask_uniforms, \
    noise_units, sample_uniforms, target_logprobs


class CoupledEstimator:
    """DiffuCoder's coupled estimator (module docstring). Two forward passes (three with ``full_mask_weight``)."""

    def __init__(self, t_min: float = 0.2, t_max: float = 0.8, full_mask_weight: float = 0.0):
        if not 0.0 < t_min <= t_max < 1.0:
            raise ValueError(f"estimator.t_min={t_min}, estimator.t_max={t_max}: need 0 < t_min <= t_max < 1")
        if not 0.0 <= full_mask_weight <= 1.0:
            raise ValueError(f"estimator.full_mask_weight={full_mask_weight} must be in [0, 1]")
        self.t_min, self.t_max, self.full_mask_weight = t_min, t_max, full_mask_weight
        self.forwards = 3 if full_mask_weight > 0 else 2

    def __call__(self, logits_fn: LogitsFn, x: torch.Tensor, completion: torch.Tensor, *, mask_id: int,
                 key: EstimateKey, sample_ids: Sequence[int], prompt: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-position terms [B, S] float32 (zero off ``completion``)."""
        check_inputs(x, completion, prompt)
        b = x.shape[0]
        n, units = noise_units(logits_fn, x)  # one t per sample, or per block (bd3lm)
        t = (self.t_min + (self.t_max - self.t_min) * sample_uniforms(key, sample_ids, n)).to(x.device)  # [B, n]
        t = at_positions(t, units)  # [B, 1] or [B, S]
        u = mask_uniforms(key, 0, sample_ids, x.shape[1]).to(x.device)
        in_a = completion & (u < t)
        in_b = completion & ~in_a
        masks = [in_a, in_b] + ([completion] if self.full_mask_weight > 0 else [])
        noisy = torch.cat([torch.where(m, torch.full_like(x, mask_id), x) for m in masks])
        logp = target_logprobs(logits_fn, noisy, x.repeat(len(masks), 1)).split(b)
        tf = t.float()
        coupled = 0.5 * torch.where(in_a, logp[0] / tf, torch.where(in_b, logp[1] / (1.0 - tf), torch.zeros(())))
        if self.full_mask_weight > 0:
            w = self.full_mask_weight
            coupled = (1.0 - w) * coupled + w * torch.where(completion, logp[2], torch.zeros(()))
        return coupled
