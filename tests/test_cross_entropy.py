"""The objectives' cross-entropy (difflm.objectives.cross_entropy): TE's fused kernel on CUDA against
``F.cross_entropy`` on FP32 logits, the unfused path everywhere else.

* CPU: the function is ``F.cross_entropy`` per row (values and gradients exact), with -100 rows at 0, and the
  fused path is never taken there.
* CUDA with Transformer Engine: losses within 2e-6 relative and BF16 gradients within one BF16 ulp of the
  unfused path's (at V = 50304, the model vocabulary); training and evaluation leave the logits intact; zero rows
  fall back; a whole TE model's step
  loss and gradients with ``fused=True`` equal ``fused=False``'s.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difflm.objectives.cross_entropy import fused_cross_entropy_available, token_cross_entropy
from difflm.training.precision import te_import_error

CUDA_TE = pytest.mark.skipif(not torch.cuda.is_available() or te_import_error() is not None,
                             reason="needs CUDA and Transformer Engine")


def inputs(n: int, v: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, v, generator=gen)).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::7] = -100  # ignored rows
    upstream = torch.rand(n, generator=gen).to(device)
    return logits, targets.to(device), upstream


def loss_and_grad(logits, targets, upstream, fused: bool):
    x = logits.clone().requires_grad_()
    ce = token_cross_entropy(x, targets, fused=fused)
    (ce * upstream).sum().backward()
    return ce.detach(), x.grad


def test_cpu_rows_equal_f_cross_entropy_with_ignored_rows_at_zero():
    logits, targets, upstream = inputs(29, 40, torch.float32, "cpu")
    assert not fused_cross_entropy_available(logits)
    ce, grad = loss_and_grad(logits, targets, upstream, fused=True)
    x = logits.clone().requires_grad_()
    reference = F.cross_entropy(x, targets, reduction="none")
    (reference * upstream).sum().backward()
    assert ce.dtype == torch.float32 and ce.shape == (29,)
    torch.testing.assert_close(ce, reference.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)
    assert (ce[targets == -100] == 0).all() and (ce[targets != -100] > 0).all()


@CUDA_TE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_matches_unfused_at_model_vocabulary(dtype):
    logits, targets, upstream = inputs(1000, 50304, dtype, "cuda")
    assert fused_cross_entropy_available(logits)
    ce_fused, grad_fused = loss_and_grad(logits, targets, upstream, fused=True)
    ce_ref, grad_ref = loss_and_grad(logits, targets, upstream, fused=False)
    torch.testing.assert_close(ce_fused, ce_ref, rtol=2e-6, atol=1e-6)
    assert grad_fused.dtype == dtype
    # the reference rounds an FP32 gradient to ``dtype`` once, as the fused kernel does: one ulp apart at most
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad_fused.float(), grad_ref.float(), rtol=ulp, atol=1e-7)


@CUDA_TE
def test_logits_are_left_intact_by_training_and_evaluation():
    logits, targets, upstream = inputs(64, 50304, torch.bfloat16, "cuda", seed=1)
    head = logits.clone().requires_grad_()
    x = head * 1  # a non-leaf, as the LM head's output is
    ce = token_cross_entropy(x, targets)
    (ce * upstream).sum().backward()
    assert torch.equal(x.detach(), logits) and not torch.equal(head.grad, logits)
    with torch.no_grad():
        ce_eval = token_cross_entropy(logits, targets)
    torch.testing.assert_close(ce_eval, ce.detach(), rtol=0, atol=0)


@CUDA_TE
def test_consumed_logits_give_the_same_loss_and_gradient_and_then_hold_it():
    """``consume_logits`` (the training steps): TE writes the gradient into the logits instead of a copy. The loss
    and the gradient are bitwise those of the copying call, the logits hold the gradient afterwards, and a second
    loss on the same logits fails in the backward instead of reading a gradient as logits."""
    logits, targets, upstream = inputs(64, 50304, torch.bfloat16, "cuda", seed=2)
    runs = []
    for consume in (False, True):
        head = logits.clone().requires_grad_()
        x = head * 1  # a non-leaf, as the LM head's output is
        ce = token_cross_entropy(x, targets, consume_logits=consume)
        (ce * upstream).sum().backward()
        runs.append((ce.detach(), head.grad, x.detach().clone()))
    (ce_kept, grad_kept, x_kept), (ce_used, grad_used, x_used) = runs
    assert torch.equal(ce_used, ce_kept) and torch.equal(grad_used, grad_kept)
    assert torch.equal(x_kept, logits) and torch.equal(x_used, grad_used) and not torch.equal(x_used, logits)
    x = logits.clone().requires_grad_() * 1
    twice = token_cross_entropy(x, targets, consume_logits=True).sum() + token_cross_entropy(
        x, targets, consume_logits=True).sum()
    with pytest.raises(RuntimeError, match="inplace"):
        twice.backward()


@CUDA_TE
def test_zero_rows_fall_back():
    logits = torch.zeros(0, 50304, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert not fused_cross_entropy_available(logits)
    ce = token_cross_entropy(logits, torch.zeros(0, dtype=torch.long, device="cuda"))
    assert ce.shape == (0,)


@CUDA_TE
def test_te_model_step_loss_and_gradients_match_with_the_fused_kernel():
    from difflm.config.schema import ModelConfig
    from difflm.model import build_model
    from difflm.objectives.base import NoisedBatch, weighted_ce_sum
    from difflm.training.precision import autocast_context

    dev = torch.device("cuda")
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, ffn_hidden_size=256, head_dim=32,
                      vocab_size=4096, qk_norm=True, backend="te", attention_backend="te")
    g = torch.Generator(device=dev).manual_seed(3)
    b, s = 4, 128
    ids = torch.randint(0, cfg.vocab_size - 1, (b, s), device=dev, generator=g)
    mask = torch.rand(b, s, device=dev, generator=g) < 0.5
    batch = NoisedBatch(input_ids=ids, targets=ids, loss_mask=mask, weights=mask.float() * 2.0,
                        t=torch.full((b,), 0.5, device=dev), num_tokens=torch.full((b,), float(s), device=dev))
    results = {}
    for fused in (False, True):
        model = build_model(cfg, causal=False, device=dev, seed=5)
        with autocast_context("bf16", dev):
            logits = model(ids, mask)
        loss = weighted_ce_sum(logits, batch, "token", b * s, fused=fused, consume_logits=True)  # the trainer's call
        loss.backward()
        results[fused] = (loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()})
    assert 5 < float(results[False][0]) < 40  # ~2 ln(4096) at initialisation (weights 2)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=2e-6, atol=0)
    for name, grad in results[False][1].items():  # the fused kernel rounds its FP32 gradient to BF16 once
        assert ((results[True][1][name] - grad).norm() / grad.norm()).item() < 1e-2, name
