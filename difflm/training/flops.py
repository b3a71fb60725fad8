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


def bd3lm_flops_per_token(num_params_non_embedding: int, num_layers: int, hidden_size: int, vocab_size: int,
                          seq_len: int, block_size: int) -> float:
    """Training FLOPs per data token of BD3-LM's vectorised training (Arriola et al. 2025, sec. 3.2), which
    runs the ``2 L`` tokens ``[x_t ; x_0]`` of each length-``L`` sequence under the block-causal mask of
    :func:`difflm.model.masks.block_causal_mask`:

        12 (N - N_head) + 6 N_head + 12 n_layers d (L + block_size)

    * Linear layers: every block's parameters (N - N_head, N without the input embedding as in
      :func:`flops_per_token`) see all ``2 L`` tokens: 6 (N - N_head) x 2L per sequence. The LM head
      (N_head = vocab x d) is counted over the ``L`` noisy tokens only, as for MDLM (PaLM's 6 N counts it at
      every position of the sequence; difflm evaluates it at the loss positions, a subset of the noisy half;
      the clean half never reaches it).
    * Attention: 12 d FLOPs (QK^T and AV, forward and backward) per layer per (query, key) pair the mask
      allows. Its nonzero entries, with n = L / block_size blocks: noisy->noisy block diagonal L x block_size,
      noisy->clean strictly earlier blocks block_size^2 n (n-1) / 2, clean->clean same or earlier blocks
      block_size^2 n (n+1) / 2; in all L^2 + L x block_size, a fraction (1 + block_size / L) / 4 of the
      dense 2L x 2L. These are the model's FLOPs: a kernel that skips masked tiles (FlexAttention with a
      ``BlockMask``) computes ~1.06x this at block 16 (its 128-wide tiles on the diagonal are partly empty); a
      kernel that applies the mask to dense scores (SDPA or ``attn_mask_type="arbitrary"`` with a dense boolean
      mask) computes all 4 L^2 pairs, ~4x. That extra work is not counted: MFU measures the model's useful
      FLOPs (PaLM appendix B: no rematerialisation or other implementation overhead), so a dense kernel shows
      as the lower MFU it is, instead of being rewarded for waste.

    Per data token (``L`` per sequence, what ``tokens/s`` counts in the trainer and the benchmark): the
    per-sequence total / L. For ``model=1.7b``, L = 4096, block 16: 2.18e10, 1.73x MDLM's 1.26e10 at the
    same L (the dense-attention count would be 3.02e10). At ``block_size = L`` the noisy half attends within
    itself (MDLM) and the clean half within itself: twice MDLM's FLOPs less one LM head (6 N_head).
    """
    head = vocab_size * hidden_size
    return 12.0 * (num_params_non_embedding - head) + 6.0 * head + 12.0 * num_layers * hidden_size * (seq_len + block_size)


def objective_flops_per_token(objective_cfg, model_cfg, num_params_non_embedding: int, seq_len: int) -> float:
    """The FLOPs per data token that MFU uses for a run of ``objective_cfg`` (``objective.name``):
    :func:`bd3lm_flops_per_token` for ``bd3lm`` (``objective.block_size``), PaLM's :func:`flops_per_token` for
    every other objective. ``model_cfg`` needs ``num_layers``, ``hidden_size`` and a resolved ``vocab_size``."""
    m = model_cfg
    if objective_cfg.name == "bd3lm":
        return bd3lm_flops_per_token(num_params_non_embedding, m.num_layers, m.hidden_size, m.vocab_size, seq_len,
                                     int(objective_cfg.block_size))
    return flops_per_token(num_params_non_embedding, m.num_layers, m.hidden_size, seq_len)


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
