"""``gen.block_length``: null (the default of every schema) is the run's block size, a bd3lm run's
``objective.block_size`` and 64 elsewhere (difflm-rl: 32); a value given is taken as given, honoured where the
sampler can decode in it and refused in one line where it cannot (a bd3lm run decodes only in its own blocks).
One rule (:func:`difflm.sampling.options.resolve_block_length`) for difflm-generate, difflm-rl
(tests/test_lifecycle.py), the end-of-training samples, the lm-eval harness and the HF export.

A fault report: the schema default (64 for difflm-generate, 32 for difflm-rl) stood for "the run's blocks" on a
bd3lm run, so the same value typed on a run with blocks of 16 was silently taken as 16."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from difflm.config.schema import GenerateConfig, RLRunConfig, RL_BLOCK_LENGTH
from difflm.errors import DifflmError
from difflm.generate import generation_options, run_generation_config
from difflm.sampling.options import (DEFAULT_BLOCK_LENGTH, GenerationConfigError, resolve_block_length,
                                     run_block_size)

from conftest import FAST, compose_run, run_cli_batch

MODEL = SimpleNamespace(cfg=SimpleNamespace(vocab_size=16))
TOK = SimpleNamespace(mask_id=15, tokenizer=list(range(15)))
BD3LM = SimpleNamespace(name="bd3lm", block_size=16)
MDLM = SimpleNamespace(name="mdlm", block_size=16)  # an mdlm run's objective.block_size is not read


def refusal(given: int, block: int = 16) -> str:
    return (f"^gen.block_length={given} is not read by objective=bd3lm runs, which sample in the model's blocks of "
            rf"{block} tokens \(its objective.block_size\): drop gen.block_length$")


def gen_of(**values):
    return OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 64, "steps": 64, **values})


def test_the_default_is_null_in_every_schema():
    assert GenerateConfig().block_length is None and RLRunConfig().gen.block_length is None
    assert compose_run([]).gen.block_length is None
    assert (DEFAULT_BLOCK_LENGTH, RL_BLOCK_LENGTH) == (64, 32)  # what null was before on runs without blocks


def test_resolve_block_length():
    assert run_block_size(BD3LM) == 16 and run_block_size(MDLM) is None and run_block_size(None) is None
    assert resolve_block_length(None, 16) == 16  # a bd3lm run's own blocks
    assert resolve_block_length(None) == 64 and resolve_block_length(None, None, RL_BLOCK_LENGTH) == 32
    for given in (8, 16, 32, 64):  # a value given is that value, on every run
        assert resolve_block_length(given, 16) == resolve_block_length(given) == given


def test_generate_honours_or_refuses_a_block_length_given():
    """null on a bd3lm run of blocks of 16 samples in 16; 16 given is honoured; 32 (and 64, the former default of
    difflm-generate) given is refused in one line, not taken as 16. An mdlm run: null is 64 as before, and a value
    given is honoured."""
    assert generation_options(MODEL, TOK, gen_of(), objective=BD3LM).block_length == 16
    assert generation_options(MODEL, TOK, gen_of(block_length=16), objective=BD3LM).block_length == 16
    for given in (32, 64, 8):
        with pytest.raises(GenerationConfigError, match=refusal(given)):
            generation_options(MODEL, TOK, gen_of(block_length=given), objective=BD3LM)
    assert generation_options(MODEL, TOK, gen_of(), objective=MDLM).block_length == 64
    for given in (16, 32, 64):
        assert generation_options(MODEL, TOK, gen_of(block_length=given), objective=MDLM).block_length == given


def test_a_bd3lm_run_s_stored_block_length_is_not_a_value_given():
    """difflm-generate starts from the run's own gen.* (its config.yaml). A bd3lm run's block_length was never read
    by its sampler, and runs recorded the former default 64 there: it is reset to null (the run's blocks); one
    typed on the command line is judged as given. An mdlm run's stored block_length is its own, kept."""
    stored = {"length": 32, "steps": 32, "block_length": 64}
    cli = OmegaConf.structured(GenerateConfig)
    gen = run_generation_config(stored, cli, set(), causal=False, objective="bd3lm")
    assert gen.block_length is None and generation_options(MODEL, TOK, gen, objective=BD3LM).block_length == 16
    typed = run_generation_config(stored, OmegaConf.merge(cli, {"block_length": 32}), {"block_length"}, causal=False,
                                  objective="bd3lm")
    with pytest.raises(GenerationConfigError, match=refusal(32)):
        generation_options(MODEL, TOK, typed, objective=BD3LM)
    assert run_generation_config(stored, cli, set(), causal=False, objective="mdlm").block_length == 64
    assert run_generation_config({**stored, "block_length": 16}, cli, set(), causal=False).block_length == 16


def test_end_of_training_samples_follow_the_same_rule():
    from difflm.config.validate import check_end_samples

    def cfg(*overrides):
        return compose_run([*FAST, "logger.num_samples=2", "objective=bd3lm", "objective.block_size=16",
                            "gen.length=32", "gen.steps=32", *overrides])

    check_end_samples(cfg())  # null: the run's blocks
    check_end_samples(cfg("gen.block_length=16"))
    with pytest.raises(DifflmError, match=r"^gen.block_length=32 is not read by objective=bd3lm runs, which sample "
                                          r"in the model's blocks of 16 tokens \(its objective.block_size\): drop gen.block_length "
                                          r"\(this run samples with gen.\* after training"):
        check_end_samples(cfg("gen.block_length=32"))


def _bd3lm_run(path: Path) -> Path:
    from test_posttrain_runtime import make_init_run

    path.mkdir()
    return make_init_run(path, "objective=bd3lm", "objective.block_size=16", "data.seq_len=64")


def test_the_harness_holds_the_run_s_block_size(tmp_path):
    pytest.importorskip("lm_eval")
    from difflm.eval_harness import DifflmHarnessLM

    run = _bd3lm_run(tmp_path / "run")
    assert DifflmHarnessLM(str(run), device="cpu").gen.block_length == 16
    assert DifflmHarnessLM(str(run), device="cpu", block_length=16).gen.block_length == 16
    lm = DifflmHarnessLM(str(run), device="cpu", block_length=32)  # taken as given: the sampler refuses it
    assert lm.gen.block_length == 32
    gen, _, _ = lm._request_gen({"max_gen_toks": 16})
    with pytest.raises(GenerationConfigError, match=refusal(32)):
        generation_options(lm.model, lm.tok, gen, objective=lm.cfg.objective)


def test_an_export_records_the_block_length_null_stands_for():
    """An HF export's config.json needs a number: null is written as what it stands for on the run (64 on an mdlm
    run, as the former default), a value given as given."""
    from difflm.data import build_tokenizer
    from difflm.interop.export import hf_config
    from difflm.model import resolve_model_config

    cfg = compose_run([*FAST])
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    resolve_model_config(cfg.model, tok.padded_vocab_size)
    assert hf_config(cfg, tok, "fp32").gen_block_length == 64
    cfg.gen.block_length = 16
    assert hf_config(cfg, tok, "fp32").gen_block_length == 16


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_difflm_generate_on_a_bd3lm_run(tmp_path):
    """The command: without gen.block_length a run of blocks of 16 samples in them; gen.block_length=32 is one line
    and exit status 2; gen.block_length=16 samples as null does."""
    run = _bd3lm_run(tmp_path / "run")
    common = [f"run.dir={run}", "prompt=ROMEO:", "gen.length=32", "gen.steps=32", "device=cpu"]
    null, sixteen, bad = run_cli_batch([("difflm.generate", [*common, *extra])
                                        for extra in ([], ["gen.block_length=16"], ["gen.block_length=32"])])
    assert null.returncode == 0, null.stderr[-2000:]
    assert sixteen.stdout == null.stdout
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines()[-1] == ("difflm: error: gen.block_length=32 is not read by objective=bd3lm runs, "
                                           "which sample in the model's blocks of 16 tokens (its objective.block_size): drop "
                                           "gen.block_length"), bad.stderr
