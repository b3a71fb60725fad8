#!/usr/bin/env python3
"""The planner against measured runs: ``difflm-plan``'s per-GPU peak memory and step time beside the real
``torch.cuda.max_memory_allocated`` and step time of ``difflm-train``'s Trainer, row by row, on the GPU at hand.

    python scripts/plan_check.py                         # the default rows (125m to 8b on the torch kernels,
                                                         # checkpointing on and off, mdlm and bd3lm, MoE; 1.7B on
                                                         # TE's: FP8, and BF16 with FA4 + quack), one process each
    python scripts/plan_check.py --row "NAME: overrides" --steps 8 --calibration h200.json --json plan_check.json

Each row trains ``--steps`` optimizer steps of the Trainer (embedded corpus, no evaluation or checkpoint) in a process
of its own; the step time is the median of the logged steps after the first two (``tokens/s`` over the global
batch's tokens), the memory the process's peak allocation. Rows that fail (a missing kernel set, out of memory) print
their reason and the others go on. Prints predicted / measured / error for each and, at the end, the worst errors.
Beside them, the peak of the same step traced on the host under fake tensors (:mod:`difflm.plan.trace`; ``-`` for
what it cannot trace: FP8, TE, MoE; ``--no-trace`` skips it). The planner and the trace plan the micro-batch with the
most loss rows (:func:`difflm.plan.memory.peak_loss_fraction`), a few steps of iid draws rarely reach it: a measured
peak below both is expected, above both is a fault of the model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from difflm import strict_json

COMMON = ["logger.progress_bar=false", "logger.num_samples=0", "train.eval_every=0", "train.save_every=0",
          "data.valid_fraction=0", "logger.log_every=1"]
TORCH = "model.backend=torch model.attention_backend=sdpa"  # model.*=auto would pick TE's kernels on a GPU with TE
ROWS = [
    f"125m-bf16: model=125m precision=bf16 data.seq_len=1024 train.global_batch_size=64 train.micro_batch_size=16 "
    f"{TORCH}",
    f"125m-bf16-ac: model=125m precision=bf16 data.seq_len=1024 train.global_batch_size=64 train.micro_batch_size=16 "
    f"parallel.activation_checkpointing=full {TORCH}",
    f"350m-bf16-bd3lm: model=350m precision=bf16 objective=bd3lm data.seq_len=1024 train.global_batch_size=32 "
    f"train.micro_batch_size=8 {TORCH}",
    f"1.7b-bf16: model=1.7b precision=bf16 data.seq_len=4096 train.global_batch_size=8 train.micro_batch_size=4 "
    f"{TORCH}",
    f"1.7b-bf16-ac: model=1.7b precision=bf16 data.seq_len=4096 train.global_batch_size=8 train.micro_batch_size=8 "
    f"parallel.activation_checkpointing=full {TORCH}",
    f"moe-1b-7b-bf16: model=moe-1b-7b precision=bf16 data.seq_len=2048 train.global_batch_size=8 "
    f"train.micro_batch_size=4 {TORCH}",
    f"8b-bf16-ac: model=8b precision=bf16 data.seq_len=2048 train.global_batch_size=2 train.micro_batch_size=1 "
    f"parallel.activation_checkpointing=full {TORCH}",
    "1.7b-fp8-te: model=1.7b precision=fp8 model.backend=te model.attention_backend=te data.seq_len=4096 "
    "train.global_batch_size=8 train.micro_batch_size=4",
    # the benchmark's fastest BF16 kernels (autotuning off here: the tiles change the time, not the saved tensors)
    "1.7b-bf16-te-fused: model=1.7b precision=bf16 model.backend=te model.attention_backend=flash model.fused_mlp=true "
    "model.fused_mlp_autotune=false data.seq_len=4096 train.global_batch_size=16 train.micro_batch_size=4",
]


def measure_one(overrides: list[str], steps: int) -> dict:
    """Train ``steps`` steps in this process; the peak allocation and the median step time (after two)."""
    import torch

    from difflm.config.compose import compose_train_config
    from difflm.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_train_config([*COMMON, *overrides, f"train.max_steps={steps}", f"run.dir={tmp}/run",
                                    f"data.cache_dir={tmp}/cache"])
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(cfg, cfg.run.dir, torch.device("cuda"))
        trainer.fit()
        peak = torch.cuda.max_memory_allocated()
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        tps = [r["tokens_per_s"] for r in lines if r.get("tokens_per_s") and r.get("step", 0) > 2]
        tokens = int(cfg.train.global_batch_size) * int(cfg.data.seq_len)
        return {"peak_bytes": peak, "step_s": tokens / statistics.median(tps) if tps else None}


def predict(overrides: list[str], calibration: str | None) -> dict:
    """The planner's peak bytes and step seconds for the row (one GPU)."""
    from difflm.config.compose import compose_train_config
    from difflm.plan.cli import active_params, layout_of, vocab_size
    from difflm.plan.rates import Rates, default_rates
    from difflm.plan.search import evaluate
    from difflm.plan.shapes import model_params

    cfg = compose_train_config([*COMMON, *overrides])
    cfg.model.vocab_size = vocab_size(cfg)
    cfg.model.head_dim = cfg.model.head_dim or int(cfg.model.hidden_size) // int(cfg.model.num_heads)
    import torch

    if torch.cuda.is_available():  # model.*=auto as the measured run resolves it here (else: difflm.plan.activations)
        from difflm.model.auto_kernels import choose_kernels

        choose_kernels(cfg, torch.device("cuda"))
    rates = Rates.from_json(calibration) if calibration else default_rates("H200")
    cand = evaluate(cfg, model_params(cfg.model, int(cfg.model.vocab_size)), active_params(cfg), layout_of(cfg, 1),
                    rates)
    return {"peak_bytes": cand.memory.total, "step_s": cand.step.seconds, "parts": cand.memory.parts,
            "phase": cand.memory.phase, "kernels": cand.memory.kernels}


def trace(overrides: list[str]) -> dict:
    """The traced peak bytes of the row's step (:func:`difflm.plan.trace.traced_peak`), or its reason."""
    from difflm.config.compose import compose_train_config
    from difflm.errors import DifflmError
    from difflm.plan.cli import vocab_size
    from difflm.plan.trace import traced_peak

    cfg = compose_train_config([*COMMON, *overrides])
    cfg.model.vocab_size = vocab_size(cfg)
    cfg.model.head_dim = cfg.model.head_dim or int(cfg.model.hidden_size) // int(cfg.model.num_heads)
    try:
        found = traced_peak(cfg)
    except DifflmError as e:
        return {"error": str(e)}
    return {"peak_bytes": found.peak_bytes, "parts": found.parts, "phase": found.phase}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", action="append", default=[], help="'NAME: overrides' (default: the built-in rows)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per row")
    ap.add_argument("--no-trace", action="store_true", help="skip the traced peak (host seconds to minutes per row)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: measure these overrides, print JSON
    args = ap.parse_args(argv)
    if args.one is not None:
        print("PLAN_CHECK " + strict_json.dumps(measure_one(args.one.split(), args.steps)))
        return 0
    results = []
    print(f"{'row':<18} {'mem plan':>9} {'traced':>7} {'mem real':>9} {'err':>7}   {'step plan':>10} {'step real':>10} "
          f"{'err':>7}")
    for spec in args.row or ROWS:
        name, _, over = spec.partition(":")
        overrides = over.split()
        row = {"name": name.strip(), "overrides": overrides, "plan": predict(overrides, args.calibration)}
        row["traced"] = {"error": "skipped"} if args.no_trace else trace(overrides)
        traced = row["traced"].get("peak_bytes")
        traced_gib = f"{traced / 2**30:>7.1f}" if traced else f"{'-':>7}"
        try:
            out = subprocess.run([sys.executable, __file__, "--one", " ".join(overrides), "--steps", str(args.steps)],
                                 capture_output=True, text=True, timeout=args.timeout)
            found = [x for x in out.stdout.splitlines() if x.startswith("PLAN_CHECK ")]
            if not found:
                raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1][:200])
            row["real"] = json.loads(found[-1][len("PLAN_CHECK "):])
        except (subprocess.TimeoutExpired, RuntimeError) as e:
            row["error"] = str(e)[:200]
        results.append(row)
        p = row["plan"]
        if "error" in row:
            print(f"{row['name']:<18} {p['peak_bytes'] / 2**30:>9.1f} {traced_gib} failed: {row['error']}")
            continue
        r = row["real"]
        row["mem_err"] = p["peak_bytes"] / r["peak_bytes"] - 1
        row["step_err"] = p["step_s"] / r["step_s"] - 1 if r["step_s"] else None
        step_err = f"{100 * row['step_err']:>+6.1f}%" if row["step_err"] is not None else "      -"
        print(f"{row['name']:<18} {p['peak_bytes'] / 2**30:>9.1f} {traced_gib} {r['peak_bytes'] / 2**30:>9.1f} "
              f"{100 * row['mem_err']:>+6.1f}%   {p['step_s'] * 1e3:>10.1f} {(r['step_s'] or 0) * 1e3:>10.1f} {step_err}",
              flush=True)
    if args.json:
        Path(args.json).write_text(strict_json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
