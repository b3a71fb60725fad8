"""Parameter initialisation shared by both backends, so the same seed gives the same weights in each."""
from __future__ import annotations

import zlib

import torch


@torch.no_grad()
def megatron_init_(model: torch.nn.Module, cfg, seed: int, shards=None) -> None:
    """Megatron-style init of every parameter of ``model``, independent of device and parallel layout.

    Norm scales are 1, biases 0; other weights are N(0, init_std^2), with the residual-branch outputs
    (``attention.proj``, ``mlp.fc2``, and in MoE layers ``mlp.experts.fc2`` / ``mlp.shared.fc2``) scaled by
    1/sqrt(2 * num_layers) (Megatron-LM ``scaled_init_method_normal``; GPT-2 paper sec. 2.3). The MoE router
    (``mlp.router.weight``) is N(0, init_std^2) as in Megatron-LM. Buffers (the MoE router's aux-loss-free
    bias and statistics) are zeroed: ``to_empty`` leaves them uninitialised. Each tensor is drawn on the CPU
    from a generator seeded by (seed, crc32(name)), so the values do not depend on the device, on the order modules are built
    in or on how the model is later sharded; ``copy_`` moves (and, for FP8 weights, quantizes) them.
    Works after ``to_empty``. ``shards`` (a :class:`difflm.parallel.te_tensor_parallel.TensorParallelShards`,
    for parameters that are plain local tensor-parallel shards) makes each rank draw the full tensor and keep
    its slice, so every layout starts from the single-process weights.
    """
    std, scaled = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
    for _, b in model.named_buffers():
        b.zero_()
    for name, p in model.named_parameters():
        if name.endswith(("norm_weight", "norm.weight")):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            sd = scaled if name.endswith(("proj.weight", "fc2_weight")) else std
            if shards is None:
                p.copy_(torch.randn(p.shape, generator=gen) * sd)
            else:
                p.copy_(shards.local(name, torch.randn(shards.full_shape(name, p.shape), generator=gen) * sd))
