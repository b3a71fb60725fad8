"""Tensor (+ sequence) parallelism of the torch backend with DTensor (``torch.distributed.tensor.parallel``).

Plan per block (Megatron-LM's split, Shoeybi et al. 2019, sec. 3; sequence parallelism: Korthikanti et
al. 2022), applied with :func:`parallelize_module` on ``mesh["tp"]``:

=========================  ==========================  ==============================================
module                     style                       placement of its parameters
=========================  ==========================  ==============================================
embedding                  ``RowwiseParallel``         weight Shard(0) (vocab-parallel); output Replicate,
                                                       or Shard(1) (sequence) with sequence_parallel
attention                  :class:`GatherSequence`     (sequence_parallel only) all-gathers its input
attention.qkv              :class:`NormColwiseParallel` weight/bias Shard(0), layer_norm_weight Replicate
attention.q_norm / k_norm  ``SequenceParallel(dim=2)``  weight Replicate; input sharded over local heads
attention.proj             ``RowwiseParallel``         weight Shard(1); output Replicate / Shard(1)
mlp                        :class:`SwiGLUParallel`     fc1 Shard(0) of the gate/up-interleaved rows,
                                                       fc2 Shard(1), layer_norm_weight Replicate
mlp (MoE)                  ``ReplicatedMoE``           all Replicate (routed experts: Shard(0) on ep when
                                                       ep > 1); runs on the gathered sequence
                                                       (:mod:`difflm.parallel.expert_parallel`)
final_norm                 ``SequenceParallel`` +      weight Replicate; its output is gathered (SP) for
                           :class:`EnterVocabParallel` the head, gradients summed over TP
output (LM head)           :class:`VocabParallelStyle` weight Shard(0) (vocab-parallel): each rank's logits
                                                       [N, V/tp]; vocab-parallel cross-entropy
=========================  ==========================  ==============================================

The fused QKV rows are grouped per KV head, so ``Shard(0)`` gives each rank whole groups when tp divides
``num_kv_heads``. ``mlp.fc1_weight`` is ``[gate; up]`` (TE's SwiGLU layout): a plain row split would give
rank 0 the gates and rank 1 the ups. :class:`SwiGLUParallel` therefore permutes the rows once, at
parallelize time, to ``[gate_0; up_0; gate_1; up_1; ...]`` (:func:`interleave_gate_up`), so that ``Shard(0)``
hands rank r ``[gate_r; up_r]``, and the checkpoint code un-permutes (:func:`canonical_state_dict`), so state
dicts and DCP checkpoints hold the ``[gate; up]`` layout of a single process under every layout.

The LM head is vocab-parallel (:mod:`difflm.parallel.vocab_parallel`, the same head and cross-entropy as the TE
backend's): the loss selects the masked rows of the full hidden states, each rank computes the logits of its
vocabulary slice, and the cross-entropy reduces over the TP group; no rank holds full-vocabulary logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from difflm.model.layers import LayerNormMLP, rms_norm
from difflm.model.lora import active_factors
from difflm.parallel.tp_adapters import FC1_ADAPTER_B, distribute_adapters
from difflm.parallel.tp_layout import (  # noqa: F401  (the layout helpers, imported from here too)
    _local,
    clean_fqn,
    deinterleave_gate_up,
    interleave_gate_up,
    shard_dim,
)
from difflm.parallel.vocab_parallel import EnterVocabParallel, VocabParallelStyle

# ------------------------------------------------------------------ styles
class NormColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a fused RMSNorm + linear (:class:`difflm.model.layers.LayerNormLinear`).

    ``weight`` (and ``bias``) are Shard(0), ``layer_norm_weight`` Replicate. The module's own forward runs on
    DTensors: the norm on the replicated input (with SP the attention's input was all-gathered by
    :class:`GatherSequence`), ``F.linear`` against the row-sharded weight, output Shard(-1) handed on as a
    local tensor (the local heads). Backward: the input gradient (partial sums) is all-reduced, or
    reduce-scattered over the sequence with SP, by DTensor.
    """

    def __init__(self):
        super().__init__(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)

    def _partition_norm_linear_fn(self, name, module, device_mesh):
        if name:  # the LoRA adapters' modules: laid out with their module's weight (difflm.parallel.tp_adapters)
            return
        distribute_adapters(module, device_mesh, {"weight": 0})
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Replicate() if pname == "layer_norm_weight" else Shard(0)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition_norm_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class AdaptedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Linear`` that may hold LoRA adapters (:mod:`difflm.model.lora`): weight
    Shard(1), bias Replicate, the adapters A Shard(1), B Replicate (:mod:`difflm.parallel.tp_adapters`); the
    adapter's partial sums join the base output's before its all-reduce / reduce-scatter."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name:  # the adapters' modules: laid out with the weight below
            return
        super()._partition_linear_fn(name, module, device_mesh)
        distribute_adapters(module, device_mesh, {"weight": 1})


class GatherSequence(ParallelStyle):
    """Sequence parallelism: the module's first positional input, a local Shard(1) (sequence) tensor, becomes a
    Replicate DTensor (all-gather; its gradient is reduce-scattered back). The module sees the full sequence
    and its other arguments (RoPE tables, masks) untouched. Used on ``attention``, whose reshapes need S.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(mod, args):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return (x.redistribute(device_mesh, [Replicate()]), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


class TensorParallelSwiGLU(LayerNormMLP):
    """:class:`LayerNormMLP` whose forward runs tensor-parallel (the class :class:`SwiGLUParallel` swaps in;
    parameter names are unchanged).

    Shapes: x [B, S, d] (Replicate) or [B, S/tp, d] (sequence-parallel shard), local tensors -> same.
    ``fc1_weight`` is a Shard(0) DTensor of the interleaved rows, so its local block is [gate_r; up_r]
    [2f/tp, d]; the SwiGLU runs on local halves, ``fc2`` (Shard(1)) gives partial sums that are all-reduced
    (or reduce-scattered over the sequence with SP).
    """

    _tp_mesh = None
    _tp_sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh, seq = self._tp_mesh, self._tp_sequence_parallel
        x = DTensor.from_local(x, mesh, [Shard(1) if seq else Replicate()], run_check=False)
        xn = rms_norm(x, self.layer_norm_weight, self.eps).redistribute(mesh, [Replicate()])
        h = F.linear(xn, self.fc1_weight)
        if (f1 := active_factors(self, "fc1_weight")) is not None:  # LoRA: A Replicate, B Shard(0) -> Shard(-1)
            h = h + f1(xn)
        h = h.redistribute(mesh, [Shard(-1)]).to_local()  # [.., 2f/tp] = gate_r|up_r
        gate, up = h.chunk(2, dim=-1)
        a = DTensor.from_local(F.silu(gate) * up, mesh, [Shard(-1)], run_check=False)  # [.., f] in true order
        out = F.linear(a, self.fc2_weight)  # Partial
        if (f2 := active_factors(self, "fc2_weight")) is not None:  # LoRA: A Shard(1), B Replicate -> Partial
            out = out + f2(a)
        return out.redistribute(mesh, [Shard(1) if seq else Replicate()]).to_local()


class SwiGLUParallel(ParallelStyle):
    """Tensor-parallel style of a SwiGLU :class:`LayerNormMLP` (fc1 = [gate; up]) on a 1-D TP mesh.

    Permutes ``fc1_weight``'s rows with :func:`interleave_gate_up`, shards it Shard(0) and ``fc2_weight``
    Shard(1), replicates ``layer_norm_weight`` and swaps the module's class to :class:`TensorParallelSwiGLU`.
    """

    def __init__(self, *, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, LayerNormMLP):
            raise TypeError(f"SwiGLUParallel applies to LayerNormMLP, got {type(module).__name__}")
        tp = device_mesh.size()
        with torch.no_grad():
            fc1 = interleave_gate_up(module.fc1_weight.detach(), tp)
        placements = {"fc1_weight": (fc1, Shard(0)), "fc2_weight": (module.fc2_weight.detach(), Shard(1)),
                      "layer_norm_weight": (module.layer_norm_weight.detach(), Replicate())}
        for name, (value, placement) in placements.items():
            frozen = not module._parameters[name].requires_grad  # LoRA runs keep the base frozen
            module.register_parameter(name, nn.Parameter(distribute_tensor(value, device_mesh, [placement]),
                                                         requires_grad=not frozen))
        distribute_adapters(module, device_mesh, {"fc1_weight": 0, "fc2_weight": 1}, gate_up="fc1_weight")
        module.__class__ = TensorParallelSwiGLU
        module._tp_mesh, module._tp_sequence_parallel = device_mesh, self.sequence_parallel
        return module


# ------------------------------------------------------------------ the plan
def apply_tensor_parallel(model: nn.Module, tp_mesh, *, sequence_parallel: bool) -> nn.Module:
    """Apply the module plan above to a :class:`Transformer` or a pipeline stage of it, in place.

    ``attention.num_heads`` / ``num_kv_heads`` become the local counts (the attention reshapes with them).
    Works on stages without embedding / final norm (pipeline parallel). Returns ``model``. Tied embeddings
    (``model.tie_embeddings``) are refused earlier by :func:`difflm.config.validate.check_parallel`.
    """
    tp = tp_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # LoRA's base (torch's styles re-wrap)
    if getattr(model, "embedding", None) is not None:  # tied embeddings are refused by check_parallel
        parallelize_module(model.embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq))
    for block in _blocks(model):
        attn = block.attention
        plan = {
            "attention.qkv": NormColwiseParallel(),
            "attention.proj": AdaptedRowwiseParallel(output_layouts=seq),
            "mlp": _mlp_style(block.mlp, sequence_parallel),
        }
        if attn.q_norm is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sequence_parallel:
            plan["attention"] = GatherSequence()
        parallelize_module(block, tp_mesh, plan)
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
    model.last_block_loss_rows = False  # the plan's layouts are [B, S(/tp), d]; the loss rows are [R, d]
    if getattr(model, "final_norm", None) is not None:  # the last stage: vocab-parallel head (vocab_parallel.py)
        if sequence_parallel:
            parallelize_module(model.final_norm, tp_mesh, SequenceParallel(use_local_output=True))
        parallelize_module(model.final_norm, tp_mesh, EnterVocabParallel(sequence_parallel=sequence_parallel))
    if getattr(model, "output", None) is not None:
        parallelize_module(model.output, tp_mesh, VocabParallelStyle())
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def _mlp_style(mlp: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    """SwiGLU split over TP for the dense MLP; the MoE slot runs replicated over TP (docs/moe.md)."""
    from difflm.model.moe import MoEMLP

    if isinstance(mlp, MoEMLP):
        from difflm.parallel.expert_parallel import ReplicatedMoE

        return ReplicatedMoE(sequence_parallel=sequence_parallel)
    return SwiGLUParallel(sequence_parallel=sequence_parallel)


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


# ------------------------------------------------------------------ layout-independent state dicts
@dataclass(frozen=True)
class GateUpInterleave:
    """The checkpoint layout of a DTensor ``fc1_weight`` held in gate/up-interleaved rows over ``tp`` ranks.

    Same methods as :class:`difflm.parallel.te_tensor_parallel.TensorParallelShards` (the TE backend's plain
    shards), so :func:`canonical_state_dict` and the sharded init treat both alike: ``full`` (the ``[gate; up]``
    tensor of a single process, from the DTensor's full value), ``full_shape``, ``local`` (what to distribute back)
    and ``full_index`` (where held rows sit in the full tensor).
    """

    tp: int

    def full(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        return deinterleave_gate_up(value, self.tp)

    def full_shape(self, fqn: str, shape: torch.Size) -> torch.Size:
        return torch.Size(shape)

    def local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        return interleave_gate_up(full, self.tp)

    def full_index(self, fqn: str, dim: int, index: torch.Tensor, held_size: int) -> torch.Tensor:
        """Positions in the ``[gate; up]`` tensor of the positions ``index`` along ``dim`` of the held (interleaved)
        tensor, whose ``dim`` has ``held_size`` entries (the sharded init, :mod:`difflm.parallel.materialize`)."""
        return interleave_gate_up(torch.arange(held_size), self.tp)[index] if dim == 0 else index


def canonical_layouts(model_parts: Iterable[nn.Module]) -> dict:
    """{parameter FQN: layout} of the tensors whose checkpoint form differs from what this rank holds: the
    torch backend's interleaved ``fc1_weight`` (:class:`GateUpInterleave`) and the TE backend's tensor-parallel
    shards (``TensorParallelShards``, from a module with a ``tp_group`` and ``tp_shards()``)."""
    out = {}
    for part in model_parts:
        for name, module in part.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, TensorParallelSwiGLU):
                out[clean_fqn(prefix + "fc1_weight")] = GateUpInterleave(module._tp_mesh.size())
                if "fc1_weight" in getattr(module, "lora", {}):  # LoRA's B rows follow fc1's (tp_adapters.py)
                    out[clean_fqn(prefix + FC1_ADAPTER_B)] = GateUpInterleave(module._tp_mesh.size())
            elif getattr(module, "tp_group", None) is not None and hasattr(module, "tp_shards"):
                shards = module.tp_shards()
                for pname, _ in module.named_parameters():
                    if shard_dim(pname) is not None:
                        out[clean_fqn(prefix + pname)] = shards
    return out


def _optim_entries(optim_sd: Optional[dict], fqn: str) -> list[tuple[dict, str]]:
    """The per-parameter optimizer tensors of ``fqn`` (Adam moments; not the scalar ``step``), in a nested
    (``{"state": {fqn: {...}}}``) or flattened (``"state.<fqn>.exp_avg"``, ``flatten_optimizer_state_dict``) dict."""
    if not optim_sd:
        return []
    if "state" in optim_sd and isinstance(optim_sd["state"], dict):
        state = optim_sd["state"].get(fqn, {})
        return [(state, k) for k, v in state.items() if isinstance(v, torch.Tensor) and v.ndim >= 1]
    prefix = f"state.{fqn}."
    return [(optim_sd, k) for k, v in optim_sd.items()
            if k.startswith(prefix) and isinstance(v, torch.Tensor) and v.ndim >= 1]


def canonical_state_dict(model_sd: dict, optim_sd: Optional[dict], layouts: dict) -> None:
    """In place: the entries of ``layouts`` (:func:`canonical_layouts`) and their optimizer moments become full
    plain tensors as a single process holds them (collective over the data- and tensor-parallel ranks). Other
    entries are untouched (DCP saves DTensors sharded). Used before ``dcp.save``.
    """
    for fqn, layout in layouts.items():
        if fqn not in model_sd:  # not saved (a LoRA checkpoint holds the adapters only)
            continue
        for container, key in [(model_sd, fqn)] + _optim_entries(optim_sd, fqn):
            value = container[key]
            container[key] = layout.full(fqn, value.full_tensor() if isinstance(value, DTensor) else value)


def prepare_canonical_load(model_sd: dict, optim_sd: Optional[dict], layouts: dict) -> list:
    """In place: the entries of ``layouts`` are replaced by empty full plain tensors for ``dcp.load`` to fill.
    Returns what :func:`finish_canonical_load` needs to copy them back into this rank's (D)Tensors."""
    pending = []
    for fqn, layout in layouts.items():
        if fqn not in model_sd:  # not read here (a LoRA checkpoint's base, or its adapters, read apart)
            continue
        for container, key in [(model_sd, fqn)] + _optim_entries(optim_sd, fqn):
            dest = container[key]
            container[key] = torch.empty(layout.full_shape(fqn, dest.shape), dtype=dest.dtype,
                                         device=_local(dest).device)
            pending.append((container, key, dest, fqn, layout))
    return pending


def finish_canonical_load(pending: list) -> None:
    """Turn each loaded full tensor into this rank's layout and copy it into the original (D)Tensor."""
    for container, key, dest, fqn, layout in pending:
        held = layout.local(fqn, container[key])
        with torch.no_grad():
            if isinstance(dest, DTensor):
                shard = distribute_tensor(held, dest.device_mesh, dest.placements, src_data_rank=None)
                dest.to_local().copy_(shard.to_local())
            else:
                dest.copy_(held)
        container[key] = dest


__all__ = [
    "AdaptedRowwiseParallel", "GatherSequence", "NormColwiseParallel", "SwiGLUParallel", "TensorParallelSwiGLU",
    "apply_tensor_parallel", "canonical_state_dict",
    "GateUpInterleave", "canonical_layouts", "deinterleave_gate_up", "finish_canonical_load", "interleave_gate_up",
    "prepare_canonical_load",
]
