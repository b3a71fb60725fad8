"""Tensor (+ sequence) parallelism of the Transformer Engine backend: what lives outside TE's modules.

TE splits its own GEMMs (``tp_group``/``parallel_mode``: column-parallel QKV and fc1, row-parallel proj and
fc2) and runs the all-gather / reduce-scatter around them, but each rank's parameters are plain local shards
and a few things are left to the framework, as Megatron-LM does them (Shoeybi et al. 2019, sec. 3;
Korthikanti et al. 2022, sec. 4.2.2):

* the sequence split of the residual stream at the sequence-parallel boundaries: :func:`scatter_sequence`
  after the embedding, :func:`gather_sequence` before the vocab-parallel LM head
  (:mod:`difflm.parallel.vocab_parallel`; its rows ``output.weight`` are split like TE's column-parallel weights);
* gradients that are partial sums over the TP ranks: the RMSNorm scales applied to a sequence shard
  (``layer_norm_weight``, ``final_norm.weight`` with sequence parallelism) and the QK-norm scales, which each
  rank applies to its own heads only; :func:`all_reduce_partial_grads` sums them, like Megatron-LM's
  ``finalize_model_grads`` for parameters marked ``sequence_parallel``;
* the global gradient norm (sharded parameters' squares summed over TP): :func:`difflm.parallel.parallelize.global_grad_norm`
  takes :func:`sharded_param_ids`;
* the same initial weights as one process (:class:`TensorParallelShards` draws the full tensor and keeps
  this rank's slice) and layout-independent checkpoints (:func:`full_tensor` / :func:`local_shard`).

Which parameters are split, and along which dimension, follows from TE's modules (their
``tensor_model_parallel``/``partition_dim`` attributes) and is written down by name in :data:`SHARD_DIM` so it
survives FSDP2 and wrappers. ``mlp.fc1_weight`` is ``[gate; up]`` in a single process and ``[gate_r; up_r]``
on TP rank r (TE's SwiGLU on the local half-split), so its shards are taken from the gate/up-interleaved
rows (:func:`difflm.parallel.tensor_parallel.interleave_gate_up`), the torch backend's convention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from difflm.parallel.tensor_parallel import _local, clean_fqn, deinterleave_gate_up, interleave_gate_up

SHARD_DIM = {  # parameter name suffix -> dimension split over TP ranks
    "attention.qkv.weight": 0,
    "attention.qkv.bias": 0,
    "attention.proj.weight": 1,
    "mlp.fc1_weight": 0,
    "mlp.fc2_weight": 1,
    "output.weight": 0,  # the vocab-parallel LM head (difflm.parallel.vocab_parallel)
}
GATE_UP = "mlp.fc1_weight"


def shard_dim(fqn: str) -> Optional[int]:
    """The TP split dimension of parameter ``fqn`` (wrapper prefixes allowed), or None when replicated."""
    fqn = clean_fqn(fqn)
    for suffix, dim in SHARD_DIM.items():
        if fqn == suffix or fqn.endswith("." + suffix):
            return dim
    return None


def has_partial_grad(fqn: str, sequence_parallel: bool) -> bool:
    """Whether each TP rank holds only a partial sum of ``fqn``'s gradient (see the module docstring)."""
    fqn = clean_fqn(fqn)
    if fqn.endswith(("q_norm.weight", "k_norm.weight")):
        return True
    return sequence_parallel and (fqn.endswith("layer_norm_weight") or fqn == "final_norm.weight"
                                  or fqn.endswith(".final_norm.weight"))


@dataclass(frozen=True)
class TensorParallelShards:
    """This rank's place in the TP group: turns full (single-process) tensors into local shards and back.

    Args: rank, size: TP rank and degree; group: the TP process group (None only when size is 1).
    """

    rank: int
    size: int
    group: Optional[object] = None

    def full_shape(self, fqn: str, local_shape: torch.Size) -> torch.Size:
        """The single-process shape of a parameter whose local shard has ``local_shape``."""
        dim = shard_dim(fqn)
        if dim is None or self.size == 1:
            return torch.Size(local_shape)
        shape = list(local_shape)
        shape[dim] *= self.size
        return torch.Size(shape)

    def local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` (gate/up-interleaved first for ``fc1``)."""
        dim = shard_dim(fqn)
        if dim is None or self.size == 1:
            return full
        if clean_fqn(fqn).endswith(GATE_UP):
            full = interleave_gate_up(full, self.size)
        return full.chunk(self.size, dim=dim)[self.rank]

    def full_index(self, fqn: str, dim: int, index: torch.Tensor, held_size: int) -> torch.Tensor:
        """Positions in the full tensor of the positions ``index`` along ``dim`` of this rank's shard (which has
        ``held_size`` entries there): the sharded init (:mod:`difflm.parallel.materialize`) draws only those."""
        if dim != shard_dim(fqn) or self.size == 1:
            return index
        full = torch.arange(held_size * self.size)
        if clean_fqn(fqn).endswith(GATE_UP):
            full = interleave_gate_up(full, self.size)
        return full.chunk(self.size)[self.rank][index]

    def full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's shard (collective over ``group``); inverse of :meth:`local`."""
        dim = shard_dim(fqn)
        if dim is None or self.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        full = torch.cat(parts, dim=dim)
        return deinterleave_gate_up(full, self.size) if clean_fqn(fqn).endswith(GATE_UP) else full


# ------------------------------------------------------------------ sequence-parallel boundaries
class _ScatterSequence(torch.autograd.Function):
    """Forward: keep this rank's chunk of ``dim``; backward: all-gather the chunks' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the chunks along ``dim``; backward: reduce-scatter (sum the ranks' gradients, keep this
    rank's chunk). What follows the gather is the vocab-parallel LM head, whose gradient to its input is a partial sum
    on each rank (Megatron's ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=True)``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


def all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (all-gather over ``group``), contiguous."""
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous()  # pipeline stages send and receive contiguous activations/gradients


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def scatter_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """[.., S, ..] (replicated on the TP ranks, sequence along ``dim``) -> this rank's [.., S / tp, ..] chunk; S
    must divide by tp. Backward: all-gather."""
    return _ScatterSequence.apply(x, group, dim)


def gather_sequence(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """[.., S / tp, ..] chunks -> the full [.., S, ..] on every TP rank; backward: reduce-scatter (see
    :class:`_GatherSequence`: used before the vocab-parallel LM head)."""
    return _GatherSequence.apply(x, group, dim)


# ------------------------------------------------------------------ gradients
def _named(parts: Iterable[nn.Module]):
    for part in parts:
        yield from part.named_parameters()


def all_reduce_partial_grads(parts: Iterable[nn.Module], group, sequence_parallel: bool) -> int:
    """Sum the partial gradients (:func:`has_partial_grad`) over the TP ``group``, in one flat all-reduce.

    Works on plain and FSDP2-sharded (DTensor over the data-parallel mesh) gradients alike: the local shards
    of TP peers cover the same rows. Returns how many gradients were reduced.
    """
    grads = []
    for name, p in _named(parts):
        if p.grad is not None and has_partial_grad(name, sequence_parallel):
            grads.append(_local(p.grad))
    if grads:
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))
    return len(grads)


def sharded_param_ids(parts: Iterable[nn.Module]) -> set[int]:
    """``id`` of every parameter that holds a TP shard (for :func:`difflm.parallel.parallelize.global_grad_norm`)."""
    return {id(p) for name, p in _named(parts) if shard_dim(name) is not None}


__all__ = [
    "SHARD_DIM", "TensorParallelShards", "all_gather_along", "all_reduce_partial_grads", "gather_sequence",
    "has_partial_grad", "scatter_sequence", "shard_dim", "sharded_param_ids",
]
