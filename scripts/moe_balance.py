#!/usr/bin/env python3
"""Expert load with and without load balancing: ``model=moe-tiny`` on tinyshakespeare, one run per setting.

    python scripts/moe_balance.py --steps 200 --json moe_balance.json [extra Hydra overrides]

Runs ``difflm-train``'s Trainer in this process (CPU by default) for each balancing setting:

    none       model.moe.aux_loss_coeff=0  model.moe.bias_update_rate=0
    aux_loss   model.moe.aux_loss_coeff=0.01 (Switch/GShard loss; OLMoE's coefficient)
    aux_free   model.moe.aux_loss_coeff=0  model.moe.bias_update_rate=0.001 (DeepSeek-V3's gamma)

and prints, per window of ``--window`` steps, the mean over steps of ``moe/load_max_mean`` (tokens of the busiest
expert / mean tokens per expert, averaged over layers; 1 = perfect balance) from each run's metrics.jsonl,
plus the final training loss. The router z-loss stays at the preset's 0.001 in every run (it does not balance).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from difflm import script_cli, strict_json  # noqa: E402
from difflm.cli import writable_output  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402

SETTINGS = {
    "none": ["model.moe.aux_loss_coeff=0", "model.moe.bias_update_rate=0"],
    "aux_loss": ["model.moe.aux_loss_coeff=0.01", "model.moe.bias_update_rate=0"],
    "aux_free": ["model.moe.aux_loss_coeff=0", "model.moe.bias_update_rate=0.001"],
}
BASE = ["model=moe-tiny", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=8",
        "train.eval_every=0", "train.save_every=0", "logger.num_samples=0", "logger.progress_bar=false",
        "logger.log_every=1", "schedule.warmup_steps=20", "optim.lr=1e-3", "objective.random_length_prob=0",
        "device=cpu"]


def run(name: str, steps: int, root: Path, extra: list[str]) -> list[dict]:
    """Train the run of balancing setting ``name`` under ``root`` with the ``extra`` overrides; its metrics rows.

    Raises: DifflmError for an extra override of a key the settings vary (every run would take its value) or for a
    dense model (no expert load to compare), before anything runs."""
    from difflm.config.compose import compose_train_config
    from difflm.config.validate import check_run
    from difflm.model.moe import moe_config
    from difflm.training.trainer import Trainer

    varied = sorted({o.split("=", 1)[0] for o in SETTINGS[name]})
    clash = [o for o in extra if o.split("=", 1)[0].lstrip("+~") in varied]
    if clash:
        raise DifflmError(f"{clash[0]}: the runs differ by {' and '.join(varied)} (--runs picks the settings), so an "
                          "override of it would give every run the same value: drop it")
    run_dir = root / name
    overrides = [*BASE, *SETTINGS[name], f"train.max_steps={steps}", f"run.dir={run_dir}",
                 f"data.cache_dir={root / 'cache'}", *extra]
    cfg = compose_train_config(overrides)  # a mistyped extra override is refused by name, not run unread
    if moe_config(cfg.model) is None:
        raise DifflmError(f"model={cfg.model.name} with model.moe.num_experts={cfg.model.moe.num_experts} is a dense "
                          "model: the runs compare expert loads; give a mixture-of-experts model (the default "
                          "model=moe-tiny, llada-moe-tiny, llada2-tiny)")
    Trainer(cfg, run_dir, check_run(cfg)).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def windows(rows: list[dict], key: str, size: int) -> list[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return [sum(values[i:i + size]) / len(values[i:i + size]) for i in range(0, len(values), size)]


@script_cli.script_main
def main(argv=None) -> dict:
    """Train one run per balancing setting of ``--runs`` and print the load table; the results."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=200,
                    help="training steps of each run (default 200)")
    ap.add_argument("--window", type=script_cli.int_at_least(1), default=20,
                    help="steps averaged into one row of the table (default 20)")
    ap.add_argument("--runs", type=script_cli.comma_list(SETTINGS, "setting"), default=list(SETTINGS),
                    help=f"comma-separated subset of {','.join(SETTINGS)} (default: all)")
    ap.add_argument("--dir", type=script_cli.caller_path, default=None,
                    help="where the run dirs go (default: a temporary directory)")
    ap.add_argument("--json", type=script_cli.caller_path, default=None,
                    help="also write the table's numbers (per window, per setting) to this JSON file")
    args = ap.parse_intermixed_args(argv)  # the overrides may come before, between or after the flags
    if args.json:
        writable_output("--json", args.json)  # before the runs, not after them
    torch.set_num_threads(1)  # tiny matrices: one thread is the fastest on a shared CPU
    names = args.runs
    root = Path(args.dir or tempfile.mkdtemp(prefix="moe_balance_"))
    result = {"steps": args.steps, "window": args.window, "overrides": BASE + args.overrides, "runs": {}}
    for name in names:
        rows = run(name, args.steps, root, args.overrides)
        result["runs"][name] = {"load_max_mean": windows(rows, "moe/load_max_mean", args.window),
                                "loss": windows(rows, "loss", args.window),
                                "final_bias_norm": rows[-1].get("moe/bias_norm")}
    head = f"{'steps':>9} " + " ".join(f"{n:>10}" for n in names)
    lines = ["moe/load_max_mean (busiest expert / mean, averaged over layers and the window's steps)", head]
    for w in range(len(next(iter(result["runs"].values()))["load_max_mean"])):
        lo, hi = w * args.window + 1, min((w + 1) * args.window, args.steps)
        lines.append(f"{lo:>4}-{hi:<4} " + " ".join(f"{result['runs'][n]['load_max_mean'][w]:>10.3f}" for n in names))
    lines.append(f"{'loss':>9} " + " ".join(f"{result['runs'][n]['loss'][-1]:>10.3f}" for n in names)
                 + "   (last window's mean training loss)")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(strict_json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
