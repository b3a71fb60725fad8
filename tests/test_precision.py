"""Precision modes, FP8 recipes and the config checks of precision/backend combinations (CPU, no TE)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)
from hydra import compose, initialize_config_dir

from difflm.config import CONF_DIR
from difflm.config.validate import check_choices, check_model, check_precision, check_run
from difflm.errors import DifflmError
from difflm.training import precision as P

CPU = torch.device("cpu")


def run_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


# ------------------------------------------------------------------ FP8 recipe / hardware matrix
@pytest.mark.parametrize("recipe,cc,cuda,ok,needle", [
    ("delayed", (9, 0), "12.8", True, None),
    ("current", (9, 0), "12.8", True, None),
    ("delayed", (8, 9), "12.4", True, None),
    ("delayed", (8, 0), "12.8", False, "8.9"),
    ("block", (9, 0), "12.8", False, "CUDA >= 12.9"),
    ("block", (9, 0), "13.0", True, None),
    ("block", (8, 9), "13.0", False, "9.0"),
    ("mxfp8", (9, 0), "13.0", False, "Blackwell"),
    ("mxfp8", (10, 0), "12.8", True, None),
    ("mxfp8", (12, 0), "12.8", False, "Blackwell"),
    ("delayed", None, None, False, "FP8-capable"),
])
def test_fp8_support_matrix(recipe, cc, cuda, ok, needle):
    reason = P.fp8_unsupported_reason(recipe, cc, cuda)
    assert (reason is None) == ok
    if not ok:
        assert needle in reason and "precision" in reason  # names the key and the way out


def test_fp8_unknown_recipe_reason():
    assert "fp8_recipe='e4m3'" in P.fp8_unsupported_reason("e4m3", (9, 0), "13.0")


def test_mxfp8_refusal_on_hopper_says_what_to_use():
    reason = P.fp8_unsupported_reason("mxfp8", (9, 0), "13.0")
    assert "delayed" in reason and "current" in reason and "block" in reason


def test_cpu_device_always_refuses_fp8():
    assert "FP8-capable" in P.device_fp8_unsupported_reason("delayed", CPU)


# ------------------------------------------------------------------ autocast contexts
def test_fp32_context_is_plain():
    with P.autocast_context("fp32", CPU):
        assert not torch.is_autocast_enabled("cpu")
        y = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert y.dtype == torch.float32


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_bf16_fp16_contexts_autocast(name, dtype):
    cfg = run_cfg(f"precision={name}")
    for precision in (name, cfg.precision):  # the name or the config node
        with P.autocast_context(precision, CPU):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
            y = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
        assert y.dtype == dtype
        assert not torch.is_autocast_enabled("cpu")
    assert P.compute_dtype(name) == dtype and P.compute_dtype("fp32") is None


def test_fp8_context_without_te_says_how_to_install():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(DifflmError, match="pip install 'transformer-engine\\[pytorch\\]'"):
        P.autocast_context("fp8", CPU)


@pytest.mark.parametrize("recipe,cls,fmt", [("delayed", "DelayedScaling", "HYBRID"),
                                            ("current", "Float8CurrentScaling", "HYBRID"),
                                            ("block", "Float8BlockScaling", "E4M3"),
                                            ("mxfp8", "MXFP8BlockScaling", "E4M3")])
def test_fp8_context_enters_bf16_autocast_and_te_recipe(fake_te, recipe, cls, fmt):
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    cfg = run_cfg("precision=fp8", f"precision.fp8_recipe={recipe}", "precision.fp8_amax_history_len=16")
    with P.autocast_context(cfg.precision, CPU):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        assert P.fp8_is_active()
        enabled, rec = FP8GlobalStateManager.history[-1]
        assert enabled and type(rec).__name__ == cls and rec.fp8_format.name == fmt
        if recipe == "delayed":
            assert rec.amax_history_len == 16 and rec.amax_compute_algo == "max"
    assert not P.fp8_is_active() and not torch.is_autocast_enabled("cpu")
    # the same settings give the same recipe object (TE keys its scaling state by recipe)
    assert P.build_fp8_recipe(cfg.precision) is P.build_fp8_recipe(cfg.precision)


def test_fp8_string_means_default_delayed_recipe(fake_te):
    rec = P.build_fp8_recipe("fp8")
    assert type(rec).__name__ == "DelayedScaling" and rec.amax_history_len == 1024


def test_fp8_context_leaves_no_autocast_when_te_fails(fake_te, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("te failed")

    monkeypatch.setattr(P, "te_autocast", broken)
    with pytest.raises(RuntimeError):
        with P.autocast_context("fp8", CPU):
            pass
    assert not torch.is_autocast_enabled("cpu")


def test_trainer_and_generate_use_this_autocast_context():
    from difflm import generate
    from difflm.training import trainer

    assert trainer.autocast_context is P.autocast_context
    assert generate.autocast_context is P.autocast_context


# ------------------------------------------------------------------ config validation
@pytest.mark.parametrize("overrides,needle", [
    (["precision=fp8"], "FP8-capable"),
    (["precision=fp16"], "needs a CUDA device"),
    (["model.attention_backend=flash"], "CUDA kernels only"),
    (["model.attention_backend=te"], "CUDA kernels only"),
    (["model.attention_backend=flex"], "trains on CUDA only"),
    (["precision=bf16", "precision.fp8_weights=true"], "precision.fp8_weights=true needs precision=fp8"),
    (["precision=bf16", "precision.fp8_skip_first_last=true"], "needs precision=fp8"),
    (["precision.fp8_recipe=e5m2"], "precision.fp8_recipe='e5m2' is not one of"),
    (["model.attention_backend=xformers"], "model.attention_backend='xformers' is not one of"),
])
def test_cpu_refusals(overrides, needle):
    cfg = run_cfg("device=cpu", *overrides)
    with pytest.raises(DifflmError, match=needle.replace("(", "\\(").replace("[", "\\[")) as info:
        check_run(cfg)
    assert "\n" not in str(info.value) and ":" in str(info.value)  # one line: problem, then the fix


def test_te_backend_refused_without_te_or_on_cpu():
    cfg = run_cfg("device=cpu", "model.backend=te")
    with pytest.raises(DifflmError, match="model.backend=te") as info:
        check_run(cfg)
    assert "pip install" in str(info.value) or "device=cuda" in str(info.value)


def test_te_backend_on_cpu_refused_with_te_installed(fake_te):
    cfg = run_cfg("device=cpu", "model.backend=te")
    check_model(cfg.model)  # TE importable: the model keys are fine
    with pytest.raises(DifflmError, match="model.backend=te runs Transformer Engine's CUDA kernels"):
        check_precision(cfg, CPU)


def test_compile_is_for_the_torch_backend(fake_te):
    check_model(run_cfg("model.compile=true").model)
    with pytest.raises(DifflmError, match="model.compile=true applies to model.backend=torch"):
        check_model(run_cfg("model.backend=te", "model.compile=true").model)


def _pretend_gpu(monkeypatch, cc, cuda="13.0"):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.version, "cuda", cuda)


@pytest.mark.parametrize("recipe,cc,cuda,needle", [
    ("mxfp8", (9, 0), "13.0", "Blackwell"),
    ("block", (9, 0), "12.8", "CUDA >= 12.9"),
    ("delayed", (8, 0), "12.8", "compute capability >= 8.9"),
])
def test_fp8_recipe_refusals_on_gpus(fake_te, monkeypatch, recipe, cc, cuda, needle):
    _pretend_gpu(monkeypatch, cc, cuda)
    cfg = run_cfg("model.backend=te", "model.attention_backend=te", "precision=fp8", f"precision.fp8_recipe={recipe}")
    with pytest.raises(DifflmError, match=needle):
        check_precision(cfg, torch.device("cuda"))


def test_fp8_combinations_accepted_on_hopper(fake_te, monkeypatch):
    _pretend_gpu(monkeypatch, (9, 0), "13.0")
    for recipe in ("delayed", "current", "block"):
        cfg = run_cfg("model.backend=te", "model.attention_backend=te", "precision=fp8",
                      f"precision.fp8_recipe={recipe}", "precision.fp8_skip_first_last=true",
                      "precision.fp8_attention=true")
        check_choices(cfg)
        check_precision(cfg, torch.device("cuda"))


def test_fp8_requires_te_backend_and_fp8_attention_requires_te_attention(fake_te, monkeypatch):
    _pretend_gpu(monkeypatch, (9, 0))
    with pytest.raises(DifflmError, match="set model.backend=te"):
        check_precision(run_cfg("precision=fp8", "model.backend=torch"), torch.device("cuda"))
    cfg = run_cfg("precision=fp8")  # model.backend=auto picks TE for FP8, and TE's attention
    check_precision(cfg, torch.device("cuda"))
    assert (cfg.model.backend, cfg.model.attention_backend) == ("te", "te")
    with pytest.raises(DifflmError, match="set model.attention_backend=te"):
        check_precision(run_cfg("model.backend=te", "model.attention_backend=sdpa", "precision=fp8",
                                "precision.fp8_attention=true"),
                        torch.device("cuda"))


def test_fp8_weights_benchmark_only(fake_te, monkeypatch):
    _pretend_gpu(monkeypatch, (9, 0))
    cfg = run_cfg("model.backend=te", "precision=fp8", "precision.fp8_weights=true")
    with pytest.raises(DifflmError, match="master weights"):
        check_precision(cfg, torch.device("cuda"))
    check_precision(cfg, torch.device("cuda"), training=False)
