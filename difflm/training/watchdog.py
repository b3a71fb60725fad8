"""Hang detection: if a step takes longer than ``train.step_timeout`` seconds, dump every thread's
Python stack to ``<run.dir>/hang_rank<r>.txt`` and end the process (exit status 1).

Built on the standard library's ``faulthandler.dump_traceback_later`` (Python docs, "faulthandler"),
armed before each step and cancelled after it, so a rank stuck in a collective still leaves a readable
trace behind.
"""
from __future__ import annotations

import faulthandler
from pathlib import Path


class StepWatchdog:
    """``arm()`` before a step, ``disarm_step()`` after it, ``close()`` at the end; a timeout of 0 disables it."""

    def __init__(self, run_dir: Path, timeout_s: float, rank: int = 0):
        self.timeout_s = timeout_s
        self.path = Path(run_dir) / f"hang_rank{rank}.txt"
        self.file = open(self.path, "w") if timeout_s > 0 else None

    def arm(self) -> None:
        if self.file is not None:
            faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self.file, exit=True)

    def disarm_step(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()
            self.file = None
            if self.path.stat().st_size == 0:  # no hang: leave no empty file behind
                self.path.unlink()
