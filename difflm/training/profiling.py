"""``profile.enabled``: a torch.profiler schedule writing Chrome/TensorBoard traces to ``<run.dir>/profile/``;
``profile.memory_snapshot``: a CUDA caching-allocator snapshot (``<run.dir>/profile/memory_snapshot.pickle``).

View traces at https://ui.perfetto.dev (or ``tensorboard --logdir <run.dir>/profile``) and the snapshot at
https://pytorch.org/memory_viz (PyTorch docs, "torch.profiler" and "Understanding CUDA Memory Usage").
"""
from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import torch


class Profiler:
    """Steps the torch.profiler schedule (wait, warmup, active) once per training step when enabled."""

    def __init__(self, cfg, run_dir: Path, device: torch.device, rank: int = 0):
        self.cfg, self.device = cfg, device
        self.dir = Path(run_dir) / "profile"
        self.prof = None
        self.snapshot_taken = False
        if cfg.enabled or cfg.memory_snapshot:
            self.dir.mkdir(parents=True, exist_ok=True)
        if cfg.enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{rank}"),
                record_shapes=True, profile_memory=True, with_stack=False)
            self.prof.start()
        if cfg.memory_snapshot and device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step(self, step: int) -> None:
        if self.prof is not None:
            self.prof.step()
        if self.cfg.memory_snapshot and not self.snapshot_taken and step >= self.cfg.memory_snapshot_step:
            self._snapshot()

    def _snapshot(self) -> None:
        self.snapshot_taken = True
        if self.device.type != "cuda":
            return
        with open(self.dir / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        if self.prof is not None:
            with contextlib.suppress(Exception):
                self.prof.stop()
            self.prof = None
