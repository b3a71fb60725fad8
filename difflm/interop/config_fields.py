"""The fields ``difflm-import`` reads from a model's ``config.json``, each refused in one line naming the field and the
file when it is missing or not a number of the kind needed (instead of ``int(None)``'s ``TypeError`` or a ``KeyError``):
:func:`need_int` / :func:`need_float` for a required field, :func:`opt_int` / :func:`opt_float` for an optional one.

``hf`` is the source as the command names it (``hf=...``), ``kind`` the layout whose field it is (``qwen3_moe``,
``llada2``, ...), said in the message so that the user knows which layout the importer read the file as.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence

from difflm.errors import DifflmError


def _where(hf: str) -> str:
    return f"hf={hf!r}: config.json"


def _as_int(value, key: str, hf: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise DifflmError(f"{_where(hf)} has {key}={value!r}, not an integer >= {low}: fix {key} in config.json "
                          "(or save the model again with save_pretrained)")
    return int(value)


def need_int(c: dict, key: str, hf: str, kind: str, low: int = 1, names: Sequence[str] = ()) -> int:
    """``c[key]`` (a ``config.json`` as a dict) as an int >= ``low``; ``names``: other spellings of the field read
    when ``key`` is absent (``num_local_experts`` for ``num_experts``).

    Raises: DifflmError naming ``hf``, config.json, the field and the layout ``kind`` when the field is missing or
    null (e.g. ``hf='q': config.json has no num_experts (or num_local_experts), a required field of the qwen3_moe
    layout: add it ...``),
    or when it is not an integer >= ``low``."""
    for name in (key, *names):
        if c.get(name) is not None:
            return _as_int(c[name], name, hf, low)
    also = f" (or {', '.join(names)})" if names else ""
    raise DifflmError(f"{_where(hf)} has no {key}{also}, a required field of the {kind} layout: add it to "
                      "config.json (the model's own value) or save the model again with save_pretrained")


def need_float(c: dict, key: str, hf: str, kind: str) -> float:
    """``c[key]`` as a float. Raises: DifflmError naming ``hf``, config.json, the field and the layout ``kind`` when
    it is missing or null, or not a number."""
    if c.get(key) is None:
        raise DifflmError(f"{_where(hf)} has no {key}, a required field of the {kind} layout: add it to config.json "
                          "(the model's own value) or save the model again with save_pretrained")
    return opt_float(c, key, hf, 0.0)


def opt_int(c: dict, key: str, hf: str, default: Optional[int], low: int = 0) -> Optional[int]:
    """``c[key]`` as an int >= ``low``, ``default`` when the field is absent, null (or 0 where ``low`` is 1, as the
    releases write "none" for optional sizes). Raises: DifflmError naming the field for another value."""
    value = c.get(key)
    if value is None or (low >= 1 and value == 0 and not isinstance(value, bool)):
        return default
    return _as_int(value, key, hf, low)


def opt_float(c: dict, key: str, hf: str, default: float) -> float:
    """``c[key]`` as a float, ``default`` when the field is absent or null. Raises: DifflmError naming the field for
    a value that is not a number."""
    value = c.get(key)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DifflmError(f"{_where(hf)} has {key}={value!r}, not a number: fix {key} in config.json (or save the "
                          "model again with save_pretrained)")
    return float(value)


def rope_theta(c: dict, hf: str, default: float = 10000.0) -> float:
    """The RoPE base of ``config.json`` ``c``: ``rope_parameters.rope_theta`` (transformers 5 keeps it there), else
    ``rope_theta``, else ``default``. Both ``rope_parameters`` and ``rope_scaling`` are checked (transformers reads
    ``rope_scaling`` first when a config.json has both).

    Raises: DifflmError naming the key for a RoPE type other than ``default`` (scaled RoPE) in either."""
    for key in ("rope_scaling", "rope_parameters"):
        params = c.get(key)
        rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
        if rope_type not in (None, "default"):
            raise DifflmError(f"hf={hf!r} uses rope_type={rope_type!r} ({key}): difflm implements plain RoPE only "
                              "(rope_type default)")
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return opt_float(params, "rope_theta", hf, default)
    return opt_float(c, "rope_theta", hf, default)


__all__ = ["need_float", "need_int", "opt_float", "opt_int", "rope_theta"]
