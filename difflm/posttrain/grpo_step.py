"""One GRPO step: group rollouts -> rewards -> advantages -> ``num_inner`` clipped updates (d1's diffu-GRPO loop,
Zhao et al. 2025, Alg. 1: the rollout-time ("old") and reference estimates are computed once per inner key before
the first update, so every inner update compares the current policy with the rollout policy under the same noise).
"""
from __future__ import annotations

import time

import torch

from difflm.posttrain.grpo import group_advantages, grpo_loss
from difflm.posttrain.loglik import EstimateKey
from difflm.posttrain.rollout import group_rollouts, padded_logits_fn


def grpo_step(run, step: int, records: list[dict]) -> dict:
    """Run GRPO step ``step`` on ``records`` (this step's prompts) with the runner ``run``
    (:class:`difflm.posttrain.runner.PostTrainer`: model, reference, estimator, reward, optimizer, configs).
    Returns the step's metrics (module docstring; names in docs/post_training.md)."""
    a, cfg = run.cfg.algorithm, run.cfg
    g = a.group_size
    start = time.perf_counter()
    prompts = [run.prompt_ids(r) for r in records]
    rolls = group_rollouts(run.model, run.tok, prompts, g, cfg.gen, seed=cfg.train.seed, step=step,
                           precision=run.precision, objective=run.init_cfg.objective, device=run.device)
    texts = [run.prompt_text(r) for r in records for _ in range(g)]
    answers = [run.answer(r) for r in records for _ in range(g)]
    rewards = torch.tensor(run.reward(texts, rolls.texts, answers), dtype=torch.float32)
    failures = run.reward.take_failures()
    for f in failures[:3]:
        run.report(f"difflm: step {step}: {f}")
    adv = group_advantages(rewards, g, scale=a.scale_rewards).to(run.device)
    ids = list(range(rolls.x.shape[0]))
    policy_fn = padded_logits_fn(run.model, rolls.valid, run.autocast)
    kw = dict(mask_id=run.tok.mask_id, sample_ids=ids, prompt=rolls.prompt)
    keys = [EstimateKey((cfg.train.seed, step, k)) for k in range(a.num_inner)]
    with torch.no_grad():
        old = [run.estimator(policy_fn, rolls.x, rolls.completion, key=key, **kw) for key in keys]
        ref = [None] * len(keys)
        if a.beta > 0 and run.reference is not None:
            ref_fn = padded_logits_fn(run.reference, rolls.valid, run.autocast)
            ref = [run.estimator(ref_fn, rolls.x, rolls.completion, key=key, **kw) for key in keys]
    losses, clip, kl, grad_norm = [], [], [], 0.0
    for k, key in enumerate(keys):
        logp = run.estimator(policy_fn, rolls.x, rolls.completion, key=key, **kw)
        loss, m = grpo_loss(logp, old[k], ref[k], adv, rolls.completion, clip_low=a.clip_low,
                            clip_high=a.clip_high, beta=a.beta if ref[k] is not None else 0.0, loss_norm=a.loss_norm)
        grad_norm = run.update(loss)
        losses.append(float(loss.detach()))
        clip.append(m["clip_fraction"])
        kl.append(m["kl"])
    generated = rolls.x.shape[0] * cfg.gen.length
    est_forwards = run.estimator.forwards * a.num_inner * (2 + int(ref[0] is not None))
    return {"loss": sum(losses) / len(losses), "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "kl": sum(kl) / len(kl), "clip_fraction": sum(clip) / len(clip),
            "completion_len": float(rolls.completion_lengths.float().mean()),
            "rollout_tokens_per_s": generated / max(rolls.seconds, 1e-9),
            "forwards_per_token": rolls.nfe / cfg.gen.length,
            "estimator_forwards": est_forwards, "grad_norm": grad_norm, "reward_failures": len(failures),
            "step_time_s": time.perf_counter() - start, "rollout_time_s": rolls.seconds}


@torch.no_grad()
def held_out_reward(run, records: list[dict]) -> float:
    """Mean reward of greedy (temperature 0) completions of the held-out ``records``, one each."""
    gen = dict(run.cfg.gen)
    gen["temperature"] = 0.0
    prompts = [run.prompt_ids(r) for r in records]
    rolls = group_rollouts(run.model, run.tok, prompts, 1, gen, seed=run.cfg.train.seed, step=0,
                           precision=run.precision, objective=run.init_cfg.objective, device=run.device)
    rewards = run.reward([run.prompt_text(r) for r in records], rolls.texts, [run.answer(r) for r in records])
    run.reward.take_failures()
    return sum(rewards) / len(rewards)


__all__ = ["grpo_step", "held_out_reward"]
