"""``model.fused_mlp=true``: the MLP half block on quack's fused GEMMs (difflm.kernels.quack_mlp), and the attention
half's norm + QKV projection that hands the residual on (difflm.kernels.quack_norm_linear).

On the CPU: what the setting refuses, with the key and the fix. On a Hopper/Blackwell GPU with quack and Transformer
Engine: the fused half block against TE's ``LayerNormMLP`` plus the two residual adds, and the fused QKV input against
TE's ``LayerNormLinear`` plus the residual's autograd sum, from the same weights (output and every gradient within BF16
rounding), weight gradients accumulated into FP32 ``main_grad`` over micro-batches,
the state-dict layout, and a whole model's loss and gradients against the unfused model.
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_run
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)

from difflm.config.validate import check_parallel, check_precision
from difflm.errors import DifflmError
from difflm.kernels.quack_mlp import quack_unavailable_reason


def run_cfg(*overrides):
    return compose_run(overrides)


def _pretend_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


# ------------------------------------------------------------------ refusals (CPU)
@pytest.mark.parametrize("overrides,needle", [
    (["model.backend=torch", "model.fused_mlp=true"], "model.fused_mlp=true is a slot of the TE kernel set and this run has "
                               "model.backend=torch: set model.backend=te"),
    (["model.backend=te", "model.fused_mlp=true", "precision=fp8"],
     "model.fused_mlp=true runs BF16 GEMMs (quack) and this run is precision=fp8"),
    (["model.backend=te", "model.fused_mlp=true", "precision=fp32"], "this run is precision=fp32"),
    (["model=moe-tiny", "model.backend=te", "model.fused_mlp=true"], "model.moe.num_experts=8"),
])
def test_fused_mlp_refusals_name_the_key(fake_te, monkeypatch, overrides, needle):
    _pretend_hopper(monkeypatch)
    cfg = run_cfg("precision=bf16", *overrides)
    with pytest.raises(DifflmError, match=needle.replace("(", "\\(").replace(")", "\\)")):
        check_precision(cfg, torch.device("cuda"))


def test_fused_mlp_refused_on_cpu_and_old_gpus(fake_te, monkeypatch):
    cfg = run_cfg("model.backend=te", "model.fused_mlp=true", "precision=bf16")
    assert quack_unavailable_reason(torch.device("cpu")) == (
        "model.fused_mlp=true runs quack's CUDA kernels and this run is on cpu: set model.fused_mlp=false")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(DifflmError, match="compute capability 9.x or 10.x\\) and this GPU is 8.x"):
        check_precision(cfg, torch.device("cuda"))


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="quack is installed here")
def test_fused_mlp_without_quack_says_how_to_install(fake_te, monkeypatch):
    _pretend_hopper(monkeypatch)
    cfg = run_cfg("model.backend=te", "model.fused_mlp=true", "precision=bf16")
    with pytest.raises(DifflmError, match="pip install quack-kernels"):
        check_precision(cfg, torch.device("cuda"))


def test_fused_mlp_refused_under_tensor_parallelism():
    cfg = run_cfg("model.backend=te", "model.fused_mlp=true", "parallel.tp=2")
    with pytest.raises(DifflmError, match="parallel.tp=2 with model.fused_mlp=true"):
        check_parallel(cfg, 2, torch.device("cpu"))


def test_fused_mlp_refused_with_cuda_graphs():
    from difflm.training.cuda_graphs import cuda_graphs_unavailable_reason

    cfg = run_cfg("model.backend=te", "model.fused_mlp=true", "train.cuda_graphs=true")
    assert "model.fused_mlp=true" in cuda_graphs_unavailable_reason(cfg, 1, torch.device("cuda"))


# ------------------------------------------------------------------ the kernels (GPU)
def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs Transformer Engine"
    return quack_unavailable_reason()


gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


def _half_blocks(d, f):
    """(TE LayerNormMLP, fused ResidualNormMLP) from the same weights, both with FP32 main_grad accumulation."""
    from difflm.model.te_kernels import TEKernels

    mods = []
    for fused in (False, True):
        cfg = SimpleNamespace(fused_mlp=fused, fuse_wgrad_accumulation=True, attention_backend="sdpa")
        mods.append(TEKernels(cfg, device="cuda").norm_mlp(d, f, eps=1e-5))
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        mods[0].layer_norm_weight.copy_(1 + 0.1 * torch.randn(d, device="cuda", generator=g))
        mods[0].fc1_weight.copy_(0.05 * torch.randn(2 * f, d, device="cuda", generator=g))
        mods[0].fc2_weight.copy_(0.05 * torch.randn(d, f, device="cuda", generator=g))
    mods[1].load_state_dict(mods[0].state_dict())
    return mods


def _run(mlp, fused, a, x, dy):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if fused:
            y = mlp(a, x)
        else:
            s = x + a
            y = s + mlp(s)
    torch.autograd.backward(y, dy)
    return y


def _rel(u, v):
    return float((u.float() - v.float()).abs().max() / v.float().abs().max())


@gpu
def test_fused_half_block_matches_te():
    d, f, n = 256, 768, 1000  # a token count that is not a multiple of the GEMM tiles
    te_mlp, quack_mlp = _half_blocks(d, f)
    g = torch.Generator(device="cuda").manual_seed(1)
    a0 = torch.randn(2, n // 2, d, device="cuda", generator=g).bfloat16()
    x0 = torch.randn(2, n // 2, d, device="cuda", generator=g).bfloat16()
    dy = torch.randn(2, n // 2, d, device="cuda", generator=g).bfloat16()
    results = []
    for mlp, fused in ((te_mlp, False), (quack_mlp, True)):
        a, x = a0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
        y = _run(mlp, fused, a, x, dy)
        assert y.dtype == torch.bfloat16 and y.shape == (2, n // 2, d)
        results.append((y, a.grad, x.grad, mlp.layer_norm_weight.grad, mlp.fc1_weight.main_grad,
                        mlp.fc2_weight.main_grad))
        assert mlp.fc1_weight.grad is mlp.fc1_weight.main_grad  # the optimizer sees the FP32 accumulator
    names = ("out", "d_branch", "d_residual", "d_norm", "d_fc1", "d_fc2")
    for name, ref, got in zip(names, *results):
        assert got.shape == ref.shape, name
        assert _rel(got, ref) < 2e-2, (name, _rel(got, ref))
    assert torch.equal(results[1][1], results[1][2])  # both residual inputs get d(x + a)


@gpu
def test_fused_weight_grads_accumulate_over_micro_batches():
    d, f, n = 128, 384, 512
    _, mlp = _half_blocks(d, f)
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [[torch.randn(n, d, device="cuda", generator=g).bfloat16() for _ in range(3)] for _ in range(2)]
    singles = []
    for a, x, dy in batches:
        for p in mlp.parameters():
            p.grad = None
        _run(mlp, True, a.requires_grad_(True), x.requires_grad_(True), dy)
        singles.append((mlp.fc1_weight.main_grad.clone(), mlp.fc2_weight.main_grad.clone()))
    for p in mlp.parameters():
        p.grad = None
    for a, x, dy in batches:
        _run(mlp, True, a.detach().requires_grad_(True), x.detach().requires_grad_(True), dy)
    for i, w in enumerate((mlp.fc1_weight, mlp.fc2_weight)):
        assert w.main_grad.dtype == torch.float32
        torch.testing.assert_close(w.main_grad, singles[0][i] + singles[1][i], rtol=1e-5, atol=1e-6)


@gpu
def test_fused_state_dict_has_te_layout():
    te_mlp, quack_mlp = _half_blocks(64, 128)
    assert list(te_mlp.state_dict()) == list(quack_mlp.state_dict())
    for k, v in te_mlp.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, quack_mlp.state_dict()[k]), k


def _norm_linears(d, out):
    """(TE LayerNormLinear, fused ResidualNormLinear) from the same weights, both with FP32 main_grad accumulation."""
    from difflm.model.te_kernels import TEKernels

    mods = [TEKernels(SimpleNamespace(fused_mlp=fused, fuse_wgrad_accumulation=True, attention_backend="sdpa"),
                      device="cuda").norm_linear(d, out, eps=1e-5) for fused in (False, True)]
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        mods[0].layer_norm_weight.copy_(1 + 0.1 * torch.randn(d, device="cuda", generator=g))
        mods[0].weight.copy_(0.05 * torch.randn(out, d, device="cuda", generator=g))
    mods[1].load_state_dict(mods[0].state_dict())
    return mods


@gpu
def test_fused_qkv_input_matches_te():
    """``y = W rmsnorm(x)`` and the residual ``x`` handed on: output, the input's gradient (the norm's and the
    residual's, summed in the norm kernel), the norm scale's and the weight's, against TE plus autograd's sum."""
    d, out, n = 256, 768, 1000
    te_qkv, quack_qkv = _norm_linears(d, out)
    assert list(te_qkv.state_dict()) == list(quack_qkv.state_dict())
    g = torch.Generator(device="cuda").manual_seed(4)
    x0 = torch.randn(2, n // 2, d, device="cuda", generator=g)  # FP32, as the embedding hands the first block
    dy = torch.randn(2, n // 2, out, device="cuda", generator=g).bfloat16()
    dres = torch.randn(2, n // 2, d, device="cuda", generator=g).bfloat16()
    results = []
    for mod, fused in ((te_qkv, False), (quack_qkv, True)):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, res = mod(x, pass_residual=True) if fused else (mod(x), x.to(torch.bfloat16))
        assert y.dtype == res.dtype == torch.bfloat16 and y.shape == (2, n // 2, out)
        torch.autograd.backward((y, res), (dy, dres))
        results.append((y, x.grad, mod.layer_norm_weight.grad, mod.weight.main_grad))
        assert mod.weight.grad is mod.weight.main_grad
    for name, ref, got in zip(("out", "d_input", "d_norm", "d_weight"), *results):
        assert got.shape == ref.shape, name
        assert _rel(got, ref) < 2e-2, (name, _rel(got, ref))
    without = x0.clone().requires_grad_(True)  # the residual unused: its gradient is None, only the norm's flows
    with torch.autocast("cuda", dtype=torch.bfloat16):
        quack_qkv(without).backward(dy)
    assert _rel(without.grad, results[1][1]) > 1e-1  # the residual's gradient was part of d_input above


@gpu
def test_fused_model_loss_and_grads_match_unfused(monkeypatch):
    """Built as the trainer builds it (on the meta device, then ``to_empty``, which replaces the parameter objects):
    loss and gradients against the unfused model, and every quack weight gradient added in place into ``main_grad``
    (three GEMMs per layer: QKV, fc1, fc2), none handed to autograd to add in a pass of its own."""
    import quack.gemm_interface as qgi

    from difflm.model import build_model

    cfg = run_cfg("model.backend=te", "precision=bf16").model
    cfg.vocab_size, cfg.head_dim = 256, cfg.hidden_size // cfg.num_heads
    models = []
    for fused in (False, True):
        cfg.fused_mlp = fused
        models.append(build_model(cfg, causal=False, device=torch.device("cuda"), seed=0))
    models[1].load_state_dict(models[0].state_dict())
    in_place, real = [], qgi.gemm_add_inplace

    def counted(a, b, out, **kw):
        in_place.append(out.shape)
        return real(a, b, out, **kw)

    monkeypatch.setattr(qgi, "gemm_add_inplace", counted)
    assert type(models[1].layers[0].mlp).__name__ == "ResidualNormMLP"
    assert type(models[1].layers[0].attention.qkv).__name__ == "ResidualNormLinear"
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    losses, grads = [], []
    for m in models:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        qkv = m.layers[0].attention.qkv.weight  # the block calls its QKV module through __call__: the hook ran
        assert qkv.grad is not None and qkv.grad is getattr(qkv, "main_grad", None)
        losses.append(float(loss))
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert len(in_place) == 3 * cfg.num_layers
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[0])
    for name, ref in grads[0].items():
        assert _rel(grads[1][name], ref) < 5e-2, name


def test_fused_mlp_autotune_tunes_the_largest_shape_only(fake_te, monkeypatch):
    _pretend_hopper(monkeypatch)
    import difflm.kernels.quack_mlp as qm

    monkeypatch.setattr(qm, "quack_unavailable_reason", lambda device=None, key="model.fused_mlp": None)
    base = ("model.backend=te", "precision=bf16", "model.fused_mlp=true", "model.fused_mlp_autotune=true")
    check_precision(run_cfg(*base), torch.device("cuda"))  # random-length steps run the default tiles
    check_precision(run_cfg(*base, "objective.random_length_prob=0"), torch.device("cuda"))
    module = torch.nn.Linear(1, 1)  # row counts of steps: short (random length), full, short, full
    assert [qm.most_rows_so_far(module, rows) for rows in (1024, 4096, 2048, 4096, 4095)] == [
        True, True, False, True, False]
    check_precision(run_cfg(*base), torch.device("cuda"), training=False)  # scripts/benchmark.py: one length
    with pytest.raises(DifflmError, match=r"set model.fused_mlp=true \(or model.moe.fused_experts=true"):
        check_precision(run_cfg("model.backend=te", "precision=bf16", "model.fused_mlp=false",
                                "model.fused_mlp_autotune=true"),
                        torch.device("cuda"))
    # the fused MoE experts are quack's GEMMs too: the key tunes them without a fused dense MLP
    check_precision(run_cfg("model=moe-tiny", "model.backend=te", "precision=bf16", "model.fused_mlp=false",
                            "model.moe.fused_experts=true", "model.fused_mlp_autotune=true"), torch.device("cuda"))
    with pytest.raises(DifflmError, match="model.fused_mlp_autotune=true tunes quack's GEMMs"):
        check_precision(run_cfg("model=moe-tiny", "model.backend=te", "precision=bf16", "model.fused_mlp=false",
                                "model.moe.fused_experts=false", "model.fused_mlp_autotune=true"), torch.device("cuda"))


def test_quack_refused_outside_site_packages():
    from difflm.kernels.quack_mlp import outside_site_packages_reason

    assert outside_site_packages_reason("/usr/lib/python3/dist-packages/cutlass/__init__.py") is None
    assert outside_site_packages_reason("/venv/lib/python3.12/site-packages/cutlass/__init__.py") is None
    reason = outside_site_packages_reason("/root/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py")
    assert reason == ("model.fused_mlp=true runs quack's GEMMs, which compile only when the CuTe DSL is installed "
                      "under a directory named site-packages, and it is imported from "
                      "/root/site/nvidia_cutlass_dsl/dsl_packages: install quack-kernels and nvidia-cutlass-dsl with "
                      "pip into the environment, or put a link named site-packages to "
                      "/root/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH instead; or set model.fused_mlp=false")


def test_quack_modules_have_the_recorded_te_layout():
    """On the CPU (no kernels run): the two quack modules' state dicts have the names, shapes and dtypes a real TE
    model recorded for ``LayerNormLinear`` (QKV) and ``LayerNormMLP`` (``fixtures/te_tiny_state_dict.json``), so a
    checkpoint moves between ``model.fused_mlp=true`` and ``false``."""
    import json
    from pathlib import Path

    from difflm.kernels.quack_mlp import ResidualNormMLP
    from difflm.kernels.quack_norm_linear import ResidualNormLinear

    recorded = json.loads((Path(__file__).parent / "fixtures" / "te_tiny_state_dict.json").read_text())
    m = recorded["model"]
    te = {t["name"]: (t["shape"], t["dtype"]) for t in recorded["tensors"]}
    qkv_out = (m["num_heads"] + 2 * m["num_kv_heads"]) * m["head_dim"]
    for prefix, module in (("layers.0.attention.qkv.", ResidualNormLinear(m["hidden_size"], qkv_out, 1e-5)),
                           ("layers.0.mlp.", ResidualNormMLP(m["hidden_size"], m["ffn_hidden_size"], 1e-5))):
        ours = {prefix + k: (list(v.shape), str(v.dtype)) for k, v in module.state_dict().items()}
        assert ours == {k: v for k, v in te.items() if k.startswith(prefix)}
