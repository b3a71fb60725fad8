"""conf/experiment/ recipes: each composes, passes every check of a training run on its intended number of
GPUs, records its source and what differs, and holds the published values."""
from __future__ import annotations

import pytest

import difflm.config
from difflm.config.validate import check_batch, check_run
from difflm.data import build_tokenizer
from difflm.errors import DifflmError

from conftest import compose_run, run_cli

EXPERIMENTS = sorted(p.stem for p in (difflm.config.CONF_DIR / "experiment").glob("*.yaml"))


# recipes whose sweep runs many small jobs, one process each (parallel=single)
SINGLE_GPU_SWEEPS = {"data_constrained": 1}


# recipes of a pre-training corpus only the user has: data.path is null, and the run refuses to start without it
LEAVE_THE_CORPUS_TO_YOU = {"llada_8b", "megadlm_1.7b"}


@pytest.mark.parametrize("name", sorted(LEAVE_THE_CORPUS_TO_YOU))
def test_recipe_without_its_corpus_refuses_to_start(name):
    """A ``???`` merged over the schema's default keeps the default (the embedded tinyshakespeare), so a recipe
    that forgot data.path used to train a 1.7B model on it; null is refused before anything is built."""
    cfg = compose_run([f"experiment={name}", "device=cpu"])
    assert cfg.data.path is None and cfg.data.hf_dataset is None
    with pytest.raises(DifflmError, match=r"^data.path is not set .*pass data.path="):
        check_run(cfg, world_size=8)
    with_hub = compose_run([f"experiment={name}", "device=cpu", "data.hf_dataset=/data/owt_saved"])
    assert check_run(with_hub, world_size=8).type == "cpu"


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_recipe_without_its_corpus_is_one_line_from_the_command_line(tmp_path):
    out = run_cli("difflm.train", "experiment=megadlm_1.7b", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line, no traceback
    assert out.stderr.startswith("difflm: error: data.path is not set")
    assert not (tmp_path / "run" / "data_cache").exists()  # nothing tokenized


def test_recipes_exist():
    assert {"llada_8b", "mdlm_owt", "bd3lm_owt", "megadlm_1.7b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_recipe_composes_validates_and_records_its_source(name):
    text = (difflm.config.CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    assert "github.com/" in text or "et al." in text, "a recipe names its source"
    assert "Same as" in text and "Differs:" in text, "a recipe says what it keeps and what differs"
    corpus = ["data.path=/data/corpus"] if name in LEAVE_THE_CORPUS_TO_YOU else []
    cfg = compose_run([f"experiment={name}", "device=cpu", *corpus])
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


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_recipe_on_the_command_line_and_overridable():
    out = run_cli("difflm.train", "--cfg", "job", "experiment=megadlm_1.7b", "train.max_steps=20000", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "num_kv_heads: 16" in out.stdout and "max_steps: 20000" in out.stdout and "seq_len: 4096" in out.stdout


def test_readme_lists_every_experiment_and_every_metrics_key():
    """The recipe table of docs/configuration.md has a row per conf/experiment/*.yaml, and the metrics.jsonl row of
    docs/operations.md names every key the trainer's metrics rows write (read from Trainer._log_metrics and
    _eval_metrics)."""
    import inspect
    import re
    from pathlib import Path

    import difflm.config
    from difflm.training.trainer import Trainer

    docs = Path(__file__).resolve().parent.parent / "docs"
    readme = (docs / "configuration.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w.]+)` \|", readme.split("| `experiment=` |")[1].split("\n\n")[0], re.M))
    assert {p.stem for p in (Path(difflm.config.CONF_DIR) / "experiment").glob("*.yaml")} <= rows
    operations = (docs / "operations.md").read_text(encoding="utf-8")
    (metrics_row,) = [line for line in operations.splitlines() if line.startswith("| `metrics.jsonl` |")]
    source = inspect.getsource(Trainer._log_metrics) + inspect.getsource(Trainer._eval_metrics)
    keys = set(re.findall(r'"(\w+)": ', source)) | set(re.findall(r"\b(val_\w+)=", source))
    assert {"tokens_per_s_per_gpu", "skipped_steps", "cuda_graph_replays", "val_ppl_bound"} <= keys
    assert sorted(k for k in keys if f"`{k}`" not in metrics_row) == []
