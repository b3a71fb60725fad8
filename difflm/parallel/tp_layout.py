"""Which parameters tensor parallelism splits and how, by name, for both kernel sets: the split dimension of each
parameter (:data:`SHARD_DIM`), the gate/up row order of the SwiGLU ``fc1`` weight over TP ranks, module paths without
the wrappers' prefixes, and a DTensor's local shard. Shared by :mod:`difflm.parallel.tensor_parallel` (DTensor, torch
kernels) and :mod:`difflm.parallel.te_tensor_parallel` (Transformer Engine)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


# ------------------------------------------------------------------ gate/up row order
def interleave_gate_up(w: torch.Tensor, tp: int) -> torch.Tensor:
    """``[gate; up]`` rows ([2f, ...]) -> ``[gate_0; up_0; ...; gate_{tp-1}; up_{tp-1}]`` (chunks of f/tp rows)."""
    rows = w.shape[0]
    return w.reshape(2, tp, rows // (2 * tp), *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def deinterleave_gate_up(w: torch.Tensor, tp: int) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    rows = w.shape[0]
    return w.reshape(tp, 2, rows // (2 * tp), *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def clean_fqn(name: str) -> str:
    """A module path without the wrappers' prefixes (activation checkpointing, compile, FSDP1)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


SHARD_DIM = {  # parameter name suffix -> dimension split over TP ranks
    "attention.qkv.weight": 0,
    "attention.qkv.bias": 0,
    "attention.proj.weight": 1,
    "mlp.fc1_weight": 0,
    "mlp.fc2_weight": 1,
    "output.weight": 0,  # the vocab-parallel LM head (difflm.parallel.vocab_parallel)
}
GATE_UP = "mlp.fc1_weight"


def shard_dim(fqn: str) -> Optional[int]:
    """The TP split dimension of parameter ``fqn`` (wrapper prefixes allowed), or None when replicated."""
    fqn = clean_fqn(fqn)
    for suffix, dim in SHARD_DIM.items():
        if fqn == suffix or fqn.endswith("." + suffix):
            return dim
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["GATE_UP", "SHARD_DIM", "clean_fqn", "deinterleave_gate_up", "interleave_gate_up", "shard_dim"]
