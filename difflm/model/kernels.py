"""Kernel sets: which modules fill the slots of the one transformer (``model.backend``).

:class:`difflm.model.transformer.Transformer` is written once; a kernel set builds what differs between backends,
slot by slot (the idea of Megatron-LM's ``ModuleSpec`` layer specs, reduced to a handful of factory methods):

=====================  ==========================================  ==========================================
slot                   ``torch`` (:class:`TorchKernels`)           ``te`` (:class:`difflm.model.te_kernels.TEKernels`)
=====================  ==========================================  ==========================================
``norm_linear``        :class:`~difflm.model.layers.LayerNormLinear`  ``te.LayerNormLinear(normalization="RMSNorm")``
``linear``             ``nn.Linear(bias=False)``                    ``te.Linear``
``norm_mlp``           :class:`~difflm.model.layers.LayerNormMLP`   ``te.LayerNormMLP(activation="swiglu")``
``norm``               :class:`~difflm.model.layers.RMSNorm`        ``te.RMSNorm``
``lm_head``            ``nn.Linear`` (vocab-parallel by DTensor TP)   ``nn.Linear``; under TP a local vocab shard
                                                                    (:class:`~difflm.parallel.vocab_parallel.VocabParallelLinear`)
``attention_core``     None (:func:`~difflm.model.attention.attend`)  ``te.DotProductAttention`` (attention_backend=te)
=====================  ==========================================  ==========================================

With ``model.fused_mlp`` the TE set's ``norm_mlp`` is :class:`~difflm.kernels.quack_mlp.ResidualNormMLP` (quack's fused
GEMMs), which also adds both residuals of the block's MLP half: it says so with ``adds_residual = True`` and
:class:`~difflm.model.transformer.Block` then calls it with the attention output and the block input.

Between the QKV projection and the attention kernel both sets run :func:`difflm.model.qkv.qkv_heads` (split into
heads, QK-norm, RoPE: two Triton kernels on CUDA, from the (cos, sin) tables of :meth:`TorchKernels.rope`), plus
the few places where a kernel set shapes the residual stream: its layout (``bshd``, or ``sbhd`` under TE's
sequence parallelism, where :meth:`enter` / :meth:`exit` scatter and gather the sequence) and the FP8 regions
(:meth:`layer_context`, :meth:`forward_context`). Parameter names and shapes are the same in both sets, so state
dicts move between them (TE adds an ``_extra_state`` per module).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from difflm.model.layers import LayerNormLinear, LayerNormMLP, RMSNorm
from difflm.model.rope import rope_tables


class TorchKernels:
    """``model.backend=torch``: plain PyTorch modules; tensor parallelism comes later from DTensor
    (:mod:`difflm.parallel.tensor_parallel`), so every module is built whole.

    Args:
        cfg: the ``model`` config (reads ``attention_backend``).
        device: where parameters are created (``"meta"`` to materialise later with ``to_empty``).
    """

    name = "torch"
    tp_size = 1
    tp_group = None
    sequence_parallel = False
    layout = "bshd"  # activations [B, S, d]

    def __init__(self, cfg, device="meta"):
        self.cfg, self.device = cfg, torch.device(device)

    # ------------------------------------------------------------------ slots
    def norm_linear(self, in_features: int, out_features: int, *, eps: float, bias: bool = False) -> nn.Module:
        """RMSNorm + column-parallel-able linear (fused QKV)."""
        with torch.device(self.device):
            return LayerNormLinear(in_features, out_features, eps, bias=bias)

    def linear(self, in_features: int, out_features: int) -> nn.Module:
        """Row-parallel-able linear without bias (attention output projection)."""
        return nn.Linear(in_features, out_features, bias=False, device=self.device)

    def norm_mlp(self, hidden: int, ffn: int, *, eps: float) -> nn.Module:
        """RMSNorm + SwiGLU MLP."""
        with torch.device(self.device):
            return LayerNormMLP(hidden, ffn, eps)

    def accumulate_weight_grads(self, module: nn.Module, *names: str) -> nn.Module:
        """``module`` (built outside the kernel set: the MoE experts) with the weights ``names`` given the kernel set's
        weight-gradient handling. The torch set leaves the gradients to autograd and returns ``module`` as it is; the
        TE set accumulates them in FP32 ``main_grad`` where it does for its own modules."""
        return module

    def norm(self, dim: int, *, eps: float, residual: bool = False) -> nn.Module:
        """RMSNorm over the last ``dim`` features; ``residual``: it normalises the residual stream (final norm)."""
        with torch.device(self.device):
            return RMSNorm(dim, eps)

    def embedding(self, vocab: int, hidden: int) -> nn.Module:
        """The token embedding (weight [vocab, hidden]); DTensor TP shards it later."""
        return nn.Embedding(vocab, hidden, device=self.device)

    def lm_head(self, hidden: int, vocab: int) -> nn.Module:
        """The LM head ``output`` (weight [vocab, hidden]); DTensor TP makes it vocab-parallel later."""
        return nn.Linear(hidden, vocab, bias=False, device=self.device)

    def attention_core(self, cfg, causal: bool, layer_number: int):
        """A layer's own attention module, or None: :func:`difflm.model.attention.attend` picks the kernel."""
        return None

    def block_init_context(self, index: int):
        """Context for building block ``index`` (FP8 weights under TE)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ residual stream
    def rope(self, angles: torch.Tensor):
        """What the layers rotate queries and keys with (:func:`difflm.model.qkv.qkv_heads`): (cos, sin) tables for
        :attr:`layout`."""
        return rope_tables(angles, self.layout)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding output [B, S, d] as the residual stream of this kernel set."""
        return x

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream back as [B, S, d] (before the LM head)."""
        return x

    def layer_context(self, index: int):
        """Context around block ``index``'s forward (FP8 off for BF16 blocks under TE)."""
        return contextlib.nullcontext()

    def forward_context(self, num_tokens: int):
        """Context around a whole forward of ``num_tokens`` tokens (BF16 for shapes FP8 GEMMs cannot take)."""
        return contextlib.nullcontext()

    def tp_shards(self):
        """This rank's tensor-parallel place for parameters that are plain-tensor shards
        (:class:`difflm.parallel.te_tensor_parallel.TensorParallelShards`), or None: DTensor carries its own."""
        return None


__all__ = ["TorchKernels"]
