"""Mixture of experts (difflm/model/moe.py) on CPU: the routed sum against a per-token reference, the grouped
GEMM kernels against the loop, the auxiliary-loss gradient, capacity dropping, the aux-loss-free bias, load
balancing over training steps, every objective with ``model=moe-tiny``, the config checks and the HF export."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import compose_run, report
from difflm.errors import DifflmError
from difflm.model.moe import (
    GroupedExperts,
    MoEMLP,
    load_balancing_loss,
    moe_inactive_params,
    moe_metrics,
    moe_step,
    router_z_loss,
    set_moe_loss_scale,
)
from fixtures.fake_te_env import fake_te  # noqa: F401  (fixture)

CPU = torch.device("cpu")



def moe_cfg(**moe):
    base = dict(num_experts=8, top_k=2, ffn_hidden_size=24, num_shared_experts=1, score_func="softmax",
                norm_topk_prob=False, aux_loss_coeff=0.01, z_loss_coeff=0.001, bias_update_rate=0.0,
                capacity_factor=None)
    base.update(moe)
    return OmegaConf.create(dict(hidden_size=16, ffn_hidden_size=32, norm_eps=1e-5, num_layers=2, init_std=0.02,
                                 moe=base))


def make_layer(seed=0, **moe) -> MoEMLP:
    torch.manual_seed(seed)
    layer = MoEMLP(moe_cfg(**moe))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def per_token_reference(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """sum_j w_j expert_{e_j}(h) + shared(h), token by token (no sorting, no dispatch)."""
    h = F.rms_norm(x, (x.shape[-1],), layer.layer_norm_weight, layer.eps).reshape(-1, x.shape[-1])
    routing = layer.router(h)
    w1, w2 = layer.experts.fc1_weight, layer.experts.fc2_weight
    rows = []
    for t in range(h.shape[0]):
        y = torch.zeros(h.shape[-1])
        for j in range(layer.top_k):
            e = int(routing.expert_ids[t, j])
            gate, up = (h[t] @ w1[e].T).chunk(2)
            y = y + routing.weights[t, j] * ((F.silu(gate) * up) @ w2[e].T)
        if layer.shared is not None:
            gate, up = (h[t] @ layer.shared.fc1_weight.T).chunk(2)
            y = y + (F.silu(gate) * up) @ layer.shared.fc2_weight.T
        rows.append(y)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("score_func,norm", [("softmax", False), ("sigmoid", True)])
def test_moe_output_equals_per_token_sum(score_func, norm):
    layer = make_layer(score_func=score_func, norm_topk_prob=norm).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        out, ref = layer(x), per_token_reference(layer, x)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        # sequence-first input gives the same per-token result
        assert torch.allclose(layer(x.transpose(0, 1)).transpose(0, 1), out, atol=1e-6)
    routing = layer.router(torch.randn(7, 16))
    if norm:
        assert torch.allclose(routing.weights.sum(-1), torch.ones(7))
    assert routing.expert_ids.shape == (7, 2) and routing.probs.sum(-1).allclose(torch.ones(7))


def test_grouped_mm_matches_the_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing in this PyTorch")
    w1, w2 = torch.randn(4, 48, 32) * 0.2, torch.randn(4, 32, 24) * 0.2
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 32)
    ref = GroupedExperts._loop(x.bfloat16().float(), counts.tolist(), w1.bfloat16().float(), w2.bfloat16().float())
    try:
        got = GroupedExperts._grouped_mm(x, counts, w1, w2)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on CPU here: {e}")
    assert got.dtype == torch.bfloat16 and got.shape == (16, 32)
    assert torch.allclose(got.float(), ref, atol=3e-2, rtol=3e-2), (got.float() - ref).abs().max()


def _main_grad_experts_against_autograd(device):
    """Two micro-batches through GroupedSwiGLUMainGrad (BF16 copies, gradients added into FP32 main_grad) against
    autograd through the same torch._grouped_mm calls (gradients cast to FP32 and summed into .grad); one expert
    gets no rows. Returns the relative errors of the outputs, dx and the two accumulated weight gradients."""
    from difflm.model.grouped_experts import GroupedSwiGLUMainGrad

    gen = torch.Generator().manual_seed(0)
    e, d, f = 4, 64, 48
    w1 = (torch.randn(e, 2 * f, d, generator=gen) * 0.1).to(device)
    w2 = (torch.randn(e, d, f, generator=gen) * 0.1).to(device)
    masters = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    for p in masters:
        p.main_grad = torch.zeros_like(p)
    ref = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    errors = {}
    for micro, counts in enumerate(([24, 0, 40, 16], [8, 32, 0, 40])):
        counts = torch.tensor(counts, device=device)
        x = torch.randn(int(counts.sum()), d, generator=gen).to(device).bfloat16()
        dy = torch.randn(x.shape[0], d, generator=gen).to(device).bfloat16()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        w1b, w2b = (p.detach().bfloat16() for p in masters)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        out = GroupedSwiGLUMainGrad.apply(xa, offs, *masters, w1b, w2b)
        out.backward(dy)
        want = GroupedExperts._grouped_mm(xb, counts, *ref)
        want.backward(dy)
        assert all(p.grad is None for p in masters)  # the gradients went to main_grad only

        def rel(a, b):
            return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

        errors[f"out{micro}"], errors[f"dx{micro}"] = rel(out, want), rel(xa.grad, xb.grad)
    errors["dW1"], errors["dW2"] = rel(masters[0].main_grad, ref[0].grad), rel(masters[1].main_grad, ref[1].grad)
    assert masters[0].main_grad.dtype == torch.float32
    return errors


def test_main_grad_experts_equal_autograd_on_cpu():
    """The experts' main_grad path (its backward written out: both weight gradients, SwiGLU's derivative, dx) equals
    autograd through torch._grouped_mm, over two accumulated micro-batches and an empty expert (CPU kernels)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing in this PyTorch")
    try:
        torch._grouped_mm(torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([8], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on CPU here: {e}")
    errors = _main_grad_experts_against_autograd(CPU)
    assert all(v < 1e-2 for v in errors.values()), errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels (torch._grouped_mm)")
def test_main_grad_experts_equal_autograd_on_cuda():
    """The same on the GPU's grouped GEMM kernels (column-major views for the weight gradients, an empty group)."""
    errors = _main_grad_experts_against_autograd(torch.device("cuda"))
    report("moe_main_grad_vs_autograd", **errors)
    assert all(v < 1e-2 for v in errors.values()), errors


def _fp8_experts_against_bf16(device, monkeypatch=None):
    """One micro-batch through GroupedSwiGLUFP8 and through GroupedSwiGLUMainGrad (BF16) with the same FP32 masters,
    rows and output gradient, an empty expert and groups not a multiple of 16 included: relative errors of y, dx and
    both weight gradients (FP8 against BF16)."""
    from difflm.model import grouped_experts as ge

    if monkeypatch is not None:  # CPU: the FP8 GEMM emulated by dequantising to BF16 (same scales, same layout)
        def emulated(a, b, scale_a, scale_b, offs):
            assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride(-2) == 1  # b column-major, as the kernel needs
            return torch._grouped_mm((a.float() * scale_a[:, None]).bfloat16(),
                                     (b.float() * scale_b[:, None, :]).bfloat16(), offs=offs)
        monkeypatch.setattr(ge, "scaled_grouped_mm", emulated)
    gen = torch.Generator().manual_seed(0)
    e, d, f = 4, 64, 48
    w1 = (torch.randn(e, 2 * f, d, generator=gen) * 0.1).to(device)
    w2 = (torch.randn(e, d, f, generator=gen) * 0.1).to(device)
    counts = torch.tensor([21, 0, 37, 6], device=device)
    x = torch.randn(int(counts.sum()), d, generator=gen).to(device).bfloat16()
    dy = torch.randn(x.shape[0], d, generator=gen).to(device).bfloat16()
    results = []
    for fp8 in (True, False):
        masters = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
        for p in masters:
            p.main_grad = torch.zeros_like(p)
        xi = x.clone().requires_grad_()
        if fp8:
            y = ge.GroupedSwiGLUFP8.apply(xi, counts, *masters, *ge.fp8_expert_weights(*masters))
        else:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            y = ge.GroupedSwiGLUMainGrad.apply(xi, offs, *masters, *(p.detach().bfloat16() for p in masters))
        y.backward(dy)
        results.append((y, xi.grad, masters[0].main_grad, masters[1].main_grad))

    def rel(a, b):
        return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

    return {name: rel(a, b) for name, a, b in zip(("y", "dx", "dW1", "dW2"), *results)}


def test_fp8_experts_pad_groups_and_track_bf16_on_cpu(monkeypatch):
    """The FP8 experts' padding, scales and backward (the FP8 GEMM emulated on CPU): groups padded to multiples of 16
    without a host sync, every row back in place, and values within FP8's error of the BF16 path."""
    from difflm.model.grouped_experts import fp8_rows, padded_groups

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing in this PyTorch")
    dest, offs, total = padded_groups(torch.tensor([21, 0, 37, 6]), 64)
    assert total == 128 and offs.tolist() == [32, 32, 80, 128]  # 21 -> 32, 0, 37 -> 48; the last takes the slack
    assert dest.tolist() == list(range(21)) + list(range(32, 69)) + list(range(80, 86))
    t = torch.randn(5, 64)
    q, scale = fp8_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((5,), 448.0))  # each row's largest value at FP8's max
    assert float(((q.float() * scale[:, None] - t).norm() / t.norm())) < 0.05
    errors = _fp8_experts_against_bf16(CPU, monkeypatch)
    assert all(v < 0.1 for v in errors.values()), errors  # E4M3 keeps 3 mantissa bits: ~5 % measured
    assert all(v > 1e-4 for v in errors.values()), errors  # FP8 really ran (not the BF16 path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels (torch._scaled_grouped_mm)")
def test_fp8_experts_track_bf16_on_cuda():
    """The FP8 expert GEMMs (torch._scaled_grouped_mm, row-wise scales) against the BF16 grouped GEMMs on the GPU:
    outputs, input gradients and both weight gradients within FP8's error."""
    from difflm.model.grouped_experts import fp8_grouped_mm_supported

    if not fp8_grouped_mm_supported(torch.zeros(1, device="cuda")):
        pytest.skip("no FP8 grouped GEMM on this GPU (compute capability 9.0+)")
    errors = _fp8_experts_against_bf16(torch.device("cuda"))
    report("moe_fp8_experts_vs_bf16", **errors)
    assert all(v < 0.1 for v in errors.values()), errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile's CUDA kernels")
def test_compiled_fp8_regions_equal_their_eager_ops_on_cuda():
    """The FP8 experts' compiled regions (difflm.kernels.compiled.fused_on_gpu) against the same functions run
    op by op. Inductor computes a fused region in FP32 without rounding its intermediates to BF16, so values may differ
    by BF16 rounding: BF16 outputs within 2^-6 relative, scales within 1 %, and each dequantised FP8 value within one
    E4M3 step (1/8 of its value, or the subnormal step) of the eager one."""
    from difflm.model import grouped_experts as ge

    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    counts = torch.tensor([21, 0, 37, 6], device=cuda)
    x = torch.randn(64, 96, generator=gen).to(cuda).bfloat16()
    h = torch.randn(80, 2 * 48, generator=gen).to(cuda).bfloat16()
    da = torch.randn(80, 48, generator=gen).to(cuda).bfloat16()
    w = torch.randn(4, 96, 40, generator=gen).to(cuda)
    dest, _, total = ge.padded_groups(counts, 64)
    cases = {"padded": (ge.padded_fp8_rows, (x, dest, total)), "swiglu": (ge.swiglu_fp8_rows, (h,)),
             "swiglu backward": (ge.swiglu_backward_fp8_rows, (h, da)), "recomputed": (ge.recomputed_swiglu, (h,)),
             "weight": (ge.weight_fp8_rows, (w,)), "transposed weight": (ge.transposed_weight_fp8_rows, (w,))}
    changed = {}
    for name, (fn, args) in cases.items():
        fused, eager = fn(*args), fn.eager(*args)
        fused, eager = (fused, eager) if isinstance(fused, tuple) else ((fused,), (eager,))
        for got, want in zip(fused, eager):
            assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), name
        if eager[0].dtype != torch.float8_e4m3fn:  # the BF16 outputs before the (q, scale) pair
            torch.testing.assert_close(fused[0], eager[0], rtol=2**-6, atol=1e-5, msg=name)
        if len(eager) >= 2 and eager[-2].dtype == torch.float8_e4m3fn:
            (q, scale), (q_ref, scale_ref) = fused[-2:], eager[-2:]
            torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0, msg=name)
            value, ref = q.float() * scale.unsqueeze(-1), q_ref.float() * scale_ref.unsqueeze(-1)
            step = ref.abs() / 8 + scale_ref.unsqueeze(-1) * 2.0**-9
            assert bool(((value - ref).abs() <= 1.05 * step).all()), name
            assert float(ref.abs().amax()) > 0, name
            changed[name] = float((q.float() != q_ref.float()).float().mean())
    report("compiled_fp8_regions_changed_fraction", **changed)
    assert max(changed.values()) < 0.2, changed  # few values round to the other side of an FP8 step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="quack's CUDA kernels")
@pytest.mark.parametrize("tuned", [False, True], ids=["default_tiles", "autotuned"])
def test_quack_fused_experts_equal_the_grouped_mm_path_on_cuda(tuned):
    """model.moe.fused_experts: quack's variable-length grouped GEMMs (SwiGLU and its derivative in the epilogues,
    weight gradients accumulated into main_grad by the GEMM) against GroupedSwiGLUMainGrad over two micro-batches with
    an empty expert: outputs, input gradients and the accumulated FP32 weight gradients; with quack's default tiles
    and with its autotuned ones (``model.fused_mlp_autotune``)."""
    from difflm.kernels.quack_mlp import quack_unavailable_reason
    from difflm.model.grouped_experts import GroupedSwiGLUMainGrad

    if quack_unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(quack_unavailable_reason(torch.device("cuda")))
    from difflm.kernels.quack_experts import QuackGroupedSwiGLU, row_groups

    gen = torch.Generator().manual_seed(0)
    e, d, f, dev = 4, 128, 64, torch.device("cuda")
    w1, w2 = (torch.randn(e, 2 * f, d, generator=gen) * 0.1).to(dev), (torch.randn(e, d, f, generator=gen) * 0.1).to(dev)
    sides = []
    for _ in range(2):
        masters = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
        for p in masters:
            p.main_grad = torch.zeros_like(p)
        sides.append(masters)
    errors = {}

    def rel(a, b):
        return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())

    for micro, counts in enumerate(([48, 0, 80, 32], [16, 64, 0, 80])):
        counts = torch.tensor(counts, device=dev)
        x = torch.randn(int(counts.sum()), d, generator=gen).to(dev).bfloat16()
        dy = torch.randn(x.shape[0], d, generator=gen).to(dev).bfloat16()
        outs = []
        for fused, masters in zip((True, False), sides):
            xi = x.clone().requires_grad_()
            w1b, w2b = (p.detach().bfloat16() for p in masters)
            if fused:
                y = QuackGroupedSwiGLU.apply(xi, row_groups(counts), *masters, w1b, w2b, tuned)
            else:
                y = GroupedSwiGLUMainGrad.apply(xi, torch.cumsum(counts, 0, dtype=torch.int32), *masters, w1b, w2b)
            y.backward(dy)
            outs.append((y, xi.grad))
        errors[f"y{micro}"], errors[f"dx{micro}"] = rel(outs[0][0], outs[1][0]), rel(outs[0][1], outs[1][1])
    errors["dW1"] = rel(sides[0][0].main_grad, sides[1][0].main_grad)
    errors["dW2"] = rel(sides[0][1].main_grad, sides[1][1].main_grad)
    report(f"moe_quack_experts_vs_grouped_mm_{'tuned' if tuned else 'default'}", **errors)
    assert all(v < 2e-2 for v in errors.values()), errors


def test_te_kernel_set_accumulates_expert_grads_in_main_grad(fake_te):
    """Under the TE kernel set (one process, model.fuse_wgrad_accumulation) the experts' weights accumulate in FP32
    main_grad like the TE modules', so the grouped GEMMs can add into it; the torch set leaves them to autograd.
    Two micro-batches on CPU give the gradients of the torch set's model summed over both."""
    from difflm.model import Transformer, resolve_model_config
    from difflm.model.te_kernels import TEKernels, torch_to_te_state_dict

    cfg = compose_run(["model=moe-tiny"]).model
    resolve_model_config(cfg, 128)
    ref = Transformer(cfg)
    ref.init_weights(3)
    te_model = Transformer(cfg, kernels=TEKernels(cfg, device="cpu"))
    te_model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))
    experts = te_model.layers[0].mlp.experts
    assert getattr(experts, "main_grad_weight_names", ()) == ("fc1_weight", "fc2_weight")
    assert getattr(ref.layers[0].mlp.experts, "main_grad_weight_names", ()) == ()
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 128, (2, 16), generator=gen)
        te_model.train()(x).float().square().mean().backward()
        ref.train()(x).float().square().mean().backward()
    w = experts.fc1_weight
    assert w.grad is w.main_grad and w.accumulates_in_main_grad
    # in FP8 regions the main_grad hook passes TE's is_first_microbatch: the experts take it and ignore it
    h, counts = torch.randn(6, cfg.hidden_size), torch.tensor([3, 0, 2, 1] + [0] * (experts.fc1_weight.shape[0] - 4))
    with torch.no_grad():
        torch.testing.assert_close(experts(h, counts, is_first_microbatch=True), experts(h, counts))
    torch.testing.assert_close(w.main_grad, ref.layers[0].mlp.experts.fc1_weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels (torch._grouped_mm)")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_cuda_expert_kernels_match_the_loop(precision):
    """On the GPU, the MoE layer with E=8 experts of d=256, f=512 over 2 x 512 tokens, its experts through
    torch._grouped_mm in BF16 (also inside an FP8 region: the experts stay BF16), against the same layer's CPU loop
    in FP32, forward and gradients (relative L2 errors; measured ~5e-3 to 8e-3 on an H200)."""
    from difflm.training.precision import autocast_context, import_te

    if precision == "fp8":
        try:
            import_te()
        except Exception as e:  # noqa: BLE001 - TE missing on this machine
            pytest.skip(f"Transformer Engine: {e}")
    cfg = moe_cfg(num_experts=8, ffn_hidden_size=512)
    cfg.hidden_size = 256
    torch.manual_seed(0)
    ref = MoEMLP(cfg).train()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    gpu = MoEMLP(cfg).train().cuda()
    gpu.load_state_dict(ref.state_dict())
    x = torch.randn(2, 512, 256)
    out_ref = ref(x)
    out_ref.square().mean().backward()
    with autocast_context(precision, torch.device("cuda")):
        out = gpu(x.cuda())
    out.float().square().mean().backward()

    def rel(a, b):
        return float((a.float().cpu() - b).norm() / b.norm())

    errors = {"out": rel(out, out_ref)}
    errors.update({n: rel(q.grad, p.grad) for (n, p), q in zip(ref.named_parameters(), gpu.parameters())})
    report(f"moe_{precision}_vs_loop", **errors)
    assert all(e < 2e-2 for e in errors.values()), errors


def test_aux_losses_enter_the_gradient_with_the_loss_scale():
    layer = make_layer(aux_loss_coeff=0.3, z_loss_coeff=0.2).train()
    set_moe_loss_scale([layer], 0.25)
    x = torch.randn(2, 8, 16)
    layer(x).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    h = F.rms_norm(x, (16,), layer.layer_norm_weight, layer.eps).reshape(-1, 16)
    routing = layer.router(h)
    counts = torch.bincount(routing.expert_ids.flatten(), minlength=8)
    aux = 0.3 * load_balancing_loss(routing.probs, counts, 2) + 0.2 * router_z_loss(routing.logits)
    (per_token_reference(layer, x).sum() + 0.25 * aux).backward()
    for name, p in layer.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-5), name
    assert got["router.weight"].abs().sum() > 0
    # statistics of the first (training) forward only: the reference above called submodules directly
    assert layer.step_tokens.sum() == 16 * 2 and layer.step_losses[2] == 1


def test_load_balancing_loss_is_one_when_balanced_and_z_loss_value():
    probs = torch.full((8, 4), 0.25)
    assert load_balancing_loss(probs, torch.tensor([4, 4, 4, 4]), 2).item() == pytest.approx(1.0)
    assert load_balancing_loss(probs, torch.tensor([16, 0, 0, 0]), 1).item() == pytest.approx(2.0)
    logits = torch.zeros(3, 4)
    assert router_z_loss(logits).item() == pytest.approx(math.log(4) ** 2)


def test_capacity_keeps_chosen_slots_whose_gating_weights_are_negative():
    """With ``bias_in_weights`` the gating weights are ``s + b``: a bias below -1 makes them lower than any fill
    value a drop rule might give the tokens an expert was not chosen by. The same bias on every expert changes
    neither the choice nor the order inside an expert, so it must drop exactly the slots a zero bias drops."""
    layer = make_layer(capacity_factor=1.0, num_shared_experts=0, bias_in_weights=True).train()
    h = torch.randn(64, 16)
    dropped = {}
    for bias in (0.0, -2.0):
        layer.router.bias.fill_(bias)
        routing = layer.router(h)
        assert bool((routing.weights < -1).all()) == (bias < -1)
        dropped[bias] = layer._drop_over_capacity(routing) == 8
    assert 0 < int(dropped[0.0].sum()) < dropped[0.0].numel()  # capacity ceil(1.0 * 64 * 2 / 8) = 16 drops some
    assert torch.equal(dropped[-2.0], dropped[0.0])


def test_capacity_drops_lowest_scores_in_training_only():
    layer = make_layer(capacity_factor=0.5, num_shared_experts=0).train()
    x = torch.randn(4, 8, 16)
    h = F.rms_norm(x, (16,), layer.layer_norm_weight, layer.eps).reshape(-1, 16)
    routing = layer.router(h)
    kept_ids = layer._drop_over_capacity(routing)
    capacity = math.ceil(0.5 * 32 * 2 / 8)
    counts = torch.bincount(kept_ids.flatten(), minlength=9)
    assert (counts[:8] <= capacity).all() and counts[8] > 0  # some slots dropped (id E)
    for e in range(8):  # every kept slot of expert e scores at least as high as every dropped one
        mine = routing.expert_ids == e
        kept, dropped = routing.weights[mine & (kept_ids == e)], routing.weights[mine & (kept_ids == 8)]
        if len(kept) and len(dropped):
            assert kept.min() >= dropped.max()
    out = layer(x)
    reference = per_token_reference(layer.eval(), x)  # eval: nothing dropped
    assert not torch.allclose(out, reference, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(layer(x), reference, atol=1e-5)


def test_moe_step_moves_the_bias_against_the_load_and_reports_metrics():
    layer = make_layer(bias_update_rate=0.1, aux_loss_coeff=0.0, z_loss_coeff=0.0).train()
    layer(torch.randn(2, 16, 16)).sum().backward()
    tokens = layer.step_tokens.clone()
    moe_step([layer])
    assert torch.equal(layer.last_tokens, tokens) and layer.step_tokens.sum() == 0
    expected = 0.1 * torch.sign(tokens.mean() - tokens)
    assert torch.allclose(layer.router.bias, expected)
    metrics = moe_metrics([layer])
    assert metrics["moe/load_max_mean"] == pytest.approx(float(tokens.max() / tokens.mean()))
    assert metrics["moe/bias_norm"] == pytest.approx(float(expected.norm()))
    assert metrics["moe/aux_loss"] == 0.0
    # the bias steers the choice only: a large bias on expert 3 sends every token there, weights stay scores
    layer.router.bias.zero_()
    layer.router.bias[3] = 10.0
    routing = layer.router(torch.randn(5, 16))
    assert (routing.expert_ids == 3).any(-1).all()
    assert (routing.weights < 1).all()


def train_layer(steps: int, **moe) -> list[float]:
    """Train one MoE layer to map skewed inputs (a common offset plus noise) to a target; max/mean load per step."""
    layer = make_layer(seed=3, num_shared_experts=0, **moe).train()
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
    gen = torch.Generator().manual_seed(0)
    centre = torch.randn(16, generator=gen)
    target = torch.randn(16, 16, generator=gen) * 0.1
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    loads = []
    for _ in range(steps):
        x = centre + torch.randn(64, 16, generator=gen)
        loss = (layer(x) - x @ target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        moe_step([layer])
        loads.append(float(layer.last_tokens.max() / layer.last_tokens.mean()))
    return loads


def test_balancing_lowers_the_expert_load_spread():
    none = train_layer(40, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    aux_free = train_layer(40, aux_loss_coeff=0.0, z_loss_coeff=0.0, bias_update_rate=0.01)
    aux_loss = train_layer(40, aux_loss_coeff=1.0, z_loss_coeff=0.0)
    tail = lambda loads: sum(loads[-10:]) / 10  # noqa: E731
    print(f"max/mean load, last 10 of 40 steps: none {tail(none):.2f} aux-free {tail(aux_free):.2f} "
          f"aux-loss {tail(aux_loss):.2f}")  # measured: 2.22, 1.41, 1.43
    assert tail(none) > 2.0  # skewed inputs: a few experts take most tokens
    assert tail(aux_free) < 0.75 * tail(none)
    assert tail(aux_loss) < 0.75 * tail(none)


def test_active_parameters_of_the_presets():
    from difflm.model import build_model, resolve_model_config
    from difflm.model.transformer import Transformer

    cfg = compose_run(["model=moe-1b-7b"])
    resolve_model_config(cfg.model, 50304)
    with torch.device("meta"):
        total = Transformer(cfg.model).num_params()
    active = total - moe_inactive_params(cfg.model)
    assert moe_inactive_params(cfg.model) == 16 * (64 - 8) * 3 * 2048 * 1024
    # OLMoE-1B-7B: 6.9B total, 1.3B active with both embeddings (1.07B without the input embedding... and head)
    assert 6.8e9 < total + 50304 * 2048 < 7.0e9 and 1.2e9 < active + 50304 * 2048 < 1.35e9
    dense = compose_run(["model=dense-1b"])
    resolve_model_config(dense.model, 50304)
    with torch.device("meta"):
        dense_n = Transformer(dense.model).num_params()
    assert abs(dense_n - active) / active < 0.005  # the benchmark's dense row has the same active parameters
    tiny = compose_run(["model=moe-tiny"])
    resolve_model_config(tiny.model, 50304)
    model = build_model(tiny.model, causal=False, device=CPU, seed=0)
    assert torch.equal(model.layers[0].mlp.router.bias, torch.zeros(8))  # buffers initialised after to_empty
    assert model.layers[1].mlp.experts.fc2_weight.std() < 0.7 * model.layers[1].mlp.experts.fc1_weight.std()


@pytest.mark.parametrize("objective", ["mdlm", "ar", "bd3lm", "sft"])
def test_every_objective_trains_a_step_with_moe(objective, fast_cfg, tmp_path):
    from difflm.training.trainer import Trainer

    extra = {"bd3lm": ["objective.block_size=8"], "sft": []}.get(objective, [])
    if objective == "sft":
        from tests.test_sft import GSM8K

        if not GSM8K.exists():
            pytest.skip("GSM8K not present under /work/shared/data")
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(open(GSM8K).readlines()[:8]))
        extra = [f"data.path={pairs}", "data.prompt_field=question", "data.response_field=answer",
                 "data.seq_len=96", "data.valid_fraction=0.25", "objective.random_length_prob=0"]
    cfg = fast_cfg("model=moe-tiny", f"objective={objective}", *extra, "train.max_steps=1", "train.eval_every=1",
                   "train.eval_windows=2", "train.eval_mc_samples=1", "train.save_every=0", "logger.log_every=1",
                   "device=cpu")
    metrics = Trainer(cfg, tmp_path / "run", CPU).fit()
    assert metrics["step"] == 1 and 0 < metrics["loss"] < 30 and math.isfinite(metrics["val_nelbo"])
    assert 1.0 <= metrics["moe/load_max_mean"] <= 8 / 2 and metrics["moe/aux_loss"] > 0
    assert {"moe/load_max_mean/0", "moe/load_max_mean/1", "moe/z_loss", "moe/bias_norm"} <= set(metrics)


@pytest.mark.parametrize("overrides,world,needle", [
    (["model.moe.top_k=9"], 1, "model.moe.top_k=9 must be <= model.moe.num_experts=8"),
    (["model.moe.score_func=relu"], 1, "model.moe.score_func='relu'"),
    (["model.moe.capacity_factor=0"], 1, "model.moe.capacity_factor=0"),
    (["model.moe.bias_update_rate=-1"], 1, "model.moe.bias_update_rate=-1"),
    (["parallel=ep2", "parallel.ep=3"], 6, "parallel.ep=3 does not divide model.moe.num_experts=8"),
    (["parallel=ep2", "parallel.ep=4"], 2, "parallel.ep=4 does not divide parallel.dp_shard=2"),
    (["parallel=ep2", "model=tiny"], 2, "parallel.ep=2 needs a mixture-of-experts model"),
    (["parallel=cp2"], 2, "parallel.cp=2 with model.moe.num_experts=8 is not supported"),
    (["model.moe.fp8_experts=true", "model.moe.fused_experts=true"], 1, "two kernels for the same GEMMs"),
    (["model.moe.fused_experts=true", "model.backend=torch"], 1,
     "this run has model.backend=torch on cpu: set model.moe.fused_experts=false"),
])
def test_bad_moe_settings_are_one_line_errors(overrides, world, needle):
    from difflm.config.validate import check_choices, check_model, check_parallel, resolve_device

    cfg = compose_run(["model=moe-tiny", "data.seq_len=32", "train.global_batch_size=12", "train.micro_batch_size=1",
                       "device=cpu", *overrides])
    with pytest.raises(DifflmError) as err:
        check_choices(cfg)
        check_model(cfg.model)
        check_parallel(cfg, world, resolve_device("cpu"))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,world,needle", [
    (["model.moe.fp8_experts=true", "precision=bf16"], 1, "inside an FP8 run and this run is precision=bf16"),
    (["model.moe.fused_experts=true", "parallel=fsdp"], 2, "FSDP2, pipelines, LoRA"),
    (["model.moe.fused_experts=true", "model.fuse_wgrad_accumulation=false"], 1, "FSDP2, pipelines"),
    (["model.moe.fp8_experts=true", "precision=fp8", "lora=attn_mlp"], 1, "FSDP2, pipelines, LoRA"),
    (["model.moe.fused_experts=true"], 1, "model.moe.fused_experts=true runs quack's CUDA kernels and this run is on cpu"),
    (["model=tiny", "model.moe.fused_experts=true"], 1, "model.moe.num_experts=0: drop it"),
    # off a GPU the TE kernel set is no fix: only dropping the key is (on a GPU: both keys FP8 experts need)
    (["model.backend=torch", "model.moe.fp8_experts=true", "precision=fp8"], 1,
     "(a CUDA GPU with model.backend=te precision=fp8) and this run has model.backend=torch on cpu: set "
     "model.moe.fp8_experts=false"),
])
def test_moe_expert_kernels_are_refused_where_they_cannot_run(overrides, world, needle):
    """fp8_experts / fused_experts run on the TE kernel set's FP32 main_grad accumulation: each layout, precision or
    device that cannot run them is one line naming the key (checked on the resolved layout, before any kernel)."""
    from difflm.config.validate import check_moe_kernels, resolve_device
    from difflm.parallel.mesh import ParallelDims

    cfg = compose_run(["model=moe-tiny", "model.backend=te", "data.seq_len=32", "train.global_batch_size=12",
                       "train.micro_batch_size=1", *overrides])
    with pytest.raises(DifflmError) as err:
        check_moe_kernels(cfg, ParallelDims.from_config(cfg.parallel, world), resolve_device("cpu"))
    assert needle in str(err.value) and "\n" not in str(err.value)
    planned = compose_run(["model=moe-tiny", "model.backend=torch", "model.moe.fp8_experts=true"])
    with pytest.raises(DifflmError, match="this run has model.backend=torch: set model.backend=te precision=fp8, or "
                                          "model.moe.fp8_experts=false"):  # the GPU difflm-plan plans for
        check_moe_kernels(planned, ParallelDims.from_config(planned.parallel, 1), None)
    ok = compose_run(["model=moe-tiny", "model.backend=te", "precision=fp8", "model.moe.fp8_experts=true"])
    check_moe_kernels(ok, ParallelDims.from_config(ok.parallel, 1), resolve_device("cpu"))  # one GPU, FP8: accepted


def test_moe_model_under_te_kernels_matches_torch_kernels(fake_te):
    """The one model builds its MoE MLP under either kernel set (the same torch module: the TE set's attention
    around it): same names, same logits, no TE metadata in the MLP slot; TE + TP + MoE is refused in one line."""
    from difflm.config.validate import check_parallel, resolve_device
    from difflm.model import Transformer, resolve_model_config
    from difflm.model.te_kernels import TEKernels, te_module_names, te_to_torch_state_dict, torch_to_te_state_dict

    cfg = compose_run(["model=moe-tiny"]).model
    resolve_model_config(cfg, 128)
    ref = Transformer(cfg)
    ref.init_weights(3)
    te_model = Transformer(cfg, kernels=TEKernels(cfg, device="cpu"))
    te_model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))  # strict: the names line up
    assert not any(k.startswith("layers.0.mlp") and k.endswith("_extra_state") for k in te_model.state_dict())
    assert "layers.0.mlp" not in te_module_names(cfg) and "layers.0.attention.qkv" in te_module_names(cfg)
    ref.load_state_dict(te_to_torch_state_dict(te_model.state_dict()))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(te_model.eval()(x), ref.eval()(x), atol=1e-5, rtol=1e-5)
    run = compose_run(["model=moe-tiny", "model.backend=te", "parallel=tp2", "data.seq_len=32", "device=cpu"])
    with pytest.raises(DifflmError, match="the TE kernels run MoE layers without tensor parallelism"):
        check_parallel(run, 2, resolve_device("cpu"))


def test_export_of_an_moe_run_matches_logits_and_sampler(fast_cfg, tmp_path):
    from transformers import AutoModel

    from difflm.generate import generate_ids
    from difflm.interop.export import export_run
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("model=moe-tiny", "model.moe.score_func=sigmoid", "model.moe.norm_topk_prob=true",
                   "model.moe.bias_update_rate=0.01", "train.max_steps=2", "train.save_every=2", "train.eval_every=0",
                   "optim.lr=1e-2", "device=cpu")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    model, tok = trainer.model.eval(), trainer.tok
    assert model.layers[0].mlp.router.bias.abs().sum() > 0  # the aux-free bias moved and is exported
    out = export_run(cfg.run.dir, tmp_path / "hf")
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    assert hf.config.moe_num_experts == 8 and hf.config.moe_score_func == "sigmoid"
    assert torch.equal(hf.layers[0].mlp.router.bias, model.layers[0].mlp.router.bias)
    ids = torch.randint(0, 50277, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-5, diff
    prompt = torch.tensor([tok.tokenizer("ROMEO:")["input_ids"]] * 2)
    for kw in (dict(temperature=0.0, remasking="low_confidence"), dict(temperature=0.7, remasking="random")):
        gen = OmegaConf.create({"length": 16, "steps": 8, "block_length": 8, "seed": 3, **kw})
        ours = generate_ids(model, tok, prompt, gen, causal=False)
        theirs = hf.generate(prompt, steps=8, gen_length=16, block_length=8,
                             generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(theirs[:, prompt.shape[1]:], ours), kw


def test_global_batch_balancing_uses_the_steps_counts():
    """``model.moe.balance_over=global_batch``: each micro-batch's aux loss is E * sum_i f_i P_i with f_i from the
    expert counts of the step so far (the last micro-batch: the whole batch's), P_i its own mean probability; computed
    here by hand from the router's probabilities and top-k choices. The router gradient is that of the hand-computed
    loss; moe_step starts the next step from zero counts."""
    from difflm.model.layers import rms_norm
    from difflm.model.moe import moe_step

    coeff = 0.5
    layer = make_layer(seed=3, aux_loss_coeff=coeff, z_loss_coeff=0.0, balance_over="global_batch").train()
    micro = make_layer(seed=3, aux_loss_coeff=coeff, z_loss_coeff=0.0).train()  # the per-micro-batch loss
    torch.manual_seed(1)
    xs = [torch.randn(2, 5, 16), torch.randn(2, 3, 16)]  # micro-batches of unequal token counts
    e = layer.num_experts

    def probs_and_counts(x):
        w = layer.router.weight.detach().clone().requires_grad_(True)
        h = rms_norm(x, layer.layer_norm_weight.detach(), layer.eps).reshape(-1, 16)
        probs = torch.softmax(h.float() @ w.t(), dim=-1)
        top = probs.topk(2, dim=-1).indices
        return w, probs, torch.bincount(top.flatten(), minlength=e).float()

    hand, grads = [], []
    seen = torch.zeros(e)
    for x in xs:
        w, probs, counts = probs_and_counts(x)
        seen = seen + counts
        aux = coeff * e * ((seen / seen.sum()) * probs.mean(dim=0)).sum()
        aux.backward()
        hand.append(aux.item())
        grads.append(w.grad.clone())
    layer.loss_scale = 1.0
    for x in xs:
        out = layer(x)
        (out * 0).sum().backward()  # only the attached aux loss sends gradient to the router
    assert torch.equal(layer.balance_tokens, seen)  # the whole batch's counts: 2 * (10 + 6) slots
    assert float(seen.sum()) == 2 * (10 + 6)
    assert layer.step_losses[0].item() == pytest.approx(sum(hand), rel=1e-5)
    torch.testing.assert_close(layer.router.weight.grad, grads[0] + grads[1], rtol=1e-4, atol=1e-6)
    # the last micro-batch's loss is the one of the whole batch's counts, which the per-micro-batch loss is not
    _, probs2, counts2 = probs_and_counts(xs[1])
    per_micro = coeff * e * ((counts2 / counts2.sum()) * probs2.mean(dim=0)).sum().item()
    micro(xs[0])
    micro.step_losses.zero_()
    micro(xs[1])
    assert micro.step_losses[0].item() == pytest.approx(per_micro, rel=1e-5)
    assert per_micro != pytest.approx(hand[1], rel=1e-3)
    moe_step([layer])
    assert not layer.balance_tokens.any()


def _balance_worker(rank, world, port, out):
    import torch.distributed as dist

    from difflm.model.moe import set_moe_balance_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layer = make_layer(seed=3, aux_loss_coeff=1.0, z_loss_coeff=0.0, balance_over="global_batch").train()
    set_moe_balance_group([layer], dist.group.WORLD)
    torch.manual_seed(10 + rank)  # each data-parallel rank its own tokens
    layer(torch.randn(2, 4 + 2 * rank, 16))
    torch.save({"tokens": layer.balance_tokens.clone(), "aux": layer.step_losses[0].item()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_global_batch_balancing_sums_the_counts_of_data_parallel_ranks(tmp_path):
    """With a data-parallel group, each rank's f_i is from the counts of every rank's tokens (2 gloo ranks with 8 and
    12 tokens), its P_i from its own: computed here by hand from each rank's router."""
    from conftest import spawn_ranks
    from difflm.model.layers import rms_norm

    got = spawn_ranks(_balance_worker, 2, tmp_path)
    layer = make_layer(seed=3)
    probs, counts = [], []
    for rank in range(2):
        torch.manual_seed(10 + rank)
        h = rms_norm(torch.randn(2, 4 + 2 * rank, 16), layer.layer_norm_weight.detach(), layer.eps).reshape(-1, 16)
        p = torch.softmax(h.float() @ layer.router.weight.detach().t(), dim=-1)
        probs.append(p)
        counts.append(torch.bincount(p.topk(2, dim=-1).indices.flatten(), minlength=layer.num_experts).float())
    total = counts[0] + counts[1]
    assert float(total.sum()) == 2 * (8 + 12)
    for rank in range(2):
        assert torch.equal(got[rank]["tokens"], total)
        want = layer.num_experts * ((total / total.sum()) * probs[rank].mean(dim=0)).sum().item()
        assert got[rank]["aux"] == pytest.approx(want, rel=1e-5)


def test_moe_statistics_settled_a_step_late_are_their_own_steps(fast_cfg, tmp_path):
    """On a GPU the host reads a step's outcome after launching the next (``settle_lag`` 1). A logging step's MoE
    statistics travel with its outcome (difflm.model.moe.moe_step_stats, copied behind the step), so the step is not
    settled before the next launch, and its row holds its own statistics: the same rows as reading each step at once
    (the router bias moves every step, so the next step's statistics would differ)."""
    import json

    from difflm.training.trainer import Trainer

    rows = {}
    for lag in (0, 1):
        cfg = fast_cfg("model=moe-tiny", "model.moe.bias_update_rate=0.01", "train.max_steps=5", "train.eval_every=0",
                       "train.save_every=0", "logger.log_every=1", "device=cpu", f"run.dir={tmp_path / f'lag{lag}'}")
        trainer = Trainer(cfg, cfg.run.dir, CPU)
        trainer.settle_lag = lag
        order, launch, settle = [], trainer.train_step, trainer._settle
        trainer.train_step = lambda: (out := launch(), order.append(("launch", trainer.step)))[0]
        trainer._settle = lambda record: (order.append(("settle", record.step)), settle(record))[1]
        trainer.fit()
        if lag:  # every step logs, and none is settled before the next is launched (but the last)
            assert order[:5] == [("launch", 1), ("launch", 2), ("settle", 1), ("launch", 3), ("settle", 2)]
        lines = (tmp_path / f"lag{lag}" / "metrics.jsonl").read_text().splitlines()
        rows[lag] = [{k: v for k, v in json.loads(x).items() if k.startswith("moe/") or k == "step"} for x in lines]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4, 5]
    assert rows[0] == rows[1]
    # the statistics change every step, so a row holding the next step's would differ from reading it at once
    norms = [r["moe/bias_norm"] for r in rows[1]]
    assert len(set(norms)) == len(norms) and norms[0] > 0, norms


@pytest.mark.parametrize("extra,needle", [
    (["model.moe.aux_loss_coeff=0.05"], "model.moe.aux_loss_coeff=0.05: the runs differ by model.moe.aux_loss_coeff "
                                        "and model.moe.bias_update_rate"),
    (["+model.moe.bias_update_rate=0.01"], "+model.moe.bias_update_rate=0.01: the runs differ by"),
    (["model=tiny"], "model=tiny with model.moe.num_experts=0 is a dense model"),
    (["model.moe.num_experts=0"], "model=moe-tiny with model.moe.num_experts=0 is a dense model"),
])
def test_balance_sweep_refuses_overrides_that_leave_nothing_to_compare(extra, needle, tmp_path):
    """scripts/moe_balance.py compares the expert load of its settings: an extra override of the keys they vary would
    make every run the same, and a dense model has no expert load; both are refused before a run directory is made."""
    from conftest import load_script

    balance = load_script("moe_balance")
    for name in balance.SETTINGS:
        with pytest.raises(DifflmError) as err:
            balance.run(name, 1, tmp_path, extra)
        assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)
    assert not list(tmp_path.iterdir())
