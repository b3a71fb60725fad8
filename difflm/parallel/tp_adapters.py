"""The tensor-parallel layout of LoRA adapters (:mod:`difflm.model.lora`) on DTensor TP's projections (docs/lora.md).

For an adapted weight W [d_out, d_in] and its factors A [r, d_in], B [d_out, r] (``h = W x + s B A x``):

==========================  ==============  ==============  ======================================================
base weight (its style)      W               A               B
==========================  ==============  ==============  ======================================================
column-parallel (qkv, fc1)   Shard(0)        Replicate       Shard(0): ``B A x`` has W x's Shard(-1) output
row-parallel (proj, fc2)     Shard(1)        Shard(1)        Replicate: ``B (A x)`` is a partial sum like W x's
==========================  ==============  ==============  ======================================================

The adapter's output then has the placement of the base output (column: this rank's output features; row: a partial
sum that the base's own all-reduce / reduce-scatter completes), so the styles add no collective of their own, and
``s B A`` has the placement of W (``B_r A`` the held rows, ``B A_r`` the held columns): the merged weight of a
rank is its shard of the single-process merged weight. The SwiGLU ``fc1``'s B rows are gate/up-interleaved as
``fc1_weight``'s (:func:`difflm.parallel.tp_layout.interleave_gate_up`), so that Shard(0) hands rank r the B rows of
its ``[gate_r; up_r]``; checkpoints hold the single-process order (``canonical_layouts``). The adapters keep
``requires_grad`` (only they train); the gradients of the replicated factors arrive as partial sums that the
gradient norm redistributes, as it does for the replicated norm weights.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from difflm.model.lora import LoraFactors
from difflm.parallel.tp_layout import interleave_gate_up

FC1_ADAPTER_B = "lora.fc1_weight.lora_B"  # its rows follow fc1_weight's gate/up interleave


def adapter_placements(weight_shard_dim: int) -> dict:
    """{factor name: placement} of the factors of a weight split on ``weight_shard_dim`` (0: column-parallel,
    1: row-parallel). Raises ValueError for another dimension."""
    if weight_shard_dim == 0:
        return {"lora_A": Replicate(), "lora_B": Shard(0)}
    if weight_shard_dim == 1:
        return {"lora_A": Shard(1), "lora_B": Replicate()}
    raise ValueError(f"no adapter layout for a weight split on dim {weight_shard_dim}")


def distribute_factors(factors: LoraFactors, mesh, weight_shard_dim: int, gate_up_tp: int = 0) -> None:
    """Make ``factors``' A and B DTensors on the TP ``mesh`` with :func:`adapter_placements` (in place, requires_grad
    kept). ``gate_up_tp`` > 0: B's rows are first interleaved over that many ranks (the SwiGLU ``fc1``)."""
    for name, placement in adapter_placements(weight_shard_dim).items():
        param = factors._parameters[name]
        if isinstance(param, DTensor):
            continue
        value = param.detach()
        if name == "lora_B" and gate_up_tp:
            value = interleave_gate_up(value, gate_up_tp)
        factors.register_parameter(name, nn.Parameter(distribute_tensor(value, mesh, [placement]),
                                                      requires_grad=param.requires_grad))


def distribute_adapters(module: nn.Module, mesh, shard_dims: dict, gate_up: str = "") -> None:
    """Lay out every adapter of ``module`` (its ``lora`` ModuleDict, keyed by the adapted parameter) for TP:
    ``shard_dims`` maps the adapted parameter's name to its base weight's split dimension; ``gate_up`` names the
    parameter whose rows are gate/up-interleaved. Modules without adapters are left as they are."""
    adapters = module._modules.get("lora")
    if adapters is None:
        return
    for pname, factors in adapters.items():
        distribute_factors(factors, mesh, shard_dims[pname], mesh.size() if pname == gate_up else 0)


__all__ = ["FC1_ADAPTER_B", "adapter_placements", "distribute_adapters", "distribute_factors"]
