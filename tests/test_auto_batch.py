"""``train.micro_batch_size=auto`` (:mod:`difflm.training.auto_batch`): the planned choice against a memory budget,
the out-of-memory probe, the refusals, and the run's config.yaml recording the choice."""
from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_run

GIB = 1024 ** 3
TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vocab_size=1000", "data.seq_len=64", "train.micro_batch_size=auto"]


@pytest.mark.parametrize("gbs, budget_gib, chosen", [(12, 10, 6), (12, 12, 12), (16, 7.5, 4), (7, 6.9, 1)])
def test_the_largest_dividing_size_under_the_budget_is_chosen(gbs, budget_gib, chosen):
    from difflm.training.auto_batch import choose_micro_batch

    cfg = compose_run([*TINY, f"train.global_batch_size={gbs}", f"train.auto_batch_budget_gib={budget_gib}"])
    line = choose_micro_batch(cfg, torch.device("cpu"), planner=lambda mb: mb * GIB)  # 1 GiB a sample
    assert cfg.train.micro_batch_size == chosen
    steps = gbs // chosen
    assert f"chose {chosen} on cpu" in line and f"; {steps} accumulation step{'s' if steps != 1 else ''})" in line
    assert cfg.train.auto_batch_reason == line and "\n" not in line


def test_the_planner_budget_splits_between_two_sizes():
    """With the real planner, a budget between the planned peaks of 2 and 4 samples picks 2 of a batch of 8."""
    from difflm.training.auto_batch import choose_micro_batch, planned_peak

    cfg = compose_run([*TINY, "train.global_batch_size=8"])
    two, four = planned_peak(cfg, 2), planned_peak(cfg, 4)
    assert two < four
    cfg.train.auto_batch_budget_gib = (two + four) / 2 / GIB
    choose_micro_batch(cfg, torch.device("cpu"))
    assert cfg.train.micro_batch_size == 2


def test_a_size_given_is_kept():
    from difflm.training.auto_batch import choose_micro_batch

    cfg = compose_run([*TINY, "train.micro_batch_size=2", "train.global_batch_size=8"])
    assert choose_micro_batch(cfg, torch.device("cpu"), planner=lambda mb: 0.0) == ""
    assert cfg.train.micro_batch_size == 2


@pytest.mark.parametrize("overrides, world, says", [
    (["parallel=pp2", "train.global_batch_size=8"], 2, "parallel.pp=2"),
    (["parallel=ddp", "train.global_batch_size=8"], 3, "not a multiple of the 3 data-parallel ranks"),
    (["train.global_batch_size=8", "train.auto_batch_budget_gib=0.5"], 1, "even a micro-batch of 1"),
])
def test_what_cannot_work_is_refused_in_one_line(overrides, world, says):
    from difflm.errors import DifflmError
    from difflm.training.auto_batch import choose_micro_batch

    cfg = compose_run([*TINY, *overrides])
    with pytest.raises(DifflmError, match=says) as err:
        choose_micro_batch(cfg, torch.device("cpu"), world, planner=lambda mb: mb * GIB)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("per_rank, start, fits, expect", [
    (16, 16, 3, (2, [16, 8, 4])),   # halving: 16, 8, 4 out of memory, 2 runs
    (12, 12, 3, (3, [12, 6])),      # the next size divides the per-rank batch and is at most half the last
    (8, 4, 8, (4, [])),             # the planned size runs: nothing else is tried
])
def test_the_probe_halves_on_out_of_memory(per_rank, start, fits, expect):
    from difflm.training.auto_batch import probe_micro_batch

    tried = []

    def step(size):
        tried.append(size)
        if size > fits:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {size}")

    assert probe_micro_batch(step, start, per_rank) == expect
    assert tried == [*expect[1], expect[0]]


def test_the_probe_refuses_when_one_sample_runs_out_of_memory():
    from difflm.errors import DifflmError
    from difflm.training.auto_batch import probe_micro_batch

    def step(size):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(DifflmError, match=r"a micro-batch of 1 runs out of GPU memory \(tried \[4, 2, 1\]\)"):
        probe_micro_batch(step, 4, 4)


def test_the_run_config_records_the_choice(fast_cfg):
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("train.micro_batch_size=auto", "train.global_batch_size=4", "train.auto_batch_budget_gib=64",
                   "train.max_steps=1")
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    assert trainer.cfg.train.micro_batch_size == 4 and trainer.accum_steps == 1  # the tiny model fits whole
    recorded = OmegaConf.load(f"{cfg.run.dir}/config.yaml")
    assert recorded.train.micro_batch_size == 4
    assert recorded.train.auto_batch_reason.startswith("train.micro_batch_size=auto chose 4 on cpu")
    assert "train.auto_batch_budget_gib" in recorded.train.auto_batch_reason


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets the CPU peak through /proc")
def test_mem_gib_is_the_peak_of_the_runs_steps_not_of_the_probes_tries(fast_cfg, monkeypatch):
    """The probe may run out of memory at the planned size (a try that fills the GPU) before it halves: the peak that
    mem_gib reports starts after the probe, so it is the run's steps', not that try's. The probe runs on CUDA; here
    it is called as the CUDA Trainer calls it, with a try that held 1 GiB of CPU memory."""
    from difflm.training import auto_batch
    from difflm.training.trainer import Trainer, memory_gib, reset_peak_memory

    cpu = torch.device("cpu")
    cfg = fast_cfg("train.micro_batch_size=auto", "train.global_batch_size=4", "train.auto_batch_budget_gib=64",
                   "train.max_steps=1")
    trainer = Trainer(cfg, cfg.run.dir, cpu)

    def probe(step, size, per_rank):  # a try at 4 that held 1 GiB and ran out of memory, then 2 fits
        hog = torch.ones(2**28)
        del hog
        return 2, size

    monkeypatch.setattr(auto_batch, "probe_micro_batch", probe)
    reset_peak_memory(cpu)
    before = memory_gib(cpu)
    trainer._probe_micro_batch()
    assert trainer.cfg.train.micro_batch_size == 2 and trainer.accum_steps == 2
    assert memory_gib(cpu) < before + 0.5, (memory_gib(cpu), before)


def test_difflm_plan_plans_auto_against_the_gpu(capsys):
    """``difflm-plan ... train.micro_batch_size=auto`` plans the size against the GPU's memory less its reserve."""
    from difflm.plan.cli import main

    assert main(["model=tiny", "model.vocab_size=1000", "train.micro_batch_size=auto", "train.global_batch_size=8",
                 "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "train.micro_batch_size=auto chose 8 on cuda" in out and "of a 75.6 GiB budget" in out
    assert "micro-batch 8 x 1 accumulation steps" in out
