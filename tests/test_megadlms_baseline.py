"""scripts/megadlms_baseline.py on CPU: Megatron log parsing, the median/MFU arithmetic, the flags, the
Transformer Engine / apex shims, and the process handling (a fake MegaDLMs export under torchrun)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, load_script

from difflm.errors import DifflmError
from difflm.training.flops import flops_per_token

SHIM = REPO / "scripts" / "megadlms_shim"
# A MegaDLMs export to check Megatron's own argument parsing against (git-ignored; absent in CI).
EXPORT = Path(os.environ.get("MEGADLMS_EXPORT", REPO / ".megadlms"))


def megatron_line(it: int, ms: float, gb: int = 16, loss: float = 10.8, length: int = 4096) -> str:
    """An iteration line exactly as Megatron-LM's training_log (MegaDLMs' copy) prints it with --log-throughput."""
    return (f" [2026-11-30 12:00:{it:02d}] iteration {it:8d}/{16:8d} | consumed samples: {it * gb:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): 321.2 |"
            f" learning rate: 2.000000E-04 | global batch size: {gb:5d} | lm loss: {loss:.6E} |"
            f" real input length: {float(length):.6E} | loss scale: 1.0 | grad norm: 12.345 |"
            f" number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_parse_and_summarize_by_hand():
    mb = load_script("megadlms_baseline")
    times = [5000.0, 2100.0, 1900.0, 1850.0, 1840.0] + [1800.0 + 7 * (i % 5) for i in range(6, 17)]
    text = "\n".join(["> building GPT model ...", "[after training is done] datetime: ..."]
                     + [megatron_line(i, t, loss=11.0 - 0.01 * i) for i, t in enumerate(times, start=1)])
    iters = mb.parse_iterations(text)
    assert [r.iteration for r in iters] == list(range(1, 17))
    assert iters[5].ms == 1800.0 + 7 * 1 and iters[0].global_batch == 16 and iters[0].input_length == 4096.0
    assert iters[-1].loss == pytest.approx(10.84)
    shape = mb.Shape(seq_len=4096, global_batch=16, micro_batch=4, gpus=1, precision="bf16")
    fpt = flops_per_token(1_629_873_152, 28, 2048, 4096)  # model=1.7b (16 KV heads), S = 4096
    out = mb.summarize(iters, shape, fpt)
    median = statistics.median(times[5:16])  # iterations 6..16
    assert out["step_ms"] == median == 1814.0
    assert out["tokens_per_s"] == pytest.approx(16 * 4096 / 1.814)
    assert out["mfu"] == pytest.approx(16 * 4096 / 1.814 * 12_597_811_200 / 989e12)
    assert out["window_points"] == 11 and "note" not in out and "error" not in out
    two = mb.summarize(iters, mb.Shape(4096, 16, 4, 2, "bf16"), fpt)  # 2 GPUs: the same job, half per GPU
    assert two["tokens_per_s_per_gpu"] == pytest.approx(out["tokens_per_s"] / 2)
    assert two["mfu"] == pytest.approx(out["mfu"] / 2)


def test_summary_refuses_short_logs_and_notes_mismatches():
    mb = load_script("megadlms_baseline")
    shape = mb.Shape(4096, 16)
    short = mb.summarize(mb.parse_iterations("\n".join(megatron_line(i, 1000.0) for i in range(1, 8))), shape, 1e10)
    assert "tokens_per_s" not in short and "only 2 of iterations 6-16 logged (last logged: 7)" in short["error"]
    odd = "\n".join(megatron_line(i, 1000.0, length=4095) for i in range(1, 17))
    out = mb.summarize(mb.parse_iterations(odd), shape, 1e10)
    assert out["tokens_per_s"] == pytest.approx(16 * 4096) and "real input length [4095], expected 4096" in out["note"]
    # a re-run iteration replaces the earlier line of the same number
    rerun = mb.parse_iterations(megatron_line(3, 1000.0) + "\n" + megatron_line(3, 1500.0))
    assert [(r.iteration, r.ms) for r in rerun] == [(3, 1500.0)]


def test_flags_are_megadlms_1_7b_recipe():
    mb = load_script("megadlms_baseline")
    m = mb.model_config("1.7b", 50304)
    assert mb.count_params(m) == 1_629_873_152
    flags = mb.megadlms_flags(m, mb.Shape(4096, 16, 4, 1, "fp8"), iters=16)
    joined = " ".join(flags)
    for part in ("--num-layers 28", "--hidden-size 2048", "--num-attention-heads 16", "--ffn-hidden-size 6144",
                 "--qk-layernorm", "--untie-embeddings-and-output-weights", "--norm-epsilon 1e-06",
                 "--model-running-mode difflm-noshift", "--attention-mask-type no_mask", "--mask-token 50277",
                 "--attention-backend fused", "--mock-data", "--tokenizer-type NullTokenizer",
                 "--use-distributed-optimizer", "--seq-length 4097", "--difflm-varilen-prob 0",
                 "--micro-batch-size 4", "--global-batch-size 16", "--fp8-format hybrid", "--vocab-size 50303",
                 "--log-interval 1", "--train-iters 16"):
        assert part in joined, part
    assert "--group-query-attention" not in flags  # 16 KV heads = MegaDLMs' 1.7B
    assert "--overlap-grad-reduce" not in flags
    m.num_kv_heads = 8
    gqa = mb.megadlms_flags(m, mb.Shape(2048, 32, 4, 2, "bf16"))
    assert gqa[gqa.index("--num-query-groups") + 1] == "8" and "--fp8-format" not in gqa
    assert "--overlap-grad-reduce" in gqa and "--seq-length" in gqa and gqa[gqa.index("--seq-length") + 1] == "2049"
    with pytest.raises(DifflmError, match="multiple of --micro-batch x --gpus"):
        mb.Shape(4096, 6, 4, 1).check()
    with pytest.raises(DifflmError, match="bf16 or fp8"):
        mb.Shape(4096, 16, 4, 1, "fp16").check()


def test_shim_gives_te1_names_over_te2_layout(tmp_path):
    """The sitecustomize hook adds TE 1.x's names to a TE 2.x package layout, only once it is imported."""
    te = tmp_path / "transformer_engine"
    (te / "pytorch" / "attention").mkdir(parents=True)
    (te / "__init__.py").write_text("")
    (te / "pytorch" / "__init__.py").write_text("from transformer_engine.pytorch import attention\n")
    (te / "pytorch" / "utils.py").write_text("class SplitAlongDim:\n    pass\n")
    (te / "pytorch" / "attention" / "__init__.py").write_text("from . import rope\n")  # 2.20: neither name here
    (te / "pytorch" / "attention" / "rope.py").write_text(textwrap.dedent("""
        class FusedRoPEFunc:  # TE 2.20's forward signature
            @staticmethod
            def apply(t, freqs, start_positions=None, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                      cp_size=1, cp_rank=0):
                return (t, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank)
        """))
    code = textwrap.dedent("""
        import sys
        assert "transformer_engine" not in sys.modules  # nothing imported early
        from transformer_engine.pytorch.attention import _SplitAlongDim, FusedRoPEFunc
        from transformer_engine.pytorch.utils import SplitAlongDim
        assert _SplitAlongDim is SplitAlongDim
        print(FusedRoPEFunc.apply("t", "f", "sbhd"))
        print(FusedRoPEFunc.apply("t", "f", "thd", "cu", 2, 1))
        import fused_weight_gradient_mlp_cuda
        """)
    env = dict(os.environ, PYTHONPATH=f"{SHIM}:{tmp_path}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["('t', 'f', None, 'sbhd', False, None, 1, 0)",
                                       "('t', 'f', None, 'thd', False, 'cu', 2, 1)"]


def test_wgrad_stand_in_accumulates_like_apex():
    sys.path.insert(0, str(SHIM))
    try:
        import fused_weight_gradient_mlp_cuda as w
    finally:
        sys.path.remove(str(SHIM))
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 5, generator=g)  # [B, S, in], [B, S, out]
    main = torch.randn(5, 8, generator=g)
    want = main + dy.reshape(-1, 5).t() @ x.reshape(-1, 8)
    w.wgrad_gemm_accum_fp32(x, dy, main)
    torch.testing.assert_close(main, want)
    main16 = torch.zeros(5, 8, dtype=torch.bfloat16)
    w.wgrad_gemm_accum_fp16(x.bfloat16(), dy.bfloat16(), main16)
    torch.testing.assert_close(main16.float(), dy.reshape(-1, 5).t() @ x.reshape(-1, 8), atol=0.1, rtol=0.02)


FAKE_PRETRAIN = '''
import os, sys, time
import fused_weight_gradient_mlp_cuda  # the shim folder is on the path
assert "megadlms_te_compat" in sys.modules  # and its sitecustomize ran
a = sys.argv[1:]
arg = lambda k: a[a.index(k) + 1]
seq, gb, iters = int(arg("--seq-length")) - 1, int(arg("--global-batch-size")), int(arg("--train-iters"))
base = 800.0 if "--fp8-format" in a else 1000.0
mode = os.environ.get("FAKE_MEGADLMS", "ok")
for i in range(1, iters + 1):
    if mode == "crash" and i == 4:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if mode == "hang" and i == 3:
        time.sleep(600)
    print(f" [x] iteration {i:8d}/{iters:8d} | consumed samples: {i * gb:12d} | elapsed time per iteration (ms): "
          f"{base + i:.1f} | global batch size: {gb:5d} | lm loss: 1.0E+01 | real input length: {float(seq):.6E} |",
          flush=True)
'''


def make_fake_export(root: Path) -> Path:
    """A stand-in MegaDLMs export: an entry point printing Megatron's iteration lines, and a Makefile for the
    dataset helpers that only touches its target."""
    (root / "megatron" / "core" / "datasets").mkdir(parents=True)
    (root / "pretrain_difflm.py").write_text(FAKE_PRETRAIN)
    (root / "megatron" / "core" / "datasets" / "helpers.cpp").write_text("// fake\n")
    (root / "megatron" / "core" / "datasets" / "Makefile").write_text("default:\n\ttouch helpers_cpp$(LIBEXT)\n")
    return root


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_run_row_under_torchrun_ok_crash_and_hang(tmp_path, monkeypatch):
    mb = load_script("megadlms_baseline")
    export = make_fake_export(tmp_path / "export")
    shape = mb.Shape(64, 8, 4, 1, "fp8")
    row = mb.run_row(export, shape, preset="tiny", timeout=120, log_dir=tmp_path / "logs")
    assert "error" not in row, row.get("log_tail")
    assert row["step_ms"] == 811.0  # median of iterations 6..16 of 800 + i
    assert row["tokens_per_s"] == pytest.approx(8 * 64 / 0.811)
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 989e12)
    assert "--seq-length 65" in row["command"] and Path(row["log"]).exists()
    assert list((export / "megatron" / "core" / "datasets").glob("helpers_cpp*"))  # built before the launch
    monkeypatch.setenv("FAKE_MEGADLMS", "crash")
    crashed = mb.run_row(export, shape, preset="tiny", timeout=120, log_dir=tmp_path / "logs")
    assert "tokens_per_s" not in crashed and "mfu" not in crashed
    assert mb.format_row(crashed) == ("megadlms-fp8-s64-gb8: failed: exit code 1 (3 iterations logged): "
                                      "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert "iteration        3/" in crashed["log_tail"] and "ChildFailedError" not in crashed["log_tail"]
    monkeypatch.setenv("FAKE_MEGADLMS", "hang")
    hung = mb.run_row(export, shape, preset="tiny", timeout=15, log_dir=tmp_path / "logs")
    assert hung["error"].startswith("timeout after 15 s (") and hung["wall_s"] < 60


def test_missing_export_is_one_line(tmp_path):
    mb = load_script("megadlms_baseline")
    row = mb.run_row(tmp_path / "nothing", mb.Shape(64, 8), preset="tiny")
    assert "no MegaDLMs export there" in row["error"] and "export --git-dir" in row["error"]


def test_dry_run_writes_no_json(tmp_path, capsys):
    """``run --dry-run`` prints the command only: an earlier row in ``--json`` stays as it was."""
    mb = load_script("megadlms_baseline")
    out = tmp_path / "row.json"
    out.write_text('{"tokens_per_s": 1234.5}')
    assert mb.main(["run", "--seq-len", "64", "--global-batch", "8", "--model", "tiny", "--megadlms",
                    str(tmp_path / "none"), "--dry-run", "--json", str(out)]) == 0
    assert out.read_text() == '{"tokens_per_s": 1234.5}'
    assert "pretrain_difflm.py --num-layers 4 " in capsys.readouterr().out


def write_stub_te(root: Path) -> None:
    """A stub Transformer Engine 2.x package under ``root`` for importing Megatron on a CPU: the TE 2.20 layout of
    SplitAlongDim and FusedRoPEFunc (which records its calls), every other TE name a placeholder class."""
    auto = textwrap.dedent("""
        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            cls = type(name, (), {"__init__": lambda self, *a, **k: None})
            globals()[name] = cls
            return cls
        """)
    files = {
        "__init__.py": '__version__ = "2.20.2"\nfrom . import common, pytorch\n',
        "common/__init__.py": "from . import recipe\n",
        "common/recipe.py": "import enum\nclass Format(enum.Enum):\n    E4M3 = 1\n    HYBRID = 2\n" + auto,
        "pytorch/__init__.py": "from . import attention, distributed, utils\n" + auto,
        "pytorch/attention/__init__.py": "from . import rope\n",
        "pytorch/attention/rope.py": "calls = []\nclass FusedRoPEFunc:\n    @staticmethod\n"
                                     "    def apply(*args):\n        calls.append(args)\n        return args[0]\n",
        "pytorch/utils.py": "class SplitAlongDim:\n    @staticmethod\n    def apply(*args):\n        return args\n",
        **{f"pytorch/{name}.py": auto for name in ("distributed", "cpu_offload", "float8_tensor", "fp8", "graph",
                                                   "cpp_extensions")},
        "pytorch/optimizers/__init__.py": auto, "pytorch/module/__init__.py": auto, "pytorch/module/base.py": auto,
    }
    for name, text in files.items():
        path = root / "transformer_engine" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_megatron(code: str, stub_root: Path) -> subprocess.CompletedProcess:
    """``code`` in a child with the environment of MegaDLMs' processes (shim, export) over the stub TE."""
    mb = load_script("megadlms_baseline")
    env = mb.child_env(EXPORT)
    env.update(PYTHONPATH=env["PYTHONPATH"] + f":{stub_root}", WORLD_SIZE="1", RANK="0")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


needs_export = pytest.mark.skipif(not (EXPORT / "megatron" / "training" / "arguments.py").exists(),
                                  reason="no MegaDLMs export (scripts/megadlms_baseline.py export; MEGADLMS_EXPORT)")


@needs_export
def test_megatron_accepts_the_flags(tmp_path):
    """MegaDLMs' own parse_args / validate_args / NullTokenizer / TransformerConfig take our flags, and with the
    shim its TE extension finds FusedRoPEFunc (apply_rope_fusion) and SplitAlongDim, over a stub TE 2.x
    package (CPU: every other TE name is a placeholder class, never called)."""
    mb = load_script("megadlms_baseline")
    write_stub_te(tmp_path)
    flags = mb.megadlms_flags(mb.model_config("1.7b", 50304), mb.Shape(4096, 16, 4, 1, "fp8"))
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.argv = ["pretrain_difflm.py"] + {flags!r}
        from megatron.training.arguments import parse_args, validate_args, core_transformer_config_from_args
        from megatron.training.tokenizer.tokenizer import build_tokenizer
        from custom_args.difflm import extra_args_provider
        args = parse_args(extra_args_provider)
        validate_args(args, {{"tokenizer_type": "HuggingFaceTokenizer"}})
        build_tokenizer(args)
        cfg = core_transformer_config_from_args(args)
        import megatron.core.extensions.transformer_engine as ext
        import megatron.core.tensor_parallel.layers as layers
        from transformer_engine.pytorch.attention import rope
        ext.fused_apply_rotary_pos_emb("t", "f")
        print("RESULT", args.seq_length, args.padded_vocab_size, cfg.num_query_groups, cfg.fp8, cfg.apply_rope_fusion,
              cfg.gradient_accumulation_fusion, layers._grad_accum_fusion_available, ext.SplitAlongDim is not None,
              rope.calls[-1][2:], args.model_running_mode, args.attention_mask_type, args.difflm_varilen_prob)
        """)
    out = run_megatron(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    assert result.split(" ", 1)[1] == ("4097 50304 16 hybrid True True True True (None, 'sbhd', False, None, 1, 0) "
                                       "difflm-noshift no_mask 0.0")


# ------------------------------------------------------------------ mixture of experts

DENSE_1P7B_FLAGS = [  # model=1.7b at S 4096, global batch 16, micro-batch 4, one GPU, BF16: the dense row's command
    "--num-layers", "28", "--hidden-size", "2048", "--num-attention-heads", "16", "--kv-channels", "128",
    "--ffn-hidden-size", "6144", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-06",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--disable-bias-linear", "--attention-dropout",
    "0.0", "--hidden-dropout", "0.0", "--attention-softmax-in-fp32", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--seq-length", "4097", "--max-position-embeddings", "4097",
    "--init-method-std", "0.02", "--qk-layernorm", "--untie-embeddings-and-output-weights", "--model-running-mode",
    "difflm-noshift", "--base-model", "vanilla", "--mask-token", "50277", "--attention-mask-type", "no_mask",
    "--difflm-varilen-prob", "0", "--attention-backend", "fused", "--micro-batch-size", "4", "--global-batch-size",
    "16", "--train-iters", "16", "--lr", "2e-4", "--min-lr", "2e-5", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--bf16",
    "--use-distributed-optimizer", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50303", "--eval-iters", "0",
    "--eval-interval", "160", "--log-interval", "1", "--log-throughput", "--seed", "1234",
]

MOE_1B_7B_FLAGS = [  # model=moe-1b-7b (OLMoE-1B-7B): what follows the model flags of its dense twin
    "--num-experts", "64", "--moe-ffn-hidden-size", "1024", "--moe-router-topk", "8", "--moe-router-type", "topk",
    "--moe-router-pre-softmax", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.001", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
    "--expert-model-parallel-size", "1",
]


def test_dense_flags_are_unchanged():
    mb = load_script("megadlms_baseline")
    m = mb.model_config("1.7b", 50304)
    assert mb.megadlms_flags(m, mb.Shape(4096, 16, 4, 1, "bf16"), iters=16) == DENSE_1P7B_FLAGS
    assert mb.moe_flags(m) == [] and not mb.is_moe(m)
    assert mb.row_name(mb.Shape(4096, 16), m) == "megadlms-bf16-s4096-gb16" == mb.row_name(mb.Shape(4096, 16))


def test_moe_1b_7b_flags():
    """moe-1b-7b: the MoE flags right after the model flags, everything else as for dense-1b (the same 16 x 2048
    blocks and attention; its unused ffn_hidden_size 8192 is dense-1b's)."""
    mb = load_script("megadlms_baseline")
    shape = mb.Shape(4096, 8, 1, 1, "bf16")
    m = mb.model_config("moe-1b-7b", 50304)
    flags = mb.megadlms_flags(m, shape)
    assert mb.moe_flags(m) == MOE_1B_7B_FLAGS
    at = flags.index("--untie-embeddings-and-output-weights") + 1
    assert flags[at:at + len(MOE_1B_7B_FLAGS)] == MOE_1B_7B_FLAGS
    assert flags[:at] + flags[at + len(MOE_1B_7B_FLAGS):] == mb.megadlms_flags(mb.model_config("dense-1b", 50304),
                                                                               shape)
    for absent in ("--moe-expert-capacity-factor", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
                   "--moe-router-topk-scaling-factor", "--moe-use-legacy-grouped-gemm"):
        assert absent not in flags  # no token dropping, no shared experts, every block MoE, weights unscaled
    assert mb.row_name(shape, m) == "megadlms-moe-bf16-s4096-gb8"
    m.moe.norm_topk_prob = True  # renormalised top-k = Megatron's softmax over the k chosen logits
    assert "--moe-router-pre-softmax" not in mb.moe_flags(m)
    m.moe.z_loss_coeff = 0.0
    assert "--moe-z-loss-coeff" not in mb.moe_flags(m)


def test_moe_flops_count_the_active_parameters_as_difflm():
    """N of a MegaDLMs MoE row = difflm's active count (num_params - moe_inactive_params, what difflm's trainer and
    benchmark use), so the two MFUs compare."""
    mb = load_script("megadlms_baseline")
    from difflm.config.compose import compose_train_config
    from difflm.model import build_model, resolve_model_config
    from difflm.model.moe import moe_inactive_params
    from difflm.training.flops import objective_flops_per_token

    m = mb.model_config("moe-1b-7b", 50304)
    inactive = 16 * (64 - 8) * 3 * 2048 * 1024  # 16 MoE blocks x 56 experts a token skips x SwiGLU 3 d f
    assert moe_inactive_params(m) == inactive == 5_637_144_576
    assert mb.count_params(m, active=False) == 6_816_077_824
    assert mb.count_params(m) == 6_816_077_824 - inactive == 1_178_933_248
    row = mb.run_row(Path("/nonexistent"), mb.Shape(4096, 8, 1, 1, "bf16"), model_cfg=m, dry_run=True)
    assert row["name"] == "megadlms-moe-bf16-s4096-gb8" and "error" not in row
    assert row["n_params_non_embedding"] == 1_178_933_248 and row["n_params_non_embedding_total"] == 6_816_077_824
    assert row["flops_per_token"] == 6 * 1_178_933_248 + 12 * 16 * 2048 * 4096
    # difflm's own count for its rows (scripts/benchmark.py: model.num_params() - moe_inactive_params)
    cfg = compose_train_config(["model=moe-1b-7b", "data.seq_len=4096"], device=torch.device("cpu"))
    resolve_model_config(cfg.model, 50304)
    n = build_model(cfg.model, causal=False, device=torch.device("meta"), seed=None).num_params()
    difflm_n = n - moe_inactive_params(cfg.model)
    assert row["flops_per_token"] == objective_flops_per_token(cfg.objective, cfg.model, difflm_n, 4096)
    dense = mb.run_row(Path("/nonexistent"), mb.Shape(4096, 8, 1, 1, "bf16"), preset="dense-1b", dry_run=True)
    assert "n_params_non_embedding_total" not in dense and dense["name"] == "megadlms-bf16-s4096-gb8"
    assert dense["n_params_non_embedding"] == mb.count_params(mb.model_config("dense-1b", 50304), active=False)


@pytest.mark.parametrize("preset,override,message", [
    ("llada2-mini", None, "model.moe.score_func=sigmoid: MegaDLMs' Megatron-Core MoE has no equivalent (softmax "
                          "router scores only)"),
    ("moe-tiny", None, "model.moe.num_shared_experts=1: MegaDLMs' Megatron-Core MoE has no equivalent (no shared "
                       "experts)"),
    ("moe-1b-7b", ("capacity_factor", 1.25), "model.moe.capacity_factor=1.25: MegaDLMs' Megatron-Core MoE has no "
                                             "equivalent (no token dropping)"),
    ("moe-1b-7b", ("bias_update_rate", 0.001), "model.moe.bias_update_rate=0.001: MegaDLMs' Megatron-Core MoE has no "
                                               "equivalent (no auxiliary-loss-free bias)"),
    ("moe-1b-7b", ("first_k_dense", 1), "model.moe.first_k_dense=1: MegaDLMs' Megatron-Core MoE has no equivalent "
                                        "(every block MoE)"),
    ("moe-1b-7b", ("balance_over", "global_batch"), "model.moe.balance_over=global_batch: MegaDLMs' Megatron-Core MoE "
                                                    "has no equivalent (per-micro-batch load balancing only)"),
])
def test_moe_without_an_equivalent_is_refused_in_one_line(preset, override, message):
    mb = load_script("megadlms_baseline")
    m = mb.model_config(preset, 50304)
    if override:
        setattr(m.moe, *override)
    with pytest.raises(DifflmError) as err:
        mb.megadlms_flags(m, mb.Shape(4096, 8, 1, 1, "bf16"))
    assert str(err.value) == message
    row = mb.run_row(Path("/nonexistent"), mb.Shape(4096, 8, 1, 1, "bf16"), model_cfg=m, dry_run=True)
    assert row["error"] == message and "command" not in row


ARGS_PROVIDER = '''
def extra_args_provider(parser):
    """difflm arguments."""
    group = parser.add_argument_group(title="difflm")
    group.add_argument("--model-running-mode", type=str, default="difflm-noshift")
    return parser
'''


def test_shim_adds_moe_router_type_to_megadlms_parser(tmp_path):
    """MegaDLMs' pretrain_difflm.py reads args.moe_router_type, which no parser of it defines: the shim's hook adds
    --moe-router-type to custom_args.difflm's extra_args_provider when that module is imported, once."""
    (tmp_path / "custom_args").mkdir()
    (tmp_path / "custom_args" / "__init__.py").write_text("")
    (tmp_path / "custom_args" / "difflm.py").write_text(ARGS_PROVIDER)
    code = textwrap.dedent("""
        import argparse, sys
        assert "custom_args.difflm" not in sys.modules
        from custom_args.difflm import extra_args_provider
        import megadlms_args_compat, custom_args.difflm as module
        megadlms_args_compat.patch(module)  # a second patch changes nothing
        assert module.extra_args_provider is extra_args_provider
        parser = extra_args_provider(argparse.ArgumentParser())
        print(parser.parse_args(["--moe-router-type", "topk"]).moe_router_type, parser.parse_args([]).moe_router_type)
        try:
            parser.parse_args(["--moe-router-type", "sinkhorn"])
        except SystemExit as e:
            print("refused", e.code)
        """)
    env = dict(os.environ, PYTHONPATH=f"{SHIM}:{tmp_path}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["topk expert_choice", "refused 2"]


@needs_export
def test_megatron_builds_the_moe_1b_7b_layer_and_routes_as_difflm(tmp_path):
    """MegaDLMs' own parser and config take the MoE flags (--moe-router-type through the shim); its block spec is
    Megatron-Core's MoELayer (TopKRouter) with TE's grouped experts in all 16 blocks; and its routing functions,
    run on CPU, give difflm's router: pre-softmax top-8 = difflm's softmax(logits)[topk] (norm_topk_prob false),
    Megatron's default softmax after top-k = difflm's renormalised top-k, the aux loss and the z-loss equal."""
    from difflm.model.moe import TopKRouter, load_balancing_loss, router_z_loss

    mb = load_script("megadlms_baseline")
    write_stub_te(tmp_path)
    flags = mb.megadlms_flags(mb.model_config("moe-1b-7b", 50304), mb.Shape(4096, 8, 1, 1, "bf16"))
    saved = tmp_path / "megatron_routing.pt"
    code = textwrap.dedent(f"""
        import sys, warnings, torch
        warnings.filterwarnings("ignore")
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # validate_args asks for --moe-grouped-gemm
        sys.argv = ["pretrain_difflm.py"] + {flags!r}
        from megatron.training.arguments import parse_args, validate_args, core_transformer_config_from_args
        from custom_args.difflm import extra_args_provider
        args = parse_args(extra_args_provider)
        validate_args(args, {{"tokenizer_type": "HuggingFaceTokenizer"}})
        cfg = core_transformer_config_from_args(args)
        from megatron.core import parallel_state
        parallel_state.set_pipeline_model_parallel_rank(0)
        parallel_state.set_pipeline_model_parallel_world_size(1)
        from megatron.core.models.difflm.gpt_layer_specs import get_difflm_decoder_block_spec
        spec = get_difflm_decoder_block_spec(cfg, use_transformer_engine=True, attn_mask_type=args.attention_mask_type,
                                             core_attn_implementation=args.core_attn_implementation,
                                             moe_router_type=args.moe_router_type)
        kinds = {{(s.submodules.mlp.module.__name__, s.submodules.mlp.submodules.experts.module.__name__,
                   s.submodules.pre_mlp_layernorm.__name__) for s in spec.layer_specs}}
        print("RESULT", len(spec.layer_specs), sorted(kinds), args.moe_router_type, cfg.num_moe_experts,
              cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_router_pre_softmax,
              cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff, cfg.moe_grouped_gemm,
              cfg.moe_token_dispatcher_type, cfg.expert_model_parallel_size, cfg.moe_expert_capacity_factor,
              cfg.moe_shared_expert_intermediate_size, cfg.moe_layer_freq, cfg.moe_router_topk_scaling_factor,
              cfg.moe_router_activation_function, cfg.gated_linear_unit, cfg.add_bias_linear)
        from megatron.core.transformer.moe.moe_utils import (switch_load_balancing_loss_func,
                                                             topk_softmax_with_capacity, z_loss_func)
        logits = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)) * 2
        out = {{"logits": logits}}
        for pre in (True, False):
            probs, routing_map, tokens_per_expert = topk_softmax_with_capacity(
                cfg, logits, cfg.moe_router_topk, capacity_factor=cfg.moe_expert_capacity_factor, use_pre_softmax=pre,
                moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor)
            out[pre] = (probs, routing_map, tokens_per_expert)
        out["aux"] = switch_load_balancing_loss_func(torch.softmax(logits, dim=-1), out[True][2], cfg.moe_router_topk,
                                                     cfg.moe_aux_loss_coeff)
        out["z"] = z_loss_func(logits, cfg.moe_z_loss_coeff)
        torch.save(out, {str(saved)!r})
        """)
    out = run_megatron(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    assert result.split(" ", 1)[1] == ("16 [('MoELayer', 'TEGroupedMLP', 'TENorm')] topk 64 8 1024 True aux_loss 0.01 "
                                       "0.001 True allgather 1 None None 1 None softmax True False")
    meg = torch.load(saved)
    logits = meg["logits"]
    for norm_topk_prob, pre in ((False, True), (True, False)):
        router = TopKRouter(64, 64, 8, "softmax", norm_topk_prob)
        with torch.no_grad():
            router.weight.copy_(torch.eye(64))  # the router's logits are the input
        routing = router(logits)
        probs, routing_map, tokens_per_expert = meg[pre]
        ours = torch.zeros_like(logits).scatter(-1, routing.expert_ids, routing.weights)
        assert torch.equal(routing_map, ours > 0) and routing_map.sum(-1).eq(8).all()
        torch.testing.assert_close(probs, ours)
        counts = torch.zeros(64, dtype=torch.long).scatter_add_(0, routing.expert_ids.flatten(),
                                                                torch.ones(512 * 8, dtype=torch.long))
        assert torch.equal(tokens_per_expert, counts)
        if not norm_topk_prob:
            torch.testing.assert_close(meg["aux"], 0.01 * load_balancing_loss(routing.probs, counts, 8))
            torch.testing.assert_close(meg["z"], 0.001 * router_z_loss(routing.logits))
    assert not torch.allclose(meg[True][0], meg[False][0])  # the two gating rules differ: the flag matters
