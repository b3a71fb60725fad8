"""Routing variants of released MoE models (difflm/model/moe.py): DeepSeek-V3's group-limited sigmoid top-k with
an expert bias and a routed scaling factor (as LLaDA 2 uses it) against a reference written from the equations,
``model.moe.first_k_dense`` dense blocks, shared experts of their own width, and the parameter counts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]

from conftest import compose_run
from difflm.errors import DifflmError
from difflm.model.moe import MoEMLP, TopKRouter, moe_inactive_params
from fixtures.fake_te_env import fake_te  # noqa: F401  (fixture)

CPU = torch.device("cpu")


def reference_routing(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, topk_group: int,
                      norm: bool, scale: float):
    """DeepSeek-V3 (tech report sec. 2.1.2, eqs. 12-16, node-limited routing), token by token with plain loops:
    s = sigmoid(u W) (eq. 15); choice = s + b (eq. 16); group score = sum of the group's 2 largest choices; keep
    the topk_group best groups; the top-k choices among their experts; g = s of those (eq. 13: / their sum when
    norm), times the routed scaling factor."""
    t_n, e = logits.shape
    per = e // n_group
    ids, weights = [], []
    for t in range(t_n):
        s = [1.0 / (1.0 + np.exp(-float(x))) for x in logits[t]]
        c = [s[i] + float(bias[i]) for i in range(e)]
        group_score = []
        for g in range(n_group):
            members = sorted(c[g * per:(g + 1) * per], reverse=True)
            group_score.append(members[0] + (members[1] if per > 1 else 0.0))
        kept_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [i for g in kept_groups for i in range(g * per, (g + 1) * per)]
        chosen = sorted(candidates, key=lambda i: -c[i])[:top_k]
        g_w = [s[i] for i in chosen]
        if norm:
            total = sum(g_w)
            g_w = [w / total for w in g_w]
        ids.append(chosen)
        weights.append([w * scale for w in g_w])
    return np.array(ids), np.array(weights)


def test_grouped_sigmoid_routing_equals_the_deepseek_v3_equations():
    torch.manual_seed(0)
    e, d, t, k, groups, kept = 16, 8, 64, 4, 4, 2
    router = TopKRouter(d, e, k, "sigmoid", True, n_group=groups, topk_group=kept, routed_scaling_factor=2.5)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        router.bias.copy_(torch.linspace(-0.3, 0.3, e)[torch.randperm(e)])
    x = torch.randn(t, d)
    routing = router(x)
    logits = x.numpy().astype(np.float64) @ router.weight.detach().numpy().astype(np.float64).T
    ref_ids, ref_w = reference_routing(logits, router.bias.numpy(), k, groups, kept, True, 2.5)
    ids, w = routing.expert_ids.numpy(), routing.weights.detach().numpy()
    assert np.array_equal(np.sort(ids, 1), np.sort(ref_ids, 1))
    for row in range(t):
        mine = dict(zip(ids[row].tolist(), w[row].tolist()))
        ref = dict(zip(ref_ids[row].tolist(), ref_w[row].tolist()))
        assert all(abs(mine[i] - ref[i]) < 1e-6 for i in ref)
    assert np.allclose(w.sum(1), 2.5, atol=1e-6)
    # the group limit matters here: plain top-k of the same choice picks experts outside the kept groups
    flat_ids, _ = reference_routing(logits, router.bias.numpy(), k, 1, 1, True, 2.5)
    assert not np.array_equal(np.sort(flat_ids, 1), np.sort(ref_ids, 1))


def test_expert_bias_steers_the_choice_but_not_the_weight():
    e, d = 8, 4
    router = TopKRouter(d, e, 2, "sigmoid", False, n_group=2, topk_group=1, routed_scaling_factor=1.0)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([3.0, 2.0, 1.0, 0.0, 2.9, 1.9, 0.9, -0.1])
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    s = torch.sigmoid(router.weight[:, 0].detach())
    plain = router(x)
    assert sorted(plain.expert_ids[0].tolist()) == [0, 1]  # group 0 (experts 0-3) wins: 3.0 + 2.0 > 2.9 + 1.9
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]))
    biased = router(x)
    assert sorted(biased.expert_ids[0].tolist()) == [4, 5]  # the bias moves the choice to group 1
    weights = dict(zip(biased.expert_ids[0].tolist(), biased.weights[0].tolist()))
    assert abs(weights[4] - float(s[4])) < 1e-6 and abs(weights[5] - float(s[5])) < 1e-6  # unbiased sigmoid
    ids, w = reference_routing(router.weight[:, :1].detach().T.double().numpy(), router.bias.numpy(), 2, 2, 1,
                               False, 1.0)
    assert sorted(ids[0].tolist()) == [4, 5] and abs(sorted(w[0])[0] - float(s[5])) < 1e-6


def test_bias_in_weights_keeps_the_bias_in_the_gating_weights():
    """``bias_in_weights`` (LLaDA-MoE's ``topk(softmax(u) + b)``): the same experts as the steering-only bias, the
    weights the chosen ``softmax(u) + b`` (by hand here, not renormalised); the router weight gets the gradient of
    the softmax part, the bias none."""
    torch.manual_seed(1)
    e, d, t = 8, 6, 32
    steer = TopKRouter(d, e, 2, "softmax", False)
    both = TopKRouter(d, e, 2, "softmax", False, bias_in_weights=True)
    with torch.no_grad():
        steer.weight.normal_(0.0, 1.0)
        steer.bias.copy_(0.2 * torch.randn(e))
    both.load_state_dict(steer.state_dict())
    x = torch.randn(t, d)
    a, b = steer(x), both(x)
    assert torch.equal(a.expert_ids, b.expert_ids)
    p = torch.softmax(x.double() @ both.weight.detach().double().T, dim=-1) + both.bias.double()
    ref_w, ref_ids = p.topk(2, dim=-1)
    assert torch.equal(b.expert_ids, ref_ids)
    assert torch.allclose(b.weights.double(), ref_w, atol=1e-6)
    assert (b.weights - a.weights - both.bias[b.expert_ids]).abs().max() < 1e-6
    b.weights.sum().backward()
    assert both.weight.grad is not None and both.bias.grad is None and not both.bias.requires_grad


def model_cfg():
    """moe-tiny with 3 blocks, the first dense (ffn 48), 8 experts of width 24 in 4 groups, a shared expert of 40."""
    from difflm.model import resolve_model_config

    cfg = compose_run(["model=moe-tiny", "model.num_layers=3", "model.hidden_size=16", "model.num_heads=2",
                       "model.num_kv_heads=2", "model.ffn_hidden_size=48", "model.moe.ffn_hidden_size=24",
                       "model.moe.score_func=sigmoid", "model.moe.norm_topk_prob=true", "model.moe.n_group=4",
                       "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5", "model.moe.first_k_dense=1",
                       "model.moe.shared_ffn_hidden_size=40"]).model
    resolve_model_config(cfg, 128)
    return cfg


def test_first_k_dense_and_shared_width_build_and_count():
    from difflm.model import build_model
    from difflm.model.layers import LayerNormMLP
    from difflm.parallel.expert_parallel import routed_expert_modules

    cfg = model_cfg()
    model = build_model(cfg, causal=False, device=CPU, seed=0)
    mlps = [block.mlp for block in model.layers]
    assert isinstance(mlps[0], LayerNormMLP) and tuple(mlps[0].fc1_weight.shape) == (2 * 48, 16)
    assert all(isinstance(m, MoEMLP) for m in mlps[1:])
    assert tuple(mlps[1].shared.fc1_weight.shape) == (2 * 40, 16) and tuple(mlps[1].shared.fc2_weight.shape) == (16, 40)
    assert mlps[1].router.n_group == 4 and mlps[1].router.routed_scaling_factor == 2.5
    # the EP/FSDP helpers find exactly the MoE blocks' experts
    assert routed_expert_modules(model) == [mlps[1].experts, mlps[2].experts]
    # inactive parameters: the routed experts a token skips, in the 2 MoE blocks only
    unused = sum(p.numel() for m in mlps[1:] for p in m.experts.parameters()) * (8 - 2) // 8
    assert moe_inactive_params(cfg) == unused == 2 * 6 * 3 * 16 * 24
    # one forward with every expert weight counted: the dense block's MLP, the shared experts, the routers
    n_mlp = {name: sum(p.numel() for p in m.parameters()) for name, m in zip("abc", mlps)}
    assert n_mlp["a"] == 16 + 3 * 16 * 48
    assert n_mlp["b"] == 16 + 8 * 16 + 8 * 3 * 16 * 24 + 3 * 16 * 40
    out = model(torch.randint(0, 128, (2, 8)))
    assert out.shape == (2, 8, 128) and torch.isfinite(out).all()


def test_tensor_parallel_style_of_mixed_blocks():
    from difflm.model import build_model
    from difflm.parallel.expert_parallel import ReplicatedMoE
    from difflm.parallel.tensor_parallel import SwiGLUParallel, _mlp_style

    model = build_model(model_cfg(), causal=False, device=CPU, seed=0)
    styles = [type(_mlp_style(block.mlp, True)) for block in model.layers]
    assert styles == [SwiGLUParallel, ReplicatedMoE, ReplicatedMoE]


def test_te_module_names_keep_the_dense_blocks_mlp():
    from difflm.model.te_kernels import te_module_names

    names = te_module_names(model_cfg())
    assert "layers.0.mlp" in names and "layers.1.mlp" not in names and "layers.2.mlp" not in names


@pytest.mark.parametrize("overrides,needle", [
    (["model.moe.n_group=3"], "model.moe.n_group=3 does not divide model.moe.num_experts=8"),
    (["model.moe.n_group=4", "model.moe.topk_group=5"], "model.moe.topk_group=5 must be <= model.moe.n_group=4"),
    (["model.moe.n_group=4", "model.moe.topk_group=1", "model.moe.top_k=3"], "raise model.moe.topk_group"),
    (["model.moe.topk_group=5"], "model.moe.topk_group=5 must be <= model.moe.n_group=1"),
    (["model.moe.topk_group=0"], "model.moe.topk_group=0 must be >= 1"),
    (["model.moe.routed_scaling_factor=0"], "model.moe.routed_scaling_factor=0"),
    (["model.moe.first_k_dense=2"], "model.moe.first_k_dense=2 must be < model.num_layers=2"),
    (["model.moe.shared_ffn_hidden_size=-1"], "model.moe.shared_ffn_hidden_size=-1"),
    (["model.moe.num_shared_experts=0", "model.moe.shared_ffn_hidden_size=40"],
     "model.moe.shared_ffn_hidden_size=40 is the width of the shared experts and model.moe.num_shared_experts=0"),
])
def test_bad_routing_settings_are_one_line_errors(overrides, needle):
    from difflm.config.validate import check_moe

    cfg = compose_run(["model=moe-tiny", *overrides])
    with pytest.raises(DifflmError) as err:
        check_moe(cfg.model)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_released_shapes_have_their_parameter_counts():
    from difflm.model import resolve_model_config
    from difflm.model.transformer import Transformer

    for preset, total_b, active_b in (("llada-moe-7b-a1b", 7.36, 1.72), ("llada2-mini", 16.26, 1.43)):
        cfg = compose_run([f"model={preset}"])
        resolve_model_config(cfg.model, 157184)
        with torch.device("meta"):
            n = Transformer(cfg.model).num_params()  # without the input embedding (docs/moe.md)
        embedding = 157184 * 2048
        assert abs((n + embedding) / 1e9 - total_b) < 0.01, preset
        assert abs((n - moe_inactive_params(cfg.model) + embedding) / 1e9 - active_b) < 0.01, preset
    assert moe_inactive_params(cfg.model) == 19 * (256 - 8) * 3 * 2048 * 512  # llada2-mini: 19 MoE blocks


@pytest.mark.parametrize("preset", ["llada-moe-tiny", "llada2-tiny"])
@pytest.mark.parametrize("objective", ["mdlm", "ar", "bd3lm", "sft"])
def test_tiny_released_shapes_train_under_every_objective(preset, objective, fast_cfg, tmp_path):
    import math

    from difflm.training.trainer import Trainer

    extra = {"bd3lm": ["objective.block_size=8"]}.get(objective, [])
    if objective == "sft":
        from tests.test_sft import GSM8K

        if not GSM8K.exists():
            pytest.skip("GSM8K not present under /work/shared/data")
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(open(GSM8K).readlines()[:8]))
        extra = [f"data.path={pairs}", "data.prompt_field=question", "data.response_field=answer",
                 "data.seq_len=96", "data.valid_fraction=0.25", "objective.random_length_prob=0"]
    own = OmegaConf.load(ROOT / "conf" / "model" / f"{preset}.yaml")  # its own sizes over conftest's FAST ones
    sizes = [f"model.{key}={own[key]}" for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                    "ffn_hidden_size")]
    cfg = fast_cfg(f"model={preset}", *sizes, f"objective={objective}", *extra, "train.max_steps=2",
                   "train.eval_every=2",
                   "train.eval_windows=2", "train.eval_mc_samples=1", "train.save_every=0", "logger.log_every=1",
                   "device=cpu")
    metrics = Trainer(cfg, tmp_path / "run", CPU).fit()
    assert metrics["step"] == 2 and 0 < metrics["loss"] < 30 and math.isfinite(metrics["val_nelbo"])
    moe_blocks = [i for i in range(cfg.model.num_layers) if i >= cfg.model.moe.first_k_dense]
    assert {f"moe/load_max_mean/{i}" for i in moe_blocks} <= set(metrics)
    assert cfg.model.num_layers == own.num_layers and cfg.model.ffn_hidden_size == own.ffn_hidden_size
    if preset == "llada2-tiny":  # the aux-loss-free bias moved after each step (16 experts, gamma 0.001)
        assert "moe/load_max_mean/0" not in metrics and metrics["moe/bias_norm"] > 0


def test_export_of_llada2_tiny_gives_its_logits(fast_cfg, tmp_path):
    """The exported modeling file builds the dense first block, group-limited routing with the moved bias and the
    scaling factor: ``AutoModel`` logits equal difflm's."""
    from transformers import AutoModel

    from difflm.interop.export import export_run
    from difflm.training.trainer import Trainer

    own = OmegaConf.load(ROOT / "conf" / "model" / "llada2-tiny.yaml")
    cfg = fast_cfg("model=llada2-tiny", f"model.num_layers={own.num_layers}",
                   f"model.ffn_hidden_size={own.ffn_hidden_size}", "model.moe.shared_ffn_hidden_size=24",
                   "model.moe.bias_update_rate=0.01", "train.max_steps=2", "train.save_every=2", "train.eval_every=0",
                   "optim.lr=1e-2", "device=cpu")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    model = trainer.model.eval()
    assert model.layers[1].mlp.router.bias.abs().sum() > 0
    out = export_run(cfg.run.dir, tmp_path / "hf")
    hf = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    assert (hf.config.moe_n_group, hf.config.moe_first_k_dense, hf.config.moe_shared_intermediate_size) == (4, 1, 24)
    assert type(hf.layers[0].mlp).__name__ == "LayerNormMLP" and type(hf.layers[1].mlp).__name__ == "MoEMLP"
    router = hf.layers[1].mlp.router
    assert (router.n_group, router.topk_group, router.scale) == (4, 2, 2.5)
    ids = torch.randint(0, 50277, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-5, diff


def test_dense_first_block_under_te_kernels_matches_torch_kernels(fake_te):
    """llada2-tiny under the TE kernel set: block 0's MLP is TE's (with its metadata), the MoE blocks' are not;
    the state dicts convert both ways and the logits agree."""
    from difflm.model import Transformer, resolve_model_config
    from difflm.model.te_kernels import TEKernels, te_to_torch_state_dict, torch_to_te_state_dict

    cfg = compose_run(["model=llada2-tiny"]).model
    resolve_model_config(cfg, 128)
    ref = Transformer(cfg)
    ref.init_weights(3)
    te_model = Transformer(cfg, kernels=TEKernels(cfg, device="cpu"))
    te_model.load_state_dict(torch_to_te_state_dict(ref.state_dict(), cfg))  # strict: the names line up
    extra = {k for k in te_model.state_dict() if k.endswith("_extra_state") and ".mlp" in k}
    assert extra == {"layers.0.mlp._extra_state"}
    ref.load_state_dict(te_to_torch_state_dict(te_model.state_dict()))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(te_model.eval()(x), ref.eval()(x), atol=1e-5, rtol=1e-5)
