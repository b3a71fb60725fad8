"""One GRPO step: group rollouts -> rewards -> advantages -> ``num_inner`` clipped updates (d1's diffu-GRPO loop,
Zhao et al. 2025, Alg. 1: the rollout-time ("old") and reference estimates are computed once per inner key before
the first update, so every inner update compares the current policy with the rollout policy under the same noise).
"""
from __future__ import annotations

import time

import torch

from difflm.posttrain.grpo import group_advantages, grpo_loss
from difflm.posttrain.loglik import EstimateKey
from difflm.posttrain.rollout import group_rollouts


def grpo_step(run, step: int, records: list[dict]) -> dict:
    """Run GRPO step ``step`` on ``records`` (this step's prompts, the same list on every rank) with the runner ``run``
    (:class:`difflm.posttrain.runner.PostTrainer`: model, reference, estimator, reward, optimizer, configs, layout).
    A data-parallel rank rolls out and trains on its share of whole prompt groups (:mod:`difflm.posttrain.layout`);
    its loss is weighted by its share of the step's normaliser, so the summed gradients are one process's.
    Returns the step's metrics over every rank (module docstring; names in docs/post_training.md)."""
    a, cfg, lay = run.cfg.algorithm, run.cfg, run.layout
    g = a.group_size
    start = time.perf_counter()
    prompts = [run.prompt_ids(r) for r in records]
    share = lay.share(len(records))
    mine = records[share]
    with run.whole_models():  # rows may need different numbers of sampler calls on different ranks
        rolls = group_rollouts(run.model, run.tok, prompts[share], g, cfg.gen, seed=cfg.train.seed, step=step,
                               precision=run.precision, objective=run.init_cfg.objective, device=run.device,
                               first_sample=share.start * g, width=max(len(p) for p in prompts))
    texts = [run.prompt_text(r) for r in mine for _ in range(g)]
    answers = [run.answer(r) for r in mine for _ in range(g)]
    rewards = torch.tensor(run.reward(texts, rolls.texts, answers), dtype=torch.float32)
    failures = run.reward.take_failures()
    for f in failures[:3]:  # ``step`` counts from 0 (the seeds), the log's steps from 1
        run.report(f"difflm: step {step + 1}: {f}", every_rank=True)
    adv = group_advantages(rewards, g, scale=a.scale_rewards).to(run.device)
    ids = list(range(share.start * g, share.stop * g))  # the step-wide sample ids: the estimates' noise keys
    # this rank's share of the step's loss normaliser: its completion tokens (token) or rows (sequence)
    tokens = rolls.completion.sum().double()
    totals = lay.all_sum(torch.stack([tokens, torch.tensor(float(len(ids)), dtype=torch.float64,
                                                           device=tokens.device)]))
    token_share = float(tokens / totals[0])
    weight = token_share if a.loss_norm == "token" else len(ids) / float(totals[1])
    policy_fn = run.logits_fn(run.model, rolls.valid)  # the init run's layout (bd3lm: [x_t ; x_0])
    kw = dict(mask_id=run.tok.mask_id, sample_ids=ids, prompt=rolls.prompt)
    keys = [EstimateKey((cfg.train.seed, step, k)) for k in range(a.num_inner)]
    with run.full_logits():
        with torch.no_grad():
            old = [run.estimator(policy_fn, rolls.x, rolls.completion, key=key, **kw) for key in keys]
            ref = [None] * len(keys)
            if a.beta > 0 and run.reference is not None:
                ref_fn = run.logits_fn(run.reference, rolls.valid)
                ref = [run.estimator(ref_fn, rolls.x, rolls.completion, key=key, **kw) for key in keys]
        sums, grad_norm = torch.zeros(3, dtype=torch.float64), 0.0  # loss, clip fraction, KL: this rank's shares
        for k, key in enumerate(keys):
            logp = run.estimator(policy_fn, rolls.x, rolls.completion, key=key, **kw)
            loss, m = grpo_loss(logp, old[k], ref[k], adv, rolls.completion, clip_low=a.clip_low,
                                clip_high=a.clip_high, beta=a.beta if ref[k] is not None else 0.0,
                                loss_norm=a.loss_norm)
            grad_norm = run.update(loss * weight)
            sums += torch.tensor([float(loss.detach()) * weight, m["clip_fraction"] * token_share,
                                  m["kl"] * token_share], dtype=torch.float64)
    elapsed = rolls.seconds
    local = torch.cat([sums / len(keys), torch.tensor([float(rolls.completion_lengths.sum()), len(failures),
                                                       rolls.x.shape[0] * cfg.gen.length / max(elapsed, 1e-9),
                                                       rolls.nfe / cfg.gen.length / lay.dp], dtype=torch.float64)])
    loss_mean, clip, kl, comp_tokens, n_failures, tokens_per_s, forwards = lay.all_sum(local.to(run.device)).tolist()
    every = lay.all_gather(rewards.to(run.device)).cpu()
    est_forwards = run.estimator.forwards * a.num_inner * (2 + int(ref[0] is not None))
    return {"loss": loss_mean, "reward_mean": float(every.mean()),
            "reward_std": float(every.std()) if every.numel() > 1 else 0.0,
            "kl": kl, "clip_fraction": clip, "completion_len": comp_tokens / every.numel(),
            "rollout_tokens_per_s": tokens_per_s, "forwards_per_token": forwards,
            "estimator_forwards": est_forwards, "grad_norm": grad_norm, "reward_failures": int(n_failures),
            "step_time_s": time.perf_counter() - start, "rollout_time_s": elapsed}


@torch.no_grad()
def held_out_reward(run, records: list[dict]) -> float:
    """Mean reward of greedy (temperature 0) completions of the held-out ``records``, one each, over every rank
    (each data-parallel rank completes its share)."""
    gen = dict(run.cfg.gen)
    gen["temperature"] = 0.0
    prompts = [run.prompt_ids(r) for r in records]
    share = run.layout.share(len(records))
    total = 0.0
    with run.whole_models():  # shares may differ in size: no collective inside
        if share.stop > share.start:
            rolls = group_rollouts(run.model, run.tok, prompts[share], 1, gen, seed=run.cfg.train.seed, step=0,
                                   precision=run.precision, objective=run.init_cfg.objective, device=run.device,
                                   first_sample=share.start, width=max(len(p) for p in prompts))
            mine = records[share]
            total = sum(run.reward([run.prompt_text(r) for r in mine], rolls.texts, [run.answer(r) for r in mine]))
            run.reward.take_failures()
    return float(run.layout.all_sum(torch.tensor([total], dtype=torch.float64, device=run.device))) / len(records)


__all__ = ["grpo_step", "held_out_reward"]
