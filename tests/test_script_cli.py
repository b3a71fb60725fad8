"""difflm.script_cli, what the scripts of scripts/ share: one-line usage errors (exit 2), argument types that name the
fix, the CUDA check, and child processes that end with the script (a timeout, SIGTERM, SIGINT, and on Linux the
script's SIGKILL: the kernel's PR_SET_PDEATHSIG, through which a torchrun child still stops its workers)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from difflm import script_cli
from difflm.errors import DifflmError

REPO = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")


def one_line_exit(capsys, fn, *args) -> tuple[int, str]:
    """The exit status ``fn(*args)`` ends with and its stderr (which must be one line; stdout empty)."""
    with pytest.raises(SystemExit) as exit_info:
        fn(*args)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return exit_info.value.code, captured.err


def test_parser_errors_are_one_line_named_after_the_script(capsys):
    ap = script_cli.parser("/somewhere/tool.py", "What the tool does.\n\nMore detail.")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=1, help="steps")
    ap.add_argument("name", help="a name")
    assert ap.prog == "tool.py" and ap.description == "What the tool does."
    code, err = one_line_exit(capsys, ap.parse_args, ["x", "--steps", "0"])
    assert code == 2 and err == "tool.py: error: argument --steps: 0 is below 1: give an integer >= 1\n"
    code, err = one_line_exit(capsys, ap.parse_args, [])
    assert err == "tool.py: error: the following arguments are required: name (tool.py --help lists the arguments)\n"
    code, err = one_line_exit(capsys, ap.parse_args, ["x", "--nope"])
    assert err == "tool.py: error: unrecognized arguments: --nope (tool.py --help lists the arguments)\n"
    whole = script_cli.parser("tool.py", "Title.\n\n    example --flag\n", whole_doc=True)
    assert "    example --flag" in whole.format_help()


def test_argument_types_name_the_fix(tmp_path, monkeypatch):
    steps = script_cli.int_at_least(2)
    assert steps("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'x' is not an integer: give one >= 2$"):
        steps("x")
    assert script_cli.positive_number("2.5") == 2.5
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="give one"):
            script_cli.positive_number(bad)
    parts = script_cli.comma_list(("a", "b"), "part")
    assert parts("a,,b") == ["a", "b"] and script_cli.comma_list()("x,y") == ["x", "y"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'c': not a known part; choose from a, b"):
        parts("a,c")
    with pytest.raises(argparse.ArgumentTypeError, match="names no part"):
        parts(",")
    assert script_cli.shell_words("a=1 'b=x y' \"c\"") == ["a=1", "b=x y", "c"] and script_cli.shell_words("") == []
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'a=\"b': no closing quotation: close each quote"):
        script_cli.shell_words('a="b')
    monkeypatch.chdir(tmp_path)
    assert script_cli.caller_path("out/x") == tmp_path / "out" / "x"
    assert script_cli.caller_path("~/x") == Path.home() / "x"
    (tmp_path / "f.json").write_text("{}")
    calibration = script_cli.existing_path("file", "a calibration JSON")
    assert calibration("f.json") == tmp_path / "f.json"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'no.json' does not exist: give a calibration JSON$"):
        calibration("no.json")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'\.' is not a file: give a calibration JSON$"):
        calibration(".")
    assert script_cli.output_file("new/r.json") == tmp_path / "new" / "r.json" and (tmp_path / "new").is_dir()
    assert script_cli.output_dir("runs") == tmp_path / "runs"
    for kind, text, says in (("file", "f.json/r.json", r"'f.json/r.json' cannot be written \(.*\): choose a folder "
                                                       "you can write in$"),
                             ("file", "new", r"^'new' is a directory: give a file path$"),
                             ("dir", "f.json", r"^'f.json' is a file: give a directory path$"),
                             ("file", " ", r"^' ' is empty: give a file path$")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            (script_cli.output_file if kind == "file" else script_cli.output_dir)(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "new"]  # no probe left behind


def test_script_main_ends_refusals_in_one_line(capsys, monkeypatch):
    def refused(argv=None):
        raise DifflmError("--x 3: give 2")

    def child_failed(argv=None):
        raise subprocess.CalledProcessError(3, [sys.executable, "-m", "difflm.train", "a=1", "b=2"])

    def interrupted(argv=None):
        raise KeyboardInterrupt

    name = Path(__file__).name
    assert one_line_exit(capsys, script_cli.script_main(refused)) == (2, f"{name}: error: --x 3: give 2\n")
    code, err = one_line_exit(capsys, script_cli.script_main(child_failed))
    assert code == 1 and err == f"{name}: error: {sys.executable} -m difflm.train a=1 ... exited with status 3 " \
                                "(its output is above)\n"
    failing = [sys.executable, "-c", "import sys; sys.exit('no such thing')"]
    code, err = one_line_exit(capsys, script_cli.script_main(
        lambda: script_cli.run(failing, check=True, capture_output=True, text=True)))
    assert code == 1 and err == f"{name}: error: {' '.join(failing)} exited with status 1: no such thing\n"
    with pytest.raises(SystemExit) as exit_info:
        script_cli.script_main(interrupted)()
    assert exit_info.value.code == 130 and capsys.readouterr().err == f"\n{name}: interrupted\n"
    assert script_cli.script_main(lambda argv=None: 7)() == 7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DifflmError, match=r"^tool.py needs a CUDA GPU \(torch.cuda.is_available\(\) is False\); "
                                          r"--plan runs without one$"):
        script_cli.require_cuda("tool.py", instead="--plan runs without one")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("lines", [3, 100_000])  # held in the buffer until the end / written while the script runs
def test_a_reader_that_stops_reading_ends_the_script_quietly(lines):
    """``script.py | head``: the script's output pipe closes early; the script ends with status 1 and nothing on
    stderr (no BrokenPipeError traceback, from its prints or from the interpreter's flush at exit)."""
    code = textwrap.dedent(f"""
        from difflm import script_cli

        @script_cli.script_main
        def main():
            for i in range({lines}):
                print("row", i)
            return 0

        raise SystemExit(main())
        """)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root)})
    os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_children_run_this_difflm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", str(REPO)]))
    assert script_cli.difflm_env()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
    assert script_cli.difflm_env({"X": "1"}) == {"X": "1", "PYTHONPATH": str(REPO)}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    return script_cli._alive(pid)


def wait_for(predicate, timeout: float) -> bool:
    """Poll ``predicate`` every 0.1 s until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def read_pids(path: Path, count: int, timeout: float = 60) -> list[int]:
    """The ``count`` pids written one per line into ``path`` (waiting for them)."""
    assert wait_for(lambda: path.exists() and len(path.read_text().split()) >= count, timeout), path
    return [int(p) for p in path.read_text().split()[:count]]


SLEEPER = "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(600)"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_timeout_stops_the_child_and_what_it_started_in_its_own_session(tmp_path):
    pids = tmp_path / "pids"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", SLEEPER, PIDS], start_new_session=True)
        open(PIDS, "a").write(f"{os.getpid()}\\n")
        time.sleep(600)
    """).replace("SLEEPER", repr(SLEEPER)).replace("PIDS", repr(str(pids))))
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        script_cli.run([sys.executable, str(child)], timeout=5, grace=2, capture_output=True)
    assert time.monotonic() - started < 30
    for pid in read_pids(pids, 2, timeout=1):
        assert wait_for(lambda: not alive(pid), 10), f"process {pid} outlived the timeout"


PARENT = """
import sys, time
sys.path.insert(0, {repo!r})
from difflm import script_cli


@script_cli.script_main
def main():
    script_cli.start({child!r})
    time.sleep(600)


main()
"""


def start_parent(tmp_path: Path, child: list[str]) -> subprocess.Popen:
    """``parent.py``: a script that starts ``child`` with :func:`script_cli.start` and waits."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(repo=str(REPO), child=child))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_children_end_with_the_script(tmp_path, sig):
    """SIGTERM or SIGINT to the script stops its child first (the script then ends by SIGTERM, saying so, or as a
    Ctrl-C, status 130); SIGKILL leaves the child to the kernel, which sends it SIGTERM (Linux)."""
    if sig == signal.SIGKILL and not LINUX:
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pids = tmp_path / "pids"
    parent = start_parent(tmp_path, [sys.executable, "-c", SLEEPER, str(pids)])
    try:
        (child,) = read_pids(pids, 1)
        parent.send_signal(sig)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert wait_for(lambda: not alive(child), 15), f"the child {child} outlived its parent ({sig.name})"
    if sig == signal.SIGTERM:
        assert parent.returncode == -signal.SIGTERM
        assert err == "parent.py: ended by SIGTERM; stopped 1 child process\n"
    elif sig == signal.SIGINT:
        assert parent.returncode == 130 and err == "\nparent.py: interrupted\n"


WORKER = "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(600)\n"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_a_torchrun_child_stops_its_workers_when_the_script_is_killed(tmp_path):
    """torchrun starts its workers in sessions of their own: the script's SIGKILL reaches them only through torchrun,
    which the kernel sends SIGTERM (PR_SET_PDEATHSIG) and which then stops its workers."""
    pids = tmp_path / "pids"
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    parent = start_parent(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node=2", str(worker), str(pids)])
    try:
        workers = read_pids(pids, 2, timeout=120)
        torchrun = [p for p in script_cli.descendants(parent.pid) if p not in workers]
        assert torchrun, "no torchrun process"
        parent.kill()
        parent.wait(timeout=30)
    finally:
        parent.kill()
    for pid in [*torchrun, *workers]:
        assert wait_for(lambda: not alive(pid), 60), f"process {pid} outlived the killed script"
