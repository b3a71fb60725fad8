"""scripts/benchmark.py on CPU (reference + torch backend, model=tiny) and the MFU arithmetic by hand."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch
from conftest import load_script, script_usage_error

from difflm.config.schema import ModelConfig
from difflm.errors import DifflmError
from difflm.model.transformer import Transformer
from difflm.training import flops


def cli_error(bench, capsys, *argv) -> str:
    """The one-line usage error of ``benchmark.py`` (its ``cli``) for ``argv``."""
    return script_usage_error(bench, capsys, *argv, entry="cli")


def tiny(vocab=50304, **kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4, ffn_hidden_size=512, head_dim=32,
                vocab_size=vocab, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kv,qk_norm", [(4, True), (2, False)])
def test_mfu_formula_by_hand(kv, qk_norm):
    cfg = tiny(num_kv_heads=kv, qk_norm=qk_norm)
    L, d, h, hd, f, V, S = 4, 128, 4, 32, 512, 50304, 256
    per_layer = (d + (h + 2 * kv) * hd * d  # qkv: fused RMSNorm scale + weight
                 + (2 * hd if qk_norm else 0)  # q/k norms
                 + h * hd * d  # output projection
                 + d + 2 * f * d + d * f)  # MLP: RMSNorm scale, SwiGLU fc1 (gate + up), fc2
    n_hand = L * per_layer + d + V * d  # final norm + LM head (the input embedding is not counted)
    model = Transformer(cfg)
    assert model.num_params() == n_hand
    assert model.num_params(exclude_embedding=False) == n_hand + V * d
    fpt = flops.flops_per_token(n_hand, L, d, S)
    assert fpt == 6 * n_hand + 12 * L * d * S
    # 1e5 tokens/s on a 989 TFLOP/s part
    assert flops.mfu(1e5, fpt, 989e12) == pytest.approx(1e5 * (6 * n_hand + 12 * L * d * S) / 989e12, rel=1e-12)
    assert flops.mfu(1e5, fpt, None) is None
    # the benchmark's eager reference has the same non-embedding parameter count
    bench = load_script("benchmark")
    assert bench.ReferenceTransformer(cfg, causal=False).num_params() == n_hand


def test_peak_is_the_bf16_datasheet_figure(monkeypatch):
    assert flops.peak_flops(torch.device("cpu")) is None
    for name, tflops in (("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert flops.peak_flops(torch.device("cuda")) == tflops * 1e12


def test_parse_variant():
    bench = load_script("benchmark")
    assert bench.parse_variant("te-fp8: model.backend=te precision=fp8") == ("te-fp8", ["model.backend=te", "precision=fp8"])
    assert bench.parse_variant("plain:") == ("plain", [])
    with pytest.raises(DifflmError, match="NAME: override"):
        bench.parse_variant("model.backend=te")


def test_reference_block_is_a_standard_llama_block():
    """Reference and difflm model compute the same function from the same weights (fp32, bidirectional)."""
    bench = load_script("benchmark")
    cfg = tiny(vocab=64, num_kv_heads=2)
    ours = Transformer(cfg)
    ours.init_weights(0)
    ref = bench.ReferenceTransformer(cfg, causal=False)
    sd = ours.state_dict()
    h, kv, hd = 4, 2, 32
    with torch.no_grad():
        ref.embedding.weight.copy_(sd["embedding.weight"])
        ref.output.weight.copy_(sd["output.weight"])
        ref.norm.weight.copy_(sd["final_norm.weight"])
        for i, blk in enumerate(ref.layers):
            p = f"layers.{i}."
            w = sd[p + "attention.qkv.weight"].view(kv, h // kv + 2, hd, -1)
            blk.q.weight.copy_(w[:, : h // kv].reshape(h * hd, -1))
            blk.k.weight.copy_(w[:, -2].reshape(kv * hd, -1))
            blk.v.weight.copy_(w[:, -1].reshape(kv * hd, -1))
            blk.o.weight.copy_(sd[p + "attention.proj.weight"])
            blk.attn_norm.weight.copy_(sd[p + "attention.qkv.layer_norm_weight"])
            blk.q_norm.weight.copy_(sd[p + "attention.q_norm.weight"])
            blk.k_norm.weight.copy_(sd[p + "attention.k_norm.weight"])
            blk.mlp_norm.weight.copy_(sd[p + "mlp.layer_norm_weight"])
            gate, up = sd[p + "mlp.fc1_weight"].chunk(2)
            blk.w1.weight.copy_(gate)
            blk.w3.weight.copy_(up)
            blk.w2.weight.copy_(sd[p + "mlp.fc2_weight"])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref(ids), ours(ids), atol=1e-4, rtol=1e-4)


def test_benchmark_runs_reference_and_torch_backend_on_cpu(tmp_path, capsys, monkeypatch):
    bench = load_script("benchmark")
    out = tmp_path / "bench.json"
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path / "tmp"))  # where it makes its row-log folder
    (tmp_path / "tmp").mkdir()
    start = time.perf_counter()
    result = bench.main(["model=tiny", "data.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu",
                         "--steps", "1", "--warmup", "0", "--batches", "2", "--json", str(out),
                         "--variant", "torch: ", "--variant", "te: model.backend=te"])
    elapsed = time.perf_counter() - start
    assert elapsed < 120, elapsed  # ~15 s on an idle 2-core CI runner; a generous bound for busy ones
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["reference", "torch", "te"]
    # rows in one process write no log: the folder is gone (torch's Inductor may put its cache beside it, as it does
    # in any temporary directory where it is first imported)
    assert [p for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []
    ref, ours = rows["reference"], rows["torch"]
    for r in (ref, ours):
        assert "error" not in r, r
        # CPU rows in one process: no per-row memory figure (ru_maxrss is the process's lifetime peak)
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) and r["peak_mem_gib"] is None
        # one optimizer step = 2 accumulated micro-batches of 2 x 16 tokens
        assert r["step_ms"] == pytest.approx(4 * 16 / r["tokens_per_s"] * 1e3, rel=1e-9)
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        # same dimensions, same N, same FLOPs per token
        assert r["flops_per_token"] == 6 * r["n_params_non_embedding"] + 12 * 4 * 128 * 16
    assert ref["n_params_non_embedding"] == ours["n_params_non_embedding"] == Transformer(
        tiny(vocab=result["vocab_size"])).num_params()
    assert ref["ratio_to_reference"] == 1.0 and result["accumulation"] == 2
    assert ours["ratio_to_reference"] == pytest.approx(ours["tokens_per_s"] / ref["tokens_per_s"])
    # a full-vocabulary CE at initialisation is about ln(V) nats
    assert abs(ref["loss"] - math.log(result["vocab_size"])) < 0.5
    assert "model.backend=te" in rows["te"]["error"]  # refused with the config's own message, not a crash
    assert json.loads(out.read_text())["rows"][1]["tokens_per_s"] == ours["tokens_per_s"]
    printed = capsys.readouterr().out
    assert "reference" in printed and "tokens/s" in printed and "te: failed: " in printed
    assert printed.splitlines()[0].split()[-4:] == ["-", "1.000", "-", f"{ref['loss']:.3f}"]  # mem GiB: "-"


def test_bd3lm_flops_count_the_mask_and_both_halves():
    """12 (N - N_head) + 6 N_head + 12 L d (S + block): the linear layers over 2S tokens (head over S), attention
    over the block-causal mask's nonzero (query, key) pairs, per data token."""
    from difflm.model.masks import block_causal_mask

    n, layers, d, vocab, s, block = 10_000_000, 4, 128, 512, 64, 16
    mask = block_causal_mask(s, block)
    pairs = int(mask.sum())
    assert pairs == s * s + s * block  # of (2S)^2 = 4 S^2 dense
    head = vocab * d
    per_sequence = 6 * (n - head) * 2 * s + 6 * head * s + 12 * d * layers * pairs
    assert flops.bd3lm_flops_per_token(n, layers, d, vocab, s, block) == per_sequence / s
    # block = S: each half attends within itself, so twice MDLM's FLOPs at length S less one LM head
    assert flops.bd3lm_flops_per_token(n, layers, d, vocab, s, s) == 2 * flops.flops_per_token(n, layers, d, s) - 6 * head


def test_objective_flops_dispatch(fast_cfg):
    from difflm.model import resolve_model_config

    for overrides, want in (((), "palm"), (("objective=ar",), "palm"), (("objective=bd3lm", "objective.block_size=8"), "bd3lm")):
        cfg = fast_cfg(*overrides)
        resolve_model_config(cfg.model, 512)
        m = cfg.model
        got = flops.objective_flops_per_token(cfg.objective, m, 1000, cfg.data.seq_len)
        if want == "palm":
            assert got == flops.flops_per_token(1000, m.num_layers, m.hidden_size, cfg.data.seq_len)
        else:
            assert got == flops.bd3lm_flops_per_token(1000, m.num_layers, m.hidden_size, 512, cfg.data.seq_len, 8)


def test_plan_orders_rows_by_megadlms_shape(capsys, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a default log directory would be made
    bench = load_script("benchmark")
    out = bench.main(["model=tiny", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
                      "device=cpu", "--no-reference", "--plan", "--megadlms", "/nonexistent",
                      "--megadlms-shapes", "32x4,64x8", "--variant", "a: ", "--variant", "b: data.seq_len=64 train.global_batch_size=8",
                      "--variant", "c: objective=bd3lm objective.block_size=8", "--variant", "bad: model.nope=1"])
    assert out["plan"] == ["megadlms-bf16-s32-gb4", "megadlms-fp8-s32-gb4", "a", "megadlms-bf16-s64-gb8",
                           "megadlms-fp8-s64-gb8", "b", "c", "bad"]
    printed = capsys.readouterr().out
    assert "bad: failed: " in printed and "--only c --json" in printed and "objective=bd3lm" in printed
    assert list(tmp_path.iterdir()) == []  # a plan writes nothing, not even an empty log directory


def test_overrides_after_flags_reach_the_rows(capsys, tmp_path, monkeypatch):
    """Overrides after the flags (bash scripts/bench_suites.sh megadlms / profile put train.micro_batch_size after
    --batches) are the base run's, as those before them."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench = load_script("benchmark")
    out = bench.main(["model=tiny", "data.seq_len=32", "device=cpu", "--no-reference", "--steps", "2",
                      "train.global_batch_size=4", "--plan", "train.micro_batch_size=2"])
    assert out["plan"] == ["difflm"]
    printed = capsys.readouterr().out
    assert "train.global_batch_size=4" in printed and "train.micro_batch_size=2" in printed


def test_scripts_taking_overrides_parse_them_between_flags():
    """Every script with a positional ``overrides`` list parses it intermixed with its flags (argparse's plain
    parse_args refuses a positional after an option: ``unrecognized arguments``)."""
    import re
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    takers = [f for f in sorted(scripts.glob("*.py")) if re.search(r'add_argument\("overrides", nargs="\*"', f.read_text())]
    assert {f.name for f in takers} >= {"benchmark.py", "layout_check.py", "adaptation_table.py"}
    for f in takers:
        assert ".parse_args(" not in f.read_text(), f"{f.name}: use parse_intermixed_args"


def test_megadlms_rows_follow_the_megadlms_model(capsys, tmp_path, monkeypatch):
    """--megadlms-model PRESET: MegaDLMs' rows run that preset (composed with the base overrides), named
    megadlms-moe-... for a mixture of experts; without it they follow the base overrides' model=."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench = load_script("benchmark")
    small = ["model=tiny", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu",
             "model.moe.num_shared_experts=0", "--no-reference", "--plan", "--megadlms", "/nonexistent"]
    out = bench.main([*small, "--megadlms-model", "moe-tiny", "--variant", "moe: model=moe-tiny", "--variant", "d: "])
    assert out["plan"] == ["megadlms-moe-bf16-s32-gb4", "megadlms-moe-fp8-s32-gb4", "moe", "d"]
    assert "megadlms-moe-bf16-s32-gb4: MegaDLMs S=32 global batch 4 bf16" in capsys.readouterr().out
    base_moe = bench.main(["model=moe-tiny", *small[1:], "--megadlms-precisions", "bf16"])
    assert base_moe["plan"] == ["megadlms-moe-bf16-s32-gb4", "difflm"]
    assert bench.main([*small, "--megadlms-precisions", "bf16"])["plan"] == ["megadlms-bf16-s32-gb4", "difflm"]
    assert list(tmp_path.iterdir()) == []


def test_megadlms_model_it_cannot_express_is_one_line_exit_2(capsys, tmp_path):
    bench = load_script("benchmark")
    small = ["model=tiny", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "device=cpu",
             "--no-reference", "--megadlms", str(tmp_path / "none"), "--log-dir", str(tmp_path / "logs")]
    err = cli_error(bench, capsys, *small, "--megadlms-model", "moe-tiny")  # one shared expert per block
    assert err == ("benchmark.py: error: --megadlms: model=moe-tiny: model.moe.num_shared_experts=1: MegaDLMs' "
                   "Megatron-Core MoE has no equivalent (no shared experts)\n")
    err = cli_error(bench, capsys, *small, "--megadlms-model", "llada2-mini")
    assert err.startswith("benchmark.py: error: --megadlms: model=llada2-mini: model.moe.score_func=")
    err = cli_error(bench, capsys, *small, "--megadlms-model", "moe-tinyy")
    assert err.startswith("benchmark.py: error: model=moe-tinyy is not a model preset")
    assert not (tmp_path / "logs").exists()  # refused before any row ran


def test_megadlms_ratio_only_for_rows_of_its_model():
    """moe-1b-7b and dense-1b share every dense dimension: the MoE MegaDLMs row is compared with the MoE row only."""
    bench = load_script("benchmark")
    from difflm.model import resolve_model_config

    plan = []
    for name, preset in (("dense", "dense-1b"), ("moe", "moe-1b-7b")):
        cfg = bench.compose([f"model={preset}"])
        resolve_model_config(cfg.model, 50304)
        plan.append({"name": name, "kind": "variant", "cfg": cfg})
    assert bench.model_key(plan[0]["cfg"].model)[:-1] == bench.model_key(plan[1]["cfg"].model)[:-1]
    assert bench.model_key(plan[1]["cfg"].model)[-1] == (64, 8, 1024, 0, 0)  # experts, top-k, width, shared, dense
    assert bench.model_key(plan[0]["cfg"].model)[-1] is None
    shape = {"seq_len": 4096, "global_batch": 8, "micro_batch": 1, "precision": "bf16"}
    rows = [{"name": "megadlms-moe-bf16-s4096-gb8", "system": "megadlms", "tokens_per_s": 20000.0, **shape},
            *({"name": n, "system": "difflm", "objective": "mdlm", "tokens_per_s": t, **shape}
              for n, t in (("dense", 50000.0), ("moe", 30000.0)))]
    bench.add_ratios(rows, plan, bench.model_key(plan[1]["cfg"].model))
    assert rows[2]["ratio_to_megadlms"] == 1.5 and "ratio_to_megadlms" not in rows[1]
    rows = [dict(r) for r in rows]
    for r in rows:
        r.pop("ratio_to_megadlms", None)
    bench.add_ratios(rows, plan)  # without a MegaDLMs model: the first row's, as before
    assert rows[1]["ratio_to_megadlms"] == 2.5 and "ratio_to_megadlms" not in rows[2]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_megadlms_rows_and_ratios_in_one_call(tmp_path, capsys):
    """Fake MegaDLMs export (scripts print Megatron's iteration lines under torchrun) next to CPU difflm rows:
    the ratio is difflm tokens/s over MegaDLMs' at the same shape and precision, from this call."""
    from test_megadlms_baseline import make_fake_export

    bench = load_script("benchmark")
    export = make_fake_export(tmp_path / "export")
    result = bench.main(["model=tiny", "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
                         "device=cpu", "precision=bf16", "--steps", "1", "--warmup", "0", "--batches", "2",
                         "--no-reference", "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "b.json"),
                         "--megadlms", str(export), "--megadlms-precisions", "bf16", "--megadlms-timeout", "120",
                         "--variant", "mdlm: ", "--variant", "bd3lm: objective=bd3lm objective.block_size=8"])
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["megadlms-bf16-s32-gb4", "mdlm", "bd3lm"]
    mega, mdlm, bd3 = rows["megadlms-bf16-s32-gb4"], rows["mdlm"], rows["bd3lm"]
    assert "error" not in mega, mega.get("log_tail")
    assert mega["tokens_per_s"] == pytest.approx(4 * 32 / 1.011)  # median of iterations 6..16 of 1000 + i ms
    assert mdlm["ratio_to_megadlms"] == pytest.approx(mdlm["tokens_per_s"] / mega["tokens_per_s"])
    assert "ratio_to_megadlms" not in bd3 and bd3["mdlm_row"] == "mdlm"
    assert bd3["ratio_to_mdlm"] == pytest.approx(bd3["tokens_per_s"] / mdlm["tokens_per_s"])
    n = mdlm["n_params_non_embedding"]
    assert bd3["flops_per_token"] == flops.bd3lm_flops_per_token(n, 4, 128, result["vocab_size"], 32, 8)
    printed = capsys.readouterr().out
    assert f"| 32, 4 | {mega['tokens_per_s'] / 1e3:.1f} k (0.0 %) | - | - | - |" in printed  # no TE rows on a CPU
    assert "tokens/s bd3lm / mdlm" in printed


def test_isolated_row_that_times_out_is_reported(tmp_path, capsys):
    bench = load_script("benchmark")
    result = bench.main(["model=tiny", "data.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2",
                         "device=cpu", "--no-reference", "--isolate", "--row-timeout", "1", "--log-dir", str(tmp_path),
                         "--variant", "slow: "])
    (row,) = result["rows"]
    assert row["error"].startswith("timeout after 1 s") and "tokens_per_s" not in row
    assert "slow: failed: timeout after 1 s" in capsys.readouterr().out


# A model small enough for a few CPU rows in seconds (the LM head is the tokenizer's 50k vocabulary).
SMALL = ["model=tiny", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
         "model.ffn_hidden_size=64", "data.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2",
         "device=cpu", "--steps", "1", "--warmup", "0", "--batches", "1"]


def test_weights_are_seeded_so_rows_and_calls_compare(capsys, tmp_path):
    """Same seed: rows of the same model start from the same weights (fused and unfused cross-entropy are one
    F.cross_entropy on CPU, so their first-step losses are equal) and the same command repeats its losses."""
    bench = load_script("benchmark")
    args = [*SMALL, "--no-reference", "--profile", "fused", "--variant", "fused: model.fused_cross_entropy=true",
            "--variant", "unfused: model.fused_cross_entropy=false"]
    first = bench.main(args)
    losses = {r["name"]: r["loss"] for r in first["rows"]}
    assert set(losses) == {"fused", "unfused"} and math.isfinite(losses["fused"])
    assert losses["fused"] == losses["unfused"]
    assert bench.exit_status(first) == 0
    printed = capsys.readouterr().out
    assert "--- profile: fused (CPU ops; kernel time shares and gpu_busy need CUDA) ---" in printed
    assert "aten::mm" in printed and "kernel time shares {}" not in printed
    # the same command again repeats its losses, and with --json writes the profile beside the table
    assert {r["name"]: r["loss"] for r in bench.main([*args, "--json", str(tmp_path / "b.json")])["rows"]} == losses
    by_shape = (tmp_path / "b_profile_fused.txt").read_text().split("By operator and input shapes:")[1]
    assert "aten::mm" in by_shape and "[[" in by_shape  # operators listed with their input shapes


def test_cpu_memory_is_per_row_only_in_its_own_process():
    bench = load_script("benchmark")
    assert bench.peak_memory_gib(torch.device("cpu"), own_process=False) is None
    assert 0.01 < bench.peak_memory_gib(torch.device("cpu"), own_process=True) < 1024  # this process's RSS


def test_unknown_profile_row_fails_before_any_row_runs(capsys):
    bench = load_script("benchmark")
    err = cli_error(bench, capsys, *SMALL, "--profile", "nosuch,a", "--variant", "a: ", "--variant", "b: ")
    assert err == "benchmark.py: error: --profile nosuch: no such row; the rows are: reference, a, b\n"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_bad_base_override_is_one_line_exit_2(capsys):
    from conftest import REPO

    bench = load_script("benchmark")
    err = cli_error(bench, capsys, "model=tinyy")  # a mistyped preset: named, with the closest, as difflm-train does
    assert err.startswith("benchmark.py: error: model=tinyy is not a model preset; did you mean model=tiny? (presets: ")
    assert ", tiny)" in err and err.count("\n") == 1
    err = cli_error(bench, capsys, "model=tiny", "model.num_layers=1,2")  # Hydra's own message, on one line
    assert err.startswith("benchmark.py: error: Ambiguous value for argument 'model.num_layers=1,2'")
    err = cli_error(bench, capsys, "+model.nosuchkey=1")  # + lets Hydra add any key; the schema check refuses it
    assert err.startswith("benchmark.py: error: +model.nosuchkey: model has no key nosuchkey")
    # the script itself: no Hydra traceback
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "model=tiny", "model.hiden_size=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("benchmark.py: error: model.hiden_size is not a config key; did you mean "
                           "model.hidden_size? (difflm-train --cfg job prints every key)\n")


def test_exit_status_1_when_every_difflm_row_fails(capsys):
    bench = load_script("benchmark")
    # the te backend is refused on a CPU; a variant whose override does not compose fails in the plan
    argv = [*SMALL, "--no-reference", "--variant", "te: model.backend=te", "--variant", "bad: model.nope=1"]
    assert bench.cli(argv) == 1
    printed = capsys.readouterr().out
    assert "te: failed: " in printed and "bad: failed: model.nope is not a config key" in printed
    # a row of the reference alone does not count as a difflm row
    assert bench.exit_status({"rows": [{"name": "reference", "system": "reference", "tokens_per_s": 1.0},
                                       {"name": "te", "system": "difflm", "error": "x"}]}) == 1
    assert bench.exit_status({"plan": ["a"]}) == 0  # --plan runs nothing


def test_kernel_classes_of_a_real_profile():
    """Kernel names from the BF16 + FA4 + fused-MLP 1.7B profile (H200): quack's RMSNorm backward is a
    CuTe DSL kernel ("cutlass" in its name) but not a GEMM, FA4's kernels are attention, and the optimizer's
    ``Optimizer.step#AdamW.step`` range is a user annotation that holds the fused AdamW kernel's time a second time,
    so it is left out of every class."""
    bench = load_script("benchmark")
    rms = "kernel_cutlass_kernel_quackrmsnormRMSNormBackward_object_at__tensorptrbf16gmemalign16o2"
    assert bench.kernel_class(rms) == "other"
    assert bench.kernel_class("void transformer_engine::normalization::rmsnorm_bwd_tuned_kernel<x>") == "other"
    assert bench.kernel_class("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_object_at__TiledMMA") == "gemm"
    assert bench.kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert bench.kernel_class("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90") == \
        "attention"
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata")
    assert bench.kernel_class(adam) == "optimizer"
    assert bench.kernel_class("qkv_heads_bwd_kernel") == "other"
    assert bench.kernel_class("Optimizer.step#AdamW.step") is None
    assert bench.kernel_class("some_range", user_annotation=True) is None
    # the MoE step's dispatch and casts (names of PyTorch's CUDA kernels)
    assert bench.kernel_class("void at::native::index_elementwise_kernel<128, 4, gpu_index_kernel>") == "routing"
    assert bench.kernel_class("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>") == "routing"
    assert bench.kernel_class("void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda>") == \
        "cast/copy"
    assert bench.kernel_class("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == "other"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("args, says", [([], "name a suite"), (["nosuch"], "unknown suite 'nosuch'"),
                                        (["megadlms", "bf61"], "megadlms takes bf16, fp8 or s2048, not 'bf61'"),
                                        (["moe", "megadlm"], "moe takes nothing, megadlms or kernels, not 'megadlm'"),
                                        (["sampling"], "sampling needs RUN_DIR")])
def test_bench_suites_refuses_a_bad_suite_before_setting_up(tmp_path, args, says):
    """bash scripts/bench_suites.sh without a suite, with an unknown one or a bad suite argument: one line on stderr
    naming it and the suites, exit status 2, before the GPU environment is set up ($OUT is not made)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/bench_suites.sh", *args], cwd=root, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "megadlms|trainer|small|moe" in lines[0]


def test_corpus_tokens_are_the_runs_training_windows(tmp_path):
    """``--tokens corpus``: the micro-batches hold the run's first training windows (``data.*``, tokenized as the
    Trainer does), in order, through the objective's noise; asking for more windows than the data holds is refused
    in one line."""
    from conftest import compose_run

    from difflm.data import build_tokenizer

    bench = load_script("benchmark")
    cfg = compose_run(["model=tiny", "data.seq_len=16", "train.micro_batch_size=2"])
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    corpus = bench.corpus_windows(cfg, tok, str(tmp_path))
    seen = []

    class Recorder:
        def noise(self, tokens, ids, key, n):
            seen.append(tokens)
            return tokens.clone()

    batches = bench.make_batches(cfg, Recorder(), len(tok.tokenizer), 3, torch.device("cpu"), 0, corpus)
    assert [tuple(b.shape) for b in batches] == [(2, 16)] * 3
    assert torch.equal(torch.cat(seen), corpus.get(range(6)))
    text = open(cfg.data.path, encoding="utf-8").read()
    assert tok.tokenizer.decode(seen[0][0]) in text and tok.tokenizer.decode(seen[2][1]) in text
    random = bench.make_batches(cfg, Recorder(), len(tok.tokenizer), 1, torch.device("cpu"), 0)
    assert not torch.equal(random[0], batches[0])
    with pytest.raises(DifflmError, match=r"fewer than --batches .* lower --batches"):
        bench.make_batches(cfg, Recorder(), len(tok.tokenizer), len(corpus), torch.device("cpu"), 0, corpus)
