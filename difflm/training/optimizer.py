"""AdamW with the usual no-decay split (norm scales and other 1-D tensors are not decayed)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` (Loshchilov & Hutter 2019) over ``model``'s parameters.

    Weight decay applies to matrices (ndim >= 2) only, as in Megatron-LM and nanoGPT. ``optim.fused=null``
    uses the fused kernel on CUDA and the for-each one elsewhere. Under tensor parallelism some parameters
    are DTensors and some (replicated) are plain tensors; the multi-tensor kernels cannot mix the two
    within one call, and AdamW calls them once per parameter group, so the two kinds get separate groups.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for decay in (True, False):
        for distributed in (False, True):
            members = [p for p in params if (p.ndim >= 2) == decay and isinstance(p, DTensor) == distributed]
            if members:
                groups.append({"params": members, "weight_decay": cfg.weight_decay if decay else 0.0})
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
