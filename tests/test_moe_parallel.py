"""Expert parallelism (difflm/parallel/expert_parallel.py) on CPU with gloo: ``model=moe-tiny`` trains the same
loss curve under ep2 (2 ranks), ep2 x dp2 (4 ranks: FSDP over dp_shard=4, experts over ep=2 x efsdp=2),
ep2 x tp2 (4 ranks) and pp2 as in one process, and its checkpoints reshard ep2 -> single -> ep2.

Same pattern as tests/test_parallel.py (the single-process reference computed once, in the test's process; the
2-rank runs in one spawn of 2 ranks; the 4-rank layouts and the ep2 resume one ``torchrun`` launch each). Losses and the MoE metrics agree to 1e-5 relative over 10 steps; gradient norms to 2e-4: each
parameter's gradient norm agrees (compared in FP64, tensor by tensor), but the reference's own FP32 global norm is
9e-5 below the FP64 value at step 1 (two 50k x 64 embedding/LM-head gradients summed on the CPU), which the
sharded norms of the other layouts do not reproduce bit for bit.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import compose_run, spawn_ranks
from test_parallel import assert_same_curve as dense_curve
from test_parallel import _two_rank_worker, launch, rows, train_here

MOE = [
    "model=moe-tiny", "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.eval_every=0", "logger.num_samples=0", "logger.progress_bar=false", "logger.log_every=1",
    "schedule.warmup_steps=2", "device=cpu", "objective.random_length_prob=0",
    "model.moe.bias_update_rate=0.001",  # both balancing mechanisms on: the bias is state that must reshard too
]
STEPS = 10
LOSS_RTOL, NORM_RTOL = 1e-5, 2e-4


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe_parallel")


def run(nproc: int, run_dir: Path, work: Path, *overrides: str):
    """A ``torchrun`` launch of ``nproc`` ranks, or for one process the run in this process (``train_here``)."""
    if nproc == 1:
        return train_here(run_dir, work / "cache", *overrides, common=MOE)
    return launch(nproc, run_dir, work / "cache", *overrides, common=MOE)


@pytest.fixture(scope="module")
def reference(work) -> dict[int, dict]:
    """One process, 10 steps, checkpoints every 5 steps."""
    run(1, work / "single", work, f"train.max_steps={STEPS}", "train.save_every=5")
    got = rows(work / "single")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS]["moe/bias_norm"] > 0 and got[STEPS]["moe/load_max_mean"] >= 1.0
    return got


LLADA2 = ["model=llada2-tiny", "train.max_steps=3"]
DENSE_FIRST = ["model.moe.first_k_dense=1", "train.max_steps=3", "train.save_every=0"]  # pp2: stage 0 holds no MoE


@pytest.fixture(scope="module")
def two_rank_runs(work) -> Path:
    """The 2-rank runs this module's tests compare with one process, in one spawn of 2 ranks (the way of
    ``test_parallel.two_rank_runs``: the ranks start once): ``ep2`` (10 steps, checkpoints every 5), ``pp2`` (4
    steps), ``llada2_ep2`` (``model=llada2-tiny`` under ep2, 3 steps) and ``pp2_dense_stage`` (pp2 with a dense first
    block, 3 steps). Returns their folder."""
    root = work / "two_ranks"
    root.mkdir()
    runs = {"ep2": ["parallel=ep2", f"train.max_steps={STEPS}", "train.save_every=5"],
            "pp2": ["parallel=pp2", "train.max_steps=4", "train.save_every=0"],
            "llada2_ep2": [*LLADA2, "parallel=ep2"],
            "pp2_dense_stage": [*DENSE_FIRST, "parallel=pp2"]}
    (root / "spec.json").write_text(json.dumps([[str(root / name), [*MOE, f"data.cache_dir={work / 'cache'}",
                                                                    *overrides]] for name, overrides in runs.items()]))
    spawn_ranks(_two_rank_worker, 2, root)
    return root


def assert_same_curve(run_dir: Path, reference: dict[int, dict], steps) -> None:
    """test_parallel's loss and grad-norm check at this module's tolerances, plus the MoE metrics."""
    dense_curve(run_dir, reference, steps, loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL)
    got = rows(run_dir)
    for s in steps:
        for key in ("moe/load_max_mean", "moe/aux_loss", "moe/bias_norm"):
            assert got[s][key] == pytest.approx(reference[s][key], rel=LOSS_RTOL), (s, key)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_ep2_matches_single_process(reference, two_rank_runs):
    assert_same_curve(two_rank_runs / "ep2", reference, range(1, STEPS + 1))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_ep2_dp2_matches_single_process(work, reference):
    """4 ranks: dp_shard=4 split into efsdp=2 x ep=2 for the experts."""
    run(4, work / "ep2dp2", work, "parallel=ep2", f"train.max_steps={STEPS}", "train.save_every=0")
    assert_same_curve(work / "ep2dp2", reference, range(1, STEPS + 1))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_ep2_tp2_matches_single_process(work, reference):
    """4 ranks: tp=2 with sequence parallelism, dp_shard=2 = ep=2 (the MoE layers run replicated over TP)."""
    run(4, work / "ep2tp2", work, "parallel=ep2", "parallel.tp=2", "train.max_steps=4", "train.save_every=0")
    assert_same_curve(work / "ep2tp2", reference, range(1, 5))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_pp2_with_a_stage_of_dense_blocks_logs_the_moe_blocks_statistics(work, two_rank_runs):
    """pp2 where the first stage holds only a dense block (``model.moe.first_k_dense=1``): every stage gathers the MoE
    statistics (none from the dense stage), so the run neither hangs nor loses them, and its curve and MoE metrics
    equal one process's."""
    run(1, work / "dense_first_single", work, *DENSE_FIRST)
    reference = rows(work / "dense_first_single")
    assert_same_curve(two_rank_runs / "pp2_dense_stage", reference, range(1, 4))
    got = rows(two_rank_runs / "pp2_dense_stage")
    assert all("moe/load_max_mean/1" in got[s] and "moe/load_max_mean/0" not in got[s] for s in range(1, 4))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_pp2_matches_single_process(reference, two_rank_runs):
    """2 pipeline stages of one MoE block each: the stages' shape-inference forwards must not count as training
    forwards (routing statistics, aux-free bias)."""
    assert_same_curve(two_rank_runs / "pp2", reference, range(1, 5))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_resharded_resume_ep2_to_single_to_ep2(work, reference, two_rank_runs):
    """ep2's step-5 checkpoint resumes in one process (steps 6-10, saved at 7); its step 7 resumes under ep2 (8-10)."""
    from difflm.training.trainer import Trainer

    src = two_rank_runs / "ep2" / "checkpoints" / "step_5"
    single = work / "ep2_to_single"
    (single / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, single / "checkpoints" / "step_5")
    cfg = compose_run([*MOE, f"data.cache_dir={work / 'cache'}", f"run.dir={single}", f"train.max_steps={STEPS}",
                       "train.save_every=7"])
    trainer = Trainer(cfg, single, torch.device("cpu"))
    assert trainer.resumed_from == 5
    trainer.fit()
    assert_same_curve(single, reference, range(6, STEPS + 1))

    back = work / "single_to_ep2"
    (back / "checkpoints").mkdir(parents=True)
    shutil.copytree(single / "checkpoints" / "step_7", back / "checkpoints" / "step_7")
    out = run(2, back, work, "parallel=ep2", f"train.max_steps={STEPS}", "train.save_every=0")
    assert "from step 7" in out.stdout
    assert_same_curve(back, reference, [8, 9, 10])


def test_all_to_all_reorders_rank_major_to_expert_major():
    from difflm.parallel.expert_parallel import _rank_major_to_expert_major

    recv = torch.tensor([[2, 1], [0, 3]])  # rank 0 sent 2 rows for expert 0, 1 for expert 1; rank 1: 0 and 3
    # received rows: r0e0 r0e0 r0e1 r1e1 r1e1 r1e1 -> expert-major: r0e0 r0e0 | r0e1 r1e1 r1e1 r1e1
    assert _rank_major_to_expert_major(recv).tolist() == [0, 1, 2, 3, 4, 5]
    recv = torch.tensor([[1, 2], [3, 0]])  # rows: a(r0e0) b c (r0e1) d e f (r1e0)
    assert _rank_major_to_expert_major(recv).tolist() == [0, 3, 4, 5, 1, 2]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_ep2_of_dense_first_block_and_grouped_routing_matches_single_process(work, two_rank_runs):
    """``model=llada2-tiny`` (dense block 0, group-limited sigmoid routing with a moving bias, a shared expert):
    ep2 over 2 ranks follows the one-process curve and MoE metrics for 3 steps."""
    steps = 3
    run(1, work / "llada2_single", work, *LLADA2)
    reference = rows(work / "llada2_single")
    assert_same_curve(two_rank_runs / "llada2_ep2", reference, range(1, steps + 1))
    assert "moe/load_max_mean/0" not in reference[steps] and reference[steps]["moe/bias_norm"] > 0
