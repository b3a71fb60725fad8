"""Checkpoints: model and optimizer through ``torch.distributed.checkpoint`` (DCP), trainer state beside them.

Layout of ``<run.dir>/checkpoints/step_<N>/``:
    *.distcp, .metadata   model and optimizer state (DCP; one file per rank under sharded layouts)
    trainer_state.pt      step, LR-schedule state, data-sampler position, RNG states (tensors and
                          plain Python values only, loaded with ``weights_only=True``)
    manifest.json         written last: every other file with its size (and SHA-256 with
                          ``train.checkpoint_checksums``); see :mod:`difflm.checkpoint.manifest`

A checkpoint is written under ``.step_<N>.tmp`` (by every rank, each its shards), its files fsynced, and
renamed to ``step_<N>`` last by rank 0 after a barrier:
a directory with the final name is complete, so a crash mid-save never leaves a checkpoint that
resumes wrongly; a checkpoint damaged afterwards (truncated file, lost file) fails its manifest check, is moved
aside to ``step_<N>.damaged`` and the previous complete one is used instead; when none is complete the run stops
(:func:`resume_checkpoint`), so damaged files are never overwritten by a fresh start. DCP's state-dict helpers
(``get_state_dict``/``set_state_dict``) key everything by parameter name, so the same files load under any later
parallel layout (PyTorch docs, "Distributed Checkpoint - torch.distributed.checkpoint").
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from difflm.checkpoint.manifest import manifest_problem, write_manifest
from difflm.checkpoint.retention import steps_to_delete
from difflm.errors import DifflmError, exception_chain
from difflm.parallel.distributed import barrier, is_distributed, is_rank0

# torch.distributed.checkpoint (with DTensor and sympy under it) is imported inside the functions that save or load:
# most of a second of start-up that a --help, a refused config or a run that never checkpoints does not pay.

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"
CONFIG = "config.yaml"


class CheckpointMismatch(DifflmError):
    """A checkpoint whose tensors do not fit this run's model (another shape, more tensors): the message names the
    checkpoint; callers that know the settings it was trained with add them
    (:func:`difflm.training.run_config.model_settings_hint`)."""


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders of a run (complete or not: :func:`manifest_problem` tells), sorted by step:
    [(step, path)]."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: Path, report=print) -> Optional[tuple[int, Path]]:
    """The newest checkpoint that matches its manifest; newer damaged ones are reported and skipped."""
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = manifest_problem(path)
        if problem is None:
            return step, path
        report(f"checkpoint {path} is incomplete or corrupt ({problem}): falling back to an earlier one")
    return None


def resume_checkpoint(run_dir: Path, report=print) -> Optional[tuple[int, Path]]:
    """The checkpoint a training run resumes from: the newest that matches its manifest (None without any).

    Newer damaged checkpoints are reported and moved aside by rank 0 to ``step_<N>.damaged`` (``.damaged.1``, ...
    if taken), where retention and a later save of the same step leave them alone: nothing is deleted.
    Collective under a process group (every rank calls it and gets the same answer).

    Raises: DifflmError naming ``run.dir`` when checkpoints exist but none is complete: starting afresh would
        overwrite them, so the run stops until the files are restored or moved away.
    """
    found = list_checkpoints(run_dir)
    problems = []
    for step, path in reversed(found):
        problem = manifest_problem(path)
        if problem is None:
            break
        problems.append((step, path, problem))
    else:
        step = path = None
    if found and step is None:
        listed = "; ".join(f"step_{s}: {p}" for s, _, p in problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise DifflmError(f"run.dir={str(run_dir)!r}: no checkpoint is complete ({listed}): restore the missing files, "
                          f"or move {checkpoints_root(run_dir)} away to start this run.dir afresh")
    barrier()  # every rank has looked before rank 0 renames
    for bad_step, bad_path, problem in problems:
        if is_rank0():
            aside = bad_path.with_name(f"{bad_path.name}.damaged")
            n = 0
            while aside.exists():
                n += 1
                aside = bad_path.with_name(f"{bad_path.name}.damaged.{n}")
            os.replace(bad_path, aside)
            report(f"checkpoint {bad_path} is incomplete or corrupt ({problem}): moved to {aside.name}, "
                   f"resuming from step {step}")
    barrier()
    return None if step is None else (step, path)


def prune_checkpoints(run_dir: Path, keep_last: int, keep_every: int, keep=()) -> list[int]:
    """Delete checkpoints outside the retention policy (``train.keep_last``/``train.keep_every``); rank 0 only.
    ``keep``: steps never deleted (a LoRA run's base). Returns the deleted steps."""
    steps = [s for s, _ in list_checkpoints(run_dir)]
    doomed = [s for s in steps_to_delete(steps, keep_last, keep_every) if s not in keep] if is_rank0() else []
    for step in doomed:
        shutil.rmtree(checkpoints_root(run_dir) / f"step_{step}", ignore_errors=True)
    return doomed


def find_checkpoint(run_dir: Path, step: Optional[int] = None,
                    keys: tuple[str, str] = ("run.dir", "step")) -> tuple[int, Path]:
    """The checkpoint at ``step`` (default: the latest); DifflmError naming the keys ``keys`` (the command's names of
    the run directory and the step: ``run.dir``/``step``, difflm-rl's ``init.run_dir``/``init.step``) if absent."""
    dir_key, step_key = keys
    found = list_checkpoints(run_dir)
    ckpts = {s: p for s, p in found if manifest_problem(p) is None}
    if not ckpts and found:
        raise DifflmError(f"{dir_key}={str(run_dir)!r}: no checkpoint is complete (step_{found[-1][0]}: "
                          f"{manifest_problem(found[-1][1])}): restore the missing files or train again")
    if not ckpts:
        raise DifflmError(f"{dir_key}={str(run_dir)!r} holds no checkpoint (checkpoints/step_<N>/): "
                          f"train first, or point {dir_key} at a run that saved one (train.save_every=0 saves none)")
    if step is None:
        step = max(ckpts)
    if step not in ckpts and step in dict(found):  # mid-write, or damaged since
        raise DifflmError(f"{step_key}={step}: checkpoint {dict(found)[step]} is not complete "
                          f"({manifest_problem(dict(found)[step])}): choose one of {sorted(ckpts)}, or let its save "
                          "finish")
    if step not in ckpts:
        raise DifflmError(f"{step_key}={step} has no checkpoint in {run_dir}: choose one of {sorted(ckpts)}")
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


def _parts(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _state_model(model):
    """What DCP's state-dict helpers take: one module. A pipeline rank holding several stages (virtual stages, V
    schedules) gets one view over them: their children under their full-model names, the blocks' ``layers``
    ModuleDicts merged (the modules are shared, so a load into the view loads the stages)."""
    parts = _parts(model)
    if len(parts) == 1:
        return parts[0]
    view = torch.nn.Module()
    for part in parts:
        for name, child in part.named_children():
            if isinstance(child, torch.nn.ModuleDict):
                view._modules.setdefault(name, torch.nn.ModuleDict()).update(child)
            elif name not in view._modules:
                view.add_module(name, child)
    return view


_ASYNC_GROUP = None


def _async_group():
    """A gloo group for ``dcp.async_save``'s background collectives, apart from the training group (as torchtitan)."""
    global _ASYNC_GROUP
    if not is_distributed():
        return None
    if _ASYNC_GROUP is None:
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


class PendingCheckpoint:
    """An ``async_save`` in flight: :meth:`wait` blocks until every rank's files are written, then renames the
    temporary directory (rank 0, after a barrier). Until then ``step_<N>/`` does not exist. A save that fails is
    handled as a synchronous one's (:func:`_save_failed`)."""

    def __init__(self, path: Path, future, finish, failed):
        self.path, self._future, self._finish, self._failed = path, future, finish, failed

    def wait(self) -> Path:
        if self._future is not None:
            future, self._future = self._future, None
            try:
                with warnings.catch_warnings():  # single-process DCP warns that no process group exists
                    warnings.simplefilter("ignore")
                    future.result()
                self._finish()
            except BaseException as exc:
                error = self._failed(exc)
                if error is exc:
                    raise
                raise error from exc
        return self.path


def save_checkpoint(run_dir: Path, step: int, model, optimizer: Optional[torch.optim.Optimizer],
                    trainer_state: dict[str, Any], *, async_save: bool = False, checksums: bool = False,
                    config: Optional[str] = None, trainable_only: bool = False):
    """Write ``checkpoints/step_<step>`` atomically (temporary directory, fsync, rename). Returns its path, or a
    :class:`PendingCheckpoint` with ``async_save``.

    Args:
        model: a module, or a list of them (the stage modules of a pipeline rank); sharded (FSDP2/DTensor)
            parameters are written sharded by every rank (collective: all ranks call this). Tensor-parallel
            ``fc1`` rows and the TE backend's TP shards are written as a single process holds them
            (:func:`difflm.parallel.tensor_parallel.canonical_state_dict`), so any layout can read the files.
        optimizer: ``None`` writes a model-only checkpoint (e.g. ``difflm-import``); loading it with an optimizer
            leaves the optimizer fresh (:func:`load_checkpoint`). Optimizer state is keyed by parameter name
            (``flatten_optimizer_state_dict``), independent of how parameters are grouped over ranks.
        trainer_state: written by rank 0 only.
        async_save: ``dcp.async_save`` (state staged to CPU, files written in the background); call
            ``.wait()`` on the result before the next save and before exiting.
        checksums: record each file's SHA-256 in the manifest (sizes are always recorded).
        config: the run's resolved settings (YAML), written as ``config.yaml`` inside the checkpoint, so a later
            resume, evaluation or export of this step reads the settings it was trained with
            (:func:`checkpoint_config_path`), whatever a resume with other settings wrote to ``run.dir`` since.
        trainable_only: write only the parameters that require gradients (a LoRA run's adapters: the frozen base
            stays in the checkpoint it came from, :func:`load_base_weights`).
    A save stopped part-way (an error, a second Ctrl-C) removes its temporary directory; a stopped KeyboardInterrupt
    inside DCP's wrapper is raised as KeyboardInterrupt again.
    """
    from difflm.parallel.tensor_parallel import canonical_state_dict, canonical_layouts
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    root = checkpoints_root(run_dir)
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    model_sd, optim_sd = get_state_dict(_state_model(model), optimizer if optimizer is not None else [],
                                        options=StateDictOptions(flatten_optimizer_state_dict=True,
                                                                 ignore_frozen_params=trainable_only))
    canonical_state_dict(model_sd, optim_sd, canonical_layouts(_parts(model)))
    state = {"model": model_sd, "optim": optim_sd}

    def finish() -> Path:
        barrier()  # every rank's shard files are written
        if is_rank0():
            torch.save(trainer_state, tmp / TRAINER_STATE)
            if config is not None:
                (tmp / CONFIG).write_text(config)
            _fsync_tree(tmp)
            write_manifest(tmp, checksums)  # last: its presence marks the files above as complete
            _fsync_tree(tmp)
            if final.exists():  # re-saving the same step (e.g. after a resume) replaces it
                shutil.rmtree(final)
            os.replace(tmp, final)
            fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        barrier()
        return final

    def failed(exc: BaseException) -> BaseException:
        return _save_failed(exc, run_dir, step, tmp)

    try:
        with warnings.catch_warnings():  # single-process DCP warns that no process group exists
            warnings.simplefilter("ignore")
            if async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=_async_group())
                return PendingCheckpoint(final, future, finish, failed)
            dcp.save(state, checkpoint_id=str(tmp))
        return finish()
    except BaseException as exc:
        error = failed(exc)
        if error is exc:
            raise
        raise error from exc


def _save_failed(exc: BaseException, run_dir: Path, step: int, tmp: Path) -> BaseException:
    """What a save of ``step`` that failed with ``exc`` raises, after rank 0 removed its temporary directory ``tmp``
    (only a complete checkpoint is ever renamed, so none is left half-written): KeyboardInterrupt for a stopped save
    (DCP wraps it in a CheckpointException); a DifflmError when the OS refused to write its files (a full disk, a
    quota, a read-only file system), naming the folder, the reason and the checkpoint a rerun resumes from;
    otherwise ``exc`` itself."""
    if is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    if _interrupted(exc):
        return exc if isinstance(exc, KeyboardInterrupt) else KeyboardInterrupt()
    os_error = next((e for e in _failure_chain(exc) if isinstance(e, OSError)), None)
    if os_error is None:
        return exc
    why = os_error.strerror or " ".join(str(os_error).split())[:200]
    latest = latest_checkpoint(run_dir, report=lambda _: None)
    then = (f"rerun the same command to resume from step {latest[0]}, the latest complete checkpoint" if latest else
            "rerun the same command (no checkpoint of this run.dir is complete yet: it starts afresh)")
    return DifflmError(f"checkpoint step_{step} could not be written to {checkpoints_root(run_dir)} ({why}); nothing "
                       f"of it was kept: make room there (train.keep_last keeps fewer checkpoints) or choose another "
                       f"run.dir, then {then}")


def _failure_chain(exc: BaseException):
    """``exc``, its chain (:func:`difflm.errors.exception_chain`) and, in a DCP CheckpointException, each rank's
    failure and its chain, each once."""
    pending, seen = [exc], set()
    while pending:
        for err in exception_chain(pending.pop()):
            if id(err) in seen:
                continue
            seen.add(id(err))
            pending += [failure[0] for failure in getattr(err, "failures", {}).values()
                        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException)]
            yield err


def _interrupted(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` is, or was caused by, a KeyboardInterrupt (DCP re-raises each rank's failure wrapped)."""
    return any(isinstance(e, KeyboardInterrupt) or "KeyboardInterrupt" in str(e) for e in exception_chain(exc))


def remove_incomplete_saves(run_dir: Path) -> list[str]:
    """Delete the ``checkpoints/.step_<N>.tmp`` directories saves that never finished left (a ``kill -9`` or power
    loss mid-save). Call it only while holding the run directory (one run per ``run.dir``): then no save is in
    flight. Returns the names removed."""
    root = checkpoints_root(run_dir)
    removed = []
    for tmp in sorted(root.glob(".step_*.tmp")) if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp.name)
    return removed


def checkpoint_config_path(run_dir: Path, checkpoint: Path) -> Path:
    """The settings ``checkpoint`` was trained with: its own ``config.yaml``, or, for checkpoints written before
    checkpoints carried one, the run's."""
    own = Path(checkpoint) / CONFIG
    return own if own.is_file() else Path(run_dir) / CONFIG


def read_settings(path: Path):
    """The settings file at ``path`` (a checkpoint's ``config.yaml``, a run's ``config.yaml`` or ``rl_config.yaml``)
    as a DictConfig.

    Raises: DifflmError naming the file when it cannot be read or parsed, or holds no mapping (bytes overwritten on
        disk, which only ``train.checkpoint_checksums`` sees at resume): restore it, or, for a checkpoint's own file,
        move that checkpoint away to use an earlier one."""
    from omegaconf import DictConfig, OmegaConf

    path = Path(path)
    try:
        settings = OmegaConf.create(path.read_text())
        why = None if isinstance(settings, DictConfig) else f"a {type(settings).__name__}, not a mapping of settings"
    except Exception as exc:  # noqa: BLE001 - yaml's, OmegaConf's, a decode or recursion error: one line
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    if why is None:
        return settings
    aside = (f", or move {path.parent.name} away to use an earlier checkpoint" if STEP_DIR.match(path.parent.name)
             else "")
    raise DifflmError(f"{path} cannot be read ({why}): restore it from a copy{aside}")


def trained_settings(run_dir, step: Optional[int] = None, keys: tuple[str, str] = ("run.dir", "step")):
    """(settings, checkpoint directory, step) of checkpoint ``step`` of a trained run (None: the newest): the run
    config that checkpoint was trained with (:func:`checkpoint_config_path`: a later resume may have changed the
    run's own config.yaml, e.g. to another objective) over the schema's defaults. What difflm-generate, -eval and
    -export read a run through.

    Raises: DifflmError when ``run_dir`` has no config.yaml or no (matching) checkpoint, naming ``keys`` (the
    command's keys of the run directory and the step, :func:`find_checkpoint`).
    """
    from omegaconf import OmegaConf

    from difflm.config.schema import RunConfig

    path = Path(run_dir)
    if not (path / CONFIG).exists():
        raise DifflmError(f"{keys[0]}={str(run_dir)!r} has no config.yaml: point {keys[0]} at a difflm-train output "
                          "directory (or a difflm-import one)")
    step, ckpt = find_checkpoint(path, step, keys)
    return OmegaConf.merge(OmegaConf.structured(RunConfig), read_settings(checkpoint_config_path(path, ckpt))), ckpt, step


def _first_cause(exc: BaseException) -> str:
    """The informative line of a DCP error (it wraps each rank's traceback into one message)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln and ":" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else type(exc).__name__


def _unreadable(exc: BaseException) -> Optional[BaseException]:
    """The error of a checkpoint file whose bytes cannot be decoded (a pickle, a zip archive or a storage cut short
    or overwritten), from a DCP load's exception (each rank's failure and its chain); None when the files were read
    and the load failed on their content (another model's shapes or names)."""
    import pickle
    import zipfile

    for err in _failure_chain(exc):
        if isinstance(err, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, UnicodeDecodeError)) or (
                isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err)):
            return err
    return None


def damaged_checkpoint(path: Path, exc: BaseException) -> Optional[DifflmError]:
    """The one-line error for a checkpoint at ``path`` whose files cannot be read (:func:`_unreadable`), or None.
    Its files have the sizes its manifest records, so only their bytes changed (a disk or copy fault):
    ``train.checkpoint_checksums=true`` records each file's SHA-256, and a resume then moves such a checkpoint aside
    by itself."""
    err = _unreadable(exc)
    if err is None:
        return None
    why = " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return DifflmError(f"checkpoint {path} is damaged: its files cannot be read ({why}); restore it from a copy, or "
                       f"move {Path(path).name} away to use an earlier checkpoint (train.checkpoint_checksums=true "
                       "finds such damage at resume and moves the checkpoint aside by itself)")


def checkpoint_keys(path: Path) -> Optional[set[str]]:
    """The flattened keys of the DCP checkpoint at ``path`` (``model.<name>``, ``optim.<...>``), or None when its
    metadata cannot be read (``dcp.load`` then reports the problem)."""
    import torch.distributed.checkpoint as dcp

    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - a missing/corrupt checkpoint fails with a clear message in dcp.load
        return None


def _refuse_unreadable_metadata(path: Path) -> None:
    """Raise :func:`damaged_checkpoint`'s error when the DCP metadata of ``path`` cannot be decoded; other failures
    to read it are left to ``dcp.load`` to report."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - only undecodable bytes are reported here
        damaged = damaged_checkpoint(path, exc)
        if damaged is not None:
            raise damaged from exc


def has_optimizer_state(path: Path) -> bool:
    """Whether the DCP checkpoint at ``path`` holds optimizer state (keys under ``optim``); True when its metadata
    cannot be read."""
    keys = checkpoint_keys(path)
    return keys is None or any(k == "optim" or k.startswith("optim.") for k in keys)


EXTRA_STATE_SUFFIX = "_extra_state"


def _absent_extra_state(model_sd: dict, keys: Optional[set[str]]) -> dict:
    """The TE ``_extra_state`` entries (FP8 scaling metadata) of ``model_sd`` that the checkpoint lacks (one written
    by the torch kernels), taken out of ``model_sd``: loading into the TE kernels keeps their fresh metadata instead
    of asking DCP for entries that do not exist."""
    if keys is None:
        return {}
    absent = [n for n in model_sd if n.endswith(EXTRA_STATE_SUFFIX) and f"model.{n}" not in keys]
    return {n: model_sd.pop(n) for n in absent}


def _refuse_unplaced_tensors(path: Path, model_sd: dict, keys: Optional[set[str]]) -> None:
    """Raise DifflmError when the checkpoint holds model tensors this model has no place for.

    ``dcp.load`` fills only the entries it is asked for, so a smaller model (fewer layers, tied embeddings, no
    QK-norm) would load silently with part of the trained weights dropped. Under pipeline parallelism a rank holds
    only its stage's entries, so the names of every rank are gathered first. TE's ``_extra_state`` (FP8 scaling
    metadata) is left out: a checkpoint of the TE kernels loads into the torch kernels without it.
    """
    if keys is None:
        return
    names = {n for n in model_sd if not n.endswith(EXTRA_STATE_SUFFIX)}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = set().union(*gathered)
    unplaced = sorted(k[len("model."):] for k in keys if k.startswith("model.") and
                      not k.endswith(EXTRA_STATE_SUFFIX) and k[len("model."):] not in names)
    if unplaced:
        raise CheckpointMismatch(f"checkpoint {path} does not match this model: it holds {len(unplaced)} tensor(s) "
                                 f"this model has no place for ({', '.join(unplaced[:3])}"
                                 f"{', ...' if len(unplaced) > 3 else ''}), so their trained values would be dropped: "
                                 "resume with the model config it was saved with, or use a new run.dir")


# param_group entries a checkpoint does not set: the parameters themselves, and the learning rate, which the LR
# schedule's position sets (difflm.training.schedule.restore_scheduler)
_GROUP_KEYS_FROM_CHECKPOINT_OR_SCHEDULE = ("params", "lr")


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param_group's hyperparameters (weight_decay, betas, eps, fused, initial_lr, ...), without its parameters
    and learning rate: what :func:`restore_optimizer_settings` puts back after a state-dict load."""
    return [{k: v for k, v in group.items() if k not in _GROUP_KEYS_FROM_CHECKPOINT_OR_SCHEDULE}
            for group in optimizer.param_groups]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict]) -> None:
    """Put ``settings`` (:func:`optimizer_settings` of the same optimizer) back into its param_groups, group by group.

    ``Optimizer.load_state_dict`` replaces every param_group entry with the saved one, so a resume with another
    ``optim.weight_decay``, ``optim.beta1``/``beta2`` or ``optim.eps`` would run on with the checkpoint's values
    while the resume line names the new ones. Group by group: the decay stays on the groups built with it
    (:func:`difflm.training.optimizer.build_optimizer`: matrices decay, norm scales and biases do not)."""
    if len(settings) != len(optimizer.param_groups):  # the load keeps the optimizer's own grouping
        raise ValueError(f"{len(settings)} param_group settings for {len(optimizer.param_groups)} groups")
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    trainable_only: bool = False) -> dict:
    """Load model (and optimizer, when given) state in place; returns the trainer state dict.

    The optimizer's state (moments, step counts) and learning rates are read from the checkpoint; its other
    param_group hyperparameters stay those it was built with (:func:`restore_optimizer_settings`), so a resume runs
    with the run's ``optim.*``. A model-only checkpoint (saved with ``optimizer=None``, e.g. by ``difflm-import``)
    loads into the model and leaves ``optimizer`` as it is (fresh). Checkpoints move between kernel sets
    (``model.backend``): parameter names are shared, TE's ``_extra_state`` is read when both sides have it and
    otherwise left alone. Raises DifflmError when the checkpoint does not match the model (e.g. another ``model``
    preset). ``trainable_only``: the checkpoint holds only the parameters that require gradients (a LoRA run's,
    :func:`save_checkpoint`); the frozen ones are left as they are.
    """
    from difflm.parallel.tensor_parallel import finish_canonical_load, canonical_layouts, prepare_canonical_load
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    if optimizer is not None and not has_optimizer_state(path):
        optimizer = None
    settings = optimizer_settings(optimizer) if optimizer is not None else None  # before the load replaces them
    options = StateDictOptions(strict=not trainable_only, flatten_optimizer_state_dict=True,
                               ignore_frozen_params=trainable_only)
    target = _state_model(model)
    if optimizer is None:
        model_sd, optim_sd = get_state_dict(target, [], options=options)[0], None
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(target, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    keys = checkpoint_keys(path)
    if keys is None:
        _refuse_unreadable_metadata(path)
    _refuse_unplaced_tensors(path, model_sd, keys)
    fresh = _absent_extra_state(model_sd, keys)
    pending = prepare_canonical_load(model_sd, optim_sd, canonical_layouts(_parts(model)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        damaged = damaged_checkpoint(path, exc)
        if damaged is not None:
            raise damaged from exc
        raise CheckpointMismatch(f"checkpoint {path} does not match this model ({_first_cause(exc)}): "
                                 "resume with the model config it was saved with, or use a new run.dir") from exc
    finish_canonical_load(pending)
    model_sd.update(fresh)
    set_state_dict(target, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=options)
    if optimizer is not None:  # the run's optim.* win over the saved param_group values
        restore_optimizer_settings(optimizer, settings)
    return read_trainer_state(path)


def load_base_weights(path: Path, model) -> None:
    """Load the frozen (base) parameters of ``model`` (a module or a rank's model parts, any layout) from the
    checkpoint at ``path`` (a ``difflm-import`` step_0, a full run's checkpoint), model only: a LoRA run's base
    (docs/lora.md). Adapter parameters and the checkpoint's optimizer state are not read.

    Raises: DifflmError when ``path`` has no complete checkpoint or its tensors do not match the base model.
    """
    from difflm.parallel.tensor_parallel import finish_canonical_load, canonical_layouts, prepare_canonical_load
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    if not path.is_dir() or manifest_problem(path) is not None:
        raise DifflmError(f"checkpoint {path} (the base of this LoRA run) is missing or incomplete: restore it, or "
                          "start the LoRA run in a new run.dir from a base checkpoint")
    target = _state_model(model)
    full = get_state_dict(target, [], options=StateDictOptions())[0]
    model_sd = {k: v for k, v in full.items() if ".lora." not in f".{k}"}  # not the adapters (difflm.model.lora)
    keys = checkpoint_keys(path)
    if keys is None:
        _refuse_unreadable_metadata(path)
    _absent_extra_state(model_sd, keys)
    pending = prepare_canonical_load(model_sd, None, canonical_layouts(_parts(model)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": model_sd}, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:
        damaged = damaged_checkpoint(path, exc)
        if damaged is not None:
            raise damaged from exc
        raise CheckpointMismatch(f"checkpoint {path} does not match this model's base ({_first_cause(exc)}): "
                                 "train the LoRA run with the model config of its base") from exc
    finish_canonical_load(pending)
    set_state_dict(target, [], model_state_dict=model_sd, optim_state_dict={},
                   options=StateDictOptions(strict=False))


def read_trainer_state(path: Path) -> dict:
    """The trainer state (step, schedule, sampler, RNG) of the checkpoint at ``path``.

    Raises: DifflmError naming the file when it cannot be read."""
    path = Path(path)
    try:
        return torch.load(path / TRAINER_STATE, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file of a complete-looking checkpoint: one line
        raise DifflmError(f"checkpoint {path}: {TRAINER_STATE} cannot be read ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]}): restore it, or move {path.name} away to resume from "
                          "an earlier checkpoint") from None


def load_trained_weights(run_dir: Path, checkpoint: Path, model: torch.nn.Module, cfg) -> None:
    """Load checkpoint ``checkpoint`` of run ``run_dir`` into ``model`` (one process, whole tensors), a LoRA run's too:
    with ``lora.rank > 0`` in ``cfg`` (the settings the checkpoint was trained with) the adapters are added to
    ``model`` (:func:`difflm.model.lora.apply_lora`), the base read from the checkpoint the run names (or the keyed
    init of ``train.seed``) and the adapters from ``checkpoint``. What difflm-eval, -generate and -export call.

    Raises: DifflmError when a checkpoint does not match the model or a LoRA run's base checkpoint is gone.
    """
    from difflm.model.lora import apply_lora, is_adapter, lora_enabled

    lora = cfg.get("lora")
    if not lora_enabled(lora):
        load_checkpoint(checkpoint, model)
        return
    lora = lora.copy()
    lora.dropout = 0.0  # no parameters; off for inference, so the TE kernels (weight-side adapters) take the run too
    state = read_trainer_state(checkpoint)
    if "lora_base" not in state:
        # the base itself (no adapters trained yet: they start at B = 0), or base and adapters in one checkpoint
        # (a difflm-rl run of a LoRA run, whose run.dir holds no base checkpoint of its own)
        inline = bool(state.get("lora_whole")) or any(is_adapter(k) for k in (checkpoint_keys(checkpoint) or ()))
        if inline:
            apply_lora(model, lora, seed=int(cfg.train.seed))
        load_checkpoint(checkpoint, model)
        if not inline:
            apply_lora(model, lora, seed=int(cfg.train.seed))
        return
    base = int(state["lora_base"])
    if base < 0:
        model.init_weights(int(cfg.train.seed))
    apply_lora(model, lora, seed=int(cfg.train.seed))
    if base >= 0:
        load_base_weights(checkpoints_root(run_dir) / f"step_{base}", model)
    load_checkpoint(checkpoint, model, trainable_only=True)
