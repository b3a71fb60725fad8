"""Tests for difflm.sampling with tiny fake models (V = 11, mask id 10)."""

import math

import pytest
import torch

from difflm.errors import DifflmError

from difflm.sampling import (
    GenerationConfigError,
    GenerationOptions,
    autoregressive_generate,
    diffusion_generate,
    gumbel_argmax,
    num_transfer_tokens,
)

V = 11
MASK = 10


def opts(**kw) -> GenerationOptions:
    return GenerationOptions(mask_id=MASK, **kw)


class Recorder:
    """Wraps a logits function and keeps a copy of every input it was called with."""

    def __init__(self, fn):
        self.fn = fn
        self.inputs = []

    def __call__(self, x):
        self.inputs.append(x.clone())
        return self.fn(x)


def positional(x, rising=True):
    """Position j prefers token j % 10 with logit j (rising) or -j (falling): confidence
    rises (falls) with position."""
    b, s = x.shape
    logits = torch.zeros(b, s, V)
    j = torch.arange(s)
    logits[:, j, j % 10] = j.float() if rising else -j.float()
    return logits


def unmask_steps(rec, out, start):
    """For each generated position, the index of the call after which it got unmasked."""
    snaps = rec.inputs[1:] + [out]
    first = []
    for pos in range(start, out.shape[1]):
        first.append(next(i for i, s in enumerate(snaps) if s[0, pos] != MASK))
    return first


def test_num_transfer_tokens_schedule():
    got = num_transfer_tokens(torch.tensor([7, 3, 2]), 3)
    assert got.tolist() == [[3, 2, 2], [1, 1, 1], [1, 1, 0]]
    assert got.dtype == torch.long


def test_low_confidence_hand_computed_order():
    rec = Recorder(positional)
    prompt = torch.tensor([[4, MASK]])  # a mask id inside the prompt must survive
    out = diffusion_generate(rec, prompt, opts(length=6, steps=3, block_length=6))
    assert out.shape == (1, 8) and out.dtype == torch.long
    assert out[0, :2].tolist() == [4, MASK]  # prompt unchanged
    assert out[0, 2:].tolist() == [2, 3, 4, 5, 6, 7]
    assert len(rec.inputs) == 3
    # confidence rises with position: 2 tokens per step, right to left
    assert unmask_steps(rec, out, 2) == [2, 2, 1, 1, 0, 0]


def test_prompt_dependent_batch_deterministic():
    def shift(x):  # position j prefers (x[:, 0] + j) % 10, confidence rising with j
        b, s = x.shape
        logits = torch.zeros(b, s, V)
        j = torch.arange(s)
        for r in range(b):
            logits[r, j, (x[r, 0] + j) % 10] = 1.0 + j.float()
        return logits

    prompt = torch.tensor([[1, 0], [5, 0]])
    a = diffusion_generate(shift, prompt, opts(length=4, steps=4, block_length=2))
    b = diffusion_generate(shift, prompt, opts(length=4, steps=4, block_length=2))
    assert torch.equal(a, b)
    assert a.tolist() == [[1, 0, 3, 4, 5, 6], [5, 0, 7, 8, 9, 0]]


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_tokens_per_step_follow_schedule(remasking):
    rec = Recorder(positional)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    g = torch.Generator().manual_seed(0)
    out = diffusion_generate(rec, prompt, opts(length=8, steps=3, block_length=8, remasking=remasking), generator=g)
    counts = [(s[:, 3:] == MASK).sum(dim=1).tolist() for s in rec.inputs + [out]]
    assert counts == [[8, 8], [5, 5], [2, 2], [0, 0]]  # schedule 3, 3, 2
    assert torch.equal(out[:, :3], prompt)


def test_blocks_are_semi_autoregressive():
    # Confidence rises with position, so without blocks the last positions would go first.
    rec = Recorder(positional)
    prompt = torch.tensor([[7]])
    out = diffusion_generate(rec, prompt, opts(length=9, steps=6, block_length=3))
    blocks = [(1, 4), (4, 7), (7, 10)]
    for snap in rec.inputs + [out]:
        for (s0, e0), (s1, e1) in zip(blocks, blocks[1:]):
            if (snap[0, s1:e1] != MASK).any():
                assert not (snap[0, s0:e0] == MASK).any()
    # 2 steps per block of 3: schedule [2, 1], right to left inside each block
    assert unmask_steps(rec, out, 1) == [1, 0, 0, 3, 2, 2, 5, 4, 4]
    assert out[0, 1:].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_random_remasking_seeded():
    def run(seed):
        rec = Recorder(positional)
        g = torch.Generator().manual_seed(seed)
        out = diffusion_generate(rec, torch.tensor([[0]]), opts(length=12, steps=12, block_length=12,
                                                                remasking="random"), generator=g)
        return out, unmask_steps(rec, out, 1)

    out_a, order_a = run(1)
    out_b, order_b = run(1)
    _, order_c = run(2)
    assert torch.equal(out_a, out_b) and order_a == order_b
    assert order_a != order_c
    assert sorted(order_a) == list(range(12))  # one token per step
    assert (out_a != MASK).all()


def test_temperature_sampling_seeded():
    flat = lambda x: torch.zeros(x.shape[0], x.shape[1], V)  # noqa: E731
    o = opts(length=16, steps=8, block_length=8, temperature=1.0, forbid_ids=[MASK])

    def run(seed):
        return diffusion_generate(flat, torch.tensor([[0, 1]]), o, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != MASK).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_forbid_ids_never_emitted(temperature, remasking):
    def loves_mask(x):  # prefers the mask id, then token 3, then token 5
        logits = torch.zeros(x.shape[0], x.shape[1], V)
        logits[..., MASK] = 10.0
        logits[..., 3] = 8.0
        logits[..., 5] = 6.0
        return logits

    g = torch.Generator().manual_seed(0)
    out = diffusion_generate(loves_mask, torch.tensor([[1, 2]]),
                             opts(length=8, steps=4, block_length=4, remasking=remasking, temperature=temperature,
                                  forbid_ids=[MASK, 3]), generator=g)
    gen = out[:, 2:]
    assert not (gen == MASK).any() and not (gen == 3).any()
    if temperature == 0:
        assert (gen == 5).all()


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(length=10, block_length=4, steps=5), "gen.length"),
        (dict(length=8, block_length=4, steps=1), "gen.steps"),
        (dict(length=8, block_length=4, steps=3), "gen.steps"),
        (dict(length=8, block_length=4, steps=10), "gen.steps"),
        (dict(length=8, block_length=0, steps=4), "gen.block_length"),
        (dict(length=0, block_length=4, steps=4), "gen.length"),
        (dict(length=8, block_length=8, steps=4, remasking="top_k"), "gen.remasking"),
        (dict(length=8, block_length=8, steps=4, temperature=-1.0), "gen.temperature"),
        (dict(length=8, block_length=8, steps=4, temperature=float("inf")), "gen.temperature=inf must be >= 0 and "),
        (dict(length=8, block_length=8, steps=4, cfg_scale=float("inf")), r"gen.cfg_scale=inf must be >= 0 and finite"),
    ],
)
def test_validation_names_key(kwargs, key):
    with pytest.raises(ValueError, match=key) as err:
        diffusion_generate(positional, torch.tensor([[1]]), opts(**kwargs))
    assert isinstance(err.value, GenerationConfigError)


@pytest.mark.parametrize("length, block_length, steps, suggested", [
    (32, 64, 64, "gen.length=32 gen.block_length=32 gen.steps=32"),  # only gen.length changed from the defaults
    (10, 4, 5, "gen.length=10 gen.block_length=10 gen.steps=5"),
    (8, 4, 3, "gen.length=8 gen.block_length=4 gen.steps=2"),
    (8, 4, 1, "gen.length=8 gen.block_length=4 gen.steps=2"),
    (8, 4, 10, "gen.length=8 gen.block_length=4 gen.steps=8"),
])
def test_block_and_step_errors_suggest_a_setting_that_runs(length, block_length, steps, suggested):
    with pytest.raises(GenerationConfigError) as err:
        diffusion_generate(positional, torch.tensor([[1]]), opts(length=length, block_length=block_length, steps=steps))
    assert str(err.value).endswith(f"; e.g. {suggested}")
    fixed = dict(part.split("=") for part in suggested.replace("gen.", "").split())
    out = diffusion_generate(positional, torch.tensor([[1]]), opts(**{k: int(v) for k, v in fixed.items()}))
    assert out.shape == (1, 1 + length)  # the suggestion is accepted and fills every position


def test_bad_logits_shape_and_forbid_ids():
    with pytest.raises(ValueError, match="logits_fn"):
        diffusion_generate(lambda x: torch.zeros(1, 3), torch.tensor([[1]]), opts(length=2, steps=2, block_length=2))
    with pytest.raises(ValueError, match="forbid_ids"):
        diffusion_generate(positional, torch.tensor([[1]]), opts(length=2, steps=2, block_length=2, forbid_ids=[V]))


def test_gumbel_argmax_matches_softmax():
    logits = torch.tensor([math.log(0.7), math.log(0.3)]).expand(20000, 2)
    g = torch.Generator().manual_seed(0)
    assert gumbel_argmax(logits, 0.0).eq(0).all()
    freq1 = gumbel_argmax(logits, 1.0, g).eq(0).float().mean().item()
    assert abs(freq1 - 0.7) < 0.02
    freq_half = gumbel_argmax(logits, 0.5, g).eq(0).float().mean().item()  # softmax(l / 0.5)
    assert abs(freq_half - 0.49 / 0.58) < 0.02


# ---------------------------------------------------------------- autoregressive


def next_token_model(x):
    """Causal fake: at every position prefers (token + 1) % 10, second choice (token + 2) % 10."""
    b, s = x.shape
    logits = torch.zeros(b, s, V)
    logits.scatter_(2, ((x + 1) % 10).unsqueeze(-1), 5.0)
    logits.scatter_(2, ((x + 2) % 10).unsqueeze(-1), 3.0)
    return logits


def test_autoregressive_greedy_growing_prefix():
    rec = Recorder(next_token_model)
    prompt = torch.tensor([[3, 7], [0, 8]])
    out = autoregressive_generate(rec, prompt, opts(length=4))
    assert out.tolist() == [[3, 7, 8, 9, 0, 1], [0, 8, 9, 0, 1, 2]]
    assert [s.shape[1] for s in rec.inputs] == [2, 3, 4, 5]
    for t, s in enumerate(rec.inputs):
        assert torch.equal(s, out[:, : 2 + t])  # each call sees the prefix generated so far


def test_autoregressive_forbid_and_seed():
    prompt = torch.tensor([[3]])
    out = autoregressive_generate(next_token_model, prompt, opts(length=5, forbid_ids=[4, 6, 8, 0]))
    # greedy with 4, 6, 8, 0 forbidden: each step falls back to the second choice, 1 -> 2 is free
    assert out.tolist() == [[3, 5, 7, 9, 1, 2]]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return autoregressive_generate(lambda x: torch.zeros(x.shape[0], x.shape[1], V), prompt,
                                       opts(length=20, temperature=1.0, forbid_ids=[MASK]), generator=g)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not (a == MASK).any()


def test_autoregressive_huge_temperature_samples_near_uniformly():
    """A finite temperature above float32's largest number scales the logits in float64: a near-uniform draw over the
    allowed ids, never a forbidden one (in float32 such a temperature is inf, which scales every logit to nan)."""
    prompt = torch.tensor([[3]])
    out = autoregressive_generate(next_token_model, prompt, opts(length=200, temperature=1e39, forbid_ids=[4, MASK]),
                                  generator=torch.Generator().manual_seed(0))
    drawn = out[0, 1:]
    assert not ((drawn == 4) | (drawn == MASK)).any()
    assert len(set(drawn.tolist())) >= 7  # near-uniform over the 9 allowed ids of 11, not the argmax chain


def test_autoregressive_validation():
    with pytest.raises(ValueError, match="gen.length"):
        autoregressive_generate(next_token_model, torch.tensor([[1]]), opts(length=0))
    with pytest.raises(ValueError, match="gen.temperature"):
        autoregressive_generate(next_token_model, torch.tensor([[1]]), opts(length=2, temperature=-0.5))


# ---------------------------------------------------------------- confidences in float64 (LLaDA)

TIE_MASK = 3


def peaked_leads(x, **kw):
    """Vocabulary 4, mask id 3, prompt [0] then two generated positions. Position 1's top logit leads by 20:
    token 1 while position 2 is masked, token 0 once it is decoded; position 2's leads by 30 (token 2). In
    float32 both probabilities round to 1.0; the more confident position 2 must still go first."""
    logits = torch.zeros(x.shape[0], x.shape[1], 4)
    rows = torch.arange(x.shape[0])
    logits[rows, 1, torch.where(x[:, 2] == TIE_MASK, 1, 0)] = 20.0
    logits[:, 2, 2] = 30.0
    return logits


@pytest.mark.parametrize("rule", [
    dict(remasking="low_confidence"), dict(remasking="margin"), dict(remasking="entropy"),
    dict(remasking="low_confidence", threshold=1.0), dict(remasking="margin", threshold=1.0),
    dict(remasking="low_confidence", top_k=2, top_p=0.9), dict(remasking="margin", top_p=0.5),
])
def test_confidences_of_very_peaked_logits_do_not_tie(rule):
    o = GenerationOptions(mask_id=TIE_MASK, length=2, steps=2, block_length=2, **rule)
    out = diffusion_generate(peaked_leads, torch.tensor([[0]]), o)
    assert out.tolist() == [[0, 0, 2]]  # float32 confidences tie and give [0, 1, 2]


@pytest.mark.parametrize("remasking", ["low_confidence", "margin", "entropy"])
def test_block_sampler_confidences_do_not_tie(remasking):
    from difflm.sampling import block_diffusion_generate

    o = GenerationOptions(mask_id=TIE_MASK, length=2, steps=2, block_size=3, remasking=remasking)
    out = block_diffusion_generate(peaked_leads, torch.tensor([[0]]), o)
    assert out.tolist() == [[0, 0, 2]]


@pytest.mark.parametrize("causal", [True, False])
def test_diffusion_only_settings_are_refused_for_ar_runs(causal):
    """Left-to-right decoding reads gen.length / temperature / top_k / top_p / seed only: a diffusion-only key set on
    an ar run (difflm-generate, the harness, end-of-training samples) is refused, naming it, instead of ignored."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig
    from difflm.generate import generation_options

    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=16))
    tok = SimpleNamespace(mask_id=15, tokenizer=list(range(15)))
    plain = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 12, "temperature": 0.7, "top_k": 3},
                            {} if causal else {"block_length": 12, "steps": 12})  # blocks the LLaDA sampler takes
    assert generation_options(model, tok, plain, causal).length == 12
    steps = OmegaConf.merge(plain, {"steps": 12, "remasking": "random"})
    if causal:
        with pytest.raises(GenerationConfigError, match=r"^gen.steps=12, gen.remasking=random: objective=ar runs "
                                                        r"decode left to right .* drop gen.steps gen.remasking$"):
            generation_options(model, tok, steps, causal)
        for key in ("steps", "block_length"):  # 64, the former default, typed: as unread as any other value
            with pytest.raises(GenerationConfigError, match=rf"^gen.{key}=64: objective=ar runs decode left to right"):
                generation_options(model, tok, OmegaConf.merge(plain, {key: 64}), causal)
    else:
        assert generation_options(model, tok, steps, causal).remasking == "random"


def test_bd3lm_refuses_settings_it_would_ignore():
    """A bd3lm run samples in its model's blocks (objective.block_size) and takes at least one token a step: a
    gen.block_length of another size and more steps than tokens are refused, naming the key (a fault report: both
    ran, the block length silently ignored); the default block length and the model's own are accepted."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig
    from difflm.generate import generation_options

    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=16))
    tok = SimpleNamespace(mask_id=15, tokenizer=list(range(15)))
    objective = SimpleNamespace(name="bd3lm", block_size=16)
    gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 32, "steps": 32})
    assert generation_options(model, tok, gen, objective=objective).block_size == 16
    assert generation_options(model, tok, OmegaConf.merge(gen, {"block_length": 16}), objective=objective).steps == 32
    with pytest.raises(GenerationConfigError, match=r"^gen.block_length=7 is not read by objective=bd3lm runs, which "
                                                    r"sample in the model's blocks of 16 tokens \(its objective.block_size\): drop "
                                                    r"gen.block_length$"):
        generation_options(model, tok, OmegaConf.merge(gen, {"block_length": 7}), objective=objective)
    with pytest.raises(GenerationConfigError, match=r"^gen.steps=100 must be <= gen.length=32 \(at least one token per "
                                                    r"step\): set gen.steps=32$"):
        generation_options(model, tok, OmegaConf.merge(gen, {"steps": 100}), objective=objective)
    with pytest.raises(GenerationConfigError, match=r"^gen.cfg_scale=1.5: classifier-free guidance is not implemented for objective=bd3lm"):
        generation_options(model, tok, OmegaConf.merge(gen, {"cfg_scale": 1.5}), objective=objective)


def test_generate_starts_from_the_run_s_own_gen_settings():
    """difflm-generate samples with the run's gen.* (as its HF export and the lm-eval harness do), the keys typed on
    the command line over them; an ar run's stored diffusion-only keys stay at their defaults (never read)."""
    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig
    from difflm.generate import run_generation_config, typed_keys
    from difflm.sampling.options import DIFFUSION_DEFAULTS

    assert typed_keys(["run.dir=x", "gen.length=32", "+gen.seed=3", "prompt=a=b", "gen=foo", "gen.top_k=2"],
                      "gen") == {"length", "seed", "top_k"}
    run_gen = {"length": 16, "steps": 16, "block_length": 16, "temperature": 0.5, "seed": 7}
    cli = OmegaConf.merge(OmegaConf.structured(GenerateConfig), {"length": 32})  # the CLI's defaults + gen.length=32
    gen = run_generation_config(run_gen, cli, {"length"}, causal=False)
    assert (gen.length, gen.steps, gen.block_length, gen.temperature, gen.seed) == (32, 16, 16, 0.5, 7)
    assert run_generation_config(run_gen, cli, set(), causal=False).length == 16  # nothing typed: the run's
    ar = run_generation_config(run_gen, cli, {"length"}, causal=True)
    assert (ar.length, ar.temperature, ar.seed) == (32, 0.5, 7)
    assert (ar.steps, ar.block_length) == (DIFFUSION_DEFAULTS["steps"], DIFFUSION_DEFAULTS["block_length"])
    typed_steps = OmegaConf.merge(cli, {"steps": 8})
    assert run_generation_config(run_gen, typed_steps, {"length", "steps"}, causal=True).steps == 8  # refused later
    assert run_generation_config(None, cli, {"length"}, causal=False).steps == GenerateConfig().steps


@pytest.mark.parametrize("causal", [True, False], ids=["ar", "mdlm"])
def test_padded_sampler_calls_give_the_unpadded_tokens(causal):
    """Under sequence parallelism every forward needs a length that parallel.tp divides, while a sampler's length is
    the prompt's plus what it has made so far (a fault report: objective=ar under parallel=tp2 crashed in gloo at
    the end-of-training samples, and so did mdlm at an odd prompt + gen.length). generate_ids pads each call
    (pad_to_multiple: the pads a document of their own): the same tokens as unpadded calls, and a padded forward
    gives the real positions' logits of the plain one."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from difflm.config.schema import GenerateConfig, ModelConfig
    from difflm.generate import generate_ids, pad_to_multiple
    from difflm.model import build_model

    cfg = OmegaConf.structured(ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                                           ffn_hidden_size=64, vocab_size=40, head_dim=8))
    model = build_model(cfg, causal=causal, device=torch.device("cpu"), seed=0).eval()
    x = torch.randint(0, 38, (2, 7))
    padded, kw = pad_to_multiple(x, 4, causal, {})
    assert padded.shape == (2, 8) and kw["attn_mask"].doc_ids[:, 7:].eq(1).all()
    with torch.no_grad():
        torch.testing.assert_close(model(padded, **kw)[:, :7], model(x), rtol=1e-5, atol=1e-5)
    tok = SimpleNamespace(mask_id=39, eos_id=0, tokenizer=list(range(38)))
    gen = OmegaConf.merge(OmegaConf.structured(GenerateConfig),
                          {"length": 6, "steps": 6, "block_length": 6, "temperature": 0.8, "seed": 3} if not causal
                          else {"length": 6, "temperature": 0.8, "seed": 3})
    prompt = torch.randint(0, 38, (2, 3))
    plain = generate_ids(model, tok, prompt, gen, causal)
    assert torch.equal(generate_ids(model, tok, prompt, gen, causal, seq_multiple=4), plain)
    with pytest.raises(DifflmError, match=r"^a sampler call of 7 tokens under sequence parallelism needs a length "
                                          r"that parallel.tp=4 divides"):
        pad_to_multiple(x, 4, causal, {"position_ids": torch.arange(7)})


def test_bd3lm_samples_under_sequence_parallelism_are_checked_before_training():
    """The BD3-LM sampler's calls carry their own mask, positions and KV cache, which the padding cannot extend: a
    prompt or block that parallel.tp does not divide is refused when the trainer is built (it failed after training),
    and the padded samplers (ar, mdlm, sft) and tp=1 pass."""
    from difflm.generate import check_padded_sampling

    with pytest.raises(DifflmError, match=r"^objective=bd3lm samples at the end of training .* parallel.tp=2, and "
                                          r"logger.sample_prompt is 1 tokens with objective.block_size=16: "):
        check_padded_sampling("bd3lm", 1, 16, 2)
    with pytest.raises(DifflmError, match="objective.block_size=6"):
        check_padded_sampling("bd3lm", 4, 6, 4)
    check_padded_sampling("bd3lm", 2, 16, 2)
    check_padded_sampling("bd3lm", 1, 16, 1)
    check_padded_sampling("mdlm", 1, 1, 2)
    check_padded_sampling("ar", 3, 1, 4)


# ------------------------------------------------------------------ infilling: mask tokens inside the prompt

def test_infill_fills_prompt_masks_and_keeps_given_tokens():
    """LLaDA sampler, infill: block 0 covers the masked prompt positions (1 and 3) and its first generated block;
    its schedule counts them: 4 masks in 2 steps, the most confident (rightmost, positional logits) first."""
    rec = Recorder(positional)
    prompt = torch.tensor([[4, MASK, 6, MASK]])
    out = diffusion_generate(rec, prompt, opts(length=4, steps=4, block_length=2, infill=True))
    assert out.tolist() == [[4, 1, 6, 3, 4, 5, 6, 7]]  # given tokens 4, 6 kept; position j takes j % 10
    assert unmask_steps(rec, out, 1) == [1, 0, 1, 0, 0, 3, 2]  # steps: {5, 4}, {3, 1}, then 7, then 6
    # without infill the prompt, mask ids included, is kept (the default)
    kept = diffusion_generate(positional, prompt, opts(length=4, steps=4, block_length=2))
    assert kept.tolist() == [[4, MASK, 6, MASK, 4, 5, 6, 7]]


@pytest.mark.parametrize("extra", [dict(), dict(cache="dual"), dict(cache="prefix"), dict(threshold=0.5),
                                   dict(cfg_scale=1.0), dict(remasking="margin", temperature=0.8)])
def test_infill_with_a_model_under_every_llada_option(extra):
    """A real tiny model: the given tokens stay, every masked prompt position and generated position gets a token
    (under the KV caches, Fast-dLLM's threshold, guidance and sampling too)."""
    from tests.dlm_helpers import model_fn, tiny_model

    model = tiny_model(std=0.3)
    prompt = torch.tensor([[5, 47, 7, 47, 9, 10], [11, 12, 47, 47, 13, 14]])
    o = GenerationOptions(mask_id=47, length=4, steps=4, block_length=2, forbid_ids=[47], infill=True, **extra)
    out = diffusion_generate(model_fn(model), prompt, o, generator=torch.Generator().manual_seed(0))
    given = prompt != 47
    assert torch.equal(out[:, :6][given], prompt[given]) and not (out == 47).any()


def test_infill_bd3lm_fills_prompt_blocks_left_to_right():
    """Block sampler, infill (block_size 2): blocks [0, 2) and [2, 4) hold one masked prompt position each and are
    filled first, in order; the block that ends the prompt keeps its given token 8."""
    from difflm.sampling import block_diffusion_generate

    calls = []

    def fn(x, attn_mask=None, position_ids=None, kv_cache=None):
        calls.append(x.clone())
        return positional(x)

    prompt = torch.tensor([[4, MASK, 6, MASK, 8]])
    out = block_diffusion_generate(fn, prompt, opts(length=3, steps=3, block_size=2, infill=True))
    assert out.tolist() == [[4, 1, 6, 3, 8, 5, 6, 7]]
    assert [c.shape[1] for c in calls] == [2, 4, 6, 8, 8]  # one step a block (one mask each), then 2 for the last
    assert calls[1][0, :2].tolist() == [4, 1] and calls[1][0, 3] == MASK  # block 0 done before block 1
    kept = block_diffusion_generate(positional_kw, prompt, opts(length=3, steps=3, block_size=2))
    assert kept[0, :5].tolist() == [4, MASK, 6, MASK, 8]


def positional_kw(x, **kw):
    return positional(x)


def test_infill_is_refused_by_left_to_right_decoding():
    with pytest.raises(GenerationConfigError, match="^infilling .* needs a diffusion sampler: an objective=ar run"):
        autoregressive_generate(positional, torch.tensor([[4, MASK, 6]]), opts(length=2, infill=True))


def test_infill_prompt_placeholders_become_mask_ids():
    """difflm-generate's prompt: each `<|mask|>` (mask_placeholder) and the tokenizer's own mask token text is one
    mask id, the text between encoded as text; the printed text puts the sampled tokens in their place."""
    from difflm.config import ASSETS
    from difflm.data import build_tokenizer
    from difflm.generate import encode_prompt, infilled_text, mask_placeholders

    tok = build_tokenizer(str(ASSETS / "tokenizers" / "gpt-neox-20b"))
    m = tok.mask_id
    places = mask_placeholders(tok, "<|mask|>")
    assert places == ["<|mask|>"] and mask_placeholders(tok, None) == []  # NeoX has no mask token of its own
    text = "The <|mask|> sat on the<|mask|><|mask|>."
    ids = encode_prompt(tok, text, False, places)
    assert ids == tok.encode("The ") + [m] + tok.encode(" sat on the") + [m, m] + tok.encode(".")
    assert encode_prompt(tok, text, False, []) == tok.encode(text)  # null placeholder: plain text
    cat, mat = tok.encode(" cat")[0], tok.encode(" mat")[0]
    assert infilled_text(tok, text, places, [cat, mat, mat]) == "The  cat sat on the mat mat."
    emoji = tok.encode("\U0001F600")  # one character, three byte-level tokens
    assert len(emoji) == 3
    assert infilled_text(tok, "a" + "<|mask|>" * 3 + "b<|mask|>", places, emoji + [cat]) == "a\U0001F600b cat"
    assert infilled_text(tok, "<|mask|>" * 3, places, emoji) == "\U0001F600"
    tok.tokenizer.add_special_tokens({"mask_token": "<|mdm_mask|>"})
    assert mask_placeholders(tok, "<|mask|>") == ["<|mask|>", "<|mdm_mask|>"]
    assert encode_prompt(tok, "a<|mdm_mask|>b", False, mask_placeholders(tok, "<|mask|>")) == \
        tok.encode("a") + [m] + tok.encode("b")


# ------------------------------------------------------------------ ReMDM remasking

def test_remdm_sigma_schedules_hand_computed():
    from difflm.sampling.remdm import remdm_sigma

    a_t, a_s = torch.tensor([0.0, 2 / 6, 4 / 6, 0.5]), torch.tensor([2 / 6, 4 / 6, 1.0, 0.6])
    # sigma_max = min(1, (1 - a_s) / a_t): 0 (nothing decoded), 1, 0, 0.8
    assert torch.allclose(remdm_sigma(a_t.double(), a_s.double(), 0.5, "cap"),
                          torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64))
    assert torch.allclose(remdm_sigma(a_t.double(), a_s.double(), 0.5, "rescale"),
                          torch.tensor([0.0, 0.5, 0.0, 0.4], dtype=torch.float64))


def test_remdm_forced_sigma_remasks_the_expected_count_by_hand():
    """Block of 6, 3 steps (schedule 2, 2, 2), positional logits (confidence rises with position), eta = 0.5 (cap).
    Step 0: nothing decoded, r = 0: unmask 5, 4. Step 1: alpha_t = 2/6, alpha_s = 4/6, sigma_max = 1, sigma = 0.5,
    r = round(0.5 * 2) = 1: remask 4 (the less confident of 4, 5) and unmask k + r = 3: 3, 2, 1. Step 2: alpha_s = 1,
    sigma = 0: unmask the last 2 (4 and 0)."""
    rec = Recorder(positional)
    out = diffusion_generate(rec, torch.tensor([[7]]), opts(length=6, steps=3, block_length=6, remasking="remdm",
                                                             remdm_sigma=0.5))
    masked = [(s[0, 1:] == MASK).nonzero().flatten().tolist() for s in rec.inputs + [out]]
    assert masked == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3], [0, 4], []]
    assert out[0, 1:].tolist() == [1, 2, 3, 4, 5, 6]
    # a forced sigma of 1 remasks every decoded token it may: step 1 remasks both (r = 2), unmasks 4
    rec = Recorder(positional)
    diffusion_generate(rec, torch.tensor([[7]]), opts(length=6, steps=3, block_length=6, remasking="remdm",
                                                       remdm_sigma=1.0))
    assert [(s[0, 1:] == MASK).nonzero().flatten().tolist() for s in rec.inputs] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3],
                                                                                     [4, 5]]


@pytest.mark.parametrize("extra", [dict(), dict(temperature=0.9, top_k=5), dict(cfg_scale=1.0), dict(cache="dual")])
def test_remdm_at_sigma_zero_is_low_confidence_exactly(extra):
    from tests.dlm_helpers import model_fn, tiny_model

    model = tiny_model(std=0.3)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])

    def run(**kw):
        o = GenerationOptions(mask_id=47, length=8, steps=8, block_length=4, forbid_ids=[47], **extra, **kw)
        return diffusion_generate(model_fn(model), prompt, o, generator=torch.Generator().manual_seed(1))

    assert torch.equal(run(remasking="remdm", remdm_sigma=0.0), run(remasking="low_confidence"))
    with_remasking = run(remasking="remdm", remdm_sigma=0.9)
    assert not (with_remasking == 47).any()  # every block still ends decoded


def test_remdm_block_sampler_sigma_zero_equals_low_confidence_and_remasks():
    from difflm.sampling import block_diffusion_generate

    def fn(x, attn_mask=None, position_ids=None, kv_cache=None):
        return positional(x)

    prompt = torch.tensor([[7, 7]])
    base = block_diffusion_generate(fn, prompt, opts(length=6, steps=6, block_size=6, remasking="low_confidence"))
    assert torch.equal(block_diffusion_generate(fn, prompt, opts(length=6, steps=6, block_size=6, remasking="remdm")),
                       base)
    calls = []
    block_diffusion_generate(lambda x, **kw: calls.append(x.clone()) or positional(x), prompt,
                             opts(length=4, steps=2, block_size=6, remasking="remdm", remdm_sigma=1.0))
    # block [0, 6): prompt 7, 7 then positions 2..5, max(1, 2 * 6 // 4) = 3 steps (schedule 2, 1, 1). Step 1:
    # alpha_t = 2/4, alpha_s = 3/4, sigma = sigma_max = 0.5, r = round(0.5 * 2) = 1: remask 4, unmask 1 + 1 (3, 2)
    assert [(c[0] == MASK).nonzero().flatten().tolist() for c in calls] == [[2, 3, 4, 5], [2, 3], [4]]


def test_sampler_refusals_spell_a_value_only_for_the_wrong_keys():
    """gen.* refusals spell key=value (what difflm.config.provenance traces to a preset) only for the keys to change:
    a negative gen.remdm_sigma without gen.remdm_schedule, a bd3lm gen.block_length without the model's
    objective.block_size, and the LLaDA sampler's block count not as a value of gen.block_length."""
    from difflm.config.provenance import _KEY_RE
    from difflm.sampling.diffusion import _validate

    def named(make) -> set:
        with pytest.raises(GenerationConfigError) as err:
            make()
        return set(_KEY_RE.findall(str(err.value).split("; e.g.")[0]))

    assert named(lambda: opts(remasking="remdm", remdm_sigma=-0.1, remdm_schedule="rescale")) == {"gen.remdm_sigma"}
    assert named(lambda: opts(remasking="remdm", remdm_sigma=1.5, remdm_schedule="rescale")) == \
        {"gen.remdm_sigma", "gen.remdm_schedule"}
    assert named(lambda: opts(length=32, steps=8, block_length=8, block_size=16).check_block_diffusion()) == \
        {"gen.block_length"}
    assert named(lambda: opts(length=32, steps=8, block_size=16, cfg_scale=1.0).check_block_diffusion()) == \
        {"gen.cfg_scale"}
    with pytest.raises(GenerationConfigError, match=r"^gen.steps=2 must be >= the number of blocks, 4 \(gen.length=32 "
                                                    r"/ gen.block_length=8\); e.g."):
        _validate(opts(length=32, steps=2, block_length=8))


def test_remdm_settings_are_checked():
    with pytest.raises(GenerationConfigError, match=r"^gen.remdm_sigma=-0.1 must be >= 0 \(0 = no remasking\)$"):
        opts(remasking="remdm", remdm_sigma=-0.1)
    with pytest.raises(GenerationConfigError, match=r"gen.remdm_sigma=1.5 must be in \[0, 1\] under "
                                                    "gen.remdm_schedule=rescale"):
        opts(remasking="remdm", remdm_sigma=1.5, remdm_schedule="rescale")
    with pytest.raises(GenerationConfigError, match="gen.remdm_schedule='loop'"):
        opts(remdm_schedule="loop")
    with pytest.raises(GenerationConfigError, match="set gen.threshold=null"):
        opts(remasking="remdm", remdm_sigma=0.5, threshold=0.9)
    with pytest.raises(GenerationConfigError, match="drop gen.remasking gen.remdm_sigma"):
        opts(remasking="remdm", remdm_sigma=0.5).check_autoregressive()


@pytest.mark.parametrize("remasking", ["low_confidence", "remdm"])
def test_infill_bd3lm_with_a_model_cached_equals_uncached(remasking):
    """Block sampler on a real tiny model, masks in the prompt's first two blocks: given tokens kept, every mask
    filled, and the exact cache of finished blocks gives the uncached tokens (with ReMDM remasking too)."""
    from difflm.sampling import block_diffusion_generate
    from tests.dlm_helpers import model_fn, tiny_model

    model = tiny_model(std=0.3)
    prompt = torch.tensor([[5, 47, 7, 47, 47, 10]])
    outs = []
    for cache in ("none", "prefix"):
        o = GenerationOptions(mask_id=47, length=6, steps=6, block_size=4, forbid_ids=[47], infill=True, cache=cache,
                              remasking=remasking, remdm_sigma=0.5)
        outs.append(block_diffusion_generate(model_fn(model), prompt, o))
    assert torch.equal(outs[0], outs[1])
    given = prompt[0] != 47
    assert torch.equal(outs[0][0, :6][given], prompt[0][given]) and not (outs[0] == 47).any()


# ------------------------------------------------------------------ settings that other settings leave unread
def test_a_typed_setting_the_others_leave_unread_is_refused():
    """gen.remdm_sigma / gen.remdm_schedule without gen.remasking=remdm, and gen.top_k / gen.top_p at
    gen.temperature=0 (greedy keeps the argmax whatever the filter), were ignored without a word: refused in one line
    naming the key and the fix, for keys the caller typed only (a run's stored top_k is read once a temperature is
    typed). An ar run refuses the ReMDM keys as diffusion-only instead."""
    from difflm.sampling.options import check_read_settings

    base = {"remasking": "low_confidence", "remdm_sigma": 0.0, "remdm_schedule": "cap", "temperature": 0.0,
            "top_k": 0, "top_p": 1.0}
    refused = [({"remdm_sigma": 0.5}, "gen.remdm_sigma=0.5 has no effect without gen.remasking=remdm: set "
                                      "gen.remasking=remdm or drop it"),
               ({"remdm_schedule": "rescale"}, "gen.remdm_schedule=rescale has no effect without gen.remasking=remdm: "
                                               "set gen.remasking=remdm or drop it"),
               ({"remdm_sigma": 0.5, "remasking": "margin"},
                "gen.remdm_sigma=0.5 has no effect without gen.remasking=remdm: set gen.remasking=remdm or drop it"),
               ({"top_k": 5}, "gen.top_k=5 has no effect with gen.temperature=0 (greedy): set gen.temperature>0 or "
                              "drop it"),
               ({"top_p": 0.9}, "gen.top_p=0.9 has no effect with gen.temperature=0 (greedy): set gen.temperature>0 "
                                "or drop it")]
    for typed, message in refused:
        with pytest.raises(GenerationConfigError) as err:
            check_read_settings({**base, **typed}, typed)
        assert str(err.value) == message
    with pytest.raises(GenerationConfigError, match=r"^top_k=5 has no effect with temperature=0 \(greedy\): set "
                                                    r"temperature>0 or drop it$"):
        check_read_settings({**base, "top_k": 5}, {"top_k"}, prefix="")
    for typed in ({"remasking": "remdm", "remdm_sigma": 0.5}, {"remasking": "remdm", "remdm_schedule": "rescale"},
                  {"temperature": 0.7, "top_k": 5, "top_p": 0.9}, {"top_k": 0, "top_p": 1.0, "remdm_sigma": 0.0}):
        check_read_settings({**base, **typed}, typed)  # read, or at the value that is off
    check_read_settings({**base, "top_k": 5, "remdm_sigma": 0.5}, {"temperature", "remasking"})  # stored, not typed
    check_read_settings({**base, "remdm_sigma": 0.5}, {"remdm_sigma"}, causal=True)  # the ar check names it
    with pytest.raises(GenerationConfigError, match=r"^gen.top_k=3 has no effect"):
        check_read_settings({**base, "top_k": 3}, {"top_k"}, causal=True)


def test_end_of_training_samples_refuse_unread_settings_and_pass_the_defaults():
    """difflm-train reads gen.* for its samples: the defaults of every objective pass; gen.top_k at
    gen.temperature=0 is refused only when every sample is greedy (samples after the first draw at
    logger.sample_temperature, where the filter applies); ReMDM keys without remasking=remdm are refused."""
    from conftest import FAST, compose_run
    from difflm.config.validate import check_end_samples

    def cfg(*overrides):
        return compose_run([*FAST, "logger.num_samples=2", *overrides])

    for objective in ("mdlm", "bd3lm", "sft", "ar"):
        check_end_samples(cfg(f"objective={objective}"))
    check_end_samples(cfg("gen.top_k=5"))  # samples 1.. at logger.sample_temperature=1.0 read it
    check_end_samples(cfg("gen.remasking=remdm", "gen.remdm_sigma=0.5"))
    for overrides, message in [(["gen.top_k=5", "logger.num_samples=1"], "gen.top_k=5 has no effect with "
                                 "gen.temperature=0 (greedy): set gen.temperature>0 or drop it (this run samples "
                                 "with gen.* after training, logger.num_samples=1: fix gen.* or set "
                                 "logger.num_samples=0)"),
                               (["gen.top_p=0.5", "logger.sample_temperature=0"], "gen.top_p=0.5 has no effect"),
                               (["gen.remdm_sigma=0.5"], "gen.remdm_sigma=0.5 has no effect without "
                                                         "gen.remasking=remdm: set gen.remasking=remdm or drop it")]:
        with pytest.raises(DifflmError) as err:
            check_end_samples(cfg(*overrides))
        assert str(err.value).startswith(message), err.value
    check_end_samples(cfg("gen.remdm_sigma=0.5", "logger.num_samples=0"))  # no samples: the run's record only


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """An mdlm and an ar run directory of a tiny untrained model (config.yaml and a step_0 checkpoint)."""
    from test_posttrain_runtime import make_init_run

    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for objective in ("mdlm", "ar"):
        (root / objective).mkdir()
        runs[objective] = make_init_run(root / objective, f"objective={objective}")
    return runs


def _generate_args(run, **gen):
    from omegaconf import OmegaConf

    from conftest import compose_run

    args = compose_run([f"run.dir={run}", "prompt=ROMEO:", "device=cpu"], config_name="generate")
    return OmegaConf.merge(args, {"gen": gen}), set(gen)


def test_difflm_generate_with_a_short_length_and_refusals(tiny_runs, monkeypatch):
    """The command's own path (in this process): gen.length=16 samples with the defaults on an mdlm run (16 new
    tokens); gen.top_k=5 alone and gen.remdm_sigma=0.5 alone are refused before the model loads."""
    import difflm.generate
    from difflm.generate import generate_text

    text = generate_text(*_generate_args(tiny_runs["mdlm"], length=16, steps=16))
    assert text.startswith("ROMEO:")
    assert generate_text(*_generate_args(tiny_runs["mdlm"], length=16)) == text  # null steps: 16, the same text
    load_run = difflm.generate.load_run

    def no_model(*args, **kw):  # the refusals below come before the model is read
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(difflm.generate, "load_run", no_model)
    for run in tiny_runs.values():
        for gen, message in [({"top_k": 5}, "gen.top_k=5 has no effect with gen.temperature=0 (greedy)"),
                             ({"top_p": 0.5}, "gen.top_p=0.5 has no effect with gen.temperature=0 (greedy)")]:
            with pytest.raises(GenerationConfigError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
                generate_text(*_generate_args(run, **gen))
    with pytest.raises(GenerationConfigError, match=r"^gen.remdm_sigma=0.5 has no effect without gen.remasking=remdm"):
        generate_text(*_generate_args(tiny_runs["mdlm"], remdm_sigma=0.5))
    with pytest.raises(GenerationConfigError, match=r"^gen.remdm_sigma=0.5: objective=ar runs decode left to right"):
        generate_text(*_generate_args(tiny_runs["ar"], remdm_sigma=0.5))
    monkeypatch.setattr(difflm.generate, "load_run", load_run)
    assert generate_text(*_generate_args(tiny_runs["ar"], length=4, top_k=5, temperature=0.5)).startswith("ROMEO:")


@pytest.mark.parametrize("objective", ["mdlm", "ar", "bd3lm"])
def test_end_of_training_sample_0_is_drawn_alone_at_any_temperature(fast_cfg, objective):
    """samples.txt's sample 0 is what difflm-generate prints with the run's gen.*, at gen.temperature > 0 too: it is
    drawn alone (a row's noise depends on the rows drawn with it), the others after it from the same generator,
    each with noise of its own."""
    from difflm.training.trainer import Trainer

    extra = ["objective.block_size=8"] if objective == "bd3lm" else []
    cfg = fast_cfg(f"objective={objective}", *extra, "gen.length=8", "gen.temperature=1.0")
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    samples = trainer.generate_samples("ROMEO:", 3)
    assert trainer.generate_samples("ROMEO:", 1) == samples[:1]
    assert len(set(samples)) == 3, samples
