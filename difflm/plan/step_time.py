"""Predicted time of one optimizer step: compute by kind, exposed communication by collective, the pipeline bubble.

Compute (per GPU, over the step's ``n_micro`` micro-batches of ``micro_batch x seq_len`` tokens; docs/planner.md,
"The step's parts", lists them with their sources):

* GEMMs: ``6 N_linear`` FLOPs per token (forward + backward; Kaplan et al. 2020, PaLM appendix B), with the LM head's
  share at the loss rows only, divided by ``tp`` and ``cp``, at the calibrated GEMM rate (FP8 rate under
  ``precision=fp8``); activation checkpointing adds a forward (``+2 N`` of ``6 N``; ``selective``: half of that);
  a mixture of experts' routed experts at the grouped-GEMM rate of their rows per expert (:func:`grouped_gemm_rate`);
* attention: ``12 L d S`` FLOPs per token for bidirectional attention (half for causal ``ar``: the kernels skip the
  masked half), :func:`difflm.training.flops.bd3lm_flops_per_token`'s mask for ``bd3lm`` (every pair of
  ``[x_t ; x_0]`` under SDPA, which takes the mask dense), at the attention rate;
* memory-bound kernels of the blocks (norms, RoPE, SwiGLU, residual adds, casts): each saved activation byte is moved
  the rates' ``membound_passes_te`` times across forward and backward by the fused TE kernels (written once, read
  about twice: 3), ``membound_passes_torch`` times by the torch kernel set's unfused ones, at the HBM rate;
* bytes counted from the code that moves them (:mod:`difflm.plan.traffic`), at the HBM rate: FP8 casts, the MoE
  slot's routing, permutation and SwiGLU, the weights' casts and gradient accumulation, AdamW and the gradient norm
  (32 bytes per local parameter), the loss's logits;
* a floor per launched kernel (:func:`difflm.plan.traffic.kernels_per_block` x ``Rates.kernel_floor_us``).

Communication (bytes per GPU at the NCCL bus bandwidth of the group: inside a node or across nodes):

* FSDP2: a BF16 all-gather of every block in each micro-batch's forward and again in its backward
  (once with ``parallel.reshard_after_forward=false`` or under pipelining) and one reduce-scatter of the gradients per step (FP32 or ``parallel.reduce_dtype``),
  each ``(n - 1) / n`` of the unsharded bytes; DDP (``dp_replicate``): one all-reduce per step, twice that;
  hidden behind compute up to ``comm_overlap`` of the compute time, the rest exposed;
* tensor + sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): per block and micro-batch two all-gathers and
  two reduce-scatters of ``[tokens, hidden]`` in the forward and as many in the backward, exposed;
* context parallelism: the ring passes each chunk's K and V ``cp - 1`` times per block (twice that in the backward),
  overlapped with attention;
* expert parallelism: all-to-all dispatch and combine of ``top_k`` copies of each token, forward and backward, exposed;
* pipeline parallelism: the 1F1B / GPipe bubble, ``(pp - 1) / (n_micro + pp - 1)`` of the step (Narayanan et al.
  2021, sec. 2.2; interleaved schedules divide the ``pp - 1`` by the virtual stages).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from difflm.model.moe import first_k_dense
from difflm.plan.activations import KernelSet, _flag, accumulates_in_main_grad, kernel_set
from difflm.plan.memory import Layout, activation_bytes_per_token, loss_row_fraction, mlp_width
from difflm.plan.rates import Rates
from difflm.plan.shapes import last_stage_rank, stages_per_rank
from difflm.plan.traffic import (OPTIMIZER_BYTES, expert_rows, fp8_cast_bytes_per_token, kernels_per_block,
                                 loss_bytes_per_row, moe_bytes_per_token, moe_widths, step_weight_bytes, weight_bytes)


@dataclass
class StepPlan:
    """Predicted seconds of one step by part (``compute`` and ``comm`` dicts), tokens/s and MFU."""

    compute: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    tokens_per_step: int = 0
    world: int = 1
    flops_per_token: float = 0.0
    peak_flops: float = 1.0

    @property
    def seconds(self) -> float:
        return sum(self.compute.values()) + sum(self.comm.values()) + self.bubble

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds

    @property
    def mfu(self) -> float:
        return self.tokens_per_s / self.world * self.flops_per_token / self.peak_flops


def _bw(rates: Rates, group: int, span: int) -> float:
    """Bus bandwidth (bytes/s) of a group of ``group`` ranks whose members lie ``span`` ranks apart at most."""
    return (rates.intra_node_gbps if span <= rates.gpus_per_node else rates.inter_node_gbps) * 1e9


def expert_params_per_token(model_cfg) -> int:
    """Routed-expert weights one token multiplies in one MoE block: ``k`` experts of ``3 d f`` (SwiGLU)."""
    d, _, k, f, _ = moe_widths(model_cfg)
    return 3 * d * f * k


def grouped_gemm_rate(rates: Rates, rows: float) -> float:
    """FLOP/s of the experts' grouped GEMMs (``torch._grouped_mm`` forward + backward) at ``rows`` rows per expert:
    ``grouped_gemm_tflops x rows / (rows + grouped_gemm_rows + 64)``. Each expert's GEMMs pay a fixed cost, the
    prologue and epilogue of a short K loop and the weight gradient's reduction over only ``rows`` rows, worth
    ``grouped_gemm_rows`` rows of work (:func:`difflm.plan.rates.calibrate` measures both rates at even counts);
    the 64 is half of the 128-row tile that the uneven counts of real routing leave partly empty per expert (tile
    quantization: NVIDIA, "Matrix Multiplication Background User's Guide")."""
    return rates.grouped_gemm_tflops * 1e12 * rows / (rows + rates.grouped_gemm_rows + 64)


def _moe_parts(cfg, kernels: KernelSet, layout: Layout, micro_tokens: float, block_tokens: float, act_bytes: int,
               ac: float, rates: Rates) -> dict[str, float]:
    """Seconds of the MoE slots of one step: the routed experts' grouped GEMMs, the router (its FP32 GEMM and
    scores), the permutation and the SwiGLU (:func:`difflm.plan.traffic.moe_bytes_per_token`).

    Args:
        micro_tokens: tokens of one micro-batch on this rank (each expert sees ``T k ep / E`` rows of them).
        block_tokens: tokens times MoE blocks of the whole step on this rank.
        ac: the forward's share recomputed by activation checkpointing (1 full, 0.5 selective).
    """
    m = cfg.model
    d, e, k, f, _ = moe_widths(m)
    hbm = rates.hbm_gbps * 1e9
    rows = expert_rows(m, micro_tokens) * layout.ep
    # the MoE slot runs replicated over TP (difflm.parallel.expert_parallel.ReplicatedMoE): every TP rank computes
    # the experts of the whole sequence
    experts = block_tokens * 2 * expert_params_per_token(m) * (3 + ac)
    main_grad = accumulates_in_main_grad(cfg, kernels, layout)
    moved = moe_bytes_per_token(m, kernels, act_bytes, main_grad)
    again = 1 + ac / 3  # a checkpointed block's forward (about a third of its bytes) runs again
    # the router's GEMM runs in FP32 with autocast off (TopKRouter.forward): 2 d E FLOPs a token, three times
    router = block_tokens * 2 * d * e * (3 + ac) / (rates.fp32_gemm_tflops * 1e12)
    parts = {"grouped gemm": experts / grouped_gemm_rate(rates, rows), "moe routing": router}
    for name, per_token in moved.items():  # routing, permutation, swiglu and, with FP8 experts, their casts
        parts[f"moe {name}"] = parts.get(f"moe {name}", 0.0) + block_tokens * per_token * again / hbm
    return parts


def plan_step(cfg, num_params: int, layout: Layout, n_micro: int, rates: Rates, stage_elems: list[int],
              kernels: Optional[KernelSet] = None, params=None) -> StepPlan:
    """Predicted step of the run ``cfg`` under ``layout`` on GPUs with ``rates``.

    Args:
        num_params: the model's parameters without the input embedding (PaLM's N; the active ones for MoE).
        n_micro: micro-batches per step and data-parallel rank.
        stage_elems: local parameter elements per pipeline stage (:func:`difflm.plan.memory.stage_params`).
        kernels: the run's kernel set (default :func:`difflm.plan.activations.kernel_set`): TE's fused kernels move
            each activation byte ``membound_passes_te`` times, the torch set's ``membound_passes_torch``.
        params: :func:`difflm.plan.shapes.model_params` of ``cfg.model``, whose names decide each weight's cast and
            gradient traffic (:func:`difflm.plan.traffic.weight_bytes`); without them every local element is
            counted as a block matrix's.
    Returns: the :class:`StepPlan`, seconds by part (``compute``: ``gemm``, ``attention``, ``memory_bound``,
        ``fp8 casts``, ``grouped gemm``, ``moe routing`` / ``permutation`` / ``swiglu``, ``weights``, ``optimizer``,
        ``loss``, ``kernel launches``; ``comm``: the exposed collectives) and the pipeline bubble.
    """
    from difflm.training.flops import objective_flops_per_token

    m = cfg.model
    seq = int(cfg.data.seq_len)
    L, h, vocab = int(m.num_layers), int(m.hidden_size), int(m.vocab_size)
    objective = cfg.objective.name
    head = vocab * h
    tokens_rank = layout.micro_batch * seq * n_micro  # tokens of one data-parallel rank per step
    per_gpu_tokens = tokens_rank / layout.cp  # each CP rank holds 1/cp of every sequence
    rows = loss_row_fraction(cfg.objective)
    copies = 2 if objective == "bd3lm" else 1  # bd3lm runs [x_t ; x_0]
    ac = {"full": 1.0, "selective": 0.5}.get(layout.activation_checkpointing, 0.0)
    kernels = kernels or kernel_set(cfg, layout)
    moe_blocks = L - first_k_dense(m) if int(m.moe.num_experts) > 0 else 0
    # the routed experts' weights a token multiplies and the router's (FP32): their own parts (_moe_parts)
    experts = moe_blocks * (expert_params_per_token(m) + h * int(m.moe.num_experts))
    # the shared experts run replicated over TP with the rest of the MoE slot: their GEMMs are not split by tp
    shared = moe_blocks * 3 * h * moe_widths(m)[4] if moe_blocks else 0
    body = num_params - head - experts - shared
    gemm_flops = per_gpu_tokens * ((copies * body * (6 + 2 * ac) + 6 * head * rows) / layout.tp
                                   + copies * shared * (6 + 2 * ac)) / layout.pp
    fp8 = cfg.precision.name == "fp8"
    gemm_rate = (rates.fp8_gemm_tflops if fp8 else rates.gemm_tflops) * 1e12
    if cfg.precision.name == "fp32":
        gemm_rate /= 8  # TF32-less FP32 GEMMs (torch's default matmul precision is "highest")
    flops_tok = objective_flops_per_token(cfg.objective, m, num_params, seq)
    if objective == "bd3lm" and kernels.attention == "sdpa":
        # SDPA takes the block-causal mask as a dense boolean tensor (difflm.model.attention.prepare_mask) and
        # computes every pair of [x_t ; x_0]: (2 S)^2 per sequence of S data tokens
        attn_per_tok = 12.0 * L * h * 4 * seq
    elif objective == "bd3lm":  # a kernel that skips the masked tiles: the mask's pairs (bd3lm_flops_per_token)
        attn_per_tok = 12.0 * L * h * (seq + int(cfg.objective.block_size))
    else:
        attn_per_tok = 12.0 * L * h * seq
    if objective == "ar":
        attn_per_tok /= 2
    attn_flops = per_gpu_tokens * attn_per_tok * (1 + ac / 3) / layout.tp / layout.pp
    act_bytes = 4 if cfg.precision.name == "fp32" else 2
    hbm = rates.hbm_gbps * 1e9
    # the blocks' elementwise kernels, as passes over their saved bytes (the rates' membound_passes); a MoE block's
    # MLP tensors are the MoE slot's, counted from its code below
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    per_token = activation_bytes_per_token(m, layout, act_bytes) * layout.cp  # per token of the full sequence
    # the MLP bytes in per_token: a MoE slot's over the whole sequence on every TP rank (torch_bytes_per_token)
    mlp_bytes = 4 * act_bytes * mlp_width(m) / (1 if moe_blocks else sp)
    dense_mlp = 4 * act_bytes * int(m.ffn_hidden_size) / sp
    block_bytes = (L - moe_blocks) * (per_token - mlp_bytes + dense_mlp) + moe_blocks * (per_token - mlp_bytes)
    passes = rates.membound_passes_te if kernels.backend == "te" else rates.membound_passes_torch
    local = tokens_rank * copies / layout.pp / layout.cp  # tokens of this rank's blocks, every micro-batch
    plan = StepPlan(world=layout.world, tokens_per_step=tokens_rank * layout.dp, flops_per_token=flops_tok,
                    peak_flops=rates.peak_tflops * 1e12)
    plan.compute = {"gemm": gemm_flops / gemm_rate, "attention": attn_flops / (rates.attention_tflops * 1e12),
                    "memory_bound": local * block_bytes * passes / hbm}
    if kernels.fp8:
        skipped = 2 if _flag(cfg.precision.get("fp8_skip_first_last", False)) else 0  # BF16 first and last blocks
        fp8_blocks = max(L - skipped, 0)
        casts = ((fp8_blocks - moe_blocks) * fp8_cast_bytes_per_token(m, act_bytes)
                 + moe_blocks * fp8_cast_bytes_per_token(m, act_bytes, moe_layer=True))
        # the forward's casts run again in a checkpointed block's recomputation (about a third of the block's bytes)
        plan.compute["fp8 casts"] = local * casts * (1 + ac / 3) / layout.tp / hbm
    if moe_blocks:
        micro_tokens = layout.micro_batch * seq * copies / layout.cp  # one micro-batch's tokens on this rank
        plan.compute.update(_moe_parts(cfg, kernels, layout, micro_tokens, local * moe_blocks, act_bytes, ac, rates))
    stage = max(range(len(stage_elems)), key=lambda s: stage_elems[s])
    weights = (step_weight_bytes(cfg, params, kernels, layout, n_micro, stage) if params is not None else
               weight_bytes(cfg, kernels, layout, "layers.0.attention.proj.weight", stage_elems[stage], n_micro))
    plan.compute["weights"] = weights / hbm
    plan.compute["optimizer"] = OPTIMIZER_BYTES * stage_elems[stage] / hbm
    if stage == last_stage_rank(*layout.stages) or params is None:
        fused = kernels.fused_cross_entropy
        loss_rows = tokens_rank * rows / layout.cp  # the head's rows on this rank, every micro-batch
        plan.compute["loss"] = loss_rows * loss_bytes_per_row(vocab, act_bytes, fused) / layout.tp / hbm
    main_grad = accumulates_in_main_grad(cfg, kernels, layout)
    launches = n_micro * ((L - moe_blocks) * kernels_per_block(kernels)
                          + moe_blocks * kernels_per_block(kernels, True, main_grad)) / layout.pp * (1 + ac / 2)
    plan.compute["kernel launches"] = launches * rates.kernel_floor_us * 1e-6
    compute = sum(plan.compute.values())
    hidden = compute * rates.comm_overlap
    stage_bytes_bf16 = 2.0 * max(stage_elems) * layout.fsdp  # one stage's unsharded BF16 weights (per tp rank)
    # ranks adjacent in the mesh: tp innermost, then cp, dp_shard, dp_replicate, pp (difflm.parallel.mesh)
    span_tp, span_cp = layout.tp, layout.tp * layout.cp
    span_shard = layout.tp * layout.cp * layout.dp_shard
    span_rep = span_shard * layout.dp_replicate
    overlapped = 0.0
    if layout.fsdp > 1:
        n = layout.fsdp
        regather = 2 if bool(cfg.parallel.get("reshard_after_forward", True)) and layout.pp == 1 else 1
        gathers = regather * n_micro * stage_bytes_bf16 * (n - 1) / n
        reduce_bytes = 2 if str(cfg.parallel.get("reduce_dtype", "fp32")) == "bf16" else 4
        scatter = reduce_bytes / 2 * stage_bytes_bf16 * (n - 1) / n
        overlapped += (gathers + scatter) / _bw(rates, n, span_shard)
    if layout.dp_replicate > 1:
        n = layout.dp_replicate
        grad_bytes = 4.0 * max(stage_elems)
        overlapped += 2 * grad_bytes * (n - 1) / n / _bw(rates, n, span_rep)
    if layout.cp > 1:
        hd = int(m.head_dim or h // int(m.num_heads))
        kv = 2 * int(m.num_kv_heads) * hd * act_bytes
        ring = 3 * layout.micro_batch * n_micro * (seq / layout.cp) * kv * (layout.cp - 1) * L / layout.pp / layout.tp
        overlapped += ring / _bw(rates, layout.cp, span_cp)
    if overlapped:
        plan.comm["fsdp/ddp/cp (exposed)"] = max(overlapped - hidden, overlapped * (1 - rates.comm_overlap))
    if layout.tp > 1:
        n = layout.tp
        act = layout.micro_batch * seq / layout.cp * h * act_bytes * copies
        plan.comm["tp/sp"] = 8 * n_micro * (L / layout.pp) * act * (n - 1) / n / _bw(rates, n, span_tp)
    if layout.ep > 1 and int(m.moe.num_experts) > 0:
        n = layout.ep
        a2a = 4 * n_micro * layout.micro_batch * seq / layout.cp * int(m.moe.top_k) * h * act_bytes * (n - 1) / n
        plan.comm["ep all-to-all"] = a2a * (L / layout.pp) / _bw(rates, n, span_shard)
    if layout.pp > 1:
        virtual = stages_per_rank(*layout.stages)
        step_body = compute + sum(plan.comm.values())
        frac = (layout.pp - 1) / virtual / (n_micro + (layout.pp - 1) / virtual)
        plan.bubble = step_body * frac / (1 - frac)
    return plan


__all__ = ["StepPlan", "expert_params_per_token", "grouped_gemm_rate", "plan_step", "mlp_width"]
