"""Pure-PyTorch layers whose parameter names match Transformer Engine's modules.

TE fuses the pre-norm into the next linear layer (``te.LayerNormLinear``: ``layer_norm_weight`` +
``weight``; ``te.LayerNormMLP``: ``layer_norm_weight`` + ``fc1_weight`` + ``fc2_weight``). These modules
keep those names and shapes, so a state dict moves between the ``torch`` and ``te`` backends unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim.

    Uses ``torch.nn.functional.rms_norm``; statistics are computed in FP32 for BF16/FP16 inputs.
    """
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale ``weight`` [dim] (name as ``te.RMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNormLinear(nn.Module):
    """RMSNorm followed by a linear map, as ``te.LayerNormLinear(normalization="RMSNorm")``.

    Args:
        in_features / out_features: ``weight`` is [out_features, in_features].
        bias: add a ``bias`` [out_features] (TE's name; e.g. Qwen2's QKV bias, ``model.qkv_bias``).
    Shapes: x [..., in_features] -> [..., out_features].
    """

    def __init__(self, in_features: int, out_features: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight, self.bias)


class LayerNormMLP(nn.Module):
    """RMSNorm + SwiGLU MLP (Shazeer 2020, eq. 6), as ``te.LayerNormMLP(activation="swiglu")``.

    ``fc1_weight`` is [2 * ffn, hidden]: rows ``[:ffn]`` are the gate (SiLU) half and ``[ffn:]`` the
    linear half, TE's split for ``swiglu``. ``fc2_weight`` is [hidden, ffn].
    Shapes: x [..., hidden] -> [..., hidden].
    """

    def __init__(self, hidden: int, ffn: int, eps: float):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight)
        gate, up = h.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)
