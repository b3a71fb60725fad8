"""Noise schedules: masking probability, the MDLM weight -alpha'/(1 - alpha) and its normalisation."""
from __future__ import annotations

import math

import pytest
import torch

from difflm.errors import DifflmError
from difflm.objectives import MDLMObjective
from difflm.objectives.schedules import SCHEDULES, alpha, floor_time, mask_prob_and_weight
from tests.dlm_helpers import objective_cfg

EPS = 1e-3


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_weight_is_minus_alpha_prime_over_one_minus_alpha(schedule):
    t = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    p, w = mask_prob_and_weight(t, schedule, EPS)
    tf = floor_time(t, EPS)
    h = 1e-6
    dalpha = (alpha(tf + h, schedule, EPS) - alpha(tf - h, schedule, EPS)) / (2 * h)
    assert torch.allclose(p.double(), 1 - alpha(tf, schedule, EPS), atol=1e-6)
    assert torch.allclose(w.double(), -dalpha / (1 - alpha(tf, schedule, EPS)), rtol=1e-4)


@pytest.mark.parametrize("schedule,expected", [
    ("linear", 1.0),                                       # (alpha(eps) - alpha(1)) / (1 - eps) = 1
    ("loglinear", 1.0 - EPS),                              # alpha(1) = eps: the last eps of mass is never masked
    ("cosine", math.cos(math.pi * EPS / 2) / (1 - EPS)),  # ~ 1
])
def test_weight_times_mask_prob_integrates_to_alpha_drop(schedule, expected):
    # E_t[w(t) (1 - alpha_t)] = int_0^1 -alpha'(t') dt: a uniform model's NELBO is this constant times log V
    n = 200_000
    t = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # midpoint rule
    p, w = mask_prob_and_weight(t, schedule, EPS)
    assert float((p.double() * w.double()).mean()) == pytest.approx(expected, rel=2e-4)


@pytest.mark.parametrize("schedule", ["cosine", "loglinear"])
def test_objective_uses_schedule(schedule):
    obj = MDLMObjective(objective_cfg(schedule=schedule, t_sampling="stratified"), 99)
    tokens = torch.randint(0, 50, (64, 256))
    batch = obj.noise(tokens, list(range(64)), (0, 0, 0), 64)
    p, w = mask_prob_and_weight(batch.t, schedule, EPS)
    rate = batch.loss_mask.float().mean(dim=1)
    assert torch.allclose(rate, p, atol=0.12)  # Bernoulli(p) over 256 tokens
    assert float((rate - p).abs().mean()) < 0.03
    rows = batch.loss_mask.any(dim=1)
    got = batch.weights.max(dim=1).values[rows]
    assert torch.allclose(got, w[rows])


def test_linear_is_the_original_objective():
    t = torch.rand(100)
    p, w = mask_prob_and_weight(t, "linear", EPS)
    assert torch.equal(p, (1 - EPS) * t + EPS) and torch.equal(w, 1 / p)


def test_unknown_schedule_names_key():
    with pytest.raises(DifflmError, match="objective.schedule='exp'"):
        mask_prob_and_weight(torch.rand(3), "exp", EPS)


def _exact_figures(logits_fn, x0, mask_id, vocab):
    """Per-token figures of one sequence, enumerated exactly over all 2^L masks (nats/token):
    the exact NLL of the model's generative process (tokens unmasked one at a time in a uniformly random order,
    p(x) = mean over orders of prod p(x_i | revealed); Ou et al. 2024), the continuous-time NELBO (MDLM eq. 10,
    schedule-invariant: mean over orders of -sum log p) and, per schedule, the expectation of difflm's NELBO
    estimate E_t[w(t') sum_{masked i} -log p(x_i | x_t)] / L (time floored at eps, midpoint quadrature in t)."""
    from itertools import combinations, permutations

    L = len(x0)
    masks = [m for k in range(1, L + 1) for m in combinations(range(L), k)]
    x = torch.tensor([x0] * len(masks))
    for r, m in enumerate(masks):
        x[r, list(m)] = mask_id
    with torch.no_grad():
        logp = torch.log_softmax(logits_fn(x).double(), dim=-1)
    lp = {m: {i: float(logp[r, i, x0[i]]) for i in m} for r, m in enumerate(masks)}
    ce = [0.0] * (L + 1)  # ce[k]: sum over masks of k tokens of their cross-entropy
    for m in masks:
        ce[len(m)] -= sum(lp[m].values())
    orders = list(permutations(range(L)))
    per_order = [sum(lp[tuple(sorted(o[j:]))][o[j]] for j in range(L)) for o in orders]
    nll = -(torch.tensor(per_order, dtype=torch.float64).logsumexp(0).item() - math.log(len(orders))) / L
    nelbo = -sum(per_order) / len(orders) / L
    n = 400_000
    t = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    est = {}
    for schedule in SCHEDULES:
        p, w = (v.double() for v in mask_prob_and_weight(t, schedule, EPS))
        est[schedule] = sum(ce[k] * float((w * p ** k * (1 - p) ** (L - k)).mean()) for k in range(1, L + 1)) / L
    return nll, nelbo, est


def test_uniform_model_scores_log_v_only_under_linear():
    v = 48
    nll, nelbo, est = _exact_figures(lambda x: torch.zeros(*x.shape, v), [5, 6, 7, 8], 47, v)
    assert nll == pytest.approx(math.log(v), rel=1e-12) and nelbo == pytest.approx(math.log(v), rel=1e-12)
    assert est["linear"] == pytest.approx(math.log(v), rel=1e-6)
    assert est["cosine"] == pytest.approx(math.cos(math.pi * EPS / 2) / (1 - EPS) * math.log(v), rel=1e-6)
    assert est["loglinear"] == pytest.approx((1 - EPS) * math.log(v), rel=1e-6)  # below the exact NLL
    assert est["loglinear"] < nll


@pytest.mark.parametrize("seed", [0, 1])
def test_nelbo_estimate_bounds_the_exact_nll_for_linear_and_cosine(seed):
    """Enumerated exactly on a tiny model: linear and cosine estimates lie above the exact NLL (linear within
    O(eps) of the continuous-time NELBO, cosine a factor ~1/(1 - eps) above it); loglinear, MDLM's convention
    (alpha(1) = eps: never fully masked), lies ~eps below the continuous-time NELBO, so it is not a bound."""
    from tests.dlm_helpers import model_fn, tiny_model

    fn = model_fn(tiny_model(std=0.3, seed=seed))
    nll, nelbo, est = _exact_figures(fn, [5, 6, 7, 8], 47, 48)
    print(f"seed {seed}: exact NLL {nll:.6f}, continuous NELBO {nelbo:.6f}, "
          + ", ".join(f"{k} {v:.6f}" for k, v in est.items()))
    assert nll < nelbo
    assert est["linear"] > nll and est["cosine"] > nll
    assert abs(est["linear"] - nelbo) < 2 * EPS * nelbo
    assert est["cosine"] > nelbo
    assert est["loglinear"] < nelbo
