#!/usr/bin/env python3
"""The planner against measured runs: ``difflm-plan``'s per-GPU peak memory and step time beside the real
``torch.cuda.max_memory_allocated`` and step time of ``difflm-train``'s Trainer, row by row, on the GPU at hand.

    python scripts/plan_check.py                         # the default rows (125m to 8b on the torch kernels,
                                                         # checkpointing on and off, mdlm and bd3lm, MoE; 1.7B on
                                                         # TE's: FP8, and BF16 with FA4 + quack), one process each
    python scripts/plan_check.py --row "NAME: overrides" --steps 12 --calibration h200.json --json plan_check.json
    python scripts/plan_check.py --replan plan_check.json --gpu H100     # a results file planned again (CPU)

Each row trains ``--warmup`` + ``--steps`` optimizer steps of the Trainer (embedded corpus, no evaluation or
checkpoint) in a process of its own; the step time is the median of the ``--steps`` logged steps after the warm-up
(``tokens/s`` over the global batch's tokens: the device's time between the ends of consecutive steps), the memory
the process's peak allocation. The warm-up holds what the first steps add once: cuBLAS / cuDNN heuristics and
autotuning, Triton and quack compilation, TE's first FP8 casts and scaling factors, the allocator's first
``cudaMalloc``s. Each row also records every step's time, their spread (slowest / fastest timed step) and the CUDA
caching allocator's retries (``num_alloc_retries``: an allocation that failed, freed the cache and synchronized the
device; a row near the memory limit pays that in its step time) with the peak reserved memory; a row with retries
or a spread above 10 % is marked ``unsteady``: its step time is not one the planner should match. Rows that fail (a
missing kernel set, out of memory) print their reason and the others go on (the exit status is then 1);
measuring needs a CUDA GPU, ``--replan`` does not. The plan uses the shipped rates of the
GPU at hand (``--gpu`` elsewhere, ``--calibration`` for measured ones). ``--replan FILE`` plans every row of a
results file again on the host and rewrites its ``plan`` entries, keeping what was measured.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli, strict_json  # noqa: E402
from difflm.cli import writable_output  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402

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


UNSTEADY = 0.10  # a spread of the timed steps above this (slowest / fastest - 1) marks the row unsteady


def timed_steps(step_seconds: list[float], warmup: int) -> dict:
    """The step time of a row from every step's seconds (in step order): the median of the steps after the first
    ``warmup``, their ``spread`` (slowest / fastest - 1) and all of them (``steps_s``). ``step_s`` is None when no
    step is left after the warm-up."""
    timed = step_seconds[warmup:]
    return {"step_s": statistics.median(timed) if timed else None, "steps_s": step_seconds,
            "spread": max(timed) / min(timed) - 1 if timed else None}


def steady(real: dict) -> bool | None:
    """Whether a measured row's step time is one the planner should match: no allocator retries, and a spread of
    the timed steps of at most :data:`UNSTEADY`; None for rows measured before these were recorded."""
    if "spread" not in real and "alloc_retries" not in real:
        return None
    return not real.get("alloc_retries") and (real.get("spread") or 0.0) <= UNSTEADY


def measure_one(overrides: list[str], steps: int, warmup: int) -> dict:
    """Train ``warmup + steps`` steps in this process: the peak allocation, the allocator's retries and peak
    reservation, and the step times (:func:`timed_steps`)."""
    import torch

    from difflm.config.compose import compose_train_config
    from difflm.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_train_config([*COMMON, *overrides, f"train.max_steps={warmup + steps}", f"run.dir={tmp}/run",
                                    f"data.cache_dir={tmp}/cache"])
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(cfg, cfg.run.dir, torch.device("cuda"))
        trainer.fit()
        stats = torch.cuda.memory_stats()
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        tokens = int(cfg.train.global_batch_size) * int(cfg.data.seq_len)
        seconds = [tokens / r["tokens_per_s"] for r in sorted(lines, key=lambda r: r.get("step", 0))
                   if r.get("tokens_per_s")]
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved(),
                "alloc_retries": int(stats.get("num_alloc_retries", 0)), "warmup": warmup,
                **timed_steps(seconds, warmup)}


def row_rates(calibration: str | None, gpu: str | None):
    """The rates a row is planned with: ``--calibration``, else the shipped rates of ``--gpu``, else of the CUDA GPU
    at hand, else the H200's."""
    from difflm.plan.rates import Rates, default_rates

    if calibration:
        return Rates.from_json(calibration)
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    return default_rates(gpu)


def predict(overrides: list[str], calibration: str | None, gpu: str | None = None) -> dict:
    """The planner's peak bytes and step seconds for the row (one GPU), with its step split by part (seconds)."""
    from difflm.config.compose import compose_train_config
    from difflm.plan.cli import active_params, layout_of, vocab_size
    from difflm.plan.search import evaluate
    from difflm.plan.shapes import model_params

    cfg = compose_train_config([*COMMON, *overrides])
    cfg.model.vocab_size = vocab_size(cfg)
    cfg.model.head_dim = cfg.model.head_dim or int(cfg.model.hidden_size) // int(cfg.model.num_heads)
    import torch

    if torch.cuda.is_available():  # model.*=auto as the measured run resolves it here (else: difflm.plan.activations)
        from difflm.model.auto_kernels import choose_kernels

        choose_kernels(cfg, torch.device("cuda"))
    rates = row_rates(calibration, gpu)
    cand = evaluate(cfg, model_params(cfg.model, int(cfg.model.vocab_size)), active_params(cfg), layout_of(cfg, 1),
                    rates)
    return {"peak_bytes": cand.memory.total, "step_s": cand.step.seconds, "parts": cand.memory.parts,
            "phase": cand.memory.phase, "kernels": cand.memory.kernels, "gpu": rates.gpu,
            "step_parts": {**cand.step.compute, **cand.step.comm}}


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


def errors(row: dict) -> dict:
    """``row`` (a results entry with ``plan`` and ``real``) with its memory and step errors (planned / measured - 1)
    and ``steady`` (:func:`steady`)."""
    p, r = row["plan"], row["real"]
    row["mem_err"] = p["peak_bytes"] / r["peak_bytes"] - 1
    row["step_err"] = p["step_s"] / r["step_s"] - 1 if r.get("step_s") else None
    row["steady"] = steady(r)
    return row


def replan(path: str, calibration: str | None, gpu: str | None) -> int:
    """Plan every measured row of the results file ``path`` again (on the host), rewrite its ``plan`` and errors,
    keep what was measured; print planned / measured per row."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DifflmError(f"--replan {path}: cannot read it as JSON ({err}): give a results file written by "
                          "--json") from None
    if not isinstance(results, list) or not all(isinstance(r, dict) and "overrides" in r for r in results):
        raise DifflmError(f"--replan {path}: not a results file (a list of rows with 'overrides'): give one "
                          "written by --json")
    for row in results:
        row["plan"] = predict(row["overrides"], calibration, gpu)
        if "real" in row:
            errors(row)
            print(f"{row['name']:<24} step {row['plan']['step_s'] * 1e3:8.1f} planned / "
                  f"{row['real']['step_s'] * 1e3:8.1f} measured ({100 * row['step_err']:+.1f} %)")
    Path(path).write_text(strict_json.dumps(results, indent=2, default=str) + "\n")
    return 0


def row_spec(text: str) -> str:
    """An argparse ``type``: ``NAME: overrides`` (a name, a colon, then difflm-train overrides) as given."""
    name, sep, _ = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'NAME: override override ...', e.g. "
                                         "'125m: model=125m precision=bf16 data.seq_len=1024'")
    return text


@script_cli.script_main
def main(argv=None) -> int:
    """Plan, trace and measure every row (or ``--replan`` a results file); 1 when a row failed, else 0."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("--row", action="append", default=[], type=row_spec,
                    help="'NAME: overrides' (repeatable; default: the built-in rows)")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=10,
                    help="timed steps per row, after the warm-up (default 10)")
    ap.add_argument("--warmup", type=script_cli.int_at_least(0), default=3,
                    help="steps per row before the timed ones (default 3)")
    ap.add_argument("--calibration", type=script_cli.existing_path("file", "a calibration JSON (difflm-plan "
                    "--calibrate FILE writes one)"), default=None,
                    help="plan with these measured rates (difflm-plan --calibrate FILE) instead of shipped ones")
    ap.add_argument("--gpu", default=None, help="plan with this GPU's shipped rates (default: the GPU at hand)")
    ap.add_argument("--json", type=script_cli.caller_path, default=None,
                    help="write every row (plan, trace, measurement) to this JSON file")
    ap.add_argument("--replan", metavar="FILE", type=script_cli.existing_path("file", "a results file written by "
                    "--json"), default=None, help="plan the rows of a results file again (no GPU needed)")
    ap.add_argument("--timeout", type=script_cli.positive_number, default=240, help="seconds per row (default 240)")
    ap.add_argument("--no-trace", action="store_true", help="skip the traced peak (host seconds to minutes per row)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: measure these overrides, print JSON
    args = ap.parse_args(argv)
    if args.one is not None:
        script_cli.require_cuda()
        print("PLAN_CHECK " + strict_json.dumps(measure_one(args.one.split(), args.steps, args.warmup)))
        return 0
    if args.gpu is not None:
        from difflm.plan.rates import default_rates

        default_rates(args.gpu)  # an unknown GPU is refused before any row
    if args.replan:
        return replan(args.replan, args.calibration, args.gpu)
    from difflm.config.compose import compose_train_config

    for spec in args.row:  # every row's overrides compose before the first row is measured
        name, _, over = spec.partition(":")
        try:
            compose_train_config([*COMMON, *over.split()])
        except DifflmError as err:
            raise DifflmError(f"--row {name.strip()}: {err}") from None
    script_cli.require_cuda(instead="--replan FILE plans a results file again without one")
    if args.json:
        writable_output("--json", args.json)
    results = []
    print(f"{'row':<18} {'mem plan':>9} {'traced':>7} {'mem real':>9} {'err':>7}   {'step plan':>10} {'step real':>10} "
          f"{'err':>7}")
    for spec in args.row or ROWS:
        name, _, over = spec.partition(":")
        overrides = over.split()
        row = {"name": name.strip(), "overrides": overrides, "plan": predict(overrides, args.calibration, args.gpu)}
        row["traced"] = {"error": "skipped"} if args.no_trace else trace(overrides)
        traced = row["traced"].get("peak_bytes")
        traced_gib = f"{traced / 2**30:>7.1f}" if traced else f"{'-':>7}"
        try:
            out = script_cli.run([sys.executable, str(Path(__file__).resolve()), "--one", " ".join(overrides),
                                  "--steps", str(args.steps), "--warmup", str(args.warmup)], capture_output=True,
                                 text=True, timeout=args.timeout, env=script_cli.difflm_env())
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
        r = errors(row)["real"]
        step_err = f"{100 * row['step_err']:>+6.1f}%" if row["step_err"] is not None else "      -"
        note = "" if row["steady"] is not False else (f"   unsteady: spread {100 * (r['spread'] or 0):.0f} %, "
                                         f"{r['alloc_retries']} allocator retries")
        print(f"{row['name']:<18} {p['peak_bytes'] / 2**30:>9.1f} {traced_gib} {r['peak_bytes'] / 2**30:>9.1f} "
              f"{100 * row['mem_err']:>+6.1f}%   {p['step_s'] * 1e3:>10.1f} {(r['step_s'] or 0) * 1e3:>10.1f} "
              f"{step_err}{note}", flush=True)
    if args.json:
        Path(args.json).write_text(strict_json.dumps(results, indent=2, default=str) + "\n")
    return 1 if any("error" in row for row in results) else 0


if __name__ == "__main__":
    sys.exit(main())
