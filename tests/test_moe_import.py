"""``difflm-import`` of a Qwen3-MoE checkpoint (CPU, offline): a tiny random ``Qwen3MoeForCausalLM`` saved locally
gives difflm's MoE model the same causal logits as ``transformers``."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from difflm.errors import DifflmError
from difflm.interop.export import load_run_for_export
from difflm.interop.hf_import import import_hf, train_overrides
from tests.test_hf_interop import N_TOK, NEOX, _randomise, hf_logits


def make_qwen3_moe(tmp: Path, **extra) -> Path:
    """Tiny random Qwen3-MoE: 2 blocks of width 64, 4 heads / 2 KV heads of dim 16, 8 experts of width 32, top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=50280, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, **extra)
    model = Qwen3MoeForCausalLM(cfg)
    _randomise(model, seed=11)
    out = tmp / "hf_qwen3_moe"
    model.save_pretrained(out)
    for f in NEOX.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_qwen3_moe_import_gives_transformers_logits(tmp_path):
    src = make_qwen3_moe(tmp_path)
    cfg = import_hf(str(src), tmp_path / "run", objective="ar")
    moe = cfg.model.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.norm_topk_prob) == (8, 2, 32, True)
    assert cfg.model.qk_norm and moe.score_func == "softmax" and moe.num_shared_experts == 0
    assert "model.moe.num_experts=8" in train_overrides(cfg) and "model.moe.norm_topk_prob=true" in train_overrides(cfg)
    _, model, tok, _ = load_run_for_export(tmp_path / "run")
    ids = torch.randint(0, N_TOK, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, ids)
    with torch.no_grad():
        ours = model(ids)
    diff = (ours[..., :N_TOK] - ref[..., :N_TOK]).abs().max().item()
    print(f"qwen3_moe: max |logit diff| = {diff:.3e} (logit scale {ref.abs().max().item():.2f})")
    assert diff < 1e-5


def test_qwen3_moe_with_dense_blocks_is_refused(tmp_path):
    src = make_qwen3_moe(tmp_path, mlp_only_layers=[0])
    with pytest.raises(DifflmError, match="mlp_only_layers=\\[0\\]"):
        import_hf(str(src), tmp_path / "run", objective="ar")


def make_moe_run(tmp: Path, overrides: list[str]) -> Path:
    """A difflm run directory (``config.yaml``, ``checkpoints/step_3``) of an MoE model, without training: random
    weights large enough for a wrong mapping to show (:func:`_randomise`) and a non-zero router bias."""
    from omegaconf import OmegaConf

    from conftest import compose_run
    from difflm.checkpoint.store import save_checkpoint
    from difflm.data import build_tokenizer
    from difflm.model import build_model, resolve_model_config

    run = tmp / "run"
    cfg = compose_run([f"run.dir={run}", f"data.tokenizer={NEOX}", *overrides])
    resolve_model_config(cfg.model, build_tokenizer(str(NEOX), cfg.model.vocab_multiple).padded_vocab_size)
    model = build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=0)
    _randomise(model, seed=13)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("router.bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    text = OmegaConf.to_yaml(cfg, resolve=True)
    save_checkpoint(run, 3, model, None, {"step": 3, "scheduler": {"last_epoch": 3}, "scaler": {}, "sampler": {},
                                          "torch_rng": torch.get_rng_state()}, config=text)
    (run / "config.yaml").write_text(text)
    return run


@pytest.mark.parametrize("overrides", [
    # shared expert (num_shared_experts x the expert width), softmax, every block MoE; balancing settings to restore
    ["model=moe-tiny", "model.moe.capacity_factor=1.25", "model.moe.balance_over=global_batch",
     "model.moe.bias_update_rate=0.01", "model.moe.aux_loss_coeff=0.02"],
    # no shared expert, sigmoid top-3 renormalised, a dense first block, the bias also in the weights
    ["model=moe-tiny", "model.num_layers=3", "model.moe.num_shared_experts=0", "model.moe.score_func=sigmoid",
     "model.moe.norm_topk_prob=true", "model.moe.top_k=3", "model.moe.first_k_dense=1",
     "model.moe.bias_in_weights=true"],
], ids=["shared_softmax", "dense_first_sigmoid_bias_in_weights"])
def test_difflm_moe_export_round_trip(tmp_path, overrides):
    """difflm MoE run -> difflm-export (difflm's own format) -> difflm-import: the same ``model.moe`` (balancing settings
    included) and identical logits; the exported modeling file (``trust_remote_code``) gives difflm's logits, also for
    a one-token input."""
    from difflm.interop.export import export_run
    from difflm.model.moe import shared_ffn_size

    run = make_moe_run(tmp_path, overrides)
    cfg, model, _, _ = load_run_for_export(run)
    out = export_run(run, tmp_path / "hf")
    again = import_hf(str(out), tmp_path / "again")
    # config.json holds the resolved widths (model.moe.shared_ffn_hidden_size 0 comes back as num_shared_experts x f);
    # the experts' kernel is the importing run's choice (auto), not part of the checkpoint
    assert again.model.moe.fused_experts == "auto"
    skip = {"shared_ffn_hidden_size": None, "fused_experts": None}
    assert {**again.model.moe, **skip} == {**cfg.model.moe, **skip}
    assert shared_ffn_size(again.model) == shared_ffn_size(cfg.model)
    assert all(again.model[k] == cfg.model[k] for k in ("num_layers", "ffn_hidden_size", "num_kv_heads", "head_dim"))
    overrides_line = train_overrides(again)
    assert f"model.moe.first_k_dense={cfg.model.moe.first_k_dense}" in overrides_line
    assert f"model.moe.capacity_factor={str(cfg.model.moe.capacity_factor).replace('None', 'null')}" in overrides_line
    _, back, _, step = load_run_for_export(tmp_path / "again")
    assert step == 0
    batch = torch.randint(0, N_TOK, (2, 16), generator=torch.Generator().manual_seed(0))
    for ids in (batch, torch.tensor([[42]])):
        with torch.no_grad():
            ours = model(ids)
            assert torch.equal(back(ids), ours)
        theirs = hf_logits(out, ids, trust=True, auto="AutoModelForMaskedLM")
        assert (theirs - ours).abs().max() < 1e-5
    if cfg.model.moe.bias_in_weights:  # the setting is live: without it the same weights give other logits
        with torch.no_grad():
            ours = model(batch)
            model.layers[1].mlp.router.bias_in_weights = False
            assert (model(batch) - ours).abs().max() > 1e-3
