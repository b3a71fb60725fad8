"""What every entry point shares: user mistakes end as one line on stderr with exit status 2, and free-text
values (prompts) reach Hydra as one string whatever characters they hold."""
from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from difflm.errors import DifflmError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for Ctrl-C


def writable_output(key: str, path, directory: bool = False) -> Path:
    """``path`` (a file, or with ``directory`` a directory to be written) checked before any work: its parent
    folders are created, and a probe file is written and removed there, so a mistake ends the command at once.

    Returns ``path`` as a Path (``~`` expanded). Raises: DifflmError naming ``key`` when ``path`` is a directory
    where a file is expected (or a file where a directory is), or its folder cannot be created or written
    (a file on the way, a read-only or pseudo filesystem such as /proc).
    """
    path = Path(path).expanduser()
    if not directory and path.is_dir():
        raise DifflmError(f"{key}={str(path)!r} is a directory: give a file path")
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
    (KeyboardInterrupt) prints ``difflm: interrupted`` and exits 130, as a shell reports it.

    A config passed as the first argument is checked first by :func:`difflm.config.schema.check_known_keys` (a key
    added with ``+`` that its schema lacks) and :func:`check_required`; a mandatory value read later (a ``???`` that
    only an interpolation reaches) ends the same way, naming its key.
    """
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    from difflm.config.schema import check_known_keys

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if args:
                check_known_keys(args[0])
                check_required(args[0])
            return fn(*args, **kwargs)
        except MissingMandatoryValue as err:
            key = getattr(err, "full_key", None) or "a mandatory key"
            message, status = f"difflm: error: {key} is required: pass {key}=... on the command line", 2
        except DifflmError as err:
            message, status = f"difflm: error: {err}", 2
        except InterpolationResolutionError as err:  # ${key} on the command line naming no key, or a failing resolver
            first = str(err).splitlines()[0]
            message = (f"difflm: error: {first}: fix the ${{...}} interpolation in the overrides (a prompt's text is "
                       "taken as typed unless it is one ${...} as a whole)")
            status = 2
        except KeyboardInterrupt:  # a second Ctrl-C during training, or one in any other command
            message, status = "\ndifflm: interrupted", EXIT_INTERRUPTED
        print(message, file=sys.stderr, flush=True)
        sys.exit(status)

    return wrapper


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
    whole (``${oc.env:PROMPT}``, on purpose), and every argument under ``-m``/``--multirun`` (where a comma list is a
    sweep on purpose).
    """
    if "-m" in argv or "--multirun" in argv:
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
