"""AdamW with the usual no-decay split (norm scales and other 1-D tensors are not decayed)."""
from __future__ import annotations

from typing import Optional

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


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device, so the host need not read the step's finite check
    first: torch's fused Adam / AdamW kernels take a ``found_inf`` tensor (the one ``torch.amp.GradScaler`` hands
    them; ``torch/optim/adam.py``, ``_fused_adam``), on CUDA and CPU, plain tensors and DTensors alike."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups)


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, finite: torch.Tensor,
                          grad_factor: Optional[torch.Tensor] = None) -> None:
    """One step of a fused Adam / AdamW (:func:`skips_on_device`) that leaves every parameter, moment and step
    count as it was when ``finite`` (a bool scalar tensor on the parameters' device) is False, without a host sync.

    ``grad_factor`` (an FP32 scalar tensor, e.g. the clipping coefficient of
    :func:`difflm.parallel.parallelize.clip_coefficient`) multiplies every gradient inside the fused kernel, which
    divides them by its ``grad_scale`` (the GradScaler's unscaling) before the update: the clipped step without a
    separate pass over the gradients. The gradients are left unscaled or scaled as the kernel leaves them; read them
    before the step.

    Raises:
        ValueError: ``optimizer`` is not fused, or already carries a ``found_inf`` / ``grad_scale`` (a GradScaler's).
    """
    if not skips_on_device(optimizer):
        raise ValueError("step_unless_nonfinite needs a fused Adam/AdamW (optim.fused=true); others take the host check")
    if getattr(optimizer, "found_inf", None) is not None or getattr(optimizer, "grad_scale", None) is not None:
        raise ValueError("the optimizer already carries a found_inf / grad_scale (torch.amp.GradScaler's): use "
                         "scaler.step")
    optimizer.found_inf = (~finite).to(torch.float32)
    if grad_factor is not None:
        optimizer.grad_scale = grad_factor.to(torch.float32).reciprocal()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
        if grad_factor is not None:
            del optimizer.grad_scale
