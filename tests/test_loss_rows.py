"""``model.last_block_loss_rows``: the last block at the loss rows only (difflm.model.loss_rows).

The model with it against the same weights without it: the logits at the loss rows and every gradient agree (FP32
on the CPU; on a GPU, FlashAttention 4's one-function path with variable-length queries and quack's fused MLP), for
plain masked diffusion, BD3-LM's block mask and packed documents; the rows are built without reading the device;
the settings that cannot take rows (causal, a boolean mask, a KV cache, torch tensor parallelism) run the full block.
"""
from __future__ import annotations

import pytest
import torch

from conftest import compose_run
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)

from difflm.model import build_model, transformer
from difflm.model.loss_rows import ROWS_MULTIPLE, add_at_rows, loss_rows
from difflm.model.masks import BlockDiffusionMask, DocumentMask


def _loss_index(batch: int, seq_len: int, rate: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nonzero((torch.rand(batch, seq_len, generator=g) < rate).flatten()).flatten()


def test_rows_pad_to_whole_tiles_and_mark_each_sequence():
    index = torch.tensor([1, 5, 6, 70, 71, 72, 130])  # sequences of 64: rows 2, 3, 0, 1 of B = 4
    rows = loss_rows(index, batch=4, seq_len=64)
    assert rows.count == 7 and rows.index.shape == (ROWS_MULTIPLE,)
    assert rows.index[:7].tolist() == index.tolist() and set(rows.index[7:].tolist()) == {130}
    assert rows.cu_seqlens_q.dtype == torch.int32 and rows.cu_seqlens_q.tolist() == [0, 3, 6, 32, 32]
    assert rows.cu_seqlens_k.tolist() == [0, 64, 128, 192, 256]
    x = torch.arange(4 * 64 * 2, dtype=torch.float32).view(4, 64, 2)
    assert torch.equal(rows.select(x)[:7], x.flatten(0, 1)[index])
    assert torch.equal(rows.in_given_order(rows.select(x)), x.flatten(0, 1)[index])
    shuffled = index[torch.tensor([3, 0, 6, 1, 5, 2, 4])]  # any order: sorted for the sequences, given back in its own
    rows = loss_rows(shuffled, batch=4, seq_len=64)
    assert rows.index[:7].tolist() == index.tolist() and rows.cu_seqlens_q.tolist() == [0, 3, 6, 32, 32]
    assert torch.equal(rows.in_given_order(rows.select(x)), x.flatten(0, 1)[shuffled])


def test_gradients_at_the_rows_go_back_summed_so_the_padding_keeps_the_last_row():
    """add_at_rows is select's adjoint: the last loss row and its padding copies (whose gradients are zero, their
    outputs feeding nothing) land on one position, which must keep the real row's gradient; a copy (index_copy_)
    keeps the last duplicate written, here a zero."""
    index = torch.tensor([1, 5, 6, 70, 71, 72, 130])
    rows = loss_rows(index, batch=4, seq_len=64)
    grad_rows = torch.randn(ROWS_MULTIPLE, 3, 2)
    grad_rows[rows.count:] = 0  # the padding's gradient
    into = torch.zeros(4, 64, 3, 2)
    out = add_at_rows(into, rows.index, grad_rows)
    assert out is into
    assert torch.equal(into.flatten(0, 1)[index], grad_rows[:rows.count])  # the last row (130) included
    others = torch.ones(4 * 64, dtype=torch.bool)
    others[index] = False
    assert not into.flatten(0, 1)[others].any()
    x = torch.randn(4, 64, 3, 2, requires_grad=True)  # the same as autograd's gradient of select
    (want,) = torch.autograd.grad(rows.select(x), x, grad_rows)
    assert torch.equal(into, want)
    slots = torch.zeros(4, 64, 5, 2)  # a strided slot of a wider gradient, as the QKV gradient's query heads
    add_at_rows(slots[:, :, 1:4], rows.index, grad_rows)
    assert torch.equal(slots[:, :, 1:4], want) and not slots[:, :, 0].any() and not slots[:, :, 4].any()


@pytest.mark.parametrize("mask,why", [
    (None, "no selection"),
    (torch.zeros(2, 64, dtype=torch.bool), "a boolean mask: its count needs the device"),
    (torch.zeros(0, dtype=torch.long), "no loss rows"),
    (torch.arange(100), "100 rows pad to 128, all of 2 x 64"),
])
def test_no_rows_where_the_full_block_is_needed_or_no_dearer(mask, why):
    assert loss_rows(mask, batch=2, seq_len=64) is None, why


def _model(overrides, causal=False, seed=0):
    cfg = compose_run(["model=tiny", "model.num_layers=3", *overrides]).model
    cfg.vocab_size, cfg.head_dim = 96, cfg.hidden_size // cfg.num_heads
    if cfg.backend == "te":  # the TE kernel set on the CPU stand-in (build_model refuses TE off CUDA)
        from difflm.model.te_kernels import TEKernels

        model = transformer.Transformer(cfg, causal, kernels=TEKernels(cfg, device="meta"))
        model.to_empty(device="cpu")
        model.init_weights(seed)
        return model
    return build_model(cfg, causal=causal, device=torch.device("cpu"), seed=seed)


def _logits_and_grads(model, ids, index, kwargs, rows_on: bool, calls: list):
    model.last_block_loss_rows = rows_on
    model.zero_grad(set_to_none=True)
    logits = model(ids, index, **kwargs)
    targets = torch.randint(0, 96, (logits.shape[0],), generator=torch.Generator().manual_seed(5))
    torch.nn.functional.cross_entropy(logits.float(), targets).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["mdlm", "bd3lm", "documents", "te-stand-in"])
def test_rows_give_the_full_models_logits_and_gradients(case, monkeypatch, request):
    """Same weights, same loss rows: the last block at the rows only against the full last block (FP32, CPU)."""
    batch, seq_len, overrides, kwargs = 2, 64, [], {}
    if case == "te-stand-in":
        request.getfixturevalue("fake_te")
        overrides = ["model.backend=te"]
    if case == "bd3lm":  # [x_t ; x_0], block-causal mask, positions 0..L-1 twice; loss rows in the x_t half
        kwargs = dict(attn_mask=BlockDiffusionMask(seq_len // 2, 8), position_ids=torch.arange(seq_len) % (seq_len // 2))
    if case == "documents":
        doc_ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14])
        kwargs = dict(attn_mask=DocumentMask(doc_ids))
    model = _model(overrides)
    assert model.last_block_loss_rows  # the default
    ids = torch.randint(0, 96, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    index = _loss_index(batch, seq_len // 2 if case == "bd3lm" else seq_len, 0.4, seed=2)
    if case == "bd3lm":
        index = index + (index // (seq_len // 2)) * (seq_len // 2)  # row-major positions of the x_t halves
    seen = []
    real = transformer.Block.forward
    monkeypatch.setattr(transformer.Block, "forward",
                        lambda self, x, *a, rows=None, **k: seen.append(rows) or real(self, x, *a, rows=rows, **k))
    got, got_grads = _logits_and_grads(model, ids, index, kwargs, True, seen)
    assert [r is not None for r in seen] == [False, False, True]  # the last block only
    assert seen[-1].count == index.numel() and seen[-1].index.numel() % ROWS_MULTIPLE == 0
    seen.clear()
    want, want_grads = _logits_and_grads(model, ids, index, kwargs, False, seen)
    assert all(r is None for r in seen)
    assert got.shape == want.shape == (index.numel(), 96)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == sum(1 for _ in model.parameters())
    for name, ref in want_grads.items():
        assert torch.allclose(got_grads[name], ref, atol=1e-6, rtol=1e-4), (name, (got_grads[name] - ref).abs().max())


def test_full_block_where_rows_cannot_serve():
    """Causal models, boolean masks and the setting off run every block in full (no rows reach a block)."""
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(1))
    index = _loss_index(2, 64, 0.4, seed=2)
    causal = _model([], causal=True)
    assert not causal.last_block_loss_rows
    off = _model(["model.last_block_loss_rows=false"])
    assert not off.last_block_loss_rows
    on = _model([])
    mask = torch.zeros(2 * 64, dtype=torch.bool)
    mask[index] = True
    assert torch.allclose(on(ids, mask.view(2, 64)), on(ids, index), atol=1e-5)  # bool mask: full block, same rows
    off.load_state_dict(on.state_dict())
    shuffled = index[torch.randperm(index.numel(), generator=torch.Generator().manual_seed(4))]
    assert torch.allclose(on(ids, shuffled), off(ids, shuffled), atol=1e-5)  # any order: the logits in its order
    assert on._last_block_rows(torch.zeros(2, 64, 8), mask.view(2, 64), None, on.blocks(), 2, 64) is None
    assert on._last_block_rows(torch.zeros(2, 64, 8), index, None, on.blocks()[:-1], 2, 64) is None  # no last block


def test_trainer_step_is_the_same_with_and_without_rows(fast_cfg, tmp_path):
    """Two training steps of the trainer (mdlm, 3 layers) with and without the setting: the same losses and gradient
    norms (the second step also sees the first step's update)."""
    from difflm.training.trainer import Trainer

    results = []
    for on in (True, False):
        cfg = fast_cfg("train.max_steps=2", "train.eval_every=0", "train.save_every=0", "device=cpu",
                       f"model.last_block_loss_rows={str(on).lower()}", "model.num_layers=3",
                       f"run.dir={tmp_path / str(on)}")
        trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
        assert trainer.model.last_block_loss_rows == on
        results.append([trainer.train_step() for _ in range(2)])
    for a, b in zip(*results):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (a, b)


def _cuda_model(overrides):
    cfg = compose_run(["model=tiny", "model.num_layers=3", "precision=bf16", *overrides]).model
    cfg.vocab_size, cfg.head_dim = 256, cfg.hidden_size // cfg.num_heads
    return build_model(cfg, causal=False, device=torch.device("cuda"), seed=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention 4 and quack run on CUDA")
@pytest.mark.parametrize("backend,fused_mlp", [("torch", False), ("te", False), ("te", True)])
def test_rows_on_the_gpu_fast_path(backend, fused_mlp, monkeypatch):
    """BF16 on a GPU with ``model.attention_backend=flash``: the last block's queries go through FA4's varlen
    interface inside the QKV + FA4 function (and quack's fused MLP at default tiles): the logits at the rows and the
    gradients against the full last block on the same weights, within BF16 rounding of other GEMM shapes."""
    from difflm.kernels.qkv_flash import fa4_interface

    if fa4_interface() is None:
        pytest.skip("needs FlashAttention 4 (flash_attn.cute)")
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    if fused_mlp:
        from difflm.kernels.quack_mlp import quack_unavailable_reason

        if quack_unavailable_reason() is not None:
            pytest.skip(quack_unavailable_reason())
    model = _cuda_model([f"model.backend={backend}", "model.attention_backend=flash",
                         f"model.fused_mlp={str(fused_mlp).lower()}", "model.num_kv_heads=2"])
    ids = torch.randint(0, 256, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    index = _loss_index(4, 256, 0.45, seed=3).cuda()
    calls, real = [], transformer.qkv_flash_attention
    monkeypatch.setattr(transformer, "qkv_flash_attention",
                        lambda *a, rows=None, **k: calls.append(rows) or real(*a, rows=rows, **k))
    out = []
    for on in (True, False):
        model.last_block_loss_rows = on
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, index).float()
        targets = ids.flatten()[index]
        torch.nn.functional.cross_entropy(logits, targets).backward()
        out.append((logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                      if p.grad is not None}))
    assert [r is not None for r in calls] == [False, False, True, False, False, False]
    (got, got_grads), (want, want_grads) = out
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
    assert got_grads.keys() == want_grads.keys()
    worst = max(((got_grads[n] - g).norm() / g.norm()).item() for n, g in want_grads.items())
    assert worst < 3e-2, worst
