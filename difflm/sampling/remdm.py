"""ReMDM: remasking of already-decoded tokens during masked-diffusion sampling.

Wang et al. 2025, "Remasking Discrete Diffusion Models with Inference-Time Scaling"
(arXiv:2503.00307), sec. 3: the reverse step from time t to s < t draws z_s from the remasking posterior

    q_sigma(z_s | z_t, x) = Cat(z_s; (1 - sigma_t) x + sigma_t m)                                  if z_t != m
                            Cat(z_s; (alpha_s - (1 - sigma_t) alpha_t) / (1 - alpha_t) x
                                     + (1 - alpha_s - sigma_t alpha_t) / (1 - alpha_t) m)         if z_t == m

(m the mask, alpha the share of clean tokens), valid for 0 <= sigma_t <= sigma_t^max = min(1, (1 - alpha_s) / alpha_t);
sigma_t = 0 is the plain masked-diffusion (MDLM / LLaDA) step. The marginal keeps alpha_s: a decoded token is
remasked with probability sigma_t and each masked one is unmasked more often to make up for it. Sec. 4.1's
schedules: ``cap`` sigma_t = min(eta, sigma_t^max) (ReMDM-cap) and ``rescale`` sigma_t = eta * sigma_t^max
(ReMDM-rescale); which decoded tokens are remasked follows ReMDM-conf: the least confident first.

difflm's samplers unmask a fixed *count* per step (LLaDA's schedule, the expected count of the linear schedule;
:func:`difflm.sampling.diffusion.num_transfer_tokens`), so ReMDM is applied in the same count form: inside the
current block of ``N`` positions to decode, with ``n`` decoded before the step and ``k`` scheduled by it,
alpha_t = n / N and alpha_s = (n + k) / N; the step remasks ``r = round(sigma_t * n)`` decoded tokens (the expected
count; the ``r`` whose confidence when they were decoded is lowest, ties to the leftmost) and unmasks ``k + r``
masked ones, so ``n + k`` are decoded after it, as without remasking. ``r <= N - n - k`` because
sigma_t <= sigma_t^max; the last step of a block has alpha_s = 1, hence sigma_t = 0: every block ends decoded.
Remasked tokens are masks in the next step's input and are predicted again there.
"""
from __future__ import annotations

import torch


def remdm_sigma(alpha_t: torch.Tensor, alpha_s: torch.Tensor, eta: float, schedule: str) -> torch.Tensor:
    """ReMDM's sigma_t (sec. 4.1) for clean shares ``alpha_t`` < ``alpha_s`` (``[B]`` float64, in [0, 1]).

    sigma_t^max = min(1, (1 - alpha_s) / alpha_t) (0 where alpha_t = 0: nothing is decoded yet); ``cap``:
    min(eta, sigma_t^max); ``rescale``: eta * sigma_t^max. Returns ``[B]`` float64.
    """
    safe = torch.where(alpha_t > 0, alpha_t, torch.ones_like(alpha_t))
    sigma_max = torch.where(alpha_t > 0, ((1 - alpha_s) / safe).clamp(0.0, 1.0), torch.zeros_like(alpha_t))
    if schedule == "cap":
        return sigma_max.clamp(max=eta)
    return eta * sigma_max


def remdm_remask(decoded: torch.Tensor, decoded_confidence: torch.Tensor, masked_count: torch.Tensor,
                 count: torch.Tensor, block_count: torch.Tensor, eta: float,
                 schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's remasking in count form (module docstring).

    Args:
        decoded: ``[B, N]`` bool, positions of the block the sampler has decoded (given tokens excluded).
        decoded_confidence: ``[B, N]`` float64, each decoded token's confidence when it was decoded.
        masked_count: ``[B]`` int64, masked positions of the block before the step.
        count: ``[B]`` int64, tokens the schedule unmasks this step (k).
        block_count: ``[B]`` int64, positions of the block the sampler decodes in all (N).
        eta, schedule: ``gen.remdm_sigma`` and ``gen.remdm_schedule`` (:func:`remdm_sigma`).
    Returns:
        (remask ``[B, N]`` bool: the ``r`` least confident decoded tokens, ties to the leftmost;
        ``[B]`` int64: ``k + r``, the masked tokens to unmask this step).
    """
    n = decoded.sum(dim=1)
    total = block_count.clamp(min=1).double()
    sigma = remdm_sigma(n.double() / total, (n + count).double() / total, eta, schedule)
    r = torch.floor(sigma * n.double() + 0.5).long()
    r = torch.minimum(r, (masked_count - count).clamp(min=0))
    score = decoded_confidence.masked_fill(~decoded, float("inf"))
    order = torch.sort(score, dim=1, stable=True).indices  # least confident first, ties to the leftmost
    ranks = torch.arange(decoded.shape[1], device=decoded.device).unsqueeze(0)
    remask = torch.zeros_like(decoded).scatter(1, order, ranks < r.unsqueeze(1)) & decoded
    return remask, count + r


__all__ = ["remdm_remask", "remdm_sigma"]
