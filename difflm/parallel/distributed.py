"""Process-group life cycle and the rank-0 helpers every distributed run needs.

One process per device. ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; under SLURM without torchrun (Hydra's submitit launcher, one task per GPU) the same values
are derived from ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the first host of
``SLURM_JOB_NODELIST`` (as ``submitit.helpers.TorchDistributedEnvironment`` does). See docs/parallel.md.
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from difflm.errors import DifflmError

DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist, as ``scontrol show hostnames`` would list it first.

    SLURM compresses node lists (``SLURM_JOB_NODELIST``): ``gpu[07-08,12],cpu3`` is gpu07, gpu08, gpu12, cpu3,
    and every bracket of a name expands (``rack[1-2]-n[01-04]``: rack1-n01 first); zero padding is kept
    (SLURM docs, "Hostlist expressions"). Used when ``scontrol`` is not on the PATH (containers).
    """
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first name: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", nodelist[:end])


def _slurm_env() -> dict[str, str]:
    """torchrun-style variables from SLURM's, for tasks started by srun/submitit (empty outside SLURM tasks)."""
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return {}
    env = {"RANK": os.environ["SLURM_PROCID"], "WORLD_SIZE": os.environ["SLURM_NTASKS"],
           "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        try:
            host = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                  check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            host = first_host(nodes)
        env["MASTER_ADDR"] = host
    if "MASTER_PORT" not in os.environ:
        env["MASTER_PORT"] = str(DEFAULT_PORT + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000)
    return env


def launch_env() -> dict[str, int]:
    """(rank, world_size, local_rank) of this process from torchrun's or SLURM's variables; (0, 1, 0) alone.

    SLURM's values are copied into ``os.environ`` (``RANK``, ``MASTER_ADDR``, ...) so ``init_process_group``
    finds them through its ``env://`` rendezvous.
    """
    if "WORLD_SIZE" not in os.environ:
        for key, value in _slurm_env().items():
            os.environ.setdefault(key, value)
    return {"rank": int(os.environ.get("RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0))}


def world_size_from_env() -> int:
    """Number of processes of this launch (1 without torchrun/SLURM); no process group needed."""
    return launch_env()["world_size"]


def init_distributed(device: torch.device, timeout_s: int = 1800) -> torch.device:
    """Create the default process group (NCCL on CUDA, gloo on CPU) when launched with several processes.

    Returns the device of this rank (``cuda:<LOCAL_RANK>`` on GPUs). A single process gets no group and
    its device back unchanged, so single-process runs never touch ``torch.distributed``.
    """
    env = launch_env()
    if env["world_size"] > 1 and not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise DifflmError(f"WORLD_SIZE={env['world_size']} is set but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not: launch the ranks with torchrun "
                              "(torchrun --standalone --nproc-per-node N -m difflm.train ...), which sets them, or "
                              "unset WORLD_SIZE for one process")
    if device.type == "cuda":
        device = torch.device("cuda", env["local_rank"])
        torch.cuda.set_device(device)
    if env["world_size"] > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return device


def destroy_distributed() -> None:
    """Tear the default process group down; a no-op without one. No barrier: after an error on one rank the
    others may never arrive (torchrun then stops them)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_rank0() -> bool:
    """True on the process that writes logs, metrics, config.yaml, Hydra outputs and W&B."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (``dist.broadcast_object_list``); ``obj`` itself alone."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (default: all ranks), in place and returned; ``t`` alone."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def agree_run_dir(run_dir: str) -> str:
    """Rank 0's ``run.dir`` on every rank.

    The default ``run.dir`` holds ``${now:...}``: ranks started a second apart would resolve different
    directories, so every rank takes rank 0's.
    """
    return str(broadcast_object(str(run_dir)))
