"""LoRA on the real Transformer Engine kernels (``model.backend=te`` on a GPU): the weight-side adapters of TE's
fused modules against the torch kernels' input-side adapters with the same factors, gradients only in the adapters,
the merged weights, and a LoRA training run with TE kernels. The CPU stand-in of the same wiring is in
tests/test_lora.py; these need a CUDA GPU with Transformer Engine and are skipped elsewhere. Figures go to
``$DIFFLM_TEST_REPORT`` (JSON lines) when set."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import report
from fixtures.fake_te_env import real_te_available
from omegaconf import OmegaConf

from difflm.config.schema import LoraConfig, ModelConfig
from difflm.model import build_model
from difflm.model.lora import adapters_disabled, apply_lora, merged_state_dict, trainable_parameter_count
from difflm.model.te_kernels import torch_to_te_state_dict

GPU = torch.cuda.is_available() and real_te_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with Transformer Engine")


def cfg_pair(attention: str = "sdpa") -> tuple[ModelConfig, ModelConfig]:
    """The same tiny model for the torch kernels and for TE (weights accumulated by autograd, as a LoRA run's are)."""
    base = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=256, head_dim=32,
                       vocab_size=160, qk_norm=True)
    return base, replace(base, backend="te", attention_backend=attention, fuse_wgrad_accumulation=False)


def lora(**kw):
    return OmegaConf.structured(LoraConfig(**dict(dict(rank=8, alpha=16.0), **kw)))


def randomise_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))


def pair(seed=3):
    """A torch-kernel and a TE-kernel model with the same base weights and the same adapters (B random)."""
    tcfg, ecfg = cfg_pair()
    dev = torch.device("cuda")
    ref = build_model(tcfg, causal=False, device=dev, seed=seed)
    te = build_model(ecfg, causal=False, device=dev, seed=seed)
    te.load_state_dict(torch_to_te_state_dict(ref.state_dict(), tcfg), strict=False)
    for m in (ref, te):
        apply_lora(m, lora(), seed=seed)
        randomise_b(m)
    return ref, te


def tokens(b=2, s=128, v=160, seed=0):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed)).cuda()


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_te_adapters_match_torch_adapters_fp32_and_only_adapters_get_gradients():
    ref, te = pair()
    assert trainable_parameter_count(te) == trainable_parameter_count(ref) > 0
    x = tokens()
    out_ref, out_te = ref(x), te(x)
    logits_rel = rel(out_te, out_ref)
    out_ref.float().square().mean().backward()
    out_te.float().square().mean().backward()
    grads_te = {n: p.grad for n, p in te.named_parameters() if p.grad is not None}
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads_te and all(".lora." in n for n in grads_te)
    assert set(grads_te) == set(grads_ref)
    grad_rel = max(rel(grads_te[n], grads_ref[n]) for n in grads_ref)
    report("lora_te_fp32", logits_rel=logits_rel, max_grad_rel=grad_rel, adapters=len(grads_te))
    assert logits_rel < 5e-3 and grad_rel < 5e-2  # FP32 on both sides: kernels and summation order differ


def test_te_adapters_in_bf16_autocast_track_torch():
    from difflm.training.precision import autocast_context

    ref, te = pair()
    x = tokens()
    with autocast_context("bf16", torch.device("cuda")):
        out_ref, out_te = ref(x), te(x)
    r = rel(out_te, out_ref)
    report("lora_te_bf16", logits_rel=r)
    assert r < 2e-2


def test_te_b_zero_is_the_base_and_disabled_adapters_are_the_base():
    _, ecfg = cfg_pair()
    te = build_model(ecfg, causal=False, device=torch.device("cuda"), seed=5)
    x = tokens()
    with torch.no_grad():
        base = te(x).clone()
        apply_lora(te, lora(), seed=5)
        torch.testing.assert_close(te(x), base, atol=0, rtol=0)  # B = 0: W + 0 exactly
        randomise_b(te)
        adapted = te(x).clone()
        assert rel(adapted, base) > 1e-3
        with adapters_disabled(te):
            torch.testing.assert_close(te(x), base, atol=0, rtol=0)


def test_te_merged_weights_give_the_adapted_logits():
    _, te = pair()
    _, ecfg = cfg_pair()
    x = tokens()
    with torch.no_grad():
        adapted = te(x)
        plain = build_model(ecfg, causal=False, device=torch.device("cuda"), seed=None)
        missing, unexpected = plain.load_state_dict(merged_state_dict(te), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        r = rel(plain(x), adapted)
    report("lora_te_merged", logits_rel=r)
    assert r < 1e-5


@pytest.mark.slow
def test_lora_training_run_on_te_kernels_moves_only_adapters(tmp_path):
    """difflm-train with ``model.backend=te lora=attn_mlp`` on the GPU: the loss falls, the checkpoint holds only
    adapters (and the TE modules' FP8 metadata), and the base weights are untouched."""
    from difflm.config.compose import compose_train_config
    from difflm.training.trainer import Trainer

    run = tmp_path / "run"
    cfg = compose_train_config(["model=tiny", "model.backend=te", "model.attention_backend=sdpa", "precision=bf16",
                                "lora=attn_mlp", "lora.rank=8", "lora.alpha=16", "optim.lr=3e-3",
                                "objective.random_length_prob=0", "train.max_steps=30", "train.save_every=30",
                                "train.eval_every=0", "logger.log_every=1", "logger.progress_bar=false",
                                "logger.num_samples=0", "data.seq_len=128", "train.global_batch_size=8",
                                "train.micro_batch_size=8", f"run.dir={run}", f"data.cache_dir={tmp_path}/cache"],
                               device=torch.device("cuda"))
    trainer = Trainer(cfg, run, torch.device("cuda"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n].detach(), v) for n, v in before.items())
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    report("lora_te_run", first_loss=first, last_loss=last, steps=len(losses))
    assert last < first
    from difflm.checkpoint.store import checkpoint_keys

    keys = checkpoint_keys(run / "checkpoints" / "step_30")
    # TE modules keep their FP8 metadata (``_extra_state``, empty under BF16) for an exact resume
    model_keys = {k for k in keys if k.startswith("model.") and not k.endswith("_extra_state")}
    assert model_keys and all(".lora." in k for k in model_keys)
    assert all(".lora." in k for k in keys if k.startswith("optim.state."))
