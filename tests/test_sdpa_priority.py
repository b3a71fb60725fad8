"""``model.attention_backend=sdpa`` puts cuDNN's fused attention first on Hopper and newer GPUs:
PyTorch's own order starts with its FlashAttention-2 kernel, about half cuDNN's speed on an H200. CUDA only."""
from __future__ import annotations

import pytest
import torch

from difflm.model.attention import attend, sdpa_priority

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
hopper = pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of compute capability 9.0 or newer")


def _kernels(fn) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches (its forward and backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _qkv(b=2, s=256, h=8, h_kv=8, d=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return [t.requires_grad_(True) for t in (q, k, v)]


def _fwd_bwd(fn, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def _math_reference(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).transpose(1, 2)


@hopper
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_unmasked_sdpa_runs_cudnn_first_and_matches_the_math_kernel(causal, compiled):
    order = sdpa_priority(torch.cuda.current_device())
    assert order is not None and order[0].name == "CUDNN_ATTENTION"
    before = torch._C._get_sdp_priority_order()
    q, k, v = _qkv()
    grad = torch.randn_like(q)

    def fn(q, k, v):
        return attend(q, k, v, causal=causal, backend="sdpa", layout="bshd")

    run = torch.compile(fn) if compiled else fn
    _fwd_bwd(run, q, k, v, grad)  # compile / warm up
    names = _kernels(lambda: _fwd_bwd(run, q, k, v, grad))
    assert any("cudnn" in n.lower() for n in names), names
    assert not any("flash_fwd" in n or "flash_bwd" in n for n in names), names
    assert torch._C._get_sdp_priority_order() == before  # the order is set for the call only

    out, grads = _fwd_bwd(run, q, k, v, grad)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _math_reference(qr, kr, vr, causal)
    ref.backward(grad.float())
    assert float((out - ref.detach()).norm() / ref.norm()) < 1e-2
    for g, r in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert float((g - r.float()).norm() / r.float().norm()) < 2e-2


@hopper
def test_masked_and_kv_cached_causal_calls_keep_pytorchs_order():
    q, k, v = _qkv(s=128)
    grad = torch.randn_like(q)
    mask = torch.ones(1, 1, 128, 128, dtype=torch.bool, device="cuda").tril()
    names = _kernels(lambda: _fwd_bwd(lambda q, k, v: attend(q, k, v, causal=False, backend="sdpa", layout="bshd",
                                                             attn_mask=mask), q, k, v, grad))
    assert not any("cudnn" in n.lower() for n in names), names  # memory-efficient kernel, as PyTorch picks

    with torch.no_grad():  # 16 new queries against 128 cached keys, causal: PyTorch's order decides
        q16 = q[:, -16:].detach()
        names = _kernels(lambda: attend(q16, k.detach(), v.detach(), causal=True, backend="sdpa", layout="bshd"))
    assert not any("cudnn" in n.lower() for n in names), names


@hopper
def test_a_users_own_sdpa_kernel_choice_stands():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(s=128)
    grad = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        names = _kernels(lambda: _fwd_bwd(lambda q, k, v: attend(q, k, v, causal=False, backend="sdpa",
                                                                 layout="bshd"), q, k, v, grad))
    assert not any("cudnn" in n.lower() for n in names), names
    assert any("flash" in n.lower() for n in names), names
