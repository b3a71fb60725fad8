"""One run's command-line overrides checked by composing them: a single run's command line, or one job of a
``-m`` sweep (:func:`sweep_jobs` expands a sweep as Hydra's basic sweeper does, so every job is checked before
the first starts). :func:`difflm.cli.check_overrides` calls :func:`check_job` for each, and
:func:`difflm.cli.check_sweep` checks the config of every job (:func:`sweep_job_configs`) as the job would at its
start. Hydra is initialised on difflm's ``conf/`` with the folders the command line adds to its search path
(:func:`initialize_conf`), and a preset file that does not compose is named in one line (:func:`preset_error`)."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import io
import os
import re
from typing import Iterator, Optional, Sequence


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


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


@dataclasses.dataclass
class SweepJobs:
    """The jobs of a ``-m`` sweep as Hydra will launch them (:func:`sweep_job_configs`).

    ``jobs``: per job, in launch order, (its overrides, those of them that are swept, its config as the task function
    receives it: without the ``hydra`` node). ``here``: the jobs run one after the other in this process (Hydra's
    basic launcher), else each in a process of its own elsewhere (``hydra/launcher=slurm``, ``submitit_local``, ...).
    ``world_size``: the processes of each job where they run elsewhere (``hydra.launcher.nodes`` x
    ``tasks_per_node``, as ``launch`` says; 1 for a launcher without them, ``launch`` then empty). ``sweep_dir``: the
    sweep's folder as Hydra resolves it before the first job (``hydra.sweep.dir``, ``run.dir`` by default; None
    where it does not resolve here); ``folders``: per job, ``(hydra.sweep.dir, hydra.sweep.subdir)`` resolved with
    that job's values and number, as the launcher resolves them for the job's folder (None where they do not)."""

    jobs: list
    here: bool
    world_size: int
    launch: str = ""
    sweep_dir: Optional[str] = None
    folders: list = dataclasses.field(default_factory=list)


def sweep_job_configs(config_name: str, overrides: list[str], search: Sequence[str] = ()) -> Optional[SweepJobs]:
    """The config of every job of a ``-m`` sweep of ``config_name`` over a command line's ``overrides`` (all of them:
    ``hydra.*``, ``+key``, ``~key`` and group choices), composed as Hydra's basic sweeper and its launcher compose
    them before the jobs run (the sweeper's ``hydra.sweeper.params`` first, then the command line, expanded into the
    product of its comma lists, ranges and globs; each job composed from the sweep's ``hydra`` overrides and its
    own). ``search``: the folders the command line adds to the search path (:func:`search_path_of`).

    Returns: the jobs (:class:`SweepJobs`), or None where they are not known before the sweep runs (a sweeper other
    than Hydra's basic one, e.g. Optuna, picks them as it goes) or Hydra refuses the command line (it says why).
    One compose per job (about 0.1-0.3 s), as Hydra's sweeper composes each job before launching."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict, read_write

    try:
        with quiet_conf(search):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration(config_name, list(overrides), run_mode=RunMode.MULTIRUN)
            if master.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
                return None
            params = master.hydra.sweeper.get("params") or {}
            lines = [f"{key}={value}" for key, value in params.items()]
            lines += OmegaConf.to_container(master.hydra.overrides.task, resolve=False)
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(lines)
            swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
            sweep_dir = _resolved(master, "hydra.sweep.dir")  # before the jobs: they copy its ${now:} cache
            jobs, folders = [], []
            for num, job in enumerate(sweep_jobs(lines, loader) or ()):
                cfg = loader.load_sweep_config(master, list(job))
                with read_write(cfg), open_dict(cfg):
                    cfg.hydra.job.num = num  # as Hydra's launchers set them before the job's folder is made
                    cfg.hydra.job.id = str(num)
                    parts = (_resolved(cfg, "hydra.sweep.dir"), _resolved(cfg, "hydra.sweep.subdir"))
                    folders.append(None if None in parts else parts)
                    del cfg["hydra"]
                jobs.append((list(job), [line for line in job if line.partition("=")[0] in swept], cfg))
            launcher = master.hydra.launcher
            nodes, tasks = launcher.get("nodes"), launcher.get("tasks_per_node")
            here = launcher.get("_target_") == BASIC_LAUNCHER
            sized = not here and isinstance(nodes, int) and isinstance(tasks, int)
            world = nodes * tasks if sized else 1
            launch = f"hydra.launcher.nodes={nodes} x hydra.launcher.tasks_per_node={tasks} processes" if sized \
                else ""
    except Exception:  # noqa: BLE001 - a sweep Hydra refuses: Hydra says why when it composes it
        return None
    return SweepJobs(jobs=jobs, here=here, world_size=world, launch=launch, sweep_dir=sweep_dir, folders=folders)


def _resolved(cfg, key: str) -> Optional[str]:
    """``cfg``'s value of ``key`` resolved, as text; None where it does not resolve here."""
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except Exception:  # noqa: BLE001 - an interpolation of state only the launch has: the launch resolves it
        return None
    return None if value is None else str(value)


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


@contextlib.contextmanager
def initialize_conf(search: Sequence[str] = ()) -> Iterator[None]:
    """Hydra initialised as ``initialize_config_dir`` on difflm's ``conf/``, with the folders of ``search`` added to
    its search path, in order, where a difflm command's Hydra app puts them: after ``conf/`` (its files are found
    first) and before the schema. ``search``: :func:`search_path_of` a command line (``--config-dir my_conf`` and
    ``hydra.searchpath=[...]``), e.g. ``("file:///abs/my_conf",)``. Hydra's state before is restored on exit."""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    from difflm.config import CONF_DIR

    backup = get_gh_backup()
    try:
        version.setbase("1.3")
        path = create_config_search_path(search_path_dir=str(CONF_DIR))
        for entry in search:
            path.prepend(provider="command-line", path=entry, anchor=SearchPathQuery(provider="schema"))
        Hydra.create_main_hydra2(task_name="app", config_search_path=path)
        yield
    finally:
        restore_gh_from_backup(backup)


@contextlib.contextmanager
def quiet_conf(search: Sequence[str] = ()) -> Iterator[None]:
    """:func:`initialize_conf` with Hydra's prints to stdout and stderr swallowed: the checks that compose a command
    line before the run say what is wrong in their own one line."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), initialize_conf(search):
        yield


def search_path_of(config_dir: Optional[str], overrides: Sequence[str]) -> tuple[str, ...] | None:
    """The folders a command line adds to Hydra's search path, in Hydra's order: ``--config-dir`` (``config_dir``,
    made absolute as Hydra does), then each entry of a ``hydra.searchpath=[...]`` override. None where Hydra would
    refuse the override (a value that is not a list of strings): Hydra says why.

    Raises: DifflmError for a ``--config-dir`` that is not a folder (Hydra's own refusal is three lines)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from difflm.errors import DifflmError

    search = []
    if config_dir is not None:
        if not os.path.isdir(config_dir):
            raise DifflmError(f"--config-dir {config_dir} is not a folder: give the folder of your presets, laid out "
                              "like difflm's conf/ (model/mine.yaml, experiment/mine.yaml, ...)")
        search.append(f"file://{os.path.abspath(config_dir)}")
    parser = OverridesParser.create()
    for line in overrides:
        if line.partition("=")[0] != "hydra.searchpath":
            continue
        try:
            value = parser.parse_override(line).value()
        except HydraException:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return None
        search.extend(value)
    return tuple(search)


# Hydra's message for a config file that fails while it is composed: "In 'model/mine': ConfigKeyError raised ..."
_IN_FILE = re.compile(r"In '([^']+)': ")


def preset_error(err: BaseException, config_name: str, prog: str) -> str | None:
    """The one-line error for a preset file (a group option such as ``model/mine``, or a recipe) that ``err``, the
    exception of a compose inside an initialised Hydra (:func:`initialize_conf`), says does not compose; None when
    ``err`` is about something else (a command-line override: :func:`difflm.cli.check_overrides` names those).

    Named: the file, the selection that loads it and the key, with the fix: a key the schema lacks with its closest
    key (``num_layer in /abs/my_conf/model/mine.yaml (model=mine) is not a config key; did you mean num_layers?
    ...``), a value of the wrong type with the key's default, a broken defaults list or YAML with Hydra's or the YAML
    parser's reason. ``config_name``: the primary config (the default of a key comes from it); ``prog``: the command
    (``difflm-train``), for where the keys are listed."""
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import ConfigKeyError, ValidationError
    from yaml import YAMLError, MarkedYAMLError

    from difflm.errors import exception_chain

    chain = list(exception_chain(err))
    parsed = next((e for e in chain if isinstance(e, YAMLError)), None)
    if isinstance(parsed, MarkedYAMLError) and parsed.problem_mark is not None:
        mark = parsed.problem_mark
        reason = "; ".join(str(part) for part in (parsed.context, parsed.problem) if part)
        return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({reason}): "
                "fix the file")
    found = _IN_FILE.match(str(err))
    if found is None:
        return None
    config_path = found.group(1)
    group, _, option = config_path.rpartition("/")
    loaded = GlobalHydra.instance().config_loader().repository.load_config(config_path)
    where = _file_of(loaded, config_path) + (f" ({group}={option})" if group else "")
    package = (loaded.header.get("package") if loaded is not None else None) or group.replace("/", ".")
    prefix = "" if package == "_global_" else package + "."

    def in_file(key: str) -> str:  # the key as the file spells it (below its package)
        return key[len(prefix):] if prefix and key.startswith(prefix) else key

    cause = next((e for e in chain if isinstance(e, (ConfigKeyError, ValidationError))), None)
    key = getattr(cause, "full_key", None)
    if cause is None or not key:
        return f"{where}: {hydra_message(err)[len(found.group(0)):]}: fix the file"
    base = _base_config(config_name)
    see = f"({prog} --cfg job prints every key)"
    if isinstance(cause, ConfigKeyError):
        parent, _, name = key.rpartition(".")
        schema = getattr(cause, "object_type", None)  # the dataclass that lacks the key (ModelConfig, ...)
        if dataclasses.is_dataclass(schema):
            close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(schema)], n=1)
            fixed = ".".join(filter(None, (parent, close[0]))) if close else None
        else:
            fixed = closest_key(base, key.split(".")) if base is not None else None
        if fixed and fixed != key:
            return f"{in_file(key)} in {where} is not a config key; did you mean {in_file(fixed)}? {see}"
        return f"{in_file(key)} in {where} is not a config key: remove it from the file {see}"
    from omegaconf import OmegaConf

    reason = str(cause).strip().splitlines()[0]
    default = OmegaConf.select(base, key, default=None, throw_on_missing=False) if base is not None else None
    example = f" (e.g. {in_file(key)}: {default}, the default)" if default is not None else ""
    return f"{in_file(key)} in {where}: {reason}; give a value of the key's type{example}"


def _file_of(loaded, config_path: str) -> str:
    """The file a config of Hydra's repository was read from: ``/abs/my_conf/model/mine.yaml`` (a folder),
    ``pkg://.../model/mine.yaml`` (a package), or the config's path where it has no file (a schema)."""
    if loaded is None or not str(loaded.path).startswith(("file://", "pkg://")):
        return config_path
    root = str(loaded.path)
    root = root[len("file://"):] if root.startswith("file://") else root
    return f"{root.rstrip('/')}/{config_path}.yaml"


def _base_config(config_name: str):
    """``config_name`` composed without overrides inside an initialised Hydra (None where it does not compose): the
    keys and defaults a preset file's key is compared with."""
    from hydra import compose

    try:
        return compose(config_name)
    except Exception:  # noqa: BLE001 - no base to compare with: the message goes without a close key
        return None


def keys_of(node) -> list[str] | None:
    """The keys of a config mapping; None for a list, a value, or a mapping that is null or ``???``."""
    from omegaconf import DictConfig

    if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
        return None
    return [str(key) for key in node.keys()]


def closest_key(cfg, parts: list[str]) -> str | None:
    """``parts`` (a dotted key split at its dots) as an existing dotted key of ``cfg``, each misspelt part replaced
    by its closest key (``model.hiden_size`` -> ``model.hidden_size``); None when a part has none. Below a value or
    a list the rest is kept as typed."""
    node, fixed = cfg, []
    for i, part in enumerate(parts):
        keys = keys_of(node)
        if keys is None:  # below a value or a list: the rest as typed
            return ".".join(fixed + parts[i:])
        if part not in keys:
            close = difflib.get_close_matches(part, keys, n=1)
            if not close:
                return None
            part = close[0]
        fixed.append(part)
        node = node._get_node(part)
    return ".".join(fixed)


def hydra_message(err: BaseException) -> str:
    """Hydra's multi-line message on one line: its first line, the first line of its cause, the rest, the
    available options comma-separated; without the search path, the grammar link and OmegaConf's key dump."""
    def lines(text: str) -> list[str]:
        out = []
        for raw in text.splitlines():
            line = raw.strip().rstrip(".")
            if line.startswith("Config search path"):
                break
            if not line or line.startswith(("See https://", "full_key:", "reference_type=", "object_type=")):
                continue
            if raw.startswith("\t") and out:  # one option of an "Available options in 'model':" list
                out[-1] += (" " if out[-1].endswith(":") else ", ") + line
            else:
                out.append(line)
        return out

    own, cause = lines(str(err)), lines(str(err.__cause__ or ""))
    return ". ".join(own[:1] + cause[:1] + own[1:]) or type(err).__name__


def check_job(overrides: list[str], config_name: str, search: Sequence[str] = ()) -> str | None:
    """The one-line error for one run's overrides (a command line without ``-m``, or one job of a sweep:
    :func:`sweep_jobs`), found by composing them once; None when the run is fine here or fails for a reason Hydra
    reports when it composes. ``search``: the folders the command line adds to the search path
    (:func:`search_path_of`).

    Refused: a value the schema's type refuses (``train.max_steps=abc``), a preset file that does not compose
    (:func:`preset_error`: a key the schema lacks in ``my_conf/model/mine.yaml``), a key of ``algorithm``,
    ``estimator`` or ``objective`` that only another preset reads (:func:`difflm.config.preset_keys.foreign_key`:
    ``algorithm=dpo algorithm.group_size=8``), and a key the run's settings never read
    (:func:`~difflm.config.preset_keys.unread_key`: ``algorithm=dpo gen.steps=64``, ``algorithm=dpo reward=format``).
    """
    return compose_and_check(overrides, config_name, search)[1]


def compose_and_check(overrides: list[str], config_name: str, search: Sequence[str] = ()):
    """``(cfg, message)``: the config Hydra composes from ``overrides`` (a DictConfig with its ``hydra`` node, as
    ``compose(..., return_hydra_config=True)`` returns it; None where Hydra refuses them) and :func:`check_job`'s
    one-line error for them (None: fine here, or Hydra's to report). A command line that composes has only known keys
    and presets, so :func:`difflm.cli.check_overrides` needs no further compose for it, and its caller may use the
    config instead of composing it again. ``search``: as :func:`check_job`'s."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config.preset_keys import foreign_key, unread_key

    try:
        with quiet_conf(search):
            try:
                cfg = compose(config_name, overrides, return_hydra_config=True)
            except Exception as err:  # noqa: BLE001 - only a wrong type or a broken preset file is ours to say
                return None, (preset_error(err, config_name, f"difflm-{config_name}")
                              or _wrong_type(config_name, overrides, err))
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


def _entry_field(overrides: list[str], field: str, value) -> tuple[str, str | None]:
    """(``data.blend[1].weight``, ``abc``): where ``field`` holds ``value`` in a list-of-mappings override
    (``data.blend=[{path:a,weight:1},{path:b,weight:abc}]``), whose entries OmegaConf validates as nodes of their own
    and names by the field alone; (``field``, None) when no override holds it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
            entries = parsed.value()
        except HydraException:
            continue
        if not isinstance(entries, list):
            continue
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and field in entry and (value is None or str(entry[field]) == str(value)):
                return f"{parsed.key_or_group}[{i}].{field}", str(entry[field])
    return field, None


def _unknown_entry_field(overrides: list[str], err: Exception) -> str | None:
    """The one-line error for a field that the entries of a list override do not have
    (``data.blend=[{path:a,wieght:1}]``): OmegaConf refuses it naming the field alone; None for any other error."""
    import dataclasses

    from omegaconf.errors import ConfigKeyError

    from difflm.errors import exception_chain

    cause = next((e for e in exception_chain(err) if isinstance(e, ConfigKeyError)), None)
    entry_type = getattr(cause, "object_type", None)
    if cause is None or not dataclasses.is_dataclass(entry_type) or not isinstance(getattr(cause, "key", None), str):
        return None
    key, given = _entry_field(overrides, cause.key, None)
    if given is None:
        return None
    fields = [f.name for f in dataclasses.fields(entry_type)]
    close = difflib.get_close_matches(cause.key, fields, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{key} is not a key of this entry; {hint}(an entry takes {', '.join(fields)})"


def _wrong_type(config_name: str, overrides: list[str], err: Exception) -> str | None:
    """The one-line error for an override whose value the schema's type refuses (``train.max_steps=abc``): ``err`` is
    what composing ``overrides`` raised; None when it is no such refusal (Hydra reports those)."""
    from hydra import compose
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from difflm.errors import exception_chain

    cause = next((e for e in exception_chain(err) if isinstance(e, ValidationError)), None)
    if cause is None:
        return _unknown_entry_field(overrides, err)
    key = getattr(cause, "full_key", None) or "a key"
    given = next((o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == key), None)
    if given is None:  # a field of a list entry (data.blend=[{path:a,weight:abc}]) is validated without its parents
        key, given = _entry_field(overrides, key, getattr(cause, "value", None))
    given = given or ""
    default = None
    if key != "a key":  # the key's default, from the config without overrides
        default = OmegaConf.select(compose(config_name), key, default=None, throw_on_missing=False)
    reason = str(cause).strip().splitlines()[0]
    example = f" (e.g. {key}={default}, the default)" if default is not None else ""
    return f"{key}={given}: {reason}; give a value of the key's type{example}"


__all__ = ["check_job", "closest_key", "compose_and_check", "hydra_message", "initialize_conf", "jobs_to_check",
           "keys_of", "preset_error", "quiet_conf", "search_path_of", "SweepJobs", "sweep_job_configs", "sweep_jobs"]
