"""Where a config value came from: the preset or recipe file that set it, for error messages.

A value that the user never typed (``model.num_kv_heads=16`` from ``experiment=megadlm_1.7b``, on top of
``model=tiny``) is hard to fix from a message that only names the key. Hydra composes a run from its defaults list
(Hydra docs, "The Defaults List": configs merge in list order, later ones win, and command-line ``key=value``
overrides win over all), so the file that set a key is the last entry of that list whose config holds the key,
unless the command line set it. :func:`key_sources` computes that from Hydra's own defaults list
(``ConfigLoader.compute_defaults_list``); :func:`name_sources` appends it to a message for every ``key=value`` the
message names that a preset or recipe (a config-group file) set.

So a refusal spells ``key=value`` for the keys whose values are wrong (one key out of range alone, or every key of a
relation that does not hold: ``t_lo < t_hi``, a block size dividing ``data.seq_len``) and for the keys its way out
sets; a key given only as context (another key's value that is fine on its own, a trained run's fixed setting) is
named without ``=``, so that no note points at a value the user need not change. The validators check each key's
own range before a relation of several keys (:mod:`difflm.config.validate`).
"""
from __future__ import annotations

import re
from typing import Optional

# ``model.num_heads=4``: a dotted key followed by ``=``, as difflm's messages spell values
_KEY_RE = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)=")


def _leaf_keys(node, prefix: str) -> list[str]:
    from omegaconf import DictConfig

    if not isinstance(node, DictConfig):
        return [prefix] if prefix else []
    out = []
    for key in node.keys():
        if key == "defaults" and not prefix:
            continue
        out += _leaf_keys(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
    return out


def key_sources(config_name: str, overrides: list[str]) -> dict[str, str]:
    """``{dotted key: config path}`` (e.g. ``{"model.num_kv_heads": "experiment/megadlm_1.7b"}``) for every key that a
    config-group file of the run's defaults list sets last (primary and schema configs, Hydra's own groups and keys
    set on the command line are left out). Needs an initialised Hydra (a running app or ``initialize_config_dir``)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults
    groups = {d.override_key for d in defaults if d.override_key}
    sources: dict[str, str] = {}
    for d in defaults:
        if d.config_path is None or d.config_path.startswith("hydra/") or d.primary or d.is_self and d.parent is None:
            continue
        if "/" not in d.config_path:  # a schema or the primary config: the defaults, not a preset
            continue
        loaded = loader.repository.load_config(d.config_path)
        if loaded is None:
            continue
        package = (d.package or "").strip(".")
        for key in _leaf_keys(loaded.config, ""):
            sources[f"{package}.{key}" if package else key] = d.config_path
    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except Exception:  # noqa: BLE001 - Hydra reports its own syntax errors
            continue
        key = override.key_or_group
        if key not in groups:  # key=value typed by the user: theirs, whatever a file said
            for known in [k for k in sources if k == key or k.startswith(key + ".")]:
                del sources[known]
    return sources


def describe(config_path: str) -> str:
    """``experiment/megadlm_1.7b`` -> ``experiment=megadlm_1.7b in conf/experiment/megadlm_1.7b.yaml``."""
    group, _, option = config_path.rpartition("/")
    return f"{group}={option} in conf/{config_path}.yaml"


def name_sources(message: str, sources: dict[str, str]) -> str:
    """``message`` with, for each ``key=`` it names that a preset or recipe set (``sources``, :func:`key_sources`),
    where that value came from and how to change it, in the same line. A key the message says ``is not set`` gets
    no note: a recipe that leaves it null set nothing to change."""
    notes, seen = [], set()
    for key in _KEY_RE.findall(message):
        if key in seen or key not in sources or f"{key} is not set" in message:
            continue
        seen.add(key)
        notes.append(f"{key} is set by {describe(sources[key])}")
    if not notes:
        return message
    return f"{message} ({'; '.join(notes)}: pass the key on the command line to change it)"


def running_sources() -> Optional[dict[str, str]]:
    """:func:`key_sources` of the running Hydra app (its config name and command-line overrides), or None outside one
    or when the defaults list cannot be computed again."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    try:
        return key_sources(hc.job.config_name, list(hc.overrides.task))
    except Exception:  # noqa: BLE001 - provenance is a courtesy; the error itself must still be said
        return None


__all__ = ["describe", "key_sources", "name_sources", "running_sources"]
