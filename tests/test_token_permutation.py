"""The MoE token permutation (gathers both ways, the gate-weighted combine) against autograd through plain indexing,
and the combine's Triton kernels against a float64 reference."""
import pytest
import torch
from triton_interpreter import interpreted_json

from difflm.model.token_permutation import SlotOrder


def _reference(h, expert_ids, weights, kept, expert):
    """What the layer computed with autograd's indexing: sort, gather, run, pad, unsort, weight."""
    t, k = expert_ids.shape
    order = torch.argsort(expert_ids.flatten(), stable=True)
    y_sorted = expert(h[order[:kept] // k])
    y_sorted = torch.cat([y_sorted, y_sorted.new_zeros(t * k - kept, h.shape[1])])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(t * k, device=order.device)
    return torch.bmm(weights.unsqueeze(1), y_sorted[inverse].view(t, k, -1)).squeeze(1)


def _permuted(h, expert_ids, weights, kept, expert):
    slots = SlotOrder(expert_ids)
    return slots.combine(expert(slots.permute(h, kept)), weights)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropped", [0, 7])
def test_permute_and_unpermute_equal_autograd_indexing(dtype, dropped, device):
    torch.manual_seed(0)
    t, k, d, e = 13, 3, 8, 5
    ids = torch.randint(0, e, (t, k))
    if dropped:  # capacity: dropped slots carry id E and sort last
        ids.view(-1)[torch.randperm(t * k)[:dropped]] = e
    kept = t * k - dropped
    ids = ids.to(device)
    scale = torch.randn(kept, d, dtype=dtype).to(device)  # an "expert" that depends on the row: the order matters
    w = torch.rand(t, k, dtype=dtype).to(device)
    outs, grads = [], []
    for fn in (_reference, _permuted):
        h = torch.randn(t, d, dtype=dtype, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        out = fn(h, ids, w, kept, lambda x: torch.tanh(x) * scale)
        out.backward(torch.cos(torch.arange(t * d, dtype=dtype)).view(t, d).to(device))
        outs.append(out.detach())
        grads.append(h.grad)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(grads[1], grads[0], **tol)
    assert grads[0].abs().sum() > 0


def test_slot_order_sorts_by_expert_keeping_token_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    slots = SlotOrder(ids)
    assert slots.order.tolist() == [1, 2, 3, 5, 0, 4]
    assert torch.equal(slots.order[slots.inverse], torch.arange(6))
    h = torch.arange(3.0).view(3, 1)
    assert slots.permute(h, 6).flatten().tolist() == [0.0, 1.0, 1.0, 2.0, 0.0, 2.0]
    back = slots.unpermute(torch.arange(5.0).view(5, 1))  # the last sorted slot dropped: a zero row
    assert back.view(3, 2).tolist() == [[4.0, 0.0], [1.0, 2.0], [0.0, 3.0]]


_COMBINE_CASES = [(7, 3, 40, 0), (9, 6, 1100, 5), (5, 8, 16, 40), (0, 2, 8, 0)]  # T, k, d, dropped slots


def _combine_errors(device, dtype, cases):
    """Max error (absolute below 1, relative above) of :func:`difflm.kernels.moe_combine.forward` / ``backward``
    against float64 autograd: [T, k, d, dropped, out, dy, dw] per case (dropped slots carry id E, so they sort last
    and add nothing)."""
    from difflm.kernels import moe_combine

    torch.manual_seed(0)
    rows = []
    for t, k, d, dropped in cases:
        ids = torch.randint(0, 4, (t, k))
        if dropped:
            ids.view(-1)[torch.randperm(t * k)[:dropped]] = 4
        inverse = SlotOrder(ids).inverse.to(device)
        kept = t * k - dropped
        # inputs representable in ``dtype`` and the weights in FP32: the reference sees what the kernels read
        y, g = (torch.randn(n, d).to(dtype).double() for n in (kept, t))
        w = torch.rand(t, k).double()
        out = moe_combine.forward(y.to(device, dtype), inverse, w.float().to(device))
        dy, dw = moe_combine.backward(g.to(device, dtype), y.to(device, dtype), inverse, w.float().to(device))
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        ref = (ww.unsqueeze(-1) * torch.cat([yy, yy.new_zeros(t * k - kept, d)])[inverse.cpu()].view(t, k, d)).sum(1)
        ref.backward(g)

        def err(a, b):  # absolute below 1, relative above: a rounding to a dtype errs in proportion to the value
            return ((a.cpu().double() - b).abs() / (b.abs() + 1)).max().item() if b.numel() else 0.0

        rows.append([t, k, d, dropped, err(out, ref.detach()), err(dy, yy.grad), err(dw, ww.grad)])
    return rows


_INTERPRETED = """
import json
from test_token_permutation import _COMBINE_CASES, _combine_errors
import torch
print(json.dumps(_combine_errors("cpu", torch.float32, _COMBINE_CASES)))
"""


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_combine_kernels_match_float64_in_the_interpreter():
    """The Triton combine on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported,
    so in a process of its own), in float32: k = 3, 6 (not a power of two), 8; d below, above and across the tiles (a
    backward loop of three steps); dropped slots; every slot dropped; no tokens."""
    pytest.importorskip("triton")
    rows = interpreted_json(_INTERPRETED)
    assert [r[:4] for r in rows] == [list(c) for c in _COMBINE_CASES]
    for t, k, d, dropped, out, dy, dw in rows:  # FP32 sums of up to d products of unit-size values
        assert out < 2e-6 and dy < 2e-6 and dw < 2e-5 * max(d, 1) ** 0.5, (t, k, d, dropped, out, dy, dw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton combine runs on CUDA here")
def test_combine_kernels_match_float64_on_cuda():
    """BF16 activations at the MoE presets' hidden size 2048, FP32 weights and sums: the output and dy within one BF16
    rounding (unit roundoff 2^-8 of the value; sums of 8 unit-size products reach 8 and more), dw (FP32 out) within
    FP32's sum of 2048 products."""
    rows = _combine_errors("cuda", torch.bfloat16, [(1000, 8, 2048, 0), (333, 6, 2048, 100)])
    for t, k, d, dropped, out, dy, dw in rows:
        assert out < 2**-8 and dy < 2**-8 and dw < 1e-3, (t, k, d, dropped, out, dy, dw)
