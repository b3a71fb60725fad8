"""The TE backend's tensor parallelism outside TE's modules (difflm.parallel.te_tensor_parallel), on CPU with gloo.

Transformer Engine itself needs CUDA; what difflm adds around it is plain torch.distributed and is checked
here against single-process values: the sequence-parallel scatter/gather and their gradients, the shard
arithmetic (init, checkpoints), partial-gradient sums and the global gradient norm over TP-sharded plain
tensors. The TE kernel set under TP on the CPU stand-in: tests/test_vocab_parallel.py (losses and gradients vs one
process) and tests/test_materialize.py (initial weights). The GPU end-to-end check is ``scripts/layout_check.py``.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import spawn_ranks
from difflm.model.init import megatron_init_
from difflm.parallel.materialize import ShardLocator
from difflm.parallel.parallelize import grad_norm_and_clip
from difflm.parallel.te_tensor_parallel import (
    TensorParallelShards,
    all_reduce_partial_grads,
    gather_sequence,
    has_partial_grad,
    scatter_sequence,
    shard_dim,
    sharded_param_ids,
)
from difflm.parallel.tensor_parallel import interleave_gate_up

D, F, TP = 8, 12, 2
CFG = SimpleNamespace(init_std=0.02, num_layers=1)


class FakeTE(nn.Module):
    """The TE backend's parameter names and local shapes for one block (no TE needed)."""

    def __init__(self, tp: int = 1, group=None):
        super().__init__()
        self.tp_group = group
        self.layers = nn.ModuleList([nn.Module()])
        block = self.layers[0]
        block.attention = nn.Module()
        block.attention.proj = nn.Linear(D // tp, D, bias=False)  # weight [D, D/tp]: row-parallel, split dim 1
        block.attention.q_norm = nn.Module()
        block.attention.q_norm.weight = nn.Parameter(torch.ones(4))
        block.mlp = nn.Module()
        block.mlp.fc1_weight = nn.Parameter(torch.empty(2 * F // tp, D))
        block.mlp.layer_norm_weight = nn.Parameter(torch.ones(D))
        self.final_norm = nn.Module()
        self.final_norm.weight = nn.Parameter(torch.ones(D))

    def tp_shards(self) -> TensorParallelShards:
        if self.tp_group is None:
            return TensorParallelShards(0, 1)
        return TensorParallelShards(dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group), self.tp_group)


class RankShards(FakeTE):
    """A FakeTE that says it is TP rank ``rank`` of ``tp`` without a process group (for the init arithmetic)."""

    def __init__(self, rank: int, tp: int):
        super().__init__(tp, group=object())
        self._place = TensorParallelShards(rank, tp)

    def tp_shards(self) -> TensorParallelShards:
        return self._place


def init_(model: nn.Module, seed: int) -> None:
    megatron_init_(model, CFG, seed, locate=ShardLocator([model]))


def test_shard_names_and_partial_grads():
    assert shard_dim("layers.3.attention.qkv.weight") == 0
    assert shard_dim("layers.3._checkpoint_wrapped_module.mlp.fc2_weight") == 1
    assert shard_dim("layers.3.mlp.layer_norm_weight") is None
    assert shard_dim("embedding.weight") is None and shard_dim("output.weight") == 0  # vocab-parallel head
    assert has_partial_grad("layers.0.attention.k_norm.weight", sequence_parallel=False)
    assert not has_partial_grad("layers.0.mlp.layer_norm_weight", sequence_parallel=False)
    assert has_partial_grad("layers.0.mlp.layer_norm_weight", sequence_parallel=True)
    assert has_partial_grad("final_norm.weight", sequence_parallel=True)
    assert not has_partial_grad("layers.0.attention.qkv.weight", sequence_parallel=True)


def test_tp_init_gives_the_shards_of_the_single_process_init():
    full = FakeTE()
    megatron_init_(full, CFG, seed=7)
    for rank in range(TP):
        part = RankShards(rank, TP)
        init_(part, seed=7)
        proj = full.layers[0].attention.proj.weight.chunk(TP, dim=1)[rank]
        fc1 = interleave_gate_up(full.layers[0].mlp.fc1_weight, TP).chunk(TP, dim=0)[rank]
        torch.testing.assert_close(part.layers[0].attention.proj.weight, proj, rtol=0, atol=0)
        torch.testing.assert_close(part.layers[0].mlp.fc1_weight, fc1, rtol=0, atol=0)
        # rank r's fc1 rows are [gate_r; up_r] of the single-process [gate; up]
        gate, up = full.layers[0].mlp.fc1_weight.split(F)
        k = F // TP
        torch.testing.assert_close(part.layers[0].mlp.fc1_weight, torch.cat([gate[rank * k:(rank + 1) * k],
                                                                             up[rank * k:(rank + 1) * k]]))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        group = dist.group.WORLD
        # sequence parallel boundaries around a split computation (the vocab-parallel head): rank r's loss is
        # sum(y[:, r]^2), its "vocabulary slice"; the sum over ranks is one process's sum((2 x[:, :2])^2), and the
        # gather's backward (reduce-scatter) sums the ranks' partial gradients
        x = torch.arange(24, dtype=torch.float64).reshape(8, 3).requires_grad_()
        chunk = scatter_sequence(x, group)
        results["chunk"] = chunk.detach().clone()
        y = gather_sequence(2 * chunk, group)
        (y[:, rank] ** 2).sum().backward()
        results["x_grad"] = x.grad.clone()
        results["y"] = y.detach().clone()
        # shards -> full is the inverse of full -> shards
        full = torch.randn(2 * F, D, generator=torch.Generator().manual_seed(0))
        shards = TensorParallelShards(rank, world, group)
        results["fc1_roundtrip"] = shards.full("layers.0.mlp.fc1_weight", shards.local("layers.0.mlp.fc1_weight", full))
        results["fc1_full"] = full
        # partial gradients summed, sharded ones left alone; the norm counts shards once and replicas once
        model = FakeTE(world, group)
        init_(model, seed=3)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        reduced = all_reduce_partial_grads([model], group, sequence_parallel=True)
        results["reduced"] = reduced
        results["q_norm_grad"] = model.layers[0].attention.q_norm.weight.grad.clone()
        results["proj_grad"] = model.layers[0].attention.proj.weight.grad.clone()
        sharded = sharded_param_ids([model])
        for p in model.parameters():  # replicated gradients are the same on every rank (after the sums above)
            p.grad = torch.full_like(p, float(rank + 1) if id(p) in sharded else 1.0)
        norm = grad_norm_and_clip(list(model.parameters()), float("inf"), tp_group=group,
                                  tp_sharded=frozenset(sharded))
        results["norm"] = float(norm)
        # checkpoint written under tp2 (plain local shards) in the single-process layout
        from difflm.checkpoint.store import load_checkpoint, save_checkpoint

        save_checkpoint(Path(out), 1, model, None, {"step": 1})
        again = FakeTE(world, group)
        load_checkpoint(Path(out) / "checkpoints" / "step_1", again)
        results["reloaded_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("te_tp")
    return out, spawn_ranks(_worker, TP, out)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_sequence_scatter_gather_values_and_gradients(tp2_results):
    _, results = tp2_results
    x = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["chunk"], x[rank * 4:(rank + 1) * 4])
        torch.testing.assert_close(res["y"], 2 * x)
        # d/dx sum((2 x[:, :2])^2) = 8x on columns 0 and 1, 0 on column 2, on every rank
        torch.testing.assert_close(res["x_grad"], 8 * x * torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
def test_shard_roundtrip_partial_grads_and_norm(tp2_results):
    _, results = tp2_results
    ranks_sum = 1.0 + 2.0
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["fc1_roundtrip"], res["fc1_full"], rtol=0, atol=0)
        assert res["reduced"] == 3  # q_norm, mlp.layer_norm_weight, final_norm (sequence parallel)
        torch.testing.assert_close(res["q_norm_grad"], torch.full((4,), ranks_sum))
        torch.testing.assert_close(res["proj_grad"], torch.full((D, D // TP), float(rank + 1)))
    # single-process equivalent: sharded tensors contribute every rank's shard, replicated ones one copy
    sharded = sum(((r + 1.0) ** 2) * (D * D // TP + 2 * F // TP * D) for r in range(TP))
    replicated = 1.0 * (4 + D + D)
    for res in results:
        assert res["norm"] == pytest.approx((sharded + replicated) ** 0.5, rel=1e-6)


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
def test_tp2_checkpoint_holds_single_process_tensors(tp2_results):
    from difflm.checkpoint.store import load_checkpoint

    out, results = tp2_results
    assert all(res["reloaded_equal"] for res in results)
    single = FakeTE()
    load_checkpoint(out / "checkpoints" / "step_1", single)
    reference = FakeTE()
    megatron_init_(reference, CFG, seed=3)
    for (name, a), b in zip(single.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_full_shapes_count_the_whole_model():
    """MFU under TE TP needs the full model's parameter count from local shards."""
    full, part = FakeTE(), FakeTE(TP)
    shards = TensorParallelShards(1, TP)
    assert sum(shards.full_shape(n, p.shape).numel() for n, p in part.named_parameters()) == \
        sum(p.numel() for p in full.parameters())
