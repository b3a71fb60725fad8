"""The command lines of scripts/: every script answers ``--help`` with a description and a help text for every
argument, and bad input ends in one line ``<script>: error: ...`` naming the argument and the fix (exit 2), before
any work; a script that needs a CUDA GPU says so in one line."""
from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import load_script, script_usage_error

from difflm import script_cli

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.sh"))


class _Parsed(Exception):
    """Raised in place of parsing: the parser a script built is in ``args[0]``."""


def script_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``scripts/<name>`` builds when run as a command (caught before it parses anything)."""
    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
            mock.patch.object(sys, "argv", [str(REPO / "scripts" / name), "--help"]), \
            mock.patch.object(sys, "path", list(sys.path)):
        with pytest.raises(_Parsed) as parsed:
            runpy.run_path(str(REPO / "scripts" / name), run_name="__main__")
    return parsed.value.args[0]


def actions(parser: argparse.ArgumentParser, where: str = ""):
    """(where, action) for every argument of ``parser`` and of its sub-commands, --help left out."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        yield where, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from actions(sub, f"{where}{name} ")


def test_every_python_script_is_found():
    assert len(SCRIPTS) >= 20 and {"layout_check.py", "benchmark.py", "moe_balance.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_describes_the_script_and_every_argument(name, capsys):
    parser = script_parser(name)
    assert isinstance(parser, script_cli.ScriptParser), f"{name}: build its parser with difflm.script_cli.parser"
    assert parser.prog == name and len(parser.description or "") > 40
    undocumented = [f"{where}{'/'.join(a.option_strings) or a.dest}" for where, a in actions(parser) if not a.help]
    assert undocumented == [], f"{name}: arguments without a help text: {undocumented}"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith(f"usage: {name}")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("name", SCRIPTS + SHELL_SCRIPTS)
def test_help_as_a_command(name, tmp_path):
    """``--help`` exits 0 with its text on stdout and nothing on stderr; gpu_env.sh sets nothing up for it."""
    cmd = ["bash" if name.endswith(".sh") else sys.executable, str(REPO / "scripts" / name), "--help"]
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    if name.endswith(".py"):
        assert first.startswith(f"usage: {name}")
    else:
        assert first.startswith(("The GPU benchmark suites", "GPU staging helper")) and "#" not in proc.stdout[:40]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_shell_scripts_refuse_what_they_do_not_take(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_env.sh"), "bogus"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("gpu_env.sh: error: unknown argument 'bogus' (usage: . scripts/gpu_env.sh to set up this "
                           "shell, or bash scripts/gpu_env.sh install WHEEL_DIR; --help says more)\n")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench_suites.sh"), "nosuch"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("bench_suites.sh: error: unknown suite 'nosuch' (usage: ")
    assert not (tmp_path / "out").exists()


def stub_python(tmp_path, cuda: bool = True) -> dict:
    """An environment whose ``python3`` is a stub: it answers bench_suites.sh's CUDA probe with ``cuda`` and fails
    every other call (exit 3), so a suite's commands run and fail in milliseconds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text("#!/bin/bash\ncase \"$*\" in *cuda.is_available*) echo %s ;; *) echo \"stub $1\" >&2; exit 3 ;; "
                    "esac\n" % cuda)
    stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("args, says", [
    (["trainer", "x"], "trainer takes no arguments, not 1 (x) (usage: "),
    (["megadlms", "bf16", "fp8"], "megadlms takes at most one argument, not 2 (bf16 fp8) (usage: "),
    (["kernels"], "kernels needs a CUDA GPU (torch.cuda.is_available() is False)\n"),
])
def test_bench_suites_refuses_what_cannot_run_before_setting_up(tmp_path, args, says):
    """An extra suite argument, or a machine without a CUDA GPU: one line, exit status 2, nothing set up ($OUT)."""
    env = stub_python(tmp_path, cuda=False)
    proc = subprocess.run(["bash", "scripts/bench_suites.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"bench_suites.sh: error: {says}") and not (tmp_path / "out").exists()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bench_suites_refuses_another_folder_and_a_missing_export(tmp_path):
    env = stub_python(tmp_path)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench_suites.sh"), "kernels"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr == (f"bench_suites.sh: error: run it from the root of the difflm "
                                                    f"checkout (cd {REPO / 'scripts'}/..), not from {tmp_path}\n")
    if (REPO / ".megadlms").exists():
        pytest.skip("this checkout has a .megadlms export")
    proc = subprocess.run(["bash", "scripts/bench_suites.sh", "moe", "megadlms"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("bench_suites.sh: error: no MegaDLMs export in .megadlms")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bench_suites_exit_status_says_a_command_failed(tmp_path):
    """Each command of the suite runs although the one before failed (behind a ``| tail``, whose status bash would
    report), and the suite exits 1 with one line saying so."""
    proc = subprocess.run(["bash", "scripts/bench_suites.sh", "kernels"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=stub_python(tmp_path))
    assert proc.returncode == 1
    started = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("stub ")]
    assert started == [f"scripts/{name}.py" for name in ("attention_speed", "qkv_speed", "mlp_speed", "flash_tiles",
                                                         "optimizer_speed")]
    assert proc.stderr.splitlines()[-1] == f"bench_suites.sh: kernels: a command failed (its output is above; logs " \
                                           f"in {tmp_path / 'out'})"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_gpu_env_install_refuses_a_missing_wheel_folder_and_reports_pip(tmp_path):
    """``gpu_env.sh install`` without a folder of .whl files: one line, exit 2, nothing set up; a pip that fails:
    one line after its output, exit 1 (not the status of the import checks after it)."""
    env = {**stub_python(tmp_path), "SITE": str(tmp_path / "site-packages")}
    (tmp_path / "empty").mkdir()
    for args, why in (([], "install needs WHEEL_DIR"), ([str(tmp_path / "none")], f"WHEEL_DIR '{tmp_path}/none' is not "
                                                                                    "a folder"),
                      ([str(tmp_path / "empty")], f"WHEEL_DIR '{tmp_path}/empty' holds no .whl files")):
        proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_env.sh"), "install", *args], capture_output=True,
                              text=True, timeout=60, env=env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (f"gpu_env.sh: error: {why} (usage: bash scripts/gpu_env.sh install WHEEL_DIR, a "
                               "folder of the staged wheels)\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "site-packages").exists()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_env.sh"), "install", str(wheels)], capture_output=True,
                          text=True, timeout=60, env=env)  # the stub python3 fails as pip
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == (
        f"gpu_env.sh: error: pip could not install the wheels of {wheels} into {tmp_path / 'site-packages'} (its "
        "output is above)")


def test_bench_suites_gputests_runs_every_test_file_with_cuda_tests():
    """``bench_suites.sh gputests`` (one GPU) lists every test file with tests that run only on a CUDA GPU (skipped
    or left out elsewhere); test_parallel.py's need two GPUs (the layouts suite runs the multi-GPU launches)."""
    import re

    text = (REPO / "scripts" / "bench_suites.sh").read_text().replace("\\\n", "")  # continuation lines joined
    listed = {f"test_{name}.py" for name in re.search(r"ls tests/test_\{([\w,]+)\}\.py", text).group(1).split(",")}
    cuda_only = re.compile(r"skipif\(\s*not (torch\.cuda\.is_available\(\)|GPU\b|HOPPER\b)|skipif\(_gpu_reason\(\)"
                           r"|\[\"cuda\"\] if torch\.cuda\.is_available\(\)")
    with_cuda = {p.name for p in (REPO / "tests").glob("test_*.py") if cuda_only.search(p.read_text())}
    assert listed == with_cuda - {"test_parallel.py"}
    assert all((REPO / "tests" / name).is_file() for name in listed)


# ------------------------------------------------------------------ one-line refusals, script by script
@pytest.fixture
def no_cuda(monkeypatch):
    """This machine without a CUDA GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def needs_cuda(name: str, instead: str = "") -> str:
    """The one line of a script that needs a CUDA GPU."""
    return (f"{name}: error: {name} needs a CUDA GPU (torch.cuda.is_available() is False)"
            + (f"; {instead}" if instead else "") + "\n")


CASES = [  # script, argv, its stderr (exact)
    ("moe_balance", ["--runs", "bogus"], "moe_balance.py: error: argument --runs: 'bogus': not a known setting; "
                                         "choose from none, aux_loss, aux_free (comma-separated)\n"),
    ("moe_balance", ["--steps", "0"], "moe_balance.py: error: argument --steps: 0 is below 1: give an integer >= 1\n"),
    ("moe_balance", ["--window", "x"], "moe_balance.py: error: argument --window: 'x' is not an integer: give one "
                                       ">= 1\n"),
    ("qkv_speed", ["--shape", "x=1,2,3"], "qkv_speed.py: error: argument --shape: 'x=1,2,3': expected "
                                          "NAME=B,S,H,H_KV,D with a name and five positive integers, e.g. "
                                          "1.7b-mb8=8,4096,16,16,128\n"),
    ("qkv_speed", ["--shape", "a=1,2,3,4,5", "--tiles", "16"], "qkv_speed.py: error: argument --tiles: '16': "
                                                               "expected BLOCK_TxWARPS, 2 positive integers, e.g. "
                                                               "16x2\n"),
    ("qkv_speed", ["--shape", "a=1,2,3,4,5"], needs_cuda("qkv_speed.py")),
    ("mlp_speed", ["--shape", "x"], "mlp_speed.py: error: argument --shape: 'x': expected NAME=TOKENS,HIDDEN,FFN with "
                                    "a name and three positive integers, e.g. 1.7b-mb8=32768,2048,6144\n"),
    ("mlp_speed", ["--shape", "a=8,16,32"], needs_cuda("mlp_speed.py")),
    ("moe_permutation_speed", ["--shape", "a=8,16,4,8,32"],
     "moe_permutation_speed.py: error: argument --shape: 'a=8,16,4,8,32': TOP_K=8 is more than EXPERTS=4\n"),
    ("moe_permutation_speed", ["--shape", "a=8,16,4,2,32"], needs_cuda("moe_permutation_speed.py")),
    ("optimizer_speed", [], needs_cuda("optimizer_speed.py")),
    ("optimizer_speed", ["--steps", "0"], "optimizer_speed.py: error: argument --steps: 0 is below 1: give an "
                                          "integer >= 1\n"),
    ("fast_sampling_speedup", ["nonexistent_dir"], "fast_sampling_speedup.py: error: RUN_DIR='nonexistent_dir' has no "
                                                   "config.yaml: point RUN_DIR at a difflm-train output directory (or "
                                                   "a difflm-import one)\n"),
    ("fast_sampling_speedup", ["--length", "7", "--block", "3", "nonexistent_dir"],
     "fast_sampling_speedup.py: error: --length 7 is not a multiple of --block 3: give e.g. --block 1, or a --length "
     "that --block 3 divides (9)\n"),
    ("fast_sampling_speedup", ["--batch", "5", "run"], "fast_sampling_speedup.py: error: --batch 5 needs 5 prompts, "
                                                       "--prompts has 4: give more '|'-separated prompts or a smaller "
                                                       "--batch\n"),
    ("plan_published", ["--calibration", "nonexist.json"],
     "plan_published.py: error: argument --calibration: 'nonexist.json' does not exist: give a calibration JSON "
     "(difflm-plan --calibrate FILE writes one on a GPU)\n"),
    ("plan_check", ["--row", "bogus"], "plan_check.py: error: argument --row: 'bogus': expected 'NAME: override "
                                       "override ...', e.g. '125m: model=125m precision=bf16 data.seq_len=1024'\n"),
    ("plan_check", ["--row", "x: model.hiden_size=8"], "plan_check.py: error: --row x: model.hiden_size is not a "
                                                       "config key; did you mean model.hidden_size? (difflm-train "
                                                       "--cfg job prints every key)\n"),
    ("plan_check", ["--row", "x: model=tiny"], needs_cuda("plan_check.py", "--replan FILE plans a results file again "
                                                                           "without one")),
    ("plan_check", ["--replan", "nonexist.json"], "plan_check.py: error: argument --replan: 'nonexist.json' does not "
                                                  "exist: give a results file written by --json\n"),
    ("auto_speed_check", ["--steps", "3"], "auto_speed_check.py: error: --skip 6 leaves none of --steps 3 for the "
                                           "median: give --steps > --skip\n"),
    ("auto_speed_check", [], needs_cuda("auto_speed_check.py")),
    ("data_constrained", ["--budgets", "x", "--plot-only"],
     "data_constrained.py: error: argument --budgets: 'x': give comma-separated positive unique-token budgets, e.g. "
     "250000,1000000\n"),
    ("adaptation_table", ["--recipes", "bogus"],
     "adaptation_table.py: error: argument --recipes: 'bogus': not a known recipe; choose from dream, diffullama, "
     "llada2_wsd, fast_dllm_v2, megatron_bridge_hybrid (comma-separated)\n"),
    ("adaptation_table", ["--seeds", "1,x"], "adaptation_table.py: error: argument --seeds: '1,x': give distinct "
                                             "comma-separated integers, e.g. 0,1,2\n"),
    ("preprocess_speed", ["--data", "."], "preprocess_speed.py: error: --data {cwd}: no .txt files there: give a "
                                          "folder of .txt files (the shared Gutenberg books: "
                                          "/work/shared/data/corpora/gutenberg)\n"),
    ("rl_benchmark", ["--thresholds", "none,x"], "rl_benchmark.py: error: argument --thresholds: 'x': give 'none' "
                                                 "(the fixed step schedule) or a confidence threshold in (0, 1], "
                                                 "comma-separated, e.g. none,0.9\n"),
    ("rl_benchmark", ["--gen-length", "7"], "rl_benchmark.py: error: --gen-length=7 must be a multiple of "
                                            "--block-length=32; e.g. --gen-length=7 --block-length=7 --gen-steps=7\n"),
    ("rl_vs_dllm", ["--skip-dllm", "--block-length", "0"], "rl_vs_dllm.py: error: --gen-length, --gen-steps and "
                                                           "--block-length must be >= 1\n"),
    ("trace_gaps", ["--top", "-1", "t.json"], "trace_gaps.py: error: argument --top: -1 is below 0: give an integer "
                                              ">= 0\n"),
    ("megadlms_baseline", ["parse", "--seq-len", "64", "--global-batch", "8", "none.log"],
     "megadlms_baseline.py parse: error: argument log: 'none.log' does not exist: give a Megatron log saved by 'run' "
     "(--log-dir)\n"),
    ("megadlms_baseline", ["run", "--seq-len", "64", "--global-batch", "8", "--iters", "8", "--dry-run"],
     "megadlms_baseline.py run: error: --window 6,16 ends after --iters 8: give --iters >= 16 or an earlier window\n"),
    ("megadlms_baseline", ["run", "--seq-len", "64", "--global-batch", "6", "--dry-run"],
     "megadlms_baseline.py: error: --global-batch 6 must be a multiple of --micro-batch x --gpus = 4 (Megatron "
     "accumulates whole micro-batches)\n"),
    ("megadlms_baseline", ["run", "--seq-len", "64", "--global-batch", "8", "--extra", '--foo "a b', "--dry-run"],
     "megadlms_baseline.py run: error: argument --extra: '--foo \"a b': no closing quotation: close each quote (the "
     "words are split as a shell splits them)\n"),
    ("layout_check", ["--plan", "--big-overrides", "x=1 'y=2"], "layout_check.py: error: argument --big-overrides: "
                                                                 "\"x=1 'y=2\": no closing quotation: close each quote "
                                                                 "(the words are split as a shell splits them)\n"),
    ("qkv_speed", ["--shape", "a=1,2,3,4,5", "--json", "."], "qkv_speed.py: error: argument --json: '.' is a "
                                                               "directory: give a file path\n"),
    ("layout_check", ["--plan", "--out", "/proc/version"], "layout_check.py: error: argument --out: '/proc/version' is "
                                                           "a file: give a directory path\n"),
    ("attention_speed", ["--shape", "a=1,16,2,8", "--backend", "sdpa"], needs_cuda("attention_speed.py")),
    ("flash_tiles", [], needs_cuda("flash_tiles.py")),
]


@pytest.mark.parametrize("script, argv, says", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_bad_input_is_one_line(script, argv, says, capsys, tmp_path, monkeypatch, no_cuda):
    monkeypatch.chdir(tmp_path)  # relative paths name nothing here
    err = script_usage_error(load_script(script), capsys, *argv)
    assert err == says.format(cwd=tmp_path)


def test_benchmark_counts_are_checked_by_the_parser(capsys, tmp_path):
    err = script_usage_error(load_script("benchmark"), capsys, "--steps", "0", entry="cli")
    assert err == "benchmark.py: error: argument --steps: 0 is below 1: give an integer >= 1\n"
    (tmp_path / "f").write_text("")
    err = script_usage_error(load_script("benchmark"), capsys, "model=tiny", "--json", str(tmp_path / "f" / "b.json"),
                             entry="cli")  # a file where the folder goes: refused before any row runs
    assert err.startswith(f"benchmark.py: error: argument --json: '{tmp_path}/f/b.json' cannot be written (")
    err = script_usage_error(load_script("benchmark"), capsys, "--megadlms-precisions", "bf16,fp4", entry="cli")
    assert err == ("benchmark.py: error: argument --megadlms-precisions: 'fp4': not a known MegaDLMs precision; "
                   "choose from bf16, fp8 (comma-separated)\n")


@pytest.mark.parametrize("script, default, argv", [("layout_check", "layout_check", ["--plan"]),
                                                   ("auto_speed_check", "auto_speed_check", []),
                                                   ("data_constrained", "outputs/data_constrained", ["--plot-only"])])
def test_default_out_folders_are_checked_as_given_ones(script, default, argv, capsys, tmp_path, monkeypatch, no_cuda):
    """``--out`` left at its default (a folder under the current one) is checked as a given one: a file of that name
    is one usage line, before anything runs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / default).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / default).write_text("")
    err = script_usage_error(load_script(script), capsys, *argv)
    assert err == f"{script}.py: error: argument --out: '{default}' is a file: give a directory path\n"


def test_data_constrained_plot_only_without_jobs(capsys, tmp_path):
    err = script_usage_error(load_script("data_constrained"), capsys, "--plot-only", "--out", str(tmp_path))
    assert err == (f"data_constrained.py: error: --out {tmp_path}: no finished jobs there: give the --out of an "
                   "earlier sweep, or drop --plot-only to run one\n")


def test_plan_check_exits_1_when_a_row_fails(capsys, monkeypatch):
    """A row whose measurement fails prints ``failed: <reason>`` and the call exits 1, not 0."""
    check = load_script("plan_check")
    monkeypatch.setattr(script_cli, "require_cuda", lambda *a, **k: None)
    monkeypatch.setattr(check, "predict", lambda overrides, calibration, gpu=None: {"peak_bytes": 2**30,
                                                                                    "step_s": 0.1})
    ran = []

    def child(cmd, **kwargs):  # the measuring child, which ran out of memory
        ran.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 1, "", "torch.OutOfMemoryError: CUDA out of memory.\n")

    monkeypatch.setattr(script_cli, "run", child)
    assert check.main(["--row", "x: model=tiny", "--no-trace"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("x ") and last.endswith("failed: torch.OutOfMemoryError: CUDA out of memory.")
    (cmd, kwargs), = ran
    assert "--one" in cmd and kwargs["timeout"] == 240 and kwargs["env"]["PYTHONPATH"].startswith(str(REPO))


def test_plan_published_names_the_units_of_its_table(capsys):
    assert load_script("plan_published").main([]) == 0
    title, head, *rows = capsys.readouterr().out.splitlines()
    assert title.startswith("tokens/s per GPU as published and as planned; ratio = planned / published; GiB/GPU")
    assert head.split()[:6] == ["row", "GPUs", "published", "planned", "ratio", "GiB/GPU"] and len(rows) == 6
