"""DPO on ELBO estimates and VRPO's shared noise."""
import math

import pytest
import torch

from difflm.posttrain.dpo import dpo_loss
from difflm.posttrain.loglik import EstimateKey, MCELBOEstimator
from difflm.posttrain.vrpo import preference_scores


def test_dpo_loss_by_hand_and_gradient():
    pc = torch.tensor([-3.0, -5.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0, -4.5], dtype=torch.float64, requires_grad=True)
    rc, rr = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-3.5, -4.0], dtype=torch.float64)
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    z = [0.5 * ((-3 + 3.5) - (-4 + 3.5)), 0.5 * ((-5 + 5) - (-4.5 + 4))]  # [0.5, 0.25]
    want = sum(math.log1p(math.exp(-v)) for v in z) / 2
    assert abs(float(loss.detach()) - want) < 1e-6
    loss.backward()
    sig = [1 / (1 + math.exp(v)) for v in z]  # d/dz -log sigmoid(z) = -sigmoid(-z)
    assert torch.allclose(pc.grad, torch.tensor([-0.5 * s / 2 for s in sig], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(pr.grad, torch.tensor([0.5 * s / 2 for s in sig], dtype=torch.float64), atol=1e-6)
    assert m["accuracy"] == 1.0 and abs(m["margin"] - 0.375) < 1e-6
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def _model(seed, V=6):
    g = torch.Generator().manual_seed(seed)
    emb, w = torch.randn(V + 1, 8, generator=g), torch.randn(8, V + 1, generator=g)
    return lambda x: torch.tanh(emb[x] + emb[x].mean(dim=1, keepdim=True)) @ w


def test_vrpo_shared_noise_lowers_score_variance():
    """The score s(y) = B_theta - B_ref varies far less over noise draws when policy and reference share t and masks
    (VRPO) than when each draws its own; the means agree (no bias)."""
    policy, ref = _model(0), _model(0)
    ref_w = _model(1)
    mix = lambda x: 0.8 * policy(x) + 0.2 * ref_w(x)  # noqa: E731  a reference close to the policy
    n = 2000
    x = torch.randint(0, 6, (1, 8)).repeat(n, 1)
    comp = torch.zeros_like(x, dtype=torch.bool)
    comp[:, 3:] = True
    est = MCELBOEstimator(num_t=2)
    shared = preference_scores(est, policy, mix, x, x, comp, comp, mask_id=6, key=EstimateKey((0,)), pair_ids=range(n))
    s_shared = shared["policy_chosen"] - shared["ref_chosen"]
    other = est(mix, x, comp, mask_id=6, key=EstimateKey((99,)), sample_ids=range(n)).sum(dim=1)
    s_indep = shared["policy_chosen"] - other
    assert float(s_shared.var()) < 0.2 * float(s_indep.var())
    se = (float(s_shared.var()) / n + float(s_indep.var()) / n) ** 0.5
    assert abs(float(s_shared.mean()) - float(s_indep.mean())) < 4 * se
