"""Cross-key checks of a composed run, done once before any model, data or process-group work.

Types and key names are checked by the schema at compose time (keys added with ``+`` by
:func:`difflm.config.schema.check_known_keys`); this module checks what a schema cannot: choices,
divisibility and what the hardware can do. Each failure is a :class:`DifflmError` whose one line names
the keys and the fix.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from difflm.errors import DifflmError

CHOICES = {
    "model.backend": ("auto", "torch", "te"),
    "model.attention_backend": ("auto", "sdpa", "te", "flash", "flex"),
    "model.moe.score_func": ("softmax", "sigmoid"),
    "model.moe.balance_over": ("micro_batch", "global_batch"),
    "precision.name": ("fp32", "bf16", "fp16", "fp8"),
    "precision.fp8_recipe": ("delayed", "current", "block", "mxfp8"),
    "objective.name": ("mdlm", "ar", "bd3lm", "sft"),
    "objective.schedule": ("linear", "cosine", "loglinear"),
    "objective.t_sampling": ("iid", "antithetic", "stratified"),
    "objective.loss_norm": ("token", "sequence"),
    "optim.name": ("adamw",),
    "schedule.name": ("cosine", "wsd", "constant"),
    "logger.name": ("console", "wandb"),
    "logger.mode": ("online", "offline", "disabled"),
    "gen.remasking": ("low_confidence", "random", "margin", "entropy", "remdm"),
    "gen.remdm_schedule": ("cap", "rescale"),
    "gen.cache": ("none", "prefix", "dual"),
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
        # logger.mode defaults to $WANDB_MODE (conf/logger/wandb.yaml): say where a bad value came from
        source = " (from WANDB_MODE)" if key == "logger.mode" and os.environ.get("WANDB_MODE") == value else ""
        _require(value in CHOICES[key], f"{key}={value!r}{source} is not one of: {', '.join(CHOICES[key])}")


def check_model(m, installed: bool = True) -> None:
    """Head and width arithmetic of ``model``; with ``installed``, also that ``model.backend=te`` can be imported
    here (``difflm-plan`` plans for another machine and passes False)."""
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
    from difflm.model.rope import rotary_dim

    try:  # partial rotary: head_dim * f rotated dims, positive and even
        rotary_dim(head_dim, float(m.get("partial_rotary_factor", 1.0)))
    except ValueError as e:
        raise DifflmError(str(e)) from None
    if installed and m.backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise DifflmError("model.backend=te needs Transformer Engine, which is not installed: "
                          "pip install 'transformer-engine[pytorch]' on a CUDA machine, or use model.backend=torch")
    check_moe(m)
    if m.backend == "te" and m.get("compile", False):
        raise DifflmError("model.compile=true applies to model.backend=torch (TE runs its own fused kernels): "
                          "set model.compile=false or model.backend=torch")


def check_moe(m) -> None:
    """``model.moe.*`` (mixture of experts; docs/moe.md): sizes, router and balancing settings."""
    moe = m.get("moe")
    if moe is None or moe.num_experts == 0:
        return
    e = moe.num_experts
    _require(e > 0, f"model.moe.num_experts={e} must be >= 0 (0 = dense MLP)")
    _require(moe.top_k >= 1, f"model.moe.top_k={moe.top_k} must be >= 1")
    _require(moe.top_k <= e, f"model.moe.top_k={moe.top_k} must be <= model.moe.num_experts={e}")
    _require(moe.ffn_hidden_size >= 0, f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} must be >= 0 "
             "(0 = model.ffn_hidden_size)")
    _require(moe.num_shared_experts >= 0, f"model.moe.num_shared_experts={moe.num_shared_experts} must be >= 0")
    _require(moe.score_func in ("softmax", "sigmoid"),
             f"model.moe.score_func={moe.score_func!r} is not one of: softmax, sigmoid")
    for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        _require(moe[key] >= 0, f"model.moe.{key}={moe[key]} must be >= 0 (0 = off)")
    _require(moe.capacity_factor is None or moe.capacity_factor > 0,
             f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null (no token dropping)")
    g, kg = moe.get("n_group", 1), moe.get("topk_group", 1)
    _require(g >= 1, f"model.moe.n_group={g} must be >= 1 (1 = no group-limited routing)")
    _require(e % g == 0, f"model.moe.n_group={g} does not divide model.moe.num_experts={e}")
    _require(kg >= 1, f"model.moe.topk_group={kg} must be >= 1")
    _require(kg <= g, f"model.moe.topk_group={kg} must be <= model.moe.n_group={g}"
             + (" (1 = no group-limited routing: leave model.moe.topk_group at 1)" if g == 1 else ""))
    if g > 1:
        _require(moe.top_k <= kg * (e // g), f"model.moe.top_k={moe.top_k} exceeds the experts of the kept groups "
                 f"(topk_group * num_experts / n_group = {kg * (e // g)}): raise model.moe.topk_group")
    _require(moe.get("routed_scaling_factor", 1.0) > 0,
             f"model.moe.routed_scaling_factor={moe.get('routed_scaling_factor')} must be > 0 (1 = unscaled)")
    k_dense = moe.get("first_k_dense", 0)
    _require(k_dense >= 0, f"model.moe.first_k_dense={k_dense} must be >= 0 (the dense blocks before the first MoE "
             "block)")
    _require(k_dense < m.num_layers, f"model.moe.first_k_dense={k_dense} must be < model.num_layers={m.num_layers} "
             "(the dense blocks before the first MoE block; at least one MoE block)")
    _require(moe.get("shared_ffn_hidden_size", 0) >= 0, f"model.moe.shared_ffn_hidden_size="
             f"{moe.get('shared_ffn_hidden_size')} must be >= 0 (0 = num_shared_experts * expert width)")
    _require(not moe.get("shared_ffn_hidden_size", 0) or moe.num_shared_experts > 0,
             f"model.moe.shared_ffn_hidden_size={moe.get('shared_ffn_hidden_size')} is the width of the shared experts "
             "and model.moe.num_shared_experts=0 builds none: set model.moe.num_shared_experts=1 (or more) for a "
             "shared expert of that width, or model.moe.shared_ffn_hidden_size=0")


def check_precision_keys(cfg) -> None:
    """The ``precision.*`` keys against each other and the chosen attention kernel, whatever the device: the FP8
    options need ``precision=fp8``; FP8 attention runs in TE's attention. Raises: DifflmError naming the key."""
    name, p = cfg.precision.name, cfg.precision
    for key in ("fp8_weights", "fp8_skip_first_last", "fp8_attention"):
        _require(not p.get(key, False) or name == "fp8",
                 f"precision.{key}=true needs precision=fp8 (this run is precision={name}): drop the override")
    if p.get("fp8_attention", False):
        _require(cfg.model.attention_backend in ("te", "auto"), "precision.fp8_attention=true runs FP8 inside "
                 "te.DotProductAttention: set model.attention_backend=te")


def check_precision(cfg, device: torch.device, training: bool = True) -> None:
    """What the chosen device can run: precision, FP8 recipe, model and attention backends.

    ``training=False`` (scripts/benchmark.py) also allows ``precision.fp8_weights``, which needs an optimizer
    with FP32 master weights that the trainer does not build yet.
    """
    from difflm.model.attention import attention_unavailable_reason
    from difflm.model.auto_kernels import choose_kernels
    from difflm.training.precision import device_fp8_unsupported_reason

    choose_kernels(cfg, device)  # every ``auto`` resolved: the checks below see the choice
    name, p, m = cfg.precision.name, cfg.precision, cfg.model
    if m.backend == "te":
        _require(device.type == "cuda", f"model.backend=te runs Transformer Engine's CUDA kernels and the device is "
                 f"{device.type}: use device=cuda on an NVIDIA GPU, or model.backend=torch")
    reason = attention_unavailable_reason(m.attention_backend, device, name)
    _require(reason is None, reason or "")
    check_precision_keys(cfg)
    if name == "fp8" and device.type == "cuda":
        reason = device_fp8_unsupported_reason(p.fp8_recipe, device)
        _require(reason is None, reason or "")
    if training:
        _require(not p.get("fp8_weights", False),
                 "precision.fp8_weights=true keeps TE weights only in FP8 and needs an optimizer with FP32 master "
                 "weights, which the trainer does not build yet: set precision.fp8_weights=false "
                 "(scripts/benchmark.py measures it)")
    fused_experts = m.get("moe") is not None and m.moe.get("fused_experts", False) is True
    _require(m.get("fused_mlp", False) or fused_experts or not m.get("fused_mlp_autotune", False),
             "model.fused_mlp_autotune=true tunes quack's GEMMs of the fused MLP and the fused MoE experts: set "
             "model.fused_mlp=true (or model.moe.fused_experts=true for an MoE model) too")
    if m.get("fused_mlp", False):
        check_fused_mlp(cfg, device, training)
    if name == "fp16":
        _require(device.type == "cuda",
                 "precision=fp16 (with loss scaling) needs a CUDA device: use precision=bf16 or precision=fp32 on CPU")
    if name == "fp8":
        _require(device.type == "cuda", "precision=fp8 needs an FP8-capable NVIDIA GPU (Hopper or newer): "
                 "use precision=bf16 or precision=fp32 on this machine")
        _require(cfg.model.backend == "te", "precision=fp8 runs through Transformer Engine: set model.backend=te")
    if name == "bf16" and device.type == "cuda":
        _require(torch.cuda.is_bf16_supported(), "precision=bf16 is not supported by this GPU: use precision=fp16")


def check_fused_mlp(cfg, device: torch.device, training: bool = True) -> None:
    """What ``model.fused_mlp=true`` (:mod:`difflm.kernels.quack_mlp`) needs: the TE kernel set, BF16, a dense MLP, and
    quack on a Hopper/Blackwell GPU (tensor parallelism is checked in :func:`check_parallel`). Random-length steps
    are allowed with ``model.fused_mlp_autotune``: quack tunes only the largest row count a module has seen
    (:func:`difflm.kernels.quack_mlp.tuned_call`)."""
    from difflm.kernels.quack_mlp import quack_unavailable_reason

    m, name = cfg.model, cfg.precision.name
    _require(m.backend == "te", f"model.fused_mlp=true is a slot of the TE kernel set and this run has model.backend="
             f"{m.backend}: set model.backend=te, or model.fused_mlp=false")
    _require(name == "bf16", f"model.fused_mlp=true runs BF16 GEMMs (quack) and this run is precision={name}: "
             "set model.fused_mlp=false (TE's LayerNormMLP runs FP8), or precision=bf16")
    moe = m.get("moe")
    _require(moe is None or not moe.num_experts, f"model.fused_mlp=true fuses the dense SwiGLU MLP and this model has "
             f"model.moe.num_experts={moe.num_experts if moe else 0}: set model.fused_mlp=false")
    reason = quack_unavailable_reason(device)
    _require(reason is None, reason or "")


def check_moe_kernels(cfg, dims, device: Optional[torch.device]) -> None:
    """What the MoE expert kernels ``model.moe.fp8_experts`` / ``model.moe.fused_experts`` need
    (:mod:`difflm.model.grouped_experts`, :mod:`difflm.kernels.quack_experts`): the TE kernel set's FP32 ``main_grad``
    accumulation (one GPU or tensor parallelism, no FSDP2 or pipeline, no LoRA, ``model.fuse_wgrad_accumulation``);
    FP8 experts an FP8 run; fused experts quack on a Hopper/Blackwell GPU; not both. ``dims``: the resolved layout;
    ``device``: the run's, or None for a GPU that has what the kernels need (``difflm-plan``, which plans for one)."""
    m = cfg.model
    moe = m.get("moe")
    chosen = [k for k in ("fp8_experts", "fused_experts") if moe is not None and moe.get(k, False)]
    if not chosen:
        return
    key = f"model.moe.{chosen[0]}"
    _require(len(chosen) == 1, "model.moe.fp8_experts and model.moe.fused_experts are two kernels for the same GEMMs: "
             "set one of them to false")
    _require(int(moe.num_experts) > 0,
             f"{key}=true is a kernel of the MoE experts and model.moe.num_experts=0: drop it")
    need = "model.backend=te precision=fp8" if chosen[0] == "fp8_experts" else "model.backend=te"
    on_gpu = device is None or torch.device(device).type == "cuda"
    _require(m.backend == "te", f"{key}=true runs on the TE kernel set's FP32 main_grad accumulation (a CUDA GPU with "
             f"{need}) and this run has model.backend={m.backend}"
             + (f": set {need}, or {key}=false" if on_gpu else f" on {torch.device(device).type}: set {key}=false"))
    from difflm.kernels.main_grad import accumulates_in_main_grad

    _require(accumulates_in_main_grad(cfg, sharded=dims.fsdp_enabled, pipelined=dims.pp_enabled),
             f"{key}=true needs the experts' gradients accumulated in FP32 main_grad, which FSDP2, pipelines, LoRA, "
             f"precision.fp8_weights and model.fuse_wgrad_accumulation=false turn off: set {key}=false for this layout")
    if chosen[0] == "fp8_experts":
        _require(cfg.precision.name == "fp8", f"{key}=true runs the experts in FP8 inside an FP8 run and this run is "
                 f"precision={cfg.precision.name}: set precision=fp8, or {key}=false")
    elif device is not None:
        from difflm.kernels.quack_mlp import quack_unavailable_reason

        reason = quack_unavailable_reason(device, key=key)
        _require(reason is None, reason or "")


def check_batch(cfg, world_size: int = 1) -> int:
    """Global batch = micro batch x accumulation steps x data-parallel ranks. Returns the accumulation steps.

    The data-parallel ranks are ``dp_replicate * dp_shard`` of the layout resolved for ``world_size``
    (:class:`difflm.parallel.mesh.ParallelDims`, which also checks that the degrees multiply to it).
    """
    from difflm.parallel.mesh import ParallelDims

    t = cfg.train
    dp = ParallelDims.from_config(cfg.parallel, world_size).dp
    _require(isinstance(t.micro_batch_size, int) and not isinstance(t.micro_batch_size, bool),
             f"train.micro_batch_size={t.micro_batch_size!r} must be a positive number or auto (auto is chosen by "
             "difflm.training.auto_batch.choose_micro_batch before this check)")
    for key in ("global_batch_size", "micro_batch_size", "max_steps"):
        _require((key == "max_steps" and t[key] is None) or t[key] > 0,  # null: train.epochs sets it (check_length)
                 f"train.{key}={t[key]} must be positive")
    per = t.micro_batch_size * dp
    if t.global_batch_size % per:
        fix = f"set train.global_batch_size to a multiple of {per}"
        if t.global_batch_size % dp == 0:
            fix += (f", or train.micro_batch_size to a divisor of {t.global_batch_size // dp} (the batch of each "
                    "data-parallel rank)")
        raise DifflmError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                          f"{t.micro_batch_size} x data-parallel ranks={dp}: {fix} (gradient accumulation fills the "
                          "rest)")
    return t.global_batch_size // (t.micro_batch_size * dp)


def check_length(t) -> None:
    """The run's length: ``train.max_steps``, or ``train.epochs`` (passes over the training windows), which sets
    ``train.max_steps`` once the data is read (:class:`difflm.training.trainer.Trainer`). Both set is refused: the
    epochs would silently replace the steps. A ``train.max_steps`` left at its schema default (300) cannot be told
    apart from one set to 300, so with ``train.epochs`` it counts as not set (the trainer prints the steps the
    epochs give).

    Raises: DifflmError naming both keys and the way out.
    """
    from difflm.config.schema import TrainConfig

    epochs, steps = t.get("epochs"), t.max_steps
    if epochs is None:
        _require(steps is not None, "train.max_steps=null needs train.epochs (passes over the training windows) to "
                 "set the run's length: set train.max_steps=<steps> or train.epochs=<passes>")
        return
    _require(epochs > 0, f"train.epochs={epochs} must be > 0 (or null: train.max_steps sets the length)")
    _require(steps is None or steps == TrainConfig.max_steps,
             f"train.epochs={epochs} and train.max_steps={steps} both set the run's length (the epochs would replace "
             f"the steps): set train.max_steps=null to train {epochs} epoch{'s' * (epochs != 1)}, or train.epochs=null to "
             f"train {steps} step{'s' * (steps != 1)}")


def check_validation_split(d, t) -> None:
    """``train.eval_every > 0`` needs validation windows: ``data.valid_fraction`` holds them out (the last fraction
    of the windows, of each ``data.blend`` source, or of the ``objective=sft`` pairs; at least one when > 0). There
    is no other validation source, so ``data.valid_fraction=0`` would make every evaluation a silent no-op.

    Raises: DifflmError naming both keys and the two ways out.
    """
    _require(not (d.valid_fraction == 0 and t.eval_every > 0),
             f"data.valid_fraction=0 holds out no validation windows and train.eval_every={t.eval_every} evaluates on "
             "them: set train.eval_every=0 (no evaluation) or a positive data.valid_fraction (e.g. 0.05)")


PARALLEL_CHOICES = {
    "parallel.pp_schedule": ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"),
    "parallel.activation_checkpointing": ("none", "selective", "full"),
    "parallel.reduce_dtype": ("fp32", "bf16"),
    "parallel.grad_sync": ("last", "every"),
}


def check_parallel(cfg, world_size: int, device: torch.device):
    """The layout against the world size, the model, the data and the device, before any process group exists.

    Returns the resolved :class:`difflm.parallel.mesh.ParallelDims`. Each failure is one line naming the keys: what
    :func:`check_layout` checks on any machine, then what this ``device`` cannot run (the MoE expert kernels, TP
    communication overlap, CP's attention kernels, the TE kernels off CUDA).
    """
    from difflm.parallel.context_parallel import cp_unavailable_reason

    from difflm.model.auto_kernels import choose_kernels

    choose_kernels(cfg, device, world_size)  # a no-op after check_precision
    dims = check_layout(cfg, world_size)
    check_moe_kernels(cfg, dims, device)
    if cfg.parallel.get("tp_comm_overlap", False):
        check_tp_comm_overlap(cfg, dims, device)
    if dims.cp_enabled:
        reason = cp_unavailable_reason(cfg.model, device)
        _require(reason is None, reason or "")
    if dims.distributed:
        _require(cfg.model.backend == "torch" or device.type == "cuda", "model.backend=te needs CUDA")
    return dims


def check_layout(cfg, world_size: int):
    """The layout against the world size, the model and the data, whatever the machine (``difflm-train`` through
    :func:`check_parallel`; ``difflm-plan`` for the GPUs it plans): degrees vs world size; tp vs heads / KV heads /
    FFN / padded vocab (``model.vocab_multiple``); pp vs layers; sequence length vs cp and sequence-parallel tp;
    micro batch x accumulation x dp vs global batch; pipeline micro-batches vs stages; ep vs the experts and
    dp_shard (MoE); layouts no backend runs (fp16 loss scaling sharded, CP with MoE or bd3lm). The kernel keys
    (``model.backend``, ``model.fused_mlp``) are read as chosen: ``auto`` passes the checks of a concrete choice.

    Returns the resolved :class:`difflm.parallel.mesh.ParallelDims`.
    """
    from difflm.parallel.mesh import ParallelDims
    from difflm.parallel.parallelize import layout_length_multiple

    p, m, d = cfg.parallel, cfg.model, cfg.data
    for key, allowed in PARALLEL_CHOICES.items():
        value = _get(cfg, key)
        _require(value in allowed, f"{key}={value!r} is not one of: {', '.join(allowed)}")
    tp = int(p.tp)  # the model's side first: launching tp processes would not help a tp that cannot split it
    if tp > 1:
        for key in ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_multiple"):
            _require(m[key] % tp == 0, f"parallel.tp={tp} does not divide model.{key}={m[key]}: pick a tp that divides "
                     "the attention heads, KV heads, FFN width and the vocabulary padding (model.vocab_multiple)")
        moe = m.get("moe")
        _require(m.backend != "te" or moe is None or not moe.num_experts,
                 f"parallel.tp={tp} with model.backend=te and model.moe.num_experts={moe.num_experts if moe else 0}: "
                 "the TE kernels run MoE layers without tensor parallelism; use model.backend=torch (MoE layers "
                 "replicated over TP) or parallel.tp=1 with parallel.ep")
        _require(m.get("fused_mlp", False) is not True,
                 f"parallel.tp={tp} with model.fused_mlp=true: the fused MLP runs whole "
                 "on each rank; set model.fused_mlp=false (TE's LayerNormMLP splits it over TP) or parallel.tp=1")
        _require(not m.tie_embeddings, f"parallel.tp={tp} with model.tie_embeddings=true: under TP the LM head is "
                 "vocab-parallel with its own weight (output.weight); set model.tie_embeddings=false or parallel.tp=1")
    dims = ParallelDims.from_config(p, world_size)
    accum = check_batch(cfg, world_size)
    if dims.pp_enabled:
        virtual = 2 if p.pp_schedule == "ZBVZeroBubble" else int(p.pp_virtual_stages)
        _require(virtual >= 1, f"parallel.pp_virtual_stages={p.pp_virtual_stages} must be >= 1")
        per_rank = ("parallel.pp_schedule=ZBVZeroBubble's 2 stages per rank" if p.pp_schedule == "ZBVZeroBubble"
                    else f"parallel.pp_virtual_stages={virtual}")
        lower = "parallel.pp or the schedule" if p.pp_schedule == "ZBVZeroBubble" else \
            "parallel.pp or parallel.pp_virtual_stages"
        _require(dims.pp * virtual <= m.num_layers,
                 f"parallel.pp={dims.pp} x {per_rank} = {dims.pp * virtual} stages > model.num_layers={m.num_layers}: "
                 f"every pipeline stage needs at least one block; lower {lower}")
        single = p.pp_schedule in ("GPipe", "1F1B")
        _require(not single or virtual == 1, f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank and "
                 f"parallel.pp_virtual_stages={virtual}: set parallel.pp_virtual_stages=1, or an interleaved schedule "
                 "(Interleaved1F1B) for more")
        _require(accum >= dims.pp and accum % dims.pp == 0,
                 f"parallel.pp={dims.pp} needs a multiple of {dims.pp} micro-batches per step and train.global_batch_size="
                 f"{cfg.train.global_batch_size} / (train.micro_batch_size={cfg.train.micro_batch_size} x dp={dims.dp}) "
                 f"gives {accum}: lower train.micro_batch_size or raise train.global_batch_size")
        _require(not m.tie_embeddings, "parallel.pp>1 with model.tie_embeddings=true: the embedding (first stage) and "
                 "the LM head (last stage) live on different ranks; set model.tie_embeddings=false")
        _require(not dims.cp_enabled, f"parallel.pp={dims.pp} with parallel.cp={dims.cp} is not supported yet: "
                 "use one of them")
    _require(int(p.get("fsdp_prefetch", 0)) >= 0,
             f"parallel.fsdp_prefetch={p.get('fsdp_prefetch')} must be >= 0 (0: FSDP2's own prefetching)")
    multiple = layout_length_multiple(p, dims)
    cp_multiple = 2 * dims.cp if dims.cp_enabled else 1
    why = [f"2 x parallel.cp={dims.cp} for load-balanced context parallelism"] if dims.cp_enabled else []
    if multiple // cp_multiple > 1:
        why.append(f"parallel.tp={tp} with parallel.sequence_parallel=true")
    # without sequence parallelism only the CP factor is left: name that way out where it is enough
    sp_off = multiple // cp_multiple > 1 and d.seq_len % cp_multiple == 0
    _require(d.seq_len % multiple == 0,
             f"data.seq_len={d.seq_len} is not a multiple of {multiple} ({' x '.join(why)}): change data.seq_len"
             + (" or set parallel.sequence_parallel=false" if sp_off else ""))
    moe = m.get("moe")
    num_experts = moe.num_experts if moe is not None else 0
    if dims.ep_enabled:
        _require(num_experts > 0, f"parallel.ep={dims.ep} needs a mixture-of-experts model: set model.moe.num_experts "
                 "(e.g. model=moe-tiny) or parallel.ep=1")
        _require(num_experts % dims.ep == 0, f"parallel.ep={dims.ep} does not divide model.moe.num_experts="
                 f"{num_experts}: pick an ep that divides the number of experts")
    if num_experts > 0:
        _require(not dims.cp_enabled, f"parallel.cp={dims.cp} with model.moe.num_experts={num_experts} is not "
                 "supported yet (the router statistics would cover one sequence chunk): use parallel.cp=1 for MoE models")
    # what no device can run comes before what this device cannot
    _require(cfg.objective.name != "bd3lm" or not dims.cp_enabled,
             f"objective=bd3lm with parallel.cp={dims.cp}: context parallelism splits the sequence for unmasked "
             "attention only; use parallel.cp=1 (or objective=mdlm)")
    if dims.distributed:
        _require(cfg.precision.name != "fp16", "precision=fp16 (loss scaling) is single-process only: use "
                 "precision=bf16 with parallel layouts")
        per_sample = d.get("intra_document_attention", False)
        _require(not per_sample or not (dims.pp_enabled or dims.cp_enabled),
                 "data.intra_document_attention=true gives every sample its own attention mask, which pipeline and "
                 "context-parallel layouts cannot carry: set it to false, or parallel.pp=1 and parallel.cp=1")
    return dims


def check_tp_comm_overlap(cfg, dims, device: torch.device) -> None:
    """What ``parallel.tp_comm_overlap=true`` needs (docs/parallel.md "TP communication overlap"): sequence-parallel
    TP on CUDA; TE userbuffers with fixed token counts; torch async TP with compiled blocks."""
    p, m = cfg.parallel, cfg.model
    _require(dims.tp_enabled and p.sequence_parallel,
             f"parallel.tp_comm_overlap=true overlaps the all-gather / reduce-scatter of sequence-parallel TP and this "
             f"layout has parallel.tp={dims.tp}, parallel.sequence_parallel={p.sequence_parallel}: use tp > 1 with "
             "sequence_parallel=true, or parallel.tp_comm_overlap=false")
    _require(device.type == "cuda", "parallel.tp_comm_overlap=true needs CUDA (TE userbuffers / symmetric memory): "
             "set parallel.tp_comm_overlap=false on this machine")
    if m.backend == "te":
        _require(cfg.objective.random_length_prob == 0,
                 f"parallel.tp_comm_overlap=true with model.backend=te allocates userbuffers for data.seq_len x "
                 f"train.micro_batch_size tokens and objective.random_length_prob={cfg.objective.random_length_prob} "
                 "changes the length: set objective.random_length_prob=0")
    else:
        _require(bool(p.compile or m.get("compile", False)),
                 "parallel.tp_comm_overlap=true with model.backend=torch is Inductor's async TP, which rewrites "
                 "compiled blocks: set parallel.compile=true (or model.compile=true)")


def check_operations(cfg) -> None:
    """The long-run settings take 0 for "off" and refuse negative values (which had passed silently: a negative
    ``train.keep_last`` kept everything, a negative ``train.time_limit`` never stopped). ``train.spike_threshold`` is
    0 (off) or a factor above 1: at or below 1 an ordinary step counts as a spike, and each one rolls the run back
    and skips its data.

    Raises: DifflmError naming the key and the values it takes.
    """
    t = cfg.train
    for key, meaning in (("keep_last", "checkpoints kept, 0 = all"), ("keep_every", "steps, 0 = none kept for good"),
                         ("time_limit", "seconds, 0 = none"), ("step_timeout", "seconds, 0 = off")):
        _require(t[key] >= 0, f"train.{key}={t[key]} must be >= 0 ({meaning})")
    _require(cfg.logger.num_samples >= 0, f"logger.num_samples={cfg.logger.num_samples} must be >= 0 (0 = none)")
    _require(t.spike_threshold == 0 or t.spike_threshold > 1,
             f"train.spike_threshold={t.spike_threshold} must be 0 (off) or a factor above 1 of the running mean loss "
             "(e.g. 2.0): at or below 1 ordinary steps count as spikes, each rolling the run back")


def check_run(cfg, world_size: int = 1) -> torch.device:
    """All checks of a training run (``world_size`` processes); returns the device to train on."""
    check_choices(cfg)
    check_model(cfg.model)
    device = resolve_device(cfg.device)
    check_precision(cfg, device)
    check_length(cfg.train)
    from difflm.training.auto_batch import choose_micro_batch

    choose_micro_batch(cfg, device, world_size)  # train.micro_batch_size=auto: a number before the batch checks
    dims = check_parallel(cfg, world_size, device)
    check_settings(cfg, dims)
    check_cuda_graphs(cfg, world_size, device)
    check_end_samples(cfg)
    check_logger(cfg.logger)
    return device


def check_config(cfg, world_size: int = 1) -> None:
    """The checks of :func:`check_run` that the config alone decides, for a run of ``world_size`` processes that
    starts on another machine (a job of a ``-m`` sweep under ``hydra/launcher=slurm``: its devices, installed kernels
    and network are not this machine's): the enumerated keys, the model, the run's length, the layout against the
    model, batch and data (:func:`check_layout`, with ``model.*=auto`` kernels as any concrete choice; with
    ``train.micro_batch_size=auto`` only the degrees against ``world_size``, the size being chosen on the run's
    device), then :func:`check_settings` and the settings of the samples drawn after training.

    Raises: DifflmError naming the keys and the fix, as :func:`check_run` would at the run's start."""
    from difflm.parallel.mesh import ParallelDims
    from difflm.training.auto_batch import is_auto

    check_choices(cfg)
    check_model(cfg.model, installed=False)
    check_precision_keys(cfg)
    check_length(cfg.train)
    dims = ParallelDims.from_config(cfg.parallel, world_size) if is_auto(cfg) else check_layout(cfg, world_size)
    check_settings(cfg, dims)
    check_end_samples(cfg)


def check_settings(cfg, dims) -> None:
    """The checks of a training run that need neither its device nor its model built: ``lora.*`` against the model
    and the layout ``dims`` (:class:`difflm.parallel.mesh.ParallelDims`), the corpus and the data keys, the long-run
    settings, the objective, optimizer, schedule and profiler keys, and the adaptation options. Part of
    :func:`check_run` and :func:`check_config`. Raises: DifflmError naming the keys and the fix."""
    if cfg.get("lora") is not None:  # lora.*: the keys, the model and the layout (difflm.model.lora)
        from difflm.model.lora import check_lora, check_lora_layout

        check_lora(cfg.lora, cfg.model)
        check_lora_layout(cfg.lora, dims, cfg.model)
        _require(not (int(cfg.lora.rank) > 0 and cfg.train.cuda_graphs),
                 f"train.cuda_graphs=true with LoRA adapters (lora.rank {cfg.lora.rank}): the captured blocks are not "
                 "built for adapters; set train.cuda_graphs=false")
    d, o, t = cfg.data, cfg.objective, cfg.train
    _require(bool(d.path or d.hf_dataset or d.get("blend")),
             "data.path is not set (this experiment leaves the corpus to you): pass data.path=<.txt/.jsonl/.parquet "
             "file, directory, glob or difflm-preprocess shards>, data.hf_dataset=<name or save_to_disk directory> or "
             "data.blend=[...]")
    from difflm.config import asset_path
    from difflm.config.schema import EMBEDDED_CORPUS

    # data.path's default is the embedded corpus, which a run with another source replaces; a path given beside
    # data.hf_dataset or data.blend would be dropped without a word (SFT pairs: check_objective_data names the key)
    sft_data = d.get("prompt_field") is not None or d.get("messages_field") is not None
    sources = [name for name, given in (("data.path", d.path and d.path != asset_path(EMBEDDED_CORPUS)),
                                        ("data.hf_dataset", d.hf_dataset), ("data.blend", d.get("blend"))) if given]
    _require(sft_data or len(sources) <= 1,
             f"{' and '.join(sources)} both name the training corpus, and a run reads only one: keep one "
             "(data.path=null, data.hf_dataset=null or data.blend=[] drops the others)")
    from difflm.objectives.keyed_rng import check_seed

    check_seed(t.seed, "train.seed")
    _require(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be at least 2")
    _require(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    for key in ("eval_every", "save_every"):
        _require(t[key] >= 0, f"train.{key}={t[key]} must be >= 0 (0 = never)")
    check_operations(cfg)
    check_logger_keys(cfg.logger)
    check_validation_split(d, t)
    _require(0.0 < o.eps < 1.0, f"objective.eps={o.eps} must be in (0, 1)")
    _require(0.0 <= o.random_length_prob <= 1.0, f"objective.random_length_prob={o.random_length_prob} must be in [0, 1]")
    _require(o.length_multiple >= 1, f"objective.length_multiple={o.length_multiple} must be >= 1")
    _require(d.seq_len % o.length_multiple == 0,
             f"objective.length_multiple={o.length_multiple} does not divide data.seq_len={d.seq_len}")
    _require(cfg.logger.log_every >= 1, f"logger.log_every={cfg.logger.log_every} must be >= 1 (steps between "
             "metrics rows; evaluation steps and the last step always write one)")
    _require(t.max_skipped_steps >= 1, f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1 (non-finite steps "
             "in a row before the run saves and stops)")
    _require(t.eval_mc_samples >= 1, f"train.eval_mc_samples={t.eval_mc_samples} must be >= 1")
    _require(t.get("eval_windows") is None or t.eval_windows >= 1, f"train.eval_windows={t.eval_windows} must be >= 1 (train.eval_every=0 turns "
             "evaluation off)")
    _require(t.get("eval_batches") is None,
             f"train.eval_batches was removed (it counted micro-batches, so val_nelbo changed with "
             f"train.micro_batch_size): set train.eval_windows={(t.get('eval_batches') or 0) * t.micro_batch_size} "
             f"instead (the same windows at this micro-batch size)")
    _require(d.get("max_train_tokens") is None or d.max_train_tokens >= d.seq_len,
             f"data.max_train_tokens={d.get('max_train_tokens')} must be at least one window (data.seq_len="
             f"{d.seq_len}) or null")
    _require(not (d.get("blend") and d.get("max_train_tokens") is not None),
             "data.max_train_tokens is not supported with data.blend: set data.max_train_tokens=null")
    _require(not (sft_data and d.get("max_train_tokens") is not None),
             "data.max_train_tokens is not supported with objective=sft (data.prompt_field): every pair is a window "
             "of its own, so cut the pairs file instead and set data.max_train_tokens=null")
    if d.get("blend"):  # each entry's path, weight and name, before the device and the data
        from difflm.config.schema import blend_entries

        blend_entries(d.blend)
    _require(not (d.get("blend") and sft_data),
             "data.blend is not supported with objective=sft (data.prompt_field): give the pairs in data.path")
    from difflm.data.documents import check_doc_separator, check_encoding

    if d.get("encoding"):
        check_encoding(d.encoding)
    check_doc_separator(d.get("doc_separator"))
    check_optim(cfg.optim)
    check_schedule(cfg.schedule)
    if cfg.profile.enabled:
        check_profile(cfg.profile, t)
    _require(0 <= cfg.logger.sample_temperature < float("inf"),
             f"logger.sample_temperature={cfg.logger.sample_temperature} must be >= 0 and finite (0 = greedy)")
    check_objective_data(cfg)
    check_adaptation(cfg)


WANDB_PROJECT_CHARS = "/\\#?%:"  # what W&B refuses in a project name (wandb.sdk.wandb_settings), besides > 128


def check_logger_keys(lg) -> None:
    """``logger.project`` under ``logger=wandb``: a name W&B takes (at most 128 characters, none of ``/ \\ # ? % :``),
    checked before the model is built rather than by ``wandb.init`` after it; not empty (``logger.project=$PROJECT``
    with the variable unset), which W&B files under its "Uncategorized" project instead of the one meant.

    Raises: DifflmError naming the key, what W&B refuses and the fix."""
    if lg.name != "wandb" or lg.mode == "disabled" or lg.project is None:
        return
    _require(str(lg.project).strip() != "", f"logger.project={lg.project!r} is empty: W&B would file the run under "
             "\"Uncategorized\"; name the project (default logger.project=difflm)")
    bad = "".join(sorted(set(str(lg.project)) & set(WANDB_PROJECT_CHARS)))
    _require(not bad, f"logger.project={lg.project!r} holds {' '.join(bad)}, which W&B refuses in a project name "
             f"(any of {' '.join(WANDB_PROJECT_CHARS)}): name the team with logger.entity and the project alone, e.g. "
             f"logger.project={str(lg.project).replace('/', '-').replace(':', '-')}")
    _require(len(str(lg.project)) <= 128, f"logger.project has {len(str(lg.project))} characters, more than the 128 "
             "W&B takes in a project name: give a shorter one")


def check_logger(lg) -> None:
    """``logger=wandb`` needs wandb importable and, online with an API key, its server reachable from the process that
    logs (rank 0): checked here so the run stops in seconds before the model is built, not in ``fit()`` after it
    (where ``wandb.init`` waits 90 s first).

    Raises: DifflmError naming the package to install, or ``logger.mode=offline`` as the way out."""
    if lg.name != "wandb" or lg.mode == "disabled":
        return
    from difflm.training.sinks import WANDB_MISSING, wandb_unreachable_reason

    if importlib.util.find_spec("wandb") is None:
        raise DifflmError(WANDB_MISSING)
    from difflm.parallel.distributed import launch_env

    why = wandb_unreachable_reason(lg) if launch_env()["rank"] == 0 else None
    if why:
        raise DifflmError(why)


def draws_samples(cfg) -> bool:
    """Whether the trainer samples with ``gen.*``: ``logger.num_samples > 0`` and ``train.sample_at_end``, or W&B's
    samples at each evaluation (``logger.name=wandb``, ``train.eval_every > 0``)."""
    t, lg = cfg.train, cfg.logger
    return lg.num_samples > 0 and bool(t.sample_at_end or (lg.name == "wandb" and t.eval_every > 0))


def check_end_samples(cfg) -> None:
    """The ``gen.*`` settings a run samples with (:func:`draws_samples`), checked before training rather than after
    it: the sampler's value ranges, for the LLaDA sampler (every diffusion objective but ``bd3lm``, which samples
    block by block) the block and step counts, for ``ar`` runs that no diffusion-only key is set (left-to-right
    decoding would ignore it), and no setting the others leave unread
    (:func:`difflm.sampling.options.check_read_settings`): ReMDM's ``gen.remdm_sigma`` / ``gen.remdm_schedule``
    without ``gen.remasking=remdm``, and ``gen.top_k`` / ``gen.top_p`` when every sample is greedy
    (``gen.temperature=0`` with one sample, or ``logger.sample_temperature=0``: samples after the first draw at
    ``logger.sample_temperature``, where the filters apply). The schema's defaults pass.

    Raises: DifflmError with the sampler's message (naming the key and a consistent setting) and the way out."""
    if not draws_samples(cfg):
        return
    from difflm.sampling.diffusion import check_generation_config
    from difflm.sampling.options import GenerationConfigError

    greedy = cfg.logger.num_samples == 1 or cfg.logger.sample_temperature == 0
    judged = ("remdm_sigma", "remdm_schedule") + (("top_k", "top_p") if greedy else ())
    try:
        check_generation_config(cfg.gen, cfg.objective, judged)
    except GenerationConfigError as err:
        raise DifflmError(f"{err} (this run samples with gen.* after training, logger.num_samples="
                          f"{cfg.logger.num_samples}: fix gen.* or set logger.num_samples=0)") from None


def check_optim(o) -> None:
    """``optim.*`` within the ranges ``torch.optim.AdamW`` accepts (its own checks raise only once the model is built
    and the run has started), and a weight decay that decays. Raises DifflmError naming the key."""
    _require(o.lr > 0, f"optim.lr={o.lr} must be positive")
    for key in ("beta1", "beta2"):
        _require(0 <= o[key] < 1, f"optim.{key}={o[key]} must be in [0, 1): AdamW's moment decay (e.g. beta1=0.9, "
                                  "beta2=0.95)")
    _require(o.eps >= 0, f"optim.eps={o.eps} must be >= 0 (AdamW's denominator term, e.g. 1e-8)")
    _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0 (0 = no decay)")


def check_schedule(s) -> None:
    """``schedule.*`` in range: a warmup of >= 0 steps, and fractions of ``optim.lr`` / of the run in [0, 1]
    (a min_lr_ratio above 1 would make the decay climb; a negative warmup would start part-way down the decay)."""
    _require(s.warmup_steps >= 0, f"schedule.warmup_steps={s.warmup_steps} must be >= 0 (0 = no warmup)")
    _require(0.0 <= s.min_lr_ratio <= 1.0, f"schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1] (the final "
             "learning rate as a fraction of optim.lr)")
    _require(0.0 <= s.decay_fraction <= 1.0, f"schedule.decay_fraction={s.decay_fraction} must be in [0, 1] (wsd: "
             "the last fraction of the steps that decays)")


def check_profile(p, t) -> None:
    """``profile.*`` when ``profile.enabled``: a schedule torch.profiler accepts, whose window ends within the run
    (``train.max_steps``, unless ``train.epochs`` sets the length later), so that a trace is written."""
    for key, low, meaning in (("wait", 0, "steps skipped first"), ("warmup", 0, "steps traced and discarded"),
                              ("active", 1, "the steps recorded")):
        _require(p[key] >= low, f"profile.{key}={p[key]} must be >= {low} ({meaning})")
    window = p.wait + p.warmup + p.active
    _require(t.get("epochs") is not None or window <= t.max_steps,
             f"profile.wait + profile.warmup + profile.active = {window} steps, more than train.max_steps="
             f"{t.max_steps}: no trace would be written; lower profile.wait (or warmup, active) or raise "
             "train.max_steps")


def check_cuda_graphs(cfg, world_size: int, device: torch.device) -> None:
    """``train.cuda_graphs=true``: a run whose blocks can be captured
    (:func:`difflm.training.cuda_graphs.cuda_graphs_unavailable_reason`)."""
    if cfg.train.cuda_graphs:
        from difflm.training.cuda_graphs import cuda_graphs_unavailable_reason

        reason = cuda_graphs_unavailable_reason(cfg, world_size, device)
        if reason is not None:
            raise DifflmError(reason)


def check_objective_data(cfg) -> None:
    """What the diffusion objectives need from the data and the attention backend."""
    d, o, m = cfg.data, cfg.objective, cfg.model
    if o.name == "bd3lm":
        _require(o.block_size >= 1, f"objective.block_size={o.block_size} must be >= 1")
        _require(d.seq_len % o.block_size == 0,
                 f"objective.block_size={o.block_size} does not divide data.seq_len={d.seq_len}")
        _require(o.random_length_prob == 0 or o.length_multiple % o.block_size == 0,
                 f"objective.random_length_prob={o.random_length_prob} draws lengths of multiples of "
                 f"objective.length_multiple={o.length_multiple}, which is not a multiple of objective.block_size="
                 f"{o.block_size}: set objective.length_multiple to a multiple of the block size or "
                 "objective.random_length_prob=0")
    if o.name == "sft":
        _require(d.get("prompt_field") is not None or d.get("messages_field") is not None,
                 "objective=sft trains on prompt/response pairs: set data.prompt_field and data.response_field "
                 "(a .jsonl file), or data.messages_field for multi-turn conversations")
        _require(d.get("prompt_field") is None or d.get("messages_field") is None,
                 f"data.prompt_field={d.get('prompt_field')!r} and data.messages_field={d.get('messages_field')!r} "
                 "name two kinds of SFT data: set one of them to null")
        _require(o.random_length_prob == 0, f"objective.random_length_prob={o.random_length_prob} would cut responses: "
                 "set it to 0 for objective=sft")
        _require(d.get("hf_dataset") is None,
                 f"data.hf_dataset={d.get('hf_dataset')!r}: objective=sft reads prompt/response pairs from the .jsonl "
                 "files of data.path: set data.path and data.hf_dataset=null")
        _require(bool(d.path), f"data.path={d.path!r}: objective=sft reads prompt/response pairs from the .jsonl files "
                 "of data.path: set data.path")
        kind = next((e for e in (".txt", ".parquet") if str(d.path).lower().endswith(e)), None)
        _require(kind is None, f"data.path={d.path!r} is a {kind} file: objective=sft trains on prompt/response pairs, "
                 f"one JSON record a line with the fields data.prompt_field / data.response_field: set data.path to "
                 "such a .jsonl file (plain text trains with objective=mdlm)")
    elif d.get("messages_field") is not None:
        raise DifflmError(f"data.messages_field={d.messages_field!r} makes conversation data, which only objective=sft "
                          "uses: set objective=sft or data.messages_field=null")
    elif d.get("prompt_field") is not None:
        raise DifflmError(f"data.prompt_field={d.prompt_field!r} makes prompt/response data, which only objective=sft "
                          "uses: set objective=sft or data.prompt_field=null")
    if m.get("shift_logits", False):  # the same refusal as difflm-import's
        _require(o.name != "ar", "model.shift_logits=true is for masked diffusion from an AR model (Dream): "
                 "objective=ar already predicts the next token; drop model.shift_logits or use objective=mdlm")
        _require(o.name != "bd3lm", "model.shift_logits=true with objective=bd3lm would read a block's first logits "
                 "from the previous block's noisy half: drop model.shift_logits or use objective=mdlm or sft")
    from difflm.model.attention import CAPABILITIES, refuse

    clean = o.get("clean_attention", "block_causal")
    _require(clean in ("block_causal", "causal"), f"objective.clean_attention={clean!r} is not one of: block_causal, "
             "causal")
    _require(clean == "block_causal" or o.name == "bd3lm", f"objective.clean_attention=causal sets how the clean half "
             f"of bd3lm's [x_t ; x_0] attends (this run is objective={o.name}, which has no clean half): drop it")
    if o.name == "bd3lm" and not CAPABILITIES[m.attention_backend].block_diffusion:
        raise refuse(m.attention_backend, "block_diffusion")
    if d.get("intra_document_attention", False) and not CAPABILITIES[m.attention_backend].documents:
        raise refuse(m.attention_backend, "documents")
    _require(not (d.get("intra_document_attention", False) and o.name == "sft" and not d.get("sft_packing", False)),
             "data.intra_document_attention=true with objective=sft applies to packed pairs: add data.sft_packing=true "
             "or drop it")
    _require(not d.get("sft_packing", False) or o.name == "sft",
             f"data.sft_packing=true packs prompt/response pairs, which only objective=sft uses (this run is "
             f"objective={o.name}): drop it")


def check_adaptation(cfg) -> None:
    """The AR-to-diffusion adaptation options (``objective.attention_anneal_steps``, ``block_schedule``,
    ``complementary_masks``, ``weighting``, ``ar_loss_weight``, ``t_lo`` / ``t_hi``; docs/adaptation.md): each is
    refused in one line under an objective, layout or kernel it does not fit."""
    from difflm.model.attention import CAPABILITIES, refuse
    from difflm.objectives.adaptation import adapts
    from difflm.objectives.block_schedule import check_block_schedule

    d, o, m, p = cfg.data, cfg.objective, cfg.model, cfg.parallel
    _require(o.get("weighting", "nelbo") in ("nelbo", "cart"),
             f"objective.weighting={o.get('weighting')!r} is not one of: nelbo, cart")
    if not adapts(o):
        return
    _require(o.name != "ar", "objective.attention_anneal_steps, block_schedule, complementary_masks, weighting, "
             "ar_loss_weight, diffusion_loss_weight, t_lo and t_hi adapt an AR model to diffusion: use objective=mdlm, "
             "sft or bd3lm (objective=ar takes none of them)")
    for key in ("t_lo", "t_hi"):  # each key's own range first: a message names only the keys whose values are wrong
        _require(0.0 <= o[key] <= 1.0, f"objective.{key}={o[key]} must be in [0, 1] (t ~ U(t_lo, t_hi))")
    _require(o.t_lo < o.t_hi, f"objective.t_lo={o.t_lo}, objective.t_hi={o.t_hi}: need 0 <= t_lo < t_hi <= 1 "
             "(t ~ U(t_lo, t_hi))")
    for key in ("diffusion_loss_weight", "ar_loss_weight"):
        _require(o[key] >= 0, f"objective.{key}={o[key]} must be >= 0 (0 = no such term)")
    _require(o.diffusion_loss_weight + o.ar_loss_weight > 0,
             f"objective.diffusion_loss_weight={o.diffusion_loss_weight} and objective.ar_loss_weight="
             f"{o.ar_loss_weight} are both 0, which leaves no loss: make one of them positive")
    if o.attention_anneal_steps:
        _require(o.attention_anneal_steps > 0, f"objective.attention_anneal_steps={o.attention_anneal_steps} must be "
                 ">= 0 (0 = no annealing)")
        _require(o.name != "bd3lm", "objective.attention_anneal_steps is for full-sequence diffusion (mdlm, sft): "
                 "bd3lm's block-causal mask already grows from AR; use objective.block_schedule instead")
        _require(not d.get("intra_document_attention", False), "objective.attention_anneal_steps with "
                 "data.intra_document_attention=true is not supported: set data.intra_document_attention=false")
        if not CAPABILITIES[m.attention_backend].dense_mask:
            raise refuse(m.attention_backend, "dense_mask")
        _require(p.pp == 1, "objective.attention_anneal_steps needs parallel.pp=1 (a per-step mask cannot reach "
                 "later pipeline stages)")
        _require(not cfg.train.get("cuda_graphs", False), "objective.attention_anneal_steps changes the attention "
                 "mask every step: set train.cuda_graphs=false")
    if o.get("block_schedule"):
        _require(o.name == "bd3lm", f"objective.block_schedule sets bd3lm's block size per phase (this run is "
                 f"objective={o.name}): use objective=bd3lm or drop it")
        check_block_schedule(o.block_schedule, d.seq_len)
        _require(int(o.block_schedule[-1][1]) == o.block_size, f"objective.block_schedule ends at block size "
                 f"{o.block_schedule[-1][1]} but objective.block_size={o.block_size} (what evaluation and sampling "
                 f"use): make the last phase's block size objective.block_size")
        _require(o.random_length_prob == 0, "objective.block_schedule needs objective.random_length_prob=0 (every "
                 "block size must divide the step's length)")
    if o.complementary_masks:
        _require(o.schedule == "linear", f"objective.complementary_masks weights ~M by 1/(1 - p), the linear "
                 f"schedule's NELBO weight (this run has objective.schedule={o.schedule}): set objective.schedule=linear")
        _require(p.pp == 1, "objective.complementary_masks doubles a micro-batch's rows: set parallel.pp=1")
    if o.weighting == "cart":
        _require(o.name != "bd3lm", "objective.weighting=cart is Dream's weighting for full-sequence diffusion "
                 "(mdlm, sft): use objective.weighting=nelbo with objective=bd3lm")
        _require(0.0 < o.cart_p <= 1.0, f"objective.cart_p={o.cart_p} must be in (0, 1]")
    if o.ar_loss_weight > 0:
        _require(o.name in ("mdlm", "bd3lm"), f"objective.ar_loss_weight adds next-token CE on clean pre-training "
                 f"windows (objective=mdlm or bd3lm; this run is objective={o.name}): set it to 0")
        _require(p.pp == 1, "objective.ar_loss_weight needs parallel.pp=1 (its AR term is a second forward, or "
                 "next-token targets on bd3lm's clean half, which pipeline stages do not carry)")
        _require(not m.get("shift_logits", False), "objective.ar_loss_weight with model.shift_logits=true would read "
                 "the next token's logits one position late on the clean copy: drop one of them")
        _require(o.random_length_prob == 0, "objective.ar_loss_weight needs equal-length windows: set "
                 "objective.random_length_prob=0")
        if not CAPABILITIES[m.attention_backend].documents:
            raise refuse(m.attention_backend, "documents")
