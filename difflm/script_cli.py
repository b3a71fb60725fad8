"""What the scripts of ``scripts/`` share on the command line: a usage error is one line on stderr,
``<script>: error: <message>``, with exit status 2 (never a traceback); a script that needs a CUDA GPU says so in one
line; and the processes a script starts end with it.

* :func:`parser`: an argparse parser named after the script whose errors are that one line (no usage block: ``--help``
  prints it); :func:`script_main` wraps a script's ``main(argv=None)`` so that a :class:`~difflm.errors.DifflmError`
  raised anywhere in it (a refused override, a file that is not what it should be) ends the same way, and Ctrl-C as
  ``<script>: interrupted`` with status 130.
* argument types that name the fix in their refusal: :func:`int_at_least`, :func:`positive_number`,
  :func:`comma_list`, :func:`shell_words`, :func:`caller_path`, :func:`existing_path`, :func:`output_file`,
  :func:`output_dir`; :func:`require_cuda`.
* child processes (:func:`start`, :func:`run`): each in a session of its own, stopped as a whole tree
  (:func:`stop_tree`) on a timeout, when the script gets SIGTERM, SIGINT or SIGHUP, and on Linux also when the script
  dies without a chance to stop them (SIGKILL): the kernel sends the child SIGTERM then (``PR_SET_PDEATHSIG``), so a
  torchrun child still stops its workers. :func:`difflm_env` gives a child the difflm this script runs.
"""
from __future__ import annotations

import argparse
import functools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from difflm.cli import EXIT_INTERRUPTED, _say, writable_output
from difflm.errors import DifflmError

KILL_GRACE_S = 20.0  # seconds a stopped child has after SIGTERM (difflm-train saves a checkpoint) before SIGKILL
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_prog = {"name": Path(sys.argv[0]).name or "script"}  # the running script's name, set by parser() / script_main
_children: dict[int, subprocess.Popen] = {}
_previous_handlers: dict[int, object] = {}


# ------------------------------------------------------------------ the command line
class ScriptParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose usage errors are one line, ``<prog>: error: <message>`` on stderr,
    exit status 2. Its sub-command parsers (``add_subparsers``) are of this class too."""

    def error(self, message: str):
        """Print the one-line usage error and exit 2 (argparse calls this for every parsing error)."""
        if message.startswith(("the following arguments are required", "unrecognized arguments")):
            message += f" ({self.prog} --help lists the arguments)"
        _say(f"{self.prog}: error: {message}")
        sys.exit(2)


def parser(script: str, doc: Optional[str], whole_doc: bool = False) -> ScriptParser:
    """The parser of the script file ``script`` (pass ``__file__``), named after it, with ``doc``'s first paragraph
    as the ``--help`` description (``whole_doc``: all of ``doc``, as written)."""
    name = Path(script).name
    _prog["name"] = name
    text = (doc or "").strip()
    if whole_doc:
        return ScriptParser(prog=name, description=text, formatter_class=argparse.RawDescriptionHelpFormatter)
    return ScriptParser(prog=name, description=text.split("\n\n")[0])


def script_main(fn: Callable) -> Callable:
    """Decorator of a script's ``main(argv=None)``: a :class:`DifflmError` raised in it prints
    ``<script>: error: <message>`` and exits 2; a child started with ``run(..., check=True)`` that fails prints
    ``<script>: error: <command> exited with status N`` (with the last line of its captured stderr) and exits 1; Ctrl-C prints ``<script>: interrupted`` and
    exits 130; a reader of the output that stops reading (``| head``) ends the script quietly, exit status 1.
    Everything else (a fault of the script) keeps its traceback."""
    name = Path(fn.__globals__.get("__file__") or sys.argv[0]).name

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _prog["name"] = name
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # a reader gone (| head) shows here, not in the interpreter's flush at exit
            return result
        except BrokenPipeError:
            try:  # the interpreter's flush at exit then has nowhere to fail
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            sys.exit(1)
        except DifflmError as err:
            message, status = f"{name}: error: {err}", 2
        except subprocess.CalledProcessError as err:
            words = [err.cmd] if isinstance(err.cmd, str) else [str(c) for c in err.cmd]
            command = " ".join(words[:4]) + (" ..." if len(words) > 4 else "")
            said = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
            why = f": {said.strip().splitlines()[-1]}" if said.strip() else " (its output is above)"
            message, status = f"{name}: error: {command} exited with status {err.returncode}{why}", 1
        except KeyboardInterrupt:
            message, status = f"\n{name}: interrupted", EXIT_INTERRUPTED
        _say(message)
        sys.exit(status)

    return wrapper


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``; its refusal names the fix (argparse adds the argument)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give one >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: give an integer >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def positive_number(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (seconds, a tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give one > 0") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0: give one above 0")
    return value


def comma_list(choices: Optional[Iterable[str]] = None, what: str = "name") -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated words (empty ones dropped), each one of ``choices`` when given."""
    known = None if choices is None else list(choices)

    def parse(text: str) -> list[str]:
        words = [w.strip() for w in text.split(",") if w.strip()]
        if not words:
            raise argparse.ArgumentTypeError(f"{text!r} names no {what}: give one or more, comma-separated")
        bad = [w for w in words if known is not None and w not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))}: not a known {what}; choose from "
                                             f"{', '.join(known)} (comma-separated)")
        return words

    parse.__name__ = f"comma-separated {what}s"
    return parse


def shell_words(text: str) -> list[str]:
    """An argparse ``type``: one string of words split as a shell splits them (:func:`shlex.split`: quotes group,
    ``'key=a b'`` is one word); a quote left open is refused."""
    try:
        return shlex.split(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(err).lower()}: close each quote (the words are split as a "
                                         "shell splits them)") from None


shell_words.__name__ = "shell-quoted words"


def caller_path(text: str) -> Path:
    """An argparse ``type``: a path as an absolute one, relative to the folder the script was started from (``~``
    expanded), so that it names the same file in a child started in another folder."""
    return Path(os.path.abspath(os.path.expanduser(text)))


def _writable(text: str, directory: bool) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a {'folder' if directory else 'file'} path")
    path = caller_path(text)
    try:
        return writable_output("", path, directory=directory)
    except DifflmError as err:  # "=<path> ...": the argument's name comes from argparse
        raise argparse.ArgumentTypeError(f"{text!r}{str(err).split(repr(str(path)), 1)[-1]}") from None


def output_file(text: str) -> Path:
    """An argparse ``type``: :func:`caller_path` of a file the script writes (``--json``), checked at once with
    :func:`difflm.cli.writable_output` (its folder is made and written to), so a path that cannot be written is
    refused before the work whose results it was to hold."""
    return _writable(text, directory=False)


def output_dir(text: str) -> Path:
    """An argparse ``type``: :func:`caller_path` of a folder the script writes into (``--out``), checked at once as
    :func:`output_file` checks a file (a file of that name is refused)."""
    return _writable(text, directory=True)


output_file.__name__, output_dir.__name__ = "writable file", "writable folder"


def existing_path(kind: str = "file", hint: str = "") -> Callable[[str], Path]:
    """An argparse ``type``: :func:`caller_path` of a ``kind`` (``file`` or ``folder``) that exists; the refusal
    ends with ``hint`` (what to give instead)."""
    def parse(text: str) -> Path:
        path = caller_path(text)
        ok = path.is_file() if kind == "file" else path.is_dir()
        if not ok:
            why = "does not exist" if not path.exists() else f"is not a {kind}"
            raise argparse.ArgumentTypeError(f"{text!r} {why}: give {hint or f'an existing {kind}'}")
        return path

    parse.__name__ = f"existing {kind}"
    return parse


def require_cuda(name: Optional[str] = None, instead: str = "") -> None:
    """Refuse to go on without a CUDA GPU: raises DifflmError ``<script> needs a CUDA GPU
    (torch.cuda.is_available() is False)``, then ``; <instead>`` when given (what runs without one)."""
    import torch

    if not torch.cuda.is_available():
        raise DifflmError(f"{name or _prog['name']} needs a CUDA GPU (torch.cuda.is_available() is False)"
                          + (f"; {instead}" if instead else ""))


# ------------------------------------------------------------------ child processes
def difflm_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's environment) with the folder holding the difflm package this script imported
    first on ``PYTHONPATH``, so that a child ``python -m difflm.train`` started in any folder runs the same difflm."""
    import difflm

    env = dict(os.environ if env is None else env)
    root = str(Path(difflm.__file__).resolve().parents[1])
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def _die_with_parent(parent: int) -> Optional[Callable[[], None]]:
    """The ``preexec_fn`` (run in the child between fork and exec) that asks Linux to send the child SIGTERM when its
    parent dies (``PR_SET_PDEATHSIG``; it survives the exec); None elsewhere. Linux ties the signal to the thread
    that forked, so children are started from the main thread (a worker thread's exit would stop them)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies (a no-op elsewhere): the ``initializer`` of a
    process pool's workers, which :func:`start` does not start."""
    preexec = _die_with_parent(os.getppid())
    if preexec is not None:
        preexec()


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` of a child that does not outlive this script: in a session of its
    own (so that :func:`stop_tree` reaches its process group), sent SIGTERM by the kernel when this script dies
    (Linux), and stopped with its whole tree when this script gets SIGTERM, SIGINT or SIGHUP (the handlers are
    installed at the first child; a previous handler still runs after)."""
    if popen_kwargs.get("preexec_fn") is not None:
        raise ValueError("start() sets preexec_fn itself")
    popen_kwargs.setdefault("start_new_session", True)
    popen_kwargs["preexec_fn"] = _die_with_parent(os.getpid())
    _install_handlers()
    proc = subprocess.Popen(list(cmd), **popen_kwargs)
    for pid in [pid for pid, p in _children.items() if p.poll() is not None]:
        del _children[pid]
    _children[proc.pid] = proc
    return proc


def run(cmd: Sequence[str], *, timeout: Optional[float] = None, check: bool = False, capture_output: bool = False,
        grace: float = KILL_GRACE_S, **popen_kwargs) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` through :func:`start`: on ``timeout`` the child's whole tree is stopped
    (:func:`stop_tree`, ``grace`` seconds between SIGTERM and SIGKILL) before ``subprocess.TimeoutExpired`` is
    raised; an exception here (Ctrl-C) stops it too. ``check``: a non-zero exit raises CalledProcessError."""
    if capture_output:
        popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
    proc = start(cmd, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree([proc], grace)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    except BaseException:
        stop_tree([proc], grace)
        raise
    finally:
        _children.pop(proc.pid, None)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (torchrun starts its workers in sessions of their own, so
    signalling its process group alone would miss them); [] where there is no /proc."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which only waits for its parent to read its status, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return state not in ("Z", "X")


def stop_tree(procs: Sequence[subprocess.Popen], grace: float = KILL_GRACE_S) -> None:
    """Stop each child of ``procs`` with everything it started: SIGTERM to the child, its process group and every
    descendant (difflm-train saves and exits on it, torchrun stops its workers), then, after at most ``grace``
    seconds, SIGKILL to what is left. Returns when all of them are gone (or 10 s after the SIGKILL)."""
    procs = [p for p in procs if p.poll() is None]
    trees = {p.pid: descendants(p.pid) for p in procs}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for proc in procs:
            for target in [proc.pid, *trees[proc.pid]]:
                try:
                    os.kill(target, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for proc in procs:
                proc.poll()
            left = [pid for pid, tree in trees.items() for pid in [pid, *tree] if _alive(pid)]
            if all(p.returncode is not None for p in procs) and not left:
                return
            time.sleep(0.1)
        for pid in trees:  # descendants that appeared since (a worker started late)
            trees[pid] = sorted(set(trees[pid]) | set(descendants(pid)))


def _install_handlers() -> None:
    """Install :func:`_on_signal` for :data:`STOP_SIGNALS` once (only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if sig not in _previous_handlers:
            _previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame) -> None:
    """Stop the live children (:func:`stop_tree`), then do what the signal did before: SIGINT raises
    KeyboardInterrupt (Python's handler), SIGTERM / SIGHUP end the script by that signal, with one line saying so."""
    live = [p for p in _children.values() if p.poll() is None]
    if live:
        stop_tree(live)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        stopped = f"; stopped {len(live)} child process{'es' if len(live) != 1 else ''}" if live else ""
        _say(f"{_prog['name']}: ended by {signal.Signals(signum).name}{stopped}")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
