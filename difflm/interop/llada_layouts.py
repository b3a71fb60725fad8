"""The LLaDA-MoE and LLaDA 2.0 checkpoint layouts <-> difflm's names and ``model.*`` keys.

``difflm-import`` reads them (detected from ``config.json``: :func:`layout_of`) and ``difflm-export format=...``
writes them (:func:`export_layout`). The mapping follows the published ``config.json`` keys and the parameter names
of the releases' ``trust_remote_code`` modeling files (inclusionAI/LLaDA-MoE-7B-A1B-Base ``modeling_lladamoe.py``,
an OLMoE-style block; inclusionAI/LLaDA2.0-mini ``modeling_llada2_moe.py``, a Ling / Bailing-MoE-V2 block).
Their code is not needed and not run: the equations are written out here (d hidden, h/h_kv heads, hd head dim,
E experts of width f, f_s shared width, f_d dense width; "gate; up" are difflm's fc1 halves)::

    difflm                               llada_moe (model.layers.i. ...)        llada2 (model.layers.i. ...)
    embedding.weight                     model.embed_tokens.weight              model.word_embeddings.weight
    attention.qkv.layer_norm_weight      input_layernorm.weight                 input_layernorm.weight
    attention.qkv.weight [(h+2h_kv)hd,d] self_attn.{q,k,v}_proj.weight          attention.query_key_value.weight
        (rows grouped per KV head)                                                 [q heads; k heads; v heads]
    attention.qkv.bias                   (none: attention_bias=false)           attention.query_key_value.bias
    attention.{q,k}_norm.weight [hd]     self_attn.{q,k}_norm.weight            attention.{query,key}_layernorm.weight
    attention.proj.weight [d, h hd]      self_attn.o_proj.weight                attention.dense.weight
    mlp.layer_norm_weight                post_attention_layernorm.weight        post_attention_layernorm.weight
    mlp.fc1_weight / fc2_weight (dense)  mlp.{gate,up,down}_proj.weight         mlp.{gate,up,down}_proj.weight
    mlp.router.weight [E, d]             mlp.gate.weight                        mlp.gate.weight
    mlp.router.bias [E]                  mlp.expert_bias (below)                mlp.gate.expert_bias
    mlp.experts.fc1_weight[j] [2f, d]    mlp.experts.j.{gate,up}_proj.weight    mlp.experts.j.{gate,up}_proj.weight
    mlp.experts.fc2_weight[j] [d, f]     mlp.experts.j.down_proj.weight         mlp.experts.j.down_proj.weight
    mlp.shared.fc1_weight / fc2_weight   shared_expert.{gate,up,down}_proj      mlp.shared_experts.{gate,up,down}_proj
    final_norm.weight                    model.norm.weight                      model.norm.weight
    output.weight                        lm_head.weight (absent when tied)      lm_head.weight

Routing. LLaDA-MoE (``LLaDAMoESparseMoeBlock``): ``p = softmax(logits)`` over the E experts, then
``weights, experts = topk(p + expert_bias, k)``: the bias (a buffer, present when ``moe_router_enable_expert_bias``)
picks the experts *and* stays in the weights, which are not renormalised (the block fixes ``norm_topk_prob = False``)
nor scaled. difflm computes this with ``model.moe.bias_in_weights=true``, which the import sets from
``moe_router_enable_expert_bias`` (without that flag the release builds no buffer and ignores a stored
``expert_bias``, and so does the import). LLaDA 2.0: sigmoid scores, the top-k
of ``scores + expert_bias`` among the ``topk_group`` best of ``n_group`` groups (group score: the sum of its top 2,
DeepSeek-V3 sec. 2.1.2), weights = the chosen scores renormalised (when k > 1) times ``routed_scaling_factor``.
RoPE: both rotate the first ``int(hd * partial_rotary_factor)`` dims rotate-half (:mod:`difflm.model.rope`).
"""
from __future__ import annotations

from typing import Optional

import torch

from difflm.errors import DifflmError
from difflm.interop.config_fields import need_int, opt_float, opt_int, rope_theta

LAYOUTS = ("llada_moe", "llada2")
AUTO_MAPS = {
    "llada_moe": {"AutoConfig": "configuration_lladamoe.LLaDAMoEConfig",
                  "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                  "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
    "llada2": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
               "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
               "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
}
# per-layout names inside ``model.layers.i.`` (module docstring)
NAMES = {
    "llada_moe": {"embed": "model.embed_tokens.weight", "q_norm": "self_attn.q_norm.weight",
                  "k_norm": "self_attn.k_norm.weight", "o": "self_attn.o_proj.weight",
                  "bias": "mlp.expert_bias", "shared": "shared_expert."},
    "llada2": {"embed": "model.word_embeddings.weight", "q_norm": "attention.query_layernorm.weight",
               "k_norm": "attention.key_layernorm.weight", "o": "attention.dense.weight",
               "bias": "mlp.gate.expert_bias", "shared": "mlp.shared_experts."},
}


def layout_of(hf_cfg: dict) -> Optional[str]:
    """``llada_moe``, ``llada2`` or None for another model, from ``model_type`` / ``architectures`` (the LLaDA-MoE
    release's config.json says ``model_type: llada``, its architecture ``LLaDAMoEModelLM``)."""
    kind, arch = hf_cfg.get("model_type"), list(hf_cfg.get("architectures") or [])
    if kind in ("llada2_moe", "llada2_moe_veomni") or "LLaDA2MoeModelLM" in arch:
        return "llada2"
    if kind in ("lladamoe", "llada_moe") or "LLaDAMoEModelLM" in arch:
        return "llada_moe"
    return None


def _refuse(hf: str, key: str, value, why: str) -> None:
    raise DifflmError(f"hf={hf!r} has {key}={value!r}: {why}")


def _rotary_factor(c: dict, head_dim: int, hf: str) -> float:
    """``partial_rotary_factor`` (1.0 when absent; transformers 5 may keep it in ``rope_parameters``); a
    ``rotary_dim`` key must agree with it. (A scaled RoPE in ``rope_scaling`` or ``rope_parameters`` is refused by
    :func:`difflm.interop.config_fields.rope_theta`, which lets ``rope_type`` ``default`` pass.)"""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    f = float(c.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0)
    if c.get("rotary_dim") not in (None, int(head_dim * f)):
        _refuse(hf, "rotary_dim", c["rotary_dim"], f"partial_rotary_factor={f} of head_dim {head_dim} rotates "
                f"{int(head_dim * f)} dims; make the two agree")
    return f


def llada_dims(c: dict, hf: str, layout: str) -> dict:
    """difflm ``model.*`` (with ``moe``) of a LLaDA-MoE / LLaDA 2.0 ``config.json`` ``c`` (vocab set later).

    Raises: DifflmError naming the config key for what difflm's block cannot compute, and naming the field (and
    config.json) for a required one that is missing or not a positive integer: ``num_attention_heads``,
    ``hidden_size``, ``num_hidden_layers``, ``num_experts``, ``num_experts_per_tok`` and the expert width
    (``moe_intermediate_size`` of llada2, ``expert_intermediate_size`` of llada_moe)."""
    if c.get("hidden_act", "silu") != "silu":
        _refuse(hf, "hidden_act", c["hidden_act"], "difflm's MLP is SwiGLU (silu)")
    heads = need_int(c, "num_attention_heads", hf, layout)
    kv = opt_int(c, "num_key_value_heads", hf, heads, low=1)
    d, layers = need_int(c, "hidden_size", hf, layout), need_int(c, "num_hidden_layers", hf, layout)
    if layout == "llada2":
        for key, why in (("use_bias", "a bias on the attention output projection"), ("norm_head", "a normalised LM "
                         "head"), ("use_sliding_window", "sliding-window attention")):
            if c.get(key):
                _refuse(hf, key, c[key], f"difflm has no {why}; set it false")
        if c.get("score_function", "sigmoid") != "sigmoid":
            _refuse(hf, "score_function", c["score_function"], "LLaDA 2.0's gate is sigmoid")
        hd = opt_int(c, "head_dim", hf, d // heads, low=1)
        k, f_e = need_int(c, "num_experts_per_tok", hf, layout), need_int(c, "moe_intermediate_size", hf, layout)
        moe = {"num_experts": need_int(c, "num_experts", hf, layout), "top_k": k, "ffn_hidden_size": f_e,
               "num_shared_experts": opt_int(c, "num_shared_experts", hf, 0), "shared_ffn_hidden_size": 0,
               "score_func": "sigmoid", "norm_topk_prob": k > 1, "n_group": opt_int(c, "n_group", hf, 1, low=1),
               "topk_group": opt_int(c, "topk_group", hf, 1, low=1),
               "routed_scaling_factor": opt_float(c, "routed_scaling_factor", hf, 1.0),
               "first_k_dense": opt_int(c, "first_k_dense_replace", hf, 0),
               # the release does not publish its balancing; difflm's: DeepSeek-V3's aux-free bias, gamma 0.001
               "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0, "bias_update_rate": 0.001}
        dense_ffn, qk_norm, qkv_bias = opt_int(c, "intermediate_size", hf, f_e, low=1), c.get("use_qk_norm", True), \
            c.get("use_qkv_bias", False)
    else:
        for key, why in (("attention_bias", "attention biases (on o_proj too)"), ("clip_qkv", "QKV clipping")):
            if c.get(key):
                _refuse(hf, key, c[key], f"difflm has no {why}; set it false/null")
        if c.get("moe_router_score_function", "softmax") not in (None, "softmax"):
            _refuse(hf, "moe_router_score_function", c["moe_router_score_function"], "LLaDA-MoE's block is softmax")
        if heads * (d // heads) != d:
            _refuse(hf, "num_attention_heads", heads, f"it does not divide hidden_size={d}")
        hd = d // heads
        freq = list(c.get("moe_layer_freq") or [1] * layers)
        first = next((i for i, v in enumerate(freq) if v), layers)
        if len(freq) != layers or any(v == 0 for v in freq[first:]):
            _refuse(hf, "moe_layer_freq", freq, "difflm keeps dense blocks first only (0s, then 1s, one per layer)")
        shared = opt_int(c, "shared_expert_intermediate_size", hf, 0)
        k = need_int(c, "num_experts_per_tok", hf, layout)
        moe = {"num_experts": need_int(c, "num_experts", hf, layout), "top_k": k,
               "ffn_hidden_size": need_int(c, "expert_intermediate_size", hf, layout),
               "num_shared_experts": 1 if shared > 0 else 0, "shared_ffn_hidden_size": shared,
               "score_func": "softmax", "norm_topk_prob": False, "n_group": 1, "topk_group": 1,
               "routed_scaling_factor": 1.0, "first_k_dense": first,
               "bias_in_weights": bool(c.get("moe_router_enable_expert_bias")),
               "aux_loss_coeff": opt_float(c, "router_aux_loss_coef", hf, 0.01), "z_loss_coeff": 0.0,
               "bias_update_rate": 0.0}
        dense_ffn = opt_int(c, "dense_intermediate_size", hf, moe["ffn_hidden_size"], low=1)
        qk_norm, qkv_bias = c.get("qk_layernorm", True), False
    return {"moe": moe, "num_layers": layers, "hidden_size": d, "num_heads": heads, "num_kv_heads": kv,
            "ffn_hidden_size": dense_ffn, "head_dim": hd, "rope_base": rope_theta(c, hf),
            "partial_rotary_factor": _rotary_factor(c, hd, hf), "norm_eps": opt_float(c, "rms_norm_eps", hf, 1e-6),
            "qk_norm": bool(qk_norm), "qkv_bias": bool(qkv_bias),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "shift_logits": False,
            "init_std": opt_float(c, "initializer_range", hf, 0.02)}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [h hd, ...], k/v [h_kv hd, ...] -> difflm's fused rows [(h + 2 h_kv) hd, ...], grouped per KV head g:
    [q heads of g; k head g; v head g] (Megatron-LM's layout, :func:`difflm.model.qkv.split_heads`)."""
    tail = q.shape[1:]
    return torch.cat([t.reshape(num_kv_heads, -1, *tail) for t in (q, k, v)], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: difflm's fused rows -> (q [h hd, ...], k [h_kv hd, ...], v [h_kv hd, ...])."""
    tail, group = qkv.shape[1:], num_heads // num_kv_heads
    g = qkv.reshape(num_kv_heads, group + 2, -1, *tail)  # [h_kv, group + 2, hd, ...]
    return (g[:, :group].reshape(-1, *tail), g[:, group].reshape(-1, *tail), g[:, group + 1].reshape(-1, *tail))


def _glu(get, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 = [gate; up], fc2 = down) of the SwiGLU MLP whose ``gate_proj`` etc. live under ``prefix``."""
    fc1 = torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
    return fc1, get(prefix + "down_proj.weight")


def to_difflm(w: dict[str, torch.Tensor], dims: dict, layout: str) -> dict[str, torch.Tensor]:
    """A LLaDA-MoE / LLaDA 2.0 state dict -> difflm's names (FP32), vocab rows as in the source."""
    names = NAMES[layout]

    def get(name: str) -> torch.Tensor:
        if name not in w:
            raise DifflmError(f"the {layout} checkpoint has no tensor {name!r}")
        return w[name].float()

    h, kv, moe = dims["num_heads"], dims["num_kv_heads"], dims["moe"]
    out = {"embedding.weight": get(names["embed"]), "final_norm.weight": get("model.norm.weight")}
    if not dims["tie_embeddings"]:
        out["output.weight"] = get("lm_head.weight")
    for i in range(dims["num_layers"]):
        p, d = f"model.layers.{i}.", f"layers.{i}."
        out[d + "attention.qkv.layer_norm_weight"] = get(p + "input_layernorm.weight")
        if layout == "llada2":
            q, k, v = get(p + "attention.query_key_value.weight").split([h * dims["head_dim"], kv * dims["head_dim"],
                                                                         kv * dims["head_dim"]])
            out[d + "attention.qkv.weight"] = fuse_qkv(q, k, v, kv)
            if dims["qkv_bias"]:
                out[d + "attention.qkv.bias"] = fuse_qkv(*get(p + "attention.query_key_value.bias").split(
                    [h * dims["head_dim"], kv * dims["head_dim"], kv * dims["head_dim"]]), kv)
        else:
            out[d + "attention.qkv.weight"] = fuse_qkv(*(get(f"{p}self_attn.{x}_proj.weight") for x in "qkv"), kv)
        if dims["qk_norm"]:
            out[d + "attention.q_norm.weight"] = get(p + names["q_norm"])
            out[d + "attention.k_norm.weight"] = get(p + names["k_norm"])
        out[d + "attention.proj.weight"] = get(p + names["o"])
        out[d + "mlp.layer_norm_weight"] = get(p + "post_attention_layernorm.weight")
        if i < moe["first_k_dense"]:
            out[d + "mlp.fc1_weight"], out[d + "mlp.fc2_weight"] = _glu(get, p + "mlp.")
            continue
        e = moe["num_experts"]
        # LLaDA-MoE without moe_router_enable_expert_bias has no bias buffer: a stored one is not used (module docstring)
        used = layout == "llada2" or moe["bias_in_weights"]
        bias = w[p + names["bias"]].float() if used and p + names["bias"] in w else torch.zeros(e)
        out[d + "mlp.router.weight"], out[d + "mlp.router.bias"] = get(p + "mlp.gate.weight"), bias
        if p + "mlp.experts.gate_proj" in w:  # the merged-experts (veomni) variant: stacked [E, f, d] / [E, d, f]
            fc1 = torch.cat([get(p + "mlp.experts.gate_proj"), get(p + "mlp.experts.up_proj")], dim=1)
            fc2 = get(p + "mlp.experts.down_proj")
        else:
            pairs = [_glu(get, f"{p}mlp.experts.{j}.") for j in range(e)]
            fc1, fc2 = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
        out[d + "mlp.experts.fc1_weight"], out[d + "mlp.experts.fc2_weight"] = fc1, fc2
        if moe["num_shared_experts"]:
            out[d + "mlp.shared.fc1_weight"], out[d + "mlp.shared.fc2_weight"] = _glu(get, p + names["shared"])
    return out


def _put_glu(out: dict, prefix: str, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
    gate, up = fc1.chunk(2, dim=0)
    out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
    out[prefix + "down_proj.weight"] = fc2


def from_difflm(state: dict[str, torch.Tensor], m, layout: str) -> dict[str, torch.Tensor]:
    """difflm's state dict (``model`` config ``m``, resolved) -> the ``layout``'s names; the inverse of
    :func:`to_difflm` (contiguous tensors, dtypes kept)."""
    from difflm.model.moe import first_k_dense

    names, h, kv, hd = NAMES[layout], int(m.num_heads), int(m.num_kv_heads), int(m.head_dim)
    out = {names["embed"]: state["embedding.weight"], "model.norm.weight": state["final_norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    for i in range(int(m.num_layers)):
        p, d = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = state[d + "attention.qkv.layer_norm_weight"]
        q, k, v = split_qkv(state[d + "attention.qkv.weight"], h, kv)
        if layout == "llada2":
            out[p + "attention.query_key_value.weight"] = torch.cat([q, k, v])
            if d + "attention.qkv.bias" in state:
                out[p + "attention.query_key_value.bias"] = torch.cat(split_qkv(state[d + "attention.qkv.bias"], h, kv))
        else:
            out.update({f"{p}self_attn.{x}_proj.weight": t for x, t in zip("qkv", (q, k, v))})
        if d + "attention.q_norm.weight" in state:
            out[p + names["q_norm"]] = state[d + "attention.q_norm.weight"]
            out[p + names["k_norm"]] = state[d + "attention.k_norm.weight"]
        out[p + names["o"]] = state[d + "attention.proj.weight"]
        out[p + "post_attention_layernorm.weight"] = state[d + "mlp.layer_norm_weight"]
        if i < first_k_dense(m):
            _put_glu(out, p + "mlp.", state[d + "mlp.fc1_weight"], state[d + "mlp.fc2_weight"])
            continue
        out[p + "mlp.gate.weight"] = state[d + "mlp.router.weight"]
        if layout == "llada2" or m.moe.get("bias_in_weights", False):
            out[p + names["bias"]] = state[d + "mlp.router.bias"]
        fc1, fc2 = state[d + "mlp.experts.fc1_weight"], state[d + "mlp.experts.fc2_weight"]
        for j in range(fc1.shape[0]):
            _put_glu(out, f"{p}mlp.experts.{j}.", fc1[j], fc2[j])
        if d + "mlp.shared.fc1_weight" in state:
            _put_glu(out, p + names["shared"], state[d + "mlp.shared.fc1_weight"], state[d + "mlp.shared.fc2_weight"])
    return {k: v.contiguous() for k, v in out.items()}


def _check_exportable(cfg, layout: str, router_bias: Optional[torch.Tensor]) -> None:
    """Raises DifflmError naming ``format`` and the key when run ``cfg``'s model is not expressible in ``layout``."""
    from difflm.model.moe import expert_ffn_size, moe_config, shared_ffn_size

    m, moe = cfg.model, moe_config(cfg.model)

    def no(what: str) -> None:
        raise DifflmError(f"format={layout}: {what}; export with format=difflm (difflm's own modeling file) instead")

    if moe is None:
        no("the run's model is dense (model.moe.num_experts=0), the layout is a mixture of experts")
    if cfg.objective.name not in ("mdlm", "sft") or m.get("shift_logits", False):
        no(f"objective={cfg.objective.name}, shift_logits={m.get('shift_logits', False)}: the layout is a masked "
           "diffusion model with bidirectional attention and unshifted logits")
    bias_in_weights = bool(moe.get("bias_in_weights", False))
    if layout == "llada2":
        if bias_in_weights and router_bias is not None and router_bias.abs().max() > 0:
            no("model.moe.bias_in_weights=true with a non-zero routing bias: LLaDA 2.0's bias only picks the experts")
        if moe.score_func != "sigmoid" or (int(moe.top_k) > 1 and not moe.norm_topk_prob):
            no(f"model.moe.score_func={moe.score_func}, norm_topk_prob={moe.norm_topk_prob}: LLaDA 2.0's gate is "
               "sigmoid with renormalised top-k weights")
        if shared_ffn_size(m) != int(moe.num_shared_experts) * expert_ffn_size(m):
            no(f"model.moe.shared_ffn_hidden_size={moe.shared_ffn_hidden_size}: LLaDA 2.0's shared width is "
               "num_shared_experts x the expert width")
        return
    if m.get("qkv_bias", False) or int(m.num_heads) * int(m.head_dim) != int(m.hidden_size):
        no(f"model.qkv_bias={m.get('qkv_bias', False)}, num_heads x head_dim={int(m.num_heads) * int(m.head_dim)} "
           f"vs hidden_size={m.hidden_size}: LLaDA-MoE has no QKV bias and head_dim = hidden / heads")
    if (moe.score_func != "softmax" or moe.norm_topk_prob or float(moe.get("routed_scaling_factor", 1.0)) != 1.0
            or int(moe.get("n_group", 1)) != 1):
        no("LLaDA-MoE routes softmax top-k without renormalising, scaling or groups (model.moe.score_func=softmax, "
           "norm_topk_prob=false, routed_scaling_factor=1, n_group=1)")
    if not bias_in_weights and router_bias is not None and router_bias.abs().max() > 0:
        no("the routing bias (model.moe.bias_update_rate > 0) is non-zero and model.moe.bias_in_weights=false: "
           "LLaDA-MoE adds its expert_bias to the gating weights too")


def export_config(cfg, tok, layout: str, dtype: str, state: dict[str, torch.Tensor]) -> dict:
    """The ``config.json`` of run ``cfg`` (resolved ``model``) in ``layout``: the release's keys and ``auto_map``
    (their modeling files are not shipped: copy them from the release to load with ``trust_remote_code``).

    Raises: DifflmError naming ``format`` for a model the layout cannot express (:func:`_check_exportable`)."""
    from difflm.model.moe import expert_ffn_size, first_k_dense, moe_config, shared_ffn_size

    biases = [v for k, v in state.items() if k.endswith("mlp.router.bias")]
    _check_exportable(cfg, layout, torch.stack(biases) if biases else None)
    m, moe = cfg.model, moe_config(cfg.model)
    layers, k_dense = int(m.num_layers), first_k_dense(m)
    common = {"architectures": ["LLaDA2MoeModelLM" if layout == "llada2" else "LLaDAMoEModelLM"],
              "auto_map": dict(AUTO_MAPS[layout]), "vocab_size": int(m.vocab_size), "hidden_size": int(m.hidden_size),
              "num_hidden_layers": layers, "num_attention_heads": int(m.num_heads),
              "num_key_value_heads": int(m.num_kv_heads), "hidden_act": "silu", "rms_norm_eps": float(m.norm_eps),
              "rope_theta": float(m.rope_base), "rope_scaling": None,
              "partial_rotary_factor": float(m.get("partial_rotary_factor", 1.0)),
              "tie_word_embeddings": bool(m.tie_embeddings), "num_experts": int(moe.num_experts),
              "num_experts_per_tok": int(moe.top_k), "max_position_embeddings": int(cfg.data.seq_len),
              # difflm's own record of the training window, which difflm-import restores as data.seq_len (it does not
              # read a release's max_position_embeddings, its longest context, as one)
              "train_seq_len": int(cfg.data.seq_len),
              "initializer_range": float(m.init_std), "mask_token_id": int(tok.mask_id), "eos_token_id": tok.eos_id,
              "pad_token_id": tok.tokenizer.pad_token_id, "use_cache": False,
              "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]}
    if layout == "llada2":
        shared = int(moe.num_shared_experts)
        return {"model_type": "llada2_moe", **common, "head_dim": int(m.head_dim),
                "rotary_dim": int(int(m.head_dim) * common["partial_rotary_factor"]),
                "intermediate_size": int(m.ffn_hidden_size), "moe_intermediate_size": expert_ffn_size(m),
                "num_shared_experts": shared or None, "first_k_dense_replace": k_dense,
                "n_group": int(moe.get("n_group", 1)), "topk_group": int(moe.get("topk_group", 1)),
                "routed_scaling_factor": float(moe.get("routed_scaling_factor", 1.0)), "score_function": "sigmoid",
                "norm_topk_prob": True, "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
                "use_qkv_bias": bool(m.get("qkv_bias", False)), "use_qk_norm": bool(m.qk_norm), "use_bias": False,
                "norm_head": False, "embedding_dropout": 0.0, "attention_dropout": 0.0, "output_dropout": 0.0}
    return {"model_type": "lladamoe", **common, "dense_intermediate_size": int(m.ffn_hidden_size),
            "expert_intermediate_size": expert_ffn_size(m),
            "shared_expert_intermediate_size": shared_ffn_size(m) or None,
            "moe_layer_freq": [0] * k_dense + [1] * (layers - k_dense), "qk_layernorm": bool(m.qk_norm),
            "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": bool(moe.get("bias_in_weights", False)), "norm_topk_prob": False,
            "routed_scaling_factor": 1.0, "router_num_group": None, "router_topk_group": None,
            "router_aux_loss_coef": float(moe.aux_loss_coeff), "attention_bias": False, "clip_qkv": None,
            "attention_dropout": 0.0}


__all__ = ["AUTO_MAPS", "LAYOUTS", "NAMES", "export_config", "from_difflm", "fuse_qkv", "layout_of", "llada_dims",
           "split_qkv", "to_difflm"]
