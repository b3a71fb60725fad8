"""The parameters of a model config and where a parallel layout puts each of them.

The parameter list comes from the real model built on the meta device (no memory), so the planner counts exactly
what ``difflm-train`` builds. The placement rules mirror the layout code:

* tensor parallelism (:mod:`difflm.parallel.tensor_parallel`, Megatron-LM's column/row split, Shoeybi et al. 2019):
  the embedding, the QKV projection, the MLP's ``fc1`` and the LM head are split along dim 0, the attention output
  projection and ``fc2`` along dim 1; norms and the MoE slot (router, experts, shared experts) are replicated;
* expert parallelism (:mod:`difflm.parallel.expert_parallel`): routed experts split along dim 0 over ``ep``;
* pipeline parallelism (:func:`difflm.parallel.pipeline.split_layers`): consecutive blocks per stage, the embedding on
  the first stage and the final norm + head on the last; a pipeline rank holds the stages
  :func:`difflm.parallel.pipeline.stage_ids` gives it (interleaved schedules ``parallel.pp_virtual_stages`` of them,
  ``ZBVZeroBubble`` the first and the last of the V: the embedding and the head on rank 0);
* FSDP2 (``fully_shard``): every tensor's dim 0 split over ``dp_shard x cp`` (routed experts over ``dp_shard x cp /
  ep``), padded to equal shards (torch docs, "torch.distributed.fsdp.fully_shard": ``torch.chunk`` on dim 0, the
  last shards padded).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

# parameter-name suffix -> dim split by tensor parallelism (None: replicated)
_TP_DIM = {"embedding.weight": 0, "attention.qkv.weight": 0, "attention.qkv.bias": 0, "attention.proj.weight": 1,
           "mlp.fc1_weight": 0, "mlp.fc2_weight": 1, "output.weight": 0}


@dataclass(frozen=True)
class Param:
    """One parameter tensor: its full ``shape``, the block it belongs to (``None`` for the embedding / final norm /
    head), and whether it is a routed expert."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    expert: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tp_dim(self) -> int | None:
        """The dim tensor parallelism splits (None: replicated over ``tp``)."""
        if ".mlp." in self.name and (".experts." in self.name or ".shared." in self.name or ".router." in self.name):
            return None  # the MoE slot runs replicated over TP
        for suffix, dim in _TP_DIM.items():
            if self.name.endswith(suffix):
                return dim
        return None


def model_params(model_cfg, vocab_size: int) -> list[Param]:
    """The parameters of ``model_cfg`` with ``vocab_size`` (padded), listed from the model built on the meta device.

    The torch kernel set is built whatever ``model.backend`` says: both kernel sets hold the same parameter names
    and shapes (docs/performance.md), and the TE one needs CUDA to be built.
    """
    from difflm.model import build_model, resolve_model_config

    from difflm.model.auto_kernels import cpu_kernels

    cfg = cpu_kernels(model_cfg, keep_explicit=False)
    resolve_model_config(cfg, vocab_size)
    cfg.compile = False
    model = build_model(cfg, causal=False, device=torch.device("cpu"), seed=None, meta=True)
    out = []
    for name, p in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        out.append(Param(name, tuple(p.shape), layer, ".experts." in name))
    return out


def stages_per_rank(pp: int, virtual: int = 1, schedule: str = "1F1B") -> int:
    """Pipeline stages one of the ``pp`` ranks holds, as the trainer cuts them
    (:func:`difflm.parallel.pipeline.build_stage_models`): 2 under a V schedule (``ZBVZeroBubble``), else
    ``virtual`` (``parallel.pp_virtual_stages``)."""
    from difflm.parallel.pipeline import V_STYLE_SCHEDULES

    return 1 if pp == 1 else (2 if schedule in V_STYLE_SCHEDULES else max(int(virtual), 1))


@functools.lru_cache(maxsize=None)
def _stage_ranks(pp: int, virtual: int, schedule: str) -> tuple[int, ...]:
    """The pipeline rank holding each of the ``pp x`` :func:`stages_per_rank` stages
    (:func:`difflm.parallel.pipeline.stage_ids`). Cached: a layout search asks once per parameter."""
    from difflm.parallel.pipeline import stage_ids

    per_rank = stages_per_rank(pp, virtual, schedule)
    ranks = [0] * (pp * per_rank)
    for r in range(pp):
        for stage in stage_ids(r, pp, per_rank, schedule):
            ranks[stage] = r
    return tuple(ranks)


@functools.lru_cache(maxsize=None)
def _layer_ranks(num_layers: int, pp: int, virtual: int, schedule: str) -> tuple[int, ...]:
    """The pipeline rank holding each block: its stage among the consecutive cuts of
    :func:`difflm.parallel.pipeline.split_layers`, and that stage's rank (:func:`_stage_ranks`)."""
    from difflm.parallel.pipeline import split_layers

    ranks = _stage_ranks(pp, virtual, schedule)
    return tuple(ranks[s] for s, layers in enumerate(split_layers(num_layers, len(ranks))) for _ in layers)


def stage_of(param: Param, num_layers: int, pp: int, virtual: int = 1, schedule: str = "1F1B") -> int:
    """The pipeline rank holding ``param``: its stage among ``pp x`` :func:`stages_per_rank` consecutive cuts
    (:func:`difflm.parallel.pipeline.split_layers`; the embedding in the first stage, the final norm and the head in
    the last), and the rank :func:`difflm.parallel.pipeline.stage_ids` gives that stage.

    Raises: ValueError for a block index outside ``num_layers``."""
    if pp == 1:
        return 0
    if param.layer is None:
        ranks = _stage_ranks(pp, int(virtual), schedule)
        return ranks[0] if param.name.startswith("embedding") else ranks[-1]
    layers = _layer_ranks(num_layers, pp, int(virtual), schedule)
    if not 0 <= param.layer < len(layers):
        stages = len(_stage_ranks(pp, int(virtual), schedule))
        raise ValueError(f"{param.name}: layer {param.layer} is in no stage of {stages}")
    return layers[param.layer]


def rank_layers(num_layers: int, pp: int, virtual: int = 1, schedule: str = "1F1B") -> list[int]:
    """Blocks each of the ``pp`` pipeline ranks holds (over all its stages, :func:`stage_of`'s cut)."""
    if pp == 1:
        return [num_layers]
    layers = _layer_ranks(num_layers, pp, int(virtual), schedule)
    return [layers.count(r) for r in range(pp)]


def last_stage_rank(pp: int, virtual: int = 1, schedule: str = "1F1B") -> int:
    """The pipeline rank holding the last stage (the final norm, the LM head and the loss): ``pp - 1``, or rank 0
    under a V schedule."""
    return 0 if pp == 1 else _stage_ranks(pp, int(virtual), schedule)[-1]


def local_numel(param: Param, tp: int, ep: int, fsdp: int, efsdp: int) -> int:
    """Elements of ``param`` one rank holds (the largest shard, as the most loaded rank sees it).

    Args:
        tp / ep: tensor- and expert-parallel degrees; fsdp: FSDP2's shard degree (``dp_shard x cp``) for every
            parameter but the routed experts, which are sharded over ``efsdp`` (``dp_shard x cp / ep``).
    """
    shape = list(param.shape)
    dim = param.tp_dim
    if tp > 1 and dim is not None:
        shape[dim] = math.ceil(shape[dim] / tp)
    if param.expert and ep > 1:
        shape[0] = math.ceil(shape[0] / ep)
    shard = efsdp if param.expert else fsdp
    if shard > 1:
        shape[0] = math.ceil(shape[0] / shard)
    return math.prod(shape)
