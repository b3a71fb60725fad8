"""The folders Hydra creates for one invocation (a run's ``hydra.run.dir``, a sweep's folder and its jobs'), noted
as they are made (:class:`difflm.training.run_dir.RunDirGuard`), so that a run refused after Hydra made them takes
back those that hold nothing but Hydra's own records (:func:`remove_refused_run_dirs`, called by
:func:`difflm.cli.exits_cleanly`): a refused run leaves no empty ``outputs/<time>/`` or sweep folder behind. In a
folder that existed (a run launched again), Hydra's records of the earlier invocation are kept before Hydra
rewrites them (:func:`keep_records`) and put back on a refusal, so that ``.hydra/`` keeps describing what trained.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

# folders Hydra created for this invocation, noted by RunDirGuard (rank 0): (folder, the outermost folder its
# creation made, the names in it that only Hydra and the guard write)
_CREATED: list[tuple[Path, Path, frozenset]] = []
# Hydra's records in a folder that existed before this invocation, as they were: (folder, {relative path: bytes, or
# None for a file that did not exist}); put back by remove_refused_run_dirs, dropped by accept_records
_KEPT: list[tuple[Path, dict]] = []


def outermost_missing(path: Path) -> Optional[Path]:
    """The outermost folder of ``path`` (itself included) that does not exist yet, i.e. what creating ``path`` with
    its parents makes; None when ``path`` exists."""
    path = Path(path).absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists():
        top = top.parent
    return top


def note_created(path, records, top: Optional[Path] = None) -> None:
    """Note ``path`` as a folder this invocation creates, for :func:`remove_refused_run_dirs`. ``records``: the
    names in it that only Hydra and the guard write; ``top``: the outermost folder its creation made (default: found
    now, before ``path`` is created; nothing is noted when ``path`` exists already)."""
    top = outermost_missing(Path(path)) if top is None else top
    if top is not None:
        _CREATED.append((Path(path).absolute(), Path(top).absolute(), frozenset(records)))


def keep_records(path, records) -> None:
    """Before Hydra writes its records (``records``: names of files or folders in ``path``, e.g. ``.hydra`` and the
    job's log) into the existing folder ``path``, keep them as they are, so that a refusal can put back what the
    earlier invocation wrote (:func:`remove_refused_run_dirs`). Nothing is kept for a folder that does not exist."""
    path = Path(path).absolute()
    if not path.is_dir():
        return
    kept = {}
    for name in records:
        entry = path / name
        if entry.is_symlink():
            continue
        if entry.is_dir():
            kept[name] = {str(f.relative_to(entry)): f.read_bytes() for f in entry.rglob("*")
                          if f.is_file() and not f.is_symlink()}
        elif entry.is_file():  # the job's log, which Hydra appends to: its length is enough to put it back
            kept[name] = entry.stat().st_size
        else:
            kept[name] = None  # not there: Hydra's new one goes
    _KEPT.append((path, kept))


def accept_records(path) -> None:
    """The run in ``path`` was accepted (it records its settings): Hydra's new records stay, even if it stops later."""
    path = Path(path).absolute()
    _KEPT[:] = [entry for entry in _KEPT if entry[0] != path]


def _put_back(path: Path, kept: dict) -> None:
    """Restore in ``path`` the records :func:`keep_records` kept: each folder's files exactly, each appended file
    cut back to its length, and what was not there removed."""
    for name, was in kept.items():
        entry = path / name
        if isinstance(was, int):  # an appended file: cut back to its length before this invocation
            if entry.is_file() and not entry.is_symlink() and entry.stat().st_size >= was:
                os.truncate(entry, was)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
        if isinstance(was, dict):
            for rel, data in was.items():
                (entry / rel).parent.mkdir(parents=True, exist_ok=True)
                (entry / rel).write_bytes(data)


def forget_created(path) -> None:
    """Drop ``path`` from the folders :func:`remove_refused_run_dirs` may take back (its run or job ended)."""
    path = Path(path).absolute()
    _CREATED[:] = [entry for entry in _CREATED if entry[0] != path]


def _holds_only(path: Path, records: frozenset) -> bool:
    """Whether the folder ``path`` holds nothing but ``records`` (by name) and folders without files."""
    for entry in path.iterdir():
        if entry.name in records:
            continue
        if entry.is_dir() and not entry.is_symlink() and all(p.is_dir() and not p.is_symlink()
                                                             for p in entry.rglob("*")):
            continue
        return False
    return True


def remove_refused_run_dirs() -> list[Path]:
    """After a refusal (:func:`difflm.cli.exits_cleanly`: one line, exit status 2), remove the folders noted by
    :func:`note_created` that still hold only Hydra's records (``.hydra/``, the job's log, the ``run.dir`` lock, a
    sweep's ``multirun.yaml``) and folders without files, newest first (a sweep's job before the sweep), then the
    parents that their creation made once they are empty (``outputs/`` of the default ``run.dir``). A folder that
    existed before the command, or in which anything else was written, is left as it is. Returns the removed
    folders; a folder that cannot be removed is left (the refusal is what the user needs to read)."""
    for path, files in reversed(_KEPT):
        try:
            _put_back(path, files)
        except OSError:
            continue
    _KEPT.clear()
    removed = []
    for path, top, records in reversed(_CREATED):
        try:
            if not path.is_dir() or not _holds_only(path, records):
                continue
            shutil.rmtree(path)
            removed.append(path)
            parent = path
            while parent != top and top in parent.parents:
                parent = parent.parent
                parent.rmdir()  # only when empty: OSError otherwise, which ends the climb
                removed.append(parent)
        except OSError:
            continue
    _CREATED.clear()
    return removed


__all__ = ["accept_records", "forget_created", "keep_records", "note_created", "outermost_missing",
           "remove_refused_run_dirs"]
