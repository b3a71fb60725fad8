"""The optimizer step: AdamW's decay groups, gradient clipping, and the fused step that skips non-finite steps and
applies the clipping coefficient inside its kernel (``difflm.training.optimizer``, ``difflm.parallel.parallelize``)."""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from difflm.parallel.parallelize import clip_coefficient, global_grad_norm, grad_norm_and_clip, scale_grads_
from difflm.training.optimizer import build_optimizer, step_unless_nonfinite
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")
OPTIM = OmegaConf.create({"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "fused": True})


def model_with_grads(scale: float, seed: int = 0) -> torch.nn.Module:
    """A small two-layer model whose gradients are random with global norm ~``scale`` x 10."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            p.grad = torch.randn(p.shape, generator=g) * scale
    return model


def step_twice(model, clip_inside: bool, max_norm: float):
    """Two fused AdamW steps clipped to ``max_norm``: in the kernel (``clip_inside``) or in place first."""
    opt = build_optimizer(model, OPTIM, CPU)
    finite = torch.tensor(True)
    norms = []
    for _ in range(2):
        params = list(model.parameters())
        if clip_inside:
            norm = global_grad_norm(params)
            step_unless_nonfinite(opt, finite, grad_factor=clip_coefficient(norm, max_norm))
        else:
            norm = grad_norm_and_clip(params, max_norm)
            step_unless_nonfinite(opt, finite)
        norms.append(float(norm))
        with torch.no_grad():  # the next step's gradients: the same for both, whatever the kernel left in .grad
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.3 * (i + 1)) * (-1) ** i
    return model, opt, norms


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipping", "below-the-limit"])
def test_clipping_inside_the_fused_step_equals_clipping_first(max_norm):
    """The clipping coefficient handed to the fused AdamW as its ``grad_scale`` gives the weights and moments of
    clipping the gradients first (to FP32 rounding of grad / (1 / c) against grad * c); below the limit exactly."""
    inside, opt_in, norms_in = step_twice(model_with_grads(1.0), True, max_norm)
    first, opt_first, norms_first = step_twice(model_with_grads(1.0), False, max_norm)
    assert norms_in == norms_first and norms_in[0] > 1.0  # the norm is read before clipping, by both
    exact = max_norm > max(norms_in)
    for a, b in zip(inside.parameters(), first.parameters()):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_in.state[a][key], opt_first.state[b][key], rtol=1e-5, atol=0.0)
    if not exact:  # the clip changed the step: an unclipped run ends elsewhere
        unclipped, _, _ = step_twice(model_with_grads(1.0), True, float("inf"))
        assert not torch.allclose(next(unclipped.parameters()), next(inside.parameters()), rtol=1e-4)


def test_a_non_finite_norm_with_a_clip_changes_nothing():
    """A NaN gradient norm makes the clipping coefficient NaN too; the device-side skip still leaves every weight,
    moment and step count as it was."""
    model = model_with_grads(1.0)
    opt = build_optimizer(model, OPTIM, CPU)
    step_unless_nonfinite(opt, torch.tensor(True), grad_factor=clip_coefficient(global_grad_norm(model.parameters()),
                                                                                 0.5))
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = global_grad_norm(model.parameters())
    assert torch.isnan(norm)
    step_unless_nonfinite(opt, torch.isfinite(norm), grad_factor=clip_coefficient(norm, 0.5))
    assert all(torch.equal(before[0][k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()["state"]
    for i, state in before[1]["state"].items():
        assert all(torch.equal(v, after[i][k]) for k, v in state.items())


def test_step_unless_nonfinite_refuses_a_grad_scaler_s_state():
    model = model_with_grads(1.0)
    opt = build_optimizer(model, OPTIM, CPU)
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(ValueError, match="grad_scale"):
        step_unless_nonfinite(opt, torch.tensor(True))
    del opt.grad_scale
    opt_foreach = build_optimizer(model, OmegaConf.merge(OPTIM, {"fused": False}), CPU)
    with pytest.raises(ValueError, match="fused"):
        step_unless_nonfinite(opt_foreach, torch.tensor(True), grad_factor=torch.tensor(0.5))


def test_scale_grads_multiplies_every_gradient():
    model = model_with_grads(1.0)
    grads = [p.grad.clone() for p in model.parameters()]
    scale_grads_(model.parameters(), torch.tensor(0.25))
    assert all(torch.equal(p.grad, g * 0.25) for p, g in zip(model.parameters(), grads))
    assert clip_coefficient(torch.tensor(4.0), float("inf")) is None
    assert float(clip_coefficient(torch.tensor(4.0), 1.0)) == pytest.approx(0.25, rel=1e-6)
    assert float(clip_coefficient(torch.tensor(0.5), 1.0)) == 1.0


def test_trainer_clips_inside_the_fused_step_like_the_foreach_path(fast_cfg):
    """A run whose every step is clipped (``optim.grad_clip`` far below the norm) trains to the same weights with the
    fused AdamW (clipping in its kernel) as with the for-each one (clipping the gradients first), to rounding."""
    states = {}
    for fused in (True, False):
        cfg = fast_cfg("train.max_steps=3", "train.save_every=0", "train.eval_every=0", "optim.grad_clip=0.01",
                       f"optim.fused={str(fused).lower()}", f"run.dir={fast_cfg().run.dir}_{fused}")
        trainer = Trainer(cfg, cfg.run.dir, CPU)
        seen = []
        real_step = trainer._finish_step

        def spy(loss, grad_norm, tokens, clip=None):
            seen.append((float(grad_norm), clip is not None))
            return real_step(loss, grad_norm, tokens, clip=clip)

        trainer._finish_step = spy
        trainer.fit()
        assert all(norm > 0.01 and clipped for norm, clipped in seen)  # every step was clipped
        states[fused] = trainer.model.state_dict()
    for k, v in states[True].items():
        torch.testing.assert_close(v, states[False][k], rtol=1e-4, atol=1e-6)
