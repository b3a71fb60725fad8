"""The MDLM/LLaDA loss against hand computations, masking statistics and keyed (layout-free) noise."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from difflm.objectives import ARObjective, MDLMObjective, loss_normaliser, shortest_step_length, step_length, \
    weighted_ce_sum
from difflm.objectives.mdlm import draw_mask, mask_prob, noise_batch, sample_t

MASK = 99


def objective(**kw):
    cfg = OmegaConf.create(dict(dict(eps=1e-3, t_sampling="iid", loss_norm="token", random_length_prob=0.0,
                                     length_multiple=1), **kw))
    return MDLMObjective(cfg, MASK)


def test_loss_equals_hand_computation():
    torch.manual_seed(0)
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    t = torch.tensor([0.5, 0.25])
    mask = torch.tensor([[True, False, True, False], [False, False, False, True]])
    batch = noise_batch(tokens, t, mask, MASK, eps=0.1)
    assert batch.input_ids.tolist() == [[MASK, 4, MASK, 6], [7, 8, 9, MASK]]
    logits_all = torch.randn(2, 4, 12)
    logits = logits_all[mask]
    got = weighted_ce_sum(logits, batch, "token", 2 * 4)  # 2 sequences x 4 tokens
    # by hand: p = 0.9 t + 0.1; sum over masked of -log softmax / p, divided by B * L
    p = [0.9 * 0.5 + 0.1, 0.9 * 0.25 + 0.1]
    total = 0.0
    for b, i in [(0, 0), (0, 2), (1, 3)]:
        logp = logits_all[b, i].log_softmax(-1)[tokens[b, i]]
        total += -logp.item() / p[b]
    assert got.item() == pytest.approx(total / (2 * 4), rel=1e-6)
    # per-sequence normalisation agrees when all lengths are equal
    assert weighted_ce_sum(logits, batch, "sequence", 2).item() == pytest.approx(got.item(), rel=1e-6)


def test_global_normaliser_makes_accumulation_exact():
    torch.manual_seed(1)
    tokens = torch.randint(0, 50, (4, 16))
    obj = objective()
    full = obj.noise(tokens, range(4), (0, 0, 0), 4)
    logits = torch.randn(int(full.loss_mask.sum()), 100)
    whole = weighted_ce_sum(logits, full, "token", 4 * 16)
    n0 = int(full.loss_mask[:2].sum())
    halves = [obj.noise(tokens[:2], range(2), (0, 0, 0), 4), obj.noise(tokens[2:], range(2, 4), (0, 0, 0), 4)]
    split = weighted_ce_sum(logits[:n0], halves[0], "token", 64) + weighted_ce_sum(logits[n0:], halves[1], "token", 64)
    assert torch.equal(halves[0].loss_mask, full.loss_mask[:2]) and torch.equal(halves[1].t, full.t[2:])
    assert split.item() == pytest.approx(whole.item(), rel=1e-6)


def test_noise_depends_only_on_key_and_sample_id():
    tokens = torch.randint(0, 50, (8, 64))
    obj = objective()
    a = obj.noise(tokens, range(8), (7, 0, 3), 8)
    b = obj.noise(tokens[5:6], [5], (7, 0, 3), 8)
    assert torch.equal(a.loss_mask[5], b.loss_mask[0]) and a.t[5] == b.t[0]
    c = obj.noise(tokens, range(8), (7, 0, 4), 8)
    assert not torch.equal(a.loss_mask, c.loss_mask)


def test_masking_rate_matches_p_and_weights_are_inverse_p():
    t = torch.full((200,), 0.3)
    mask = draw_mask(mask_prob(t, 1e-3), 500, range(200), (1, 2, 3))
    expected = 0.999 * 0.3 + 1e-3
    assert mask.float().mean().item() == pytest.approx(expected, abs=0.005)  # 100k draws: sd ~ 0.0015
    batch = noise_batch(torch.zeros(200, 500, dtype=torch.long), t, mask, MASK, 1e-3)
    assert torch.allclose(batch.weights[mask], torch.full_like(batch.weights[mask], 1 / expected))
    assert (batch.weights[~mask] == 0).all()


def test_t_iid_is_uniform():
    t = sample_t(range(20000), key=(0, 0, 0), global_batch_size=20000, mode="iid")
    assert t.min() >= 0 and t.max() < 1
    assert t.mean().item() == pytest.approx(0.5, abs=0.01)
    hist = torch.histc(t, bins=10, min=0, max=1) / 20000
    assert (hist - 0.1).abs().max() < 0.01


@pytest.mark.parametrize("mode", ["antithetic", "stratified"])
def test_low_discrepancy_t_covers_unit_interval(mode):
    g = 16
    t = sample_t(range(g), key=(3, 0, 5), global_batch_size=g, mode=mode)
    assert t.min() >= 0 and t.max() < 1
    # exactly one t in each of the G strata [k/G, (k+1)/G)
    assert sorted((t * g).floor().long().tolist()) == list(range(g))


def test_antithetic_eval_draws_stratify_each_sequence():
    obj = objective()
    tokens = torch.randint(0, 50, (3, 8))
    ts = torch.stack([obj.eval_noise(tokens, [0, 1, 2], d, 4, seed=5).t for d in range(4)])  # [draw, seq]
    for seq in range(3):
        assert sorted((ts[:, seq] * 4).floor().long().tolist()) == [0, 1, 2, 3]


def test_ar_objective_is_next_token_nll():
    tokens = torch.tensor([[1, 2, 3, 4]])
    batch = ARObjective(None, MASK).noise(tokens, [0], (0,), 1)
    assert batch.input_ids.tolist() == tokens.tolist()
    assert batch.targets[0, :3].tolist() == [2, 3, 4] and batch.loss_mask.tolist() == [[True, True, True, False]]
    logits_all = torch.randn(1, 4, 10)
    got = weighted_ce_sum(logits_all[batch.loss_mask], batch, "token", 3)
    assert got.item() == pytest.approx(F.cross_entropy(logits_all[0, :3], tokens[0, 1:]).item(), rel=1e-6)


def test_random_length_truncation():
    lengths = [step_length(128, s, seed=0, prob=0.2, multiple=8) for s in range(2000)]
    short = [n for n in lengths if n != 128]
    assert 0.15 < len(short) / 2000 < 0.25
    assert all(n % 8 == 0 and 8 <= n <= 128 for n in lengths)
    assert lengths == [step_length(128, s, seed=0, prob=0.2, multiple=8) for s in range(2000)]
    assert all(step_length(128, s, 0, 0.0, 1) == 128 for s in range(100))


@pytest.mark.parametrize("overrides, shortest", [(dict(name="ar"), 2), (dict(name="mdlm", ar_loss_weight=1.0), 2),
                                                  (dict(name="bd3lm", ar_loss_weight=0.3), 2), (dict(name="mdlm"), 1),
                                                  (dict(name="sft"), 1), (dict(name="bd3lm"), 1)])
def test_random_lengths_leave_next_token_losses_a_prediction(overrides, shortest):
    # a one-token window has no next token: an ar step (or the hybrid AR term) would divide 0 by 0
    assert shortest_step_length(OmegaConf.create(overrides)) == shortest
    lengths = {step_length(2, s, seed=0, prob=1.0, multiple=1, shortest=shortest) for s in range(400)}
    assert lengths == ({2} if shortest == 2 else {1, 2})
    lengths = [step_length(8, s, seed=1, prob=1.0, multiple=1, shortest=2) for s in range(4000)]
    assert set(lengths) == set(range(2, 9))  # U{2, ..., 8}, each about 1/7 of the draws
    assert all(abs(lengths.count(n) / 4000 - 1 / 7) < 0.03 for n in range(2, 9))
    # the shortest ar window still gives a finite loss: its one prediction over its one loss token
    tokens = torch.tensor([[3, 4]])
    batch = ARObjective(None, MASK).noise(tokens, [0], (0,), 1)
    logits = torch.randn(1, 2, 10)
    got = weighted_ce_sum(logits[batch.loss_mask], batch, "token", loss_normaliser("token", batch.num_tokens))
    assert got.item() == pytest.approx(F.cross_entropy(logits[0, :1], tokens[0, 1:]).item(), rel=1e-6)


def test_expected_loss_of_uniform_model_is_log_vocab():
    # A model that predicts uniformly over V has NELBO E_t[(1/p) * p * log V] = log V per token.
    v, obj = 64, objective()
    tokens = torch.randint(0, v, (256, 64))
    batch = obj.noise(tokens, range(256), (0, 0, 0), 256)
    logits = torch.zeros(int(batch.loss_mask.sum()), v)
    assert weighted_ce_sum(logits, batch, "token", 256 * 64).item() == pytest.approx(math.log(v), rel=0.05)


def test_keyed_streams_are_domain_separated():
    """A fault report: bare-int keys were zero-padded by SeedSequence, so step 0's random-length coin
    (seed, 0, STREAM_LENGTH=2) drew the same number as sample 0's t at step 2 (seed, STREAM_TRAIN=0, 2, 0).
    Keys now have a fixed layout with the stream first, and every number is a counter-based function of its key."""
    import numpy as np

    from difflm.objectives.keyed_rng import (MAX_FIELDS, NUM_STREAMS, STREAM_LENGTH, STREAM_MASK, STREAM_T, key_hash,
                                             keyed_uniform, keyed_uniforms)

    def old_uniform(*key):
        seed = int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> 1)
        return float(torch.rand((), generator=torch.Generator().manual_seed(seed)))

    assert old_uniform(1234, 0, 2) == old_uniform(1234, 0, 2, 0) == pytest.approx(0.18532628)  # the reported collision
    coin = keyed_uniforms(STREAM_LENGTH, 1234, 0, n=2)[0]  # step_length's first draw
    t = sample_t([0], key=(1234, 2), global_batch_size=1, mode="iid")  # sample 0's t at step 2
    assert coin != pytest.approx(float(t[0]), abs=1e-3)
    assert float(t[0]) == pytest.approx(keyed_uniform(STREAM_T, 1234, 2, 0), abs=1e-7)
    # no two (stream, fields) hash the same: trailing zeros, large ints, other streams
    keys = [(s, *f) for s in range(NUM_STREAMS) for f in [(), (0,), (0, 0), (1234, 0, 2), (1234, 0, 2, 0), (1234, 2, 0),
                                                         (2**32 + 5,), (5, 1), (5, 0, 1), (2**64 - 1,)]]
    assert len({int(key_hash(*k)) for k in keys}) == len(keys)
    assert len({keyed_uniform(*k) for k in keys}) == len(keys)
    for bad in [(STREAM_T, -1), (NUM_STREAMS, 0), (STREAM_T, 2**64), (STREAM_T, *range(MAX_FIELDS + 1)),
                (STREAM_T, np.array([3, -1]))]:
        with pytest.raises(ValueError):
            key_hash(*bad)
    # vectorised over ids and counters = one key at a time; values uniform on [0, 1)
    ids = np.arange(50)
    rows = keyed_uniforms(STREAM_MASK, 7, 3, ids, n=400)
    assert rows.shape == (50, 400) and np.array_equal(rows[17], keyed_uniforms(STREAM_MASK, 7, 3, 17, n=400))
    assert 0.0 <= rows.min() and rows.max() < 1.0 and abs(rows.mean() - 0.5) < 0.01 and abs(rows.var() - 1 / 12) < 0.002
    # counters do not overlap between neighbouring keys (a row is not a shifted copy of another)
    assert not np.isin(rows[0], rows[1]).any()
