#!/usr/bin/env python3
"""Training-step throughput of difflm's model against MegaDLMs and a plain eager PyTorch reference, in one call.

    python scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 train.global_batch_size=4 precision=bf16 \\
        --variant "torch-compile: model.compile=true" \\
        --variant "te-fp8: model.backend=te model.attention_backend=te precision=fp8" \\
        --steps 10 --warmup 3 --json bench.json
    python scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 train.global_batch_size=16 \
        precision=bf16 --no-reference --variant "full: " --variant "lora: lora=attn_mlp" --json lora.json

(the second: LoRA training beside full fine-tuning in one process, docs/lora.md: tokens/s, peak memory, trainable
parameters and AdamW state bytes per row, printed after the table).

Positional arguments are Hydra overrides of ``conf/train.yaml`` (composed with ``hydra.compose``,
the same schema and checks as ``difflm-train``); each ``--variant "NAME: overrides"`` adds a row composed
from the base overrides plus its own (without ``--variant`` the base config is the one row). A variant may
change the shape (``data.seq_len``, ``train.global_batch_size``) and the objective (``objective=bd3lm``).

Every row runs real training steps of the same model code (:func:`difflm.model.build_model`) on uniform random
tokens (``--tokens corpus``: the run's training windows, ``data.*``, which route a mixture of experts' tokens as a
real run does): the row's objective's ``noise`` (MDLM: t ~ U(0,1), Bernoulli(p) masking, keyed; BD3-LM: the ``2 L``
tokens ``[x_t ; x_0]`` with the block-causal mask and positions, passed as the trainer passes them) on
``--batches`` batches drawn once and kept on the device, so the timed loop does no host work; the model's
logits only at the loss positions; :func:`difflm.objectives.weighted_ce_sum`; gradient clipping (with a fused
AdamW inside its kernel, as the trainer does); the run's AdamW (fused on CUDA). One timed step is one optimizer step
over ``train.global_batch_size`` sequences, accumulated in micro-batches of ``train.micro_batch_size`` as the
trainer does. Weights are drawn on the
device (Megatron-style, :func:`fast_init`), not by the trainer's keyed CPU init, which would take longer
than the measurement at 1.7B; each row's draw is seeded with ``--seed`` (as are the batches), so the same
command gives the same losses and rows of the same model start from the same weights. ``reference`` is the
baseline written below: a plain eager PyTorch transformer of the same dimensions (separate nn.Linear
q/k/v/o, SwiGLU MLP, nn.RMSNorm, SDPA, full-vocab LM head with cross-entropy at every position, fused
AdamW), at BF16 autocast on CUDA (FP32 on CPU), at the base shape and objective (``--no-reference``
leaves it out).

Timing: ``--warmup`` steps (compilation, autotuning, FP8 scaling history), then ``--steps`` steps between
two CUDA events. Tokens/s counts the data tokens, ``train.global_batch_size x data.seq_len`` per step (also
for bd3lm, whose model sees twice as many). MFU = tokens/s x FLOPs per token / peak, with
:func:`difflm.training.flops.objective_flops_per_token` (the trainer's count): PaLM's 6 N + 12 L d S (N
without the input embedding, appendix B; for mixture-of-experts models without the experts a token is not
routed to, the active parameters, docs/moe.md) and, for ``bd3lm``, the FLOPs of its 2 L tokens under the
block-causal mask (:func:`difflm.training.flops.bd3lm_flops_per_token` says how they are counted); peak =
989 TFLOP/s dense BF16 on H100/H200 (:data:`difflm.training.flops.PEAK_TFLOPS_BF16`), also for FP8 rows so
that rows compare. ``mem GiB``: on CUDA the row's peak allocation; on a CPU the process's peak RSS, shown
only for rows with a process of their own (``--isolate``), ``-`` for rows sharing one. ``--profile NAME``
(a row of the plan, checked before any row runs) adds a torch.profiler table of the top kernels of that row
(printed and written next to the JSON); the kernel time shares and ``gpu_busy`` need CUDA, on a CPU the
table is of CPU ops.

MegaDLMs in the same call (``--megadlms DIR``, an export made by ``scripts/megadlms_baseline.py export``):
its own pretraining at the base model's dimensions (``--megadlms-model PRESET``: that preset's, composed with the
base overrides) and the base micro-batch, one GPU, for each ``--megadlms-shapes`` (``S x global batch``) and
``--megadlms-precisions`` (bf16, FP8 hybrid), timed from its log (median of iterations 6-16;
scripts/megadlms_baseline.py). A mixture-of-experts model runs as Megatron-Core's MoE (rows
``megadlms-moe-<precision>-s<S>-gb<GB>``, MFU over the active parameters as difflm's rows; docs/moe.md); a model
the baseline cannot express (sigmoid router scores, shared experts, token dropping, ...) stops the call before
any row with one ``benchmark.py: error:`` line. Each difflm row gets ``vs MegaDLMs`` = its tokens/s over
MegaDLMs' at the same model, S, global and micro batch and precision (bf16 or fp8) measured in this call,
and the end of the output has the comparison table (MegaDLMs BF16 / FP8 | difflm TE BF16 / FP8, tokens/s,
MFU, ratio; the fastest TE mdlm row of each precision, named). bd3lm rows are compared with the mdlm row of
the same shape, backend, precision and attention (``vs mdlm`` line).

Isolation (``--isolate``, the GPU way): every row runs in its own process (``--only NAME``), at most
``--row-timeout`` seconds (MegaDLMs rows: ``--megadlms-timeout``), so a crash, a hang or an out-of-memory
row prints ``NAME: failed: <reason>`` and the others still run; ``--time-budget S`` cuts each row's timeout
to what is left of S seconds and starts no row with less than 30 s left (``NAME: skipped: ...``). Rows run in
the order of the variants, each preceded by the MegaDLMs rows of its shape (S, global batch) not run yet,
so the order of ``--variant`` decides what a budget cut leaves out. Each row is printed as it completes and
the JSON is rewritten after every row. Without ``--isolate`` rows share one process (CPU tests); a variant
whose overrides do not compose fails alone. Exit status: 2 with one ``benchmark.py: error:`` line for a usage
error (a base override that does not compose, a bad option or row name), 1 when every difflm row failed,
else 0.

GPU command: one H200 with the optional kernels staged (``scripts/gpu_env.sh``), ``.megadlms`` carried; one call of <= 10 min (``--time-budget 550``;
estimated: MegaDLMs rows ~70 s each, difflm mdlm rows ~35 s, bd3lm ~55 s; rows that do not fit are reported
``skipped``, the S=4096 comparison and the bd3lm rows come first):

    export PYTHONPATH=$PWD:/root/site:/root/site/nvidia_cutlass_dsl/dsl_packages NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
    export CUDNN_HOME=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])")
    export LD_LIBRARY_PATH=$CUDNN_HOME/lib:$LD_LIBRARY_PATH
    T="model.backend=te model.attention_backend=te"; F="$T precision=fp8"
    B="objective=bd3lm objective.block_size=16"; S="data.seq_len=2048 train.global_batch_size=32"
    python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 \
      train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate \
      --steps 6 --warmup 2 --batches 2 --row-timeout 120 --time-budget 550 --json $OUT/bench.json \
      --megadlms .megadlms --megadlms-shapes 4096x16,2048x32 --megadlms-timeout 150 \
      --variant "te-bf16: $T" --variant "te-fp8: $F" \
      --variant "te-bf16-bd3lm: $T $B" --variant "te-fp8-bd3lm: $F $B" \
      --variant "te-bf16-s2048: $T $S" --variant "te-fp8-s2048: $F $S" \
      --variant "te-bf16-flash: model.backend=te model.attention_backend=flash"

Rows run: MegaDLMs BF16 and FP8 at 4096 x 16, te-bf16, te-fp8, the two bd3lm rows (block 16, S = 4096: compared
with te-bf16 / te-fp8), MegaDLMs at 2048 x 32, the two S = 2048 rows, then ``te-bf16-flash`` (flash-attn 4 needs
to be staged, ``scripts/gpu_env.sh``; without it that row fails in seconds). ``--plan`` prints this order and the child
command lines without running anything (also on a CPU, with ``device=cpu``).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))

from difflm import script_cli, strict_json  # noqa: E402
from difflm.config.compose import compose_train_config  # noqa: E402
from difflm.config.validate import (  # noqa: E402
    check_batch, check_choices, check_cuda_graphs, check_model, check_precision, resolve_device)
from difflm.errors import DifflmError  # noqa: E402
from difflm.model import build_model, resolve_model_config  # noqa: E402
from difflm.model.lora import apply_lora, lora_enabled  # noqa: E402
from difflm.model.moe import moe_inactive_params, moe_step, set_moe_loss_scale  # noqa: E402
from difflm.objectives import build_objective, loss_normaliser, weighted_ce_sum  # noqa: E402
from difflm.training.allocator import use_expandable_segments  # noqa: E402
from difflm.training.cuda_graphs import capture_block_graphs  # noqa: E402
from difflm.training.flops import flops_per_token, mfu, objective_flops_per_token, peak_flops  # noqa: E402
from difflm.parallel.parallelize import clip_coefficient, global_grad_norm  # noqa: E402
from difflm.training.optimizer import build_optimizer, skips_on_device, step_unless_nonfinite  # noqa: E402
from difflm.training.precision import autocast_context  # noqa: E402

# ------------------------------------------------------------------ the eager reference


class RefBlock(nn.Module):
    """Llama-style block as commonly written in eager PyTorch: separate q/k/v/o, nn.RMSNorm, SDPA, SwiGLU."""

    def __init__(self, m, causal: bool):
        super().__init__()
        d, h, h_kv, hd, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size
        self.h, self.h_kv, self.hd, self.causal = h, h_kv, hd, causal
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=m.norm_eps), nn.RMSNorm(d, eps=m.norm_eps)
        self.q, self.k = nn.Linear(d, h * hd, bias=False), nn.Linear(d, h_kv * hd, bias=False)
        self.v, self.o = nn.Linear(d, h_kv * hd, bias=False), nn.Linear(h * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=m.norm_eps) if m.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=m.norm_eps) if m.qk_norm else None
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    @staticmethod
    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, s, self.h, self.hd)
        k = self.k(y).view(b, s, self.h_kv, self.hd)
        v = self.v(y).view(b, s, self.h_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.h != self.h_kv)
        x = x + self.o(o.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class ReferenceTransformer(nn.Module):
    """The baseline: embedding, blocks, final nn.RMSNorm, full-vocabulary LM head (logits [B, S, V])."""

    def __init__(self, m, causal: bool):
        super().__init__()
        self.m = m
        self.embedding = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList(RefBlock(m, causal) for _ in range(m.num_layers))
        self.norm = nn.RMSNorm(m.hidden_size, eps=m.norm_eps)
        self.output = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, ids):
        from difflm.model.rope import rope_cos_sin

        cos, sin = rope_cos_sin(ids.shape[1], self.m.head_dim, self.m.rope_base, ids.device)
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.embedding.weight.numel()


# ------------------------------------------------------------------ helpers


def compose(overrides: list[str]):
    """``conf/train.yaml`` composed with ``overrides``, checked as ``difflm-train`` checks its command line
    (:func:`difflm.config.compose.compose_train_config`: a mistyped key or preset, another Hydra error or a ``+`` key
    the schema lacks raises DifflmError with one line naming it)."""
    return compose_train_config(overrides)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME: key=value key=value"`` -> (NAME, [overrides]). Raises DifflmError without a name."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise DifflmError(f"--variant {text!r} needs the form 'NAME: override override ...'")
    return name.strip(), rest.split()


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"4096x16,2048x32"`` -> [(4096, 16), (2048, 32)] (sequence length x global batch)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        s, sep, g = part.partition("x")
        if not sep or not s.isdigit() or not g.isdigit():
            raise DifflmError(f"--megadlms-shapes {text!r}: each shape is SEQxGLOBAL_BATCH, e.g. 4096x16")
        shapes.append((int(s), int(g)))
    return shapes


def load_sibling(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    key = f"difflm_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@torch.no_grad()
def fast_init(model: nn.Module, std: float, num_layers: int, seed: int) -> None:
    """Megatron-style init drawn on the model's device (the keyed CPU init is slow for billions of
    parameters and irrelevant to speed): norms 1, residual outputs std / sqrt(2 L), others std. The draws
    come from a generator seeded with ``seed`` on that device, so the same model and seed give the same weights."""
    scaled = std / math.sqrt(2 * num_layers)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for b in model.buffers():  # MoE router bias and statistics: uninitialised after to_empty
        b.zero_()
    for name, p in model.named_parameters():
        if type(p) is not torch.Tensor and type(p) is not nn.Parameter:
            continue  # TE FP8 weights (precision.fp8_weights): initialised by TE
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, scaled if name.endswith(("proj.weight", "fc2_weight", "o.weight", "w2.weight")) else std,
                      generator=gen)


def build_variant_model(cfg, causal: bool, device: torch.device, seed: int) -> nn.Module:
    """The model of ``cfg.model`` through the public :func:`difflm.model.build_model` (any backend, compiled
    blocks with ``model.compile``), left uninitialised there and filled by :func:`fast_init` on ``device``."""
    torch.manual_seed(seed)  # what TE initialises itself (FP8 weights) draws from the global generators
    model = build_model(cfg.model, causal=causal, device=device, seed=None, precision=cfg.precision)
    fast_init(model, cfg.model.init_std, cfg.model.num_layers, seed)
    if lora_enabled(cfg.get("lora")):  # lora=...: the adapters (keyed init, B = 0) on the frozen base, as the trainer
        apply_lora(model, cfg.lora, seed=seed)
    return model


def build_variant_optimizer(model: nn.Module, cfg, device: torch.device):
    if cfg.precision.name == "fp8" and cfg.precision.get("fp8_weights", False):
        from transformer_engine.pytorch.optimizers import FusedAdam

        o = cfg.optim
        return FusedAdam(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                         weight_decay=o.weight_decay, master_weights=True)
    return build_optimizer(model, cfg.optim, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device, own_process: bool) -> float | None:
    """The row's peak memory: CUDA's peak allocation (reset per row), or on CPU the process's peak RSS, which is
    the row's only when it has the process to itself (``own_process``: ``--only``, so ``--isolate``); else None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if not own_process:  # ru_maxrss is the whole process's lifetime peak: the same for every in-process row
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def micro_batches(batches, step: int, accum: int) -> list:
    """The ``accum`` micro-batches of optimizer step ``step``, cycling through the prepared pool."""
    return [batches[(step * accum + j) % len(batches)] for j in range(accum)]


def median_cuda_ms(fn, steps: int, warmup: int = 1) -> float:
    """Median ms of ``steps`` calls of ``fn`` after ``warmup`` untimed ones, each timed with CUDA events (the small
    benchmarks of one kernel or one optimizer step: scripts/qkv_speed.py, scripts/optimizer_speed.py)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def median_ms_under_load(fn, iters: int, warmup: int, gemm_between: int, rows: int, after=None) -> float:
    """Median ms of ``iters`` calls of ``fn`` after ``warmup`` untimed ones, each preceded by ``gemm_between`` BF16
    GEMMs of the 1.7B MLP's size (``[rows, 2048] x [2048, 6144]``, untimed) so the GPU runs at a training step's
    power and clock state, not an isolated loop's; CUDA events around ``fn`` alone. ``after`` (untimed, optional)
    runs after each call (e.g. dropping gradients). One device sync, at the end (scripts/attention_speed.py,
    scripts/flash_tiles.py)."""
    a = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16)
    events = []
    for i in range(warmup + iters):
        for _ in range(gemm_between):
            a @ w
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= warmup:
            events.append((start, end))
        if after is not None:
            after()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_steps(step, batches, warmup: int, steps: int, device: torch.device, accum: int = 1) -> tuple[float, float]:
    """Seconds per optimizer step over ``steps`` timed steps after ``warmup`` untimed ones, and the last loss.
    Each step runs ``accum`` micro-batches (gradient accumulation) before the optimizer."""
    loss = None
    for i in range(warmup):
        loss = step(micro_batches(batches, i, accum))
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            loss = step(micro_batches(batches, i, accum))
        end.record()
        sync(device)
        seconds = start.elapsed_time(end) / 1000.0
    else:
        t0 = time.perf_counter()
        for i in range(steps):
            loss = step(micro_batches(batches, i, accum))
        seconds = time.perf_counter() - t0
    return seconds / steps, float(loss)


KERNEL_CLASSES = (  # first match wins: quack's and FA4's kernels all carry "cutlass" in their names
    ("attention", ("flash", "fmha", "attn", "cudnn", "sdpa")),
    ("other", ("rmsnorm", "layernorm", "layer_norm")),  # quack's norm kernels are CuTe DSL, not GEMMs
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    # MoE dispatch: top-k, sort, the gathers and scatters that permute tokens by expert
    ("routing", ("topk", "sort", "radix", "gather", "scatter", "index", "cumsum")),
    ("cast/copy", ("copy",)),  # dtype casts (FP32 weights to BF16) and copies
)


def kernel_class(name: str, user_annotation: bool = False):
    """The profile class of a device event (:data:`KERNEL_CLASSES`, else ``"other"``), or None for a user-annotated
    range (``Optimizer.step#AdamW.step``, ``record_function``): the profiler gives those the device time of the
    kernels inside them, which would count the kernels twice."""
    name = name.lower()
    if user_annotation or name.startswith(("optimizer.step#", "profilerstep#")):  # the names: older profilers
        return None
    return next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")


def profile_step(step, batches, device: torch.device, rows: int = 20, accum: int = 1) -> tuple[str, dict]:
    """torch.profiler over 2 steps: (table of the top ``rows`` kernels by device time, then the top ``rows`` operators
    by input shapes, then the ``rows`` largest kernels of each class but GEMM in ms per step; share per class, plus
    ``device_ms_per_step`` (kernel time) and ``gpu_busy``: kernel time / wall time of the profiled steps)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        for i in range(2):
            step(micro_batches(batches, i, accum))
        sync(device)
        wall_ms = (time.perf_counter() - t0) * 1000.0 / 2
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort, row_limit=rows, max_name_column_width=90)
    # the same time by operator and input shapes: which tensors the small kernels move (e.g. weight-sized FP32 adds
    # of gradients that should have been accumulated inside the GEMMs)
    by_shape = prof.key_averages(group_by_input_shape=True)
    table += "\n\nBy operator and input shapes:\n" + by_shape.table(
        sort_by=sort, row_limit=rows, max_name_column_width=90, max_shapes_column_width=60, top_level_events_only=False)
    shares: dict = {}
    by_class: dict = {}  # class -> {kernel name: device us over the profiled steps}
    if device.type == "cuda":
        total = 0.0
        for ev in averages:
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0.0)
            if not t or getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            cls = kernel_class(ev.key, bool(getattr(ev, "is_user_annotation", False)))
            if cls is None:
                continue
            shares[cls] = shares.get(cls, 0.0) + t
            by_class.setdefault(cls, {})[ev.key] = by_class.get(cls, {}).get(ev.key, 0.0) + t
            total += t
        shares = {k: round(v / total, 4) for k, v in sorted(shares.items())} if total else {}
        shares["device_ms_per_step"] = round(total / 2 / 1000.0, 2)
        # kernel time over the profiled steps' wall time: well below 1 means the GPU waits for the host
        shares["gpu_busy"] = round(total / 2 / 1000.0 / wall_ms, 3)
        # the largest kernels of every class but the GEMMs, ms per step: what the small classes are made of
        for cls, kernels in sorted(by_class.items()):
            if cls == "gemm":
                continue
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:rows]
            table += f"\n\nClass {cls}, ms per step (top {len(top)} of {len(kernels)} kernels):\n" + "\n".join(
                f"{t / 2 / 1000.0:9.2f}  {name[:110]}" for name, t in top)
    return table, shares


# ------------------------------------------------------------------ rows


def make_batches(cfg, objective, vocab_real: int, count: int, device: torch.device, seed: int, corpus=None):
    """``count`` noised micro-batches [B, S] on ``device``, through ``objective.noise`` (keyed by (seed, k)): uniform
    random tokens, or with ``corpus`` (the run's training windows, :func:`corpus_windows`) its first ``count x B``
    windows in file order (the windows the Trainer samples from): real text routes a mixture of experts' tokens less
    evenly than uniform tokens do (docs/performance.md)."""
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    if corpus is not None and len(corpus) < count * b:
        raise DifflmError(f"--tokens corpus: the training data holds {len(corpus)} windows of data.seq_len={s}, "
                          f"fewer than --batches {count} x train.micro_batch_size {b}: lower --batches")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        if corpus is None:
            tokens = torch.randint(0, vocab_real, (b, s), generator=gen)
        else:
            tokens = corpus.get(range(k * b, (k + 1) * b))
        batch = objective.noise(tokens, range(k * b, (k + 1) * b), (seed, k), b)
        out.append(batch.to(device))
    sync(device)
    return out


def corpus_windows(cfg, tok, cache_dir: str):
    """The training windows of ``cfg.data`` (:func:`difflm.data.datasets.build_datasets`, as the Trainer builds them;
    tokens cached under ``cache_dir`` unless ``data.cache_dir`` is set)."""
    from difflm.data.datasets import build_datasets

    return build_datasets(cfg.data, tok, cfg.data.cache_dir or cache_dir)[0]


def run_difflm_row(cfg, device, causal: bool, seed: int) -> dict:
    """Model (weights seeded with ``seed``), optimizer and one training step of a difflm row (the trainer's
    step without data loading)."""
    model = build_variant_model(cfg, causal, device, seed)
    optimizer = build_variant_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision.name == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    on_device = skips_on_device(optimizer) and not scaler.is_enabled()  # as Trainer._finish_step decides
    precision = cfg.precision
    set_moe_loss_scale([model], cfg.train.micro_batch_size / cfg.train.global_batch_size)
    if cfg.train.cuda_graphs:  # the trainer captures at its first step; here before the timed ones
        capture_block_graphs(model, precision, cfg.train.micro_batch_size, cfg.data.seq_len)

    def step(micro):
        loss = 0.0
        norm = cfg.objective.loss_norm
        normaliser = sum(loss_normaliser(norm, batch.num_tokens) for batch in micro)  # the step's global count
        for batch in micro:
            with autocast_context(precision, device):
                logits = model(batch.input_ids, batch.logits_selector(), **batch.model_kwargs())
            micro_loss = weighted_ce_sum(logits, batch, norm, normaliser, fused=cfg.model.fused_cross_entropy,
                                         consume_logits=True)
            scaler.scale(micro_loss).backward()
            loss = loss + micro_loss.detach()
        moe_step([model])  # MoE: reset the step's routing statistics (and move an aux-loss-free bias)
        if on_device:  # the trainer's step with a fused AdamW: the clip coefficient applied inside its kernel
            grad_norm = global_grad_norm(params)
            finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
            step_unless_nonfinite(optimizer, finite, grad_factor=clip_coefficient(grad_norm, clip))
        else:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=device.type == "cuda")
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    n = model.num_params() - moe_inactive_params(cfg.model)  # MoE: the active parameters (docs/moe.md)
    return {"n_params_non_embedding": n, "step": step, "model": model, "optimizer": optimizer,
            "flops_per_token": objective_flops_per_token(cfg.objective, cfg.model, n, cfg.data.seq_len)}


def run_reference_row(cfg, device, causal: bool, reference_precision: str, seed: int) -> dict:
    """Model (weights seeded with ``seed``), optimizer and one training step of the eager reference (AR-style
    loss at every position)."""
    m = cfg.model
    with torch.device("meta"):
        model = ReferenceTransformer(m, causal)
    model.to_empty(device=device)
    fast_init(model, m.init_std, m.num_layers, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": None}[reference_precision]
    params = list(model.parameters())
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf

    def step(micro):
        loss = 0.0
        norm = cfg.objective.loss_norm
        normaliser = sum(loss_normaliser(norm, batch.num_tokens) for batch in micro)  # the step's global count
        for batch in micro:
            targets = torch.roll(batch.targets, shifts=-1, dims=1)  # AR-style: every position predicts the next
            ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else torch.autocast(device.type, enabled=False)
            with ctx:
                logits = model(batch.targets)
            micro_loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1)) / len(micro)
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=device.type == "cuda")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    n = model.num_params()
    return {"n_params_non_embedding": n, "step": step, "model": model, "optimizer": optimizer,
            "flops_per_token": flops_per_token(n, m.num_layers, m.hidden_size, cfg.data.seq_len)}




def row_info(name: str, cfg, system: str, reference_precision: str = "bf16") -> dict:
    """The descriptive columns of a row (what was measured, not how fast)."""
    ref = system == "reference"
    m = cfg.model
    return {"name": name, "system": system, "objective": cfg.objective.name,
            "backend": "reference" if ref else m.backend, "precision": reference_precision if ref else cfg.precision.name,
            "fp8_recipe": cfg.precision.fp8_recipe if cfg.precision.name == "fp8" and not ref else None,
            "attention": "sdpa" if ref else m.attention_backend, "compile": bool(m.get("compile", False)) and not ref,
            "cuda_graphs": cfg.train.cuda_graphs and not ref,
            "seq_len": cfg.data.seq_len, "global_batch": cfg.train.global_batch_size,
            "micro_batch": cfg.train.micro_batch_size, "model": m.name}


def measure(row: dict, cfg, device, batches, args, build) -> dict:
    """Time one row (``build`` returns its step); a failure is recorded in ``row["error"]``, never raised."""
    state = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        state = build()
        accum = cfg.train.global_batch_size // cfg.train.micro_batch_size
        seconds, loss = time_steps(state["step"], batches, args.warmup, args.steps, device, accum)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        tps = tokens / seconds
        row.update(step_ms=seconds * 1e3, tokens_per_s=tps, loss=loss,
                   mfu=mfu(tps, state["flops_per_token"], args.peak),
                   peak_mem_gib=peak_memory_gib(device, own_process=args.only is not None),
                   n_params_non_embedding=state["n_params_non_embedding"], flops_per_token=state["flops_per_token"])
        if "optimizer" in state:  # what full fine-tuning and LoRA differ in besides speed
            row.update(trainable_params=sum(p.numel() for p in state["model"].parameters() if p.requires_grad),
                       optimizer_bytes=sum(t.numel() * t.element_size() for st in state["optimizer"].state.values()
                                           for t in st.values() if torch.is_tensor(t)),
                       lora_rank=int(cfg.lora.rank) if "lora" in cfg else 0)
        if not math.isfinite(loss):
            row["error"] = f"non-finite loss {loss}"
        if row["name"] in args.profile:
            table, shares = profile_step(state["step"], batches, device, rows=max(30, args.profile_rows), accum=accum)
            row["kernel_shares"] = shares
            row["profile_table"] = table
    except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"
        if args.traceback:
            traceback.print_exc()
    finally:
        state = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        _reset_te_state()
    return row


def _reset_te_state() -> None:
    if "transformer_engine.pytorch" in sys.modules:
        try:
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        except ImportError:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        FP8GlobalStateManager.reset()


# ------------------------------------------------------------------ the plan: which rows, in which order

MIN_ROW_S = 30.0  # with --time-budget, a row needs at least this much time left to start


def model_key(m) -> tuple:
    """The dimensions that make two models the same size (MegaDLMs rows match difflm rows on these); for a
    mixture of experts also the experts (number, top-k, width, shared, leading dense blocks), so that ``moe-1b-7b``
    and ``dense-1b`` (the same dense dimensions) differ."""
    from difflm.model.moe import expert_ffn_size, first_k_dense, moe_config, shared_ffn_size

    moe = moe_config(m)
    experts = None if moe is None else (int(moe.num_experts), int(moe.top_k), expert_ffn_size(m), shared_ffn_size(m),
                                        first_k_dense(m))
    return (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, bool(m.qk_norm),
            bool(m.tie_embeddings), m.vocab_size, experts)


def plan_rows(args, base, vocab_size: int) -> list[dict]:
    """Every row of the call, in running order: ``reference``; then the variants in the order given, each
    preceded by the MegaDLMs rows of its shape (S, global batch) that have not run yet; then MegaDLMs rows
    of shapes no variant has. Each entry: name, kind (reference | variant | megadlms), cfg (composed, model
    resolved) or shape, and for variants the extra overrides. Config errors become rows with ``error``."""
    plan = []
    if not args.no_reference:
        plan.append({"name": "reference", "kind": "reference", "extra": [], "cfg": compose(args.overrides)})
    pending = []
    if args.megadlms_shapes:
        mb = load_sibling("megadlms_baseline")
    for seq, gb in args.megadlms_shapes:
        for prec in args.megadlms_precisions:
            name = mb.row_name(mb.Shape(seq, gb, precision=prec), args.megadlms_model)  # megadlms[-moe]-<prec>-s-gb
            pending.append({"name": name, "kind": "megadlms", "seq_len": seq, "global_batch": gb, "precision": prec})
    for name, extra in args.variants:
        try:
            cfg = compose(args.overrides + extra)
        except DifflmError as e:  # a bad override fails its row, not the call
            plan.append({"name": name, "kind": "variant", "extra": extra, "error": str(e)})
            continue
        entry = {"name": name, "kind": "variant", "extra": extra, "cfg": cfg}
        shape = (cfg.data.seq_len, cfg.train.global_batch_size)
        plan += [p for p in pending if (p["seq_len"], p["global_batch"]) == shape]
        pending = [p for p in pending if (p["seq_len"], p["global_batch"]) != shape]
        plan.append(entry)
    plan += pending
    for p in plan:
        if "cfg" in p:
            resolve_model_config(p["cfg"].model, vocab_size)
    names = [p["name"] for p in plan]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DifflmError(f"row names must be unique: {', '.join(dup)} (rename a --variant)")
    return plan


def check_row(cfg, device) -> None:
    """The config checks of one row (difflm-train's); raises DifflmError."""
    check_choices(cfg)
    check_model(cfg.model)
    check_precision(cfg, device, training=False)
    check_batch(cfg)
    check_cuda_graphs(cfg, 1, device)


def megadlms_model(args, base, vocab_size: int):
    """The resolved model config MegaDLMs' rows run: ``--megadlms-model PRESET`` composed with the base overrides,
    else the base model. Raises DifflmError (one line) for a model scripts/megadlms_baseline.py cannot express
    (e.g. sigmoid router scores, shared experts, token dropping), before any row runs."""
    if args.megadlms_model_preset:
        m = compose(args.overrides + [f"model={args.megadlms_model_preset}"]).model
        resolve_model_config(m, vocab_size)
    else:
        m = base.model
    try:
        load_sibling("megadlms_baseline").check_model(m)
    except DifflmError as e:
        raise DifflmError(f"--megadlms: model={m.name}: {e}") from None
    return m


def megadlms_row(p: dict, base, args, timeout: float) -> dict:
    """Run one MegaDLMs row of the plan (scripts/megadlms_baseline.py) at the MegaDLMs model (:func:`megadlms_model`)
    and the base micro-batch."""
    mb = load_sibling("megadlms_baseline")
    shape = mb.Shape(p["seq_len"], p["global_batch"], base.train.micro_batch_size, 1, p["precision"])
    row = mb.run_row(Path(args.megadlms), shape, model_cfg=args.megadlms_model, iters=args.megadlms_iters,
                     timeout=timeout, log_dir=args.log_dir)
    row.update(name=p["name"], objective="mdlm", backend="megadlms", attention="fused", compile=False,
               fp8_recipe="delayed" if p["precision"] == "fp8" else None, model=args.megadlms_model.name)
    return row


# ------------------------------------------------------------------ running the rows


def child_command(args, p: dict, json_path: Path) -> list[str]:
    """The ``--only`` command line that runs plan entry ``p`` alone in a fresh process."""
    cmd = [sys.executable, str(SCRIPTS / "benchmark.py"), *args.overrides, "--only", p["name"], "--json", str(json_path),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batches", str(args.batches),
           "--seed", str(args.seed), "--reference-precision", args.reference_precision,
           "--profile-rows", str(args.profile_rows), "--tokens", args.tokens]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    if p["kind"] == "variant":
        cmd += ["--no-reference", "--variant", f"{p['name']}: {' '.join(p['extra'])}"]
    if p["name"] in args.profile:
        cmd += ["--profile", p["name"]]
    if args.traceback:
        cmd.append("--traceback")
    return cmd


def run_child(args, p: dict, timeout: float) -> dict:
    """Plan entry ``p`` in its own process, at most ``timeout`` seconds; never raises."""
    mb = load_sibling("megadlms_baseline")
    row = row_info(p["name"], p["cfg"], p["kind"] if p["kind"] == "reference" else "difflm", args.reference_precision)
    json_path = Path(args.log_dir) / f"{p['name']}.json"
    log_path = Path(args.log_dir) / f"{p['name']}.log"
    json_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **mb.NO_MULTICAST)
    rc, seconds = mb.run_process(child_command(args, p, json_path), env, log_path, timeout, cwd=Path.cwd())
    row["wall_s"] = round(seconds, 1)
    text = log_path.read_text(errors="replace")
    if json_path.exists():
        rows = json.loads(json_path.read_text()).get("rows", [])
        if rows:
            row.update(rows[0])
            if json_path.with_name(f"{json_path.stem}_profile_{p['name']}.txt").exists():
                row["profile_table"] = json_path.with_name(f"{json_path.stem}_profile_{p['name']}.txt").read_text()
    if "tokens_per_s" not in row and "error" not in row:  # no row from the child: it crashed or hung
        why = f"timeout after {timeout:.0f} s" if rc is None else f"exit code {rc}"
        row["error"] = f"{why}: {mb.error_line(text)}"
        row["log_tail"] = "\n".join(text.splitlines()[-25:])
    return row


def run_in_process(p: dict, args, device, tok, cache: dict) -> dict:
    """Plan entry ``p`` in this process (batches shared between rows of the same objective and shape)."""
    cfg = p["cfg"]
    row = row_info(p["name"], cfg, p["kind"] if p["kind"] == "reference" else "difflm", args.reference_precision)
    # the trainer's allocator mode (train.expandable_segments); once on, it stays on for this process's later rows
    use_expandable_segments(cfg.train.expandable_segments, device)
    try:
        check_row(cfg, device)
        objective = build_objective(cfg.objective, tok.mask_id)
        key = (json.dumps(dict(cfg.objective), sort_keys=True, default=str), cfg.data.seq_len, cfg.train.micro_batch_size)
        if key not in cache:
            corpus = corpus_windows(cfg, tok, args.cache_dir) if args.tokens == "corpus" else None
            cache[key] = make_batches(cfg, objective, len(tok.tokenizer), args.batches, device, args.seed, corpus)
    except DifflmError as e:
        row["error"] = str(e)
        return row
    if p["kind"] == "reference":
        build = lambda: run_reference_row(  # noqa: E731
            cfg, device, objective.causal, args.reference_precision, args.seed)
    else:
        build = lambda: run_difflm_row(cfg, device, objective.causal, args.seed)  # noqa: E731
    return measure(row, cfg, device, cache[key], args, build)


# ------------------------------------------------------------------ comparisons and tables


def lora_lines(rows: list[dict]) -> list[str]:
    """With a LoRA row (``lora=...``) in the call: each difflm row's trainable parameters, optimizer state and peak
    memory, and each LoRA row's tokens/s against the full fine-tuning row of the same shape and kernels."""
    if not any(r.get("lora_rank") for r in rows):
        return []
    out = ["\nLoRA vs full fine-tuning (trainable parameters, AdamW state, peak memory; speed vs the full row):"]
    for r in rows:
        if "trainable_params" not in r:
            continue
        full = next((f for f in rows if not f.get("lora_rank") and "tokens_per_s" in f and "trainable_params" in f
                     and all(f.get(k) == r.get(k) for k in ("seq_len", "global_batch", "micro_batch", "backend",
                                                            "precision", "attention", "objective"))), None)
        ratio = f", {r['tokens_per_s'] / full['tokens_per_s']:.3f}x the tokens/s of {full['name']}" \
            if r.get("lora_rank") and full is not None else ""
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else "-"
        out.append(f"  {r['name']}: lora.rank={r['lora_rank']}, trainable {r['trainable_params'] / 1e6:.2f} M, "
                   f"optimizer state {r['optimizer_bytes'] / 2**30:.3f} GiB, peak memory {mem}, "
                   f"{r['tokens_per_s']:.0f} tokens/s{ratio}")
    return out


def add_ratios(rows: list[dict], plan: list[dict], megadlms_key: tuple | None = None) -> None:
    """``ratio_to_reference`` (same shape and objective as ``reference``), ``ratio_to_megadlms`` (same model as
    MegaDLMs' rows, ``megadlms_key`` = :func:`model_key` of it, default: the first row's model; S, global and micro
    batch, precision) and, for bd3lm rows, ``ratio_to_mdlm`` (the mdlm row of the same shape, backend, precision,
    recipe, attention and compile), all from rows of this call."""
    keys = {p["name"]: model_key(p["cfg"].model) for p in plan if "cfg" in p}
    base_key = megadlms_key if megadlms_key is not None else next(iter(keys.values()), None)
    ok = [r for r in rows if "tokens_per_s" in r]

    def shape(r):
        return (r["seq_len"], r["global_batch"], r["micro_batch"])

    ref = next((r for r in ok if r["name"] == "reference"), None)
    mega = {(shape(r), r["precision"]): r for r in ok if r["system"] == "megadlms"}
    for r in ok:
        if r["system"] == "megadlms":
            continue
        if ref is not None and shape(r) == shape(ref) and r["objective"] == ref["objective"]:
            r["ratio_to_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]
        m = mega.get((shape(r), r["precision"]))
        if m is not None and r["objective"] == "mdlm" and r["system"] == "difflm" and keys.get(r["name"]) == base_key:
            r["ratio_to_megadlms"] = r["tokens_per_s"] / m["tokens_per_s"]
        if r["objective"] == "bd3lm":
            same = ("backend", "precision", "fp8_recipe", "attention", "compile")
            twin = next((o for o in ok if o["objective"] == "mdlm" and o["system"] == "difflm" and shape(o) == shape(r)
                         and all(o[k] == r[k] for k in same) and keys.get(o["name"]) == keys.get(r["name"])), None)
            if twin is not None:
                r["mdlm_row"] = twin["name"]
                r["ratio_to_mdlm"] = r["tokens_per_s"] / twin["tokens_per_s"]


def _x(value) -> str:
    return f"{value:.3f}" if value is not None else "-"


def format_row_line(r: dict) -> str:
    """One table line, or ``NAME: failed: <reason>`` / ``NAME: skipped: <reason>``."""
    if "tokens_per_s" not in r:
        status = "skipped" if r.get("skipped") else "failed"
        return f"{r['name']}: {status}: {r.get('error', '?')}"
    mfu_s = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
    loss = f"{r['loss']:.3f}" if r.get("loss") is not None else "-"
    line = (f"{r['name']:<24} {r.get('objective', '-'):<6} {r['backend']:<9} {r['precision']:<5} "
            f"{str(r.get('fp8_recipe') or '-'):<8} {r.get('attention', '-'):<5} {'y' if r.get('compile') else 'n':<3} "
            f"{r['seq_len']:>5} {r['global_batch']:>4} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {mfu_s:>6} "
            f"{mem:>7} {_x(r.get('ratio_to_reference')):>7} {_x(r.get('ratio_to_megadlms')):>8} {loss:>7}")
    return line + (f"  [{r['note']}]" if r.get("note") else "")


def format_table(rows: list[dict]) -> str:
    head = (f"{'row':<24} {'obj':<6} {'backend':<9} {'prec':<5} {'recipe':<8} {'attn':<5} {'cmp':<3} {'S':>5} {'GB':>4} "
            f"{'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'mem GiB':>7} {'vs ref':>7} {'vs MgDLM':>8} {'loss':>7}")
    return "\n".join([head, "-" * len(head)] + [format_row_line(r) for r in rows])


def _cell(r) -> str:
    if r is None:
        return "-"
    mfu_s = f" ({100 * r['mfu']:.1f} %)" if r.get("mfu") is not None else ""
    return f"{r['tokens_per_s'] / 1e3:.1f} k{mfu_s}"


def megadlms_table(rows: list[dict], shapes: list[tuple[int, int]]) -> str:
    """The comparison table: per shape, MegaDLMs BF16 / FP8 and the fastest TE mdlm row of each precision with its
    ratio against MegaDLMs at the same precision (rows of this call only)."""
    ok = [r for r in rows if "tokens_per_s" in r]
    lines = ["| S, global batch | MegaDLMs BF16 | MegaDLMs FP8 hybrid | difflm TE BF16, same shape | difflm TE FP8, same shape |",
             "|---|---|---|---|---|"]
    for seq, gb in shapes:
        cells = []
        for prec in ("bf16", "fp8"):
            cells.append(next((r for r in ok if r["system"] == "megadlms" and r["precision"] == prec
                               and (r["seq_len"], r["global_batch"]) == (seq, gb)), None))
        for prec in ("bf16", "fp8"):
            cand = [r for r in ok if r["system"] == "difflm" and r["backend"] == "te" and r["objective"] == "mdlm"
                    and r["precision"] == prec and (r["seq_len"], r["global_batch"]) == (seq, gb)
                    and r.get("ratio_to_megadlms") is not None]
            best = max(cand, key=lambda r: r["tokens_per_s"], default=None)
            cells.append(best)
        text = [_cell(c) for c in cells[:2]]
        for c in cells[2:]:
            text.append("-" if c is None else f"{_cell(c)} = {c['ratio_to_megadlms']:.3f}x [{c['name']}]")
        lines.append(f"| {seq}, {gb} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def bd3lm_lines(rows: list[dict]) -> list[str]:
    """One line per bd3lm row: its figures, the FLOPs count used, and the mdlm row of the same settings."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        if r.get("objective") != "bd3lm" or "tokens_per_s" not in r:
            continue
        line = (f"{r['name']} (bd3lm): {_cell(r)}, {r['flops_per_token']:.3g} FLOP/token "
                f"([x_t ; x_0] under the block-causal mask, difflm.training.flops.bd3lm_flops_per_token)")
        twin = by_name.get(r.get("mdlm_row"))
        if twin is not None:
            line += (f" | {twin['name']} (mdlm): {_cell(twin)}, {twin['flops_per_token']:.3g} FLOP/token"
                     f" | tokens/s bd3lm / mdlm = {r['ratio_to_mdlm']:.3f}x")
        out.append(line)
    return out


# ------------------------------------------------------------------ main


def result_record(args, base, device_name: str, vocab_size: int, rows: list[dict]) -> dict:
    return {
        "device": device_name, "torch": torch.__version__, "peak_tflops": args.peak / 1e12 if args.peak else None,
        "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup, "tokens": args.tokens,
        "micro_batch_size": base.train.micro_batch_size, "global_batch_size": base.train.global_batch_size,
        "accumulation": base.train.global_batch_size // base.train.micro_batch_size, "seq_len": base.data.seq_len,
        "vocab_size": vocab_size, "model": base.model.name, "objective": base.objective.name,
        "megadlms": args.megadlms, "megadlms_shapes": [list(s) for s in args.megadlms_shapes],
        "megadlms_model": args.megadlms_model.name if args.megadlms_model is not None else None,
        "rows": [{k: v for k, v in r.items() if k != "profile_table"} for r in rows],
    }


def write_json(args, record: dict, rows: list[dict]) -> None:
    if not args.json:
        return
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json.dumps(record, indent=2, default=str))
    for r in rows:
        if "profile_table" in r:
            path.with_name(f"{path.stem}_profile_{r['name']}.txt").write_text(r["profile_table"])


def main(argv=None) -> dict:
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    ap.add_argument("--variant", action="append", default=[], help="'NAME: override ...' (repeatable)")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=10,
                    help="timed optimizer steps per row (default 10)")
    ap.add_argument("--warmup", type=script_cli.int_at_least(0), default=3,
                    help="untimed steps before them: compilation, autotuning, FP8 scaling history (default 3)")
    ap.add_argument("--batches", type=script_cli.int_at_least(1), default=4,
                    help="distinct noised batches cycled through (default 4)")
    ap.add_argument("--no-reference", action="store_true",
                    help="leave out the plain eager PyTorch reference row")
    ap.add_argument("--reference-precision", default=None, help="bf16 (CUDA default) or fp32 (CPU default)")
    ap.add_argument("--json", type=script_cli.output_file, default=None, help="write the results here")
    ap.add_argument("--profile", default="", help="comma-separated row names to profile")
    ap.add_argument("--profile-rows", type=int, default=12, help="kernels printed per profile (files hold 30)")
    ap.add_argument("--traceback", action="store_true", help="print tracebacks of failing rows")
    ap.add_argument("--seed", type=int, default=0, help="seed of every row's weights and batches (default 0)")
    ap.add_argument("--tokens", choices=("random", "corpus"), default="random",
                    help="uniform random tokens, or the run's training data (data.*) as the Trainer reads it")
    ap.add_argument("--cache-dir", default=None, help="--tokens corpus: where its tokens are cached "
                    "(default: data.cache_dir, else benchmark_tokens beside difflm's tokenizer cache, ~/.cache/difflm)")
    ap.add_argument("--isolate", action="store_true", help="each row in its own process (see the docstring)")
    ap.add_argument("--row-timeout", type=script_cli.positive_number, default=240,
                    help="seconds per isolated difflm row")
    ap.add_argument("--time-budget", type=script_cli.positive_number, default=None,
                    help="seconds for the whole call: each isolated row's timeout is cut to what is left, and no "
                         f"row starts with less than {MIN_ROW_S:.0f} s left")
    ap.add_argument("--log-dir", default=None, help="per-row logs and JSON (default: a temp dir)")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one row of the plan (--isolate's children)
    ap.add_argument("--megadlms", default=None, help="MegaDLMs export (scripts/megadlms_baseline.py export)")
    ap.add_argument("--megadlms-shapes", default=None, help="SEQxGLOBAL_BATCH,... (default: the base shape)")
    ap.add_argument("--megadlms-precisions", type=script_cli.comma_list(("bf16", "fp8"), "MegaDLMs precision"),
                    default=["bf16", "fp8"], help="comma-separated MegaDLMs rows per shape: bf16, fp8 (default both)")
    ap.add_argument("--megadlms-timeout", type=script_cli.positive_number, default=180,
                    help="seconds per MegaDLMs row")
    ap.add_argument("--megadlms-iters", type=script_cli.int_at_least(16), default=16,
                    help="iterations of each MegaDLMs row; the median is of iterations 6-16 (default 16)")
    ap.add_argument("--megadlms-model", default=None, dest="megadlms_model_preset",
                    help="difflm model preset MegaDLMs' rows run (default: the base overrides' model=), e.g. moe-1b-7b")
    ap.add_argument("--plan", action="store_true", help="print the rows (and child commands) and exit")
    args = ap.parse_intermixed_args(argv)  # the overrides may come before, between or after the flags
    args.profile = {p for p in args.profile.split(",") if p}
    args.variants = [parse_variant(v) for v in args.variant] or [("difflm", [])]
    if args.tokens == "corpus" and args.cache_dir is None:  # one tokenization per machine, shared by the rows
        from difflm.data.tokenizer import difflm_cache_dir

        args.cache_dir = difflm_cache_dir("benchmark_tokens")
    started = time.monotonic()

    base = compose(args.overrides)
    check_choices(base)
    check_batch(base)
    device = resolve_device(base.device)
    args.peak = peak_flops(device)
    if args.reference_precision is None:
        args.reference_precision = "bf16" if device.type == "cuda" else "fp32"
    if args.reference_precision not in ("bf16", "fp32"):
        raise DifflmError(f"--reference-precision={args.reference_precision!r} is not one of: bf16, fp32")
    args.megadlms_shapes = ([] if not args.megadlms else parse_shapes(args.megadlms_shapes) if args.megadlms_shapes
                            else [(base.data.seq_len, base.train.global_batch_size)])
    from difflm.data import build_tokenizer

    tok = build_tokenizer(base.data.tokenizer, base.model.vocab_multiple)
    resolve_model_config(base.model, tok.padded_vocab_size)
    args.megadlms_model = megadlms_model(args, base, tok.padded_vocab_size) if args.megadlms_shapes else None
    plan = plan_rows(args, base, tok.padded_vocab_size)
    profilable = [p["name"] for p in plan if p["kind"] != "megadlms"]  # MegaDLMs rows run its own code
    unknown = sorted(args.profile - set(profilable))
    if unknown:
        raise DifflmError(f"--profile {','.join(unknown)}: no such row; the rows are: {', '.join(profilable)}")
    if args.only is not None:
        plan = [p for p in plan if p["name"] == args.only and p["kind"] != "megadlms"]
        if not plan:
            raise DifflmError(f"--only {args.only}: no such difflm row")
    if args.plan:  # prints the rows' commands; writes nothing, so no log directory is made
        args.log_dir = args.log_dir or str(Path(tempfile.gettempdir()) / "difflm_bench_XXXXXXXX")
        for p in plan:
            if "error" in p:
                what = f"failed: {p['error']}"
            elif p["kind"] == "megadlms":
                what = f"MegaDLMs S={p['seq_len']} global batch {p['global_batch']} {p['precision']}"
            else:
                what = shlex.join(child_command(args, p, Path(args.log_dir) / f"{p['name']}.json"))
            print(f"{p['name']}: {what}")
        return {"plan": [p["name"] for p in plan]}
    made_log_dir = args.log_dir is None  # removed at the end if no row wrote a log into it
    if made_log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="difflm_bench_")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: list[dict] = []
    cache: dict = {}
    isolated = args.isolate and args.only is None
    for p in plan:
        left = math.inf if args.time_budget is None else args.time_budget - (time.monotonic() - started)
        system = {"variant": "difflm"}.get(p["kind"], p["kind"])
        if "error" in p:
            row = {"name": p["name"], "system": system, "error": p["error"]}
        elif left < MIN_ROW_S:
            row = {"name": p["name"], "system": system, "skipped": True,
                   "error": f"time budget ({args.time_budget:.0f} s) spent"}
        elif p["kind"] == "megadlms":
            row = megadlms_row(p, base, args, timeout=min(args.megadlms_timeout, left))
        elif isolated:
            row = run_child(args, p, timeout=min(args.row_timeout, left))
        else:
            row = run_in_process(p, args, device, tok, cache)
        rows.append(row)
        add_ratios(rows, plan, model_key(args.megadlms_model) if args.megadlms_model is not None else None)
        if args.only is None:
            print(format_row_line(row), flush=True)
            if "log_tail" in row and "tokens_per_s" not in row:
                print("    " + "\n    ".join(row["log_tail"].splitlines()[-12:]), flush=True)
        write_json(args, result_record(args, base, device_name, tok.padded_vocab_size, rows), rows)
    result = result_record(args, base, device_name, tok.padded_vocab_size, rows)
    for r in rows:  # profiles first, the tables last (the end of the output is what a log tail shows)
        if "profile_table" in r:
            what = (f"kernel time shares {r['kernel_shares']}" if r.get("kernel_shares")
                    else "CPU ops; kernel time shares and gpu_busy need CUDA")
            print(f"\n--- profile: {r['name']} ({what}) ---\n"
                  + "\n".join(line[:160] for line in r["profile_table"].splitlines()[:args.profile_rows + 4]))
    print(f"\n{device_name} | model={base.model.name} micro_batch={base.train.micro_batch_size} | "
          f"{args.steps} steps after {args.warmup} warm-up, {args.tokens} tokens | MFU vs {result['peak_tflops'] or '-'} TFLOP/s | "
          f"S, GB per row; MegaDLMs: median of iterations 6-{args.megadlms_iters}")
    print(format_table(rows))
    for line in bd3lm_lines(rows):
        print(line)
    for line in lora_lines(rows):
        print(line)
    if args.megadlms_shapes:
        print(f"\nMegaDLMs vs difflm, model={args.megadlms_model.name}, micro-batch {base.train.micro_batch_size}, "
              f"{device_name}, same call (tokens/s, MFU, ratio to MegaDLMs at the same precision):")
        print(megadlms_table(rows, args.megadlms_shapes))
    write_json(args, result, rows)
    if made_log_dir and not any(Path(args.log_dir).iterdir()):
        Path(args.log_dir).rmdir()
    return result


def exit_status(result: dict) -> int:
    """1 when the call had difflm rows (the variants, not ``reference`` or MegaDLMs) and every one failed or was
    skipped, so scripts notice; else 0."""
    ours = [r for r in result.get("rows", []) if r.get("system") == "difflm"]
    return 1 if ours and not any("tokens_per_s" in r and "error" not in r for r in ours) else 0


@script_cli.script_main
def cli(argv=None) -> int:
    """The command line: :func:`main`'s exit status (:func:`exit_status`); a usage error (a bad override, option or
    row name) ends as one line ``benchmark.py: error: ...`` on stderr, exit status 2."""
    return exit_status(main(argv))


if __name__ == "__main__":
    sys.exit(cli())
