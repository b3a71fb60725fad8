"""Start-up: the entry points import the heavy libraries (torch.distributed.checkpoint, torch._dynamo, the trainer)
only where a run needs them, so a --help or a refused config answers quickly; and the FlashAttention / TE attention
kernels, whose ``torch.compiler.disable`` wrappers import torch._dynamo, get them when a model that uses them is
built, before any ``torch.compile`` traces it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dlm_helpers import tiny_model


@pytest.mark.slow
def test_importing_the_entry_points_leaves_dcp_dynamo_and_the_trainer_out():
    code = ("import sys, difflm.train, difflm.generate, difflm.evaluate\n"
            "heavy = ['torch.distributed.checkpoint', 'torch._dynamo', 'difflm.training.trainer']\n"
            "print(' '.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", out.stdout


@pytest.mark.parametrize("backend", ["flash", "te"])
def test_a_model_with_an_opaque_attention_kernel_wraps_it_when_built(backend):
    from difflm.model import attention

    attention._OPAQUE[backend] = None  # as in a fresh process
    tiny_model(backend=backend)
    kernel = attention._OPAQUE[backend]
    assert kernel is not None and kernel is not attention._KERNELS[backend]
    assert getattr(kernel, "_torchdynamo_disable", False)  # what torch.compiler.disable marks
    assert attention.opaque_kernel(backend) is kernel  # made once
    tiny_model(backend="sdpa")
    assert attention._OPAQUE[backend] is kernel


def test_sdpa_runs_its_kernel_unwrapped():
    from difflm.model import attention

    q = torch.randn(1, 2, 4, 8)
    out = attention.attend(q, q, q, causal=False, backend="sdpa", layout="bhsd")
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-6)
    assert "sdpa" not in attention._OPAQUE
