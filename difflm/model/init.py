"""Parameter initialisation shared by every kernel set and every layout: the same seed gives the same weights.

Counter-based keyed init. Each random weight is N(0, std^2) (Megatron-LM's init, see :func:`init_std`); its full
(single-process) tensor, viewed as a matrix [rows, cols], is cut into fixed :data:`TILE` x :data:`TILE` tiles, and
tile ``(a, b)`` is drawn from NumPy's Philox4x64 counter-based generator (Salmon et al. 2011, "Parallel random
numbers: as easy as 1, 2, 3") keyed by a 128-bit hash of ``(seed, parameter name)``, its counter starting at
``(a * col_tiles + b) << 64``. A rank that holds a shard of the tensor (FSDP2 rows, tensor-parallel rows or columns,
the gate/up-interleaved rows of ``fc1``, any mix: :mod:`difflm.parallel.materialize` says which rows and columns)
draws only the tiles its shard intersects, so initialisation costs O(shard), never O(full tensor), and every layout
holds exactly the values one process holds. The values do not depend on the device, on the order modules are built
in, or on the layout; they are not those of difflm before this scheme (one ``torch.randn`` per full tensor), which
only changes fresh runs: checkpoints hold the weights themselves.
"""
from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np
import torch

TILE = 256  # rows and columns of one independently keyed tile (64 Ki values, 256 KiB in FP32)
Index = Sequence[Optional[torch.Tensor]]  # per matrix dim: int64 positions in the full tensor (None: all of it)


def init_std(name: str, cfg) -> Optional[float]:
    """Standard deviation of parameter ``name``'s init; None for the constant ones (norm scales 1, biases 0).

    Weights are N(0, init_std^2); the residual-branch outputs (``attention.proj``, ``mlp.fc2``, and in MoE layers
    ``mlp.experts.fc2`` / ``mlp.shared.fc2``) are scaled by 1/sqrt(2 * num_layers) (Megatron-LM
    ``scaled_init_method_normal``; GPT-2 paper sec. 2.3); the MoE router is N(0, init_std^2) as in Megatron-LM.
    """
    if name.endswith(("norm_weight", "norm.weight", "bias")):
        return None
    if name.endswith(("proj.weight", "fc2_weight")):
        return cfg.init_std / math.sqrt(2 * cfg.num_layers)
    return cfg.init_std


def _key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest(), "little")


def _as_slice(idx: np.ndarray):
    """``idx`` as a slice when it is a run of consecutive integers (the common case: plain row/column blocks)."""
    if len(idx) and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and bool((np.diff(idx) == 1).all()):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _groups(idx: np.ndarray) -> list[tuple[int, object, object]]:
    """(tile, positions in ``idx``, offsets inside the tile) for each tile the positions ``idx`` fall in; positions
    and offsets are slices where they are consecutive."""
    tiles = idx // TILE
    order = np.argsort(tiles, kind="stable")
    values, starts = np.unique(tiles[order], return_index=True)
    out = []
    for tile, pos in zip(values.tolist(), np.split(order, starts[1:])):
        out.append((tile, _as_slice(pos), _as_slice(idx[pos] - tile * TILE)))
    return out


def keyed_normal(seed: int, name: str, full_shape: Sequence[int], index: Index = (None, None),
                 std: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Values of the keyed N(0, std^2) init of parameter ``name`` at the rows ``index[0]`` and columns ``index[1]``
    of its full tensor (see the module docstring).

    Args:
        full_shape: the single-process shape; 1-D tensors are one column, n-D ones [shape[0], prod(rest)].
        index: int64 positions (any order, any subset) per matrix dim; None takes the whole dim.
        out: an FP32 CPU tensor of ``len(index[0]) * len(index[1])`` elements to fill in place (no second buffer).
    Returns: FP32 CPU tensor [len(index[0]), len(index[1])] (1-D for a 1-D ``full_shape``; ``out`` reshaped when
        given); only the tiles it intersects are drawn, by ``torch.get_num_threads()`` threads (NumPy's generators
        and copies release the GIL); the values do not depend on the thread count.
    """
    rows = int(full_shape[0]) if len(full_shape) else 1
    cols = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    r_idx = np.arange(rows) if index[0] is None else index[0].cpu().numpy().astype(np.int64)
    c_idx = np.arange(cols) if len(index) < 2 or index[1] is None else index[1].cpu().numpy().astype(np.int64)
    out = torch.empty(len(r_idx), len(c_idx)) if out is None else out.view(len(r_idx), len(c_idx))
    dest = out.detach().numpy()  # shares memory with ``out``
    key, col_tiles = _key(seed, name), -(-cols // TILE)
    col_groups = _groups(c_idx)

    def fill(row_group) -> None:
        a, r_pos, r_in = row_group
        for b, c_pos, c_in in col_groups:
            gen = np.random.Generator(np.random.Philox(key=key, counter=(a * col_tiles + b) << 64))
            tile = gen.standard_normal((min(TILE, rows - a * TILE), min(TILE, cols - b * TILE)), dtype=np.float32)
            tile *= np.float32(std)
            block = tile[r_in][:, c_in]
            if isinstance(r_pos, slice) or isinstance(c_pos, slice):
                dest[r_pos, c_pos] = block
            else:
                dest[np.ix_(r_pos, c_pos)] = block

    row_groups = _groups(r_idx)
    threads = min(torch.get_num_threads(), len(row_groups))
    if threads > 1 and len(r_idx) * len(c_idx) >= 1 << 22:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, row_groups))
    else:
        for group in row_groups:
            fill(group)
    return out.reshape(len(r_idx)) if len(full_shape) <= 1 else out


# locate(name, param) -> (name in the full model, full shape, index of this rank's local tensor): the layout's part
Locate = Callable[[str, torch.Tensor], tuple[str, torch.Size, Index]]


@torch.no_grad()
def megatron_init_(model: torch.nn.Module, cfg, seed: int, locate: Optional[Locate] = None) -> None:
    """Megatron-style keyed init (:func:`init_std`, :func:`keyed_normal`) of every parameter of ``model``, in place.

    Works after ``to_empty`` and on sharded parameters: ``locate`` (default: every parameter whole, named as in
    ``model``) says which part of which full tensor each local tensor holds, so a shard gets exactly the values of
    the same rows and columns in one process. DTensor parameters are written through their local tensor; ``copy_``
    moves the values to the parameter's device (and quantizes FP8 weights). Shapes: a local tensor of n dims > 2 is
    filled as [shape[0], prod(rest)].
    Buffers (the MoE router's aux-loss-free bias and statistics) are zeroed: ``to_empty`` leaves them uninitialised.
    Raises: ValueError when ``locate`` gives an index whose size does not match the local tensor.
    """
    for _, b in model.named_buffers():
        b.zero_()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        full_name, full_shape, index = locate(name, p) if locate is not None else (name, p.shape, (None, None))
        std = init_std(full_name, cfg)
        if full_name.endswith((".lora_A", ".lora_B")):  # LoRA factors (difflm.model.lora): A ~ N(0, (1/r)^2), B = 0
            std = 1.0 / int(full_shape[-2]) if full_name.endswith(".lora_A") else None
        if std is None:
            local.fill_(0.0 if full_name.endswith(("bias", ".lora_B")) else 1.0)
            continue
        if local.numel() == 0:
            continue
        sizes = [full_shape[0] if len(full_shape) else 1, math.prod(full_shape[1:])]
        count = math.prod(len(i) if i is not None else n for i, n in zip(index, sizes))
        if count != local.numel():
            raise ValueError(f"init of {full_name}: the layout locates {count} values for a local tensor of shape "
                             f"{tuple(local.shape)}")
        in_place = (type(local) in (torch.Tensor, torch.nn.Parameter) and local.device.type == "cpu"
                    and local.dtype == torch.float32 and local.is_contiguous())
        values = keyed_normal(seed, full_name, full_shape, index, std, out=local if in_place else None)
        if not in_place:
            local.copy_(values.reshape(local.shape))
