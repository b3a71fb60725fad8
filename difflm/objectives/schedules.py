"""Noise schedules of masked diffusion and their continuous-time NELBO weights (``objective.schedule``).

A token is kept with probability alpha_t and masked with probability 1 - alpha_t. The continuous-time NELBO
of MDLM (Sahoo et al. 2024, eq. 10) weighs the cross-entropy of every masked token by

    w(t) = -alpha'_t / (1 - alpha_t),

and in continuous time the NELBO does not depend on the schedule (MDLM sec. 3.2); it is an upper bound on
the model's NLL. Time is floored, t' = (1 - eps) t + eps, to keep w bounded (MDLM's ``sampling_eps``), so the
estimate is E_t'[...] over [eps, 1) and E_t[w (1 - alpha)] = (alpha(eps) - alpha(1)) / (1 - eps): 1 for
``linear``, 1 - eps for ``loglinear``, cos(pi eps / 2) / (1 - eps) ~ 1 + eps for ``cosine``. A uniform model
therefore scores exactly log V under ``linear`` only (0.1 % below / above under ``loglinear`` / ``cosine`` at
eps = 1e-3).

Bound. ``linear`` stays within O(eps) of the continuous-time NELBO and ``cosine`` lies ~eps above it: both
upper-bound the NLL (enumerated exactly on tiny models, tests/test_schedules.py). ``loglinear`` follows
MDLM's published convention: alpha(1) = eps, so no sequence is ever fully masked and the most-masked end of the
integral is left out; it lies ~eps below the continuous-time NELBO and can fall below the exact NLL (a uniform
model: (1 - eps) log V < log V). Its figures compare with MDLM's, but they are not a bound.

=============  =========================  ===================  ==============================
schedule       alpha(t)                   mask prob 1 - alpha  weight -alpha'/(1 - alpha)
=============  =========================  ===================  ==============================
``linear``     1 - t                      t                    1 / t           (LLaDA eq. 3)
``loglinear``  1 - (1 - eps) t            (1 - eps) t          1 / t           (MDLM / SEDD)
``cosine``     cos(pi t / 2)              1 - cos(pi t / 2)    (pi/2) sin / (1 - cos)
=============  =========================  ===================  ==============================

``loglinear`` is MDLM's ``LogLinearNoise``: sigma(t) = -log(1 - (1 - eps) t), alpha = exp(-sigma), weight
sigma'(t) / expm1(sigma(t)) = 1 / t; ``cosine`` is Shi et al. 2024 (MD4, Table 1) / Austin et al. 2021.
``linear`` with the floor is the repo's original p = (1 - eps) t + eps with weight 1 / p.
"""
from __future__ import annotations

import math

import torch

from difflm.errors import DifflmError

SCHEDULES = ("linear", "cosine", "loglinear")


def floor_time(t: torch.Tensor, eps: float) -> torch.Tensor:
    """t' = (1 - eps) t + eps, [..] float32."""
    return (1.0 - eps) * t + eps


def alpha(t: torch.Tensor, schedule: str, eps: float) -> torch.Tensor:
    """alpha(t) (probability a token is still clean) for a floored time t."""
    if schedule == "linear":
        return 1.0 - t
    if schedule == "loglinear":
        return 1.0 - (1.0 - eps) * t
    if schedule == "cosine":
        return torch.cos(0.5 * math.pi * t)
    raise DifflmError(f"objective.schedule={schedule!r} is not one of: {', '.join(SCHEDULES)}")


def mask_prob_and_weight(t: torch.Tensor, schedule: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(masking probability 1 - alpha(t'), NELBO weight -alpha'(t') / (1 - alpha(t'))) at t' = floor_time(t).

    Args: t [...] float in [0, 1). Returns two float32 tensors shaped like t.
    Raises: DifflmError for an unknown ``objective.schedule``.
    """
    if schedule == "linear":  # float32 as the original mdlm code: p = (1 - eps) t + eps, weight 1 / p
        p = floor_time(t.float(), eps)
        return p, 1.0 / p
    tf = floor_time(t.double(), eps)
    if schedule == "loglinear":
        p, w = (1.0 - eps) * tf, 1.0 / tf
    elif schedule == "cosine":
        half = 0.5 * math.pi * tf
        p = 1.0 - torch.cos(half)
        w = 0.5 * math.pi * torch.sin(half) / p
    else:
        raise DifflmError(f"objective.schedule={schedule!r} is not one of: {', '.join(SCHEDULES)}")
    return p.float(), w.float()
