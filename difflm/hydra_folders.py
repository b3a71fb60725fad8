"""The folders Hydra creates for one invocation (a run's ``hydra.run.dir``, a sweep's folder and its jobs'), noted
as they are made (:class:`difflm.training.run_dir.RunDirGuard`), so that a run refused after Hydra made them takes
back those that hold nothing but Hydra's own records (:func:`remove_refused_run_dirs`, called by
:func:`difflm.cli.exits_cleanly`): a refused run leaves no empty ``outputs/<time>/`` or sweep folder behind.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

# folders Hydra created for this invocation, noted by RunDirGuard (rank 0): (folder, the outermost folder its
# creation made, the names in it that only Hydra and the guard write)
_CREATED: list[tuple[Path, Path, frozenset]] = []


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


__all__ = ["forget_created", "note_created", "outermost_missing", "remove_refused_run_dirs"]
