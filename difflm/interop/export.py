"""``difflm-export``: a run's checkpoint -> a Hugging Face directory loadable with ``trust_remote_code=True``.

    difflm-export run.dir=DIR out=HF_DIR [step=N] [dtype=bf16] [max_shard_size=5GB] [overwrite=true]
                  [format=difflm|llada_moe|llada2]

Writes into ``out``:
    model.safetensors                      difflm's state dict, unchanged names (or shards
                                           ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``
                                           when larger than ``max_shard_size``)
    config.json                            :class:`DiffLMConfig` fields + ``auto_map`` to the two files below;
                                           also the run's whole ``gen.*`` (``gen_*``) and ``data.seq_len``
                                           (``train_seq_len``), which ``difflm-import`` restores
    configuration_difflm.py, modeling_difflm.py
                                           self-contained (torch + transformers) copies of ``difflm/interop/hf_modeling``
    generation_config.json                 the run's ``gen.*`` sampler settings and the special ids
    tokenizer files                        the run's tokenizer, with its mask token added when it had none

so that ``AutoModel.from_pretrained(out, trust_remote_code=True)`` (or ``AutoModelForMaskedLM``) returns
a model whose logits equal difflm's and whose ``generate`` is difflm's sampler (docs/hf_interop.md).
``format=llada_moe`` / ``llada2`` write an MoE run in the LLaDA-MoE / LLaDA 2.0 releases' layout instead (their
tensor names and ``config.json`` keys, :mod:`difflm.interop.llada_layouts`; their modeling files, not shipped here,
load it with ``trust_remote_code``, and ``difflm-import`` reads it back).
The checkpoint is read with :func:`difflm.checkpoint.store.load_checkpoint` (DCP, any sharding) into a
pure-PyTorch model: TE-backend runs share its parameter names; their ``_extra_state`` entries are dropped.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from difflm.checkpoint.store import load_trained_weights, trained_settings
from difflm.cli import hydra_app, writable_output
from difflm.data import TokenizerInfo, build_tokenizer
from difflm import strict_json
from difflm.errors import DifflmError
from difflm.interop.difflm_format import moe_fields
from difflm.interop.llada_layouts import LAYOUTS, export_config, from_difflm, layout_of
from difflm.model import build_model
from difflm.sampling.options import unread_stored_settings

TEMPLATES = Path(__file__).resolve().parent / "hf_modeling"
MODELING_FILES = ("configuration_difflm.py", "modeling_difflm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_difflm.DiffLMConfig",
    "AutoModel": "modeling_difflm.DiffLMModel",
    "AutoModelForMaskedLM": "modeling_difflm.DiffLMForMaskedLM",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MASK_TOKEN = "<|mdm_mask|>"
EXTRA_STATE = "_extra_state"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"2GiB"`` / ``1000`` -> bytes (decimal units as Hugging Face's ``max_shard_size``).

    Raises: DifflmError naming ``max_shard_size`` for anything else.
    """
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise DifflmError(f"max_shard_size={text!r} is not a size: use e.g. 5GB, 500MB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def load_run_for_export(run_dir: str | Path, step: Optional[int] = None):
    """(run config, FP32 CPU model in eval mode with the checkpoint's weights, tokenizer info, step).

    Builds the pure-PyTorch backend whatever ``model.backend`` the run trained with (same parameter names;
    TE's ``_extra_state`` is simply not requested from the checkpoint), without ``torch.compile``.
    Raises: DifflmError when ``run.dir`` has no config.yaml or no (matching) checkpoint.
    """
    cfg, ckpt, step = trained_settings(run_dir, step)
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    from difflm.model.auto_kernels import cpu_kernels

    cfg.model = cpu_kernels(cfg.model, keep_explicit=False)  # the export's weights come from the torch kernels
    cfg.model.compile = False
    model = build_model(cfg.model, causal=cfg.objective.name == "ar", device=torch.device("cpu"), seed=0)
    load_trained_weights(run_dir, ckpt, model, cfg)  # a LoRA run: base + adapters, merged by export_checkpoint
    return cfg, model.eval(), tok, step


def lora_export_state(model: torch.nn.Module, lora_format: str) -> dict[str, torch.Tensor]:
    """The base-model state dict to export from a LoRA model (docs/lora.md): ``merge``: every adapter merged into its
    weight (``W + alpha / r B A``); ``peft``: the base weights alone (the adapters go to ``adapter/``)."""
    from difflm.model.lora import adapters_disabled, merged_state_dict

    if lora_format == "merge":
        return merged_state_dict(model)
    with adapters_disabled(model):
        return merged_state_dict(model)


def save_peft_adapter(model: torch.nn.Module, cfg, base_dir: Path, adapter_dir: Path,
                      base_name: Optional[str] = None) -> None:
    """Write ``model``'s adapters as a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained`` loads onto the Hugging Face model in ``base_dir`` (the export of the
    base weights). peft's ``LoraConfig(target_parameters=...)`` adapts the named parameters of the HF model, whose
    names are difflm's (``layers.0.mlp.fc1_weight``); its ``ParamWrapper`` adds ``lora_alpha / r B A`` to each, as
    difflm does. The factors are copied into a peft model built on ``base_dir`` and saved by peft itself.

    Routed experts (``lora.moe=adapt_experts``: 3-D weights [E, d_out, d_in], the layout peft's ``ParamWrapper``
    takes for 3-D parameters without ``is_transposed``) go in peft's expert layout (:func:`peft_factor_weights`).
    Raises: DifflmError without peft, or when peft adapts other parameters than difflm's adapters.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise DifflmError("lora_format=peft needs the peft library: pip install 'difflm[peft]'") from None
    from transformers import AutoModelForMaskedLM

    from difflm.model.lora import adapter_factors

    factors = dict(adapter_factors(model))
    hf = AutoModelForMaskedLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=True)
    peft_cfg = LoraConfig(r=int(cfg.lora.rank), lora_alpha=float(cfg.lora.alpha), lora_dropout=0.0,
                          target_modules=[], target_parameters=sorted(factors), init_lora_weights=False)
    peft_model = get_peft_model(hf, peft_cfg)
    filled = set()
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if not hasattr(module, "parameter_name") or "default" not in getattr(module, "lora_A", {}):
                continue
            owner = name.removeprefix("base_model.model.").replace(".base_layer", "")
            key = f"{owner}.{module.parameter_name}"
            lora_a, lora_b = peft_factor_weights(factors[key])
            module.lora_A["default"].weight.copy_(lora_a)
            module.lora_B["default"].weight.copy_(lora_b)
            filled.add(key)
    if filled != set(factors):
        raise DifflmError(f"peft adapted {sorted(filled)[:3]}..., not difflm's {sorted(factors)[:3]}...")
    peft_model.peft_config["default"].base_model_name_or_path = base_name or str(base_dir)
    # no embedding adapters: peft's "auto" would look for the base's config.json at `base_name`, not written yet
    peft_model.save_pretrained(str(adapter_dir), save_embedding_layers=False)


def peft_factor_weights(factors) -> tuple[torch.Tensor, torch.Tensor]:
    """(``lora_A.weight``, ``lora_B.weight``) of peft's ``ParamWrapper`` for a difflm :class:`LoraFactors`.

    2-D factors A [r, d_in], B [d_out, r] are peft's ``lora.Linear`` ones. For E experts (A [E, r, d_in],
    B [E, d_out, r]) peft holds one ``nn.Linear`` pair of rank r E: ``lora_A.weight`` [E r, d_in] read back as
    ``reshape(E, r, d_in)``, and ``lora_B.weight`` [d_out, r E] read back as ``reshape(d_out, r, E)``, so that its
    delta ``einsum("o r e, e r i -> e o i")`` is difflm's ``B_e A_e`` per expert.
    """
    a, b = factors.lora_A.detach(), factors.lora_B.detach()
    if a.dim() == 2:
        return a, b
    experts, rank, d_in = a.shape
    return a.reshape(experts * rank, d_in), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)


def export_state_dict(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """difflm's state dict for safetensors: contiguous CPU tensors in ``dtype`` (floating ones), no ``_extra_state``."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(EXTRA_STATE):
            continue
        t = t.detach().to("cpu")
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    return out


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def save_sharded(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    """Write ``state`` as ``model.safetensors``, or as shards + ``model.safetensors.index.json`` (the layout
    ``transformers`` reads) when the total exceeds ``max_shard_bytes``. A tensor larger than the limit gets a
    shard of its own. Returns the file names written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    umask = _umask()

    def save(shard: dict, fname: str) -> None:
        save_file(shard, str(out / fname), metadata=metadata)
        os.chmod(out / fname, 0o666 & ~umask)  # safetensors writes 0600; the other files follow the umask

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save(shard, fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(strict_json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + ["model.safetensors.index.json"]


def _config_class():
    """The template's ``DiffLMConfig`` (loaded from its file: it is shipped as data, not as a difflm module)."""
    spec = importlib.util.spec_from_file_location("_difflm_hf_configuration", TEMPLATES / "configuration_difflm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DiffLMConfig


def save_tokenizer_with_mask(tok: TokenizerInfo, out: Path, mask_token: str = DEFAULT_MASK_TOKEN) -> None:
    """Save ``tok.tokenizer`` to ``out`` with a mask token at ``tok.mask_id``.

    difflm's implicit mask id of a tokenizer without one is ``len(tokenizer)``; adding ``mask_token`` as a
    special token gives it exactly that id, so the saved tokenizer yields the same mask id and padded vocab.
    Raises: DifflmError when ``mask_token`` is already a token with another id (pick another mask_token).
    """
    tokenizer = tok.tokenizer
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": mask_token})
        if tokenizer.mask_token_id != tok.mask_id:
            raise DifflmError(f"mask_token={mask_token!r} is already token {tokenizer.mask_token_id} of the tokenizer, "
                              f"not the free id {tok.mask_id}: choose another mask_token")
    tokenizer.save_pretrained(str(out))


def exported_gen(cfg):
    """The run's ``gen.*`` as an export records them (``config.json``'s ``gen_*``, ``generation_config.json``):
    ``steps`` and ``block_length`` null where the run's are (a stored 64, the former default, counts as null:
    :func:`difflm.sampling.options.unread_stored_settings`), so that the export's ``generate`` fits them to the
    ``gen_length`` it is given, as difflm-generate does; a value given is recorded as given."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg.gen, unread_stored_settings(None, cfg.gen))


def hf_config(cfg, tok: TokenizerInfo, dtype: str, step: Optional[int] = None):
    """The :class:`DiffLMConfig` of a run (``cfg`` resolved: ``model.vocab_size`` and ``head_dim`` set) at checkpoint
    ``step`` (``train_step``: an export says which checkpoint it holds)."""
    m, config_cls = cfg.model, _config_class()
    g = exported_gen(cfg)
    return config_cls(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, intermediate_size=m.ffn_hidden_size,
        head_dim=m.head_dim, rope_theta=float(m.rope_base), rms_norm_eps=float(m.norm_eps), qk_norm=m.qk_norm,
        partial_rotary_factor=float(m.get("partial_rotary_factor", 1.0)),
        qkv_bias=bool(m.get("qkv_bias", False)), tie_word_embeddings=m.tie_embeddings,
        causal=cfg.objective.name == "ar", shift_logits=bool(m.get("shift_logits", False)),
        mask_token_id=tok.mask_id, tokenizer_vocab_size=len(tok.tokenizer), initializer_range=m.init_std,
        gen_length=g.length, gen_steps=g.steps, gen_block_length=g.block_length, gen_remasking=g.remasking,
        gen_temperature=float(g.temperature), gen_cfg_scale=float(g.get("cfg_scale", 0.0)),
        gen_top_k=int(g.get("top_k", 0)), gen_top_p=float(g.get("top_p", 1.0)), gen_threshold=g.get("threshold"),
        gen_seed=int(g.get("seed", 0)), gen_cache=str(g.get("cache", "none")), train_seq_len=int(cfg.data.seq_len),
        gen_remdm_sigma=float(g.get("remdm_sigma", 0.0)), gen_remdm_schedule=str(g.get("remdm_schedule", "cap")),
        train_step=None if step is None else int(step),
        bos_token_id=tok.tokenizer.bos_token_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.tokenizer.pad_token_id, architectures=["DiffLMForMaskedLM"], auto_map=dict(AUTO_MAP),
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        **moe_fields(m),
    )


def _refuse_unsafe_out(out: Path, run_dir: Path, overwrite: bool) -> None:
    """Refuse an ``out`` whose replacement would lose data: the run directory itself or a folder holding it, and,
    with ``overwrite=true``, any non-empty folder that is not an earlier difflm-export output (:func:`_not_an_export`).

    Raises: DifflmError naming ``out`` and the fix.
    """
    target, run = out.resolve(), run_dir.resolve()
    if target == run or target in run.parents:
        raise DifflmError(f"out={str(out)!r} is {'the run directory' if target == run else 'a folder holding run.dir'} "
                          f"({str(run_dir)!r}): replacing it would delete the run's checkpoints; choose another "
                          "directory, e.g. out=<run.dir>/hf")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise DifflmError(f"out={str(out)!r} exists and is not empty: choose a new directory or pass overwrite=true")
    if (what := _not_an_export(out)) is not None:
        raise DifflmError(f"out={str(out)!r} is not an earlier export ({what}), and overwrite=true would delete "
                          "everything in it: choose a new directory")


# the keys of difflm's sampler that every difflm-export output's generation_config.json records
_EXPORT_GEN_KEYS = ("gen_length", "steps", "block_length", "remasking", "cfg_scale", "threshold")


def _not_an_export(out: Path) -> Optional[str]:
    """None when ``out`` holds a difflm-export output (its ``config.json`` says ``model_type: difflm``, or is a
    LLaDA layout that difflm-export wrote: with ``train_seq_len``, or with a ``generation_config.json`` holding
    difflm's sampler settings, :data:`_EXPORT_GEN_KEYS`), else why not: a Hugging Face model downloaded or saved
    there (a Llama, a LLaDA release) has a config.json too."""
    path = out / "config.json"
    if not path.is_file():
        return "it has no config.json"
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
        return "its config.json is not JSON"
    if not isinstance(config, dict):
        return "its config.json is not a JSON object"
    if config.get("model_type") == "difflm" or (layout_of(config) is not None and
                                                 ("train_seq_len" in config or _records_difflm_sampler(out))):
        return None
    return f"its config.json is a model_type={config.get('model_type')!r} model that difflm-export did not write"


def _records_difflm_sampler(out: Path) -> bool:
    """Whether ``out/generation_config.json`` is a JSON object with every key of :data:`_EXPORT_GEN_KEYS`, as
    difflm-export writes it (LLaDA-layout exports without ``train_seq_len`` in config.json have it too)."""
    try:
        gen = json.loads((out / "generation_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(gen, dict) and all(k in gen for k in _EXPORT_GEN_KEYS)


def export_run(run_dir: str | Path, out: str | Path, step: Optional[int] = None, dtype: str = "fp32",
               max_shard_size: str | int = "5GB", overwrite: bool = False) -> Path:
    """Export ``run_dir``'s checkpoint (latest, or ``step``) to the Hugging Face directory ``out``; returns ``out``.
    See :func:`export_checkpoint` (which also returns the step exported)."""
    return export_checkpoint(run_dir, out, step, dtype, max_shard_size, overwrite)[0]


def export_checkpoint(run_dir: str | Path, out: str | Path, step: Optional[int] = None, dtype: str = "fp32",
                      max_shard_size: str | int = "5GB", overwrite: bool = False,
                      lora_format: str = "merge", format: str = "difflm") -> tuple[Path, int]:
    """Export ``run_dir``'s checkpoint (latest, or ``step``) to the Hugging Face directory ``out``.

    The directory is written into a new hidden folder beside it (``.<out name>.XXXX.tmp``, never an existing one) and
    renamed at the end, so ``out`` is complete or absent; a failed export removes that folder. An earlier export in
    ``out`` (``overwrite=true``) is moved aside until the new one is in place, and is back in ``out`` when that
    rename fails.
    ``config.json`` records the checkpoint's step as ``train_step``. A LoRA run's adapters are merged into the
    weights (``lora_format=merge``), or (``peft``) ``out`` holds the base weights and ``out/adapter`` the PEFT adapter
    (:func:`save_peft_adapter`).
    ``format=llada_moe`` / ``llada2``: the release's tensor names and config.json (no modeling file; module docstring).
    Returns (``out``, the step exported). Raises DifflmError for a bad ``dtype``/``max_shard_size``/``format``, a
    non-empty ``out`` without ``overwrite``, a run without config/checkpoint, an ``objective=bd3lm`` run, or a model
    the chosen layout cannot express.
    """
    if dtype not in DTYPES:
        raise DifflmError(f"dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
    if format not in ("difflm", *LAYOUTS):
        raise DifflmError(f"format={format!r} is not one of: difflm, {', '.join(LAYOUTS)}")
    if format != "difflm" and lora_format == "peft":
        raise DifflmError(f"format={format} with lora_format=peft: the adapters have no layout there; use "
                          "lora_format=merge")
    max_bytes = parse_size(max_shard_size)
    if lora_format not in ("merge", "peft"):
        raise DifflmError(f"lora_format={lora_format!r} is not one of: merge, peft")
    out = writable_output("out", out, directory=True)
    if out.is_symlink():  # the folder the link names is written (replaced in place); the link stays
        out = writable_output("out", out.resolve(), directory=True)
    _refuse_unsafe_out(out, Path(run_dir).expanduser(), overwrite)
    cfg, model, tok, step = load_run_for_export(run_dir, step)
    if cfg.objective.name == "bd3lm":  # the exported generate is LLaDA's sampler over bidirectional attention
        raise DifflmError(f"run.dir={str(run_dir)!r} is an objective=bd3lm run: the exported modeling file samples "
                          "masked diffusion with bidirectional attention, not BD3-LM's block-causal blocks, so its "
                          "generate would not be the model's sampler; sample with difflm-generate instead")
    # a new folder beside out (mkdtemp never picks an existing one), removed when the export fails
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_export(run_dir, out, tmp, cfg, model, tok, step, dtype, max_bytes, lora_format, format)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, step


def _write_export(run_dir, out: Path, tmp: Path, cfg, model, tok, step, dtype: str, max_bytes: int,
                  lora_format: str, format: str) -> None:
    """Write the export into the empty folder ``tmp``, then put it in place of ``out`` (:func:`export_checkpoint`)."""
    from difflm.model.lora import lora_enabled

    lora = lora_enabled(cfg.get("lora"))
    if lora_format == "peft" and not lora:
        raise DifflmError(f"lora_format=peft: run.dir={str(run_dir)!r} trained no LoRA adapters (lora.rank=0)")
    weights = model
    if lora:  # a plain model with the exported weights: the modeling file has no adapters
        weights = build_model(cfg.model, causal=cfg.objective.name == "ar", device=torch.device("cpu"), seed=None)
        weights.load_state_dict(lora_export_state(model, lora_format))
    state = export_state_dict(weights, DTYPES[dtype])
    if format == "difflm":
        save_sharded(state, tmp, max_bytes)
        config = hf_config(cfg, tok, dtype, step)
        config.save_pretrained(str(tmp))
        for name in MODELING_FILES:
            shutil.copyfile(TEMPLATES / name, tmp / name)
    else:  # the release's names and config.json keys (checked first: a model it cannot express fails here)
        config = export_config(cfg, tok, format, dtype, state)
        save_sharded(from_difflm(state, cfg.model, format), tmp, max_bytes)
        (tmp / "config.json").write_text(strict_json.dumps(config, indent=2) + "\n")
    save_tokenizer_with_mask(tok, tmp)
    g = exported_gen(cfg)
    gen = {"bos_token_id": tok.tokenizer.bos_token_id, "eos_token_id": tok.eos_id, "mask_token_id": tok.mask_id,
           "max_new_tokens": g.length, "gen_length": g.length, "steps": g.steps, "block_length": g.block_length,
           "remasking": cfg.gen.remasking,
           "cfg_scale": float(cfg.gen.get("cfg_scale", 0.0)), "threshold": cfg.gen.get("threshold"),
           "do_sample": cfg.gen.temperature > 0}
    if cfg.gen.temperature > 0:  # transformers warns about sampling settings without sampling
        gen.update(temperature=float(cfg.gen.temperature), top_k=int(cfg.gen.get("top_k", 0)),
                   top_p=float(cfg.gen.get("top_p", 1.0)))
    (tmp / "generation_config.json").write_text(strict_json.dumps(gen, indent=2) + "\n")
    if lora_format == "peft":
        save_peft_adapter(model, cfg, tmp, tmp / "adapter", base_name=str(out))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; an export folder follows the umask
    if not out.exists():
        os.replace(tmp, out)
        return
    # the earlier export is moved aside, not deleted, until the new one is in place: a failed move puts it back
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.replace(out, aside / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside / out.name, out)
        aside.rmdir()
        raise
    shutil.rmtree(aside)


@hydra_app("export")
def main(args) -> None:
    fmt = args.get("format", "difflm")
    out, step = export_checkpoint(args.run.dir, args.out, args.step, args.dtype, args.max_shard_size, args.overwrite,
                                  args.lora_format, fmt)
    if fmt != "difflm":
        print(f"exported {args.run.dir} checkpoint step {step} -> {out} in the {fmt} layout; copy the release's "
              "configuration/modeling files there to load it with trust_remote_code=True, or difflm-import it")
        return
    print(f"exported {args.run.dir} checkpoint step {step} -> {out}; load with "
          f"AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True)" + export_peft_hint(out, args.lora_format))


def export_peft_hint(out: Path, lora_format: str) -> str:
    """The rest of difflm-export's last line for ``lora_format=peft``: that ``out`` is the base model without the
    adapters, and how peft adds ``out/adapter`` to it (docs/lora.md)."""
    if lora_format != "peft":
        return ""
    return (f" (the base, without the adapters), then PeftModel.from_pretrained(model, "
            f"{str(Path(out) / 'adapter')!r}) for the adapters")


if __name__ == "__main__":
    main()
