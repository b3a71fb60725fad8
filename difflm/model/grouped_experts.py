"""The MoE experts' grouped GEMMs on the GPU when their weight gradients accumulate in FP32 ``main_grad`` (one GPU,
the TE kernel set: :mod:`difflm.kernels.main_grad`): BF16 (:class:`GroupedSwiGLUMainGrad`) and FP8
(:class:`GroupedSwiGLUFP8`, ``model.moe.fp8_experts`` inside an FP8 region).

Both run the routed experts ``y_r = (SiLU(x_r W1g_e^T) * x_r W1u_e^T) W2_e^T`` (Shazeer 2020, eq. 6) over rows ``x``
sorted by expert, with groups given by ``offs = cumsum(rows per expert)``, and write their own backward so that:

* the weights are converted once per optimizer step (BF16 copies, or FP8 copies with scales) instead of in every
  micro-batch's forward, as autograd's ``w.bfloat16()`` does;
* the BF16 weight gradients are added straight into the FP32 ``main_grad`` (Megatron-LM's
  ``gradient_accumulation_fusion``) instead of being cast to FP32 and summed into ``.grad`` by autograd.

With E experts of d x f and few rows per expert, that weight traffic (3 E d f values read and written several times
per micro-batch) rivals the GEMMs. The modules fall back to autograd through ``torch._grouped_mm``
(:class:`difflm.model.moe.GroupedExperts`) wherever these do not apply.
"""
from __future__ import annotations

import functools

import torch

from difflm.kernels.compiled import fused_on_gpu
from difflm.kernels.quack_experts import add_weight_grad

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec; Micikevicius et al. 2022, table 1)
FP8_GROUP_ROWS = 16  # rows per expert group are padded to this multiple for the FP8 grouped GEMM


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., 2f] rows [gate; up] -> SiLU(gate) * up, [..., f] (Shazeer 2020, eq. 6)."""
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu` at ``h`` [R, 2f] for the output gradient ``da`` [R, f] -> [R, 2f] BF16,
    computed in FP32: d/dgate = da * up * s (1 + gate (1 - s)) with s = sigmoid(gate), d/dup = da * SiLU(gate)."""
    gate, up = (t.float() for t in h.chunk(2, dim=-1))
    s = torch.sigmoid(gate)
    da = da.float()
    return torch.cat([da * up * s * (1 + gate * (1 - s)), da * gate * s], dim=-1).to(torch.bfloat16)


def _add_weight_grad(master: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """``master.main_grad[e] += a_e^T b_e`` for the row groups e of ``offs`` (a [R, m], b [R, n] BF16): the weight
    gradient of one expert GEMM, a 2-D x 2-D ``torch._grouped_mm`` with its groups along the contraction."""
    if master.requires_grad:
        master.main_grad.add_(torch._grouped_mm(a.t(), b, offs=offs))


@functools.lru_cache(maxsize=None)
def _quack_runs_on(device: torch.device) -> bool:
    from difflm.kernels.quack_mlp import quack_unavailable_reason

    return quack_unavailable_reason(device) is None


def _add_weight_grad_in_epilogue(master: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """:func:`_add_weight_grad` by quack's grouped GEMM where quack runs
    (:func:`difflm.kernels.quack_experts.add_weight_grad`, as the fused BF16 experts do), else by
    :func:`_add_weight_grad` (a BF16 GEMM, then a memory-bound add)."""
    if a.is_cuda and _quack_runs_on(a.device):
        add_weight_grad(master, a, b, torch.nn.functional.pad(offs, (1, 0)))
    else:
        _add_weight_grad(master, a, b, offs)


class GroupedSwiGLUMainGrad(torch.autograd.Function):
    """The experts' two grouped GEMMs with the SwiGLU between them, in BF16, weight gradients into ``main_grad``.

    Forward: x [R, d] BF16 rows sorted by expert; ``offs`` [E] int32 = cumsum of the rows per expert (the last equals
        R); ``fc1_weight`` [E, 2f, d] / ``fc2_weight`` [E, d, f] the FP32 masters (their ``main_grad`` receives the
        gradients; no gradient is returned for them); ``w1``, ``w2`` their BF16 copies. -> [R, d] BF16.
    Backward (per expert e, rows r of e): ``dW2_e += dy_r^T a_r``, ``da = dy W2_e``, :func:`swiglu_backward`,
        ``dW1_e += dh_r^T x_r``, ``dx = dh W1_e``: each a ``torch._grouped_mm``.
    """

    @staticmethod
    def forward(ctx, x, offs, fc1_weight, fc2_weight, w1, w2):
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)  # [R, 2f]: gate, up
        y = torch._grouped_mm(swiglu(h), w2.transpose(-2, -1), offs=offs)
        ctx.save_for_backward(x, h, offs, w1, w2)
        ctx.masters = (fc1_weight, fc2_weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, offs, w1, w2 = ctx.saved_tensors
        fc1_weight, fc2_weight = ctx.masters
        dy = dy.contiguous().to(torch.bfloat16)
        _add_weight_grad(fc2_weight, dy, swiglu(h), offs)
        dh = swiglu_backward(h, torch._grouped_mm(dy, w2, offs=offs))
        _add_weight_grad(fc1_weight, dh, x, offs)
        dx = torch._grouped_mm(dh, w1, offs=offs) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None, None


# ------------------------------------------------------------------ FP8
def fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 (E4M3) quantisation: t [..., K] -> (q [..., K] float8_e4m3fn, scale [...] FP32) with
    ``t ~= q * scale[..., None]``, ``scale = amax(|row|) / 448`` (per-row "axiswise" scaling as in torchao's
    ``float8`` rowwise recipe; an all-zero row gets a tiny scale and stays zero)."""
    amax = t.abs().amax(dim=-1).float().clamp(min=1e-12)
    q = (t.float() * (E4M3_MAX / amax).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, amax / E4M3_MAX


@fused_on_gpu
def weight_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_rows` of a weight stack [E, N, K] along K (as stored)."""
    return fp8_rows(w)


@fused_on_gpu
def transposed_weight_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_rows` of a weight stack [E, N, K] transposed and made contiguous, [E, K, N], along N."""
    return fp8_rows(w.transpose(-2, -1).contiguous())


@fused_on_gpu
def padded_fp8_rows(x: torch.Tensor, dest: torch.Tensor, total: int):
    """Rows x [R, K] scattered to ``dest`` [R] of a zeroed [total, K] buffer (:func:`padded_groups`), then
    :func:`fp8_rows` of that buffer -> (padded [total, K] in x's dtype, q [total, K] FP8, scale [total] FP32)."""
    padded = x.new_zeros(total, x.shape[1])
    padded[dest] = x
    return (padded, *fp8_rows(padded))


@fused_on_gpu
def swiglu_fp8_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_rows` of :func:`swiglu` (h [R, 2f] -> q [R, f] FP8, scale [R] FP32)."""
    return fp8_rows(swiglu(h))


recomputed_swiglu = fused_on_gpu(swiglu)


@fused_on_gpu
def swiglu_backward_fp8_rows(h: torch.Tensor, da: torch.Tensor):
    """:func:`swiglu_backward` and its :func:`fp8_rows` -> (dh [R, 2f] BF16, q [R, 2f] FP8, scale [R] FP32)."""
    dh = swiglu_backward(h, da)
    return (dh, *fp8_rows(dh))


def fp8_expert_weights(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The FP8 copies of the expert weights the forward and the input-gradient GEMMs read, each quantised along its
    contraction dimension with one scale per output column (rows of the stored tensor):

    w1 [E, 2f, d] -> (w1 along d, scales [E, 2f]) for ``x W1^T``; (w1^T [E, d, 2f] along 2f, scales [E, d]) for
    ``dh W1``; w2 [E, d, f] -> (w2 along f, [E, d]) for ``a W2^T``; (w2^T [E, f, d] along d, [E, f]) for ``dy W2``.
    Returns the eight tensors in that order (FP8 row-major data, FP32 scales)."""
    out = []
    for w in (w1, w2):
        out += [*weight_fp8_rows(w), *transposed_weight_fp8_rows(w)]
    return tuple(out)


def padded_groups(counts: torch.Tensor, rows: int, align: int = FP8_GROUP_ROWS):
    """Where each row goes when every expert's group of rows is padded to a multiple of ``align`` (zero rows), without
    a host sync: ``counts`` [E] rows per expert (sum = ``rows``) -> (``dest`` [rows] int64 index of each row in the
    padded buffer, ``offs`` [E] int32 padded group ends, ``total`` the static buffer size). The last group absorbs the
    slack so that ``offs[-1] == total``: every row of the buffer belongs to a group."""
    e = counts.numel()
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts, output_size=rows)
    dest = padded_starts[expert] + torch.arange(rows, device=counts.device) - starts[expert]
    total = -(-(rows + (align - 1) * e) // align) * align
    offs = torch.cumsum(padded, 0).to(torch.int32)
    offs[-1] = total
    return dest, offs, total


def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """``torch._scaled_grouped_mm`` with row-wise scales, BF16 out: a [M, K] FP8 row-major, b [E, K, N] FP8
    column-major, scale_a [M], scale_b [E, N] (dequantising scales) -> [M, N] BF16 (PyTorch's FP8 grouped GEMM,
    the call torchao's ``_Float8GroupedMM`` makes). A module attribute so that CPU tests can emulate it."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)


class GroupedSwiGLUFP8(torch.autograd.Function):
    """:class:`GroupedSwiGLUMainGrad` with the forward and input-gradient GEMMs in FP8 (E4M3, row-wise scales on the
    activations and gradients, per-output-column scales on the weights) through ``torch._scaled_grouped_mm``; the
    weight-gradient GEMMs stay BF16 and add into the FP32 ``main_grad``, in quack's GEMM epilogue where quack runs
    (:func:`_add_weight_grad_in_epilogue`). Rows are padded per expert to :data:`FP8_GROUP_ROWS`
    (:func:`padded_groups`). The padding, the row-wise quantisations and the SwiGLU around the GEMMs are compiled
    regions on the GPU (:func:`difflm.kernels.compiled.fused_on_gpu`): five in all, not dozens of kernels.

    Forward: x [R, d] BF16 sorted by expert; ``counts`` [E] int64 rows per expert; the FP32 masters ``fc1_weight``,
        ``fc2_weight`` (gradients into ``main_grad``, none returned); ``fp8`` the eight tensors of
        :func:`fp8_expert_weights`. -> [R, d] BF16.
    """

    @staticmethod
    def forward(ctx, x, counts, fc1_weight, fc2_weight, *fp8):
        w1q, s1, w1tq, s1t, w2q, s2, w2tq, s2t = fp8
        dest, offs, total = padded_groups(counts, x.shape[0])
        xp, xq, x_scale = padded_fp8_rows(x, dest, total)
        h = scaled_grouped_mm(xq, w1q.transpose(-2, -1), x_scale, s1, offs=offs)  # [P, 2f]
        aq, a_scale = swiglu_fp8_rows(h)
        y = scaled_grouped_mm(aq, w2q.transpose(-2, -1), a_scale, s2, offs=offs)
        ctx.save_for_backward(xp, h, dest, offs, w1tq, s1t, w2tq, s2t)
        ctx.masters = (fc1_weight, fc2_weight)
        return y[dest]

    @staticmethod
    def backward(ctx, dy):
        xp, h, dest, offs, w1tq, s1t, w2tq, s2t = ctx.saved_tensors
        fc1_weight, fc2_weight = ctx.masters
        dyp, dyq, dy_scale = padded_fp8_rows(dy.to(torch.bfloat16), dest, xp.shape[0])
        _add_weight_grad_in_epilogue(fc2_weight, dyp, recomputed_swiglu(h), offs)
        da = scaled_grouped_mm(dyq, w2tq.transpose(-2, -1), dy_scale, s2t, offs=offs)
        dh, dhq, dh_scale = swiglu_backward_fp8_rows(h, da)
        _add_weight_grad_in_epilogue(fc1_weight, dh, xp, offs)
        if not ctx.needs_input_grad[0]:
            return (None,) * 12
        dx = scaled_grouped_mm(dhq, w1tq.transpose(-2, -1), dh_scale, s1t, offs=offs)[dest]
        return (dx, None, None, None) + (None,) * 8


def fp8_grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs row-wise FP8 for ``x``'s device: CUDA, compute capability 9.0+."""
    return (x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and hasattr(torch, "float8_e4m3fn")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


__all__ = ["E4M3_MAX", "FP8_GROUP_ROWS", "GroupedSwiGLUFP8", "GroupedSwiGLUMainGrad", "fp8_expert_weights",
           "fp8_grouped_mm_supported", "fp8_rows", "padded_fp8_rows", "padded_groups",
           "recomputed_swiglu", "scaled_grouped_mm", "swiglu", "swiglu_backward", "swiglu_backward_fp8_rows",
           "swiglu_fp8_rows", "transposed_weight_fp8_rows", "weight_fp8_rows"]
