"""The MoE token permutation's gathers against autograd through plain indexing."""
import pytest
import torch

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
    return torch.bmm(weights.unsqueeze(1), slots.unpermute(expert(slots.permute(h, kept)))).squeeze(1)


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
