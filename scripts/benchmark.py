#!/usr/bin/env python3
"""Training-step throughput of difflm's model against a plain eager PyTorch reference, in one process.

    python scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 train.global_batch_size=4 precision=bf16 \\
        --variant "torch-compile: model.compile=true" \\
        --variant "te-fp8: model.backend=te model.attention_backend=te precision=fp8" \\
        --steps 10 --warmup 3 --json bench.json

Positional arguments are Hydra overrides of ``difflm/conf/train.yaml`` (composed with ``hydra.compose``,
the same schema and checks as ``difflm-train``); each ``--variant "NAME: overrides"`` adds a row composed
from the base overrides plus its own (without ``--variant`` the base config is the one row).

Every row runs real training steps of the same model code (:func:`difflm.model.build_model`'s classes) on
synthetic tokens: the configured objective's ``noise`` (MDLM: t ~ U(0,1), Bernoulli(p) masking, keyed) on
``--batches`` batches drawn once and kept on the device, so the timed loop does no host work; the model's
logits only at the loss positions; :func:`difflm.objectives.weighted_ce_sum`; gradient clipping; the
run's AdamW (fused on CUDA). One timed step is one optimizer step over ``train.global_batch_size`` sequences,
accumulated in micro-batches of ``train.micro_batch_size`` as the trainer does. ``reference`` is the baseline written below: a plain eager PyTorch
transformer of the same dimensions (separate nn.Linear q/k/v/o, SwiGLU MLP, nn.RMSNorm, SDPA, full-vocab
LM head with cross-entropy at every position, fused AdamW), at BF16 autocast on CUDA (FP32 on CPU).

Timing: ``--warmup`` steps (compilation, autotuning, FP8 scaling history), then ``--steps`` steps between
two CUDA events. MFU = tokens/s x (6 N + 12 L d S) / peak, N without the input embedding
(:func:`difflm.training.flops.flops_per_token`, PaLM appendix B), peak = 989 TFLOP/s dense BF16 on
H100/H200 (:data:`difflm.training.flops.PEAK_TFLOPS_BF16`), also for FP8 rows so that rows compare.
Prints one table and writes JSON (``--json``). ``--profile NAME`` adds a torch.profiler table of the
top kernels of that row (printed and written next to the JSON).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import sys
import time
import traceback
from pathlib import Path
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from difflm.config import CONF_DIR  # noqa: E402
from difflm.config.validate import check_batch, check_choices, check_model, check_precision, resolve_device  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402
from difflm.model import compile_blocks, resolve_model_config  # noqa: E402
from difflm.model.transformer import Transformer  # noqa: E402
from difflm.objectives import build_objective, loss_normaliser, weighted_ce_sum  # noqa: E402
from difflm.training.flops import flops_per_token, mfu, peak_flops  # noqa: E402
from difflm.training.optimizer import build_optimizer  # noqa: E402
from difflm.training.precision import autocast_context, precision_name  # noqa: E402

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
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME: key=value key=value"`` -> (NAME, [overrides]). Raises DifflmError without a name."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise DifflmError(f"--variant {text!r} needs the form 'NAME: override override ...'")
    return name.strip(), rest.split()


@torch.no_grad()
def fast_init(model: nn.Module, std: float, num_layers: int) -> None:
    """Megatron-style init drawn on the model's device (the keyed CPU init is slow for billions of
    parameters and irrelevant to speed): norms 1, residual outputs std / sqrt(2 L), others std."""
    scaled = std / math.sqrt(2 * num_layers)
    for name, p in model.named_parameters():
        if type(p) is not torch.Tensor and type(p) is not nn.Parameter:
            continue  # TE FP8 weights (precision.fp8_weights): initialised by TE
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, scaled if name.endswith(("proj.weight", "fc2_weight", "o.weight", "w2.weight")) else std)


def build_variant_model(cfg, causal: bool, device: torch.device) -> nn.Module:
    """The model of ``cfg.model`` (torch or TE backend), materialised on ``device`` with :func:`fast_init`."""
    m = cfg.model
    if m.backend == "te":
        from difflm.model.te_backend import TETransformer, fp8_layer_options

        options = fp8_layer_options(m, cfg.precision)
        where = device if options["fp8_weights_recipe"] is not None else "meta"
        model = TETransformer(m, causal, device=where, **options)
    else:
        with torch.device("meta"):
            model = Transformer(m, causal=causal)
        where = "meta"
    if where == "meta":
        model.to_empty(device=device)
    fast_init(model, m.init_std, m.num_layers)
    if getattr(m, "compile", False):
        compile_blocks(model)
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


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def micro_batches(batches, step: int, accum: int) -> list:
    """The ``accum`` micro-batches of optimizer step ``step``, cycling through the prepared pool."""
    return [batches[(step * accum + j) % len(batches)] for j in range(accum)]


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


KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attn", "cudnn", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel")),
)


def profile_step(step, batches, device: torch.device, rows: int = 20, accum: int = 1) -> tuple[str, dict]:
    """torch.profiler over 2 steps: (table of the top ``rows`` kernels by device time, share per class)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            step(micro_batches(batches, i, accum))
        sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort, row_limit=rows, max_name_column_width=90)
    shares: dict = {}
    if device.type == "cuda":
        total = 0.0
        for ev in averages:
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0.0)
            if not t or getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            name = ev.key.lower()
            cls = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
            shares[cls] = shares.get(cls, 0.0) + t
            total += t
        shares = {k: round(v / total, 4) for k, v in sorted(shares.items())} if total else {}
        shares["device_ms_per_step"] = round(total / 2 / 1000.0, 2)
    return table, shares


# ------------------------------------------------------------------ rows


def make_batches(cfg, objective, vocab_real: int, count: int, device: torch.device, seed: int):
    """``count`` noised micro-batches [B, S] on ``device``, through ``objective.noise`` (keyed by (seed, k))."""
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        tokens = torch.randint(0, vocab_real, (b, s), generator=gen)
        batch = objective.noise(tokens, range(k * b, (k + 1) * b), (seed, k), b)
        out.append(batch.to(device))
    sync(device)
    return out


def run_difflm_row(cfg, device, causal: bool) -> dict:
    """Model, optimizer and one training step of a difflm row (the trainer's step without data loading)."""
    model = build_variant_model(cfg, causal, device)
    optimizer = build_variant_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision.name == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    precision = cfg.precision

    def step(micro):
        loss = 0.0
        norm = cfg.objective.loss_norm
        normaliser = sum(loss_normaliser(norm, batch.num_tokens) for batch in micro)  # the step's global count
        for batch in micro:
            with autocast_context(precision, device):
                logits = model(batch.input_ids, batch.loss_mask)
            micro_loss = weighted_ce_sum(logits, batch, norm, normaliser)
            scaler.scale(micro_loss).backward()
            loss = loss + micro_loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=device.type == "cuda")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    m = cfg.model
    n = model.num_params()
    return {"n_params_non_embedding": n, "step": step, "model": model, "optimizer": optimizer,
            "flops_per_token": flops_per_token(n, m.num_layers, m.hidden_size, cfg.data.seq_len)}


def run_reference_row(cfg, device, causal: bool, reference_precision: str) -> dict:
    """Model, optimizer and one training step of the eager reference (AR-style loss at every position)."""
    m = cfg.model
    with torch.device("meta"):
        model = ReferenceTransformer(m, causal)
    model.to_empty(device=device)
    fast_init(model, m.init_std, m.num_layers)
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


def measure(name: str, cfg, device, batches, args, build) -> dict:
    row = {"name": name, "backend": "reference" if name == "reference" else cfg.model.backend,
           "precision": args.reference_precision if name == "reference" else precision_name(cfg.precision),
           "fp8_recipe": cfg.precision.fp8_recipe if cfg.precision.name == "fp8" and name != "reference" else None,
           "attention": "sdpa" if name == "reference" else cfg.model.attention_backend,
           "compile": bool(cfg.model.get("compile", False)) and name != "reference"}
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
                   mfu=mfu(tps, state["flops_per_token"], args.peak), peak_mem_gib=peak_memory_gib(device),
                   n_params_non_embedding=state["n_params_non_embedding"], flops_per_token=state["flops_per_token"])
        if not math.isfinite(loss):
            row["error"] = f"non-finite loss {loss}"
        if name in args.profile:
            table, shares = profile_step(state["step"], batches, device, rows=30, accum=accum)
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


def format_table(rows: list[dict]) -> str:
    head = f"{'row':<22} {'backend':<9} {'prec':<5} {'recipe':<8} {'attn':<5} {'cmp':<3} {'step ms':>9} " \
           f"{'tokens/s':>10} {'MFU':>6} {'mem GiB':>8} {'vs ref':>7} {'loss':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r and "tokens_per_s" not in r:
            lines.append(f"{r['name']:<22} {r['backend']:<9} {r['precision']:<5} FAILED: {r['error'][:110]}")
            continue
        mfu_s = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        ratio = f"{r['ratio_to_reference']:.3f}" if r.get("ratio_to_reference") is not None else "-"
        lines.append(f"{r['name']:<22} {r['backend']:<9} {r['precision']:<5} {str(r['fp8_recipe'] or '-'):<8} "
                     f"{r['attention']:<5} {'y' if r['compile'] else 'n':<3} {r['step_ms']:>9.1f} "
                     f"{r['tokens_per_s']:>10.0f} {mfu_s:>6} {r['peak_mem_gib']:>8.1f} {ratio:>7} {r['loss']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of difflm/conf/train.yaml")
    ap.add_argument("--variant", action="append", default=[], help="'NAME: override ...' (repeatable)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", type=int, default=4, help="distinct noised batches cycled through")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--reference-precision", default=None, help="bf16 (CUDA default) or fp32 (CPU default)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", default="", help="comma-separated row names to profile")
    ap.add_argument("--profile-rows", type=int, default=12, help="kernels printed per profile (files hold 30)")
    ap.add_argument("--traceback", action="store_true", help="print tracebacks of failing rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.profile = {p for p in args.profile.split(",") if p}
    if args.steps < 1 or args.warmup < 0 or args.batches < 1:
        raise DifflmError("--steps must be >= 1, --warmup >= 0 and --batches >= 1")

    base = compose(args.overrides)
    check_choices(base)
    accum = check_batch(base)  # micro-batches per optimizer step (train.global_batch_size / micro_batch_size)
    device = resolve_device(base.device)
    args.peak = peak_flops(device)
    if args.reference_precision is None:
        args.reference_precision = "bf16" if device.type == "cuda" else "fp32"
    if args.reference_precision not in ("bf16", "fp32"):
        raise DifflmError(f"--reference-precision={args.reference_precision!r} is not one of: bf16, fp32")
    from difflm.data import build_tokenizer

    tok = build_tokenizer(base.data.tokenizer, base.model.vocab_multiple)
    variants = [parse_variant(v) for v in args.variant] or [("difflm", [])]
    objective = build_objective(base.objective, tok.mask_id)
    batches = make_batches(base, objective, len(tok.tokenizer), args.batches, device, args.seed)

    rows = []
    if not args.no_reference:
        ref_cfg = compose(args.overrides)
        resolve_model_config(ref_cfg.model, tok.padded_vocab_size)
        rows.append(measure("reference", ref_cfg, device, batches, args,
                            lambda: run_reference_row(ref_cfg, device, objective.causal, args.reference_precision)))
    for name, extra in variants:
        cfg = compose(args.overrides + extra)
        try:
            check_choices(cfg)
            check_model(cfg.model)
            check_precision(cfg, device, training=False)
            for key in ("micro_batch_size", "global_batch_size"):
                if cfg.train[key] != base.train[key] or cfg.data.seq_len != base.data.seq_len:
                    raise DifflmError(f"--variant {name}: train.micro_batch_size, train.global_batch_size and data.seq_len "
                                      "must match the base overrides (the batches are shared)")
        except DifflmError as e:
            rows.append({"name": name, "backend": cfg.model.backend, "precision": cfg.precision.name, "error": str(e)})
            continue
        resolve_model_config(cfg.model, tok.padded_vocab_size)
        rows.append(measure(name, cfg, device, batches, args, lambda: run_difflm_row(cfg, device, objective.causal)))

    ref = next((r for r in rows if r["name"] == "reference" and "tokens_per_s" in r), None)
    for r in rows:
        if ref is not None and "tokens_per_s" in r:
            r["ratio_to_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "device": device_name, "torch": torch.__version__, "peak_tflops": args.peak / 1e12 if args.peak else None,
        "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
        "micro_batch_size": base.train.micro_batch_size, "global_batch_size": base.train.global_batch_size,
        "accumulation": accum, "seq_len": base.data.seq_len,
        "vocab_size": tok.padded_vocab_size, "model": base.model.name, "objective": base.objective.name,
        "rows": [{k: v for k, v in r.items() if k != "profile_table"} for r in rows],
    }
    for r in rows:  # profiles first, the table last (the end of the output is what a log tail shows)
        if "profile_table" in r:
            print(f"\n--- profile: {r['name']} (kernel time shares {r.get('kernel_shares')}) ---\n"
                  + "\n".join(line[:160] for line in r["profile_table"].splitlines()[:args.profile_rows + 4]))
    print(f"\n{device_name} | model={base.model.name} seq_len={base.data.seq_len} micro_batch={base.train.micro_batch_size} "
          f"x {accum} per optimizer step "
          f"objective={base.objective.name} | {args.steps} steps after {args.warmup} warm-up | "
          f"MFU vs {result['peak_tflops'] or '-'} TFLOP/s")
    print(format_table(rows))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        for r in rows:
            if "profile_table" in r:
                path.with_name(f"{path.stem}_profile_{r['name']}.txt").write_text(r["profile_table"])
    return result


if __name__ == "__main__":
    try:
        main()
    except DifflmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
