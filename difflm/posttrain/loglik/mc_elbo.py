"""Monte-Carlo ELBO of the completion with antithetic t (``estimator=mc_elbo``; VRPO's estimator).

The conditional ELBO of a masked-diffusion model (LLaDA, Nie et al. 2025, eq. 5 with the sign of a log-likelihood;
LLaDA 1.5, Zhu et al. 2025, "LLaDA 1.5: Variance-Reduced Preference Optimization for Large Language Diffusion
Models", arXiv:2505.19223, eq. 3-4):

    B_pi(y | x) = E_{t ~ U[0,1]} E_{y_t ~ q(y_t | t, y)} [ (1/t) sum_{i : y_t^i = M} log p_theta(y^i | y_t, x) ]
               <= log pi(y | x).

Estimate with n timesteps and one mask each (VRPO's allocation, sec. 3.2 / Thm. 3: for a fixed budget of n
forwards, n timesteps with one mask each is the lowest-variance split), and antithetic, stratified t per sample:
t_k = (u + k / n) mod 1 for k < n with one u per sample (the low-discrepancy sampler of MDLM, Sahoo et al. 2024,
sec. 3.5). Time is floored as in training, t' = (1 - eps) t + eps with weight 1/t' (:mod:`difflm.objectives.schedules`,
``linear``), so the estimator's mean is the ELBO integrated over [eps, 1) (tests/test_posttrain_loglik.py checks it
against enumeration of every mask). Per-token term: (1/n) sum_k (1/t'_k) 1[i masked in draw k] log p_theta.

On a ``bd3lm`` run (a logits function with blocks, :class:`difflm.posttrain.forward.BlockLogitsFn`) each forward is
BD3-LM's ``[x_t ; x_0]`` forward and t is drawn per block (antithetic within each block: t_{b,k} = (u_b + k / n) mod 1,
one u_b per block and sample), as training draws one t per block: token i of block b is masked in draw k with
probability t'_{b,k}, predicted from its noised block and the clean blocks before it, and weighted 1/t'_{b,k}. The row
sum estimates BD3-LM's block ELBO, sum_b E_{t_b} E[(1/t_b) sum_{masked i in b} log p_theta(x^i | x_t^b, x^{<b})]
(Arriola et al. 2025, eq. 6/7; the completion's blocks only, the prompt clean).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from difflm.objectives.schedules import floor_time
from difflm.posttrain.loglik.base import EstimateKey, LogitsFn, at_positions, check_inputs, mask_uniforms, \
    noise_units, sample_uniforms, target_logprobs


class MCELBOEstimator:
    """Antithetic Monte-Carlo ELBO (module docstring). Args: ``num_t`` timesteps (one mask and one forward each),
    ``eps`` the time floor (the ``objective.eps`` of training), ``antithetic`` (False: iid t)."""

    def __init__(self, num_t: int = 2, eps: float = 1e-3, antithetic: bool = True):
        if num_t < 1:
            raise ValueError(f"estimator.num_t={num_t} must be >= 1")
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"estimator.eps={eps} must be in [0, 1)")
        self.num_t, self.eps, self.antithetic = num_t, eps, antithetic
        self.forwards = num_t

    def times(self, key: EstimateKey, sample_ids: Sequence[int], units: int = 1) -> torch.Tensor:
        """The floored t'_k of each sample's ``units`` noise units (its blocks on a bd3lm run), [B, units, num_t]
        float32."""
        if self.antithetic:
            u = sample_uniforms(key, sample_ids, units)[:, :, None]  # [B, units, 1]
            t = (u + torch.arange(self.num_t, dtype=torch.float64) / self.num_t) % 1.0
        else:
            t = sample_uniforms(key, sample_ids, n=units * self.num_t).view(-1, units, self.num_t)
        return floor_time(t, self.eps).float()

    def __call__(self, logits_fn: LogitsFn, x: torch.Tensor, completion: torch.Tensor, *, mask_id: int,
                 key: EstimateKey, sample_ids: Sequence[int], prompt: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-position terms [B, S] float32 (zero off ``completion``); the row sums estimate B_pi(y | x)."""
        check_inputs(x, completion, prompt)
        b, s = x.shape
        n, units = noise_units(logits_fn, x)  # one t per sample, or per block (bd3lm)
        t = self.times(key, sample_ids, n).to(x.device)  # [B, n, num_t]
        t = [at_positions(t[:, :, k], units) for k in range(self.num_t)]  # each [B, 1] or [B, S]
        masks = [completion & (mask_uniforms(key, k, sample_ids, s).to(x.device) < t[k]) for k in range(self.num_t)]
        noisy = torch.cat([torch.where(m, torch.full_like(x, mask_id), x) for m in masks])
        logp = target_logprobs(logits_fn, noisy, x.repeat(self.num_t, 1)).split(b)
        terms = sum(torch.where(m, lp / t[k], torch.zeros(())) for k, (m, lp) in enumerate(zip(masks, logp)))
        return terms / self.num_t
