"""Shared fixtures: compose a run config from the packaged conf/ tree, as `difflm-train` would."""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import difflm.config

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

# Under pytest-xdist (`make test`: one worker per core) each worker and every process it starts runs torch on one
# thread: N workers x N intra-op threads on N cores would oversubscribe them.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# The files that take longest (process launches, end-to-end CLI runs; measured in docs/testing.md), started first so
# that the workers of `--dist loadfile` end together rather than one waiting on a long file begun last.
LONGEST_FIRST = [
    "test_operations.py", "test_end_to_end.py", "test_parallel.py", "test_posttrain_layouts.py", "test_moe_parallel.py",
    "test_rl_learning.py", "test_eval.py", "test_cli.py", "test_preprocess.py", "test_llada_interop.py",
    "test_checkpoint.py", "test_plan.py", "test_lifecycle.py", "test_materialize.py", "test_benchmark.py",
    "test_config.py", "test_eval_harness.py", "test_lora.py", "test_hf_interop.py", "test_layout_check.py",
    "test_slurm.py", "test_command_line_errors.py", "test_megadlms_baseline.py", "test_adaptation.py",
    "test_lora_layouts.py", "test_sft.py", "test_qkv.py", "test_lora_parallel.py", "test_auto_batch.py",
    "test_plan_trace.py",
]


def pytest_configure(config):
    if XDIST_WORKER:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Put the files of :data:`LONGEST_FIRST` first (in that order), each file's tests keeping their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# A model small enough for many CPU steps in a test; the data is the embedded corpus.
FAST = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2",
    "train.eval_windows=4", "train.eval_mc_samples=2", "logger.progress_bar=false", "logger.num_samples=0",
    "schedule.warmup_steps=2",
]


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple, config_name: str):
    """Hydra's compose of ``overrides`` (conf/ does not change while the tests run): each command line is composed
    once per process; :func:`compose_run` hands out copies."""
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


def compose_run(overrides=(), config_name: str = "train", auto: bool = False):
    """The composed config for ``overrides``, from difflm's own conf/ directory (a copy of its own: tests edit it).

    ``model.*=auto`` is resolved for the CPU (:func:`difflm.model.auto_kernels.choose_kernels`: torch kernels, SDPA,
    no fused MLP), so tests that build a model from the config directly see concrete kernels on every machine;
    ``auto=True`` keeps the ``auto`` values for tests of the choice itself."""
    cfg = copy.deepcopy(_composed(tuple(overrides), config_name))
    if not auto and config_name == "train":
        import torch

        from difflm.model.auto_kernels import choose_kernels

        choose_kernels(cfg, torch.device("cpu"))
    return cfg


@pytest.fixture(scope="session")
def seed_token_cache(tmp_path_factory):
    """``seed(cfg)``: give a run that reads the default corpus (the data settings of :data:`FAST`) a copy of its
    token cache in ``cfg.data.cache_dir`` when that folder does not exist yet. The corpus is tokenized once per
    process instead of once per test (about 1.5 s each); the cache's key hashes the text, the tokenizer and the
    data settings, so the copy holds the files the run would have written. Other data settings are left alone."""
    from omegaconf import OmegaConf

    store = tmp_path_factory.mktemp("default_tokens")

    def settings(cfg):
        data = OmegaConf.to_container(cfg.data, resolve=True)
        cache_dir = data.pop("cache_dir")
        return (data, cfg.model.vocab_multiple), cache_dir

    default, _ = settings(compose_run([*FAST, f"data.cache_dir={store}"]))

    def seed(cfg):
        wanted, cache_dir = settings(cfg)
        if wanted != default or not cache_dir or Path(cache_dir).exists():
            return
        if not any(store.iterdir()):
            from difflm.data.preprocess import tokenize_corpus
            from difflm.data.tokenizer import build_tokenizer

            tokenize_corpus(cfg.data, build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple), str(store))
        shutil.copytree(store, cache_dir)

    return seed


@pytest.fixture
def fast_cfg(tmp_path, seed_token_cache):
    def make(*overrides):
        cfg = compose_run([*FAST, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *overrides])
        seed_token_cache(cfg)
        return cfg
    return make


def straight_and_resumed(fast_cfg, tmp_path, overrides, stop_at: int = 3) -> tuple[Path, Path, object]:
    """Train ``overrides`` (on top of :func:`fast_cfg`) straight through into ``tmp_path/a``, and again into
    ``tmp_path/b`` stopped after ``stop_at`` steps, checkpointed and resumed by a new Trainer (on the CPU). Returns the
    two run directories, whose ``metrics.jsonl`` an exact resume makes equal after ``stop_at``, and the resumed
    Trainer after its last step."""
    import torch

    from difflm.training.trainer import Trainer

    cpu = torch.device("cpu")
    straight = fast_cfg(*overrides, f"run.dir={tmp_path / 'a'}")
    Trainer(straight, straight.run.dir, cpu).fit()
    interrupted = fast_cfg(*overrides, f"run.dir={tmp_path / 'b'}")
    first = Trainer(interrupted, interrupted.run.dir, cpu)
    for _ in range(stop_at):
        first.train_step()
    first.save()
    del first
    resumed = Trainer(fast_cfg(*overrides, f"run.dir={tmp_path / 'b'}"), tmp_path / "b", cpu)
    assert resumed.resumed_from == stop_at
    resumed.fit()
    return tmp_path / "a", tmp_path / "b", resumed


def run_cli(*args: str, cwd=None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a difflm entry point as a user would (``python -m difflm.<module> ...``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_cli_batch(calls, timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """Run several entry points in one new process (``tests/cli_batch.py``), each as ``python -m <module> <args>``
    would run it (``sys.argv``, exit status, its own stdout and stderr), in the order given; ``calls`` holds
    ``(module, args)`` or ``(module, args, cwd)``. A process start (torch, difflm) costs seconds on a small CPU: a
    test of several short command lines (refusals, help) pays it once. Returns one CompletedProcess per call."""
    import tempfile

    spec = [{"module": c[0], "args": [str(a) for a in c[1]], "cwd": str(c[2] if len(c) > 2 else Path.cwd())}
            for c in calls]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
        runner = [sys.executable, str(Path(__file__).with_name("cli_batch.py")), str(Path(tmp, "spec.json")),
                  str(Path(tmp, "results.json"))]
        done = subprocess.run(runner, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(Path(tmp, "results.json").read_text())
    return [subprocess.CompletedProcess([sys.executable, "-m", c["module"], *c["args"]], r["returncode"], r["stdout"],
                                        r["stderr"]) for c, r in zip(spec, results)]


def load_script(name: str):
    """Import ``scripts/<name>.py`` (not a package) as module ``difflm_<name>``."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"difflm_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"difflm_{name}"] = module
    spec.loader.exec_module(module)
    return module


def script_usage_error(script, capsys, *argv, entry: str = "main") -> str:
    """Run ``script.<entry>(argv)`` (``main``), require the usage-error exit (status 2) with one line on stderr,
    ``<script>: error: ...``, and nothing on stdout; return that line (with its newline)."""
    with pytest.raises(SystemExit) as exit_info:
        getattr(script, entry)(list(argv))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    assert captured.err.count("\n") == 1 and ": error: " in captured.err, captured.err
    assert captured.out == ""
    return captured.err


def report(name: str, **values) -> None:
    """Print a GPU test's figures and append them to ``$DIFFLM_TEST_REPORT`` (JSON lines) when it is set: the
    numbers docs/performance.md quotes come from these lines."""
    print(name, values)
    path = os.environ.get("DIFFLM_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def spawn_ranks(worker, world: int, out) -> list:
    """Run ``worker(rank, world, port, out)`` in ``world`` spawned processes (``port``: a free localhost port for
    their gloo rendezvous) and return what each rank saved to ``out/rank{r}.pt``."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, str(out)), nprocs=world, join=True)
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rewrite_run_settings(run_dir, old: str, new: str) -> None:
    """Fake a run trained with other settings: replace ``old`` by ``new`` in its ``config.yaml`` and in the one each
    checkpoint carries (the settings ``step=N`` reads), rewriting those checkpoints' manifests to match."""
    from pathlib import Path

    from difflm.checkpoint.manifest import write_manifest

    run_dir = Path(run_dir)
    for path in [run_dir / "config.yaml", *sorted(run_dir.glob("checkpoints/step_*/config.yaml"))]:
        text = path.read_text()
        assert old in text, (path, old)
        path.write_text(text.replace(old, new))
        if path.parent.name.startswith("step_"):
            write_manifest(path.parent)
