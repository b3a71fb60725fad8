"""One run's command-line overrides checked by composing them: a single run's command line, or one job of a
``-m`` sweep (:func:`sweep_jobs` expands a sweep as Hydra's basic sweeper does, so every job is checked before
the first starts). :func:`difflm.cli.check_overrides` calls :func:`check_job` for each."""
from __future__ import annotations

import contextlib
import functools
import io


def sweep_jobs(overrides: list[str], loader=None) -> list[list[str]] | None:
    """The jobs of a ``-m`` sweep over ``overrides`` (``["algorithm=grpo,dpo", "gen.steps=64"]``), each a list of
    ``key=value`` overrides, in the order Hydra's basic sweeper launches them (the product of the comma lists, ranges
    and, with Hydra's config ``loader``, group globs); None for a sweep it cannot expand (an interval)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
        return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
    except HydraException:
        return None


def jobs_to_check(jobs: list[list[str]], groups) -> list[list[str]]:
    """The jobs of a sweep that :func:`check_job` must compose to judge them all: each job that holds an override no
    earlier one held (a wrong type is a property of one override) or a new set of group selections and overrides
    under :data:`~difflm.config.preset_keys.CONDITION_ROOTS` (what decides whether a key is read). ``groups``: the
    config's group names. A sweep of 10 seeds x 5 learning rates composes 10 jobs, not 50."""
    from difflm.config.preset_keys import CONDITION_ROOTS

    def decides(line: str) -> bool:
        key = line.partition("=")[0]
        return key in groups or key.split(".")[0] in CONDITION_ROOTS

    seen, signatures, out = set(), set(), []
    for job in jobs:
        signature = tuple(line for line in job if decides(line))
        if signature not in signatures or not seen.issuperset(job):
            out.append(job)
            signatures.add(signature)
            seen.update(job)
    return out


def check_job(overrides: list[str], config_name: str) -> str | None:
    """The one-line error for one run's overrides (a command line without ``-m``, or one job of a sweep:
    :func:`sweep_jobs`), found by composing them once; None when the run is fine here or fails for a reason Hydra
    reports when it composes.

    Refused: a value the schema's type refuses (``train.max_steps=abc``), a key of ``algorithm``, ``estimator`` or
    ``objective`` that only another preset reads (:func:`difflm.config.preset_keys.foreign_key`:
    ``algorithm=dpo algorithm.group_size=8``), and a key the run's settings never read
    (:func:`~difflm.config.preset_keys.unread_key`: ``algorithm=dpo gen.steps=64``, ``algorithm=dpo reward=format``).
    """
    return compose_and_check(overrides, config_name)[1]


def compose_and_check(overrides: list[str], config_name: str):
    """``(cfg, message)``: the config Hydra composes from ``overrides`` (a DictConfig with its ``hydra`` node, as
    ``compose(..., return_hydra_config=True)`` returns it; None where Hydra refuses them) and :func:`check_job`'s
    one-line error for them (None: fine here, or Hydra's to report). A command line that composes has only known keys
    and presets, so :func:`difflm.cli.check_overrides` needs no further compose for it, and its caller may use the
    config instead of composing it again."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config import CONF_DIR
    from difflm.config.preset_keys import foreign_key, unread_key

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
                try:
                    cfg = compose(config_name, overrides, return_hydra_config=True)
                except Exception as err:  # noqa: BLE001 - only a wrong type is ours to say
                    return None, _wrong_type(config_name, overrides, err)
                loader, parser = GlobalHydra.instance().config_loader(), OverridesParser.create()
                choices = cfg.hydra.runtime.choices
                for line in overrides:
                    key = parser.parse_override(line).key_or_group
                    group = key.partition(".")[0]
                    suggest = functools.partial(_presets_that_accept, config_name, overrides, group, parser)
                    message = unread_key(cfg, config_name, line) or (
                        foreign_key(loader, group, choices[group], key, suggest) if choices.get(group) else None)
                    if message:
                        return cfg, message
    except Exception:  # noqa: BLE001 - a config this check cannot compose: Hydra composes it and reports why
        return None, None
    return cfg, None


def _presets_that_accept(config_name: str, overrides: list[str], group: str, parser, presets: list[str]) -> list[str]:
    """``presets`` of ``group`` under which the run's other overrides compose and pass the group's own checks
    (:data:`PRESET_CHECKS`), the group's default preset first, then in the given order. Inside an initialised Hydra.
    For the fix a key-of-another-preset message offers: ``objective=ar objective.weighting=cart`` names
    ``objective=mdlm`` (cart is refused under bd3lm), not the first preset alphabetically."""
    from hydra import compose

    others = [o for o in overrides if parser.parse_override(o).key_or_group != group]
    default = compose(config_name, [], return_hydra_config=True).hydra.runtime.choices.get(group)
    check = PRESET_CHECKS.get((config_name, group))
    accepted = []
    for preset in sorted(presets, key=lambda p: p != default):  # stable: the default first
        try:
            cfg = compose(config_name, [*others, f"{group}={preset}"])
            if check is not None:
                check(cfg)
        except Exception:  # noqa: BLE001 - refused under this preset: not a fix to offer
            continue
        accepted.append(preset)
    return accepted


def _check_objective(cfg) -> None:
    from difflm.config.validate import check_adaptation

    check_adaptation(cfg)


# (config name, group) -> the checks of that group's settings that need no data, device or model
PRESET_CHECKS = {("train", "objective"): _check_objective}


def _wrong_type(config_name: str, overrides: list[str], err: Exception) -> str | None:
    """The one-line error for an override whose value the schema's type refuses (``train.max_steps=abc``): ``err`` is
    what composing ``overrides`` raised; None when it is no such refusal (Hydra reports those)."""
    from hydra import compose
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from difflm.errors import exception_chain

    cause = next((e for e in exception_chain(err) if isinstance(e, ValidationError)), None)
    if cause is None:
        return None
    key = getattr(cause, "full_key", None) or "a key"
    given = next((o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == key), "")
    default = None
    if key != "a key":  # the key's default, from the config without overrides
        default = OmegaConf.select(compose(config_name), key, default=None, throw_on_missing=False)
    reason = str(cause).strip().splitlines()[0]
    example = f" (e.g. {key}={default}, the default)" if default is not None else ""
    return f"{key}={given}: {reason}; give a value of the key's type{example}"


__all__ = ["check_job", "compose_and_check", "jobs_to_check", "sweep_jobs"]
