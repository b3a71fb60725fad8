"""``parallelize``: apply a layout to a model (torchtitan's ``parallelize_llama`` + ``pipeline_llm``);
``build_parallel_model``: build on the meta device, lay out, materialise this rank's shards (what the trainer does).

Order, per model part: pipeline split -> expert parallel (MoE experts sharded over ep, all-to-all dispatch) ->
tensor/sequence parallel (DTensor; the TE backend does TP inside its modules) -> activation checkpointing ->
per-block ``torch.compile`` -> FSDP2 (routed experts over efsdp, the rest over dp_shard x cp). The model
itself never knows its layout (docs/DESIGN.md).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from difflm.parallel.expert_parallel import apply_expert_parallel, expert_fsdp_mesh, expert_mesh, expert_param_mesh
from difflm.parallel.fsdp import apply_activation_checkpointing, apply_compile, apply_fsdp, fsdp_mesh
from difflm.parallel.mesh import ParallelDims
from difflm.parallel.pipeline import Pipeline, build_stage_models, loss_fns
from difflm.parallel.tensor_parallel import apply_tensor_parallel

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # parallel.reduce_dtype


def sequence_parallel_enabled(p, dims: ParallelDims) -> bool:
    """Sequence parallelism is on when ``parallel.sequence_parallel`` and tp > 1."""
    return bool(p.sequence_parallel) and dims.tp_enabled


def layout_length_multiple(p, dims: ParallelDims) -> int:
    """What every sequence length must be a multiple of under this layout: ``2 cp`` (load-balanced CP chunks)
    times ``tp`` with sequence parallelism; 1 otherwise."""
    m = 2 * dims.cp if dims.cp_enabled else 1
    return m * (dims.tp if sequence_parallel_enabled(p, dims) else 1)


def effective_length_multiple(cfg, dims: ParallelDims) -> int:
    """``objective.length_multiple`` raised to a multiple of :func:`layout_length_multiple` (their lcm), so random-
    length steps stay splittable by SP/CP without the user setting it."""
    return math.lcm(int(cfg.objective.length_multiple), layout_length_multiple(cfg.parallel, dims))


def parallelize(model: nn.Module, mesh, dims: ParallelDims, cfg, device: torch.device,
                n_microbatches: int) -> tuple[list[nn.Module], Optional[Pipeline]]:
    """Lay ``model`` out over ``mesh``: on the meta device (then :func:`difflm.parallel.materialize.materialize`
    allocates and initialises each rank's shards, as :func:`build_parallel_model` does), or built and initialised
    identically on every rank.

    Returns (model parts of this rank, pipeline or None). Without pipeline parallelism the one part is
    ``model`` itself (same parameter names); with it, this rank's stage modules.
    """
    p = cfg.parallel
    sp = sequence_parallel_enabled(p, dims)
    te = cfg.model.backend == "te"
    if dims.pp_enabled:
        parts, ids, num_stages = build_stage_models(model, mesh["pp"].get_local_rank(), dims.pp,
                                                    int(p.pp_virtual_stages), p.pp_schedule,
                                                    seq_shards=dims.tp if sp else 1)
    else:
        parts, ids, num_stages = [model], [0], 1
    param_dtype = torch.bfloat16 if cfg.precision.name in ("bf16", "fp8") else None
    emesh = expert_mesh(mesh, dims)
    reduce_dtype = REDUCE_DTYPES[p.get("reduce_dtype", "fp32")]
    if dims.tp_enabled and not te and p.get("tp_comm_overlap", False):
        enable_async_tensor_parallel()
    for part in parts:
        if emesh is not None:
            apply_expert_parallel(part, expert_param_mesh(emesh, dims), emesh["ep"].get_group())
        if dims.tp_enabled and not te:
            apply_tensor_parallel(part, mesh["tp"], sequence_parallel=sp)
        apply_activation_checkpointing(part, p.activation_checkpointing)
        if p.compile or cfg.model.get("compile", False):
            apply_compile(part)
        if dims.fsdp_enabled:
            apply_fsdp(part, fsdp_mesh(mesh, dims), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       reshard_after_forward=bool(p.get("reshard_after_forward", True)) and not dims.pp_enabled,
                       expert_mesh=expert_fsdp_mesh(emesh, dims) if emesh is not None else None,
                       prefetch=int(p.get("fsdp_prefetch", 0)))
    pipeline = None
    if dims.pp_enabled:
        vocab_group = mesh["tp"].get_group() if dims.tp_enabled else None
        train_loss, eval_loss = loss_fns(cfg.objective, vocab_group, cfg.model.fused_cross_entropy)
        from difflm.training.precision import compute_dtype

        pipeline = Pipeline(parts, ids, num_stages, mesh["pp"].get_group(), device, p.pp_schedule,
                            n_microbatches, train_loss, eval_loss,
                            activation_dtype=compute_dtype(cfg.precision) or torch.float32)
    return parts, pipeline


def build_parallel_model(cfg, mesh, dims: ParallelDims, device: torch.device, causal: bool,
                         n_microbatches: int) -> tuple[list[nn.Module], Optional[Pipeline], int, dict]:
    """This rank's part of the model of ``cfg`` under the layout ``dims``, without ever building the whole model:
    built on the meta device, laid out there (:func:`parallelize`), then only this rank's shards are allocated on
    ``device`` and initialised with the keyed init of ``train.seed`` (:func:`difflm.parallel.materialize.materialize`:
    the weights of one process, drawn at O(shard) cost).

    Returns (model parts, pipeline or None, the full model's parameter count without the input embedding (for MFU),
    the TE process-group arguments the kernels got (empty for the torch backend)).
    """
    from difflm.kernels.main_grad import accumulates_in_main_grad
    from difflm.model import build_model
    from difflm.model.lora import apply_lora, lora_enabled
    from difflm.parallel.materialize import materialize
    from difflm.parallel.mesh import te_process_groups

    model_cfg = cfg.model.copy()
    model_cfg.compile = False  # compiled per block after TP/AC, before FSDP (parallelize)
    te_groups = {}
    if cfg.model.backend == "te":
        te_groups = te_process_groups(mesh, dims, sequence_parallel_enabled(cfg.parallel, dims))
        if dims.tp_enabled and cfg.parallel.get("tp_comm_overlap", False):
            te_groups["ub_tokens"] = cfg.data.seq_len * cfg.train.micro_batch_size // dims.cp
        te_groups["fuse_wgrad_accumulation"] = accumulates_in_main_grad(cfg, sharded=dims.fsdp_enabled,
                                                                        pipelined=dims.pp_enabled)
    model = build_model(model_cfg, causal=causal, device=device, seed=cfg.train.seed, precision=cfg.precision,
                        meta=True, **te_groups)
    num_params = model.num_params()
    if lora_enabled(cfg.get("lora")):  # the converter, before the layout (materialize initialises the adapters)
        apply_lora(model, cfg.lora)
    parts, pipeline = parallelize(model, mesh, dims, cfg, device, n_microbatches)
    materialize(parts, device, cfg.model, cfg.train.seed)
    return parts, pipeline, num_params, te_groups


def enable_async_tensor_parallel() -> None:
    """Torch backend, ``parallel.tp_comm_overlap``: Inductor's micro-pipelined TP (async TP; torchtitan's
    ``maybe_enable_async_tp``) fuses the sequence-parallel all-gather + matmul and matmul + reduce-scatter of the
    compiled blocks into chunked, overlapped ops on symmetric memory. Needs compiled blocks and CUDA (checked by
    :func:`difflm.config.validate.check_parallel`). NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    unless set): symmetric memory then uses CUDA IPC peer access."""
    import os

    import torch._inductor.config as inductor_config

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    inductor_config._micro_pipeline_tp = True


def grad_norm_and_clip(parameters, max_norm: float, pp_group=None, tp_group=None,
                       tp_sharded: frozenset = frozenset()) -> torch.Tensor:
    """Global L2 norm of the gradients of a sharded model (:func:`global_grad_norm`), then clip them to ``max_norm``
    (inf: no clipping) in place (:func:`scale_grads_`). Returns the norm before clipping (a plain scalar tensor)."""
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, pp_group, tp_group=tp_group, tp_sharded=tp_sharded)
    coef = clip_coefficient(total, max_norm)
    if coef is not None:
        scale_grads_(params, coef)
    return total


def global_grad_norm(parameters, pp_group=None, tp_group=None, tp_sharded: frozenset = frozenset()) -> torch.Tensor:
    """Global L2 norm of the gradients of a sharded model: an FP32 scalar tensor on the gradients' device, the same on
    every rank (no host sync).

    Per-gradient norms are DTensor reductions (sharded grads sum their squares over the shard group,
    replicated ones count once), as torchtitan's ``clip_grad_norm_``; stages of a pipeline hold disjoint
    parameters, so their squared norms are summed over ``pp_group``. Gradients whose placement differs from
    their parameter's (partial sums of replicated parameters under sequence parallelism) are first
    redistributed to it (in place: ``p.grad`` is replaced). Plain tensors that are tensor-parallel shards (the TE
    backend's, ``id`` in ``tp_sharded``) have their squares summed over ``tp_group``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    squares, sharded_squares = [], []
    plain = {True: [], False: []}  # plain-tensor gradients by "TP-sharded": one multi-tensor norm per list
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor):
            plain[id(p) in tp_sharded].append(g.float())
            continue
        if isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g = g.redistribute(p.device_mesh, p.placements)
        (sharded_squares if id(p) in tp_sharded else squares).append(
            torch.linalg.vector_norm(g, 2.0).full_tensor().float() ** 2)
    for sharded, grads in plain.items():
        if grads:  # torch._foreach_norm: a few kernels for all of them, where one norm per tensor launches hundreds
            (sharded_squares if sharded else squares).append(torch.stack(torch._foreach_norm(grads, 2.0)).float()
                                                             .square().sum())
    device = params[0].grad.device if params else torch.device("cpu")
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if tp_group is not None and tp_sharded:
        sharded_sq = torch.stack(sharded_squares).sum() if sharded_squares else torch.zeros((), device=device)
        dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM, group=tp_group)
        total_sq = total_sq + sharded_sq
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return total_sq.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> Optional[torch.Tensor]:
    """The factor that clips gradients of global norm ``total_norm`` to ``max_norm``: ``min(1, max_norm / (norm +
    1e-6))``, torch's ``clip_grad_norm_`` (``torch.nn.utils.clip_grads_with_norm_``), as a scalar tensor (no host
    sync); None when ``max_norm`` is inf (no clipping)."""
    if not math.isfinite(max_norm):
        return None
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def scale_grads_(parameters, coef: torch.Tensor) -> None:
    """Multiply every gradient of ``parameters`` by the scalar tensor ``coef`` in place (multi-tensor kernels; plain
    tensors and DTensors in separate calls, as the foreach ops take them)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    for kind in (True, False):
        grads = [p.grad.to_local() if kind else p.grad for p in params if isinstance(p.grad, DTensor) == kind]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
