"""The sequence-parallel boundaries of the residual stream over a TP group (Korthikanti et al. 2022, sec. 4.2.2;
Megatron-LM's ``scatter_to_sequence_parallel_region`` / ``gather_from_sequence_parallel_region``): keep this rank's
chunk of the sequence (backward: all-gather) and gather every rank's chunk (backward: reduce-scatter)."""
from __future__ import annotations

import torch
import torch.distributed as dist

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


__all__ = ["all_gather_along", "gather_sequence", "scatter_sequence"]
