"""Construction without the full model (difflm.parallel.materialize, difflm.model.init) on CPU with gloo.

* The counter-based keyed init: any block of rows and columns of a parameter equals the same entries of its full
  draw, and drawing a shard touches only the tiles the shard intersects.
* Every layout's initial weights equal one process's exactly: the model is built on the meta device, laid out
  (FSDP2, DDP, DTensor TP with and without SP, pipeline stages, tp x pp, the TE kernel set's TP shards on the CPU
  stand-in) and each rank materialises only its shards; their single-process form (``canonical_state_dict``, as
  checkpoints write it) is compared with ``build_model`` in one process, bit for bit.
* A 70B-shaped model (Llama-3-70B layer shapes: hidden 8192, 64 heads, 8 KV heads, FFN 28672) under fsdp on 4 gloo
  ranks: each rank's peak RSS stays well below the full model's size. The CI machine (2 cores, 24 GiB, shared) fits
  1 layer and a 32 Ki vocabulary (5.6 GB in FP32); Llama 3's 128 Ki vocabulary would add 6.3 GB.
"""
from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import compose_run, spawn_ranks
from difflm.model import init as model_init
from difflm.model.init import keyed_normal

SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=96", "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
         "device=cpu", "train.seed=5"]
VOCAB = 320  # > one init tile (256 rows), divisible by tp=2
LAYOUTS = {  # name -> (overrides, backend); 4 ranks each
    "fsdp": (["parallel=fsdp"], "torch"),
    "fsdp_levers": (["parallel=fsdp", "parallel.reshard_after_forward=false", "parallel.fsdp_prefetch=2",
                     "parallel.reduce_dtype=bf16", "precision=bf16"], "torch"),
    "ddp": (["parallel=ddp"], "torch"),
    "tp2_sp": (["parallel=tp2"], "torch"),
    "tp2_no_sp": (["parallel=tp2", "parallel.sequence_parallel=false", "model.qk_norm=true"], "torch"),
    "pp2": (["parallel=pp2"], "torch"),
    "tp2pp2": (["parallel=tp2pp2"], "torch"),
    "te_tp2_sp": (["parallel=tp2", "model.qkv_bias=true"], "te"),
    "te_tp2pp2": (["parallel=tp2pp2"], "te"),
}


def test_keyed_normal_blocks_are_entries_of_the_full_draw():
    full = keyed_normal(3, "layers.0.mlp.fc1_weight", (700, 600), std=0.02)
    rows, cols = torch.tensor([5, 699, 256, 3, 300]), torch.tensor([599, 0, 255, 256])
    for index in [(rows, cols), (torch.arange(100, 400), torch.arange(200, 600)), (rows, torch.arange(10, 20)),
                  (torch.arange(0, 700), cols)]:
        got = keyed_normal(3, "layers.0.mlp.fc1_weight", (700, 600), index, std=0.02)
        torch.testing.assert_close(got, full[index[0]][:, index[1]], rtol=0, atol=0)
    assert full.std().item() == pytest.approx(0.02, rel=0.01) and abs(full.mean().item()) < 5e-4
    assert not torch.equal(full, keyed_normal(4, "layers.0.mlp.fc1_weight", (700, 600), std=0.02))  # seed
    assert not torch.equal(full, keyed_normal(3, "layers.1.mlp.fc1_weight", (700, 600), std=0.02))  # name
    vec = keyed_normal(3, "v", (700,))
    assert vec.shape == (700,) and torch.equal(keyed_normal(3, "v", (700,), (torch.arange(300, 700), None)), vec[300:])


def test_a_3d_shard_gets_the_values_of_its_full_tensor():
    """Expert stacks [E, out, in] are drawn as [E, out x in]: a shard split along any dims (experts over EP, a
    trailing dim over TP) gets exactly the entries of the full tensor at its positions (materialize._flat_columns)."""
    from difflm.parallel.materialize import _flat_columns

    full_shape = torch.Size([6, 40, 300])
    full = keyed_normal(2, "layers.0.mlp.experts.fc1_weight", full_shape, std=0.02).view(full_shape)
    experts, rows, cols = torch.arange(2, 4), torch.tensor([39, 0, 7]), torch.arange(250, 300)
    for index in ([experts, None, cols], [experts, rows, cols], [None, rows, None], [experts, None, None]):
        flat = _flat_columns(index[1:], full_shape[1:])
        got = keyed_normal(2, "layers.0.mlp.experts.fc1_weight", full_shape, [index[0], flat], std=0.02)
        want = full
        for dim, i in enumerate(index):
            want = want if i is None else want.index_select(dim, i)
        torch.testing.assert_close(got.view(want.shape), want, rtol=0, atol=0)
    assert _flat_columns([None, None], full_shape[1:]) is None


def test_threads_do_not_change_the_values():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = keyed_normal(1, "w", (2048, 2048 + 7))
        torch.set_num_threads(2)
        two = keyed_normal(1, "w", (2048, 2048 + 7))  # >= 4 Mi values: drawn by 2 threads
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_shard_draws_only_the_tiles_it_intersects(monkeypatch):
    drawn = []
    real = model_init.np.random.Philox

    def counting(key, counter):
        drawn.append(counter >> 64)
        return real(key=key, counter=counter)

    monkeypatch.setattr(model_init.np.random, "Philox", counting)
    tile = model_init.TILE
    # rows [tile, 2 tile + 10) x columns [0, 20) of a 4 x 3 tile grid: tiles (1, 0) and (2, 0) only
    keyed_normal(0, "w", (4 * tile, 3 * tile), (torch.arange(tile, 2 * tile + 10), torch.arange(20)))
    assert sorted(drawn) == [1 * 3 + 0, 2 * 3 + 0]


# ------------------------------------------------------------------ layouts vs one process
def _config(overrides, backend):
    cfg = compose_run([*SMALL, f"model.backend={backend}", *overrides])
    cfg.model.vocab_size, cfg.model.head_dim = VOCAB, cfg.model.hidden_size // cfg.model.num_heads
    return cfg


def _canonical(parts) -> dict[str, torch.Tensor]:
    """This rank's parameters in their single-process form (full tensors, [gate; up], clean names)."""
    from torch.distributed.tensor import DTensor

    from difflm.parallel.tensor_parallel import canonical_layouts, canonical_state_dict, clean_fqn

    out = {}
    for part in parts:
        sd = {clean_fqn(k): v for k, v in part.state_dict().items() if not k.endswith("_extra_state")}
        canonical_state_dict(sd, None, canonical_layouts([part]))
        out.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()})
    return out


def _fsdp_settings(model) -> dict:
    """The FSDP2 settings of block 0 (the data-parallel levers' wiring)."""
    block = model.layers[next(iter(model.layers.keys()))] if hasattr(model.layers, "keys") else model.layers[0]
    if not hasattr(block, "_get_fsdp_state"):
        return {}
    state = block._get_fsdp_state()
    group = state._fsdp_param_group
    return {"param_dtype": group.mp_policy.param_dtype, "reduce_dtype": group.mp_policy.reduce_dtype,
            "reshard_after_forward": group.post_forward_mesh_info is not None,
            "forward_prefetch": len(state._states_to_forward_prefetch or []),
            "backward_prefetch": len(state._states_to_backward_prefetch or [])}


def _layouts_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "fake_te"))  # the TE stand-in
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from difflm.model import Transformer
        from difflm.model.te_kernels import TEKernels
        from difflm.parallel.materialize import materialize
        from difflm.parallel.mesh import ParallelDims, build_mesh, te_process_groups
        from difflm.parallel.parallelize import build_parallel_model, parallelize, sequence_parallel_enabled

        results = {}
        for name, (overrides, backend) in LAYOUTS.items():
            cfg = _config(overrides, backend)
            dims = ParallelDims.from_config(cfg.parallel, world)
            mesh = build_mesh(dims, "cpu")
            if backend == "torch":
                parts, _, num_params, _ = build_parallel_model(cfg, mesh, dims, torch.device("cpu"), causal=False,
                                                               n_microbatches=2)
            else:  # build_parallel_model's steps, without build_model's CUDA check (the stand-in runs on CPU)
                groups = te_process_groups(mesh, dims, sequence_parallel_enabled(cfg.parallel, dims))
                model = Transformer(cfg.model, kernels=TEKernels(cfg.model, "meta", cfg.precision, **groups))
                num_params = model.num_params()
                parts, _ = parallelize(model, mesh, dims, cfg, torch.device("cpu"), 2)
                materialize(parts, torch.device("cpu"), cfg.model, cfg.train.seed)
            results[name] = {"params": _canonical(parts), "num_params": num_params, "fsdp": _fsdp_settings(parts[0])}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def layout_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("materialize")
    return spawn_ranks(_layouts_worker, 4, out)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_starts_from_the_single_process_weights(name, layout_weights):
    from difflm.model import build_model

    overrides, backend = LAYOUTS[name]
    cfg = _config(overrides, "torch")  # the torch kernels in one process: the same names and values as TE's
    reference = build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=cfg.train.seed)
    expected = {k: v for k, v in reference.state_dict().items()}
    seen = set()
    for rank_results in layout_weights:
        got = rank_results[name]["params"]
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=f"{name}: {key}")
        seen |= set(got)
        assert rank_results[name]["num_params"] == reference.num_params()
    assert seen == set(expected), sorted(set(expected) ^ seen)


@pytest.mark.slow  # its fixture starts processes: make test-fast leaves it out
def test_data_parallel_levers_reach_fsdp2(layout_weights):
    """parallel.reduce_dtype / reshard_after_forward / fsdp_prefetch set FSDP2's policy; the defaults keep FP32
    reduction, resharding after forward and FSDP2's implicit prefetching."""
    default, levers = layout_weights[0]["fsdp"]["fsdp"], layout_weights[0]["fsdp_levers"]["fsdp"]
    assert default == {"param_dtype": None, "reduce_dtype": torch.float32, "reshard_after_forward": True,
                       "forward_prefetch": 0, "backward_prefetch": 0}
    # block 0 of 4: prefetches blocks 1 and 2 in forward, none in backward (it runs last there)
    assert levers == {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "reshard_after_forward": False,
                      "forward_prefetch": 2, "backward_prefetch": 0}


# ------------------------------------------------------------------ 70B-shaped construction on 4 ranks
LLAMA70B_LAYER = ["model.hidden_size=8192", "model.num_heads=64", "model.num_kv_heads=8", "model.ffn_hidden_size=28672",
                  "model.num_layers=1", "parallel=fsdp", "device=cpu", "precision=fp32", "train.global_batch_size=4",
                  "train.micro_batch_size=1"]
BIG_VOCAB = 32768


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _big_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor

        from difflm.parallel.mesh import ParallelDims, build_mesh
        from difflm.parallel.parallelize import build_parallel_model

        cfg = compose_run(LLAMA70B_LAYER)
        cfg.model.vocab_size, cfg.model.head_dim = BIG_VOCAB, 128
        dims = ParallelDims.from_config(cfg.parallel, world)
        mesh = build_mesh(dims, "cpu")
        before = _rss_gib()
        parts, _, _, _ = build_parallel_model(cfg, mesh, dims, torch.device("cpu"), causal=False, n_microbatches=1)
        params = list(parts[0].named_parameters())
        full = sum(p.numel() for _, p in params)
        local = sum(p.to_local().numel() for _, p in params)
        # a spot check of the values: rank r's rows of fc1 are rows [r f/2, (r + 1) f/2) of the full draw
        fc1 = dict(params)["layers.0.mlp.fc1_weight"]
        rows = fc1.to_local().shape[0]
        expect = keyed_normal(cfg.train.seed, "layers.0.mlp.fc1_weight", fc1.shape,
                              (torch.arange(rank * rows, rank * rows + 3), torch.arange(5)), std=cfg.model.init_std)
        ok = torch.equal(fc1.to_local()[:3, :5], expect) and all(isinstance(p, DTensor) for _, p in params)
        torch.save({"before": before, "peak": _rss_gib(), "full_bytes": 4 * full, "local_bytes": 4 * local,
                    "values_ok": ok}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_70b_shaped_fsdp_construction_stays_below_the_full_model(tmp_path):
    stats = spawn_ranks(_big_worker, 4, tmp_path)
    gib = 2**30
    full = stats[0]["full_bytes"] / gib
    largest = 2 * 28672 * 8192 * 4 / gib  # fc1 [2 f, d] in FP32: what drawing one full tensor would add
    print(f"full model {full:.2f} GiB; per rank: " + ", ".join(
        f"local {s['local_bytes'] / gib:.2f} GiB, RSS {s['before']:.2f} -> {s['peak']:.2f} GiB" for s in stats))
    for s in stats:
        assert s["values_ok"]
        assert s["local_bytes"] / gib == pytest.approx(full / 4, rel=0.01)
        assert s["peak"] < 0.45 * full  # one rank never holds anything like the model
        assert s["peak"] - s["before"] < s["local_bytes"] / gib + 0.5 * largest  # nor a full tensor beyond its shards
