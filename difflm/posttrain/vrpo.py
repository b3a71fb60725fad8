"""VRPO's scores of one preference batch: the policy's and the reference's ELBOs of the chosen and rejected
completions under shared noise (LLaDA 1.5, Zhu et al. 2025, arXiv:2505.19223, sec. 3.2 and Alg. 1).

Chosen and rejected rows are stacked into one batch of 2B rows (sample ids ``2 i`` and ``2 i + 1`` of pair i), so
one estimate of each model covers both; the policy and the reference take the same key, hence the same t and masks
(VRPO's antithetic sampling between the two models).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from difflm.posttrain.loglik.base import EstimateKey, LogitsFn


def preference_scores(estimator, policy_fn: LogitsFn, reference_fn: LogitsFn, chosen: torch.Tensor,
                      rejected: torch.Tensor, chosen_completion: torch.Tensor, rejected_completion: torch.Tensor, *,
                      mask_id: int, key: EstimateKey, pair_ids: Sequence[int],
                      prompt: Optional[torch.Tensor] = None) -> dict:
    """ELBO estimates [B] float32 of both completions under both models.

    Args: ``chosen`` / ``rejected`` [B, S] int64 (prompt then completion), their completion masks [B, S] bool,
    ``pair_ids`` the B pairs' ids (keys of their noise), ``key`` the step's estimate key, ``prompt`` [B, S] bool the
    real prompt tokens of a pair's rows (the ones ``estimator=one_step`` masks at random; None: every position off the
    completion, the EOS padding after a response included).
    Returns: dict with ``policy_chosen``, ``policy_rejected`` (differentiable), ``ref_chosen``, ``ref_rejected``.
    """
    x = torch.cat([chosen, rejected])
    completion = torch.cat([chosen_completion, rejected_completion])
    ids = [2 * int(i) for i in pair_ids] + [2 * int(i) + 1 for i in pair_ids]
    kw = dict(mask_id=mask_id, key=key, sample_ids=ids, prompt=None if prompt is None else torch.cat([prompt, prompt]))
    b = chosen.shape[0]
    policy = estimator(policy_fn, x, completion, **kw).sum(dim=1)
    with torch.no_grad():
        ref = estimator(reference_fn, x, completion, **kw).sum(dim=1)
    return {"policy_chosen": policy[:b], "policy_rejected": policy[b:], "ref_chosen": ref[:b], "ref_rejected": ref[b:]}


__all__ = ["preference_scores"]
