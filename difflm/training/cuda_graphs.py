"""CUDA graphs of the transformer blocks (``train.cuda_graphs``).

Each block's forward and backward at the run's micro-batch shape is captured once, at the first training step, with
Transformer Engine's ``make_graphed_callables`` (TE docs, "CUDA Graphs"; Megatron-LM's ``--external-cuda-graph`` does
the same), and replayed for every later micro-batch of that shape. The host then launches one graph per block and
direction instead of its ~40 kernels and their Python: the lever for steps the host cannot keep the GPU busy on
(FP8 TE modules at ``model=1.7b``, S = 2048, micro-batch 4 spend about as long on the CPU as their kernels take on
the GPU; docs/performance.md).

What is graphed and what is not:

* Only blocks, in training mode, with gradients recorded, at the captured shape [micro batch, S, d], in the FP8 state
  they were captured in, without an attention mask or KV cache. Every other call (evaluation, sampling, a
  random-length step, a masked forward) runs the block's own eager forward, which shares the weights.
* The embedding, final norm, LM head and loss stay eager: the masked-row count of the head changes every micro-batch.
* Gradient accumulation: the captured weight-gradient GEMMs accumulate into the FP32 ``main_grad`` buffers of
  :func:`difflm.model.te_kernels.accumulate_into_grad`; the first replay of a step zeroes them (``.grad`` None after
  ``zero_grad(set_to_none=True)``), as the eager pre-hooks do. Norm weights get their gradients back from the graph.
* FP8: the delayed-scaling amaxes are reduced as in eager TE (the outer ``te.autocast`` region and the first module's
  backward), and FP8 weight casts are cached across the micro-batches of a step (``is_first_microbatch`` from the
  same test the eager hooks use).
* A block's graph holds its activations until its backward replays; a second forward of the same block before that
  backward runs eager instead, so the first call's activations are not overwritten. (Under FP8 that second forward is
  outside TE's one-forward-per-micro-batch contract, as it is in eager training: no objective makes one.)

One process only for now: FSDP2 (``parallel=ddp|fsdp``), pipeline schedules and TE's TP/CP communicate from hooks
and inside the modules, which a captured graph would have to include (:func:`cuda_graphs_unavailable_reason`).
"""
from __future__ import annotations

import inspect
import time
from typing import Optional

import torch

from difflm.errors import DifflmError
from difflm.model.moe import moe_config
from difflm.model.rope import rope_angles
from difflm.model.te_kernels import (
    FP8_ROWS_MULTIPLE,
    attach_main_grads,
    fp8_fits,
    main_grad_weights,
    weights_changed_since_cast,
)
from difflm.training.precision import build_fp8_recipe, compute_dtype, fp8_is_active, import_te, precision_name


def cuda_graphs_unavailable_reason(cfg, world_size: int, device: torch.device) -> Optional[str]:
    """Why ``train.cuda_graphs=true`` cannot run with ``cfg``, or None when it can (one line naming the key and the
    fix). Checked before anything is built (:func:`difflm.config.validate.check_run`)."""
    m, o, d = cfg.model, cfg.objective, cfg.data
    if device.type != "cuda":
        return f"train.cuda_graphs=true captures CUDA graphs; device={device.type} has none: set train.cuda_graphs=false"
    if m.backend != "te":
        return ("train.cuda_graphs=true graphs Transformer Engine blocks (te.make_graphed_callables): set "
                "model.backend=te, or use model.compile=true on the torch kernels")
    if world_size > 1:
        return (f"train.cuda_graphs=true runs in one process; this run has {world_size} (parallel layouts communicate "
                "from hooks a graph cannot hold): set train.cuda_graphs=false")
    if moe_config(m) is not None:
        return ("train.cuda_graphs=true needs fixed shapes; mixture-of-experts routing (model.moe.num_experts > 0) "
                "changes them every micro-batch: set train.cuda_graphs=false")
    if o.name == "bd3lm" or d.intra_document_attention:
        what = "objective=bd3lm" if o.name == "bd3lm" else "data.intra_document_attention=true"
        return (f"train.cuda_graphs=true graphs unmasked full-sequence blocks; {what} gives every step an attention "
                "mask: set train.cuda_graphs=false")
    if m.get("fused_mlp", False) is True:  # auto resolves to false under train.cuda_graphs
        return ("train.cuda_graphs=true graphs TE's own modules and model.fused_mlp=true puts quack's kernels in the "
                "blocks: set one of them to false")
    if m.compile:
        return "train.cuda_graphs=true with model.compile=true: TE blocks are not compiled; set model.compile=false"
    tokens = cfg.train.micro_batch_size * d.seq_len
    if precision_name(cfg.precision) == "fp8" and not fp8_fits(tokens):
        return (f"train.cuda_graphs=true with precision=fp8: train.micro_batch_size x data.seq_len = {tokens} tokens "
                f"is not a multiple of {FP8_ROWS_MULTIPLE}, so the blocks would run in BF16 outside their FP8 graphs: "
                "change either, or set train.cuda_graphs=false")
    return None


class GraphedBlock:
    """The forward of one block after capture: replays the graph when the call matches it, else runs the block's own
    (eager) forward. Counts ``replays`` and ``eager_calls``.

    Args:
        block: the :class:`difflm.model.transformer.Block`; index: its place in the model (for messages).
        graphed: TE's graphed forward of the block (``block.forward`` right after ``make_graphed_callables``).
        shape, dtype: of the captured input [B, S, d]; rope_shapes: of the captured (cos, sin) tables.
        fp8: whether the block was captured inside an FP8 region; cache_fp8_weights: whether the graph takes TE's
            ``is_first_microbatch`` (FP8 weight casts cached across micro-batches).
    Raises (on a call): DifflmError when the block's parameters were replaced after capture (the graph would read
        the old storage): parameters must be updated in place, as the optimizers and checkpoint loads do.
    """

    def __init__(self, block, index: int, graphed, shape, dtype, rope_shapes, fp8: bool, cache_fp8_weights: bool):
        self.block, self.index, self.graphed = block, index, graphed
        self.shape, self.dtype, self.rope_shapes = tuple(shape), dtype, tuple(rope_shapes)
        self.fp8, self.cache_fp8_weights = fp8, cache_fp8_weights
        self.weights = [p for p in block.parameters() if p.requires_grad]
        self.main_grad_weights = [p for p in main_grad_weights(block) if p.requires_grad]
        self.pointers = self._storage()
        self.pending = False  # a graphed forward whose backward has not replayed yet
        self.replays = self.eager_calls = 0

    def _storage(self) -> tuple:
        # the objects too: TE's FP8 weights are wrapper tensors whose data_ptr() is 0
        return tuple((id(p), p.data_ptr()) for p in self.block.parameters())

    def matches(self, x: torch.Tensor, rope, attn_mask, kv_cache) -> bool:
        """Whether this call is the captured one: training, gradients on, same shapes, dtype and FP8 state, no mask or
        cache, and no graphed forward of this block waiting for its backward."""
        return (attn_mask is None and kv_cache is None and self.block.training and torch.is_grad_enabled()
                and not self.pending and tuple(x.shape) == self.shape and x.dtype == self.dtype
                and tuple(tuple(t.shape) for t in rope) == self.rope_shapes and fp8_is_active() == self.fp8)

    def __call__(self, x: torch.Tensor, rope, attn_mask=None, kv_cache=None, rows=None) -> torch.Tensor:
        if rows is not None or not self.matches(x, rope, attn_mask, kv_cache):  # rows: a shape per step
            self.eager_calls += 1
            return type(self.block).forward(self.block, x, rope, attn_mask, kv_cache, rows=rows)
        if self._storage() != self.pointers:
            raise DifflmError(f"layers.{self.index}: its parameters were replaced after its CUDA graph was captured "
                              "(train.cuda_graphs=true); update weights in place (load_state_dict, optimizer steps) or "
                              "set train.cuda_graphs=false")
        attach_main_grads(self.main_grad_weights)  # the step's first micro-batch: zero the FP32 accumulators
        kwargs = {}
        if self.cache_fp8_weights:
            kwargs["is_first_microbatch"] = weights_changed_since_cast(self.block, self.weights)
        y = self.graphed(x, tuple(rope), **kwargs)
        if y.requires_grad:
            self.pending = True
            y.register_hook(self._backward_reached)
        self.replays += 1
        return y

    def _backward_reached(self, grad):
        self.pending = False  # the graph's backward runs next: its saved activations are used up


class BlockGraphs:
    """The captured blocks of a model (:func:`capture_block_graphs`): ``blocks`` (one :class:`GraphedBlock` each),
    ``seconds`` (the capture's wall time) and the totals ``replays`` / ``eager_calls``."""

    def __init__(self, blocks: list, seconds: float):
        self.blocks, self.seconds = blocks, seconds

    @property
    def replays(self) -> int:
        return sum(b.replays for b in self.blocks)

    @property
    def eager_calls(self) -> int:
        return sum(b.eager_calls for b in self.blocks)


def _make_graphed_callables(te, modules, sample_args, enabled, recipe, cache: bool):
    """``te.make_graphed_callables`` under the argument names of the installed TE (2.x renamed the FP8 ones)."""
    params = inspect.signature(te.make_graphed_callables).parameters
    if "cache_quantized_params" in params:
        options = dict(enabled=enabled, recipe=recipe, cache_quantized_params=cache)
    else:
        options = dict(fp8_enabled=enabled, fp8_recipe=recipe, fp8_weight_caching=cache)
    return te.make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=True, **options)


def capture_block_graphs(model, precision, micro_batch: int, seq_len: int) -> BlockGraphs:
    """Capture every block of ``model`` (one process, TE kernels, bshd) for inputs [``micro_batch``, ``seq_len``, d]
    in the compute dtype of ``precision`` and install :class:`GraphedBlock` as each block's forward.

    Call it at the start of a training step (gradients of the step not yet accumulated): the capture runs three
    warm-up forward/backward passes on random inputs and then clears every gradient of the blocks. FP8 scaling state
    is restored by TE afterwards; the weights are not changed.
    Returns: the :class:`BlockGraphs`. Raises: DifflmError when Transformer Engine is missing, or the model is not a
    TE model with a batch-first residual stream (other layouts are refused earlier: :func:`cuda_graphs_unavailable_reason`).
    """
    te = import_te()
    if getattr(model.kernels, "name", None) != "te" or getattr(model.kernels, "layout", "bshd") != "bshd":
        raise DifflmError("train.cuda_graphs=true graphs the blocks of a one-process TE model (model.backend=te)")
    cfg = model.cfg
    device = model.embedding.weight.device
    dtype = compute_dtype(precision) or torch.float32
    fp8 = precision_name(precision) == "fp8"
    bf16_layers = getattr(model.kernels, "bf16_layers", frozenset())
    blocks = model.blocks()
    enabled = tuple(fp8 and fp8_fits(micro_batch * seq_len) and i not in bf16_layers for i, _ in blocks)
    cache = any(enabled) and getattr(model.kernels, "fp8_weights_recipe", None) is None  # none for FP8 weights
    rope = tuple(model.kernels.rope(rope_angles(torch.arange(seq_len, device=device), cfg.head_dim, cfg.rope_base,
                                                 getattr(cfg, "partial_rotary_factor", 1.0))))
    shape = (micro_batch, seq_len, cfg.hidden_size)
    sample_args = tuple((torch.randn(shape, dtype=dtype, device=device, requires_grad=True), rope) for _ in blocks)
    start = time.perf_counter()
    modes = [block.training for _, block in blocks]
    for _, block in blocks:  # TE graphs the mode a module is in: the training graphs (forward and backward)
        block.train()
    for _, block in blocks:  # the FP32 accumulators exist before capture, so no graph allocates or zeroes them
        block.zero_grad(set_to_none=True)
        attach_main_grads(main_grad_weights(block))
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False):
        _make_graphed_callables(te, tuple(b for _, b in blocks), sample_args, enabled,
                                build_fp8_recipe(precision) if fp8 else None, cache)
    model.last_block_loss_rows = False  # a graph replays one shape; the loss rows change every micro-batch
    graphed = []
    for (index, block), fp8_block in zip(blocks, enabled):
        g = GraphedBlock(block, index, block.forward, shape, dtype, [t.shape for t in rope], fp8_block, cache)
        block.forward = g
        graphed.append(g)
    for (_, block), mode in zip(blocks, modes):  # the modes as they were; the warm-up passes' gradients dropped (the
        block.train(mode)  # next forward zeroes the main_grad buffers: attach_main_grads)
        block.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return BlockGraphs(graphed, time.perf_counter() - start)


__all__ = ["BlockGraphs", "GraphedBlock", "capture_block_graphs", "cuda_graphs_unavailable_reason"]
