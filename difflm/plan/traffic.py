"""Memory traffic and kernel launches of a training step beside its GEMM and attention FLOPs, counted from the code
that runs them, for :mod:`difflm.plan.step_time`. Every count is bytes read + written (what an HBM copy rate
measures, :func:`difflm.plan.rates.calibrate`), per element, token or parameter as each function says:

* FP8 casts (:func:`fp8_cast_bytes_per_token`): Transformer Engine quantizes each GEMM's activation-side operands,
  the inputs in the forward and the output gradients in the backward, in one pass that reads the compute-dtype
  tensor and writes FP8 row-wise and column-wise copies (Hopper's FP8 GEMMs take only the "TN" layout, so the
  other GEMM of the backward reads the transpose: TE's ``cast_transpose``, ``transformer_engine/common/transpose/
  cast_transpose.cu``); the weights' FP8 casts are :func:`weight_bytes`'.
* the mixture-of-experts slot (:func:`moe_bytes_per_token`): the router's FP32 scores, the token permutation into
  expert order and back, the SwiGLU between the grouped GEMMs, forward and backward, as
  :class:`difflm.model.moe.MoEMLP` and :mod:`difflm.model.grouped_experts` run them.
* the weights (:func:`weight_bytes`): their casts to the compute dtype (per forward, or once per step where the
  kernel set keeps a copy) and the accumulation of their gradients over the micro-batches (autograd's ``.grad``,
  or FP32 ``main_grad``).
* AdamW (:data:`OPTIMIZER_BYTES`) and the loss's logits (:func:`loss_bytes_per_row`).
* kernel launches (:func:`kernels_per_block`): each kernel costs the GPU a few microseconds beyond its bytes and
  FLOPs (``Rates.kernel_floor_us``), which decides the step of a small model.
"""
from __future__ import annotations

from difflm.plan.activations import KernelSet, accumulates_in_main_grad, residual_bytes, step_state_bytes

FP32, FP8 = 4, 1
# fused AdamW (torch.optim.AdamW(fused=True), torch/optim/adam.py _fused_adamw): reads the parameter, its gradient
# and both moments and writes the parameter and both moments, FP32 each; difflm.parallel.parallelize.global_grad_norm
# reads every gradient once more (the clipping coefficient then rides inside the fused kernel: grad_factor)
OPTIMIZER_BYTES = 7 * FP32 + FP32
# model.moe.fp8_experts' weight copies, once a step (weight_bytes): the FP32 master read and its FP8 copy written,
# as stored and transposed, each one compiled region (difflm.model.grouped_experts.weight_fp8_rows and
# transposed_weight_fp8_rows)
FP8_EXPERT_WEIGHT_BYTES = 2 * (FP32 + FP8)


def _widths(model_cfg) -> tuple[int, int, int, int]:
    """(h, q, kv, f): hidden, query width, key/value width, dense MLP width."""
    h = int(model_cfg.hidden_size)
    hd = int(model_cfg.head_dim or h // int(model_cfg.num_heads))
    return h, int(model_cfg.num_heads) * hd, int(model_cfg.num_kv_heads) * hd, int(model_cfg.ffn_hidden_size)


def fp8_cast_bytes_per_token(model_cfg, act_bytes: int, moe_layer: bool = False) -> float:
    """Bytes TE's FP8 casts of activations and gradients move per token in one block, forward + backward
    (per-tensor recipes on Hopper).

    Each FP8 GEMM quantizes its input ``X`` [T, K] in the forward and its output gradient ``dY`` [T, N] in the
    backward, each read once in the compute dtype (``act_bytes``) and written as FP8 row-wise and column-wise
    (1 + 1 bytes): ``(a + 2)`` bytes an element. The four GEMMs of a dense block (TE's ``LayerNormLinear`` for QKV,
    ``Linear`` for the projection, ``LayerNormMLP``'s ``fc1`` / ``fc2``) have inputs of width ``h, q, h, f`` and
    outputs of width ``q + 2 kv, h, 2 f, h``: ``(a + 2) (4 h + 2 q + 2 kv + 3 f)``. A mixture-of-experts block runs
    its experts in BF16 (:class:`difflm.model.moe.GroupedExperts`), so only its attention half counts:
    ``(a + 2) (2 h + 2 q + 2 kv)``.
    """
    h, q, kv, f = _widths(model_cfg)
    elements = h + q + (q + 2 * kv) + h  # QKV input and output gradient, projection input and output gradient
    if not moe_layer:
        elements += h + f + 2 * f + h  # fc1 input, fc2 input, fc1 output gradient (gate and up), fc2's
    return float((act_bytes + 2 * FP8) * elements)


def moe_widths(model_cfg) -> tuple[int, int, int, int, int]:
    """(d, E, k, f, f_s): hidden, routed experts, experts per token, expert width, fused shared-expert width."""
    from difflm.model.moe import expert_ffn_size, shared_ffn_size

    moe = model_cfg.moe
    return (int(model_cfg.hidden_size), int(moe.num_experts), int(moe.top_k), expert_ffn_size(model_cfg),
            shared_ffn_size(model_cfg))


def moe_bytes_per_token(model_cfg, kernels: KernelSet, act_bytes: int, main_grad: bool) -> dict[str, float]:
    """Bytes the mixture-of-experts slot moves per token of one MoE block, forward + backward, beyond its GEMMs and
    its norm, by part, as :class:`difflm.model.moe.MoEMLP` runs on a GPU (``torch._grouped_mm`` experts).

    With ``d`` hidden, ``E`` experts, ``k`` per token, ``f`` the expert width, ``a`` the compute dtype's bytes and
    ``r`` those of the norm's output (the residual's dtype: FP32 under the torch kernel set, ``a`` under TE's):

    * ``routing``: the router's FP32 ``[T, E]`` tensors (``TopKRouter.forward``): the input cast ``x.float()``
      (``(r + 4) d`` where ``r < 4``) and back in the backward, softmax, top-k, the z-loss's logsumexp and the
      balancing loss's mean read them (``4 E`` each) and their backward writes and sums the gradients:
      ``4 E (2 + 1 + 1 + 1 + 3 + 2 + 3)``.
    * ``permutation``: ``MoEMLP._routed``: the gather into expert order ``h[order // k]`` (``2 k r d``; its backward
      an accumulating ``index_put_`` into zeros, ``r d + 3 k r d``), the cast of those rows to BF16 where ``r = 4``
      (``GroupedExperts.forward``: ``6 k d`` each way), the gather back ``y_sorted[inverse]`` (``2 k a d``; backward
      ``4 k a d``), the gate-weighted sum ``torch.bmm(weights, y)`` (``k a d + a d``; backward ``2 a d + 2 k a d``),
      its cast to ``h``'s dtype where ``r = 4`` (``(a + 4) d`` each way) and the sum of the router's and the
      experts' gradients into ``h`` (``3 r d``).
    * ``swiglu``: :func:`difflm.model.grouped_experts.swiglu` on the ``k`` rows of each token (SiLU: ``2 a f``, the
      product: ``3 a f``), recomputed in the backward of the ``main_grad`` path (:class:`difflm.model.
      grouped_experts.GroupedSwiGLUMainGrad`), whose :func:`difflm.model.grouped_experts.swiglu_backward` runs in
      FP32, kernel by kernel ``2 (a + 4) f`` (the halves' casts) ``+ 8 f`` (sigmoid) ``+ (a + 4) f`` (the gradient's
      cast) ``+ 6 x 12 f`` (the six products of the two gradient expressions) ``+ 2 x 8 f`` (``1 - s``, ``1 + ...``)
      ``+ 16 f`` (``torch.cat``) ``+ (8 + 2 a) f`` (the cast to BF16): ``(5 a + 132) f`` a row; autograd's
      backward of the same SwiGLU (without ``main_grad``) reads and writes BF16: the two products' gradients
      (``3 a f`` each), ``silu_backward`` (``3 a f``) and the halves' gradients joined (``4 a f``): ``13 a f``.
      The shared experts (width ``f_s``) run the same SwiGLU once per token under autograd. The fused experts
      (``model.moe.fused_experts``, :mod:`difflm.kernels.quack_experts`) run the routed experts' SwiGLU in the GEMMs'
      epilogues: beyond the GEMMs' own outputs, the activation written beside the pre-activation (``a f``), and in
      the backward the pre-activation read again and the recomputed activation written (``2 a f + a f``): ``4 a f``.
    * ``fp8 experts`` (``model.moe.fp8_experts`` with ``main_grad``, :class:`difflm.model.grouped_experts.
      GroupedSwiGLUFP8`), per routed row, each piece one ``torch.compile``d region
      (:func:`difflm.kernels.compiled.fused_on_gpu`) whose row reductions read a row once: the input and the
      output gradient scattered into buffers padded per expert (zeros, then read and written: ``3 a d`` each) and
      quantised (read ``a``, FP8 written ``1``), the output and the input gradient gathered back (``2 a d`` each):
      ``(12 a + 2) d``; the SwiGLU quantised in the forward (``h`` read, FP8 written: ``2 a f + f``), recomputed for
      the second weight gradient (``3 a f``), and its backward quantised (``h`` and ``da`` read, ``dh`` and its FP8
      written: ``5 a f + 2 f``): ``(10 a + 3) f``, in place of the routed SwiGLU's bytes above.
    """
    d, e, k, f, f_s = moe_widths(model_cfg)
    a, r = act_bytes, residual_bytes(kernels, act_bytes)
    wide = r >= FP32  # the torch kernel set's FP32 norm output: the rows are cast to BF16 for the experts
    routing = 4 * e * (2 + 1 + 1 + 1 + 3 + 2 + 3) + (0 if wide else 2 * (r + FP32) * d)
    permutation = (2 * k * r * d + (r * d + 3 * k * r * d)  # dispatch gather and its backward
                   + (2 * 6 * k * d if wide else 0)  # the dispatched rows cast to BF16, and their gradient back
                   + 2 * k * a * d + 4 * k * a * d  # combine gather and its backward
                   + (k * a * d + a * d) + (2 * a * d + 2 * k * a * d)  # gate-weighted sum and its backward
                   + (2 * (a + FP32) * d if wide else 0)  # the output cast to h's dtype, and back
                   + 3 * r * d)  # the router's and the experts' gradients summed
    forward_swiglu = 5 * a * f
    backward_swiglu = forward_swiglu + (5 * a + 132) * f if main_grad else 13 * a * f
    fp8 = main_grad and kernels.fp8_experts
    routed = 4 * a * f if main_grad and kernels.fused_experts else forward_swiglu + backward_swiglu
    swiglu = k * (0 if fp8 else routed) + (5 * a + 13 * a) * f_s
    parts = {"routing": float(routing), "permutation": float(permutation), "swiglu": float(swiglu)}
    if fp8:
        parts["fp8 experts"] = float(k * ((12 * a + 2) * d + (10 * a + 3) * f))
    return parts


def expert_rows(model_cfg, tokens: float) -> float:
    """Rows each routed expert's GEMMs see in a micro-batch of ``tokens`` tokens (balanced routing): ``T k / E``."""
    _, e, k, _, _ = moe_widths(model_cfg)
    return tokens * k / e


def weight_bytes(cfg, kernels: KernelSet, layout, name: str, numel: int, n_micro: int) -> float:
    """Bytes one step moves for the casts and gradient accumulation of weight ``name`` (``numel`` local elements)
    over ``n_micro`` micro-batches, beside its GEMMs and the optimizer.

    * Weights whose gradients accumulate in FP32 ``main_grad`` (:func:`difflm.plan.activations.step_state_bytes`):
      the buffer zeroed once a step (``attach_main_grads``: 4 bytes); the weight cast once per step where the kernel
      set keeps a copy (FP8 workspaces with their transposes, BF16 copies: read 4, write 2), else at every forward
      (TE's BF16 modules: ``cast_if_needed``, 6 bytes a micro-batch); each micro-batch's gradient added in place by
      the weight-gradient GEMM, which reads and writes the FP32 buffer (TE's ``fuse_wgrad_accumulation``, quack's
      in-place epilogues: 8 bytes, the fused MoE experts' and the FP8 experts' too, with quack installed), or, for
      the other MoE experts, written in BF16 by the
      grouped GEMM and added by ``main_grad.add_`` (:func:`difflm.model.grouped_experts._add_weight_grad`:
      2 + 2 + 4 + 4 bytes). Under ``model.moe.fp8_experts`` the experts' once-a-step copy is FP8, quantised from
      the FP32 master by :func:`difflm.model.grouped_experts.fp8_expert_weights` as stored and transposed, each
      one compiled region that reads the master and writes its FP8 copy: 10 bytes in place of the cast's 6. The
      embedding adds its gradient row by row (:class:`difflm.kernels.embedding.Embedding`): per token, not per weight.
    * The others (the torch kernel set; the TE set's head, router and shared experts; layouts without
      ``main_grad``): autocast's cast of each matrix in every forward (read 4, write 2; not the embedding, which
      gathers FP32 rows, nor the norms' vectors) and the cast of its BF16 gradient back to FP32 (read 2, write 4;
      the embedding writes a dense FP32 ``[V, d]`` gradient instead: 4), and from the second micro-batch on
      autograd's ``AccumulateGrad`` adding it into ``.grad`` (read 4 + 4, write 4). FP32 runs have no casts.
    """
    grad, copy = step_state_bytes(cfg, kernels, layout, name)
    m = n_micro
    if grad:
        if name == "embedding.weight":
            return float(numel * (FP32 + (FP32 + copy if copy else 0)))
        per_step = FP32 + (FP32 + copy if copy else 0)
        if kernels.fp8_experts and ".experts." in name:
            per_step = FP32 + FP8_EXPERT_WEIGHT_BYTES
        cast = 0 if copy else FP32 + 2
        separate_add = ".experts." in name and not (kernels.fused_experts or kernels.fp8_experts)
        accumulate = 2 + 2 + FP32 + FP32 if separate_add else 2 * FP32
        return float(numel * (per_step + m * (cast + accumulate)))
    fp32 = cfg.precision.name == "fp32"
    embedding = name.endswith("embedding.weight")
    matrix = name.endswith("weight") and not name.endswith(("norm.weight", "norm_weight")) and not embedding
    cast = 0 if fp32 or not matrix else FP32 + 2
    grad_cast = FP32 if embedding else (0 if fp32 or not matrix else 2 + FP32)
    return float(numel * (m * (cast + grad_cast) + (m - 1) * 3 * FP32))


def step_weight_bytes(cfg, params, kernels: KernelSet, layout, n_micro: int, stage: int = 0) -> float:
    """:func:`weight_bytes` summed over the local parameters of pipeline rank ``stage`` (``params``:
    :func:`difflm.plan.shapes.model_params`)."""
    from difflm.plan.shapes import local_numel, stage_of

    efsdp = max(layout.fsdp // layout.ep, 1)
    num_layers = int(cfg.model.num_layers)  # read once: an OmegaConf lookup per weight adds up over a layout search
    total = 0.0
    for p in params:
        if stage_of(p, num_layers, *layout.stages) != stage:
            continue
        n = local_numel(p, layout.tp, layout.ep, layout.fsdp, efsdp)
        total += weight_bytes(cfg, kernels, layout, p.name, n, n_micro)
    return total


def loss_bytes_per_row(vocab: int, act_bytes: int, fused: bool) -> float:
    """Bytes the cross-entropy moves per loss row of ``vocab`` logits (the LM head's output, written by its GEMM),
    per logit:

    Unfused (``F.cross_entropy(logits.float(), ...)``, :func:`difflm.objectives.cross_entropy.token_cross_entropy`):
    the FP32 copy (read ``a``, write 4), ``log_softmax`` (read 4, write 4), in the backward ``nll_loss_backward``'s
    zero-filled gradient (write 4), ``log_softmax``'s backward (read 4 + 4, write 4) and the cast back to the
    logits' dtype (read 4, write ``a``): ``2 a + 36``. TE's fused kernel (``model.fused_cross_entropy``, the TE
    kernel set) reads the logits twice (the online softmax, then the gradient) and writes the gradient into them,
    and its backward scales that gradient in place: ``5 a``.
    """
    a = act_bytes
    return float(vocab * (5 * a if fused else 2 * a + 9 * FP32))


TORCH_KERNELS = {"attention": 21, "mlp": 23}  # a dense block of the torch kernel set (kernels_per_block)
TE_KERNELS = {"attention": 16, "mlp": 14}  # ... of the TE kernel set
MOE_KERNELS = {True: 100, False: 88}  # the MoE slot, with main_grad experts (True) or autograd's (False)


def kernels_per_block(kernels: KernelSet, moe_layer: bool = False, main_grad: bool = False) -> int:
    """Kernels one block launches per micro-batch, forward + backward, one per ATen operator that computes (views
    and allocations launch none); activation checkpointing adds the forward's again.

    * Torch kernel set, dense block, 44 (counted from a traced step; ``tests/test_plan_time.py`` counts them again):
      the attention half 21: its two weights' autocast casts and their gradients' casts back (4), the norm output's
      cast to BF16 and its gradient's back (2), the FP32 residual's gradient cast for the branch (1), two GEMMs
      forward and four backward (6), the residual add and the gradients' sum (2), attention forward and backward
      (2), the fused RMSNorm (2) and the Triton QKV split / QK-norm / RoPE (2), each forward and backward; the MLP
      half 23: the same 7 casts, 6 GEMMs, 2 adds, SwiGLU (SiLU and product forward, two products, ``silu_backward``
      and the halves' join backward: 6) and the norm (2).
    * TE kernel set, dense block, 30, from TE 2.20's modules: ``LayerNormLinear`` (norm, weight cast, GEMM;
      backward: two GEMMs and the norm's: 6), the QKV split (2), attention (2), ``Linear`` (cast, GEMM; two GEMMs:
      4), the residual add and its gradients' sum (2): 16; ``LayerNormMLP`` (norm, two casts, two GEMMs, SwiGLU;
      backward: four GEMMs, SwiGLU's and the norm's: 12) and its residual (2): 14. FP8 adds a cast-transpose per
      GEMM input and output gradient (8).
    * A mixture-of-experts slot in the MLP's place (the same torch module under both sets), counted from a traced
      step: 100 with the experts' gradients into ``main_grad`` (:class:`difflm.model.grouped_experts.
      GroupedSwiGLUMainGrad`: the SwiGLU recomputed, its FP32 backward, two ``main_grad`` adds), 88 under autograd:
      the norm, the router (FP32 cast, GEMM, softmax, top-k, gather), the expert counts, sort and permutation, the
      auxiliary losses, the grouped GEMMs, SwiGLU, the gate-weighted sum and the residual, forward and backward.
    """
    table = TE_KERNELS if kernels.backend == "te" else TORCH_KERNELS
    attention = table["attention"] + (4 if kernels.fp8 else 0)
    if moe_layer:
        return attention + MOE_KERNELS[bool(main_grad)]
    return attention + table["mlp"] + (4 if kernels.fp8 else 0)


__all__ = ["MOE_KERNELS", "OPTIMIZER_BYTES", "TE_KERNELS", "TORCH_KERNELS", "expert_rows", "fp8_cast_bytes_per_token",
           "kernels_per_block", "loss_bytes_per_row",
           "moe_bytes_per_token", "moe_widths", "step_weight_bytes", "weight_bytes"]
