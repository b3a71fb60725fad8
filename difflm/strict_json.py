"""JSON that strict parsers read: every file difflm writes as JSON goes through :func:`dumps`.

RFC 8259 (sec. 6) has no NaN or Infinity, and Python's ``json.dumps`` writes them as the bare words ``NaN`` and
``Infinity`` unless ``allow_nan=False``: a parser that follows the standard (``json.loads`` with a raising
``parse_constant``, JavaScript's ``JSON.parse``, jq, pandas' and wandb's strict readers) rejects the whole line.
Here a non-finite float becomes ``null``, and the keys that were non-finite are listed under ``nonfinite`` (an
object's top level only, when ``flag`` is on), so a reader can tell "not logged" from "NaN / inf" without the file
ceasing to be JSON.
"""
from __future__ import annotations

import json
import math
from typing import Any

NONFINITE_KEY = "nonfinite"


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf; numpy floats included, as ``float`` subclasses) replaced by
    None, recursively through dicts, lists and tuples (tuples become lists, as JSON writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def nonfinite_keys(record: dict) -> list[str]:
    """The top-level keys of ``record`` whose value is a non-finite float, in order."""
    return [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]


def dumps(obj: Any, flag: bool = False, **kwargs) -> str:
    """``json.dumps(obj, **kwargs)`` with non-finite floats written as null (:func:`finite`); with ``flag`` and a
    dict ``obj`` that had any, ``"nonfinite": [their keys]`` is added. ``allow_nan=False`` stays on, so a NaN that
    slipped through (e.g. one a ``default=`` hook returned) raises ValueError rather than writing invalid JSON."""
    bad = nonfinite_keys(obj) if flag and isinstance(obj, dict) else []
    clean = finite(obj)
    if bad:
        clean[NONFINITE_KEY] = bad
    kwargs.setdefault("allow_nan", False)
    return json.dumps(clean, **kwargs)


__all__ = ["NONFINITE_KEY", "dumps", "finite", "nonfinite_keys"]
