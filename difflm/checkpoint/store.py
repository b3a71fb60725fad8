"""Checkpoints: model and optimizer through ``torch.distributed.checkpoint`` (DCP), trainer state beside them.

Layout of ``<run.dir>/checkpoints/step_<N>/``:
    *.distcp, .metadata   model and optimizer state (DCP; sharded by rank once layouts shard them)
    trainer_state.pt      step, LR-schedule state, data-sampler position, RNG states (tensors and
                          plain Python values only, loaded with ``weights_only=True``)

A checkpoint is written under ``.step_<N>.tmp``, its files fsynced, and renamed to ``step_<N>`` last:
a directory with the final name is always complete, so a crash mid-save never leaves a checkpoint that
resumes wrongly. DCP's state-dict helpers (``get_state_dict``/``set_state_dict``) key everything by
parameter name, so the same files load under any later parallel layout (PyTorch docs,
"Distributed Checkpoint - torch.distributed.checkpoint").
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from difflm.errors import DifflmError

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, sorted by step: [(step, path)]."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def find_checkpoint(run_dir: Path, step: Optional[int] = None) -> tuple[int, Path]:
    """The checkpoint at ``step`` (default: the latest); DifflmError naming ``run.dir``/``step`` if absent."""
    ckpts = dict(list_checkpoints(run_dir))
    if not ckpts:
        raise DifflmError(f"run.dir={str(run_dir)!r} holds no checkpoint (checkpoints/step_<N>/): "
                          "train first, or point run.dir at a run that saved one (train.save_every)")
    if step is None:
        step = max(ckpts)
    if step not in ckpts:
        raise DifflmError(f"step={step} has no checkpoint in {run_dir}: choose one of {sorted(ckpts)}")
    return step, ckpts[step]


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any]) -> Path:
    """Write ``checkpoints/step_<step>`` atomically (temporary directory, fsync, rename). Returns its path."""
    root = checkpoints_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # single-process DCP warns that no process group exists
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(trainer_state, tmp / TRAINER_STATE)
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def _first_cause(exc: BaseException) -> str:
    """The informative line of a DCP error (it wraps each rank's traceback into one message)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln and ":" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else type(exc).__name__


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Load model (and optimizer, when given) state in place; returns the trainer state dict.

    Raises DifflmError when the checkpoint does not match the model (e.g. another ``model`` preset).
    """
    path = Path(path)
    options = StateDictOptions(strict=True)
    if optimizer is None:
        model_sd = get_state_dict(model, [], options=options)[0]
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise DifflmError(f"checkpoint {path} does not match this model ({_first_cause(exc)}): "
                          "resume with the model config it was saved with, or use a new run.dir") from exc
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=options)
    return torch.load(path / TRAINER_STATE, weights_only=True)
