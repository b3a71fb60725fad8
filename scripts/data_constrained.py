"""The data-constrained recipe in one command: a Hydra multirun over unique-token budgets x epochs for ``objective=ar``
and ``objective=mdlm`` (``experiment=data_constrained``: ``model=125m``, S=1024, global batch 64), then a plot of
the best validation loss against epochs for both, with the crossover marked (Prabhudesai et al. 2025, fig. 1-2;
Ni et al. 2025). ``--data`` points at your corpus (any ``data.path``: a .txt/.jsonl/.parquet file, folder or glob);
without it the embedded tinyshakespeare (340k tokens) is used, with a budget of 250k unique tokens that fits it.

    python scripts/data_constrained.py --scale small                                   # tinyshakespeare, 250k tokens
    python scripts/data_constrained.py --data books/ --scale small                     # ~10 min, 1 H200
    python scripts/data_constrained.py --data books/ --scale full                      # 3 budgets x 8 epochs
    python scripts/data_constrained.py --plot-only --out outputs/data_constrained                 # redraw
    python scripts/data_constrained.py --data corpus.txt --budgets 2048 --epochs 1,3 -- model=tiny device=cpu \\
        data.seq_len=32 train.global_batch_size=4 train.micro_batch_size=4 precision=fp32       # a CPU smoke run

Writes ``<out>/<job>/`` (one run dir per job), ``<out>/results.json`` (objective, budget, epochs, best loss and
its step per job), ``<out>/data_constrained.png`` and prints the table and each budget's crossover: the number of
epochs (interpolated in log2 epochs between the grid points) from which MDLM's best loss is below AR's. A sweep into
an ``--out`` that holds an earlier one first moves the earlier jobs and results into ``<out>/previous/<time>/``.
Needs matplotlib (``pip install '.[plot]'``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli, strict_json  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402

EMBEDDED_CORPUS = "corpora/tinyshakespeare/input.txt"  # difflm/assets: 340,240 GPT-NeoX tokens
EMBEDDED_BUDGETS = [250_000]  # 244 windows of 1024 tokens: below the ~315 training windows the embedded corpus has
SCALES = {  # (unique-token budgets, epochs)
    "small": ([1_000_000], [2, 8, 32]),  # 2 x 42M tokens of 125m training: about 10 minutes on one H200
    "full": ([250_000, 500_000, 1_000_000], [1, 2, 4, 8, 16, 32, 64, 128]),
}


def run_sweep(data: str, out: Path, budgets: list[int], epochs: list[float], overrides: list[str]) -> int:
    """``difflm-train -m experiment=data_constrained ...`` over objective x budgets x epochs; returns its exit code."""
    cmd = [sys.executable, "-m", "difflm.train", "-m", "experiment=data_constrained", f"data.path={data}",
           f"run.dir={out}", f"data.cache_dir={out / 'data_cache'}", "objective=ar,mdlm",
           "data.max_train_tokens=" + ",".join(str(b) for b in budgets),
           "train.epochs=" + ",".join(str(e) for e in epochs), *overrides]
    print("+ " + " ".join(cmd), flush=True)
    return script_cli.run(cmd, env=script_cli.difflm_env()).returncode


def set_aside_earlier_sweep(out: Path) -> Optional[Path]:
    """Move what an earlier sweep left in ``out`` (its job dirs ``0``, ``1``, ..., ``results.json``, the plot,
    ``multirun.yaml``) into ``out/previous/<YYYYmmdd-HHMMSS>/``, so that the table and the plot of a new sweep hold
    its own jobs only (a new grid of fewer jobs leaves the earlier higher-numbered jobs behind otherwise). The token
    cache stays. Returns the folder, or None when there was nothing to move."""
    import os
    import time

    earlier = sorted(p for p in out.glob("*") if (p.is_dir() and p.name.isdigit())
                     or p.name in ("results.json", "data_constrained.png", "multirun.yaml"))
    if not earlier:
        return None
    base = out / "previous" / time.strftime("%Y%m%d-%H%M%S")
    dest, k = base, 1
    while dest.exists():
        dest, k = base.with_name(f"{base.name}-{k}"), k + 1
    try:
        dest.mkdir(parents=True)
        for path in earlier:
            os.replace(path, dest / path.name)
    except OSError as exc:
        raise DifflmError(f"--out {out}: cannot move the earlier sweep's jobs into {dest} ({exc.strerror or exc}): "
                          "move them away yourself or give another --out") from None
    return dest


def collect(out: Path) -> list[dict]:
    """One row per finished job under ``out``: objective, budget (unique tokens), epochs, steps, the best validation
    loss (``val_nelbo``: the exact NLL for ar, the NELBO bound for mdlm) and the step it was reached at."""
    rows = []
    for cfg_file in sorted(out.glob("*/config.yaml"), key=lambda p: (len(p.parent.name), p.parent.name)):
        metrics = cfg_file.parent / "metrics.jsonl"
        if not metrics.exists():
            continue
        cfg = yaml.safe_load(cfg_file.read_text())
        evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("val_nelbo") is not None]
        if not evals:
            continue
        best = min(evals, key=lambda r: r["val_nelbo"])
        rows.append({"job": cfg_file.parent.name, "objective": cfg["objective"]["name"],
                     "budget": cfg["data"]["max_train_tokens"], "epochs": float(cfg["train"]["epochs"]),
                     "steps": cfg["train"]["max_steps"], "best": best["val_nelbo"], "best_step": best["step"],
                     "final": evals[-1]["val_nelbo"]})
    return rows


def crossover(ar: dict[float, float], mdlm: dict[float, float]) -> Optional[float]:
    """Epochs at which MDLM's best loss falls below AR's: the first grid interval where AR - MDLM goes from <= 0 to
    > 0, interpolated linearly in log2(epochs); the first grid point when MDLM is ahead throughout; None when never
    (or no common grid point). ``ar`` / ``mdlm``: epochs -> best loss."""
    grid = sorted(set(ar) & set(mdlm))
    if not grid:
        return None
    diff = [ar[e] - mdlm[e] for e in grid]
    if diff[0] > 0:
        return grid[0]
    for (e0, d0), (e1, d1) in zip(zip(grid, diff), zip(grid[1:], diff[1:])):
        if d0 <= 0 < d1:
            x0, x1 = math.log2(e0), math.log2(e1)
            return 2 ** (x0 + (x1 - x0) * (-d0) / (d1 - d0))
    return None


def summarize(rows: list[dict]) -> dict[int, dict]:
    """Per budget: {"ar": {epochs: best}, "mdlm": {...}, "crossover": epochs or None}."""
    out: dict[int, dict] = {}
    for r in rows:
        out.setdefault(r["budget"], {"ar": {}, "mdlm": {}})[r["objective"]][r["epochs"]] = r["best"]
    for per in out.values():
        per["crossover"] = crossover(per["ar"], per["mdlm"])
    return dict(sorted(out.items()))


def _tokens(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 100_000 else f"{n / 1e3:g}k" if n >= 1000 else str(n)


def plot(rows: list[dict], path: Path) -> Path:
    """Best validation loss against epochs (log2 axis), AR solid and MDLM dashed, one shade per budget; each
    budget's crossover is a dotted vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    summary = summarize(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (budget, per) in enumerate(summary.items()):
        shade = 0.45 + 0.55 * (i + 1) / len(summary)
        for name, style, cmap in (("ar", "-o", plt.cm.Blues), ("mdlm", "--s", plt.cm.Oranges)):
            pts = sorted(per[name].items())
            if pts:
                ax.plot([e for e, _ in pts], [v for _, v in pts], style, color=cmap(shade),
                        label=f"{'AR' if name == 'ar' else 'MDLM'}, {_tokens(budget)} unique tokens")
        if per["crossover"] is not None:
            c = per["crossover"]
            ax.axvline(c, color=plt.cm.Greys(shade), linestyle=":", linewidth=1.2)
            grid = sorted(per["ar"])
            ax.plot([c], [np.interp(math.log2(c), np.log2(grid), [per["ar"][e] for e in grid])], "*", markersize=13,
                    color=plt.cm.Greys(shade), zorder=5)
            ax.annotate(f"{_tokens(budget)}: crossover at {c:.1f} epochs", (per["crossover"], 1.0),
                        xycoords=("data", "axes fraction"), xytext=(3, -12 - 11 * i), textcoords="offset points",
                        fontsize=8, color=plt.cm.Greys(shade))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("epochs over the unique tokens")
    ax.set_ylabel("best validation loss (nats/token)\nAR: NLL, MDLM: NELBO bound")
    ax.set_title("Data-constrained training: AR vs masked diffusion")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def corpus_and_budgets(data: Optional[str], budgets: list[int], given: bool) -> tuple[str, list[int]]:
    """The corpus to sweep and its unique-token budgets: ``data`` as given, or the embedded tinyshakespeare with
    :data:`EMBEDDED_BUDGETS` (the scales' budgets of up to 1M tokens exceed its 340k) unless budgets were ``given``."""
    if data:
        return data, budgets
    from difflm.config import asset_path

    if not given:
        budgets = EMBEDDED_BUDGETS
    print(f"--data not given: the embedded tinyshakespeare, budgets {budgets}", file=sys.stderr)
    return asset_path(EMBEDDED_CORPUS), budgets


def numbers(kind, what: str):
    """An argparse ``type``: comma-separated positive ``kind`` values (int budgets; epochs: an int, or a float
    where a ``.`` is written)."""
    def parse(text: str) -> list:
        try:
            values = [(float(v) if "." in v else int(v)) if kind is float else int(v) for v in text.split(",") if v]
        except ValueError:
            values = []
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated positive {what}, e.g. "
                                             f"{'250000,1000000' if kind is int else '1,2,4'}")
        return values

    return parse


@script_cli.script_main
def main(argv: Optional[list[str]] = None) -> int:
    """Run the sweep (unless ``--plot-only``), then collect, tabulate and plot; 0, or 1 without a finished job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = script_cli.parser(__file__, __doc__)
    p.add_argument("--data", help="data.path of the corpus (default: the embedded tinyshakespeare, 250k-token budget)")
    p.add_argument("--out", type=script_cli.output_dir, default="outputs/data_constrained",
                   help="sweep directory (run.dir; default ./outputs/data_constrained)")
    p.add_argument("--scale", choices=sorted(SCALES), default="small",
                   help="the grid: small = 1M tokens x 2, 8, 32 epochs; full = 3 budgets x 8 epochs (default small)")
    p.add_argument("--budgets", type=numbers(int, "unique-token budgets"),
                   help="comma-separated unique-token budgets (default: the scale's)")
    p.add_argument("--epochs", type=numbers(float, "epochs"), help="comma-separated epochs (default: the scale's)")
    p.add_argument("--plot-only", action="store_true", help="only collect the finished jobs and plot")
    p.epilog = "Overrides of every job of the sweep follow a --, e.g. -- model=tiny device=cpu."
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        raise DifflmError("the plot needs matplotlib: pip install '.[plot]' (in the difflm checkout), then rerun")
    out = args.out
    budgets, epochs = SCALES[args.scale]
    budgets = args.budgets or budgets
    epochs = args.epochs or epochs
    if not args.plot_only:
        data, budgets = corpus_and_budgets(args.data, budgets, given=bool(args.budgets))
        moved = set_aside_earlier_sweep(out)
        if moved is not None:
            print(f"--out {out} held an earlier sweep: moved its jobs and results to {moved}; this sweep starts "
                  "afresh", file=sys.stderr)
        code = run_sweep(data, out, budgets, epochs, overrides)
        if code != 0:
            print(f"the sweep exited with status {code}; plotting the jobs that finished", file=sys.stderr)
    rows = collect(out)
    if not rows and args.plot_only:
        raise DifflmError(f"--out {out}: no finished jobs there: give the --out of an earlier sweep, or drop "
                          "--plot-only to run one")
    if not rows:
        print(f"data_constrained.py: no finished jobs under {out}", file=sys.stderr)
        return 1
    (out / "results.json").write_text(strict_json.dumps({"jobs": rows, "by_budget": {
        str(b): {"ar": {str(k): v for k, v in s["ar"].items()}, "mdlm": {str(k): v for k, v in s["mdlm"].items()},
                 "crossover_epochs": s["crossover"]} for b, s in summarize(rows).items()}}, indent=1))
    print(f"{'objective':>9} {'budget':>9} {'epochs':>7} {'steps':>6} {'best':>8} {'at step':>7} {'final':>8}")
    for r in sorted(rows, key=lambda r: (r["budget"], r["objective"], r["epochs"])):
        print(f"{r['objective']:>9} {r['budget']:>9} {r['epochs']:>7g} {r['steps']:>6} {r['best']:>8.4f} "
              f"{r['best_step']:>7} {r['final']:>8.4f}")
    for budget, s in summarize(rows).items():
        c = s["crossover"]
        print(f"budget {budget}: " + (f"MDLM's best loss is below AR's from {c:.1f} epochs" if c is not None
                                      else "no crossover on this grid"))
    print(f"plot: {plot(rows, out / 'data_constrained.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
