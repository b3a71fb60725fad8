"""``model.*=auto`` (difflm.model.auto_kernels): the kernels chosen for a run from what is installed and what the run
needs, with the installation faked on the CPU (CUDA present, TE / FlashAttention 4 / quack importable or not)."""
from __future__ import annotations

import pytest
import torch
from conftest import compose_run, run_cli

import difflm.model.auto_kernels as ak
from difflm.errors import DifflmError

CUDA = torch.device("cuda")


@pytest.fixture
def machine(monkeypatch):
    """A Hopper GPU with TE, FlashAttention 4 and quack installed; each test takes pieces away."""
    state = {"te": None, "fa4": True, "quack": None}
    monkeypatch.setattr(ak, "te_import_error", lambda: state["te"])
    monkeypatch.setattr(ak, "fa4_installed", lambda: state["fa4"])
    monkeypatch.setattr(ak, "quack_reason", lambda device: state["quack"])
    return state


def choose(*overrides, device=CUDA, **kw):
    cfg = compose_run(list(overrides), auto=True)
    choice = ak.choose_kernels(cfg, device, **kw)
    values = tuple(choice.values[k] for k in ak.KEYS)
    assert values == tuple(cfg.model[k] for k in ak.KEYS)  # written back into the config
    return values, choice


def test_full_install_bf16_picks_the_benchmarks_fastest_row(machine):
    values, choice = choose("model=1.7b", "precision=bf16")
    assert values == ("te", "flash", True, True)
    assert choice.line == (
        "kernels auto on cuda: model.backend=te (Transformer Engine imports), model.attention_backend=flash "
        "(FlashAttention 4 imports, bf16, no mask it cannot take), model.fused_mlp=true (quack on a Hopper/Blackwell "
        "GPU, BF16, dense), model.fused_mlp_autotune=true (each GEMM shape tuned once, kept in quack's disk cache)")


def test_experiment_megadlm_picks_the_fastest_row_with_no_switch(machine):
    cfg = compose_run(["experiment=megadlm_1.7b", "data.path=x.txt"], auto=True)
    ak.choose_kernels(cfg, CUDA)
    m = cfg.model
    assert (m.backend, m.attention_backend, m.fused_mlp, m.fused_mlp_autotune) == ("te", "flash", True, True)
    assert (cfg.train.micro_batch_size, cfg.precision.name) == (8, "bf16")
    assert m.auto_reason.startswith("kernels auto on cuda: model.backend=te")


@pytest.mark.parametrize("overrides,missing,expected,needle", [
    # step by step down the fallbacks
    (["precision=bf16"], {"fa4": False}, ("te", "te", True, False), "FlashAttention 4 not installed: TE's cuDNN"),
    (["precision=bf16"], {"te": "ImportError: no te", "fa4": False}, ("torch", "sdpa", False, False),
     "Transformer Engine does not import (ImportError)"),
    (["precision=bf16"], {"te": "ImportError: no te"}, ("torch", "flash", False, False), "a slot of the TE kernel"),
    (["precision=bf16"], {"quack": "no quack"}, ("te", "flash", False, False), "quack cannot run here"),
    # what the run needs
    (["precision=fp32"], {}, ("te", "te", False, False), "precision=fp32: TE's cuDNN attention"),
    (["precision=fp8"], {}, ("te", "te", False, False), "precision=fp8: TE's attention"),
    (["precision=bf16", "objective=bd3lm"], {}, ("te", "sdpa", True, False), "block-diffusion mask"),
    (["precision=bf16", "objective=ar"], {}, ("te", "flash", True, False), "FlashAttention 4 imports"),
    (["precision=bf16", "model=moe-tiny"], {}, ("te", "flash", False, False), "MoE layers"),
    (["precision=bf16", "model=moe-tiny", "parallel=tp2"], {}, ("torch", "flash", False, False),
     "MoE layers under parallel.tp>1"),
    (["precision=bf16", "parallel=tp2"], {}, ("te", "flash", False, False), "parallel.tp>1"),
    (["precision=bf16", "parallel=pp2"], {}, ("te", "flash", True, False), "quack on a Hopper"),
    (["precision=bf16", "parallel=cp2"], {}, ("te", "te", True, False), "parallel.cp>1 runs inside te."),
    (["precision=bf16", "parallel=cp2", "model.compile=true"], {}, ("torch", "sdpa", False, False),
     "parallel.cp>1 patches SDPA"),
    (["precision=bf16", "model.compile=true"], {}, ("torch", "flash", False, False), "model.compile=true"),
    (["precision=bf16", "train.cuda_graphs=true"], {}, ("te", "flash", False, False), "train.cuda_graphs=true"),
    (["precision=bf16", "lora=attn_mlp"], {}, ("te", "flash", False, False), "lora.rank>0 (quack's kernels"),
    (["precision=bf16", "lora=attn_mlp", "parallel=tp2"], {}, ("torch", "flash", False, False),
     "LoRA under parallel.tp>1 runs on the torch kernels"),
])
def test_fallbacks_and_run_needs(machine, overrides, missing, expected, needle):
    machine.update(missing)
    values, choice = choose("model=tiny", *overrides)
    assert values == expected
    assert needle in choice.line


def test_cpu_resolves_to_torch_and_sdpa(machine):
    values, choice = choose("model=1.7b", "precision=bf16", device=torch.device("cpu"))
    assert values == ("torch", "sdpa", False, False)
    assert choice.line.startswith("kernels auto on cpu: model.backend=torch")


def test_explicit_values_are_kept(machine):
    values, choice = choose("precision=bf16", "model.backend=torch", "model.attention_backend=flex",
                            "model.fused_mlp=false")
    assert values == ("torch", "flex", False, False)
    assert set(choice.why) == {"fused_mlp_autotune"}  # only what was auto is explained
    values, choice = choose("model.backend=te", "model.attention_backend=sdpa", "model.fused_mlp=true",
                            "model.fused_mlp_autotune=false", device=torch.device("cpu"))
    assert values == ("te", "sdpa", True, False) and choice.line == ""
    cfg = compose_run(["precision=bf16"], auto=True)
    first = ak.choose_kernels(cfg, CUDA).line
    assert ak.choose_kernels(cfg, CUDA).line == "" and cfg.model.auto_reason == first  # once: a no-op after


def _experts(*overrides, device=CUDA, **kw):
    cfg = compose_run(["model=moe-tiny", *overrides], auto=True)
    choice = ak.choose_kernels(cfg, device, **kw)
    assert choice.values[ak.MOE_KEY] is cfg.model.moe.fused_experts  # written back, a bool
    return cfg.model.moe.fused_experts, choice.why.get(ak.MOE_KEY)


@pytest.mark.parametrize("overrides,kw,missing,needle", [
    (["parallel=fsdp"], {}, {}, "no FP32 main_grad accumulation"),
    (["parallel=cp2"], {}, {}, "no FP32 main_grad accumulation"),
    (["parallel=pp2"], {}, {}, "no FP32 main_grad accumulation"),
    (["lora=attn_mlp"], {}, {}, "no FP32 main_grad accumulation"),
    (["model.fuse_wgrad_accumulation=false"], {}, {}, "no FP32 main_grad accumulation"),
    (["precision=fp8"], {}, {}, "precision=fp8: quack's grouped GEMMs here are BF16"),
    (["precision=fp8", "model.moe.fp8_experts=true"], {}, {}, "precision=fp8"),
    (["model.backend=torch"], {}, {}, "the TE kernel set's"),
    ([], {}, {"quack": "quack is not installed"}, "quack cannot run here"),
    ([], {"forward_only": True}, {}, "sampling and evaluation"),
    ([], {"device": torch.device("cpu")}, {}, "cpu: quack runs CUDA kernels only"),
])
def test_fused_experts_fall_back_to_the_grouped_gemm_experts(machine, overrides, kw, missing, needle):
    machine.update(missing)
    fused, why = _experts("precision=bf16", *overrides, **kw)
    assert fused is False and needle in why


def test_fused_experts_chosen_for_a_one_gpu_bf16_moe_run(machine):
    fused, why = _experts("precision=bf16")
    assert fused is True and why == "quack's grouped GEMMs, SwiGLU and main_grad in their epilogues"
    cfg = compose_run(["model=moe-tiny", "precision=bf16"], auto=True)
    assert ak.choose_kernels(cfg, CUDA).line.endswith(
        "model.moe.fused_experts=true (quack's grouped GEMMs, SwiGLU and main_grad in their epilogues)")
    # explicit values stay (and are checked by difflm.config.validate.check_moe_kernels); dense models say nothing
    assert _experts("precision=bf16", "model.moe.fused_experts=false") == (False, None)
    assert _experts("precision=bf16", "model.moe.fp8_experts=true", "model.moe.fused_experts=true")[0] is True
    values, choice = choose("model=1.7b", "precision=bf16")
    assert ak.MOE_KEY not in choice.values and "fused_experts" not in choice.line
    with pytest.raises(DifflmError, match="model.moe.fused_experts='yes' is not one of: auto, true, false"):
        _experts("model.moe.fused_experts=yes")


def test_build_model_refuses_unchosen_fused_experts():
    from difflm.model import build_model, resolve_model_config

    cfg = compose_run(["model=moe-tiny"], auto=True).model
    resolve_model_config(cfg, 128)
    cfg.update(ak.CPU_CHOICE)
    with pytest.raises(DifflmError, match="model.moe.fused_experts=auto is chosen for a device before the model is built"):
        build_model(cfg, causal=False, device=torch.device("cpu"), seed=0)
    model = build_model(ak.cpu_kernels(cfg), causal=False, device=torch.device("cpu"), seed=0)
    assert all(not layer.mlp.experts.fused for layer in model.layers if hasattr(layer.mlp, "experts"))


def test_fp8_without_te_is_one_line(machine):
    machine["te"] = "ImportError: No module named 'transformer_engine'"
    with pytest.raises(DifflmError, match="precision=fp8 runs through Transformer Engine, which could not be imported"):
        choose("precision=fp8")


def test_explicit_value_refused_in_one_line():
    from difflm.config.validate import check_run

    with pytest.raises(DifflmError, match="model.attention_backend=flash runs CUDA kernels only"):
        check_run(compose_run(["model.attention_backend=flash", "device=cpu"], auto=True))
    with pytest.raises(DifflmError, match="model.backend='tee' is not one of: auto, torch, te"):
        check_run(compose_run(["model.backend=tee"], auto=True))
    with pytest.raises(DifflmError, match="model.fused_mlp='yes' is not one of: auto, true, false"):
        check_run(compose_run(["model.fused_mlp=yes"], auto=True))


def test_sampling_chooses_again_for_its_device(machine):
    from difflm.generate import apply_kernel_overrides

    cfg = compose_run(["precision=bf16"], auto=True)
    ak.choose_kernels(cfg, CUDA)  # trained on a GPU: te + flash
    apply_kernel_overrides(cfg, None, torch.device("cpu"))
    assert (cfg.model.backend, cfg.model.attention_backend) == ("torch", "sdpa")
    cfg = compose_run(["precision=bf16", "model.backend=te"], auto=True)  # an explicit choice stays, and is refused on a CPU
    ak.choose_kernels(cfg, CUDA)
    with pytest.raises(DifflmError, match="the run's model.backend=te needs CUDA"):
        apply_kernel_overrides(cfg, None, torch.device("cpu"))
    cfg = compose_run(["model=moe-tiny", "precision=bf16"], auto=True)
    ak.choose_kernels(cfg, CUDA)  # trained with the fused experts that auto chose
    assert cfg.model.moe.fused_experts is True
    apply_kernel_overrides(cfg, None, CUDA)  # sampling on the same GPU: the grouped-GEMM experts
    assert cfg.model.moe.fused_experts is False


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cpu_run_with_defaults_trains_and_records_the_choice(tmp_path):
    out = run_cli("difflm.train", "model=tiny", "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
                  "train.sample_at_end=false", "data.seq_len=32", "train.global_batch_size=2",
                  "train.micro_batch_size=2", f"run.dir={tmp_path}/run")
    assert out.stdout.splitlines()[0].startswith("difflm: kernels auto on cpu: model.backend=torch")
    from omegaconf import OmegaConf

    saved = OmegaConf.load(tmp_path / "run" / "config.yaml").model
    assert (saved.backend, saved.attention_backend, saved.fused_mlp, saved.fused_mlp_autotune) == (
        "torch", "sdpa", False, False)
    assert saved.auto_reason.startswith("kernels auto on cpu")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cfg_job_shows_the_choice_as_yaml_comments():
    out = run_cli("difflm.train", "--cfg", "job", "model=tiny", "precision=bf16")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-5].startswith("# kernels auto on cpu: model.backend=torch")
    assert lines[-4:] == ["#   model.backend: torch", "#   model.attention_backend: sdpa", "#   model.fused_mlp: false",
                          "#   model.fused_mlp_autotune: false"]
    import yaml

    assert yaml.safe_load(out.stdout)["model"]["backend"] == "auto"  # the printed config itself is unchanged
