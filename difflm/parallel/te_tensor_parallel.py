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

from difflm.parallel.sequence_parallel import (  # noqa: F401  (the boundaries, imported from here too)
    all_gather_along,
    gather_sequence,
    scatter_sequence,
)
from difflm.parallel.tp_layout import (  # noqa: F401
    GATE_UP,
    SHARD_DIM,
    _local,
    clean_fqn,
    deinterleave_gate_up,
    interleave_gate_up,
    shard_dim,
)

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
