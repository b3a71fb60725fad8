"""AdamW with the usual no-decay split (norm scales and embeddings-free 1-D tensors are not decayed)."""
from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` (Loshchilov & Hutter 2019) over ``model``'s parameters.

    Weight decay applies to matrices (ndim >= 2) only, as in Megatron-LM and nanoGPT. ``optim.fused=null``
    uses the fused kernel on CUDA and the for-each one elsewhere.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
