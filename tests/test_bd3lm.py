"""BD3-LM: the block-causal mask (dense and FlexAttention), the model's mask/position inputs, and the loss limits
block_size=1 (next-token NLL) and block_size=L (MDLM)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

from difflm.errors import DifflmError
from difflm.model.masks import (block_causal_block_mask, block_causal_inference_mask, block_causal_mask, document_ids,
                                document_mask, to_block_mask)
from difflm.objectives import BD3LMObjective, MDLMObjective, weighted_ce_sum
from tests.dlm_helpers import objective_cfg, tiny_model

MASK = 47


def hand_mask(L, bs):
    n = 2 * L
    m = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            qn, kn = q < L, k < L
            qb, kb = (q % L) // bs, (k % L) // bs
            if qn and kn:
                m[q, k] = qb == kb
            elif qn and not kn:
                m[q, k] = kb < qb
            elif not qn and not kn:
                m[q, k] = kb <= qb
    return m


@pytest.mark.parametrize("L,bs", [(4, 1), (4, 2), (6, 3), (8, 4), (8, 8)])
def test_block_causal_mask_equals_hand_built(L, bs):
    assert torch.equal(block_causal_mask(L, bs)[0, 0], hand_mask(L, bs))


def test_block_size_must_divide_length():
    with pytest.raises(DifflmError, match="objective.block_size=3"):
        block_causal_mask(8, 3)


@pytest.mark.parametrize("L,bs", [(8, 2), (80, 16)])
def test_flex_block_mask_equals_dense(L, bs):
    dense = block_causal_mask(L, bs)[0, 0]
    bm = block_causal_block_mask(L, bs)
    n = 2 * L
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    token_level = bm.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, k)
    assert torch.equal(token_level, dense)
    # block level: a (q-block, kv-block) tile is present iff some token pair in it attends
    blocks = bm.to_dense()[0, 0].bool()
    size = bm.BLOCK_SIZE[0]
    nb = -(-n // size)
    padded = torch.zeros(nb * size, nb * size, dtype=torch.bool)
    padded[:n, :n] = dense
    tiles = padded.view(nb, size, nb, size).any(dim=3).any(dim=1)
    assert torch.equal(blocks[:nb, :nb], tiles)
    # and attention outputs agree (FlexAttention eager on CPU vs SDPA with the dense mask)
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    qkv = [torch.randn(1, 2, n, 8) for _ in range(3)]
    out_flex = flex_attention(*qkv, block_mask=bm)
    out_sdpa = F.scaled_dot_product_attention(*qkv, attn_mask=dense)
    assert torch.allclose(out_flex, out_sdpa, atol=1e-5)


def test_to_block_mask_of_document_mask_matches():
    tokens = torch.tensor([[1, 2, 0, 3, 4, 5, 0, 6], [1, 0, 2, 3, 0, 4, 5, 6]])
    dense = document_mask(document_ids(tokens, 0))
    bm = to_block_mask(dense)
    from torch.nn.attention.flex_attention import flex_attention

    qkv = [torch.randn(2, 2, 8, 8) for _ in range(3)]
    assert torch.allclose(flex_attention(*qkv, block_mask=bm), F.scaled_dot_product_attention(*qkv, attn_mask=dense),
                          atol=1e-5)


def test_model_mask_and_position_inputs():
    model = tiny_model()
    x = torch.randint(0, 40, (2, 10))
    base = model(x)
    assert torch.allclose(model(x, position_ids=torch.arange(10)), base, atol=1e-6)
    assert torch.allclose(model(x, position_ids=torch.arange(10).expand(2, 10)), base, atol=1e-6)
    assert torch.allclose(model(x, attn_mask=torch.ones(1, 1, 10, 10, dtype=torch.bool)), base, atol=1e-6)
    causal = tiny_model(causal=True)
    tril = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    assert torch.allclose(causal(x), model(x, attn_mask=tril), atol=1e-6)
    with pytest.raises(DifflmError, match="attention_backend=te cannot take a dense attention mask"):
        from difflm.model.attention import prepare_mask

        prepare_mask(tril, "te")


def test_structured_masks_equal_their_dense_and_flex_forms():
    """BlockDiffusionMask / DocumentMask spell out to the dense masks and build BlockMasks with the same pattern."""
    from difflm.model.masks import BlockDiffusionMask, DocumentMask

    x = torch.tensor([[5, 6, 0, 8, 9, 10, 0, 11], [1, 2, 3, 4, 0, 5, 6, 7]])
    ids = document_ids(x, 0)
    L = x.shape[1]
    n = 2 * L
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    bd = BlockDiffusionMask(L, 4)
    assert torch.equal(bd.dense(), block_causal_mask(L, 4))
    with_docs = BlockDiffusionMask(L, 4, ids)
    doc2 = torch.cat([ids, ids], dim=1)
    want = block_causal_mask(L, 4) & (doc2[:, :, None] == doc2[:, None, :])[:, None]
    assert torch.equal(with_docs.dense(), want)
    for b in range(2):
        bi = torch.tensor(b)
        token_level = with_docs.block_mask().mask_mod(bi, torch.tensor(0), q, k)
        assert torch.equal(token_level, want[b, 0])
    for causal in (False, True):
        dm = DocumentMask(ids, causal=causal)
        assert torch.equal(dm.dense(), document_mask(ids, causal=causal))
        qq, kk = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
        for b in range(2):
            assert torch.equal(dm.block_mask().mask_mod(torch.tensor(b), torch.tensor(0), qq, kk), dm.dense()[b, 0])
    cu, longest = DocumentMask(ids).varlen()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 7, 8, 13, 16] and longest == 5


def test_flex_backend_model_equals_sdpa_under_block_causal_mask():
    a, b = tiny_model(), tiny_model(backend="flex")
    x = torch.randint(0, 40, (2, 16))
    mask, pos = block_causal_mask(8, 4), torch.arange(8).repeat(2)
    with torch.no_grad():  # PyTorch has no FlexAttention backward on CPU
        assert torch.allclose(a(x, attn_mask=mask, position_ids=pos), b(x, attn_mask=mask, position_ids=pos),
                              atol=1e-5)


def test_intra_document_mask_isolates_documents():
    model = tiny_model()
    x = torch.tensor([[5, 6, 7, 0, 8, 9, 10, 11]])
    mask = document_mask(document_ids(x, 0))
    y = x.clone()
    y[0, 5:] = torch.tensor([20, 21, 22])  # change the second document only
    la, lb = model(x, attn_mask=mask), model(y, attn_mask=mask)
    assert torch.allclose(la[0, :4], lb[0, :4], atol=1e-6)  # first document (with its EOS) unaffected
    assert not torch.allclose(model(x)[0, :4], model(y)[0, :4], atol=1e-6)  # but it would be without the mask


def test_bd3lm_at_block_size_L_equals_mdlm():
    torch.manual_seed(0)
    tokens = torch.randint(0, 40, (3, 8))
    key, ids = (7, 0, 3), [0, 1, 2]
    for mode in ("iid", "antithetic", "stratified"):
        bd = BD3LMObjective(objective_cfg(name="bd3lm", block_size=8, t_sampling=mode), MASK).noise(tokens, ids, key, 3)
        md = MDLMObjective(objective_cfg(t_sampling=mode), MASK).noise(tokens, ids, key, 3)
        assert torch.equal(bd.loss_mask[:, :8], md.loss_mask) and torch.equal(bd.input_ids[:, :8], md.input_ids)
        assert torch.allclose(bd.weights[:, :8], md.weights)
    model = tiny_model()
    lbd = weighted_ce_sum(model(bd.input_ids, bd.loss_mask, **bd.model_kwargs()), bd, "token", 3 * 8)
    lmd = weighted_ce_sum(model(md.input_ids, md.loss_mask), md, "token", 3 * 8)
    assert lbd.item() == pytest.approx(lmd.item(), rel=1e-5)


def test_bd3lm_at_block_size_1_is_the_next_token_nll():
    torch.manual_seed(1)
    L = 6
    tokens = torch.randint(0, 40, (2, L))
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=1, eps=1e-3), MASK)
    model = tiny_model()
    full = obj.build(tokens, torch.ones(2, L), torch.ones(2, L, dtype=torch.bool))  # t = 1: everything masked
    logits = model(full.input_ids, **full.model_kwargs())  # [2, 2L, V]
    # position i of the noisy half = a causal forward over [x_<i, MASK] read at its last position
    nll = torch.zeros(())
    for i in range(L):
        ctx = torch.cat([tokens[:, :i], torch.full((2, 1), MASK)], dim=1)
        tril = torch.ones(i + 1, i + 1, dtype=torch.bool).tril()[None, None]
        ref = model(ctx, attn_mask=tril)[:, -1]
        assert torch.allclose(logits[:, i], ref, atol=1e-5)
        nll = nll + F.cross_entropy(ref, tokens[:, i], reduction="sum")
    loss = weighted_ce_sum(model(full.input_ids, full.loss_mask, **full.model_kwargs()), full, "token", 2 * L)
    assert loss.item() == pytest.approx(nll.item() / (2 * L), rel=1e-5)  # weight 1/t = 1 at t = 1
    # any other mask: each masked token's loss is the same AR term (it sees only the clean prefix), weight 1/p
    part = obj.noise(tokens, [0, 1], (3, 0, 1), 2)
    lp = model(part.input_ids, **part.model_kwargs())
    assert torch.allclose(lp[:, :L][part.loss_mask[:, :L]], logits[:, :L][part.loss_mask[:, :L]], atol=1e-5)


def test_bd3lm_one_t_per_block_and_keyed():
    obj = BD3LMObjective(objective_cfg(name="bd3lm", block_size=4), MASK)
    tokens = torch.randint(0, 40, (2, 16))
    a = obj.noise(tokens, [0, 1], (1, 0, 5), 2)
    b = obj.noise(tokens[1:], [1], (1, 0, 5), 2)
    assert torch.equal(a.input_ids[1:], b.input_ids)  # a sample's noise depends only on (key, sample id)
    w = a.weights[:, :16].view(2, 4, 4)
    for r in range(2):
        for j in range(4):
            vals = w[r, j][w[r, j] > 0]
            assert vals.numel() == 0 or torch.allclose(vals, vals[0].expand_as(vals))
    assert a.input_ids.shape == (2, 32) and torch.equal(a.input_ids[:, 16:], tokens)
    assert torch.equal(a.position_ids, torch.arange(16).repeat(2))


def test_inference_mask_is_the_training_context():
    m = block_causal_inference_mask(6, 4)[0, 0]
    assert m[5].tolist() == [True] * 6 and m[3].tolist() == [True] * 4 + [False] * 2


def test_bd3lm_config_checks(fast_cfg):
    from difflm.config.validate import check_run

    with pytest.raises(DifflmError, match="objective.block_size=5"):
        check_run(fast_cfg("objective=bd3lm", "objective.block_size=5", "device=cpu"))
    with pytest.raises(DifflmError, match="model.attention_backend=te"):
        from difflm.config.validate import check_objective_data

        cfg = fast_cfg("objective=bd3lm", "objective.block_size=4")
        cfg.model.attention_backend = "te"
        check_objective_data(cfg)


def test_bd3lm_trains_with_intra_document_attention(fast_cfg, tmp_path):
    from difflm.training.flops import bd3lm_flops_per_token
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("objective=bd3lm", "objective.block_size=8", "data.intra_document_attention=true",
                   "train.max_steps=2", "train.eval_every=2", "train.save_every=0", "device=cpu")
    trainer = Trainer(cfg, tmp_path / "run", torch.device("cpu"))
    m = cfg.model  # MFU counts what bd3lm runs: [x_t ; x_0] under the block-causal mask (as scripts/benchmark.py)
    assert trainer.flops_per_token == bd3lm_flops_per_token(trainer.model.num_params(), m.num_layers, m.hidden_size,
                                                            m.vocab_size, cfg.data.seq_len, 8)
    metrics = trainer.fit()
    assert metrics["step"] == 2 and 0 < metrics["val_nelbo"] < 20
