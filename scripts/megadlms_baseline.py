#!/usr/bin/env python3
"""MegaDLMs' own pretraining, timed at a difflm model's shape: the baseline difflm is compared with, from its log.

MegaDLMs (github JinjieNi/MegaDLMs: Megatron-LM + Transformer Engine, LLaDA-style masked-diffusion loss) is
the system users would pick instead of difflm. This script runs ITS entry point, ``pretrain_difflm.py``, under
``torchrun`` on N GPUs, with mock data, at the dimensions of a difflm ``model=`` preset (default ``1.7b``,
which is MegaDLMs' 1.7B), and reports tokens/s and MFU from the iteration lines of Megatron's log.
MegaDLMs' code is never committed here: ``export`` writes a stripped copy into a git-ignored folder.

    # once, on a machine with the mirror (fetch github:JinjieNi/MegaDLMs): ~4 MB, the pretraining path only
    python scripts/megadlms_baseline.py export --git-dir /work/.mirror/JinjieNi+MegaDLMs/repo --out .megadlms

    # on the GPU machine (TE staged, see scripts/gpu_env.sh), one row:
    python scripts/megadlms_baseline.py run --megadlms .megadlms --seq-len 4096 --global-batch 16 \\
        --precision fp8 --gpus 1 --timeout 150 --json /root/out/megadlms_fp8_4096.json

    python scripts/megadlms_baseline.py run ... --dry-run      # print the torchrun command, run nothing
    python scripts/megadlms_baseline.py parse LOG --seq-len 4096 --global-batch 16   # re-read a saved log

``scripts/benchmark.py --megadlms .megadlms`` runs these rows in the same call as difflm's and prints the
ratios. Measurement: ``--iters 16`` iterations with ``--log-interval 1``; tokens/s = global batch x S /
the median ``elapsed time per iteration (ms)`` of iterations 6-16 (``--window``; Megatron times each
iteration between barriers). MFU = tokens/s per GPU x (6 N + 12 L d S) / 989 TFLOP/s (PaLM appendix B, N
without the input embedding, counted on difflm's model of the same preset:
:func:`difflm.training.flops.flops_per_token`; the dense BF16 peak also for FP8, as in difflm's benchmark).

What runs (``megadlms_flags``): the model flags of MegaDLMs' ``examples/dlm_training/dlm_pretrain_1.7b.sh``
derived from the preset (28 x 2048, 16 heads, 16 KV groups = no GQA, FFN 6144, SwiGLU, RMSNorm eps 1e-6,
QK-norm, RoPE 10000, untied, no biases, no dropout), its optimizer settings, micro-batch 4, and
``--model-running-mode difflm-noshift --attention-mask-type no_mask --mask-token 50277 --attention-backend
fused --mock-data --tokenizer-type NullTokenizer --use-distributed-optimizer``; BF16: ``--bf16``; FP8:
``--bf16 --fp8-format hybrid`` (Megatron's delayed scaling, MegaDLMs' defaults: amax history 1, most recent).
MegaDLMs drops the first token of every sample (``input_ids[:, 1:]``), and its FP8 GEMMs crash on the
S - 1 rows that leaves, so every row runs ``--seq-length S+1 --difflm-varilen-prob 0``: the model sees
exactly S tokens per sequence (its ``real input length`` log entry says so; the parser checks it) and never a
random shorter one. With 2+ GPUs, MegaDLMs' ``--overlap-grad-reduce --overlap-param-gather`` are added.

Mixture of experts (``--model moe-1b-7b``; :func:`moe_flags`): every MLP is Megatron-Core's ``MoELayer`` with
its ``TopKRouter`` (``--moe-router-type topk``), ``--num-experts``, ``--moe-ffn-hidden-size``,
``--moe-router-topk``, ``--moe-router-pre-softmax`` (top-k of the softmax over all experts, not renormalised, as
difflm's router without ``norm_topk_prob``), the aux loss (``aux_loss``, ``--moe-aux-loss-coeff``) and z-loss
(``--moe-z-loss-coeff``) of the preset, TE's grouped GEMM (``--moe-grouped-gemm``), no capacity factor, no shared
experts, EP 1 (``allgather`` dispatcher, local on one GPU). Rows are named ``megadlms-moe-...``; N is the active
count (:func:`count_params`: difflm's parameters minus :func:`difflm.model.moe.moe_inactive_params`), so MFU
compares with difflm's MoE rows. An MoE feature this Megatron lacks (sigmoid scores, the auxiliary-loss-free
bias, group-limited routing, shared experts, leading dense blocks, token dropping, global-batch balancing, scaled
gating weights) raises DifflmError with one line naming the key; docs/moe.md lists what else differs.

Compatibility with the GPU image (TE 2.20, no apex), without editing MegaDLMs' files:
``scripts/megadlms_shim`` goes first on the child's PYTHONPATH. Its ``sitecustomize.py`` installs an import
hook that adds TE 1.x's ``transformer_engine.pytorch.attention._SplitAlongDim`` and ``FusedRoPEFunc`` (TE 2.x
argument order, :mod:`megadlms_te_compat`), and one that adds ``--moe-router-type`` to MegaDLMs' parser
(``pretrain_difflm.py`` reads it for every MoE run, no parser defines it; :mod:`megadlms_args_compat`);
``fused_weight_gradient_mlp_cuda.py`` stands in for apex's
extension (a ``torch.matmul`` wgrad accumulation, used by the LM head only). Every other import on the
pretraining path is present on the image or guarded by MegaDLMs itself (apex, amp_C -> TE's multi-tensor
kernels and FusedAdam; flash_attn, grouped_gemm, modelopt, boto3, one_logger, wandb, tensorboard, nltk and
the tokenizers are unused with these flags). Megatron compiles its dataset index helpers (pybind11 C++) with
``make`` on rank 0; this script builds them first with an explicit extension suffix, so a missing
``python3-config`` does not matter. The cuDNN of PyTorch's wheel is put first (``CUDNN_HOME`` and
``LD_LIBRARY_PATH``, docs/performance.md) unless ``CUDNN_HOME`` is set; NVLink multicast stays off.

A failing or hanging run never raises: ``run`` returns (and prints) a row ``failed: <reason>`` with the end of
the log (``--timeout`` seconds, then SIGTERM to its processes and SIGKILL 15 s later); exit status 1. The run ends
with the script (SIGTERM, SIGINT, or its death on Linux, stops torchrun, which stops its workers). A usage error
(a count below 1, a shape Megatron refuses, a missing log or mirror) is one line
``megadlms_baseline.py: error: ...``, exit status 2.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
SHIM_DIR = Path(__file__).resolve().parent / "megadlms_shim"
sys.path.insert(0, str(REPO))
from difflm import script_cli, strict_json  # noqa: E402

PEAK_TFLOPS = 989.0  # dense BF16, H100/H200 (difflm.training.flops.PEAK_TFLOPS_BF16["H200"])
MASK_TOKEN = 50277  # MegaDLMs' NeoX [MASK] id (the first free id), as difflm
DEFAULT_WINDOW = (6, 16)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# What the pretraining path needs; tests, tools, tasks, examples and the tokenizer vocabularies (11 MB) stay out.
EXPORT_PATHS = ("pretrain_difflm.py", "custom_args", "megatron")
EXPORT_SKIP = re.compile(r"(^|/)tests?/|^megatron/training/tokenizer/[a-z0-9]+_tokenizer/|^megatron/inference/static/")


# ------------------------------------------------------------------ model and flags


@dataclass
class Shape:
    """One measured shape: S tokens per sequence seen by the model, global batch (sequences per optimizer step
    over all GPUs), micro-batch per GPU, number of GPUs, precision (``bf16`` | ``fp8``)."""

    seq_len: int
    global_batch: int
    micro_batch: int = 4
    gpus: int = 1
    precision: str = "bf16"

    def check(self) -> None:
        """Raises DifflmError on a shape Megatron would refuse later (and slower)."""
        from difflm.errors import DifflmError

        if self.precision not in ("bf16", "fp8"):
            raise DifflmError(f"--precision {self.precision!r}: MegaDLMs rows are bf16 or fp8")
        if min(self.seq_len, self.global_batch, self.micro_batch, self.gpus) < 1:
            raise DifflmError("--seq-len, --global-batch, --micro-batch and --gpus must be >= 1")
        if self.global_batch % (self.micro_batch * self.gpus):
            raise DifflmError(f"--global-batch {self.global_batch} must be a multiple of --micro-batch x --gpus "
                              f"= {self.micro_batch * self.gpus} (Megatron accumulates whole micro-batches)")
        if self.precision == "fp8" and (self.seq_len * self.micro_batch) % 16:
            raise DifflmError(f"--seq-len {self.seq_len} x --micro-batch {self.micro_batch} must be a multiple of 16 "
                              "for FP8 GEMMs")


def model_config(preset: str = "1.7b", vocab_size: int = 50304):
    """difflm's ``model=<preset>`` config (Hydra compose of conf/), vocabulary ``vocab_size``."""
    from difflm.config.compose import compose_train_config
    from difflm.model import resolve_model_config

    cfg = compose_train_config([f"model={preset}"])  # an unknown preset: DifflmError naming the closest
    resolve_model_config(cfg.model, vocab_size)
    return cfg.model


def count_params(model_cfg, active: bool = True) -> int:
    """N of PaLM's MFU formula: parameters without the input embedding, from difflm's model of ``model_cfg``
    built on the meta device (no memory, no initialisation). For a mixture-of-experts model (``active``, the
    default) the active count, as difflm's trainer and benchmark take it: minus the routed experts a token is not
    sent to (:func:`difflm.model.moe.moe_inactive_params`); ``active=False``: every parameter."""
    import torch

    from difflm.model import build_model
    from difflm.model.auto_kernels import cpu_kernels
    from difflm.model.moe import moe_inactive_params

    cfg = cpu_kernels(model_cfg)  # the same parameters under every kernel set
    cfg.backend, cfg.compile = "torch", False
    n = build_model(cfg, causal=False, device=torch.device("meta"), seed=None).num_params()
    return n - moe_inactive_params(model_cfg) if active else n


def moe_flags(m) -> list[str]:
    """Megatron-Core MoE arguments (MegaDLMs' copy) of difflm model config ``m``; ``[]`` for a dense model.

    Every MoE block: ``--num-experts E`` SwiGLU experts of width ``--moe-ffn-hidden-size f`` (TE's grouped GEMM,
    ``--moe-grouped-gemm``), ``--moe-router-topk k`` chosen per token; gating weights = the top-k of
    ``softmax(logits)`` not renormalised (``--moe-router-pre-softmax``: softmax over all E, then top-k, as
    difflm's ``softmax(logits)[topk]``) or, with ``model.moe.norm_topk_prob``, Megatron's default softmax over the
    k chosen logits (= the chosen softmax scores divided by their sum); Switch's load-balancing loss per
    micro-batch (``--moe-router-load-balancing-type aux_loss``, ``--moe-aux-loss-coeff``) and the ST-MoE z-loss
    (``--moe-z-loss-coeff``); no capacity factor (no token dropped), no shared experts, every block MoE,
    experts on the local GPU (``--expert-model-parallel-size 1``, local ``allgather`` dispatcher). MegaDLMs'
    ``pretrain_difflm.py`` reads ``args.moe_router_type`` (``topk``: Megatron's ``MoELayer`` + ``TopKRouter``;
    ``expert_choice``: its own expert-choice layer), which none of its parsers defines: the shim adds
    ``--moe-router-type`` (``megadlms_shim/megadlms_args_compat.py``). Raises DifflmError naming the key when
    ``m``'s MoE has no equivalent there."""
    from difflm.errors import DifflmError
    from difflm.model.moe import expert_ffn_size, first_k_dense, moe_config

    moe = moe_config(m)
    if moe is None:
        return []

    def get(key, default):
        return moe.get(key, default) if hasattr(moe, "get") else getattr(moe, key, default)

    why = "MegaDLMs' Megatron-Core MoE has no equivalent"
    refusals = [
        (get("score_func", "softmax") != "softmax", f"model.moe.score_func={get('score_func', None)}: {why} "
         "(softmax router scores only)"),
        (float(get("bias_update_rate", 0.0)) > 0, f"model.moe.bias_update_rate={get('bias_update_rate', None)}: "
         f"{why} (no auxiliary-loss-free bias)"),
        (int(get("n_group", 1)) > 1, f"model.moe.n_group={get('n_group', None)}: {why} (no group-limited routing)"),
        (float(get("routed_scaling_factor", 1.0)) != 1.0,
         f"model.moe.routed_scaling_factor={get('routed_scaling_factor', None)}: {why} (unscaled gating weights "
         "only)"),
        (int(get("num_shared_experts", 0)) > 0, f"model.moe.num_shared_experts={get('num_shared_experts', None)}: "
         f"{why} (no shared experts)"),
        (first_k_dense(m) > 0, f"model.moe.first_k_dense={first_k_dense(m)}: {why} (every block MoE)"),
        (get("capacity_factor", None) is not None, f"model.moe.capacity_factor={get('capacity_factor', None)}: "
         f"{why} (no token dropping)"),
        (str(get("balance_over", "micro_batch")) != "micro_batch",
         f"model.moe.balance_over={get('balance_over', None)}: {why} (per-micro-batch load balancing only)"),
        (float(get("aux_loss_coeff", 0.0)) <= 0, f"model.moe.aux_loss_coeff={get('aux_loss_coeff', None)}: {why} "
         "(its top-k router without the load-balancing loss, type 'none', does not run in MegaDLMs)"),
        (bool(get("norm_topk_prob", False)) and int(moe.top_k) == 1,
         f"model.moe.norm_topk_prob=true with top_k=1: {why} (Megatron refuses softmax after a top-1 choice)"),
    ]
    for refused, message in refusals:
        if refused:
            raise DifflmError(message)
    flags = [
        "--num-experts", str(int(moe.num_experts)), "--moe-ffn-hidden-size", str(expert_ffn_size(m)),
        "--moe-router-topk", str(int(moe.top_k)), "--moe-router-type", "topk",
    ]
    if not bool(get("norm_topk_prob", False)):
        flags.append("--moe-router-pre-softmax")
    flags += ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", repr(float(moe.aux_loss_coeff))]
    if float(get("z_loss_coeff", 0.0)) > 0:
        flags += ["--moe-z-loss-coeff", repr(float(moe.z_loss_coeff))]
    flags += ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather", "--expert-model-parallel-size", "1"]
    return flags


def check_model(m) -> None:
    """Raises DifflmError (one line, naming the key) when difflm model config ``m`` has no MegaDLMs equivalent:
    a vocabulary Megatron would pad differently, QKV biases, shifted logits, or an MoE :func:`moe_flags` refuses
    (tied embeddings are allowed)."""
    from difflm.errors import DifflmError

    if m.vocab_size % 128:
        raise DifflmError(f"model.vocab_size={m.vocab_size} must be a multiple of 128 (Megatron pads to 128)")
    if getattr(m, "qkv_bias", False) or getattr(m, "shift_logits", False):
        raise DifflmError("MegaDLMs rows need model.qkv_bias=false and model.shift_logits=false")
    moe_flags(m)


def megadlms_flags(m, shape: Shape, iters: int = 16) -> list[str]:
    """Megatron-LM arguments of one MegaDLMs row for difflm model config ``m`` (see the module docstring).

    ``--seq-length`` is S + 1: MegaDLMs feeds ``tokens[:, 1:]``. The NullTokenizer's ``--vocab-size V-1``
    (its end-of-document id is V - 1) makes Megatron's padded vocabulary exactly ``m.vocab_size`` (a multiple
    of 128). A mixture-of-experts ``m`` adds :func:`moe_flags` after the model flags. Raises DifflmError when
    ``m`` has no MegaDLMs equivalent (:func:`check_model`).
    """
    check_model(m)
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    flags = [
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--num-attention-heads", str(m.num_heads), "--kv-channels", str(head_dim),
        "--ffn-hidden-size", str(m.ffn_hidden_size), "--swiglu", "--normalization", "RMSNorm",
        "--norm-epsilon", repr(float(m.norm_eps)), "--position-embedding-type", "rope",
        "--rotary-base", str(int(m.rope_base)), "--disable-bias-linear",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--attention-softmax-in-fp32",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
        "--seq-length", str(shape.seq_len + 1), "--max-position-embeddings", str(shape.seq_len + 1),
        "--init-method-std", str(m.init_std),
    ]
    if m.num_kv_heads != m.num_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.qk_norm:
        flags.append("--qk-layernorm")
    if not m.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    flags += moe_flags(m)  # mixture of experts: every MLP an MoE layer; nothing for a dense model
    flags += [  # MegaDLMs' diffusion mode (LLaDA loss, bidirectional attention)
        "--model-running-mode", "difflm-noshift", "--base-model", "vanilla", "--mask-token", str(MASK_TOKEN),
        "--attention-mask-type", "no_mask", "--difflm-varilen-prob", "0", "--attention-backend", "fused",
    ]
    flags += [  # MegaDLMs' optimizer settings; a constant LR (the schedule does not change the step time)
        "--micro-batch-size", str(shape.micro_batch), "--global-batch-size", str(shape.global_batch),
        "--train-iters", str(iters), "--lr", "2e-4", "--min-lr", "2e-5", "--lr-decay-style", "constant",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--bf16", "--use-distributed-optimizer", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1",
    ]
    if shape.gpus > 1:
        flags += ["--overlap-grad-reduce", "--overlap-param-gather"]
    if shape.precision == "fp8":
        flags += ["--fp8-format", "hybrid"]
    flags += [  # mock data, no evaluation, no checkpoints, one log line per iteration
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size - 1),
        "--eval-iters", "0", "--eval-interval", str(10 * iters), "--log-interval", "1", "--log-throughput",
        "--seed", "1234",
    ]
    return flags


# ------------------------------------------------------------------ the log


@dataclass
class IterLog:
    """One Megatron iteration line: iteration number, wall time (ms, between barriers), global batch, lm loss,
    and MegaDLMs' ``real input length`` (tokens per sequence the model saw; None when not logged)."""

    iteration: int
    ms: float
    global_batch: Optional[int] = None
    loss: Optional[float] = None
    input_length: Optional[float] = None


_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.]+)")
_FIELD = {
    "global_batch": re.compile(r"global batch size:\s*(\d+)"),
    "loss": re.compile(r"\blm loss:\s*([-+0-9.eE]+)"),
    "input_length": re.compile(r"real input length:\s*([-+0-9.eE]+)"),
}


def parse_iterations(text: str) -> list[IterLog]:
    """Every iteration line of a Megatron-LM training log (``training_log``'s format:
    ``iteration 5/ 16 | consumed samples: ... | elapsed time per iteration (ms): 1842.3 | ...``), in order.
    A later line for the same iteration (a re-run) replaces the earlier one."""
    found: dict[int, IterLog] = {}
    for line in text.splitlines():
        m = _ITER.search(line)
        if not m:
            continue
        row = IterLog(iteration=int(m.group(1)), ms=float(m.group(3)))
        for key, rx in _FIELD.items():
            f = rx.search(line)
            if f:
                setattr(row, key, int(f.group(1)) if key == "global_batch" else float(f.group(1)))
        found[row.iteration] = row
    return [found[k] for k in sorted(found)]


def summarize(iters: list[IterLog], shape: Shape, flops_per_token: float, peak_tflops: float = PEAK_TFLOPS,
              window: tuple[int, int] = DEFAULT_WINDOW, min_points: int = 3) -> dict:
    """Tokens/s and MFU from the median iteration time over ``window`` (inclusive iteration numbers).

    tokens/s = global batch x S / (median ms / 1000); per GPU = that / gpus; MFU = per-GPU tokens/s x
    ``flops_per_token`` / (``peak_tflops`` x 1e12). Returns a dict with ``error`` set (and no tokens/s) when
    fewer than ``min_points`` iterations of the window were logged, and a ``note`` when some are missing or
    when the log's global batch / input length disagree with ``shape``.
    """
    lo, hi = window
    sel = [r for r in iters if lo <= r.iteration <= hi]
    out = {"iterations_logged": len(iters), "window": [lo, hi], "window_points": len(sel),
           "iteration_ms": [round(r.ms, 2) for r in iters]}
    if len(sel) < min_points:
        last = iters[-1].iteration if iters else 0
        out["error"] = f"only {len(sel)} of iterations {lo}-{hi} logged (last logged: {last})"
        return out
    notes = []
    if len(sel) < hi - lo + 1:
        notes.append(f"median of {len(sel)} of iterations {lo}-{hi}")
    batches = {r.global_batch for r in sel if r.global_batch is not None}
    if batches and batches != {shape.global_batch}:
        notes.append(f"log says global batch {sorted(batches)}, expected {shape.global_batch}")
    lengths = {round(r.input_length) for r in sel if r.input_length is not None}
    if lengths and lengths != {shape.seq_len}:
        notes.append(f"log says real input length {sorted(lengths)}, expected {shape.seq_len}")
    step_ms = statistics.median(r.ms for r in sel)
    tps = shape.global_batch * shape.seq_len / (step_ms / 1e3)
    per_gpu = tps / shape.gpus
    losses = [r.loss for r in sel if r.loss is not None]
    out.update(step_ms=step_ms, tokens_per_s=tps, tokens_per_s_per_gpu=per_gpu,
               mfu=per_gpu * flops_per_token / (peak_tflops * 1e12), flops_per_token=flops_per_token,
               loss=losses[-1] if losses else None)
    if notes:
        out["note"] = "; ".join(notes)
    return out


# ------------------------------------------------------------------ running


def cudnn_env(env: dict) -> dict:
    """Put PyTorch's cuDNN first (TE otherwise loads the image's older system cuDNN and torch's cuDNN check
    fails; docs/performance.md), unless ``CUDNN_HOME`` is already set or ``nvidia.cudnn`` is absent."""
    if env.get("CUDNN_HOME"):
        return env
    try:
        import nvidia.cudnn as cudnn  # the pip package of PyTorch's CUDA wheels
    except ImportError:
        return env
    home = list(cudnn.__path__)[0]
    env = dict(env, CUDNN_HOME=home)
    lib = os.path.join(home, "lib")
    parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = ":".join([lib] + [p for p in parts if p != lib])
    return env


def child_env(megadlms: Path, base: Optional[dict] = None) -> dict:
    """The environment of MegaDLMs' processes: shim dir, then the export, then the caller's PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    path = [str(SHIM_DIR), str(Path(megadlms).resolve())]
    path += [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(":") if p]  # the run's cwd differs
    env.update(NO_MULTICAST, PYTHONPATH=":".join(path), CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
               NVTE_FRAMEWORK="pytorch", TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="600")
    env.pop("WANDB_API_KEY", None)
    return cudnn_env(env)


def check_export(megadlms: Path) -> None:
    """Raises DifflmError unless ``megadlms`` holds an export (``pretrain_difflm.py`` and ``megatron/``)."""
    from difflm.errors import DifflmError

    if not (megadlms / "pretrain_difflm.py").is_file() or not (megadlms / "megatron").is_dir():
        raise DifflmError(f"--megadlms {megadlms}: no MegaDLMs export there (pretrain_difflm.py, megatron/); make "
                          "one with: python scripts/megadlms_baseline.py export --git-dir <mirror> --out " + str(megadlms))


def build_helpers(megadlms: Path, env: dict, timeout: float = 180) -> Optional[str]:
    """Compile Megatron's dataset index helpers (``megatron/core/datasets/helpers_cpp<EXT_SUFFIX>``) with
    ``make``, naming the suffix so that ``python3-config`` is not needed. Returns None, or the reason it failed."""
    folder = megadlms / "megatron" / "core" / "datasets"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = folder / f"helpers_cpp{suffix}"
    if target.exists() and target.stat().st_mtime >= (folder / "helpers.cpp").stat().st_mtime:
        return None
    cmd = ["make", "-C", str(folder), f"LIBEXT={suffix}", f"CPPFLAGS={pybind11_includes()}"]
    try:
        p = script_cli.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"building the dataset helpers ({' '.join(cmd)}): {type(e).__name__}: {e}"
    if p.returncode != 0 or not target.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return f"building the dataset helpers failed (make exit {p.returncode}): {' | '.join(tail)}"
    # Megatron's own `make` (rank 0, initialize.py) names the target with `python3-config --extension-suffix`,
    # empty where python3-config is missing: give it an up-to-date file under that name too, so it rebuilds nothing.
    try:
        theirs = script_cli.run(["python3-config", "--extension-suffix"], env=env, capture_output=True, text=True,
                                timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        theirs = ""
    if theirs != suffix:
        shutil.copyfile(target, folder / f"helpers_cpp{theirs}")
    return None


def pybind11_includes() -> str:
    """``-I`` flags for Python's and pybind11's headers (what ``python3 -m pybind11 --includes`` prints)."""
    flags = [f"-I{sysconfig.get_path('include')}"]
    try:
        import pybind11

        flags.append(f"-I{pybind11.get_include()}")
    except ImportError:
        pass
    return " ".join(flags)


def torchrun_command(megadlms: Path, flags: list[str], gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            str(megadlms / "pretrain_difflm.py"), *flags]


def run_process(cmd: list[str], env: dict, log_path: Path, timeout: float, cwd: Path) -> tuple[Optional[int], float]:
    """Run ``cmd`` in a session of its own, stdout+stderr into ``log_path``
    (:func:`difflm.script_cli.start`: it ends with this script). Returns (exit code or None on timeout, seconds). On
    timeout: SIGTERM to its process tree, SIGKILL 15 s later."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = script_cli.start(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout), time.monotonic() - start
        except subprocess.TimeoutExpired:
            script_cli.stop_tree([proc], grace=15)
            return None, time.monotonic() - start


_EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)\b|.*: error: |Killed|.*CUDA out of memory)")
_LAUNCHER = ("torch.distributed.elastic", "ChildFailedError", "SignalException")


def error_line(text: str) -> str:
    """The most telling line of a failed run's log: the last exception line of a worker (not torchrun's own
    ``ChildFailedError`` summary), else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _EXCEPTION.search(ln) and not any(k in ln for k in _LAUNCHER):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def log_tail(text: str, lines: int = 25) -> str:
    """The last ``lines`` lines of a run's log before torchrun's own failure report (its traceback and
    ``ChildFailedError`` summary say nothing about the cause)."""
    rows = text.splitlines()
    cut = next((i for i, ln in enumerate(rows) if "failed (exitcode:" in ln or "Received Signals." in ln), len(rows))
    return "\n".join(rows[max(0, cut - lines):cut + 1])


def is_moe(m) -> bool:
    """Whether difflm model config ``m`` is a mixture of experts (``model.moe.num_experts`` > 0)."""
    from difflm.model.moe import moe_config

    return m is not None and moe_config(m) is not None


def row_name(shape: Shape, m=None) -> str:
    """``megadlms-<precision>-s<S>-gb<global batch>``; ``megadlms-moe-...`` for a mixture-of-experts ``m``."""
    kind = "moe-" if is_moe(m) else ""
    return f"megadlms-{kind}{shape.precision}-s{shape.seq_len}-gb{shape.global_batch}"


def run_row(megadlms: Path, shape: Shape, *, model_cfg=None, preset: str = "1.7b", vocab_size: int = 50304,
            iters: int = 16, window: tuple[int, int] = DEFAULT_WINDOW, timeout: float = 300,
            log_dir: Optional[Path] = None, peak_tflops: float = PEAK_TFLOPS, extra: Optional[list[str]] = None,
            dry_run: bool = False) -> dict:
    """One MegaDLMs row: flags, helpers, torchrun, log, summary, at the dimensions of ``model_cfg`` (a resolved
    difflm ``model`` config; default: the ``preset`` with ``vocab_size``). Never raises for a failed run: the
    returned dict then has ``error`` (and ``log_tail``); with ``dry_run`` it only has the ``command``."""
    from difflm.errors import DifflmError
    from difflm.training.flops import flops_per_token

    megadlms = Path(megadlms).resolve()  # the run's cwd is its log folder
    row = {"name": row_name(shape, model_cfg), "system": "megadlms", "precision": shape.precision,
           "seq_len": shape.seq_len, "global_batch": shape.global_batch, "micro_batch": shape.micro_batch,
           "gpus": shape.gpus, "model": model_cfg.name if model_cfg is not None else preset}
    try:
        shape.check()
        if window[1] > iters or window[0] < 1 or window[0] > window[1]:
            raise DifflmError(f"--window {window[0]},{window[1]} must lie within iterations 1..--iters {iters}")
        m = model_cfg if model_cfg is not None else model_config(preset, vocab_size)
        row["name"] = row_name(shape, m)
        n = count_params(m)  # MoE: the active parameters, as difflm counts them
        row.update(n_params_non_embedding=n, flops_per_token=flops_per_token(n, m.num_layers, m.hidden_size,
                                                                             shape.seq_len))
        if is_moe(m):
            row["n_params_non_embedding_total"] = count_params(m, active=False)
        flags = megadlms_flags(m, shape, iters) + list(extra or [])
        cmd = torchrun_command(megadlms, flags, shape.gpus)
        row["command"] = shlex.join(cmd)
        if dry_run:
            return row
        check_export(megadlms)
    except DifflmError as e:
        row["error"] = str(e)
        return row
    env = child_env(megadlms)
    err = build_helpers(megadlms, env)
    if err:
        row["error"] = err
        return row
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="megadlms_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{row['name']}.log"
    row["log"] = str(log_path)
    rc, seconds = run_process(cmd, env, log_path, timeout, cwd=log_dir)
    row["wall_s"] = round(seconds, 1)
    text = log_path.read_text(errors="replace")
    summary = summarize(parse_iterations(text), shape, row["flops_per_token"], peak_tflops, window)
    row.update(summary)
    problem = f"timeout after {timeout:.0f} s" if rc is None else (f"exit code {rc}" if rc != 0 else None)
    complete = summary["window_points"] == window[1] - window[0] + 1
    if problem and complete:  # every timed iteration is in: the figures stand, the exit is noted
        row["note"] = "; ".join(x for x in (row.get("note"), f"{problem} after the last timed iteration") if x)
    elif problem:
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_ms"):
            row.pop(key, None)
        row["error"] = f"{problem} ({summary['iterations_logged']} iterations logged): {error_line(text)}"
    elif "error" in row:
        row["error"] += f": {error_line(text)}"
    if "error" in row:
        row["log_tail"] = log_tail(text)
    return row


def format_row(r: dict) -> str:
    """One printed line: ``name: tokens/s (MFU) ...`` or ``name: failed: <reason>``."""
    if "error" in r:
        return f"{r['name']}: failed: {r['error']}"
    if "tokens_per_s" not in r:
        return f"{r['name']}: {r.get('command', '')}"
    note = f"  [{r['note']}]" if r.get("note") else ""
    return (f"{r['name']}: {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_per_gpu']:,.0f}/GPU), "
            f"MFU {100 * r['mfu']:.1f} %, step {r['step_ms']:.1f} ms (median of {r['window_points']}), "
            f"loss {r['loss'] if r['loss'] is None else format(r['loss'], '.3f')}{note}")


# ------------------------------------------------------------------ export


def export(git_dir: Path, out: Path, commit: str = "HEAD") -> dict:
    """Write ``commit`` of the MegaDLMs mirror ``git_dir`` (a bare repository) into ``out``: the pretraining
    path only (:data:`EXPORT_PATHS` minus :data:`EXPORT_SKIP`), plus ``MEGADLMS_SOURCE.json`` (commit, files,
    bytes). Replaces an earlier export's files. Returns that record. Raises DifflmError when git fails."""
    from difflm.errors import DifflmError

    try:
        sha = script_cli.run(["git", f"--git-dir={git_dir}", "rev-parse", commit], check=True, capture_output=True,
                             text=True).stdout.strip()
        data = script_cli.run(["git", f"--git-dir={git_dir}", "archive", "--format=tar", sha, *EXPORT_PATHS],
                              check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        said = (getattr(e, "stderr", None) or b"")
        said = (said.decode(errors="replace") if isinstance(said, bytes) else said).strip().splitlines()
        raise DifflmError(f"--git-dir {git_dir}: git failed ({said[-1] if said else e}): give the bare git folder "
                          "of a MegaDLMs mirror (fetch github:JinjieNi/MegaDLMs) and a --commit it holds") from None
    out.mkdir(parents=True, exist_ok=True)
    for name in (*EXPORT_PATHS, "MEGADLMS_SOURCE.json"):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    files, size = 0, 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [t for t in tar.getmembers() if t.isfile() and not EXPORT_SKIP.search(t.name)]
        for t in members:
            files, size = files + 1, size + t.size
        tar.extractall(out, members=members, filter="data")
    record = {"repository": "github.com/JinjieNi/MegaDLMs", "commit": sha, "paths": list(EXPORT_PATHS),
              "skipped": EXPORT_SKIP.pattern, "files": files, "bytes": size}
    (out / "MEGADLMS_SOURCE.json").write_text(strict_json.dumps(record, indent=2) + "\n")
    return record


# ------------------------------------------------------------------ CLI


def parse_window(text: str) -> tuple[int, int]:
    """``FIRST,LAST`` -> (FIRST, LAST): iterations 1 <= FIRST <= LAST (an argparse ``type``)."""
    lo, sep, hi = text.partition(",")
    try:
        first, last = int(lo), int(hi)
    except ValueError:
        first = last = 0
    if not sep or not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: give FIRST,LAST iterations with 1 <= FIRST <= LAST, e.g. 6,16")
    return first, last


@script_cli.script_main
def main(argv=None) -> int:
    """Run, parse or export (the sub-command of ``argv``); the exit status: 1 for a failed row."""
    ap = script_cli.parser(__file__, __doc__)
    at_least_1 = script_cli.int_at_least(1)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{run,parse,export}",
                            help="run: one MegaDLMs row; parse: a saved Megatron log; export: MegaDLMs' pretraining "
                                 "path from a mirror (each has its own --help)")
    r = sub.add_parser("run", help="run one MegaDLMs row", description="Run one MegaDLMs row under torchrun and "
                       "print its tokens/s and MFU (exit status 1 when it fails).")
    p = sub.add_parser("parse", help="summarize a saved Megatron log", description="Summarize a saved Megatron log "
                       "as a row: tokens/s and MFU of the timed iterations.")
    for q in (r, p):
        q.add_argument("--seq-len", type=at_least_1, required=True, help="tokens per sequence the model sees (S)")
        q.add_argument("--global-batch", type=at_least_1, required=True,
                       help="sequences per optimizer step over all GPUs")
        q.add_argument("--micro-batch", type=at_least_1, default=4, help="sequences per GPU and step (default 4)")
        q.add_argument("--gpus", type=at_least_1, default=1, help="GPUs of one host, torchrun ranks (default 1)")
        q.add_argument("--precision", default="bf16", choices=["bf16", "fp8"], help="bf16, or fp8 (hybrid)")
        q.add_argument("--model", default="1.7b", help="difflm model preset whose shape MegaDLMs runs")
        q.add_argument("--vocab-size", type=at_least_1, default=50304, help="padded vocabulary (NeoX: 50304)")
        q.add_argument("--window", type=parse_window, default=DEFAULT_WINDOW,
                       help="FIRST,LAST iteration of the median (default 6,16)")
        q.add_argument("--peak-tflops", type=script_cli.positive_number, default=PEAK_TFLOPS,
                       help=f"the MFU's peak TFLOP/s per GPU (default {PEAK_TFLOPS:g}, dense BF16 H100/H200)")
        q.add_argument("--json", type=script_cli.output_file, default=None, help="write the row here")
    r.add_argument("--megadlms", type=script_cli.caller_path, default=script_cli.caller_path(".megadlms"),
                   help="the export (see 'export'; default ./.megadlms)")
    r.add_argument("--iters", type=at_least_1, default=16, help="iterations Megatron runs (default 16)")
    r.add_argument("--timeout", type=script_cli.positive_number, default=300,
                   help="seconds before the run is stopped (default 300)")
    r.add_argument("--log-dir", type=script_cli.caller_path, default=None,
                   help="where the run's log goes (default: a temp dir)")
    r.add_argument("--extra", type=script_cli.shell_words, default="",
                   help="more Megatron flags, one shell-quoted string")
    r.add_argument("--dry-run", action="store_true", help="print the command only (--json is not written)")
    p.add_argument("log", type=script_cli.existing_path("file", "a Megatron log saved by 'run' (--log-dir)"),
                   help="the saved log")
    e = sub.add_parser("export", help="export the pretraining path of a MegaDLMs mirror",
                       description="Write the pretraining path of a MegaDLMs mirror (a bare git folder) into --out.")
    e.add_argument("--git-dir", type=script_cli.existing_path("folder", "the bare git folder of a MegaDLMs mirror"),
                   required=True, help="bare git dir of github:JinjieNi/MegaDLMs")
    e.add_argument("--out", type=script_cli.caller_path, required=True, help="the export folder (e.g. .megadlms)")
    e.add_argument("--commit", default="HEAD", help="the commit to export (default HEAD)")
    args = ap.parse_args(argv)

    if args.cmd == "export":
        rec = export(args.git_dir, args.out, args.commit)
        print(f"exported MegaDLMs {rec['commit'][:12]}: {rec['files']} files, {rec['bytes'] / 2**20:.1f} MiB -> {args.out}")
        return 0
    shape = Shape(args.seq_len, args.global_batch, args.micro_batch, args.gpus, args.precision)
    shape.check()  # usage errors here (exit 2); run_row reports them as a failed row, for benchmark.py
    m = model_config(args.model, args.vocab_size)
    if args.cmd == "parse":
        from difflm.training.flops import flops_per_token

        n = count_params(m)
        row = {"name": row_name(shape, m), "system": "megadlms", "precision": shape.precision, "seq_len": shape.seq_len,
               "global_batch": shape.global_batch, "gpus": shape.gpus, "log": str(args.log)}
        row.update(summarize(parse_iterations(args.log.read_text(errors="replace")), shape,
                             flops_per_token(n, m.num_layers, m.hidden_size, shape.seq_len), args.peak_tflops, args.window))
    else:
        if args.window[1] > args.iters:
            r.error(f"--window {args.window[0]},{args.window[1]} ends after --iters {args.iters}: give --iters >= "
                     f"{args.window[1]} or an earlier window")
        row = run_row(args.megadlms, shape, preset=args.model, vocab_size=args.vocab_size, iters=args.iters,
                      window=args.window, timeout=args.timeout, log_dir=args.log_dir, peak_tflops=args.peak_tflops,
                      extra=args.extra, dry_run=args.dry_run)
        if "log_tail" in row:
            print(row["log_tail"])
    print(format_row(row))
    if args.json and not (args.cmd == "run" and args.dry_run):  # a dry run prints its command only
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(strict_json.dumps(row, indent=2))
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
