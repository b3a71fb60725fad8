"""Claiming ``run.dir`` for one training run: the path must be a writable directory, and one run holds it.

Two runs writing the same ``run.dir`` interleave their metrics and replace each other's checkpoints. The run
that starts first takes an exclusive ``fcntl.flock`` on ``<run.dir>/.difflm.lock`` and holds it until it
ends; a second run finds it held and stops with one line. The kernel drops a flock when its process dies
(exit, crash, ``kill -9``), so a stale lock file never blocks a resume (Linux ``flock(2)``; it also holds
across NFS clients on Linux >= 2.6.12, where flock is emulated with POSIX byte-range locks).

``difflm-train`` and ``difflm-rl`` claim the directory in a Hydra callback (:class:`RunDirGuard`, listed under
``hydra.callbacks`` in ``conf/train.yaml`` and ``conf/rl.yaml``) *before* Hydra creates the directory and writes
``.hydra/`` into it. Under torchrun or SLURM only global rank 0 claims it (the other ranks take rank 0's ``run.dir``;
when rank 0 stops, the launcher ends them). The guard also notes which folders Hydra created for this invocation, so
that a run refused after Hydra made them (a one-line error, exit status 2) takes back those that hold nothing but
Hydra's records (:func:`difflm.hydra_folders.remove_refused_run_dirs`): a refused run leaves no empty
``outputs/<time>/`` behind.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, IO, Optional

from hydra.experimental.callback import Callback
from hydra.types import RunMode

from difflm.errors import DifflmError
from difflm.hydra_folders import accept_records, forget_created, keep_records, note_created, outermost_missing

LOCK_FILE = ".difflm.lock"

# What a run leaves in run.dir that a later run there would pick up as its own: metrics.jsonl is appended to,
# wandb_id.txt resumes that W&B run, config*.yaml and rl_config*.yaml (difflm-rl's command line) describe settings
# the new run never had, and it would write over them. Inputs and caches stay:
# tokenizer/ (difflm-import's), data_cache/ (keyed by source content and tokenizer), and this invocation's
# .hydra/ and train.log (Hydra has written them before the trainer starts).
RUN_RECORDS = ("metrics.jsonl", "samples.txt", "wandb_id.txt", "wandb", "config.yaml", "config.step_*.yaml",
               "rl_config.yaml", "rl_config.step_*.yaml", "profile", "hang_rank*.txt")
PREVIOUS_DIR = "previous"


def check_run_dir(run_dir: str | Path) -> None:
    """Refuse a ``run.dir`` that is not (or cannot become) a directory, before anything is written.

    Raises: DifflmError naming ``run.dir`` when it, or its ``checkpoints`` entry, is an existing file.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise DifflmError(f"run.dir={str(run_dir)!r} is an existing file, not a directory: choose another run.dir "
                          "(the file was left as it is)")
    ckpts = path / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():
        raise DifflmError(f"run.dir={str(run_dir)!r} holds a file named checkpoints where the checkpoint directory "
                          "goes: move it away or choose another run.dir")


def check_sweep_dir(run_dir: str | Path) -> None:
    """Refuse a ``-m`` sweep whose ``run.dir`` holds checkpoints of its own (e.g. a ``difflm-import`` base, or a run
    to fine-tune): every job runs in ``<run.dir>/<job number>``, which holds none, so each job would start without
    them (a LoRA job on the keyed init instead of the imported weights) and nothing would say so.

    Raises: DifflmError naming ``run.dir``, its newest checkpoint and what to do instead."""
    from difflm.checkpoint.store import list_checkpoints

    found = list_checkpoints(Path(run_dir))
    if found:
        raise DifflmError(f"run.dir={str(run_dir)!r} holds checkpoints ({found[-1][1].name}), and under -m each job "
                          "runs in <run.dir>/<job number> without them (it would not start from these weights): run "
                          "each setting as its own command on its own copy of the run (cp -r RUN RUN-a; ... "
                          "run.dir=RUN-a), or sweep into a new run.dir")


def claim_run_dir(run_dir: str | Path) -> IO[str]:
    """Create ``run_dir`` if needed and take its exclusive lock; returns the open lock file (keep it open: closing
    it, or the process ending, releases the lock).

    Raises: DifflmError naming ``run.dir`` when it is a file (:func:`check_run_dir`), cannot be created or written
        (with the OS's reason), or is held by another running process (whose pid and host the message names).
    """
    check_run_dir(run_dir)
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = open(path / LOCK_FILE, "a+", encoding="utf-8")
    except OSError as exc:
        raise DifflmError(f"run.dir={str(run_dir)!r} cannot be created or written ({exc.strerror or exc}): choose a "
                          "writable run.dir") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DifflmError(f"run.dir={str(run_dir)!r} is in use by another run ({holder}): wait for it to end, or "
                              "choose another run.dir") from None
        raise DifflmError(f"run.dir={str(run_dir)!r}: cannot lock {LOCK_FILE} ({exc.strerror or exc}): choose a "
                          "run.dir on a file system with flock support") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
    except OSError as exc:  # a full disk: nothing else the run writes would fit either
        with contextlib.suppress(OSError):  # the close flushes the same bytes again
            handle.close()
        raise DifflmError(f"run.dir={str(run_dir)!r} cannot be written ({exc.strerror or exc}): make room there or "
                          "choose another run.dir") from None
    return handle


def release_run_dir(handle: Optional[IO[str]]) -> None:
    """Release a lock taken by :func:`claim_run_dir` (the lock file stays; a later run reuses it)."""
    if handle is not None and not handle.closed:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


@contextlib.contextmanager
def held_run_dir(run_dir: str | Path):
    """``with held_run_dir(d):`` holds ``d``'s lock (:func:`claim_run_dir`) for the block and releases it after,
    also when the block raises (difflm-import's writes)."""
    handle = claim_run_dir(run_dir)
    try:
        yield handle
    finally:
        release_run_dir(handle)


def run_records(run_dir: str | Path) -> list[Path]:
    """The records of an earlier run in ``run_dir`` (:data:`RUN_RECORDS`), sorted; [] for none."""
    path = Path(run_dir)
    if not path.is_dir():
        return []
    return sorted({p for pattern in RUN_RECORDS for p in path.glob(pattern)})


def set_aside_run_records(run_dir: str | Path) -> Optional[Path]:
    """Move the records of an earlier run (:func:`run_records`) into ``run_dir/previous/<YYYYmmdd-HHMMSS>/`` (a
    ``-<k>`` suffix when taken), so a run that starts afresh there writes its own metrics, config and W&B run.
    Nothing is deleted. Call it only while holding ``run_dir`` (:func:`claim_run_dir`; under torchrun: global rank
    0). Returns the folder, or None when there was nothing to move.

    Raises: DifflmError naming ``run.dir`` when a record cannot be moved (with the OS's reason).
    """
    records = run_records(run_dir)
    if not records:
        return None
    base = Path(run_dir) / PREVIOUS_DIR / time.strftime("%Y%m%d-%H%M%S")
    dest, k = base, 1
    while dest.exists():  # two fresh starts in one second: never merge into (or replace) an earlier folder
        dest, k = base.with_name(f"{base.name}-{k}"), k + 1
    try:
        dest.mkdir(parents=True)
        for record in records:
            os.replace(record, dest / record.name)  # same file system: a rename, atomic per record
    except OSError as exc:
        raise DifflmError(f"run.dir={str(run_dir)!r}: cannot move the earlier run's records into {dest} "
                          f"({exc.strerror or exc}): move them away yourself or choose another run.dir") from None
    return dest


def remove_path(path: Path, what: str) -> None:
    """Delete the file or directory ``path`` (no error if absent). A directory is first renamed to a hidden
    ``.<name>.removing-<pid>`` next to it, so nothing sees it half deleted under its own name, then removed.

    Raises: DifflmError naming ``what`` and ``path`` when it cannot be removed (with the OS's reason).
    """
    try:
        if not path.is_dir() or path.is_symlink():
            path.unlink(missing_ok=True)
            return
        doomed = path.with_name(f".{path.name}.removing-{os.getpid()}")
        if doomed.exists():  # left by an earlier removal that failed part way
            shutil.rmtree(doomed)
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    except OSError as exc:
        raise DifflmError(f"{what}: cannot remove {path} ({exc.strerror or exc}): check its permissions, or remove "
                          "it yourself and rerun") from None


def _global_rank() -> int:
    from difflm.parallel.distributed import launch_env

    return launch_env()["rank"]


def _exit_on_error(fn, *args) -> Any:
    """Run ``fn``; a DifflmError ends the process as every entry point does (one line, exit status 2)."""
    from difflm.cli import exits_cleanly

    return exits_cleanly(fn)(*args)


class RunDirGuard(Callback):
    """Hydra callback (``hydra.experimental.callback.Callback``) that claims ``run.dir``.

    A single run claims ``hydra.run.dir`` in ``on_run_start``, before Hydra creates it. In a multirun the sweep
    directory is checked in ``on_multirun_start`` and each job claims its own directory in ``on_job_start``.
    Only global rank 0 claims; the lock is released when the run or job ends (or the process dies).
    """

    def __init__(self) -> None:
        self._handle: Optional[IO[str]] = None
        self._sweep_created = False  # this invocation created the sweep directory (its jobs' folders are new too)

    def _claim(self, run_dir: str) -> None:
        if _global_rank() == 0:
            self._handle = _exit_on_error(claim_run_dir, run_dir)

    def _release(self) -> None:
        release_run_dir(self._handle)
        self._handle = None

    @staticmethod
    def _records(config) -> tuple[str, ...]:
        """What Hydra and the guard write into a run or job folder: ``.hydra/``, the job's log, the lock."""
        from omegaconf import OmegaConf

        name = OmegaConf.select(config, "hydra.job.name", default=None)
        return (".hydra", LOCK_FILE) + ((f"{name}.log",) if name else ())

    def on_run_start(self, config, **kwargs: Any) -> None:
        run_dir = str(config.hydra.run.dir)
        top = outermost_missing(Path(run_dir))  # before the claim creates it
        self._claim(run_dir)
        if top is not None and _global_rank() == 0:
            note_created(run_dir, self._records(config), top)
        elif _global_rank() == 0:  # a run launched again: a refusal puts back the records of what trained
            keep_records(run_dir, [r for r in self._records(config) if r != LOCK_FILE])

    def on_run_end(self, config, **kwargs: Any) -> None:
        self._release()
        forget_created(str(config.hydra.run.dir))
        accept_records(str(config.hydra.run.dir))

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if _global_rank() == 0:
            _exit_on_error(check_run_dir, str(config.hydra.sweep.dir))
            _exit_on_error(check_sweep_dir, str(config.hydra.sweep.dir))
            self._sweep_created = outermost_missing(Path(str(config.hydra.sweep.dir))) is not None
            note_created(str(config.hydra.sweep.dir), ("multirun.yaml",))

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        forget_created(str(config.hydra.sweep.dir))

    def on_job_start(self, config, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            job_dir = str(config.hydra.runtime.output_dir)
            if self._sweep_created and _global_rank() == 0:  # Hydra made it inside the new sweep folder
                note_created(job_dir, self._records(config), Path(job_dir))
            self._claim(job_dir)

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            self._release()
            forget_created(str(config.hydra.runtime.output_dir))
