"""Parallel layouts on a DeviceMesh with PyTorch's own engines: FSDP2, DTensor TP/SP, pipelining, CP, DCP.

See docs/parallel.md. Modules: :mod:`~difflm.parallel.mesh` (degrees and the mesh),
:mod:`~difflm.parallel.distributed` (process group, rank-0 helpers), :mod:`~difflm.parallel.tensor_parallel`,
:mod:`~difflm.parallel.te_tensor_parallel`, :mod:`~difflm.parallel.vocab_parallel` (LM head and cross-entropy under
TP), :mod:`~difflm.parallel.fsdp`, :mod:`~difflm.parallel.pipeline`, :mod:`~difflm.parallel.context_parallel`,
:mod:`~difflm.parallel.parallelize` (applies them in order) and :mod:`~difflm.parallel.materialize` (each rank
allocates and initialises only its shards of a model built on the meta device).
"""
from difflm.parallel.mesh import MESH_DIMS, ParallelDims, build_mesh, te_process_groups

__all__ = ["MESH_DIMS", "ParallelDims", "build_mesh", "te_process_groups"]
