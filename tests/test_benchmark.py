"""scripts/benchmark.py on CPU (reference + torch backend, model=tiny) and the MFU arithmetic by hand."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from conftest import load_script

from difflm.config.schema import ModelConfig
from difflm.errors import DifflmError
from difflm.model.transformer import Transformer
from difflm.training import flops


def tiny(vocab=50304, **kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4, ffn_hidden_size=512, head_dim=32,
                vocab_size=vocab, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kv,qk_norm", [(4, True), (2, False)])
def test_mfu_formula_by_hand(kv, qk_norm):
    cfg = tiny(num_kv_heads=kv, qk_norm=qk_norm)
    L, d, h, hd, f, V, S = 4, 128, 4, 32, 512, 50304, 256
    per_layer = (d + (h + 2 * kv) * hd * d  # qkv: fused RMSNorm scale + weight
                 + (2 * hd if qk_norm else 0)  # q/k norms
                 + h * hd * d  # output projection
                 + d + 2 * f * d + d * f)  # MLP: RMSNorm scale, SwiGLU fc1 (gate + up), fc2
    n_hand = L * per_layer + d + V * d  # final norm + LM head (the input embedding is not counted)
    model = Transformer(cfg)
    assert model.num_params() == n_hand
    assert model.num_params(exclude_embedding=False) == n_hand + V * d
    fpt = flops.flops_per_token(n_hand, L, d, S)
    assert fpt == 6 * n_hand + 12 * L * d * S
    # 1e5 tokens/s on a 989 TFLOP/s part
    assert flops.mfu(1e5, fpt, 989e12) == pytest.approx(1e5 * (6 * n_hand + 12 * L * d * S) / 989e12, rel=1e-12)
    assert flops.mfu(1e5, fpt, None) is None
    # the benchmark's eager reference has the same non-embedding parameter count
    bench = load_script("benchmark")
    assert bench.ReferenceTransformer(cfg, causal=False).num_params() == n_hand


def test_peak_is_the_bf16_datasheet_figure(monkeypatch):
    assert flops.peak_flops(torch.device("cpu")) is None
    for name, tflops in (("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert flops.peak_flops(torch.device("cuda")) == tflops * 1e12


def test_parse_variant():
    bench = load_script("benchmark")
    assert bench.parse_variant("te-fp8: model.backend=te precision=fp8") == ("te-fp8", ["model.backend=te", "precision=fp8"])
    assert bench.parse_variant("plain:") == ("plain", [])
    with pytest.raises(DifflmError, match="NAME: override"):
        bench.parse_variant("model.backend=te")


def test_reference_block_is_a_standard_llama_block():
    """Reference and difflm model compute the same function from the same weights (fp32, bidirectional)."""
    bench = load_script("benchmark")
    cfg = tiny(vocab=64, num_kv_heads=2)
    ours = Transformer(cfg)
    ours.init_weights(0)
    ref = bench.ReferenceTransformer(cfg, causal=False)
    sd = ours.state_dict()
    h, kv, hd = 4, 2, 32
    with torch.no_grad():
        ref.embedding.weight.copy_(sd["embedding.weight"])
        ref.output.weight.copy_(sd["output.weight"])
        ref.norm.weight.copy_(sd["final_norm.weight"])
        for i, blk in enumerate(ref.layers):
            p = f"layers.{i}."
            w = sd[p + "attention.qkv.weight"].view(kv, h // kv + 2, hd, -1)
            blk.q.weight.copy_(w[:, : h // kv].reshape(h * hd, -1))
            blk.k.weight.copy_(w[:, -2].reshape(kv * hd, -1))
            blk.v.weight.copy_(w[:, -1].reshape(kv * hd, -1))
            blk.o.weight.copy_(sd[p + "attention.proj.weight"])
            blk.attn_norm.weight.copy_(sd[p + "attention.qkv.layer_norm_weight"])
            blk.q_norm.weight.copy_(sd[p + "attention.q_norm.weight"])
            blk.k_norm.weight.copy_(sd[p + "attention.k_norm.weight"])
            blk.mlp_norm.weight.copy_(sd[p + "mlp.layer_norm_weight"])
            gate, up = sd[p + "mlp.fc1_weight"].chunk(2)
            blk.w1.weight.copy_(gate)
            blk.w3.weight.copy_(up)
            blk.w2.weight.copy_(sd[p + "mlp.fc2_weight"])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref(ids), ours(ids), atol=1e-4, rtol=1e-4)


def test_benchmark_runs_reference_and_torch_backend_on_cpu(tmp_path, capsys):
    bench = load_script("benchmark")
    out = tmp_path / "bench.json"
    start = time.perf_counter()
    result = bench.main(["model=tiny", "data.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu",
                         "--steps", "1", "--warmup", "0", "--batches", "2", "--json", str(out),
                         "--variant", "torch: ", "--variant", "te: model.backend=te"])
    elapsed = time.perf_counter() - start
    assert elapsed < 120, elapsed  # ~15 s on an idle 2-core CI runner; a generous bound for busy ones
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["reference", "torch", "te"]
    ref, ours = rows["reference"], rows["torch"]
    for r in (ref, ours):
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) and r["peak_mem_gib"] > 0
        # one optimizer step = 2 accumulated micro-batches of 2 x 16 tokens
        assert r["step_ms"] == pytest.approx(4 * 16 / r["tokens_per_s"] * 1e3, rel=1e-9)
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        # same dimensions, same N, same FLOPs per token
        assert r["flops_per_token"] == 6 * r["n_params_non_embedding"] + 12 * 4 * 128 * 16
    assert ref["n_params_non_embedding"] == ours["n_params_non_embedding"] == Transformer(
        tiny(vocab=result["vocab_size"])).num_params()
    assert ref["ratio_to_reference"] == 1.0 and result["accumulation"] == 2
    assert ours["ratio_to_reference"] == pytest.approx(ours["tokens_per_s"] / ref["tokens_per_s"])
    # a full-vocabulary CE at initialisation is about ln(V) nats
    assert abs(ref["loss"] - math.log(result["vocab_size"])) < 0.5
    assert "model.backend=te" in rows["te"]["error"]  # refused with the config's own message, not a crash
    assert json.loads(out.read_text())["rows"][1]["tokens_per_s"] == ours["tokens_per_s"]
    printed = capsys.readouterr().out
    assert "reference" in printed and "tokens/s" in printed and "FAILED" in printed
