"""The point of AR-to-diffusion adaptation, measured: a model trained as AR for ``--ar-steps`` steps, then adapted
by each recipe for ``--adapt-steps`` steps, against the same model trained from scratch by the same recipe for the
same steps. Prints one row per recipe: the recipe's diffusion validation NELBO (nats/token; bd3lm recipes: the block
NELBO at their final block size) from scratch and adapted, and, with ``--target-nelbo`` (a value, or ``scratch``: each
recipe's from-scratch final NELBO), the training tokens each run needed to reach it (evaluated every ``--eval-every``
steps).

The recipes are the objective settings of conf/experiment/*_adapt.yaml with their step counts scaled to
``--adapt-steps`` and their block sizes to ``data.seq_len`` (:data:`RECIPES`). Everything after the options is a
Hydra override of the runs (model, data, batch, device, precision).

CPU (a few minutes; model=tiny on the embedded corpus):
    python scripts/adaptation_table.py

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
from pathlib import Path
from typing import Optional

import torch
from hydra import compose, initialize_config_dir

import difflm.config
from difflm.config.validate import check_run
from difflm.training.trainer import Trainer
from difflm import strict_json

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
        return ["objective=bd3lm", f"objective.block_size={_div(seq_len, min(64, seq_len // 2))}", "objective.ar_loss_weight=1.0",
                "objective.diffusion_loss_weight=0.3"]
    raise SystemExit(f"adaptation_table: unknown recipe {name!r}: choose from {', '.join(RECIPES)}")


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ar-steps", type=int, default=60, help="AR pre-training steps of the checkpoint to adapt")
    ap.add_argument("--adapt-steps", type=int, default=30, help="steps of each recipe, adapted and from scratch")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: only at the end)")
    ap.add_argument("--target-nelbo", default=None, help="report the tokens each run needs to reach this NELBO; "
                    "'scratch': each recipe's from-scratch final NELBO")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of " + ", ".join(RECIPES))
    ap.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of every run (default: the CPU setting)")
    args = ap.parse_args(argv)
    overrides = [*(args.overrides or CPU_DEFAULTS), *COMMON]
    out = Path(args.out or tempfile.mkdtemp(prefix="adaptation_"))
    cache = out / "data_cache"

    ar = make_trainer([*overrides, "objective=ar", f"train.max_steps={args.ar_steps}"], out / "ar", cache)
    ar_nll = train(ar, args.ar_steps, None)[-1][1]
    seq_len = ar.cfg.data.seq_len
    weights = {k: v.detach().clone() for k, v in ar.model.state_dict().items()}
    print(f"AR checkpoint: {args.ar_steps} steps, validation NLL {ar_nll:.4f} nats/token", flush=True)
    del ar

    rows = []
    for name in args.recipes.split(","):
        recipe = [*overrides, *recipe_overrides(name, args.adapt_steps, seq_len), f"train.max_steps={args.adapt_steps}"]
        result = {"recipe": name}
        for start in ("scratch", "adapted"):
            trainer = make_trainer(recipe, out / f"{name}_{start}", cache)
            if start == "adapted":
                trainer.model.load_state_dict(weights)
            result[start] = train(trainer, args.adapt_steps, args.eval_every)
            print(f"  {name} {start}: val NELBO {result[start][-1][1]:.4f}", flush=True)
            del trainer
        rows.append(result)

    def millions(value) -> str:
        return "not reached" if value is None else f"{value / 1e6:.2f}M"

    target = "" if args.target_nelbo is None else " | target | tokens scratch | tokens adapted"
    print(f"\nval NELBO (nats/token) after {args.adapt_steps} steps; adapted = from {args.ar_steps} AR steps")
    print(f"| recipe | scratch | adapted | adapted - scratch{target} |")
    print("|---|---|---|---|" + ("---|---|---|" if target else ""))
    for r in rows:
        s_nelbo, a_nelbo = r["scratch"][-1][1], r["adapted"][-1][1]
        extra = ""
        if args.target_nelbo is not None:
            goal = s_nelbo if args.target_nelbo == "scratch" else float(args.target_nelbo)
            r["target"] = goal
            extra = f" | {goal:.4f} | {millions(tokens_to(r['scratch'], goal))} | {millions(tokens_to(r['adapted'], goal))}"
        print(f"| {r['recipe']} | {s_nelbo:.4f} | {a_nelbo:.4f} | {a_nelbo - s_nelbo:+.4f}{extra} |")
    (out / "adaptation_table.json").write_text(strict_json.dumps({"ar_nll": ar_nll, "rows": rows}, indent=1))
    return 0 if all(math.isfinite(r["adapted"][-1][1]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
