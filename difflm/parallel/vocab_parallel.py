"""Vocab-parallel LM head and cross-entropy under tensor parallelism, for both kernel sets and pipeline stages.

Megatron-LM's scheme (Shoeybi et al. 2019, sec. 3; ``megatron/core/tensor_parallel/cross_entropy.py``): TP rank r
holds rows ``[r V/tp, (r + 1) V/tp)`` of the LM head (``output.weight``), computes logits for its vocabulary slice
only, and the cross-entropy is assembled from three reductions over the TP group: the row maxima (MAX), the target
logit (SUM, from the one rank that holds the target) and the sum of exponentials (SUM). No rank ever holds
full-vocabulary logits: with V = 128 Ki and tp = 8 that is 8x less logit memory and LM-head work per rank.

Pieces, one mechanism for every backend:

* :class:`VocabParallelLinear` is the head module (``output``; parameter ``output.weight`` as before): the TE kernel
  set builds it with a plain local shard ``[V/tp, d]`` (:meth:`VocabParallelLinear.local`); the torch backend's
  DTensor plan swaps an ``nn.Linear`` into it with a ``Shard(0)`` DTensor weight (:class:`VocabParallelStyle`).
  It returns this rank's logits ``[N, V/tp]``, or, with ``parallel_output`` off (:func:`gather_logits`, used by
  sampling), the full ``[N, V]``.
* The head's input is the full (replicated) hidden state; each rank's gradient to it is a partial sum over its
  vocabulary slice. The entry into the head therefore sums gradients over TP: :func:`copy_to_group` (identity,
  backward all-reduce) without sequence parallelism, :func:`difflm.parallel.te_tensor_parallel.gather_sequence`
  (all-gather, backward reduce-scatter) with it. The TE kernel set does it in ``exit``; the torch plan on the
  final norm's output (:class:`EnterVocabParallel`).
* :func:`vocab_parallel_cross_entropy`, called by :func:`difflm.objectives.weighted_ce_sum` when it gets the TP
  group (the trainer's step and evaluation, the pipeline's last-stage loss).

Tied embeddings stay refused under TP (:func:`difflm.config.validate.check_parallel`).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


# ------------------------------------------------------------------ autograd pieces
class _CopyToGroup(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (SUM) over ``group`` (Megatron-LM's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """Forward: all-gather the vocabulary slices along the last dim; backward: this rank's slice of the gradient
    (the computation on the full logits is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy from vocabulary-sharded FP32 logits (Megatron-LM ``_VocabParallelCrossEntropy``).

    loss_i = log sum_v exp(z_iv - m_i) - (z_{i,t_i} - m_i), with m_i the global row max; each sum over v is a local
    sum all-reduced over the group. Backward: d loss_i / d z_iv = softmax_iv - [v == t_i].
    """

    @staticmethod
    def forward(ctx, logits, targets, group):
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        row_max = logits.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max[:, None]
        local_target = targets - start
        outside = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(1, local_target[:, None]).squeeze(1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums
        exp.div_(sum_exp[:, None])  # now the softmax, kept for backward
        ctx.save_for_backward(exp, local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax * grad[:, None]
        hit = (~outside).to(grad_logits.dtype) * grad
        grad_logits.scatter_add_(1, local_target[:, None], -hit[:, None])
        return grad_logits, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group`` (the input of a vocab-parallel head)."""
    return _CopyToGroup.apply(x, group)


def gather_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    """[..., V/tp] slices -> full [..., V] logits on every rank of ``group``."""
    return _GatherVocab.apply(logits, group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """Cross-entropy per row (``reduction="none"``) from this rank's vocabulary slice of the logits.

    Args:
        logits: [N, V/tp] (any float dtype; computed in FP32), rank r's slice ``[r V/tp, (r + 1) V/tp)``.
        targets: [N] int64 global token ids.
        group: the tensor-parallel process group (collective: every rank of it must call).
    Returns: [N] FP32, the same on every rank of ``group``; equal to ``F.cross_entropy(full_logits, targets,
        reduction="none")`` up to FP32 rounding.
    """
    return _VocabParallelCrossEntropy.apply(logits.float(), targets, group)


# ------------------------------------------------------------------ the head module
class VocabParallelLinear(nn.Linear):
    """The LM head with its vocabulary split over a tensor-parallel group (see the module docstring).

    ``weight``: a plain local shard [V/tp, d] (TE kernel set), or a ``Shard(0)`` DTensor [V, d] (torch backend;
    FSDP2 may shard it further over data-parallel ranks). Shapes: x [N, d] (the head's input, entered with
    :func:`copy_to_group` / ``gather_sequence``) -> logits [N, V/tp], or [N, V] with ``parallel_output`` off.
    """

    group = None
    parallel_output = True

    @classmethod
    def local(cls, in_features: int, vocab_size: int, group, device) -> "VocabParallelLinear":
        """A head holding this rank's ``vocab_size / tp`` rows as a plain tensor (the TE kernel set's)."""
        head = cls(in_features, vocab_size // dist.get_world_size(group), bias=False, device=device)
        head.group = group
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        logits = F.linear(x, weight)
        return logits if self.parallel_output else gather_vocab(logits, self.group)


class VocabParallelStyle(ParallelStyle):
    """DTensor TP style of the torch backend's ``output`` (an ``nn.Linear`` [V, d]): weight ``Shard(0)``, class
    swapped to :class:`VocabParallelLinear` over the TP mesh's process group."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module) is not nn.Linear or module.bias is not None:
            raise TypeError(f"VocabParallelStyle applies to a bias-free nn.Linear, got {type(module).__name__}")
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight.detach(), device_mesh,
                                                                           [Shard(0)])))
        module.__class__ = VocabParallelLinear
        module.group = device_mesh.get_group()
        return module


class EnterVocabParallel(ParallelStyle):
    """DTensor TP style of the torch backend's final norm: its output becomes the full, local hidden state whose
    gradient is summed over TP (all-gather / reduce-scatter of the sequence with SP, identity / all-reduce without),
    the input a :class:`VocabParallelLinear` head needs."""

    def __init__(self, *, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from difflm.parallel.sequence_parallel import gather_sequence

        group, seq = device_mesh.get_group(), self.sequence_parallel

        def enter(mod, args, out):
            out = out.to_local() if isinstance(out, DTensor) else out
            return gather_sequence(out, group, dim=1) if seq else copy_to_group(out, group)

        module.register_forward_hook(enter)
        return module


@contextlib.contextmanager
def gather_logits(modules: Iterable[nn.Module]):
    """Within the context the vocab-parallel heads of ``modules`` return full-vocabulary logits (sampling)."""
    heads = [m for module in modules for m in module.modules() if isinstance(m, VocabParallelLinear)]
    for head in heads:
        head.parallel_output = False
    try:
        yield
    finally:
        for head in heads:
            head.parallel_output = True


__all__ = ["EnterVocabParallel", "VocabParallelLinear", "VocabParallelStyle", "copy_to_group", "gather_logits",
           "gather_vocab", "vocab_parallel_cross_entropy"]
