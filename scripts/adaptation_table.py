"""The point of AR-to-diffusion adaptation, measured: a model trained as AR for ``--ar-steps`` steps, then adapted
by each recipe for ``--adapt-steps`` steps, against the same model trained from scratch by the same recipe for the
same steps. Prints one row per recipe: the recipe's diffusion validation NELBO (nats/token; bd3lm recipes: the block
NELBO at their final block size) from scratch and adapted, and, with ``--target-nelbo`` (a value, or ``scratch``: each
recipe's from-scratch final NELBO), the training tokens each run needed to reach it (evaluated every ``--eval-every``
steps).

The recipes are the objective settings of conf/experiment/*_adapt.yaml with their step counts scaled to
``--adapt-steps`` and their block sizes to ``data.seq_len`` (:data:`RECIPES`). Everything after the options is a
Hydra override of the runs (model, data, batch, device, precision).

``--seeds`` repeats the whole table (AR checkpoint included) for each ``train.seed``; the table then gives each
recipe's mean final NELBOs, adapted - scratch as mean ± sample standard deviation, each seed's difference and the
number of seeds in which the adapted run ends lower (``--jobs``: seeds in parallel processes).

CPU (a few minutes per seed; model=tiny on the embedded corpus; docs/adaptation.md's table is the second command):
    python scripts/adaptation_table.py
    python scripts/adaptation_table.py --seeds 0,1,2 --jobs 3 --json benchmarks/results/adaptation_tiny_cpu.json

One H200 (model=125m on a real corpus; only torch, hydra, omegaconf and datasets are needed, no Transformer Engine):
    python scripts/adaptation_table.py --ar-steps 2000 --adapt-steps 500 --eval-every 50 --target-nelbo scratch \\
        --out runs/adaptation_125m -- model=125m data.path=/work/shared/data/corpora/gutenberg data.seq_len=1024 \\
        device=cuda precision=bf16 model.backend=torch model.attention_backend=sdpa model.fused_cross_entropy=false \\
        model.fused_qkv=false train.global_batch_size=64 train.micro_batch_size=16 optim.lr=6e-4 \\
        train.eval_windows=256 train.eval_mc_samples=4
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import difflm.config  # noqa: E402
from difflm import script_cli, strict_json  # noqa: E402
from difflm.cli import writable_output  # noqa: E402
from difflm.config.compose import compose_train_config  # noqa: E402
from difflm.config.validate import check_run  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402
from difflm.training.trainer import Trainer  # noqa: E402

CPU_DEFAULTS = [  # model=tiny on the embedded tinyshakespeare corpus, small enough for minutes on a CPU
    "model=tiny", "device=cpu", "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=8",
    "train.eval_windows=16", "train.eval_mc_samples=2", "optim.lr=3e-3", "schedule.warmup_steps=5",
]
COMMON = ["logger.progress_bar=false", "logger.num_samples=0", "train.eval_every=0", "train.save_every=0",
          "objective.random_length_prob=0"]


def _div(seq_len: int, size: int) -> int:
    """The largest divisor of ``seq_len`` not above ``size``."""
    size = max(1, min(size, seq_len))
    while seq_len % size:
        size -= 1
    return size


def recipe_overrides(name: str, steps: int, seq_len: int) -> list[str]:
    """The objective overrides of recipe ``name`` for ``steps`` training steps at sequence length ``seq_len``."""
    block = _div(seq_len, min(32, seq_len // 4))  # the final / decoding block: 32, or a quarter of a short window
    if name == "dream":
        return ["objective=mdlm", "model.shift_logits=true", "objective.weighting=cart"]
    if name == "diffullama":
        return ["objective=mdlm", "model.shift_logits=true", f"objective.attention_anneal_steps={max(1, steps // 2)}"]
    if name == "llada2_wsd":
        w, d = max(1, steps // 8), max(1, steps // 4)
        phases = [[w, 1], [w, _div(seq_len, 4)], [max(1, steps - 2 * w - d), seq_len], [d, block]]
        return ["objective=bd3lm", f"objective.block_size={block}",
                "objective.block_schedule=" + json.dumps(phases).replace(" ", "")]
    if name == "fast_dllm_v2":
        return ["objective=bd3lm", f"objective.block_size={block}", "objective.complementary_masks=true"]
    if name == "megatron_bridge_hybrid":
        return ["objective=bd3lm", f"objective.block_size={_div(seq_len, min(64, seq_len // 2))}",
                "objective.diffusion_loss_weight=0.3", "objective.ar_loss_weight=1.0", "objective.clean_attention=causal"]
    raise DifflmError(f"--recipes: unknown recipe {name!r}: choose from {', '.join(RECIPES)}")


RECIPES = ["dream", "diffullama", "llada2_wsd", "fast_dllm_v2", "megatron_bridge_hybrid"]


def make_trainer(overrides: list[str], run_dir: Path, cache: Path) -> Trainer:
    """A validated Trainer for ``overrides`` (composed like ``difflm-train``) in ``run_dir``."""
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"run.dir={run_dir}", f"data.cache_dir={cache}"])
    device = check_run(cfg)
    return Trainer(cfg, cfg.run.dir, device)


def train(trainer: Trainer, steps: int, eval_every: Optional[int]) -> list[tuple[int, float]]:
    """Train ``steps`` steps; returns the validation curve [(training tokens, NELBO)], evaluated every ``eval_every``
    steps (None: only at the end) and at the end."""
    tokens_per_step = trainer.cfg.train.global_batch_size * trainer.cfg.data.seq_len
    curve = []
    for _ in range(steps):
        trainer.train_step()
        if eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
            curve.append((trainer.step * tokens_per_step, trainer.evaluate()))
    curve.append((trainer.step * tokens_per_step, trainer.evaluate()))
    return curve


def tokens_to(curve: list[tuple[int, float]], target: float) -> Optional[int]:
    """The training tokens at the first evaluation with NELBO <= ``target``, or None."""
    return next((tokens for tokens, nelbo in curve if nelbo <= target), None)


def run_seed(seed: int, args, overrides: list[str], out: Path) -> dict:
    """One seed of the table (``train.seed=seed`` in every run): the AR checkpoint, then each recipe from scratch and
    adapted. Returns {"seed", "ar_nll", "rows": [{"recipe", "scratch", "adapted": curves}]}."""
    overrides = [*overrides, f"train.seed={seed}"]
    # parallel seeds each tokenise into their own cache (no two processes write one file)
    cache = out / (f"seed_{seed}" if args.jobs > 1 else "") / "data_cache"
    out = out / f"seed_{seed}"
    ar = make_trainer([*overrides, "objective=ar", f"train.max_steps={args.ar_steps}"], out / "ar", cache)
    # the AR checkpoint of an earlier call with the same --out, overrides and --ar-steps is reused (a table split over
    # several calls adapts one checkpoint); anything else trains it again
    saved = out / "ar_weights.pt"
    key = {"overrides": overrides, "ar_steps": args.ar_steps}
    kept = torch.load(saved, map_location=ar.device, weights_only=True) if saved.exists() else None
    if kept is not None and kept["key"] == key:
        ar_nll, weights = kept["ar_nll"], kept["weights"]
        print(f"seed {seed}: AR checkpoint reused from {saved}", flush=True)
    else:
        ar_nll = train(ar, args.ar_steps, None)[-1][1]
        weights = {k: v.detach().clone() for k, v in ar.model.state_dict().items()}
        torch.save({"key": key, "ar_nll": ar_nll, "weights": weights}, saved)
    seq_len = ar.cfg.data.seq_len
    cpu = f"CPU ({torch.get_num_threads()} torch threads)"
    device = torch.cuda.get_device_name(ar.device) if ar.device.type == "cuda" else cpu
    print(f"seed {seed}: AR checkpoint: {args.ar_steps} steps, validation NLL {ar_nll:.4f} nats/token", flush=True)
    del ar
    rows = []
    for name in args.recipes:
        recipe = [*overrides, *recipe_overrides(name, args.adapt_steps, seq_len), f"train.max_steps={args.adapt_steps}"]
        result = {"recipe": name}
        for start in ("scratch", "adapted"):
            trainer = make_trainer(recipe, out / f"{name}_{start}", cache)
            if start == "adapted":
                trainer.model.load_state_dict(weights)
            result[start] = train(trainer, args.adapt_steps, args.eval_every)
            print(f"  seed {seed}: {name} {start}: val NELBO {result[start][-1][1]:.4f}", flush=True)
            del trainer
        rows.append(result)
    return {"seed": seed, "device": device, "ar_nll": ar_nll, "rows": rows}


def summarise(runs: list[dict]) -> list[dict]:
    """Per recipe over the seeds of ``runs``: the final NELBOs' means and adapted - scratch per seed, its mean and
    sample standard deviation (0 for one seed)."""
    summary = []
    for i, name in enumerate(r["recipe"] for r in runs[0]["rows"]):
        scratch = [run["rows"][i]["scratch"][-1][1] for run in runs]
        adapted = [run["rows"][i]["adapted"][-1][1] for run in runs]
        diffs = [a - s for a, s in zip(adapted, scratch)]
        mean = sum(diffs) / len(diffs)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) if len(diffs) > 1 else 0.0
        summary.append({"recipe": name, "scratch_mean": sum(scratch) / len(scratch),
                        "adapted_mean": sum(adapted) / len(adapted), "diff_mean": mean, "diff_sd": sd,
                        "diffs": diffs, "lower_in": sum(d < 0 for d in diffs)})
    return summary


def seed_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integer seeds, each at most once."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct comma-separated integers, e.g. 0,1,2")
    return seeds


def target_nelbo(text: str):
    """An argparse ``type``: ``scratch`` or a number."""
    if text == "scratch":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a NELBO in nats/token (e.g. 5.2) or 'scratch'") from None


@script_cli.script_main
def main(argv=None) -> int:
    """Train the AR checkpoint and every recipe per seed, print the table, write the JSON; 1 for a nonfinite loss."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("--ar-steps", type=script_cli.int_at_least(1), default=200,
                    help="AR pre-training steps of the checkpoint to adapt")
    ap.add_argument("--adapt-steps", type=script_cli.int_at_least(1), default=30,
                    help="steps of each recipe, adapted and from scratch")
    ap.add_argument("--seeds", type=seed_list, default=[0], help="comma-separated train.seed values: the whole table "
                    "(AR checkpoint included) runs once per seed; the table gives the mean and the per-seed "
                    "differences (default 0)")
    ap.add_argument("--jobs", type=script_cli.int_at_least(1), default=1,
                    help="seeds run in parallel, one process each")
    ap.add_argument("--eval-every", type=script_cli.int_at_least(1), default=None,
                    help="steps between evaluations (default: only at the end)")
    ap.add_argument("--target-nelbo", type=target_nelbo, default=None, help="report the tokens each run needs to "
                    "reach this NELBO; 'scratch': each recipe's from-scratch final NELBO")
    ap.add_argument("--recipes", type=script_cli.comma_list(RECIPES, "recipe"), default=list(RECIPES),
                    help="comma-separated subset of " + ", ".join(RECIPES))
    ap.add_argument("--out", type=script_cli.caller_path, default=None, help="run directories (default: a temporary "
                    "directory); an AR checkpoint trained there with the same overrides and --ar-steps is reused")
    ap.add_argument("--json", type=script_cli.caller_path, default=None,
                    help="also write the table's JSON (every curve, the summary) here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of every run (default: the CPU setting)")
    args = ap.parse_intermixed_args(argv)  # the overrides may come before, between or after the flags
    overrides = [*(args.overrides or CPU_DEFAULTS), *COMMON]
    compose_train_config(overrides)  # a mistyped override is refused by name before any training
    if args.json:
        writable_output("--json", args.json)
    out = Path(args.out or tempfile.mkdtemp(prefix="adaptation_"))
    seeds = args.seeds
    if args.jobs > 1 and len(seeds) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(seeds)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=script_cli.die_with_parent) as pool:
            runs = list(pool.map(run_seed, seeds, [args] * len(seeds), [overrides] * len(seeds), [out] * len(seeds)))
    else:
        runs = [run_seed(seed, args, overrides, out) for seed in seeds]

    def millions(value) -> str:
        return "not reached" if value is None else f"{value / 1e6:.2f}M"

    for run in runs:
        for r in run["rows"]:
            if args.target_nelbo is not None:
                r["target"] = r["scratch"][-1][1] if args.target_nelbo == "scratch" else args.target_nelbo
    summary = summarise(runs)
    ar = ", ".join(f"{run['ar_nll']:.4f}" for run in runs)
    print(f"\nval NELBO (nats/token) after {args.adapt_steps} steps; adapted = from {args.ar_steps} AR steps "
          f"(AR validation NLL {ar}); seeds {','.join(map(str, seeds))}: mean over seeds, sd = sample standard "
          "deviation")
    target = "" if args.target_nelbo is None else " | target | tokens scratch | tokens adapted"
    print(f"| recipe | scratch | adapted | adapted - scratch (mean ± sd) | per seed | lower in{target} |")
    print("|---|---|---|---|---|---|" + ("---|---|---|" if target else ""))
    for i, s in enumerate(summary):
        extra = ""
        if args.target_nelbo is not None:  # per seed, " / "-separated
            rows = [run["rows"][i] for run in runs]
            extra = (" | " + " / ".join(f"{r['target']:.4f}" for r in rows)
                     + " | " + " / ".join(millions(tokens_to(r["scratch"], r["target"])) for r in rows)
                     + " | " + " / ".join(millions(tokens_to(r["adapted"], r["target"])) for r in rows))
        per_seed = ", ".join(f"{d:+.3f}" for d in s["diffs"])
        print(f"| {s['recipe']} | {s['scratch_mean']:.4f} | {s['adapted_mean']:.4f} | "
              f"{s['diff_mean']:+.4f} ± {s['diff_sd']:.4f} | {per_seed} | {s['lower_in']}/{len(runs)}{extra} |")
    result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": runs[0]["device"],
              "command": "python scripts/adaptation_table.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "ar_steps": args.ar_steps, "adapt_steps": args.adapt_steps, "seeds": seeds, "runs": runs,
              "summary": summary}
    text = strict_json.dumps(result, indent=1)
    (out / "adaptation_table.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if all(math.isfinite(r["adapted"][-1][1]) for run in runs for r in run["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
