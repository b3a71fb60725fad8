#!/usr/bin/env python3
"""``model.*=auto`` on a GPU against the benchmark's fastest BF16 row, in one call on one machine.

Runs, one after the other on the same GPU:

1. ``scripts/benchmark.py`` at ``model=1.7b``, S = 4096, global batch 16, micro-batch 8 (``--micro-batch``), BF16,
   with the fastest row's switches spelled out (``model.backend=te model.attention_backend=flash model.fused_mlp=true
   model.fused_mlp_autotune=true``);
2. ``difflm-train experiment=megadlm_1.7b`` with no kernel switch (only the corpus, the length and the global batch
   of the benchmark row: gradient accumulation does not change tokens/s), whose first line says what ``auto`` chose;

3. with ``--auto-batch-steps N`` (N > 0), ``difflm-train experiment=megadlm_1.7b train.micro_batch_size=auto`` for N
   steps: the micro-batch the planner and the CUDA probe chose (``train.auto_batch_reason``) and its tokens/s;

then prints both tokens/s (the trainer's: the median of its logged steps after ``--skip``), their ratio, and the
trainer's choice line. The target: the ratio within 2 % of 1.

    PYTHONPATH=$PWD python scripts/auto_speed_check.py --steps 24 --out $OUT

Needs a CUDA GPU. Exit status 1 when either run fails, else 0; a usage error is one line
``auto_speed_check.py: error: ...``, exit 2. The runs start in the current folder (``--out`` is relative to it) and
end with the script (SIGTERM, SIGINT or its death stops them).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
from difflm import script_cli  # noqa: E402

CORPUS = "${difflm_asset:corpora/tinyshakespeare/input.txt}"
SHAPE = ["model=1.7b", "data.seq_len=4096", "train.global_batch_size=16", "precision=bf16"]
FASTEST = "model.backend=te model.attention_backend=flash model.fused_mlp=true model.fused_mlp_autotune=true"


def train_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    """``difflm-train experiment=megadlm_1.7b`` on the embedded corpus at the benchmark row's length and global batch
    for ``steps`` steps, logging every step, no eval, checkpoint or sample; ``extra`` overrides are appended."""
    return [sys.executable, "-m", "difflm.train", "experiment=megadlm_1.7b", f"data.path={CORPUS}",
            f"train.max_steps={steps}", "train.global_batch_size=16", "train.eval_every=0", "train.save_every=0",
            "train.sample_at_end=false", "logger.log_every=1", "logger.progress_bar=false", "parallel=single",
            f"run.dir={run_dir}", *extra]


def median_tokens_per_s(run_dir: Path, skip: int) -> tuple[float, int]:
    """The median ``tokens_per_s`` of ``run_dir/metrics.jsonl`` over the steps after ``skip``, and how many."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = [s["tokens_per_s"] for s in steps if s.get("tokens_per_s") and s.get("step", 0) > skip]
    return statistics.median(tps), len(tps)


def auto_batch(run_dir: Path, steps: int) -> int:
    """Run ``train.micro_batch_size=auto`` for ``steps`` steps; print the choice and its tokens/s. Returns the exit
    status of difflm-train."""
    proc = script_cli.run(train_args(run_dir, steps, "train.micro_batch_size=auto"), text=True, capture_output=True,
                          env=script_cli.difflm_env())
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:], sep="\n")
        print(f"failed: difflm-train train.micro_batch_size=auto exit {proc.returncode}")
        return proc.returncode
    import yaml  # PyYAML comes with omegaconf

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    tps, n = median_tokens_per_s(run_dir, min(2, steps - 1))
    t = cfg["train"]
    print(f"train.micro_batch_size=auto chose {t['micro_batch_size']}: {t.get('auto_batch_reason')}; "
          f"{tps:.0f} tokens/s (median of {n} steps)")
    return 0


@script_cli.script_main
def main(argv=None) -> int:
    """Run the benchmark row and difflm-train (and the auto micro-batch run) and print their tokens/s."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("--steps", type=script_cli.int_at_least(2), default=24,
                    help="training steps of difflm-train (more than --skip; default 24)")
    ap.add_argument("--skip", type=script_cli.int_at_least(0), default=6,
                    help="first logged steps left out of the median (autotuning; default 6)")
    ap.add_argument("--out", type=script_cli.output_dir, default="auto_speed_check",
                    help="folder for the benchmark JSON and the run (default ./auto_speed_check)")
    ap.add_argument("--micro-batch", type=script_cli.int_at_least(1), default=None,
                    help="micro-batch of both runs (default: the experiment's 8; 4 fits an 80 GB GPU)")
    ap.add_argument("--auto-batch-steps", type=script_cli.int_at_least(0), default=0,
                    help="also run train.micro_batch_size=auto for this many steps (0: skip)")
    args = ap.parse_args(argv)
    if args.skip >= args.steps:
        ap.error(f"--skip {args.skip} leaves none of --steps {args.steps} for the median: give --steps > --skip")
    script_cli.require_cuda()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    mb = [f"train.micro_batch_size={args.micro_batch}"] if args.micro_batch else []
    bench = script_cli.run([sys.executable, str(SCRIPTS / "benchmark.py"), *SHAPE,
                            f"train.micro_batch_size={args.micro_batch or 8}", "device=cuda", "--no-reference",
                            "--steps", "6", "--warmup", "2", "--batches", "2", "--json", str(out / "bench.json"),
                            "--variant", f"fastest-bf16: {FASTEST}"], text=True, env=script_cli.difflm_env())
    run_dir = out / "run"
    train = script_cli.run(train_args(run_dir, args.steps, *mb), text=True, capture_output=True,
                           env=script_cli.difflm_env())
    print(train.stdout[-3000:], train.stderr[-3000:], sep="\n")
    if bench.returncode or train.returncode:
        print(f"failed: benchmark exit {bench.returncode}, difflm-train exit {train.returncode}")
        return 1
    rows = [r for r in json.loads((out / "bench.json").read_text())["rows"] if "tokens_per_s" in r]
    row = max(rows, key=lambda r: r["tokens_per_s"])
    trained, n = median_tokens_per_s(run_dir, args.skip)
    choice = next((line for line in train.stdout.splitlines() if "kernels auto" in line), "(no auto line)")
    print(f"benchmark {row['name']}: {row['tokens_per_s']:.0f} tokens/s; difflm-train experiment=megadlm_1.7b: "
          f"{trained:.0f} tokens/s (median of {n} steps) = {trained / row['tokens_per_s']:.3f}x")
    print(choice, flush=True)
    if args.auto_batch_steps > 0 and auto_batch(out / "run_auto_batch", args.auto_batch_steps):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
