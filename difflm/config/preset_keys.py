"""Keys that belong to another preset of a group: ``algorithm.group_size`` under ``algorithm=dpo``.

The schema of a group (:class:`~difflm.config.schema.AlgorithmConfig`, ``EstimatorConfig``, ``ObjectiveConfig``) is
the union of the keys of all its presets, so a key only one preset reads composes under every preset and is then
never read. Each preset file of these groups lists every key its code reads, so a command-line key that the
selected preset's file lacks while another preset's file has it is a key of that other preset.
:func:`foreign_key` says so in one line; :func:`difflm.cli.check_overrides` calls it for every ``group.key=value``
of the command line. A key no preset file names (a key every preset shares through the schema) is accepted.
"""
from __future__ import annotations

from typing import Optional

# groups whose presets are variants of one thing, each file listing the keys its variant reads
SCOPED_GROUPS = ("algorithm", "estimator", "objective")


def _preset_keys(loader, group: str, option: str) -> set[str]:
    """The top-level keys of ``conf/<group>/<option>.yaml`` (empty when it cannot be loaded)."""
    loaded = loader.repository.load_config(f"{group}/{option}")
    if loaded is None:
        return set()
    return {str(k) for k in loaded.config.keys() if k != "defaults"}


def foreign_key(loader, group: str, option: str, key: str) -> Optional[str]:
    """The one-line error for ``key`` (dotted, ``algorithm.group_size``) set on the command line of a run whose
    ``group`` is ``option``, when ``conf/<group>/<option>.yaml`` lacks the key and another preset of ``group`` has
    it; None otherwise (``group`` not in :data:`SCOPED_GROUPS`, the preset reads the key, or no preset names it).

    ``loader``: Hydra's config loader (``GlobalHydra.instance().config_loader()`` of an initialised Hydra).
    """
    if group not in SCOPED_GROUPS or not key.startswith(group + "."):
        return None
    name = key[len(group) + 1:].split(".")[0]
    if name in _preset_keys(loader, group, option):
        return None
    users = [o for o in sorted(loader.get_group_options(group))
             if o != option and name in _preset_keys(loader, group, o)]
    if not users:
        return None
    owner = "/".join(users)
    return (f"{group}.{name} is a {owner} key; {group}={option} does not use it: "
            f"drop it (or set {group}={users[0]})")


# groups only some presets of another group read: {group: (that group, the presets that read it, why not the rest)}
GROUP_USERS = {"reward": ("algorithm", ("grpo",), "it learns from preference pairs, not rewards")}


def unused_group(choices, override_key: str) -> Optional[str]:
    """The one-line error for a command-line ``reward=...`` or ``reward.*`` (:data:`GROUP_USERS`) when the run's
    ``algorithm`` (``choices``: Hydra's ``runtime.choices``) does not read it; None otherwise."""
    group = override_key.partition(".")[0]
    if group not in GROUP_USERS:
        return None
    owner, users, why = GROUP_USERS[group]
    chosen = choices.get(owner)
    if chosen is None or chosen in users:
        return None
    return (f"{override_key} is a {'/'.join(users)} setting; {owner}={chosen} does not use it ({why}): drop it "
            f"(or set {owner}={users[0]})")


__all__ = ["GROUP_USERS", "SCOPED_GROUPS", "foreign_key", "unused_group"]
