"""The rates a GPU reaches, which turn FLOPs and bytes into seconds: one JSON file per GPU model.

``difflm-plan --calibrate FILE`` measures them on the GPU at hand (:func:`calibrate`): BF16 GEMMs at the run's
shapes, bidirectional attention forward + backward (SDPA), an HBM copy, and, under ``torchrun`` with more than one
process, NCCL all-reduce and all-gather bus bandwidth (the NCCL-tests definition: ``busbw = algbw x 2 (n - 1) / n``
for all-reduce, ``(n - 1) / n`` for all-gather). Defaults ship for the H100 and H200 (SXM): the rates measured
under load in a training step on an H200 (docs/performance.md: GEMMs at ~720 TFLOP/s, FA4 attention at ~475),
NVLink 4 at NCCL's typical ~360 GB/s bus bandwidth inside a node and 400 Gb/s InfiniBand (~45 GB/s) between nodes.
``membound_passes_torch`` is fitted to ``scripts/plan_check.py``'s rows at 350m-8B on an H200 (docs/planner.md): the
torch kernel set's unfused elementwise kernels move ~3x the bytes of the fused ones. ``activation_scale`` is 1: the
activation model's terms equal the bytes the traced step saves (:mod:`difflm.plan.trace`, ``tests/test_plan.py``).
Measured on an H200 with PyTorch 2.11 (docs/planner.md, "The step's parts"): FP32 GEMMs without TF32 at 50 TFLOP/s
(8,192 x 2,048 x 2,048); ``torch._grouped_mm`` forward + backward over 64 experts of ``[rows, 2048] @ [2048, 2048]``
at 349 / 472 / 552 / 583 TFLOP/s for 256 / 512 / 1,024 / 2,048 rows each, ``1 / rate`` a line in ``1 / rows``:
640 TFLOP/s at many rows, half that at 216; a one-element kernel 0.93 us launch to launch from a CUDA graph. The
H100 shares them (the same SMs and clocks) but for its HBM (about 3.0 TB/s for the same copy).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from difflm.errors import DifflmError
from difflm import strict_json


@dataclass
class Rates:
    """Rates of one GPU model. FLOP rates in TFLOP/s, bandwidths in GB/s (1e9 bytes/s), memory in GiB."""

    gpu: str = "H200"
    memory_gib: float = 141.0  # HBM per GPU (143,771 MiB shown by nvidia-smi on the H200)
    peak_tflops: float = 989.0  # dense BF16 peak (data sheet): the MFU denominator
    gemm_tflops: float = 720.0  # BF16 GEMMs inside a training step
    fp8_gemm_tflops: float = 1150.0  # FP8 GEMMs inside a training step
    attention_tflops: float = 475.0  # bidirectional attention forward + backward
    hbm_gbps: float = 4300.0  # memory-bound kernels (copy: bytes read + written per second)
    intra_node_gbps: float = 360.0  # NCCL bus bandwidth inside a node (NVLink)
    inter_node_gbps: float = 45.0  # NCCL bus bandwidth across nodes (per GPU: one 400 Gb/s NIC)
    gpus_per_node: int = 8
    comm_overlap: float = 0.9  # fraction of FSDP / DDP / CP traffic hidden behind compute when compute is longer
    activation_scale: float = 1.0  # factor on difflm.plan.memory's activation model (1: its terms as traced)
    membound_passes_te: float = 3.0  # memory-bound bytes moved per saved activation byte: TE / fused kernels
    membound_passes_torch: float = 10.0  # the same for the torch kernel set (unfused norms, casts, SwiGLU, residual)
    fp32_gemm_tflops: float = 50.0  # FP32 GEMMs without TF32 (the MoE router's)
    grouped_gemm_tflops: float = 640.0  # torch._grouped_mm forward + backward with many rows per expert ...
    grouped_gemm_rows: float = 216.0  # ... and the rows per expert at which it runs at half that
    kernel_floor_us: float = 0.93  # device time of a kernel beyond its bytes and FLOPs (launch to launch)
    reserve_gib: float = 4.0  # CUDA context, allocator slack and NCCL buffers kept free of the plan

    def to_json(self, path: str | Path) -> None:
        """Write the rates as JSON (atomically: a temporary file renamed)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(strict_json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def from_json(cls, path: str | Path) -> "Rates":
        """Read a calibration file. Raises DifflmError naming the file and an unknown key."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DifflmError(f"--calibration {path}: cannot read it as JSON ({e})") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DifflmError(f"--calibration {path}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")
        return cls(**data)


DEFAULTS = {
    "H200": Rates(),
    "H100": Rates(gpu="H100", memory_gib=79.6, hbm_gbps=3000.0),
}


def default_rates(gpu: str) -> Rates:
    """The shipped rates of ``gpu`` (``H100`` or ``H200``). Raises DifflmError for another name."""
    key = gpu.upper().replace("NVIDIA", "").strip().split("-")[0].split()[0] if gpu else ""
    if key not in DEFAULTS:
        raise DifflmError(f"--gpu {gpu}: no shipped rates for it (shipped: {', '.join(DEFAULTS)}); measure them on "
                          "that GPU with `difflm-plan --calibrate FILE` and pass --calibration FILE")
    return DEFAULTS[key]


def _time_cuda(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _grouped_rate(experts: int, rows: int, d: int, n: int, dev) -> float:
    """FLOP/s of ``torch._grouped_mm`` forward + backward over ``experts`` groups of ``rows`` rows, ``[rows, d] @
    [d, n]`` each (the MoE experts' GEMM, :class:`difflm.model.moe.GroupedExperts`)."""
    import torch

    x = torch.randn(experts * rows, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, d, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * rows
    grad = torch.randn(experts * rows, n, device=dev, dtype=torch.bfloat16)
    return 6 * experts * rows * d * n / _time_cuda(lambda: torch._grouped_mm(x, w, offs=offs).backward(grad), 10)


def calibrate(model_cfg, seq_len: int, micro_batch: int, base: Rates) -> Rates:
    """Measure ``base``'s rates on the current CUDA device at the shapes of ``model_cfg`` (BF16).

    GEMM: ``[micro_batch x seq_len, hidden] @ [hidden, ffn]`` forward, and in FP32 (the MoE router's precision);
    attention: SDPA forward + backward at ``[micro_batch, heads, seq_len, head_dim]`` (the model-FLOPs count
    12 B H S^2 D of forward + backward, as MFU counts it); HBM: a 1 GiB device-to-device copy (bytes read + written);
    the kernel floor: 1,000 one-element kernels replayed from a CUDA graph (launch to launch on the device, no host
    in between);
    for a mixture of experts, ``torch._grouped_mm`` forward + backward over its experts at the micro-batch's rows
    per expert and four times as many, whose two rates give ``grouped_gemm_tflops`` and ``grouped_gemm_rows``
    (``1 / rate = (1 + rows_half / rows) / rate_max``, :func:`difflm.plan.step_time.grouped_gemm_rate`). Under
    ``torch.distributed`` with more than one rank, the bus bandwidth of a 256 MiB all-reduce (intra-node when the
    world fits in one node). Raises DifflmError without CUDA.
    """
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise DifflmError("--calibrate needs a CUDA GPU: run it on the GPU model you plan for")
    out = Rates(**asdict(base))
    dev = torch.device("cuda")
    out.gpu = torch.cuda.get_device_name(dev).replace("NVIDIA ", "").split()[0]
    out.memory_gib = torch.cuda.get_device_properties(dev).total_memory / 1024 ** 3
    h, f = int(model_cfg.hidden_size), int(model_cfg.ffn_hidden_size)
    t = micro_batch * seq_len
    a = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(h, f, device=dev, dtype=torch.bfloat16)
    out.gemm_tflops = 2 * t * h * f / _time_cuda(lambda: a @ w) / 1e12
    a32, w32 = a.float(), w.float()
    out.fp32_gemm_tflops = 2 * t * h * f / _time_cuda(lambda: a32 @ w32, 5) / 1e12
    del a32, w32
    heads = int(model_cfg.num_heads)
    hd = int(model_cfg.head_dim or h // heads)
    q = torch.randn(micro_batch, heads, seq_len, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))

    def attention():
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    flops = 12 * micro_batch * heads * seq_len * seq_len * hd  # model FLOPs: forward 4 B H S^2 D, backward twice that
    out.attention_tflops = flops / _time_cuda(attention, 10) / 1e12
    src = torch.empty(1024 ** 3 // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out.hbm_gbps = 2 * src.numel() * 2 / _time_cuda(lambda: dst.copy_(src)) / 1e9
    del src, dst
    one = torch.zeros(1, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(1000):
            one.add_(1)
    out.kernel_floor_us = _time_cuda(graph.replay, 5) / 1000 * 1e6
    experts = int(model_cfg.moe.num_experts) if "moe" in model_cfg else 0
    if experts:
        ef = int(model_cfg.moe.ffn_hidden_size) or f
        rows = max(t * int(model_cfg.moe.top_k) // experts, 16)
        near, far = (_grouped_rate(experts, r, h, 2 * ef, dev) for r in (rows, 4 * rows))
        slope = (1 / near - 1 / far) / (1 / rows - 1 / (4 * rows))  # 1 / rate against 1 / rows: a line
        rate_max = 1 / (1 / far - slope / (4 * rows))
        out.grouped_gemm_tflops, out.grouped_gemm_rows = rate_max / 1e12, max(slope * rate_max, 0.0)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        n = dist.get_world_size()
        buf = torch.empty(128 * 1024 ** 2, device=dev, dtype=torch.bfloat16)
        seconds = _time_cuda(lambda: dist.all_reduce(buf), 10)
        busbw = buf.numel() * 2 / seconds * 2 * (n - 1) / n / 1e9
        if n <= out.gpus_per_node:
            out.intra_node_gbps = busbw
        else:
            out.inter_node_gbps = busbw
    return out
