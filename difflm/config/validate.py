"""Cross-key checks of a composed run, done once before any model, data or process-group work.

Types and key names are checked by the schema at compose time; this module checks what a schema
cannot: choices, divisibility and what the hardware can do. Each failure is a :class:`DifflmError`
whose one line names the keys and the fix.
"""
from __future__ import annotations

import importlib.util

import torch

from difflm.errors import DifflmError

CHOICES = {
    "model.backend": ("torch", "te"),
    "model.attention_backend": ("sdpa", "te", "flash", "flex"),
    "precision.name": ("fp32", "bf16", "fp16", "fp8"),
    "precision.fp8_recipe": ("delayed", "current", "block", "mxfp8"),
    "objective.name": ("mdlm", "ar"),
    "objective.t_sampling": ("iid", "antithetic", "stratified"),
    "objective.loss_norm": ("token", "sequence"),
    "optim.name": ("adamw",),
    "schedule.name": ("cosine", "wsd", "constant"),
    "logger.name": ("console", "wandb"),
    "logger.mode": ("online", "offline", "disabled"),
    "gen.remasking": ("low_confidence", "random"),
    "device": ("auto", "cpu", "cuda"),
}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise DifflmError(message)


def resolve_device(name: str) -> torch.device:
    """``device=auto|cpu|cuda`` -> torch.device; DifflmError when CUDA is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DifflmError("device=cuda but no CUDA device is visible to PyTorch: use device=cpu (or device=auto)")
    return torch.device(name)


def check_choices(cfg, keys=None) -> None:
    """Every enumerated key holds one of its allowed values."""
    for key in keys or CHOICES:
        value = _get(cfg, key)
        _require(value in CHOICES[key], f"{key}={value!r} is not one of: {', '.join(CHOICES[key])}")


def check_model(m) -> None:
    """Head and width arithmetic of ``model``."""
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        _require(m[key] > 0, f"model.{key}={m[key]} must be positive")
    _require(m.num_heads % m.num_kv_heads == 0,
             f"model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}: "
             "pick a divisor for grouped-query attention")
    if m.head_dim is None:
        _require(m.hidden_size % m.num_heads == 0,
                 f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}: "
                 "change one of them or set model.head_dim")
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    _require(head_dim % 2 == 0, f"head dim {head_dim} must be even for RoPE: set model.head_dim to an even value")
    if m.backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise DifflmError("model.backend=te needs Transformer Engine, which is not installed: "
                          "pip install 'difflm[te]' on a CUDA machine, or use model.backend=torch")
    if m.backend == "te" and m.get("compile", False):
        raise DifflmError("model.compile=true applies to model.backend=torch (TE runs its own fused kernels): "
                          "set model.compile=false or model.backend=torch")


def check_precision(cfg, device: torch.device, training: bool = True) -> None:
    """What the chosen device can run: precision, FP8 recipe, model and attention backends.

    ``training=False`` (scripts/benchmark.py) also allows ``precision.fp8_weights``, which needs an optimizer
    with FP32 master weights that the trainer does not build yet.
    """
    from difflm.model.attention import attention_unavailable_reason
    from difflm.training.precision import device_fp8_unsupported_reason

    name, p, m = cfg.precision.name, cfg.precision, cfg.model
    if m.backend == "te":
        _require(device.type == "cuda", f"model.backend=te runs Transformer Engine's CUDA kernels and the device is "
                 f"{device.type}: use device=cuda on an NVIDIA GPU, or model.backend=torch")
    reason = attention_unavailable_reason(m.attention_backend, device, name)
    _require(reason is None, reason or "")
    for key in ("fp8_weights", "fp8_skip_first_last", "fp8_attention"):
        _require(not p.get(key, False) or name == "fp8",
                 f"precision.{key}=true needs precision=fp8 (this run is precision={name}): drop the override")
    if name == "fp8" and device.type == "cuda":
        reason = device_fp8_unsupported_reason(p.fp8_recipe, device)
        _require(reason is None, reason or "")
    if p.get("fp8_attention", False):
        _require(m.attention_backend == "te", "precision.fp8_attention=true runs FP8 inside te.DotProductAttention: "
                 "set model.attention_backend=te")
    if training:
        _require(not p.get("fp8_weights", False),
                 "precision.fp8_weights=true keeps TE weights only in FP8 and needs an optimizer with FP32 master "
                 "weights, which the trainer does not build yet: set precision.fp8_weights=false "
                 "(scripts/benchmark.py measures it)")
    if name == "fp16":
        _require(device.type == "cuda",
                 "precision=fp16 (with loss scaling) needs a CUDA device: use precision=bf16 or precision=fp32 on CPU")
    if name == "fp8":
        _require(device.type == "cuda", "precision=fp8 needs an FP8-capable NVIDIA GPU (Hopper or newer): "
                 "use precision=bf16 or precision=fp32 on this machine")
        _require(cfg.model.backend == "te", "precision=fp8 runs through Transformer Engine: set model.backend=te")
    if name == "bf16" and device.type == "cuda":
        _require(torch.cuda.is_bf16_supported(), "precision=bf16 is not supported by this GPU: use precision=fp16")


def check_batch(cfg, world_size: int = 1) -> int:
    """Global batch = micro batch x accumulation steps x data-parallel ranks. Returns the accumulation steps."""
    t, p = cfg.train, cfg.parallel
    degrees = p.dp_replicate * p.dp_shard * p.tp * p.pp * p.cp
    _require(degrees == world_size,
             f"parallel.dp_replicate*dp_shard*tp*pp*cp={degrees} but the world size is {world_size}: "
             f"parallel={p.name} runs on {world_size} process(es); launch with torchrun --nproc-per-node {degrees} "
             "or pick a layout whose degrees multiply to the world size")
    dp = p.dp_replicate * p.dp_shard
    for key in ("global_batch_size", "micro_batch_size", "max_steps"):
        _require(t[key] > 0, f"train.{key}={t[key]} must be positive")
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
             f"{t.micro_batch_size} x data-parallel ranks={dp}: make it one (gradient accumulation fills the rest)")
    return t.global_batch_size // (t.micro_batch_size * dp)


def check_run(cfg, world_size: int = 1) -> torch.device:
    """All checks of a training run; returns the device to train on."""
    check_choices(cfg)
    check_model(cfg.model)
    device = resolve_device(cfg.device)
    check_precision(cfg, device)
    check_batch(cfg, world_size)
    d, o, t = cfg.data, cfg.objective, cfg.train
    _require(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be at least 2")
    _require(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    _require(0.0 < o.eps < 1.0, f"objective.eps={o.eps} must be in (0, 1)")
    _require(0.0 <= o.random_length_prob <= 1.0, f"objective.random_length_prob={o.random_length_prob} must be in [0, 1]")
    _require(o.length_multiple >= 1 and d.seq_len % o.length_multiple == 0,
             f"objective.length_multiple={o.length_multiple} must be >= 1 and divide data.seq_len={d.seq_len}")
    _require(t.eval_every >= 0 and t.save_every >= 0, "train.eval_every and train.save_every must be >= 0 (0 = never)")
    _require(t.eval_mc_samples >= 1, f"train.eval_mc_samples={t.eval_mc_samples} must be >= 1")
    _require(cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} must be positive")
    return device
