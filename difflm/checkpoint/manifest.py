"""Completion manifest of a checkpoint: the last file written, listing every other file with its size
(and optionally its SHA-256). A checkpoint whose manifest is missing or does not match the files on disk
is incomplete or corrupt and is never resumed from.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from difflm import strict_json

MANIFEST = "manifest.json"


def file_sha256(path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks (also keys the token caches)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt_dir: Path, checksums: bool = False) -> None:
    """List every file under ``ckpt_dir`` (relative path -> size, sha256) in ``manifest.json``."""
    files = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            entry = {"size": p.stat().st_size}
            if checksums:
                entry["sha256"] = file_sha256(p)
            files[str(p.relative_to(ckpt_dir))] = entry
    (ckpt_dir / MANIFEST).write_text(strict_json.dumps({"version": 1, "files": files}, indent=1))


def manifest_problem(ckpt_dir: Path) -> Optional[str]:
    """None when ``ckpt_dir`` matches its manifest, else what is wrong (one line)."""
    path = Path(ckpt_dir) / MANIFEST
    if not path.exists():
        return "no manifest.json (the save did not finish)"
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest.json ({type(exc).__name__}: {exc})"
    if not isinstance(files, dict) or not files or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values()):
        return "unreadable manifest.json (its files are not listed as {name: {size, ...}})"
    for rel, entry in files.items():
        p = Path(ckpt_dir) / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != entry["size"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and file_sha256(p) != entry["sha256"]:
            return f"{rel} does not match its SHA-256"
    return None
