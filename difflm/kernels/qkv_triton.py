"""Triton kernels of :func:`difflm.model.qkv.qkv_heads`: one pass forward, one pass backward.

Between the QKV GEMM and the attention kernel sit only memory-bound steps (the split into heads, QK-norm, RoPE, the
copies that make q / k / v dense). ``torch.compile`` fused them into one forward kernel plus a copy of v, and three
backward kernels, because the backward feeds the un-rotated gradient into two reductions along different axes (the
per-row norm and the norm scale's sum over rows) and so wrote it out in FP32 and read it twice. On an H200 at
``model=1.7b``, S = 4096, micro-batch 8 those kernels took 56 ms of a 1,414 ms step against ~26 ms for reading and
writing the activations once (profile in docs/performance.md). Here a forward program owns a tile of rows (tokens)
and every head of it (the RoPE tables and norm scales read once per tile), a backward program a few tiles of rows
and one KV group, so both of the backward's reductions stay in registers: it reads the three incoming gradients and
the saved QKV output once and writes the QKV gradient once, plus one [D] partial sum of each norm scale's gradient per
program (summed by ``torch.sum``, so the result is deterministic; no atomics).

The arithmetic follows the eager composition operation for operation, in float32 (``F.rms_norm`` on the upcast
head, the norm's output rounded to the compute dtype, ``x * cos + rotate_half(x) * sin``, and in the backward the
gradient rounded to the compute dtype where eager autograd rounds it), with floating-point contraction off, so the
values equal the eager ones up to the order of the norm's sum. Formulas: RMSNorm (Zhang & Sennrich 2019, eq. 4)
``y = x * rsqrt(mean(x^2) + eps) * w``; its gradient ``dx = r (w dy) - x r^3 mean(w dy x)``, ``dw = sum dy x r``;
RoPE (Su et al. 2021, eq. 34, rotate-half form; both halves of a row rotate by the same angles, so only the tables'
first half is read) and its transpose ``dx1 = g1 cos + g2 sin``, ``dx2 = g2 cos - g1 sin``.

Runs on any device Triton runs on, including the CPU under ``TRITON_INTERPRET=1`` (how CI tests it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from difflm.kernels.qkv_layout import head_slots


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, rows, inner, cos_s0, cos_s1, cos_sd, d, mask):
    """cos / sin of the first half of the head dimension for each row (token) of the tile: [T, HB] each. The second
    half's are the same (rotate-half RoPE repeats the D/2 frequencies: :func:`difflm.model.rope.rope_angles`), so
    they are not read: at one KV group per backward program the full tables were 40 % of each program's memory
    traffic."""
    toff = (rows // inner).to(tl.int64) * cos_s0 + (rows % inner).to(tl.int64) * cos_s1
    lo = toff[:, None] + d[None, :] * cos_sd
    c = tl.load(cos_ptr + lo, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + lo, mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _load_scale(w_ptr, d, HALF: tl.constexpr):
    return (tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32),
            tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32))


@triton.jit
def qkv_heads_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
                         n_rows, inner, cos_s0, cos_s1, cos_sd, eps,
                         H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HB: tl.constexpr,
                         BLOCK_T: tl.constexpr, QK_NORM: tl.constexpr, WRITE_V: tl.constexpr):
    """One program per tile of ``BLOCK_T`` rows (tokens), every head of them: the RoPE tables and norm scales are
    read once per tile. Slot ``g * (group + 2) + j`` of a row is query head ``g * group + j`` for ``j < group``, key
    head ``g`` for ``j = group``, value head ``g`` for ``j = group + 1`` (Megatron-LM's grouping,
    :func:`difflm.model.qkv.split_heads`). Without ``WRITE_V`` the value heads are left where they are (the caller
    reads them as a strided view of ``qkv``)."""
    GROUP: tl.constexpr = H // HKV
    HALF: tl.constexpr = D // 2
    C: tl.constexpr = (H + 2 * HKV) * D
    dt = q_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HB)
    mask = (rows < n_rows)[:, None] & (d < HALF)[None, :]
    row64 = rows[:, None].to(tl.int64)
    c, s = _rope_tables(cos_ptr, sin_ptr, rows, inner, cos_s0, cos_s1, cos_sd, d, mask)
    if QK_NORM:
        qw1, qw2 = _load_scale(qw_ptr, d, HALF)
        kw1, kw2 = _load_scale(kw_ptr, d, HALF)
    for g in range(HKV):
        for j in tl.static_range(GROUP + 2 if WRITE_V else GROUP + 1):
            src = qkv_ptr + row64 * C + (g * (GROUP + 2) + j) * D + d[None, :]
            x1 = tl.load(src, mask=mask, other=0.0)
            x2 = tl.load(src + HALF, mask=mask, other=0.0)
            if j == GROUP + 1:  # value head: a dense copy
                dst = v_ptr + (row64 * HKV + g) * D + d[None, :]
                tl.store(dst, x1, mask=mask)
                tl.store(dst + HALF, x2, mask=mask)
            else:
                x1 = x1.to(tl.float32)
                x2 = x2.to(tl.float32)
                if QK_NORM:
                    if j < GROUP:
                        w1, w2 = qw1, qw2
                    else:
                        w1, w2 = kw1, kw2
                    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
                    # the norm's output in the compute dtype, as the unfused norm module returns it
                    x1 = (x1 * r * w1[None, :]).to(dt).to(tl.float32)
                    x2 = (x2 * r * w2[None, :]).to(dt).to(tl.float32)
                o1 = x1 * c + (-x2) * s
                o2 = x2 * c + x1 * s
                if j < GROUP:
                    dst = q_ptr + (row64 * H + g * GROUP + j) * D + d[None, :]
                else:
                    dst = k_ptr + (row64 * HKV + g) * D + d[None, :]
                tl.store(dst, o1.to(dt), mask=mask)
                tl.store(dst + HALF, o2.to(dt), mask=mask)


@triton.jit
def qkv_heads_bwd_kernel(gq_ptr, gk_ptr, gv_ptr, qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, dqkv_ptr, dw_ptr,
                         n_rows, inner, cos_s0, cos_s1, cos_sd, eps, gq_rs, gq_hs, gk_rs, gk_hs, gv_rs, gv_hs,
                         H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HB: tl.constexpr,
                         BLOCK_T: tl.constexpr, TILES: tl.constexpr, QK_NORM: tl.constexpr,
                         COPY_V: tl.constexpr):
    """One program per ``TILES`` consecutive tiles of ``BLOCK_T`` rows and one KV group (its query heads, key head
    and value head): the backward reads and writes twice what the forward does per head, so it takes more programs
    in flight than one per tile; and the norm scales' partial sums are kept across the program's tiles, so there are
    ``TILES`` times fewer of them to sum afterwards. Writes the QKV gradient and, with QK-norm, the program's partial
    sums of the query and key norm scales' gradients to ``dw_ptr[program, group, 0 | 1, :]`` (float32). The incoming
    gradients are read with row and head strides (``g*_rs``, ``g*_hs``), so they may already sit in ``dqkv``'s
    slots: each element is read before the value computed from it is written back, by the same program. ``COPY_V``
    false: the value gradient is in place."""
    GROUP: tl.constexpr = H // HKV
    HALF: tl.constexpr = D // 2
    C: tl.constexpr = (H + 2 * HKV) * D
    dt = dqkv_ptr.dtype.element_ty
    program = tl.program_id(0)
    g = tl.program_id(1)
    d = tl.arange(0, HB)
    dq1 = tl.zeros([HB], dtype=tl.float32)
    dq2 = tl.zeros([HB], dtype=tl.float32)
    dk1 = tl.zeros([HB], dtype=tl.float32)
    dk2 = tl.zeros([HB], dtype=tl.float32)
    if QK_NORM:
        qw1, qw2 = _load_scale(qw_ptr, d, HALF)
        kw1, kw2 = _load_scale(kw_ptr, d, HALF)
    for t in range(TILES):
        rows = (program * TILES + t) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (rows < n_rows)[:, None] & (d < HALF)[None, :]
        row64 = rows[:, None].to(tl.int64)
        c, s = _rope_tables(cos_ptr, sin_ptr, rows, inner, cos_s0, cos_s1, cos_sd, d, mask)
        for j in tl.static_range(GROUP + 2 if COPY_V else GROUP + 1):
            dst = dqkv_ptr + row64 * C + (g * (GROUP + 2) + j) * D + d[None, :]
            if j == GROUP + 1:
                src = gv_ptr + row64 * gv_rs + g * gv_hs + d[None, :]
                tl.store(dst, tl.load(src, mask=mask, other=0.0), mask=mask)
                tl.store(dst + HALF, tl.load(src + HALF, mask=mask, other=0.0), mask=mask)
            else:
                if j < GROUP:
                    src = gq_ptr + row64 * gq_rs + (g * GROUP + j) * gq_hs + d[None, :]
                else:
                    src = gk_ptr + row64 * gk_rs + g * gk_hs + d[None, :]
                g1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
                # the gradient of the rotation's input, in the compute dtype (eager autograd rounds it there)
                y1 = (g1 * c + g2 * s).to(dt).to(tl.float32)
                y2 = (g2 * c + (-g1) * s).to(dt).to(tl.float32)
                if QK_NORM:
                    src = qkv_ptr + row64 * C + (g * (GROUP + 2) + j) * D + d[None, :]
                    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
                    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
                    if j < GROUP:  # rows past n_rows load as 0 and add nothing
                        w1, w2 = qw1, qw2
                        dq1 += tl.sum(y1 * (x1 * r), 0)
                        dq2 += tl.sum(y2 * (x2 * r), 0)
                    else:
                        w1, w2 = kw1, kw2
                        dk1 += tl.sum(y1 * (x1 * r), 0)
                        dk2 += tl.sum(y2 * (x2 * r), 0)
                    u1 = y1 * w1[None, :]
                    u2 = y2 * w2[None, :]
                    dot = ((tl.sum(u1 * x1, 1) + tl.sum(u2 * x2, 1)) / D)[:, None]
                    r3 = r * r * r
                    y1 = r * u1 - x1 * r3 * dot
                    y2 = r * u2 - x2 * r3 * dot
                tl.store(dst, y1.to(dt), mask=mask)
                tl.store(dst + HALF, y2.to(dt), mask=mask)
    if QK_NORM:
        part = dw_ptr + (program.to(tl.int64) * HKV + g) * 2 * D + d
        tl.store(part, dq1, mask=d < HALF)
        tl.store(part + HALF, dq2, mask=d < HALF)
        tl.store(part + D, dk1, mask=d < HALF)
        tl.store(part + D + HALF, dk2, mask=d < HALF)


# rows (tokens) per program and warps per program, forward and backward (scripts/qkv_speed.py times others; the
# backward's one-warp programs of 8 rows were the fastest of 15 settings timed in place on an H200, 0.31 ms a call at
# 1.7B, micro-batch 8, S = 4096, against 0.375 for 16 rows x 2 warps: scripts/qkv_speed.py --in-place)
FWD_BLOCK_T, FWD_WARPS = 32, 4
BWD_BLOCK_T, BWD_WARPS = 8, 1
# tiles per backward program: the norm scales' partial sums left for torch.sum shrink by this factor (256 rows a
# program; at that shape from 33.5 MB a call to 2.1 MB), while 2,048 programs still fill the GPU (32 tiles: 0.298 ms a
# call in place, 16: 0.308)
BWD_TILES = 32


def _tables(qkv, cos, sin, head_dim: int):
    """The RoPE tables as broadcast views [A0, A1, D] of ``qkv``'s two leading dims, and their common strides."""
    shape = (qkv.shape[0], qkv.shape[1], 1, head_dim)
    cos, sin = torch.broadcast_to(cos, shape)[:, :, 0], torch.broadcast_to(sin, shape)[:, :, 0]
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, cos.stride()


def _launch_args(qkv, cos, sin, head_dim):
    cos, sin, (s0, s1, sd) = _tables(qkv, cos, sin, head_dim)
    n_rows = qkv.shape[0] * qkv.shape[1]
    return cos, sin, n_rows, (n_rows, qkv.shape[1], s0, s1, sd)


def forward(qkv, cos, sin, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
            dense_v: bool = True):
    """q [A0, A1, H, D], k and v [A0, A1, H_kv, D] (contiguous, ``qkv``'s dtype) from ``qkv`` [A0, A1, (H + 2 H_kv) D]
    (contiguous; [B, S, ...] or [S, B, ...]), the RoPE tables ``cos`` / ``sin`` (float32, broadcasting against
    [A0, A1, 1, D], the two halves of the last dim equal as :func:`difflm.model.rope.rope_angles` makes them; only
    the first half is read) and the QK-norm scales ``q_weight`` / ``k_weight`` [D] (None: no QK-norm).
    ``dense_v=False``: v is the strided view of ``qkv``'s value heads (:func:`difflm.model.qkv.head_slots`), not a
    copy."""
    a0, a1 = qkv.shape[:2]
    q = qkv.new_empty(a0, a1, num_heads, head_dim)
    k = qkv.new_empty(a0, a1, num_kv_heads, head_dim)
    v = qkv.new_empty(a0, a1, num_kv_heads, head_dim) if dense_v else head_slots(qkv, num_heads, num_kv_heads,
                                                                                   head_dim)[2]
    cos, sin, n_rows, geometry = _launch_args(qkv, cos, sin, head_dim)
    norm = q_weight is not None
    if n_rows == 0:  # no tokens: nothing to launch
        return q, k, v
    weights = (q_weight, k_weight) if norm else (qkv, qkv)  # not read without QK-norm
    qkv_heads_fwd_kernel[(triton.cdiv(n_rows, FWD_BLOCK_T),)](
        qkv, cos, sin, *weights, q, k, v, *geometry, float(eps), H=num_heads, HKV=num_kv_heads, D=head_dim,
        HB=triton.next_power_of_2(head_dim // 2), BLOCK_T=FWD_BLOCK_T, QK_NORM=norm, WRITE_V=dense_v,
        num_warps=FWD_WARPS, enable_fp_fusion=False)
    return q, k, v


def _row_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """(row, head) strides of a gradient [A0, A1, heads, D] whose two leading dims merge into rows and whose head
    dim is dense; a copy is made by the caller otherwise."""
    return t.stride(1), t.stride(2)


def _rows_mergeable(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1))


def backward(gq, gk, gv, qkv, cos, sin, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int,
             head_dim: int, dqkv: Optional[torch.Tensor] = None):
    """(d qkv [A0, A1, C] in ``qkv``'s dtype, d q_weight, d k_weight [D] in the weights' dtype, or None without
    QK-norm) from the gradients of q, k, v and the forward's inputs.

    The gradients gq [A0, A1, H, D], gk / gv [A0, A1, H_kv, D] may be None (zero) and have any strides: they are
    read in place when their two leading dims merge into rows and the head dim is dense, copied first otherwise.
    ``dqkv``: the output buffer (contiguous, ``qkv``'s shape and dtype; default: a new one). The only gradients that
    may overlap it are exact views of its own slots (:func:`difflm.model.qkv.head_slots`, where the attention kernel
    wrote them): those are transformed in place, and a value gradient in its slot is not copied.
    Raises: ValueError when ``dqkv`` is not such a buffer."""
    a0, a1 = qkv.shape[:2]
    gq = torch.zeros(a0, a1, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype) if gq is None else gq
    gk = torch.zeros(a0, a1, num_kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype) if gk is None else gk
    gv = torch.zeros(a0, a1, num_kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype) if gv is None else gv
    gq, gk, gv = (t if _rows_mergeable(t) else t.contiguous() for t in (gq, gk, gv))
    cos, sin, n_rows, geometry = _launch_args(qkv, cos, sin, head_dim)
    norm = q_weight is not None
    programs = triton.cdiv(n_rows, BWD_BLOCK_T * BWD_TILES)
    dqkv = torch.empty_like(qkv) if dqkv is None else dqkv
    if dqkv.shape != qkv.shape or dqkv.dtype != qkv.dtype or not dqkv.is_contiguous():
        raise ValueError(f"dqkv must be contiguous with qkv's shape {tuple(qkv.shape)} and dtype {qkv.dtype}; got "
                         f"{tuple(dqkv.shape)}, {dqkv.dtype}, strides {dqkv.stride()}")
    v_slot = head_slots(dqkv, num_heads, num_kv_heads, head_dim)[2]
    copy_v = not (gv.data_ptr() == v_slot.data_ptr() and gv.stride() == v_slot.stride())
    if n_rows == 0:
        return dqkv, *((torch.zeros_like(q_weight), torch.zeros_like(k_weight)) if norm else (None, None))
    partial = torch.empty(programs * num_kv_heads if norm else 1, 2, head_dim, device=qkv.device,
                          dtype=torch.float32)
    weights = (q_weight, k_weight) if norm else (qkv, qkv)
    strides = (*_row_head_strides(gq), *_row_head_strides(gk), *_row_head_strides(gv))
    qkv_heads_bwd_kernel[(programs, num_kv_heads)](
        gq, gk, gv, qkv, cos, sin, *weights, dqkv, partial, *geometry, float(eps), *strides, H=num_heads,
        HKV=num_kv_heads, D=head_dim, HB=triton.next_power_of_2(head_dim // 2), BLOCK_T=BWD_BLOCK_T,
        TILES=BWD_TILES, QK_NORM=norm, COPY_V=copy_v, num_warps=BWD_WARPS, enable_fp_fusion=False)
    if not norm:
        return dqkv, None, None
    dw = partial.sum(0)
    return dqkv, dw[0].to(q_weight.dtype), dw[1].to(k_weight.dtype)
