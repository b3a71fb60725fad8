"""Hugging Face interop (CPU, offline): import of Llama/Qwen2 causal LMs, export with a self-contained modeling
file, export -> import round trip, and the trainer continuing from an imported step_0."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST, compose_run, rewrite_run_settings, run_cli
from difflm.checkpoint.store import list_checkpoints
from difflm.config import ASSETS
from difflm.data.documents import resolve_sources
from difflm.data import build_tokenizer
from difflm.errors import DifflmError
from difflm.generate import generate_ids
from difflm.interop.export import export_checkpoint, export_run, load_run_for_export, parse_size
from difflm.interop.hf_import import continue_command, fuse_qkv, import_hf, train_overrides

CPU = torch.device("cpu")
NEOX = ASSETS / "tokenizers" / "gpt-neox-20b"
N_TOK = 50277  # len(NeoX tokenizer); difflm's mask id for it, padded vocab 50304


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong mapping shows in the logits (HF's init is near zero); norms != 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.08 * noise)


def make_hf(tmp: Path, kind: str, vocab: int, tie: bool) -> Path:
    """A tiny random HF causal LM with GQA (4 heads, 2 KV heads), saved with the NeoX tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=500000.0))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0))
    _randomise(model, seed=7)
    out = tmp / f"hf_{kind}"
    model.save_pretrained(out)
    for f in NEOX.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def hf_logits(path: Path, ids: torch.Tensor, trust: bool = False, auto: str = "AutoModelForCausalLM") -> torch.Tensor:
    import transformers

    model = getattr(transformers, auto).from_pretrained(str(path), dtype=torch.float32, trust_remote_code=trust).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, data_cache):
    """Overrides for a 40 kB slice of the embedded corpus (fast to tokenize)."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text((ASSETS / "corpora" / "tinyshakespeare" / "input.txt").read_text()[:40_000])
    return [f"data.path={path}", f"data.cache_dir={data_cache}"]


@pytest.mark.parametrize("kind,vocab,tie", [("llama", 50280, False), ("qwen2", 50432, True)])
def test_import_ar_logits_equal_hf(tmp_path, kind, vocab, tie):
    src = make_hf(tmp_path, kind, vocab, tie)
    cfg = import_hf(str(src), tmp_path / "run", objective="ar")
    assert cfg.model.num_kv_heads == 2 and cfg.model.tie_embeddings == tie and cfg.model.qkv_bias == (kind == "qwen2")
    assert cfg.model.rope_base == (500000.0 if kind == "llama" else 1000000.0)
    _, model, tok, step = load_run_for_export(tmp_path / "run")
    assert step == 0 and tok.mask_id == N_TOK and model.cfg.vocab_size == 50304
    ids = torch.randint(0, N_TOK, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, ids)
    with torch.no_grad():
        ours = model(ids)
    # the tokenizer's tokens; column N_TOK is the new mask token (mean-initialised even where the HF model
    # had a spare row there), columns beyond are padding
    diff = (ours[..., :N_TOK] - ref[..., :N_TOK]).abs().max().item()
    print(f"{kind}: max |logit diff| = {diff:.3e} (logit scale {ref.abs().max().item():.2f})")
    assert diff < 1e-4
    # new rows (mask; Llama's padding rows) hold the mean embedding of the real tokens
    emb = model.embedding.weight
    assert torch.allclose(emb[N_TOK], emb[:N_TOK].mean(0), atol=1e-6)


def test_fuse_qkv_groups_rows_per_kv_head():
    hd, d = 2, 3
    q = torch.arange(4 * hd).repeat_interleave(d).view(4 * hd, d).float()  # q head j: rows 2j, 2j+1
    k = 100 + torch.arange(2 * hd).repeat_interleave(d).view(2 * hd, d).float()
    v = 200 + torch.arange(2 * hd).repeat_interleave(d).view(2 * hd, d).float()
    fused = fuse_qkv(q, k, v, num_kv_heads=2)[:, 0].tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_imported_mdlm_run_resumes_in_trainer(tmp_path, small_data):
    from difflm.training.trainer import Trainer

    src = make_hf(tmp_path, "llama", 50280, False)
    imported = import_hf(str(src), tmp_path / "run", objective="mdlm")
    overrides = train_overrides(imported)
    assert "model.num_kv_heads=2" in overrides
    # the printed command names the corpus to choose (difflm-train refuses the placeholder) and no optim.lr
    printed = continue_command(imported).split()
    assert printed == ["difflm-train", *overrides, "data.path=CORPUS"]
    with pytest.raises(DifflmError, match="data.path='CORPUS' does not exist"):
        resolve_sources(compose_run(printed[1:]).data.path)
    # difflm-train's defaults are left to an adaptation recipe added to the printed command
    assert not any(o.startswith(("objective=", "model.shift_logits=", "data.seq_len=")) for o in overrides)
    for recipe, objective, shift, seq_len in (("fast_dllm_v2_adapt", "bd3lm", False, 2048),
                                              ("dream_adapt", "mdlm", True, 2048)):
        composed = compose_run([f"experiment={recipe}", *overrides])
        assert (composed.objective.name, composed.model.shift_logits, composed.data.seq_len) == \
            (objective, shift, seq_len), recipe
    _, ref_model, _, _ = load_run_for_export(tmp_path / "run")
    # the printed model.* left out: the load is refused, naming the settings that differ, as printed by the import
    bare = compose_run([*FAST, *small_data, *[o for o in overrides if not o.startswith("model.")],
                        "train.max_steps=1", "train.eval_every=0"])
    with pytest.raises(DifflmError, match=r"^checkpoint .*step_0 does not match this model.*; it was trained with "
                                          r"other model settings \(.*step_0/config.yaml\): pass (model\.\S+ )+"
                                          r"\(the model.\* overrides difflm-import printed\)$") as refused:
        Trainer(bare, bare.run.dir, CPU)
    named = str(refused.value).split(": pass ")[1].split(" (")[0].split()
    assert "model.ffn_hidden_size=96" in named and set(named) <= set(overrides), named
    cfg = compose_run([*FAST, *small_data, *overrides, "train.max_steps=1",
                       "train.save_every=1", "train.eval_every=0"])
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    assert trainer.resumed_from == 0 and trainer.step == 0
    for (name, p), q in zip(trainer.model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(p, q), name
    assert not trainer.optimizer.state  # model-only checkpoint: fresh optimizer
    metrics = trainer.fit()
    assert metrics["step"] == 1 and math.isfinite(metrics["loss"])
    assert (Path(cfg.run.dir) / "checkpoints" / "step_1").is_dir()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_data):
    """A 2-step difflm run (GQA, QKV bias, QK-norm, untied) to export."""
    from difflm.training.trainer import Trainer

    root = tmp_path_factory.mktemp("difflm_run")
    cfg = compose_run([*FAST, *small_data, f"run.dir={root / 'run'}", "train.max_steps=2",
                       "train.save_every=2", "train.eval_every=0", "model.qkv_bias=true", "optim.lr=1e-2"])
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    return root, trainer.model.eval(), trainer.tok


def test_export_matches_difflm_logits_and_sampler(trained_run):
    from transformers import AutoModel

    root, model, tok = trained_run
    out = export_run(root / "run", root / "hf", max_shard_size="3MB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded above max_shard_size
    assert any(k.endswith("attention.qkv.bias") for k in index["weight_map"])
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_difflm.DiffLMModel" and config["mask_token_id"] == N_TOK
    modeling = (out / "modeling_difflm.py").read_text()
    assert "difflm" not in [ln.split()[1].split(".")[0] for ln in modeling.splitlines()
                            if ln.startswith(("import ", "from "))]  # self-contained
    assert build_tokenizer(str(out)).mask_id == N_TOK  # the saved tokenizer carries the mask token

    ids = torch.randint(0, N_TOK, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
    diff = (hf_logits(out, ids, trust=True, auto="AutoModelForMaskedLM") - ref).abs().max().item()
    print(f"export: max |logit diff| = {diff:.3e}")
    assert diff < 1e-5

    hf_model = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    prompt = torch.tensor([tok.tokenizer("ROMEO:")["input_ids"]] * 2)
    settings = [dict(temperature=0.0, remasking="low_confidence"),
                dict(temperature=0.7, remasking="random", cfg_scale=1.5),
                dict(temperature=0.5, remasking="margin", top_k=50, top_p=0.9)]
    for kw in settings:
        gen = OmegaConf.create({"length": 16, "steps": 8, "block_length": 8, "seed": 3, **kw})
        ours = generate_ids(model, tok, prompt, gen, causal=False)
        theirs = hf_model.generate(prompt, steps=8, gen_length=16, block_length=8,
                                   generator=torch.Generator().manual_seed(3), stop_at_eos=False, **kw)
        assert torch.equal(theirs[:, :prompt.shape[1]], prompt)
        assert torch.equal(theirs[:, prompt.shape[1]:], ours), kw
        assert not (theirs == N_TOK).any()
        # by default a row ends at its first EOS (padded with EOS: NeoX has no pad token), as transformers' generate
        # does; the text is then what difflm's commands print (cut at EOS)
        ended = hf_model.generate(prompt, steps=8, gen_length=16, block_length=8,
                                  generator=torch.Generator().manual_seed(3), **kw)[:, prompt.shape[1]:]
        for row, raw in zip(ended.tolist(), ours.tolist()):
            cut = raw[:raw.index(tok.eos_id)] if tok.eos_id in raw else raw
            assert row[:len(cut)] == cut and set(row[len(cut):]) <= {tok.eos_id}


def test_export_import_round_trip_is_identical(trained_run, tmp_path):
    root, model, _ = trained_run
    out = export_run(root / "run", tmp_path / "hf")
    cfg = import_hf(str(out), tmp_path / "back")
    assert cfg.objective.name == "mdlm" and cfg.model.qkv_bias and cfg.model.qk_norm
    _, back, _, _ = load_run_for_export(tmp_path / "back")
    original = model.state_dict()
    assert list(back.state_dict()) == list(original)
    for name, p in back.state_dict().items():
        assert torch.equal(p, original[name]), name


# a run's training window and sampler settings, none at the schema's default (data.seq_len 128, gen.* of GenerateConfig)
RUN_SETTINGS = {"data.seq_len": 48, "gen.length": 32, "gen.steps": 16, "gen.block_length": 8,
                "gen.remasking": "margin", "gen.temperature": 0.3, "gen.seed": 5, "gen.top_k": 7, "gen.top_p": 0.9,
                "gen.cfg_scale": 0.5, "gen.threshold": 0.8, "gen.cache": "prefix", "gen.remdm_sigma": 0.4,
                "gen.remdm_schedule": "rescale"}


def test_export_import_round_trip_keeps_seq_len_and_gen(tmp_path, small_data):
    from difflm.checkpoint.store import trained_settings
    from difflm.config.schema import GenerateConfig
    from difflm.training.trainer import Trainer

    settings = [f"{k}={v}" for k, v in RUN_SETTINGS.items()]
    cfg = compose_run([*FAST, *small_data, f"run.dir={tmp_path / 'run'}", "train.max_steps=1", "train.save_every=1",
                       "train.eval_every=0", *settings])
    Trainer(cfg, cfg.run.dir, CPU).fit()
    original, _, _ = trained_settings(tmp_path / "run")
    assert original.data.seq_len == 48 and original.data.seq_len != compose_run([]).data.seq_len
    assert all(original.gen[k] != v for k, v in vars(GenerateConfig()).items())  # every gen.* key is non-default

    out = export_run(tmp_path / "run", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["train_seq_len"] == 48 and config["gen_cache"] == "prefix" and config["gen_seed"] == 5
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 32
    imported = import_hf(str(out), tmp_path / "back")
    on_disk = OmegaConf.load(tmp_path / "back" / "config.yaml")
    back, _, _ = trained_settings(tmp_path / "back")  # what difflm-eval / -generate read
    for c in (imported, on_disk, back):
        assert c.data.seq_len == 48
        assert OmegaConf.to_container(c.gen) == OmegaConf.to_container(original.gen)
    overrides = train_overrides(imported)  # the continue command keeps them too
    assert "data.seq_len=48" in overrides
    assert {"gen.length=32", "gen.steps=16", "gen.remasking=margin", "gen.threshold=0.8", "gen.cache=prefix",
            "gen.seed=5"} <= set(overrides)
    continued = compose_run([*FAST, *small_data, *overrides])
    assert continued.data.seq_len == 48 and continued.gen == original.gen

    # an export without the records (older difflm): the defaults, as for other HF models; bad records are refused
    for key in [k for k in config if k.startswith("gen_")] + ["train_seq_len"]:
        del config[key]
    (out / "config.json").write_text(json.dumps(config))
    plain = import_hf(str(out), tmp_path / "plain")
    assert plain.data.seq_len == 128 and plain.gen == compose_run([]).gen
    assert not any(o.startswith(("gen.", "data.seq_len=")) for o in train_overrides(plain))  # the defaults
    for bad, match in [({"train_seq_len": 0}, "train_seq_len=0"), ({"gen_temperature": -1.0}, "gen.temperature=-1"),
                       ({"gen_cache": "all"}, "gen.cache='all'")]:
        (out / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(DifflmError, match=f"^hf=.*{match}"):
            import_hf(str(out), tmp_path / "bad")
        assert not (tmp_path / "bad").exists()  # refused before anything is written


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_export_says_which_checkpoint_step_it_holds(trained_run, tmp_path):
    """The export's config.json records the checkpoint's step, and difflm-export's message names it."""
    from difflm.interop.export import export_checkpoint

    root, _, _ = trained_run
    out, step = export_checkpoint(root / "run", tmp_path / "hf")
    assert step == 2 and json.loads((out / "config.json").read_text())["train_step"] == 2
    res = run_cli("difflm.interop.export", f"run.dir={root / 'run'}", f"out={tmp_path / 'cli'}", "step=2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"exported {root / 'run'} checkpoint step 2 -> {tmp_path / 'cli'}; load with ")


def test_export_bf16_and_errors(trained_run, tmp_path):
    from safetensors import safe_open

    root, _, _ = trained_run
    out = export_run(root / "run", tmp_path / "bf16", dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embedding.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(DifflmError, match="out=.*not empty"):
        export_run(root / "run", out)
    with pytest.raises(DifflmError, match="dtype="):
        export_run(root / "run", tmp_path / "x", dtype="fp64")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    with pytest.raises(DifflmError, match="max_shard_size"):
        parse_size("lots")
    bd3lm = tmp_path / "bd3lm_run"  # the same run, said to be bd3lm: its export would sample the wrong way
    import shutil

    shutil.copytree(root / "run", bd3lm, ignore=shutil.ignore_patterns("data_cache", ".difflm.lock"))
    rewrite_run_settings(bd3lm, "name: mdlm", "name: bd3lm")
    with pytest.raises(DifflmError, match="objective=bd3lm run: the exported modeling file"):
        export_run(bd3lm, tmp_path / "bd3lm_out")


def test_export_never_replaces_the_run_or_a_folder_that_is_not_an_export(trained_run, tmp_path):
    import stat

    root, _, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run, ignore=shutil.ignore_patterns("data_cache", ".difflm.lock"))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for out in (run, tmp_path):  # the run directory, a folder holding it
        with pytest.raises(DifflmError, match=r"^out=.*(the run directory|a folder holding run.dir).*out=<run.dir>/hf"):
            export_run(run, out, overwrite=True)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(DifflmError, match="not an earlier export .* choose a new directory"):
        export_run(run, notes, overwrite=True)
    assert (notes / "todo.txt").read_text() == "keep me"
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    hf = export_run(run, run / "hf")  # inside the run: fine, and an earlier export is replaced on request
    assert export_run(run, hf, overwrite=True) == hf and (hf / "config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((hf / "model.safetensors").stat().st_mode) == 0o666 & ~umask  # readable like the rest
    with pytest.raises(DifflmError, match=r"^out=.* is a file: give a directory path"):
        export_run(run, notes / "todo.txt")


def test_export_overwrite_replaces_only_its_own_output_and_never_a_tmp_folder(trained_run, tmp_path):
    """overwrite=true replaces only difflm-export's own output: a Hugging Face model it did not write (a Llama with
    its config.json) is refused and kept. A folder named <out>.tmp beside out is left alone (the export writes into a
    new hidden folder), and a failed export leaves no folder of its own."""
    root, _, _ = trained_run
    llama = make_hf(tmp_path, "llama", 50280, False)
    before = {p.name: p.read_bytes() for p in llama.iterdir()}
    with pytest.raises(DifflmError, match=r"^out=.* is not an earlier export \(its config.json is a "
                                          r"model_type='llama' model that difflm-export did not write\), and "
                                          r"overwrite=true would delete everything in it: choose a new directory$"):
        export_run(root / "run", llama, overwrite=True)
    assert {p.name: p.read_bytes() for p in llama.iterdir()} == before
    out = tmp_path / "hf"
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "notes.txt").write_text("keep me")
    export_run(root / "run", out)
    export_run(root / "run", out, overwrite=True)  # difflm-export's own output is replaced on request
    assert json.loads((out / "config.json").read_text())["model_type"] == "difflm"
    assert (tmp_path / "hf.tmp" / "notes.txt").read_text() == "keep me"
    with pytest.raises(DifflmError, match="lora_format=peft: run.dir=.* trained no LoRA adapters"):
        export_checkpoint(root / "run", tmp_path / "hf2", lora_format="peft")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.tmp", "hf_llama"]


def _old_run_records(run: Path) -> None:
    """What an earlier run leaves in run.dir besides checkpoints (a fresh run would pick each of these up)."""
    (run / "metrics.jsonl").write_text('{"step": 12, "loss": 3.0}\n')
    (run / "samples.txt").write_text("old samples\n")
    (run / "wandb_id.txt").write_text("oldrun42")  # a logger=wandb run would log into this W&B run again
    (run / "config.yaml").write_text("old: config\n")
    (run / "config.step_5.yaml").write_text("older: config\n")
    (run / "wandb" / "offline-run-x").mkdir(parents=True)
    (run / "wandb" / "offline-run-x" / "run-x.wandb").write_text("w&b log")
    (run / "data_cache").mkdir(exist_ok=True)
    (run / "data_cache" / "corpus.bin").write_text("tokens")  # keyed by content and tokenizer: kept


def test_import_overwrite_starts_a_clean_record(tmp_path):
    """overwrite=true removed only metrics.jsonl and samples.txt: wandb_id.txt sent the next logger=wandb run
    into the old W&B run, and config.step_*.yaml / wandb/ stayed. Every record goes; the data cache stays."""
    src = make_hf(tmp_path, "llama", 50280, False)
    run = tmp_path / "run"
    import_hf(str(src), run)
    (run / "checkpoints" / "step_7").mkdir()  # the earlier run trained on
    _old_run_records(run)
    import_hf(str(src), run, overwrite=True)
    left = sorted(p.name for p in run.iterdir())
    assert left == [".difflm.lock", "checkpoints", "config.yaml", "data_cache", "tokenizer"], left
    assert (run / "data_cache" / "corpus.bin").read_text() == "tokens"
    assert "old: config" not in (run / "config.yaml").read_text() and "imported" in (run / "config.yaml").read_text()
    assert [s for s, _ in list_checkpoints(run)] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0"]


def test_import_into_a_run_dir_without_checkpoints_moves_old_records_aside(tmp_path, capsys):
    """No checkpoint: nothing to overwrite was asked for, so an earlier run's records are kept, moved aside."""
    src = make_hf(tmp_path, "llama", 50280, False)
    run = tmp_path / "run"
    run.mkdir()
    _old_run_records(run)
    import_hf(str(src), run)
    (kept,) = (run / "previous").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", kept.name)
    assert sorted(p.name for p in kept.iterdir()) == ["config.step_5.yaml", "config.yaml", "metrics.jsonl",
                                                      "samples.txt", "wandb", "wandb_id.txt"]
    assert (kept / "wandb_id.txt").read_text() == "oldrun42" and (kept / "config.yaml").read_text() == "old: config\n"
    assert not (run / "wandb_id.txt").exists() and not (run / "metrics.jsonl").exists()
    assert f"moved them to {kept}" in capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(run)] == [0]


def test_import_overwrite_of_a_run_dir_in_use_is_refused_and_deletes_nothing(tmp_path):
    """overwrite=true deleted the checkpoints of a training run that was still running (then crashed on rmtree's
    'Directory not empty'). The import takes run.dir's lock as difflm-train does: a live run refuses it in one line."""
    from difflm.training.run_dir import claim_run_dir, release_run_dir

    src = make_hf(tmp_path, "llama", 50280, False)
    run = tmp_path / "run"
    import_hf(str(src), run)
    _old_run_records(run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".difflm.lock"}
    held = claim_run_dir(run)  # as the live trainer holds it
    try:
        with pytest.raises(DifflmError) as err:
            import_hf(str(src), run, overwrite=True)
    finally:
        release_run_dir(held)
    assert str(err.value) == (f"run.dir='{run.resolve()}' is in use by another run (pid {os.getpid()} on "
                              f"{os.uname().nodename}): wait for it to end, or choose another run.dir")
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".difflm.lock"}
    assert after == before
    import_hf(str(src), run, overwrite=True)  # once the run has ended
    assert [s for s, _ in list_checkpoints(run)] == [0] and not (run / "metrics.jsonl").exists()


def test_import_errors_name_the_problem(tmp_path, monkeypatch):
    src = make_hf(tmp_path, "llama", 50280, False)
    (src / "tokenizer.json").unlink()
    with pytest.raises(DifflmError, match="tokenizer.json"):
        import_hf(str(src), tmp_path / "run")
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DifflmError, match="model_type='gpt2'"):
        import_hf(str(src), tmp_path / "run")
    (src / "config.json").unlink()
    with pytest.raises(DifflmError, match="config.json is missing"):
        import_hf(str(src), tmp_path / "run")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DifflmError, match="HF_HUB_OFFLINE=1"):
        import_hf("difflm-test/not-a-cached-model", tmp_path / "run")
    with pytest.raises(DifflmError, match="data.tokenizer=.*none of the tokenizer files"):
        build_tokenizer(str(tmp_path))


def test_shift_logits_moves_logits_right():
    from difflm.model import build_model, resolve_model_config

    cfg = compose_run([*FAST]).model
    resolve_model_config(cfg, 256)
    plain = build_model(cfg, causal=False, device=CPU, seed=0).eval()
    cfg = cfg.copy()  # the model keeps a reference to its config
    cfg.shift_logits = True
    shifted = build_model(cfg, causal=False, device=CPU, seed=0).eval()
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        a, b = plain(ids), shifted(ids)
        mask = torch.zeros(2, 10, dtype=torch.bool)
        mask[:, 3] = True
        assert torch.allclose(shifted(ids, mask), b[:, 3], atol=1e-6)  # same values, another matmul shape
    assert torch.allclose(b[:, 1:], a[:, :-1], atol=1e-6) and torch.allclose(b[:, 0], a[:, 0], atol=1e-6)


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cli_import_prints_train_command(tmp_path):
    src = make_hf(tmp_path, "qwen2", 50432, True)
    res = run_cli("difflm.interop.hf_import", f"hf={src}", f"run.dir={tmp_path / 'run'}", "objective=ar", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "difflm-train objective=ar" in res.stdout and "model.qkv_bias=true" in res.stdout
    assert "data.seq_len=" not in res.stdout  # the default: left to the command (an adaptation recipe sets its own)
    with pytest.raises(DifflmError, match="already holds checkpoints"):
        import_hf(str(src), tmp_path / "run")


# ------------------------------------------------------------------ the exported modeling file: padding, shift, ties

def _hf_twin(shift: bool = False, causal: bool = False):
    """A tiny difflm model and the exported modeling file's class holding the same weights (V = 48, mask 47)."""
    from difflm.interop.hf_modeling.configuration_difflm import DiffLMConfig
    from difflm.interop.hf_modeling.modeling_difflm import DiffLMForMaskedLM
    from tests.dlm_helpers import tiny_model

    ours = tiny_model(std=0.3, shift_logits=shift, causal=causal)
    cfg = DiffLMConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, qk_norm=True,
                       tie_word_embeddings=False, causal=causal, shift_logits=shift, mask_token_id=47,
                       tokenizer_vocab_size=47)
    hf = DiffLMForMaskedLM(cfg).eval()
    hf.load_state_dict(ours.state_dict())
    return ours, hf


def _pad(prompts, side):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = torch.tensor(p), 1
    return ids, mask, width


PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_export_generate_applies_attention_mask(shift, side):
    from difflm.sampling import GenerationOptions, diffusion_generate
    from tests.dlm_helpers import model_fn

    ours, hf = _hf_twin(shift)
    ids, mask, width = _pad(PROMPTS, side)
    with torch.no_grad():  # forward: every real position's logits equal those of the unpadded row
        padded = hf(ids, attention_mask=mask).logits
        for i, p in enumerate(PROMPTS):
            alone = hf(torch.tensor([p])).logits[0]
            assert torch.allclose(padded[i][mask[i].bool()], alone, atol=1e-5)
            assert torch.allclose(alone, ours(torch.tensor([p]))[0], atol=1e-5)
    settings = [dict(), dict(cfg_scale=1.5), dict(threshold=0.3), dict(remasking="margin", top_k=8, temperature=0.7),
                dict(temperature=0.7, remasking="random"), dict(remasking="remdm", remdm_sigma=0.8),
                dict(remasking="remdm", remdm_sigma=0.5, remdm_schedule="rescale", temperature=0.7)]
    for kw in settings:
        gen = dict(steps=4, gen_length=8, block_length=4, **kw)
        theirs = hf.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(3), **gen)
        o = GenerationOptions(mask_id=47, length=8, steps=4, block_length=4, forbid_ids=[47], shift_logits=shift, **kw)
        mine = diffusion_generate(model_fn(ours), ids, o, prompt_mask=mask.bool(),
                                  generator=torch.Generator().manual_seed(3))
        assert torch.equal(theirs, mine), kw  # difflm's sampler, token for token
        if kw.get("temperature", 0) == 0:  # each row as if alone
            for i, p in enumerate(PROMPTS):
                alone = hf.generate(torch.tensor([p]), **gen)[0, len(p):]
                assert theirs[i, width:].tolist() == alone.tolist(), (kw, i)


@pytest.mark.parametrize("side", ["left", "right"])
def test_export_causal_generate_applies_attention_mask(side):
    _, hf = _hf_twin(causal=True)
    ids, mask, width = _pad(PROMPTS, side)
    out = hf.generate(ids, attention_mask=mask, gen_length=5)
    for i, p in enumerate(PROMPTS):
        assert out[i, width:].tolist() == hf.generate(torch.tensor([p]), gen_length=5)[0, len(p):].tolist()


def test_export_generate_refuses_unknown_arguments_and_bad_masks():
    _, hf = _hf_twin()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match="max_new_token"):
        hf.generate(ids, max_new_token=8)  # a typo must not be swallowed
    with pytest.raises(TypeError):
        hf(ids, position_ids=torch.arange(3))  # nor an input the forward ignores
    with pytest.raises(ValueError, match="attention_mask"):
        hf.generate(ids, attention_mask=torch.ones(1, 4, dtype=torch.long), gen_length=4, steps=4, block_length=4)
    with pytest.raises(ValueError, match="attention_mask"):
        hf.generate(ids, attention_mask=torch.zeros(1, 3, dtype=torch.long), gen_length=4, steps=4, block_length=4)


@pytest.mark.parametrize("rule", [dict(remasking="low_confidence"), dict(remasking="margin"),
                                  dict(remasking="low_confidence", threshold=1.0),
                                  dict(remasking="margin", top_p=0.5, temperature=1e-6)])  # the filter: T > 0
def test_export_confidences_of_very_peaked_logits_do_not_tie(rule):
    from tests.test_sampling import peaked_leads

    _, hf = _hf_twin()
    hf._logits = lambda x, valid=None: peaked_leads(x)  # vocabulary 4, mask id 3 (see peaked_leads)
    hf._forbidden_ids = lambda: []
    out = hf.generate(torch.tensor([[0]]), gen_length=2, steps=2, block_length=2, mask_id=3, **rule)
    assert out.tolist() == [[0, 0, 2]]


def test_export_generate_validates_like_difflm():
    _, hf = _hf_twin()
    ids = torch.tensor([[5, 6, 7]])
    gen = dict(gen_length=8, steps=4, block_length=4)
    for bad, match in [(dict(temperature=-1.0), "temperature=-1.0 must be >= 0"), (dict(top_k=-1), "top_k=-1"),
                       (dict(temperature=float("inf")), "temperature=inf must be >= 0 and finite"),
                       (dict(cfg_scale=float("inf")), "cfg_scale=inf must be >= 0 and finite"),
                       (dict(threshold=0.9, remasking="entropy"), "threshold=0.9 is compared with a confidence"),
                       (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
                       (dict(cfg_scale=-0.5), "cfg_scale=-0.5"), (dict(threshold=0.0), "threshold=0.0"),
                       (dict(threshold=1.5), "threshold=1.5"), (dict(remasking="best"), "remasking='best'"),
                       (dict(steps=0), "steps=0"), (dict(gen_length=0), "gen_length .*=0"),
                       (dict(block_length=3), "gen_length=8 must be a multiple of block_length=3; e.g. gen_length=8, "
                                              "block_length=8, steps=4"),
                       (dict(steps=3), "steps=3 must be a multiple of the number of blocks")]:
        with pytest.raises(ValueError, match=match):
            hf.generate(ids, **{**gen, **bad})
    # a positive temperature is accepted (as by difflm)
    assert hf.generate(ids, temperature=0.5, generator=torch.Generator().manual_seed(0), **gen).shape == (1, 11)


def test_export_generate_takes_max_new_tokens_as_gen_length():
    _, hf = _hf_twin()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    ref = hf.generate(ids, gen_length=8, steps=4, block_length=4)
    assert ref.shape == (2, 11)
    assert torch.equal(hf.generate(ids, max_new_tokens=8, steps=4, block_length=4), ref)
    assert torch.equal(hf.generate(ids, max_new_tokens=8, gen_length=8, steps=4, block_length=4), ref)
    with pytest.raises(ValueError, match="max_new_tokens=4 and gen_length=8"):
        hf.generate(ids, max_new_tokens=4, gen_length=8, steps=4, block_length=4)
    _, ar = _hf_twin(causal=True)
    ref = ar.generate(ids, gen_length=5)
    assert ref.shape == (2, 8) and torch.equal(ar.generate(ids, max_new_tokens=5), ref)
    with pytest.raises(ValueError, match="max_new_tokens=6 and gen_length=5"):
        ar.generate(ids, max_new_tokens=6, gen_length=5)


def test_export_causal_generate_refuses_diffusion_settings():
    from difflm.sampling import GenerationConfigError, GenerationOptions

    _, ar = _hf_twin(causal=True)
    ids = torch.tensor([[5, 6, 7]])
    for bad in [dict(steps=16), dict(block_length=8), dict(remasking="margin"), dict(cfg_scale=1.5),
                dict(threshold=0.9)]:
        (key, value), = bad.items()
        with pytest.raises(GenerationConfigError, match=f"drop gen.{key}$"):  # difflm refuses it ...
            GenerationOptions(mask_id=47, **bad).check_autoregressive()
        with pytest.raises(ValueError, match=f"^{key}={value!r}: .*left to right.*drop {key}$"):  # ... so does the export
            ar.generate(ids, max_new_tokens=4, **bad)
    with pytest.raises(ValueError, match="temperature=-1"):
        ar.generate(ids, max_new_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="at least one token"):
        ar.generate(ids[:, :0], max_new_tokens=4)
    # difflm's defaults of those settings, and the settings left-to-right decoding reads, are accepted
    out = ar.generate(ids, max_new_tokens=4, steps=64, remasking="low_confidence", cfg_scale=0.0, temperature=0.7,
                      top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 7) and torch.equal(out[:, :3], ids)


def test_self_contained_sampler_checks_follow_difflms():
    """modeling_difflm.py ships without difflm (torch + transformers only), so it keeps copies of the sampler's
    names, defaults and fix-it suggestion; they must stay those of difflm.sampling."""
    from difflm.interop.hf_modeling import modeling_difflm as hf
    from difflm.sampling.diffusion import consistent_setting
    from difflm.sampling.options import DIFFUSION_DEFAULTS, REMASKING

    # generate() has no KV cache argument, so gen.cache is the one diffusion-only setting it cannot be given
    assert hf.AR_IGNORED == {k: v for k, v in DIFFUSION_DEFAULTS.items() if k != "cache"}
    assert tuple(hf.REMASKING) == tuple(REMASKING)
    from difflm.sampling.options import (DEFAULT_BLOCK_LENGTH, DEFAULT_STEPS, FORMER_DEFAULTS, fitted_block_length,
                                         resolve_steps)

    # null steps / block_length fit the length as difflm's do
    assert (hf.DEFAULT_BLOCK_LENGTH, hf.DEFAULT_STEPS, hf.FORMER_DEFAULTS) == (DEFAULT_BLOCK_LENGTH, DEFAULT_STEPS,
                                                                              FORMER_DEFAULTS)
    for length in range(1, 300):
        block = fitted_block_length(length)
        assert hf._fitted_block_length(length) == block, length
        for given in (block, 7, length + 1):
            assert hf._fitted_steps(length, given) == resolve_steps(None, length, given), (length, given)
    numbers = lambda text: [int(n) for n in re.findall(r"=(\d+)", text)]  # noqa: E731  (length, block, steps)
    for length, steps, block in [(64, 64, 64), (64, 10, 24), (48, 100, 16), (30, 7, 0), (8, 3, 8), (96, 12, 32)]:
        ours = numbers(consistent_setting(length, steps, block))
        assert len(ours) == 3 and numbers(hf._consistent_setting(length, steps, block)) == ours, (length, steps, block)


def _tiny_export(out: Path, tie: bool) -> Path:
    """A random tiny export (NeoX tokenizer with its mask token, modeling files, auto_map) without a training run."""
    from difflm.interop.export import MODELING_FILES, TEMPLATES, _config_class, save_tokenizer_with_mask
    from difflm.interop.hf_modeling.modeling_difflm import DiffLMForMaskedLM

    tok = build_tokenizer(str(NEOX))
    cfg = _config_class()(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, head_dim=8, tie_word_embeddings=tie,
                          mask_token_id=N_TOK, tokenizer_vocab_size=N_TOK, eos_token_id=tok.eos_id,
                          architectures=["DiffLMForMaskedLM"], auto_map=dict(__import__(
                              "difflm.interop.export", fromlist=["AUTO_MAP"]).AUTO_MAP))
    model = DiffLMForMaskedLM(cfg)
    _randomise(model, seed=3)
    model.save_pretrained(str(out))
    for name in MODELING_FILES:
        shutil.copyfile(TEMPLATES / name, out / name)
    save_tokenizer_with_mask(tok, out)
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_export_resize_token_embeddings_then_forward(tmp_path, tie):
    """Tokens added to an export's tokenizer: resize_token_embeddings grows the embedding and the (untied) head,
    the old tokens' logits stay, the new ids go through the forward, get gradients and may be generated."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = _tiny_export(tmp_path / "hf", tie)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True, local_files_only=True).eval()
    assert model.get_input_embeddings() is model.embedding
    assert (model.get_output_embeddings() is None) == tie
    ids = torch.tensor([tokenizer("ROMEO: hello")["input_ids"]])
    with torch.no_grad():
        before = model(ids).logits
    old_head = model.head_weight().detach().clone()
    assert tokenizer.add_tokens(["<|user|>", "<|assistant|>"]) == 2
    new = len(tokenizer)
    assert new == N_TOK + 3  # the mask token, then the two new ones
    model.resize_token_embeddings(new)
    assert model.embedding.weight.shape == (new, 32) and model.config.vocab_size == new
    assert model.head_weight().shape == (new, 32)
    if tie:
        assert model.head_weight() is model.embedding.weight
    else:
        assert model.output.weight.shape == (new, 32) and model.output.weight is not model.embedding.weight
    assert torch.equal(model.head_weight()[:N_TOK], old_head[:N_TOK])  # old rows kept
    with torch.no_grad():
        after = model(ids).logits
    assert after.shape == (1, ids.shape[1], new)
    assert torch.allclose(after[..., :N_TOK], before[..., :N_TOK], atol=1e-6)  # same logits of the old tokens
    added = tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert added == [N_TOK + 1, N_TOK + 2]
    x = torch.tensor([[*added, *ids[0].tolist()]])
    model.train()
    loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and model.embedding.weight.grad[added].abs().sum() > 0
    # the new tokens may be emitted; the mask token still may not
    assert model.config.tokenizer_vocab_size == new and model._forbidden_ids() == [N_TOK]
    model.eval()
    model.save_pretrained(str(tmp_path / "resized"))
    back = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "resized"), trust_remote_code=True,
                                                local_files_only=True).eval()
    with torch.no_grad():
        assert torch.allclose(back(x).logits, model(x).logits, atol=1e-6)
    with pytest.raises(ValueError, match="mask token"):
        model.resize_token_embeddings(N_TOK)
    if tie:
        with pytest.raises(ValueError, match="set_input_embeddings"):
            model.set_output_embeddings(torch.nn.Linear(32, new, bias=False))


# ------------------------------------------------------------------ sampling semantics against transformers' generate

@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 0, 0.6), (2.0, 0, 0.6), (1.7, 5, 0.8), (0.3, 3, 1.0),
                                                     (1.0, 0, 0.9)])
def test_top_k_top_p_filter_the_distribution_transformers_samples(temperature, top_k, top_p):
    """transformers' generate scales by the temperature before its top-k / top-p warpers, so the nucleus is that of
    softmax(logits / T); difflm's samplers and the export keep exactly the tokens transformers keeps."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from difflm.interop.hf_modeling.modeling_difflm import _filter_top_k_top_p
    from difflm.sampling import filter_top_k_top_p

    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    kept = torch.isfinite(warpers(None, logits.clone()))
    assert torch.equal(torch.isfinite(filter_top_k_top_p(logits, top_k, top_p, temperature)), kept)
    assert torch.equal(torch.isfinite(_filter_top_k_top_p(logits, top_k, top_p, temperature)), kept)
    # hand-computed: logits [2, 1, 0], top_p 0.6: at T = 1 p = (.665, .245, .090) keeps one token; at T = 2
    # p = (.506, .307, .186) keeps two
    small = torch.tensor([[2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_top_k_top_p(small, top_p=0.6)).tolist() == [[True, False, False]]
    assert torch.isfinite(filter_top_k_top_p(small, top_p=0.6, temperature=2.0)).tolist() == [[True, True, False]]


def test_export_generate_do_sample_and_end_of_text_as_transformers():
    _, hf = _hf_twin()
    ids = torch.tensor([[5, 6, 7]])
    gen = dict(gen_length=8, steps=4, block_length=4)
    greedy = hf.generate(ids, **gen)
    assert torch.equal(hf.generate(ids, do_sample=False, temperature=0.9, **gen), greedy)  # do_sample=False: greedy
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    assert torch.equal(hf.generate(ids, do_sample=True, generator=g(), **gen),
                       hf.generate(ids, temperature=1.0, generator=g(), **gen))  # run's temperature 0 -> 1.0
    # end of text: every token after a row's first EOS becomes the pad token (transformers pads finished rows)
    raw = hf.generate(ids, stop_at_eos=False, **gen)[0, 3:].tolist()
    eos = raw[2]
    hf.config.eos_token_id, hf.config.pad_token_id = eos, 46
    ended = hf.generate(ids, **gen)[0, 3:].tolist()
    first = raw.index(eos)
    assert ended == raw[:first + 1] + [46] * (len(raw) - first - 1)
    hf.config.pad_token_id = None
    assert hf.generate(ids, **gen)[0, 3:].tolist() == raw[:first + 1] + [eos] * (len(raw) - first - 1)
    assert hf.generate(ids, stop_at_eos=False, **gen)[0, 3:].tolist() == raw


@pytest.mark.parametrize("kw", [dict(), dict(remasking="remdm", remdm_sigma=0.6), dict(cfg_scale=1.0)])
def test_export_generate_infills_as_difflm(kw):
    from difflm.sampling import GenerationOptions, diffusion_generate
    from tests.dlm_helpers import model_fn

    ours, hf = _hf_twin()
    ids = torch.tensor([[5, 47, 7, 47, 9], [10, 11, 47, 12, 13]])
    theirs = hf.generate(ids, gen_length=4, steps=4, block_length=2, infill=True, **kw)
    o = GenerationOptions(mask_id=47, length=4, steps=4, block_length=2, forbid_ids=[47], infill=True, **kw)
    assert torch.equal(theirs, diffusion_generate(model_fn(ours), ids, o))
    assert torch.equal(theirs[:, :5][ids != 47], ids[ids != 47]) and not (theirs == 47).any()
    kept = hf.generate(ids, gen_length=4, steps=4, block_length=2, **kw)
    assert torch.equal(kept[:, :5], ids)  # without infill the prompt is kept whole
    _, ar = _hf_twin(causal=True)
    with pytest.raises(ValueError, match="infill=True needs a masked-diffusion export"):
        ar.generate(ids, max_new_tokens=2, infill=True)


def test_export_generate_refuses_arguments_the_others_leave_unread():
    """generate(top_k=5) at temperature 0 (greedy: the argmax whatever the filter) and remdm_sigma without
    remasking="remdm" were ignored: refused as difflm refuses them; read (a temperature, ReMDM) they sample."""
    _, hf = _hf_twin()
    ids = torch.tensor([[5, 6, 7]])
    gen = dict(gen_length=4, steps=4, block_length=4)
    for kw, message in [(dict(top_k=5), "top_k=5 has no effect with temperature=0 (greedy): pass temperature>0 (or "
                                        "do_sample=True) or drop it"),
                        (dict(top_p=0.5, do_sample=False, temperature=0.7), "top_p=0.5 has no effect with "
                                                                            "temperature=0 (greedy)"),
                        (dict(remdm_sigma=0.5), "remdm_sigma=0.5 has no effect without remasking='remdm': pass "
                                                "remasking='remdm' or drop it"),
                        (dict(remdm_schedule="rescale", remasking="margin"), "remdm_schedule='rescale' has no effect "
                                                                              "without remasking='remdm'")]:
        with pytest.raises(ValueError) as err:
            hf.generate(ids, **gen, **kw)
        assert str(err.value).startswith(message), err.value
    g = torch.Generator().manual_seed(0)
    assert hf.generate(ids, **gen, top_k=5, top_p=0.5, temperature=0.7, generator=g).shape == (1, 7)
    assert hf.generate(ids, **gen, top_k=5, do_sample=True, generator=g).shape == (1, 7)
    assert hf.generate(ids, **gen, remasking="remdm", remdm_sigma=0.5, remdm_schedule="rescale").shape == (1, 7)
    _, ar = _hf_twin(causal=True)
    with pytest.raises(ValueError, match="^top_k=5 has no effect with temperature=0"):
        ar.generate(ids, max_new_tokens=4, top_k=5)
    with pytest.raises(ValueError, match=r"^remdm_sigma=0.5: this causal \(objective=ar\) export decodes left to "):
        ar.generate(ids, max_new_tokens=4, remdm_sigma=0.5)


@pytest.mark.parametrize("objective", ["bd3lm", "sft", "bogus", "mdml"])
def test_import_objective_refusals_say_what_difflm_import_writes(tmp_path, objective):
    """objective=bd3lm said "not one of: mdlm, ar" and objective=bogus listed the objective presets: both (the command
    line and import_hf) now say what difflm-import writes, before anything is read; mdlm and ar pass."""
    from difflm.cli import check_overrides

    what = ("is not an objective difflm-import writes: it writes objective=mdlm or objective=ar runs (without "
            "objective=: ar for a causal difflm export, else mdlm)")
    fix = {"bd3lm": "; for a bd3lm run, import with objective=mdlm and add objective=bd3lm to the difflm-train "
                    "command it prints",
           "sft": "; for an sft run, import with objective=mdlm and add objective=sft to the difflm-train command it "
                  "prints",
           "bogus": ": set objective=mdlm or objective=ar, or drop objective=",
           "mdml": "; did you mean objective=mdlm?"}[objective]
    argv = [f"hf={tmp_path / 'none'}", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(DifflmError) as err:
        check_overrides([*argv, f"objective={objective}"], "import")
    assert str(err.value) == f"objective={objective} {what}{fix}"
    if objective in ("bd3lm", "sft"):
        with pytest.raises(DifflmError) as err:
            import_hf(str(tmp_path / "none"), tmp_path / "run", objective=objective)  # the source is not read first
        assert str(err.value) == f"objective={objective} {what}{fix}"
    for ok in ("mdlm", "ar"):
        check_overrides([*argv, f"objective={ok}"], "import")


def _config_dicts() -> dict:
    """config.json of each layout difflm-import reads, as dicts: transformers' own Llama / Qwen2 / Qwen3 / Qwen3-MoE
    configs, the LLaDA-MoE and LLaDA 2.0 release keys (tests/test_llada_interop.py) and a difflm export's."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    from difflm.interop.export import hf_config
    from difflm.model import resolve_model_config
    from tests.test_llada_interop import llada2_config, llada_moe_config

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    out = {"llama": LlamaConfig(**small).to_dict(), "qwen2": Qwen2Config(**small).to_dict(),
           "qwen3": Qwen3Config(**small, head_dim=16).to_dict(),
           "qwen3_moe": Qwen3MoeConfig(**small, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32).to_dict(),
           "llada_moe": llada_moe_config(), "llada2": llada2_config()}
    cfg = compose_run([*FAST, "model=moe-tiny"])
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    resolve_model_config(cfg.model, tok.padded_vocab_size)
    out["difflm"] = hf_config(cfg, tok, "fp32").to_dict()
    return out


# the required fields of each layout, and the name its message gives the layout
REQUIRED = {
    "llama": ["num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size"],
    "qwen2": ["num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size"],
    "qwen3": ["num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size"],
    "qwen3_moe": ["num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size"],
    "llada_moe": ["num_attention_heads", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                  "expert_intermediate_size"],
    "llada2": ["num_attention_heads", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size"],
    "difflm": ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "head_dim", "rope_theta", "rms_norm_eps", "moe_num_experts", "moe_top_k", "moe_intermediate_size"],
}
LAYOUT_NAME = {"difflm": "difflm export"}


def test_every_required_config_field_is_refused_naming_it_and_the_file():
    """A required field missing from config.json (or null, or not a positive integer) crashed with int(None)'s
    TypeError or a KeyError deep in the import; each is now one line naming hf, config.json, the field and the
    layout it was read as. The complete configs map."""
    from difflm.interop.hf_import import model_dims

    configs = _config_dicts()
    for layout, fields in REQUIRED.items():
        c = configs[layout]
        model_dims(c, "src")  # complete: maps
        name = LAYOUT_NAME.get(layout, layout)
        for key in fields:
            gone = (key, "num_local_experts") if key == "num_experts" else (key,)  # transformers 5 writes the latter
            broken = {k: v for k, v in c.items() if k not in gone}
            if key == "moe_num_experts":  # without it a difflm export is a dense one: no moe_* field is read
                assert "moe" not in model_dims(broken, "src")
                continue
            with pytest.raises(DifflmError) as err:
                model_dims(broken, "src")
            if layout == "difflm" and key.startswith("moe_"):  # an MoE export's moe_* fields are listed together
                assert str(err.value) == (f"hf='src' is a mixture-of-experts difflm export without {key} in its "
                                          "config.json: export the run again with difflm-export")
                continue
            also = " (or num_local_experts)" if key == "num_experts" and layout == "qwen3_moe" else ""
            assert str(err.value).startswith(f"hf='src': config.json has no {key}{also}, a required field of the "
                                             f"{name} layout: add it to config.json"), (layout, key, str(err.value))
        key = fields[0]
        for bad in ("4", 0, 2.5, True):
            with pytest.raises(DifflmError, match=rf"^hf='src': config.json has {key}={bad!r}, not an integer >= 1: "
                                                  rf"fix {key} in config.json"):
                model_dims({**c, key: bad}, "src")


def test_qwen3_moe_without_num_experts_is_one_line(tmp_path):
    """The reported case: a Qwen3-MoE config.json without num_experts crashed with TypeError (int(None)), without
    num_experts_per_tok with KeyError; difflm-import now refuses both in one line, before writing run.dir."""
    from tests.test_moe_import import make_qwen3_moe

    src = make_qwen3_moe(tmp_path)
    full = json.loads((src / "config.json").read_text())
    for key, shown in (("num_experts", "num_experts (or num_local_experts)"),
                       ("num_experts_per_tok", "num_experts_per_tok")):
        gone = (key, "num_local_experts") if key == "num_experts" else (key,)  # transformers 5 writes the latter
        (src / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k not in gone}))
        with pytest.raises(DifflmError) as err:
            import_hf(str(src), tmp_path / "run", objective="ar")
        assert str(err.value) == (f"hf={str(src)!r}: config.json has no {shown}, a required field of the qwen3_moe "
                                  "layout: add it to config.json (the model's own value) or save the model again "
                                  "with save_pretrained")
        assert not (tmp_path / "run").exists()


def test_config_fields_that_change_the_math_are_refused():
    """Qwen3 / Qwen3-MoE attention_bias puts a bias on o_proj as well as q/k/v, Qwen3's use_sliding_window limits
    attention, Mistral slides at 4096 when config.json has no sliding_window, and transformers reads rope_scaling
    before rope_parameters: each is refused in one line naming the key (difflm's model would compute other logits),
    the plain configs still map."""
    from transformers import MistralConfig, Qwen3Config, Qwen3ForCausalLM

    from difflm.interop.hf_import import model_dims

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64)
    biased = Qwen3ForCausalLM(Qwen3Config(**small, head_dim=16, attention_bias=True))
    assert biased.model.layers[0].self_attn.o_proj.bias is not None  # what the import cannot map
    configs = _config_dicts()
    for kind in ("qwen3", "qwen3_moe"):
        assert model_dims(configs[kind], "src")["qkv_bias"] is False
        with pytest.raises(DifflmError, match=r"^hf='src' has attention_bias=true \(bias on o_proj too\)"):
            model_dims({**configs[kind], "attention_bias": True}, "src")
        with pytest.raises(DifflmError, match=r"^hf='src' has use_sliding_window=true: difflm attends to the full"):
            model_dims({**configs[kind], "use_sliding_window": True, "sliding_window": 4}, "src")
    mistral = MistralConfig(**small, sliding_window=None).to_dict()
    assert model_dims(mistral, "src")["num_layers"] == 2
    with pytest.raises(DifflmError, match=r"^hf='src' uses sliding_window=4096: difflm attends to the full window"):
        model_dims({k: v for k, v in mistral.items() if k != "sliding_window"}, "src")
    llama = configs["llama"]
    assert model_dims({**llama, "rope_scaling": {"rope_type": "default"}}, "src")["rope_base"] == 10000.0
    scaled = {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    with pytest.raises(DifflmError, match=r"^hf='src' uses rope_type='linear' \(rope_scaling\): difflm implements"):
        model_dims(scaled, "src")


def test_damaged_source_files_are_one_line(tmp_path):
    """A config.json that is not a JSON object, an index without weight_map, a truncated safetensors or .bin file: one
    line naming hf and the file (no JSONDecodeError / KeyError / SafetensorError traceback), run.dir not created."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32)).save_pretrained(src)
    for f in NEOX.glob("tokenizer*"):
        shutil.copy(f, src / f.name)
    run = tmp_path / "run"
    good = (src / "config.json").read_text()
    for text, said in (("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list, not an object")):
        (src / "config.json").write_text(text)
        with pytest.raises(DifflmError, match=rf"^hf='{src}': {src / 'config.json'} {re.escape(said)}"):
            import_hf(str(src), run)
    (src / "config.json").write_text(good)
    weights = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(weights[:1000])
    with pytest.raises(DifflmError, match=rf"^hf='{src}': {src / 'model.safetensors'} cannot be read \(.*\): the file "
                                          "is damaged or incomplete"):
        import_hf(str(src), run)
    (src / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(DifflmError, match=r"model.safetensors.index.json has no weight_map"):
        import_hf(str(src), run)
    (src / "model.safetensors.index.json").unlink()
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DifflmError, match=r"pytorch_model.bin cannot be read \(.*\): the file is damaged"):
        import_hf(str(src), run)
    assert not run.exists()
    (src / "model.safetensors").write_bytes(weights)  # the intact file imports
    assert import_hf(str(src), run).model.num_layers == 1


def test_import_refuses_empty_or_bad_settings_before_writing(tmp_path):
    """hf= empty (not the current folder), an empty mask_token and vocab_multiple=0 are each refused in one line
    naming the key, before run.dir is claimed or written: run.dir is not created."""
    run = tmp_path / "run"
    for kwargs, said in (({"hf": ""}, "hf= is empty: give a local Hugging Face model directory or a hub name"),
                         ({"mask_token": " "}, "mask_token=' ' is empty: give the text of the token to add"),
                         ({"vocab_multiple": 0}, "vocab_multiple=0 must be an integer >= 1")):
        with pytest.raises(DifflmError, match="^" + re.escape(said)):
            import_hf(**{"hf": str(tmp_path), "run_dir": run, **kwargs})
        assert not run.exists()


def test_hub_repository_with_bin_weights_only_is_fetched(tmp_path, monkeypatch):
    """A hub name is fetched without .bin files (so a repository holding both downloads the safetensors alone); a
    repository whose weights are pytorch_model*.bin only then has its .bin files fetched too, and imports."""
    import huggingface_hub

    from transformers import LlamaConfig, LlamaForCausalLM

    repo = tmp_path / "repo"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    repo.mkdir()
    model.config.save_pretrained(repo)
    torch.save(model.state_dict(), repo / "pytorch_model.bin")
    for f in NEOX.glob("tokenizer*"):
        shutil.copy(f, repo / f.name)
    calls = []

    def fake_download(name, revision=None, local_files_only=False, allow_patterns=()):
        """The files of ``repo`` that match ``allow_patterns``, added to one snapshot folder, as the hub's cache."""
        import fnmatch

        calls.append(list(allow_patterns))
        snap = tmp_path / "snapshot"
        snap.mkdir(exist_ok=True)
        for f in repo.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snap / f.name)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    cfg = import_hf("someone/llama-bin", tmp_path / "run", objective="ar")
    assert cfg.model.num_layers == 1 and len(calls) == 2 and calls[1] == ["pytorch_model*.bin"]
    assert not any("bin" in p for p in calls[0])


def test_export_to_a_symlinked_folder_writes_the_folder_it_names(trained_run, tmp_path):
    """out= a symbolic link to a folder (empty, or an earlier export with overwrite=true): the folder the link names
    is written, the link stays, and no other folder is left beside them."""
    root, _, _ = trained_run
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert export_run(root / "run", tmp_path / "link") == tmp_path / "real"
    assert export_run(root / "run", tmp_path / "link", overwrite=True) == tmp_path / "real"
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_import_of_a_peft_export_says_the_adapter_is_not_read(tmp_path, capsys):
    """difflm-export lora_format=peft writes the base weights and adapter/; difflm-import of that folder imports the
    base (a model of its own) and says in one line that the adapter is not read."""
    src = make_hf(tmp_path, "llama", 50280, False)
    import_hf(str(src), tmp_path / "run", objective="ar")
    assert "PEFT adapter" not in capsys.readouterr().out
    (src / "adapter").mkdir()
    (src / "adapter" / "adapter_config.json").write_text("{}")
    import_hf(str(src), tmp_path / "run2", objective="ar")
    assert (f"difflm: hf={src} holds a PEFT adapter in {src / 'adapter'}, which difflm-import does not read: the run "
            "gets the base weights without it; to import the adapted model, export the LoRA run with "
            "lora_format=merge") in capsys.readouterr().out


def test_overwrite_keeps_the_earlier_export_when_the_new_one_cannot_be_put_in_place(trained_run, tmp_path,
                                                                                   monkeypatch):
    """overwrite=true: when the finished export cannot be renamed to out, the earlier export stays there whole and
    no folder of the export is left beside it."""
    import difflm.interop.export as export_mod

    root, _, _ = trained_run
    out = tmp_path / "hf"
    export_run(root / "run", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def failing_replace(src, dst):
        if Path(dst) == out and Path(src).name.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(export_mod.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        export_run(root / "run", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
