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
