"""Layout correctness (and throughput) on the GPUs of one host: the first steps of every parallel layout
against ``parallel=single``, with NCCL. Prints one table and writes ``layout_check.json``.

    python scripts/layout_check.py --gpus 2 --steps 20 --out /tmp/layouts -- model=125m precision=bf16

Each layout is its own ``torchrun`` launch of ``python -m difflm.train`` with the same seed, global batch and
data; the table gives the largest relative loss difference over the first ``--steps`` steps and the tokens/s
per GPU of the last logged step. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), also in the
processes started here, because it can take shared GPUs down.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LAYOUTS = {  # name -> (parallel preset, ranks)
    1: [],
    2: [("ddp", 2), ("fsdp", 2), ("tp2", 2), ("pp2", 2)],
    4: [("ddp", 4), ("fsdp", 4), ("tp2", 4), ("tp2pp2", 4), ("tp4", 4)],
    8: [("ddp", 8), ("fsdp", 8), ("tp2", 8), ("tp4pp2", 8), ("tp8", 8)],
}
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}


def losses(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r.get("loss") is not None}


def launch(name: str, ranks: int, out: Path, steps: int, overrides: list[str], device: str = "cuda") -> Path:
    run_dir = out / name
    common = ["-m", "difflm.train", f"parallel={name}", f"train.max_steps={steps}", "train.eval_every=0",
              "train.save_every=0", "logger.log_every=1", "logger.progress_bar=false", "logger.num_samples=0",
              f"device={device}", f"run.dir={run_dir}", f"data.cache_dir={out / 'cache'}", *overrides]
    cmd = [sys.executable, *common] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *common]
    proc = subprocess.run(cmd, env={**os.environ, **SAFE_ENV}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("layout_check"))
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo, for a dry run)")
    ap.add_argument("--layouts", default=None, help="comma-separated presets (default: all for --gpus)")
    ap.add_argument("overrides", nargs="*", help="difflm-train overrides shared by every run")
    args = ap.parse_args()
    os.environ.update(SAFE_ENV)
    layouts = LAYOUTS[args.gpus] if args.layouts is None else \
        [(name, args.gpus) for name in args.layouts.split(",")]
    ref = losses(launch("single", 1, args.out, args.steps, args.overrides, args.device))
    rows = [("single", 1, 0.0, ref[args.steps]["tokens_per_s_per_gpu"], ref[args.steps].get("mfu"))]
    for name, ranks in layouts:
        try:
            got = losses(launch(name, ranks, args.out, args.steps, args.overrides, args.device))
        except RuntimeError as err:
            print(err, file=sys.stderr)
            rows.append((name, ranks, float("nan"), float("nan"), None))
            continue
        diff = max(abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in range(1, args.steps + 1))
        rows.append((name, ranks, diff, got[args.steps]["tokens_per_s_per_gpu"], got[args.steps].get("mfu")))
    print(f"{'layout':<10} {'ranks':>5} {'max rel loss diff':>18} {'tokens/s/GPU':>13} {'MFU':>7}")
    for name, ranks, diff, tps, m in rows:
        print(f"{name:<10} {ranks:>5} {diff:>18.2e} {tps:>13,.0f} {'-' if m is None else f'{m:.1%}':>7}")
    (args.out / "layout_check.json").write_text(json.dumps(
        [dict(zip(("layout", "ranks", "max_rel_loss_diff", "tokens_per_s_per_gpu", "mfu"), r)) for r in rows]))


if __name__ == "__main__":
    main()
