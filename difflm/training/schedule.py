"""Learning-rate schedules as multipliers of ``optim.lr``, applied through ``torch.optim.lr_scheduler.LambdaLR``."""
from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, cfg, max_steps: int) -> float:
    """LR multiplier at 0-based ``step`` for ``schedule.name``.

    * all: linear warmup over ``warmup_steps`` (multiplier (step + 1) / warmup_steps).
    * ``constant``: 1 after warmup.
    * ``cosine``: min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2 from the end of warmup to
      ``max_steps`` (Loshchilov & Hutter 2017, SGDR eq. 5, without restarts).
    * ``wsd``: warmup-stable-decay (Hu et al. 2024, MiniCPM sec. 4): 1 until the last ``decay_fraction``
      of the steps, then linear down to ``min_lr_ratio``.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.name == "wsd":
        decay_steps = max(1, int(round(cfg.decay_fraction * max_steps)))
        decay_start = max(warmup, max_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return 1.0 - (1.0 - floor) * progress
    raise ValueError(f"schedule.name={cfg.name!r} is not one of cosine, wsd, constant")


def short_run_warning(cfg, max_steps: int, lr: float) -> str | None:
    """A line for the start of a run whose warmup does not end within ``max_steps``: the learning rate would
    climb only to ``max_steps / warmup_steps`` of ``optim.lr`` (reach it only at the last step when the two are equal)
    and never decay, which looks like a model that does not learn. None otherwise. (Not an error: a short run that
    is resumed with a larger max_steps is fine.)"""
    if cfg.warmup_steps <= 0 or cfg.warmup_steps < max_steps:
        return None
    peak = lr_multiplier(max_steps - 1, cfg, max_steps) * lr
    climb = (f"reaches optim.lr={lr:g} only at the last step" if cfg.warmup_steps == max_steps else
             f"climbs only to {peak:.2e} (optim.lr={lr:g})")
    return (f"difflm: warning: schedule.warmup_steps={cfg.warmup_steps} >= train.max_steps={max_steps}: the learning "
            f"rate {climb} and never decays; lower schedule.warmup_steps for a short run")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch) is checkpointed with the optimizer."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, max_steps))


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Resume ``scheduler`` (and its optimizer's learning rates) at the step recorded in ``state`` (a
    ``LambdaLR.state_dict()``).

    Only the position is restored: the schedule itself is a function of the step and the config, and every
    parameter group runs the same multiplier, so a checkpoint resumes under a layout whose optimizer has
    another number of parameter groups (DTensor and plain tensors are grouped apart, see
    :func:`difflm.training.optimizer.build_optimizer`). The learning rates are those ``LambdaLR.step`` sets.
    A state without ``last_epoch`` (a model-only checkpoint of an older ``difflm-import``) keeps the fresh schedule.
    """
    if "last_epoch" not in state:
        return
    scheduler.last_epoch = int(state["last_epoch"])
    scheduler._step_count = int(state.get("_step_count", scheduler.last_epoch + 1))
    multiplier = scheduler.lr_lambdas[0]
    lrs = [base * multiplier(scheduler.last_epoch) for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
