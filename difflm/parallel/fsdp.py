"""Data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``), activation checkpointing and
per-block ``torch.compile``, in torchtitan's order: TP -> activation checkpointing -> compile -> FSDP.

* ``ddp``  = FSDP2 on a 2-D (dp_replicate, dp_shard_cp=1) mesh: parameters replicated, gradients all-reduced.
* ``fsdp`` = FSDP2 on ``dp_shard_cp`` (ZeRO-3: parameters, gradients and optimizer state sharded).
* ``hsdp`` = both: shard within a group, replicate across groups (FSDP2's HSDP with a 2-D mesh).

Context-parallel ranks hold the same parameters and see different tokens, so they join the FSDP shard
group (``dp_shard_cp``), as in torchtitan. Each rank's loss is already divided by the global normaliser
(the objectives' ``weighted_ce_sum``), so gradients are summed, not averaged:
``set_gradient_divide_factor(1.0)`` on every FSDP module.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _block_items(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = model.layers
    return list(layers.items()) if isinstance(layers, nn.ModuleDict) else [(str(i), b) for i, b in enumerate(layers)]


def _set_block(model: nn.Module, key: str, block: nn.Module) -> None:
    if isinstance(model.layers, nn.ModuleDict):
        model.layers[key] = block
    else:
        model.layers[int(key)] = block


def has_te_modules(block: nn.Module) -> bool:
    """Whether ``block`` holds Transformer Engine modules (the ``te`` kernel set)."""
    return any(type(m).__module__.startswith("transformer_engine.") for m in block.modules())


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Recompute activations in the backward pass (Chen et al. 2016), per transformer block.

    ``full`` wraps every block with ``checkpoint_wrapper`` (non-reentrant); ``selective`` wraps every second block
    (torchtitan's layer-selective AC with frequency 2); ``none`` leaves the model alone. State-dict keys are
    unchanged (the wrapper strips its prefix). Blocks of TE modules recompute through Transformer Engine's own
    ``transformer_engine.pytorch.checkpoint`` (non-reentrant), which replays the forward's FP8 state (recipe,
    scales, cached FP8 weights): under ``torch.utils.checkpoint`` an FP8 block saves a different set of tensors in
    the recomputation than in the forward and the backward fails. Other blocks use ``torch.utils.checkpoint``.
    """
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, (key, block) in enumerate(_block_items(model)):
        if mode == "full" or index % 2 == 0:
            if has_te_modules(block):
                from transformer_engine.pytorch import checkpoint as te_checkpoint

                wrapped = checkpoint_wrapper(block, checkpoint_fn=te_checkpoint, use_reentrant=False)
            else:
                wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            _set_block(model, key, wrapped)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """``torch.compile`` each block in place (``nn.Module.compile``: parameter names unchanged)."""
    for _, block in _block_items(model):
        block.compile()
    return model


def apply_fsdp(model: nn.Module, dp_mesh, *, param_dtype: Optional[torch.dtype] = None,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True,
               expert_mesh=None, prefetch: int = 0) -> nn.Module:
    """``fully_shard`` every block, then the rest of ``model`` (embedding, final norm, head) as the root unit.

    Args:
        dp_mesh: 1-D (shard) or 2-D (replicate, shard) mesh; parameters that already are DTensors on the TP
            mesh get 2-D (dp, tp) placements from FSDP2.
        param_dtype / reduce_dtype: ``MixedPrecisionPolicy`` (bf16 compute with FP32 gradient reduction for
            ``precision=bf16``; ``parallel.reduce_dtype=bf16`` halves the gradient traffic; None keeps FP32).
        reshard_after_forward: free the all-gathered parameters after each block's forward (ZeRO-3) and gather them
            again for its backward; False keeps them until the backward (one all-gather fewer per micro-batch, the
            memory of the unsharded blocks). False under pipeline parallelism (each micro-batch would re-gather).
        expert_mesh: under expert parallelism, the mesh the routed experts (DTensors on ep) are sharded over
            (:func:`difflm.parallel.expert_parallel.expert_fsdp_mesh`); each MoE layer's ``experts`` becomes an
            FSDP unit of its own, inside its block's.
        prefetch: 0 leaves FSDP2's implicit prefetching (the next block's all-gather is issued as the current one
            runs); n >= 1 prefetches the next n blocks explicitly in forward and the previous n in backward
            (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``).
    Returns: ``model`` (its class swapped to an ``FSDPModule``), gradients summed over the data-parallel ranks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if expert_mesh is not None:
        from difflm.parallel.expert_parallel import routed_expert_modules

        for experts in routed_expert_modules(model):
            fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    blocks = [block for _, block in _block_items(model)]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if prefetch > 0:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def fsdp_mesh(mesh, dims):
    """The data-parallel mesh FSDP2 shards over: ``dp_shard_cp``, or (``dp_replicate``, ``dp_shard_cp``) for HSDP/DDP."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]
