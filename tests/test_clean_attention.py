"""``objective.clean_attention=causal``: bd3lm's ``[x_t ; x_0]`` with a causally attending clean half (Megatron-Bridge's
``sbd_block_diff`` mask), the hybrid loss from that one forward against a reference written from the recipe's
equations, the clean half's causality, its sampler mask, and the refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

from dlm_helpers import model_fn, objective_cfg, tiny_model
from difflm.errors import DifflmError
from difflm.model.masks import (BlockDiffusionMask, block_causal_block_mask, block_causal_inference_mask,
                                block_causal_mask, causal_prefix_inference_mask)
from difflm.objectives import build_objective, loss_normaliser, weighted_ce_sum

VOCAB, MASK, L, B, BS = 48, 47, 8, 3, 4
SEED, STEP = 5, 2


def sbd_mask(length: int, bs: int) -> torch.Tensor:
    """[2L, 2L] bool, written from the three sub-masks of the recipe's mask: M_BD (a noisy token sees its own noisy
    block), M_OBC (a noisy token sees the clean blocks strictly before its block), M_FC (a clean token sees the
    clean tokens at or before it); a clean token never sees a noisy one."""
    n = 2 * length
    m = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            if q < length and k < length:
                m[q, k] = q // bs == k // bs
            elif q < length:
                m[q, k] = (k - length) // bs < q // bs
            elif k >= length:
                m[q, k] = k <= q
    return m


@pytest.mark.parametrize("length,bs", [(4, 1), (8, 2), (8, 4), (8, 8)])
def test_clean_causal_mask_is_sbd_block_diff(length, bs):
    """Dense form, BlockDiffusionMask, FlexAttention mask_mod and flex output (CPU eager) against SDPA."""
    want = sbd_mask(length, bs)
    assert torch.equal(block_causal_mask(length, bs, clean_causal=True)[0, 0], want)
    assert torch.equal(BlockDiffusionMask(length, bs, clean_causal=True).dense()[0, 0], want)
    n = 2 * length
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    bm = block_causal_block_mask(length, bs, clean_causal=True)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(bm.mask_mod(zero, zero, q, k), want)
    ids = torch.tensor([[0] * (length // 2) + [1] * (length - length // 2)])
    doc = torch.cat([ids, ids], dim=1)[0]
    with_docs = BlockDiffusionMask(length, bs, ids, clean_causal=True)
    assert torch.equal(with_docs.block_mask().mask_mod(zero, zero, q, k), want & (doc[:, None] == doc[None, :]))
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    qkv = [torch.randn(1, 2, n, 8) for _ in range(3)]
    assert torch.allclose(flex_attention(*qkv, block_mask=bm), F.scaled_dot_product_attention(*qkv, attn_mask=want),
                          atol=1e-5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model(vocab=VOCAB)


def hybrid_cfg(**kw):
    base = dict(name="bd3lm", block_size=BS, attention_anneal_steps=0, block_schedule=None, complementary_masks=False,
                weighting="nelbo", cart_p=0.3, diffusion_loss_weight=0.3, ar_loss_weight=1.0, t_lo=0.0, t_hi=1.0,
                clean_attention="causal")
    return objective_cfg(**{**base, **kw})


def step_loss(model, objective, batch, toks, norm) -> float:
    """The trainer's loss of a micro-batch that is the whole step (plus its aux batch's, if any)."""
    normaliser = loss_normaliser(norm, objective.num_tokens(toks))
    total = 0.0
    with torch.no_grad():
        while batch is not None:
            logits = model(batch.input_ids, batch.logits_selector(), **batch.model_kwargs()).double()
            total += float(weighted_ce_sum(logits, batch, norm, normaliser, fused=False))
            batch = batch.aux
    return total


def draw_t():
    from difflm.objectives.mdlm import sample_t

    nb = L // BS
    return sample_t([i * nb + j for i in range(B) for j in range(nb)], key=(SEED, STEP), global_batch_size=B * nb,
                    mode="iid").view(B, nb)


@pytest.mark.parametrize("norm,pair", [("token", False), ("sequence", False), ("token", True)])
def test_hybrid_causal_clean_half_matches_megatron_bridge(model, norm, pair):
    """L = 0.3 (1 / (B L)) sum_b sum_{masked i} (1/p_b) CE(x_t)  +  1.0 (1 / (B (L - 1))) sum_b sum_{j < L-1}
    -log p(x_0^{j+1} | x_0^{<=j}): the diffusion term from one forward of [x_t ; x_0] under the sbd_block_diff mask,
    the AR term from a causal forward of x_0 alone (the same value the clean half gives). Complementary pairs:
    the mean of the M and ~M diffusion terms (~M weighted 1 / (1 - p)), the AR term once."""
    obj = build_objective(hybrid_cfg(loss_norm=norm, complementary_masks=pair), MASK)
    x0 = torch.randint(0, MASK, (B, L), generator=torch.Generator().manual_seed(0))
    batch = obj.noise(x0, range(B), (SEED, STEP), B)
    assert batch.aux is None and batch.attn_mask.clean_causal  # one forward, as the recipe
    t = draw_t()
    p = (1 - 1e-3) * t + 1e-3
    mask = torch.as_tensor(sbd_mask(L, BS))[None, None]
    pos = torch.arange(L).repeat(2)
    xts = [batch.input_ids[r * B:(r + 1) * B, :L] for r in range(2 if pair else 1)]
    diffusion = 0.0
    with torch.no_grad():
        for r, xt in enumerate(xts):
            lp = -F.log_softmax(model(torch.cat([xt, x0], dim=1), attn_mask=mask, position_ids=pos).double(), dim=-1)
            for b in range(B):
                for i in range(L):
                    if xt[b, i] == MASK:
                        pb = float(p[b, i // BS])
                        w = 1 / pb if r == 0 else 1 / max(1 - pb, 1e-3)
                        diffusion += w * float(lp[b, i, x0[b, i]]) / (B * L)
        diffusion /= len(xts)
        tril = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        lp = -F.log_softmax(model(x0, attn_mask=tril).double(), dim=-1)
    ar = sum(float(lp[b, j, x0[b, j + 1]]) for b in range(B) for j in range(L - 1)) / (B * (L - 1))
    assert step_loss(model, obj, batch, x0, norm) == pytest.approx(0.3 * diffusion + 1.0 * ar, abs=1e-6)
    # the old way (block-causal clean half, AR term from a second causal forward) gives the same AR term
    old = build_objective(hybrid_cfg(loss_norm=norm, clean_attention="block_causal", diffusion_loss_weight=1e-9), MASK)
    old_batch = old.noise(x0, range(B), (SEED, STEP), B)
    assert old_batch.aux is not None and not old_batch.attn_mask.clean_causal
    assert step_loss(model, old, old_batch, x0, norm) == pytest.approx(ar, abs=1e-6)
    ev = obj.eval_noise(x0, range(B), 0, 2, SEED)  # val_nelbo: the diffusion bound under the run's clean half
    assert ev.aux is None and ev.attn_mask.clean_causal and not bool(ev.loss_mask[:, L:].any())


@pytest.mark.parametrize("clean_attention", ["causal", "block_causal"])
def test_clean_logits_do_not_see_later_clean_tokens(model, clean_attention):
    """With the causal clean half the logits at clean position i do not change when clean tokens after i change;
    with the block-causal one those of the tokens before the change in its block do."""
    obj = build_objective(hybrid_cfg(clean_attention=clean_attention), MASK)
    x0 = torch.randint(0, MASK, (1, L), generator=torch.Generator().manual_seed(1))
    batch = obj.noise(x0, [0], (SEED, STEP), 1)
    kw = batch.model_kwargs()
    with torch.no_grad():
        for i in range(L - 1):
            changed = batch.input_ids.clone()
            changed[0, L + i + 1:] = (changed[0, L + i + 1:] + 1) % MASK  # every clean token after i
            a, b = model(batch.input_ids, **kw)[0, L:L + i + 1], model(changed, **kw)[0, L:L + i + 1]
            same = torch.allclose(a, b, atol=1e-6, rtol=0)
            if clean_attention == "causal":
                assert same, i
            else:  # position i sees the rest of its block
                assert same == ((i + 1) % BS == 0), i


def test_sampler_causal_prefix_mask_is_the_training_context(model):
    """The sampler's forward of (prefix, noisy block) under causal_prefix_inference_mask gives the noisy block the
    logits the training forward gives it under the causal clean half; cached and uncached sampling agree."""
    from difflm.sampling import GenerationOptions, block_diffusion_generate

    x0 = torch.randint(0, MASK, (1, L), generator=torch.Generator().manual_seed(2))
    xt = x0.clone()
    xt[0, BS:] = torch.where(torch.arange(L - BS) % 2 == 0, MASK, x0[0, BS:])
    start = BS  # the second block is the noisy one
    with torch.no_grad():
        train = model(torch.cat([xt, x0], dim=1), attn_mask=BlockDiffusionMask(L, BS, clean_causal=True),
                      position_ids=torch.arange(L).repeat(2))[:, start:L]
        sample_in = torch.cat([x0[:, :start], xt[:, start:]], dim=1)
        sampled = model(sample_in, attn_mask=causal_prefix_inference_mask(L, start))[:, start:]
        block_causal = model(sample_in, attn_mask=block_causal_inference_mask(L, BS))[:, start:]
    assert torch.allclose(train, sampled, atol=1e-5)
    assert not torch.allclose(train, block_causal, atol=1e-5)  # BD3-LM's sampling mask is another context
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    outs = [block_diffusion_generate(model_fn(model), prompt, GenerationOptions(
        mask_id=MASK, length=6, steps=6, block_size=BS, forbid_ids=[MASK], cache=cache, causal_prefix=True))
        for cache in ("none", "prefix")]
    assert torch.equal(outs[0], outs[1]) and not (outs[0] == MASK).any()


def test_run_samples_with_its_clean_attention():
    """difflm-generate and training samples read objective.clean_attention from the run's config."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig, ObjectiveConfig
    from difflm.generate import generation_options

    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=16))
    tok = SimpleNamespace(mask_id=15, tokenizer=list(range(15)))
    gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 32, "steps": 32})
    for clean, want in (("causal", True), ("block_causal", False)):
        objective = OmegaConf.merge(OmegaConf.structured(ObjectiveConfig),
                                    {"name": "bd3lm", "block_size": 16, "clean_attention": clean})
        assert generation_options(model, tok, gen, objective=objective).causal_prefix is want


@pytest.mark.parametrize("overrides,message", [
    (["objective=mdlm", "objective.clean_attention=causal"], "which has no clean half"),
    (["objective=bd3lm", "objective.block_size=8", "objective.clean_attention=full"], "not one of: block_causal, causal"),
])
def test_clean_attention_refusals(fast_cfg, overrides, message):
    from difflm.config.validate import check_run

    with pytest.raises(DifflmError, match=message):
        check_run(fast_cfg("objective.random_length_prob=0", *overrides))


@pytest.mark.parametrize("backend", ["te", "flash"])
def test_te_and_flash_refuse_the_causal_clean_half(backend):
    """Their kernels take no-mask / causal attention and packed documents only: one line, naming the backends that can."""
    from difflm.model.attention import prepare_mask

    with pytest.raises(DifflmError, match=rf"model.attention_backend={backend} cannot take the block-diffusion mask"
                                          r".*use model.attention_backend=sdpa or flex"):
        prepare_mask(BlockDiffusionMask(L, BS, clean_causal=True), backend)
