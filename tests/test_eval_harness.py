"""The lm-evaluation-harness adapter (``difflm/eval_harness.py``) on briefly trained ``mdlm`` and ``ar`` runs:
exact AR log-likelihoods, LLaDA's stratified Monte-Carlo estimator against its exact expectation, ``until`` in
generation, and ``lm_eval.simple_evaluate`` on a local multiple-choice task (offline)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from difflm.eval_harness import DifflmHarnessLM, stratified_mask_counts  # noqa: E402
from difflm.training.trainer import Trainer  # noqa: E402
from tests.conftest import FAST, compose_run  # noqa: E402

CPU = torch.device("cpu")


def _train(root, objective: str, *extra: str) -> str:
    cfg = compose_run([*FAST, f"objective={objective}", "train.max_steps=3", "train.save_every=3",
                       "train.eval_every=0", f"run.dir={root / objective}", f"data.cache_dir={root / 'cache'}",
                       "device=cpu", "gen.length=8", "gen.steps=8", "gen.block_length=8", *extra])
    Trainer(cfg, cfg.run.dir, CPU).fit()
    return str(cfg.run.dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness_runs")
    return {name: _train(root, name) for name in ("mdlm", "ar")}


@pytest.fixture(scope="module")
def bd3lm_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("harness_bd3lm"), "bd3lm", "objective.block_size=4",
                  "objective.random_length_prob=0")


def ll_requests(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


PAIRS = [("ROMEO: O, she doth teach the torches to burn", " bright."),
         ("ROMEO: O, she doth teach the torches to burn", " quantum spreadsheet")]


def test_stratified_counts_use_every_l_once():
    g = torch.Generator().manual_seed(3)
    for L in (1, 2, 5, 7):
        assert sorted(stratified_mask_counts(L, L, g).tolist()) == list(range(1, L + 1))
        assert sorted(stratified_mask_counts(L, 3 * L, g).tolist()) == sorted(list(range(1, L + 1)) * 3)


def test_stratified_counts_are_uniform_for_every_draw():
    # over the L equally likely starts, every draw k takes each count 1..L once: unbiased for eq. 6 at any (L, K)
    for L in range(1, 10):
        for K in range(1, 13):
            table = torch.stack([stratified_mask_counts(L, K, start=s) for s in range(1, L + 1)])  # [starts, K]
            for k in range(K):
                assert sorted(table[:, k].tolist()) == list(range(1, L + 1)), (L, K, k)


def _llada_counts(L, K, s):
    """LLaDA's get_log_likelihood.py counts (round half to even): biased where k L / K is a half-integer."""
    counts = torch.round(torch.linspace(float(s), s + (K - 1) * (L / K), steps=K, dtype=torch.float64)).long()
    return (counts - 1) % L + 1


@pytest.mark.parametrize("L,K", [(3, 2), (4, 8)])
def test_mc_expectation_equals_llada_eq6_by_enumeration(monkeypatch, L, K):
    """The estimator's exact expectation (every start s, every masking permutation) equals LLaDA's eq. 6,
    (1/L) sum_l (L/l) E_{|M|=l} sum_{i in M} log p(x_i | x_M masked), enumerated on a tiny model."""
    from itertools import combinations, permutations

    from difflm.eval_harness import mc_loglikelihood
    from tests.dlm_helpers import model_fn, tiny_model

    fn, mask_id = model_fn(tiny_model(std=0.3)), 47
    ctx, cont = [5, 6], [7, 8, 9, 10][:L]
    seq, P = ctx + cont, len(ctx)

    def draw(masked):  # (L / l) sum_{i in M} log p(x_i | x_t)
        x = torch.tensor([seq])
        x[0, [P + i for i in masked]] = mask_id
        with torch.no_grad():
            logp = F.log_softmax(fn(x)[0].float(), dim=-1).double()
        return L / len(masked) * sum(float(logp[P + i, cont[i]]) for i in masked)

    f = {l: sum(map(draw, combinations(range(L), l))) / math.comb(L, l) for l in range(1, L + 1)}
    eq6 = sum(f.values()) / L
    perms = list(permutations(range(L)))
    current = [perms[0]]
    monkeypatch.setattr(torch, "randperm", lambda n, generator=None: torch.tensor(current[0]))

    def expectation(counts_of):
        total = 0.0
        for s in range(1, L + 1):
            for perm in perms:
                current[0] = perm
                with torch.no_grad():
                    total += mc_loglikelihood(fn, seq, L, mask_id, counts_of(s), torch.Generator(), batch_size=K)
        return total / (L * len(perms))

    got = expectation(lambda s: stratified_mask_counts(L, K, start=s))
    assert got == pytest.approx(eq6, rel=1e-6, abs=1e-6)
    biased = sum(f[int(l)] for s in range(1, L + 1) for l in _llada_counts(L, K, s)) / (L * K)
    assert abs(biased - eq6) > 1e-3  # the setup sees the bias of half-to-even rounding
    print(f"L={L} K={K}: eq. 6 {eq6:.5f}, estimator expectation {got:.5f}, LLaDA rounding {biased:.5f}")


def test_mdlm_loglikelihood_finite_negative_deterministic(runs):
    lm = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", mc_samples=8, batch_size=4)
    first = lm.loglikelihood(ll_requests(PAIRS))
    assert all(math.isfinite(v) and v < 0 and isinstance(g, bool) for v, g in first)
    assert lm.loglikelihood(ll_requests(PAIRS)) == first
    assert lm.loglikelihood(ll_requests(PAIRS[::-1])) == first[::-1]  # keyed per request, not by order
    other = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", mc_samples=8, batch_size=3)  # batching-invariant
    regrouped = other.loglikelihood(ll_requests(PAIRS))
    # values within summation-order rounding, greedy flags equal (pytest >= 9 compares no nested (value, flag) pairs)
    assert [v for v, _ in regrouped] == pytest.approx([v for v, _ in first], rel=1e-5)
    assert [g for _, g in regrouped] == [g for _, g in first]


def test_ar_loglikelihood_is_exact(runs):
    lm = DifflmHarnessLM(run_dir=runs["ar"], device="cpu")
    got = lm.loglikelihood(ll_requests(PAIRS))
    for (context, continuation), (value, greedy) in zip(PAIRS, got):
        ctx, cont = lm.encode_pair(context, continuation)
        seq = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = F.log_softmax(lm.model(seq)[0].float(), dim=-1)
        ref = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        assert value == pytest.approx(ref, rel=1e-5, abs=1e-5) and value < 0
        assert greedy == all(int(logp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("To be or not to be",), 0)])
    ids = lm.tok_encode("To be or not to be")
    assert rolling[0] == pytest.approx(lm.loglikelihood(ll_requests([("", "To be or not to be")]))[0][0], rel=1e-5)
    assert len(ids) > 1


def test_mc_estimate_matches_exact_expectation(runs):
    """For a 2-token continuation the estimator's expectation is enumerable: an even number K of draws has
    K/2 draws with l=2 (both masked: b1 + b2) and K/2 with l=1 (one uniformly chosen position, 2 a_i)."""
    K = 400
    lm = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", mc_samples=K, batch_size=100)
    context = "ROMEO: O, she doth teach the torches"
    cont = None
    for word in (" to burn", " to", " burning", " bright"):
        if len(lm.encode_pair(context, word)[1]) == 2:
            cont = word
            break
    assert cont is not None
    ctx, (x1, x2) = lm.encode_pair(context, cont)
    P, M = len(ctx), lm.tok.mask_id

    def logp(seq, pos, tok):
        with torch.no_grad():
            return float(F.log_softmax(lm.model(torch.tensor([seq]))[0, pos].float(), dim=-1)[tok])

    b = logp(ctx + [M, M], P, x1) + logp(ctx + [M, M], P + 1, x2)
    a1, a2 = logp(ctx + [M, x2], P, x1), logp(ctx + [x1, M], P + 1, x2)
    exact = 0.5 * b + 0.5 * (a1 + a2)
    se = math.sqrt(K / 2) * abs(a1 - a2) / K
    est, _ = lm.loglikelihood(ll_requests([(context, cont)]))[0]
    assert abs(est - exact) <= 4 * se + 1e-4, (est, exact, se)


def _gen(lm, until, max_gen_toks=8):
    reqs = [Instance("generate_until", {}, ("ROMEO:", {"until": until, "max_gen_toks": max_gen_toks}), 0),
            Instance("generate_until", {}, ("JULIET: Good night", {"until": until, "max_gen_toks": max_gen_toks}), 1)]
    return lm.generate_until(reqs)


@pytest.mark.parametrize("objective", ["mdlm", "ar"])
def test_generate_until_stops(runs, objective):
    lm = DifflmHarnessLM(run_dir=runs[objective], device="cpu", batch_size=2)
    full = _gen(lm, [])
    assert all(isinstance(t, str) for t in full) and any(full)
    assert _gen(lm, []) == full  # greedy, deterministic
    text = max(full, key=len)
    stop = text[len(text) // 2: len(text) // 2 + 1]
    cut = _gen(lm, [stop])
    for f, c in zip(full, cut):
        assert stop not in c and f.startswith(c)
        assert c == (f[:f.index(stop)] if stop in f else f)


BATCH_PROMPTS = ["ROMEO:", "JULIET: Good night", "JULIET: Good day", "O Romeo, Romeo! wherefore art thou"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("objective", ["bd3lm", "mdlm", "ar"])
def test_generate_until_batched_equals_one_request_at_a_time(runs, bd3lm_run, monkeypatch, objective, temperature):
    """Requests of several prompt lengths sampled in one batch (bd3lm: the rows of each length together, unpadded)
    give each request the text it gets alone: each row draws from its own generator seeded with gen.seed, so this
    holds at temperature > 0 too."""
    import difflm.eval_harness as harness

    calls = []
    real = harness.generate_ids

    def spy(*args, **kwargs):
        calls.append(args[2].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "generate_ids", spy)
    run_dir = bd3lm_run if objective == "bd3lm" else runs[objective]
    reqs = [Instance("generate_until", {}, (ctx, {"until": [], "max_gen_toks": 8}), i)
            for i, ctx in enumerate(BATCH_PROMPTS)]
    batched = DifflmHarnessLM(run_dir=run_dir, device="cpu", batch_size=4, temperature=temperature)
    lengths = [len(batched.context_ids(c)) for c in BATCH_PROMPTS]
    assert len(set(lengths)) == 3  # two prompts of one length, two of others
    together = batched.generate_until(reqs)
    assert calls == [4]  # one sampler call for the four requests
    alone = DifflmHarnessLM(run_dir=run_dir, device="cpu", batch_size=1, temperature=temperature).generate_until(reqs)
    assert calls == [4, 1, 1, 1, 1]
    assert together == alone and any(together)


def test_ar_run_refuses_diffusion_only_model_args(runs):
    """The ar run was trained with gen.steps=8, gen.block_length=8 (never read by its decoding: generate_until above
    runs with them reset); a diffusion-only setting given to the harness for it is refused at construction."""
    from difflm.sampling.options import GenerationConfigError

    assert DifflmHarnessLM(run_dir=runs["ar"], device="cpu", length=8).gen.steps is None  # the default: null
    with pytest.raises(GenerationConfigError, match=r"^model_args steps=4: objective=ar runs decode left to right and "
                                                    r"read only length, temperature, top_k, top_p and seed: drop steps$"):
        DifflmHarnessLM(run_dir=runs["ar"], device="cpu", steps=4)
    assert DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", steps=4).gen.steps == 4


def test_model_args_that_other_settings_leave_unread_are_refused(runs):
    """model_args are the caller's gen.*: top_k / top_p at temperature 0 (greedy) and remdm_sigma without
    remasking=remdm are refused at construction in one line, as difflm-generate refuses them; read they pass."""
    from difflm.sampling.options import GenerationConfigError

    for kw, message in [(dict(top_k=5), "model_args top_k=5 has no effect with temperature=0 (greedy): set "
                                        "temperature>0 or drop it"),
                        (dict(top_p=0.8), "model_args top_p=0.8 has no effect with temperature=0 (greedy): set "
                                          "temperature>0 or drop it"),
                        (dict(remdm_sigma=0.5), "model_args remdm_sigma=0.5 has no effect without remasking=remdm: "
                                                "set remasking=remdm or drop it")]:
        with pytest.raises(GenerationConfigError) as err:
            DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", **kw)
        assert str(err.value) == message
    assert DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", top_k=5, temperature=0.5).gen.top_k == 5
    remdm = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", remasking="remdm", remdm_sigma=0.5)
    assert remdm.gen.remdm_sigma == 0.5


def test_count_model_args_are_refused_before_the_run_is_read(tmp_path):
    """mc_samples, batch_size and max_length below their least are refused naming the key; the run directory (here
    none) is not read first."""
    from difflm.errors import DifflmError

    for kw, message in [(dict(mc_samples=0), "mc_samples=0 must be >= 1"),
                        (dict(batch_size=-1), "batch_size=-1 must be >= 1"),
                        (dict(max_length=1), "max_length=1 must be >= 2")]:
        with pytest.raises(DifflmError) as err:
            DifflmHarnessLM(run_dir=str(tmp_path / "no_run"), device="cpu", **kw)
        assert str(err.value) == message


def test_model_args_batch_size_and_device_win_over_lm_evals_flags(runs):
    """lm-eval's command line passes its --batch_size and --device always (1 and cuda:0 when not typed): the
    documented model_args batch_size= and device= win over them instead of reaching the constructor twice, and the
    flags apply where model_args leave the key out."""
    flags = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    lm = DifflmHarnessLM.create_from_arg_string(f"run_dir={runs['mdlm']},batch_size=4,device=cpu", flags)
    assert (lm.batch_size, lm._device) == (4, CPU)
    lm = DifflmHarnessLM.create_from_arg_obj({"run_dir": runs["mdlm"], "device": "cpu"}, {**flags, "batch_size": 3})
    assert (lm.batch_size, lm._device) == (3, CPU)


def test_simple_evaluate_local_multiple_choice(runs, tmp_path, monkeypatch):
    import lm_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    docs = [{"question": "ROMEO: O, she doth teach the torches to burn", "choices": [" bright.", " wet."], "label": 0},
            {"question": "JULIET: Good night, good night! Parting is such sweet", "choices": [" sorrow", " soup"],
             "label": 0},
            {"question": "To be, or not to be, that is the", "choices": [" question", " spoon"], "label": 0}]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": "difflm_tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "label", "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    lm = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", mc_samples=4, batch_size=4)
    # the task is given whole, so lm-eval's index of its own tasks (about 6 s of YAML scanning) is not built
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks, bootstrap_iters=0, log_samples=False)
    acc = out["results"]["difflm_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    # which checkpoint was evaluated: the newest (step 3) though model_args named none
    assert (out["config"]["difflm_step"], out["config"]["difflm_run_dir"]) == (3, runs["mdlm"])
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_generate_until_warns_when_prompts_are_cut(runs, caplog, monkeypatch):
    """max_gen_toks as large as max_length (lm-eval's default 256 against a short run) leaves one prompt position:
    the prompt reaching the sampler is its last token, and the harness says so, naming the fix."""
    import logging

    import difflm.eval_harness as harness

    seen = []
    real = harness.generate_ids

    def spy(model, tok, prompt_ids, gen, *args, **kwargs):
        seen.append(prompt_ids.shape[1])
        return real(model, tok, prompt_ids, gen, *args, **kwargs)

    monkeypatch.setattr(harness, "generate_ids", spy)
    lm = DifflmHarnessLM(run_dir=runs["mdlm"], device="cpu", batch_size=2, max_length=16)
    with caplog.at_level(logging.WARNING, logger="difflm.eval_harness"):
        _gen(lm, [], max_gen_toks=4)
    assert not [r for r in caplog.records if "were cut" in r.message] and seen[-1] > 1  # both prompts fit in 12
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="difflm.eval_harness"):
        _gen(lm, [], max_gen_toks=16)
    assert seen[-1] == 1
    prompt, other = len(lm.tok_encode("JULIET: Good night")), len(lm.tok_encode("ROMEO:"))
    share = (prompt + other - 2) / (prompt + other)
    msg = [r.message for r in caplog.records if "were cut" in r.message]
    assert msg == [f"generate_until: 2 of 2 prompts were cut from the left to fit max_length=16 beside their "
                   f"gen.length new tokens ({share:.0%} of their tokens dropped; the worst "
                   f"lost {prompt - 1} of {prompt} tokens beside gen.length=16): pass a smaller max_gen_toks (the "
                   f"task's generation_kwargs) or a larger max_length in model_args"]


@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_loglikelihood_warns_when_contexts_or_continuations_are_cut(runs, caplog, objective):
    """Pairs longer than max_length were cut from the left silently, and a long continuation only partly scored."""
    import logging

    lm = DifflmHarnessLM(run_dir=runs[objective], device="cpu", max_length=8, mc_samples=2)
    extra = 1 if objective == "ar" else 0  # an AR window predicts one token past its max_length inputs
    long_ctx = ("ROMEO: O, she doth teach the torches to burn bright", " night.")
    long_cont = ("ROMEO:", " O, she doth teach the torches to burn bright and more")
    fits = ("A", " b")
    (c1, k1), (c2, k2) = lm.encode_pair(*long_ctx), lm.encode_pair(*long_cont)
    assert len(c1) + len(k1) > 8 + extra and len(k1) <= 8 and len(k2) > 8 and sum(map(len, lm.encode_pair(*fits))) <= 8
    with caplog.at_level(logging.WARNING, logger="difflm.eval_harness"):
        lm.loglikelihood(ll_requests([fits]))
    assert not [r for r in caplog.records if "were cut" in r.message]
    with caplog.at_level(logging.WARNING, logger="difflm.eval_harness"):
        lm.loglikelihood(ll_requests([long_ctx, fits, long_cont]))
    d1 = len(c1) + len(k1) - 8 - extra
    share = (d1 + len(c2)) / (len(c1) + len(c2))  # the long continuation leaves no room for its context
    msg = [r.message for r in caplog.records if "were cut" in r.message]
    assert msg == [f"loglikelihood: 2 of 3 requests were cut from the left to fit max_length=8 (2 contexts lost "
                   f"{share:.0%} of their tokens, the worst {max((d1, len(c1)), (len(c2), len(c2)))[0]} of "
                   f"{max((d1, len(c1)), (len(c2), len(c2)))[1]}; 1 continuation is longer than max_length and "
                   f"only the last tokens are scored (the worst: 8 of {len(k2)} tokens), so their log-likelihoods "
                   f"are too high): pass a larger max_length in model_args, or pick tasks with shorter contexts"]


def test_missing_lm_eval_names_the_extra(monkeypatch):
    """Without lm-eval, importing the adapter (or python -m difflm.eval_harness) says which extra to install."""
    import importlib
    import subprocess
    import sys

    from difflm.errors import DifflmError

    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "difflm.eval_harness")
    with pytest.raises(DifflmError, match=r"needs lm-eval .*pip install lm-eval"):
        importlib.import_module("difflm.eval_harness")
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; "
            "runpy.run_module('difflm.eval_harness', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("difflm: error: difflm.eval_harness needs lm-eval")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("objective", ["mdlm", "ar"])
def test_generate_until_returns_at_most_max_gen_toks(runs, monkeypatch, objective):
    """max_gen_toks=5 with block_length=4: the LLaDA sampler generates 8 tokens (two blocks) and the request
    returned all 8; it returns the text of the first 5 generated ids, cut at until (the ar run generates 5)."""
    import difflm.eval_harness as harness

    seen = []
    real = harness.generate_ids

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(harness, "generate_ids", spy)
    lm = DifflmHarnessLM(run_dir=runs[objective], device="cpu", batch_size=2)
    eos = lm.tok.tokenizer.decode([lm.tok.eos_id])
    kw = {"max_gen_toks": 5, **({} if objective == "ar" else {"block_length": 4})}
    reqs = [Instance("generate_until", {}, (ctx, {"until": [], **kw}), i)
            for i, ctx in enumerate(["ROMEO:", "JULIET: Good night"])]
    texts = lm.generate_until(reqs)
    assert seen[-1].shape[1] == (5 if objective == "ar" else 8)
    for text, ids in zip(texts, seen[-1]):
        want = lm.tok.decode(ids[:5])
        assert text == (want[:want.index(eos)] if eos in want else want)


def test_a_task_whose_dataset_the_offline_hub_cannot_give_is_one_line(monkeypatch):
    """`HF_HUB_OFFLINE=1` and a task whose dataset is not cached: datasets raises ConnectionError("Couldn't reach
    'NAME' on the Hub (OfflineModeIsEnabled)") deep inside lm-eval; the command says which task, which dataset and
    the fix in one line instead of the traceback. Other errors are left alone."""
    from difflm.eval_harness import hub_unreachable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    try:
        try:
            raise ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (OfflineModeIsEnabled)")
        except ConnectionError as inner:
            raise RuntimeError("task setup failed") from inner
    except RuntimeError as err:
        message = hub_unreachable(err, "lambada_openai")
    assert message == ("lm-eval task(s) lambada_openai: dataset 'EleutherAI/lambada_openai' is not cached and the "
                       "Hugging Face hub cannot be reached: run it once with network access and without "
                       "HF_HUB_OFFLINE=1, so the dataset is cached")
    assert hub_unreachable(ValueError("bad limit"), "piqa") is None


def test_generate_refuses_infilling_for_an_ar_run_and_a_template_the_tokenizer_lacks(runs):
    """difflm-generate: mask placeholders in an ar run's prompt, and chat_template=true without a template, are one
    line each naming the way out; mask_placeholder=null keeps the placeholder as text."""
    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateRunConfig
    from difflm.errors import DifflmError
    from difflm.generate import generate_text

    def args(run, **kw):
        return OmegaConf.merge(OmegaConf.structured(GenerateRunConfig), {
            "run": {"dir": run}, "prompt": "ROMEO <|mask|>", "device": "cpu", "gen": {"length": 4}, **kw})

    with pytest.raises(DifflmError, match=r"^the prompt holds mask placeholders \(<\|mask\|>\), and infilling needs a "
                                          r"diffusion sampler: .*set mask_placeholder=null to keep them as text$"):
        generate_text(args(runs["ar"]), set())
    assert generate_text(args(runs["ar"], mask_placeholder=None), set()).startswith("ROMEO <|mask|>")
    with pytest.raises(DifflmError, match="^chat_template=true but the run's tokenizer .* has no chat template: "
                                          "drop chat_template$"):
        generate_text(args(runs["mdlm"], chat_template=True), set())


def test_python_m_eval_harness_ends_a_difflm_refusal_in_one_line(tmp_path, monkeypatch, capsys):
    """A bad model_args value reaches lm-eval's command line as the adapter's DifflmError (here a run_dir without
    a run, raised while lm-eval builds the model, and wrapped once more as lm-eval may): one line and exit 2, as
    every difflm-* command, not lm-eval's traceback. Other errors still propagate."""
    import sys

    import lm_eval.__main__ as lm_eval_main

    import difflm.eval_harness as harness

    def builds_the_model():
        try:
            DifflmHarnessLM(run_dir=str(tmp_path / "nowhere"), device="cpu")
        except Exception as err:
            raise RuntimeError("model construction failed") from err

    monkeypatch.setattr(lm_eval_main, "cli_evaluate", builds_the_model)
    monkeypatch.setattr(sys, "argv", ["difflm.eval_harness", "--model", "difflm", "--tasks", "piqa"])
    with pytest.raises(SystemExit) as done:
        harness.main()
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == f"difflm: error: run_dir='{tmp_path / 'nowhere'}' has no config.yaml: point run_dir at a " \
                  "difflm-train output directory (or a difflm-import one)\n"

    def fails_otherwise():
        raise ValueError("bad limit")

    monkeypatch.setattr(lm_eval_main, "cli_evaluate", fails_otherwise)
    with pytest.raises(ValueError, match="bad limit"):
        harness.main()
