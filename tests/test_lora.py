"""LoRA (difflm.model.lora, docs/lora.md): adapter counts, the base at B = 0, adapters-only optimizer and checkpoints,
exact resume, merged and PEFT exports (routed experts too) against difflm's logits, FSDP2 against one process, the TE
stand-in, refusals. Tensor parallelism: tests/test_lora_parallel.py; pipeline, context and expert parallelism:
tests/test_lora_layouts.py."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import run_cli, spawn_ranks, straight_and_resumed
from fixtures.fake_te_env import fake_te  # noqa: F401  (pytest fixture)
from omegaconf import OmegaConf

from difflm.config.schema import LoraConfig, ModelConfig, MoEConfig
from difflm.errors import DifflmError
from difflm.model import Transformer, build_model, resolve_model_config
from difflm.model.lora import (adapters_disabled, apply_lora, check_lora, check_lora_layout, expected_adapter_count,
                               merged_state_dict, trainable_parameter_count)
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")
LORA = ["lora=attn_mlp", "lora.rank=4", "lora.alpha=8", "objective.random_length_prob=0"]


def model_cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, head_dim=16,
                vocab_size=128)
    base.update(kw)
    return OmegaConf.structured(ModelConfig(**base))


def lora_cfg(**kw):
    return OmegaConf.structured(LoraConfig(**dict(dict(rank=4, alpha=8.0), **kw)))


def ids(b=2, s=16, v=128, seed=0):
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


def randomise_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("targets", [["qkv", "proj", "fc1", "fc2"], ["qkv", "proj"], ["fc2"]])
def test_trainable_count_is_the_formula_and_b_zero_is_the_base(targets):
    cfg = model_cfg()
    model = build_model(cfg, causal=False, device=CPU, seed=0)
    x = ids()
    base = model(x)
    apply_lora(model, lora_cfg(targets=targets), seed=0)
    d, f, qkv_out = 64, 96, (4 + 2 * 2) * 16
    per = {"qkv": 4 * (d + qkv_out), "proj": 4 * (d + d), "fc1": 4 * (d + 2 * f), "fc2": 4 * (f + d)}
    formula = 2 * sum(per[t] for t in targets)  # r (d_in + d_out) per adapted linear, 2 layers
    assert trainable_parameter_count(model) == formula == expected_adapter_count(cfg, lora_cfg(targets=targets))
    assert torch.equal(model(x), base)  # B = 0: exactly the base logits
    randomise_b(model)
    assert not torch.allclose(model(x), base)
    with adapters_disabled(model):
        assert torch.equal(model(x), base)
    assert not torch.allclose(model(x), base)


def test_input_side_adapter_equals_peft_lora_linear():
    """difflm's adapter on an nn.Linear against peft's own lora.Linear with the same factors."""
    from peft.tuners.lora.layer import Linear as PeftLinear
    from peft import LoraConfig as PeftConfig

    cfg = model_cfg()
    model = build_model(cfg, causal=False, device=CPU, seed=0)
    apply_lora(model, lora_cfg(targets=["proj"]), seed=0)
    randomise_b(model)
    proj = model.layers[0].attention.proj
    plain = torch.nn.Linear(64, 64, bias=False)
    plain.weight.data.copy_(proj.weight)
    ref = PeftLinear(plain, "default", r=4, lora_alpha=8, config=PeftConfig(r=4, lora_alpha=8))
    ref.lora_A["default"].weight.data.copy_(proj.lora["weight"].lora_A)
    ref.lora_B["default"].weight.data.copy_(proj.lora["weight"].lora_B)
    x = torch.randn(3, 64)
    torch.testing.assert_close(proj(x), ref(x), atol=1e-6, rtol=1e-6)


def test_moe_policies_freeze_the_router():
    cfg = model_cfg(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, num_shared_experts=1))
    for policy in ("freeze_experts", "adapt_experts"):
        model = build_model(cfg, causal=False, device=CPU, seed=0)
        x = ids()
        base = model(x)
        apply_lora(model, lora_cfg(moe=policy), seed=0)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert not any("router" in n for n in trainable)
        assert any("experts.lora" in n for n in trainable) == (policy == "adapt_experts")
        assert trainable_parameter_count(model) == expected_adapter_count(cfg, lora_cfg(moe=policy))
        torch.testing.assert_close(model(x), base, atol=0, rtol=0)
        randomise_b(model)
        out = model(x)
        merged = build_model(cfg, causal=False, device=CPU, seed=None)
        merged.load_state_dict(merged_state_dict(model))
        torch.testing.assert_close(merged(x), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset,shared,width", [("moe-tiny", 48, 48), ("moe-tiny", 0, 64), ("llada2-tiny", 24, 24)])
@pytest.mark.parametrize("policy", ["freeze_experts", "adapt_experts"])
@pytest.mark.parametrize("targets", [["qkv", "proj", "fc1", "fc2"], ["fc1"], ["fc2"]])
def test_expected_count_is_the_adapters_built(preset, shared, width, policy, targets):
    """The count from the dimensions equals the adapters apply_lora builds: shared experts of their own width
    (model.moe.shared_ffn_hidden_size, 0 = num_shared_experts x the expert width) and the dense first_k_dense blocks
    (llada2-tiny) included, under both lora.moe policies."""
    from conftest import compose_run

    cfg = compose_run([f"model={preset}", f"model.moe.shared_ffn_hidden_size={shared}", "lora=attn_mlp",
                       "lora.rank=4", f"lora.moe={policy}", f"lora.targets=[{','.join(targets)}]"])
    built = cfg.model.copy()
    resolve_model_config(built, 128)  # the count reads the preset as composed (model.head_dim null)
    model = build_model(built, causal=False, device=CPU, seed=0)
    shared_width = [m.shared.fc1_weight.shape[0] // 2 for m in model.modules() if getattr(m, "shared", None) is not None]
    assert set(shared_width) == {width}  # the shared experts' own width, not the routed experts' (64 or 16)
    apply_lora(model, cfg.lora, seed=0)
    assert trainable_parameter_count(model) == expected_adapter_count(built, cfg.lora)
    assert trainable_parameter_count(model) == expected_adapter_count(cfg.model, cfg.lora)  # model.head_dim null


def test_rank_above_the_shared_experts_width_is_refused():
    """lora.rank is checked against every adapted weight's sides, the shared experts' own width among them, also on
    a preset that leaves model.head_dim null."""
    from conftest import compose_run

    cfg = compose_run(["model=moe-tiny", "model.moe.shared_ffn_hidden_size=8", "lora=attn_mlp", "lora.rank=12",
                       "lora.moe=adapt_experts"])
    with pytest.raises(DifflmError, match=r"^lora.rank=12 is above the width of the shared experts' mlp.fc2_weight "
                                          r"\[64, 8\] \(8\)"):
        check_lora(cfg.lora, cfg.model)
    cfg.lora.moe = "freeze_experts"
    check_lora(cfg.lora, cfg.model)  # frozen shared experts are not adapted
    cfg = compose_run(["model=moe-tiny", "lora=attn_mlp", "lora.rank=80"])
    with pytest.raises(DifflmError, match=r"^lora.rank=80 is above the width of attention.qkv \[128, 64\] \(64\)"):
        check_lora(cfg.lora, cfg.model)


@pytest.mark.parametrize("policy", ["freeze_experts", "adapt_experts"])
def test_adapter_count_of_dense_first_blocks_and_shared_width(policy):
    """expected_adapter_count counts what apply_lora adapts in an MoE model with a dense first block (its MLP) and
    shared experts of their own width (llada2-tiny's kind of model)."""
    cfg = model_cfg(num_layers=3, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, num_shared_experts=1,
                                                shared_ffn_hidden_size=24, first_k_dense=1))
    model = build_model(cfg, causal=False, device=CPU, seed=0)
    apply_lora(model, lora_cfg(moe=policy), seed=0)
    r, d, qkv, attn = 4, 64, (4 + 2 * 2) * 16, 4 * 16
    count = 3 * r * (d + qkv + attn + d) + r * (d + 2 * 96) + r * (96 + d)  # attention of 3 blocks, 1 dense MLP
    if policy == "adapt_experts":  # 2 MoE blocks: 4 routed experts of width 16, the shared one of width 24
        count += 2 * (4 * r * (d + 2 * 16 + 16 + d) + r * (d + 2 * 24 + 24 + d))
    assert trainable_parameter_count(model) == count == expected_adapter_count(cfg, lora_cfg(moe=policy))


def test_rank_check_covers_the_shared_experts():
    """With lora.moe=adapt_experts the shared experts are adapted too: a rank above their width is refused."""
    cfg = model_cfg(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, num_shared_experts=1,
                                  shared_ffn_hidden_size=8))
    check_lora(lora_cfg(rank=12, moe="freeze_experts"), cfg)
    with pytest.raises(DifflmError, match="lora.rank=12 is above the width of the shared experts' mlp"):
        check_lora(lora_cfg(rank=12, moe="adapt_experts"), cfg)


def test_te_stand_in_weight_side_adapters(fake_te):
    """TE modules (the CPU stand-in) take the adapter as a weight update: the same logits as the torch kernels'
    input-side adapters with the same factors."""
    from difflm.model.te_kernels import TEKernels

    cfg = model_cfg()
    with pytest.raises(DifflmError, match="model.fuse_wgrad_accumulation=false"):
        apply_lora(Transformer(cfg, causal=False, kernels=TEKernels(cfg, device="meta")), lora_cfg())
    cfg.fuse_wgrad_accumulation = False  # as the trainer builds a LoRA run's TE modules
    ref = build_model(cfg, causal=False, device=CPU, seed=3)
    te = Transformer(cfg, causal=False, kernels=TEKernels(cfg, device="meta"))
    te.to_empty(device=CPU)
    te.load_state_dict(ref.state_dict(), strict=False)
    apply_lora(ref, lora_cfg(), seed=3)
    apply_lora(te, lora_cfg(), seed=3)
    randomise_b(ref)
    randomise_b(te)
    x = ids()
    torch.testing.assert_close(te(x), ref(x), atol=1e-5, rtol=1e-5)
    te(x).sum().backward()
    grads = {n: p.grad for n, p in te.named_parameters() if p.grad is not None}
    assert grads and all(".lora." in n for n in grads)
    with pytest.raises(DifflmError, match="lora.dropout"):
        apply_lora(Transformer(cfg, causal=False, kernels=TEKernels(cfg, device="meta")), lora_cfg(dropout=0.1))


def test_optimizer_and_checkpoint_hold_only_adapters_and_resume_is_bit_exact(fast_cfg, tmp_path):
    common = [*LORA, "train.max_steps=4", "train.save_every=2", "logger.log_every=1", "train.eval_every=0",
              "optim.lr=1e-2"]
    dir_a, dir_b, resumed = straight_and_resumed(fast_cfg, tmp_path, common, stop_at=2)

    def losses(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}

    a, b = losses(dir_a), losses(dir_b)
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]  # bit-exact
    adapters = {id(p) for n, p in resumed.model.named_parameters() if ".lora." in n}
    assert {id(p) for g in resumed.optimizer.param_groups for p in g["params"]} == adapters
    assert {id(p) for p in resumed.optimizer.state} == adapters
    from difflm.checkpoint.store import checkpoint_keys

    keys = checkpoint_keys(dir_b / "checkpoints" / "step_4")
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora." in k for k in model_keys)
    assert all(".lora." in k for k in keys if k.startswith("optim.state."))


def test_base_from_import_merged_and_peft_exports_match_difflm(fast_cfg, tmp_path):
    """A base checkpoint (model only, as difflm-import writes), LoRA trained on it, then difflm-export merged and as
    a PEFT adapter: both give difflm's logits with adapters."""
    from transformers import AutoModelForMaskedLM

    from difflm.checkpoint.store import save_checkpoint
    from difflm.generate import load_run
    from difflm.interop.export import export_checkpoint

    base_cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0", f"run.dir={tmp_path / 'r'}")
    base = Trainer(base_cfg, base_cfg.run.dir, CPU)  # a base model: a full run's weights, saved model-only
    base.train_step()
    save_checkpoint(tmp_path / "r", 0, base.model, None, {"step": 0, "scheduler": {"last_epoch": 0}, "scaler": {},
                                                         "sampler": {}, "torch_rng": torch.get_rng_state()},
                    config=OmegaConf.to_yaml(base_cfg, resolve=True))
    base_sd = {k: v.clone() for k, v in base.model.state_dict().items()}
    del base
    cfg = fast_cfg(*LORA, "train.max_steps=2", "train.save_every=1", "train.eval_every=0", "optim.lr=3e-2",
                   "schedule.warmup_steps=0", "train.keep_last=1", f"run.dir={tmp_path / 'r'}")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    assert trainer.resumed_from == 0 and trainer.lora_base == 0
    for k, v in base_sd.items():  # the base came from step_0
        assert torch.equal(trainer.model.state_dict()[k], v), k
    trainer.fit()
    assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["step_0", "step_2"]  # the base is kept
    _, model, _, step = load_run(str(tmp_path / "r"), None, CPU)
    assert step == 2
    for k, v in base_sd.items():  # base weights unchanged by training
        assert torch.equal(model.state_dict()[k], v), k
    x = ids(v=model.vocab_size if hasattr(model, "vocab_size") else 128)
    with torch.no_grad():
        want = model(x)
        with adapters_disabled(model):
            assert not torch.allclose(model(x), want)  # the adapters moved

    merged_dir, _ = export_checkpoint(tmp_path / "r", tmp_path / "merged")
    peft_dir, _ = export_checkpoint(tmp_path / "r", tmp_path / "peft", lora_format="peft")
    hf = AutoModelForMaskedLM.from_pretrained(str(merged_dir), dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, atol=1e-5, rtol=1e-5)
    from peft import PeftModel

    hf_base = AutoModelForMaskedLM.from_pretrained(str(peft_dir), dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        plain = hf_base(x).logits.clone()
        peft_model = PeftModel.from_pretrained(hf_base, str(peft_dir / "adapter")).eval()
        torch.testing.assert_close(peft_model(x).logits, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, want)


def test_moe_expert_adapters_export_as_a_peft_adapter(fast_cfg, tmp_path):
    """lora.moe=adapt_experts: the routed experts' 3-D adapters go to peft's ParamWrapper expert layout; peft loads them
    onto the exported MoE base with difflm's logits (and the merged export gives them too)."""
    from peft import PeftModel
    from transformers import AutoModelForMaskedLM

    from difflm.generate import load_run
    from difflm.interop.export import export_checkpoint

    cfg = fast_cfg(*LORA, "model=moe-tiny", "lora.moe=adapt_experts", "train.max_steps=2", "train.save_every=2",
                   "train.eval_every=0", "optim.lr=3e-2", "schedule.warmup_steps=0", f"run.dir={tmp_path / 'r'}")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    _, model, _, _ = load_run(str(tmp_path / "r"), None, CPU)
    experts_b = [p for n, p in model.named_parameters() if "experts.lora" in n and n.endswith("lora_B")]
    assert experts_b and all(p.dim() == 3 and p.abs().sum() > 0 for p in experts_b)  # trained expert adapters
    x = ids(v=model.output.weight.shape[0])
    with torch.no_grad():
        want = model(x)
    peft_dir, _ = export_checkpoint(tmp_path / "r", tmp_path / "peft", lora_format="peft")
    merged_dir, _ = export_checkpoint(tmp_path / "r", tmp_path / "merged")
    config = json.loads((peft_dir / "adapter" / "adapter_config.json").read_text())
    assert "layers.0.mlp.experts.fc1_weight" in config["target_parameters"]
    hf_base = AutoModelForMaskedLM.from_pretrained(str(peft_dir), dtype=torch.float32, trust_remote_code=True).eval()
    merged = AutoModelForMaskedLM.from_pretrained(str(merged_dir), dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        plain = hf_base(x).logits.clone()
        torch.testing.assert_close(merged(x).logits, want, atol=1e-5, rtol=1e-5)
        peft_model = PeftModel.from_pretrained(hf_base, str(peft_dir / "adapter")).eval()
        torch.testing.assert_close(peft_model(x).logits, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, want, atol=1e-4)


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import FAST, compose_run

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    cfg = compose_run([*FAST, *LORA, "parallel=fsdp", "train.max_steps=3", "train.save_every=0", "train.eval_every=0",
                       "logger.log_every=1", "optim.lr=1e-2", "lora.targets=[qkv,fc1]", f"run.dir={out}/fsdp",
                       f"data.cache_dir={out}/cache"])
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    torch.save({"losses": None}, Path(out) / f"rank{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_fsdp2_two_ranks_equal_one_process(fast_cfg, tmp_path):
    overrides = [*LORA, "train.max_steps=3", "train.save_every=0", "train.eval_every=0", "logger.log_every=1",
                 "optim.lr=1e-2", "lora.targets=[qkv,fc1]"]
    single = fast_cfg(*overrides, f"run.dir={tmp_path / 'single'}", f"data.cache_dir={tmp_path / 'cache'}")
    Trainer(single, single.run.dir, CPU).fit()
    spawn_ranks(_fsdp_worker, 2, tmp_path)

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("loss") is not None]

    one, two = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=1e-5)  # the adapters' keyed init and updates are the same under FSDP2
    assert one[0] != one[-1]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_refusals_are_one_line(tmp_path):
    from difflm.parallel.mesh import ParallelDims

    moe = model_cfg(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32))  # MoE blocks only
    mlp_only = lora_cfg(targets=["fc1", "fc2"])  # lora.moe=freeze_experts: the MoE blocks get no adapter
    with pytest.raises(DifflmError, match=r"^lora.targets=\['fc1', 'fc2'\] with lora.moe=freeze_experts adapts no "
                                          r"weight .*set lora.moe=adapt_experts$"):
        check_lora(mlp_only, moe)
    moe.moe.first_k_dense = 1  # the dense block takes them: accepted in one process, refused under pipeline stages
    check_lora(mlp_only, moe)
    p = OmegaConf.create({"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2, "cp": 1, "ep": 1})
    with pytest.raises(DifflmError, match=r"^lora.targets=.* and parallel.pp=2: the MoE blocks hold no adapter"):
        check_lora_layout(mlp_only, ParallelDims.from_config(p, 2), moe)
    check_lora_layout(lora_cfg(), ParallelDims.from_config(p, 2), moe)  # attention adapters in every block
    r = run_cli("difflm.train", "model=tiny", "lora=attn_mlp", "lora.targets=[qkv,attn]", f"run.dir={tmp_path / 'x'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("difflm: error: lora.targets=['qkv', 'attn']")
    model = build_model(model_cfg(), causal=False, device=CPU, seed=0)
    apply_lora(model, lora_cfg(), seed=0)
    with pytest.raises(DifflmError, match="already has LoRA adapters"):
        apply_lora(model, lora_cfg(), seed=0)


def test_a_rank_above_the_narrowest_adapted_weight_is_refused():
    """B A has rank at most min(d_in, d_out): a lora.rank above the narrowest adapted weight's side (the width of a
    small model) only adds parameters, and is refused in one line naming that weight and the largest rank it takes.
    Width 64, 4 heads of 16, 2 KV heads: qkv [128, 64], proj [64, 64], fc1 [192, 64], fc2 [64, 96]; the routed
    experts of width 24 narrow it to 24 under lora.moe=adapt_experts only."""
    dense = model_cfg()
    check_lora(lora_cfg(rank=64), dense)
    with pytest.raises(DifflmError, match=r"^lora.rank=65 is above the width of attention.qkv \[128, 64\] \(64\): B A "
                                          r"cannot have a rank above 64, .*; set lora.rank <= 64$"):
        check_lora(lora_cfg(rank=65), dense)
    narrow_mlp = model_cfg(ffn_hidden_size=40)
    with pytest.raises(DifflmError, match=r"^lora.rank=48 is above the width of mlp.fc2_weight \[64, 40\] \(40\)"):
        check_lora(lora_cfg(rank=48), narrow_mlp)
    check_lora(lora_cfg(rank=48, targets=["qkv", "proj"]), narrow_mlp)  # the MLP is not adapted
    moe = model_cfg(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=24))
    check_lora(lora_cfg(rank=32), moe)  # freeze_experts: attention adapters only
    with pytest.raises(DifflmError, match=r"^lora.rank=32 is above the width of the routed experts' "
                                          r"mlp.fc2_weight \[64, 24\] \(24\)"):
        check_lora(lora_cfg(rank=32, moe="adapt_experts"), moe)


def test_benchmark_lora_rows_report_params_optimizer_and_speed(capsys):
    """scripts/benchmark.py with a LoRA row beside a full fine-tuning row in one process (model=tiny, CPU)."""
    from conftest import load_script

    bench = load_script("benchmark")
    result = bench.main(["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
                         "model.ffn_hidden_size=64", "data.seq_len=16", "train.micro_batch_size=2",
                         "train.global_batch_size=2", "--no-reference", "--variant", "full: ", "--variant",
                         "lora: lora=attn_mlp lora.rank=2", "--steps", "1", "--warmup", "0", "--batches", "1"])
    full, lora = result["rows"]
    d, f, qkv_out = 32, 64, 3 * 32
    assert lora["trainable_params"] == 2 * ((d + qkv_out) + 2 * d + (d + 2 * f) + (f + d))
    assert full["trainable_params"] > 100 * lora["trainable_params"]
    # AdamW: two FP32 moments per parameter and a 4-byte step count per tensor (8 factors: 4 targets x A, B)
    assert lora["optimizer_bytes"] == 2 * 4 * lora["trainable_params"] + 4 * 8
    assert full["optimizer_bytes"] > 2 * 4 * full["trainable_params"]
    out = capsys.readouterr().out
    assert "lora: lora.rank=2, trainable 0.00 M" in out and "the tokens/s of full" in out


def test_resuming_adapters_with_other_shapes_is_refused_naming_the_key(fast_cfg, tmp_path):
    """A LoRA checkpoint holds adapters of its lora.rank / lora.targets / lora.moe: a resume with other values is
    refused in one line naming the key and the saved value, not as a mismatch of the model config; lora.alpha may
    change (the resume reports it)."""
    cfg = fast_cfg(*LORA, "train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    where = f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_1'} holds the adapters of"
    for change, message in [("lora.rank=2", f"lora.rank=2: {where} lora.rank=4; resume with lora.rank=4, or start a "
                                            "new run.dir"),
                            ("lora.targets=[qkv,proj]", f"lora.targets=[qkv,proj]: {where} lora.targets="
                                                        "[qkv,proj,fc1,fc2]; resume with lora.targets=[qkv,proj,fc1,fc2]")]:
        with pytest.raises(DifflmError, match="^" + re.escape(message)):
            Trainer(fast_cfg(*LORA, change, "train.max_steps=2", "train.eval_every=0"), cfg.run.dir, CPU)
    resumed = Trainer(fast_cfg(*LORA, "lora.alpha=16", "train.max_steps=2", "train.eval_every=0"), cfg.run.dir, CPU)
    assert resumed.step == 1
