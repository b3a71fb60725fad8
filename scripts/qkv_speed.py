"""Time the QKV split / QK-norm / RoPE step (:func:`difflm.model.qkv.qkv_heads`) forward and backward on a GPU:
eager, ``torch.compile`` of the same function (the path before the Triton kernels), and the Triton kernels of
:mod:`difflm.kernels.qkv_triton` at several tile sizes, each against the bytes it must move (read the QKV output, write
q / k / v; backward: read their gradients and the saved q / k, write the QKV gradient).

    python scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --shape 125m-mb64=64,1024,12,12,64

A shape is NAME=B,S,H,H_KV,D (QK-norm on). Prints ms per call and GB/s per row.

    python scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --in-place 16x2x8,16x2x1,32x4x4 --gemm-between 8

``--in-place`` instead times the backward as :mod:`difflm.kernels.qkv_flash` calls it (the incoming gradients already
in the QKV gradient's slots, transformed there; the value slots left alone) at each BLOCK_TxWARPSxTILES setting
(rows per tile, warps, tiles per program), and the forward without the value copy, with ``--gemm-between`` MLP-sized
GEMMs before each call (``benchmark.median_ms_under_load``: a training step's clocks, not an isolated loop's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from difflm import script_cli  # noqa: E402


def positive_ints(text: str, count: int, what: str, example: str) -> tuple[int, ...]:
    """``count`` positive integers separated by ``,`` or ``x`` (argparse reports the ArgumentTypeError)."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != count or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}, {count} positive integers, e.g. {example}")
    return tuple(int(p) for p in parts)


def parse_shape(spec: str) -> str:
    """An argparse ``type``: ``NAME=B,S,H,H_KV,D`` checked (a name, five positive integers), returned as given."""
    name, sep, dims = spec.partition("=")
    parts = dims.split(",")
    if not sep or not name.strip() or len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=B,S,H,H_KV,D with a name and five positive "
                                         "integers, e.g. 1.7b-mb8=8,4096,16,16,128")
    return spec


def tile_list(count: int, example: str):
    """An argparse ``type``: comma-separated settings of ``count`` positive integers joined by ``x``."""
    def parse(text: str) -> list[str]:
        settings = [t for t in text.split(",") if t]
        for t in settings:
            positive_ints(t, count, "x".join(["BLOCK_T", "WARPS", "TILES"][:count]), example)
        return settings

    return parse


@script_cli.script_main
def main(argv=None) -> None:
    """Time every shape's rows (or the ``--in-place`` backward settings) and print them; write ``--json``."""
    ap = script_cli.parser(__file__, __doc__, whole_doc=True)
    ap.add_argument("--shape", action="append", required=True, type=parse_shape, metavar="NAME=B,S,H,H_KV,D",
                    help="a shape to time (repeatable): batch, sequence, heads, KV heads, head size")
    ap.add_argument("--tiles", type=tile_list(2, "16x2"), default="16x2,16x4,32x4,32x8,64x4,64x8",
                    help="Triton BLOCK_TxWARPS settings, each used forward and backward")
    ap.add_argument("--in-place", type=tile_list(3, "16x2x8"), default=[],
                    help="comma-separated BLOCK_TxWARPSxTILES backward settings, timed in "
                    "place under load (module docstring) instead of the rows above")
    ap.add_argument("--gemm-between", type=script_cli.int_at_least(0), default=8,
                    help="MLP-sized GEMMs before each --in-place call")
    ap.add_argument("--json", type=script_cli.output_file, default=None,
                    help="also write the rows (ms per call) to this JSON file")
    args = ap.parse_args(argv)
    script_cli.require_cuda()
    if args.in_place:
        results = [row for spec in args.shape for row in in_place_rows(spec, args.in_place, args.gemm_between)]
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    from benchmark import median_cuda_ms

    from difflm.kernels import qkv_triton
    from difflm.model.qkv import _qkv_heads, qkv_heads_triton
    from difflm.model.rope import rope_angles, rope_tables

    compiled = torch.compile(_qkv_heads, dynamic=False, fullgraph=True)
    results = []
    for spec in args.shape:
        name, dims = spec.split("=")
        b, s, h, hkv, d = (int(x) for x in dims.split(","))
        qkv = (torch.randn(b, s, (h + 2 * hkv) * d, device="cuda") * 2).bfloat16().requires_grad_(True)
        qw = torch.nn.Parameter(1 + 0.1 * torch.randn(d, device="cuda"))
        kw = torch.nn.Parameter(1 + 0.1 * torch.randn(d, device="cuda"))
        cos, sin = rope_tables(rope_angles(torch.arange(s, device="cuda"), d, 10000.0), "bshd")
        grads = [torch.randn(b, s, n, d, device="cuda").bfloat16() for n in (h, hkv, hkv)]
        nbytes = qkv.numel() * 2  # one read or one write of the QKV output
        fwd_bytes, bwd_bytes = 2 * nbytes, 2 * nbytes + nbytes * (h + hkv) // (h + 2 * hkv)

        def run(fn):
            def fwd():
                return fn(qkv, cos, sin, qw, kw, 1e-6, h, hkv, d)

            def fwd_bwd():
                torch.autograd.backward(fwd(), grads)

            with torch.no_grad():
                f = median_cuda_ms(fwd, 20, warmup=3)
            return f, median_cuda_ms(fwd_bwd, 20, warmup=3) - f

        rows = [("eager", *run(_qkv_heads)), ("torch.compile", *run(compiled))]
        for tile in args.tiles:
            block_t, warps = (int(x) for x in tile.split("x"))
            qkv_triton.FWD_BLOCK_T, qkv_triton.FWD_WARPS = block_t, warps
            qkv_triton.BWD_BLOCK_T, qkv_triton.BWD_WARPS = block_t, warps
            rows.append((f"triton {tile}", *run(qkv_heads_triton)))
        print(f"\n{name}: B={b} S={s} H={h} H_kv={hkv} D={d}  (fwd {fwd_bytes / 1e9:.2f} GB, bwd {bwd_bytes / 1e9:.2f} GB)")
        for label, f, bw in rows:
            print(f"  {label:16s} fwd {f:7.3f} ms {fwd_bytes / f / 1e6:6.0f} GB/s   bwd {bw:7.3f} ms "
                  f"{bwd_bytes / bw / 1e6:6.0f} GB/s")
            results.append({"shape": name, "row": label, "fwd_ms": f, "bwd_ms": bw})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def in_place_rows(spec: str, settings: list[str], gemm_between: int) -> list[dict]:
    """The forward (v left in place) and the in-place backward of :mod:`difflm.kernels.qkv_triton` at ``spec``
    (NAME=B,S,H,H_KV,D, QK-norm on), the backward at each BLOCK_TxWARPSxTILES setting: ms per call under load and
    GB/s against the bytes each must move (forward: read and write the q / k slots; backward: read the q / k
    gradients and the saved q / k, write the QKV gradient's q / k slots)."""
    from benchmark import median_ms_under_load

    from difflm.kernels import qkv_triton
    from difflm.model.qkv import head_slots
    from difflm.model.rope import rope_angles, rope_tables

    name, dims = spec.split("=")
    b, s, h, hkv, d = (int(x) for x in dims.split(","))
    qkv = (torch.randn(b, s, (h + 2 * hkv) * d, device="cuda") * 2).bfloat16()
    qw, kw = (1 + 0.1 * torch.randn(d, device="cuda") for _ in range(2))
    cos, sin = rope_tables(rope_angles(torch.arange(s, device="cuda"), d, 10000.0), "bshd")
    args = (qkv, cos, sin, qw, kw, 1e-6, h, hkv, d)
    dqkv = torch.randn_like(qkv)
    incoming = [slot if slot is not None else torch.randn(b, s, h, d, device="cuda").bfloat16()
                for slot in head_slots(dqkv, h, hkv, d)]
    saved = dqkv.clone()
    qk_bytes = b * s * (h + hkv) * d * 2  # one pass over the q and k heads, BF16
    fwd_ms = median_ms_under_load(lambda: qkv_triton.forward(*args, dense_v=False), 20, 3, gemm_between, b * s)
    print(f"\n{name}: B={b} S={s} H={h} H_kv={hkv} D={d}, {gemm_between} GEMMs before each call")
    print(f"  forward (v in place)   {fwd_ms:7.3f} ms {2 * qk_bytes / fwd_ms / 1e6:6.0f} GB/s")
    rows = [{"shape": name, "row": "forward", "ms": fwd_ms}]
    default = qkv_triton.BWD_BLOCK_T, qkv_triton.BWD_WARPS, qkv_triton.BWD_TILES
    try:
        for setting in settings:
            qkv_triton.BWD_BLOCK_T, qkv_triton.BWD_WARPS, qkv_triton.BWD_TILES = (int(x) for x in setting.split("x"))
            ms = median_ms_under_load(lambda: qkv_triton.backward(*incoming, *args, dqkv=dqkv), 20, 3, gemm_between,
                                      b * s, after=lambda: dqkv.copy_(saved))
            print(f"  backward {setting:12s}  {ms:7.3f} ms {3 * qk_bytes / ms / 1e6:6.0f} GB/s")
            rows.append({"shape": name, "row": f"backward {setting}", "ms": ms})
    finally:
        qkv_triton.BWD_BLOCK_T, qkv_triton.BWD_WARPS, qkv_triton.BWD_TILES = default
    return rows


if __name__ == "__main__":
    main()
