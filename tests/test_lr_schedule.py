"""Learning-rate schedules (difflm.training.schedule): their keys in range, and the warning of a run too short
for its warmup."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf


def test_schedule_keys_out_of_range_are_refused():
    from difflm.config.validate import check_schedule
    from difflm.errors import DifflmError

    good = OmegaConf.create({"name": "wsd", "warmup_steps": 0, "min_lr_ratio": 1.0, "decay_fraction": 0.0})
    check_schedule(good)
    for key, value, needle in [("warmup_steps", -5, "must be >= 0"), ("min_lr_ratio", 2.0, "must be in \\[0, 1\\]"),
                               ("min_lr_ratio", -0.1, "must be in \\[0, 1\\]"), ("decay_fraction", 1.5, "must be in \\[0, 1\\]")]:
        with pytest.raises(DifflmError, match=f"^schedule.{key}={value} {needle}"):
            check_schedule(OmegaConf.merge(good, {key: value}))


def test_a_warmup_longer_than_the_run_is_reported():
    from difflm.training.schedule import short_run_warning

    cfg = OmegaConf.create({"name": "cosine", "warmup_steps": 100, "min_lr_ratio": 0.1, "decay_fraction": 0.2})
    line = short_run_warning(cfg, 20, 3e-4)
    assert line == ("difflm: warning: schedule.warmup_steps=100 >= train.max_steps=20: the learning rate climbs only "
                    "to 6.00e-05 (optim.lr=0.0003) and never decays; lower schedule.warmup_steps for a short run")
    assert short_run_warning(cfg, 100, 3e-4) == (
        "difflm: warning: schedule.warmup_steps=100 >= train.max_steps=100: the learning rate reaches optim.lr=0.0003 "
        "only at the last step and never decays; lower schedule.warmup_steps for a short run")
    assert short_run_warning(cfg, 101, 3e-4) is None
    assert short_run_warning(OmegaConf.merge(cfg, {"warmup_steps": 0}), 5, 3e-4) is None
