"""Candidate layouts for a GPU count, and the ranking of those that fit.

The search space: ``tp`` in powers of two dividing both head counts and at most a node; ``pp`` in powers of two up
to the layer count; ``cp`` in {1, 2, 4} for sequences of 4,096 tokens and more (each rank keeps at least 1,024);
``ep`` in powers of two dividing the expert count and the shard group (MoE only); the data-parallel ranks left either
all sharded (FSDP2), all replicated (DDP) or sharded inside a node and replicated across (HSDP); every micro-batch
size that divides the per-rank batch (at most 16); activation checkpointing none, selective or full. A candidate fits
when its planned peak leaves the calibration's ``reserve_gib`` of the GPU free.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from difflm.plan.activations import KernelSet, kernel_set
from difflm.plan.memory import Layout, MemoryPlan, plan_memory, stage_params
from difflm.plan.rates import Rates
from difflm.plan.step_time import StepPlan, plan_step


@dataclass
class Candidate:
    """A layout with its plans."""

    layout: Layout
    n_micro: int
    memory: MemoryPlan
    step: StepPlan


def _pow2(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def data_layouts(dp: int, per_node: int) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) splits of ``dp`` ranks: FSDP, DDP and, when ``dp`` spans nodes, HSDP."""
    out = {(1, dp), (dp, 1)}
    if per_node > 1 and dp > per_node and dp % per_node == 0:
        out.add((dp // per_node, per_node))
    return sorted(out)


def kernel_key(layout: Layout) -> tuple:
    """What ``model.*=auto``'s choice (:func:`difflm.model.auto_kernels.choose_kernels`) reads of a layout: the TP and
    CP degrees, sequence parallelism, and whether gradients are sharded over data-parallel ranks or cut into pipeline
    stages (the MoE experts' fused kernels need neither)."""
    return layout.tp, layout.cp, layout.sequence_parallel, layout.dp > 1, layout.pp > 1


def runnable(cfg, gpus: int, layout: Layout, _runs: Optional[dict] = None) -> bool:
    """Whether ``difflm-train`` takes the run ``cfg`` under ``layout`` on ``gpus`` ranks (:func:`refusal` is None)."""
    return refusal(cfg, gpus, layout, _runs) is None


def refusal(cfg, gpus: int, layout: Layout, _runs: Optional[dict] = None) -> Optional[str]:
    """``difflm-train``'s one-line refusal of the run ``cfg`` under ``layout`` on ``gpus`` ranks, or None when it
    takes it (:func:`difflm.config.validate.check_layout` and the MoE expert kernels' needs, with ``model.*=auto``
    chosen as on the GPU planned for). ``_runs``: a cache of the config copies by :func:`kernel_key`, what the kernel
    choice reads of the layout."""
    import torch

    from difflm.config.validate import check_layout, check_moe_kernels
    from difflm.errors import DifflmError
    from difflm.model.auto_kernels import FULL_INSTALL, choose_kernels

    runs = {} if _runs is None else _runs
    key = kernel_key(layout)
    if key not in runs:
        run = cfg.copy()
        p = run.parallel
        p.tp, p.pp, p.cp = layout.tp, layout.pp, layout.cp
        p.dp_replicate, p.dp_shard = layout.dp_replicate, layout.dp_shard
        choose_kernels(run, torch.device("cuda"), gpus, installed=FULL_INSTALL)
        runs[key] = run
    run = runs[key]
    p = run.parallel
    p.tp, p.pp, p.cp, p.ep = layout.tp, layout.pp, layout.cp, layout.ep
    p.dp_replicate, p.dp_shard = layout.dp_replicate, layout.dp_shard
    p.activation_checkpointing, p.sequence_parallel = layout.activation_checkpointing, layout.sequence_parallel
    run.train.micro_batch_size = layout.micro_batch
    try:
        check_moe_kernels(run, check_layout(run, gpus), device=None)
    except DifflmError as err:
        return str(err)
    return None


def candidates(cfg, gpus: int, rates: Rates, refused: Optional[list] = None) -> list[Layout]:
    """Every layout of the search space (module docstring) for ``gpus`` ranks and the run ``cfg`` that
    ``difflm-train`` would run (:func:`refusal`). ``refused``: a list that receives (layout, refusal) of the others
    that split the heads and the batch."""
    m = cfg.model
    heads, kv = int(m.num_heads), int(m.num_kv_heads)
    seq = int(cfg.data.seq_len)
    gbs = int(cfg.train.global_batch_size)
    experts = int(m.moe.num_experts)
    out = []
    for tp in _pow2(min(rates.gpus_per_node, gpus)):
        if heads % tp or kv % tp:
            continue
        for pp in _pow2(min(int(m.num_layers), gpus // tp)):
            for cp in [c for c in (1, 2, 4) if c == 1 or (seq >= 4096 and seq // c >= 1024)]:
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if gbs % dp:
                    continue
                for rep, shard in data_layouts(dp, max(rates.gpus_per_node // (tp * cp), 1)):
                    eps = [e for e in _pow2(experts) if experts % e == 0 and (shard * cp) % e == 0] if experts else [1]
                    for ep in eps:
                        for mb in [b for b in _pow2(16) if (gbs // dp) % b == 0]:
                            for ac in ("none", "selective", "full"):
                                out.append(Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=rep, dp_shard=shard,
                                                  micro_batch=mb, activation_checkpointing=ac,
                                                  pp_schedule=str(cfg.parallel.pp_schedule),
                                                  pp_virtual_stages=int(cfg.parallel.pp_virtual_stages)))
    runs: dict = {}
    kept = []
    for lay in out:
        why = refusal(cfg, gpus, lay, runs)
        if why is None:
            kept.append(lay)
        elif refused is not None:
            refused.append((lay, why))
    return kept


def evaluate(cfg, params, num_params: int, layout: Layout, rates: Rates,
             kernels: Optional[KernelSet] = None) -> Candidate:
    """The memory and step plans of one layout; ``kernels``: the run's kernel set under it (default:
    :func:`difflm.plan.activations.kernel_set`)."""
    n_micro = int(cfg.train.global_batch_size) // (layout.dp * layout.micro_batch)
    kernels = kernels or kernel_set(cfg, layout)
    memory = plan_memory(cfg, params, layout, n_micro, rates.activation_scale, kernels)
    step = plan_step(cfg, num_params, layout, n_micro, rates, stage_params(params, layout, int(cfg.model.num_layers)),
                     kernels, params)
    return Candidate(layout, n_micro, memory, step)


def search(cfg, params, num_params: int, gpus: int, rates: Rates,
           refused: Optional[list] = None) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates that fit, ranked fastest first; all candidates, smallest peak first). ``refused``: as
    :func:`candidates`'."""
    budget = (rates.memory_gib - rates.reserve_gib) * 1024 ** 3
    sets: dict[tuple, KernelSet] = {}  # the kernel set depends on the layout through kernel_key only
    every = []
    for lay in candidates(cfg, gpus, rates, refused):
        key = kernel_key(lay)
        if key not in sets:
            sets[key] = kernel_set(cfg, lay)
        every.append(evaluate(cfg, params, num_params, lay, rates, sets[key]))
    fits = sorted((c for c in every if c.memory.total <= budget), key=lambda c: -c.step.tokens_per_s)
    return fits, sorted(every, key=lambda c: c.memory.total)


__all__ = ["Candidate", "candidates", "data_layouts", "evaluate", "kernel_key", "refusal", "runnable", "search",
           "replace"]
