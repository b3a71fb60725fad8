"""The command line: prompts reach Hydra as one string whatever they hold; prompt_file=; a mistyped key or preset
is one line before Hydra composes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from difflm.cli import check_overrides, check_required, hydra_quoted, quote_free_text
from difflm.errors import DifflmError
from difflm.generate import read_prompt

from conftest import FAST, run_cli, run_cli_batch

TEXTS = ["a, b", "ROMEO: my lord (aside) [exit]", "it's", "say \"hi\", ok", "back\\", "a\\'b", "${oc.env:HOME}",
         "k=v, w", "two\nlines", "", "{x: 1}"]


@pytest.mark.parametrize("text", TEXTS)
def test_quoted_text_parses_back_to_itself(text):
    value = OverridesParser.create().parse_override("prompt=" + hydra_quoted(text)).value()
    assert OmegaConf.create({"p": value}).p == text


def test_only_values_hydra_cannot_take_are_quoted():
    argv = ["run.dir=x", "prompt=a, b", "gen.length=8"]
    assert quote_free_text(argv, ("prompt",)) == ["run.dir=x", "prompt='a, b'", "gen.length=8"]
    for kept in (["prompt=ROMEO:"], ["prompt='a, b'"], ["prompt=${oc.env:USER}"], ["prompt=hello world"]):
        assert quote_free_text(kept, ("prompt",)) == kept
    assert quote_free_text(["prompt=x: (y)"], ("prompt",)) == ["prompt='x: (y)'"]
    assert quote_free_text(["-m", "prompt=a,b"], ("prompt",)) == ["-m", "prompt=a,b"]  # a sweep on purpose
    assert quote_free_text(["gen.cache=a,b"], ("prompt",)) == ["gen.cache=a,b"]  # other keys: Hydra's rules


@pytest.mark.parametrize("typed", ["true", "1e3", "null", "42", "Pay ${name} now", "[1, 2]", "a ${x} b ${y}"])
def test_prompt_is_the_text_as_typed(typed):
    """What Hydra would read as a bool, a number, None or a list, and text with an interpolation inside it, reach the
    prompt as the typed text (a fault report: ``prompt=true`` prompted with "True", ``Pay ${name}`` failed)."""
    (arg,) = quote_free_text([f"prompt={typed}"], ("prompt",))
    value = OverridesParser.create().parse_override(arg).value()
    assert OmegaConf.create({"p": value}).p == typed


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_a_bad_interpolation_is_one_line(cli_runs):
    out = cli_runs["interpolation"]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("difflm: error: Interpolation key 'nokey' not found")


def test_prompt_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("First line, with a comma\nsecond: (line)\n", encoding="utf-8")
    args = OmegaConf.create({"prompt": "", "prompt_file": str(path)})
    assert read_prompt(args) == "First line, with a comma\nsecond: (line)"
    assert read_prompt(OmegaConf.create({"prompt": "hi", "prompt_file": None})) == "hi"
    with pytest.raises(DifflmError, match="not both"):
        read_prompt(OmegaConf.create({"prompt": "hi", "prompt_file": str(path)}))
    with pytest.raises(DifflmError, match="prompt_file="):
        read_prompt(OmegaConf.create({"prompt": "", "prompt_file": str(tmp_path / "missing.txt")}))


def test_check_required_names_every_missing_key():
    check_required(OmegaConf.create({"run": {"dir": "x"}, "out": "y"}))  # all given: no error
    with pytest.raises(DifflmError, match=r"^out, run.dir are required: pass out=... run.dir=..."):
        check_required(OmegaConf.create({"run": {"dir": "???"}, "out": "???", "step": None}))


# Every entry point with a mandatory key, run with none given: one line naming the keys, exit 2, no traceback.
REQUIRED = [("difflm.evaluate", [], "data.path, run.dir are required"),
            ("difflm.evaluate", ["run.dir=somewhere"], "data.path is required"),
            ("difflm.generate", [], "run.dir is required"),
            ("difflm.interop.export", ["run.dir=somewhere"], "out is required"),
            ("difflm.interop.hf_import", [], "hf, run.dir are required"),
            ("difflm.preprocess", ["input=x.txt"], "output is required")]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The short command lines of this module's process tests, in one process (``run_cli_batch``): :data:`REQUIRED`
    and :data:`UNKNOWN` (a folder each), a bad interpolation, a mistyped key and a correct ``--cfg job`` line.
    Returns {"required": [...], "unknown": [(folder, outcome), ...], "interpolation", "mistyped", "correct":
    (folder, outcome)}."""
    required = [(module, args, tmp_path_factory.mktemp("required")) for module, args, _ in REQUIRED]
    folders = [tmp_path_factory.mktemp("unknown") for _ in UNKNOWN]
    unknown = [(module, [f"run.dir={cwd / 'run'}", *args], cwd) for (module, args, _), cwd in zip(UNKNOWN, folders)]
    mistyped, correct = tmp_path_factory.mktemp("mistyped"), tmp_path_factory.mktemp("correct")
    single = [("difflm.generate", ["run.dir=nowhere", "prompt=${nokey}"]),
              ("difflm.train", ["model.hiden_size=64", f"run.dir={mistyped / 'run'}"]),
              ("difflm.train", ["--cfg", "job", "model=125m", "model.hidden_size=64", "logger.sample_prompt=a=b",
                                f"run.dir={correct}"])]
    outs = run_cli_batch([*required, *unknown, *single])
    n, m = len(required), len(required) + len(unknown)
    return {"required": outs[:n], "unknown": list(zip(folders, outs[n:m])), "interpolation": outs[m],
            "mistyped": (mistyped, outs[m + 1]), "correct": (correct, outs[m + 2])}


@pytest.fixture(scope="module")
def required_runs(cli_runs):
    """Each command line of :data:`REQUIRED`, in a folder of its own (run in :func:`cli_runs`' process)."""
    return cli_runs["required"]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("module,args,message", REQUIRED, ids=[f"{m}-{len(a)}" for m, a, _ in REQUIRED])
def test_entry_points_name_their_missing_keys(module, args, message, required_runs):
    out = required_runs[REQUIRED.index((module, args, message))]
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"difflm: error: {message}: pass "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


UNKNOWN = [("difflm.train", ["+train.max_stepz=5"], "+train.max_stepz: train has no key max_stepz (did you mean "
                                                      "max_steps?); the keys of train are listed in "
                                                      "difflm/config/schema.py (TrainConfig)"),
           ("difflm.generate", ["+gen.sed=1"],
            "+gen.sed: gen has no key sed (did you mean seed?); the keys of gen are listed in difflm/config/schema.py "
            "(GenerateConfig)")]


@pytest.fixture(scope="module")
def unknown_key_runs(cli_runs):
    """Each command line of :data:`UNKNOWN` with a run.dir in a folder of its own (run in :func:`cli_runs`'
    process): (folder, outcome)."""
    return cli_runs["unknown"]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("module,args,message", UNKNOWN, ids=[m for m, _, _ in UNKNOWN])
def test_entry_points_refuse_a_key_added_with_plus_that_the_schema_lacks(module, args, message, unknown_key_runs):
    cwd, out = unknown_key_runs[UNKNOWN.index((module, args, message))]
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == f"difflm: error: {message}\n"
    assert not (cwd / "run" / "checkpoints").exists()


def test_generation_past_the_trained_length_is_reported():
    from difflm.generate import beyond_trained_length

    assert beyond_trained_length(60, 4, 64) is None
    assert beyond_trained_length(300, 16, 64) == (
        "difflm: warning: the prompt (300 tokens) and gen.length=16 make 316 positions, more than the run's "
        "data.seq_len=64 it was trained on: expect poor text; shorten the prompt or gen.length")


def test_kernel_override_errors_blame_the_override_not_the_run():
    import torch

    from conftest import compose_run
    from difflm.generate import apply_kernel_overrides

    cfg = compose_run(["model=tiny"])
    assert cfg.model.backend == "torch"
    with pytest.raises(DifflmError, match=r"^kernels.backend=te needs CUDA and the device is cpu: drop it"):
        apply_kernel_overrides(cfg, OmegaConf.create({"backend": "te"}), torch.device("cpu"))
    te_run = compose_run(["model=tiny", "model.backend=te"])
    with pytest.raises(DifflmError, match=r"^the run's model.backend=te needs CUDA .* add kernels.backend=torch"):
        apply_kernel_overrides(te_run, None, torch.device("cpu"))


def test_forward_only_reads_leave_the_training_kernels_out():
    """A run trained with compiled blocks or the fused (quack) MLP is read back with the kernels every host has: the
    parameters are the same, and quack's gains are in training."""
    import torch

    from conftest import compose_run
    from difflm.generate import apply_kernel_overrides

    cfg = compose_run(["model=tiny", "model.compile=true", "model.fused_mlp=true", "model.fused_mlp_autotune=true"])
    apply_kernel_overrides(cfg, None, torch.device("cpu"))
    assert (cfg.model.compile, cfg.model.fused_mlp, cfg.model.fused_mlp_autotune) == (False, False, False)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "RANK": "1"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}],
                         ids=["torchrun", "srun"])
@pytest.mark.parametrize("module,extra", [("difflm.train", []), ("difflm.rl", ["init.run_dir=x"])],
                         ids=["train", "rl"])
def test_a_multirun_under_a_multi_process_launch_is_refused(env, module, extra, tmp_path):
    """``torchrun --nproc-per-node 2 -m difflm.train -m optim.lr=a,b`` (or ``difflm.rl``) would start one sweep per
    rank; the first job would finish and the second hang in its collectives (30 minutes by default). It is refused
    at once, before Hydra starts, naming the two ways that work."""
    out = subprocess.run([sys.executable, "-m", module, "-m", "optim.lr=1e-4,3e-4", f"run.dir={tmp_path}/s", *extra],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("difflm: error: a multirun (-m) under torchrun/srun (2 processes) would start one "
                                 "sweep per process"), out.stderr
    assert "hydra/launcher=slurm" in out.stderr and not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv", [["-m", "optim.lr=1e-4,3e-4"], ["model=tiny", "-m", "optim.lr=1e-4,3e-4"]])
def test_rank_argv_refuses_a_multirun_wherever_its_flag_stands(argv, monkeypatch, capsys):
    """A ``-m`` after an override is one the entry point moves first: refused under two ranks as one typed first; a
    single run of rank 1 gets the overrides that keep Hydra's files to rank 0."""
    from difflm.cli import NON_ZERO_RANK_OVERRIDES, rank_argv

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        rank_argv(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("difflm: error: a multirun (-m) under torchrun/srun (2 processes)")
    assert rank_argv(["model=tiny"]) == ["model=tiny", *NON_ZERO_RANK_OVERRIDES]


# A mistyped key or preset, refused before Hydra composes (difflm.cli.check_overrides), run through each entry point.
TYPOS = [("difflm.train", ["model.hiden_size=64"], "model.hiden_size is not a config key; did you mean "
                                                   "model.hidden_size? (difflm-train --cfg job prints every key)"),
         ("difflm.train", ["modle=tiny"], "modle=tiny: no config group or key 'modle'; did you mean model=tiny?"),
         ("difflm.train", ["model=tinyy"], "model=tinyy is not a model preset; did you mean model=tiny? (presets: "
                                           "1.7b, 125m, 350m, 8b, dense-1b, llada-moe-7b-a1b, llada-moe-tiny, llada2-mini, "
                                           "llada2-tiny, moe-1b-7b, moe-tiny, tiny)"),
         ("difflm.train", ["-m", "model=tiny,tinyy"], "model=tinyy is not a model preset; did you mean model=tiny? "
                                                      "(presets: 1.7b, 125m, 350m, 8b, dense-1b, llada-moe-7b-a1b, "
                                                      "llada-moe-tiny, llada2-mini, llada2-tiny, moe-1b-7b, moe-tiny, "
                                                      "tiny)"),
         ("difflm.train", ["trian.max_steps=3"], "trian.max_steps is not a config key; did you mean train.max_steps? "
                                                 "(difflm-train --cfg job prints every key)"),
         ("difflm.evaluate", ["eval.mc_sample=4"], "eval.mc_sample is not a config key; did you mean eval.mc_samples? "
                                                   "(difflm-eval --cfg job prints every key)"),
         ("difflm.evaluate", ["model=tiny"], "model=tiny: no config group or key 'model' (difflm-eval --cfg job "
                                             "prints every key)"),
         ("difflm.interop.hf_import", ["objectiv=mdlm"], "objectiv=mdlm: no config group or key 'objectiv'; did you "
                                                         "mean objective=mdlm?"),
         ("difflm.interop.hf_import", ["objective=mdml"], "objective=mdml is not an objective difflm-import writes: it "
                                                          "writes objective=mdlm or objective=ar runs (without "
                                                          "objective=: ar for a causal difflm export, else mdlm); did "
                                                          "you mean objective=mdlm?"),
         ("difflm.generate", ["gen.lenght=8"], "gen.lenght is not a config key; did you mean gen.length? "
                                               "(difflm-generate --cfg job prints every key)"),
         ("difflm.interop.export", ["dtyp=bf16"], "dtyp=bf16: no config group or key 'dtyp'; did you mean dtype=bf16?"),
         ("difflm.preprocess", ["worker=2"], "worker=2: no config group or key 'worker'; did you mean workers=2?")]


@pytest.mark.parametrize("module,args,message", TYPOS, ids=[f"{m}-{a[-1]}" for m, a, _ in TYPOS])
def test_a_mistyped_key_or_preset_is_one_line_before_hydra(module, args, message, monkeypatch, capsys):
    """The entry point itself (in this process: the refusal comes before Hydra starts): one line, exit status 2."""
    import importlib

    entry = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, *args, "run.dir=somewhere"])
    with pytest.raises(SystemExit) as exit_info:
        entry()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"difflm: error: {message}\n"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_a_mistyped_key_on_the_command_line_is_all_that_is_printed(cli_runs):
    tmp_path, out = cli_runs["mistyped"]
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("difflm: error: model.hiden_size is not a config key; did you mean model.hidden_size? "
                          "(difflm-train --cfg job prints every key)\n")  # not Hydra's "use +model.hiden_size=64"
    assert not (tmp_path / "run").exists()


PASSING = [("train", ["model=125m", "model.hidden_size=64", "experiment=mdlm_owt", "device=cpu", "run.dir=x"]),
           ("train", ["-m", "model.hidden_size=64,128", "model=tiny,125m", "optim.lr=range(1,3)", "model=glob(*)"]),
           ("train", ["logger.sample_prompt='a=b'", "data.blend.0.path=x", "data.blend=[{path:a}]",
                      "model={hidden_size:64}", "experiment=null"]),
           ("train", ["+model.zz=1", "++model.yy=1", "~model.qk_norm", "hydra.job.chdir=true", "hydra/launcher=basic",
                      "logger.sample_prompt=a=b"]),  # left to Hydra and check_known_keys
           ("train", ["--config-name", "train", "model.hiden_size=1"]),  # another primary config: left to Hydra
           ("import", ["objective=mdlm", "objective.eps=0.1", "hf=x", "run.dir=y"]),
           ("eval", ["data.path=x", "eval.mc_samples=2", "kernels.backend=torch", "step=3"])]


@pytest.mark.parametrize("config_name,argv", PASSING, ids=range(len(PASSING)))
def test_command_lines_with_known_keys_and_presets_pass(config_name, argv):
    check_overrides(argv, config_name)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_a_correct_command_line_reaches_hydra_unchanged(cli_runs):
    _, out = cli_runs["correct"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "  hidden_size: 64\n" in out.stdout and "  sample_prompt: a=b\n" in out.stdout


def _errors_said_by_ranks(monkeypatch, rank_variable: str, *args) -> list[int]:
    """The number of ``difflm: error:`` lines ranks 0 and 1 (``rank_variable`` set to each) print for the command
    line ``args``, each asserted to exit 2."""
    counts = []
    for rank in ("0", "1"):
        monkeypatch.setenv(rank_variable, rank)
        out = run_cli(*args, timeout=300)
        assert out.returncode == 2, (args, rank, out.stderr[-500:])
        counts.append(sum(line.startswith("difflm: error:") for line in out.stderr.splitlines()))
    return counts


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_errors_under_torchrun_are_said_once_by_rank_0(monkeypatch):
    """Every rank checks the same command line and config: rank 0 says what is wrong, the others exit 2 without a
    word (a 2-rank launch printed each line twice, and two ranks' lines could run together)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [("difflm.train", "model=tiny", "device=cpu", "parallel=ddp", "train.global_batch_size=6",
              "train.micro_batch_size=4"),  # a config check (check_run)
             ("difflm.train", "model.hiden_size=64")]  # a mistyped key (check_overrides)
    for args in cases:
        assert _errors_said_by_ranks(monkeypatch, "RANK", *args) == [1, 0], args


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_rl_errors_under_torchrun_are_said_once_by_rank_0(monkeypatch, tmp_path):
    """difflm-rl's checks of its config, records and layout run alike on every rank before any process group: rank
    0 says what is wrong, the others exit 2 without a word, and no rank leaves a run.dir behind."""
    from test_posttrain_runtime import GSM8K, make_init_run

    (tmp_path / "init").mkdir()
    init = make_init_run(tmp_path / "init")
    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["difflm.rl", f"init.run_dir={init}", "device=cpu", "data.prompt_field=question",
            "data.answer_field=answer", "parallel=fsdp", f"run.dir={tmp_path / 'rl'}"]
    for extra in ([f"data.path={tmp_path / 'empty.jsonl'}"],  # the records
                  [f"data.path={GSM8K}", "algorithm.prompts_per_step=3"]):  # the layout
        assert _errors_said_by_ranks(monkeypatch, "RANK", *base, *extra) == [1, 0], extra
        assert not (tmp_path / "rl").exists()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_errors_under_srun_are_said_once_by_task_0(monkeypatch):
    """srun sets SLURM_PROCID, not RANK: the rank is read the one way the launch is (launch_env), so a mistyped key
    is said once there too, also by an entry point that does not set RANK itself (difflm-eval)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert _errors_said_by_ranks(monkeypatch, "SLURM_PROCID", "difflm.evaluate", "eval.mc_sample=4") == [1, 0]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_hydra_job_chdir_keeps_relative_paths_relative_to_the_launch_folder(tmp_path):
    """``hydra.job.chdir=true`` moved the job into run.dir, so a relative ``data.path`` or ``data.tokenizer`` (in the
    launch folder) was reported missing. Every path is read from the launch folder, for train and preprocess alike."""
    import shutil

    from difflm.config import ASSETS

    shutil.copytree(ASSETS / "tokenizers" / "gpt-neox-20b", tmp_path / "toks" / "neox")
    (tmp_path / "small.txt").write_text("hello world, a small corpus for a short run.\n" * 400)
    res = run_cli("difflm.train", *FAST, "train.max_steps=1", "train.eval_every=0", "data.path=small.txt",
                  "data.tokenizer=./toks/neox", "data.cache_dir=cache", "run.dir=runs/a", "hydra.job.chdir=true",
                  "device=cpu", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "runs" / "a" / "metrics.jsonl").exists() and (tmp_path / "cache").is_dir()
    assert not (tmp_path / "runs" / "a" / "runs").exists()  # run.dir is not taken relative to itself
    res = run_cli("difflm.preprocess", "input=small.txt", "output=shards", "tokenizer=./toks/neox", "workers=1",
                  "hydra.job.chdir=true", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert list((tmp_path / "shards").glob("*.idx"))
