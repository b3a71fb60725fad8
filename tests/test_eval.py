"""``difflm-eval``: the antithetic NELBO estimator's variance reduction, the exact AR NLL, and the CLI on a
briefly trained run. The lm-evaluation-harness adapter is tested when ``lm_eval`` is importable."""
from __future__ import annotations

import functools
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from difflm.errors import DifflmError
from difflm.evaluate import sequence_nelbo
from difflm.objectives import ARObjective, MDLMObjective
from tests.conftest import run_cli
from tests.dlm_helpers import objective_cfg, tiny_model

MASK = 47


class ContextModel(torch.nn.Module):
    """A stand-in for a trained model: it predicts the clean token more surely the more context is visible, so
    the conditional mean of the NELBO integrand varies with t (as for a real trained model; for an untrained
    one it is flat, L log V at every t, and no sampler of t can reduce anything)."""

    def __init__(self, clean: torch.Tensor, vocab: int = 48):
        super().__init__()
        self.clean, self.vocab = clean, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, logits_mask=None, **kw):
        visible = (input_ids != MASK).float().mean(dim=1)  # [B]
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits.scatter_(2, self.clean.expand_as(input_ids)[..., None], (8.0 * visible)[:, None, None].expand(-1, input_ids.shape[1], 1))
        if logits_mask is None:
            return logits
        # the model contract: a [B, S] bool mask, or [N] int64 positions in the flattened [B * S]
        return logits[logits_mask] if logits_mask.dtype == torch.bool else logits.flatten(0, 1)[logits_mask]


def test_antithetic_draws_reduce_variance():
    torch.manual_seed(0)
    tokens = torch.randint(0, 40, (1, 128))
    model = ContextModel(tokens)
    obj = MDLMObjective(objective_cfg(), MASK)
    K, reps = 4, 100
    anti = torch.stack([sequence_nelbo(model, obj, tokens, [0], K, seed).mean() for seed in range(reps)])
    iid = []
    for seed in range(reps):  # K independent (t, mask) draws per estimate
        vals = []
        for d in range(K):
            b = obj.noise(tokens, [0], (seed, 9, d), 1, t_sampling="iid")
            logits = model(b.input_ids, b.loss_mask)
            vals.append((F.cross_entropy(logits, b.targets[b.loss_mask], reduction="none") * b.weights[b.loss_mask]).sum())
        iid.append(torch.stack(vals).mean())
    iid = torch.stack(iid).double()
    # the same expectation (within 4 standard errors) and a clearly smaller variance
    se = (anti.var() / reps + iid.var() / reps).sqrt()
    assert abs(float(anti.mean() - iid.mean())) < 4 * float(se)
    assert float(anti.var()) < 0.5 * float(iid.var()), (float(anti.var()), float(iid.var()))


def test_nelbo_passes_the_runs_fused_cross_entropy_choice_to_the_loss(monkeypatch):
    """``difflm-eval`` honours ``model.fused_cross_entropy`` as training does (on the CPU both paths are
    ``F.cross_entropy``, so the estimates agree exactly)."""
    import difflm.evaluate as ev

    seen = []
    real = ev.token_cross_entropy

    def spy(logits, targets, vocab_group=None, fused=True):
        seen.append(fused)
        return real(logits, targets, vocab_group, fused)

    monkeypatch.setattr(ev, "token_cross_entropy", spy)
    tokens = torch.randint(0, 40, (2, 32), generator=torch.Generator().manual_seed(4))
    model, obj = ContextModel(tokens), MDLMObjective(objective_cfg(), MASK)
    off = sequence_nelbo(model, obj, tokens, [0, 1], 2, 3, fused=False)
    on = sequence_nelbo(model, obj, tokens, [0, 1], 2, 3)
    assert seen == [False, False, True, True]
    assert torch.equal(off, on) and bool((on > 0).all())


def test_ar_estimate_is_the_exact_nll():
    model = tiny_model(causal=True)
    tokens = torch.randint(0, 40, (2, 12))
    est = sequence_nelbo(model, ARObjective(objective_cfg(name="ar"), MASK), tokens, [0, 1], 1, 0)
    logits = model(tokens)
    ref = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").sum(1)
    assert torch.allclose(est[0].float(), ref, rtol=1e-5)


def eval_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """difflm-eval's entry point (``difflm.evaluate.main``) run in this process on the command line ``args``: its
    exit status, stdout and stderr."""
    import difflm.evaluate

    monkeypatch.setattr(sys, "argv", ["difflm-eval", *args])
    capsys.readouterr()
    try:
        difflm.evaluate.main()
        status = 0
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("objective", ["bd3lm"])
def test_eval_cli_on_trained_run(tmp_path, objective, seed_token_cache, monkeypatch, capsys):
    """difflm-eval's command line on a briefly trained run, through its entry point in this process (each call
    composes its own config, as a new process does: nothing here is about process boundaries), and difflm-generate
    at an earlier checkpoint as a process."""
    from difflm.training.trainer import Trainer
    from tests.conftest import compose_run

    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20)
    run = tmp_path / "run"
    cfg = compose_run(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
                       "model.ffn_hidden_size=64", "data.seq_len=32", f"objective={objective}",
                       "objective.block_size=8", "train.max_steps=2", "train.global_batch_size=2",
                       "train.micro_batch_size=2", "train.eval_every=0", "train.save_every=1",
                       "logger.progress_bar=false", "logger.num_samples=0", f"run.dir={run}",
                       f"data.cache_dir={tmp_path / 'cache'}", "device=cpu"])
    seed_token_cache(cfg)
    Trainer(cfg, run, torch.device("cpu")).fit()
    cli = functools.partial(eval_cli, monkeypatch, capsys)
    out = tmp_path / "eval.json"
    status, stdout, stderr = cli(f"run.dir={run}", f"data.path={text}", "eval.mc_samples=2", "eval.max_windows=4",
                                 f"eval.output={out}", "device=cpu")
    assert status == 0, stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["objective"] == objective and got["windows"] == 4 and got["mc_samples"] == 2
    assert got["step"] == 2 and json.loads(stdout) == got  # the newest checkpoint, in file and printout
    assert 5 < got["nelbo"] < 15 and got["ppl_bound"] > 1
    assert got["bits_per_byte"] == pytest.approx(got["nats_per_byte"] / 0.6931471805599453)
    # the same text as difflm-preprocess shards: the same windows, hence the same estimate
    from difflm.data.shards import run_preprocess

    run_preprocess(compose_run([f"input={text}", f"output={tmp_path / 'shards'}", "workers=1", "progress_bar=false"],
                               config_name="preprocess"))
    status, _, stderr = cli(f"run.dir={run}", f"data.path={tmp_path / 'shards'}", "eval.mc_samples=2",
                            "eval.max_windows=4", f"eval.output={tmp_path / 'eval_shards.json'}", "device=cpu")
    assert status == 0, stderr[-2000:]
    assert json.loads((tmp_path / "eval_shards.json").read_text())["nelbo"] == got["nelbo"]
    one = tmp_path / "one_window.json"  # one window: no standard error, written as null (NaN is not JSON)
    status, stdout, stderr = cli(f"run.dir={run}", f"data.path={text}", "eval.mc_samples=2", "eval.max_windows=1",
                                 f"eval.output={one}", "device=cpu")
    assert status == 0, stderr[-2000:]
    assert "NaN" not in one.read_text() and "NaN" not in stdout
    got_one = json.loads(one.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in eval.output"))
    assert got_one["windows"] == 1 and got_one["nelbo_stderr"] is None and 5 < got_one["nelbo"] < 15
    assert json.loads(stdout) == got_one
    status, stdout, stderr = cli(f"run.dir={run}", f"data.path={text}", "eval.mc_samples=2", "eval.max_windows=1",
                                 "step=1", "device=cpu")
    assert status == 0, stderr[-2000:]
    assert json.loads(stdout)["step"] == 1
    gen = run_cli("difflm.generate", f"run.dir={run}", "prompt=To be", "gen.length=8", "gen.steps=8",
                  "gen.block_length=8", "step=1", "device=cpu", timeout=300)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert f"difflm-generate: {run} at checkpoint step 1" in gen.stderr.splitlines()
    assert "checkpoint step" not in gen.stdout and gen.stdout.startswith("To be")  # stdout: the text alone
    status, stdout, stderr = cli(f"run.dir={run}", f"data.path={text}", "data.seq_len=0",
                                 "device=cpu")  # 0 was replaced by the run's 32
    assert status == 2 and "Traceback" not in stderr and '"nelbo"' not in stdout
    assert stderr.strip().splitlines() == [
        "difflm: error: data.seq_len=0 leaves no loss token for objective=bd3lm: give data.seq_len >= 1, or drop it "
        "for the run's 32"]
    status, _, stderr = cli(f"run.dir={tmp_path / 'nope'}", f"data.path={text}")
    assert status == 2 and "run.dir=" in stderr
    status, stdout, stderr = cli(f"run.dir={run}", f"data.path={text}", f"eval.output={plain_file(tmp_path)}/x.json",
                                 "device=cpu")  # a file where the output's folder should be: refused before the work
    assert status == 2 and "Traceback" not in stderr and '"nelbo"' not in stdout
    assert stderr.startswith("difflm: error: eval.output=") and "cannot be written" in stderr
    latin1 = tmp_path / "latin1.txt"  # A fault report: one line naming the file, the byte and its offset
    latin1.write_bytes(b"caf\xe9\n")
    status, _, stderr = cli(f"run.dir={run}", f"data.path={latin1}", "device=cpu")
    assert status == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(
        f"difflm: error: data.path: {latin1} is not UTF-8 text (byte 0xe9 at offset 3): ")


def plain_file(tmp_path):
    """A plain file, to stand where a folder is expected."""
    path = tmp_path / "plain_file"
    path.write_text("")
    return path


def _train(fast_cfg, *overrides):
    """A one-step in-process run with a checkpoint (the FAST model); returns the trainer."""
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0", "device=cpu", *overrides)
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    trainer.fit()
    return trainer


def _evaluate(*overrides):
    from conftest import compose_run
    from difflm.evaluate import evaluate_file

    return evaluate_file(compose_run(["device=cpu", *overrides], config_name="eval"), torch.device("cpu"))


def test_bits_per_byte_count_only_document_bytes(fast_cfg, tmp_path):
    """A fault report: 60 JSONL lines of "To be or not" in 32-token windows; 8 windows = 256 tokens hold 51 documents
    and the "To" of the 52nd: 51 * 12 + 2 = 614 UTF-8 bytes of text. The EOS separators' text (13 bytes each) made
    it 1,277 bytes and halved bits per byte."""
    from difflm.evaluate import document_bytes

    trainer = _train(fast_cfg)
    data = tmp_path / "to_be.jsonl"
    data.write_text('{"text": "To be or not"}\n' * 60)
    got = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={data}", "eval.max_windows=8", "eval.mc_samples=2")
    assert (got["windows"], got["tokens"], got["bytes"]) == (8, 256, 51 * len(b"To be or not") + 2)
    assert got["bits_per_byte"] == pytest.approx(got["nelbo"] * 256 / 614 / math.log(2), rel=1e-9)
    tok = trainer.tok
    doc = tok.tokenizer("To be or not", add_special_tokens=False)["input_ids"]
    assert document_bytes(tok, [*doc, tok.eos_id, *doc, tok.mask_id, doc[0]]) == 12 + 12 + 2
    assert document_bytes(tok, [tok.eos_id, tok.eos_id]) == 0
    mixed = tok.tokenizer("naïve café — 東京", add_special_tokens=False)["input_ids"]
    assert document_bytes(tok, [tok.eos_id, *mixed, tok.eos_id]) == len("naïve café — 東京".encode("utf-8"))


def test_eval_reads_text_as_the_run_did(fast_cfg, tmp_path):
    """difflm-eval read every file with its own defaults (text_field "text", separator <|endoftext|>, UTF-8), so a
    run trained with another separator was scored on windows where the separator lines were text: another NELBO,
    no word. Now the run's data.text_field / doc_separator / encoding are the defaults; data.* still overrides."""
    trainer = _train(fast_cfg, "data.doc_separator='==='", "data.text_field=body", "data.encoding=latin-1")
    text = tmp_path / "sep.txt"
    text.write_text("".join(f"Line {i} of the first café story.\n===\nAnd line {i} of the next.\n===\n"
                            for i in range(20)), encoding="latin-1")
    run = (f"run.dir={trainer.run_dir}", f"data.path={text}", "eval.max_windows=4", "eval.mc_samples=2")
    as_run = _evaluate(*run)
    assert as_run == _evaluate(*run, "data.doc_separator='==='", "data.encoding=latin-1")
    other = _evaluate(*run, "data.doc_separator=null", "data.encoding=latin-1")  # "===" lines read as text
    assert other["bytes"] != as_run["bytes"] and other["nelbo"] != as_run["nelbo"]
    with pytest.raises(DifflmError, match="is not UTF-8 text"):  # the run's latin-1 was in use, not a default
        _evaluate(*run, "data.encoding=utf-8")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "To be or not"}\n' * 20)
    assert _evaluate(f"run.dir={trainer.run_dir}", f"data.path={rows}", "eval.max_windows=2")["windows"] == 2
    with pytest.raises(DifflmError, match="data.text_field='text' not found"):
        _evaluate(f"run.dir={trainer.run_dir}", f"data.path={rows}", "data.text_field=text")


def test_eval_of_an_sft_run_is_the_response_only_nelbo(fast_cfg, tmp_path):
    """A fault report: difflm-eval refused sft runs. On prompt/response JSONL it gives the response-only NELBO of
    each pair in a window of exactly prompt + response + EOS (LLaDA's conditional likelihood), with tokens = the
    response lengths with their EOS and bytes = the responses' UTF-8 bytes. A fault report: it scored the EOS
    padding up to data.seq_len as well, so tokens and bits_per_byte changed with the window (2,194 tokens and 12.1
    bits per byte at 64, 4,754 and 26.0 at 128, for the same 40 pairs); now data.seq_len changes nothing."""
    pairs = [{"q": " ".join(["why"] * (1 + 3 * i)), "a": f"because {i} — naïve"} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    valid = tmp_path / "valid.jsonl"
    valid.write_text("".join(json.dumps(p) + "\n" for p in pairs[6:]))  # valid_fraction 0.25: the last 2 pairs
    trainer = _train(fast_cfg, "objective=sft", "objective.loss_norm=token", f"data.path={path}",
                     "data.prompt_field=q", "data.response_field=a", "data.valid_fraction=0.25",
                     "train.eval_mc_samples=3", "train.seed=5")
    got = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={valid}", "eval.mc_samples=3", "eval.seed=5")
    tok = trainer.tok.tokenizer
    prompt_lengths = [len(tok(p["q"], add_special_tokens=False)["input_ids"]) for p in pairs[6:]]
    assert got["objective"] == "sft" and got["windows"] == 2
    response_lengths = [len(tok(p["a"], add_special_tokens=False)["input_ids"]) + 1 for p in pairs[6:]]  # + EOS
    assert max(n + r for n, r in zip(prompt_lengths, response_lengths)) < 32  # padded windows: none was cut
    assert got["tokens"] == sum(response_lengths)
    assert got["bytes"] == sum(len(p["a"].encode("utf-8")) for p in pairs[6:])
    wide = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={valid}", "eval.mc_samples=3", "eval.seed=5",
                     "data.seq_len=64")
    assert (wide["tokens"], wide["bytes"]) == (got["tokens"], got["bytes"])
    assert wide["nelbo"] == pytest.approx(got["nelbo"], rel=1e-4)
    assert wide["bits_per_byte"] == pytest.approx(got["bits_per_byte"], rel=1e-4)
    # the trainer's validation loss is training's: it also scores the padding, so it differs
    assert abs(trainer.evaluate() - got["nelbo"]) > 1e-3
    mdlm = _train(fast_cfg, f"run.dir={tmp_path / 'mdlm'}")
    with pytest.raises(DifflmError, match="data.prompt_field applies to objective=sft runs"):
        _evaluate(f"run.dir={mdlm.run_dir}", f"data.path={valid}", "data.prompt_field=q")


def test_validation_nelbo_does_not_depend_on_the_micro_batch_size(fast_cfg, tmp_path):
    """train.eval_windows counts windows: the same windows, draws and model give the same val_nelbo whatever
    train.micro_batch_size batches them (train.eval_batches counted micro-batches, so it did not)."""
    from difflm.config.validate import check_run
    from difflm.training.trainer import Trainer

    got = []
    for mb in (1, 2, 4):
        cfg = fast_cfg(f"train.micro_batch_size={mb}", "train.eval_windows=4", f"run.dir={tmp_path / f'mb{mb}'}")
        got.append(Trainer(cfg, cfg.run.dir, torch.device("cpu")).evaluate())
    assert got[0] > 5 and got == pytest.approx([got[0]] * 3, rel=1e-6)
    with pytest.raises(DifflmError, match=r"train.eval_batches was removed .* set train.eval_windows=6 instead"):
        check_run(fast_cfg("train.eval_batches=3", "train.micro_batch_size=2", "device=cpu"))


def test_eval_data_seq_len_must_leave_a_loss_token(fast_cfg, tmp_path):
    """data.seq_len=1 on an ar run divided by its 0 loss tokens (ZeroDivisionError); data.seq_len=0 was silently
    replaced by the run's seq_len. Both are refused naming data.seq_len; the shortest windows with a loss token work."""
    data = tmp_path / "to_be.jsonl"
    data.write_text('{"text": "To be or not"}\n' * 20)
    ar = _train(fast_cfg, "objective=ar", f"run.dir={tmp_path / 'ar'}")
    for bad in (1, 0, -4):
        with pytest.raises(DifflmError) as err:
            _evaluate(f"run.dir={ar.run_dir}", f"data.path={data}", f"data.seq_len={bad}")
        assert str(err.value) == (f"data.seq_len={bad} leaves no loss token for objective=ar: give data.seq_len >= 2 "
                                  "(ar predicts each token from the ones before it), or drop it for the run's 32")
    got = _evaluate(f"run.dir={ar.run_dir}", f"data.path={data}", "data.seq_len=2", "eval.max_windows=5")
    assert (got["seq_len"], got["windows"], got["tokens"]) == (2, 5, 5)  # one predicted token per window
    assert 1 < got["nelbo"] < 20 and math.isfinite(got["nelbo_stderr"])
    mdlm = _train(fast_cfg, f"run.dir={tmp_path / 'mdlm'}")
    with pytest.raises(DifflmError, match=r"^data.seq_len=0 leaves no loss token for objective=mdlm: give "
                                          r"data.seq_len >= 1, or drop it for the run's 32$"):
        _evaluate(f"run.dir={mdlm.run_dir}", f"data.path={data}", "data.seq_len=0")
    got = _evaluate(f"run.dir={mdlm.run_dir}", f"data.path={data}", "data.seq_len=1", "eval.max_windows=3",
                    "eval.mc_samples=2")
    assert (got["seq_len"], got["windows"], got["tokens"]) == (1, 3, 3) and got["nelbo"] > 0
    assert _evaluate(f"run.dir={mdlm.run_dir}", f"data.path={data}", "eval.max_windows=1")["seq_len"] == 32


def test_eval_windows_longer_than_the_run_trained_on_are_warned_of(fast_cfg, tmp_path, capsys):
    """difflm-generate warns of positions beyond the trained data.seq_len; difflm-eval at a longer data.seq_len gave
    a worse figure than at the trained length without a word."""
    data = tmp_path / "to_be.jsonl"
    data.write_text('{"text": "To be or not to be, that is the question"}\n' * 20)
    run = _train(fast_cfg, f"run.dir={tmp_path / 'mdlm'}")
    capsys.readouterr()
    got = _evaluate(f"run.dir={run.run_dir}", f"data.path={data}", "data.seq_len=64", "eval.max_windows=1",
                    "eval.mc_samples=1")
    assert got["seq_len"] == 64
    assert capsys.readouterr().err == (
        "difflm: warning: data.seq_len=64 is longer than the run's data.seq_len=32 it was trained on: positions "
        "beyond 32 were never seen in training, so expect worse figures than at 32, not comparable with the run's "
        "val_nelbo; drop data.seq_len to evaluate at the trained length\n")
    _evaluate(f"run.dir={run.run_dir}", f"data.path={data}", "data.seq_len=32", "eval.max_windows=1",
              "eval.mc_samples=1")
    assert "warning" not in capsys.readouterr().err


def test_eval_of_shards_made_with_another_tokenizer_names_the_runs_tokenizer(fast_cfg, tmp_path):
    """difflm-eval has no data.tokenizer key, so the shared shard check's "set data.tokenizer to that tokenizer" led
    to Hydra's "Key 'tokenizer' not in 'EvalDataConfig'". difflm-eval names the run's tokenizer and the
    difflm-preprocess command that re-tokenizes the corpus with it; the trainer keeps its own wording."""
    from difflm.data.shards import find_shards, run_preprocess
    from difflm.evaluate import json_safe
    from tests.conftest import compose_run

    trainer = _train(fast_cfg)
    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 40)
    shards = tmp_path / "shards"
    run_preprocess(compose_run([f"input={text}", f"output={shards}", "workers=1", "progress_bar=false"],
                               config_name="preprocess"))
    same = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={shards}", "eval.max_windows=2", "eval.mc_samples=2")
    assert same["windows"] == 2 and same["nelbo"] > 0
    manifest = shards / "manifest.json"  # as if made with gpt2: another name and definition
    m = json.loads(manifest.read_text())
    m["tokenizer"].update(name="gpt2", fingerprint="0" * 64)
    manifest.write_text(json.dumps(m))
    run_tok = trainer.cfg.data.tokenizer
    with pytest.raises(DifflmError) as err:
        _evaluate(f"run.dir={trainer.run_dir}", f"data.path={shards}")
    assert str(err.value) == (
        f"data.path={str(shards)!r} was tokenized with another tokenizer (gpt2) than the run's "
        f"data.tokenizer={run_tok}, and difflm-eval always uses the run's tokenizer: rerun difflm-preprocess "
        f"input={m['sources'][0]['path']} output=<a new folder> tokenizer={run_tok} and pass that folder as data.path "
        "(or pass the text itself)")
    assert m["sources"][0]["path"] == str(text) and "tokenizers" in run_tok
    with pytest.raises(DifflmError, match="another tokenizer"):  # the shared check (the trainer) still refuses them
        find_shards(str(shards), trainer.tok)
    assert json_safe({"a": float("nan"), "b": float("inf"), "c": 1.5, "d": 2}) == {"a": None, "b": None, "c": 1.5, "d": 2}


def test_no_scored_bytes_give_no_per_byte_figure(fast_cfg, tmp_path):
    """An ar run on a file holding "hi": its one scored token is the EOS after "hi", whose text is no document byte.
    nats / bits per byte are then undefined: null and listed under nonfinite in the JSON, not the total loss."""
    from difflm import strict_json

    trainer = _train(fast_cfg, "objective=ar")
    data = tmp_path / "hi.txt"
    data.write_text("hi")
    got = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={data}")
    assert (got["tokens"], got["bytes"]) == (1, 0) and math.isfinite(got["nelbo"])
    assert math.isnan(got["nats_per_byte"]) and math.isnan(got["bits_per_byte"])
    record = json.loads(strict_json.dumps(got, flag=True))  # as difflm-eval writes it
    assert record["bits_per_byte"] is None and {"nats_per_byte", "bits_per_byte"} <= set(record["nonfinite"])


@pytest.mark.parametrize("override,message", [
    ("eval.max_windows=-1", "eval.max_windows=-1 must be >= 0 (the first windows evaluated; 0 = every window): set "
                            "eval.max_windows=0 for all of them, or a positive count"),
    ("eval.mc_samples=0", "eval.mc_samples=0 must be >= 1 (draws of t per window; ar runs take 1, their NLL is "
                          "exact): e.g. eval.mc_samples=8"),
    ("eval.batch_size=-2", "eval.batch_size=-2 must be >= 1 (windows per forward): e.g. eval.batch_size=8"),
])
def test_negative_eval_counts_are_refused_before_the_run_is_read(tmp_path, monkeypatch, capsys, override, message):
    """eval.max_windows=-1 evaluated every window without a word (<= 0 meant all); the count keys are refused in
    one line, exit status 2, before the run (here none) or the data is read."""
    status, out, err = eval_cli(monkeypatch, capsys, f"run.dir={tmp_path / 'no_run'}", f"data.path={tmp_path}",
                                override, "device=cpu")
    assert (status, out) == (2, "")
    assert err.strip().splitlines()[-1] == f"difflm: error: {message}"


def test_eval_output_never_replaces_a_file_that_is_not_an_earlier_result(fast_cfg, tmp_path, monkeypatch, capsys):
    """eval.output naming the evaluated text or the run's config.yaml is refused before any work (the JSON would
    replace the corpus, or the run's config that difflm-eval / -generate read); an earlier result and an empty file
    (``mktemp``'s) are replaced."""
    trainer = _train(fast_cfg)
    data = tmp_path / "to_be.txt"
    data.write_text("To be or not to be\n" * 20)
    config = trainer.run_dir / "config.yaml"
    kept = {path: path.read_bytes() for path in (data, config)}
    for path in kept:
        status, out, err = eval_cli(monkeypatch, capsys, f"run.dir={trainer.run_dir}", f"data.path={data}",
                                    f"eval.output={path}", "device=cpu", "eval.max_windows=1")
        assert (status, out) == (2, "")
        assert err.strip().splitlines()[-1] == (
            f"difflm: error: eval.output={str(path)!r} exists and is not a difflm-eval result (an earlier result is "
            "replaced): the output would replace it; give a new file path")
    assert {path: path.read_bytes() for path in kept} == kept
    result = tmp_path / "result.json"
    result.touch()
    for _ in range(2):  # an empty file written, then the result replaced
        status, out, _ = eval_cli(monkeypatch, capsys, f"run.dir={trainer.run_dir}", f"data.path={data}",
                                  f"eval.output={result}", "device=cpu", "eval.max_windows=1")
        assert status == 0 and json.loads(result.read_text()) == json.loads(out)


def test_eval_max_windows_counts_the_windows(fast_cfg, tmp_path):
    """eval.max_windows=0 evaluates every window, a positive count that many."""
    trainer = _train(fast_cfg)
    data = tmp_path / "to_be.jsonl"
    data.write_text('{"text": "To be or not"}\n' * 40)
    every = _evaluate(f"run.dir={trainer.run_dir}", f"data.path={data}", "eval.max_windows=0")
    assert every["windows"] > 3
    assert _evaluate(f"run.dir={trainer.run_dir}", f"data.path={data}", "eval.max_windows=3")["windows"] == 3
