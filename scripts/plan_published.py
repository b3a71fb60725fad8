#!/usr/bin/env python3
"""``difflm-plan`` against published per-GPU training throughput that no one here measured: NVIDIA's NeMo/Megatron
performance summaries for Llama 3 on DGX-H100, run as the autoregressive objective (causal attention: the planner
counts half the attention FLOPs, as a kernel that skips the masked half computes).

    python scripts/plan_published.py [--calibration h100.json]

Sources (tokens/s/GPU as published, each row's layout as published):
* NeMo Framework 24.12 performance summary, pre-training at FP8 on DGX-H100
  (docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html):
  LLAMA3-8B, 8 GPUs, GBS 128, MBS 1, S 8192, TP1 PP1 CP2: 12,273; LLAMA3-70B, 64 GPUs, GBS 128, MBS 1, S 8192,
  TP4 PP4 CP2 VP5: 1,524.
* Megatron-Bridge performance summary, 25.11 NeMo container, pre-training at FP8 (current scaling) on DGX-H100
  (github.com/NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md): LLAMA3_8B, 8 GPUs, GBS 128, MBS 1, S 8192,
  FSDP: 14,451; LLAMA3_70B, 64 GPUs, GBS 128, MBS 1, TP4 PP8 VP5: 1,602; LLAMA3.1_405B, 1,024 GPUs, GBS 512, MBS 1,
  TP8 PP8 CP2 VP8: 292.
* NeMo AutoModel performance summary, pre-training at BF16 on DGX-H100 (docs.nvidia.com/nemo/automodel/performance/
  performance-summary.md): Llama3 70B, 64 GPUs, GBS 128, MBS 1, S 8192, CP2, FSDP 32 (TE + FSDP2 prefetch): 866.77.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli  # noqa: E402

LLAMA3_8B = ["model.num_layers=32", "model.hidden_size=4096", "model.num_heads=32", "model.num_kv_heads=8",
             "model.ffn_hidden_size=14336", "model.qk_norm=false", "model.rope_base=500000", "model.vocab_size=128256"]
LLAMA3_70B = ["model.num_layers=80", "model.hidden_size=8192", "model.num_heads=64", "model.num_kv_heads=8",
              "model.ffn_hidden_size=28672", "model.qk_norm=false", "model.rope_base=500000", "model.vocab_size=128256"]
LLAMA31_405B = ["model.num_layers=126", "model.hidden_size=16384", "model.num_heads=128", "model.num_kv_heads=8",
                "model.ffn_hidden_size=53248", "model.qk_norm=false", "model.rope_base=500000",
                "model.vocab_size=128256"]
COMMON = ["objective=ar", "data.seq_len=8192", "train.global_batch_size=128", "train.micro_batch_size=1",
          "model.backend=te"]
ROWS = [  # name, model, precision, GPUs, layout overrides, published tokens/s/GPU, source
    ("Llama3-8B FP8 tp1 cp2", LLAMA3_8B, "fp8", 8, ["parallel.cp=2", "parallel.dp_shard=1", "parallel.dp_replicate=-1"],
     12273, "NeMo 24.12"),
    ("Llama3-70B FP8 tp4 pp4 cp2 vp5", LLAMA3_70B, "fp8", 64,
     ["parallel.tp=4", "parallel.pp=4", "parallel.cp=2", "parallel.dp_shard=1", "parallel.dp_replicate=-1",
      "parallel.pp_virtual_stages=5", "parallel.pp_schedule=Interleaved1F1B"], 1524, "NeMo 24.12"),
    ("Llama3-70B BF16 fsdp32 cp2", LLAMA3_70B, "bf16", 64, ["parallel.cp=2", "parallel.dp_shard=-1"], 866.77,
     "NeMo AutoModel"),
    ("Llama3-8B FP8 fsdp8", LLAMA3_8B, "fp8", 8, ["parallel.dp_shard=-1"], 14451, "Megatron-Bridge 25.11"),
    ("Llama3-70B FP8 tp4 pp8 vp5", LLAMA3_70B, "fp8", 64,
     ["parallel.tp=4", "parallel.pp=8", "parallel.dp_shard=1", "parallel.dp_replicate=-1",
      "parallel.pp_virtual_stages=5", "parallel.pp_schedule=Interleaved1F1B"], 1602, "Megatron-Bridge 25.11"),
    ("Llama3.1-405B FP8 tp8 pp8 cp2 vp8", LLAMA31_405B, "fp8", 1024,
     ["parallel.tp=8", "parallel.pp=8", "parallel.cp=2", "parallel.dp_shard=1", "parallel.dp_replicate=-1",
      "parallel.pp_virtual_stages=8", "parallel.pp_schedule=Interleaved1F1B", "train.global_batch_size=512"], 292,
     "Megatron-Bridge 25.11"),
]


CALIBRATION = script_cli.existing_path("file", "a calibration JSON (difflm-plan --calibrate FILE writes one on a GPU)")


@script_cli.script_main
def main(argv=None) -> int:
    """Plan every published row and print planned against published tokens/s/GPU."""
    from difflm.config.compose import compose_train_config
    from difflm.plan.cli import active_params, layout_of
    from difflm.plan.rates import Rates, default_rates
    from difflm.plan.search import evaluate
    from difflm.plan.shapes import model_params

    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("--calibration", type=CALIBRATION, default=None,
                    help="H100 rates measured by difflm-plan --calibrate (default: the shipped H100 rates)")
    args = ap.parse_args(argv)
    rates = Rates.from_json(args.calibration) if args.calibration else default_rates("H100")
    print("tokens/s per GPU as published and as planned; ratio = planned / published; GiB/GPU: the planned peak "
          "memory per GPU")
    print(f"{'row':<32} {'GPUs':>5} {'published':>10} {'planned':>9} {'ratio':>6}  {'GiB/GPU':>8}  source")
    for name, model, precision, gpus, layout, published, source in ROWS:
        cfg = compose_train_config([*COMMON, *model, f"precision={precision}", *layout])
        cfg.model.head_dim = int(cfg.model.hidden_size) // int(cfg.model.num_heads)
        cand = evaluate(cfg, model_params(cfg.model, 128256), active_params(cfg), layout_of(cfg, gpus), rates)
        planned = cand.step.tokens_per_s / gpus
        print(f"{name:<32} {gpus:>5} {published:>10,.0f} {planned:>9,.0f} {planned / published:>6.2f}  "
              f"{cand.memory.total / 2**30:>8.1f}  {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
