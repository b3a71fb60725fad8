"""Time the MoE layer's token permutation on a GPU, forward and backward in BF16: difflm's
(:class:`difflm.model.token_permutation.SlotOrder`: gathers both ways, the gate-weighted combine as one Triton kernel
each way reading the sorted rows) against autograd through plain indexing and a batched GEMM (``h[order // k]``,
``y[inverse]``, whose backwards run ``index_put_`` with accumulation, then ``bmm`` over the k slots).

Two timings per shape, each from the same inputs for both ways:

* ``perm``: the permutation alone: sort the T k slots by expert, gather, a one-kernel stand-in for the experts,
  unsort, the gate-weighted sum;
* ``layer``: the whole :class:`difflm.model.moe.MoEMLP` (RMSNorm, FP32 router, auxiliary losses, ``torch._grouped_mm``
  experts under BF16 autocast), its ``_routed`` running either way.

Prints one JSON line per shape: ms per forward + backward of each, the speed-up, and how far difflm's output and
input gradient are from autograd's (max |diff| / max |ref|; difflm sums a token's k slot gradients and the combine in
FP32 with FP32 gating weights, autograd adds one BF16 slot gradient at a time and rounds the weights to BF16).

    python scripts/moe_permutation_speed.py --shape moe-1b-7b-mb2=8192,2048,64,8,1024

A shape is NAME=TOKENS,HIDDEN,EXPERTS,TOP_K,EXPERT_FFN (default: moe-1b-7b at micro-batch 1 and 2 of 4096 tokens).
Needs only PyTorch (no Transformer Engine, Hydra or quack).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from difflm import script_cli, strict_json  # noqa: E402

DEFAULT_SHAPES = ("moe-1b-7b-mb1=4096,2048,64,8,1024", "moe-1b-7b-mb2=8192,2048,64,8,1024")


def parse_shape(spec: str) -> tuple[str, tuple[int, ...]]:
    """An argparse ``type``: ``NAME=TOKENS,HIDDEN,EXPERTS,TOP_K,EXPERT_FFN`` -> (NAME, the five integers)."""
    name, sep, dims = spec.partition("=")
    parts = dims.split(",")
    if not sep or not name.strip() or len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=TOKENS,HIDDEN,EXPERTS,TOP_K,EXPERT_FFN with a name "
                                         "and five positive integers, e.g. moe-1b-7b-mb2=8192,2048,64,8,1024")
    t, d, e, k, f = (int(p) for p in parts)
    if k > e:
        raise argparse.ArgumentTypeError(f"{spec!r}: TOP_K={k} is more than EXPERTS={e}")
    return name.strip(), (t, d, e, k, f)


def indexing_routed(self, h, expert_ids, weights):
    """``MoEMLP._routed`` through autograd's indexing and ``bmm`` (the baseline): the same sums as difflm's."""
    t, k = expert_ids.shape
    order = torch.argsort(expert_ids.flatten(), stable=True)
    counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts)
    y_sorted = self.experts(h[order // k], counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(t * k, device=order.device)
    y = y_sorted[inverse].view(t, k, -1)
    return torch.bmm(weights.unsqueeze(1).to(y.dtype), y).squeeze(1).to(h.dtype)


def permutation_only(gathers: bool, h, ids, w, scale):
    """Sort, gather, ``x * scale`` for the experts, unsort and gate-weighted sum: [T, d]."""
    from difflm.model.token_permutation import SlotOrder

    t, k = ids.shape
    if gathers:
        slots = SlotOrder(ids)
        return slots.combine(slots.permute(h, t * k) * scale, w)
    order = torch.argsort(ids.flatten(), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(t * k, device=order.device)
    y = (h[order // k] * scale)[inverse].view(t, k, -1)
    return torch.bmm(w.unsqueeze(1).to(y.dtype), y).squeeze(1)


def moe_layer(d: int, e: int, k: int, f: int):
    """A training-mode :class:`difflm.model.moe.MoEMLP` on the GPU (FP32 parameters, OLMoE-style routing)."""
    from difflm.model.moe import MoEMLP

    moe = SimpleNamespace(num_experts=e, top_k=k, ffn_hidden_size=f, num_shared_experts=0, score_func="softmax",
                          norm_topk_prob=False, aux_loss_coeff=0.01, z_loss_coeff=0.001, bias_update_rate=0.0,
                          capacity_factor=None, balance_over="micro_batch")
    layer = MoEMLP(SimpleNamespace(hidden_size=d, norm_eps=1e-5, ffn_hidden_size=f, moe=moe)).cuda().train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return layer


def rel(u: torch.Tensor, v: torch.Tensor) -> float:
    """max |u - v| / max |v| (float32)."""
    return float((u.float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-30))


def time_shape(t: int, d: int, e: int, k: int, f: int, steps: int) -> dict:
    """One row: ms per forward + backward of both ways, for the permutation alone and the whole layer."""
    from benchmark import median_cuda_ms
    from difflm.model.moe import MoEMLP

    torch.manual_seed(0)
    h = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices  # k distinct experts per token, near uniform
    w = torch.rand(t, k, device="cuda")  # FP32, as the router's
    scale = torch.full((1, d), 1.5, device="cuda", dtype=torch.bfloat16)
    row = {"tokens": t, "hidden": d, "experts": e, "top_k": k, "expert_ffn": f}
    results = {}
    for gathers in (False, True):
        way = "difflm" if gathers else "autograd"

        def perm(gathers=gathers):
            h.grad = None
            permutation_only(gathers, h, ids, w, scale).backward(dy)

        perm()
        results[("perm", way)] = (permutation_only(gathers, h, ids, w, scale).detach(), h.grad.clone())
        row[f"perm_{way}_ms"] = round(median_cuda_ms(perm, steps, warmup=3), 3)

    layer, routed = moe_layer(d, e, k, f), MoEMLP._routed
    x = torch.randn(t, d, device="cuda", requires_grad=True)
    for gathers in (False, True):
        way = "difflm" if gathers else "autograd"
        MoEMLP._routed = routed if gathers else indexing_routed

        def step():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(x)
            out.backward(dy.float())
            return out

        try:
            out = step()
            results[("layer", way)] = (out.detach(), x.grad.clone())
            row[f"layer_{way}_ms"] = round(median_cuda_ms(step, steps, warmup=3), 3)
        finally:
            MoEMLP._routed = routed
    for part in ("perm", "layer"):
        row[f"{part}_speedup"] = round(row[f"{part}_autograd_ms"] / row[f"{part}_difflm_ms"], 3)
        (o_ref, g_ref), (o, g) = results[(part, "autograd")], results[(part, "difflm")]
        row[f"{part}_rel_err_out"], row[f"{part}_rel_err_grad"] = rel(o, o_ref), rel(g, g_ref)
    return row


@script_cli.script_main
def main(argv=None) -> None:
    """Time both ways at every ``--shape`` and print one JSON line each; write ``--json``."""
    ap = script_cli.parser(__file__, __doc__, whole_doc=True)
    ap.add_argument("--shape", action="append", type=parse_shape, metavar="NAME=TOKENS,HIDDEN,EXPERTS,TOP_K,EXPERT_FFN",
                    help="a shape to time (repeatable; default: moe-1b-7b at micro-batch 1 and 2 of 4096 tokens)")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=20,
                    help="timed calls per way (median; default 20)")
    ap.add_argument("--json", type=script_cli.output_file, default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    script_cli.require_cuda()
    results = []
    for name, dims in args.shape or [parse_shape(s) for s in DEFAULT_SHAPES]:
        row = {"shape": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               **time_shape(*dims, steps=args.steps)}
        print(strict_json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
