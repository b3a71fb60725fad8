"""The Transformer Engine kernels (``model.backend=te``) of the one model: state-dict layout, attention dispatch,
and (on a GPU) numerics against the torch kernels.

CPU tests (CI) use no Transformer Engine: the layout is checked against ``fixtures/te_tiny_state_dict.json``,
recorded from a real TE model on a GPU, and the module wiring runs on the CPU stand-in in
``fixtures/fake_te``. The ``cuda`` tests need a GPU with TE; they re-record the fixture when
``DIFFLM_RECORD_TE_FIXTURE=1`` and append their figures to ``$DIFFLM_TEST_REPORT`` (JSON lines) if set.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import report
from fixtures.fake_te_env import fake_te, real_te_available  # noqa: F401  (pytest fixture)

from difflm.config.schema import ModelConfig
from difflm.errors import DifflmError
from difflm.model import build_model
from difflm.model.attention import attend, attention_unavailable_reason
from difflm.model.rope import rope_cos_sin
from difflm.model.te_kernels import (
    EXTRA_STATE,
    main_grad_weights,
    te_module_names,
    te_to_torch_state_dict,
    torch_to_te_state_dict,
)
from difflm.model.transformer import Transformer

FIXTURE = Path(__file__).parent / "fixtures" / "te_tiny_state_dict.json"
GPU = torch.cuda.is_available() and real_te_available()
cuda_te = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with Transformer Engine")


def small_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, head_dim=16,
                vocab_size=96, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------ layout vs the recorded TE fixture
def fixture_cfg() -> tuple[ModelConfig, dict]:
    data = json.loads(FIXTURE.read_text())
    return ModelConfig(**data["model"]), data


def test_fixture_was_recorded_from_real_te():
    _, data = fixture_cfg()
    assert data["recorded_with"]["transformer_engine"][0].isdigit()  # a TE version, not the CPU stand-in
    assert "nvidia" in data["recorded_with"]["device"].lower()
    names = [t["name"] for t in data["tensors"]]
    assert len(names) == len(set(names)) and any(n.endswith(EXTRA_STATE) for n in names)


def test_torch_state_dict_maps_onto_recorded_te_names_and_shapes():
    cfg, data = fixture_cfg()
    model = Transformer(cfg, causal=False)
    model.init_weights(0)
    torch_sd = model.state_dict()
    mapped = torch_to_te_state_dict(torch_sd, cfg)
    recorded = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in data["tensors"]}
    got = {k: (tuple(v.shape), str(v.dtype)) for k, v in mapped.items()}
    assert set(got) == set(recorded), (sorted(set(got) ^ set(recorded)))
    assert got == recorded
    # and back: exactly the torch names, values untouched
    back = te_to_torch_state_dict(mapped)
    assert set(back) == set(torch_sd)
    assert all(torch.equal(back[k], torch_sd[k]) for k in torch_sd)


def test_extra_state_names_follow_the_te_modules():
    cfg = small_cfg(num_layers=2, qk_norm=False)
    names = te_module_names(cfg)
    assert names == ["layers.0.attention.qkv", "layers.0.attention.core", "layers.0.attention.proj", "layers.0.mlp",
                     "layers.1.attention.qkv", "layers.1.attention.core", "layers.1.attention.proj", "layers.1.mlp",
                     "final_norm"]
    assert len(te_module_names(replace(cfg, qk_norm=True))) == len(names) + 2 * cfg.num_layers


def test_mapping_refuses_a_te_state_dict_and_dequantizes_fp8(fake_te):
    from transformer_engine.pytorch.tensor import Float8Tensor

    cfg = small_cfg()
    sd = torch_to_te_state_dict(Transformer(cfg).state_dict(), cfg)
    with pytest.raises(DifflmError, match="already has the TE layout"):
        torch_to_te_state_dict(sd, cfg)
    w = torch.randn(8, 4)
    out = te_to_torch_state_dict({"a.weight": Float8Tensor(w), "a._extra_state": torch.zeros(3, dtype=torch.uint8)})
    assert list(out) == ["a.weight"] and out["a.weight"].dtype == torch.float32
    assert torch.equal(out["a.weight"], w.to(torch.bfloat16).float())


# ------------------------------------------------------------------ attention dispatch (CPU)
def qkv(b=2, h=4, h_kv=2, s=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g),
            torch.randn(b, h_kv, s, d, generator=g))


def naive_attention(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.double()).float()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backends_agree_on_cpu(backend, causal):
    q, k, v = qkv()
    with torch.no_grad():  # PyTorch's FlexAttention has no CPU backward
        out = attend(q, k, v, causal=causal, backend=backend)
        out_bshd = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, backend=backend,
                          layout="bshd")
    ref = naive_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_bshd.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["flash", "te"])
def test_cuda_only_attention_backends_refuse_cpu(backend):
    q, k, v = qkv()
    with pytest.raises(DifflmError, match=f"model.attention_backend={backend} runs CUDA kernels only"):
        attend(q, k, v, causal=False, backend=backend)
    assert attention_unavailable_reason("sdpa", torch.device("cpu")) is None
    with pytest.raises(DifflmError, match="is not one of"):
        attend(q, k, v, causal=False, backend="xformers")


@pytest.mark.parametrize("backend", ["flash", "te"])
def test_cpu_refusals_suggest_only_backends_that_run_there(backend):
    """Training on the CPU: sdpa only (flex has no CPU backward); forward-only runs (eval, generate) may also use
    flex, and the message names the key the user sets there."""
    cpu = torch.device("cpu")
    training = attention_unavailable_reason(backend, cpu)
    assert training.endswith("use model.attention_backend=sdpa")
    assert attention_unavailable_reason("flex", cpu).endswith("use model.attention_backend=sdpa")
    forward = attention_unavailable_reason(backend, cpu, training=False, key="kernels.attention_backend")
    assert forward.startswith(f"kernels.attention_backend={backend} runs CUDA kernels only")
    assert forward.endswith("use kernels.attention_backend=sdpa (or flex)")
    assert attention_unavailable_reason("flex", cpu, training=False) is None


def test_eval_and_generate_kernel_overrides_name_the_kernels_key():
    from omegaconf import OmegaConf

    from difflm.generate import apply_kernel_overrides

    cpu = torch.device("cpu")
    cfg = OmegaConf.create({"model": {"backend": "torch", "attention_backend": "te", "compile": False}})
    with pytest.raises(DifflmError) as err:  # the run's own choice
        apply_kernel_overrides(cfg, None, cpu)
    assert str(err.value).startswith("the run's model.attention_backend=te cannot run here; kernels.attention_backend"
                                     "=te runs CUDA kernels only")
    with pytest.raises(DifflmError, match=r"^kernels.attention_backend=flash runs CUDA kernels only"):
        apply_kernel_overrides(cfg, {"attention_backend": "flash"}, cpu)
    apply_kernel_overrides(cfg, {"attention_backend": "flex"}, cpu)  # forward-only: flex runs on the CPU
    assert cfg.model.attention_backend == "flex"


# ------------------------------------------------------------------ TE kernels in the one model, on the CPU stand-in
def te_model(cfg, causal=False, seed=7, **kernel_args):
    """The one Transformer with TE kernels on the CPU stand-in, keyed init."""
    from difflm.model.te_kernels import TEKernels

    model = Transformer(cfg, causal, kernels=TEKernels(cfg, device="meta", **kernel_args))
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_one_model_class_for_both_kernel_sets(fake_te):
    import difflm.model as package
    import difflm.model.te_kernels as te_kernels

    model = te_model(small_cfg())
    assert type(model) is Transformer and type(model.layers[0]).__name__ == "Block"
    assert type(model.layers[0].mlp).__module__.startswith("transformer_engine")
    # the TE file defines no network module: only the kernel set
    modules = [v for v in vars(te_kernels).values() if isinstance(v, type) and issubclass(v, torch.nn.Module)]
    assert modules == []
    assert not hasattr(package, "TETransformer")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h_kv,extra", [(4, {}), (2, {}), (1, {}), (2, {"qkv_bias": True, "shift_logits": True})])
def test_te_model_matches_torch_model_on_stand_in(fake_te, causal, h_kv, extra):
    cfg = small_cfg(num_kv_heads=h_kv, **extra)
    ref = Transformer(cfg, causal)
    ref.init_weights(7)
    model = te_model(cfg, causal)
    te_sd = model.state_dict()
    assert set(te_sd) == set(torch_to_te_state_dict(ref.state_dict(), cfg))
    for k, v in ref.state_dict().items():  # same keyed init, value for value
        assert torch.equal(te_sd[k], v), k
    model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))  # strict
    ref.load_state_dict(te_to_torch_state_dict(te_sd))  # strict
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.rand(2, 20, generator=torch.Generator().manual_seed(2)) < 0.4
    torch.testing.assert_close(model(ids, mask), ref(ids, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)
    assert model.num_params() == ref.num_params()


def test_weight_gradients_accumulate_in_place_across_micro_batches_and_steps(fake_te):
    """fuse_wgrad_accumulation: TE's weight-gradient GEMMs add into ``main_grad``, which is the parameter's
    ``.grad``; over three micro-batches and two optimizer steps (zero_grad both ways) the gradients equal those of
    the torch kernels, which autograd accumulates."""
    cfg = small_cfg()
    ref, model = Transformer(cfg), te_model(cfg)
    ref.load_state_dict(te_to_torch_state_dict(model.state_dict()))
    fused = [p for n, p in model.named_parameters() if n.endswith(("qkv.weight", "proj.weight", "fc1_weight",
                                                                  "fc2_weight")) or n == "embedding.weight"]
    assert len(fused) == 4 * cfg.num_layers + 1  # the embedding's too (difflm.kernels.embedding)
    g = torch.Generator().manual_seed(4)
    steps = [[torch.randint(0, cfg.vocab_size, (2, 12), generator=g) for _ in range(3)] for _ in range(2)]
    for step, set_to_none in zip(steps, (True, False)):
        for m in (model, ref):
            for ids in step:
                m(ids).float().square().mean().backward()
        assert model.layers[0].attention.qkv.seen_first_microbatch is None  # BF16: no micro-batch contract
        for p in fused:
            assert p.grad is p.main_grad  # one FP32 buffer, no second copy
            # marked on the live parameter (to_empty replaced the ones the kernels built): the quack modules read it
            assert p.accumulates_in_main_grad is True
        assert [id(p) for p in main_grad_weights(model)] == [id(p) for p in fused]
        grads = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
        for m in (model, ref):
            m.zero_grad(set_to_none=set_to_none)
        if not set_to_none:
            assert all(p.grad is p.main_grad and not p.main_grad.any() for p in fused)  # zeroed in place
    # FP8: the weights are cast in a step's first micro-batch and reused after; evaluation caches nothing
    from difflm.training.precision import te_autocast

    firsts = []
    tiles = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(3)]  # whole FP8 tiles of tokens
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fused: no version-counter bumps
    for set_to_none in (True, False, True):
        for ids in tiles:
            with te_autocast(True):
                model(ids).float().square().mean().backward()
            firsts.append(model.layers[0].attention.qkv.seen_first_microbatch)
        opt.step()  # new weights: the next step casts again, whichever way the gradients are zeroed
        opt.zero_grad(set_to_none=set_to_none)
    assert firsts == [True, False, False] * 3
    seen = []
    for load in (False, True):  # a checkpoint load between micro-batches writes the weights in place too
        if load:
            with torch.no_grad():
                model.load_state_dict({k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()})
        with te_autocast(True):
            model(tiles[0]).float().square().mean().backward()
        seen.append(model.layers[0].attention.qkv.seen_first_microbatch)
    assert seen == [True, True]
    with torch.no_grad(), te_autocast(True):
        model(tiles[0])
    assert model.layers[0].attention.qkv.seen_first_microbatch is None
    # without the option TE returns gradients to autograd
    plain = te_model(cfg, fuse_wgrad_accumulation=False)
    plain(steps[0][0]).float().square().mean().backward()
    assert all(not hasattr(p, "main_grad") and p.grad is not None for p in plain.parameters())


def test_weights_cast_once_per_step():
    """The quack modules' BF16 weight copies: one cast per optimizer step shared by the step's micro-batches
    (forwards that record gradients, of weights accumulating in main_grad), a new one after any optimizer step (fused
    AdamW bumps no version counter) or in-place write (a checkpoint load); forwards without gradients, and weights
    that do not accumulate in main_grad (FSDP2's gathered shards), cast afresh and leave the cache alone."""
    from difflm.model.te_kernels import weights_cast_once_per_step

    owner, w = torch.nn.Module(), torch.nn.Parameter(torch.randn(8, 4))
    unmarked = weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0]  # not accumulating in main_grad (FSDP2)
    assert weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0] is not unmarked
    assert getattr(owner, "_cast_weights", None) is None
    w.accumulates_in_main_grad = True  # what attach_main_grads marks
    first = weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0]
    assert first.dtype == torch.bfloat16 and torch.equal(first, w.detach().bfloat16())
    assert weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0] is first  # the next micro-batch
    with torch.no_grad():
        fresh = weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0]
    assert fresh is not first and torch.equal(fresh, first) and owner._cast_weights[1][0] is first
    w.data.add_(1.0)  # a write no version counter sees, as fused AdamW's: the cast stays until a step is counted
    assert weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0] is first
    torch.optim.SGD([w], lr=0.5).step()  # no gradient, so no change; what matters is that a step was taken
    after_step = weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0]
    assert after_step is not first and torch.equal(after_step, w.detach().bfloat16())
    with torch.no_grad():
        w.copy_(torch.zeros_like(w))  # a checkpoint load
    assert not weights_cast_once_per_step(owner, (w,), torch.bfloat16)[0].any()
    assert weights_cast_once_per_step(owner, (w,), torch.float16)[0].dtype == torch.float16
    assert weights_cast_once_per_step(owner, (w,), torch.float32)[0].data_ptr() == w.data_ptr()  # no copy needed


def test_te_kernels_take_masks_positions_and_caches(fake_te):
    """bd3lm masks, packed documents, explicit positions and KV caches run through the TE kernels as through torch's."""
    from difflm.model.kv_cache import KVCache
    from difflm.model.masks import BlockDiffusionMask, DocumentMask, document_ids

    cfg = small_cfg()
    ref, model = Transformer(cfg), te_model(cfg)
    ref.load_state_dict(te_to_torch_state_dict(model.state_dict()))
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1, cfg.vocab_size, (2, 16), generator=g)
    x[0, 5] = x[1, 9] = 0
    with torch.no_grad():
        bd = dict(attn_mask=BlockDiffusionMask(8, 4), position_ids=torch.arange(8).repeat(2))
        torch.testing.assert_close(model(x, **bd), ref(x, **bd), atol=1e-5, rtol=1e-5)
        docs = dict(attn_mask=DocumentMask(document_ids(x, 0)))
        torch.testing.assert_close(model(x, **docs), ref(x, **docs), atol=1e-5, rtol=1e-5)
        caches = []
        for m in (model, ref):
            c = KVCache()
            m(x, kv_cache=c.write())
            caches.append(m(x[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=c.read(4, 8)))
        torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[1], ref(x)[:, 4:8], atol=1e-5, rtol=1e-5)


def test_te_attention_runs_packed_documents_as_thd(fake_te, monkeypatch):
    """attention_backend=te hands packed documents to te.DotProductAttention as qkv_format=thd with cu_seqlens
    (the stand-in checks the arguments and attends within each document)."""
    from difflm.model import attention
    from difflm.model.masks import DocumentMask, document_ids

    monkeypatch.setattr(attention, "_check", lambda backend, device: None)  # the stand-in runs on the CPU
    cfg = small_cfg(attention_backend="te")
    model = te_model(cfg)
    assert type(model.layers[0].attention.core).__name__ == "DotProductAttention"
    ref = Transformer(replace(cfg, attention_backend="sdpa"))
    ref.load_state_dict(te_to_torch_state_dict(model.state_dict()))
    x = torch.randint(1, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    x[0, 3] = x[0, 11] = x[1, 7] = 0
    for causal in (False, True):
        mask = DocumentMask(document_ids(x, 0), causal=causal)
        with torch.no_grad():
            out = model(x, attn_mask=mask)
            torch.testing.assert_close(out, ref(x, attn_mask=mask.dense()), atol=1e-5, rtol=1e-5)
    assert mask.varlen()[0].tolist() == [0, 4, 12, 16, 24, 32]


@pytest.mark.parametrize("backend", ["te", "flash"])
def test_backends_refuse_masks_they_cannot_take(backend, monkeypatch):
    from difflm.model import attention
    from difflm.model.masks import BlockDiffusionMask

    monkeypatch.setattr(attention, "_check", lambda b, d: None)
    q, k, v = qkv(s=16)
    with pytest.raises(DifflmError, match=rf"model.attention_backend={backend} cannot take the block-diffusion mask "
                                          r"\(objective=bd3lm\): use model.attention_backend=sdpa or flex"):
        attend(q, k, v, causal=False, backend=backend, attn_mask=BlockDiffusionMask(8, 4))
    with pytest.raises(DifflmError, match=f"model.attention_backend={backend} cannot take a dense attention mask"):
        attend(q, k, v, causal=False, backend=backend, attn_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))


OBJECTIVE_CASES = {
    "mdlm": dict(name="mdlm"),
    "ar": dict(name="ar"),
    "bd3lm": dict(name="bd3lm", block_size=4),
    "sft": dict(name="sft"),
    "sft_packed": dict(name="sft", packed=True),
    "mdlm_packed": dict(name="mdlm", packed=True),
    "ar_packed": dict(name="ar", packed=True),
    "bd3lm_packed": dict(name="bd3lm", block_size=4, packed=True),
}


@pytest.mark.parametrize("case", list(OBJECTIVE_CASES))
def test_every_objective_trains_a_step_under_both_kernel_sets(fake_te, case):
    """One optimizer step of each objective (with packed documents where it applies) on the torch kernels and on the
    TE kernels (CPU stand-in), same weights: same loss, same updated weights."""
    from difflm.data.batch import TokenBatch
    from difflm.model.masks import document_ids
    from difflm.objectives import build_objective, weighted_ce_sum
    from tests.dlm_helpers import objective_cfg

    spec = dict(OBJECTIVE_CASES[case])
    packed = spec.pop("packed", False)
    obj = build_objective(objective_cfg(**spec), mask_id=95)
    cfg = small_cfg()
    x = torch.randint(1, 95, (2, 16), generator=torch.Generator().manual_seed(5))
    if packed and spec["name"] == "sft":  # two pairs in row 0, three in row 1 (data.sft_packing)
        doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 5 + [1] * 6 + [2] * 5])
        prompt = torch.zeros(2, 16, dtype=torch.bool)
        prompt[0, :3] = prompt[0, 9:12] = prompt[1, :2] = prompt[1, 5:8] = prompt[1, 11:13] = True
        tokens = TokenBatch(x, doc_ids=doc, prompt_mask=prompt)
    elif packed:
        x[0, 6] = x[1, 3] = x[1, 10] = 0
        tokens = TokenBatch(x, doc_ids=document_ids(x, 0))
    elif spec["name"] == "sft":
        tokens = TokenBatch(x, prompt_lengths=torch.tensor([4, 7]))
    else:
        tokens = x
    batch = obj.noise(tokens, [0, 1], (0, 0, 3), 2)
    losses, weights = [], []
    for model in (Transformer(cfg, obj.causal), te_model(cfg, obj.causal)):
        model.init_weights(11)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = weighted_ce_sum(model(batch.input_ids, batch.loss_mask, **batch.model_kwargs()), batch, "token", 2)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        weights.append({k: v for k, v in model.state_dict().items() if not k.endswith(EXTRA_STATE)})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and 0 < losses[0] < 100
    for k, v in weights[0].items():
        torch.testing.assert_close(weights[1][k], v, atol=1e-5, rtol=1e-4)


def _fp8_per_layer(model, ids):
    from difflm.training.precision import fp8_is_active

    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(fp8_is_active())) for layer in model.layers]
    model(ids)
    for h in hooks:
        h.remove()
    return seen


def test_fp8_skip_first_last_and_odd_shapes(fake_te):
    from difflm.config.schema import PrecisionConfig
    from difflm.model.te_kernels import fp8_layer_options
    from difflm.training.precision import te_autocast

    cfg = small_cfg(num_layers=4)
    prec = PrecisionConfig(name="fp8", fp8_skip_first_last=True)
    opts = fp8_layer_options(cfg, prec)
    assert set(opts["bf16_layers"]) == {0, 3} and opts["fp8_weights_recipe"] is None
    assert fp8_layer_options(cfg, PrecisionConfig(name="bf16", fp8_skip_first_last=True))["bf16_layers"] == ()
    model = te_model(cfg, precision=prec)
    with te_autocast(True):
        assert _fp8_per_layer(model, torch.zeros(2, 32, dtype=torch.long)) == [False, True, True, False]
        # 2 x 21 tokens is no whole FP8 tile: the whole forward falls back to BF16
        assert _fp8_per_layer(model, torch.zeros(2, 21, dtype=torch.long)) == [False] * 4
    assert _fp8_per_layer(model, torch.zeros(2, 32, dtype=torch.long)) == [False] * 4


def test_build_model_dispatch(fake_te):
    cfg = small_cfg(backend="te")
    with pytest.raises(DifflmError, match="model.backend=te runs Transformer Engine's CUDA kernels"):
        build_model(cfg, causal=False, device=torch.device("cpu"), seed=0)
    torch_model = build_model(replace(cfg, backend="torch"), causal=False, device=torch.device("cpu"), seed=0)
    assert isinstance(torch_model, Transformer) and torch_model.kernels.name == "torch"


@pytest.mark.parametrize("mode,wrapped", [("full", [0, 1, 2]), ("selective", [0, 2])])
def test_activation_checkpointing_recomputes_te_blocks_through_te_checkpoint(fake_te, mode, wrapped):
    """TE blocks are checkpointed by ``transformer_engine.pytorch.checkpoint`` (which replays the forward's FP8
    state; torch's checkpoint fails the backward of an FP8 block), torch blocks by ``torch.utils.checkpoint``; the
    gradients equal the unwrapped model's."""
    import transformer_engine.pytorch as te
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from difflm.model.te_kernels import TEKernels
    from difflm.parallel.fsdp import apply_activation_checkpointing

    cfg = small_cfg(backend="te")
    ref = build_model(replace(cfg, backend="torch"), causal=False, device=torch.device("cpu"), seed=0)
    models = {}
    for name in ("plain", "ac"):
        m = Transformer(cfg, causal=False, kernels=TEKernels(cfg, device="meta"))
        m.to_empty(device=torch.device("cpu"))
        m.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg), strict=False)
        models[name] = m
    apply_activation_checkpointing(models["ac"], mode)
    blocks = list(models["ac"].layers)
    assert [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)] == wrapped
    assert all(blocks[i].checkpoint_fn.func is te.checkpoint for i in wrapped)
    torch_ac = apply_activation_checkpointing(
        build_model(replace(cfg, backend="torch"), causal=False, device=torch.device("cpu"), seed=0), mode)
    assert all(b.checkpoint_fn.func is torch.utils.checkpoint.checkpoint
               for b in torch_ac.layers if isinstance(b, CheckpointWrapper))
    ids = torch.randint(0, cfg.vocab_size - 1, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = {}
    calls = te.checkpoint.calls
    for name, m in models.items():
        m(ids).float().square().mean().backward()
        grads[name] = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                       for k, p in m.named_parameters() if p.grad is not None}
    assert te.checkpoint.calls - calls == len(wrapped)
    assert set(grads["ac"]) == set(grads["plain"])
    for k in grads["plain"]:
        torch.testing.assert_close(grads["ac"][k], grads["plain"][k], atol=1e-6, rtol=1e-5)


def test_build_model_compiles_blocks_in_place():
    model = build_model(small_cfg(compile=True), causal=False, device=torch.device("cpu"), seed=0)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    assert set(model.state_dict()) == set(Transformer(small_cfg()).state_dict())  # names unchanged


# ------------------------------------------------------------------ real TE on a GPU
def te_tiny_cfg() -> ModelConfig:
    from conftest import compose_run

    from difflm.data import build_tokenizer
    from difflm.model import resolve_model_config

    run = compose_run(["model=tiny"])  # model.*=auto resolved to the torch kernels: each test names the TE ones
    tok = build_tokenizer(run.data.tokenizer, run.model.vocab_multiple)
    resolve_model_config(run.model, tok.padded_vocab_size)
    fields = {f: run.model[f] for f in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields)


def test_te_tiny_cfg_builds_off_the_gpu_too():
    """The GPU tests' config holds concrete kernels (build_model refuses model.*=auto), checked where CI runs."""
    cfg = te_tiny_cfg()
    assert (cfg.backend, cfg.attention_backend, cfg.fused_mlp, cfg.fused_mlp_autotune) == ("torch", "sdpa", False,
                                                                                           False)
    model = build_model(cfg, causal=False, device=torch.device("cpu"), seed=0)
    assert sum(p.numel() for p in model.parameters()) > 0


@cuda_te
def test_record_and_check_te_fixture():
    import transformer_engine

    cfg = te_tiny_cfg()
    model = build_model(replace(cfg, backend="te"), causal=False, device=torch.device("cuda"), seed=0)
    tensors = [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in model.state_dict().items()]
    path = FIXTURE
    if os.environ.get("DIFFLM_RECORD_TE_FIXTURE") == "1":
        data = {"recorded_with": {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
                                  "device": torch.cuda.get_device_name()},
                "model": {f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__},
                "tensors": tensors}
        path = Path(os.environ.get("DIFFLM_FIXTURE_OUT", FIXTURE))
        path.write_text(json.dumps(data, indent=1) + "\n")
    assert tensors == json.loads(path.read_text())["tensors"]
    # the mapping of a torch-backend state dict gives exactly these names and shapes
    mapped = torch_to_te_state_dict(Transformer(cfg).state_dict(), cfg)
    assert {k: list(v.shape) for k, v in mapped.items()} == {t["name"]: t["shape"] for t in tensors}


def build_te_model(cfg, **kw):
    return build_model(replace(cfg, backend="te"), **kw)


def _parity(cfg, causal, seed=0, b=2, s=256, attention="sdpa"):
    from difflm.objectives.base import NoisedBatch, weighted_ce_sum
    from difflm.training.precision import autocast_context

    dev = torch.device("cuda")
    ref = build_model(cfg, causal=causal, device=dev, seed=seed)
    model = build_te_model(replace(cfg, attention_backend=attention), causal=causal, device=dev, seed=seed)
    model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size - 1, (b, s), device=dev, generator=g)
    mask = torch.rand(b, s, device=dev, generator=g) < 0.5
    batch = NoisedBatch(input_ids=ids, targets=ids, loss_mask=mask, weights=mask.float() * 2.0,
                        t=torch.full((b,), 0.5, device=dev), num_tokens=torch.full((b,), float(s), device=dev))
    out = {}
    for name, m in (("torch", ref), ("te", model)):
        with autocast_context("bf16", dev):
            logits = m(ids, mask)
        loss = weighted_ce_sum(logits, batch, "token", b * s)
        loss.backward()
        grads = {k: p.grad.float().clone() for k, p in m.named_parameters()}
        out[name] = (logits.float(), loss.detach(), grads)
    (lt, st, gt), (le, se, ge) = out["torch"], out["te"]
    rel = lambda a, c: float((a - c).norm() / c.norm())  # noqa: E731
    grad_rel = max(rel(ge[k], gt[k]) for k in gt)
    return {"logits_rel": rel(le, lt), "loss_torch": float(st), "loss_te": float(se),
            "loss_rel": abs(float(se) - float(st)) / float(st), "max_grad_rel": grad_rel}


@cuda_te
@pytest.mark.parametrize("attention", ["te", "sdpa", "flash"])
@pytest.mark.parametrize("causal", [False, True])
def test_te_matches_torch_backend_in_bf16(causal, attention):
    if attention_unavailable_reason(attention, torch.device("cuda"), "bf16"):
        pytest.skip(attention_unavailable_reason(attention, torch.device("cuda"), "bf16"))
    cfg = replace(te_tiny_cfg(), num_kv_heads=2)
    r = _parity(cfg, causal, attention=attention)
    report("parity_bf16", causal=causal, attention=attention, **r)
    assert r["logits_rel"] < 2e-2 and r["loss_rel"] < 5e-3 and r["max_grad_rel"] < 5e-2


def _masked_parity(cfg, batch, attention: str, seed: int = 0):
    """Torch kernels + SDPA (dense masks) against TE kernels + ``attention`` on the same weights, BF16, for a noised
    batch with a structured mask: logits and loss."""
    from difflm.objectives.base import weighted_ce_sum
    from difflm.training.precision import autocast_context

    dev = torch.device("cuda")
    ref = build_model(cfg, causal=False, device=dev, seed=seed)
    model = build_te_model(replace(cfg, attention_backend=attention), causal=False, device=dev, seed=seed)
    model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))
    batch = batch.to(dev)
    out = {}
    for name, m in (("torch", ref), ("te", model)):
        with autocast_context("bf16", dev):
            logits = m(batch.input_ids, batch.loss_mask, **batch.model_kwargs())
        loss = weighted_ce_sum(logits, batch, "token", batch.input_ids.shape[0])
        loss.backward()
        out[name] = (logits.float(), float(loss))
    (lt, st), (le, se) = out["torch"], out["te"]
    return {"logits_rel": float((le - lt).norm() / lt.norm()), "loss_torch": st, "loss_te": se,
            "loss_rel": abs(se - st) / st}


def _tokens(cfg, b, s, eos_every=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, cfg.vocab_size - 1, (b, s), generator=g)
    if eos_every:
        x[torch.rand(b, s, generator=g) < 1.0 / eos_every] = 0
    return x


@cuda_te
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_bd3lm_te_kernels_match_torch_in_bf16(attention):
    from difflm.objectives import BD3LMObjective
    from tests.dlm_helpers import objective_cfg

    cfg = replace(te_tiny_cfg(), num_kv_heads=2)
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=16), cfg.vocab_size - 1)
    batch = obj.noise(_tokens(cfg, 2, 256), [0, 1], (0, 0, 1), 2)
    r = _masked_parity(cfg, batch, attention)
    report("parity_bd3lm_bf16", block_size=16, attention=attention, **r)
    assert r["logits_rel"] <= 1e-2 and r["loss_rel"] <= 1e-3


@cuda_te
@pytest.mark.parametrize("attention", ["te", "flash", "flex", "sdpa"])
def test_packed_documents_te_kernels_match_torch_in_bf16(attention):
    from difflm.data.batch import TokenBatch
    from difflm.model.masks import document_ids
    from difflm.objectives import MDLMObjective
    from tests.dlm_helpers import objective_cfg

    if attention_unavailable_reason(attention, torch.device("cuda"), "bf16"):
        pytest.skip(attention_unavailable_reason(attention, torch.device("cuda"), "bf16"))
    cfg = replace(te_tiny_cfg(), num_kv_heads=2)
    x = _tokens(cfg, 2, 512, eos_every=60)
    obj = MDLMObjective(objective_cfg(), cfg.vocab_size - 1)
    batch = obj.noise(TokenBatch(x, doc_ids=document_ids(x, 0)), [0, 1], (0, 0, 1), 2)
    r = _masked_parity(cfg, batch, attention)
    report("parity_packed_documents_bf16", attention=attention, documents=int(batch.attn_mask.varlen()[0].numel() - 1),
           **r)
    assert r["logits_rel"] <= 1e-2 and r["loss_rel"] <= 1e-3


@cuda_te
@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_step_tracks_bf16_and_state_dict_goes_back(recipe, monkeypatch):
    from difflm.config.schema import PrecisionConfig
    from difflm.training.precision import autocast_context, device_fp8_unsupported_reason

    dev = torch.device("cuda")
    if device_fp8_unsupported_reason(recipe, dev):
        pytest.skip(device_fp8_unsupported_reason(recipe, dev))
    cfg = replace(te_tiny_cfg(), attention_backend="te")
    prec = PrecisionConfig(name="fp8", fp8_recipe=recipe)
    model = build_te_model(cfg, causal=False, device=dev, seed=0, precision=prec)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size - 1, (4, 128), device=dev, generator=g)
    losses = {}
    for name, p in (("bf16", "bf16"), ("fp8", prec)):
        for _ in range(3):  # delayed scaling needs a step or two of amax history
            with autocast_context(p, dev):
                logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
            model.zero_grad()
        losses[name] = float(loss)
    rel = abs(losses["fp8"] - losses["bf16"]) / losses["bf16"]
    report("fp8_vs_bf16_forward", recipe=recipe, **losses, rel=rel)
    assert rel < 2e-2
    sd = model.state_dict()
    extra = [k for k in sd if k.endswith(EXTRA_STATE) and sd[k].numel() > 0]
    if recipe == "delayed":
        assert extra  # the FP8 amax history is checkpointed
    ref = Transformer(replace(cfg, attention_backend="sdpa"))
    ref.load_state_dict(te_to_torch_state_dict(sd))  # strict, FP8 metadata dropped
    # TE -> TE keeps the FP8 metadata; TE unpickles delayed-scaling state only when told the file is trusted
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    fresh = build_te_model(cfg, causal=False, device=dev, seed=1)
    fresh.load_state_dict(sd)


@cuda_te
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fp8_step_with_activation_checkpointing_equals_without(mode):
    """An FP8 (current scaling) step of a checkpointed TE model: the backward runs (TE's checkpoint replays the FP8
    state) and the loss and gradients equal the unchecked model's."""
    from difflm.config.schema import PrecisionConfig
    from difflm.parallel.fsdp import apply_activation_checkpointing
    from difflm.training.precision import autocast_context, device_fp8_unsupported_reason

    dev = torch.device("cuda")
    if device_fp8_unsupported_reason("current", dev):
        pytest.skip(device_fp8_unsupported_reason("current", dev))
    cfg = replace(te_tiny_cfg(), attention_backend="te")
    prec = PrecisionConfig(name="fp8", fp8_recipe="current")
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size - 1, (4, 128), device=dev, generator=g)
    out = {}
    for name in ("plain", "ac"):
        model = build_te_model(cfg, causal=False, device=dev, seed=0, precision=prec)
        if name == "ac":
            apply_activation_checkpointing(model, mode)
        for _ in range(2):  # the second step runs on cached FP8 weights of the first, as training does
            model.zero_grad()
            with autocast_context(prec, dev):
                logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
        out[name] = (float(loss), {k.replace("_checkpoint_wrapped_module.", ""): p.grad.float().clone()
                                   for k, p in model.named_parameters() if p.grad is not None})
    (lp, gp), (la, ga) = out["plain"], out["ac"]
    grad_rel = max(float((ga[k] - gp[k]).norm() / gp[k].norm().clamp_min(1e-12)) for k in gp)
    report("fp8_activation_checkpointing", mode=mode, loss_plain=lp, loss_ac=la, max_grad_rel=grad_rel)
    assert set(ga) == set(gp) and abs(la - lp) <= 1e-3 * abs(lp) and grad_rel < 1e-2


@cuda_te
def test_fp8_weights_model_runs_and_dequantizes():
    from difflm.config.schema import PrecisionConfig
    from difflm.training.precision import autocast_context

    dev = torch.device("cuda")
    cfg = te_tiny_cfg()
    prec = PrecisionConfig(name="fp8", fp8_weights=True, fp8_skip_first_last=True)
    model = build_te_model(cfg, causal=False, device=dev, seed=0, precision=prec)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, 128), device=dev)
    with autocast_context(prec, dev):
        assert torch.isfinite(model(ids)).all()
    ref_sd = Transformer(cfg).state_dict()
    back = te_to_torch_state_dict(model.state_dict())
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in ref_sd.items()}
    assert all(v.dtype == torch.float32 for v in back.values())


@cuda_te
@pytest.mark.parametrize("backend", ["te", "flash", "flex"])
def test_attention_backends_match_sdpa_on_gpu(backend):
    dev = torch.device("cuda")
    reason = attention_unavailable_reason(backend, dev, "bf16")
    if reason:
        pytest.skip(reason)
    q, k, v = (t.to(dev, torch.bfloat16) for t in qkv(b=2, h=8, h_kv=2, s=512, d=128))
    for causal in (False, True):
        ref = attend(q, k, v, causal=causal, backend="sdpa").float()
        out = attend(q, k, v, causal=causal, backend=backend).float()
        rel = float((out - ref).norm() / ref.norm())
        report("attention_vs_sdpa", backend=backend, causal=causal, rel=rel)
        assert rel < 1e-2


@cuda_te
@pytest.mark.parametrize("attention", ["te", "flash", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_sampler_calls_on_the_te_kernels(attention, causal):
    """The trainer pads each sampler call to a multiple of parallel.tp under sequence parallelism
    (difflm.generate.pad_to_multiple: the pads a document of their own); on the GPU kernels the real positions'
    logits match the plain call's within BF16 rounding, and the padded sampler runs end to end (a tiny random
    model's near-flat logits let BF16 rounding flip its greedy picks, so the tokens are not compared here; the CPU
    test compares them in FP32)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig
    from difflm.generate import generate_ids, pad_to_multiple

    if attention_unavailable_reason(attention, torch.device("cuda"), "bf16"):
        pytest.skip(attention_unavailable_reason(attention, torch.device("cuda"), "bf16"))
    cfg = replace(te_tiny_cfg(), attention_backend=attention)
    model = build_model(cfg, causal=causal, device=torch.device("cuda"), seed=0).eval()
    x = torch.randint(0, cfg.vocab_size - 2, (2, 37), device="cuda")
    padded, kw = pad_to_multiple(x, 8, causal, {})
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = model(padded, **kw)[:, :37].float(), model(x).float()
    rel = float((got - want).norm() / want.norm())
    report("padded_sampler_call", attention=attention, causal=causal, logits_rel=rel)
    assert rel <= 1e-2
    tok = SimpleNamespace(mask_id=cfg.vocab_size - 1, eos_id=0, tokenizer=list(range(cfg.vocab_size - 2)))
    gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 6, "temperature": 0.0} if causal else
                          {"length": 6, "steps": 6, "block_length": 6, "temperature": 0.0})
    prompt = x[:, :5]
    plain = generate_ids(model, tok, prompt, gen, causal, precision="bf16")
    assert generate_ids(model, tok, prompt, gen, causal, precision="bf16", seq_multiple=8).shape == plain.shape
