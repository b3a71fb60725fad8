"""LLaDA-MoE / LLaDA 2.0 checkpoints (CPU, offline) and partial RoPE.

Their ``trust_remote_code`` modeling files are not available offline, so the references here are written from their
published equations (module docstring of :mod:`difflm.interop.llada_layouts`): a float64 forward that reads a tiny
random checkpoint by the release's tensor names and config keys. difflm-import must give its logits; difflm-export
``format=llada2`` / ``llada_moe`` must write the release's names back (checked against the expected key lists below)
and re-import to the same logits.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from difflm.errors import DifflmError
from difflm.interop.export import export_checkpoint, load_run_for_export
from difflm.interop.hf_import import import_hf, train_overrides
from difflm.model.rope import apply_rope, rope_angles, rope_cos_sin_at, rope_tables
from tests.test_hf_interop import N_TOK, NEOX, hf_logits

VOCAB = 50280
D, HEADS, KV, HD, E, F_E, F_D = 64, 4, 2, 16, 8, 32, 96


# ------------------------------------------------------------------ partial RoPE
def rotate_reference(x: torch.Tensor, pos: torch.Tensor, fraction: float, base: float) -> torch.Tensor:
    """x [..., S, H, D]: pairs (i, i + R/2) of the first R = D * fraction dims turned by pos * base^(-2i/R), the
    rest unchanged (transformers' partial rotary, rotate-half within the rotated slice); float64."""
    r = int(x.shape[-1] * fraction)
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = (pos.double()[..., None] * inv)[..., None, :]  # [..., S, 1, R/2]
    c, s = ang.cos(), ang.sin()
    a, b = x[..., : r // 2].double(), x[..., r // 2: r].double()
    return torch.cat([a * c - b * s, b * c + a * s, x[..., r:].double()], dim=-1)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_partial_rope_rotates_the_first_dims_only(fraction):
    x = torch.randn(2, 7, 3, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7)
    cos, sin = rope_tables(rope_angles(pos, 32, 10000.0, fraction), "bshd")
    ours = apply_rope(x, cos, sin)
    assert (ours.double() - rotate_reference(x, pos, fraction, 10000.0)).abs().max() < 1e-5
    # explicit [B, S] positions (padded batches, KV-cached sampling) in [B, H, S, D]
    ids = torch.tensor([[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]])
    cos, sin = rope_cos_sin_at(ids, 32, 10000.0, fraction)
    ours = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    assert (ours.double() - rotate_reference(x, ids, fraction, 10000.0)).abs().max() < 1e-5


def test_partial_rotary_factor_must_give_even_dims():
    from difflm.config.compose import compose_train_config
    from difflm.config.validate import check_model

    cfg = compose_train_config(["model=tiny", "model.partial_rotary_factor=0.3"])
    with pytest.raises(DifflmError, match="model.partial_rotary_factor=0.3 gives 9 rotary dims"):
        check_model(cfg.model)


def _partial_model(fraction: float):
    from omegaconf import OmegaConf

    from difflm.model.transformer import Transformer

    cfg = OmegaConf.create(dict(
        name="t", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, head_dim=8,
        vocab_size=48, vocab_multiple=1, rope_base=10000.0, partial_rotary_factor=fraction, norm_eps=1e-5,
        qk_norm=True, tie_embeddings=False, init_std=0.3, backend="torch", attention_backend="sdpa", compile=False))
    model = Transformer(cfg, causal=False)
    model.init_weights(0)
    return model.eval()


def test_partial_rope_kv_cached_forward_is_exact_and_the_factor_is_live():
    from difflm.model.kv_cache import KVCache

    model = _partial_model(0.5)
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        cache = KVCache()
        model(x, kv_cache=cache.write())
        part = model(x[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=cache.read(4, 8))
        whole_head = _partial_model(1.0)(x)
    assert torch.allclose(part, full[:, 4:8], atol=1e-5)
    assert (whole_head - full).abs().max() > 1e-2  # same weights, RoPE on every dim: other logits


# ------------------------------------------------------------------ tiny checkpoints in the releases' layouts
def llada2_config(**extra) -> dict:
    """A 2-block LLaDA 2.0 config.json (block 0 dense, block 1 MoE), the release's keys."""
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": VOCAB,
            "hidden_size": D, "intermediate_size": F_D, "num_hidden_layers": 2, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "head_dim": HD, "hidden_act": "silu", "use_qkv_bias": True, "use_qk_norm": True,
            "use_bias": False, "norm_head": False, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 600000, "rope_scaling": None, "partial_rotary_factor": 0.5, "rotary_dim": 8,
            "num_experts": E, "num_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.5, "moe_intermediate_size": F_E, "first_k_dense_replace": 1,
            "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True,
            "pad_token_id": 0, "eos_token_id": 0, **extra}


def llada_moe_config(**extra) -> dict:
    """A 2-block LLaDA-MoE config.json (every block MoE), the release's keys (its ``model_type`` is ``llada``)."""
    return {"architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "vocab_size": VOCAB, "hidden_size": D,
            "dense_intermediate_size": F_D, "expert_intermediate_size": F_E, "shared_expert_intermediate_size": None,
            "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 50000.0, "rope_scaling": None,
            "partial_rotary_factor": 1.0, "attention_bias": False, "clip_qkv": None, "num_experts_per_tok": 2,
            "num_experts": E, "router_aux_loss_coef": 0.01, "norm_topk_prob": False, "qk_layernorm": True,
            "moe_layer_freq": [1, 1], "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
            "routed_scaling_factor": 1, "pad_token_id": 0, "eos_token_id": 0, **extra}


def _mlp_keys(prefix: str) -> list[str]:
    return [f"{prefix}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def llada2_keys() -> set[str]:
    """The release's tensor names of :func:`llada2_config` (LLaDA2MoeModelLM's state dict)."""
    keys = ["model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                 p + "attention.query_key_value.weight", p + "attention.query_key_value.bias",
                 p + "attention.query_layernorm.weight", p + "attention.key_layernorm.weight",
                 p + "attention.dense.weight"]
    keys += _mlp_keys("model.layers.0.mlp.")
    keys += ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias"]
    keys += [k for j in range(E) for k in _mlp_keys(f"model.layers.1.mlp.experts.{j}.")]
    return set(keys + _mlp_keys("model.layers.1.mlp.shared_experts."))


def llada_moe_keys(dense: tuple[int, ...] = (), shared: bool = False, bias: bool = False) -> set[str]:
    """The release's tensor names of :func:`llada_moe_config` (LLaDAMoEModelLM's state dict): blocks ``dense`` with
    the dense MLP, the others MoE with ``shared_expert`` and ``mlp.expert_bias`` (moe_router_enable_expert_bias) when
    asked."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [f"{p}self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        if i in dense:
            keys += _mlp_keys(p + "mlp.")
            continue
        keys += [p + "mlp.gate.weight"] + [k for j in range(E) for k in _mlp_keys(f"{p}mlp.experts.{j}.")]
        keys += _mlp_keys(p + "shared_expert.") if shared else []
        keys += [p + "mlp.expert_bias"] if bias else []
    return set(keys)


def shapes(c: dict, keys: set[str]) -> dict[str, tuple]:
    """Shape of each release tensor (from the modeling files' module definitions)."""
    h, kv, hd, d = c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim") or D // HEADS, D
    out = {}
    for k in keys:
        if "embed" in k or k == "lm_head.weight":
            s = (VOCAB, d)
        elif k.endswith(("norm.weight", "layernorm.weight")):
            s = (hd,) if any(t in k for t in ("q_norm", "k_norm", "query_", "key_")) else (d,)
        elif "query_key_value" in k:
            s = ((h + 2 * kv) * hd, d) if k.endswith("weight") else ((h + 2 * kv) * hd,)
        elif k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            s = ((h if "q_proj" in k else kv) * hd, d)
        elif k.endswith(("dense.weight", "o_proj.weight")):
            s = (d, h * hd)
        elif k.endswith("gate.weight"):
            s = (E, d)
        elif k.endswith("expert_bias"):
            s = (E,)
        else:
            f = F_E if ("experts" in k or "shared" in k) else F_D
            s = (d, f) if "down_proj" in k else (f, d)
        out[k] = s
    return out


def write_checkpoint(tmp: Path, c: dict, keys: set[str], seed: int = 3) -> Path:
    """Random tensors under the release's names + config.json + the NeoX tokenizer (no mask token: added)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, s in sorted(shapes(c, keys).items()):
        if k.endswith(("norm.weight", "layernorm.weight")):
            state[k] = 1.0 + 0.1 * torch.randn(s, generator=g)
        elif k.endswith("expert_bias"):
            state[k] = 0.05 * torch.randn(s, generator=g)
        else:
            state[k] = (0.3 if k.endswith("gate.weight") else 0.08) * torch.randn(s, generator=g)
    out = tmp / "src"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(c))
    for f in NEOX.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


# ------------------------------------------------------------------ the releases' forward, from their equations
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(x, w, p):
    return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def reference_logits(src: Path, ids: torch.Tensor, routes: list | None = None,
                     weights: dict | None = None) -> torch.Tensor:
    """Bidirectional forward of the checkpoint in ``src`` (or of its tensors ``weights``) by the release's names and
    keys, float64. ``routes`` collects each MoE block's chosen experts [T, k]."""
    from safetensors.torch import load_file

    c = json.loads((src / "config.json").read_text())
    w = {k: v.double() for k, v in (weights or load_file(str(src / "model.safetensors"))).items()}
    two = c["model_type"] == "llada2_moe"
    eps, h, kv = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or D // h
    b, s = ids.shape
    x = w["model.word_embeddings.weight" if two else "model.embed_tokens.weight"][ids]
    pos = torch.arange(s)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        if two:
            qkv = a @ w[p + "attention.query_key_value.weight"].T + w[p + "attention.query_key_value.bias"]
            q, k, v = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
            qn, kn, o = "attention.query_layernorm", "attention.key_layernorm", "attention.dense"
        else:
            q, k, v = (a @ w[f"{p}self_attn.{t}_proj.weight"].T for t in "qkv")
            qn, kn, o = "self_attn.q_norm", "self_attn.k_norm", "self_attn.o_proj"
        q, k, v = q.view(b, s, h, hd), k.view(b, s, kv, hd), v.view(b, s, kv, hd)
        q, k = _rms(q, w[p + qn + ".weight"], eps), _rms(k, w[p + kn + ".weight"], eps)
        f = c.get("partial_rotary_factor", 1.0)
        q, k = rotate_reference(q, pos, f, c["rope_theta"]), rotate_reference(k, pos, f, c["rope_theta"])
        rep = h // kv  # query head j reads KV head j // rep
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        att = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd), dim=-1)
        x = x + torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h * hd) @ w[p + o + ".weight"].T
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        dense = i < c["first_k_dense_replace"] if two else c["moe_layer_freq"][i] == 0
        mlp = _swiglu(m, w, p + "mlp.") if dense else _moe(m.reshape(b * s, -1), w, p, c, two, routes).view(b, s, -1)
        x = x + mlp
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def _moe(t, w, p, c, two, routes=None):
    logits = t @ w[p + "mlp.gate.weight"].T
    k = c["num_experts_per_tok"]
    if two:  # sigmoid; group-limited choice on scores + bias; renormalised chosen scores x routed_scaling_factor
        scores = torch.sigmoid(logits)
        choice = (scores + w[p + "mlp.gate.expert_bias"]).view(t.shape[0], c["n_group"], -1)
        group = choice.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group, dtype=torch.bool).scatter(1, group.topk(c["topk_group"], -1).indices, True)
        idx = choice.masked_fill(~keep[..., None], float("-inf")).view(t.shape[0], -1).topk(k, -1).indices
        weights = scores.gather(1, idx)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
    else:  # softmax (+ expert_bias, when the flag builds it) top-k: experts and weights; not renormalised
        probs = torch.softmax(logits, dim=-1)
        if c.get("moe_router_enable_expert_bias"):
            probs = probs + w[p + "mlp.expert_bias"]
        weights, idx = probs.topk(k, dim=-1)
    if routes is not None:
        routes.append(idx)
    y = torch.zeros_like(t)
    for n in range(t.shape[0]):
        for j in range(k):
            y[n] += weights[n, j] * _swiglu(t[n], w, f"{p}mlp.experts.{int(idx[n, j])}.")
    shared = "mlp.shared_experts." if two else "shared_expert."
    if p + shared + "gate_proj.weight" in w:
        y = y + _swiglu(t, w, p + shared)
    return y


def _difflm_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    _, model, _, _ = load_run_for_export(run)
    with torch.no_grad():
        return model(ids)


CASES = {"llada2": (llada2_config, llada2_keys), "llada_moe": (llada_moe_config, llada_moe_keys)}


@pytest.mark.parametrize("layout", ["llada2", "llada_moe"])
def test_import_gives_the_release_logits_and_export_writes_its_layout(tmp_path, layout):
    from safetensors.torch import load_file

    make_cfg, make_keys = CASES[layout]
    c, keys = make_cfg(), make_keys()
    src = write_checkpoint(tmp_path, c, keys)
    cfg = import_hf(str(src), tmp_path / "run")
    m = cfg.model
    assert cfg.objective.name == "mdlm" and m.partial_rotary_factor == c["partial_rotary_factor"]
    if layout == "llada2":
        assert (m.moe.score_func, m.moe.n_group, m.moe.topk_group, m.moe.first_k_dense) == ("sigmoid", 4, 2, 1)
        assert m.moe.routed_scaling_factor == 2.5 and m.qkv_bias and "model.moe.first_k_dense=1" in train_overrides(cfg)
    ids = torch.randint(0, N_TOK, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(src, ids)
    ours = _difflm_logits(tmp_path / "run", ids)
    diff = (ours[..., :N_TOK].double() - ref[..., :N_TOK]).abs().max().item()
    print(f"{layout}: max |logit diff| vs the reference forward = {diff:.2e} (scale {ref.abs().max().item():.2f})")
    assert diff < 2e-5

    out = export_checkpoint(tmp_path / "run", tmp_path / "out", format=layout)[0]
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == keys
    source = load_file(str(src / "model.safetensors"))
    for k in keys - {"model.word_embeddings.weight", "model.embed_tokens.weight", "lm_head.weight"}:
        assert torch.equal(exported[k], source[k]), k  # vocab rows: padded to difflm's 50304 (mask token added)
    written = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts",
                "num_experts_per_tok", "partial_rotary_factor", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        assert written[key] == c[key], key
    assert written["vocab_size"] == 50304 and written["mask_token_id"] == N_TOK
    again = import_hf(str(out), tmp_path / "again")
    assert again.model.moe == cfg.model.moe
    assert torch.equal(_difflm_logits(tmp_path / "again", ids), ours)  # import(export(run)) is the run


def biased_llada_moe(tmp: Path, scale: float = 0.05) -> tuple[Path, dict, set[str]]:
    """A LLaDA-MoE checkpoint with ``moe_router_enable_expert_bias``, a dense first block and a shared expert; its
    ``expert_bias`` is ``scale`` x N(0, 1), comparable with the softmax probabilities (1/E on average), so that it
    changes the chosen experts of some tokens (a third of those of the tests' ids)."""
    from safetensors.torch import load_file, save_file

    c = llada_moe_config(moe_router_enable_expert_bias=True, moe_layer_freq=[0, 1], shared_expert_intermediate_size=F_E)
    keys = llada_moe_keys(dense=(0,), shared=True, bias=True)
    src = write_checkpoint(tmp, c, keys)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.1.mlp.expert_bias"] = scale * torch.randn(E, generator=torch.Generator().manual_seed(5))
    save_file(w, str(src / "model.safetensors"))
    return src, c, keys


def test_llada_moe_expert_bias_picks_and_weights_the_experts(tmp_path):
    """LLaDA-MoE's ``topk(softmax(logits) + expert_bias)``: the bias picks the experts and stays in their weights.
    difflm-import (``model.moe.bias_in_weights``) gives the float64 reference's logits; the bias changes the routing
    (other experts, other logits than bias 0), and a steering-only bias would not give these logits; format=llada_moe
    writes the bias back and re-imports to the same logits, and so does difflm's own format."""
    from safetensors.torch import load_file

    src, c, keys = biased_llada_moe(tmp_path)
    cfg = import_hf(str(src), tmp_path / "run")
    moe = cfg.model.moe
    assert moe.bias_in_weights and moe.first_k_dense == 1 and moe.shared_ffn_hidden_size == F_E
    assert "model.moe.bias_in_weights=true" in train_overrides(cfg)
    ids = torch.randint(0, N_TOK, (2, 12), generator=torch.Generator().manual_seed(0))
    routes, unbiased_routes = [], []
    ref = reference_logits(src, ids, routes)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.1.mlp.expert_bias"] = torch.zeros(E)
    unbiased = reference_logits(src, ids, unbiased_routes, weights=w)
    moved = (routes[0] != unbiased_routes[0]).any(dim=-1).float().mean().item()
    assert 0.2 < moved < 1, moved  # the bias changes the experts of many tokens, and the gate still matters
    assert (ref - unbiased).abs().max() > 0.05

    _, model, _, _ = load_run_for_export(tmp_path / "run")
    with torch.no_grad():
        ours = model(ids)
        model.layers[1].mlp.router.bias_in_weights = False  # DeepSeek-V3's bias: the choice only
        steering = model(ids)
    diff = (ours[..., :N_TOK].double() - ref[..., :N_TOK]).abs().max().item()
    print(f"llada_moe with expert_bias: max |logit diff| vs the reference = {diff:.2e} (scale "
          f"{ref.abs().max().item():.2f}; {moved:.0%} of tokens routed elsewhere than with bias 0)")
    assert diff < 4e-6  # float32 rounding: difflm runs FP32 against the float64 reference
    assert (steering[..., :N_TOK].double() - ref[..., :N_TOK]).abs().max() > 1e-3

    out = export_checkpoint(tmp_path / "run", tmp_path / "out", format="llada_moe")[0]
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == keys
    assert torch.equal(exported["model.layers.1.mlp.expert_bias"], load_file(str(src / "model.safetensors"))[
        "model.layers.1.mlp.expert_bias"])
    written = json.loads((out / "config.json").read_text())
    assert written["moe_router_enable_expert_bias"] and written["moe_layer_freq"] == [0, 1]
    assert written["shared_expert_intermediate_size"] == F_E
    again = import_hf(str(out), tmp_path / "again")
    assert again.model.moe == cfg.model.moe
    assert torch.equal(_difflm_logits(tmp_path / "again", ids), ours)
    _difflm_format_round_trip(tmp_path, cfg, ids, ours)


def _difflm_format_round_trip(tmp: Path, cfg, ids: torch.Tensor, ours: torch.Tensor) -> None:
    """difflm-export's own format of the run ``tmp/run`` (config ``cfg``, logits ``ours`` for ``ids``): the shipped
    modeling file gives difflm's logits, and difflm-import of the export rebuilds the run (the same ``model.*``,
    widths resolved; identical logits)."""
    from difflm.model.moe import expert_ffn_size, shared_ffn_size

    out = export_checkpoint(tmp / "run", tmp / "hf")[0]
    written = json.loads((out / "config.json").read_text())
    assert written["moe_first_k_dense"] == cfg.model.moe.first_k_dense
    assert written["moe_bias_in_weights"] == cfg.model.moe.bias_in_weights
    assert written["partial_rotary_factor"] == cfg.model.partial_rotary_factor
    theirs = hf_logits(out, ids, trust=True, auto="AutoModelForMaskedLM")
    assert (theirs - ours).abs().max() < 1e-5
    again = import_hf(str(out), tmp / "difflm_again")
    a, b = again.model, cfg.model
    assert {k: a.moe[k] for k in b.moe if "ffn_hidden_size" not in k} == {
        k: b.moe[k] for k in b.moe if "ffn_hidden_size" not in k}
    assert (expert_ffn_size(a), shared_ffn_size(a)) == (expert_ffn_size(b), shared_ffn_size(b))
    assert all(a[k] == b[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "head_dim", "qkv_bias",
                                      "partial_rotary_factor", "rope_base", "norm_eps"))
    assert torch.equal(_difflm_logits(tmp / "difflm_again", ids), ours)


def test_difflm_format_export_of_llada2_loads_in_transformers_and_reimports(tmp_path):
    """An imported LLaDA 2.0 model (dense first block, shared expert, group-limited sigmoid routing with a non-zero
    bias that picks only, partial RoPE) through difflm's own format and back."""
    src = write_checkpoint(tmp_path, llada2_config(), llada2_keys())
    cfg = import_hf(str(src), tmp_path / "run")
    assert cfg.model.partial_rotary_factor == 0.5
    ids = torch.randint(0, N_TOK, (2, 10), generator=torch.Generator().manual_seed(1))
    _difflm_format_round_trip(tmp_path, cfg, ids, _difflm_logits(tmp_path / "run", ids))


def test_layout_errors_name_the_key(tmp_path):
    from difflm.interop.llada_layouts import export_config

    # without moe_router_enable_expert_bias the release builds no expert_bias buffer: a stored one is not used
    c = llada_moe_config()
    src = write_checkpoint(tmp_path, c, llada_moe_keys(bias=True))
    cfg = import_hf(str(src), tmp_path / "run")
    assert not cfg.model.moe.bias_in_weights
    ids = torch.randint(0, N_TOK, (1, 8), generator=torch.Generator().manual_seed(2))
    assert (_difflm_logits(tmp_path / "run", ids)[..., :N_TOK].double() - reference_logits(src, ids)[..., :N_TOK]
            ).abs().max() < 2e-5
    moved = {"layers.1.mlp.router.bias": torch.full((E,), 0.01)}
    with pytest.raises(DifflmError, match="format=llada_moe: .*bias_in_weights=false"):
        export_config(cfg, None, "llada_moe", "fp32", moved)
    (tmp_path / "b").mkdir()
    src = write_checkpoint(tmp_path / "b", llada2_config(use_bias=True), llada2_keys())
    with pytest.raises(DifflmError, match="use_bias=True"):
        import_hf(str(src), tmp_path / "b" / "run")
    (tmp_path / "c").mkdir()
    src = write_checkpoint(tmp_path / "c", llada_moe_config(), llada_moe_keys())
    import_hf(str(src), tmp_path / "c" / "run")
    with pytest.raises(DifflmError, match="format=llada2: .*score_func=softmax"):
        export_checkpoint(tmp_path / "c" / "run", tmp_path / "c" / "out", format="llada2")
    with pytest.raises(DifflmError, match="format='nope' is not one of"):
        export_checkpoint(tmp_path / "c" / "run", tmp_path / "c" / "out", format="nope")
    cfg.model.moe.score_func, cfg.model.moe.norm_topk_prob, cfg.model.moe.bias_in_weights = "sigmoid", True, True
    with pytest.raises(DifflmError, match="format=llada2: .*LLaDA 2.0's bias only picks the experts"):
        export_config(cfg, None, "llada2", "fp32", moved)


def test_merged_experts_variant_maps_to_the_same_tensors(tmp_path):
    """dFactory's ``llada2_moe_veomni`` checkpoints stack each projection of the experts ([E, f, d], [E, d, f])."""
    from safetensors.torch import load_file

    from difflm.interop.llada_layouts import llada_dims, to_difflm

    c = llada2_config()
    w = load_file(str(write_checkpoint(tmp_path, c, llada2_keys()) / "model.safetensors"))
    merged = {k: v for k, v in w.items() if ".mlp.experts." not in k}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        merged[f"model.layers.1.mlp.experts.{proj}"] = torch.stack(
            [w[f"model.layers.1.mlp.experts.{j}.{proj}.weight"] for j in range(E)])
    dims = llada_dims(dict(c, model_type="llada2_moe_veomni"), "merged", "llada2")
    a, b = to_difflm(w, dims, "llada2"), to_difflm(merged, dims, "llada2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["layers.1.mlp.experts.fc1_weight"].shape == (E, 2 * F_E, D)


@pytest.mark.parametrize("layout,preset", [("llada2", ["model=llada2-tiny"]),
                                           ("llada_moe", ["model=llada-moe-tiny", "model.moe.bias_in_weights=true"])])
def test_layout_export_keeps_the_training_window(tmp_path, layout, preset):
    """difflm-export format=llada2 / llada_moe wrote max_position_embeddings: 64 (the run's data.seq_len), and the
    re-import came back with difflm-train's default 128. The export also records train_seq_len, which the import
    restores (and the continue command prints); a release's config.json (max_position_embeddings its longest
    context, no train_seq_len) keeps the default."""
    from tests.test_moe_import import make_moe_run

    run = make_moe_run(tmp_path, [*preset, "data.seq_len=64"])
    out = export_checkpoint(run, tmp_path / "out", format=layout)[0]
    written = json.loads((out / "config.json").read_text())
    assert written["max_position_embeddings"] == written["train_seq_len"] == 64
    again = import_hf(str(out), tmp_path / "again")
    assert again.data.seq_len == 64 and "data.seq_len=64" in train_overrides(again)
    release = {k: v for k, v in written.items() if k != "train_seq_len"}
    (out / "config.json").write_text(json.dumps({**release, "max_position_embeddings": 4096}))
    assert import_hf(str(out), tmp_path / "release").data.seq_len == 128
    (out / "config.json").write_text(json.dumps({**written, "train_seq_len": 0}))
    with pytest.raises(DifflmError, match=r"config.json has train_seq_len=0, not a positive integer"):
        import_hf(str(out), tmp_path / "bad")


def test_llada_rope_settings_in_transformers_5_keys():
    """A LLaDA config.json saved by transformers 5 keeps the RoPE base and partial_rotary_factor in rope_parameters:
    they are read from there, and a scaled rope_type there is refused in one line as rope_scaling's is. A rope_scaling
    of rope_type default (plain RoPE) maps, as the Llama/Qwen readers take it."""
    from difflm.interop.llada_layouts import llada_dims

    for layout, make in (("llada2", llada2_config), ("llada_moe", llada_moe_config)):
        c = {k: v for k, v in make().items() if k not in ("rope_theta", "partial_rotary_factor", "rope_scaling")}
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0, "partial_rotary_factor": 0.5}
        c.pop("rotary_dim", None)
        dims = llada_dims(c, "src", layout)
        assert (dims["rope_base"], dims["partial_rotary_factor"]) == (123456.0, 0.5), layout
        c["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 123456.0}
        with pytest.raises(DifflmError, match=r"^hf='src' uses rope_type='yarn' \(rope_parameters\): difflm "
                                              r"implements plain RoPE only"):
            llada_dims(c, "src", layout)
        plain = make(rope_scaling={"rope_type": "default"})  # the Llama/Qwen readers take it too
        assert llada_dims(plain, "src", layout)["rope_base"] == make()["rope_theta"], layout
        with pytest.raises(DifflmError, match=r"^hf='src' uses rope_type='linear' \(rope_scaling\): difflm "
                                              r"implements plain RoPE only"):
            llada_dims(make(rope_scaling={"type": "linear", "factor": 2.0}), "src", layout)


def test_overwrite_replaces_a_layout_export_without_train_seq_len(tmp_path):
    """A LLaDA-layout export whose config.json has no train_seq_len (difflm-export wrote it without one before it
    recorded the training window) is replaced by overwrite=true, as its generation_config.json holds difflm's sampler
    settings; the same config.json beside a release's generation_config.json is refused and kept."""
    from tests.test_moe_import import make_moe_run

    run = make_moe_run(tmp_path, ["model=llada2-tiny", "data.seq_len=64"])
    out = export_checkpoint(run, tmp_path / "out", format="llada2")[0]
    written = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in written.items() if k != "train_seq_len"}))
    (out / "notes.txt").write_text("an earlier export's folder")
    assert export_checkpoint(run, out, format="llada2", overwrite=True)[0] == out
    assert json.loads((out / "config.json").read_text()) == written and not (out / "notes.txt").exists()
    (out / "config.json").write_text(json.dumps({k: v for k, v in written.items() if k != "train_seq_len"}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    with pytest.raises(DifflmError, match=r"is not an earlier export \(its config.json is a model_type='llada2_moe' "
                                          r"model that difflm-export did not write\)"):
        export_checkpoint(run, out, format="llada2", overwrite=True)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
