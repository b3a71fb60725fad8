"""Run several difflm command lines in one Python process: ``python tests/cli_batch.py SPEC RESULTS``.

SPEC is a JSON list of ``{"module": "difflm.train", "args": [...], "cwd": "..."}``; each entry point's ``main()`` is
called in turn as ``python -m <module> <args>`` would call it (``sys.argv``, the working directory), with file
descriptors 1 and 2 redirected to files of its own, so that everything it prints (Python, C, logging handlers made
before the redirection) is its own. RESULTS gets a JSON list of ``{"returncode", "stdout", "stderr"}``: the exit
status as a process would report it (an uncaught exception: its traceback on stderr and status 1).

:func:`conftest.run_cli_batch` starts it. The torch and difflm imports, most of a short command's time, are paid once
for the batch; the command lines share one interpreter, so a batch holds commands whose outcome does not hang on
process state another one leaves (refusals, printed help, short runs in folders of their own).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback


def run_one(module: str, args: list[str], cwd: str) -> dict:
    start_dir = os.getcwd()
    streams = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(streams[0].fileno(), 1)
    os.dup2(streams[1].fileno(), 2)
    try:
        os.chdir(cwd)
        sys.argv = [module, *args]
        try:
            importlib.import_module(module).main()
            status = 0
        except SystemExit as exit_:  # as the interpreter reports sys.exit(code)
            status = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - an uncaught exception ends a process with its traceback, status 1
            traceback.print_exc()
            status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        os.chdir(start_dir)
    out = []
    for stream in streams:
        stream.seek(0)
        out.append(stream.read().decode("utf-8", errors="replace"))
        stream.close()
    return {"returncode": status, "stdout": out[0], "stderr": out[1]}


def main(spec_path: str, results_path: str) -> None:
    # the tree under test first, as for ``python -m`` started in the repository (not this script's folder)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(spec_path) as f:
        calls = json.load(f)
    results = [run_one(c["module"], c["args"], c["cwd"]) for c in calls]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
