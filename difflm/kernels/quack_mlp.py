"""The MLP half of a block on quack's fused GEMMs (``model.fused_mlp=true``): ``y = s + W2 swiglu(W1 rmsnorm(s))``
with ``s = residual + branch`` (the attention output), as one autograd function.

What it fuses, against TE's ``LayerNormMLP`` plus the block's two residual adds (both BF16):

* the residual add after attention, inside the RMSNorm kernel (quack ``rmsnorm_fwd(residual=...)`` writes ``s`` and
  the normed ``h`` in one pass);
* SwiGLU (Shazeer 2020, eq. 6) in the epilogue of the fc1 GEMM (quack ``gemm_gated``: writes the pre-activation
  for the backward and the activation for fc2), and its gradient in the epilogue of fc2's input-gradient GEMM
  (``gemm_dgated``: reads the saved pre-activation, writes its gradient and recomputes the activation that fc2's
  weight gradient needs);
* the residual add after the MLP as fc2's ``C`` operand (quack ``gemm_add``: ``out = postact @ W2^T + s``);
* in the backward, the gradient that reaches ``s`` through the residual path added inside the RMSNorm backward
  (``rmsnorm_bwd(dresidual_out=...)``).

So the memory-bound passes of TE's path (the SwiGLU kernels, two residual adds and one gradient sum) leave only
the GEMMs and the norm. quack (Tri Dao's CuTe-DSL kernels, github.com/Dao-AILab/quack, the library flash-attn 4
ships with) compiles them for Hopper (SM90) and Blackwell (SM100). Arithmetic: BF16 operands, FP32 accumulation;
the activation is computed from the FP32 accumulator (TE computes it from the BF16-rounded pre-activation), so the
two paths agree to BF16 rounding, not bitwise.

Parameters have TE's names and shapes (``layer_norm_weight`` [d], ``fc1_weight`` [2f, d] with the gate half first,
``fc2_weight`` [d, f]; FP32 masters cast to BF16 once per optimizer step and reused by every micro-batch,
:func:`difflm.model.te_kernels.weights_cast_once_per_step`) and the module carries an empty
``_extra_state`` like every TE module, so a checkpoint moves between ``model.fused_mlp=true`` and ``false`` unchanged.
Weight gradients accumulate in place into FP32 ``main_grad`` when the kernel set gave the weights one
(:func:`difflm.model.te_kernels.accumulate_into_grad`), otherwise they are returned to autograd in FP32.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Optional

import torch
from torch import nn

from difflm.kernels.main_grad import weights_cast_once_per_step

# The fc1 weight [2f, d] holds [gate; up] halves (TE's swiglu split). quack's gated epilogue pairs neighbouring
# columns, so it reads this "concat" layout through its concat_layout option and keeps the pre-activation and its
# gradient interleaved in between (the composition of quack.linear's gated ops).
FC1_FWD = ("B", "bias")
FC1_DGRAD = ("B",)
FC1_WGRAD_INTO = ("C", "out")
FC1_WGRAD = ("out",)
# quack keeps autotuning results on disk (~/.quack/cache, QUACK_CACHE_DIR) only when asked, and reads the switch when
# quack.gemm_interface is imported: a shape is then tuned once per machine, not once per run.
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")


def quack_unavailable_reason(device: Optional[torch.device] = None, key: str = "model.fused_mlp") -> Optional[str]:
    """Why ``model.fused_mlp=true`` cannot run here (no CUDA, a GPU older than Hopper, quack missing); None when it
    can. ``device``: the run's device (None: the current CUDA device)."""
    if device is not None and torch.device(device).type != "cuda":
        return f"{key}=true runs quack's CUDA kernels and this run is on {torch.device(device).type}: set {key}=false"
    if not torch.cuda.is_available():
        return f"{key}=true runs quack's CUDA kernels and no GPU is visible: set {key}=false"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return (f"{key}=true runs quack's Hopper/Blackwell GEMMs (compute capability 9.x or 10.x) and this GPU is "
                f"{major}.x: set {key}=false")
    try:
        importlib.import_module("quack.gemm_interface")
        cutlass = importlib.import_module("cutlass")
    except Exception as err:  # ImportError, or the CuTe DSL failing to load its libraries
        return (f"{key}=true needs quack-kernels (pip install quack-kernels; flash-attn 4 installs it), which could "
                f"not be imported ({type(err).__name__}: {err}): set {key}=false")
    return outside_site_packages_reason(cutlass.__file__, key)


def outside_site_packages_reason(cutlass_file: str, key: str = "model.fused_mlp") -> Optional[str]:
    """Why quack cannot compile its GEMMs with the CuTe DSL installed at ``cutlass_file``, or None.

    quack keys its compiled kernels by the code they call (``quack.gemm_runtime.identity``) and takes only code under
    a ``site-packages`` / ``dist-packages`` directory (or the standard library) as fixed library code; from anywhere
    else (``pip install --target DIR`` on PYTHONPATH) it walks into the DSL's internals and fails with "has no
    fail-closed semantic key" at the first GEMM."""
    path = os.path.abspath(cutlass_file)
    if any(f"{os.sep}{d}{os.sep}" in path for d in ("site-packages", "dist-packages")):
        return None
    root = os.path.dirname(os.path.dirname(path))
    return (f"{key}=true runs quack's GEMMs, which compile only when the CuTe DSL is installed under a directory named "
            f"site-packages, and it is imported from {root}: install quack-kernels and nvidia-cutlass-dsl with pip into "
            f"the environment, or put a link named site-packages to {root} on PYTHONPATH instead; or set {key}=false")


@functools.lru_cache(maxsize=None)
def _notice_tuning() -> None:
    """Say once per process (the cache) that the first training step waits for quack's autotuning."""
    print("difflm: model.fused_mlp_autotune=true: quack tunes the MLP (and MoE expert) GEMMs at the first training "
          "step of each "
          "shape (about 2.5 min at model=1.7b, micro-batch 8 x 4096 on an H200; kept in quack's disk cache, "
          "QUACK_CACHE_DIR, so once per machine)", file=sys.stderr, flush=True)


def most_rows_so_far(module: torch.nn.Module, rows: int) -> bool:
    """Whether ``rows`` is at least every row count ``module`` was asked about before (then recorded on it)."""
    if rows < getattr(module, "_most_tuned_rows", 0):
        return False
    module._most_tuned_rows = rows
    return True


def tuned_call(x: torch.Tensor, autotune: bool, module: Optional[torch.nn.Module] = None) -> bool:
    """Whether quack autotunes this call: ``autotune``, a forward that records gradients, and (with ``module``) a row
    count ``x.numel() / x.shape[-1]`` at least the largest that ``module`` has seen in such a call. Steps shortened
    at random (``objective.random_length_prob``) then run quack's default tiles instead of tuning every new length;
    the full-length shape is tuned once (kept in quack's disk cache). Says so once.

    Raises: DifflmError (one line) when ``x`` is on the CPU or not BF16/FP16 (quack's GEMMs take BF16/FP16 operands).
    """
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        from difflm.errors import DifflmError

        raise DifflmError(f"model.fused_mlp=true runs BF16/FP16 CUDA kernels and got {x.dtype} on "
                          f"{x.device.type}: use precision=bf16 on a GPU, or model.fused_mlp=false")
    tuned = autotune and torch.is_grad_enabled()
    if tuned and module is not None:
        tuned = most_rows_so_far(module, x.numel() // max(x.shape[-1], 1))
    if tuned:
        _notice_tuning()
    return tuned


class TEStateLayout:
    """TE modules carry FP8 metadata as ``_extra_state``; the quack modules have none but keep the entry (empty), so
    state dicts keep one layout with and without ``model.fused_mlp``."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _weight_grad(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, into: tuple, alone: tuple, tuned: bool):
    """``a @ b`` (the gradient of ``weight``): added in place into ``weight.main_grad`` when its gradients accumulate
    there (returns None, as TE's modules do), else returned in the weight's dtype. ``tuned``: quack autotunes the GEMM."""
    from quack.gemm_interface import gemm, gemm_add_inplace

    if getattr(weight, "accumulates_in_main_grad", False) and getattr(weight, "main_grad", None) is not None:
        gemm_add_inplace(a, b, weight.main_grad, dynamic_scheduler=True, tuned=tuned, concat_layout=into or None)
        return None
    return gemm(a, b, out_dtype=weight.dtype, dynamic_scheduler=True, tuned=tuned, concat_layout=alone or None)


class _ResidualNormMLPFunction(torch.autograd.Function):
    """Forward / backward of :class:`ResidualNormMLP` (see the module docstring for what each kernel fuses)."""

    @staticmethod
    def forward(ctx, branch, residual, norm_weight, fc1_weight, fc2_weight, w1, w2, eps, tuned):
        from quack.gemm_interface import gemm_add, gemm_gated
        from quack.rmsnorm import rmsnorm_fwd

        shape, dtype = branch.shape, branch.dtype
        need_grad = any(ctx.needs_input_grad[:5])
        h, s, rstd = rmsnorm_fwd(_flat(branch), norm_weight, residual=_flat(residual.to(dtype)), eps=eps,
                                 store_rstd=need_grad)
        preact, postact = gemm_gated(h, w1.T, activation="swiglu", store_preact=need_grad, tuned=tuned,
                                     concat_layout=FC1_FWD)
        out = gemm_add(postact, w2.T, s, tuned=tuned)
        if need_grad:
            ctx.save_for_backward(s, norm_weight, rstd, h, preact, w1, w2)
            ctx.weights = (fc1_weight, fc2_weight)
            ctx.shape, ctx.tuned = shape, tuned
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        from quack.gemm_interface import gemm, gemm_dgated
        from quack.rmsnorm import rmsnorm_bwd

        s, norm_weight, rstd, h, preact, w1, w2 = ctx.saved_tensors
        fc1_weight, fc2_weight = ctx.weights
        dy, tuned = _flat(dout), ctx.tuned
        # dpreact = swiglu'(preact) * (dy @ W2), and the activation recomputed for fc2's weight gradient
        dpreact, postact = gemm_dgated(dy, w2, preact, activation="swiglu", dynamic_scheduler=True, tuned=tuned)
        dw2 = _weight_grad(fc2_weight, dy.T, postact, (), (), tuned) if ctx.needs_input_grad[4] else None
        dh = gemm(dpreact, w1, dynamic_scheduler=True, tuned=tuned, concat_layout=FC1_DGRAD)
        dw1 = (_weight_grad(fc1_weight, dpreact.T, h, FC1_WGRAD_INTO, FC1_WGRAD, tuned)
               if ctx.needs_input_grad[3] else None)
        # ds = dy (the residual path) + the norm's input gradient, in one kernel
        ds, dnorm, _, _ = rmsnorm_bwd(s, norm_weight, dh, rstd, dresidual_out=dy, has_residual=True)
        ds = ds.view(ctx.shape)
        return ds, ds, dnorm, dw1, dw2, None, None, None, None


class ResidualNormMLP(TEStateLayout, nn.Module):
    """``residual + branch + MLP(RMSNorm(residual + branch))``: a block's MLP half with both residual adds, on quack's
    fused kernels (module docstring). Built by :meth:`difflm.model.te_kernels.TEKernels.norm_mlp` for
    ``model.fused_mlp=true``; :class:`difflm.model.transformer.Block` calls it with the attention output and the
    block input (``adds_residual``).

    Args:
        hidden, ffn: d and f (``fc1_weight`` [2f, d]: gate rows first; ``fc2_weight`` [d, f]).
        eps: the RMSNorm epsilon.
        autotune: forwards that record gradients (training) let quack autotune each GEMM shape (its
            ``tuned=True``: ~2.5 min at the 1.7B micro-batch-8 shape, once per shape and machine, kept in quack's disk
            cache; ``model.fused_mlp_autotune``); other forwards and ``autotune=False`` use quack's default tiles.
        device: where the parameters are created.
    Shapes: ``branch``, ``residual`` [..., d] (BF16 residual stream; [R, d] rows of the last block) -> [..., d] in
    ``branch``'s dtype.
    Raises: DifflmError (one line) when called on CPU tensors or in FP32 (quack's GEMMs take BF16/FP16 operands).
    """

    adds_residual = True

    def __init__(self, hidden: int, ffn: int, eps: float, autotune: bool = False, device=None):
        super().__init__()
        self.eps, self.autotune = eps, bool(autotune)
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden, device=device))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn, device=device))

    def forward(self, branch: torch.Tensor, residual: torch.Tensor, varying_rows: bool = False) -> torch.Tensor:
        """``varying_rows``: the row count changes from call to call (the last block at the loss rows,
        :mod:`difflm.model.loss_rows`), so quack's default tiles, never autotuning (it would tune every count)."""
        tuned = tuned_call(branch, self.autotune and not varying_rows, self)
        w1, w2 = weights_cast_once_per_step(self, (self.fc1_weight, self.fc2_weight), branch.dtype)
        return _ResidualNormMLPFunction.apply(branch, residual, self.layer_norm_weight, self.fc1_weight,
                                              self.fc2_weight, w1, w2, self.eps, tuned)


__all__ = ["ResidualNormMLP", "outside_site_packages_reason", "quack_unavailable_reason"]
