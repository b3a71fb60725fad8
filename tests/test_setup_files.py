"""The set-up a newcomer meets: what `make install` installs against `make install-dev`, what CI installs before
`make test`, the license, and the example folders that git ignores and `make clean` removes."""
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def recipe(target: str) -> str:
    """The recipe lines of a Makefile target."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n?)+)", text, re.M)
    assert match, f"no target {target}"
    return match.group(1)


def test_install_is_the_runtime_and_install_dev_adds_the_test_tools():
    assert re.search(r"install -e \.\s*$", recipe("install"), re.M)  # no extras: what running needs
    assert "install -e '.[dev]'" in recipe("install-dev")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.split(">")[0].split("[")[0] in ("pytest", "lm-eval", "matplotlib") for d in project["dependencies"])
    assert any(d.startswith("pytest") for d in project["optional-dependencies"]["dev"])
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make install-dev") < ci.index("make test")


def test_make_test_spreads_files_over_xdist_workers_and_test_fast_leaves_out_the_slow_runs():
    """`make test` runs every test (no marker filter) on pytest-xdist workers, a file per worker (its module fixtures
    built once); pytest-xdist comes with the dev extra. `make test-fast` leaves out the end-to-end file and the tests
    marked slow, nothing else."""
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^PYTEST_PARALLEL = -n \$\(TEST_WORKERS\) --dist loadfile --no-loadscope-reorder$", text, re.M)
    full, fast = recipe("test"), recipe("test-fast")
    assert "$(PYTEST_PARALLEL)" in full and "-m \"" not in full and "--ignore" not in full and "-k " not in full
    assert "$(PYTEST_PARALLEL)" in fast and '-m "not slow"' in fast
    assert re.findall(r"--ignore=(\S+)", fast) == ["tests/test_end_to_end.py"]
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("pytest-xdist") for d in dev)


def test_the_license_is_apache_2_as_pyproject_says():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}


@pytest.mark.parametrize("folder", ["outputs", "multirun", "runs", "sweeps", "hf"])
def test_the_example_folders_are_ignored_and_cleaned(folder):
    out = subprocess.run(["git", "check-ignore", "-q", f"{folder}/x/metrics.jsonl"], cwd=ROOT)
    if out.returncode == 128:
        pytest.skip("not a git checkout")
    assert out.returncode == 0, f"{folder}/ is not git-ignored"
    assert re.search(rf"rm -rf .*\b{folder}\b", recipe("clean"))
