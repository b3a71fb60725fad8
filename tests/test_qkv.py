"""q, k, v from the fused QKV projection (:mod:`difflm.model.qkv`): the one function both kernel sets run equals the
step-by-step composition (head split, QK-norm module, rotary embedding), in values and gradients; on a GPU the
compiled kernel equals the eager one."""
from __future__ import annotations

import pytest
import torch

from difflm.model.layers import RMSNorm
from difflm.model.qkv import qkv_heads, split_heads
from difflm.model.rope import apply_rope, rope_angles, rope_tables


def _inputs(layout, heads, kv_heads, d=16, b=2, s=12, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (b, s) if layout == "bshd" else (s, b)
    qkv = torch.randn(*lead, (heads + 2 * kv_heads) * d, generator=g).to(device=device, dtype=dtype)
    norms = []
    for _ in range(2):
        n = RMSNorm(d, eps=1e-5).to(device)
        with torch.no_grad():
            n.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
        norms.append(n)
    positions = torch.arange(3, 3 + s, device=device)
    return qkv.requires_grad_(True), norms, rope_tables(rope_angles(positions, d, 10000.0), layout)


def _stepwise(qkv, tables, heads, kv_heads, d, norms):
    """The composition qkv_heads replaces: per-group rows, norm modules, RoPE one tensor at a time."""
    lead = qkv.shape[:2]
    group = heads // kv_heads
    rows = qkv.view(*lead, kv_heads, group + 2, d)
    q = rows[..., :group, :].reshape(*lead, heads, d)
    k, v = rows[..., group, :], rows[..., group + 1, :]
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return apply_rope(q, *tables), apply_rope(k, *tables), v


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_heads_equals_the_stepwise_composition(layout, heads, kv_heads, qk_norm):
    d = 16
    qkv, norms, tables = _inputs(layout, heads, kv_heads, d)
    norms = norms if qk_norm else None
    got = qkv_heads(qkv, tables, heads, kv_heads, d, *(norms or (None, None)))
    assert [t.shape[2:] for t in got] == [(heads, d), (kv_heads, d), (kv_heads, d)]
    assert all(t.is_contiguous() for t in got)
    want = _stepwise(qkv, tables, heads, kv_heads, d, norms)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # gradients, to the projection and to the norm scales
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g) for t in got]
    params = [qkv] + ([n.weight for n in norms] if norms else [])
    grads = torch.autograd.grad(sum((t * w).sum() for t, w in zip(got, weights)), params)
    ref = torch.autograd.grad(sum((t * w).sum() for t, w in zip(want, weights)), params)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_split_heads_reads_megatron_groups():
    """Rows per KV group: its H / H_kv query heads, then its key head, then its value head."""
    heads, kv_heads, d = 4, 2, 3
    qkv = torch.arange((heads + 2 * kv_heads) * d, dtype=torch.float32).view(1, 1, -1)
    q, k, v = split_heads(qkv, heads, kv_heads, d)
    assert q[0, 0, :, 0].tolist() == [0, 3, 12, 15]  # group 0: heads 0, 1; group 1: heads 2, 3
    assert k[0, 0, :, 0].tolist() == [6, 18] and v[0, 0, :, 0].tolist() == [9, 21]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
def test_compiled_qkv_heads_matches_eager_on_cuda(heads, kv_heads):
    d = 128
    qkv, norms, tables = _inputs("bshd", heads, kv_heads, d, b=2, s=256, dtype=torch.bfloat16, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        fused = qkv_heads(qkv, tables, heads, kv_heads, d, *norms)
        eager = qkv_heads(qkv, tables, heads, kv_heads, d, *norms, fused=False)
    w = [torch.randn_like(t) for t in fused]
    params = [qkv, norms[0].weight, norms[1].weight]
    g_fused = torch.autograd.grad(sum((t.float() * x).sum() for t, x in zip(fused, w)), params)
    g_eager = torch.autograd.grad(sum((t.float() * x).sum() for t, x in zip(eager, w)), params)
    for a, b in zip(fused, eager):
        assert a.dtype == torch.bfloat16 and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)
    for a, b in zip(g_fused, g_eager):
        assert (a.float() - b.float()).norm() / b.float().norm() < 1e-2
