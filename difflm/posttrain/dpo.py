"""DPO on ELBO estimates with VRPO's variance reduction (``algorithm=dpo``).

DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7) with the intractable log-likelihoods of a
diffusion LM replaced by ELBO estimates (LLaDA 1.5, Zhu et al. 2025, arXiv:2505.19223, eq. 5):

    s(y) = B_theta(y | x) - B_ref(y | x)
    loss = -log sigmoid( beta [ s(y_w) - s(y_l) ] ),

with B the Monte-Carlo ELBO of :class:`difflm.posttrain.loglik.MCELBOEstimator`. VRPO (sec. 3.2, Thm. 3 and
Alg. 1) lowers the variance of the score without bias by (1) spending the budget of n forwards on n timesteps
with one mask each (``estimator.num_t``), (2) antithetic sampling: the policy and the reference are evaluated on the
same t and masks (the same estimate key), so their noise cancels in s(y); chosen and rejected get their own draws.
The reference's ELBOs are computed once without gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, dict]:
    """DPO loss on sequence scores (module docstring).

    Args: four [B] float tensors, the policy's and reference's ELBO estimates of the chosen and rejected completions
    (the reference ones are detached here); ``beta`` > 0 the DPO temperature.
    Returns: (scalar float32 mean loss, metrics: ``margin`` = mean beta [s(y_w) - s(y_l)], ``accuracy`` = the share
    of pairs with a positive margin, ``elbo_margin`` = mean B_theta(y_w) - B_theta(y_l)).
    Raises: ValueError for beta <= 0 or mismatched shapes.
    """
    if not beta > 0:
        raise ValueError(f"algorithm.beta={beta} must be > 0")
    if not (policy_chosen.shape == policy_rejected.shape == ref_chosen.shape == ref_rejected.shape) \
            or policy_chosen.dim() != 1:
        raise ValueError("dpo_loss takes four [B] tensors of one shape")
    logits = beta * ((policy_chosen.float() - ref_chosen.detach().float())
                     - (policy_rejected.float() - ref_rejected.detach().float()))
    loss = -F.logsigmoid(logits).mean()
    with torch.no_grad():
        metrics = {"margin": float(logits.mean()), "accuracy": float((logits > 0).float().mean()),
                   "elbo_margin": float((policy_chosen - policy_rejected).float().mean())}
    return loss, metrics


__all__ = ["dpo_loss"]
