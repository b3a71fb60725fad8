"""Bytes one block saves for its backward, per token, for the kernel set a run uses.

Which modules fill a block's slots (:mod:`difflm.model.kernels`) decides what stays in memory between the forward and
the backward, so the planner counts each kernel set's saved tensors from its code:

* ``model.backend=torch`` (:func:`torch_bytes_per_token`): the formula of :mod:`difflm.plan.memory`'s docstring
  (FP32 residual stream, ``q, k, v`` before and after RoPE, four ``f``-wide MLP tensors), checked against the traced
  step (:mod:`difflm.plan.trace`).
* ``model.backend=te`` (:func:`te_saved_bytes`): Transformer Engine's modules, or quack's fused ones with
  ``model.fused_mlp``, with the residual stream in the compute dtype (:meth:`difflm.model.te_kernels.TEKernels.enter`)
  and, under ``precision=fp8``, FP8 copies of the GEMM inputs in place of BF16 ones. Written from TE 2.20's
  ``_LayerNormLinear.forward`` / ``_LayerNormMLP._forward`` / ``_linear_forward_impl`` (``transformer_engine/pytorch/
  module/layernorm_linear.py``, ``layernorm_mlp.py``, ``linear.py``: what they pass to ``prepare_for_saving``), its
  ``FusedAttnFunc.forward`` (``attention/dot_product_attention/backends.py``), and difflm's own autograd functions
  (below). The FP8 byte counts are those of the per-tensor recipes (``delayed``, ``current``) on Hopper, where an
  FP8 GEMM input kept for the weight gradient is stored transposed ("columnwise").

Beside the activations, the weight state the TE kernel set keeps through every phase of a step
(:func:`step_state_bytes`): the FP32 ``main_grad`` buffers of the weights whose gradients accumulate in place, and
their copies cast once per step (FP8 workspaces with their transposes, BF16 tables).

``model.*=auto`` is planned as :func:`difflm.model.auto_kernels.choose_kernels` resolves it on a CUDA GPU with
difflm's ``te``, ``flash`` and ``quack`` extras installed (:func:`kernel_set`), the machine the shipped rates (H100,
H200) describe; ``difflm-plan`` prints the set it planned. Give ``model.backend=torch`` (etc.) to plan another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from difflm.kernels import main_grad

FP32, FP8 = 4, 1  # bytes per element: RMSNorm's saved 1/rms and the log-sum-exp; an FP8 copy


@dataclass(frozen=True)
class KernelSet:
    """The kernels that decide a block's saved tensors.

    Attributes:
        backend: ``torch`` or ``te`` (``model.backend``).
        attention: ``sdpa``, ``te``, ``flash`` or ``flex`` (``model.attention_backend``).
        fused_mlp: quack's norm + GEMM modules in the QKV and MLP slots (``model.fused_mlp``, TE kernel set only).
        fp8: TE's GEMMs in FP8 (``precision=fp8``, TE kernel set only).
        fp8_recipe: ``precision.fp8_recipe`` (``block`` / ``mxfp8`` keep the SwiGLU output both ways).
        qkv_flash: attention through :func:`difflm.kernels.qkv_flash.qkv_flash_attention` (FlashAttention 4 reads
            the value heads in place, so no dense ``v`` is saved).
        fused_experts: the MoE experts on quack's grouped GEMMs (``model.moe.fused_experts``: SwiGLU and the
            ``main_grad`` accumulation in their epilogues).
        fp8_experts: the MoE experts' forward and input-gradient GEMMs in FP8 (``model.moe.fp8_experts`` under
            ``precision=fp8``: :class:`difflm.model.grouped_experts.GroupedSwiGLUFP8`, with row-wise quantisation
            and per-expert padding as compiled regions).
        fused_cross_entropy: TE's fused cross-entropy at the loss (``model.fused_cross_entropy``), which runs under
            either kernel set wherever Transformer Engine is installed
            (:func:`difflm.objectives.cross_entropy.token_cross_entropy`); ``model.fused_cross_entropy=false`` plans
            a machine without it.
    """

    backend: str = "torch"
    attention: str = "sdpa"
    fused_mlp: bool = False
    fp8: bool = False
    fp8_recipe: str = "delayed"
    qkv_flash: bool = False
    fused_experts: bool = False
    fp8_experts: bool = False
    fused_cross_entropy: bool = False

    def describe(self) -> str:
        """One line: ``te kernels, flash attention (FA4 over the QKV output), quack fused MLP, FP8 (delayed)``."""
        parts = [f"{self.backend} kernels", f"{self.attention} attention" + (" (FA4 over the QKV output)"
                                                                             if self.qkv_flash else "")]
        if self.fused_mlp:
            parts.append("quack fused MLP")
        if self.fused_experts:
            parts.append("quack fused experts")
        if self.fp8_experts:
            parts.append("FP8 experts")
        if self.fp8:
            parts.append(f"FP8 ({self.fp8_recipe})")
        if self.fused_cross_entropy:
            parts.append("TE fused cross-entropy")
        return ", ".join(parts)


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() == "true"


def kernel_set(cfg, layout) -> KernelSet:
    """The :class:`KernelSet` of the run ``cfg`` (the composed train config) under ``layout`` (a
    :class:`difflm.plan.memory.Layout`). ``model.*=auto`` values are resolved on a copy as ``choose_kernels`` would on
    a CUDA GPU with the te, flash and quack extras (:data:`difflm.model.auto_kernels.FULL_INSTALL`), with the
    layout's degrees; ``cfg`` itself is left as it is.

    FlashAttention is taken to be FA4 (what ``auto`` picks ``flash`` for); it reads the QKV output in place when
    :func:`difflm.kernels.qkv_flash.fused_qkv_flash_applies` would: ``model.fused_qkv``, a batch-first layout (not
    TE's sequence-parallel ``sbhd``), no mask (not packed documents), whole-head RoPE and ``head_dim % 8 == 0``.
    """
    from difflm.model.auto_kernels import FULL_INSTALL, choose_kernels, unresolved

    if unresolved(cfg):
        cfg = cfg.copy()
        p = cfg.parallel
        p.tp, p.cp, p.pp = layout.tp, layout.cp, layout.pp
        p.dp_replicate, p.dp_shard = layout.dp_replicate, layout.dp_shard
        choose_kernels(cfg, torch.device("cuda"), installed=FULL_INSTALL)
    m = cfg.model
    backend, attention = str(m.backend), str(m.attention_backend)
    te = backend == "te"
    head_dim = int(m.head_dim or int(m.hidden_size) // int(m.num_heads))
    sbhd = te and layout.tp > 1 and layout.sequence_parallel
    documents = bool(cfg.data.get("intra_document_attention", False)) if "data" in cfg else False
    qkv_flash = (attention == "flash" and _flag(m.get("fused_qkv", True)) and not sbhd and not documents
                 and head_dim % 8 == 0 and float(m.get("partial_rotary_factor", 1.0) or 1.0) == 1.0)
    fp8 = te and cfg.precision.name == "fp8"
    moe = m.get("moe")
    has_experts = moe is not None and int(moe.get("num_experts", 0) or 0) > 0
    fused_experts = te and has_experts and _flag(moe.get("fused_experts", False))
    fp8_experts = fp8 and has_experts and _flag(moe.get("fp8_experts", False))
    return KernelSet(backend=backend, attention=attention, fused_mlp=te and _flag(m.get("fused_mlp", False)),
                     fp8=fp8, fp8_recipe=str(cfg.precision.get("fp8_recipe", "delayed")) if fp8 else "delayed",
                     qkv_flash=qkv_flash, fused_experts=fused_experts, fp8_experts=fp8_experts,
                     fused_cross_entropy=_flag(m.get("fused_cross_entropy", True)))


def mlp_width(model_cfg) -> int:
    """Per-token MLP width: the dense ``ffn_hidden_size``, or for MoE ``top_k`` experts plus the shared ones."""
    moe = model_cfg.moe
    if int(moe.num_experts) > 0:
        width = int(moe.ffn_hidden_size) or int(model_cfg.ffn_hidden_size)
        return int(moe.top_k) * width + int(moe.num_shared_experts) * width
    return int(model_cfg.ffn_hidden_size)


def _widths(model_cfg) -> tuple[int, int, int, int, int]:
    """(h, q, kv, f, heads): hidden, query width, key/value width, MLP width, query heads."""
    h = int(model_cfg.hidden_size)
    hd = int(model_cfg.head_dim or h // int(model_cfg.num_heads))
    return h, int(model_cfg.num_heads) * hd, int(model_cfg.num_kv_heads) * hd, mlp_width(model_cfg), \
        int(model_cfg.num_heads)


def _split(attention: float, rest: float, layout, replicated: float = 0.0) -> float:
    """Bytes per token on one rank: the attention's terms over ``tp`` (heads), the others over ``tp`` under
    sequence parallelism only, those of a slot that runs replicated over TP on the whole sequence (``replicated``:
    the MoE slot) over none, everything over ``cp``."""
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    return (attention / layout.tp + rest / sp + replicated) / layout.cp


def torch_bytes_per_token(model_cfg, layout, act_bytes: int) -> float:
    """Bytes one block of the torch kernel set saves for its backward per token of the full sequence, on one rank of
    ``layout`` (:mod:`difflm.plan.memory`'s formula ``2 r h + 2 a h + a (2 (q + 2 kv) + q) + 4 a f``, ``r`` = 4 the
    FP32 residual, ``a`` = ``act_bytes`` the compute dtype's). A mixture-of-experts slot runs replicated over TP
    (:class:`difflm.parallel.expert_parallel.ReplicatedMoE`: under sequence parallelism its input is gathered to
    the whole sequence), so its norm's input and output and its ``4 a f`` are not divided by ``tp``."""
    h, q, kv, f, _ = _widths(model_cfg)
    r, a = 4, act_bytes
    attention = a * (2 * (q + 2 * kv) + q)
    if int(model_cfg.moe.num_experts) > 0:
        return _split(attention, r * h + a * h, layout, replicated=r * h + a * h + 4 * a * f)
    return _split(attention, 2 * r * h + 2 * a * h + 4 * a * f, layout)


def te_saved_bytes(model_cfg, kernels: KernelSet, act_bytes: int) -> dict[str, tuple[str, float]]:
    """What one block of the TE kernel set saves for its backward, per token, whole (before any split over ranks).

    Args:
        model_cfg: the ``model`` config (widths; ``moe.num_experts > 0``: a torch MoE slot in the MLP's place).
        kernels: the run's :class:`KernelSet` (``backend == "te"``).
        act_bytes: the compute dtype's bytes ``a`` (2 for BF16, FP16 and FP8 runs, 4 for FP32).
    Returns: tensor -> (``"attention"`` or ``"rest"``: how tensor parallelism splits it, bytes per token). With ``h``
        hidden, ``q`` / ``kv`` the query and key/value widths, ``f`` the MLP width, ``H`` the query heads, BF16
        without fused MLP that is ``4 a h + 8 + 3 a f`` (rest) and ``2 a (q + 2 kv) + a q + 4 H`` (attention).

    Sources, slot by slot:

    * QKV: ``te.LayerNormLinear`` saves ``inputmat`` (the block input, the residual stream in the compute dtype),
      ``ln_out`` and ``rsigma`` (FP32 per token); under FP8 ``ln_out`` is the FP8 copy, its row-wise data dropped
      before saving (``ln_out.update_usage(rowwise_usage=False)``: the transposed copy the weight gradient reads).
      quack's ``ResidualNormLinear`` (``difflm/kernels/quack_norm_linear.py``, ``_NormLinearFunction.forward``)
      saves ``x``, ``rstd`` and the normed ``h``: the same bytes as BF16.
    * heads: ``_QKVHeadsTriton.forward`` (``difflm/model/qkv.py``) saves the QKV output ``qkv``; the attention
      kernel saves the dense ``q, k, v``, its output and an FP32 log-sum-exp per head (``FusedAttnFunc`` for
      ``te``; FlashAttention's and PyTorch's cuDNN / flash kernels the same). ``_QKVFlashAttention.forward``
      (``difflm/kernels/qkv_flash.py``) saves ``qkv, q, k, out, lse``: no dense ``v``.
    * proj: ``te.Linear`` saves its input, the attention output already saved (no new bytes); under FP8 its FP8
      copy, column-wise only (``inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)``).
    * MLP: ``te.LayerNormMLP`` saves ``inputmat`` (the residual after attention), ``ln_out``, ``fc1_out`` (``2 f``,
      compute dtype), ``act_out`` (the SwiGLU output, ``f``) and ``rsigma``; under FP8 ``ln_out`` is FP8 with both
      usages (row-wise for the forward GEMM, column-wise set by ``fc1_input_quantizer``, no usage update before
      saving: 2 bytes) and ``act_out`` is FP8 row-wise (``fc2_input_quantizer``; ``block`` / ``mxfp8`` recipes
      also column-wise). quack's ``ResidualNormMLP`` (``difflm/kernels/quack_mlp.py``,
      ``_ResidualNormMLPFunction.forward``) saves ``s`` (the residual after attention), ``rstd``, ``h`` and the
      pre-activation ``preact`` (``2 f``); the SwiGLU output is recomputed in the backward's ``gemm_dgated``.
      A mixture-of-experts slot is the torch module under both kernel sets: its norm's input and output and
      ``4 a f`` (the torch count) on the compute-dtype residual.
    """
    h, q, kv, f, heads = _widths(model_cfg)
    a, fp8 = act_bytes, kernels.fp8
    gemm_in = FP8 if fp8 else a
    out = {
        "qkv norm input": ("rest", a * h),
        "qkv norm output": ("rest", gemm_in * h),
        "qkv norm 1/rms": ("rest", FP32),
        "qkv output": ("attention", a * (q + 2 * kv)),
        "q, k, v heads": ("attention", a * (q + kv if kernels.qkv_flash else q + 2 * kv)),
        "attention output": ("attention", a * q),
        "attention log-sum-exp": ("attention", FP32 * heads),
        "proj input (FP8 copy)": ("attention", FP8 * q if fp8 else 0),
        "mlp norm input": ("rest", a * h),
    }
    if int(model_cfg.moe.num_experts) > 0:
        out.update({"mlp norm output": ("rest", a * h), "mlp (torch MoE slot)": ("rest", 4 * a * f)})
        return out
    out.update({
        "mlp norm output": ("rest", 2 * FP8 * h if fp8 else a * h),
        "mlp norm 1/rms": ("rest", FP32),
        "fc1 output": ("rest", 2 * a * f),
        "swiglu output": ("rest", 0 if kernels.fused_mlp else
                          (FP8 * (2 if kernels.fp8_recipe in ("block", "mxfp8") else 1) if fp8 else a) * f),
    })
    return out


def block_bytes_per_token(model_cfg, kernels: KernelSet, layout, act_bytes: int) -> float:
    """Bytes one block saves for its backward per token of the full sequence, on one rank of ``layout``, under
    ``kernels`` (:func:`kernel_set`): :func:`torch_bytes_per_token`, or the sum of :func:`te_saved_bytes` split as
    the torch count is (the attention's terms over ``tp``, the others over ``tp`` under sequence parallelism only,
    everything over ``cp``)."""
    if kernels.backend != "te":
        return torch_bytes_per_token(model_cfg, layout, act_bytes)
    terms = te_saved_bytes(model_cfg, kernels, act_bytes).values()
    return _split(sum(b for kind, b in terms if kind == "attention"), sum(b for kind, b in terms if kind == "rest"),
                  layout)


MAIN_GRAD_SLOTS = (".attention.qkv.weight", ".attention.proj.weight", ".mlp.fc1_weight", ".mlp.fc2_weight",
                   ".mlp.experts.fc1_weight", ".mlp.experts.fc2_weight")  # what TEKernels hands accumulate_into_grad


def accumulates_in_main_grad(cfg, kernels: KernelSet, layout) -> bool:
    """Whether the run ``cfg`` under ``layout`` builds its TE kernel set with ``fuse_wgrad_accumulation``, i.e. with
    the weight gradients of its GEMMs in FP32 ``main_grad`` buffers (:func:`difflm.kernels.main_grad.
    accumulate_into_grad`): the TE kernel set on a layout without FSDP2, context or data parallelism and pipeline
    stages (``difflm.parallel.parallelize.build_parallel_model``: ``not (dims.fsdp_enabled or dims.pp_enabled)``;
    one process builds with the default, on), ``model.fuse_wgrad_accumulation`` on, no LoRA (the trainer and
    ``build_parallel_model`` turn it off) and no FP8 weights (``TEKernels.__init__`` leaves it off under
    ``precision.fp8_weights``)."""
    return kernels.backend == "te" and main_grad.accumulates_in_main_grad(
        cfg, sharded=layout.dp_replicate * layout.dp_shard * layout.cp > 1, pipelined=layout.pp > 1)


def step_state_bytes(cfg, kernels: KernelSet, layout, name: str) -> tuple[int, int]:
    """Bytes per element of the state a weight ``name`` (:func:`difflm.plan.shapes.model_params`' names) keeps from
    the first forward of a step to the end of the step, and on into the next one, under the TE kernel set with
    ``main_grad`` (:func:`accumulates_in_main_grad`; (0, 0) otherwise, and for the torch kernel set):
    (its FP32 gradient buffer, its low-precision weight copy).

    * The gradient buffer, 4 bytes: ``difflm.kernels.main_grad.attach_main_grads`` creates ``p.main_grad`` in the
      forward pre-hook of the step's first micro-batch and sets it as ``p.grad``; the trainer's
      ``optimizer.zero_grad(set_to_none=True)`` drops ``p.grad`` but the module keeps ``p.main_grad``, zeroed in
      place at the next step. So unlike autograd's ``.grad`` (None between steps) these buffers are held in every
      phase of every step, also without gradient accumulation. Which weights: the TE GEMMs' (``TEKernels.
      norm_linear`` / ``linear`` / ``norm_mlp``, the quack modules in their slots), the MoE experts'
      (``accumulate_weight_grads(self.mlp.experts, ...)``) and, on one TP rank, the embedding's
      (``TEKernels.embedding``: :class:`difflm.kernels.embedding.Embedding`). Not the LM head, the norms, the router
      or the shared experts: autograd's ``.grad``.
    * The weight copy, 2 bytes, cast at the step's first forward and kept by its module until the weights change:
      under FP8, TE 2.20's weight workspace of ``te.LayerNormLinear`` / ``te.Linear`` / ``te.LayerNormMLP``
      (``module/base.py``: ``quantize_weight(..., cache=True)`` stored in ``self._fp8_workspaces`` when the
      module gets an ``is_first_microbatch``, which ``accumulate_into_grad``'s pre-hook passes in FP8 regions):
      the FP8 data and, on Hopper, its FP8 transpose for the input-gradient GEMM (the quantizer's column-wise usage
      is set while gradients are on: ``columnwise=is_grad_enabled`` in ``_linear_forward_impl``,
      ``_LayerNormLinear.forward``, ``_LayerNormMLP._forward``); not for the blocks that
      ``precision.fp8_skip_first_last`` runs in BF16. The BF16 copies of
      :func:`difflm.kernels.main_grad.weights_cast_once_per_step`: the quack modules' (``model.fused_mlp``), the
      experts' (their FP8 copies under ``model.moe.fp8_experts``: data both ways, the same 2 bytes) and the
      embedding's table (:class:`difflm.kernels.embedding.Embedding`). TE's BF16 modules cast their weights at every
      forward (``cast_if_needed``): no copy kept.
    """
    if not accumulates_in_main_grad(cfg, kernels, layout):
        return 0, 0
    if name == "embedding.weight":
        return (4, 2) if layout.tp == 1 else (0, 0)
    if not (name.startswith("layers.") and name.endswith(MAIN_GRAD_SLOTS)):
        return 0, 0
    if ".experts." in name:
        return 4, 2
    if kernels.fused_mlp and not name.endswith(".attention.proj.weight"):
        return 4, 2  # quack's ResidualNormLinear / ResidualNormMLP
    if not kernels.fp8:
        return 4, 0
    layer, last = int(name.split(".")[1]), int(cfg.model.num_layers) - 1
    skipped = _flag(cfg.precision.get("fp8_skip_first_last", False)) and layer in (0, last)
    return 4, 0 if skipped else 2 * FP8


def residual_bytes(kernels: KernelSet, act_bytes: int) -> int:
    """Bytes per element of the residual stream between blocks (what a checkpointed block keeps): FP32 under the
    torch kernel set (autocast leaves the residual adds in FP32), the compute dtype under TE's."""
    return act_bytes if kernels.backend == "te" else 4


__all__ = ["KernelSet", "accumulates_in_main_grad", "block_bytes_per_token", "kernel_set", "mlp_width",
           "residual_bytes", "step_state_bytes", "te_saved_bytes", "torch_bytes_per_token"]
