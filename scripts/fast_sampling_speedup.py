"""Speed of Fast-dLLM decoding (threshold, prefix/dual KV cache) against plain LLaDA sampling on a trained run.

    python scripts/fast_sampling_speedup.py RUN_DIR [--length 64] [--block 16] [--batch 4]

Prints wall time, model calls (NFE) and the fraction of generated tokens equal to the plain sampler's, on the CPU.
For bd3lm runs it compares the exact block-wise KV cache against the uncached block sampler.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli  # noqa: E402
from difflm.generate import generate_ids, load_run  # noqa: E402


@script_cli.script_main
def main(argv=None) -> None:
    """Generate with each decoding variant from the run's newest checkpoint and print its time and NFE."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("run_dir", metavar="RUN_DIR",
                    help="a trained run (difflm-train's run.dir); its newest checkpoint is read")
    ap.add_argument("--length", type=script_cli.int_at_least(1), default=64,
                    help="tokens generated per prompt, also the sampler steps (default 64)")
    ap.add_argument("--block", type=script_cli.int_at_least(1), default=16,
                    help="semi-autoregressive block length; must divide --length (default 16)")
    ap.add_argument("--batch", type=script_cli.int_at_least(1), default=4,
                    help="prompts generated together, the first --batch of --prompts (default 4)")
    ap.add_argument("--prompts", default="ROMEO:|JULIET:|KING HENRY:|First Citizen:",
                    help="'|'-separated prompt texts (default: four tinyshakespeare speaker names)")
    a = ap.parse_args(argv)
    if a.length % a.block:
        fits = max(b for b in range(1, a.block + 1) if a.length % b == 0)
        ap.error(f"--length {a.length} is not a multiple of --block {a.block}: give e.g. --block {fits}, or a "
                 f"--length that --block {a.block} divides ({a.length + a.block - a.length % a.block})")
    texts = [t for t in a.prompts.split("|") if t]
    if len(texts) < a.batch:
        ap.error(f"--batch {a.batch} needs {a.batch} prompts, --prompts has {len(texts)}: give more '|'-separated "
                 "prompts or a smaller --batch")
    texts = texts[:a.batch]
    device = torch.device("cpu")
    cfg, model, tok, _ = load_run(a.run_dir, None, device, keys=("RUN_DIR", "step"))
    ids = [tok.encode(t) for t in texts]
    width = max(map(len, ids))
    prompt = torch.tensor([[tok.eos_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[False] * (width - len(i)) + [True] * len(i) for i in ids])
    base_gen = dict(length=a.length, steps=a.length, block_length=a.block, remasking="low_confidence", temperature=0.0,
                    seed=0, top_k=0, top_p=1.0, cfg_scale=0.0, threshold=None, cache="none")
    variants = [("plain", {}), ("threshold=0.9", {"threshold": 0.9}), ("cache=prefix", {"cache": "prefix"}),
                ("cache=dual", {"cache": "dual"}), ("threshold=0.9 + dual", {"threshold": 0.9, "cache": "dual"})]
    if cfg.objective.name == "bd3lm":
        variants = [("plain", {}), ("cache (exact)", {"cache": "prefix"}), ("threshold=0.9", {"threshold": 0.9}),
                    ("threshold=0.9 + cache", {"threshold": 0.9, "cache": "prefix"})]
        mask = None
    print(f"run {a.run_dir} objective={cfg.objective.name} batch={a.batch} length={a.length} block={a.block}")
    base, base_t = None, None
    for name, over in variants:
        gen = OmegaConf.create({**base_gen, **over})
        stats = {}
        t0 = time.perf_counter()
        out = generate_ids(model, tok, prompt, gen, False, objective=cfg.objective, prompt_mask=mask, stats=stats)
        dt = time.perf_counter() - t0
        if base is None:
            base, base_t = out, dt
        same = float((out == base).float().mean())
        print(f"{name:24s} {dt:7.2f} s  nfe={stats['nfe']:4d}  speed-up={base_t / dt:5.2f}x  same tokens={same:.3f}")
    print("sample:", repr(texts[0] + tok.decode(base[0].tolist())[:120]))


if __name__ == "__main__":
    main()
