"""``difflm-import``: a Hugging Face causal LM -> a difflm run directory that ``difflm-train`` resumes.

    difflm-import hf=HF_DIR_OR_NAME run.dir=DIR [objective=mdlm|ar] [shift_logits=true] [revision=REV]

Sources: Llama-family (``model_type`` llama, mistral without sliding window), Qwen2 (QKV bias), Qwen3
(QK-norm), Qwen3-MoE (``model_type`` qwen3_moe: every block MoE), LLaDA-MoE and LLaDA 2.0 (``LLaDAMoEModelLM``,
``LLaDA2MoeModelLM``: :mod:`difflm.interop.llada_layouts` has their mapping) and difflm exports (``model_type``
difflm, dense or MoE: :mod:`difflm.interop.difflm_format`). A local directory is read
as is; a hub name is fetched with ``huggingface_hub.snapshot_download`` (from the cache only when
``HF_HUB_OFFLINE=1``). Only ``config.json`` (plain JSON), ``*.safetensors`` (or ``pytorch_model*.bin`` through
``torch.load(weights_only=True)``) and the tokenizer are read; no remote code runs (``trust_remote_code`` is
never set). A required ``config.json`` field that is missing or of the wrong kind is refused in one line naming the
field and the file (:mod:`difflm.interop.config_fields`).

Writes ``DIR/config.yaml`` (composed from difflm's conf tree, ``model.*`` set from the HF config; from a difflm
export also the run's ``data.seq_len`` and ``gen.*``, recorded in its config.json as ``train_seq_len`` and ``gen_*``,
and from difflm's LLaDA-layout exports the ``data.seq_len`` of their ``train_seq_len``),
``DIR/tokenizer/`` (the HF tokenizer with a mask token added when it has none) and
``DIR/checkpoints/step_0`` (model only, :func:`difflm.checkpoint.store.save_checkpoint` with
``optimizer=None``: ``difflm-train`` resumes from it with a fresh optimizer and LR schedule), then prints
the ``difflm-train`` command line that continues training.

Weight mapping (HF [shape] -> difflm [shape]; d hidden, h/h_kv heads, hd head dim, f FFN, V vocab):
    model.embed_tokens.weight [V_hf, d]          -> embedding.weight [V, d] (rows padded/truncated, below)
    layers.i.input_layernorm.weight [d]          -> layers.i.attention.qkv.layer_norm_weight
    layers.i.self_attn.{q,k,v}_proj.weight       -> layers.i.attention.qkv.weight [(h + 2 h_kv) hd, d], rows
        grouped per KV head g: q heads g*h/h_kv ... (g+1)*h/h_kv - 1, then k head g, then v head g (HF's
        repeat_kv serves query head j from KV head j // (h / h_kv))
    layers.i.self_attn.{q,k,v}_proj.bias         -> layers.i.attention.qkv.bias (same grouping; Qwen2)
    layers.i.self_attn.{q,k}_norm.weight [hd]    -> layers.i.attention.{q,k}_norm.weight (Qwen3)
    layers.i.self_attn.o_proj.weight [d, h hd]   -> layers.i.attention.proj.weight
    layers.i.post_attention_layernorm.weight     -> layers.i.mlp.layer_norm_weight
    layers.i.mlp.{gate,up}_proj.weight [f, d]    -> layers.i.mlp.fc1_weight [2 f, d] = [gate; up]
    layers.i.mlp.down_proj.weight [d, f]         -> layers.i.mlp.fc2_weight
    Qwen3-MoE blocks (E experts of width f_e, HF ``Qwen3MoeSparseMoeBlock``):
    layers.i.mlp.gate.weight [E, d]              -> layers.i.mlp.router.weight (softmax top-k, norm_topk_prob)
    layers.i.mlp.experts.j.{gate,up}_proj.weight [f_e, d] -> layers.i.mlp.experts.fc1_weight[j] [2 f_e, d]
    layers.i.mlp.experts.j.down_proj.weight [d, f_e]      -> layers.i.mlp.experts.fc2_weight[j]
        (or the stacked ``experts.gate_up_proj`` [E, 2 f_e, d] and ``experts.down_proj`` [E, d, f_e] as is)
    model.norm.weight                            -> final_norm.weight
    lm_head.weight [V_hf, d]                     -> output.weight [V, d] (absent when tied)

Vocabulary: V is difflm's padded size for the saved tokenizer (mask token included, a multiple of
``vocab_multiple``). Rows the HF model lacks (and the row of a newly added mask token) are set to the mean of
the HF rows of real tokens; HF rows >= V (never produced by the tokenizer) are dropped.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from difflm.checkpoint.store import checkpoints_root, list_checkpoints, save_checkpoint
from difflm.cli import hydra_app
from difflm.config.compose import compose_train_config
from difflm.config.schema import MODEL_KEYS, MOE_KEYS, import_objective_error, override_value
from difflm.config.validate import check_model
from difflm.data import build_tokenizer
from difflm.data.tokenizer import missing_tokenizer_files
from difflm.errors import DifflmError
from difflm.interop.config_fields import need_int, opt_float, opt_int, rope_theta
from difflm.interop.difflm_format import difflm_dims
from difflm.interop.llada_layouts import layout_of, llada_dims, to_difflm
from difflm.model import build_model
from difflm.training.run_dir import held_run_dir, remove_path, run_records, set_aside_run_records

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "difflm")
DEFAULT_MASK_TOKEN = "<|mdm_mask|>"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_source(hf: str, revision: Optional[str] = None) -> Path:
    """Local directory of ``hf`` (a directory, or a hub name fetched/found in the HF cache).

    Raises: DifflmError naming ``hf`` for a missing directory, or a hub name that cannot be fetched
    (offline and not cached, unknown name, no network).
    """
    path = Path(hf).expanduser()
    if path.is_dir():
        return path
    if hf.startswith(("/", "./", "../", "~")) or os.path.isabs(hf) or hf.count("/") > 1:
        raise DifflmError(f"hf={hf!r} is not a directory: give a local Hugging Face model directory or a hub name")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(hf, revision=revision, local_files_only=_offline(),
                                  allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"])
        if not any(Path(local).glob("*.safetensors")):  # a repository with PyTorch .bin weights only
            local = snapshot_download(hf, revision=revision, local_files_only=_offline(),
                                      allow_patterns=["pytorch_model*.bin"])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one line
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        hint = ("HF_HUB_OFFLINE=1 and it is not in the cache: download it first or unset HF_HUB_OFFLINE"
                if _offline() else "check the name, revision and network")
        raise DifflmError(f"hf={hf!r} could not be fetched ({reason}): {hint}") from None
    return Path(local)


def read_hf_config(src: Path, hf: str) -> dict:
    """``config.json`` as a dict (plain JSON: no config class, no remote code)."""
    path = src / "config.json"
    if not path.is_file():
        raise DifflmError(f"hf={hf!r}: {path} is missing: a Hugging Face model directory needs config.json")
    return _read_json_object(path, hf, "save the model again with save_pretrained")


def _read_json_object(path: Path, hf: str, fix: str) -> dict:
    """``path`` read as a JSON object. Raises: DifflmError naming ``hf`` and the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise DifflmError(f"hf={hf!r}: {path} is not valid JSON ({reason}): {fix}") from None
    if not isinstance(value, dict):
        raise DifflmError(f"hf={hf!r}: {path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value


def read_hf_weights(src: Path, hf: str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``src``: ``model.safetensors[.index.json]`` or, failing that,
    ``pytorch_model.bin[.index.json]`` loaded with ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    fix = "save the model again with save_pretrained"

    def files(index_name: str, single: str) -> Optional[list[Path]]:
        if (src / index_name).is_file():
            weight_map = _read_json_object(src / index_name, hf, fix).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise DifflmError(f"hf={hf!r}: {src / index_name} has no weight_map of tensor names to shard files: "
                                  f"{fix}")
            shards = [src / f for f in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise DifflmError(f"hf={hf!r}: shards {missing} listed in {index_name} are missing from {src}")
            return shards
        return [src / single] if (src / single).is_file() else None

    def load(shard: Path, read) -> dict[str, torch.Tensor]:
        try:
            tensors = read(shard)
        except Exception as e:  # noqa: BLE001 - a truncated or overwritten file, whatever the reader raises
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise DifflmError(f"hf={hf!r}: {shard} cannot be read ({reason}): the file is damaged or incomplete; "
                              "download or save the model again") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise DifflmError(f"hf={hf!r}: {shard} does not hold a state dict of tensors: {fix}")
        return tensors

    state: dict[str, torch.Tensor] = {}
    if (shards := files("model.safetensors.index.json", "model.safetensors")) is not None:
        for shard in shards:
            state.update(load(shard, lambda f: load_file(str(f))))
        return state
    if (shards := files("pytorch_model.bin.index.json", "pytorch_model.bin")) is not None:
        for shard in shards:
            state.update(load(shard, lambda f: torch.load(f, map_location="cpu", weights_only=True)))
        return state
    raise DifflmError(f"hf={hf!r}: {src} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin: "
                      "save the model with save_pretrained(dir)")


def model_dims(hf_cfg: dict, hf: str) -> dict:
    """difflm ``model.*`` values of an HF config (vocab set later). Raises DifflmError for unsupported features."""
    kind = hf_cfg.get("model_type")
    if (layout := layout_of(hf_cfg)) is not None:
        return llada_dims(hf_cfg, hf, layout)
    if kind not in SUPPORTED:
        raise DifflmError(f"hf={hf!r} has model_type={kind!r}: difflm-import supports {', '.join(SUPPORTED)}, "
                          "and the LLaDA-MoE / LLaDA 2.0 layouts")
    if kind == "difflm":
        return difflm_dims(hf_cfg, hf)
    act = hf_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise DifflmError(f"hf={hf!r} has hidden_act={act!r}: difflm's MLP is SwiGLU (silu)")
    if hf_cfg.get("mlp_bias"):
        raise DifflmError(f"hf={hf!r} has mlp_bias=true: difflm's MLP has no biases")
    # Qwen2's q/k/v biases are fixed (qkv_bias); the others' attention_bias puts a bias on o_proj too
    if kind != "qwen2" and hf_cfg.get("attention_bias"):
        raise DifflmError(f"hf={hf!r} has attention_bias=true (bias on o_proj too): difflm supports a QKV bias only")
    # Mistral slides unless sliding_window is null (transformers' default, when the key is absent, is 4096)
    if kind == "mistral" and (window := hf_cfg.get("sliding_window", 4096)):
        raise DifflmError(f"hf={hf!r} uses sliding_window={window}: difflm attends to the full window")
    if kind in ("qwen2", "qwen3", "qwen3_moe") and hf_cfg.get("use_sliding_window"):
        raise DifflmError(f"hf={hf!r} has use_sliding_window=true: difflm attends to the full window")
    heads = need_int(hf_cfg, "num_attention_heads", hf, kind)
    layers, hidden = need_int(hf_cfg, "num_hidden_layers", hf, kind), need_int(hf_cfg, "hidden_size", hf, kind)
    ffn = need_int(hf_cfg, "intermediate_size", hf, kind)
    moe = _qwen3_moe_dims(hf_cfg, hf) if kind == "qwen3_moe" else {}
    return moe | {"num_layers": layers, "hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": opt_int(hf_cfg, "num_key_value_heads", hf, heads, low=1), "ffn_hidden_size": ffn,
            "head_dim": opt_int(hf_cfg, "head_dim", hf, hidden // heads, low=1), "rope_base": rope_theta(hf_cfg, hf),
            "norm_eps": opt_float(hf_cfg, "rms_norm_eps", hf, 1e-6), "qk_norm": kind in ("qwen3", "qwen3_moe"),
            "qkv_bias": kind == "qwen2",
            "tie_embeddings": bool(hf_cfg.get("tie_word_embeddings", False)), "shift_logits": False,
            "init_std": opt_float(hf_cfg, "initializer_range", hf, 0.02)}


def _qwen3_moe_dims(hf_cfg: dict, hf: str) -> dict:
    """``{"moe": {...}}``: difflm's ``model.moe.*`` for a Qwen3-MoE config (HF ``Qwen3MoeConfig``: softmax router,
    top-k renormalised when ``norm_topk_prob``, no shared experts, Switch aux loss ``router_aux_loss_coef``).

    Raises: DifflmError for dense blocks among the MoE ones (``decoder_sparse_step`` != 1 or ``mlp_only_layers``),
    and naming the field for a missing or bad ``num_experts``, ``num_experts_per_tok`` or ``moe_intermediate_size``
    (:func:`difflm.interop.config_fields.need_int`).
    """
    step, dense = hf_cfg.get("decoder_sparse_step", 1), list(hf_cfg.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise DifflmError(f"hf={hf!r} has decoder_sparse_step={step}, mlp_only_layers={dense}: difflm-import maps "
                          "Qwen3-MoE models whose every block is MoE (decoder_sparse_step 1, mlp_only_layers [])")
    kind = "qwen3_moe"
    experts = need_int(hf_cfg, "num_experts", hf, kind, names=("num_local_experts",))  # transformers 5's key
    top_k = need_int(hf_cfg, "num_experts_per_tok", hf, kind)
    if top_k > experts:
        raise DifflmError(f"hf={hf!r}: config.json has num_experts_per_tok={top_k} above num_experts={experts}: "
                          "fix num_experts_per_tok in config.json")
    return {"moe": {"num_experts": experts, "top_k": top_k,
                    "ffn_hidden_size": need_int(hf_cfg, "moe_intermediate_size", hf, kind), "num_shared_experts": 0,
                    "score_func": "softmax", "norm_topk_prob": bool(hf_cfg.get("norm_topk_prob", False)),
                    "aux_loss_coeff": opt_float(hf_cfg, "router_aux_loss_coef", hf, 0.001), "z_loss_coeff": 0.0}}


def _qwen3_moe_mlp(get, w: dict, m: str, num_experts: int) -> dict[str, torch.Tensor]:
    """One Qwen3-MoE block's ``mlp.*`` tensors (HF prefix ``m``) under difflm's ``mlp.`` names (module docstring)."""
    if m + "experts.gate_up_proj" in w:  # transformers >= 5 in memory: stacked [E, 2 f, d] (gate; up) and [E, d, f]
        fc1, fc2 = get(m + "experts.gate_up_proj"), get(m + "experts.down_proj")
    else:
        e = range(num_experts)
        fc1 = torch.stack([torch.cat([get(f"{m}experts.{j}.gate_proj.weight"), get(f"{m}experts.{j}.up_proj.weight")])
                           for j in e])
        fc2 = torch.stack([get(f"{m}experts.{j}.down_proj.weight") for j in e])
    return {"mlp.router.weight": get(m + "gate.weight"), "mlp.experts.fc1_weight": fc1,
            "mlp.experts.fc2_weight": fc2, "mlp.router.bias": torch.zeros(num_experts)}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q [h hd, ...], k/v [h_kv hd, ...] (weights [., d] or biases) -> difflm's fused [(h + 2 h_kv) hd, ...],
    grouped per KV head: [q heads of group g; k head g; v head g] for g = 0 .. h_kv - 1."""
    tail = q.shape[1:]
    groups = [t.reshape(num_kv_heads, -1, *tail) for t in (q, k, v)]  # [h_kv, rows per group, ...]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def convert_llama_state(w: dict[str, torch.Tensor], dims: dict) -> dict[str, torch.Tensor]:
    """Llama/Qwen2/Qwen3/Qwen3-MoE HF names -> difflm names (module docstring), FP32; vocab rows as in the HF model."""
    def get(name: str) -> torch.Tensor:
        if name not in w:
            raise DifflmError(f"HF checkpoint has no tensor {name!r}: it is not a Llama/Qwen2/Qwen3 checkpoint")
        return w[name].float()

    out = {"embedding.weight": get("model.embed_tokens.weight"), "final_norm.weight": get("model.norm.weight")}
    if not dims["tie_embeddings"]:
        out["output.weight"] = get("lm_head.weight")
    for i in range(dims["num_layers"]):
        a, d = f"model.layers.{i}.self_attn.", f"layers.{i}."
        out[d + "attention.qkv.layer_norm_weight"] = get(f"model.layers.{i}.input_layernorm.weight")
        out[d + "attention.qkv.weight"] = fuse_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                  get(a + "v_proj.weight"), dims["num_kv_heads"])
        if dims["qkv_bias"]:
            out[d + "attention.qkv.bias"] = fuse_qkv(get(a + "q_proj.bias"), get(a + "k_proj.bias"),
                                                    get(a + "v_proj.bias"), dims["num_kv_heads"])
        if dims["qk_norm"]:
            out[d + "attention.q_norm.weight"] = get(a + "q_norm.weight")
            out[d + "attention.k_norm.weight"] = get(a + "k_norm.weight")
        out[d + "attention.proj.weight"] = get(a + "o_proj.weight")
        m = f"model.layers.{i}.mlp."
        out[d + "mlp.layer_norm_weight"] = get(f"model.layers.{i}.post_attention_layernorm.weight")
        if "moe" in dims:
            out.update({d + k: v for k, v in _qwen3_moe_mlp(get, w, m, dims["moe"]["num_experts"]).items()})
            continue
        out[d + "mlp.fc1_weight"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")], dim=0)
        out[d + "mlp.fc2_weight"] = get(m + "down_proj.weight")
    return out


def resize_vocab(weight: torch.Tensor, vocab: int, real_tokens: int, reinit: list[int]) -> torch.Tensor:
    """Rows [V_hf, d] -> [vocab, d]: kept up to ``vocab``; new rows and rows ``reinit`` = mean of the first
    ``real_tokens`` HF rows (the tokenizer's tokens)."""
    mean = weight[: min(real_tokens, weight.shape[0])].mean(dim=0)
    out = mean.expand(vocab, -1).clone()
    keep = min(vocab, weight.shape[0])
    out[:keep] = weight[:keep]
    for row in reinit:
        out[row] = mean
    return out


# a difflm export's config.json key -> the ``gen.*`` key it records (difflm.interop.export.hf_config)
EXPORTED_GEN = {"gen_length": "length", "gen_steps": "steps", "gen_block_length": "block_length",
                "gen_remasking": "remasking", "gen_temperature": "temperature", "gen_seed": "seed",
                "gen_top_k": "top_k", "gen_top_p": "top_p", "gen_cfg_scale": "cfg_scale", "gen_threshold": "threshold",
                "gen_cache": "cache", "gen_remdm_sigma": "remdm_sigma", "gen_remdm_schedule": "remdm_schedule"}


def exported_run_settings(hf_cfg: dict, hf: str) -> dict:
    """``{"data.seq_len": n, "gen.<key>": value, ...}`` recorded in a difflm export's ``config.json`` (``train_seq_len``
    and ``gen_*``), those present only; empty for other models (they keep the conf tree's defaults). The LLaDA-MoE /
    LLaDA 2.0 layouts that ``difflm-export`` writes carry ``train_seq_len`` too (their ``max_position_embeddings``
    is the same number, but a release's is the longest context it serves, not a window to train at, so it is not
    read: a release keeps difflm-train's default, as a Llama or Qwen model does).

    Raises: DifflmError naming ``hf`` and the config.json key for a value difflm's run config refuses.
    """
    difflm_export = hf_cfg.get("model_type") == "difflm"
    if not difflm_export and layout_of(hf_cfg) is None:
        return {}
    from difflm.sampling import GenerationOptions
    from difflm.sampling.options import unread_stored_settings

    out = {}
    seq_len = hf_cfg.get("train_seq_len")
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DifflmError(f"hf={hf!r}: config.json has train_seq_len={seq_len!r}, not a positive integer: set it "
                              "to the run's data.seq_len or remove it")
        out["data.seq_len"] = seq_len
    if not difflm_export:  # the layouts record no gen.*
        return out
    gen = {key: hf_cfg[name] for name, key in EXPORTED_GEN.items() if name in hf_cfg}
    try:  # the sampler's own checks (ranges, remasking and cache names)
        GenerationOptions(mask_id=0, **{k: v for k, v in gen.items() if k != "seed" and v is not None})
    except (ValueError, TypeError) as e:
        raise DifflmError(f"hf={hf!r}: config.json's gen_* settings are not valid difflm gen.* settings ({e}): "
                          "fix or remove them") from None
    if "seed" in gen and (isinstance(gen["seed"], bool) or not isinstance(gen["seed"], int)):
        raise DifflmError(f"hf={hf!r}: config.json has gen_seed={gen['seed']!r}, not an integer: fix or remove it")
    # steps / block_length at 64 (the former default, which an older export recorded for null): null again
    gen.update(unread_stored_settings(None, gen))
    out.update({f"gen.{k}": v for k, v in gen.items()})
    return out


def train_overrides(cfg) -> list[str]:
    """The ``difflm-train`` overrides that rebuild the imported run: objective, tokenizer, ``data.seq_len`` (the
    training window restored from a difflm export), ``model.*``,
    the ``gen.*`` settings that differ from the schema's defaults (restored from a difflm export), run.dir.

    ``objective``, ``data.seq_len`` and ``model.shift_logits`` are left out at difflm-train's defaults (mdlm, 128,
    false): an adaptation recipe added to the command (``experiment=fast_dllm_v2_adapt``: bd3lm; ``dream_adapt``:
    L = 2048, shifted logits) sets them, and a command-line value would silently override the recipe's."""
    from difflm.config.schema import DataConfig, GenerateConfig

    m, defaults = cfg.model, GenerateConfig()
    # an export's null steps / block_length stay null (an older export's 64 is read as null: exported_run_settings),
    # so that a recipe added to the command (a bd3lm one) decodes in its own blocks
    gen = [f"gen.{k}={override_value(v)}" for k, v in cfg.gen.items() if v != getattr(defaults, k, v)]
    keys = [k for k in MODEL_KEYS if k != "shift_logits" or m[k]]
    return ([f"objective={cfg.objective.name}"] * (cfg.objective.name != "mdlm")
            + [f"data.tokenizer={cfg.data.tokenizer}"]
            + [f"data.seq_len={cfg.data.seq_len}"] * (cfg.data.seq_len != DataConfig.seq_len) + ["model.name=imported"]
            + [f"model.{k}={override_value(m[k])}" for k in keys]
            + [f"model.moe.{k}={override_value(m.moe[k])}" for k in MOE_KEYS if m.moe.num_experts]
            + gen + [f"run.dir={cfg.run.dir}"])


def import_hf(hf: str, run_dir: str | Path, objective: Optional[str] = None, shift_logits: bool = False,
              vocab_multiple: int = 128, mask_token: str = DEFAULT_MASK_TOKEN, revision: Optional[str] = None,
              overwrite: bool = False):
    """Convert ``hf`` into the difflm run directory ``run_dir`` (module docstring). Returns the composed config.

    ``overwrite=true`` replaces an earlier run's checkpoints and every record a new run would pick up
    (:data:`difflm.training.run_dir.RUN_RECORDS`); without checkpoints such records are moved to ``previous/``.
    ``run_dir`` is held (``.difflm.lock``, :func:`difflm.training.run_dir.claim_run_dir`) while it is changed.

    Raises: DifflmError for a missing source/file, an unsupported architecture, a run dir that already holds
    checkpoints (without ``overwrite``), a run dir in use by a running difflm-train, or a bad ``objective``.
    """
    if objective is not None and (refused := import_objective_error(objective)) is not None:
        raise DifflmError(refused)
    if not str(hf).strip():  # Path("") is the current folder
        raise DifflmError("hf= is empty: give a local Hugging Face model directory or a hub name")
    if not mask_token.strip():
        raise DifflmError(f"mask_token={mask_token!r} is empty: give the text of the token to add, e.g. "
                          f"mask_token='{DEFAULT_MASK_TOKEN}' (the default)")
    if isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int) or vocab_multiple < 1:
        raise DifflmError(f"vocab_multiple={vocab_multiple} must be an integer >= 1 (the embedding is padded to a "
                          "multiple of it): e.g. vocab_multiple=128 (the default)")
    run_dir = Path(run_dir).expanduser().resolve()
    if list_checkpoints(run_dir) and not overwrite:
        raise DifflmError(f"run.dir={str(run_dir)!r} already holds checkpoints: choose a new run.dir or pass "
                          "overwrite=true")
    src = resolve_source(hf, revision)
    hf_cfg = read_hf_config(src, hf)
    dims = model_dims(hf_cfg, hf)
    run_settings = exported_run_settings(hf_cfg, hf)  # before anything is written: a bad value fails first
    if objective is None:
        objective = "ar" if hf_cfg.get("model_type") == "difflm" and hf_cfg.get("causal") else "mdlm"
    dims["shift_logits"] = dims["shift_logits"] or shift_logits
    if dims["shift_logits"] and objective == "ar":
        raise DifflmError("shift_logits=true is for masked diffusion (objective=mdlm): an ar model already "
                          "predicts the next token; drop shift_logits or use objective=mdlm")
    if (missing := missing_tokenizer_files(str(src))) is not None:
        raise DifflmError(f"hf={hf!r} has no tokenizer: {missing}; save it there with tokenizer.save_pretrained")
    weights = read_hf_weights(src, hf)
    if (src / "adapter" / "adapter_config.json").is_file():  # difflm-export lora_format=peft: base + adapter/
        print(f"difflm: hf={hf} holds a PEFT adapter in {src / 'adapter'}, which difflm-import does not read: the run "
              "gets the base weights without it; to import the adapted model, export the LoRA run with "
              "lora_format=merge", flush=True)

    # Hold run.dir as difflm-train does (one run per run.dir): a training run still writing there is never
    # deleted from under it, and no trainer starts on a half-written import. The kernel drops the lock if we die.
    with held_run_dir(run_dir):
        _clear_earlier_run(run_dir, overwrite)
        # tokenizer with a mask token, saved in the run dir; difflm derives mask id and padded vocab from it
        from transformers import AutoTokenizer

        tok_dir = run_dir / "tokenizer"
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # a difflm export's config.json makes AutoTokenizer warn about its model_type
        try:
            hf_tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - one line naming the source
            reason = " ".join(str(e).split())[:200]
            raise DifflmError(f"hf={hf!r}: the tokenizer in {src} could not be loaded ({reason}): save it there with "
                              "tokenizer.save_pretrained") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        real_tokens = len(hf_tok)
        added_mask = hf_tok.mask_token_id is None
        if added_mask:
            hf_tok.add_special_tokens({"mask_token": mask_token})
            if hf_tok.mask_token_id != real_tokens:
                raise DifflmError(f"mask_token={mask_token!r} is already token {hf_tok.mask_token_id}: choose another "
                                  "mask_token")
        tok_dir.mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(tok_dir))
        tok = build_tokenizer(str(tok_dir), vocab_multiple)

        cfg = compose_train_config([f"objective={objective}", f"run.dir={run_dir}", f"data.tokenizer={tok_dir}"])
        for key, value in dims.items():
            if key == "moe":
                for moe_key, moe_value in value.items():
                    cfg.model.moe[moe_key] = moe_value
            else:
                cfg.model[key] = value
        cfg.model.name, cfg.model.vocab_multiple = "imported", vocab_multiple
        cfg.model.vocab_size = tok.padded_vocab_size
        for key, value in run_settings.items():  # a difflm export's training window and sampler settings
            OmegaConf.update(cfg, key, value, merge=False)
        check_model(cfg.model)

        if hf_cfg.get("model_type") == "difflm":
            state = {k: v.float() for k, v in weights.items() if not k.endswith("_extra_state")}
        elif (layout := layout_of(hf_cfg)) is not None:
            state = to_difflm(weights, dims, layout)
        else:
            state = convert_llama_state(weights, dims)
        reinit = [tok.mask_id] if added_mask and tok.mask_id < state["embedding.weight"].shape[0] else []
        for name in ("embedding.weight", "output.weight"):
            if name in state:
                state[name] = resize_vocab(state[name], tok.padded_vocab_size, real_tokens, reinit)

        from difflm.model.auto_kernels import cpu_kernels  # the run keeps ``auto``; the conversion runs here

        model = build_model(cpu_kernels(cfg.model), causal=objective == "ar", device=torch.device("cpu"),
                            seed=cfg.train.seed)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            reason = " ".join(str(e).split())[:300]
            raise DifflmError(f"hf={hf!r} does not convert to difflm's model ({reason})") from None
        torch.manual_seed(cfg.train.seed)
        trainer_state = {
            "step": 0,
            # the position of a fresh schedule (difflm.training.schedule.restore_scheduler)
            "scheduler": {"last_epoch": 0},
            "scaler": {},                      # falsy: the trainer keeps its fresh GradScaler
            "sampler": {},                     # no keys to check: any data/batch may continue from step 0
            "torch_rng": torch.get_rng_state(),  # that of a fresh run with train.seed
            "imported_from": str(hf),
        }
        text = OmegaConf.to_yaml(cfg, resolve=True)
        save_checkpoint(run_dir, 0, model, None, trainer_state, config=text)
        (run_dir / "config.yaml").write_text(text)
        return cfg


def _clear_earlier_run(run_dir: Path, overwrite: bool) -> None:
    """Make ``run_dir`` (held) ready for an import: with checkpoints (``overwrite=true``) the earlier run is
    replaced, checkpoints and every record a new run would pick up (:data:`RUN_RECORDS`: metrics, samples, the W&B
    id, configs) removed; without checkpoints such records are moved aside (nothing to overwrite was asked for)."""
    if list_checkpoints(run_dir):
        if not overwrite:  # a run saved its first checkpoint since the check at the start
            raise DifflmError(f"run.dir={str(run_dir)!r} already holds checkpoints: choose a new run.dir or pass "
                              "overwrite=true")
        what = f"run.dir={str(run_dir)!r} (overwrite=true)"
        for path in [checkpoints_root(run_dir)] + run_records(run_dir):
            remove_path(path, what)
    elif (kept := set_aside_run_records(run_dir)) is not None:
        print(f"difflm: run.dir={run_dir} held records of an earlier run without a checkpoint: moved them to {kept}",
              flush=True)


@hydra_app("import")
def main(args) -> None:
    objective = args.objective.name if args.objective is not None else None
    cfg = import_hf(args.hf, args.run.dir, objective, args.shift_logits, args.vocab_multiple, args.mask_token,
                    args.revision, args.overwrite)
    print(f"imported {args.hf} -> {cfg.run.dir} (checkpoints/step_0, objective={cfg.objective.name}); continue with:")
    print(continue_command(cfg), flush=True)


def continue_command(cfg) -> str:
    """The ``difflm-train`` command difflm-import prints: :func:`train_overrides`, then ``data.path=CORPUS``, a
    placeholder that difflm-train refuses until it names the corpus (its default is the embedded tinyshakespeare
    corpus, which a copied command would otherwise train on without a word). No ``optim.lr``: an adaptation recipe
    added to the command sets its own."""
    return "difflm-train " + " ".join(shlex.quote(o) for o in train_overrides(cfg)) + " data.path=CORPUS"


if __name__ == "__main__":
    main()
