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
