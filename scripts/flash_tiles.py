#!/usr/bin/env python3
"""FlashAttention 4's Hopper tile configurations, swept at one shape.

    python scripts/flash_tiles.py --shape 8,4096,16,128 [--gemm-between 8] [--json out.json]

FA4 picks its SM90 tiles from ``flash_attn.cute.interface._tile_size_fwd_sm90`` / ``_tile_size_bwd_sm90``,
tables ported from FlashAttention 3 and benchmarked on an H100 SXM (FA4's docstrings say so). An H200 has the
same SMs and more memory bandwidth, so another tile may win there. This script replaces those two functions,
for the duration of one row, by one that returns the row's configuration, and times FA4's own calls
(``_flash_attn_fwd`` / ``_flash_attn_bwd``, bidirectional, BF16, dense ``B, S, H, D`` inputs; the kernels that
``difflm.kernels.qkv_flash`` and ``attend(backend="flash")`` run) between CUDA events: the forward alone and the
backward alone (median of ``--iters`` after ``--warmup``), with ``--gemm-between`` BF16 GEMMs of the 1.7B MLP's
size before each timed call so the GPU runs at a training step's clock. TFLOP/s: PaLM's count (appendix B),
4 B S^2 H D forward, twice that backward (the recomputed QK^T not counted).

A configuration the kernel cannot build (registers, shared memory, an assertion of FA4's) prints
``failed: reason`` and the sweep goes on. Needs CUDA and flash-attn 4 on a Hopper GPU. This is a measuring tool:
it changes nothing in difflm.
"""
from __future__ import annotations

import contextlib
import json

import torch
from difflm import script_cli, strict_json

# (name, kind, fields): bwd fields are BwdConfig's, fwd fields FwdConfig's; "default" keeps FA4's own table.
CONFIGS = [
    ("bwd-default", "bwd", None),
    ("bwd-m64", "bwd", dict(m_block_size=64, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2,
                            SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=False,
                            AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)),
    ("bwd-m96", "bwd", dict(m_block_size=96, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2,
                            SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=True,
                            AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)),
    ("bwd-m80-pds1", "bwd", dict(m_block_size=80, n_block_size=128, num_stages_Q=2, num_stages_dO=2,
                                 num_stages_PdS=1, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=True,
                                 AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)),
    ("bwd-m80-dq1wg", "bwd", dict(m_block_size=80, n_block_size=128, num_stages_Q=2, num_stages_dO=2,
                                  num_stages_PdS=2, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=True,
                                  AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1, dQ_single_wg=True)),
    ("bwd-m64-dq1wg", "bwd", dict(m_block_size=64, n_block_size=128, num_stages_Q=2, num_stages_dO=2,
                                  num_stages_PdS=2, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=False,
                                  AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1, dQ_single_wg=True)),
    ("bwd-m112", "bwd", dict(m_block_size=112, n_block_size=128, num_stages_Q=2, num_stages_dO=2,
                             num_stages_PdS=2, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=True,
                             AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)),
    ("bwd-m128-q1", "bwd", dict(m_block_size=128, n_block_size=128, num_stages_Q=1, num_stages_dO=1,
                                num_stages_PdS=1, SdP_swapAB=True, dKV_swapAB=False, dQ_swapAB=False,
                                AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)),
    ("bwd-m80-n112", "bwd", {'m_block_size': 80, 'n_block_size': 112, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m80-do1", "bwd", {'m_block_size': 80, 'n_block_size': 128, 'num_stages_Q': 2, 'num_stages_dO': 1, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m80-sdp2", "bwd", {'m_block_size': 80, 'n_block_size': 128, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 2, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m80-mdq2", "bwd", {'m_block_size': 80, 'n_block_size': 128, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 2}),
    ("bwd-m64-n144", "bwd", {'m_block_size': 64, 'n_block_size': 144, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': False, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m48", "bwd", {'m_block_size': 48, 'n_block_size': 128, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m80-nosdpswap", "bwd", {'m_block_size': 80, 'n_block_size': 128, 'num_stages_Q': 2, 'num_stages_dO': 2, 'num_stages_PdS': 2, 'SdP_swapAB': False, 'dKV_swapAB': False, 'dQ_swapAB': True, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("bwd-m64-q1", "bwd", {'m_block_size': 64, 'n_block_size': 128, 'num_stages_Q': 1, 'num_stages_dO': 1, 'num_stages_PdS': 1, 'SdP_swapAB': True, 'dKV_swapAB': False, 'dQ_swapAB': False, 'AtomLayoutMSdP': 1, 'AtomLayoutNdKV': 2, 'AtomLayoutMdQ': 1}),
    ("fwd-192x112", "fwd", dict(m_block_size=192, n_block_size=112, mma_pv_is_rs=False, intra_wg_overlap=True)),
    ("fwd-192x144", "fwd", dict(m_block_size=192, n_block_size=144, mma_pv_is_rs=False, intra_wg_overlap=True)),
    ("fwd-192x96", "fwd", dict(m_block_size=192, n_block_size=96, mma_pv_is_rs=False, intra_wg_overlap=True)),
    ("fwd-192x128-rs", "fwd", dict(m_block_size=192, n_block_size=128, mma_pv_is_rs=True, intra_wg_overlap=True)),
    ("fwd-default", "fwd", None),
    ("fwd-128x176", "fwd", dict(m_block_size=128, n_block_size=176, mma_pv_is_rs=True, intra_wg_overlap=True)),
    ("fwd-128x160", "fwd", dict(m_block_size=128, n_block_size=160, mma_pv_is_rs=True, intra_wg_overlap=True)),
    ("fwd-192x128", "fwd", dict(m_block_size=192, n_block_size=128, mma_pv_is_rs=False, intra_wg_overlap=True)),
    ("fwd-128x192", "fwd", dict(m_block_size=128, n_block_size=192, mma_pv_is_rs=False, intra_wg_overlap=True)),
]


@contextlib.contextmanager
def tiles(kind: str, fields: dict | None):
    """Make FA4's SM90 tile table answer ``fields`` (a BwdConfig / FwdConfig's fields) while the block runs.

    The call's compiled-kernel cache is swapped for an empty in-memory one meanwhile: FA4's backward cache key
    leaves out some fields (``num_stages_PdS``), so a cached kernel could otherwise answer for another tile, and
    nothing swept is written to a persistent cache.
    """
    from flash_attn.cute import interface
    from flash_attn.cute.cache_utils import JITCache

    if fields is None:
        yield
        return
    name, cls, fn = (("_tile_size_bwd_sm90", interface.BwdConfig, interface._flash_attn_bwd) if kind == "bwd"
                     else ("_tile_size_fwd_sm90", interface.FwdConfig, interface._flash_attn_fwd))
    original, cache = getattr(interface, name), fn.compile_cache
    setattr(interface, name, lambda *a, **k: cls(**fields))
    fn.compile_cache = JITCache()
    try:
        yield
    finally:
        setattr(interface, name, original)
        fn.compile_cache = cache


def time_config(kind, fields, b, s, h, d, *, iters, warmup, gemm_between) -> dict:
    """Median ms of FA4's forward or backward call under ``fields``; raises what FA4 raises when it cannot build."""
    from benchmark import median_ms_under_load
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    out, lse = _flash_attn_fwd(q, k, v, causal=False, return_lse=True)[:2]  # default tiles: the reference
    with tiles(kind, fields):
        if kind == "fwd":
            call = lambda: _flash_attn_fwd(q, k, v, causal=False, return_lse=True)  # noqa: E731
        else:
            call = lambda: _flash_attn_bwd(q, k, v, out, dout, lse, causal=False)  # noqa: E731
        result = call()
        torch.cuda.synchronize()
        ms = median_ms_under_load(call, iters, warmup, gemm_between, rows=b * s)
    flops = 4 * b * s * s * h * d * (1 if kind == "fwd" else 2)
    # the row's answer against the default tiles' (same inputs): a wrong tile would show here, not only in speed
    if kind == "fwd":
        err = (result[0].float() - out.float()).abs().max().item()
    else:
        ref = _flash_attn_bwd(q, k, v, out, dout, lse, causal=False)
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(result[:3], ref[:3]))
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "max_abs_diff_vs_default": err}


@script_cli.script_main
def main(argv=None) -> int:
    """Time every configuration (``--only`` picks some by name) and print one line each; write ``--json``."""
    parser = script_cli.parser(__file__, __doc__, whole_doc=True)
    parser.add_argument("--shape", default="8,4096,16,128", metavar="B,S,H,D",
                        help="batch, sequence, heads, head size (default 8,4096,16,128)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per configuration (median; default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    parser.add_argument("--gemm-between", type=int, default=8,
                        help="MLP-sized GEMMs before each timed call (default 8)")
    parser.add_argument("--only", action="append", choices=[c[0] for c in CONFIGS],
                        help="time only this configuration (repeatable; default: all)")
    parser.add_argument("--json", type=script_cli.output_file,
                        help="write the rows to this JSON file, after each")
    args = parser.parse_args(argv)
    dims = args.shape.split(",")
    if len(dims) != 4 or not all(p.isdigit() and int(p) > 0 for p in dims):
        parser.error(f"--shape {args.shape!r}: expected four positive integers B,S,H,D, e.g. 8,4096,16,128")
    if args.iters < 1 or args.warmup < 0 or args.gemm_between < 0:
        parser.error("--iters must be >= 1, --warmup >= 0 and --gemm-between >= 0")
    script_cli.require_cuda()
    b, s, h, d = (int(p) for p in dims)
    rows = []
    for name, kind, fields in CONFIGS:
        if args.only and name not in args.only:
            continue
        row = {"config": name, "kind": kind, "fields": fields, "shape": [b, s, h, d],
               "gemm_between": args.gemm_between}
        try:
            row.update(time_config(kind, fields, b, s, h, d, iters=args.iters, warmup=args.warmup,
                                   gemm_between=args.gemm_between))
            print(f"{name}: {row['ms']} ms, {row['tflops']} TFLOP/s, max |diff| vs default "
                  f"{row['max_abs_diff_vs_default']:.3g}", flush=True)
        except Exception as err:  # noqa: BLE001 - a tile FA4 cannot build is a result of the sweep
            row["failed"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{name}: failed: {row['failed']}", flush=True)
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                f.write(strict_json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
