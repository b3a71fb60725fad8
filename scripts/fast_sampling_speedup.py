"""Speed of Fast-dLLM decoding (threshold, prefix/dual KV cache) against plain LLaDA sampling on a trained run.

    python scripts/fast_sampling_speedup.py RUN_DIR [--length 64] [--block 16] [--batch 4]

Prints wall time, model calls (NFE) and the fraction of generated tokens equal to the plain sampler's.
For bd3lm runs it compares the exact block-wise KV cache against the uncached block sampler.
"""
from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf

from difflm.generate import generate_ids, load_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", default="ROMEO:|JULIET:|KING HENRY:|First Citizen:")
    a = ap.parse_args()
    device = torch.device("cpu")
    cfg, model, tok, _ = load_run(a.run_dir, None, device)
    texts = a.prompts.split("|")[: a.batch]
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
