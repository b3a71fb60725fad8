"""difflm-plan: the memory model against the bytes a built model really holds under each layout (gloo, 2 ranks),
the step-time model's parts, the search and its one-line refusals."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import compose_run, run_cli, spawn_ranks

TINY = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=96", "model.vocab_size=1000", "data.seq_len=32", "train.global_batch_size=4",
        "train.micro_batch_size=1"]
# name -> overrides; each runs on 2 gloo ranks
LAYOUTS = {
    "ddp": ["parallel=ddp"],
    "fsdp": ["parallel=fsdp"],
    "tp2": ["parallel=tp2"],
    "pp2": ["parallel=pp2"],
    "fsdp_moe_ep2": ["parallel=fsdp", "parallel.ep=2", "model=moe-tiny", "model.vocab_size=1000"],
}


def _local(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from difflm.parallel.mesh import ParallelDims, build_mesh
        from difflm.parallel.parallelize import build_parallel_model
        from difflm.training.optimizer import build_optimizer

        results = {}
        for name, overrides in LAYOUTS.items():
            cfg = compose_run([*TINY, *overrides])
            cfg.model.head_dim = cfg.model.hidden_size // cfg.model.num_heads
            dims = ParallelDims.from_config(cfg.parallel, world)
            mesh = build_mesh(dims, "cpu")
            parts, _, _, _ = build_parallel_model(cfg, mesh, dims, torch.device("cpu"), causal=False, n_microbatches=2)
            params = [p for part in parts for p in part.parameters()]
            for p in params:
                p.grad = torch.zeros_like(p)
            opt = build_optimizer(torch.nn.ModuleList(parts), cfg.optim, torch.device("cpu"))
            opt.step()
            nbytes = lambda ts: sum(_local(t).numel() * _local(t).element_size() for t in ts)  # noqa: E731
            state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            results[name] = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params),
                             "optimizer": nbytes(state),
                             "stage": mesh["pp"].get_local_rank() if dims.pp_enabled else 0}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("plan"))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_persistent_bytes_equal_the_built_model(measured, name):
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import persistent_bytes
    from difflm.plan.shapes import model_params

    cfg = compose_run([*TINY, *LAYOUTS[name]])
    params = model_params(cfg.model, int(cfg.model.vocab_size))
    planned = persistent_bytes(params, layout_of(cfg, 2), int(cfg.model.num_layers))
    for part in ("parameters", "gradients", "optimizer"):
        per_stage = {}
        for rank in measured:  # the most loaded rank of each stage
            r = rank[name]
            per_stage[r["stage"]] = max(per_stage.get(r["stage"], 0), r[part])
        for stage, real in per_stage.items():
            assert planned[stage][part] == real, (name, part, stage)


@pytest.mark.parametrize("schedule, virtual, layers", [("1F1B", 1, 5), ("Interleaved1F1B", 2, 5),
                                                       ("ZBVZeroBubble", 1, 4), ("LoopedBFS", 3, 7)])
def test_pipeline_ranks_hold_the_stages_the_trainer_cuts(schedule, virtual, layers):
    """Each pipeline rank is planned with the parameters of the stages the trainer gives it
    (difflm.parallel.pipeline.build_stage_models): several stages per rank under interleaved schedules, the first and
    the last (embedding and head) on rank 0 under ZBVZeroBubble; its loss rows are planned on that rank."""
    from difflm.model import build_model
    from difflm.parallel.pipeline import build_stage_models
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import plan_memory, stage_params
    from difflm.plan.shapes import model_params

    cfg = compose_run([*TINY, "parallel=pp2", f"parallel.pp_schedule={schedule}",
                       f"parallel.pp_virtual_stages={virtual}", f"model.num_layers={layers}",
                       "train.global_batch_size=8"])
    cfg.model.head_dim = cfg.model.hidden_size // cfg.model.num_heads
    layout = layout_of(cfg, 2)
    planned = stage_params(model_params(cfg.model, 1000), layout, layers)
    real, head_rank = [], None
    for rank in range(2):
        model = build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=None, meta=True)
        parts, _, _ = build_stage_models(model, rank, 2, virtual, schedule)
        real.append(sum(p.numel() for part in parts for p in part.parameters()))
        if any(part.output is not None for part in parts):
            head_rank = rank
    assert planned == real
    assert head_rank == (0 if schedule == "ZBVZeroBubble" else 1)
    if schedule == "ZBVZeroBubble":  # rank 0, the most loaded, holds the loss rows' logits too
        assert plan_memory(cfg, model_params(cfg.model, 1000), layout, 4).parts["logits"] > 0


def test_parameter_count_of_the_plan_is_the_model_count():
    from difflm.plan.cli import active_params
    from difflm.plan.shapes import model_params

    cfg = compose_run(["model=1.7b", "model.vocab_size=50304"])
    params = model_params(cfg.model, 50304)
    total = sum(p.numel for p in params)
    # MegaDLMs' 1.7B: 28 x (QKV 3 d^2 + proj d^2 + MLP 3 d f + norms) + untied embedding and head
    d, f, layers, hd = 2048, 6144, 28, 128
    per_layer = 3 * d * d + d * d + 3 * d * f + 2 * d + 2 * hd
    assert total == layers * per_layer + 2 * 50304 * d + d
    assert active_params(cfg) == total - 50304 * d


def test_step_plan_parts_follow_the_flop_count():
    """GEMM seconds = 6 N_body tokens / rate (+ the head at the loss rows); attention = 12 L d S tokens / rate."""
    from difflm.plan.cli import active_params, layout_of
    from difflm.plan.memory import stage_params
    from difflm.plan.rates import default_rates
    from difflm.plan.shapes import model_params
    from difflm.plan.step_time import plan_step

    cfg = compose_run(["model=1.7b", "model.vocab_size=50304", "precision=bf16", "data.seq_len=4096",
                       "train.global_batch_size=16", "train.micro_batch_size=8"])
    cfg.model.head_dim = 128
    params = model_params(cfg.model, 50304)
    n = active_params(cfg)
    layout = layout_of(cfg, 1)
    rates = default_rates("H200")
    step = plan_step(cfg, n, layout, 2, rates, stage_params(params, layout, 28))
    tokens = 16 * 4096
    head = 50304 * 2048
    rows = (1 + float(cfg.objective.eps)) / 2
    gemm = tokens * (6 * (n - head) + 6 * head * rows) / (rates.gemm_tflops * 1e12)
    attention = tokens * 12 * 28 * 2048 * 4096 / (rates.attention_tflops * 1e12)
    assert step.compute["gemm"] == pytest.approx(gemm, rel=1e-12)
    assert step.compute["attention"] == pytest.approx(attention, rel=1e-12)
    assert not step.comm and step.bubble == 0
    # two pipeline stages with 4 micro-batches: the bubble is 1/4 of the busy time (Narayanan et al. 2021)
    cfg2 = compose_run(["model=1.7b", "model.vocab_size=50304", "precision=bf16", "data.seq_len=4096",
                        "train.global_batch_size=16", "train.micro_batch_size=4", "parallel=pp2"])
    cfg2.model.head_dim = 128
    lay2 = layout_of(cfg2, 2)
    step2 = plan_step(cfg2, n, lay2, 4, rates, stage_params(params, lay2, 28))
    busy = sum(step2.compute.values()) + sum(step2.comm.values())
    assert step2.bubble == pytest.approx(busy * 1 / 4, rel=1e-12)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_plan_prints_parts_and_search_ranks(tmp_path):
    r = run_cli("difflm.plan.cli", "model=1.7b", "precision=bf16", "data.seq_len=4096", "train.global_batch_size=64",
                "model.vocab_size=50304", "--gpus", "8", "--search", "--top", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "candidates fit 8 x H200" in r.stdout
    for part in ("parameters", "gradients", "optimizer", "activations", "logits", "compute gemm", "MFU"):
        assert part in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(" ") and line[:4].strip().isdigit()]
    speeds = [float(row[-2].replace(",", "")) for row in rows]
    assert len(rows) == 3 and speeds == sorted(speeds, reverse=True)


MOE_1B = ["model=moe-1b-7b", "model.vocab_size=1000", "precision=bf16", "data.seq_len=4096", "--gpu", "H100",
          "train.global_batch_size=8", "train.micro_batch_size=1"]


@pytest.mark.parametrize("args, says", [
    (["model=8b", "data.seq_len=4096", "precision=bf16", "train.global_batch_size=8", "--gpus", "1", "--gpu", "H100",
      "--search"], "nothing fits 1 x H100"),
    (["model=tiny", "model.vocab_size=1000", "train.global_batch_size=8", "--gpus", "3", "--search"],
     "no layout splits"),
    (["model=tiny", "model.vocab_size=1000", "--gpu", "MI300X"], "--gpu MI300X: no shipped rates"),
    (["model=tiny", "model.vocab_size=1000", "--gpus", "0"], "--gpus 0"),
    # a layout for another GPU count: the fix is --gpus, a layout or --search (nothing is launched with torchrun)
    (["model=tiny", "model.vocab_size=1000", "parallel=tp2", "--gpus", "3"],
     "parallel=tp2 runs on a multiple of 2 GPU(s), not --gpus 3: pass --gpus a multiple of 2, a layout for 3 GPUs "
     "(parallel=fsdp fills them: dp_shard=-1), or --search"),
    (["model=tiny", "model.vocab_size=1000", "--gpus", "8"],
     "parallel=single runs on 1 GPU(s), not --gpus 8: pass --gpus 1, a layout for 8 GPUs"),
    (["model=tiny", "model.vocab_size=1000", "--gpus", "8", "train.micro_batch_size=auto"],
     "parallel=single runs on 1 GPU(s), not --gpus 8"),
    # the planner's own flags: a misspelt flag, a bad value, a count of rows below 1
    (["model=tiny", "model.vocab_size=1000", "--serch"], "--serch is not a difflm-plan flag; did you mean --search?"),
    (["model=tiny", "model.vocab_size=1000", "--gpus=two"], "argument --gpus: invalid int value: 'two'"),
    (["model=tiny", "model.vocab_size=1000", "--search", "--top", "0"], "--top 0: pass how many"),
    # difflm-train's checks of the batch, the model and the layout, on the GPUs planned for
    (["model=tiny", "model.vocab_size=1000", "train.micro_batch_size=0"], "train.micro_batch_size=0 must be positive"),
    (["model=tiny", "model.vocab_size=1000", "train.global_batch_size=0", "--search"],
     "train.global_batch_size=0 must be positive"),
    (["model=tiny", "model.vocab_size=1000", "train.global_batch_size=8", "train.micro_batch_size=16"],
     "train.micro_batch_size to a divisor of 8"),
    (["model=8b", "model.vocab_size=1000", "train.global_batch_size=256", "parallel=fsdp", "--gpus", "64"],
     "set train.global_batch_size to a multiple of 512, or train.micro_batch_size to a divisor of 4"),
    (["model=tiny", "model.vocab_size=1000", "model.num_heads=5"], "model.num_kv_heads=4 does not divide"),
    (["model=tiny", "model.vocab_size=1000", "parallel.tp=3", "--gpus", "3"], "parallel.tp=3 does not divide"),
    (["model=moe-tiny", "model.vocab_size=1000", "model.moe.top_k=9"], "model.moe.top_k=9 must be <="),
    (["model=moe-tiny", "model.vocab_size=1000", "parallel.ep=3", "parallel.dp_shard=3", "--gpus", "3",
      "train.global_batch_size=24"], "parallel.ep=3 does not divide model.moe.num_experts=8"),
    (["model=moe-tiny", "model.vocab_size=1000", "parallel.tp=2", "--gpus", "2", "model.backend=te"],
     "the TE kernels run MoE layers without tensor parallelism"),
    (["model=tiny", "model.vocab_size=1000", "lora=attn_mlp", "lora.rank=1000"], "lora.rank=1000 is above"),
    (["model=tiny", "model.vocab_size=1000", "train.micro_batch_size=auto", "--calibrate", "rates.json"],
     "train.micro_batch_size=auto with --calibrate"),
    # every check difflm-train makes of the config alone: the data window, the objective, the optimizer
    (["model=tiny", "model.vocab_size=1000", "data.seq_len=-5"], "data.seq_len=-5 must be at least 2"),
    (["model=tiny", "model.vocab_size=1000", "objective=bd3lm", "data.seq_len=100"],
     "objective.block_size=16 does not divide data.seq_len=100"),
    (["model=tiny", "model.vocab_size=1000", "objective=ar", "model.shift_logits=true"],
     "model.shift_logits=true is for masked diffusion from an AR model"),
    (["model=tiny", "model.vocab_size=1000", "optim.lr=-1", "--search"], "optim.lr=-1.0 must be positive"),
    # the MoE expert kernels against the precision and the layout, planned or searched
    (MOE_1B + ["model.moe.fp8_experts=true", "model.moe.fused_experts=true"], "two kernels for the same GEMMs"),
    (MOE_1B + ["model.moe.fp8_experts=true"], "inside an FP8 run and this run is precision=bf16"),
    (MOE_1B + ["model.moe.fused_experts=true", "parallel=fsdp", "--gpus", "8"], "FSDP2, pipelines, LoRA"),
    (MOE_1B + ["model.moe.fused_experts=true", "--gpus", "8", "--search"],
     "--gpus 8: difflm-train refuses every layout that splits this run over 8 GPUs, e.g. fsdp8: "
     "model.moe.fused_experts=true needs the experts' gradients accumulated in FP32 main_grad"),
    # a plan whose weights, gradients and optimizer state alone exceed the GPU: no shorter sequence helps
    (["model=8b", "model.vocab_size=1000", "--gpu", "H100", "--search"],
     "its weights, gradients and optimizer state alone take"),
])
def test_impossible_requests_are_one_line(capfd, args, says):
    from difflm.plan.cli import main

    assert main(args) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("difflm: error: ") and says in lines[0], err


def test_the_exit_status_says_whether_the_plan_fits(capfd):
    """0: the plan fits; 1: it does not (the plan is printed); a recipe that leaves data.path to the user plans."""
    from difflm.plan.cli import main

    assert main(["model=8b", "model.vocab_size=1000", "--gpu", "H100", "data.seq_len=4096"]) == 1
    assert "DOES NOT FIT" in capfd.readouterr().out
    assert main(["model=tiny", "model.vocab_size=1000"]) == 0
    assert "fits" in capfd.readouterr().out
    assert main(["experiment=llada_8b", "model.vocab_size=126464", "--gpus", "8"]) == 0
    assert main(["model=tiny", "model.vocab_size=1000", "--search", "--gpus", "2", "parallel.cp=2"]) == 0
    assert ("--search ranks every layout: parallel.cp given on the command line is not kept"
            in capfd.readouterr().out)


def test_search_offers_only_layouts_difflm_train_runs():
    """Every candidate of the search passes difflm-train's layout checks: no ep that does not divide the experts, no
    pipeline with context parallelism, no pipeline with fewer micro-batches than stages."""
    from difflm.config.validate import check_layout
    from difflm.plan.rates import default_rates
    from difflm.plan.search import candidates

    cfg = compose_run(["model=moe-tiny", "model.vocab_size=1000", "model.moe.num_experts=6", "data.seq_len=64",
                       "train.global_batch_size=32"])
    eps = {lay.ep for lay in candidates(cfg, 4, default_rates("H200"))}
    assert eps == {1, 2}  # 4 does not divide 6 experts

    cfg = compose_run(["model=tiny", "model.vocab_size=1000", "model.num_layers=8", "data.seq_len=4096",
                       "train.global_batch_size=16"])
    found = candidates(cfg, 8, default_rates("H200"))
    assert found and not any(lay.pp > 1 and lay.cp > 1 for lay in found)
    assert {lay.cp for lay in found} == {1, 2, 4} and {lay.pp for lay in found} >= {1, 2}
    for lay in found:
        n_micro = 16 // (lay.dp * lay.micro_batch)
        assert lay.pp == 1 or (n_micro >= lay.pp and n_micro % lay.pp == 0)
        run = cfg.copy()
        for key in ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard"):
            run.parallel[key] = getattr(lay, key)
        run.train.micro_batch_size = lay.micro_batch
        run.model.backend, run.model.fused_mlp = "torch", False
        check_layout(run, 8)


def test_moe_slot_is_planned_replicated_over_tp():
    """Under tensor parallelism the MoE slot runs replicated on the whole sequence (ReplicatedMoE, docs/moe.md): each
    TP rank computes every routed and shared expert GEMM of its data-parallel rank's tokens and saves the slot's
    activations whole; only the attention and the dense parts are split by tp."""
    from difflm.model.moe import shared_ffn_size
    from difflm.plan.activations import torch_bytes_per_token
    from difflm.plan.cli import active_params
    from difflm.plan.memory import Layout, mlp_width, stage_params
    from difflm.plan.rates import default_rates
    from difflm.plan.shapes import model_params
    from difflm.plan.step_time import plan_step

    cfg = compose_run(["model=moe-tiny", "model.vocab_size=1000", "precision=bf16", "data.seq_len=64",
                       "train.global_batch_size=4", "train.micro_batch_size=4"])
    m = cfg.model
    m.head_dim = m.hidden_size // m.num_heads
    params, n, rates = model_params(m, 1000), active_params(cfg), default_rates("H200")
    one, two = Layout(micro_batch=4), Layout(tp=2, micro_batch=4, sequence_parallel=True)
    s1, s2 = (plan_step(cfg, n, lay, 1, rates, stage_params(params, lay, int(m.num_layers)), params=params)
              for lay in (one, two))
    assert s2.compute["grouped gemm"] == pytest.approx(s1.compute["grouped gemm"], rel=1e-12)
    moe_blocks = int(m.num_layers) - int(m.moe.first_k_dense)
    shared = 4 * 64 * 6 * moe_blocks * 3 * m.hidden_size * shared_ffn_size(m) / (rates.gemm_tflops * 1e12)
    assert shared > 0
    assert s2.compute["gemm"] == pytest.approx((s1.compute["gemm"] - shared) / 2 + shared, rel=1e-9)
    h, a, r = m.hidden_size, 2, 4
    q, kv, f = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, mlp_width(m)
    assert torch_bytes_per_token(m, two, a) == pytest.approx(a * (2 * (q + 2 * kv) + q) / 2 + (r * h + a * h) / 2
                                                             + r * h + a * h + 4 * a * f)


def test_search_ranks_sharded_layouts_of_a_bf16_moe_model():
    """``model.moe.fused_experts=auto`` is chosen per candidate as difflm-train chooses it under that layout: off
    where FSDP2 shards the gradients, so the data- and expert-parallel layouts of a BF16 MoE model are ranked, not
    refused for the fused experts that one GPU would take."""
    from difflm.plan.rates import default_rates
    from difflm.plan.search import candidates

    cfg = compose_run(["model=moe-tiny", "model.vocab_size=1000", "precision=bf16", "data.seq_len=64",
                       "train.global_batch_size=16"], auto=True)
    refused: list = []
    found = candidates(cfg, 4, default_rates("H200"), refused)
    layouts = {(lay.tp, lay.ep, lay.dp_shard, lay.dp_replicate) for lay in found}
    assert {(1, 1, 4, 1), (1, 2, 4, 1), (1, 4, 4, 1), (1, 1, 1, 4)} <= layouts
    assert not any("fused_experts" in why for _, why in refused)


@pytest.mark.parametrize("mode, wrapped", [("full", [0, 1])])
def test_activation_checkpointing_applies_on_one_process(fast_cfg, mode, wrapped):
    """``parallel.activation_checkpointing`` on one process wraps the blocks as under a layout (the planner's
    activations assume it) and leaves the losses and gradients unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from difflm.training.trainer import Trainer

    losses = {}
    for m in ("none", mode):
        cfg = fast_cfg(f"parallel.activation_checkpointing={m}", "train.max_steps=2")
        trainer = Trainer(cfg, cfg.run.dir + m, torch.device("cpu"))
        blocks = list(trainer.model.layers.values()) if hasattr(trainer.model.layers, "values") else list(trainer.model.layers)
        assert [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)] == ([] if m == "none" else wrapped)
        losses[m] = [float(trainer.train_step()["loss"]) for _ in range(2)]
        assert "layers.0.attention.qkv.weight" in trainer.model.state_dict()
    assert losses[mode] == pytest.approx(losses["none"], rel=1e-6)
