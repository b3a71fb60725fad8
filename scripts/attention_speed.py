#!/usr/bin/env python3
"""Bidirectional attention forward + backward in isolation: TFLOP/s per backend, layout and shape.

    python scripts/attention_speed.py --shape 1.7b-s4096=4,4096,16,128 --backend te --backend flash \\
        [--gemm-between 8] [--json out.json]

Each row times :func:`difflm.model.attention.attend` (the model's own call, no mask, ``causal=False``) on dense
BF16 q, k, v of shape ``B, S, H, D`` in the row's layout, between CUDA events: ``--iters`` forward+backward passes
after ``--warmup`` ones, and separately the forward alone. TFLOP/s count PaLM's attention FLOPs (appendix B): 4 B S^2
H D for the forward (QK^T and PV), three times that for forward + backward, the count the trainer's MFU uses; the
backward's recomputation of QK^T is not counted.

``--gemm-between N`` runs N BF16 GEMMs of the model's MLP size ([B S, 2048] x [2048, 6144]) before each timed
attention call and times the attention alone (events around it), so the GPU is at a training step's power and
clock state rather than an attention-only loop's: the gap between the two says how much of the in-model attention
time against the isolated ceiling is the clock, not the call.

Backends (``--backend``, repeatable): ``te`` / ``te-sbhd`` (``te.DotProductAttention``, cuDNN fused attention, bshd
/ sbhd), ``sdpa`` (difflm's ``attention_backend=sdpa``: cuDNN first on Hopper and newer,
:func:`difflm.model.attention.sdpa_priority`), ``sdpa-cudnn`` / ``sdpa-flash`` (one PyTorch SDPA kernel forced;
``sdpa-flash`` is PyTorch's own first choice, FlashAttention-2),
``flash`` (flash-attn 4 / 3 / 2, whichever is installed). A backend that cannot run prints ``NAME: failed: reason``.
Needs CUDA; every argument (each ``--shape``: a name and four positive integers) is checked first, before the CUDA
check and any timing (usage errors exit 2). ``--json`` is rewritten after every row.
"""
from __future__ import annotations

import contextlib
import json

import torch
from difflm import script_cli, strict_json


def _sdpa_only(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name)])


BACKENDS = {  # name -> (difflm attention_backend, layout, context)
    "te": ("te", "bshd", contextlib.nullcontext),
    "te-sbhd": ("te", "sbhd", contextlib.nullcontext),
    "sdpa": ("sdpa", "bhsd", contextlib.nullcontext),
    "sdpa-cudnn": ("sdpa", "bhsd", lambda: _sdpa_only("CUDNN_ATTENTION")),
    "sdpa-flash": ("sdpa", "bhsd", lambda: _sdpa_only("FLASH_ATTENTION")),
    "flash": ("flash", "bshd", contextlib.nullcontext),
}


def _dims(layout: str, b: int, s: int, h: int, d: int) -> tuple[int, ...]:
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[layout]


def time_row(backend: str, b: int, s: int, h: int, d: int, *, iters: int, warmup: int, gemm_between: int) -> dict:
    """Median milliseconds of attention forward and forward + backward, and their TFLOP/s (see the module doc).

    Raises whatever the backend raises when it cannot run this shape (the caller reports it as failed).
    """
    from benchmark import median_ms_under_load
    from difflm.model.attention import attend

    kind, layout, context = BACKENDS[backend]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(_dims(layout, b, s, h, d), device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def call(backward: bool):
        with context():
            out = attend(q, k, v, causal=False, backend=kind, layout=layout)
            if backward:
                out.backward(grad)

    def drop_grads():
        q.grad = k.grad = v.grad = None

    def timed(backward: bool) -> float:
        return median_ms_under_load(lambda: call(backward), iters, warmup, gemm_between, rows=b * s, after=drop_grads)

    fwd_ms, step_ms = timed(False), timed(True)
    fwd_flops = 4 * b * s * s * h * d
    return {"backend": backend, "shape": [b, s, h, d], "gemm_between": gemm_between,
            "fwd_ms": round(fwd_ms, 3), "fwd_bwd_ms": round(step_ms, 3),
            "fwd_tflops": round(fwd_flops / fwd_ms / 1e9, 1),
            "fwd_bwd_tflops": round(3 * fwd_flops / step_ms / 1e9, 1)}


def parse_shape(spec: str) -> tuple[str, tuple[int, int, int, int]]:
    """``"NAME=B,S,H,D"`` -> (NAME, (B, S, H, D)); raises ValueError naming the fault (empty name, not four
    positive integers)."""
    name, sep, dims = spec.partition("=")
    parts = dims.split(",")
    if not sep or not name.strip() or len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape {spec!r}: expected NAME=B,S,H,D with a name and four positive integers, "
                         "e.g. 1.7b-s4096=4,4096,16,128")
    b, s, h, d = (int(p) for p in parts)
    return name.strip(), (b, s, h, d)


@script_cli.script_main
def main(argv=None) -> int:
    """Time every shape x backend x ``--gemm-between`` row and print it; write ``--json``. Usage errors exit 2."""
    parser = script_cli.parser(__file__, __doc__, whole_doc=True)
    parser.add_argument("--shape", action="append", required=True, metavar="NAME=B,S,H,D",
                        help="a shape to time (repeatable): a name, batch, sequence, heads, head size")
    parser.add_argument("--backend", action="append", choices=sorted(BACKENDS), required=True,
                        help="an attention backend to time (repeatable; see the list above)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per row (median; default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    parser.add_argument("--gemm-between", type=int, action="append", default=None,
                        help="GEMMs before each timed call (repeatable: one row per value; default 0)")
    parser.add_argument("--json", type=script_cli.output_file, help="write the rows to this JSON file, after each")
    args = parser.parse_args(argv)
    # every argument is checked before the CUDA check and any timing, so no row is timed and then lost
    shapes = []
    for spec in args.shape:
        try:
            shapes.append(parse_shape(spec))
        except ValueError as err:
            parser.error(str(err))
    if args.iters < 1 or args.warmup < 0 or any(n < 0 for n in args.gemm_between or []):
        parser.error("--iters must be >= 1, --warmup >= 0 and --gemm-between >= 0")
    script_cli.require_cuda()
    rows = []

    def save():  # after every row, so a run cut short (timeout, a crash in a kernel) keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                f.write(strict_json.dumps(rows, indent=1))

    for name, (b, s, h, d) in shapes:
        for backend in args.backend:
            for between in args.gemm_between or [0]:
                label = f"{name} {backend} gemm_between={between}"
                try:
                    row = dict(time_row(backend, b, s, h, d, iters=args.iters, warmup=args.warmup,
                                        gemm_between=between), name=name)
                except Exception as err:  # one backend failing must not hide the others
                    print(f"{label}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                rows.append(row)
                save()
                print(f"{label}: fwd {row['fwd_ms']} ms ({row['fwd_tflops']} TFLOP/s), fwd+bwd {row['fwd_bwd_ms']} "
                      f"ms ({row['fwd_bwd_tflops']} TFLOP/s)", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
