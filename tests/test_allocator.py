"""``train.expandable_segments``: the trainer (and the benchmark's rows) put the CUDA caching allocator in expandable
segments mode unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` themselves (difflm.training.allocator)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import difflm.training.trainer as trainer_module
from difflm.training import allocator
from difflm.training.trainer import Trainer

CUDA = torch.device("cuda")


@pytest.fixture
def settings(monkeypatch):
    """Record what would reach the allocator instead of changing it."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    return calls


def test_expandable_segments_are_set_on_cuda_unless_the_user_chose(settings, monkeypatch):
    assert allocator.use_expandable_segments(True, CUDA) is True
    assert settings == ["expandable_segments:True"]

    assert allocator.use_expandable_segments(False, CUDA) is False  # train.expandable_segments=false
    assert allocator.use_expandable_segments(True, torch.device("cpu")) is False
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:128")
    assert allocator.use_expandable_segments(True, CUDA) is False  # the user's own settings win
    assert settings == ["expandable_segments:True"]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_trainer_passes_its_key_and_device(fast_cfg, monkeypatch, enabled):
    seen = []
    monkeypatch.setattr(trainer_module, "use_expandable_segments", lambda flag, device: seen.append((flag, device.type)))
    cfg = fast_cfg(f"train.expandable_segments={str(enabled).lower()}", "train.max_steps=1")
    Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    assert seen == [(enabled, "cpu")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_following_segments_are_expandable():
    code = (
        "import torch\n"
        "from difflm.training.allocator import use_expandable_segments\n"
        "torch.empty(1, device='cuda')  # CUDA started, the default mode read\n"
        "assert use_expandable_segments(True, torch.device('cuda'))\n"
        "x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')\n"
        "segs = [s for s in torch.cuda.memory._snapshot()['segments'] if s['total_size'] >= x.numel()]\n"
        "print(sorted({bool(s.get('is_expandable')) for s in segs}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True]"


@pytest.mark.parametrize("enabled", [True, False])
def test_eval_and_generate_follow_the_runs_setting(fast_cfg, monkeypatch, enabled):
    import difflm.generate as generate_module

    cfg = fast_cfg(f"train.expandable_segments={str(enabled).lower()}", "train.max_steps=1", "train.save_every=1",
                   "train.eval_every=0", "logger.num_samples=0")
    Trainer(cfg, cfg.run.dir, torch.device("cpu")).fit()
    seen = []
    monkeypatch.setattr(generate_module, "use_expandable_segments", lambda flag, device: seen.append((flag, device.type)))
    generate_module.load_run(cfg.run.dir, None, torch.device("cpu"))  # difflm-eval, -generate and the harness
    assert seen == [(enabled, "cpu")]
