"""What Hydra leaves in the working directory: a command that runs one job refuses ``-m`` before Hydra's launcher
creates ``multirun/<date>/<time>/``, and a refused difflm-train / difflm-rl run takes back the ``outputs/<time>/`` (or
sweep) folders Hydra made for it while they hold only Hydra's records. Sweeps of difflm-train and difflm-rl keep
their folders (tests/test_end_to_end.py, tests/test_lifecycle.py)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difflm.cli import multirun_flag
from difflm import hydra_folders
from difflm.hydra_folders import note_created, remove_refused_run_dirs
from difflm.training.run_dir import LOCK_FILE

from conftest import run_cli_batch

ROOT = Path(__file__).resolve().parent.parent

# (module, the command's name, arguments that would otherwise pass its own checks or fail only inside the job)
SINGLE_JOB = [("difflm.generate", "difflm-generate", ["run.dir=r", "prompt=a,b"]),
              ("difflm.evaluate", "difflm-eval", ["run.dir=r", "data.path=x"]),
              ("difflm.interop.export", "difflm-export", ["run.dir=r", "out=o"]),
              ("difflm.interop.hf_import", "difflm-import", ["hf=h", "run.dir=r"]),
              ("difflm.preprocess", "difflm-preprocess", ["input=i", "output=o"])]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m <args>`` in ``tmp_path`` with this tree on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("argv,flag", [(["-m", "a=1"], "-m"), (["a=1", "--multirun"], "--multirun"),
                                       (["hydra.mode=MULTIRUN"], "hydra.mode=MULTIRUN"),
                                       (["++hydra.mode=multirun"], "++hydra.mode=multirun"),
                                       (["hydra.mode=RUN", "a=1"], None), (["a=1"], None), (["--help", "-m"], None),
                                       (["-c", "job", "prompt=-m"], None)])
def test_multirun_flag(argv, flag):
    assert multirun_flag(argv) == flag


@pytest.mark.parametrize("flag", ["-m", "--multirun", "hydra.mode=MULTIRUN"])
@pytest.mark.parametrize("module,prog,args", SINGLE_JOB, ids=[m for m, _, _ in SINGLE_JOB])
def test_a_single_job_command_refuses_a_multirun_before_hydra(module, prog, args, flag, tmp_path, monkeypatch,
                                                              capsys):
    """The entry point itself, in this process: one line naming the fix, exit status 2, nothing created."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [module, flag, *args])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"difflm: error: {prog} takes no {flag}: it runs one job (only difflm-train "
                                       f"and difflm-rl sweep); drop {flag} and run {prog} once per setting\n")
    assert list(tmp_path.iterdir()) == []


def test_the_planner_refuses_a_multirun(capsys):
    from difflm.plan.cli import main

    assert main(["-m", "model=tiny", "optim.lr=1e-4,3e-4"]) == 2
    assert capsys.readouterr().err == ("difflm: error: difflm-plan takes no -m: it runs one job (only difflm-train "
                                       "and difflm-rl sweep); drop -m and run difflm-plan once per setting\n")


@pytest.fixture(scope="module")
def single_job_multiruns(tmp_path_factory):
    """``<module> -m <args>`` for each command of :data:`SINGLE_JOB`, in an empty folder of its own, all in one
    process: (folder, outcome)."""
    folders = [tmp_path_factory.mktemp("multirun") for _ in SINGLE_JOB]
    return list(zip(folders, run_cli_batch([(module, ["-m", *args], cwd)
                                            for (module, _, args), cwd in zip(SINGLE_JOB, folders)])))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("module,prog,args", SINGLE_JOB, ids=[m for m, _, _ in SINGLE_JOB])
def test_no_multirun_folder_is_left_by_a_single_job_command(module, prog, args, single_job_multiruns):
    """A fault report: ``difflm-generate -m ...`` (and -eval, -export, -import, -preprocess) ran a one-job sweep
    whose launcher created ``multirun/<date>/<time>/`` with ``multirun.yaml`` and an empty job folder before the
    command's own refusal. Now: one line on stderr, exit status 2, the working directory untouched."""
    cwd, out = single_job_multiruns[SINGLE_JOB.index((module, prog, args))]
    assert (out.returncode, out.stdout) == (2, ""), out.stderr[-2000:]
    assert out.stderr.splitlines() == [f"difflm: error: {prog} takes no -m: it runs one job (only difflm-train and "
                                       f"difflm-rl sweep); drop -m and run {prog} once per setting"]
    assert list(cwd.iterdir()) == []


REFUSED = [["difflm.train", "model.hidden_size=-3"], ["difflm.rl"], ["difflm.rl", "-m", "init.run_dir=nowhere"],
           ["difflm.rl", "-m", "init.run_dir=nowhere", "run.dir=sweeps/rl"]]


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory):
    """Each command line of :data:`REFUSED` in an empty folder of its own, all in one process: (folder, outcome)."""
    folders = [tmp_path_factory.mktemp("refused") for _ in REFUSED]
    return list(zip(folders, run_cli_batch([(module, args, cwd) for (module, *args), cwd in zip(REFUSED, folders)])))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("args", REFUSED, ids=["train", "rl", "rl-sweep", "rl-sweep-run-dir"])
def test_a_refused_train_or_rl_run_leaves_no_folder(args, refused_runs):
    """A run refused inside its job (after Hydra made ``outputs/<time>/``, or a sweep folder and its job's) takes
    those folders back: they held only ``.hydra/``, the job's log, the lock and ``multirun.yaml``."""
    cwd, out = refused_runs[REFUSED.index(args)]
    assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith("difflm: error: "), out.stderr[-2000:]
    assert list(cwd.iterdir()) == []


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_a_refused_run_in_an_existing_run_dir_keeps_it(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine\n")
    out = _cli(tmp_path, "difflm.rl", f"run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE, "notes.txt"]  # no .hydra/
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine\n"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_a_refused_relaunch_keeps_the_records_of_what_trained(tmp_path):
    """A fault report: a refused relaunch of a finished run (``train.max_steps`` below its checkpoint) rewrote the
    run's ``.hydra/`` with the refused command line, and ``difflm-plot`` then labelled the run with it. Now the
    records of what trained are put back; a relaunch that trains records its own."""
    from conftest import FAST

    run = tmp_path / "run"
    args = ["difflm.train", "model=tiny", *FAST, f"run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
            "train.eval_every=0", "train.save_every=2"]
    assert _cli(tmp_path, *args, "train.max_steps=2").returncode == 0

    def records():
        return {str(f.relative_to(run)): f.read_bytes() for f in (run / ".hydra").rglob("*") if f.is_file()}

    trained = records()
    assert "train.max_steps=2" in (run / ".hydra" / "overrides.yaml").read_text()
    refused = _cli(tmp_path, *args, "train.max_steps=1", "optim.lr=0.5")
    assert refused.returncode == 2 and "is below the step of the checkpoint" in refused.stderr, refused.stderr[-2000:]
    assert records() == trained
    assert _cli(tmp_path, *args, "train.max_steps=3").returncode == 0
    overrides = (run / ".hydra" / "overrides.yaml").read_text()
    assert "train.max_steps=3" in overrides and "train.max_steps=2" not in overrides


def test_kept_records_are_put_back_exactly_on_a_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(hydra_folders, "_KEPT", [])
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- a=1\n")
    (run / "notes.txt").write_text("mine\n")
    hydra_folders.keep_records(run, [".hydra", "train.log"])
    (run / ".hydra" / "overrides.yaml").write_text("- a=2\n")  # what Hydra writes for the refused invocation
    (run / ".hydra" / "hydra.yaml").write_text("new\n")
    (run / "train.log").write_text("refused\n")
    remove_refused_run_dirs()
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [".hydra", ".hydra/overrides.yaml", "notes.txt"]
    assert (run / ".hydra" / "overrides.yaml").read_text() == "- a=1\n"
    (run / "train.log").write_text("earlier run\n")  # a log Hydra appends to: cut back to its length
    hydra_folders.keep_records(run, [".hydra", "train.log"])
    with open(run / "train.log", "a") as log:
        log.write("refused\n")
    remove_refused_run_dirs()
    assert (run / "train.log").read_text() == "earlier run\n"
    hydra_folders.keep_records(run, [".hydra"])
    hydra_folders.accept_records(run)  # the run recorded its settings: nothing is put back
    (run / ".hydra" / "overrides.yaml").write_text("- a=3\n")
    remove_refused_run_dirs()
    assert (run / ".hydra" / "overrides.yaml").read_text() == "- a=3\n"


def test_only_folders_holding_nothing_but_hydras_records_are_taken_back(tmp_path, monkeypatch):
    monkeypatch.setattr(hydra_folders, "_CREATED", [])
    records = (".hydra", LOCK_FILE, "train.log")
    plain, written, elsewhere = tmp_path / "out" / "a", tmp_path / "out" / "b", tmp_path / "kept" / "c"
    for path in (plain, written, elsewhere):
        if path is not elsewhere:
            note_created(path, records)
        (path / ".hydra").mkdir(parents=True)
        (path / ".hydra" / "config.yaml").write_text("x: 1\n")
        (path / "train.log").write_text("")
        (path / LOCK_FILE).write_text("pid 1\n")
        (path / "data_cache" / "empty").mkdir(parents=True)  # folders without files count as nothing
    (written / "metrics.jsonl").write_text("{}\n")
    assert remove_refused_run_dirs() == [plain]  # out/ still holds b: it stays
    assert not plain.exists() and written.is_dir() and elsewhere.is_dir()
    note_created(tmp_path / "new" / "deeper" / "run", records)
    (tmp_path / "new" / "deeper" / "run").mkdir(parents=True)
    assert remove_refused_run_dirs() == [tmp_path / "new" / "deeper" / "run", tmp_path / "new" / "deeper",
                                         tmp_path / "new"]
    assert remove_refused_run_dirs() == []  # each noted folder is judged once
