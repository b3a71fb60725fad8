"""``gen.block_length``: null (the default of every schema) is the run's block size, a bd3lm run's
``objective.block_size``, elsewhere the largest divisor of ``gen.length`` up to 64 (difflm-rl: 32); a value given is
taken as given, honoured where the sampler can decode in it and refused in one line where it cannot (a bd3lm run
decodes only in its own blocks). ``gen.steps`` null is ``min(64, gen.length)`` (difflm-rl: 32) rounded down to a
multiple of the blocks. One rule (:func:`difflm.sampling.options.resolve_block_length`,
:func:`~difflm.sampling.options.resolve_steps`) for difflm-generate, difflm-rl (tests/test_lifecycle.py), the
end-of-training samples, the lm-eval harness and the HF export.

The schema default (64 for difflm-generate, 32 for difflm-rl) once stood for "the run's blocks" on a bd3lm run, so
the same value typed on a run with blocks of 16 was silently taken as 16; and fixed defaults of 64 refused any
gen.length below 64 that the user typed alone."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
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
    typed on the command line is judged as given. An mdlm run's stored block_length is its own, kept, except the
    former default 64, which is null again: fitted to the length (32 here, which 64 does not divide)."""
    stored = {"length": 32, "steps": 32, "block_length": 64}
    cli = OmegaConf.structured(GenerateConfig)
    gen = run_generation_config(stored, cli, set(), causal=False, objective="bd3lm")
    assert gen.block_length is None and generation_options(MODEL, TOK, gen, objective=BD3LM).block_length == 16
    typed = run_generation_config(stored, OmegaConf.merge(cli, {"block_length": 32}), {"block_length"}, causal=False,
                                  objective="bd3lm")
    with pytest.raises(GenerationConfigError, match=refusal(32)):
        generation_options(MODEL, TOK, typed, objective=BD3LM)
    mdlm = run_generation_config(stored, cli, set(), causal=False, objective="mdlm")
    assert mdlm.block_length is None and generation_options(MODEL, TOK, mdlm, objective=MDLM).block_length == 32
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


def test_an_export_records_a_null_block_length_as_null():
    """An HF export's config.json records null as null (its generate fits it to each gen_length, as difflm-generate
    does), the former default 64 as null too, a value given as given."""
    from difflm.data import build_tokenizer
    from difflm.interop.export import hf_config
    from difflm.model import resolve_model_config

    cfg = compose_run([*FAST])
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    resolve_model_config(cfg.model, tok.padded_vocab_size)
    assert hf_config(cfg, tok, "fp32").gen_block_length is None and hf_config(cfg, tok, "fp32").gen_steps is None
    cfg.gen.block_length, cfg.gen.steps = 64, 64  # an older run's record
    assert (hf_config(cfg, tok, "fp32").gen_block_length, hf_config(cfg, tok, "fp32").gen_steps) == (None, None)
    cfg.gen.block_length, cfg.gen.steps = 16, 32
    assert (hf_config(cfg, tok, "fp32").gen_block_length, hf_config(cfg, tok, "fp32").gen_steps) == (16, 32)


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


# ------------------------------------------------------------------ null steps and block length fit gen.length
def gen_null(**values):
    """The schema's gen.* (steps and block_length null) with ``values`` over them."""
    return OmegaConf.merge(OmegaConf.structured(GenerateConfig), values)


def test_null_block_length_and_steps_fit_the_length():
    """The largest divisor of gen.length up to 64 (the length itself up to 64), and min(64, length) steps rounded
    down to a multiple of the blocks: every length samples with the defaults; 64 where 64 fits, as before."""
    from difflm.sampling.options import DEFAULT_STEPS, GenerationOptions, fitted_block_length, resolve_steps

    # a length whose divisors up to 64 are all below 16 (65 = 5 x 13, a prime) is one block, not token by token
    blocks = {1: 1, 16: 16, 63: 63, 64: 64, 65: 65, 67: 67, 96: 48, 100: 50, 128: 64, 130: 26, 256: 64, 1000: 50}
    assert {n: fitted_block_length(n) for n in blocks} == blocks
    assert fitted_block_length(48, RL_BLOCK_LENGTH) == 24 and fitted_block_length(16, RL_BLOCK_LENGTH) == 16
    assert fitted_block_length(37, RL_BLOCK_LENGTH) == 37 and fitted_block_length(40, RL_BLOCK_LENGTH) == 20
    for length in range(65, 400):  # never more steps than min(64, length), never blocks below a quarter of 64
        block = fitted_block_length(length)
        assert block >= 16 and length % block == 0 and resolve_steps(None, length, block) <= 64, length
    assert resolve_block_length(None, length=16) == 16 and resolve_block_length(None, 16, length=40) == 16
    assert resolve_block_length(32, length=16) == 32  # a value given stays: the sampler refuses it
    steps = {(16, 16): 16, (64, 64): 64, (96, 48): 64, (128, 64): 64, (1000, 50): 60, (67, 67): 64, (65, 13): 60,
             (130, 26): 60}
    assert {k: resolve_steps(None, *k) for k in steps} == steps
    assert resolve_steps(None, 16) == 16 and resolve_steps(None, 200) == DEFAULT_STEPS  # bd3lm / ar: no multiple
    assert resolve_steps(None, 64, 32, 32) == 32 and resolve_steps(7, 16) == 7
    from difflm.sampling.diffusion import _validate

    for length in (1, 5, 16, 48, 67, 96, 100, 1000):  # the LLaDA sampler's checks pass for every length
        opts = GenerationOptions(mask_id=0, length=length)
        assert _validate(opts) == length // opts.block_length and opts.steps <= length
    opts = GenerationOptions(mask_id=0, length=16, block_size=16)
    assert (opts.block_length, opts.steps, opts.fitted) == (16, 16, ("block_length", "steps"))
    again = opts.replace(length=8)  # fitted values follow a new length; one given is kept
    assert (again.steps, opts.replace(length=8, steps=4).steps) == (8, 4)


@pytest.mark.parametrize("objective", [MDLM, BD3LM], ids=["mdlm", "bd3lm"])
def test_generate_samples_gen_length_16_with_the_defaults(objective):
    """gen.length=16 alone (and with gen.steps=16) samples: one block of 16 tokens in 16 steps; bd3lm in its blocks of
    16. Values the user gives are still honoured or refused as before."""
    for gen in (gen_null(length=16), gen_null(length=16, steps=16)):
        opts = generation_options(MODEL, TOK, gen, objective=objective)
        assert (opts.length, opts.block_length, opts.steps) == (16, 16, 16)
    if objective is BD3LM:
        with pytest.raises(GenerationConfigError, match=r"^gen.steps=64 must be <= gen.length=16 \(at least one token "
                                                        r"per step\): set gen.steps=16$"):
            generation_options(MODEL, TOK, gen_null(length=16, steps=64), objective=objective)
    else:
        with pytest.raises(GenerationConfigError, match=r"^gen.length=16 must be a multiple of gen.block_length=64; "
                                                        r"e.g. gen.length=16 gen.block_length=16 gen.steps=16$"):
            generation_options(MODEL, TOK, gen_null(length=16, block_length=64), objective=objective)
        assert generation_options(MODEL, TOK, gen_null(length=96), objective=objective).steps == 64
        assert generation_options(MODEL, TOK, gen_null(length=96), objective=objective).block_length == 48


def test_a_stored_former_default_is_read_as_null():
    """A run trained before the null defaults recorded gen.steps=64 gen.block_length=64 in its config.yaml: with
    gen.length=16 typed they are null again (fitted: 16 and 16), not refused; a stored value that is no former
    default is the run's own, and refused where it does not fit."""
    cli = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 16})
    stored = {"length": 64, "steps": 64, "block_length": 64}
    for objective in ("mdlm", "bd3lm"):
        gen = run_generation_config(stored, cli, {"length"}, causal=False, objective=objective)
        assert (gen.steps, gen.block_length) == (None, None)
        opts = generation_options(MODEL, TOK, gen, objective=BD3LM if objective == "bd3lm" else MDLM)
        assert (opts.block_length, opts.steps) == (16, 16)
    own = run_generation_config({**stored, "steps": 32}, cli, {"length"}, causal=False)
    with pytest.raises(GenerationConfigError, match=r"^gen.steps=32 must be <= gen.length=16"):
        generation_options(MODEL, TOK, own, objective=MDLM)
    assert run_generation_config(stored, cli, set(), causal=False).length == 64  # nothing typed: the run's length


def test_end_of_training_samples_with_a_short_length_pass():
    """difflm-train gen.length=16 (samples at the end of training) starts: the defaults fit the length."""
    from difflm.config.validate import check_end_samples

    for extra in ([], ["objective=bd3lm", "objective.block_size=16"], ["objective=ar"]):
        check_end_samples(compose_run([*FAST, "logger.num_samples=2", "gen.length=16", *extra]))
    with pytest.raises(DifflmError, match=r"^gen.steps=64 must be <= gen.length=16"):
        check_end_samples(compose_run([*FAST, "logger.num_samples=2", "gen.length=16", "gen.steps=64"]))


def test_rl_rollouts_fit_the_length_with_their_own_defaults():
    """difflm-rl's null defaults are 32 (RL_BLOCK_LENGTH, RL_STEPS) under the same rule: gen.length=64 is two blocks
    of 32 in 32 steps as before, gen.length=16 one block of 16 in 16 steps; rl_config.yaml records the numbers."""
    from difflm.config.schema import RL_STEPS
    from difflm.posttrain.runner import PostTrainer

    assert RLRunConfig().gen.steps is None and RL_STEPS == 32
    for length, objective, want in ((64, MDLM, (32, 32)), (16, MDLM, (16, 16)), (48, MDLM, (24, 32)),
                                    (16, BD3LM, (16, 16)), (64, BD3LM, (16, 32))):
        cfg = OmegaConf.merge(OmegaConf.structured(RLRunConfig), {"gen": {"length": length}})
        run = SimpleNamespace(init_cfg=SimpleNamespace(objective=objective), cfg=cfg, tok=TOK)
        PostTrainer._check_gen(run, MODEL)
        assert (cfg.gen.block_length, cfg.gen.steps) == want, (length, objective)
    cfg = OmegaConf.merge(OmegaConf.structured(RLRunConfig), {"gen": {"length": 16, "steps": 32}})
    with pytest.raises(GenerationConfigError, match=r"^gen.steps=32 must be <= gen.length=16"):
        PostTrainer._check_gen(SimpleNamespace(init_cfg=SimpleNamespace(objective=MDLM), cfg=cfg, tok=TOK), MODEL)


def _harness(objective: str, **gen):
    """A lm-eval adapter without a run: only what ``_request_gen`` reads (the run's gen.* merged as at construction)."""
    pytest.importorskip("lm_eval")
    from difflm.eval_harness import DifflmHarnessLM

    lm = DifflmHarnessLM.__new__(DifflmHarnessLM)
    lm.objective, lm.causal = objective, objective == "ar"
    lm.tok = SimpleNamespace(eos_id=0, tokenizer=SimpleNamespace(decode=lambda ids: "<eos>"))
    lm.gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig), gen)
    return lm


def test_the_harness_fits_null_settings_to_each_request():
    """max_gen_toks=16 with the null defaults: 16 tokens in one block and 16 steps (the former 64 steps were refused);
    100: blocks of 64 (rounded up to 128 tokens, the surplus cut) in 64 steps; a gen.steps given keeps its steps per
    token."""
    lm = _harness("mdlm")
    for want, (length, block, steps) in ((16, (16, 16, 16)), (100, (128, 64, 64)), (64, (64, 64, 64))):
        gen, _, limit = lm._request_gen({"max_gen_toks": want})
        opts = generation_options(MODEL, TOK, gen, objective=MDLM)
        assert (opts.length, opts.block_length, opts.steps, limit) == (length, block, steps, want)
    gen, _, _ = _harness("mdlm", length=64, steps=32)._request_gen({"max_gen_toks": 16})
    assert (gen.length, gen.block_length, gen.steps) == (16, 16, 8)
    gen, _, _ = _harness("bd3lm", block_length=16)._request_gen({"max_gen_toks": 24})
    opts = generation_options(MODEL, TOK, gen, objective=BD3LM)
    assert (opts.length, opts.block_length, opts.steps) == (24, 16, 24)


def test_the_hf_export_generate_fits_null_settings():
    """The exported model's generate(ids, gen_length=16) and (gen_length=16, steps=16) sample with a config of null
    gen_steps / gen_block_length (what an export of a run with the defaults records): difflm's tokens, token for
    token; values given are refused as before."""
    from difflm.sampling import GenerationOptions, diffusion_generate
    from tests.dlm_helpers import model_fn
    from tests.test_hf_interop import _hf_twin

    ours, hf = _hf_twin()
    assert (hf.config.gen_steps, hf.config.gen_block_length) == (None, None)
    ids = torch.tensor([[5, 6, 7]])
    mine = diffusion_generate(model_fn(ours), ids, GenerationOptions(mask_id=47, length=16, forbid_ids=[47]))
    for kw in (dict(gen_length=16), dict(gen_length=16, steps=16), dict(max_new_tokens=16)):
        assert torch.equal(hf.generate(ids, **kw), mine), kw
    assert hf.generate(ids, gen_length=96).shape == (1, 99)
    with pytest.raises(ValueError, match=r"^steps=64 must be <= gen_length=16 \(at least one token per step\); e.g. "
                                         r"gen_length=16, block_length=16, steps=16$"):
        hf.generate(ids, gen_length=16, steps=64)
    with pytest.raises(ValueError, match=r"^gen_length=16 must be a multiple of block_length=64"):
        hf.generate(ids, gen_length=16, block_length=64)


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_difflm_generate_commands_of_the_fault_report(tmp_path):
    """The reported command lines: gen.length=16 (with and without gen.steps=16) samples on an mdlm and a bd3lm run
    with the default gen.*; gen.top_k=5 and gen.remdm_sigma=0.5 alone are one line and exit status 2."""
    from test_posttrain_runtime import make_init_run

    (tmp_path / "mdlm").mkdir()
    runs = {"mdlm": make_init_run(tmp_path / "mdlm", "data.seq_len=64"), "bd3lm": _bd3lm_run(tmp_path / "bd3lm")}
    calls = [("difflm.generate", [f"run.dir={run}", "prompt=ROMEO:", "device=cpu", "gen.length=16", *extra])
             for run in runs.values() for extra in ([], ["gen.steps=16"])]
    calls += [("difflm.generate", [f"run.dir={runs['mdlm']}", "prompt=ROMEO:", "device=cpu", extra])
              for extra in ("gen.top_k=5", "gen.remdm_sigma=0.5")]
    *ok, top_k, remdm = run_cli_batch(calls)
    for done in ok:
        assert done.returncode == 0 and done.stdout.startswith("ROMEO:"), done.stderr[-2000:]
    assert ok[0].stdout == ok[1].stdout and ok[2].stdout == ok[3].stdout  # null steps: 16, as typed
    assert top_k.returncode == 2 and top_k.stderr.splitlines()[-1] == (
        "difflm: error: gen.top_k=5 has no effect with gen.temperature=0 (greedy): set gen.temperature>0 or drop it")
    assert remdm.returncode == 2 and remdm.stderr.splitlines()[-1] == (
        "difflm: error: gen.remdm_sigma=0.5 has no effect without gen.remasking=remdm: set gen.remasking=remdm or "
        "drop it")
