"""Checkpoints written by the code before the one-model refactor (tests/fixtures/LEGACY.md) still load, and give the
logits that code computed."""
from __future__ import annotations

from pathlib import Path

import torch
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)
from omegaconf import OmegaConf

from difflm.checkpoint.store import load_checkpoint
from difflm.model import Transformer, build_model
from difflm.model.kv_cache import KVCache
from difflm.model.masks import BlockDiffusionMask

FIXTURES = Path(__file__).parent / "fixtures"


def _expected(name: str) -> tuple[dict, dict]:
    root = FIXTURES / name
    return OmegaConf.load(root / "model.yaml"), torch.load(root / "expected.pt")


def test_torch_layout_checkpoint_loads_with_optimizer_and_gives_its_logits():
    cfg, want = _expected("legacy_v0")
    model = build_model(cfg, causal=False, device=torch.device("cpu"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = load_checkpoint(FIXTURES / "legacy_v0" / "checkpoints" / "step_1", model, opt)
    assert state["step"] == 1 and all(len(s) for s in opt.state.values())  # Adam moments restored
    x = want["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), want["logits"], rtol=0, atol=1e-6)
        bd = model(x, attn_mask=BlockDiffusionMask(6, 3), position_ids=torch.arange(6).repeat(2))
        torch.testing.assert_close(bd, want["bd3lm_logits"], rtol=0, atol=1e-6)
        cache = KVCache()
        model(x, kv_cache=cache.write())
        cached = model(x[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=cache.read(4, 8))
        torch.testing.assert_close(cached, want["cached_logits"], rtol=0, atol=1e-6)


def test_te_layout_checkpoint_loads_into_the_one_model(fake_te):
    from difflm.model.te_kernels import TEKernels

    cfg, want = _expected("legacy_v0_te")
    model = Transformer(cfg, kernels=TEKernels(cfg, device="meta"))
    model.to_empty(device="cpu")
    load_checkpoint(FIXTURES / "legacy_v0_te" / "checkpoints" / "step_1", model)  # strict, _extra_state included
    with torch.no_grad():
        torch.testing.assert_close(model(want["input_ids"]), want["logits"], rtol=0, atol=1e-6)


def test_checkpoints_move_between_kernel_sets(fake_te):
    """A TE-layout checkpoint loads into the torch kernels (its _extra_state is not asked for) and a torch-layout one
    into the TE kernels (their fresh FP8 metadata is kept): same logits."""
    from difflm.model.te_kernels import TEKernels

    cfg, want = _expected("legacy_v0_te")
    cfg.backend = "torch"
    torch_model = build_model(cfg, causal=False, device=torch.device("cpu"), seed=0)
    load_checkpoint(FIXTURES / "legacy_v0_te" / "checkpoints" / "step_1", torch_model)
    with torch.no_grad():
        torch.testing.assert_close(torch_model(want["input_ids"]), want["logits"], rtol=0, atol=1e-6)

    cfg, want = _expected("legacy_v0")
    te_model = Transformer(cfg, kernels=TEKernels(cfg, device="meta"))
    te_model.to_empty(device="cpu")
    load_checkpoint(FIXTURES / "legacy_v0" / "checkpoints" / "step_1", te_model)
    with torch.no_grad():
        torch.testing.assert_close(te_model(want["input_ids"]), want["logits"], rtol=0, atol=1e-6)
