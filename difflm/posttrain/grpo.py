"""GRPO for masked-diffusion LMs: group-normalised advantages and the clipped surrogate with a k3 KL penalty.

Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), eq. 3 (the objective) and sec. 4.1.2 (outcome supervision:
A_i = (r_i - mean(r)) / std(r) over the G completions of one prompt), with the per-token log-likelihood of a
diffusion LM replaced by an estimator's per-token terms (:mod:`difflm.posttrain.loglik`; d1, Zhao et al. 2025,
eq. 4; DiffuCoder, Gong et al. 2025, eq. 5). Per completion token k of sample i:

    rho = exp(l_theta - l_old),      l = the estimator's term of the token (same noise key for all three models)
    J   = min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i)
    KL  = exp(l_ref - l_theta) - (l_ref - l_theta) - 1          (k3; Schulman 2020, "Approximating KL divergence")
    loss_token = -J + beta KL

averaged over every completion token of the batch (``loss_norm=token``: d1's and DiffuCoder's trainers) or over each
completion and then the batch (``loss_norm=sequence``: GRPO's eq. 3, 1/G sum_i 1/|o_i| sum_k). ``l_old`` is the
detached estimate of the policy that drew the rollouts, kept across the ``num_inner`` updates of one rollout batch
(with one inner update rho = 1 and the gradient is the plain policy gradient).
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group of ``group_size`` consecutive rewards.

    Args: rewards [B] float (B a multiple of ``group_size``); ``scale=False`` leaves out the division (Dr. GRPO,
    Liu et al. 2025, sec. 3.2: no std normalisation). std is the unbiased sample std, as TRL's GRPOTrainer.
    Returns: [B] float32. Raises: ValueError when B is not a multiple of ``group_size``.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r)
        centred = centred / (std + eps)
    return centred.flatten().float()


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              completion: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2, beta: float = 0.04,
              loss_norm: str = "token") -> tuple[torch.Tensor, dict]:
    """The GRPO loss of one batch (module docstring).

    Args:
        logp: [B, S] float, the policy's per-token estimator terms (differentiable).
        old_logp: [B, S] float, the rollout policy's terms under the same noise (detached here).
        ref_logp: [B, S] float, the frozen reference's terms under the same noise, or None when ``beta == 0``.
        advantages: [B] float (:func:`group_advantages`).
        completion: [B, S] bool, the completion tokens that carry loss (padding after EOS excluded by the caller).
        clip_low, clip_high: eps_low / eps_high of the clipped ratio (DAPO's asymmetric clip; 0.2 / 0.2 is PPO's).
        beta: the KL weight (0: no reference is read).
        loss_norm: ``token`` or ``sequence`` (module docstring).
    Returns: (scalar float32 loss, metrics: ``kl``, ``clip_fraction``, ``ratio_mean`` as floats; KL 0 when beta=0).
    Raises: ValueError for a bad ``loss_norm``, a missing reference with beta > 0, or mismatched shapes.
    """
    if loss_norm not in ("token", "sequence"):
        raise ValueError(f"algorithm.loss_norm={loss_norm!r} must be token or sequence")
    if logp.shape != completion.shape or old_logp.shape != logp.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(f"shapes: logp {tuple(logp.shape)}, old {tuple(old_logp.shape)}, completion "
                         f"{tuple(completion.shape)}, advantages {tuple(advantages.shape)}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs the reference's log-likelihood terms")
    m = completion.float()
    ratio = torch.exp(logp.float() - old_logp.detach().float())
    a = advantages.float()[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * a)
    per_token = -surrogate
    kl = None
    if beta > 0:
        diff = ref_logp.detach().float() - logp.float()
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + beta * kl
    if loss_norm == "token":
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    else:
        loss = ((per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()
    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        clipped = ((ratio < 1.0 - clip_low) & (a < 0)) | ((ratio > 1.0 + clip_high) & (a > 0))
        metrics = {"clip_fraction": float((clipped.float() * m).sum() / n),
                   "ratio_mean": float((ratio * m).sum() / n),
                   "kl": float((kl * m).sum() / n) if kl is not None else 0.0}
    return loss, metrics


__all__ = ["group_advantages", "grpo_loss"]
