#!/usr/bin/env python3
"""Rollout tokens/s and GRPO step time of difflm's post-training on one GPU (on the CPU where there is none).

    PYTHONPATH=. python scripts/rl_benchmark.py --models 125m,1.7b --caches none,dual --json rl_bench.json

For each ``model`` preset (weights drawn on the device, Megatron-style: scripts/benchmark.py's ``fast_init``; BF16
autocast; the torch kernel set unless ``--backend te``) and each rollout setting (``--caches`` x ``--thresholds``):

* rollout: ``--prompts`` random prompts of ``--prompt-len`` tokens, each sampled ``--group`` times by
  :func:`difflm.sampling.diffusion_generate` (LLaDA low-confidence remasking, ``--gen-length`` tokens in blocks of
  ``--block-length``, ``--gen-steps`` steps, or Fast-dLLM's threshold with ``--thresholds``; the prefix / dual
  KV cache with ``--caches``); tokens/s = generated tokens / wall time, NFE = model calls;
* RL step: one GRPO step after the rollouts as difflm-rl runs it (:mod:`difflm.posttrain.grpo_step`): the rollout
  policy's and the frozen reference's estimates for ``--num-inner`` keys, then ``--num-inner`` updates (estimate
  with gradient, :func:`difflm.posttrain.grpo.grpo_loss`, backward, clip, fused AdamW), with the ``--estimator``.
  ``step s`` = rollout + update time; ``steps/h`` = 3600 / step s.

Timed after ``--warmup`` untimed repetitions, with CUDA synchronisation around each phase (on the CPU where there is
no CUDA GPU). Prints one row per setting and writes them to ``--json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli, strict_json  # noqa: E402
from difflm.cli import writable_output  # noqa: E402
from difflm.config import CONF_DIR  # noqa: E402
from difflm.config.compose import compose_train_config  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402
from difflm.model import build_model, resolve_model_config  # noqa: E402
from difflm.posttrain.grpo import group_advantages, grpo_loss  # noqa: E402
from difflm.posttrain.loglik import ESTIMATORS, EstimateKey, build_estimator  # noqa: E402
from difflm.posttrain.reference import FrozenCopyReference  # noqa: E402
from difflm.sampling import GenerationOptions, diffusion_generate  # noqa: E402
from difflm.sampling.diffusion import check_sampler_settings  # noqa: E402
from difflm.training.precision import autocast_context  # noqa: E402

# the sampler's keys as this script's flags, in the sampler's refusals
GEN_FLAGS = {"gen.length": "--gen-length", "gen.block_length": "--block-length", "gen.steps": "--gen-steps",
             "gen.cache": "--caches", "gen.threshold": "--thresholds"}


def fast_init():
    spec = importlib.util.spec_from_file_location("difflm_benchmark", Path(__file__).with_name("benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fast_init


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_setting(model, ref, est, args, cache: str, threshold, device, vocab: int, mask_id: int) -> dict:
    b = args.prompts * args.group
    g = torch.Generator(device=device).manual_seed(0)
    prompts = torch.randint(0, vocab - 64, (args.prompts, args.prompt_len), generator=g, device=device)
    prompts = prompts.repeat_interleave(args.group, dim=0)
    opts = GenerationOptions(mask_id=mask_id, length=args.gen_length, steps=args.gen_steps,
                             block_length=args.block_length, temperature=1.0, threshold=threshold, cache=cache,
                             forbid_ids=(mask_id,))

    def logits_fn(x, **kw):
        with autocast_context("bf16", device):
            return model(x, **kw)

    def policy_fn(x):
        with autocast_context("bf16", device):
            return model(x).float()

    def ref_fn(x):
        with autocast_context("bf16", device):
            return ref(x).float()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows = []
    for rep in range(args.warmup + args.repeats):
        stats = {}
        sync(device)
        t0 = time.perf_counter()
        model.eval()
        x = diffusion_generate(logits_fn, prompts, opts, generator=torch.Generator(device=device).manual_seed(rep),
                               stats=stats)
        model.train()
        sync(device)
        t1 = time.perf_counter()
        comp = torch.zeros_like(x, dtype=torch.bool)
        comp[:, args.prompt_len:] = True
        rewards = torch.rand(b, generator=torch.Generator().manual_seed(rep))
        adv = group_advantages(rewards, args.group).to(device)
        keys = [EstimateKey((0, rep, k)) for k in range(args.num_inner)]
        kw = dict(mask_id=mask_id, sample_ids=range(b))
        with torch.no_grad():
            old = [est(policy_fn, x, comp, key=k, **kw) for k in keys]
            refs = [est(ref_fn, x, comp, key=k, **kw) for k in keys]
        for k, key in enumerate(keys):
            for i in range(0, b, args.micro_batch):  # gradient accumulation over micro-batches of rows
                sl = slice(i, i + args.micro_batch)
                ids = list(range(b))[sl]
                logp = est(policy_fn, x[sl], comp[sl], key=key, mask_id=mask_id, sample_ids=ids)
                loss, _ = grpo_loss(logp, old[k][sl], refs[k][sl], adv[sl], comp[sl], beta=0.04)
                (loss * (len(ids) / b)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if rep >= args.warmup:
            rows.append((t1 - t0, t2 - t1, stats.get("nfe", 0)))
    roll = sum(r[0] for r in rows) / len(rows)
    upd = sum(r[1] for r in rows) / len(rows)
    return {"cache": cache, "threshold": threshold, "rollout_s": roll, "update_s": upd, "step_s": roll + upd,
            "rollout_tokens_per_s": b * args.gen_length / roll, "nfe": rows[-1][2], "steps_per_h": 3600 / (roll + upd),
            "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def threshold_list(text: str) -> list:
    """An argparse ``type``: comma-separated ``none`` or thresholds in (0, 1]."""
    out = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        try:
            value = None if word == "none" else float(word)
        except ValueError:
            value = -1.0
        if value is not None and not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{word!r}: give 'none' (the fixed step schedule) or a confidence "
                                             "threshold in (0, 1], comma-separated, e.g. none,0.9")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of none, 0.9, ... (comma-separated)")
    return out


def check_settings(args) -> None:
    """Every rollout setting passes the sampler's checks before a model is built. Raises DifflmError naming this
    script's flags."""
    for cache in args.caches:
        for threshold in args.thresholds:
            try:
                opts = GenerationOptions(mask_id=0, length=args.gen_length, steps=args.gen_steps,
                                         block_length=args.block_length, threshold=threshold, cache=cache)
                check_sampler_settings(opts, "mdlm")
            except DifflmError as err:
                message = str(err)
                for key, flag in GEN_FLAGS.items():
                    message = message.replace(key, flag)
                raise DifflmError(message) from None


@script_cli.script_main
def main(argv=None) -> None:
    """Time every model x rollout setting and print one row each; write ``--json``."""
    p = script_cli.parser(__file__, __doc__)
    count = script_cli.int_at_least(1)
    models = sorted(f.stem for f in (CONF_DIR / "model").glob("*.yaml"))
    p.add_argument("--models", type=script_cli.comma_list(models, "model preset"), default=["125m", "1.7b"],
                   help="comma-separated model presets (default 125m,1.7b)")
    p.add_argument("--backend", default="torch", choices=["torch", "te", "auto"],
                   help="model.backend: torch (default), te or auto")
    p.add_argument("--prompts", type=count, default=8, help="prompts per rollout (default 8)")
    p.add_argument("--group", type=count, default=8, help="samples per prompt, GRPO's group (default 8)")
    p.add_argument("--prompt-len", type=count, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--gen-length", type=count, default=256, help="tokens generated per sample (default 256)")
    p.add_argument("--gen-steps", type=count, default=256, help="sampler steps over --gen-length (default 256)")
    p.add_argument("--block-length", type=count, default=32,
                   help="semi-autoregressive block; divides --gen-length (default 32)")
    p.add_argument("--caches", type=script_cli.comma_list(("none", "prefix", "dual"), "cache"),
                   default=["none", "dual"], help="comma-separated KV caches: none, prefix, dual (default none,dual)")
    p.add_argument("--thresholds", type=threshold_list, default=[None, 0.9],
                   help="comma list; none = the fixed step schedule, a number = Fast-dLLM's confidence threshold "
                        "(default none,0.9)")
    p.add_argument("--estimator", default="coupled", choices=sorted(ESTIMATORS),
                   help="the log-likelihood estimator of the update (default coupled)")
    p.add_argument("--num-inner", type=count, default=2, help="updates per rollout (default 2)")
    p.add_argument("--micro-batch", type=count, default=16, help="rows per backward in the update")
    p.add_argument("--warmup", type=script_cli.int_at_least(0), default=1,
                   help="untimed repetitions first (default 1)")
    p.add_argument("--repeats", type=count, default=2, help="timed repetitions, averaged (default 2)")
    p.add_argument("--json", type=script_cli.caller_path, default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    check_settings(args)
    if args.json:
        writable_output("--json", args.json)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    est = build_estimator({"name": args.estimator})
    results = []
    for name in args.models:
        cfg = compose_train_config([f"model={name}", "precision=bf16", f"model.backend={args.backend}"], device=device)
        vocab = 50304
        resolve_model_config(cfg.model, vocab)
        torch.manual_seed(0)
        model = build_model(cfg.model, causal=False, device=device, seed=None, precision=cfg.precision)
        fast_init()(model, cfg.model.init_std, cfg.model.num_layers, 0)
        ref = FrozenCopyReference(model)
        for cache in args.caches:
            for threshold in args.thresholds:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                row = {"model": name, **run_setting(model, ref, est, args, cache, threshold, device, vocab, 50277)}
                results.append(row)
                print(f"{name:>5} cache={cache:<6} threshold={str(threshold):<5} "
                      f"rollout {row['rollout_tokens_per_s']:>9,.0f}"
                      f" tok/s  nfe {row['nfe']:>4}  rollout {row['rollout_s']:.2f} s  update {row['update_s']:.2f} s"
                      f"  step {row['step_s']:.2f} s  ({row['steps_per_h']:.0f} steps/h)", flush=True)
        del model, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(strict_json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
