"""The parallel layout of a ``difflm-rl`` run (``parallel=``): which rank rolls out and trains on what.

Supported layouts, the mesh and the code of ``difflm-train`` (:mod:`difflm.parallel`):

* data parallel (``parallel=ddp|fsdp|hsdp``, FSDP2): the step's prompts (GRPO) or preference pairs (DPO) are
  split into contiguous, equal shares, one per data-parallel rank (:meth:`RLLayout.share`). A prompt's whole group
  of G completions stays on one rank, so group advantages need no communication. Each rank divides its loss by the
  step's global normaliser (tokens or sequences of every rank) and FSDP2 sums the gradients, so the update is the
  one process's. Metrics are summed over the data-parallel ranks (``all_reduce``; rewards are all-gathered for
  their std).
* tensor parallel (``parallel.tp``, DTensor, without sequence parallelism): the TP ranks of one data-parallel rank
  hold the same prompts and sample them with the same per-sample generators, so they draw the same completions;
  the vocab-parallel head returns full logits to the sampler and the estimators (:func:`full_logits`).

Rollouts call the model a number of times that can differ between data-parallel ranks (Fast-dLLM thresholds finish
a block when its rows are decoded), while every forward of an FSDP2 module is an all-gather that all ranks must
join. :func:`sampling_view` therefore all-gathers the parameters once before the rollouts and keeps them whole
until after them (``set_reshard_after_forward(False)`` then ``reshard``, FSDP2's own switch for evaluation): the
memory of the unsharded model during rollouts, no collective inside the sampler loop. The training forwards and
backwards run sharded as in ``difflm-train``.

Refused in one line: pipeline (``parallel.pp``) and context (``parallel.cp``) parallelism, expert parallelism
(``parallel.ep``), sequence parallelism (the sampler calls the model at lengths ``tp`` need not divide) and the
TE kernel set under TP (its TP groups are fixed when the model is built; difflm-rl builds it with load_run).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from omegaconf import OmegaConf

from difflm.errors import DifflmError
from difflm.parallel import distributed as pdist
from difflm.parallel.mesh import ParallelDims


@dataclass
class RLLayout:
    """This rank's place in the run's layout. ``mesh`` is None for one process; ``dp_group`` is None when there is
    one data-parallel rank (then every reduction is the identity)."""

    dims: ParallelDims
    mesh: object = None
    dp_rank: int = 0
    dp_group: object = None

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def share(self, n: int) -> slice:
        """This data-parallel rank's contiguous share of ``n`` items: ``ceil``-sized shares first (``np.array_split``
        order), so shares of a multiple of dp are equal."""
        base, extra = divmod(n, self.dp)
        start = self.dp_rank * base + min(self.dp_rank, extra)
        return slice(start, start + base + (self.dp_rank < extra))

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the data-parallel ranks (in place and returned)."""
        return pdist.all_reduce_sum(values, self.dp_group) if self.dp_group is not None else values

    def all_gather(self, values: torch.Tensor) -> torch.Tensor:
        """The data-parallel ranks' ``values`` [n, ...] (equal n on every rank) concatenated in rank order."""
        if self.dp_group is None:
            return values
        parts = [torch.empty_like(values) for _ in range(self.dp)]
        torch.distributed.all_gather(parts, values.contiguous(), group=self.dp_group)
        return torch.cat(parts)


def check_rl_layout(cfg, init_cfg, world_size: int) -> ParallelDims:
    """The ``parallel`` layout of a difflm-rl config against the world size, the trained run's model and the
    algorithm. Raises: DifflmError (one line naming the key and the fix)."""
    p, m = cfg.parallel, init_cfg.model
    dims = ParallelDims.from_config(p, world_size)
    for key in ("pp", "cp", "ep"):
        degree = getattr(dims, key)
        if degree > 1:
            raise DifflmError(f"parallel.{key}={degree}: difflm-rl runs under data parallelism (parallel=ddp|fsdp|hsdp)"
                              f" and tensor parallelism (parallel.tp); set parallel.{key}=1")
    if dims.tp_enabled:
        if bool(p.sequence_parallel):
            raise DifflmError(f"parallel.sequence_parallel=true with parallel.tp={dims.tp}: rollouts call the model at "
                              "lengths tp need not divide; set parallel.sequence_parallel=false")
        if m.backend == "te":
            raise DifflmError(f"parallel.tp={dims.tp} with the trained run's model.backend=te: difflm-rl lays TP out "
                              "with the torch kernels' DTensor plan; use parallel.tp=1 (data parallelism) for this run")
        for key in ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_multiple"):
            if m[key] % dims.tp:
                raise DifflmError(f"parallel.tp={dims.tp} does not divide model.{key}={m[key]} of the trained run: "
                                  "pick a tp that divides it")
        if m.tie_embeddings:
            raise DifflmError(f"parallel.tp={dims.tp} with the trained run's model.tie_embeddings=true: the vocab-"
                              "parallel head needs its own weight; use parallel.tp=1")
        from difflm.model.lora import check_lora_layout

        check_lora_layout(init_cfg.get("lora"), dims)
    k = cfg.algorithm.prompts_per_step
    if k % dims.dp:
        what = "prompt groups" if cfg.algorithm.name == "grpo" else "preference pairs"
        raise DifflmError(f"algorithm.prompts_per_step={k} does not split into equal shares of {what} over the "
                          f"{dims.dp} data-parallel ranks: set it to a multiple of {dims.dp}")
    if dims.distributed and init_cfg.precision.name == "fp16":
        raise DifflmError("the trained run's precision=fp16 is single-process only: run difflm-rl with parallel="
                          "single, or post-train a bf16 run")
    return dims


def build_layout(cfg, init_cfg, device: torch.device) -> tuple[RLLayout, torch.device]:
    """Check the layout (:func:`check_rl_layout`), create the process group and mesh when several processes run.
    Returns (layout, this rank's device)."""
    dims = check_rl_layout(cfg, init_cfg, pdist.world_size_from_env())
    if not dims.distributed:
        return RLLayout(dims), device
    from difflm.parallel.mesh import build_mesh

    device = pdist.init_distributed(device)
    mesh = build_mesh(dims, device.type)
    dp_mesh = mesh["dp"]
    return RLLayout(dims, mesh, dp_mesh.get_local_rank(), dp_mesh.get_group() if dims.dp > 1 else None), device


def lay_out(model: torch.nn.Module, layout: RLLayout, cfg, init_cfg, device: torch.device) -> torch.nn.Module:
    """``model`` (whole, the same weights on every rank) laid out over the mesh with difflm-train's
    :func:`difflm.parallel.parallelize.parallelize` (TP, activation checkpointing, compile, FSDP2); itself for
    one process."""
    if not layout.distributed:
        return model
    from difflm.parallel.parallelize import parallelize

    settings = OmegaConf.merge(init_cfg, {"parallel": OmegaConf.to_container(cfg.parallel)})
    parts, _ = parallelize(model, layout.mesh, layout.dims, settings, device, 1)
    return parts[0]


@contextlib.contextmanager
def full_logits(modules: Sequence[torch.nn.Module]):
    """Inside, ``modules`` return full-vocabulary logits (a vocab-parallel head under TP gathers its slices; its
    backward keeps this rank's slice): what the sampler and the estimators read. A no-op without TP."""
    from difflm.parallel.vocab_parallel import gather_logits

    with gather_logits(modules):
        yield


@contextlib.contextmanager
def sampling_view(modules: Sequence[torch.nn.Module], reshard_after_forward: bool = True):
    """Inside: the FSDP2 units of ``modules`` all-gathered once and kept whole (no collective per forward, so
    data-parallel ranks may call the models different numbers of times), and full logits (:func:`full_logits`).
    After: sharded again, with ``reshard_after_forward`` (the layout's ``parallel.reshard_after_forward``). Entering
    is collective over the FSDP2 ranks; modules without FSDP2 units only get full logits."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        with full_logits(modules):
            yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


__all__ = ["RLLayout", "build_layout", "check_rl_layout", "full_logits", "lay_out", "sampling_view"]
