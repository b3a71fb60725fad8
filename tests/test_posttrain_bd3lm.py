"""The log-likelihood estimators on block-diffusion (bd3lm) runs: every estimate's per-position terms against BD3-LM's
vectorised forward written out by hand (the unpadded row as ``[x_t ; x_0]``, the block-causal mask built from its
rules, logits of the x_t half), the mdlm path unchanged, and a GRPO / DPO step on a tiny bd3lm run scoring the
policy, its rollout-time copy and the reference through that forward."""
import pytest
import torch

from difflm.model.masks import BlockDiffusionMask
from difflm.objectives.bd3lm import BD3LMObjective
from difflm.objectives.schedules import floor_time
from difflm.posttrain.forward import BlockLogitsFn, block_objective, estimator_logits_fn
from difflm.posttrain.loglik import CoupledEstimator, EstimateKey, MCELBOEstimator, OneStepEstimator
from difflm.posttrain.loglik.base import mask_uniforms, sample_uniforms
from difflm.posttrain.rollout import padded_logits_fn
from tests.dlm_helpers import objective_cfg, tiny_model

MASK, S, FIRST = 47, 11, 5  # mask id of the 48-token tiny model, row width, first completion column
KEY, IDS = EstimateKey((3, 1, 0)), [4, 9, 2]


def rows():
    """Three left-padded rows (0, 2 and 1 pad columns; S = 11 is no multiple of the block sizes, so last blocks are
    partial): x [3, S], valid, prompt, completion (row 1's last two tokens are clean context after its EOS)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, MASK, (3, S), generator=g)
    col = torch.arange(S)[None]
    valid = col >= torch.tensor([0, 2, 1])[:, None]
    prompt = valid & (col < FIRST)
    completion = (col >= FIRST).repeat(3, 1)
    completion[1, -2:] = False
    return x, valid, prompt, completion


def hand_mask(n, bs, clean_causal):
    """BD3-LM's mask over [x_t ; x_0] of n real tokens from its rules (Arriola et al. 2025, eq. 8-9): noisy -> noisy
    in the same block, noisy -> clean in earlier blocks, clean -> clean in the same or earlier blocks (causal:
    positions)."""
    m = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    for q in range(2 * n):
        for k in range(2 * n):
            qi, ki = q % n, k % n
            if q < n and k < n:
                m[q, k] = qi // bs == ki // bs
            elif q < n:
                m[q, k] = ki // bs < qi // bs
            elif k >= n:
                m[q, k] = ki <= qi if clean_causal else ki // bs <= qi // bs
    return m


def hand_logprobs(model, noisy, x, valid, bs, clean_causal):
    """log p(x^i | x_t^{block(i)}, x_0^{<block(i)}) at every real position, [B, S] float64 (0 at padding): each row
    alone, unpadded, through the model with the hand-built mask."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        cols = valid[r].nonzero().flatten()
        n = len(cols)
        ids = torch.cat([noisy[r, cols], x[r, cols]])[None]
        logits = model(ids, attn_mask=hand_mask(n, bs, clean_causal)[None, None],
                       position_ids=torch.arange(n).repeat(2)).double()[0, :n]
        out[r, cols] = torch.log_softmax(logits, dim=-1).gather(1, x[r, cols][:, None])[:, 0]
    return out


def blocks_of(valid, bs):
    """The block of each column of each row, counted from its first real token ([B, S] int64, 0 at padding)."""
    return ((valid.long().cumsum(dim=1) - 1).clamp(min=0) // bs)


def masked(x, m):
    return torch.where(m, torch.full_like(x, MASK), x)


def expected_terms(name, model, x, valid, prompt, completion, bs, cc):
    """The estimator's terms from its equation, the bd3lm forward done by hand."""
    lp = lambda noisy: hand_logprobs(model, noisy, x, valid, bs, cc)  # noqa: E731
    zero = torch.zeros((), dtype=torch.float64)
    nb = -(-S // bs)
    blocks = blocks_of(valid, bs)
    if name == "one_step":  # completion fully masked, prompt masked with p = 0.3, weight 1
        m = completion | (prompt & (mask_uniforms(KEY, 0, IDS, S) < 0.3))
        return torch.where(completion, lp(masked(x, m)), zero)
    if name == "coupled":  # t_b ~ U[0.2, 0.8] per block, A = {u < t_b}, B its complement, 1/2 (A/t + B/(1-t))
        t = (0.2 + 0.6 * sample_uniforms(KEY, IDS, nb)).float().double().gather(1, blocks)
        a = completion & (mask_uniforms(KEY, 0, IDS, S) < t)
        b = completion & ~a
        return 0.5 * torch.where(a, lp(masked(x, a)) / t, torch.where(b, lp(masked(x, b)) / (1 - t), zero))
    # mc_elbo, num_t = 2: t_{b,k} = (u_b + k / 2) mod 1, floored; token masked in draw k iff u_{i,k} < t_{b,k}
    u = sample_uniforms(KEY, IDS, nb)
    total = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(2):
        t = floor_time((u + k / 2) % 1.0, 1e-3).float().double().gather(1, blocks)
        m = completion & (mask_uniforms(KEY, k, IDS, S) < t)
        total += torch.where(m, lp(masked(x, m)) / t, zero)
    return total / 2


ESTIMATORS = {"one_step": OneStepEstimator(0.3), "coupled": CoupledEstimator(), "mc_elbo": MCELBOEstimator(2)}


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("bs,clean_attention", [(3, "block_causal"), (4, "causal"), (1, "block_causal")])
def test_estimators_score_the_bd3lm_forward(name, bs, clean_attention):
    torch.set_num_threads(1)
    model = tiny_model(std=0.3).double()
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=bs, clean_attention=clean_attention), MASK)
    x, valid, prompt, completion = rows()
    fn = estimator_logits_fn(model, valid, None, obj)
    assert isinstance(fn, BlockLogitsFn)
    with torch.no_grad():
        got = ESTIMATORS[name](fn, x, completion, mask_id=MASK, key=KEY, sample_ids=IDS, prompt=prompt)
        want = expected_terms(name, model, x, valid, prompt, completion, bs, clean_attention == "causal")
        plain = ESTIMATORS[name](padded_logits_fn(model, valid), x, completion, mask_id=MASK, key=KEY, sample_ids=IDS,
                                 prompt=prompt)
    assert bool((got[~completion] == 0).all())
    scored = (want[completion] != 0).float().mean()  # one_step and coupled score every token, mc_elbo most
    assert scored == 1 if name != "mc_elbo" else scored > 0.5
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, plain, atol=1e-3)  # the plain bidirectional forward scores something else


def test_block_forward_reuses_the_training_batch_forward():
    """Unpadded rows of a multiple of the block size: the estimators' logits are those of the objective's own
    training batch (BD3LMObjective.build, what the trainer feeds the model) at the x_t half."""
    model = tiny_model(std=0.3).double()
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=4), MASK)
    x = torch.randint(0, MASK, (2, 12), generator=torch.Generator().manual_seed(1))
    m = torch.rand(2, 12, generator=torch.Generator().manual_seed(2)) < 0.5
    batch = obj.build(x, torch.full((2, 3), 0.5), m)
    with torch.no_grad():
        want = model(batch.input_ids, **batch.model_kwargs())[:, :12]
        fn = BlockLogitsFn(model, torch.ones(2, 12, dtype=torch.bool), obj)
        got = fn(masked(x, m), x)
    assert fn.doc_ids is None and torch.equal(fn.blocks, torch.arange(12).repeat(2, 1) // 4)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_mdlm_path_is_unchanged():
    """mdlm / sft runs: no block objective, the plain padded forward, and one t per sample (the estimators' terms
    equal their one-t-per-sample formulas bit for bit)."""
    assert block_objective(objective_cfg(name="mdlm"), MASK) is None
    assert block_objective(objective_cfg(name="sft"), MASK) is None
    assert isinstance(block_objective(objective_cfg(name="bd3lm"), MASK), BD3LMObjective)
    model = tiny_model(std=0.3)
    x, valid, prompt, completion = rows()
    fn = estimator_logits_fn(model, valid, None, None)
    ref = padded_logits_fn(model, valid)
    with torch.no_grad():
        assert torch.equal(fn(x), ref(x))
        lp = lambda m: -torch.nn.functional.cross_entropy(  # noqa: E731
            ref(masked(x, m)).flatten(0, 1), x.flatten(), reduction="none").view(x.shape)
        t = (0.2 + 0.6 * sample_uniforms(KEY, IDS)).float()  # [B, 1]
        a = completion & (mask_uniforms(KEY, 0, IDS, S) < t)
        b = completion & ~a
        want = 0.5 * torch.where(a, lp(a) / t, torch.where(b, lp(b) / (1 - t), torch.zeros(())))
        assert torch.equal(CoupledEstimator()(fn, x, completion, mask_id=MASK, key=KEY, sample_ids=IDS), want)
        u = sample_uniforms(KEY, IDS)
        want = 0
        for k in range(2):
            t = floor_time((u + k / 2) % 1.0, 1e-3).float()
            m = completion & (mask_uniforms(KEY, k, IDS, S) < t)
            want = want + torch.where(m, lp(m) / t, torch.zeros(()))
        assert torch.equal(MCELBOEstimator(2)(fn, x, completion, mask_id=MASK, key=KEY, sample_ids=IDS), want / 2)


def test_rows_must_be_padded_on_one_side():
    valid = torch.tensor([[True, False, True, True]])
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=2), MASK)
    with pytest.raises(Exception, match="pad each row on one side only"):
        BlockLogitsFn(tiny_model(), valid, obj)


@pytest.fixture(scope="module")
def bd3lm_run(tmp_path_factory):
    from test_posttrain_runtime import make_init_run

    return make_init_run(tmp_path_factory.mktemp("bd3lm"), "objective=bd3lm", "objective.block_size=4")


def spy_forwards(monkeypatch):
    """Record (module, attn_mask) of every Transformer forward."""
    from difflm.model.transformer import Transformer

    calls, forward = [], Transformer.forward

    def spy(self, *args, **kwargs):
        calls.append((self, kwargs.get("attn_mask"), args[0].shape))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    return calls


def test_grpo_step_scores_policy_old_and_reference_with_the_bd3lm_forward(bd3lm_run, tmp_path, monkeypatch):
    from test_posttrain_runtime import rl_config

    from difflm.posttrain.grpo_step import grpo_step
    from difflm.posttrain.runner import PostTrainer

    run = PostTrainer(rl_config(bd3lm_run, tmp_path / "grpo", "estimator=mc_elbo", "train.max_steps=1",
                                "data.eval_records=0"), torch.device("cpu"))
    assert isinstance(run.blocks, BD3LMObjective) and run.blocks.block_size == 4
    fns = []
    make = run.logits_fn
    monkeypatch.setattr(run, "logits_fn", lambda model, valid: fns.append((model, make(model, valid))) or fns[-1][1])
    calls = spy_forwards(monkeypatch)
    estimates, estimate = [], run.estimator
    monkeypatch.setattr(run, "estimator", lambda *a, **k: estimates.append(estimate(*a, **k)) or estimates[-1])
    run.estimator.forwards = estimate.forwards
    records, _ = run.records_of_step(0)
    grpo_step(run, 0, records)
    assert [m for m, _ in fns] == [run.model, run.reference] and all(isinstance(f, BlockLogitsFn) for _, f in fns)
    scored = [(m, mask, shape) for m, mask, shape in calls if isinstance(mask, BlockDiffusionMask)]
    policy = [c for c in scored if c[0] is run.model]
    reference = [c for c in scored if c[0] is run.reference.model]
    a = run.cfg.algorithm
    # one forward per estimate (num_t draws stacked): old and new per inner key on the policy, one on the reference;
    # the rollouts' forwards (the block sampler's own masks) are not among them
    assert len(policy) == 2 * a.num_inner and len(reference) == a.num_inner and len(scored) == 3 * a.num_inner
    w = fns[0][1].width
    assert all(shape == (2 * a.group_size, 2 * w) and mask.seq_len == w and mask.block_size == 4
               for _, mask, shape in scored)
    # old (per key), reference (per key), then new per key: before the first update the three models are one
    n = a.num_inner
    old, ref, new = estimates[:n], estimates[n:2 * n], estimates[2 * n:]
    assert torch.equal(old[0], new[0].detach()) and torch.allclose(old[0], ref[0], atol=1e-6)
    assert not torch.equal(old[0], old[1])  # each inner key draws its own noise


def test_dpo_step_scores_with_the_bd3lm_forward(bd3lm_run, tmp_path, monkeypatch):
    import json

    from test_posttrain_runtime import rl_config

    from difflm.posttrain.runner import PostTrainer

    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"})
                             + "\n" for i in range(4)))
    cfg = rl_config(bd3lm_run, tmp_path / "dpo", "algorithm=dpo", "estimator=mc_elbo", f"data.path={prefs}",
                    "data.prompt_field=prompt", "data.answer_field=null", "algorithm.prompts_per_step=2",
                    "data.eval_records=0", "train.max_steps=1")
    run = PostTrainer(cfg, torch.device("cpu"))
    calls = spy_forwards(monkeypatch)
    last = run.fit()
    scored = [m for m, mask, _ in calls if isinstance(mask, BlockDiffusionMask)]
    assert scored == [run.model, run.reference.model]  # the policy's estimate, then the reference's
    assert abs(last["loss"] - 0.693147) < 1e-5  # policy = reference under shared noise: every score difference 0


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bd3lm_grpo_under_fsdp2_and_tp2_equals_one_process(bd3lm_run, tmp_path):
    """The bd3lm forward (a per-row document mask over padded rows, logits of the x_t half by index) under sharded
    weights and a vocab-parallel head gives one process's run (to 1e-4: step 2's gradient norm, after an update of
    lr 1e-2, differs from one process's in float32 summation order by about 1e-5 relative)."""
    from test_posttrain_layouts import assert_same_run, run_rl, spawn

    run_rl(bd3lm_run, tmp_path / "single", "grpo")
    spawn(tmp_path, bd3lm_run, [["fsdp", "grpo", ["parallel=fsdp"]],
                                ["tp", "grpo", ["parallel=tp2", "parallel.sequence_parallel=false"]]])
    for name in ("fsdp", "tp"):
        assert_same_run(tmp_path / "single", tmp_path / name, "grpo", tol=1e-4)
