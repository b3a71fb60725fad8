"""The attention half's input on quack's kernels (``model.fused_mlp=true``): ``y = W rmsnorm(x)`` that also hands ``x``
on as the block's residual, so the residual's gradient is added inside the RMSNorm backward.

In a pre-norm block the input ``x`` feeds two branches: the norm before the QKV projection and the residual add after
attention. Autograd sums their gradients with one more pass over the activations (read two, write one, per layer and
micro-batch). :class:`ResidualNormLinear` returns ``x`` itself as a second output; the block adds the attention
output to that (inside :class:`difflm.kernels.quack_mlp.ResidualNormMLP`'s norm kernel), so the residual's gradient
comes back through this function, whose backward hands it to quack's ``rmsnorm_bwd(dresidual_out=...)``: the norm's
input gradient and the residual's in one kernel. The projection is quack's GEMM (``tuned``: autotuned per shape, as the
MLP's), its weight gradient accumulated in place into FP32 ``main_grad`` as TE's modules do.

Parameters have TE ``LayerNormLinear``'s names and shapes (``layer_norm_weight`` [d], ``weight`` [out, d]; FP32
masters cast to BF16 once per optimizer step, :func:`difflm.model.te_kernels.weights_cast_once_per_step`) and an empty
``_extra_state``, so checkpoints move between the fused and TE modules unchanged. Arithmetic: BF16 operands, FP32
accumulation and norm statistics, as TE's.
"""
from __future__ import annotations

import torch
from torch import nn

from difflm.kernels.main_grad import weights_cast_once_per_step
from difflm.kernels.quack_mlp import TEStateLayout, _flat, tuned_call, _weight_grad


class _NormLinearFunction(torch.autograd.Function):
    """Forward / backward of :class:`ResidualNormLinear` (module docstring)."""

    @staticmethod
    def forward(ctx, x, norm_weight, weight, w, eps, tuned):
        from quack.gemm_interface import gemm
        from quack.rmsnorm import rmsnorm_fwd

        shape = x.shape
        need_grad = any(ctx.needs_input_grad[:3])
        ctx.set_materialize_grads(False)  # an unused residual output's gradient stays None, not a tensor of zeros
        h, _, rstd = rmsnorm_fwd(_flat(x), norm_weight, eps=eps, store_rstd=need_grad)
        y = gemm(h, w.T, tuned=tuned)
        if need_grad:
            ctx.save_for_backward(x, norm_weight, rstd, h, w)
            ctx.weight, ctx.shape, ctx.tuned = weight, shape, tuned
        return y.view(*shape[:-1], y.shape[-1]), x

    @staticmethod
    def backward(ctx, dy, dresidual):
        from quack.gemm_interface import gemm
        from quack.rmsnorm import rmsnorm_bwd

        x, norm_weight, rstd, h, w = ctx.saved_tensors
        dy, tuned = _flat(dy), ctx.tuned
        dh = gemm(dy, w, dynamic_scheduler=True, tuned=tuned)
        dw = _weight_grad(ctx.weight, dy.T, h, (), (), tuned) if ctx.needs_input_grad[2] else None
        # dx = the norm's input gradient + the residual path's, in one kernel
        dres = None if dresidual is None else _flat(dresidual.to(x.dtype))
        dx, dnorm, _, _ = rmsnorm_bwd(_flat(x), norm_weight, dh, rstd, dresidual_out=dres)
        return dx.view(ctx.shape), dnorm, dw, None, None, None


class ResidualNormLinear(TEStateLayout, nn.Module):
    """``W RMSNorm(x)`` with ``x`` handed on as the residual (module docstring): the QKV projection of
    :class:`difflm.model.transformer.Attention` under ``model.fused_mlp=true``, built by
    :meth:`difflm.model.te_kernels.TEKernels.norm_linear`.

    ``forward(x)`` returns ``W RMSNorm(x)`` like TE's ``LayerNormLinear``; ``forward(x, pass_residual=True)`` returns it
    together with ``x`` as a tensor whose gradient flows back through this module's norm kernel (the block calls that,
    through ``__call__``, so the forward pre-hook that attaches ``main_grad`` runs).

    Args:
        in_features, out_features: d and the output width (``weight`` [out, d]).
        eps: the RMSNorm epsilon.
        autotune: forwards that record gradients let quack autotune the GEMM shapes (``model.fused_mlp_autotune``).
        device: where the parameters are created.
    Shapes: ``x`` [..., d] BF16/FP16 CUDA -> [..., out] in ``x``'s dtype.
    Raises: DifflmError (one line) for CPU tensors or FP32 inputs.
    """

    passes_residual = True

    def __init__(self, in_features: int, out_features: int, eps: float, autotune: bool = False, device=None):
        super().__init__()
        self.eps, self.autotune = eps, bool(autotune)
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=device))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))

    def forward(self, x: torch.Tensor, pass_residual: bool = False):
        if x.is_cuda and torch.is_autocast_enabled("cuda"):  # the first block's input (the embedding's) is FP32
            x = x.to(torch.get_autocast_dtype("cuda"))
        tuned = tuned_call(x, self.autotune, self)
        (w,) = weights_cast_once_per_step(self, (self.weight,), x.dtype)
        y, residual = _NormLinearFunction.apply(x, self.layer_norm_weight, self.weight, w, self.eps, tuned)
        return (y, residual) if pass_residual else y


__all__ = ["ResidualNormLinear"]
