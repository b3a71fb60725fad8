"""Free text on the command line: prompts reach Hydra as one string whatever they hold; prompt_file=."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from difflm.cli import check_required, hydra_quoted, quote_free_text
from difflm.errors import DifflmError
from difflm.generate import read_prompt

from conftest import run_cli

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


def test_a_bad_interpolation_is_one_line():
    out = run_cli("difflm.generate", "run.dir=nowhere", "prompt=${nokey}", timeout=120)
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


@pytest.mark.parametrize("module,args,message", REQUIRED, ids=[f"{m}-{len(a)}" for m, a, _ in REQUIRED])
def test_entry_points_name_their_missing_keys(module, args, message, tmp_path):
    out = run_cli(module, *args, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"difflm: error: {message}: pass "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


UNKNOWN = [("difflm.train", ["+train.max_stepz=5"], "+train.max_stepz: train has no key max_stepz (did you mean "
                                                      "max_steps?); the keys of train are listed in "
                                                      "difflm/config/schema.py (TrainConfig)"),
           ("difflm.generate", ["+gen.sed=1"],
            "+gen.sed: gen has no key sed (did you mean seed?); the keys of gen are listed in difflm/config/schema.py "
            "(GenerateConfig)")]


@pytest.mark.parametrize("module,args,message", UNKNOWN, ids=[m for m, _, _ in UNKNOWN])
def test_entry_points_refuse_a_key_added_with_plus_that_the_schema_lacks(module, args, message, tmp_path):
    out = run_cli(module, f"run.dir={tmp_path / 'run'}", *args, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == f"difflm: error: {message}\n"
    assert not (tmp_path / "run" / "checkpoints").exists()


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


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "RANK": "1"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}],
                         ids=["torchrun", "srun"])
def test_a_multirun_under_a_multi_process_launch_is_refused(env, tmp_path):
    """A fault report: ``torchrun --nproc-per-node 2 -m difflm.train -m optim.lr=a,b`` started one sweep per rank;
    the first job finished and the second hung in its collectives (30 minutes by default). It is refused at once,
    before Hydra starts, naming the two ways that work."""
    out = subprocess.run([sys.executable, "-m", "difflm.train", "-m", "optim.lr=1e-4,3e-4", f"run.dir={tmp_path}/s"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("difflm: error: a multirun (-m) under torchrun/srun (2 processes) would start one "
                                 "sweep per process"), out.stderr
    assert "hydra/launcher=slurm" in out.stderr and not (tmp_path / "s").exists()
