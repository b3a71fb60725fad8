"""Remasking policies, top-k/p, classifier-free guidance, padded batches, Fast-dLLM threshold decoding and the
block-level KV cache (exact where it should be), and BD3-LM block sampling with its exact cache."""
from __future__ import annotations

import pytest
import torch

from difflm.errors import DifflmError
from difflm.model.kv_cache import KVCache
from difflm.sampling import (GenerationConfigError, GenerationOptions, autoregressive_generate,
                             block_diffusion_generate, diffusion_generate, filter_top_k_top_p)
from difflm.sampling.diffusion import propose, select_transfer
from tests.dlm_helpers import model_fn, tiny_model

V, MASK = 48, 47
FORBID = [MASK]


def opts(**kw) -> GenerationOptions:
    return GenerationOptions(mask_id=MASK, **kw)


def test_margin_and_entropy_confidence():
    logits = torch.log(torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.3, 0.0]]]) + 1e-12)
    x0, margin = propose(logits, "margin", 0.0, None)
    assert x0.tolist() == [[0, 0, 0]]
    assert torch.allclose(margin, torch.tensor([[0.0, 0.6, 0.1]], dtype=torch.float64), atol=1e-5)
    _, ent = propose(logits, "entropy", 0.0, None)
    h = lambda ps: -sum(p * torch.log(torch.tensor(p)).item() for p in ps if p > 0)  # noqa: E731
    assert torch.allclose(ent, -torch.tensor([[h([.5, .5]), h([.7, .1, .1, .1]), h([.4, .3, .3])]], dtype=torch.float64),
                          atol=1e-4)
    # the most confident by entropy is the peaked position 1; by low_confidence too; margin ranks 1 > 2 > 0
    order = torch.sort(margin, descending=True).indices.tolist()
    assert order == [[1, 2, 0]]


def test_top_k_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isinf(filter_top_k_top_p(logits, top_k=2)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_top_k_top_p(logits, top_p=0.6)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_top_k_top_p(logits, top_p=0.5)).tolist() == [False, True, True, True, True]
    assert torch.equal(filter_top_k_top_p(logits), logits)


def test_threshold_unmasks_all_confident_and_at_least_one():
    conf = torch.tensor([[0.95, 0.2, 0.91, 0.5]], dtype=torch.float64)
    cand = torch.tensor([[True, True, True, True]])
    assert select_transfer(conf, cand, None, 0.9).tolist() == [[True, False, True, False]]
    assert select_transfer(conf * 0.1, cand, None, 0.9).tolist() == [[True, False, False, False]]


def peaked(x, **kw):
    logits = torch.full((*x.shape, V), -5.0)
    logits[..., 3] = 5.0
    return logits


def test_threshold_decodes_a_confident_block_in_one_step():
    stats = {}
    out = diffusion_generate(peaked, torch.tensor([[1, 2]]), opts(length=8, steps=8, block_length=4, threshold=0.9),
                             stats=stats)
    assert stats["nfe"] == 2 and out[0, 2:].tolist() == [3] * 8


def test_threshold_with_entropy_remasking_is_refused():
    """gen.remasking=entropy ranks by minus an entropy (<= 0), which no threshold in (0, 1] is reached by: the
    threshold would decode one token a step however confident the model is (here 8 steps where margin takes 2)."""
    stats = {}
    diffusion_generate(peaked, torch.tensor([[1, 2]]), opts(length=8, steps=8, block_length=4, threshold=0.9,
                                                              remasking="margin"), stats=stats)
    assert stats["nfe"] == 2
    with pytest.raises(GenerationConfigError, match=r"^gen.threshold=0.9 is compared with a confidence in \(0, 1\], "
                                                    r"and gen.remasking=entropy gives minus an entropy"):
        opts(length=8, steps=8, block_length=4, threshold=0.9, remasking="entropy")


def test_classifier_free_guidance_masks_prompt_for_unconditional():
    seen = []

    def fn(x, **kw):
        seen.append(x.clone())
        logits = torch.zeros(*x.shape, V)
        cond = (x[:, :1] != MASK).float()  # conditional rows prefer token 5, unconditional token 6
        logits[..., 5] = cond  # cond: l5 = 1, l6 = 1.2 -> 6; uncond: l5 = 0, l6 = 1.5
        logits[..., 6] = 1.5 - 0.3 * cond
        return logits

    prompt = torch.tensor([[1, 2]])
    plain = diffusion_generate(fn, prompt, opts(length=4, steps=4, block_length=4, cfg_scale=0.0))
    guided = diffusion_generate(fn, prompt, opts(length=4, steps=4, block_length=4, cfg_scale=1.0))
    assert seen[-1].shape[0] == 2 and (seen[-1][1, :2] == MASK).all() and torch.equal(seen[-1][0, :2], prompt[0])
    assert plain[0, 2:].tolist() == [6] * 4
    # guided = un + (s + 1)(cond - un) with s = 1: l5 = 0 + 2 * 1 = 2, l6 = 1.5 + 2 * (-0.3) = 0.9 -> token 5
    assert guided[0, 2:].tolist() == [5] * 4


@pytest.mark.parametrize("remasking", ["low_confidence", "margin", "entropy"])
def test_deterministic_at_temperature_zero(remasking):
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 40, (2, 5))
    o = opts(length=8, steps=4, block_length=4, remasking=remasking, forbid_ids=FORBID)
    a = diffusion_generate(model_fn(model), prompt, o, generator=torch.Generator().manual_seed(0))
    b = diffusion_generate(model_fn(model), prompt, o, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not (a == MASK).any()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_single_prompts(side):
    model = tiny_model(std=0.3)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    width = 5
    rows, masks = [], []
    for p in prompts:
        pad = [0] * (width - len(p))
        rows.append(pad + p if side == "left" else p + pad)
        masks.append([False] * len(pad) + [True] * len(p) if side == "left" else [True] * len(p) + [False] * len(pad))
    batch, pmask = torch.tensor(rows), torch.tensor(masks)
    o = opts(length=8, steps=8, block_length=4, forbid_ids=FORBID)
    out = diffusion_generate(model_fn(model), batch, o, prompt_mask=pmask)
    ar = tiny_model(causal=True, std=0.3)
    o_ar = opts(length=4, forbid_ids=FORBID)
    out_ar = autoregressive_generate(model_fn(ar), batch, o_ar, prompt_mask=pmask)
    for i, p in enumerate(prompts):
        alone = diffusion_generate(model_fn(model), torch.tensor([p]), o)
        assert out[i, width:].tolist() == alone[0, len(p):].tolist()
        alone_ar = autoregressive_generate(model_fn(ar), torch.tensor([p]), o_ar)
        assert out_ar[i, width:].tolist() == alone_ar[0, len(p):].tolist()


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_kv_cache_read_is_exact_when_nothing_changed(mode):
    model = tiny_model(std=0.3)
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        full = model(x)
        cache = KVCache()
        model(x, kv_cache=cache.write())
        a, b = 4, (12 if mode == "prefix" else 8)
        part = model(x[:, a:b], position_ids=torch.arange(a, b), kv_cache=cache.read(a, b))
    assert torch.allclose(part, full[:, a:b], atol=1e-5)


def test_cached_sampler_equals_uncached_with_one_step_per_block_and_batches():
    # with one step per block every model call is the cache-writing full forward: identical tokens
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 40, (3, 4))
    o = opts(length=8, steps=2, block_length=4, forbid_ids=FORBID)
    base = diffusion_generate(model_fn(model), prompt, o)
    for cache in ("prefix", "dual"):
        assert torch.equal(diffusion_generate(model_fn(model), prompt, o.replace(cache=cache)), base)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_sampler_batch_rows_are_independent(cache):
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 40, (3, 4))
    o = opts(length=8, steps=8, block_length=4, forbid_ids=FORBID, cache=cache)
    stats = {}
    batched = diffusion_generate(model_fn(model), prompt, o, stats=stats)
    assert stats["nfe"] == 8
    for i in range(3):
        assert torch.equal(diffusion_generate(model_fn(model), prompt[i:i + 1], o), batched[i:i + 1])


@pytest.mark.parametrize("prompt_len", [3, 4])
def test_bd3lm_cached_sampling_is_exact(prompt_len):
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 40, (2, prompt_len))
    o = opts(length=10, steps=5, block_size=4, forbid_ids=FORBID)  # 5 * 4 // 10 = 2 steps per block
    s0, s1 = {}, {}
    plain = block_diffusion_generate(model_fn(model), prompt, o, stats=s0)
    cached = block_diffusion_generate(model_fn(model), prompt, o.replace(cache="prefix"), stats=s1)
    assert torch.equal(plain, cached) and not (plain[:, prompt_len:] == MASK).any()
    # with the threshold the same holds
    assert torch.equal(block_diffusion_generate(model_fn(model), prompt, o.replace(threshold=0.5)),
                       block_diffusion_generate(model_fn(model), prompt, o.replace(threshold=0.5, cache="dual")))


def test_bd3lm_sampler_respects_block_causality():
    # a block's tokens must not depend on anything after it: the first block is the same for any length
    model = tiny_model(std=0.3)
    prompt = torch.randint(0, 40, (1, 4))
    short = block_diffusion_generate(model_fn(model), prompt, opts(length=4, steps=4, block_size=4, forbid_ids=FORBID))
    long = block_diffusion_generate(model_fn(model), prompt, opts(length=12, steps=12, block_size=4, forbid_ids=FORBID))
    assert torch.equal(long[:, :8], short)


@pytest.mark.parametrize("side", ["left", "right"])
def test_bd3lm_padded_prompts_sample_as_each_prompt_alone(side):
    """A bd3lm model's blocks sit at absolute positions, so a batch of prompts of several lengths (difflm-rl's
    left-padded rollouts of GSM8K questions) cannot be sampled as one padded block batch. generate_ids samples the
    rows of each prompt length together, without their padding: with one generator per row each row gets the tokens
    it gets alone, the padding stays, nfe counts every group's calls, and a mask with holes is refused."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig
    from difflm.generate import generate_ids

    model = tiny_model(std=0.3)
    model.cfg.vocab_size = V
    tok = SimpleNamespace(mask_id=MASK, eos_id=0, tokenizer=list(range(V - 1)))
    gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 8, "steps": 8, "temperature": 1.0})
    objective = OmegaConf.create({"name": "bd3lm", "block_size": 4, "clean_attention": "block_causal"})
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]]
    width = 5
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for r, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[r, cols], mask[r, cols] = torch.tensor(p), True
    seeds = [11, 12, 13]
    stats = {}
    batch = generate_ids(model, tok, ids, gen, False, objective=objective, prompt_mask=mask, stats=stats,
                         generator=[torch.Generator().manual_seed(s) for s in seeds])
    alone_nfe = {}
    for r, p in enumerate(prompts):
        one = {}
        alone = generate_ids(model, tok, torch.tensor([p]), gen, False, objective=objective, stats=one,
                             generator=[torch.Generator().manual_seed(seeds[r])])
        assert torch.equal(batch[r], alone[0]), r
        alone_nfe[len(p)] = one["nfe"]
    assert batch.shape == (3, 8) and not (batch == MASK).any()
    assert stats["nfe"] == alone_nfe[3] + alone_nfe[5] == 16  # the two 3-token prompts are sampled together
    ids[0, -1 if side == "left" else 1] = MASK  # infilling: the prompt comes back in the batch's layout, filled
    infilled = generate_ids(model, tok, ids, gen, False, objective=objective, prompt_mask=mask, infill=True,
                            generator=[torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(infilled[:, :width][~mask], ids[~mask])
    for r in (0, 1):  # (row 2 shares row 0's group, which starts at the block of row 0's masked position)
        alone = generate_ids(model, tok, ids[r][mask[r]][None], gen, False, objective=objective, infill=True,
                             generator=[torch.Generator().manual_seed(seeds[r])])
        assert torch.equal(infilled[r][torch.cat([mask[r], torch.ones(8, dtype=torch.bool)])], alone[0]), r
    assert infilled[0, :width][mask[0]].ne(MASK).all()
    with pytest.raises(DifflmError, match="^objective=bd3lm samples blocks at absolute positions: pad each prompt on "
                                          "one side only"):
        generate_ids(model, tok, ids, gen, False, objective=objective, prompt_mask=torch.tensor([[1, 0, 1, 1, 1]] * 3,
                                                                                                  dtype=torch.bool))


def test_generation_errors_name_keys():
    with pytest.raises(GenerationConfigError, match="gen.cache"):
        opts(length=4, steps=4, block_length=4, cache="full")
    with pytest.raises(GenerationConfigError, match="gen.top_p"):
        opts(length=4, steps=4, block_length=4, top_p=0.0)
    with pytest.raises(GenerationConfigError, match="gen.threshold"):
        opts(length=4, steps=1, block_size=4, threshold=2.0)
    with pytest.raises(GenerationConfigError, match="block_size"):
        block_diffusion_generate(peaked, torch.tensor([[1]]), opts(length=4, steps=4))
    with pytest.raises(GenerationConfigError, match="gen.cfg_scale"):
        block_diffusion_generate(peaked, torch.tensor([[1]]), opts(length=4, steps=4, block_size=4, cfg_scale=1.0))


# ---------------------------------------------------------------- model.shift_logits (Dream) under every path


def test_shift_logits_span_forward_needs_the_state_before_the_span():
    # the issue's case: a span forward of a shifting model cannot compute position 4's logits (state 3 is outside)
    model = tiny_model(std=0.3, shift_logits=True)
    x = torch.arange(1, 11)[None]
    with torch.no_grad():
        cache = KVCache()
        full = model(x, kv_cache=cache.write())
        naive = model(x[:, 4:8], position_ids=torch.arange(4, 8), kv_cache=cache.read(4, 8))
        from_before = model(x[:, 3:8], position_ids=torch.arange(3, 8), kv_cache=cache.read(3, 8))[:, 1:]
    assert (naive[0, 0] - full[0, 4]).abs().max() > 0.1  # the fault: row 0 is state 4, not state 3
    assert torch.allclose(from_before, full[:, 4:8], atol=1e-5)  # the sampler's span starts one earlier


def _padded(prompts, side):
    width = max(map(len, prompts))
    rows, masks = [], []
    for p in prompts:
        pad = [0] * (width - len(p))
        rows.append(pad + p if side == "left" else p + pad)
        masks.append([False] * len(pad) + [True] * len(p) if side == "left" else [True] * len(p) + [False] * len(pad))
    return torch.tensor(rows), torch.tensor(masks), width


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_shift_logits_cached_forward_equals_full_forward(side, cfg_scale, cache):
    """Where nothing changed since the cache was written, the sampler's cached forward returns exactly the
    logits of the full forward, and those equal each row's unpadded logits (a shifting 2-layer model)."""
    from difflm.sampling.diffusion import _Forward

    model = tiny_model(std=0.3, shift_logits=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    batch, pmask, width = _padded(prompts, "right" if side == "none" else side)
    if side == "none":
        batch, pmask, width = batch[:1], None, 5
    o = opts(length=8, steps=8, block_length=4, cfg_scale=cfg_scale, cache=cache, shift_logits=True)
    x = torch.cat([batch, torch.randint(0, 40, (batch.shape[0], 8), generator=torch.Generator().manual_seed(0))], 1)
    x[:, width + 6:] = MASK
    fwd = _Forward(model_fn(model), width, width + 8, o, pmask, x.device)
    for start in (width, width + 4):  # the first block (after the padding) and the second
        full = fwd(x, start, start + 4, first_of_block=True)
        cached = fwd(x, start, start + 4, first_of_block=False)
        assert (cached - full).abs().max() < 1e-5
        for i, p in enumerate(prompts[: batch.shape[0]]):  # the same logits without padding or the cache
            alone = torch.cat([torch.tensor([p]), x[i:i + 1, width:]], dim=1)
            ref = _Forward(model_fn(model), len(p), len(p) + 8, o.replace(cache="none"), None, x.device)
            off = start - width
            # padded and unpadded rows sum in different orders; guidance, (1 + w) cond - w uncond, scales that
            # FP32 rounding (~1e-6 of logits ~3) by up to 1 + 2w
            tol = 1e-5 * (1 + 2 * cfg_scale)
            assert (ref(alone, len(p) + off, len(p) + off + 4, True) - full[i:i + 1]).abs().max() < tol


@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_shift_logits_every_sampler_path_equals_unpadded_uncached(side):
    """A one-layer model's K/V depend on the token and position only, so the prefix and dual caches are exact
    for it: with model.shift_logits every path (padding side, cache, CFG, threshold, remasking rule) must give
    each row the tokens of its unpadded, uncached run."""
    model = tiny_model(std=0.5, shift_logits=True, layers=1)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    batch, pmask, width = _padded(prompts, "right" if side == "none" else side)
    variants = [dict(), dict(cfg_scale=1.5), dict(threshold=0.2), dict(remasking="margin", top_k=8)]
    for v in variants:
        o = opts(length=8, steps=8, block_length=4, forbid_ids=FORBID, shift_logits=True, **v)
        alone = [diffusion_generate(model_fn(model), torch.tensor([p]), o)[0, len(p):].tolist() for p in prompts]
        for cache in ("none", "prefix", "dual"):
            if side == "none":
                got = [diffusion_generate(model_fn(model), torch.tensor([p]), o.replace(cache=cache))[0, len(p):]
                       for p in prompts]
            else:
                got = diffusion_generate(model_fn(model), batch, o.replace(cache=cache), prompt_mask=pmask)[:, width:]
            assert [g.tolist() for g in got] == alone, (v, cache)


def test_shift_logits_refuses_a_prompt_row_of_padding_only():
    with pytest.raises(ValueError, match="shift_logits"):
        diffusion_generate(peaked, torch.tensor([[1, 2], [3, 4]]), opts(length=4, steps=4, block_length=4,
                                                                         shift_logits=True),
                           prompt_mask=torch.tensor([[True, True], [False, False]]))


@pytest.mark.parametrize("prompt_len", [3, 4])
def test_bd3lm_cached_sampling_is_exact_with_shift_logits(prompt_len):
    # prompt_len 4: every block starts at a block boundary, whose prediction needs the state of the block before
    model = tiny_model(std=0.3, shift_logits=True)
    prompt = torch.randint(0, 40, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    o = opts(length=10, steps=5, block_size=4, forbid_ids=FORBID, shift_logits=True)
    for extra in (dict(), dict(threshold=0.3)):
        plain = block_diffusion_generate(model_fn(model), prompt, o.replace(**extra))
        cached = block_diffusion_generate(model_fn(model), prompt, o.replace(cache="prefix", **extra))
        assert torch.equal(plain, cached), extra


def test_generate_ids_builds_one_options_object_for_every_sampler():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.errors import DifflmError
    from difflm.generate import generate_ids, generation_options

    tok = SimpleNamespace(mask_id=MASK, tokenizer=[None] * 40)  # 40 real ids: 40..47 are never emitted
    gen = OmegaConf.create(dict(length=8, steps=4, block_length=4, remasking="margin", temperature=0.0, seed=0,
                                top_k=0, top_p=1.0, cfg_scale=0.0, threshold=None, cache="prefix"))
    model = tiny_model(std=0.3, shift_logits=True)
    prompt = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(2))
    bd3lm = OmegaConf.create(dict(name="bd3lm", block_size=4))
    o = generation_options(model, tok, gen, objective=bd3lm)
    assert o == GenerationOptions(mask_id=MASK, length=8, steps=4, block_length=4, remasking="margin", cache="prefix",
                                  forbid_ids=list(range(40, 48)), shift_logits=True, block_size=4)
    assert torch.equal(generate_ids(model, tok, prompt, gen, False, objective=bd3lm),
                       block_diffusion_generate(model_fn(model), prompt, o)[:, 4:])
    mdlm = generation_options(model, tok, gen, objective=OmegaConf.create(dict(name="mdlm", block_size=4)))
    assert mdlm.block_size is None
    assert torch.equal(generate_ids(model, tok, prompt, gen, False),
                       diffusion_generate(model_fn(model), prompt, mdlm)[:, 4:])
    with pytest.raises(DifflmError, match="gen.cfg_scale"):
        generation_options(model, tok, OmegaConf.merge(gen, {"cfg_scale": 1.0}), objective=bd3lm)
    assert torch.equal(generate_ids(model, tok, prompt, gen, False, objective=bd3lm,  # padding: sampled without it
                                    prompt_mask=torch.tensor([[0, 1, 1, 1]] * 2).bool()),
                       generate_ids(model, tok, prompt[:, 1:], gen, False, objective=bd3lm))
    with pytest.raises(GenerationConfigError, match="gen.remasking"):
        generation_options(model, tok, OmegaConf.merge(gen, {"remasking": "oldest"}))
