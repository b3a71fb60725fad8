"""Bytes per GPU of a training run, by part.

Persistent state (exact, from :mod:`difflm.plan.shapes`): FP32 parameters, FP32 gradients (``.grad`` or TE's
``main_grad``), AdamW's two FP32 moments and its per-tensor ``step`` (torch.optim.AdamW). Transient peaks (models,
scaled by the calibration's ``activation_scale``):

* activations saved for the backward, per token and block (bytes; Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", sec. 4, redone for this block: RMSNorm + fused QKV with QK-norm and RoPE,
  memory-efficient attention with no S x S scores, SwiGLU MLP, an FP32 residual stream under autocast)::

      2 r h + 2 a h + a (2 (q + 2 kv) + q) + 3 a f

  with ``r`` = 4 (the FP32 residual), ``a`` the compute dtype's bytes, ``h`` hidden, ``q`` / ``kv`` the query and
  key/value widths, ``f`` the MLP width (MoE: ``top_k x`` the expert width plus the shared experts). Under sequence
  parallelism every term but the attention's is divided by ``tp``; the attention's is divided by ``tp`` always
  (heads), and everything by ``cp``. ``activation_checkpointing=full`` keeps the block input (``r h``) per block plus
  one block's activations; ``selective`` (every 2nd block) keeps half the blocks whole.
* in-flight micro-batches: 1 without pipelining; the first stage of 1F1B holds ``pp`` (GPipe: all of them);
* the logits of the loss rows (the LM head runs at masked positions only: ``E[p] = (1 + eps) / 2`` of the tokens for
  a linear schedule; all of them for ``ar``): the logits and their gradient in the compute dtype, plus an FP32 copy,
  FP32 log-probabilities and their FP32 gradient when TE's fused cross-entropy is off;
* BF16 weight copies: autocast caches each weight's cast for the step (torch docs, "Automatic Mixed Precision"), so
  without FSDP a stage's weights are held twice over; FSDP2 gathers BF16 blocks instead: the unsharded block in use,
  the prefetched ones, and one block's gradient before its reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from difflm.plan.shapes import Param, local_numel, stage_of

GIB = 1024 ** 3


@dataclass
class Layout:
    """Degrees of a parallel layout (``parallel.*``), the batch split and checkpointing of one candidate."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    micro_batch: int = 1
    activation_checkpointing: str = "none"  # none | selective | full
    sequence_parallel: bool = True
    pp_schedule: str = "1F1B"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_replicate * self.dp_shard

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """FSDP2's shard degree for all parameters but the routed experts."""
        return self.dp_shard * self.cp

    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        if self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        return "-".join(parts) or "single"


@dataclass
class MemoryPlan:
    """Predicted bytes on the most loaded GPU, by part (``parts``), and their sum (``total``)."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))


def stage_params(params: list[Param], layout: Layout, num_layers: int) -> list[int]:
    """Elements held by one rank of each pipeline stage (a list of ``pp`` counts)."""
    efsdp = max(layout.fsdp // layout.ep, 1)
    out = [0] * layout.pp
    for p in params:
        out[stage_of(p, num_layers, layout.pp)] += local_numel(p, layout.tp, layout.ep, layout.fsdp, efsdp)
    return out


def stage_tensors(params: list[Param], layout: Layout, num_layers: int) -> list[int]:
    """Parameter tensors per pipeline stage (AdamW keeps one ``step`` scalar for each)."""
    out = [0] * layout.pp
    for p in params:
        out[stage_of(p, num_layers, layout.pp)] += 1
    return out


def persistent_bytes(params: list[Param], layout: Layout, num_layers: int) -> list[dict[str, float]]:
    """FP32 parameters, gradients and AdamW state (two moments + a 4-byte ``step`` per tensor) per stage."""
    out = []
    for n, tensors in zip(stage_params(params, layout, num_layers), stage_tensors(params, layout, num_layers)):
        out.append({"parameters": 4.0 * n, "gradients": 4.0 * n, "optimizer": 8.0 * n + 4.0 * tensors})
    return out


def mlp_width(model_cfg) -> int:
    """Per-token MLP width: the dense ``ffn_hidden_size``, or for MoE ``top_k`` experts plus the shared ones."""
    moe = model_cfg.moe
    if int(moe.num_experts) > 0:
        width = int(moe.ffn_hidden_size) or int(model_cfg.ffn_hidden_size)
        return int(moe.top_k) * width + int(moe.num_shared_experts) * width
    return int(model_cfg.ffn_hidden_size)


def activation_bytes_per_token(model_cfg, layout: Layout, act_bytes: int) -> float:
    """Bytes one block saves for its backward per token of the full sequence (module docstring's formula)."""
    h = int(model_cfg.hidden_size)
    hd = int(model_cfg.head_dim or h // int(model_cfg.num_heads))
    q, kv = int(model_cfg.num_heads) * hd, int(model_cfg.num_kv_heads) * hd
    f = mlp_width(model_cfg)
    r, a = 4, act_bytes
    attention = a * (2 * (q + 2 * kv) + q) / layout.tp
    rest = (2 * r * h + 2 * a * h + 3 * a * f) / (layout.tp if layout.sequence_parallel and layout.tp > 1 else 1)
    return (attention + rest) / layout.cp


def in_flight(layout: Layout, n_micro: int) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once."""
    if layout.pp == 1:
        return 1
    if layout.pp_schedule == "GPipe":
        return n_micro
    return min(layout.pp, n_micro)


def loss_row_fraction(objective_cfg) -> float:
    """Expected fraction of a sequence's positions at which the LM head runs."""
    name = objective_cfg.name
    if name == "ar":
        return 1.0
    eps = float(objective_cfg.get("eps", 1e-3) or 0.0)
    return (1.0 + eps) / 2.0


def plan_memory(cfg, params: list[Param], layout: Layout, n_micro: int, activation_scale: float = 1.0) -> MemoryPlan:
    """Predicted bytes on the most loaded GPU of ``layout`` for the run ``cfg`` (the composed train config).

    Args:
        params: :func:`difflm.plan.shapes.model_params` of ``cfg.model``.
        n_micro: micro-batches per optimizer step and data-parallel rank (gradient accumulation steps).
        activation_scale: the calibration's factor on the activation model (1.0 uncalibrated).
    Returns: the :class:`MemoryPlan` of the stage with the largest total.
    """
    m = cfg.model
    seq = int(cfg.data.seq_len)
    if cfg.objective.name == "bd3lm":
        seq *= 2  # [x_t ; x_0]
    precision = cfg.precision.name
    act_bytes = 4 if precision == "fp32" else 2
    num_layers = int(m.num_layers)
    vocab = int(m.vocab_size)
    persistent = persistent_bytes(params, layout, num_layers)
    layers_per_stage = [len(x) for x in _split(num_layers, layout.pp)]
    tokens = layout.micro_batch * seq
    per_token = activation_bytes_per_token(m, layout, act_bytes) * activation_scale
    block_input = 4.0 * int(m.hidden_size) / layout.cp / (layout.tp if layout.sequence_parallel and layout.tp > 1 else 1)
    best = None
    for s, state in enumerate(persistent):
        n = layers_per_stage[s]
        ac = layout.activation_checkpointing
        if ac == "full":
            act = tokens * (n * block_input + per_token)
        elif ac == "selective":
            kept = n - n // 2
            act = tokens * (kept * per_token + (n // 2) * block_input + per_token)
        else:
            act = tokens * n * per_token
        flights = in_flight(layout, n_micro) if s == 0 else max(1, in_flight(layout, n_micro) - s)
        parts = dict(state)
        parts["activations"] = act * flights
        if s == layout.pp - 1:
            rows = tokens / layout.cp * loss_row_fraction(cfg.objective) if cfg.objective.name != "bd3lm" else \
                layout.micro_batch * int(cfg.data.seq_len) / layout.cp * loss_row_fraction(cfg.objective)
            fused = bool(m.get("fused_cross_entropy", True)) and m.get("backend") == "te"
            # logits and their gradient in the compute dtype; unfused: an FP32 copy, log-probs and gradient too
            per_row = 2 * act_bytes + (0 if fused else 12)
            parts["logits"] = rows * vocab / layout.tp * per_row
        else:
            parts["logits"] = 0.0
        stage_elems = state["parameters"] / 4.0
        if precision != "fp32":
            if layout.fsdp > 1:
                block = stage_elems / max(n, 1) * layout.fsdp  # one unsharded block
                prefetch = 1 + int(cfg.parallel.get("fsdp_prefetch", 0) or 1)
                parts["buffers"] = block * 2 * (1 + prefetch) + block * 4
            else:
                parts["buffers"] = 2.0 * stage_elems  # autocast's BF16 weight casts
        else:
            parts["buffers"] = (stage_elems / max(n, 1) * layout.fsdp * 8) if layout.fsdp > 1 else 0.0
        plan = MemoryPlan(parts)
        if best is None or plan.total > best.total:
            best = plan
    return best


def _split(num_layers: int, pp: int) -> list[list[int]]:
    from difflm.parallel.pipeline import split_layers

    return split_layers(num_layers, pp)
