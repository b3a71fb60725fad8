"""Command-line keys a run never reads, refused in one line before it starts.

* A key of another preset of a group: ``algorithm.group_size`` under ``algorithm=dpo``. The schema of a group
  (:class:`~difflm.config.schema.AlgorithmConfig`, ``EstimatorConfig``, ``ObjectiveConfig``) is the union of the keys
  of all its presets, so a key only one preset reads composes under every preset and is then never read. Each preset
  file of these groups lists every key its code reads, so a command-line key that the selected preset's file lacks
  while another preset's file has it is a key of that other preset (:func:`foreign_key`). A key no preset file
  names (a key every preset shares through the schema) is accepted.
* A key that other settings leave unread (:data:`UNREAD`, :func:`unread_key`): the rollout sampler's ``gen.*``,
  the ``reward`` and ``data.answer_field`` without rollouts (``algorithm=dpo``), the preference fields under
  ``algorithm=grpo``, ``algorithm.reference`` when GRPO has no KL term (``algorithm.beta=0``), ``lora.*``
  without adapters (``lora.rank=0``), W&B's ``logger.*`` under ``logger=console`` and the sample-logging
  ``logger.*`` under difflm-rl.

:func:`difflm.config.job_check.check_job` calls both for every override of a run's command line, or of each job
of a ``-m`` sweep.
"""
from __future__ import annotations

from typing import Callable, Optional

# groups whose presets are variants of one thing, each file listing the keys its variant reads
SCOPED_GROUPS = ("algorithm", "estimator", "objective")


def _preset_keys(loader, group: str, option: str) -> set[str]:
    """The top-level keys of ``conf/<group>/<option>.yaml`` (empty when it cannot be loaded)."""
    loaded = loader.repository.load_config(f"{group}/{option}")
    if loaded is None:
        return set()
    return {str(k) for k in loaded.config.keys() if k != "defaults"}


def foreign_key(loader, group: str, option: str, key: str,
                suggest: Optional[Callable[[list[str]], list[str]]] = None) -> Optional[str]:
    """The one-line error for ``key`` (dotted, ``algorithm.group_size``) set on the command line of a run whose
    ``group`` is ``option``, when ``conf/<group>/<option>.yaml`` lacks the key and another preset of ``group`` has
    it; None otherwise (``group`` not in :data:`SCOPED_GROUPS`, the preset reads the key, or no preset names it).

    ``loader``: Hydra's config loader (``GlobalHydra.instance().config_loader()`` of an initialised Hydra).
    ``suggest``: orders the presets that read the key, best first, for the fix the message offers (e.g. those that
    accept the typed value first: :func:`difflm.config.job_check.check_job`); alphabetical without it.
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
    best = (suggest(users) if suggest else None) or users
    return (f"{group}.{name} is a {owner} key; {group}={option} does not use it: "
            f"drop it (or set {group}={best[0]})")


def _only_under(users: tuple[str, ...], why: str):
    """A condition of :data:`UNREAD`: the key is read only under ``algorithm`` in ``users``; ``why`` says why not."""
    def unread(cfg, key: str):
        name = cfg.algorithm.name
        return None if name in users else (f"algorithm={name} ({why})", f"use algorithm={users[0]}")
    return unread


def _reference_unread(cfg, key: str):
    """``algorithm.reference`` under GRPO with ``beta=0``: no KL term, so the runner holds and reads no reference."""
    a = cfg.algorithm
    if a.name != "grpo" or a.beta != 0 or a.reference == "none":
        return None
    return "algorithm.beta=0 (no KL term: no reference is built or read)", "set algorithm.beta > 0"


def _adapter_key_unread(cfg, key: str):
    """``lora.*`` but ``lora.rank`` with rank 0 (``lora=none``): no adapters are added, so none of it is read; and an
    adapter preset (``lora=attn_mlp``) with ``lora.rank=0``, which would train every weight instead."""
    if key == "lora.rank" or int(cfg.lora.get("rank", 0) or 0) > 0:
        return None
    if key == "lora":
        if cfg.lora.get("name", "none") == "none":
            return None
        return "lora.rank=0 (no adapters: every weight would train)", "set lora.rank >= 1"
    return f"lora={cfg.lora.name} (no adapters: lora.rank=0)", "choose lora=attn or lora=attn_mlp"


def _wandb_key_unread(cfg, key: str):
    """``logger.project``, ``logger.entity``, ``logger.mode``: read by the W&B sink only."""
    if key not in ("logger.project", "logger.entity", "logger.mode") or cfg.logger.name == "wandb":
        return None
    return f"logger={cfg.logger.name} (no W&B run)", "use logger=wandb"


def _rl_logs_no_samples(cfg, key: str):
    """The trainer's sample-logging keys: difflm-rl logs rewards and margins, no generated samples."""
    if key not in ("logger.num_samples", "logger.sample_prompt", "logger.sample_temperature"):
        return None
    return "difflm-rl (it logs no generated samples; its rollouts use gen.*)", None


# the config nodes the conditions of UNREAD read (with the group selections: what decides whether a key is read)
CONDITION_ROOTS = ("algorithm", "lora", "logger")
_NO_ROLLOUTS = _only_under(("grpo",), "no rollouts: it scores given preference pairs")
_NO_PAIRS = _only_under(("dpo",), "no preference pairs: it samples completions of the prompts")
# keys a run reads only under some settings of another key: {config name: ((key, condition), ...)}; a condition
# ``(cfg, key) -> (the setting, the fix or None)`` says why the composed run ``cfg`` never reads ``key`` (a key
# equal to or under the table's), None if it does
UNREAD = {
    "rl": (("gen", _NO_ROLLOUTS),
           ("reward", _only_under(("grpo",), "no rewards: it learns from preference pairs")),
           ("data.answer_field", _only_under(("grpo",), "no reward reads a reference answer")),
           ("data.chosen_field", _NO_PAIRS), ("data.rejected_field", _NO_PAIRS),
           ("data.max_response_tokens", _NO_PAIRS),
           ("algorithm.reference", _reference_unread),
           ("lora", _adapter_key_unread), ("logger", _wandb_key_unread), ("logger", _rl_logs_no_samples)),
    "train": (("lora", _adapter_key_unread), ("logger", _wandb_key_unread)),
}


def unread_key(cfg, config_name: str, override: str) -> Optional[str]:
    """The one-line error for ``override`` (``gen.steps=64`` or ``reward=format``, as typed) of a run of
    ``config_name`` whose composed config ``cfg`` never reads the key (:data:`UNREAD`), e.g. ``gen.steps=64 has no
    effect with algorithm=dpo (no rollouts: ...); remove it or use algorithm=grpo``; None otherwise."""
    key = override.partition("=")[0].lstrip("+~")
    for prefix, condition in UNREAD.get(config_name, ()):
        if key == prefix or key.startswith(prefix + "."):
            found = condition(cfg, key)
            if found:
                setting, fix = found
                return f"{override} has no effect with {setting}; remove it" + (f" or {fix}" if fix else "")
    return None


__all__ = ["CONDITION_ROOTS", "SCOPED_GROUPS", "UNREAD", "foreign_key", "unread_key"]
