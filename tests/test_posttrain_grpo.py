"""GRPO's advantages, loss and gradient against hand-written references on fixed rollouts and rewards."""
import math

import pytest
import torch

from difflm.posttrain.grpo import group_advantages, grpo_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.5])
    a = group_advantages(r, 4, eps=0.0 + 1e-4)
    # group 1: mean 0.5, sample std sqrt(1/3); group 2: mean 1, sample std sqrt(3 / 3) = 1
    s1, s2 = math.sqrt(1 / 3), 1.0
    want = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -0.5 / s2, -0.5 / s2, -0.5 / s2, 1.5 / s2]
    want = [w * s / (s + 1e-4) for w, s in zip(want, [s1] * 4 + [s2] * 4)]
    assert torch.allclose(a.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert torch.equal(group_advantages(torch.ones(4), 2), torch.zeros(4))  # no signal in a solved group
    assert torch.allclose(group_advantages(r, 4, scale=False), torch.tensor([.5, -.5, -.5, .5, -.5, -.5, -.5, 1.5]))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def reference_loss(logp, old, ref, adv, comp, cl, ch, beta, norm):
    """GRPO's eq. 3 written token by token with Python floats for the constants."""
    total, count, per_seq = 0.0, 0, []
    for i in range(logp.shape[0]):
        s_i, n_i = 0.0, 0
        for k in range(logp.shape[1]):
            if not comp[i, k]:
                continue
            rho = torch.exp(logp[i, k] - float(old[i, k]))
            a = float(adv[i])
            j = torch.minimum(rho * a, torch.clamp(rho, 1 - cl, 1 + ch) * a)
            d = float(ref[i, k]) - logp[i, k]
            term = -j + beta * (torch.exp(d) - d - 1)
            total, count, s_i, n_i = total + term, count + 1, s_i + term, n_i + 1
        per_seq.append(s_i / max(n_i, 1))
    return total / count if norm == "token" else sum(per_seq) / len(per_seq)


def reference_grad(logp, old, ref, adv, comp, cl, ch, beta, norm):
    """d loss / d logp in closed form: -rho A where the min picks the unclipped term (0 where the clip binds), plus
    beta (1 - exp(ref - logp)); divided by the token count (or by each row's count and the rows)."""
    rho = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp)
    clipped = ((rho > 1 + ch) & (a > 0)) | ((rho < 1 - cl) & (a < 0))
    g = torch.where(clipped, torch.zeros_like(rho), -rho * a) + beta * (1 - torch.exp(ref - logp))
    g = g * comp
    if norm == "token":
        return g / comp.sum()
    return g / comp.sum(dim=1, keepdim=True) / logp.shape[0]


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_and_gradient_match_hand_written(norm, beta):
    g = torch.Generator().manual_seed(0)
    B, S = 8, 6
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(B, S, generator=g, dtype=torch.float64)).requires_grad_()  # some ratios clip
    ref = old + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, 4).double()
    comp = torch.ones(B, S, dtype=torch.bool)
    comp[:, :2] = False  # prompt
    comp[1, 4:] = False  # a short completion
    loss, metrics = grpo_loss(logp, old, ref, adv, comp, clip_low=0.2, clip_high=0.28, beta=beta, loss_norm=norm)
    loss.backward()
    want = reference_loss(logp.detach().requires_grad_(), old, ref, adv, comp, 0.2, 0.28, beta, norm)
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-6
    grad = reference_grad(logp.detach(), old, ref, adv, comp.double(), 0.2, 0.28, beta, norm)
    assert torch.allclose(logp.grad.double(), grad, atol=1e-6)
    assert 0 < metrics["clip_fraction"] < 1
    assert (metrics["kl"] > 0) == (beta > 0)


def test_grpo_gradient_through_a_model_matches_reference():
    """The loss's gradient w.r.t. model parameters (a linear logits model under the MC-ELBO estimator) equals the
    hand-written reference's, autograd through the same estimator terms."""
    from difflm.posttrain.loglik import EstimateKey, MCELBOEstimator

    torch.manual_seed(0)
    V, mask = 5, 4
    emb = torch.nn.Embedding(V, 8, dtype=torch.float64)
    head = torch.nn.Linear(8, V, dtype=torch.float64)
    fn = lambda x: head(torch.tanh(emb(x) + emb(x).mean(dim=1, keepdim=True)))  # noqa: E731
    x = torch.randint(0, 4, (4, 5))
    comp = torch.zeros_like(x, dtype=torch.bool)
    comp[:, 2:] = True
    est, key = MCELBOEstimator(num_t=2), EstimateKey((0, 1))
    kw = dict(mask_id=mask, key=key, sample_ids=range(4))
    with torch.no_grad():
        old = est(fn, x, comp, **kw).double() + 0.1
        ref = old - 0.05
    adv = group_advantages(torch.tensor([1.0, 0, 0.5, 0]), 2).double()
    loss, _ = grpo_loss(est(fn, x, comp, **kw).double(), old, ref, adv, comp, beta=0.1)
    grads = torch.autograd.grad(loss, list(emb.parameters()) + list(head.parameters()))
    want = reference_loss(est(fn, x, comp, **kw).double(), old, ref, adv, comp, 0.2, 0.2, 0.1, "token")
    want_grads = torch.autograd.grad(want, list(emb.parameters()) + list(head.parameters()))
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-6
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_grpo_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_norm"):
        grpo_loss(z, z, z, torch.zeros(2), z.bool(), loss_norm="mean")
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(z, z, None, torch.zeros(2), z.bool(), beta=0.1)
