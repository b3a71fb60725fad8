"""d1's one-step log-likelihood estimate with random prompt masking (``estimator=one_step``).

Zhao et al. 2025, "d1: Scaling Reasoning in Diffusion Large Language Models via Reinforcement Learning"
(arXiv:2504.12216), sec. 3.2 ("Efficient log probability estimation"): the completion o is masked entirely, each
prompt token is masked independently with probability p_mask (0.15 in the paper), and one forward pass gives the
mean-field per-token estimate

    log pi(o^k | q) ~ log f_theta(o^k | q', o_masked),      log pi(o | q) ~ sum_k log f_theta(o^k | q', o_masked),

with q' the randomly masked prompt. The prompt mask is redrawn for every inner update (a new key) and shared by the
policy, its rollout-time copy and the reference within one (the same key), as diffu-GRPO does. The completion
never gets context from itself, so this is a biased, cheap (one forward) surrogate of the sequence log-likelihood.

On a ``bd3lm`` run (a logits function that reads the clean rows, :class:`difflm.posttrain.forward.BlockLogitsFn`)
the forward is BD3-LM's ``[x_t ; x_0]`` forward: every completion block is fully masked in x_t (t_b = 1) and sees
the clean blocks before it in x_0, so the estimate is sum_b sum_{k in b} log p_theta(o^k | block b masked, x^{<b}):
mean-field within a block, exact across blocks (the autoregressive log-likelihood at ``block_size = 1``). The prompt
mask applies to x_t only, as training never masks x_0: it reaches the prompt tokens that share a block with the
completion, not the clean prompt blocks before it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from difflm.posttrain.loglik.base import EstimateKey, LogitsFn, check_inputs, mask_uniforms, target_logprobs


class OneStepEstimator:
    """d1's estimator (module docstring). Args: ``prompt_mask_prob`` in [0, 1): each real prompt token's masking
    probability (d1: 0.15). One forward pass per estimate (:attr:`forwards`)."""

    forwards = 1

    def __init__(self, prompt_mask_prob: float = 0.15):
        if not 0.0 <= prompt_mask_prob < 1.0:
            raise ValueError(f"estimator.prompt_mask_prob={prompt_mask_prob} must be in [0, 1)")
        self.prompt_mask_prob = prompt_mask_prob

    def __call__(self, logits_fn: LogitsFn, x: torch.Tensor, completion: torch.Tensor, *, mask_id: int,
                 key: EstimateKey, sample_ids: Sequence[int], prompt: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-position terms [B, S] float32 (zero off ``completion``); see :class:`~difflm.posttrain.loglik.base`
        for the arguments."""
        prompt = check_inputs(x, completion, prompt)
        u = mask_uniforms(key, 0, sample_ids, x.shape[1]).to(x.device)
        masked = completion | (prompt & (u < self.prompt_mask_prob))
        noisy = torch.where(masked, torch.full_like(x, mask_id), x)
        return torch.where(completion, target_logprobs(logits_fn, noisy, x), torch.zeros(()))
