"""The token embedding whose gradient accumulates in FP32 ``main_grad`` (difflm.kernels.embedding.Embedding): against
``nn.Embedding`` followed by the residual stream's cast, over two micro-batches of one step and the next step, on the
CPU under BF16 autocast (CUDA where available, where the adds are atomic)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from difflm.kernels.embedding import Embedding
from difflm.model.te_kernels import accumulate_into_grad

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _micro_batches(vocab: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (3, 40), generator=g).to(device) for _ in range(2)]  # repeats ids within a batch
    grads = [torch.randn(3, 40, 16, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    return ids, grads


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_in_main_grad_equals_nn_embedding(device):
    vocab, dim = 50, 16
    ref = nn.Embedding(vocab, dim, device=device)
    emb = accumulate_into_grad_module(Embedding(vocab, dim, device=device))
    with torch.no_grad():
        emb.weight.copy_(ref.weight)
    for step in range(2):
        ids, grads = _micro_batches(vocab, device, seed=step)
        ref.zero_grad(set_to_none=True)
        emb.zero_grad(set_to_none=True)  # as the optimizer does: the next forward zeroes main_grad (attach_main_grads)
        for i, g in zip(ids, grads):
            with torch.autocast(device, dtype=torch.bfloat16):
                want = ref(i).to(torch.bfloat16)  # TEKernels.enter's cast of the residual stream
                got = emb(i)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # rounding, then gathering: the same values
            want.backward(g)
            got.backward(g)
        assert emb.weight.grad is emb.weight.main_grad and emb.weight.main_grad.dtype == torch.float32
        assert float(ref.weight.grad.abs().sum()) > 0
        torch.testing.assert_close(emb.weight.main_grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
        with torch.no_grad():  # a step changes the weight: the next step gathers from a fresh cast
            ref.weight.add_(0.01)
            emb.weight.add_(0.01)


@pytest.mark.parametrize("device", DEVICES)
def test_other_forwards_are_nn_embedding(device):
    """Without main_grad (no accumulate_into_grad), without gradients or outside autocast: ``nn.Embedding``."""
    vocab, dim = 50, 16
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    plain = Embedding(vocab, dim, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = plain(ids)
    assert out.dtype == torch.float32  # nn.Embedding is not autocast
    out.sum().backward()
    assert plain.weight.grad is not None and getattr(plain.weight, "main_grad", None) is None
    hooked = accumulate_into_grad_module(Embedding(vocab, dim, device=device))
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        assert hooked(ids).dtype == torch.float32 and getattr(hooked.weight, "main_grad", None) is None
    assert hooked(ids).dtype == torch.float32  # no autocast: the weight's dtype, gradient through autograd


def accumulate_into_grad_module(module: nn.Module) -> nn.Module:
    accumulate_into_grad(module, ["weight"])
    return module
