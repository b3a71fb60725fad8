"""How many validation windows an evaluation of the trainer reads: ``train.eval_windows``, or, when it is null (the
default), a number sized to the run.

On a GPU the default is :data:`GPU_WINDOWS` windows. On a CPU an evaluation of that size takes most of a short run
(``make train``, 2 cores: 258 s against 98 s with 8 windows), because a validation window costs one forward pass per
Monte-Carlo draw of ``t`` and, measured on ``model=tiny``, one such forward costs about as much as the training steps
of 5 sequences (0.16 s against 0.03 s). The CPU default keeps one evaluation at about a quarter of the training
between two evaluations:

    eval_windows = eval_every * global_batch_size / (CPU_COST_RATIO * 4 * draws),  clipped to [8, 64]

with ``draws = train.eval_mc_samples`` (1 for ``objective=ar``, whose NLL is exact). ``make train`` (eval every 100
steps, batch 8, 4 draws) gets 10 windows.
"""
from __future__ import annotations

GPU_WINDOWS = 64  # validation windows per evaluation on a GPU (and the most on a CPU)
CPU_MIN_WINDOWS = 8  # the fewest on a CPU: a NELBO estimate over fewer windows moves too much between evaluations
CPU_COST_RATIO = 5  # CPU cost of a validation window's forward per draw, in training sequences (model=tiny, 2 cores)


def eval_windows(train, objective: str, device_type: str) -> int:
    """Validation windows per evaluation: ``train.eval_windows`` when set, else the default above.

    Args:
        train: the ``train`` config group (``eval_windows``, ``eval_every``, ``global_batch_size``,
            ``eval_mc_samples``).
        objective: ``objective.name`` (``ar`` evaluates one draw per window).
        device_type: ``"cuda"``, ``"cpu"``, ... (``torch.device.type``).
    Returns:
        int >= 1.
    """
    if train.get("eval_windows") is not None:
        return int(train.eval_windows)
    if device_type != "cpu":
        return GPU_WINDOWS
    draws = 1 if objective == "ar" else max(1, int(train.eval_mc_samples))
    every = int(train.eval_every) or 100
    sized = every * int(train.global_batch_size) // (CPU_COST_RATIO * 4 * draws)
    return max(CPU_MIN_WINDOWS, min(GPU_WINDOWS, sized))
