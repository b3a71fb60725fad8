"""Atomic checkpoints and exact resume: a resumed run reproduces the uninterrupted run bit for bit (CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from difflm.checkpoint.store import latest_checkpoint, list_checkpoints
from difflm.errors import DifflmError
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def test_resume_is_bit_exact(fast_cfg, tmp_path):
    common = ["train.max_steps=6", "train.save_every=3", "logger.log_every=1", "train.eval_every=0",
              "objective.random_length_prob=0.3", "objective.t_sampling=antithetic"]
    straight = fast_cfg(*common, f"run.dir={tmp_path / 'a'}")
    Trainer(straight, straight.run.dir, CPU).fit()

    interrupted = fast_cfg(*common, f"run.dir={tmp_path / 'b'}")
    first = Trainer(interrupted, interrupted.run.dir, CPU)
    for _ in range(3):
        first.train_step()
    first.save()
    del first
    resumed = Trainer(fast_cfg(*common, f"run.dir={tmp_path / 'b'}"), tmp_path / "b", CPU)
    assert resumed.resumed_from == 3
    resumed.fit()

    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == [4, 5, 6]
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # bit-exact
    straight_again = Trainer(fast_cfg(*common, f"run.dir={tmp_path / 'a'}"), tmp_path / "a", CPU)
    for (name, p), q in zip(resumed.model.state_dict().items(), straight_again.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_checkpoint_is_atomic_and_listed(fast_cfg, tmp_path):
    cfg = fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    root = Path(cfg.run.dir) / "checkpoints"
    assert [s for s, _ in list_checkpoints(cfg.run.dir)] == [1, 2]
    assert sorted(os.listdir(root / "step_2")) == sorted(["trainer_state.pt", ".metadata", "__0_0.distcp", "manifest.json"])
    # an interrupted save (temporary directory) is never taken for a checkpoint
    (root / ".step_3.tmp").mkdir()
    assert latest_checkpoint(cfg.run.dir)[0] == 2
    state = torch.load(root / "step_2" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["sampler"]["consumed_samples"] == 2 * cfg.train.global_batch_size


def test_resume_with_other_model_is_refused(fast_cfg):
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    with pytest.raises(DifflmError, match="does not match this model"):
        Trainer(fast_cfg("model.hidden_size=32", "train.max_steps=2"), cfg.run.dir, CPU)


@pytest.mark.parametrize("smaller", ["model.num_layers=1", "model.tie_embeddings=true", "model.qk_norm=false"])
def test_resume_with_a_smaller_model_is_refused(fast_cfg, smaller):
    """A model with no place for some checkpoint tensors would drop their trained values without a word."""
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0", "model.qk_norm=true")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    saved = (Path(cfg.run.dir) / "config.yaml").read_text()
    with pytest.raises(DifflmError, match=r"does not match this model: it holds [1-9]\d* tensor\(s\) this model has "
                                          r"no place for \((layers\.1\.|output\.weight|.*norm)"):
        Trainer(fast_cfg("train.max_steps=2", "model.qk_norm=true", smaller), cfg.run.dir, CPU)
    assert (Path(cfg.run.dir) / "config.yaml").read_text() == saved  # the run's record still names its model


def test_resume_with_other_batch_is_refused(fast_cfg):
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    with pytest.raises(DifflmError, match="global_batch_size"):
        Trainer(fast_cfg("train.global_batch_size=8", "train.max_steps=2"), cfg.run.dir, CPU)


def test_scheduler_resumes_with_another_number_of_parameter_groups():
    """A layout's optimizer may hold 3 groups (TP without FSDP: DTensor and plain tensors apart) and another 2:
    the schedule position carries over and every group gets the lr LambdaLR.step would have set."""
    from omegaconf import OmegaConf

    from difflm.training.schedule import build_scheduler, restore_scheduler

    cfg = OmegaConf.create({"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1, "decay_fraction": 0.2})
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    three = torch.optim.AdamW([{"params": [w]} for w in weights], lr=1e-3)
    source = build_scheduler(three, cfg, max_steps=10)
    for _ in range(5):
        three.step()
        source.step()
    two = torch.optim.AdamW([{"params": weights[:2]}, {"params": weights[2:]}], lr=1e-3)
    resumed = build_scheduler(two, cfg, max_steps=10)
    restore_scheduler(resumed, source.state_dict())
    assert resumed.last_epoch == 5
    assert [g["lr"] for g in two.param_groups] == [three.param_groups[0]["lr"]] * 2
    for _ in range(3):
        two.step()
        resumed.step()
        three.step()
        source.step()
    assert resumed.get_last_lr() == source.get_last_lr()[:2]


def test_resume_with_other_settings_names_them_and_keeps_the_earlier_config(fast_cfg, capsys):
    """Changed settings are allowed on a resume (a lower lr, another objective: AR-to-diffusion adaptation), but named
    in one line, and the settings the earlier steps ran with stay next to the run as config.step_<N>[.<k>].yaml."""
    from omegaconf import OmegaConf

    common = ("train.save_every=1", "train.eval_every=0")
    cfg = fast_cfg("train.max_steps=1", *common)
    Trainer(cfg, cfg.run.dir, CPU).fit()
    run = Path(cfg.run.dir)
    first = (run / "config.yaml").read_text()
    capsys.readouterr()
    Trainer(fast_cfg("train.max_steps=2", *common), run, CPU)  # the same settings but the length
    line = next(x for x in capsys.readouterr().out.splitlines() if "changed settings" in x)
    assert line == (f"difflm: resuming at step 1 with changed settings: train.max_steps: 1 -> 2 (the earlier settings "
                    f"are kept in {run / 'config.step_1.yaml'})")
    assert (run / "config.step_1.yaml").read_text() == first
    second = (run / "config.yaml").read_text()
    resumed = Trainer(fast_cfg("train.max_steps=2", *common, "optim.lr=1e-4", "objective=ar"), run, CPU)
    line = next(x for x in capsys.readouterr().out.splitlines() if "changed settings" in x)
    assert "objective.name: 'mdlm' -> 'ar'" in line and "optim.lr: 0.0003 -> 0.0001" in line
    assert line.endswith(f"(the earlier settings are kept in {run / 'config.step_1.2.yaml'})")
    assert (run / "config.step_1.yaml").read_text() == first  # no record is replaced
    assert (run / "config.step_1.2.yaml").read_text() == second
    assert OmegaConf.load(run / "config.yaml").objective.name == "ar" and resumed.resumed_from == 1
    Trainer(fast_cfg("train.max_steps=2", *common, "optim.lr=1e-4", "objective=ar"), run, CPU)
    assert "changed settings" not in capsys.readouterr().out  # the same settings again: nothing to report


def test_changed_settings_lists_every_differing_leaf():
    from difflm.training.run_config import changed_settings

    old = {"a": {"b": 1, "c": [1, 2]}, "d": "x", "gone": 3}
    new = {"a": {"b": 2, "c": [1, 2]}, "d": "x", "new": {"e": None}}
    assert changed_settings(old, new) == [("a.b", 1, 2), ("gone", 3, "<absent>"), ("new.e", "<absent>", None)]
    assert changed_settings(old, old) == []
