"""difflm-rl under parallel layouts (CPU, gloo, 2 and 4 ranks): GRPO under FSDP2, TP, DDP, HSDP and FSDP2 x TP and
DPO (VRPO) under FSDP2 give one process's metrics and weights; a resume under FSDP2 repeats the uninterrupted run;
per-row sampler generators make a row's rollout independent of the rows sampled with it; unsupported layouts are
refused in one line."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import spawn_ranks

HERE = Path(__file__).resolve().parent
CPU = torch.device("cpu")
# two prompt groups / pairs a step (one per rank under fsdp=2), three held-out records (an uneven split)
COMMON = ["algorithm.prompts_per_step=2", "train.max_steps=2", "train.save_every=1", "train.eval_every=2",
          "data.eval_records=3"]
GRPO = ["estimator=coupled", "algorithm.beta=0.1", "algorithm.num_inner=2"]
# optim.eps=1e-3: at the first DPO step (policy = reference) the gradient's small components are the rounding of the
# reduction order, which differs between layouts; with eps=1e-8 Adam scales them up to updates of order lr (measured:
# one fc1 weight of 4096 apart by 5.6e-5 under FSDP2), as in the GRPO layout test below
DPO = ["algorithm=dpo", "estimator=mc_elbo", "estimator.num_t=2", "data.prompt_field=prompt", "data.answer_field=null",
       "optim.eps=1e-3"]
COMPARED = {"grpo": ("loss", "reward_mean", "reward_std", "kl", "clip_fraction", "completion_len", "grad_norm",
                     "eval_reward"),
            "dpo": ("loss", "margin", "accuracy", "elbo_margin", "grad_norm", "eval_elbo_margin")}


@pytest.fixture(scope="module")
def init_run(tmp_path_factory):
    """A randomly initialised one-layer tiny model as a difflm run (TP-splittable: 2 heads, 2 KV heads), and a
    preference file for DPO."""
    from test_posttrain_runtime import make_init_run

    path = make_init_run(tmp_path_factory.mktemp("init"))
    with open(path / "prefs.jsonl", "w") as f:
        for i in range(7):
            f.write(json.dumps({"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}{i}"})
                    + "\n")
    return path


def run_rl(init, run_dir, algo, *overrides):
    """One difflm-rl run (this process's part of it); returns the trainer."""
    from test_posttrain_runtime import rl_config

    from difflm.posttrain.runner import PostTrainer

    extra = GRPO if algo == "grpo" else [*DPO, f"data.path={Path(init) / 'prefs.jsonl'}"]
    trainer = PostTrainer(rl_config(init, run_dir, *COMMON, *extra, *overrides), CPU)
    trainer.fit()
    return trainer


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir) -> dict:
    """The run's newest checkpoint read by one process (whole tensors, as difflm-generate reads it)."""
    from difflm.generate import load_run

    return {k: v.clone() for k, v in load_run(str(run_dir), None, CPU)[1].state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, str(HERE))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    spec = json.loads(Path(out, "spec.json").read_text())
    layouts = {}
    for name, algo, overrides, *init in spec["runs"]:
        trainer = run_rl(init[0] if init else spec["init"], Path(out) / name, algo, *overrides)
        # how the policy's and the reference's weights are laid out: (mesh dimensions, placements) of each DTensor
        layouts[name] = [sorted({(p.device_mesh.mesh_dim_names, str(p.placements)) for p in m.parameters()
                                 if isinstance(p, DTensor)}) for m in trainer._modules()]
        layouts[name + "_mesh"] = sorted({tuple(p.device_mesh.shape) for p in trainer.model.parameters()
                                          if isinstance(p, DTensor)})
        if name.startswith("lora"):  # its weights, whole (data parallel only: no TP row order to undo)
            layouts[name + "_weights"] = {k: v.full_tensor() if isinstance(v, DTensor) else v
                                          for k, v in trainer.model.state_dict().items()}
    torch.save(layouts, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def spawn(tmp_path, init, runs, world: int = 2) -> dict:
    """Run ``runs`` ([name, algorithm, overrides], or with a fourth item, the init run.dir of that run) on ``world``
    ranks, one after the other in the same processes; returns rank 0's {name: [policy, reference] parameter
    layouts}."""
    (tmp_path / "spec.json").write_text(json.dumps({"init": str(init), "runs": runs}))
    return spawn_ranks(_worker, world, tmp_path)[0]


def assert_same_run(one, two, algo, tol=1e-5):
    a, b = metrics(one), metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        for key in COMPARED[algo]:
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=tol, abs=tol), (ra["step"], key)
    wa, wb = final_weights(one), final_weights(two)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=tol, atol=tol, msg=name)
    return a


LORA = {  # test_grpo_lora_reference_is_the_base_with_adapters_off: (adapters from the init run, layout)
    "lora_run_fsdp": (False, "fsdp"), "fresh_on_full_run_fsdp": (True, "fsdp"),
    "fresh_on_full_run_tp2": (True, "tp2"),
}
LORA_RL = ["algorithm.reference=adapters_off", "train.eval_every=0", "algorithm.loss_norm=sequence"]
LAYOUT = {"fsdp": ["parallel=fsdp"], "tp2": ["parallel=tp2", "parallel.sequence_parallel=false"]}


@pytest.fixture(scope="module")
def lora_init_run(tmp_path_factory):
    """An init run trained with LoRA adapters (``lora=attn_mlp``)."""
    from test_posttrain_runtime import make_init_run

    return make_init_run(tmp_path_factory.mktemp("init_lora"), "lora=attn_mlp")


@pytest.fixture(scope="module")
def two_ranks(init_run, lora_init_run, tmp_path_factory):
    """The 2-rank runs of this module's tests, in one launch (each test compares its own with one process): a
    launch's processes import torch and difflm first, most of a run's time here. Returns (their folder, rank 0's
    layouts)."""
    out = tmp_path_factory.mktemp("two_ranks")
    runs = [["fsdp", "grpo", ["parallel=fsdp"]],
            ["cut", "grpo", ["parallel=fsdp", "train.max_steps=1"]],
            ["cut", "grpo", ["parallel=fsdp"]],
            ["tp", "grpo", LAYOUT["tp2"]],
            ["dpo_fsdp", "dpo", ["parallel=fsdp"]]]
    for case, (fresh, layout) in LORA.items():
        lora = [*LORA_RL, *(["lora=attn_mlp"] if fresh else [])]
        runs.append([f"lora_{case}", "grpo", [*LAYOUT[layout], *lora], str(init_run if fresh else lora_init_run)])
    return out, spawn(out, init_run, runs)


@pytest.fixture(scope="module")
def single_grpo(init_run, tmp_path_factory):
    """The one-process GRPO run the layouts are compared with: (trainer, run dir)."""
    path = tmp_path_factory.mktemp("single_grpo") / "run"
    return run_rl(init_run, path, "grpo"), path


@pytest.mark.slow
def test_grpo_fsdp2_equals_one_process_and_resumes_exactly(single_grpo, two_ranks):
    single, single_dir = single_grpo
    runs, layouts = two_ranks
    fsdp = [(("dp_shard_cp",), "(Shard(dim=0),)")]
    assert layouts["fsdp"] == [fsdp, fsdp]  # the policy and the frozen reference, sharded over both ranks
    rows = assert_same_run(single_dir, runs / "fsdp", "grpo")
    assert rows[1]["reward_std"] > 0 and rows[2]["kl"] > 0  # the rewards vary and the steps move the policy
    assert "eval_reward" in rows[0] and "eval_reward" in rows[2]
    # the resumed FSDP2 run (rollouts keyed per sample, the reference from reference.pt) ends bit for bit where the
    # uninterrupted one does
    full, resumed = final_weights(runs / "fsdp"), final_weights(runs / "cut")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    last_full, last_cut = metrics(runs / "fsdp")[-1], metrics(runs / "cut")[-1]
    assert all(last_cut[k] == last_full[k] for k in ("step", "lr", *COMPARED["grpo"]))
    ref = torch.load(runs / "cut" / "reference.pt", weights_only=True)
    init = single.reference.model.state_dict()
    assert ref.keys() == init.keys() and all(torch.equal(ref[k], init[k]) for k in ref)


@pytest.mark.slow
def test_grpo_tp2_equals_one_process(single_grpo, two_ranks):
    runs, layouts = two_ranks
    for placements in layouts["tp"]:  # the policy's and the reference's weights split over the TP ranks
        assert (("tp",), "(Shard(dim=0),)") in placements and (("tp",), "(Shard(dim=1),)") in placements
    assert_same_run(single_grpo[1], runs / "tp", "grpo")


@pytest.mark.slow
def test_grpo_ddp_hsdp_and_fsdp2_x_tp_on_4_ranks_equal_one_process(init_run, tmp_path):
    """One 4-rank launch: DDP (4 replicas), HSDP (2 replicas x 2 shards) and FSDP2 x TP (2 x 2), each against one
    process on the same 4 prompt groups a step (one per data-parallel rank under DDP and HSDP, two under FSDP2 x TP)."""
    # optim.eps=1e-3 keeps Adam's updates lr * m / (sqrt(v) + eps) near linear in the gradient: a gradient here is
    # a sum over completions weighted by advantages that cancel within each group, so its small components are
    # mostly the rounding of the reduction order, which differs between layouts; with the default eps=1e-8 Adam
    # scales those components up to updates of order lr (measured with it: weights apart by up to 1e-3 under DDP
    # and 7e-3 under FSDP2 x TP after two steps, at embedding rows)
    four = ["algorithm.prompts_per_step=4", "optim.eps=1e-3"]
    run_rl(init_run, tmp_path / "single", "grpo", *four)
    layouts = spawn(tmp_path, init_run, [["ddp", "grpo", ["parallel=ddp", *four]],
                                         ["hsdp", "grpo", ["parallel=hsdp", *four]],
                                         ["fsdp_tp", "grpo", ["parallel=tp2", "parallel.sequence_parallel=false",
                                                              *four]]], world=4)
    # DDP is FSDP2 on a (4 replicas, shards of 1 rank) mesh, HSDP on (2, 2): the policy and the frozen reference alike
    hsdp = [(("dp_replicate", "dp_shard_cp"), "(Replicate(), Shard(dim=0))")]
    assert layouts["ddp"] == layouts["hsdp"] == [hsdp, hsdp], layouts
    assert layouts["ddp_mesh"] == [(4, 1)] and layouts["hsdp_mesh"] == [(2, 2)]
    for placements in layouts["fsdp_tp"]:  # the matrices split over the TP ranks, all sharded over the other two
        assert {dims for dims, _ in placements} == {("dp_shard_cp",), ("dp_shard_cp", "tp")}, layouts
        assert (("dp_shard_cp", "tp"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))") in placements
    assert layouts["fsdp_tp_mesh"] == [(2,), (2, 2)]
    for name in ("ddp", "hsdp", "fsdp_tp"):
        rows = assert_same_run(tmp_path / "single", tmp_path / name, "grpo")
    assert rows[1]["reward_std"] > 0 and rows[2]["kl"] > 0  # the rewards vary and the steps move the policy


@pytest.mark.slow
def test_dpo_fsdp2_equals_one_process(init_run, two_ranks, tmp_path):
    runs, layouts = two_ranks
    run_rl(init_run, tmp_path / "single", "dpo")
    assert all(layouts["dpo_fsdp"])  # policy and reference sharded
    rows = assert_same_run(tmp_path / "single", runs / "dpo_fsdp", "dpo")
    assert rows[1]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # policy = reference at the first step
    assert rows[2]["loss"] != rows[1]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LORA))
def test_grpo_lora_reference_is_the_base_with_adapters_off(case, init_run, lora_init_run, two_ranks, tmp_path):
    """A LoRA init run's adapters, or fresh ones on a full init run (``lora=attn_mlp``), under FSDP2 or TP give one
    process's metrics and weights, with the policy as the only model held."""
    fresh, layout = LORA[case]
    runs, out = two_ranks
    init = init_run if fresh else lora_init_run
    lora = [*LORA_RL, *(["lora=attn_mlp"] if fresh else [])]
    single = run_rl(init, tmp_path / "single", "grpo", *lora)
    parallel = runs / f"lora_{case}"
    a, b = metrics(tmp_path / "single"), metrics(parallel)
    for ra, rb in zip(a[1:], b[1:]):
        for key in ("loss", "reward_mean", "reward_std", "kl", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-5), (ra["step"], key)
    assert a[2]["kl"] > 0  # the adapters moved the policy away from the base
    # no second copy: the reference is the sharded policy itself
    assert len(out[parallel.name]) == 1 and out[parallel.name][0]
    want = single.model.state_dict()
    assert any(".lora." in k for k in want)
    if layout == "fsdp":  # the live weights, whole (TP holds fc1's gate/up-interleaved rows: the checkpoint below)
        for name, value in out[f"{parallel.name}_weights"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)
    # difflm-generate reads the LoRA run's checkpoint (base and adapters, written by both ranks)
    read = final_weights(parallel)
    assert read.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(read[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_per_row_generators_make_a_row_independent_of_its_batch():
    """A row sampled with others (its own generator) equals the row sampled alone, also with Fast-dLLM thresholds,
    where a block takes as many steps as its slowest row needs."""
    from difflm.sampling import GenerationOptions
    from difflm.sampling.diffusion import diffusion_generate

    vocab, mask_id = 8, 7
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))

    def logits_fn(x, **kw):  # each position's logits from its token and its left neighbour: rows are independent
        return table[x] + 0.5 * table[torch.roll(x, 1, dims=1)]

    prompts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    for threshold in (None, 0.4):
        opts = GenerationOptions(mask_id=mask_id, length=6, steps=6, block_length=3, temperature=1.0,
                                 threshold=threshold, forbid_ids=(mask_id,))
        gens = lambda rows: [torch.Generator().manual_seed(100 + r) for r in rows]  # noqa: E731
        together = diffusion_generate(logits_fn, prompts, opts, generator=gens([0, 1, 2]))
        for r in range(3):
            alone = diffusion_generate(logits_fn, prompts[r:r + 1], opts, generator=gens([r]))
            assert torch.equal(alone[0], together[r]), (threshold, r)
    one = diffusion_generate(logits_fn, prompts, opts, generator=torch.Generator().manual_seed(100))
    assert not torch.equal(one, together)  # one shared generator draws other noise


@pytest.mark.parametrize("override, key", [("parallel.pp=2", "parallel.pp"), ("parallel.cp=2", "parallel.cp"),
                                           ("parallel.tp=2", "parallel.sequence_parallel"),
                                           ("algorithm.prompts_per_step=3", "algorithm.prompts_per_step")])
def test_unsupported_layouts_are_refused_in_one_line(init_run, tmp_path, override, key):
    from test_posttrain_runtime import rl_config

    from difflm.checkpoint.store import trained_settings
    from difflm.errors import DifflmError
    from difflm.posttrain.layout import check_rl_layout

    cfg = rl_config(init_run, tmp_path / "run", "parallel.dp_shard=-1", override)
    with pytest.raises(DifflmError) as err:
        check_rl_layout(cfg, trained_settings(str(init_run))[0], 4)
    assert "\n" not in str(err.value) and key in str(err.value)


def test_reports_are_said_by_rank_0_unless_they_are_a_ranks_own(capsys):
    """A notice every rank reaches alike (a cut notice, a skipped update) is printed once, by rank 0; a line about a
    rank's own share of the step (its reward failures) by that rank."""
    from types import SimpleNamespace

    from difflm.posttrain.runner import PostTrainer

    for rank0 in (True, False):
        run = SimpleNamespace(_reports=[], is_rank0=rank0)
        PostTrainer.report(run, "difflm: notice: a")
        PostTrainer.report(run, "difflm: step 1: b", every_rank=True)
        assert run._reports == ["difflm: notice: a", "difflm: step 1: b"]
        assert capsys.readouterr().out == ("difflm: notice: a\n" if rank0 else "") + "difflm: step 1: b\n"
