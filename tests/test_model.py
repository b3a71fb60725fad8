"""Model shapes, attention direction, TE-compatible parameter names, deterministic init."""
from __future__ import annotations

import pytest
import torch
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)

from difflm.config.schema import ModelConfig
from difflm.model import Transformer, build_model, resolve_model_config
from difflm.model.rope import apply_rope, rope_cos_sin

from conftest import compose_run


def tiny(**kw):
    cfg = compose_run(["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
                       "model.ffn_hidden_size=96"] + [f"model.{k}={v}" for k, v in kw.items()]).model
    resolve_model_config(cfg, 256)
    return cfg


def test_shapes_and_logits_mask():
    model = build_model(tiny(), causal=False, device=torch.device("cpu"), seed=0)
    x = torch.randint(0, 256, (3, 10))
    logits = model(x)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    sel = torch.rand(3, 10) < 0.4
    assert torch.allclose(model(x, sel), logits[sel], atol=1e-5)


def test_bidirectional_vs_causal():
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % 256  # change a late token
    for causal in (False, True):
        model = build_model(tiny(), causal=causal, device=torch.device("cpu"), seed=0)
        early = (model(x)[0, :8] - model(y)[0, :8]).abs().max().item()
        if causal:
            assert early == 0.0  # earlier positions cannot see the future
        else:
            assert early > 1e-4  # diffusion attends both ways


def test_parameter_names_follow_transformer_engine():
    model = build_model(tiny(), causal=False, device=torch.device("cpu"), seed=0)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    hd = 16
    assert shapes["layers.0.attention.qkv.weight"] == ((4 + 2 * 2) * hd, 64)
    assert shapes["layers.0.attention.qkv.layer_norm_weight"] == (64,)
    assert shapes["layers.0.attention.proj.weight"] == (64, 4 * hd)
    assert shapes["layers.0.mlp.fc1_weight"] == (2 * 96, 64) and shapes["layers.0.mlp.fc2_weight"] == (64, 96)
    assert shapes["layers.1.attention.q_norm.weight"] == (hd,)
    assert {"embedding.weight", "final_norm.weight", "output.weight"} <= set(shapes)
    tied = build_model(tiny(tie_embeddings=True), causal=False, device=torch.device("cpu"), seed=0)
    assert "output.weight" not in tied.state_dict()


def test_init_is_deterministic_and_megatron_scaled():
    a = build_model(tiny(), causal=False, device=torch.device("cpu"), seed=3)
    b = build_model(tiny(), causal=False, device=torch.device("cpu"), seed=3)
    c = build_model(tiny(), causal=False, device=torch.device("cpu"), seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    big = build_model(tiny(hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024), causal=False,
                      device=torch.device("cpu"), seed=0)
    assert big.embedding.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert big.layers[0].mlp.fc2_weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)  # / sqrt(2 * 2 layers)
    assert torch.all(big.layers[0].mlp.layer_norm_weight == 1)


def test_gqa_equals_repeated_kv_heads():
    # GQA with 2 KV heads must equal MHA whose K/V heads are the GQA ones repeated per group.
    cfg_gqa = tiny()
    gqa = build_model(cfg_gqa, causal=False, device=torch.device("cpu"), seed=0)
    cfg_mha = tiny(num_kv_heads=4)
    mha = build_model(cfg_mha, causal=False, device=torch.device("cpu"), seed=0)
    sd = gqa.state_dict()
    hd, groups = 16, 2
    for i in range(2):
        w = sd[f"layers.{i}.attention.qkv.weight"].view(groups, 4, hd, 64)  # per group: q, q, k, v
        q, k, v = w[:, :2], w[:, 2:3], w[:, 3:4]
        # MHA layout: 4 groups of (q, k, v); group g uses query head g and the K/V of its GQA group
        mha_rows = [torch.cat([q[g // 2, g % 2 : g % 2 + 1], k[g // 2], v[g // 2]]) for g in range(4)]
        sd[f"layers.{i}.attention.qkv.weight"] = torch.cat(mha_rows).reshape(-1, 64)
    mha.load_state_dict(sd)
    x = torch.randint(0, 256, (2, 9))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


def test_rope_is_relative():
    cos, sin = rope_cos_sin(16, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    qs, ks = q.expand(1, 1, 16, 8), k.expand(1, 1, 16, 8)
    rq, rk = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
    dot = lambda i, j: (rq[0, 0, i] * rk[0, 0, j]).sum().item()
    assert dot(3, 1) == pytest.approx(dot(10, 8), rel=1e-4)  # depends only on i - j
    assert rq[0, 0, 0].allclose(q[0, 0, 0])


@pytest.mark.parametrize("kernels", ["torch", "te"])
def test_pipeline_stages_of_the_model_chain_to_the_full_forward(kernels, request):
    """A pipeline stage is the same Transformer holding a run of blocks; chained, the stages give the full logits,
    with shared step inputs (BD3-LM mask and positions) and under either kernel set."""
    from difflm.model.masks import BlockDiffusionMask

    cfg = ModelConfig(num_layers=5, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=64,
                      head_dim=8)
    if kernels == "te":
        request.getfixturevalue("fake_te")
        from difflm.model.te_kernels import TEKernels

        model = Transformer(cfg, kernels=TEKernels(cfg, device="cpu"))
        model.init_weights(3)
    else:
        model = build_model(cfg, causal=False, device=torch.device("cpu"), seed=3)
    stages = [model.pipeline_stage(ids, first=i == 0, last=i == 2) for i, ids in enumerate([[0, 1], [2], [3, 4]])]
    names = [set(dict(s.named_parameters())) for s in stages]  # full-model names, each parameter on one stage
    assert set().union(*names) == set(dict(model.named_parameters())) and sum(map(len, names)) == len(names[0] |
                                                                                                    names[1] | names[2])
    assert "layers.2.mlp.fc1_weight" in names[1] and "embedding.weight" in names[0] and "output.weight" in names[2]
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    shared = dict(attn_mask=BlockDiffusionMask(8, 4), position_ids=torch.arange(8).repeat(2))
    with torch.no_grad():
        for inputs in ({}, shared):
            h = x
            for stage in stages:
                stage.step_inputs = inputs
                h = stage(h)
            torch.testing.assert_close(h, model(x, **inputs), rtol=0, atol=1e-6)
    # the shapes a pipeline schedule is given for stages that cannot run on meta tensors (TE) are the real ones
    dtype = torch.bfloat16
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        h = x
        for stage in stages:
            stage.step_inputs = {}
            want_in, want_out = stage.pipeline_io(2, 16, dtype)
            assert (h.shape, h.dtype if h.dtype == torch.long or kernels == "te" else dtype) == \
                (want_in.shape, want_in.dtype)
            h = stage(h)
            if kernels == "te":  # the TE residual stream and the logits are in the autocast dtype
                assert (h.shape, h.dtype) == (want_out.shape, want_out.dtype)
            assert h.shape == want_out.shape
