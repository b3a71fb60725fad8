"""Context parallelism (CP): the sequence of every sample is split over ``cp`` ranks; attention exchanges K/V.

Load balancing for bidirectional attention: the sequence is cut into ``2 cp`` chunks and rank r holds
chunks r and 2 cp - 1 - r (Transformer Engine's "dual chunk swap", also PyTorch's round-robin CP load
balancer). For full (non-causal) attention every split costs the same; the balanced one is kept so the AR
objective (causal) and both backends use one layout. Hence ``data.seq_len`` (and random lengths) must be a
multiple of ``2 cp`` (times ``tp`` with sequence parallelism).

Where it runs:

* ``model.backend=te`` (CUDA): TE's ``DotProductAttention(cp_group=...)`` does the ring exchange; the trainer
  feeds each rank its chunks (:func:`shard_sequence`) and TE rotates the positions itself.
* ``model.backend=torch`` on CUDA: ``torch.distributed.tensor.experimental.context_parallel`` patches SDPA
  with ring attention and shards the batch buffers and ``position_ids`` in place (:func:`torch_cp_context`).
* CPU: PyTorch's CP ring attention needs the CUDA SDPA kernels (flash / memory-efficient); there is no CPU
  path, and :func:`cp_unavailable_reason` refuses the layout before any process group exists. The
  sharding arithmetic below is pure and tested on CPU.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


def cp_unavailable_reason(model_cfg, device: torch.device) -> Optional[str]:
    """Why ``parallel.cp > 1`` cannot run with this model and device; None when it can."""
    if device.type != "cuda":
        return (f"parallel.cp>1 needs CUDA (PyTorch's context-parallel ring attention and TE's run on GPU kernels "
                f"only) and device={device.type}: use parallel.cp=1 on CPU")
    if model_cfg.backend == "te" and model_cfg.attention_backend != "te":
        return "parallel.cp>1 with model.backend=te runs inside te.DotProductAttention: set model.attention_backend=te"
    if model_cfg.backend == "torch" and model_cfg.attention_backend != "sdpa":
        return ("parallel.cp>1 with model.backend=torch patches scaled_dot_product_attention: set "
                "model.attention_backend=sdpa")
    return None


def load_balanced_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions held by ``cp_rank``: chunks r and 2 cp - 1 - r of 2 cp equal chunks, [seq_len / cp] int64.

    Raises: ValueError when 2 cp does not divide ``seq_len``.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``t`` (sequence along ``dim``) that ``cp_rank`` holds, in :func:`load_balanced_indices` order."""
    if cp == 1:
        return t
    return t.index_select(dim, load_balanced_indices(t.shape[dim], cp, cp_rank).to(t.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from the shards of ranks 0..cp-1 (e.g. all-gathered)."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    seq_len = shards[0].shape[dim] * cp
    order = torch.cat([load_balanced_indices(seq_len, cp, r) for r in range(cp)]).to(shards[0].device)
    gathered = torch.cat(shards, dim=dim)
    out = torch.empty_like(gathered)
    index_shape = [1] * gathered.ndim
    index_shape[dim] = seq_len
    out.index_copy_(dim, order, gathered)
    return out


def torch_cp_context(cp_mesh, buffers: list[torch.Tensor], seq_dims: list[int], causal: bool):
    """``torch.distributed.tensor.experimental.context_parallel`` over ``cp_mesh`` (CUDA, SDPA); buffers are
    sharded in place for the duration (input ids, targets, weights, masks, ``position_ids``).

    Load balancing (head-tail chunks) only pays, and is only accepted by PyTorch's ring attention, for causal
    attention: bidirectional (diffusion) attention does the same work on every chunk, so its buffers are cut
    into contiguous chunks (``_cp_options.enable_load_balance``, as torchtitan sets it).
    A null context when ``cp_mesh`` has one rank."""
    if cp_mesh.size() == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    _cp_options.enable_load_balance = bool(causal)

    return context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers))


__all__ = ["cp_unavailable_reason", "load_balanced_indices", "shard_sequence", "torch_cp_context", "unshard_sequence"]
