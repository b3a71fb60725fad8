"""AR-to-diffusion adaptation options: each loss against an implementation written from its paper's equation, on
fixed weights, tokens, t and masks; the recipes compose and train."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dlm_helpers import objective_cfg, tiny_model
from difflm.errors import DifflmError
from difflm.objectives import build_objective, loss_normaliser, weighted_ce_sum
from difflm.objectives.adaptation import AdaptedObjective
from difflm.objectives.keyed_rng import STREAM_ANNEAL, keyed_uniforms

VOCAB, MASK, L, B = 48, 47, 8, 3
SEED, STEP = 5, 2


def adapted_cfg(**kw):
    base = dict(attention_anneal_steps=0, block_schedule=None, complementary_masks=False, weighting="nelbo",
                cart_p=0.3, diffusion_loss_weight=1.0, ar_loss_weight=0.0, t_lo=0.0, t_hi=1.0)
    return objective_cfg(**{**base, **kw})


def tokens():
    return torch.randint(0, MASK, (B, L), generator=torch.Generator().manual_seed(0))


def difflm_loss(model, objective, batch, toks, norm="token") -> float:
    """The trainer's loss of one micro-batch that is the whole step: weighted CE (plus the aux batch's)."""
    normaliser = loss_normaliser(norm, objective.num_tokens(toks))
    total = 0.0
    while batch is not None:
        logits = model(batch.input_ids, batch.logits_selector(), **batch.model_kwargs()).double()
        total += float(weighted_ce_sum(logits, batch, norm, normaliser, fused=False))
        batch = batch.aux
    return total


def nll(model, x, mask=None, positions=None) -> torch.Tensor:
    """-log softmax of the model's full logits [B, S, V] (float64) under a dense bool mask [1|B, 1, S, S]."""
    kw = {} if mask is None else {"attn_mask": mask}
    if positions is not None:
        kw["position_ids"] = positions
    return -F.log_softmax(model(x, **kw).double(), dim=-1)


def p_of(t, eps=1e-3):
    return (1 - eps) * t + eps


def mdlm_reference(model, x0, xt, t, weight_fn, mask=None):
    """(1 / (B L)) sum_b sum_{i: x_t^i = MASK} w_{b,i} (-log p(x_0^i | x_t)) (LLaDA eq. 3 with weights w)."""
    lp = nll(model, xt, mask)
    total = 0.0
    for b in range(xt.shape[0]):
        for i in range(xt.shape[1]):
            if xt[b, i] == MASK:
                total += weight_fn(b, i) * float(lp[b, i, x0[b, i]])
    return total / (xt.shape[0] * xt.shape[1])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model(vocab=VOCAB)


def test_attention_anneal_matches_diffullama(model):
    """Step s: query i sees key j iff j <= i or u_ij < min(1, (s + 1) / N) (DiffuLLaMA sec. 3.2), u keyed by
    (seed, step, i); the loss is MDLM's under that mask; bidirectional from step N - 1 on and in evaluation."""
    n = 6
    obj = build_objective(adapted_cfg(attention_anneal_steps=n), MASK)
    assert isinstance(obj, AdaptedObjective)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    r = (STEP + 1) / n
    ref_mask = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        u = keyed_uniforms(STREAM_ANNEAL, SEED, STEP, i, n=L)
        for j in range(L):
            ref_mask[i, j] = bool(j <= i or u[j] < r)
    assert torch.equal(batch.attn_mask[0, 0], ref_mask)
    assert 0 < int((ref_mask & ~torch.ones(L, L, dtype=torch.bool).tril()).sum()) < L * (L - 1) // 2
    ref = mdlm_reference(model, x0, batch.input_ids, batch.t, lambda b, i: 1 / p_of(float(batch.t[b])),
                         ref_mask[None, None])
    assert difflm_loss(model, obj, batch, x0) == pytest.approx(ref, abs=1e-6)
    again = obj.noise(x0, range(B), (SEED, STEP), B)  # keyed: any rerun or resume draws the same mask
    assert torch.equal(again.attn_mask, batch.attn_mask) and torch.equal(again.input_ids, batch.input_ids)
    assert obj.noise(x0, range(B), (SEED, n - 1), B).attn_mask is None
    assert obj.eval_noise(x0, range(B), 0, 2, SEED).attn_mask is None


def bd3lm_reference(model, x0, xt, t_blocks, bs, weight=lambda p: 1 / p):
    """BD3-LM (Arriola et al. 2025, eq. 6/7 vectorised, sec. 3.2): the model sees [x_t ; x_0] with x_t block b
    attending x_t block b and x_0 blocks < b, x_0 block b attending x_0 blocks <= b; loss
    (1 / (B L)) sum_b sum_{masked i in block b} w(p_b) (-log p(x_0^i | ...))."""
    n = 2 * L
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            qb, kb = (q % L) // bs, (k % L) // bs
            if q < L:
                mask[q, k] = (k < L and kb == qb) or (k >= L and kb < qb)
            else:
                mask[q, k] = k >= L and kb <= qb
    lp = nll(model, torch.cat([xt, x0], dim=1), mask[None, None], torch.arange(L).repeat(2))
    total = 0.0
    for b in range(B):
        for i in range(L):
            if xt[b, i] == MASK:
                total += weight(p_of(float(t_blocks[b, i // bs]))) * float(lp[b, i, x0[b, i]])
    return total / (B * L)


def per_block_t(obj, bs):
    """The per-block t the objective drew (the keyed draw of BD3-LM's noise at (SEED, STEP))."""
    from difflm.objectives.mdlm import sample_t

    nb = L // bs
    return sample_t([i * nb + j for i in range(B) for j in range(nb)], key=(SEED, STEP), global_batch_size=B * nb,
                    mode="iid").view(B, nb)


@pytest.mark.parametrize("step,expected", [(0, 1), (1, 1), (2, 8), (3, 8), (4, 4), (9, 4)])
def test_block_schedule_phases_match_bd3lm(model, step, expected):
    """LLaDA 2.0 WSD phases [[2, 1], [2, 8], [1, 4]]: warmup at block 1 (AR-like), stable at block L (MDLM), decay to
    block 4, which then holds; each step's loss is BD3-LM's at that block size."""
    obj = build_objective(adapted_cfg(name="bd3lm", block_size=4, block_schedule=[[2, 1], [2, 8], [1, 4]]), MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, step), B)
    assert batch.attn_mask.block_size == expected
    from difflm.objectives.mdlm import sample_t

    nb = L // expected
    t = sample_t([i * nb + j for i in range(B) for j in range(nb)], key=(SEED, step), global_batch_size=B * nb,
                 mode="iid").view(B, nb)
    ref = bd3lm_reference(model, x0, batch.input_ids[:, :L], t, expected)
    assert difflm_loss(model, obj, batch, x0) == pytest.approx(ref, abs=1e-6)
    assert obj.eval_noise(x0, range(B), 0, 2, SEED).attn_mask.block_size == 4  # evaluation: the final block size


def test_complementary_masks_mdlm(model):
    """Fast-dLLM v2 sec. 3.2: rows under M (weight 1/p) and ~M (weight 1/(1-p)); every token masked exactly once;
    the step's loss is the mean of the two NELBO estimates."""
    obj = build_objective(adapted_cfg(complementary_masks=True), MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    assert batch.input_ids.shape == (2 * B, L)
    first, second = batch.input_ids[:B] == MASK, batch.input_ids[B:] == MASK
    assert torch.equal(first, ~second)
    t = batch.t[:B]
    assert torch.equal(batch.t[B:], t)
    lp = nll(model, batch.input_ids)
    total = 0.0
    for b in range(B):
        p = p_of(float(t[b]))
        for i in range(L):
            row, w = (b, 1 / p) if first[b, i] else (B + b, 1 / max(1 - p, 1e-3))
            total += w * float(lp[row, i, x0[b, i]])
    assert difflm_loss(model, obj, batch, x0) == pytest.approx(total / (2 * B * L), abs=1e-6)
    assert obj.eval_noise(x0, range(B), 0, 2, SEED).input_ids.shape == (B, L)  # evaluation: the plain NELBO draw


def test_complementary_masks_bd3lm(model):
    """The pair under block diffusion: per-block p_b, ~M weighted 1 / (1 - p_b)."""
    obj = build_objective(adapted_cfg(name="bd3lm", block_size=4, complementary_masks=True), MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    t = per_block_t(obj, 4)
    xt = batch.input_ids[:, :L]
    assert torch.equal(xt[:B] == MASK, xt[B:] != MASK)
    ref = bd3lm_reference(model, x0, xt[:B], t, 4) + bd3lm_reference(model, x0, xt[B:], t, 4,
                                                                       lambda p: 1 / max(1 - p, 1e-3))
    assert difflm_loss(model, obj, batch, x0) == pytest.approx(ref / 2, abs=1e-6)


@pytest.mark.parametrize("shift", [False, True])
def test_cart_matches_dream_eq3(shift):
    """Dream eq. 3: w(t, x_t, n) = 1/2 sum_i 1[x_t^i clean] (1 - p)^{|n - i| - 1} p replaces 1/t; with Dream's shifted
    logits the prediction of token n is the unshifted model's output at n - 1 (same weights)."""
    torch.manual_seed(0)
    shifted = tiny_model(vocab=VOCAB, shift_logits=shift)
    plain = tiny_model(vocab=VOCAB)
    q = 0.3
    obj = build_objective(adapted_cfg(weighting="cart", cart_p=q), MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    xt = batch.input_ids
    lp = nll(plain, xt)
    if shift:
        lp = torch.cat([lp[:, :1], lp[:, :-1]], dim=1)
    total = 0.0
    for b in range(B):
        for n in range(L):
            if xt[b, n] == MASK:
                w = 0.5 * sum((1 - q) ** (abs(n - i) - 1) * q for i in range(L) if xt[b, i] != MASK)
                total += w * float(lp[b, n, x0[b, n]])
    assert difflm_loss(shifted, obj, batch, x0) == pytest.approx(total / (B * L), abs=1e-6)


@pytest.mark.parametrize("pair", [False, True])
def test_cart_counts_only_the_context_a_packed_document_sees(pair):
    """Under intra-document attention a packed window's documents do not see each other, so Dream's eq. 3 sums over
    the clean tokens of the token's own document only (complementary rows too), not those of its neighbours, which
    it cannot attend to. Complementary rows keep their 1/2 share of the pair's mean under CART's weights (two full
    shares would double the loss)."""
    from difflm.data.batch import TokenBatch
    from difflm.model.masks import document_ids

    q = 0.3
    obj = build_objective(adapted_cfg(weighting="cart", cart_p=q, complementary_masks=pair), MASK)
    x0 = tokens()
    x0[0, 2], x0[0, 5], x0[1, 3] = 0, 0, 0  # EOS (id 0) closes a document: row 0 packs 3, row 1 packs 2
    docs = document_ids(x0, 0)
    batch = obj.noise(TokenBatch(x0, doc_ids=docs), range(B), (SEED, STEP), B)
    rows = batch.input_ids.shape[0]
    assert rows == (2 if pair else 1) * B
    xt, docs = batch.input_ids, docs.repeat(rows // B, 1)
    for b in range(rows):
        for n in range(L):
            want = 0.5 * sum((1 - q) ** (abs(n - i) - 1) * q for i in range(L)
                             if i != n and xt[b, i] != MASK and docs[b, i] == docs[b, n])
            if xt[b, n] == MASK:
                assert float(batch.weights[b, n]) == pytest.approx(want * (0.5 if pair else 1.0), abs=1e-6)
            else:
                assert float(batch.weights[b, n]) == 0.0


@pytest.mark.parametrize("name,norm", [("bd3lm", "token"), ("mdlm", "sequence")])
def test_hybrid_matches_megatron_bridge(model, name, norm):
    """0.3 x diffusion CE on x_t + 1.0 x mean next-token CE on the clean copy under causal attention."""
    cfg = adapted_cfg(name=name, block_size=4, ar_loss_weight=1.0, diffusion_loss_weight=0.3, loss_norm=norm)
    obj = build_objective(cfg, MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    if name == "bd3lm":
        diffusion = bd3lm_reference(model, x0, batch.input_ids[:, :L], per_block_t(obj, 4), 4)
    else:  # sequence norm of equal-length rows: the same mean
        diffusion = mdlm_reference(model, x0, batch.input_ids, batch.t, lambda b, i: 1 / p_of(float(batch.t[b])))
    lp = nll(model, x0, torch.ones(L, L, dtype=torch.bool).tril()[None, None])
    ar = sum(float(lp[b, j, x0[b, j + 1]]) for b in range(B) for j in range(L - 1)) / (B * (L - 1))
    assert difflm_loss(model, obj, batch, x0, norm) == pytest.approx(0.3 * diffusion + 1.0 * ar, abs=1e-6)
    assert obj.eval_noise(x0, range(B), 0, 2, SEED).aux is None  # val_nelbo stays the diffusion bound


def test_truncated_t(model):
    """t ~ U(t_lo, t_hi): the base draw u mapped to t_lo + (t_hi - t_lo) u, and the loss MDLM's at that t; evaluation
    keeps U(0, 1)."""
    lo, hi = 0.4, 0.7
    obj = build_objective(adapted_cfg(t_lo=lo, t_hi=hi, t_sampling="antithetic"), MASK)
    plain = build_objective(objective_cfg(t_sampling="antithetic"), MASK)
    x0 = tokens()
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    u = plain.noise(x0, range(B), (SEED, STEP), B).t
    assert torch.allclose(batch.t, lo + (hi - lo) * u)
    assert bool(((batch.t >= lo) & (batch.t < hi)).all())
    ref = mdlm_reference(model, x0, batch.input_ids, batch.t, lambda b, i: 1 / p_of(float(batch.t[b])))
    assert difflm_loss(model, obj, batch, x0) == pytest.approx(ref, abs=1e-6)
    assert torch.equal(obj.eval_noise(x0, range(B), 0, 2, SEED).t, plain.eval_noise(x0, range(B), 0, 2, SEED).t)


REFUSALS = [
    (["objective=ar", "objective.attention_anneal_steps=10"], "objective=ar takes none of them"),
    (["objective=bd3lm", "objective.block_size=8", "objective.attention_anneal_steps=10"], "block_schedule instead"),
    (["objective=mdlm", "objective.block_schedule=[[2,1],[2,8]]"], "use objective=bd3lm"),
    (["objective=bd3lm", "objective.block_size=8", "objective.block_schedule=[[2,1],[2,4]]"], "last phase"),
    (["objective=bd3lm", "objective.block_size=8", "objective.block_schedule=[[2,3],[2,8]]"], "does not divide"),
    (["objective=bd3lm", "objective.block_size=8", "objective.weighting=cart"], "full-sequence diffusion"),
    (["objective=mdlm", "objective.t_lo=0.6", "objective.t_hi=0.5"], "0 <= t_lo < t_hi <= 1"),
    (["objective=mdlm", "objective.complementary_masks=true", "objective.schedule=cosine"], "schedule=linear"),
    (["objective=mdlm", "objective.weighting=uniform"], "not one of: nelbo, cart"),
    (["objective=mdlm", "objective.ar_loss_weight=1.0", "model.shift_logits=true"], "drop one of them"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_refusals(fast_cfg, overrides, message):
    from difflm.config.validate import check_run

    cfg = fast_cfg("objective.random_length_prob=0", *overrides)
    with pytest.raises(DifflmError, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_run(cfg)


RECIPES = ["dream_adapt", "diffullama_adapt", "llada2_wsd_adapt", "fast_dllm_v2_adapt", "megatron_bridge_hybrid_adapt"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_trains(fast_cfg, tmp_path, recipe):
    """Each recipe composes on model=tiny (its block sizes cut to a 64-token window) and trains 2 steps."""
    from difflm.config.validate import check_run
    from difflm.training.trainer import Trainer

    cut = {"llada2_wsd_adapt": ["objective.block_schedule=[[1,1],[1,64],[1,8]]", "objective.block_size=8"],
           "fast_dllm_v2_adapt": ["objective.block_size=8"]}.get(recipe, [])
    cfg = fast_cfg(f"experiment={recipe}", "model=tiny", "data.seq_len=64", "train.max_steps=2", "train.eval_every=0",
                   "train.save_every=0", "schedule.warmup_steps=1", "precision=fp32", "parallel=single", *cut)
    assert OmegaConf.to_yaml(cfg)  # what --cfg job prints
    device = check_run(cfg)
    trainer = Trainer(cfg, cfg.run.dir, device)
    trainer.fit()
    assert trainer.step == 2 and math.isfinite(trainer.evaluate())


def test_complementary_masks_sft_keep_prompts_clean(model):
    """Under sft the pair covers every response token exactly once and never masks or weighs a prompt token; the loss
    is the mean of the two halves' response NELBOs, each row divided by its response length (loss_norm=sequence)."""
    from difflm.data.batch import TokenBatch

    obj = build_objective(adapted_cfg(name="sft", complementary_masks=True, loss_norm="sequence"), MASK)
    x0 = tokens()
    lengths = torch.tensor([2, 3, 5])
    tb = TokenBatch(x0, prompt_lengths=lengths)
    batch = obj.noise(tb, range(B), (SEED, STEP), B)
    response = torch.arange(L)[None, :] >= lengths[:, None]
    first, second = batch.input_ids[:B] == MASK, batch.input_ids[B:] == MASK
    assert torch.equal(first | second, response) and not bool((first & second).any())
    lp = nll(model, batch.input_ids)
    total = 0.0
    for b in range(B):
        p = p_of(float(batch.t[b]))
        n = int(response[b].sum())
        for i in range(L):
            if response[b, i]:
                row, w = (b, 1 / p) if first[b, i] else (B + b, 1 / max(1 - p, 1e-3))
                total += 0.5 * w * float(lp[row, i, x0[b, i]]) / n
    assert difflm_loss(model, obj, batch, tb, "sequence") == pytest.approx(total / B, abs=1e-6)


def test_adaptation_table_hybrid_row_keeps_the_recipe_weights():
    """The table's hybrid row trains the recipe's loss weights (diffusion 0.3, AR 1.0, as Megatron-Bridge's
    NemotronLabsDiffusion provider sets dlm_loss_weight / ar_loss_weight), not swapped ones, and its causal clean
    half (the sbd_block_diff mask)."""
    from conftest import load_script

    table = load_script("adaptation_table")
    recipe = OmegaConf.load(table.difflm.config.CONF_DIR / "experiment" / "megatron_bridge_hybrid_adapt.yaml")
    row = dict(o.split("=", 1) for o in table.recipe_overrides("megatron_bridge_hybrid", 30, 32))
    assert (float(row["objective.diffusion_loss_weight"]), float(row["objective.ar_loss_weight"])) == \
        (recipe.objective.diffusion_loss_weight, recipe.objective.ar_loss_weight) == (0.3, 1.0)
    assert row["objective.clean_attention"] == recipe.objective.clean_attention == "causal"


def test_adaptation_table_summary_over_seeds():
    """Per recipe: the mean of the final NELBOs, adapted - scratch per seed, its mean and sample standard deviation
    and the number of seeds in which the adapted run ends lower."""
    import statistics

    from conftest import load_script

    finals = {"a": [(6.0, 5.5), (6.2, 6.3), (5.9, 5.6)], "b": [(7.0, 6.0), (7.1, 6.4), (7.3, 6.2)]}
    runs = [{"seed": s, "ar_nll": 5.0, "rows": [{"recipe": name, "scratch": [(0, 9.0), (1, pairs[s][0])],
                                                  "adapted": [(0, 8.0), (1, pairs[s][1])]}
                                                 for name, pairs in finals.items()]} for s in range(3)]
    summary = load_script("adaptation_table").summarise(runs)
    for row, (name, pairs) in zip(summary, finals.items()):
        diffs = [a - s for s, a in pairs]
        assert row["recipe"] == name and row["diffs"] == pytest.approx(diffs, abs=1e-12)
        assert row["diff_mean"] == pytest.approx(statistics.mean(diffs), abs=1e-12)
        assert row["diff_sd"] == pytest.approx(statistics.stdev(diffs), abs=1e-12)
        assert row["scratch_mean"] == pytest.approx(statistics.mean(s for s, _ in pairs), abs=1e-12)
        assert row["adapted_mean"] == pytest.approx(statistics.mean(a for _, a in pairs), abs=1e-12)
    assert [row["lower_in"] for row in summary] == [2, 3]


def test_adaptation_table_reuses_its_ar_checkpoint(tmp_path, capsys):
    """A second table in the same --out with the same overrides and --ar-steps adapts the saved AR checkpoint (the same
    AR NLL, no AR training); other --ar-steps train it again."""
    import json

    from conftest import load_script

    table = load_script("adaptation_table")
    args = ["--ar-steps", "2", "--adapt-steps", "1", "--recipes", "dream", "--out", str(tmp_path)]
    assert table.main([*args, "--json", str(tmp_path / "a.json")]) == 0
    assert "reused" not in capsys.readouterr().out
    assert table.main([*args, "--json", str(tmp_path / "b.json")]) == 0
    assert "AR checkpoint reused" in capsys.readouterr().out
    first, second = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert first["runs"][0]["ar_nll"] == second["runs"][0]["ar_nll"]
    args[1] = "3"
    assert table.main([*args, "--json", str(tmp_path / "c.json")]) == 0
    assert "reused" not in capsys.readouterr().out


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_needs_the_imported_checkpoint(fast_cfg, tmp_path, recipe):
    """Each adaptation recipe sets train.require_checkpoint: its run.dir must hold a complete checkpoint to continue
    (difflm-import's step_0). An empty run.dir and a checkpoint folder without its manifest (a save that never
    finished) are refused in one line naming difflm-import and the key; a model-only step_0 as difflm-import writes
    it passes; without a recipe a run.dir without checkpoints trains from random weights as before."""
    from difflm.checkpoint.store import save_checkpoint
    from difflm.model import Transformer, resolve_model_config
    from difflm.training.run_config import check_start_checkpoint

    cfg = fast_cfg(f"experiment={recipe}", "model=tiny")
    assert cfg.train.require_checkpoint is True
    run_dir = tmp_path / "run"
    with pytest.raises(DifflmError, match=r"^train.require_checkpoint=true and run.dir=.* holds no complete "
                                          r"checkpoint to start from: import the AR model into it first "
                                          r"\(difflm-import hf=") as err:
        check_start_checkpoint(cfg, run_dir)
    assert "\n" not in str(err.value) and str(err.value).endswith("set train.require_checkpoint=false to train from "
                                                                  "random weights")
    (run_dir / "checkpoints" / "step_0").mkdir(parents=True)  # no manifest: not a checkpoint
    with pytest.raises(DifflmError, match="holds no complete checkpoint"):
        check_start_checkpoint(cfg, run_dir)
    (run_dir / "checkpoints" / "step_0").rmdir()
    resolve_model_config(cfg.model, 512)
    save_checkpoint(run_dir, 0, Transformer(cfg.model), None, {"step": 0}, config="{}")
    assert check_start_checkpoint(cfg, run_dir) is None  # difflm-import's model-only step_0
    plain = fast_cfg("model=tiny")
    assert plain.train.require_checkpoint is False
    assert check_start_checkpoint(plain, tmp_path / "elsewhere") is None


def test_lora_without_a_checkpoint_to_continue_is_said(fast_cfg, tmp_path):
    """A LoRA run's base weights come from a checkpoint in run.dir: without one its adapters would train on random
    weights, which the run says in one warning line (and train.require_checkpoint=true refuses); with one, nothing."""
    from difflm.checkpoint.store import save_checkpoint
    from difflm.model import Transformer, resolve_model_config
    from difflm.training.run_config import check_start_checkpoint

    cfg = fast_cfg("model=tiny", "lora=attn")
    run_dir = tmp_path / "run"
    warning = check_start_checkpoint(cfg, run_dir)
    assert warning == (f"difflm: warning: lora.rank={cfg.lora.rank} trains adapters on random base weights: "
                       f"run.dir={run_dir} holds no checkpoint to continue (difflm-import hf=<model> run.dir={run_dir} "
                       f"writes one; set train.require_checkpoint=true to refuse such a run)")
    cfg.train.require_checkpoint = True
    with pytest.raises(DifflmError, match="holds no complete checkpoint to start from"):
        check_start_checkpoint(cfg, run_dir)
    resolve_model_config(cfg.model, 512)
    save_checkpoint(run_dir, 0, Transformer(cfg.model), None, {"step": 0}, config="{}")
    assert check_start_checkpoint(cfg, run_dir) is None
