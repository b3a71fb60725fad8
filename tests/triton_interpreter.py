"""Triton kernels run on the CPU by Triton's interpreter, for the tests of difflm's Triton kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def interpreted_json(code: str):
    """Run ``code`` in a Python process of its own under Triton's interpreter and return what its last line of
    standard output holds, read as JSON. ``TRITON_INTERPRET=1`` takes effect when Triton is imported, so not in the
    test's process; the tests folder is on the child's ``sys.path`` (``code`` may import the test modules). A non-zero
    exit fails the calling test with the end of the child's standard error."""
    tests = str(Path(__file__).parent)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, {tests!r})\n{code}"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
