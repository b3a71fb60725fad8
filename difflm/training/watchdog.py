"""Hang detection: if a step takes longer than ``train.step_timeout`` seconds, dump every thread's
Python stack to ``<run.dir>/hang_rank<r>.txt`` and end the process.

Built on the standard library's ``faulthandler.dump_traceback_later`` (Python docs, "faulthandler"),
re-armed at every step, so a rank stuck in a collective still leaves a readable trace behind.
"""
from __future__ import annotations

import faulthandler
from pathlib import Path


class StepWatchdog:
    """``arm()`` before a step, ``disarm()`` on exit; a timeout of 0 disables it."""

    def __init__(self, run_dir: Path, timeout_s: float, rank: int = 0):
        self.timeout_s = timeout_s
        self.file = open(Path(run_dir) / f"hang_rank{rank}.txt", "w") if timeout_s > 0 else None

    def arm(self) -> None:
        if self.file is not None:
            faulthandler.dump_traceback_later(self.timeout_s, repeat=False, file=self.file, exit=True)

    def disarm(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
            path = Path(self.file.name)
            self.file.close()
            self.file = None
            if path.stat().st_size == 0:
                path.unlink()
