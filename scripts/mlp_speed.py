"""Time the MLP half of a block, ``s = x + a; y = s + MLP(RMSNorm(s))``, forward and backward on a GPU, in BF16, with
the two MLP slots of the TE kernel set: TE's ``LayerNormMLP`` plus two residual adds (``model.fused_mlp=false``) and
quack's fused kernels (:class:`difflm.kernels.quack_mlp.ResidualNormMLP`, ``model.fused_mlp=true``). Both from the same
weights; prints ms per call, the first call's time (quack compiles its kernels then), the peak memory, and how far
the fused path's output and gradients are from TE's (max |diff| / max |TE|).

    python scripts/mlp_speed.py --shape 1.7b-mb8=32768,2048,6144 --shape 125m-mb64=65536,768,2048 [--autotune]

A shape is NAME=TOKENS,HIDDEN,FFN. Weight gradients accumulate into FP32 main_grad (TE's fuse_wgrad_accumulation),
as in training.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from difflm import script_cli, strict_json  # noqa: E402


def half_block(fused: bool, hidden: int, ffn: int, autotune: bool = False):
    """(module, fn(a, x) -> y) of one MLP half block built by the TE kernel set."""
    from difflm.model.te_kernels import TEKernels

    cfg = SimpleNamespace(fused_mlp=fused, fused_mlp_autotune=autotune, fuse_wgrad_accumulation=True,
                          attention_backend="sdpa")
    mlp = TEKernels(cfg, device="cuda").norm_mlp(hidden, ffn, eps=1e-5)
    if fused:
        return mlp, lambda a, x: mlp(a, x)

    def unfused(a, x):
        s = x + a
        return s + mlp(s)

    return mlp, unfused


def grads(mlp) -> dict:
    return {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().float().clone()
            for n, p in mlp.named_parameters()}


def parse_shape(spec: str) -> tuple[str, tuple[int, int, int]]:
    """An argparse ``type``: ``NAME=TOKENS,HIDDEN,FFN`` -> (NAME, (TOKENS, HIDDEN, FFN))."""
    name, sep, dims = spec.partition("=")
    parts = dims.split(",")
    if not sep or not name.strip() or len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=TOKENS,HIDDEN,FFN with a name and three positive "
                                         "integers, e.g. 1.7b-mb8=32768,2048,6144")
    n, d, f = (int(p) for p in parts)
    return name.strip(), (n, d, f)


@script_cli.script_main
def main(argv=None) -> None:
    """Time both MLP paths at every ``--shape`` and print one JSON line each; write ``--json``."""
    ap = script_cli.parser(__file__, __doc__, whole_doc=True)
    ap.add_argument("--shape", action="append", required=True, type=parse_shape, metavar="NAME=TOKENS,HIDDEN,FFN",
                    help="a shape to time (repeatable): tokens per call, hidden size, MLP width")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=20,
                    help="timed calls per path (median; default 20)")
    ap.add_argument("--autotune", action="store_true", help="model.fused_mlp_autotune: quack tunes each GEMM shape "
                    "(minutes on the first call; then from quack's disk cache)")
    ap.add_argument("--json", type=script_cli.output_file, default=None,
                    help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    script_cli.require_cuda()
    from benchmark import median_cuda_ms

    results = []
    for name, (n, d, f) in args.shape:
        torch.manual_seed(0)
        x = torch.randn(n, d, device="cuda").bfloat16().requires_grad_(True)
        a = torch.randn(n, d, device="cuda").bfloat16().requires_grad_(True)
        dy = torch.randn(n, d, device="cuda").bfloat16()
        ref_state = None
        row = {"shape": name, "tokens": n, "hidden": d, "ffn": f}
        outs = {}
        for fused in (False, True):
            mlp, fn = half_block(fused, d, f, args.autotune)
            with torch.no_grad():
                if ref_state is None:
                    mlp.layer_norm_weight.copy_(1 + 0.1 * torch.randn(d, device="cuda"))
                    mlp.fc1_weight.normal_(0, 0.02)
                    mlp.fc2_weight.normal_(0, 0.02 / 8)
                    ref_state = {k: v.clone() for k, v in mlp.state_dict().items() if not k.endswith("_extra_state")}
                else:
                    mlp.load_state_dict(ref_state, strict=False)
            label = "quack" if fused else "te"

            def fwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return fn(a, x)

            def fwd_bwd():
                torch.autograd.backward(fwd(), dy)

            for p in mlp.parameters():
                p.grad = None
            a.grad = x.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = fwd()
            torch.autograd.backward(y, dy)
            torch.cuda.synchronize()
            row[f"{label}_first_call_s"] = round(time.perf_counter() - t0, 2)
            outs[label] = (y.detach().float(), a.grad.float().clone(), x.grad.float().clone(), grads(mlp))
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                fwd_ms = median_cuda_ms(fwd, args.steps, warmup=3)
            both_ms = median_cuda_ms(fwd_bwd, args.steps, warmup=3)
            row[f"{label}_fwd_ms"] = round(fwd_ms, 3)
            row[f"{label}_bwd_ms"] = round(both_ms - fwd_ms, 3)
            row[f"{label}_fwd_bwd_ms"] = round(both_ms, 3)
            row[f"{label}_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            del mlp, fn, y
        te, qk = outs["te"], outs["quack"]

        def rel(u, v):
            return float((u - v).abs().max() / v.abs().max().clamp_min(1e-30))

        row["rel_err_out"] = rel(qk[0], te[0])
        row["rel_err_da"] = rel(qk[1], te[1])
        row["rel_err_dx"] = rel(qk[2], te[2])
        for k in te[3]:
            row[f"rel_err_{k}"] = rel(qk[3][k], te[3][k])
        row["speedup"] = round(row["te_fwd_bwd_ms"] / row["quack_fwd_bwd_ms"], 3)
        print(strict_json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
