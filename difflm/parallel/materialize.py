"""Materialise a model laid out on the meta device: each rank allocates and initialises only its own shards.

The flow of torchtitan's ``train.py`` (build on ``meta``, parallelize, ``to_empty``, ``init_weights``):

1. :func:`difflm.model.build_model` with ``meta=True`` builds the whole model on the meta device (no memory);
2. :func:`difflm.parallel.parallelize.parallelize` cuts pipeline stages, applies DTensor TP (the TE kernels were
   built with their TP shapes), activation checkpointing, compile and FSDP2, all on meta;
3. :func:`materialize`: ``to_empty`` allocates this rank's local tensors on the device, then the keyed init
   (:func:`difflm.model.init.megatron_init_`) writes into each local tensor the values of the rows and columns of the
   full tensor it holds, drawing only the init tiles it intersects.

So no rank ever holds, or draws, a full parameter it does not own, and the weights are those of one process in
every layout (tested: ``tests/test_materialize.py``).

Where a local tensor sits in its full tensor (:class:`ShardLocator`), composed from two layers:

* DTensor placements (FSDP2's ``Shard(0)``, DTensor TP's ``Shard(0/1)``, FSDP2-over-TP's ``_StridedShard``): the
  positions of the local tensor in the DTensor's global tensor, by the chunking rules DTensor and FSDP2 use
  (``torch.chunk``, empty chunks at the end);
* the checkpoint layouts of :func:`difflm.parallel.tensor_parallel.canonical_layouts` (the same objects that make
  checkpoints layout-independent): the torch backend's gate/up-interleaved ``fc1`` rows and the TE backend's plain
  tensor-parallel shards map positions of the held tensor to positions of the single-process tensor.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from difflm.model.init import megatron_init_
from difflm.parallel.tensor_parallel import canonical_layouts, clean_fqn


def _chunk(idx: torch.Tensor, parts: int, which: int) -> torch.Tensor:
    """``torch.chunk(idx, parts)[which]``, empty where ``torch.chunk`` returns fewer chunks (DTensor/FSDP2 rule)."""
    chunks = torch.chunk(idx, parts)
    return chunks[which] if which < len(chunks) else idx[:0]


def dtensor_indices(p: DTensor) -> list[torch.Tensor]:
    """Per dim of ``p``'s global shape, the positions (int64) its local tensor holds on this rank.

    Plain ``Shard`` placements split in mesh order (the outer mesh dim first); a ``_StridedShard`` (FSDP2 sharding a
    dim that TP already shards) splits each chunk its right-hand ``Shard`` placements left, i.e. after them.
    Raises: ValueError when the result does not match the local shape (a placement this rule does not cover).
    """
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    out = []
    for dim in range(p.ndim):
        idx = torch.arange(p.shape[dim])
        plain, strided = [], []
        for mesh_dim, placement in enumerate(p.placements):
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim % p.ndim == dim:
                (strided if isinstance(placement, _StridedShard) else plain).append(mesh_dim)
        for mesh_dim in plain + strided:
            idx = _chunk(idx, mesh.size(mesh_dim), coord[mesh_dim])
        out.append(idx)
    local = p.to_local().shape
    if tuple(len(i) for i in out) != tuple(local):
        raise ValueError(f"cannot locate the local tensor {tuple(local)} of a DTensor {tuple(p.shape)} with "
                         f"placements {p.placements}")
    return out


class ShardLocator:
    """``locate(name, param)`` for :func:`difflm.model.init.megatron_init_`: the parameter's name in the full model
    (wrapper prefixes removed), its full shape and the rows / columns of the full tensor its local tensor holds.

    Args:
        parts: this rank's model parts (a whole model, or its pipeline stages) after the layout is applied.
    """

    def __init__(self, parts: Iterable[nn.Module]):
        self.layouts = canonical_layouts(parts)

    def __call__(self, name: str, p: torch.Tensor) -> tuple[str, torch.Size, list[Optional[torch.Tensor]]]:
        fqn = clean_fqn(name)
        held_shape = p.shape  # a DTensor's global shape: the TE TP shard, or the interleaved fc1, or the full tensor
        index: list[Optional[torch.Tensor]] = dtensor_indices(p) if isinstance(p, DTensor) else [None] * p.ndim
        layout = self.layouts.get(fqn)
        full_shape = torch.Size(held_shape)
        if layout is not None:
            full_shape = layout.full_shape(fqn, held_shape)
            index = [layout.full_index(fqn, d, torch.arange(held_shape[d]) if i is None else i, held_shape[d])
                     for d, i in enumerate(index)]
        if p.ndim <= 2:
            return fqn, full_shape, (index + [None, None])[:2]
        return fqn, full_shape, [index[0], _flat_columns(index[1:], full_shape[1:])]


def _flat_columns(index: list[Optional[torch.Tensor]], full_shape: torch.Size) -> Optional[torch.Tensor]:
    """Positions in the flattened trailing dims ``prod(full_shape)`` (row-major) of the local tensor's trailing dims,
    in the order ``reshape`` lays them out (e.g. the [E, in, out] expert weights split by TP along dim 1 or 2).
    None when no trailing dim is split."""
    if all(i is None for i in index):
        return None
    flat = torch.zeros(1, dtype=torch.int64)
    for i, n in zip(index, full_shape):
        i = torch.arange(n) if i is None else i
        flat = (flat[:, None] * n + i[None, :]).reshape(-1)
    return flat


def materialize(parts: list[nn.Module], device: torch.device, model_cfg, seed: int) -> list[nn.Module]:
    """Allocate the (sharded) parameters of ``parts``, built on the meta device, on ``device`` and initialise them
    with the keyed init of ``seed``: each local tensor gets the single-process values of the part of the full
    tensor it holds. Returns ``parts``."""
    locate = ShardLocator(parts)
    for part in parts:
        part.to_empty(device=device)
        megatron_init_(part, model_cfg, seed, locate=locate)
    return parts


__all__ = ["ShardLocator", "dtensor_indices", "materialize"]
