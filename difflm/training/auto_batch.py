"""``train.micro_batch_size=auto``: the largest micro-batch that fits, planned, then confirmed on the GPU.

Two steps, as Lightning's ``BatchSizeFinder`` (its ``binsearch`` / ``power`` modes run steps and catch the CUDA
out-of-memory error) but starting from a plan instead of from 1:

1. :func:`choose_micro_batch`, before anything is built: the planner's memory model
   (:func:`difflm.plan.memory.plan_memory`, the run's layout, ``rates.activation_scale`` 1) gives the peak of every
   micro-batch size that divides the per-rank batch (``train.global_batch_size / dp``); the largest whose peak fits
   the budget is chosen. The budget: ``train.auto_batch_budget_gib`` when set; else, on CUDA, the device's free
   memory (``torch.cuda.mem_get_info``) less ``train.auto_batch_margin`` of it (allocator fragmentation, kernel
   workspaces, NCCL buffers); on the CPU, the memory the system reports available
   (``/proc/meminfo`` ``MemAvailable``) less the same margin.
2. :func:`probe_micro_batch`, on CUDA, after the model and optimizer are built: one forward and backward at the
   chosen size; on ``torch.cuda.OutOfMemoryError`` the next dividing size at most half as large is tried, down to 1.

The choice is written back into the config (``train.micro_batch_size`` holds the number, ``train.auto_batch_reason``
the line that says why), so the run's ``config.yaml`` records what ran, as ``model.*=auto`` kernels are recorded.
Refused in one line: a pipeline layout (``parallel.pp > 1``: micro-batches are the schedule's units, counted
against the stages; give a number) and a global batch that the data-parallel ranks do not divide.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from difflm.errors import DifflmError

AUTO = "auto"
GIB = 1024 ** 3


def is_auto(cfg) -> bool:
    """Whether ``train.micro_batch_size`` is ``auto``."""
    return str(cfg.train.micro_batch_size).lower() == AUTO


def dividing_sizes(per_rank: int) -> list[int]:
    """Every micro-batch size that divides the per-rank batch ``per_rank``, largest first."""
    return [b for b in range(per_rank, 0, -1) if per_rank % b == 0]


def available_bytes(device: torch.device) -> tuple[float, str]:
    """(free bytes, where they were read) of ``device``: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of
    ``/proc/meminfo`` on the CPU (the total physical memory where that file is absent)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), "free on the GPU"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "available to the CPU"
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the CPU's physical memory"


def choose_micro_batch(cfg, device: torch.device, world_size: int = 1,
                       planner: Optional[Callable[[int], float]] = None) -> str:
    """Replace ``train.micro_batch_size=auto`` in ``cfg`` by the largest dividing size whose planned peak fits.

    Args:
        cfg: the composed train config (``model.vocab_size`` may be unset: the tokenizer's is used).
        device: the device the run trains on.
        world_size: processes of the run (the data-parallel ranks divide the global batch).
        planner: micro-batch size -> planned peak bytes (default: :func:`planned_peak`); tests pass their own.
    Returns: the one line that says what was chosen and why (also in ``train.auto_batch_reason``); "" when the
        size was given.
    Raises: DifflmError under pipelining, for a global batch the data-parallel ranks do not divide, and when even a
        micro-batch of 1 is planned over the budget.
    """
    from difflm.parallel.mesh import ParallelDims

    t = cfg.train
    if not is_auto(cfg):
        return ""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    if dims.pp > 1:
        raise DifflmError(f"train.micro_batch_size=auto with parallel.pp={dims.pp}: a pipeline's micro-batches are its "
                          "schedule's units (at least pp per step), so the size is the layout's choice; give "
                          "train.micro_batch_size a number (difflm-plan --search ranks them)")
    gbs = int(t.global_batch_size)
    if gbs < 1 or gbs % dims.dp:
        raise DifflmError(f"train.micro_batch_size=auto: train.global_batch_size={gbs} is not a multiple of the "
                          f"{dims.dp} data-parallel ranks; pick a global batch that is")
    per_rank = gbs // dims.dp
    if t.get("auto_batch_budget_gib") is not None:
        budget, source = float(t.auto_batch_budget_gib) * GIB, "train.auto_batch_budget_gib"
    else:
        free, where = available_bytes(device)
        margin = float(t.get("auto_batch_margin", 0.1))
        budget, source = free * (1.0 - margin), f"{where} less train.auto_batch_margin={margin:g}"
    plan = planner or (lambda mb: planned_peak(cfg, mb, world_size))
    for size in dividing_sizes(per_rank):
        peak = plan(size)
        if peak <= budget:
            line = (f"train.micro_batch_size=auto chose {size} on {device.type} (planned peak {peak / GIB:.1f} GiB of a "
                    f"{budget / GIB:.1f} GiB budget: {source}; {per_rank // size} accumulation "
                    f"step{'s' if per_rank // size != 1 else ''})")
            t.micro_batch_size = size
            if "auto_batch_reason" in t:
                t.auto_batch_reason = line
            return line
    raise DifflmError(f"train.micro_batch_size=auto: even a micro-batch of 1 is planned at {plan(1) / GIB:.1f} GiB, "
                      f"over the {budget / GIB:.1f} GiB budget ({source}); use activation checkpointing "
                      "(parallel.activation_checkpointing=full), a shorter data.seq_len or more GPUs")


def planned_peak(cfg, micro_batch: int, world_size: int = 1) -> float:
    """The planner's peak bytes per GPU of ``cfg`` at ``micro_batch`` (:func:`difflm.plan.memory.plan_memory`)."""
    from difflm.plan.from_config import layout_of, vocab_size
    from difflm.plan.memory import plan_memory
    from difflm.plan.shapes import model_params

    c = cfg.copy()
    c.train.micro_batch_size = micro_batch
    c.model.vocab_size = vocab_size(c)
    if c.model.head_dim is None:
        c.model.head_dim = int(c.model.hidden_size) // int(c.model.num_heads)
    layout = layout_of(c, world_size)
    n_micro = int(c.train.global_batch_size) // (layout.dp * micro_batch)
    return plan_memory(c, model_params(c.model, int(c.model.vocab_size)), layout, n_micro).total


def probe_micro_batch(step: Callable[[int], None], start: int, per_rank: int) -> tuple[int, list[int]]:
    """The largest size from ``start`` down whose ``step(size)`` (one forward and backward) runs without
    ``torch.cuda.OutOfMemoryError``; after each failure the next size divides ``per_rank`` and is at most half the
    last (Lightning's ``BatchSizeFinder`` halves too).

    Returns: (the size, the sizes that ran out of memory).
    Raises: DifflmError when a micro-batch of 1 runs out of memory.
    """
    failed: list[int] = []
    size = start
    while True:
        try:
            step(size)
            return size, failed
        except torch.cuda.OutOfMemoryError:
            failed.append(size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            smaller = [b for b in dividing_sizes(per_rank) if b <= size // 2]
            if not smaller:
                raise DifflmError(f"train.micro_batch_size=auto: a micro-batch of {size} runs out of GPU memory "
                                  f"(tried {failed}); use parallel.activation_checkpointing=full, a shorter "
                                  "data.seq_len or more GPUs") from None
            size = smaller[0]
