"""Model FLOPs per token and MFU in one place."""
from __future__ import annotations

from typing import Optional

import torch

# Dense BF16 peak (TFLOP/s, no sparsity) from the vendors' data sheets. FP8 runs are also reported
# against the BF16 peak so that figures stay comparable across precisions.
PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe part is 756
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}


def flops_per_token(num_params_non_embedding: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's formula (Chowdhery et al. 2022, appendix B):

        6 N + 12 L d S

    with N the parameters without the input embedding, L layers, d hidden size, S sequence length
    (forward + backward, attention counted over the full S x S score matrix as for bidirectional attention).
    For a mixture-of-experts model N is the active count: the parameters without the routed experts a token
    is not sent to (``num_params - difflm.model.moe.moe_inactive_params(cfg)``; docs/moe.md), so MFU counts the
    FLOPs a token really takes (router and shared experts included, no token dropped).
    """
    return 6.0 * num_params_non_embedding + 12.0 * num_layers * hidden_size * seq_len


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak BF16 FLOP/s of ``device``, or None when unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    model = torch.cuda.get_device_name(device).replace("NVIDIA ", "").split()[0].split("-")[0]
    tflops = PEAK_TFLOPS_BF16.get(model)
    return None if tflops is None else tflops * 1e12


def mfu(tokens_per_s: float, flops_per_tok: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation = achieved model FLOP/s / peak FLOP/s (None when the peak is unknown)."""
    return None if peak is None else tokens_per_s * flops_per_tok / peak
