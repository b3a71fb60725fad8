"""A training step never waits for the GPU: noise, loss rows, gradient clipping, the finite check (the
fused AdamW skips a non-finite step on the device) and the next step's batches are launched without a host sync;
``Trainer.fit`` reads each step's outcome after the next step is launched. CUDA only: PyTorch's sync debug mode
reports every blocking device-to-host transfer."""
from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("objective", ["mdlm", "bd3lm", "sft"])
def test_a_training_step_does_not_wait_for_the_device(fast_cfg, tmp_path, objective):
    import json

    from difflm.training.trainer import Trainer

    extra = []
    if objective == "sft":
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps({"q": f"question {i} " * (1 + i % 5), "a": f"answer {i}"}) + "\n"
                                for i in range(32)))
        extra = [f"data.path={path}", "data.prompt_field=q", "data.response_field=a"]
    elif objective == "bd3lm":
        extra = ["objective.block_size=8"]
    cfg = fast_cfg(f"objective={objective}", "device=cuda", "precision=bf16", "train.max_steps=6", "train.eval_every=0",
                   "train.save_every=0", "logger.num_samples=0", *extra)
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cuda"))
    for _ in range(2):  # warm-up: allocator, cuBLAS handles, first prefetch
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    print(objective, [str(w.message)[:120] for w in syncs])
    assert not syncs, [str(w.message) for w in syncs]


def test_a_non_finite_step_is_skipped_on_the_device(fast_cfg):
    """On CUDA the fused AdamW skips a poisoned step itself (found_inf): no weight, moment or step count moves, the
    host learns of it a step later (``settle_lag`` 1), and the same run without the poison trains on from the
    same weights."""
    import json
    from pathlib import Path

    from difflm.training.trainer import Trainer

    cfg = fast_cfg("device=cuda", "precision=bf16", "train.max_steps=4", "train.eval_every=0", "train.save_every=0",
                   "logger.log_every=1")
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cuda"))
    assert trainer.settle_lag == 1 and trainer.optimizer.param_groups[0]["fused"]
    forward, seen = trainer.model.forward, {}

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out * float("nan") if trainer.data_step == 2 else out

    trainer.model.forward = poisoned
    real_step = trainer._finish_step

    def spy(*args, **kwargs):
        if trainer.step == 2:
            seen["before"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            seen["steps"] = [float(s["step"]) for s in trainer.optimizer.state.values()]
        out = real_step(*args, **kwargs)
        if trainer.step == 3:
            seen["after"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            seen["steps_after"] = [float(s["step"]) for s in trainer.optimizer.state.values()]
        return out

    trainer._finish_step = spy
    trainer.fit()
    assert all(torch.equal(seen["before"][k], v) for k, v in seen["after"].items())
    assert seen["steps"] == seen["steps_after"] == [2.0] * len(seen["steps"])
    rows = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1] and trainer.skipped_steps == 1
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["tokens_per_s"] > 0 for r in rows)
