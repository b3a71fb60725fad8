"""AdamW with the usual no-decay split (norm scales and other 1-D tensors are not decayed)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` (Loshchilov & Hutter 2019) over ``model``'s parameters.

    Weight decay applies to matrices (ndim >= 2) only, as in Megatron-LM and nanoGPT. ``optim.fused=null``
    uses the fused kernel on CUDA and the for-each one elsewhere. Under tensor parallelism some parameters
    are DTensors and some (replicated) are plain tensors, and under expert parallelism the routed experts are
    DTensors on another mesh; the multi-tensor kernels cannot mix them within one call, and AdamW calls them
    once per parameter group, so every (plain | device mesh) kind gets its own groups.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups: dict = {}
    for p in params:  # one group per (decay, device mesh): plain tensors, TP DTensors, expert-parallel DTensors
        key = (p.ndim >= 2, p.device_mesh if isinstance(p, DTensor) else None)  # meshes compare by layout
        groups.setdefault(key, []).append(p)
    groups = [{"params": members, "weight_decay": cfg.weight_decay if decay else 0.0}
              for (decay, _), members in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1] is not None))]
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
