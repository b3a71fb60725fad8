"""The planner's activations per kernel set (:mod:`difflm.plan.activations`): Transformer Engine's saved tensors
counted by hand from its modules, FP8 against BF16, the torch set's count unchanged, ``model.*=auto`` planned as a
fully installed GPU would run it, and the two measured TE rows."""
from __future__ import annotations

import pytest

from conftest import compose_run

# h 64, 4 query heads and 2 KV heads of 16: q = 64, kv = 32; MLP width f = 96
TINY = ["model=tiny", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=96", "model.vocab_size=1000", "data.seq_len=32", "train.global_batch_size=4",
        "train.micro_batch_size=2"]
TE_BF16 = ["precision=bf16", "model.backend=te", "model.attention_backend=te", "model.fused_mlp=false"]
TE_FP8 = ["precision=fp8", "model.backend=te", "model.attention_backend=te", "model.fused_mlp=false"]
TE_FUSED = ["precision=bf16", "model.backend=te", "model.attention_backend=flash", "model.fused_mlp=true"]
GIB = 1024 ** 3

h, q, kv, f, heads = 64, 64, 32, 96, 4
HAND = {  # bytes per token and block, tensor by tensor as each module saves it (difflm.plan.activations)
    "te-bf16": (
        2 * h + 2 * h + 4            # te.LayerNormLinear (QKV): inputmat (BF16 residual), ln_out, rsigma (FP32)
        + 2 * (q + 2 * kv)           # _QKVHeadsTriton: the QKV output
        + 2 * (q + 2 * kv) + 2 * q   # FusedAttnFunc: dense q, k, v and the output
        + 4 * heads                  # ... and the FP32 softmax stats per head
        + 0                          # te.Linear (proj): its input is the attention output, saved already
        + 2 * h + 2 * h + 4          # te.LayerNormMLP: inputmat, ln_out, rsigma
        + 2 * 2 * f + 2 * f),        # ... fc1_out (2f) and act_out (the SwiGLU output, f)
    "te-fp8": (
        2 * h + 1 * h + 4            # LayerNormLinear: BF16 inputmat, ln_out as FP8 column-wise only, rsigma
        + 2 * (q + 2 * kv)           # the QKV output
        + 2 * (q + 2 * kv) + 2 * q + 4 * heads  # attention in BF16 (precision.fp8_attention off)
        + 1 * q                      # te.Linear: its input's FP8 column-wise copy
        + 2 * h + 2 * h + 4          # LayerNormMLP: BF16 inputmat, ln_out FP8 row-wise and column-wise, rsigma
        + 2 * 2 * f + 1 * f),        # ... fc1_out in BF16, act_out FP8 row-wise
    "te-fused": (
        2 * h + 2 * h + 4            # quack ResidualNormLinear: x, h, rstd
        + 2 * (q + 2 * kv)           # _QKVFlashAttention: the QKV output ...
        + 2 * (q + kv) + 2 * q + 4 * heads  # ... q, k (v read in place from it), out, lse
        + 2 * h + 2 * h + 4          # quack ResidualNormMLP: s, h, rstd
        + 2 * 2 * f),                # ... the pre-activation (the SwiGLU output is recomputed in the backward)
    # the torch set: 2 r h + 2 a h + a (2 (q + 2 kv) + q) + 4 a f with r = 4, a = 2
    "torch": 2 * 4 * h + 2 * 2 * h + 2 * (2 * (q + 2 * kv) + q) + 4 * 2 * f,
}
SETS = {"te-bf16": TE_BF16, "te-fp8": TE_FP8, "te-fused": TE_FUSED,
        "torch": ["precision=bf16", "model.backend=torch", "model.attention_backend=sdpa"]}


def _per_token(overrides, **layout):
    from difflm.plan.activations import block_bytes_per_token, kernel_set
    from difflm.plan.memory import Layout

    cfg = compose_run([*TINY, *overrides])
    lay = Layout(**layout)
    return block_bytes_per_token(cfg.model, kernel_set(cfg, lay), lay, 2)


@pytest.mark.parametrize("name", list(HAND))
def test_saved_bytes_per_token_equal_the_hand_count(name):
    assert _per_token(SETS[name]) == HAND[name]


def test_fp8_saves_fewer_bytes_than_bf16_and_te_fewer_than_torch():
    """At the 1.7B widths (h 2048, q = kv 2048, f 6144, 16 heads): FP8 75,848 < TE BF16 81,992 < torch 102,400 bytes
    per token and block; the fused MLP with FA4 saves 65,608."""
    from difflm.plan.activations import block_bytes_per_token, kernel_set
    from difflm.plan.memory import Layout

    counts = {}
    for name, overrides in SETS.items():
        cfg = compose_run(["model=1.7b", "model.vocab_size=50304", *overrides])
        counts[name] = block_bytes_per_token(cfg.model, kernel_set(cfg, Layout()), Layout(), 2)
    assert counts == {"te-fp8": 75848, "te-bf16": 81992, "te-fused": 65608, "torch": 102400}


def test_tensor_parallel_splits_te_terms_as_the_torch_ones():
    """Under tp 2 with sequence parallelism every term halves; without it only the attention's (heads) do."""
    full = HAND["te-bf16"]
    assert _per_token(TE_BF16, tp=2, sequence_parallel=True) == full / 2
    attention = 2 * (q + 2 * kv) * 2 + 2 * q + 4 * heads
    assert _per_token(TE_BF16, tp=2, sequence_parallel=False) == (full - attention) + attention / 2


def test_fa4_reads_the_value_heads_in_place_only_batch_first():
    """FlashAttention 4 over the QKV output saves no dense v (2 kv bytes less); TE's sequence-parallel layout is
    sequence-first, where the two-call path saves it."""
    flash = ["precision=bf16", "model.backend=te", "model.attention_backend=flash", "model.fused_mlp=false"]
    assert _per_token(flash) == HAND["te-bf16"] - 2 * kv
    assert _per_token(flash, tp=2, sequence_parallel=True) == HAND["te-bf16"] / 2
    assert _per_token([*flash, "model.fused_qkv=false"]) == HAND["te-bf16"]


def test_torch_plans_are_unchanged():
    """The torch kernel set's 1.7B rows of docs/planner.md, to the byte as planned before TE had its own count."""
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import activation_bytes_per_token, plan_memory
    from difflm.plan.shapes import model_params

    rows = {("train.micro_batch_size=4",): 88934697369.76949,
            ("train.micro_batch_size=8", "parallel.activation_checkpointing=full"): 46919823467.0076}
    for overrides, planned in rows.items():
        cfg = compose_run(["model=1.7b", "model.vocab_size=50304", "precision=bf16", "data.seq_len=4096",
                           "train.global_batch_size=8", *SETS["torch"], "model.fused_cross_entropy=false",
                           *overrides])
        layout = layout_of(cfg, 1)
        n_micro = 8 // layout.micro_batch
        assert plan_memory(cfg, model_params(cfg.model, 50304), layout, n_micro).total == pytest.approx(planned,
                                                                                                     rel=1e-12)
        assert activation_bytes_per_token(cfg.model, layout, 2) == 102400  # the torch count at the 1.7B widths



def test_checkpointed_te_blocks_keep_a_bf16_block_input():
    """Under full checkpointing a TE block keeps its input in BF16 (2 h bytes a token), the torch block in FP32."""
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import plan_memory
    from difflm.plan.shapes import model_params

    tokens = 2 * 32
    for overrides, residual in ((TE_BF16, 2), (SETS["torch"], 4)):
        cfg = compose_run([*TINY, *overrides, "parallel.activation_checkpointing=full"])
        plan = plan_memory(cfg, model_params(cfg.model, 1000), layout_of(cfg, 1), 2)
        kept = tokens * 2 * residual * h  # two blocks' inputs
        one_block = tokens * HAND["te-bf16" if residual == 2 else "torch"]
        assert plan.parts["activations"] == {"loss": kept, "checkpointed forward": kept + one_block}[plan.phase]


def test_auto_is_planned_as_a_fully_installed_gpu_picks():
    """``model.*=auto`` plans what ``choose_kernels`` picks on a CUDA GPU with the te, flash and quack extras: TE with
    FA4 and the fused MLP in BF16, TE's attention under FP8, no fused MLP under tensor parallelism."""
    from difflm.plan.activations import kernel_set
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import Layout, plan_memory
    from difflm.plan.shapes import model_params

    auto = compose_run([*TINY, "precision=bf16"], auto=True)
    ks = kernel_set(auto, Layout())
    assert (ks.backend, ks.attention, ks.fused_mlp, ks.qkv_flash) == ("te", "flash", True, True)
    assert auto.model.backend == "auto"  # the config itself is left as given
    tp2 = kernel_set(auto, Layout(tp=2))
    assert (tp2.backend, tp2.attention, tp2.fused_mlp, tp2.qkv_flash) == ("te", "flash", False, False)
    fp8 = kernel_set(compose_run([*TINY, "precision=fp8"], auto=True), Layout())
    assert (fp8.backend, fp8.attention, fp8.fused_mlp, fp8.fp8) == ("te", "te", False, True)
    explicit = compose_run([*TINY, *TE_FUSED])
    params = model_params(explicit.model, 1000)
    assert plan_memory(auto, params, layout_of(auto, 1), 2).parts == \
        plan_memory(explicit, params, layout_of(explicit, 1), 2).parts


@pytest.mark.parametrize("overrides, measured_gib", [
    # one H100 80GB, torch.cuda.max_memory_allocated (docs/planner.md, benchmarks/results/plan_check_h100.json)
    (["precision=fp8", "model.backend=te", "model.attention_backend=te", "train.global_batch_size=8"], 62.96),
    # benchmarks/results/auto_speed_check_h100.json: the trainer's run of experiment=megadlm_1.7b at micro-batch 4
    (["precision=bf16", "model.backend=te", "model.attention_backend=flash", "model.fused_mlp=true",
      "train.global_batch_size=16"], 58.64),
    # one H200, benchmarks/results/auto_speed_check_h200.json: the same at the experiment's micro-batch 8
    (["precision=bf16", "model.backend=te", "model.attention_backend=flash", "model.fused_mlp=true",
      "train.global_batch_size=16", "train.micro_batch_size=8"], 87.31),
])
def test_measured_te_rows_are_planned_within_five_percent(overrides, measured_gib):
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import plan_memory
    from difflm.plan.shapes import model_params

    cfg = compose_run(["model=1.7b", "model.vocab_size=50304", "data.seq_len=4096", "train.micro_batch_size=4",
                       *overrides])
    layout = layout_of(cfg, 1)
    n_micro = int(cfg.train.global_batch_size) // int(cfg.train.micro_batch_size)
    plan = plan_memory(cfg, model_params(cfg.model, 50304), layout, n_micro)
    assert plan.total / GIB == pytest.approx(measured_gib, rel=0.05), plan.parts


# weights of TINY's two blocks whose gradients go to main_grad under TE: qkv [q + 2 kv, h], proj [h, q], fc1 [2 f, h],
# fc2 [h, f]; the embedding [vocab, h]; not the LM head, the norms
GEMM = 2 * ((q + 2 * kv) * h + h * q + 2 * f * h + h * f)  # 61,440
TABLE = 1000 * h  # 64,000


@pytest.mark.parametrize("overrides, layout, main_grad, copies", [
    # FP32 main_grad for the GEMMs and the embedding; FP8 workspaces of the TE GEMMs (data + transpose, 2 bytes),
    # the embedding's BF16 table
    (TE_FP8, {}, 4 * (GEMM + TABLE), 2 * GEMM + 2 * TABLE),
    # BF16: TE casts its weights at every forward (no copy kept), the embedding keeps its table
    (TE_BF16, {}, 4 * (GEMM + TABLE), 2 * TABLE),
    # quack's QKV and MLP modules keep BF16 copies (the output projection stays te.Linear)
    (TE_FUSED, {}, 4 * (GEMM + TABLE), 2 * (GEMM - 2 * h * q) + 2 * TABLE),
    # blocks 0 and L-1 in BF16 inside the FP8 region: no FP8 workspace (here: both blocks)
    ([*TE_FP8, "precision.fp8_skip_first_last=true"], {}, 4 * (GEMM + TABLE), 2 * TABLE),
    # tensor parallelism: each rank's GEMM shards; the embedding is a plain nn.Embedding there
    (TE_FP8, {"tp": 2}, 4 * GEMM // 2, 2 * GEMM // 2),
    # FSDP2 (or DDP, context parallelism, pipeline stages): autograd's gradients, no main_grad, no cached copies
    (TE_FP8, {"dp_shard": 2}, 0, 0),
    (TE_FP8, {"pp": 2}, 0, 0),
    ([*TE_FP8, "model.fuse_wgrad_accumulation=false"], {}, 0, 0),
    (SETS["torch"], {}, 0, 0),
])
def test_main_grad_buffers_and_step_copies_equal_the_hand_count(overrides, layout, main_grad, copies):
    """The weight state the TE kernel set keeps through the whole step (difflm.plan.activations.step_state_bytes):
    the FP32 main_grad buffers, which zero_grad(set_to_none=True) does not free, and the weight copies cast once per
    step."""
    from difflm.plan.activations import kernel_set
    from difflm.plan.memory import Layout, step_state
    from difflm.plan.shapes import model_params

    cfg = compose_run([*TINY, *overrides])
    lay = Layout(**layout)
    kept = step_state(cfg, model_params(cfg.model, 1000), lay, 2, kernel_set(cfg, lay))
    assert sum(s["main_grad"] for s in kept) == main_grad
    assert sum(s["copies"] for s in kept) == copies


def test_fp8_checkpointed_step_holds_main_grad_and_the_fp8_copies():
    """1.7B FP8 with full checkpointing, one micro-batch a step (benchmarks/results/plan_check_h100_fp8_ac.json,
    measured 38.1 GiB): the loss holds the main_grad buffers of the GEMMs and the embedding, the FP8 workspaces (with
    transposes) of every block, the embedding's BF16 table and the head's cast, beside the blocks' BF16 inputs and
    the logits. Before, the plan held no gradients and dropped the checkpointed blocks' casts: 28.4 GiB."""
    from difflm.plan.cli import layout_of
    from difflm.plan.memory import plan_memory
    from difflm.plan.shapes import model_params

    cfg = compose_run(["model=1.7b", "model.vocab_size=50304", "data.seq_len=4096", "train.global_batch_size=8",
                       "train.micro_batch_size=8", "parallel.activation_checkpointing=full", *TE_FP8])
    plan = plan_memory(cfg, model_params(cfg.model, 50304), layout_of(cfg, 1), 1)
    gemm = 28 * (3 * 2048 * 2048 + 2048 * 2048 + 2 * 6144 * 2048 + 2048 * 6144)  # 54,525,952 a block
    table = 50304 * 2048
    assert plan.phase == "loss"
    assert plan.parts["gradients"] == 4 * (gemm + table)
    assert plan.parts["buffers"] == 2 * gemm + 2 * table + 2 * (table + 2048)  # + the head's and final norm's casts
    assert plan.parts["activations"] == 28 * 8 * 4096 * 2 * 2048
    assert plan.total / GIB == pytest.approx(34.64, abs=0.01)
