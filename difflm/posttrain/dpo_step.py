"""One DPO step on preference pairs with VRPO's shared noise (:mod:`difflm.posttrain.dpo`,
:mod:`difflm.posttrain.vrpo`)."""
from __future__ import annotations

import time

import torch

from difflm.posttrain.dpo import dpo_loss
from difflm.posttrain.loglik import EstimateKey
from difflm.posttrain.rollout import left_pad
from difflm.posttrain.vrpo import preference_scores


def preference_batch(run, records: list[dict]):
    """(chosen [B, S], rejected [B, S], chosen completion, rejected completion, valid, prompt) on the run's device:
    prompts left-padded to one length, responses (ending in EOS) right-padded with EOS to one length (the padding
    is clean context without loss, as SFT's EOS padding)."""
    triples = [run.preference_ids(r) for r in records]
    prompts, mask = left_pad([t[0] for t in triples], run.tok.eos_id)
    width = max(max(len(t[1]), len(t[2])) for t in triples)
    out = []
    for j in (1, 2):
        resp = torch.full((len(triples), width), run.tok.eos_id, dtype=torch.long)
        comp = torch.zeros(len(triples), width, dtype=torch.bool)
        for i, t in enumerate(triples):
            resp[i, :len(t[j])] = torch.tensor(t[j])
            comp[i, :len(t[j])] = True
        out.append((torch.cat([prompts, resp], dim=1), torch.cat([torch.zeros_like(mask), comp], dim=1)))
    valid = torch.cat([mask, torch.ones(len(triples), width, dtype=torch.bool)], dim=1)
    prompt = torch.cat([mask, torch.zeros(len(triples), width, dtype=torch.bool)], dim=1)
    d = run.device
    return out[0][0].to(d), out[1][0].to(d), out[0][1].to(d), out[1][1].to(d), valid.to(d), prompt.to(d)


def _scores(run, records, key, pair_ids, share: slice):
    """VRPO scores of this rank's ``share`` of the pairs, padded to the widths of all of ``records`` (every rank's rows
    are the one-process batch's rows), and the share's completion tokens."""
    chosen, rejected, cc, rc, valid, prompt = preference_batch(run, records)
    chosen, rejected, cc, rc, valid, prompt = (t[share] for t in (chosen, rejected, cc, rc, valid, prompt))
    policy_fn = run.logits_fn(run.model, valid)  # the init run's layout (bd3lm: [x_t ; x_0])
    ref_fn = run.logits_fn(run.reference, valid)
    with run.full_logits():
        scores = preference_scores(run.estimator, policy_fn, ref_fn, chosen, rejected, cc, rc, mask_id=run.tok.mask_id,
                                   key=key, pair_ids=list(pair_ids)[share], prompt=prompt)
    return scores, cc.sum() + rc.sum()


def dpo_step(run, step: int, records: list[dict], pair_ids: list[int]) -> dict:
    """DPO step ``step`` on ``records`` (ids ``pair_ids``, the keys of their noise; the same lists on every rank).
    A data-parallel rank scores its share of the pairs and weights its mean loss by its share of the pairs, so the
    summed gradients are one process's. Returns the step's metrics over every rank."""
    start = time.perf_counter()
    lay = run.layout
    share = lay.share(len(records))
    weight = (share.stop - share.start) / len(records)
    with run.full_logits():
        scores, tokens = _scores(run, records, EstimateKey((run.cfg.train.seed, step)), pair_ids, share)
        loss, m = dpo_loss(scores["policy_chosen"], scores["policy_rejected"], scores["ref_chosen"],
                           scores["ref_rejected"], beta=run.cfg.algorithm.beta)
        grad_norm = run.update(loss * weight)
    local = torch.tensor([float(loss.detach()), m["margin"], m["accuracy"], m["elbo_margin"]], dtype=torch.float64)
    totals = lay.all_sum(torch.cat([local * weight, tokens.double().cpu().view(1)]).to(run.device)).tolist()
    elapsed = time.perf_counter() - start
    return {"loss": totals[0], "margin": totals[1], "accuracy": totals[2], "elbo_margin": totals[3],
            "grad_norm": grad_norm, "step_time_s": elapsed, "tokens_per_s": totals[4] / max(elapsed, 1e-9),
            "estimator_forwards": 2 * run.estimator.forwards}


@torch.no_grad()
def held_out_margin(run, records: list[dict]) -> float:
    """Mean B_theta(chosen) - B_theta(rejected) over the held-out ``records`` under one fixed estimate key (the same
    noise at every evaluation, so the curve compares like with like); each data-parallel rank scores its share."""
    share = run.layout.share(len(records))
    total = 0.0
    with run.whole_models():  # shares may differ in size: no collective inside
        if share.stop > share.start:
            scores, _ = _scores(run, records, EstimateKey((run.cfg.train.seed, 0, 0, 1)), range(len(records)), share)
            total = float((scores["policy_chosen"] - scores["policy_rejected"]).double().sum())
    return float(run.layout.all_sum(torch.tensor([total], dtype=torch.float64, device=run.device))) / len(records)


__all__ = ["dpo_step", "held_out_margin", "preference_batch"]
