"""Time the optimizer step of a model preset alone: fused AdamW, the gradient norm and clipping, and zeroing the
gradient buffers, each against the bytes it must move (HBM traffic / time = achieved bandwidth). The trainer's step
with a fused AdamW is ``norm`` + ``adamw_clipped`` (the clipping coefficient applied inside the fused kernel); other
optimizers run ``norm_and_clip`` + ``adamw``.

The parameters are FP32 tensors of the preset's shapes (``difflm.model.build_model`` on the meta device, then
materialised empty on the GPU); the step is the trainer's (``difflm.training.optimizer.build_optimizer``,
``difflm.parallel.parallelize``, ``difflm.training.optimizer.step_unless_nonfinite``), so a lever tried here is the
one the trainer runs.

    python scripts/optimizer_speed.py model=1.7b --steps 10

Prints one line per part: ms per step, GB moved, GB/s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from difflm import script_cli, strict_json  # noqa: E402


@script_cli.script_main
def main(argv=None) -> None:
    """Time each part of the optimizer step of the composed model and print one line each; write ``--json``."""
    ap = script_cli.parser(__file__, __doc__, whole_doc=True)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the run config (model=1.7b ...)")
    ap.add_argument("--steps", type=script_cli.int_at_least(1), default=10,
                    help="timed calls per part (median; default 10)")
    ap.add_argument("--json", type=script_cli.output_file, default=None,
                    help="also write ms and bytes per part to this JSON file")
    args = ap.parse_intermixed_args(argv)  # the overrides may come before, between or after the flags
    script_cli.require_cuda()
    from benchmark import compose, median_cuda_ms
    from difflm.data import build_tokenizer
    from difflm.model import build_model, resolve_model_config
    from difflm.parallel.parallelize import clip_coefficient, global_grad_norm, grad_norm_and_clip
    from difflm.training.optimizer import build_optimizer, step_unless_nonfinite

    device = torch.device("cuda")
    cfg = compose(args.overrides)
    from difflm.model.auto_kernels import choose_kernels

    choose_kernels(cfg, device)
    resolve_model_config(cfg.model, build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple).padded_vocab_size)
    meta = build_model(cfg.model, causal=False, device=torch.device("meta"), seed=None, meta=True)
    params = [torch.nn.Parameter(torch.empty(p.shape, device=device).normal_(0, 0.02)) for p in meta.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(params)
    optimizer = build_optimizer(holder, cfg.optim, device)
    finite, coef = torch.ones((), dtype=torch.bool, device=device), clip_coefficient(torch.tensor(2.0, device=device), 1.0)
    results = {
        # param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written (FP32)
        "adamw": (median_cuda_ms(optimizer.step, args.steps), 28 * n),
        "adamw_clipped": (median_cuda_ms(lambda: step_unless_nonfinite(optimizer, finite, coef), args.steps), 28 * n),
        "norm": (median_cuda_ms(lambda: global_grad_norm(params), args.steps), 4 * n),
        # every gradient read once for the norm, read and written once by the clip
        "norm_and_clip": (median_cuda_ms(lambda: grad_norm_and_clip(params, 1e-9), args.steps), 12 * n),
        "zero_grads": (median_cuda_ms(lambda: torch._foreach_zero_([p.grad for p in params]), args.steps), 4 * n),
    }
    print(f"{torch.cuda.get_device_name()} | {n / 1e9:.3f} B FP32 parameters in {len(params)} tensors")
    for name, (ms, nbytes) in results.items():
        print(f"{name:14s} {ms:8.2f} ms  {nbytes / 1e9:7.1f} GB  {nbytes / ms / 1e6:7.0f} GB/s")
    if args.json:
        Path(args.json).write_text(strict_json.dumps({k: {"ms": v[0], "bytes": v[1]} for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
