"""What every entry point shares: user mistakes end as one line on stderr with exit status 2 (a mistyped key or
preset on the command line before Hydra composes: :func:`hydra_app`), and free-text values (prompts) reach Hydra as
one string whatever characters they hold."""
from __future__ import annotations

import contextlib
import difflib
import functools
import io
import os
import re
import sys
from pathlib import Path

from difflm.errors import DifflmError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for Ctrl-C


def writable_output(key: str, path, directory: bool = False, replaceable=None) -> Path:
    """``path`` (a file, or with ``directory`` a directory to be written) checked before any work: its parent
    folders are created, and a probe file is written and removed there, so a mistake ends the command at once.
    ``replaceable(path) -> str | None``: for an existing file, None when the command may write over it (an earlier
    output of its own), else what the file is (``not a difflm-eval result``), and the command refuses it.

    Returns ``path`` as a Path (``~`` expanded). Raises: DifflmError naming ``key`` when ``path`` is empty, a directory
    where a file is expected (or a file where a directory is), an existing file ``replaceable`` refuses, or its
    folder cannot be created or written (a file on the way, a read-only or pseudo filesystem such as /proc).
    """
    if not str(path).strip():  # Path("") is the current folder
        raise DifflmError(f"{key}= is empty: give a {'directory' if directory else 'file'} path")
    path = Path(path).expanduser()
    if not directory and path.is_dir():
        raise DifflmError(f"{key}={str(path)!r} is a directory: give a file path")
    if not directory and replaceable is not None and path.is_file() and (what := replaceable(path)) is not None:
        raise DifflmError(f"{key}={str(path)!r} exists and is {what}: the output would replace it; give a new file "
                          "path")
    if directory and path.exists() and not path.is_dir():
        raise DifflmError(f"{key}={str(path)!r} is a file: give a directory path")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{path.name}.probe{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DifflmError(f"{key}={str(path)!r} cannot be written ({err.strerror or type(err).__name__}: "
                          f"{err.filename or parent}): choose a folder you can write in") from None
    return path


def check_required(cfg) -> None:
    """Refuse a composed config that leaves a mandatory key (``???`` in a schema or YAML) without a value.

    Raises: DifflmError naming every such key and how to give it (``run.dir is required: pass run.dir=...``),
    before any work starts; OmegaConf would otherwise raise ``MissingMandatoryValue`` wherever the key is first read.
    """
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        given = " ".join(f"{key}=..." for key in missing)
        raise DifflmError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: pass {given} "
                          f"on the command line (--cfg job prints the composed config)")


def exits_cleanly(fn):
    """Wrap a Hydra task function: a :class:`DifflmError` prints ``difflm: error: <message>`` and exits 2, Ctrl-C
    (KeyboardInterrupt) prints ``difflm: interrupted`` and exits 130, as a shell reports it. On such a refusal
    (status 2) the folders Hydra created for this invocation that hold only its own records (a fresh default
    ``outputs/<time>/``, a new sweep folder) are removed first
    (:func:`difflm.hydra_folders.remove_refused_run_dirs`).

    A config passed as the first argument is checked first by :func:`difflm.config.schema.check_known_keys` (a key
    added with ``+`` that its schema lacks) and :func:`check_required`; a mandatory value read later (a ``???`` that
    only an interpolation reaches) ends the same way, naming its key.
    """
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    from difflm.config.schema import check_known_keys

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            launch_folder_cwd()
            if args:
                check_known_keys(args[0])
                check_required(args[0])
            return fn(*args, **kwargs)
        except MissingMandatoryValue as err:
            key = getattr(err, "full_key", None) or "a mandatory key"
            message, status = f"difflm: error: {key} is required: pass {key}=... on the command line", 2
        except DifflmError as err:
            message, status = f"difflm: error: {with_sources(str(err))}", 2
        except InterpolationResolutionError as err:  # ${key} on the command line naming no key, or a failing resolver
            first = str(err).splitlines()[0]
            message = (f"difflm: error: {first}: fix the ${{...}} interpolation in the overrides (a prompt's text is "
                       "taken as typed unless it is one ${...} as a whole)")
            status = 2
        except KeyboardInterrupt:  # a second Ctrl-C during training, or one in any other command
            message, status = "\ndifflm: interrupted", EXIT_INTERRUPTED
        if status == 2:  # a refusal: the run or sweep folders Hydra just made for it hold nothing to keep
            from difflm.hydra_folders import remove_refused_run_dirs

            remove_refused_run_dirs()
        _say(message)
        sys.exit(status)

    return wrapper


def with_sources(message: str) -> str:
    """``message`` naming the preset or recipe file that set each value it names
    (:func:`difflm.config.provenance.name_sources`); unchanged outside a Hydra app."""
    from difflm.config.provenance import name_sources, running_sources

    sources = running_sources()
    return message if not sources else name_sources(message, sources)


def launch_folder_cwd() -> None:
    """Under ``hydra.job.chdir=true`` go back to the folder the command was launched from.

    Every relative path a difflm command reads or writes (``data.path``, ``data.tokenizer``, ``data.cache_dir``,
    ``checkpoint``, ``output``, ``run.dir``, ...) is meant relative to the launch folder, and difflm writes its
    outputs into ``run.dir`` by name, so Hydra's change into the job's output folder would only make relative input
    paths point into it. Returning to the launch folder is ``hydra.utils.to_absolute_path`` applied to every path
    key at once (Hydra, "Output/Working directory"). A no-op outside a Hydra job or with ``chdir=false``.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    if not HydraConfig.initialized() or not HydraConfig.get().job.get("chdir", False):
        return
    launch = get_original_cwd()
    if os.getcwd() != launch:
        os.chdir(launch)


# keys whose value is any text: the entry points quote them for Hydra (quote_free_text) before composing
FREE_TEXT_KEYS = ("prompt", "logger.sample_prompt", "data.prompt_template")


def _say(message: str) -> None:
    """``message`` and its newline on stderr in one write, so the lines of processes sharing it (torchrun's ranks)
    never run together."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's capture): write to it
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def hydra_quoted(text: str) -> str:
    """``text`` as a single-quoted Hydra override value that parses back to exactly ``text``.

    Hydra's grammar (docs, "Override grammar: quoted values"): inside quotes ``\\'`` is a quote and backslashes
    are literal except a run of them right before a quote (or the closing quote), which is written doubled.
    ``${`` is escaped as ``\\${`` so OmegaConf keeps it as text instead of an interpolation.
    """
    body = text.replace("${", "\\${")
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", body)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def quote_free_text(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """Command-line overrides ``key=value`` of free-text ``keys`` made safe for Hydra.

    Hydra reads ``prompt=a, b`` as a sweep over ``a`` and ``b`` and refuses ``prompt=a: b (c)``; it reads
    ``prompt=true`` as a bool, ``prompt=1e3`` as a float, ``prompt=null`` as None, and OmegaConf resolves
    ``Pay ${name}`` as an interpolation. A prompt is always the text as typed, so such values are quoted with
    :func:`hydra_quoted` (which also escapes ``${``). Left as they are: values Hydra already reads as exactly the
    typed string, a value quoted in Hydra's syntax (``'...'`` or ``"..."``), a value that is one interpolation as a
    whole (``${oc.env:PROMPT}``, on purpose), and every argument of a multirun (``-m``/``--multirun`` or
    ``hydra.mode=MULTIRUN``, :func:`multirun_flag`), where a comma list is a sweep on purpose.
    """
    if multirun_flag(argv) is not None:
        return list(argv)
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in keys:
            try:
                override = parser.parse_override(arg)
                parsed = None if override.is_sweep_override() else override.value()
            except HydraException:
                parsed = None
            quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
            whole_interpolation = re.fullmatch(r"\$\{[^{}]*\}", value) is not None
            as_typed = isinstance(parsed, str) and (
                quoted or whole_interpolation or (parsed == value and "${" not in value))
            if not as_typed:
                arg = f"{key}={hydra_quoted(value)}"
        out.append(arg)
    return out


def hydra_app(config_name: str, sweeps: bool = False, job_check=None):
    """Decorator of a difflm entry point: ``hydra.main`` over ``conf/<config_name>.yaml`` around
    :func:`exits_cleanly`, preceded by :func:`check_overrides` on the command line and, for a command that runs one
    job (``sweeps`` false: all but difflm-train and difflm-rl), :func:`refuse_multirun`; for one that sweeps, a
    ``-m`` sweep's jobs are each checked by ``job_check`` first (:func:`check_sweep`).

    ``job_check(cfg, world_size, here)``: the checks a job of this command runs on its config at its start, before
    any work (raising DifflmError); ``here`` false: the job runs elsewhere (another launcher than Hydra's basic one),
    so only what its config alone decides for ``world_size`` processes is checked, not this machine's devices.

    The returned function takes no arguments (it reads ``sys.argv``). A mistyped key or preset, ``-m`` on a command
    that does not sweep, or a sweep job its checks refuse ends it before Hydra composes or creates a folder:
    ``difflm: error: <message>`` on stderr, exit status 2.
    """
    import hydra

    from difflm.config import CONF_DIR

    def decorate(task):
        app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(exits_cleanly(task))

        @functools.wraps(task)
        def entry() -> None:
            sys.argv[1:] = hydra_flags_first(sys.argv[1:])
            try:
                check_flags(sys.argv[1:], f"difflm-{config_name}")
                if not sweeps:
                    refuse_multirun(sys.argv[1:], f"difflm-{config_name}")
                check_overrides(sys.argv[1:], config_name)
                check_edits(sys.argv[1:], config_name)
                check_launcher(sys.argv[1:], config_name)
                check_shadowed_presets(sys.argv[1:], config_name)
                if sweeps and job_check is not None:
                    check_sweep(sys.argv[1:], config_name, job_check)
            except DifflmError as err:
                from difflm.parallel.distributed import launch_env

                if launch_env()["rank"] == 0:  # under torchrun or srun every rank sees the same command line
                    _say(f"difflm: error: {err}")
                sys.exit(2)
            app()

        return entry

    return decorate


def check_flags(argv: list[str], prog: str) -> None:
    """Refuse a dash word that is none of Hydra's flags (``difflm-train --bogus``, ``--cfgg job``), which Hydra's
    parser answers with its whole usage text and ``unrecognized arguments``. A command line Hydra reads, or one with
    ``--``, passes. Two of the flags that each say what Hydra does (``-m`` and ``--cfg job``, ``--cfg`` and
    ``--info``), which Hydra refuses with a traceback, are refused too (:func:`_one_mode`).

    Raises: DifflmError naming the word, the closest flag, and that settings are ``key=value``; or the two flags
    given together and which to drop."""
    from hydra._internal.utils import get_args_parser

    if "--" in argv:
        return
    args = _hydra_args(argv)
    if args is not None:
        _one_mode(argv, args, prog)
        return
    options = get_args_parser()._option_string_actions
    key_at, strays, value_next = None, 0, False  # the last key=value word, plain words after it, a flag's value due
    for i, arg in enumerate(argv):
        name = arg.partition("=")[0]  # --cfg=job and -cd=DIR alike
        if value_next:
            value_next = False
            if not arg.startswith("-"):
                continue  # the value of the flag before it (--cfg job, -cd DIR)
        if not arg.startswith("-") or re.fullmatch(r"-[\d.]+(e-?\d+)?", arg):
            key_at, strays = (i, 0) if "=" in arg else (key_at, strays + 1)
            continue
        action = options.get(name)
        if action is not None:
            takes = action.nargs is None or (action.nargs == "?" and i + 1 < len(argv)
                                              and (action.choices is None or argv[i + 1] in action.choices))
            value_next = "=" not in arg and takes
            continue
        if key_at is not None and strays:  # a key's value the shell split at spaces, this word part of it
            key, _, value = argv[key_at].partition("=")
            whole = " ".join([value, *(w for w in argv[key_at + 1:] if "=" not in w)])
            raise DifflmError(f"{arg} is not a flag of {prog}: the shell split {key}= at a space; quote the "
                              f"value: {key}='{whole}'")
        close = difflib.get_close_matches(name, [o for o in options if o.startswith("--")], n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "."
        raise DifflmError(f"{arg} is not a flag of {prog}{hint} Settings are key=value words ({prog} --cfg job "
                          f"prints every key); {prog} --help lists its flags (--cfg job, -m, --config-dir DIR, "
                          f"--config-name NAME, ...)")


def _one_mode(argv: list[str], args, prog: str) -> None:
    """Refuse a command line holding two of Hydra's mode flags (``--run``, ``-m``, ``--cfg``, ``--info``,
    ``-sc``): Hydra runs one of them and ends any other combination with ``ValueError: Only one of --run,
    --multirun, --cfg, --info and --shell_completion can be specified`` and its traceback. ``--help`` and
    ``--hydra-help`` print before Hydra looks, so they pass. Raises: DifflmError naming the two flags as typed."""
    if args.help or args.hydra_help:
        return
    modes = {"run": args.run, "multirun": args.multirun, "cfg": args.cfg is not None, "info": args.info is not None,
             "shell_completion": args.shell_completion}
    if sum(modes.values()) < 2:
        return
    names = {"run": ("--run", "-r"), "multirun": ("--multirun", "-m"), "cfg": ("--cfg", "-c"),
             "info": ("--info", "-i"), "shell_completion": ("--shell-completion", "-sc")}
    given = [mode for mode, on in modes.items() if on]
    typed = {}
    for mode in given:
        spelled = [a.partition("=")[0] for a in argv if a.partition("=")[0] in names[mode]]
        typed[mode] = spelled[0] if spelled else names[mode][0]
    first, second = (typed[mode] for mode in given[:2])
    hint = ""
    if modes["multirun"] and modes["cfg"]:
        hint = f"; to print one job's config drop {typed['multirun']} and give that job's values (one per swept key)"
    raise DifflmError(f"{first} and {second} cannot be given together: {prog} takes one of --run, "
                      f"--multirun (-m), --cfg, --info and --shell-completion at a time{hint}")


def hydra_flags_first(argv: list[str]) -> list[str]:
    """``argv`` with Hydra's own flags (``-m``, ``--cfg job``, ``-cd DIR``, ...) moved before the overrides, when a flag
    typed after an override (``difflm-train model=tiny -m optim.lr=1e-4,3e-4``) would make Hydra's parser stop with
    its usage text and ``unrecognized arguments``; the flags keep their order, and so do the overrides. Returned as
    given when Hydra reads it already, and when it holds ``--`` or a dash word that is not one of Hydra's flags."""
    from hydra._internal.utils import get_args_parser

    if _hydra_args(argv) is not None or "--" in argv:
        return list(argv)
    actions = get_args_parser()._option_string_actions
    flags, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            overrides.append(arg)
            i += 1
            continue
        action = actions.get(arg.partition("=")[0])  # --cfg=job and -cd=DIR alike
        if action is None:
            return list(argv)
        flags.append(arg)
        i += 1
        if "=" in arg or action.nargs == 0:
            continue
        value = argv[i] if i < len(argv) else None
        takes = value is not None and not value.startswith("-") and (action.choices is None or value in action.choices)
        if action.nargs is None or (action.nargs == "?" and takes):
            if value is not None:
                flags.append(value)
                i += 1
    moved = flags + overrides
    return moved if _hydra_args(moved) is not None else list(argv)


def _hydra_args(argv: list[str]):
    """Hydra's own reading of a command line (its flags, ``overrides`` the positional arguments); None where Hydra
    would print something and stop (``--version``, a flag it refuses)."""
    from hydra._internal.utils import get_args_parser

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return get_args_parser().parse_args(argv)
        except SystemExit:
            return None


def multirun_flag(argv: list[str]) -> str | None:
    """How a Hydra command line asks for a multirun, as typed: ``-m`` / ``--multirun``, or a ``hydra.mode=MULTIRUN``
    override (Hydra 1.3 takes either); None for a single run, and for ``--help`` / ``--hydra-help`` / ``--version``
    / shell completion, which print and run nothing."""
    args = _hydra_args(argv)
    if args is None or args.help or args.hydra_help or args.shell_completion:
        return None
    if args.multirun:
        return next((a for a in argv if a in ("-m", "--multirun")), "-m")
    for override in args.overrides:
        key, sep, value = override.partition("=")
        mode = value.strip().strip("'\"").upper()
        if sep and key.lstrip("+~") == "hydra.mode" and mode.rpartition(".")[2] == "MULTIRUN":
            return override
    return None


NON_ZERO_RANK_OVERRIDES = (
    # Hydra's own outputs (.hydra/, <job>.log) are written by rank 0 only; other ranks run in place.
    "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
)


def rank_argv(argv: list[str]) -> list[str]:
    """The command line ``argv`` of a command that trains (difflm-train, difflm-rl) for this process of a
    torchrun / srun launch: ranks other than 0 get :data:`NON_ZERO_RANK_OVERRIDES`, so that only rank 0 creates the
    Hydra run directory and writes its files. A multirun (``-m``) under several processes, which would start one
    sweep per process whose jobs wait on each other's collectives forever, ends in one line (exit status 2)."""
    from difflm.parallel.distributed import launch_env

    argv = hydra_flags_first(argv)  # a -m typed after an override counts (entry() reads it so)
    multirun = multirun_flag(argv) is not None  # -m, --multirun or hydra.mode=MULTIRUN
    env = launch_env()
    if multirun and env["world_size"] > 1:
        _say(f"difflm: error: a multirun (-m) under torchrun/srun ({env['world_size']} processes) would start one "
             "sweep per process, and their jobs wait on each other forever: sweep from one process with "
             "hydra/launcher=slurm (each job its own torchrun-style launch), or run one torchrun per point "
             "(docs/parallel.md)")
        sys.exit(2)
    return list(argv) + (list(NON_ZERO_RANK_OVERRIDES) if env["rank"] != 0 and not multirun else [])


def refuse_multirun(argv: list[str], prog: str) -> None:
    """Refuse a multirun (:func:`multirun_flag`) of a command that runs one job (difflm-generate, -eval, -export,
    -import, -preprocess), before Hydra starts: Hydra's launcher would create ``multirun/<date>/<time>/`` (and a job
    folder per job) in the working directory before the command's own checks ran, and the command writes nothing
    there. Raises: DifflmError naming the flag and the fix."""
    flag = multirun_flag(argv)
    if flag is not None:
        raise DifflmError(f"{prog} takes no {flag}: it runs one job (only difflm-train and difflm-rl sweep); drop "
                          f"{flag} and run {prog} once per setting")


def check_overrides(argv: list[str], config_name: str):
    """Check the keys and group selections of a Hydra command line against the config ``config_name`` composes.

    Checked: ``a.b=value`` (the key must exist, unless a node on its way is an open dict, a list or a value) and
    ``group=option`` (the option must be a preset of the group; under ``-m`` every option of a sweep), then each run
    the command line makes, one or every job of a ``-m`` sweep (expanded as Hydra's basic sweeper does), by
    :func:`difflm.config.job_check.check_job`: values of the wrong type and keys the run never reads. Left to Hydra
    (``+key=``, ``++key=``, ``~key`` and ``group@package=`` then to :func:`check_edits`):
    ``+key=``, ``++key=``, ``~key``, ``hydra.*`` and ``hydra/...``, ``group@package=``, overrides Hydra cannot parse,
    sweeps its basic sweeper cannot expand (intervals), command lines naming another primary config (``--config-name``:
    only its existence is checked, :func:`check_primary_config`, which also refuses ``--config-path``), rerunning a
    job (``--experimental-rerun``) or completing a shell (``-sc``). The folders ``--config-dir`` and
    ``hydra.searchpath=[...]`` add are searched as Hydra searches them, so your own presets are checked as difflm's
    are, and a preset file that does not compose (a key the schema lacks, a value of the wrong type) is refused
    naming the file and the key (:func:`difflm.config.job_check.preset_error`). Costs one compose for a single run
    that composes (~0.3 s), else a compose or two more to find the unknown key or preset, and one per job of a sweep.

    Returns: the config a single run's command line composes to (with its ``hydra`` node, as ``compose(...,
    return_hydra_config=True)`` gives it), for a caller that would compose it next; None otherwise (a sweep, a line
    with any override left to Hydra, or one Hydra refuses).

    A group selection the command does not take (difflm-import's ``objective=bd3lm``, :func:`_refused_selections`)
    is refused as one that is no preset is, saying what the command takes.

    Raises: DifflmError naming the first unknown key or preset, with the closest key or preset when there is one
    (``model.hiden_size is not a config key; did you mean model.hidden_size? ...``), the preset file that does not
    compose, or ``check_job``'s refusal (for a sweep, with the job it refuses).
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from difflm.config.job_check import check_job, compose_and_check, jobs_to_check, preset_error, quiet_conf, \
        search_path_of, sweep_jobs

    args = _hydra_args(argv)  # Hydra's own argument parser: the overrides are its positional arguments
    if args is None:  # --version, or a flag Hydra refuses: Hydra prints it
        return None
    if args.experimental_rerun or args.shell_completion:
        return None
    search = search_path_of(args.config_dir, args.overrides)  # --config-dir and hydra.searchpath: the user's presets
    if args.config_path or args.config_name:
        check_primary_config(args.config_path, args.config_name, config_name, search)
        return None
    if search is None:  # a hydra.searchpath Hydra refuses: Hydra says why
        return None
    parser, overrides = OverridesParser.create(), []
    for index, arg in enumerate(args.overrides):
        try:
            override = parser.parse_override(arg)
        except HydraException as err:
            if arg.partition("=")[0].lstrip("+~") in FREE_TEXT_KEYS:  # quoted by the entry point (quote_free_text)
                continue
            raise DifflmError(_unparsable(args.overrides, index, err, parser)) from None
        if not (override.is_hydra_override() or override.is_add() or override.is_force_add()
                or override.is_delete() or override.package is not None):
            overrides.append(override)
    if not overrides:
        return None
    prog = f"difflm-{config_name}"
    sweep = any(o.is_sweep_override() for o in overrides)
    if not sweep:  # a command line that composes names only known keys and presets: one compose checks it
        composed, message = compose_and_check([o.input_line for o in overrides], config_name, search)
        if composed is not None:
            message = message or _refused_selections(config_name, overrides)
            if message:
                raise DifflmError(message)
            # the config of the whole line only: one with overrides this check leaves to Hydra is composed by Hydra
            return composed if len(overrides) == len(args.overrides) else None

    def compose_checked(selections: list[str]):
        try:
            return compose(config_name, selections, return_hydra_config=True)
        except Exception as err:  # a preset file that does not compose (the user's own): named in one line
            message = preset_error(err, config_name, prog)
            if message:
                raise DifflmError(message) from None
            raise

    try:
        with quiet_conf(search):
            base = compose_checked([])
            groups = [g for g in base.hydra.runtime.choices if "/" not in g]
            loader = GlobalHydra.instance().config_loader()
            selections, keys = [], []
            for override in overrides:
                as_dict = not override.is_sweep_override() and isinstance(override.value(), dict)  # a key's value
                if override.key_or_group in groups and not as_dict:
                    options = _selected_options(override)
                    presets = loader.get_group_options(override.key_or_group)
                    message = _unknown_preset(override.key_or_group, options, presets)
                    if message:  # one the command does not take at all says what it takes instead
                        raise DifflmError(_refused_selections(config_name, [override]) or message)
                    if options:
                        selections.append(f"{override.key_or_group}={options[0]}")
                else:
                    keys.append(override)
            cfg = compose_checked(selections) if selections else base
            message = _refused_selections(config_name, overrides)  # presets that compose, but not for this command
            if message:
                raise DifflmError(message)
            jobs = sweep_jobs([o.input_line for o in overrides], loader) if sweep else \
                [[o.input_line for o in overrides]]
    except DifflmError:
        raise
    except Exception:  # a config this check cannot compose: Hydra composes it and reports why
        return None
    for override in keys:
        message = _unknown_key(cfg, override, groups, prog)
        if message:
            raise DifflmError(message)
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    for job in jobs_to_check(jobs, groups) if jobs else ():
        message = check_job(job, config_name, search)
        if message:  # a sweep's job named by its swept values
            which = " ".join(line for line in job if line.partition("=")[0] in swept)
            raise DifflmError(f"{message} (in the sweep's job {which})" if sweep else message)
    return None


def check_edits(argv: list[str], config_name: str) -> None:
    """Check the overrides of a command line that add, remove or move keys and presets (``+key=``, ``++key=``,
    ``~key``, ``group@package=``), which :func:`check_overrides` leaves to Hydra, by composing the line with them
    (for a ``-m`` sweep, its first job) after composing it without them. Hydra would end a mistake among them in its
    multi-line message and exit status 1 (``+optim.lr=`` of a key that exists, ``~run.dir`` of a key the schema
    always has), and ``--cfg job`` would print a ``+`` key the schema lacks that the run then refuses.

    A line that does not compose without them, or whose sweep Hydra cannot expand here, is left to Hydra and the
    other checks. Costs two composes (~0.3 s each), only for a line holding such an override.

    Raises: DifflmError naming the first override that does not compose, with Hydra's reason on one line (a key the
    schema always has: that it cannot be removed and to give it a value instead), or a ``+`` key the schema lacks
    (:func:`difflm.config.schema.check_known_keys`)."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config.job_check import hydra_message, quiet_conf, search_path_of, sweep_jobs
    from difflm.config.schema import check_known_keys

    args = _hydra_args(argv)
    if args is None or args.experimental_rerun or args.shell_completion or args.config_path or args.config_name:
        return
    search = search_path_of(args.config_dir, args.overrides)
    if search is None:
        return
    parser = OverridesParser.create()
    try:
        parsed = [parser.parse_override(arg) for arg in args.overrides]
    except Exception:  # noqa: BLE001 - a free-text value the entry point quoted: check_overrides judged the line
        return
    lines = [o.input_line for o in parsed]
    if multirun_flag(argv) is not None and any(o.is_sweep_override() for o in parsed):
        jobs = sweep_jobs(lines)
        if not jobs:
            return
        lines = jobs[0]
        parsed = [parser.parse_override(line) for line in lines]
    edits = [o.input_line for o in parsed if not o.is_hydra_override() and (
        o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None)]
    if not edits:
        return
    rest = [line for line in lines if line not in edits]

    def composes(overrides: list[str]):
        try:
            return compose(config_name, overrides), None
        except Exception as err:  # noqa: BLE001 - Hydra's reason, said on one line below
            return None, err

    with quiet_conf(search):
        if composes(rest)[1] is not None:  # not the edits' doing: Hydra or the other checks say why
            return
        cfg, err = composes(lines)
        if err is not None:  # the first edit that fails alone with the rest, with its own reason; else all together
            culprit, reason = next(((e, hydra_message(own)) for e in edits if (own := composes(rest + [e])[1])),
                                   (edits[0], hydra_message(err)))
            if "does not support deletion" in reason:
                key = parser.parse_override(culprit).key_or_group
                raise DifflmError(f"{culprit}: {key} cannot be removed: it is a key of the schema every "
                                  f"difflm-{config_name} config holds (difflm/config/schema.py); give it a value "
                                  f"instead ({key}=...)")
            edit = parser.parse_override(culprit)
            if edit.is_add() and ("Multiple values for" in reason or "appears more than once" in reason):
                group = edit.key_or_group
                raise DifflmError(f"{culprit}: {group} is a group of difflm-{config_name}'s config already (one "
                                  f"preset each): select it without +: {group}={culprit.partition('=')[2]}")
            raise DifflmError(f"{culprit}: {reason.replace(':.', ':')}")
    check_known_keys(cfg)


SUBMITIT_LAUNCHERS = ("slurm", "submitit_slurm", "submitit_local")  # hydra/launcher= options of the plugin
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def submitit_installed() -> bool:
    """Whether Hydra's submitit launcher plugin (``pip install '.[slurm]'``) can be imported."""
    import importlib.util

    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ImportError:
        return False


def check_launcher(argv: list[str], config_name: str) -> None:
    """Check a ``hydra/launcher=NAME`` of the command line before Hydra composes or launches anything: a name that is
    no launcher (Hydra's multi-line "Could not find" with its options), one of the submitit launcher plugin's
    (``slurm``, ``submitit_slurm``, ``submitit_local``) where the plugin is not installed (Hydra's "Could not load
    'hydra/launcher/submitit_slurm'"), and, for a ``-m`` sweep, SLURM's launcher on a machine without SLURM's ``srun``
    (submitit's ``RuntimeError: Could not detect "srun"`` traceback after Hydra made the sweep folder).

    Raises: DifflmError naming the launcher and the fix."""
    import shutil

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config.job_check import quiet_conf, search_path_of

    args = _hydra_args(argv)
    if args is None or args.help or args.hydra_help or args.shell_completion or args.config_path:
        return
    chosen, hydra_lines = None, []
    for arg in args.overrides:
        try:
            override = OverridesParser.create().parse_override(arg)
        except Exception:  # noqa: BLE001 - check_overrides judged the line
            continue
        if override.is_hydra_override() and not override.is_sweep_override():
            hydra_lines.append(arg)  # hydra.launcher._target_=... may name another launcher class
        if override.key_or_group == "hydra/launcher" and not override.is_delete() and not override.is_sweep_override():
            chosen = str(override.value())
    if chosen is None:
        return
    if chosen in SUBMITIT_LAUNCHERS and not submitit_installed():
        raise DifflmError(f"hydra/launcher={chosen} needs Hydra's submitit launcher plugin, which is not installed: "
                          "pip install hydra-submitit-launcher (from a clone: pip install '.[slurm]'), or drop "
                          "hydra/launcher= to run the jobs one after the other in this process")
    search = search_path_of(args.config_dir, args.overrides)
    if search is None:
        return
    with quiet_conf(search):
        launchers = GlobalHydra.instance().config_loader().get_group_options("hydra/launcher")
    if launchers and chosen not in launchers:
        close = difflib.get_close_matches(chosen, launchers, n=1)
        hint = f"; did you mean hydra/launcher={close[0]}?" if close else ""
        raise DifflmError(f"hydra/launcher={chosen} is not a launcher{hint} (launchers: {', '.join(launchers)})")
    if multirun_flag(argv) is None or args.cfg or args.info:
        return
    from hydra import compose

    with quiet_conf(search):
        try:
            target = compose(config_name=config_name, overrides=hydra_lines,
                             return_hydra_config=True).hydra.launcher.get("_target_")
        except Exception:  # noqa: BLE001 - Hydra says why when it composes the line
            return
    if target == SLURM_LAUNCHER and shutil.which("srun") is None:
        raise DifflmError(f"hydra/launcher={chosen} submits each job to SLURM, and this machine has no srun (SLURM's "
                          "commands are not on PATH): start the sweep on a SLURM login node, or run its jobs here "
                          "with hydra/launcher=submitit_local (each its own process) or without hydra/launcher= (one "
                          "after the other)")


def check_shadowed_presets(argv: list[str], config_name: str) -> None:
    """Refuse a run that selects a preset of which your own folder (``--config-dir``, ``hydra.searchpath``) holds a
    file under the name of one of difflm's own (``my_conf/model/tiny.yaml`` with ``model=tiny``, the default or typed)
    with other contents: Hydra finds difflm's ``conf/`` first, so your file would be left unread without a word. A
    copy with the same contents (a whole ``conf/`` copied as a start) passes. Costs one compose, only for a command
    line that adds a folder; for a ``-m`` sweep its first job's selections and every option a group is swept over.

    Raises: DifflmError naming your file, difflm's, and the fix (a new name)."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config import CONF_DIR
    from difflm.config.job_check import quiet_conf, search_path_of, sweep_jobs

    args = _hydra_args(argv)
    if args is None or args.help or args.hydra_help or args.shell_completion or args.config_path:
        return
    search = search_path_of(args.config_dir, args.overrides)
    folders = [entry[len("file://"):] for entry in search or () if entry.startswith("file://")]
    if not folders:
        return
    parser = OverridesParser.create()
    try:
        parsed = [parser.parse_override(arg) for arg in args.overrides]
    except Exception:  # noqa: BLE001 - check_overrides judged the line
        return
    lines = [o.input_line for o in parsed]
    if any(o.is_sweep_override() for o in parsed):
        lines = (sweep_jobs(lines) or [[]])[0]
    with quiet_conf(search):
        try:
            choices = dict(compose(config_name, lines, return_hydra_config=True).hydra.runtime.choices)
        except Exception:  # noqa: BLE001 - Hydra or the other checks say why
            return
    selected = [(group, str(option)) for group, option in choices.items() if option is not None]
    for o in parsed:
        if o.is_sweep_override() and o.key_or_group in choices:
            selected += [(o.key_or_group, str(v)) for v in (_selected_options(o) or ())]
    for group, option in selected:
        shipped = Path(CONF_DIR) / group / f"{option}.yaml"
        for folder in folders:
            mine = Path(folder) / group / f"{option}.yaml"
            if shipped.is_file() and mine.is_file() and mine.read_bytes() != shipped.read_bytes():
                raise DifflmError(f"{group}={option}: your {mine} is not read: difflm's own {shipped} has that name "
                                  f"and is found first; give your file a new name ({group}/{option}_mine.yaml) and "
                                  f"select it ({group}={option}_mine)")


def check_primary_config(config_path: str | None, name: str | None, config_name: str, search) -> None:
    """Refuse a ``--config-path`` and a ``--config-name`` that names no config, before Hydra's multi-line errors.

    ``--config-path`` replaces the folder of the primary config, so the groups every difflm config composes
    (``model/``, ``objective/``, ...) are no longer found unless it holds a whole copy of ``conf/`` (an absolute
    folder with ``model/`` and ``objective/``: passed to Hydra); a relative one is read as a Python package. Your own
    configs go in a folder passed as ``--config-dir``, which Hydra searches after difflm's own ``conf/``. ``--config-name NAME``
    must then be the command's own config or a ``NAME.yaml`` in one of the folders of ``search``
    (:func:`difflm.config.job_check.search_path_of`; an entry other than a ``file://`` folder leaves it to Hydra):
    another command's config in difflm's ``conf/`` (``difflm-train --config-name rl``) is refused too.
    The named config's own keys and the overrides are Hydra's to check.

    Raises: DifflmError naming the flag and the fix.
    """
    from difflm.config import CONF_DIR

    prog = f"difflm-{config_name}"
    if config_path and os.path.isabs(config_path) and all(
            os.path.isdir(os.path.join(config_path, group)) for group in ("model", "objective")):
        return  # a whole config tree of your own (a copy of conf/): Hydra composes from it
    if config_path:
        raise DifflmError(f"--config-path {config_path} is not an absolute folder holding difflm's config groups "
                          f"(model/, objective/, ...), which every config composes: put your configs in a folder and "
                          f"pass --config-dir FOLDER (and --config-name NAME for a NAME.yaml of your own there), or "
                          f"give the absolute path of a whole copy of difflm's conf/")
    if not name or search is None or any(not str(entry).startswith("file://") for entry in search):
        return
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    folders = [Path(str(entry)[len("file://"):]) for entry in search]
    if stem == config_name or any((folder / f"{stem}.yaml").is_file() for folder in folders):
        return
    mine = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
    where = f" (the configs there: {', '.join(mine)})" if mine else ""
    raise DifflmError(f"--config-name {name}: no {stem}.yaml in --config-dir{where}. Put "
                      f"{stem}.yaml in a folder and pass --config-dir FOLDER (start from a copy of "
                      f"{Path(CONF_DIR) / config_name}.yaml: its defaults list composes the groups), or leave "
                      f"--config-name out")


def check_sweep(argv: list[str], config_name: str, job_check) -> None:
    """Check every job of a ``-m`` sweep (:func:`multirun_flag`) of the command line ``argv`` before Hydra launches
    the first: each job's config, composed as Hydra will compose it
    (:func:`difflm.config.job_check.sweep_job_configs`), goes through what the job would check at its start:
    :func:`difflm.config.schema.check_known_keys`, :func:`check_required` and ``job_check(cfg, world_size, here)``
    (:func:`hydra_app`; difflm-train's :func:`difflm.config.validate.check_run`: ``parallel.tp=3`` that does not
    divide ``model.num_heads``, a batch the micro-batches do not fill, ...). Where the jobs run in this process
    (Hydra's basic launcher) ``world_size`` is this launch's and ``here`` true; under another launcher ``world_size``
    is its ``hydra.launcher.nodes`` x ``tasks_per_node`` and ``here`` false. A no-op for a single run, and for a sweep
    whose jobs are not known before it runs or that Hydra refuses (:func:`sweep_job_configs` returns None). A job's
    check that fails other than with a refusal is left to the job.

    Raises: DifflmError with the first refused job's message and the job, named by its swept values
    (``... (in the sweep's job parallel.tp=3)``)."""
    from omegaconf.errors import MissingMandatoryValue

    from difflm.config.job_check import search_path_of, sweep_job_configs
    from difflm.config.schema import check_known_keys
    from difflm.parallel.distributed import launch_env

    if multirun_flag(argv) is None:
        return
    args = _hydra_args(argv)
    if args is None or args.cfg or args.info or args.config_name or args.config_path or args.experimental_rerun:
        return
    search = search_path_of(args.config_dir, args.overrides)
    sweep = sweep_job_configs(config_name, args.overrides, search) if search is not None else None
    if sweep is None:
        return
    check_sweep_folders(sweep)
    world_size = launch_env()["world_size"] if sweep.here else sweep.world_size
    for job, swept, cfg in sweep.jobs:
        try:
            check_known_keys(cfg)
            check_required(cfg)
            job_check(cfg, world_size, sweep.here)
            continue
        except DifflmError as err:
            message = str(err)
        except MissingMandatoryValue as err:  # a ``???`` that only an interpolation reaches
            key = getattr(err, "full_key", None) or "a mandatory key"
            message = f"{key} is required: pass {key}=... on the command line"
        except Exception:  # noqa: BLE001 - not a refusal (an interpolation of Hydra's job state): the job says it
            continue
        launch = f", launched as {sweep.launch}" if sweep.launch else ""
        raise DifflmError(f"{message} (in the sweep's job {' '.join(swept or job)}{launch})")


def check_sweep_folders(sweep) -> None:
    """Refuse a ``-m`` sweep (:class:`difflm.config.job_check.SweepJobs`) whose jobs would not each run in a folder of
    their own inside the sweep's folder: Hydra resolves the sweep's folder (``hydra.sweep.dir``: ``run.dir``) once,
    with no job's values, but each job's folder with its own, so a ``run.dir`` naming a swept key
    (``run.dir=sweeps/lr_${optim.lr}``) scatters the jobs over several folders (``sweeps/lr_0.001/0``,
    ``sweeps/lr_0.0003/1``) while ``multirun.yaml`` goes in a third, and a ``hydra.sweep.subdir`` that does not tell
    the jobs apart puts several in one folder, where each later job resumes or refuses the earlier one's checkpoint.

    Raises: DifflmError naming the first job at fault, its folder and the fix."""
    def named(job, swept):
        return " ".join(swept or job)

    seen = {}
    for (job, swept, _), folder in zip(sweep.jobs, sweep.folders):
        if folder is None:
            continue
        top, sub = folder
        if sweep.sweep_dir is not None and top != sweep.sweep_dir:
            raise DifflmError(
                f"the sweep's folder changes with its values: run.dir (hydra.sweep.dir) is {sweep.sweep_dir!r} for "
                f"the sweep, but {top!r} for its job {named(job, swept)}, so its jobs would be scattered over "
                "several folders: give run.dir without the swept keys (every job runs in <run.dir>/<job number>), "
                "and name the jobs' folders by their values with hydra.sweep.subdir if you like (e.g. "
                "hydra.sweep.subdir='lr_${optim.lr}')")
        path = os.path.normpath(os.path.join(top, sub))
        if path in seen:
            raise DifflmError(
                f"the sweep's jobs {seen[path]} and {named(job, swept)} would both run in {path} "
                f"(hydra.sweep.subdir gives {sub!r} for both): each job needs a folder of its own; let "
                "hydra.sweep.subdir tell every job apart (the default ${hydra.job.num}, the job's number, does)")
        seen[path] = named(job, swept)


def _unparsable(args: list[str], index: int, err: Exception, parser) -> str:
    """The one-line error for ``args[index]``, an override Hydra's grammar cannot parse. A word without ``=`` after a
    ``key=value`` is the rest of a value the shell split at its spaces (``prompt=Hello, world``): the fix is to quote
    the whole value. Otherwise Hydra's reason and the quoting its grammar takes (``key='"a: (b)"'``)."""
    arg = args[index]
    if "=" not in arg:
        start = index
        while start > 0 and "=" not in args[start - 1]:
            start -= 1
        if start > 0:
            key, _, value = args[start - 1].partition("=")
            try:
                value = parser.parse_override(args[start - 1]).value()
            except Exception:  # noqa: BLE001 - the text as typed
                pass
            end = index
            while end + 1 < len(args) and "=" not in args[end + 1] and not args[end + 1].startswith("-"):
                end += 1
            words = " ".join([str(value), *args[start:end + 1]])
            what = "the prompt" if key.lstrip("+~").endswith("prompt") else "the value"
            return (f"'{arg}' is not key=value: the shell split {key}= at a space; quote {what}: "
                    f"{key}='{words}'")
        return f"'{arg}' is not key=value (an override is key=value, a group choice group=option)"
    key, _, value = arg.partition("=")
    reason = str(err).strip().splitlines()[-1] if str(err).strip() else "a syntax error"
    return (f"{arg}: Hydra cannot parse this value ({reason}); quote it inside shell quotes as Hydra's grammar "
            f"says: {key}='\"{value}\"'")


def _selected_options(override) -> list[str]:
    """The presets a group override selects (each one of a ``-m`` sweep), as Hydra spells them; [] for a glob or an
    interval sweep, which Hydra expands itself."""
    from hydra.core.override_parser.types import ValueType

    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    if override.is_discrete_sweep() and override.value_type != ValueType.GLOB_CHOICE_SWEEP:
        return list(override.sweep_string_iterator())
    return []


def _refused_selections(config_name: str, overrides) -> str | None:
    """The refusal of the first group selection among ``overrides`` (parsed) that the command does not take, else
    None: difflm-import's ``objective=`` other than ``mdlm`` / ``ar``
    (:func:`difflm.config.schema.import_objective_error`), refused with the same message whether the name is another
    objective preset (``bd3lm``) or none (``bogus``). A preset file of your own that does not compose is reported
    as such first (:func:`difflm.config.job_check.preset_error`)."""
    if config_name != "import":
        return None
    from difflm.config.schema import import_objective_error

    for override in overrides:
        if override.key_or_group == "objective" and not override.is_sweep_override():
            value = override.value()
            message = import_objective_error(value) if isinstance(value, str) else None
            if message:
                return message
    return None


def _unknown_preset(group: str, options: list[str], presets: list[str]) -> str | None:
    """The refusal of the first of ``options`` that is no preset of ``group`` (``null`` is one), else None."""
    for option in options:
        if option != "null" and option not in presets:
            close = difflib.get_close_matches(option, presets, n=1)
            hint = f"; did you mean {group}={close[0]}?" if close else ""
            article = "an" if group[0] in "aeiou" else "a"
            return f"{group}={option} is not {article} {group} preset{hint} (presets: {', '.join(presets)})"
    return None


def _unknown_key(cfg, override, groups: list[str], prog: str) -> str | None:
    """The refusal of ``override``'s key when ``cfg`` (struct) lacks it, else None. A list, a value or an open dict
    on the key's way ends the check there: Hydra and the schema judge what lies below."""
    from omegaconf import OmegaConf

    from difflm.config.job_check import closest_key, keys_of

    parts = override.key_or_group.split(".")
    node = cfg
    for part in parts:
        keys = keys_of(node)
        if keys is None or not OmegaConf.is_struct(node):
            return None
        if part not in keys:
            break
        node = node._get_node(part)  # not node[part]: that would resolve interpolations
    else:
        return None
    see = f"({prog} --cfg job prints every key)"
    if len(parts) == 1:  # a top-level name: a group or a key
        names = sorted({*groups, *(k for k in keys_of(cfg) if k != "hydra")})
        close = difflib.get_close_matches(parts[0], names, n=1)
        typed = override.input_line
        value = typed.partition("=")[2]
        if close:
            return f"{typed}: no config group or key '{parts[0]}'; did you mean {close[0]}={value}?"
        return f"{typed}: no config group or key '{parts[0]}' {see}"
    fixed = closest_key(cfg, parts)
    hint = f"; did you mean {fixed}?" if fixed else ""
    return f"{override.key_or_group} is not a config key{hint} {see}"
