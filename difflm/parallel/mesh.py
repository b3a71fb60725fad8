"""Mesh arithmetic of a parallel layout in one small class, and the DeviceMesh built from it.

After torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``). The mesh has five
named dimensions, outermost first (the last one varies fastest over global ranks)::

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")

so tensor-parallel peers are adjacent ranks (same node, NVLink), then context-parallel peers, then the
FSDP shard group, then replicas, and pipeline stages are the slowest dimension (they talk least).
Flattened views used by the trainer:

    "dp"           = dp_replicate x dp_shard       data loading: rank r reads slice r of the global batch
    "dp_shard_cp"  = dp_shard x cp                 FSDP2 shards parameters over this (CP ranks hold the
                                                   same parameters, so they share the FSDP group)
    "dp_cp"        = dp_replicate x dp_shard x cp  ranks whose gradients are averaged (loss reduction)
    "stage"        = dp_replicate x dp_shard x cp x tp   ranks holding the same pipeline stage (FP8 amax reduction)

Every dimension exists even when its size is 1, so ``mesh["tp"]`` always works.
Expert parallelism (``parallel.ep``, MoE models) is not a sixth dimension: it splits ``dp_shard`` into
``(efsdp, ep)`` for the routed experts only (:func:`difflm.parallel.expert_parallel.expert_mesh`).
See docs/parallel.md for a picture and docs/moe.md for expert parallelism.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from difflm.errors import DifflmError

# torch >= 2.10 warns, once per process and slice, that slicing a flattened dimension ("dp", "dp_shard_cp", "dp_cp",
# "stage") from the root mesh "will be deprecated"; every rank of every run printed it. The slices are what
# torchtitan takes too, and tests/test_parallel.py checks the groups they give on every layout, so the notice is
# silenced here, where the flattened dimensions are made, and only that one.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LaunchSizeMismatch(DifflmError):
    """A layout whose degrees do not fit the number of processes. ``runs_on`` is the process count it needs
    (``multiple=False``) or must be a multiple of (``multiple=True``, a ``-1`` degree to fill), so a command that
    does not launch processes (``difflm-plan``, given ``--gpus``) can word the fix its own way."""

    def __init__(self, message: str, runs_on: int, multiple: bool):
        super().__init__(message)
        self.runs_on, self.multiple = runs_on, multiple


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a layout; their product is the world size.

    Build with :meth:`from_config`, which fills a ``-1`` (``dp_shard`` or ``dp_replicate``) with the ranks left.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1  # expert parallel: borrowed from dp_shard (efsdp = dp_shard / ep)

    @classmethod
    def from_config(cls, p, world_size: int) -> "ParallelDims":
        """Resolve the ``parallel`` config for ``world_size`` processes.

        Raises: DifflmError (one line naming the keys) when a degree is not positive (or -1), when both
        ``dp_shard`` and ``dp_replicate`` are -1, or when the degrees do not multiply to ``world_size``.
        """
        degrees = {k: int(p[k]) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
        for key, value in degrees.items():
            if value == 0 or value < -1 or (value == -1 and key not in ("dp_shard", "dp_replicate")):
                raise DifflmError(f"parallel.{key}={value} must be a positive degree"
                                  + (" (or -1: fill the remaining ranks)" if key in ("dp_shard", "dp_replicate") else ""))
        fill = [k for k in ("dp_shard", "dp_replicate") if degrees[k] == -1]
        if len(fill) > 1:
            raise DifflmError("parallel.dp_shard=-1 and parallel.dp_replicate=-1: only one degree can fill the "
                              "remaining ranks; set the other to a number")
        rest = 1
        for key, value in degrees.items():
            if value != -1:
                rest *= value
        if fill:
            if world_size % rest:
                raise LaunchSizeMismatch(
                    f"parallel.{fill[0]}=-1 cannot fill the world size {world_size}: the other degrees "
                    f"(dp_replicate*dp_shard*tp*pp*cp without it) multiply to {rest}, which does not divide it; "
                    f"launch a multiple of {rest} processes or change parallel={p.name}", rest, multiple=True)
            degrees[fill[0]] = world_size // rest
        product = 1
        for value in degrees.values():
            product *= value
        if product != world_size:
            layout = " ".join(f"{k}={degrees[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))
            raise LaunchSizeMismatch(
                f"parallel.dp_replicate*dp_shard*tp*pp*cp={product} but the world size is {world_size}: this layout "
                f"({layout}) runs on {product} process(es); launch with torchrun --nproc-per-node {product} "
                "or pick a layout whose degrees multiply to the world size (dp_shard=-1 fills it)", product,
                multiple=False)
        ep = int(p.get("ep", 1))
        if ep < 1:
            raise DifflmError(f"parallel.ep={ep} must be a positive degree")
        if degrees["dp_shard"] % ep:
            raise DifflmError(f"parallel.ep={ep} does not divide parallel.dp_shard={degrees['dp_shard']}: expert "
                              "parallelism splits the FSDP shard group; pick an ep dividing dp_shard (world size / "
                              "(dp_replicate*tp*pp*cp))")
        return cls(world_size=world_size, ep=ep, **degrees)

    # ------------------------------------------------------------------ derived sizes
    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model when data or context parallel ranks must share/average gradients."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """FSDP shard degree of the routed experts: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_DIMS` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def describe(self) -> str:
        text = " x ".join(f"{name}={size}" for name, size in zip(MESH_DIMS, self.shape()))
        return text + (f" (ep={self.ep} of dp_shard)" if self.ep_enabled else "")


def build_mesh(dims: ParallelDims, device_type: str):
    """The 5-D :class:`torch.distributed.device_mesh.DeviceMesh` of ``dims`` plus its flattened views.

    Args:
        dims: resolved degrees; the default process group must already exist with ``dims.world_size`` ranks.
        device_type: ``"cuda"`` (NCCL) or ``"cpu"`` (gloo).
    Returns: the mesh; ``mesh["dp"]``, ``mesh["dp_shard_cp"]``, ``mesh["dp_cp"]`` and ``mesh["stage"]`` are
        flattened submeshes (``DeviceMesh._flatten``, torchtitan's use).
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.shape(), mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
    return mesh


def te_process_groups(mesh, dims: ParallelDims, sequence_parallel: bool) -> dict:
    """Keyword arguments for ``build_model(..., **te_parallel)`` (the TE backend's constructor).

    ``tp_group``/``sequence_parallel`` when tp > 1, ``cp_group``/``cp_global_ranks`` when cp > 1, all taken from
    the same mesh as every other layout (``mesh["tp"].get_group()``), so TE's collectives run on the right ranks.
    """
    out: dict = {}
    if dims.tp_enabled:
        out.update(tp_group=mesh["tp"].get_group(), sequence_parallel=bool(sequence_parallel))
    if dims.cp_enabled:
        out.update(cp_group=mesh["cp"].get_group(), cp_global_ranks=mesh["cp"].mesh.flatten().tolist())
    return out


def mesh_coordinates(mesh) -> dict[str, int]:
    """This rank's coordinate on each named (and flattened) dimension: {"pp": 0, "dp": 1, "tp": 0, ...}."""
    return {name: mesh[name].get_local_rank() for name in (*MESH_DIMS, "dp", "dp_shard_cp", "dp_cp")}
