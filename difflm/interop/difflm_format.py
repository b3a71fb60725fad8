"""difflm's own Hugging Face format (``difflm-export``'s default ``format=difflm``): ``model.*`` <-> the
``config.json`` fields of :class:`DiffLMConfig` (``difflm/interop/hf_modeling/configuration_difflm.py``).

:func:`moe_fields` writes ``model.moe`` as ``moe_*`` fields, :func:`difflm_dims` reads a difflm export's
``config.json`` back into ``model.*`` (with ``moe``), so that ``difflm-import`` of an export rebuilds the run's model:
same modules, same tensor names (the safetensors hold difflm's state dict unchanged), same logits. The two live
here together so that a field added to one side is added to the other::

    config.json                          model.*
    num_hidden_layers, hidden_size ...   num_layers, hidden_size ... (dense dimensions, :func:`difflm_dims`)
    moe_num_experts, moe_top_k           moe.num_experts, moe.top_k (0 experts: a dense model)
    moe_intermediate_size                moe.ffn_hidden_size (resolved: the expert width f)
    moe_num_shared_experts               moe.num_shared_experts
    moe_shared_intermediate_size         moe.shared_ffn_hidden_size (resolved: the shared width f_s)
    moe_score_func, moe_norm_topk_prob   moe.score_func, moe.norm_topk_prob
    moe_n_group, moe_topk_group          moe.n_group, moe.topk_group
    moe_routed_scaling_factor            moe.routed_scaling_factor
    moe_first_k_dense                    moe.first_k_dense
    moe_bias_in_weights                  moe.bias_in_weights
    moe_aux_loss_coeff, moe_z_loss_coeff, moe_bias_update_rate, moe_capacity_factor, moe_balance_over
                                         the balancing settings (training only; absent in older exports: defaults)
"""
from __future__ import annotations

from difflm.errors import DifflmError
from difflm.interop.config_fields import need_float, need_int, opt_float, opt_int

# model.moe keys the modeling file does not use, recorded so that an import resumes training as the run did
TRAINING_MOE_KEYS = ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "capacity_factor", "balance_over")


def moe_fields(m) -> dict:
    """The ``moe_*`` fields of :class:`DiffLMConfig` for ``model`` config ``m`` (resolved; empty for a dense model)."""
    from difflm.model.moe import expert_ffn_size, first_k_dense, moe_config, shared_ffn_size

    moe = moe_config(m)
    if moe is None:
        return {}
    capacity = moe.get("capacity_factor")
    return {"moe_n_group": int(moe.get("n_group", 1)), "moe_topk_group": int(moe.get("topk_group", 1)),
            "moe_routed_scaling_factor": float(moe.get("routed_scaling_factor", 1.0)),
            "moe_first_k_dense": first_k_dense(m), "moe_shared_intermediate_size": shared_ffn_size(m),
            "moe_num_experts": int(moe.num_experts), "moe_top_k": int(moe.top_k),
            "moe_intermediate_size": expert_ffn_size(m), "moe_num_shared_experts": int(moe.num_shared_experts),
            "moe_score_func": str(moe.score_func), "moe_norm_topk_prob": bool(moe.norm_topk_prob),
            "moe_bias_in_weights": bool(moe.get("bias_in_weights", False)),
            "moe_aux_loss_coeff": float(moe.aux_loss_coeff), "moe_z_loss_coeff": float(moe.z_loss_coeff),
            "moe_bias_update_rate": float(moe.bias_update_rate),
            "moe_capacity_factor": None if capacity is None else float(capacity),
            "moe_balance_over": str(moe.get("balance_over", "micro_batch") or "micro_batch")}


def _moe_dims(c: dict, hf: str) -> dict:
    """``model.moe`` of a difflm export's ``config.json`` ``c`` with ``moe_num_experts`` > 0 (the inverse of
    :func:`moe_fields`). Raises: DifflmError naming ``hf`` and the key when a required ``moe_*`` field is missing."""
    missing = [k for k in ("moe_top_k", "moe_intermediate_size", "moe_num_shared_experts", "moe_score_func",
                           "moe_norm_topk_prob") if k not in c]
    if missing:
        raise DifflmError(f"hf={hf!r} is a mixture-of-experts difflm export without {', '.join(missing)} in its "
                          "config.json: export the run again with difflm-export")
    kind = "mixture-of-experts difflm export"
    f, shared_n = need_int(c, "moe_intermediate_size", hf, kind), opt_int(c, "moe_num_shared_experts", hf, 0)
    shared = opt_int(c, "moe_shared_intermediate_size", hf, 0) if shared_n else 0
    moe = {"num_experts": need_int(c, "moe_num_experts", hf, kind), "top_k": need_int(c, "moe_top_k", hf, kind),
           "ffn_hidden_size": f, "num_shared_experts": shared_n, "shared_ffn_hidden_size": shared,
           "score_func": str(c["moe_score_func"]), "norm_topk_prob": bool(c["moe_norm_topk_prob"]),
           "n_group": opt_int(c, "moe_n_group", hf, 1, low=1), "topk_group": opt_int(c, "moe_topk_group", hf, 1, low=1),
           "routed_scaling_factor": opt_float(c, "moe_routed_scaling_factor", hf, 1.0),
           "first_k_dense": opt_int(c, "moe_first_k_dense", hf, 0),
           "bias_in_weights": bool(c.get("moe_bias_in_weights", False))}
    # the balancing settings (exports made before they were recorded keep the schema's defaults)
    moe.update({k: c[f"moe_{k}"] for k in TRAINING_MOE_KEYS
                if c.get(f"moe_{k}") is not None or (k == "capacity_factor" and f"moe_{k}" in c)})
    return moe


def difflm_dims(c: dict, hf: str) -> dict:
    """difflm ``model.*`` (with ``moe`` for a mixture of experts) of a difflm export's ``config.json`` ``c`` (vocab set
    later). The fields every export writes are required (``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``head_dim``, ``rope_theta``,
    ``rms_norm_eps``, ``qk_norm``).

    Raises: DifflmError naming the field and config.json for a required one missing or of the wrong kind
    (:mod:`difflm.interop.config_fields`), and for an MoE export missing its ``moe_*`` fields (:func:`_moe_dims`)."""
    kind = "difflm export"
    if c.get("qk_norm") is None:
        raise DifflmError(f"hf={hf!r}: config.json has no qk_norm, a required field of the difflm export layout: "
                          "export the run again with difflm-export")
    dims = {"num_layers": need_int(c, "num_hidden_layers", hf, kind),
            "hidden_size": need_int(c, "hidden_size", hf, kind),
            "num_heads": need_int(c, "num_attention_heads", hf, kind),
            "num_kv_heads": need_int(c, "num_key_value_heads", hf, kind),
            "ffn_hidden_size": need_int(c, "intermediate_size", hf, kind),
            "head_dim": need_int(c, "head_dim", hf, kind),
            "rope_base": need_float(c, "rope_theta", hf, kind), "norm_eps": need_float(c, "rms_norm_eps", hf, kind),
            "partial_rotary_factor": opt_float(c, "partial_rotary_factor", hf, 1.0),
            "qk_norm": bool(c["qk_norm"]), "qkv_bias": bool(c.get("qkv_bias", False)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "shift_logits": bool(c.get("shift_logits", False)),
            "init_std": opt_float(c, "initializer_range", hf, 0.02)}
    if (opt_int(c, "moe_num_experts", hf, 0) or 0) > 0:
        dims["moe"] = _moe_dims(c, hf)
    return dims


__all__ = ["TRAINING_MOE_KEYS", "difflm_dims", "moe_fields"]
