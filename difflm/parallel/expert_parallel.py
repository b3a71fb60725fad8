"""Expert parallelism (``parallel.ep``) for :class:`difflm.model.moe.MoEMLP`, and its place in the other layouts.

Design (after torchtitan's ``torchtitan/distributed/expert_parallel.py`` + token dispatcher and Megatron-LM's
``MoEAlltoAllTokenDispatcher``): each of the ``ep`` ranks of an expert-parallel group holds ``E / ep``
consecutive experts of every MoE layer; a layer's forward sorts its tokens' (token, expert) slots by expert,
exchanges the per-expert counts (one small all-to-all), sends every slot to the rank holding its expert (a
variable-size all-to-all with autograd: ``all_to_all_single_autograd``), runs the local experts as one grouped
GEMM, and sends the results back the same way (combine). The router, the shared experts and everything outside
the MoE layers stay data-parallel.

Mesh: ``ep`` is not a sixth dimension; it borrows from ``dp_shard`` (as Megatron-LM's expert-data-parallel and
torchtitan's ``efsdp x ep`` split), so the expert weights live on a second view of the same ranks::

    dense mesh   (pp, dp_replicate, dp_shard,       cp, tp)    everything but the routed experts
    expert mesh  (pp, dp_replicate, efsdp, ep,      cp, tp)    dp_shard = efsdp x ep, ep varying fastest

Routed-expert weights are DTensors ``Shard(0)`` on ``ep`` (``Replicate`` on ``tp``), and FSDP2 shards them over
``efsdp`` (``dp_replicate x efsdp`` for HSDP), a unit of their own inside each block's FSDP unit. Tokens never
leave their data-parallel rank except through the two all-to-alls, so the batch, the loss and the other
parameters are laid out as without EP. Checkpoints hold every expert tensor at its full [E, ...] shape (DCP
saves the shards), so they load under any ``ep`` (``ep2 -> single -> ep2``).

Tensor parallelism: the MoE layer runs replicated over the TP group (:class:`ReplicatedMoE`): with sequence
parallelism its input is all-gathered along the sequence first and its output split again; every TP rank then
routes the same tokens through the same (unsplit) experts, so all MoE gradients are identical over TP
(``Replicate``) and the auxiliary losses need no TP correction. Expert tensor parallelism (experts split over
TP like the dense MLP) is left for later (docs/moe.md). Context parallelism with MoE is refused
(:func:`difflm.config.validate.check_parallel`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from difflm.model.moe import MoEMLP, moe_layers
from difflm.parallel.sequence_parallel import all_gather_along, scatter_sequence


# ------------------------------------------------------------------ meshes
def expert_mesh(mesh, dims):
    """The expert view of ``mesh`` (``dp_shard`` unflattened into ``(efsdp, ep)``), or None when ep is 1."""
    if dims.ep <= 1:
        return None
    # the dim by position: torch 2.11's _unflatten refuses a dim given by name (pytorch/pytorch#176443)
    dim = mesh.mesh_dim_names.index("dp_shard")
    return mesh._unflatten(dim, (dims.dp_shard // dims.ep, dims.ep), ("efsdp", "ep"))


def expert_param_mesh(emesh, dims):
    """Where the routed-expert DTensors live: ``ep``, or ``(ep, tp)`` under tensor parallelism."""
    return emesh["ep", "tp"] if dims.tp_enabled else emesh["ep"]


def expert_fsdp_mesh(emesh, dims):
    """The mesh FSDP2 shards routed-expert weights over: ``efsdp``, or ``(dp_replicate, efsdp)`` (HSDP/DDP)."""
    return emesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else emesh["efsdp"]


# ------------------------------------------------------------------ dispatch / combine
def _rank_major_to_expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row permutation of the received slots: from (source rank, local expert) order, as the all-to-all delivers
    them, to (local expert, source rank) order, which the grouped GEMM needs (torchtitan's ``_permute``).
    recv [ep, E_local] int64 slot counts -> index [R] int64 (new row i = old row index[i])."""
    ep, e_local = recv.shape
    lengths = recv.flatten()
    starts = (torch.cumsum(lengths, 0) - lengths).view(ep, e_local)
    seg_lengths, seg_starts = recv.t().reshape(-1), starts.t().reshape(-1)  # segments in (expert, rank) order
    total = int(lengths.sum())
    seg_ids = torch.repeat_interleave(torch.arange(seg_lengths.numel(), device=recv.device), seg_lengths,
                                      output_size=total)
    out_starts = torch.cumsum(seg_lengths, 0) - seg_lengths
    return seg_starts[seg_ids] + torch.arange(total, device=recv.device) - out_starts[seg_ids]


class AllToAllDispatcher:
    """Sends each (token, expert) slot to the expert-parallel rank that holds its expert and back.

    Args:
        group: the expert-parallel process group (ranks holding experts ``[r E/ep, (r+1) E/ep)`` for rank r).
        num_experts: E (divisible by the group size).
    ``dispatch(x [N, d] sorted by global expert id, counts [E]) -> (rows for this rank's experts [R, d] in
    expert-major order, their counts [E/ep], ctx)``; ``combine(y [R, d], ctx) -> [N, d]`` in ``x``'s order.
    Both are collective over ``group`` (every rank calls them once per MoE forward) and differentiable.
    One host sync per dispatch (the split sizes), as in Megatron-LM and torchtitan.
    """

    def __init__(self, group, num_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        counts = counts.to(torch.int64)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)  # recv[r * E_local + j]: rank r's slots for my j
        recv = recv.view(self.ep, -1)
        send_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        received = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, self.group)
        perm = _rank_major_to_expert_major(recv)
        return received[perm], recv.sum(dim=0), (perm, send_splits, recv_splits)

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        perm, send_splits, recv_splits = ctx
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return all_to_all_single_autograd(y[inverse].contiguous(), send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, param_mesh, ep_group) -> nn.Module:
    """Shard every MoE layer's routed experts over the expert-parallel ranks and route its tokens there, in place.

    ``experts.fc1_weight`` / ``fc2_weight`` [E, ...] (and their LoRA factors [E, ...], ``lora.moe=adapt_experts``)
    become DTensors ``Shard(0)`` on ``param_mesh`` (``ep``, or ``(ep, tp)`` with ``Replicate`` on tp) holding this
    rank's ``E / ep`` experts (sliced locally: every rank
    built the same full weights); the dispatcher becomes :class:`AllToAllDispatcher` on ``ep_group``.
    Returns ``model``. Call before tensor parallelism and FSDP (:func:`difflm.parallel.parallelize.parallelize`).
    """
    placements = [Shard(0)] + [Replicate()] * (param_mesh.ndim - 1)
    for _, moe in moe_layers([model]):
        for sub in moe.experts.modules():  # LoRA factors of the experts ([E, r, d_in], [E, d_out, r]) shard alike
            for name, param in list(sub.named_parameters(recurse=False)):
                value = distribute_tensor(param.detach(), param_mesh, placements, src_data_rank=None)
                sub.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_group, moe.num_experts)
    return model


def routed_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The ``experts`` submodule of every MoE layer (their own FSDP2 unit under expert parallelism)."""
    return [moe.experts for _, moe in moe_layers([model])]


# ------------------------------------------------------------------ tensor parallelism of the MoE slot
class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; the gradient of a replicated consumer is identical on every rank,
    so backward keeps this rank's chunk (Megatron-LM's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``; :func:`difflm.parallel.te_tensor_parallel.gather_sequence` is the
    variant whose backward reduce-scatters partial gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence_replicated(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """x [.., S / tp, ..] on each TP rank -> the full [.., S, ..] on every rank (see :class:`_GatherSequence`)."""
    return _GatherSequence.apply(x, dim, group)


def split_sequence_replicated(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full [.., S, ..], identical on every TP rank -> this rank's [.., S / tp, ..]; backward all-gathers
    (:func:`difflm.parallel.te_tensor_parallel.scatter_sequence`)."""
    return scatter_sequence(x, group, dim)


def replicate_moe_over_tp(module: MoEMLP, group, sequence_parallel: bool, seq_dim: int = 1) -> MoEMLP:
    """Run ``module`` replicated over the TP ``group``: under sequence parallelism its input shard is gathered
    to the full sequence (dim ``seq_dim``: 1 for [B, S, d], 0 for TE's [S, B, d]) and its output split again.
    Without sequence parallelism the input is already replicated: nothing to do. Kernel-set independent
    (plain autograd functions over a process group), so the TE kernels can use it as well."""
    if sequence_parallel:
        module.register_forward_pre_hook(lambda mod, args: (gather_sequence_replicated(args[0], seq_dim, group),
                                                            *args[1:]))
        module.register_forward_hook(lambda mod, args, out: split_sequence_replicated(out, seq_dim, group))
    return module


class ReplicatedMoE(ParallelStyle):
    """Tensor-parallel style of a :class:`MoEMLP` (torch kernel set, DTensor TP): its parameters that are not yet
    DTensors (norm, router, shared experts; routed experts without EP) become ``Replicate`` DTensors on the TP
    mesh, so FSDP2 and the gradient norm treat them like the other replicated TP parameters, and the layer runs
    replicated over TP (:func:`replicate_moe_over_tp`). Routed experts already sharded over ep keep their
    (ep, tp) placements."""

    def __init__(self, *, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, MoEMLP):
            raise TypeError(f"ReplicatedMoE applies to MoEMLP, got {type(module).__name__}")
        for sub in module.modules():
            for name, param in list(sub.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    value = distribute_tensor(param.detach(), device_mesh, [Replicate()], src_data_rank=None)
                    sub.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        return replicate_moe_over_tp(module, device_mesh.get_group(), self.sequence_parallel)


def moe_stat_group(mesh, dims) -> Optional[object]:
    """The process group over which MoE statistics are summed (:func:`difflm.model.moe.moe_step`): the ranks that
    route different tokens through the same layers, i.e. the data (and context) parallel ranks of this pipeline
    stage and TP coordinate; None in one process."""
    if mesh is None or dims.dp_replicate * dims.dp_shard * dims.cp == 1:
        return None
    return mesh["dp_cp"].get_group()


__all__ = [
    "AllToAllDispatcher", "ReplicatedMoE", "apply_expert_parallel", "expert_fsdp_mesh", "expert_mesh",
    "expert_param_mesh", "gather_sequence_replicated", "moe_stat_group", "replicate_moe_over_tp",
    "routed_expert_modules", "split_sequence_replicated",
]
