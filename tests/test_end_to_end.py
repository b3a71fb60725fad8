"""`difflm-train` and `difflm-generate` as a user runs them: real text, falling NELBO, decodable samples,
one-line errors. The trained run is shared by the tests of this module (one CPU training of about a minute)."""
from __future__ import annotations

import json

import pytest

from conftest import rewrite_run_settings, run_cli, run_cli_batch


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    # 60 steps take val_nelbo from ~10.9 to ~6.6 (the test asks for a drop of 2.5); twice as many only lower it further
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    out = run_cli("difflm.train", "model=tiny", "train.max_steps=60", "train.eval_every=30",
                  "train.save_every=30", "optim.lr=1e-3", "schedule.warmup_steps=20", "logger.progress_bar=false",
                  "logger.num_samples=1", "gen.length=16", "gen.steps=16", "gen.block_length=16", f"run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


def test_training_lowers_val_nelbo(trained_run):
    run_dir, _ = trained_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_nelbo" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    start, end = evals[0]["val_nelbo"], evals[-1]["val_nelbo"]
    assert start == pytest.approx(10.83, abs=0.4)  # ~ log(50304): an untrained model is near uniform
    assert end < start - 2.5, (start, end)
    assert evals[-1]["val_ppl_bound"] == pytest.approx(2.718281828 ** end, rel=1e-6)
    logged = [r for r in rows if r.get("loss") is not None]
    for key in ("step", "loss", "lr", "tokens_per_s", "mfu"):
        assert all(key in r for r in logged)
    assert all(r["tokens_per_s"] > 0 for r in logged) and all(r["mfu"] is None for r in logged)  # CPU: no peak
    assert (run_dir / "config.yaml").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_30", "step_60"]
    assert "--- step 60 sample 0 ---\nROMEO:" in (run_dir / "samples.txt").read_text()


GREEDY = ("prompt=ROMEO:", "gen.length=24", "gen.steps=12", "gen.block_length=12", "device=cpu")
PROMPT = "ROMEO: my lord, (aside) [to JULIET]"  # a comma, brackets and a colon: no Hydra quoting needed


@pytest.fixture(scope="module")
def generated(trained_run, tmp_path_factory):
    """Every ``difflm-generate`` command line of the tests below on the trained run, in one process
    (``run_cli_batch``; each call seeds its own generator): name -> CompletedProcess. Beside the run itself, two
    copies of it trained "with model.backend=te": one where ``auto`` chose TE (``chosen``), one where TE was set by
    hand (``by_hand``)."""
    import shutil

    run_dir, _ = trained_run
    root = tmp_path_factory.mktemp("generate")
    chosen, by_hand = root / "auto_te", root / "hand_te"
    for te_run in (chosen, by_hand):
        shutil.copytree(run_dir, te_run, ignore=shutil.ignore_patterns("data_cache"))
        rewrite_run_settings(te_run, "backend: torch", "backend: te")
    rewrite_run_settings(by_hand, "kernels auto on cpu: model.backend=torch", "kernels auto on cpu: (backend given)")
    (root / "prompt.txt").write_text(PROMPT + "\n", encoding="utf-8")
    # sampled (seeded: the two prompt runs agree): the 60-step model's greedy continuation is newlines, which
    # str.strip() drops
    sampled = (f"run.dir={run_dir}", "gen.length=8", "gen.steps=8", "gen.block_length=8", "gen.temperature=1.0")
    calls = {
        "greedy": [f"run.dir={run_dir}", *GREEDY],
        "low_confidence": [f"run.dir={run_dir}", *GREEDY, "gen.remasking=low_confidence"],
        "random": [f"run.dir={run_dir}", "prompt=ROMEO:", "gen.length=24", "gen.steps=24", "gen.block_length=8",
                   "gen.remasking=random", "gen.temperature=1.0", "step=30"],
        "auto_te": [f"run.dir={chosen}", *GREEDY],
        "hand_te": [f"run.dir={by_hand}", *GREEDY],
        "hand_te_torch": [f"run.dir={by_hand}", *GREEDY, "kernels.backend=torch"],
        "prompt": [*sampled, f"prompt={PROMPT}"],
        "prompt_file": [*sampled, f"prompt_file={root / 'prompt.txt'}"],
    }
    return dict(zip(calls, run_cli_batch([("difflm.generate", args) for args in calls.values()], timeout=600)))


@pytest.fixture(scope="module")
def greedy(generated):
    """difflm-generate's greedy text of the trained run (:data:`GREEDY`), which the tests below reproduce."""
    out = generated["greedy"]
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_generate_prints_decodable_continuation(generated, greedy):
    # after 60 steps a tiny model's greedy continuation is mostly "\n", the corpus' most frequent token: count
    # what was printed after the prompt (24 decoded tokens), not what survives str.strip()
    text = greedy.removesuffix("\n")
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:") + 10, repr(greedy)
    again = generated["low_confidence"]
    assert again.stdout == greedy  # temperature 0 is deterministic, and low_confidence is the default
    rnd = generated["random"]
    assert rnd.returncode == 0 and rnd.stdout.startswith("ROMEO:")


def test_generate_from_a_te_run_on_cpu_with_torch_kernels(generated, greedy):
    """A run trained with model.backend=te on a GPU samples on a CPU: when ``auto`` chose TE (model.auto_reason names
    model.backend) the CPU's kernels are chosen again; when TE was set by hand, kernels.backend=torch is needed and
    the refusal names it. Both give the torch run's text."""
    again = generated["auto_te"]
    assert again.returncode == 0 and again.stdout == greedy, again.stderr[-2000:]
    refused = generated["hand_te"]
    assert refused.returncode == 2 and "kernels.backend=torch" in refused.stderr
    out = generated["hand_te_torch"]
    assert out.returncode == 0 and out.stdout == greedy, out.stderr[-2000:]


def test_generate_takes_any_prompt_text_and_prompt_file(generated):
    out = generated["prompt"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(PROMPT) and len(out.stdout.strip()) > len(PROMPT)
    from_file = generated["prompt_file"]
    assert from_file.returncode == 0 and from_file.stdout == out.stdout


def test_rerun_resumes_from_latest_checkpoint(trained_run, tmp_path):
    run_dir, _ = trained_run
    out = run_cli("difflm.train", "model=tiny", "train.max_steps=65", "train.eval_every=0", "train.save_every=0",
                  "optim.lr=1e-3", "schedule.warmup_steps=20", "logger.progress_bar=false", "logger.num_samples=0",
                  f"run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resuming" in out.stdout and "from step 60" in out.stdout


MISTAKES = [
    (["data.path=/nonexistent/corpus.txt"], "data.path"),
    (["data.tokenizer=/nonexistent/tokenizer"], "data.tokenizer"),
    (["data.seq_len=1000000"], "data.seq_len"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size"),
    (["precision=fp8", "device=cpu"], "precision=fp8"),
]


def latin1_cases(root):
    """difflm-train's data on a Latin-1 text file and on Latin-1 SFT JSONL: (overrides, file, offset of the bad
    byte)."""
    bad = root / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    pairs = root / "pairs.jsonl"
    pairs.write_bytes(b'{"q": "caf\xe9", "a": "x"}\n')
    return (([f"data.path={bad}"], bad, 3),
            (["objective=sft", f"data.path={pairs}", "data.prompt_field=q", "data.response_field=a"], pairs, 10))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """The refused command lines of this module, in one process (``run_cli_batch``): difflm-train on each line of
    :data:`MISTAKES` (a run.dir each) and on :func:`latin1_cases`, difflm-generate on a folder without a run.
    Returns {"mistakes": [...], "latin1": (cases, [...]), "no_run": CompletedProcess}."""
    root = tmp_path_factory.mktemp("refusals")
    cases = latin1_cases(root)
    calls = [("difflm.train", [*args, f"run.dir={root / str(i)}", "train.max_steps=1"])
             for i, (args, _) in enumerate(MISTAKES)]
    calls += [("difflm.train", [*args, f"run.dir={root / 'r'}", "train.max_steps=1", "device=cpu"])
              for args, _, _ in cases]
    (root / "empty").mkdir()
    calls.append(("difflm.generate", [f"run.dir={root / 'empty'}", "prompt=hi"]))
    outs = run_cli_batch(calls)
    return {"mistakes": outs[:len(MISTAKES)], "latin1": (cases, outs[len(MISTAKES):-1]), "no_run": outs[-1]}


@pytest.mark.parametrize("args,needle", MISTAKES)
def test_user_mistakes_end_in_one_line(args, needle, refusals):
    out = refusals["mistakes"][MISTAKES.index((args, needle))]
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr
    assert err[-1].startswith("difflm: error: ") and needle in err[-1]


def test_generate_without_run_is_one_line(refusals):
    out = refusals["no_run"]
    assert out.returncode == 2 and "run.dir=" in out.stderr and "Traceback" not in out.stderr


def test_multirun_gives_one_run_dir_per_job(tmp_path):
    out = run_cli("difflm.train", "-m", "optim.lr=1e-4,3e-4", "model.hidden_size=32", "model.num_layers=1",
                  "model.ffn_hidden_size=64", "data.seq_len=16", "train.max_steps=2", "train.eval_every=0",
                  "train.save_every=0", "logger.num_samples=0", "logger.progress_bar=false",
                  f"run.dir={tmp_path / 'sweep'}", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for job, lr in ((0, 1e-4), (1, 3e-4)):
        job_dir = tmp_path / "sweep" / str(job)
        assert (job_dir / "metrics.jsonl").exists()
        assert f"lr: {lr}" in (job_dir / "config.yaml").read_text()


def test_data_that_is_not_utf8_is_one_line(refusals):
    """A fault report: difflm-train on a Latin-1 text file and on Latin-1 SFT JSONL: one line naming the file."""
    cases, outs = refusals["latin1"]
    for (args, path, offset), out in zip(cases, outs):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith(
            f"difflm: error: data.path: {path} is not UTF-8 text (byte 0xe9 at offset {offset}): ")
