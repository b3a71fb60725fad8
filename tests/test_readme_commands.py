"""Every command in README.md's bash blocks runs as written, as far as a CPU test can see in seconds: each
``difflm-*`` command (and ``torchrun ... -m difflm.train``) passes difflm's command-line checks and composes, as
``--cfg job`` would; each ``make`` target exists; each script named exists (a shell script parses and has the
suite named); each ``pip install '.[extra]'`` names an extra of pyproject.toml. A command of another kind fails the
test, so a new kind of README command gets a check here."""
from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from difflm.cli import FREE_TEXT_KEYS, check_overrides, quote_free_text

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HYDRA_COMMANDS = {"difflm-train": "train", "difflm-generate": "generate", "difflm-eval": "eval", "difflm-rl": "rl",
                  "difflm-export": "export", "difflm-import": "import", "difflm-preprocess": "preprocess"}
SETUP = ("python3 -m venv", ". .venv/bin/activate", "cd ")  # the environment's own commands


def readme_commands() -> list[tuple[int, str]]:
    """(line number, command) of every command in README.md's ```bash blocks: continuation lines joined, comments
    dropped, ``a && b`` split."""
    commands, block, start, pending = [], False, 0, ""
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        if not pending:
            start = number
        text = " ".join(shlex.split(line, comments=True, posix=False)) if line.strip() else ""
        if line.rstrip().endswith("\\") and "#" not in line.split("\\")[-1]:
            pending += text.rstrip("\\").rstrip() + " "
            continue
        if text.endswith("\\"):
            pending += text.rstrip("\\").rstrip() + " "
            continue
        full = (pending + text).strip()
        pending = ""
        for part in filter(None, (p.strip() for p in full.split("&&"))):
            commands.append((start, part))
    return commands


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_hydra_command(config_name: str, argv: list[str]) -> None:
    """difflm's checks of the command line (keys, presets, value types, quoting), then a compose of it."""
    from hydra import compose, initialize_config_dir

    from difflm.config import CONF_DIR

    argv = quote_free_text(argv, FREE_TEXT_KEYS)
    check_overrides(argv, config_name)
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)  # Hydra's own flags (--cfg job, -m) apart from the overrides
    overrides = [a for a in args.overrides if not a.startswith("hydra")]
    if not args.multirun and not args.help:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name, overrides)
        if config_name == "rl":  # difflm-rl's cross-key checks (a reward that needs data.answer_field, ...)
            from difflm.posttrain.runner import check_rl_config

            check_rl_config(cfg)


def check(command: str) -> None:
    words = shlex.split(command)
    head = words[0]
    if command.startswith(SETUP):
        return
    if head == "make":
        assert set(words[1:]) <= make_targets(), f"make {words[1:]}: no such target in the Makefile"
    elif head in HYDRA_COMMANDS:
        check_hydra_command(HYDRA_COMMANDS[head], words[1:])
    elif head == "difflm-plan":
        from difflm.plan.cli import parse_args as plan_args

        check_hydra_command("train", plan_args(words[1:])[1])
    elif head == "difflm-plot":
        from difflm.plot import parse_args

        parse_args(words[1:])
    elif head == "torchrun":
        module = words.index("-m")
        assert words[module + 1] == "difflm.train", command
        check_hydra_command("train", words[module + 2:])
    elif head == "pip" and words[1:3] == ["wheel", "--no-deps"] or head == "pip" and "torch" in words:
        return
    elif head == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in words[2:]:
            match = re.fullmatch(r"\.\[([\w,]+)\]", word)
            assert match or word.startswith("dist/"), f"{word}: install from the clone, pip install '.[extra]'"
            if match:
                assert set(match.group(1).split(",")) <= set(extras), word
    elif head in ("python", "python3") and words[1] == "-m":
        import importlib.util

        assert importlib.util.find_spec(words[2]) is not None, f"{words[2]}: no such module"
    elif head in ("python", "python3"):
        assert (ROOT / words[1]).is_file(), f"{words[1]}: no such script"
    elif head == "bash":
        script = ROOT / words[1]
        assert script.is_file(), f"{words[1]}: no such script"
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        if len(words) > 2:
            assert re.search(rf"^\s*{re.escape(words[2])}\)", script.read_text(), re.M), f"{words[2]}: no such suite"
    else:
        raise AssertionError(f"a README command this test does not know how to check: {command}")


COMMANDS = readme_commands()


def test_the_readme_commands_are_found():
    heads = {shlex.split(c)[0] for _, c in COMMANDS}
    assert {"make", "difflm-train", "difflm-generate", "difflm-eval", "difflm-export", "difflm-import",
            "difflm-preprocess", "difflm-plot", "torchrun", "bash", "pip"} <= heads
    assert len(COMMANDS) >= 25


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("line,command", COMMANDS, ids=[f"README:{n}" for n, _ in COMMANDS])
def test_readme_command_runs_as_written(line, command):
    check(command)


def test_a_broken_command_is_caught():
    from difflm.errors import DifflmError

    with pytest.raises(DifflmError, match="did you mean model.hidden_size"):
        check("difflm-train model.hiden_size=64")
    with pytest.raises(DifflmError, match="set data.answer_field"):
        check("difflm-rl init.run_dir=runs/sft data.path=prompts.jsonl reward=gsm8k")
    with pytest.raises(AssertionError, match="no such target"):
        check("make instal")
    with pytest.raises(AssertionError, match="no such script"):
        check("python scripts/nonexistent.py --data x")
    with pytest.raises(AssertionError, match="install from the clone"):
        check("pip install 'difflm[slurm]'")
    with pytest.raises(AssertionError, match="no such suite"):
        check("bash scripts/bench_suites.sh nosuchsuite")
