"""Learning check of difflm's post-training on CPU: two-digit addition with a character-level masked-diffusion model.

    PYTHONPATH=. python scripts/rl_learning.py                 # full run (a few minutes on 2 CPU cores)
    PYTHONPATH=. python scripts/rl_learning.py --quick         # fewer GRPO / VRPO steps (the slow test runs it)

The 8100 problems "a+b=" (10 <= a, b <= 99) are split once: 500 held out, never trained on; the rest train.
1. SFT: a small difflm Transformer learns "a+b=" -> the digits of a + b (then EOS) with the masked-diffusion SFT loss
   (the negative Monte-Carlo ELBO of the answer, LLaDA eq. 5) until the model half knows the task: checked every
   100 steps from step 800, SFT stops once 30 % of 100 training problems come out exact (it has left the loss
   plateau): room to learn, and enough right samples for the groups to compare. Where the model leaves the plateau
   varies with the seed and the machine's arithmetic (from about step 800 to 1400), so a fixed count would start
   GRPO from anywhere between 0.2 and 0.9. Held-out metric: exact-match accuracy of greedy LLaDA
   decoding (and the per-digit accuracy).
2. GRPO (difflm.posttrain.grpo, DiffuCoder's coupled estimator, rollouts from difflm.sampling.diffusion_generate at
   temperature 1) continues from the SFT model, trained on the per-digit partial-credit reward (:func:`digits`;
   reward shaping, the held-out metric stays exact match), without the KL term (beta = 0: DAPO, Yu et al. 2025,
   sec. 3.5), at a learning rate 10x below SFT's: the held-out exact-match accuracy rises. A control continues the
   SFT (with the answers) for as many updates as GRPO made.
3. DPO with VRPO (difflm.posttrain.dpo / vrpo, MC-ELBO with antithetic t and shared policy/reference noise) on
   synthetic pairs (chosen: the right sum, rejected: a sum off by one digit), also from the SFT model: the held-out
   chosen-minus-rejected ELBO margin rises.
Every seed is fixed, so the printed figures repeat run to run (on one machine and torch build).
"""
from __future__ import annotations

import copy
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli  # noqa: E402
from difflm.cli import writable_output  # noqa: E402
from difflm.config.compose import compose_train_config  # noqa: E402
from difflm.model import build_model, resolve_model_config  # noqa: E402
from difflm.posttrain.dpo import dpo_loss  # noqa: E402
from difflm.posttrain.grpo import group_advantages, grpo_loss  # noqa: E402
from difflm.posttrain.loglik import EstimateKey, MCELBOEstimator, build_estimator  # noqa: E402
from difflm.posttrain.reference import FrozenCopyReference  # noqa: E402
from difflm.posttrain.rollout import completion_mask  # noqa: E402
from difflm.posttrain.vrpo import preference_scores  # noqa: E402
from difflm.sampling import GenerationOptions, diffusion_generate  # noqa: E402

CHARS = "0123456789+="
EOS, MASK, VOCAB = 12, 13, 16
PROMPT, ANSWER = 6, 4  # "ab+cd=" and up to three digits + EOS
HELD_OUT = 500  # held-out problems, never trained on


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def decode(ids) -> str:
    out = []
    for i in ids:
        if i == EOS or i >= len(CHARS):
            break
        out.append(CHARS[i])
    return "".join(out)


def split(held: int, seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All 8100 two-digit pairs (a, b), shuffled by ``seed``: the first ``held`` are held out, the rest train, so no
    held-out problem is ever seen in SFT, GRPO or VRPO."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[:held], pairs[held:]


def batch(pairs, wrong: bool = False, seed: int = 0):
    """x [B, 10] (prompt, answer, EOS padding) and the completion mask; ``wrong``: one answer digit changed."""
    rng = random.Random(seed)
    rows = []
    for a, b in pairs:
        s = str(a + b)
        if wrong:
            i = rng.randrange(len(s))
            s = s[:i] + str((int(s[i]) + rng.randint(1, 9)) % 10) + s[i + 1:]
        ans = encode(s) + [EOS] * (ANSWER - len(s))
        rows.append(encode(f"{a}+{b}=") + ans)
    x = torch.tensor(rows)
    completion = torch.zeros_like(x, dtype=torch.bool)
    completion[:, PROMPT:] = True
    return x, completion


def exact(pred: str, a: int, b: int) -> float:
    """1 for the exact sum, else 0: the held-out metric (exact-match accuracy)."""
    return float(pred == str(a + b))


def digits(pred: str, a: int, b: int) -> float:
    """The share of the sum's characters right in place, 1 for the exact sum (a length mismatch counts as wrong
    characters): per-digit partial credit, GRPO's training reward (reward shaping: a group whose completions are
    all wrong still has a spread of rewards, so fewer groups carry zero advantage than under exact match)."""
    want = str(a + b)
    if pred == want:
        return 1.0
    right = sum(p == w for p, w in zip(pred, want))
    return right / max(len(want), len(pred), 1)


REWARDS = {"exact": exact, "digits": digits}


def build(seed: int):
    cfg = compose_train_config(["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                "model.num_kv_heads=4", "model.ffn_hidden_size=256"], device=torch.device("cpu"))
    resolve_model_config(cfg.model, VOCAB)
    return build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=seed)


OPTS = dict(mask_id=MASK, length=ANSWER, steps=ANSWER, block_length=ANSWER, forbid_ids=(MASK, 14, 15))


@torch.no_grad()
def generate(model, pairs, temperature: float, seed: int, group: int = 1) -> list[str]:
    prompts = batch(pairs)[0][:, :PROMPT].repeat_interleave(group, dim=0)
    model.eval()
    out = diffusion_generate(lambda x, **kw: model(x, **kw).float(), prompts,
                             GenerationOptions(**OPTS, temperature=temperature),
                             generator=torch.Generator().manual_seed(seed))
    model.train()
    return [decode(row[PROMPT:].tolist()) for row in out], out


def held_out(model, pairs) -> tuple[float, float]:
    """(exact-match rate, per-digit accuracy) of greedy answers to ``pairs``; the per-digit figure is the mean of
    :func:`digits`, the training reward."""
    texts, _ = generate(model, pairs, 0.0, 0)
    n = len(pairs)
    return (sum(exact(t, a, b) for t, (a, b) in zip(texts, pairs)) / n,
            sum(digits(t, a, b) for t, (a, b) in zip(texts, pairs)) / n)


def sft(model, train, steps: int, lr: float = 3e-3, bs: int = 64, start: int = 0, opt=None):
    """``steps`` SFT updates (batches ``start`` to ``start + steps`` of one fixed stream; ``opt`` continues an earlier
    call's AdamW). Returns the optimizer."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    est = MCELBOEstimator(num_t=1)
    fn = lambda x: model(x).float()  # noqa: E731
    rng = random.Random(0)
    for _ in range(start):
        rng.sample(train, bs)
    for step in range(start, start + steps):
        pairs = rng.sample(train, bs)
        x, comp = batch(pairs)
        loss = -est(fn, x, comp, mask_id=MASK, key=EstimateKey((1, step)), sample_ids=range(bs)).sum() / bs
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return opt


@dataclass
class GRPOSettings:
    """The GRPO settings of the check (the keys of ``algorithm=grpo`` / ``estimator`` / ``gen`` of difflm-rl).

    ``reward``: the training reward, ``digits`` (partial credit) or ``exact``; the held-out metric is exact match
    either way. ``beta`` 0: no KL term and no reference (DAPO, Yu et al. 2025, sec. 3.5; Dr. GRPO, Liu et al. 2025).
    ``scale_rewards`` False: Dr. GRPO's unnormalised advantages r - mean (Liu et al. 2025, sec. 3.2). ``lr`` is 10x
    below SFT's: AdamW moves each weight by about lr per update whatever the size of the (noisy) policy gradient,
    and 1e-3 left the held-out accuracy flat (docs/post_training.md, "Learning check", has the measurements).
    """

    prompts: int = 16
    group: int = 8
    inner: int = 2
    lr: float = 3e-4
    beta: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    scale_rewards: bool = True
    temperature: float = 1.0
    reward: str = "digits"
    estimator: str = "coupled"


def grpo(model, train, steps: int, s: GRPOSettings = GRPOSettings()) -> None:
    """``steps`` GRPO steps: ``s.prompts`` training problems, ``s.group`` sampled answers each, ``s.inner`` clipped
    updates per rollout batch under fresh estimator noise (difflm.posttrain.grpo_step's loop)."""
    ref = FrozenCopyReference(model) if s.beta > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    est = build_estimator({"name": s.estimator})
    reward = REWARDS[s.reward]
    rng = random.Random(1)
    policy_fn = lambda x: model(x).float()  # noqa: E731
    for step in range(steps):
        pairs = rng.sample(train, s.prompts)
        texts, x = generate(model, pairs, s.temperature, 1000 + step, s.group)
        asked = [p for p in pairs for _ in range(s.group)]
        rewards = torch.tensor([reward(t, a, b) for t, (a, b) in zip(texts, asked)])
        adv = group_advantages(rewards, s.group, scale=s.scale_rewards)
        comp = torch.zeros_like(x, dtype=torch.bool)
        comp[:, PROMPT:] = completion_mask(x[:, PROMPT:], EOS)  # up to and including the first EOS
        keys = [EstimateKey((2, step, k)) for k in range(s.inner)]
        kw = dict(mask_id=MASK, sample_ids=range(x.shape[0]))
        with torch.no_grad():
            old = [est(policy_fn, x, comp, key=k, **kw) for k in keys]
            refs = [est(lambda z: ref(z).float(), x, comp, key=k, **kw) if ref else None for k in keys]
        for k, key in enumerate(keys):
            loss, _ = grpo_loss(est(policy_fn, x, comp, key=key, **kw), old[k], refs[k], adv, comp, beta=s.beta,
                                clip_low=s.clip_low, clip_high=s.clip_high)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


@torch.no_grad()
def margin(model, pairs) -> float:
    est = MCELBOEstimator(num_t=8)
    fn = lambda x: model(x).float()  # noqa: E731
    xc, comp = batch(pairs)
    xr, _ = batch(pairs, wrong=True, seed=99)
    kw = dict(mask_id=MASK, key=EstimateKey((3, 0, 0, 1)), sample_ids=range(len(pairs)))
    return float((est(fn, xc, comp, **kw).sum(1) - est(fn, xr, comp, **kw).sum(1)).mean())


def vrpo(model, train, steps: int, bs: int = 32, lr: float = 1e-3, beta: float = 0.1):
    ref = FrozenCopyReference(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    est = MCELBOEstimator(num_t=4)
    rng = random.Random(2)
    for step in range(steps):
        pairs = rng.sample(train, bs)
        xc, comp = batch(pairs)
        xr, _ = batch(pairs, wrong=True, seed=step)
        s = preference_scores(est, lambda x: model(x).float(), lambda x: ref(x).float(), xc, xr, comp, comp,
                              mask_id=MASK, key=EstimateKey((4, step)), pair_ids=range(bs))
        loss, _ = dpo_loss(s["policy_chosen"], s["policy_rejected"], s["ref_chosen"], s["ref_rejected"], beta=beta)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


SETTINGS = {  # (most SFT steps, GRPO steps, VRPO steps)
    "quick": (2000, 60, 15),
    "default": (2000, 60, 60),
}
SFT_FIRST, SFT_EVERY, SFT_TARGET, SFT_DEV = 800, 100, 0.3, 100  # SFT stops at SFT_TARGET exact on SFT_DEV problems


def sft_until_half_known(model, train, most: int):
    """SFT (:func:`sft`) for ``SFT_FIRST`` steps, then ``SFT_EVERY`` at a time until greedy answers to ``SFT_DEV``
    training problems are ``SFT_TARGET`` exact, or ``most`` steps. Returns (optimizer, steps)."""
    dev = random.Random(1).sample(train, SFT_DEV)
    opt, steps = sft(model, train, SFT_FIRST), SFT_FIRST
    while steps < most and held_out(model, dev)[0] < SFT_TARGET:
        opt = sft(model, train, SFT_EVERY, start=steps, opt=opt)
        steps += SFT_EVERY
    return opt, steps


def run(quick: bool = False, grpo_settings: GRPOSettings = GRPOSettings(), seed: int = 0) -> dict:
    """SFT, then GRPO and (from the same SFT weights) VRPO; the held-out figures of each, seeds fixed (``seed``: the
    model's initialisation and torch's generator)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    held, train = split(HELD_OUT)
    most_sft, grpo_steps, vrpo_steps = SETTINGS["quick" if quick else "default"]
    model = build(seed)
    opt, sft_steps = sft_until_half_known(model, train, most_sft)
    sft_exact, sft_digits = held_out(model, held)
    sft_margin = margin(model, held)
    sft_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    grpo(model, train, grpo_steps, grpo_settings)
    grpo_exact, grpo_digits = held_out(model, held)
    # control: SFT, with the answers, continued for as many updates as GRPO made
    model.load_state_dict(sft_state)
    opt.load_state_dict(opt_state)
    sft(model, train, grpo_steps * grpo_settings.inner, start=sft_steps, opt=opt)
    control_exact, control_digits = held_out(model, held)
    model.load_state_dict(sft_state)
    vrpo(model, train, vrpo_steps)
    vrpo_margin = margin(model, held)
    return {"sft_steps": sft_steps, "grpo_steps": grpo_steps, "vrpo_steps": vrpo_steps, "held_out": len(held),
            "grpo_settings": asdict(grpo_settings),
            "sft_exact": sft_exact, "sft_digits": sft_digits, "grpo_exact": grpo_exact, "grpo_digits": grpo_digits,
            "sft_more_exact": control_exact, "sft_more_digits": control_digits, "sft_margin": sft_margin,
            "vrpo_margin": vrpo_margin, "wall_s": time.perf_counter() - start}


@script_cli.script_main
def main(argv=None) -> None:
    """Run the three post-training stages and print their held-out figures; write ``--json``."""
    parser = script_cli.parser(__file__, __doc__)
    parser.add_argument("--quick", action="store_true", help="fewer GRPO / VRPO steps (the test's settings)")
    parser.add_argument("--json", type=script_cli.caller_path, default=None,
                        help="also write the figures and settings to this JSON file")
    args = parser.parse_args(argv)
    if args.json:
        writable_output("--json", args.json)  # before the minutes of training, not after them
    torch.set_num_threads(1)  # a tiny model gains nothing from threads, and one thread fixes the reduction order
    r = run(args.quick)
    print(f"held-out exact-match accuracy  SFT {r['sft_exact']:.3f}  ->  GRPO {r['grpo_exact']:.3f}   "
          f"(per-digit accuracy {r['sft_digits']:.3f} -> {r['grpo_digits']:.3f}; {r['held_out']} problems)")
    print(f"control: SFT continued for as many updates as GRPO made  {r['sft_exact']:.3f}  ->  "
          f"{r['sft_more_exact']:.3f}   (per-digit {r['sft_more_digits']:.3f})")
    print(f"held-out chosen-minus-rejected ELBO margin  SFT {r['sft_margin']:.3f}  ->  VRPO {r['vrpo_margin']:.3f}")
    print(f"wall {r['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "PYTHONPATH=. python scripts/rl_learning.py" + (" --quick" if args.quick else ""),
                       "device": f"CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
                       "load_average_1min": os.getloadavg()[0], **r}, f, indent=1)


if __name__ == "__main__":
    main()
