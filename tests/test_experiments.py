"""conf/experiment/ recipes: each composes, passes every check of a training run on its intended number of
GPUs, records its source and what differs, and holds the published values."""
from __future__ import annotations

import pytest

import difflm.config
from difflm.config.validate import check_batch, check_run
from difflm.data import build_tokenizer

from conftest import compose_run, run_cli

EXPERIMENTS = sorted(p.stem for p in (difflm.config.CONF_DIR / "experiment").glob("*.yaml"))


# recipes whose sweep runs many small jobs, one process each (parallel=single)
SINGLE_GPU_SWEEPS = {"data_constrained": 1}


def test_recipes_exist():
    assert {"llada_8b", "mdlm_owt", "bd3lm_owt", "megadlm_1.7b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_recipe_composes_validates_and_records_its_source(name):
    text = (difflm.config.CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    assert "github.com/" in text or "et al." in text, "a recipe names its source"
    assert "Same as" in text and "Differs:" in text, "a recipe says what it keeps and what differs"
    cfg = compose_run([f"experiment={name}", "device=cpu"])
    world = SINGLE_GPU_SWEEPS.get(name, 8)
    assert check_run(cfg, world_size=world).type == "cpu"
    assert check_batch(cfg, world_size=world) >= 1  # accumulation steps on one 8-GPU node (or one GPU per job)


def test_recipe_values_are_the_published_ones():
    llada = compose_run(["experiment=llada_8b"])
    assert (llada.model.num_layers, llada.model.hidden_size, llada.model.num_heads, llada.model.num_kv_heads,
            llada.model.ffn_hidden_size, llada.model.rope_base) == (32, 4096, 32, 32, 12288, 500000.0)
    assert (llada.data.seq_len, llada.train.global_batch_size, llada.optim.lr, llada.schedule.warmup_steps) == \
        (4096, 1280, 4e-4, 2000)
    assert llada.train.max_steps * 1280 * 4096 == pytest.approx(2.3e12, rel=1e-3)  # 2.3T tokens
    assert llada.objective.random_length_prob == 0.01

    mdlm = compose_run(["experiment=mdlm_owt"])
    assert (mdlm.model.name, mdlm.data.seq_len, mdlm.data.hf_dataset, mdlm.data.tokenizer) == \
        ("125m", 1024, "Skylion007/openwebtext", "gpt2")
    assert (mdlm.objective.schedule, mdlm.objective.t_sampling, mdlm.optim.beta2, mdlm.optim.weight_decay) == \
        ("loglinear", "antithetic", 0.999, 0.0)
    assert (mdlm.train.global_batch_size, mdlm.train.max_steps, mdlm.schedule.name, mdlm.schedule.warmup_steps) == \
        (512, 1_000_000, "constant", 2500)

    bd3 = compose_run(["experiment=bd3lm_owt"])
    assert (bd3.objective.name, bd3.objective.block_size, bd3.data.seq_len) == ("bd3lm", 16, 1024)
    assert compose_run(["experiment=bd3lm_owt", "objective.block_size=4"]).objective.block_size == 4

    mega = compose_run(["experiment=megadlm_1.7b"])
    m = mega.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (28, 2048, 16, 16, 6144)
    assert m.qk_norm and not m.tie_embeddings and m.norm_eps == 1e-6 and mega.data.seq_len == 4096
    tok = build_tokenizer(mega.data.tokenizer, m.vocab_multiple)  # the shipped GPT-NeoX tokenizer
    assert (tok.mask_id, tok.padded_vocab_size) == (50277, 50304)  # MegaDLMs' --mask-token, padded vocab
    assert (mega.optim.lr, mega.optim.lr * mega.schedule.min_lr_ratio, mega.train.global_batch_size) == \
        (2e-4, pytest.approx(2e-5), 256)


def test_recipe_on_the_command_line_and_overridable():
    out = run_cli("difflm.train", "--cfg", "job", "experiment=megadlm_1.7b", "train.max_steps=20000", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "num_kv_heads: 16" in out.stdout and "max_steps: 20000" in out.stdout and "seq_len: 4096" in out.stdout
