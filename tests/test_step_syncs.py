"""A training step never waits for the GPU (issue 17): noise, loss rows, gradient clipping, the finite check (the
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
