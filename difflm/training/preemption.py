"""Stop requests from the cluster: SIGTERM / SIGUSR1 and a wall-clock limit; and Ctrl-C (SIGINT) at a terminal.

SLURM sends SIGUSR1 ahead of the time limit when the job asks for it (``#SBATCH --signal=USR1@120``) and
SIGTERM on preemption or ``scancel``. The handler only records the request; the training loop finishes
the step it is in, saves a checkpoint and exits with :data:`EXIT_REQUEUE`; under SLURM, rank 0 first asks
for the job to be requeued (:func:`request_slurm_requeue`). Ctrl-C saves the same way but exits with
:data:`EXIT_INTERRUPTED` and never requeues (:func:`exit_status`); a second Ctrl-C raises KeyboardInterrupt at
once. Megatron-LM's ``--exit-signal-handler`` and torchtitan work the same way.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from difflm.cli import EXIT_INTERRUPTED

EXIT_REQUEUE = 75  # EX_TEMPFAIL (sysexits.h): "try again later"; the run saved and can resume


def exit_status(reason: str) -> int:
    """``difflm-train``'s exit status after a saved stop for ``reason`` (:attr:`StopRequest.reason`): Ctrl-C's
    :data:`EXIT_INTERRUPTED` (a person stopped it: no requeue), else :data:`EXIT_REQUEUE`."""
    return EXIT_INTERRUPTED if reason == signal.Signals.SIGINT.name else EXIT_REQUEUE


def process_age_s() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat`` field 22, the start time in clock ticks after
    boot, against ``/proc/uptime``; proc(5)); 0.0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StopRequest:
    """Collects SIGTERM/SIGUSR1 and a ``train.time_limit`` (seconds, 0 = none) into one flag.

    ``should_stop()`` is collective when a process group exists (max over ranks), so every rank stops
    after the same step even if only one received the signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, time_limit_s: float = 0.0, margin_s: float = 0.0, elapsed_s: float = 0.0):
        """``elapsed_s``: time the limit has already run (the trainer passes :func:`process_age_s`, so imports, the
        model build and the data count, as they do in a SLURM job's time)."""
        self.reason: Optional[str] = None
        self.deadline = time.monotonic() - elapsed_s + time_limit_s if time_limit_s > 0 else None
        self.margin_s = margin_s  # the loop raises it to ~2 steps so the save finishes inside the limit
        self._previous = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners): signals stay default
                pass

    def _handle(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name
        if signum == signal.SIGINT:  # Ctrl-C: save like SIGTERM; a second Ctrl-C interrupts at once
            # Python's own handler, whatever was there before: a process started in the background inherits SIGINT
            # ignored, and chaining to that would make the second Ctrl-C do nothing. restore() puts the old one back.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("\ndifflm: Ctrl-C: saving at the end of this step and exiting (Ctrl-C again stops at once, "
                  "without saving)", file=sys.stderr, flush=True)

    def should_stop(self) -> bool:
        if self.reason is None and self.deadline is not None and time.monotonic() + self.margin_s >= self.deadline:
            self.reason = "train.time_limit"
        flag = torch.tensor(1.0 if self.reason else 0.0)
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0 and self.reason is None:
                self.reason = "another rank's stop request"
        return flag.item() > 0

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def request_slurm_requeue() -> bool:
    """Under SLURM, ask the scheduler to requeue this job (``scontrol requeue $SLURM_JOB_ID``, as PyTorch
    Lightning's SLURM auto-requeue does). Called by rank 0 after a saved stop; the requeued job resumes from
    the checkpoint. Returns whether a requeue was requested."""
    job_id, scontrol = os.environ.get("SLURM_JOB_ID"), shutil.which("scontrol")
    if not job_id or scontrol is None:
        return False
    return subprocess.run([scontrol, "requeue", job_id], check=False).returncode == 0
