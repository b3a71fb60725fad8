"""The post-training lifecycle across entry points (docs/adaptation.md, lora.md, post_training.md, hf_interop.md):
a full run continued by LoRA SFT on other data, difflm-rl on that LoRA run (its checkpoints and export keep the
adapters), the adapters-off reference, and a resume that would read the ids with another tokenizer."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from difflm.errors import DifflmError
from difflm.training.trainer import Trainer
from test_posttrain_runtime import init_run  # noqa: F401  (pytest fixture)

CPU = torch.device("cpu")
LORA = ["lora=attn_mlp", "lora.rank=4", "lora.alpha=8", "objective.random_length_prob=0"]


def write_pairs(path, n=12):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f" {i} + {i} = {2 * i}. #### {2 * i}"})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def lora_sft_run(tmp_path_factory):
    """A full run (1 step on the embedded corpus), continued in the same run.dir by LoRA SFT on pairs (2 steps)."""
    from conftest import FAST, compose_run

    root = tmp_path_factory.mktemp("lifecycle")
    common = [*FAST, f"run.dir={root / 'run'}", f"data.cache_dir={root / 'cache'}", "train.eval_every=0",
              "train.save_every=1"]
    full = compose_run([*common, "train.max_steps=1"])
    Trainer(full, full.run.dir, CPU).fit()
    pairs = write_pairs(root / "pairs.jsonl")
    sft = compose_run([*common, *LORA, "objective=sft", f"data.path={pairs}", "data.prompt_field=prompt",
                       "train.max_steps=3", "optim.lr=3e-2", "schedule.warmup_steps=0"])
    trainer = Trainer(sft, sft.run.dir, CPU)
    return root, trainer, common


def test_lora_sft_on_a_full_run_reads_its_own_data(lora_sft_run):
    """Adapters on a full run's weights start a new phase on other data (the window count differs from the base's);
    once the LoRA run has checkpoints, its own data is checked on resume as for any run."""
    from conftest import compose_run

    root, trainer, common = lora_sft_run
    assert trainer.resumed_from == 1 and trainer.lora_base == 1
    trainer.fit()
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    sft_losses = [r["loss"] for r in rows if r.get("objective") == "sft" and r.get("loss") is not None]
    assert sft_losses and all(v > 0 for v in sft_losses)  # the responses carry the loss
    other = write_pairs(root / "other.jsonl", n=40)
    again = compose_run([*common, *LORA, "objective=sft", f"data.path={other}", "data.prompt_field=prompt",
                         "train.max_steps=4"])
    with pytest.raises(DifflmError, match="num_windows changed since the checkpoint"):
        Trainer(again, again.run.dir, CPU)


def test_rl_of_a_lora_run_keeps_and_exports_its_adapters(lora_sft_run, tmp_path):
    """difflm-rl on a LoRA run (reference: adapters off) trains the adapters only; its checkpoint holds base and
    adapters, and difflm-generate's load / difflm-export give the policy's logits (the adapters are not dropped)."""
    from transformers import AutoModelForMaskedLM

    from difflm.generate import load_run
    from difflm.interop.export import export_checkpoint
    from difflm.model.lora import adapters_disabled
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    root, trainer, common = lora_sft_run
    if trainer.step < 3:
        trainer.fit()
    _, sft_model, _, _ = load_run(str(root / "run"), None, CPU)
    rl = PostTrainer(rl_config(root / "run", tmp_path / "rl", "algorithm.reference=adapters_off", "optim.lr=5e-2",
                               "train.max_steps=1"), CPU)
    assert {n for n, p in rl.model.named_parameters() if p.requires_grad} == \
        {n for n, _ in rl.model.named_parameters() if ".lora." in n}
    rl.fit()
    policy = {k: v.clone() for k, v in rl.model.state_dict().items()}
    _, loaded, _, step = load_run(str(tmp_path / "rl"), None, CPU)
    assert step == 1 and loaded.state_dict().keys() == policy.keys()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, policy[k]), k
    moved = [k for k in policy if ".lora." in k and not torch.equal(policy[k], sft_model.state_dict()[k])]
    assert moved  # RL moved the adapters ...
    assert all(torch.equal(policy[k], v) for k, v in sft_model.state_dict().items() if ".lora." not in k)  # not W
    x = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = loaded(x)
        with adapters_disabled(loaded):
            assert not torch.allclose(loaded(x), want)
    out, _ = export_checkpoint(tmp_path / "rl", tmp_path / "merged")
    hf = AutoModelForMaskedLM.from_pretrained(str(out), dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, atol=1e-5, rtol=1e-5)
    # difflm-train continues the RL run with LoRA: base and RL adapters read, a fresh optimizer, its own data
    from conftest import compose_run

    more = compose_run([*common, *LORA, "objective=sft", f"data.path={root / 'pairs.jsonl'}",
                        "data.prompt_field=prompt", "train.max_steps=2", f"run.dir={tmp_path / 'rl'}"])
    sft_again = Trainer(more, more.run.dir, CPU)
    assert sft_again.resumed_from == 1 and sft_again.lora_base == 1 and not sft_again.optimizer.state
    for k, v in sft_again.model.state_dict().items():
        assert torch.equal(v, policy[k]), k
    sft_again.fit()
    assert sft_again.step == 2


def test_lora_rl_on_a_full_run(init_run, tmp_path):  # noqa: F811  (the imported fixture)
    """difflm-rl lora=attn_mlp on a full run: fresh adapters (B = 0) train, the base stays bit-equal to the init
    checkpoint, the reference is the base (adapters off, no copy), 2 steps + a resumed 3rd equal 3 straight, and
    difflm-generate's load and difflm-export's merged model of the RL run give the policy's logits."""
    from transformers import AutoModelForMaskedLM

    from difflm.generate import load_run
    from difflm.interop.export import export_checkpoint
    from difflm.model.lora import expected_adapter_count, trainable_parameter_count
    from difflm.posttrain.reference import AdaptersOffReference
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    lora = ["lora=attn_mlp", "lora.rank=4", "lora.alpha=8", "algorithm.reference=adapters_off", "optim.lr=5e-2"]
    _, init_model, _, _ = load_run(str(init_run), None, CPU)
    init = {k: v.clone() for k, v in init_model.state_dict().items()}
    cut = PostTrainer(rl_config(init_run, tmp_path / "cut", *lora), CPU)
    lora_params = {n: p.numel() for n, p in cut.model.named_parameters() if ".lora." in n}
    assert {n for n, p in cut.model.named_parameters() if p.requires_grad} == set(lora_params)
    assert trainable_parameter_count(cut.model) == sum(lora_params.values()) == \
        expected_adapter_count(cut.init_cfg.model, cut.init_cfg.lora) == 1 * 4 * (32 + 96 + 32 + 32 + 32 + 128 + 64 + 32)
    assert sum(p.numel() for g in cut.optimizer.param_groups for p in g["params"]) == sum(lora_params.values())
    assert isinstance(cut.reference, AdaptersOffReference) and not (tmp_path / "cut" / "reference.pt").exists()
    cut.fit()
    x = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(cut.reference(x), init_model(x), atol=0, rtol=0)  # the base, after 2 steps
    policy = {k: v.clone() for k, v in cut.model.state_dict().items()}
    assert all(torch.equal(policy[k], v) for k, v in init.items())  # the base weights: bit-equal to the init run's
    assert any(".lora_B" in k and v.abs().max() > 0 for k, v in policy.items())  # the adapters moved
    _, loaded, _, step = load_run(str(tmp_path / "cut"), None, CPU)  # difflm-generate's read: base + adapters
    assert step == 2 and loaded.state_dict().keys() == policy.keys()
    assert all(torch.equal(v, policy[k]) for k, v in loaded.state_dict().items())
    with torch.no_grad():
        want = loaded(x)
        assert not torch.allclose(want, init_model(x))
    out, _ = export_checkpoint(tmp_path / "cut", tmp_path / "merged")
    hf = AutoModelForMaskedLM.from_pretrained(str(out), dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, atol=1e-5, rtol=1e-5)
    # exact resume: the 2-step run continued to 3 equals 3 straight steps
    resumed = PostTrainer(rl_config(init_run, tmp_path / "cut", *lora, "train.max_steps=3"), CPU)
    assert resumed.step == 2
    resumed.fit()
    straight = PostTrainer(rl_config(init_run, tmp_path / "straight", *lora, "train.max_steps=3"), CPU)
    straight.fit()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(DifflmError, match="holds LoRA adapters and lora.rank=0 here: pass the lora=..."):
        PostTrainer(rl_config(init_run, tmp_path / "cut", "algorithm.reference=adapters_off", "train.max_steps=4"), CPU)


def test_lora_rl_on_a_lora_run_is_refused(tmp_path):
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import make_init_run, rl_config

    (tmp_path / "init").mkdir()
    init = make_init_run(tmp_path / "init", "lora=attn")
    with pytest.raises(DifflmError, match="lora=attn_mlp with init.run_dir=.*a LoRA run .lora.rank=16.: difflm-rl "
                                          "trains that run's adapters; drop lora="):
        PostTrainer(rl_config(init, tmp_path / "rl", "lora=attn_mlp"), CPU)
    with pytest.raises(DifflmError, match=r"^lora.rank=4 with init.run_dir=.*drop lora=... and lora.\*"):
        PostTrainer(rl_config(init, tmp_path / "rl", "lora.rank=4"), CPU)  # a rank alone adds adapters too


def test_rl_negative_lora_rank_is_refused(init_run, tmp_path):
    """``difflm-rl lora=attn lora.rank=-1`` is refused as difflm-train refuses it, rather than read as "no
    adapters" (which would train every weight without a word)."""
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    with pytest.raises(DifflmError, match=r"^lora.rank=-1 must be >= 0 \(0 turns LoRA off\)$"):
        PostTrainer(rl_config(init_run, tmp_path / "rl", "lora=attn", "lora.rank=-1"), CPU)


def test_adapters_off_reference_needs_adapters():
    from difflm.config.schema import ModelConfig
    from difflm.model import build_model
    from difflm.posttrain.reference import build_reference

    model = build_model(OmegaConf.structured(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                                         ffn_hidden_size=64, head_dim=16, vocab_size=128)),
                        causal=False, device=CPU, seed=0)
    with pytest.raises(DifflmError, match="algorithm.reference=adapters_off needs a LoRA run"):
        build_reference("adapters_off", model)


def test_resume_with_another_tokenizer_is_refused(tmp_path):
    """The default tokenizer where the run's checkpoint used another one (e.g. a difflm-import run's own) is
    refused; the same tokenizer under another path (a copied run) is not."""
    from transformers import AutoTokenizer

    from difflm.checkpoint.store import save_checkpoint
    from difflm.config import asset_path
    from difflm.data import build_tokenizer
    from difflm.training.run_config import check_resume_tokenizer

    neox = str(asset_path("tokenizers/gpt-neox-20b"))
    other = tmp_path / "other_tok"
    tok = AutoTokenizer.from_pretrained(neox)
    tok.add_tokens(["<|extra|>"])  # the same embedding shape (50304 rows), other ids: the mask moves by one
    tok.save_pretrained(str(other))
    copy = tmp_path / "copy_tok"
    shutil.copytree(neox, copy)
    run = tmp_path / "run"
    save_checkpoint(run, 1, torch.nn.Linear(2, 2), None, {"step": 1},
                    config=OmegaConf.to_yaml({"data": {"tokenizer": str(other)}}))
    check_resume_tokenizer(run, str(other), build_tokenizer(str(other)), 128)  # unchanged
    with pytest.raises(DifflmError, match=f"pass data.tokenizer={other}$"):
        check_resume_tokenizer(run, neox, build_tokenizer(neox), 128)
    save_checkpoint(run, 2, torch.nn.Linear(2, 2), None, {"step": 2},
                    config=OmegaConf.to_yaml({"data": {"tokenizer": neox}}))
    check_resume_tokenizer(run, str(copy), build_tokenizer(str(copy)), 128)  # the same definition elsewhere


def test_answer_reward_without_answer_field_is_refused(tmp_path):
    """reward=gsm8k (difflm-rl's default) compares with the reference answer: without data.answer_field every
    completion would fail it and score 0, so the run is refused before its first rollout; reward=format is not."""
    from difflm.posttrain.rewards import build_reward
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_config import compose_rl

    assert build_reward(compose_rl(["reward=gsm8k"]).reward).needs_answer() == ["gsm8k_answer_match"]
    assert build_reward(compose_rl(["reward=format"]).reward).needs_answer() == []
    cfg = compose_rl([f"run.dir={tmp_path / 'rl'}", "data.path=x.jsonl"])
    with pytest.raises(DifflmError, match="data.answer_field is null: set data.answer_field"):
        PostTrainer(cfg, CPU)
    assert not (tmp_path / "rl").exists()  # refused before anything is written


def test_rl_warns_beyond_the_trained_window(init_run, tmp_path):
    """Prompts + gen.length (grpo) or prompt + response (dpo) past the init run's data.seq_len (128) are warned about
    once, naming the keys that shorten them, as difflm-generate does; within the window nothing is said."""
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    quiet = PostTrainer(rl_config(init_run, tmp_path / "a"), CPU)  # 8 prompt tokens + gen.length=4
    assert not any("warning" in r for r in quiet._reports)
    loud = PostTrainer(rl_config(init_run, tmp_path / "b", "gen.length=128", "gen.block_length=128",
                                 "gen.steps=64"), CPU)
    warned = [r for r in loud._reports if "warning" in r]
    assert len(warned) == 1 and "the longest prompt (8 tokens) and gen.length=128 make 136 positions, more than " \
        "the data.seq_len=128" in warned[0] and warned[0].endswith("lower data.max_prompt_tokens or gen.length")


def test_rl_names_the_prompts_and_responses_it_cuts(init_run, tmp_path):
    """data.max_prompt_tokens / data.max_response_tokens cut records silently no more: one notice says how many
    prompts (GRPO, DPO) and chosen / rejected responses (DPO) are cut, what they lose and the key that keeps them
    whole, as difflm-train's SFT notice does; records that fit say nothing."""
    from difflm.posttrain.rewards.gsm8k import GSM8K_SAMPLE
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    grpo = PostTrainer(rl_config(init_run, tmp_path / "g"), CPU)  # data.max_prompt_tokens=8 on GSM8K's questions
    lengths = [len(grpo.tok.encode(json.loads(line)["question"])) for line in open(GSM8K_SAMPLE)]
    cut = sum(n > 8 for n in lengths)
    assert 0 < cut <= len(lengths) == 32
    assert [r for r in grpo._reports if "notice" in r] == [
        f"difflm: notice: data.max_prompt_tokens=8 cuts {cut} of 32 prompts (their start is dropped, the end kept; "
        f"the longest has {max(lengths)} tokens: data.max_prompt_tokens={max(lengths)} keeps every one whole)"]
    whole = PostTrainer(rl_config(init_run, tmp_path / "w", f"data.max_prompt_tokens={max(lengths)}"), CPU)
    assert not any("notice" in r for r in whole._reports)

    prefs = tmp_path / "prefs.jsonl"
    pairs = [("1 + 1 =", " 2", " 3"), ("2 + 2 =", " four, as every child knows", " 5")]
    prefs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in pairs * 3))
    dpo = PostTrainer(rl_config(init_run, tmp_path / "d", "algorithm=dpo", "estimator=mc_elbo", f"data.path={prefs}",
                                "data.prompt_field=prompt", "data.answer_field=null", "data.max_response_tokens=3"),
                      CPU)
    long = len(dpo.tok.encode(" four, as every child knows")) + 1  # + EOS
    assert long > 3 >= len(dpo.tok.encode(" 3")) + 1
    assert [r for r in dpo._reports if "notice" in r] == [
        f"difflm: notice: data.max_response_tokens=3 cuts 3 of 12 chosen / rejected responses (they lose their end, "
        f"the EOS that tells the model to stop included; the longest has {long} tokens: "
        f"data.max_response_tokens={long} keeps every one whole)"]


def chat_tokenizer(path):
    """The embedded GPT-NeoX tokenizer with a small chat template, saved at ``path``."""
    from transformers import AutoTokenizer

    from difflm.config import asset_path

    tok = AutoTokenizer.from_pretrained(str(asset_path("tokenizers/gpt-neox-20b")))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tok.save_pretrained(str(path))
    return str(path)


def test_rl_prompts_as_a_chat_sft_run_by_default(tmp_path):
    """difflm-rl's data.chat_template defaults to the init run's: an SFT run trained with data.chat_template=true has
    its rollout prompts wrapped in the template (as difflm-generate wraps them), not raw; false given on the command
    line reaches the RL run's config.yaml, so difflm-generate of that run prompts raw as the RL run trained."""
    from difflm.data.sft import chat_prompt_ids
    from difflm.generate import run_chat_template
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import make_init_run, rl_config

    tokdir = chat_tokenizer(tmp_path / "tok")
    (tmp_path / "init").mkdir()
    init = make_init_run(tmp_path / "init", "objective=sft", "data.chat_template=true", f"data.tokenizer={tokdir}")
    record = {"prompt_field": "What is 2 plus 3?", "answer_field": "5"}
    rl = PostTrainer(rl_config(init, tmp_path / "rl", "data.max_prompt_tokens=64"), CPU)
    assert rl.cfg.data.chat_template is True
    wrapped = chat_prompt_ids(rl.tok.tokenizer, "What is 2 plus 3?")
    assert rl.prompt_ids(record) == wrapped and wrapped != rl.tok.encode("What is 2 plus 3?")
    assert run_chat_template(OmegaConf.load(tmp_path / "rl" / "config.yaml"))
    raw = PostTrainer(rl_config(init, tmp_path / "raw", "data.chat_template=false", "data.max_prompt_tokens=64"), CPU)
    assert raw.prompt_ids(record) == raw.tok.encode("What is 2 plus 3?")
    assert not run_chat_template(OmegaConf.load(tmp_path / "raw" / "config.yaml"))
    (tmp_path / "plain").mkdir()
    plain = make_init_run(tmp_path / "plain")  # an mdlm run: raw prompts by default
    assert PostTrainer(rl_config(plain, tmp_path / "p"), CPU).cfg.data.chat_template is False


def test_rl_on_a_bd3lm_run_samples_in_its_blocks(tmp_path):
    """difflm-rl's gen.block_length=null (its default) on a bd3lm run is the run's own block size, as difflm-generate's
    null is; a value given is taken as given: the run's block size is honoured, another one (32, the former default,
    included: it used to stand for the run's blocks whatever they were) is refused in one line before anything is
    written. On an mdlm run null is 32 for gen.length=64, as the former default was."""
    from difflm.config.schema import RLRunConfig
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import make_init_run, rl_config

    assert RLRunConfig().gen.block_length is None
    (tmp_path / "init").mkdir()
    init = make_init_run(tmp_path / "init", "objective=bd3lm", "objective.block_size=2")
    rl = PostTrainer(rl_config(init, tmp_path / "rl", "train.max_steps=1", "gen.block_length=null"), CPU)
    assert rl.cfg.gen.block_length == 2
    assert rl.fit()["completion_len"] > 0
    assert OmegaConf.load(tmp_path / "rl" / "rl_config.yaml").gen.block_length == 2  # what the rollouts decoded in
    assert PostTrainer(rl_config(init, tmp_path / "own", "gen.block_length=2"), CPU).cfg.gen.block_length == 2
    for given in (32, 4):
        with pytest.raises(DifflmError, match=f"^gen.block_length={given} is not read by objective=bd3lm runs, which "
                                              r"sample in the model's blocks of 2 tokens \(its objective.block_size\): drop "
                                              "gen.block_length$"):
            PostTrainer(rl_config(init, tmp_path / f"bad{given}", f"gen.block_length={given}"), CPU)
        assert not (tmp_path / f"bad{given}" / "checkpoints").exists()
    (tmp_path / "plain").mkdir()
    plain = make_init_run(tmp_path / "plain")
    null = PostTrainer(rl_config(plain, tmp_path / "p", "gen.length=64", "gen.steps=2", "gen.block_length=null"), CPU)
    assert null.cfg.gen.block_length == 32
    explicit = PostTrainer(rl_config(plain, tmp_path / "e", "gen.length=64", "gen.steps=4", "gen.block_length=16"), CPU)
    assert explicit.cfg.gen.block_length == 16


def test_rl_resume_reports_changes_and_refuses_another_init(init_run, tmp_path):
    """A resumed difflm-rl run with other settings names each changed key and keeps the earlier rl_config.yaml as
    rl_config.step_<N>.yaml (as difflm-train keeps config.step_<N>.yaml); a resume from another init.run_dir, whose
    model the checkpoints and reference.pt do not hold, is refused in one line."""
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import make_init_run, rl_config

    run = tmp_path / "rl"
    PostTrainer(rl_config(init_run, run, "train.max_steps=1"), CPU).fit()
    resumed = PostTrainer(rl_config(init_run, run, "algorithm.group_size=3"), CPU)
    assert resumed.step == 1
    said = [r for r in resumed._reports if "changed settings" in r]
    assert len(said) == 1 and said[0].startswith("difflm: resuming at step 1 with changed settings: "
                                                 "algorithm.group_size: 2 -> 3, train.max_steps: 1 -> 2")
    assert OmegaConf.load(run / "rl_config.step_1.yaml").algorithm.group_size == 2
    assert OmegaConf.load(run / "rl_config.yaml").algorithm.group_size == 3
    (tmp_path / "other").mkdir()
    other = make_init_run(tmp_path / "other", "model.hidden_size=64")
    with pytest.raises(DifflmError, match=f"^init.run_dir={other}: run.dir={run} was started from "
                                          f"init.run_dir={init_run} .*pass init.run_dir={init_run} to resume it"):
        PostTrainer(rl_config(other, run), CPU)


@pytest.mark.slow  # starts a process
def test_rl_multirun_gives_each_job_its_run_dir(init_run, tmp_path):
    """``difflm-rl -m optim.lr=a,b run.dir=D`` runs each job in D/<job number>, as difflm-train does: the second
    job trains with its own learning rate and does not resume the first job's finished run."""
    from conftest import run_cli
    from test_posttrain_runtime import GSM8K

    out = run_cli("difflm.rl", "-m", "optim.lr=1e-3,1e-2", f"run.dir={tmp_path / 'sweep'}",
                  f"init.run_dir={init_run}", "device=cpu", f"data.path={GSM8K}", "data.prompt_field=question",
                  "data.answer_field=answer", "data.eval_records=1", "data.max_prompt_tokens=8", "gen.length=4",
                  "gen.steps=2", "gen.block_length=4", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
                  "estimator=one_step", "train.max_steps=1", "logger.progress_bar=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for job, lr in (("0", 1e-3), ("1", 1e-2)):
        rows = [json.loads(line) for line in open(tmp_path / "sweep" / job / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [0, 1] and rows[1]["lr"] == lr
        assert (tmp_path / "sweep" / job / "checkpoints" / "step_1").is_dir()
    assert "resuming" not in out.stdout and not (tmp_path / "multirun").exists()


def test_peft_export_message_names_the_adapter_folder():
    """difflm-export lora_format=peft writes the base model and its adapters in out/adapter: its last line says both,
    where a merged export's line names the model only."""
    from pathlib import Path

    from difflm.interop.export import export_peft_hint

    assert export_peft_hint(Path("hf/base"), "peft") == (" (the base, without the adapters), then "
                                                         "PeftModel.from_pretrained(model, 'hf/base/adapter') for the "
                                                         "adapters")
    assert export_peft_hint(Path("hf/merged"), "merge") == ""


def test_a_sweep_over_a_run_with_checkpoints_is_refused(tmp_path, capsys):
    """``difflm-train -m lora.rank=4,8 run.dir=<a difflm-import run>`` would run each job in <run.dir>/<n>, which
    holds no checkpoint, so the LoRA jobs would train adapters on the keyed random init (``lora_base: -1``) instead
    of the imported weights. A sweep whose run.dir holds checkpoints is refused before any job starts; a sweep
    directory of earlier jobs (their checkpoints in <run.dir>/<n>) is not."""
    from difflm.checkpoint.store import save_checkpoint
    from difflm.training.run_dir import RunDirGuard, check_sweep_dir

    sweep = tmp_path / "sweep"
    save_checkpoint(sweep / "0", 1, torch.nn.Linear(2, 2), None, {"step": 1})  # a job of an earlier sweep
    check_sweep_dir(sweep)
    base = tmp_path / "imported"
    save_checkpoint(base, 0, torch.nn.Linear(2, 2), None, {"step": 0})
    with pytest.raises(DifflmError, match=f"^run.dir='{base}' holds checkpoints .step_0., and under -m each job runs "
                                          "in <run.dir>/<job number> without them"):
        check_sweep_dir(base)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(base)}}})
    with pytest.raises(SystemExit) as exit_:
        RunDirGuard().on_multirun_start(config)
    assert exit_.value.code == 2 and "holds checkpoints (step_0)" in capsys.readouterr().err


@pytest.mark.slow  # starts a process
def test_rl_prompt_template_takes_any_text(tmp_path):
    """``data.prompt_template=Question: {prompt}, in short. Answer:`` is a prompt's text as typed, as ``prompt=`` of
    difflm-generate: Hydra would read the braces as a dict and the comma as a sweep and refuse the line."""
    from conftest import run_cli

    out = run_cli("difflm.rl", f"init.run_dir={tmp_path}", "data.prompt_template=Question: {prompt}, in short. Answer:",
                  "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "prompt_template: 'Question: {prompt}, in short. Answer:'" in out.stdout


def test_a_relative_tokenizer_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    """``difflm-train data.tokenizer=runs/x/tokenizer`` (the commands of docs/adaptation.md) records the absolute
    path in config.yaml: difflm-generate, -eval, -export and -rl read the run from any folder, where the relative
    path would name nothing (or a hub repository). A hub name stays as it is."""
    from conftest import FAST, compose_run

    from difflm.config import asset_path
    from difflm.data.tokenizer import tokenizer_reference

    shutil.copytree(asset_path("tokenizers/gpt-neox-20b"), tmp_path / "runs" / "x" / "tokenizer")
    monkeypatch.chdir(tmp_path)
    cfg = compose_run([*FAST, "run.dir=runs/x", "data.tokenizer=runs/x/tokenizer", "train.max_steps=1",
                       "train.eval_every=0"])
    Trainer(cfg, cfg.run.dir, CPU)
    recorded = OmegaConf.load(tmp_path / "runs" / "x" / "config.yaml").data.tokenizer
    assert recorded == str(tmp_path / "runs" / "x" / "tokenizer")
    assert tokenizer_reference("EleutherAI/gpt-neox-20b") == "EleutherAI/gpt-neox-20b"


def test_rl_names_init_keys_for_a_missing_init_run_or_step(init_run, tmp_path):  # noqa: F811
    """difflm-rl's trained run is init.run_dir (run.dir is the RL run's own folder), its checkpoint init.step: a
    folder without a run or a step without a checkpoint is refused naming those keys; difflm-generate's names stay
    run.dir / step."""
    from difflm.generate import load_run
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    missing = tmp_path / "nope"
    with pytest.raises(DifflmError, match=f"^init.run_dir='{missing}' has no config.yaml: point init.run_dir at a "
                                          "difflm-train output directory"):
        PostTrainer(rl_config(missing, tmp_path / "rl"), CPU)
    with pytest.raises(DifflmError, match=rf"^init.step=7 has no checkpoint in {init_run}: choose one of \[0\]$"):
        PostTrainer(rl_config(init_run, tmp_path / "rl", "init.step=7"), CPU)
    with pytest.raises(DifflmError, match=rf"^step=7 has no checkpoint in {init_run}: choose one of \[0\]$"):
        load_run(str(init_run), 7, CPU)


def test_rl_checks_the_rollout_block_and_step_counts_before_it_starts(init_run, tmp_path):  # noqa: F811
    """docs/post_training.md: the rollouts' gen.* are checked before the run starts. A gen.length that the LLaDA
    sampler's blocks given do not divide, or a step count that does not fit them, is refused in one line with a
    consistent setting, before the frozen reference or rl_config.yaml is written (the same rule as difflm-train's
    end-of-training samples); gen.block_length=null fits the length (16: one block of 16)."""
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    null = PostTrainer(rl_config(init_run, tmp_path / "null", "gen.length=16", "gen.steps=8", "gen.block_length=null"),
                       CPU)
    assert (null.cfg.gen.block_length, null.cfg.gen.steps) == (16, 8)
    for i, (overrides, message) in enumerate([(("gen.length=16", "gen.steps=8", "gen.block_length=32"),
                                "gen.length=16 must be a multiple of gen.block_length=32; e.g. gen.length=16 "
                                "gen.block_length=16 gen.steps=8"),
                               (("gen.length=8", "gen.steps=3", "gen.block_length=4"),
                                "gen.steps=3 must be a multiple of the number of blocks, 2 (gen.length=8 / "
                                "gen.block_length=4); e.g. gen.length=8 gen.block_length=4 gen.steps=2")]):
        run_dir = tmp_path / f"rl{i}"
        with pytest.raises(DifflmError, match=f"^{re.escape(message)}$"):
            PostTrainer(rl_config(init_run, run_dir, *overrides), CPU)
        assert not (run_dir / "reference.pt").exists() and not (run_dir / "rl_config.yaml").exists()


def test_rl_resume_with_other_adapter_shapes_is_refused(init_run, tmp_path):  # noqa: F811
    """difflm-rl lora=... on a full run: its checkpoints and reference.pt hold adapters of the lora.rank / targets
    its rl_config.yaml names; a resume with another rank is refused in one line naming it (not a state-dict
    traceback from reference.pt)."""
    from difflm.posttrain.runner import PostTrainer
    from test_posttrain_runtime import rl_config

    first = ("lora=attn_mlp", "lora.rank=4", "lora.alpha=8", "train.max_steps=1")
    PostTrainer(rl_config(init_run, tmp_path / "rl", *first), CPU).fit()
    with pytest.raises(DifflmError, match=rf"^lora.rank=2: run.dir={tmp_path / 'rl'} \(its rl_config.yaml\) holds "
                                          r"the adapters of lora.rank=4; resume with lora.rank=4, or start a new "
                                          r"run.dir$"):
        PostTrainer(rl_config(init_run, tmp_path / "rl", "lora=attn_mlp", "lora.rank=2", "lora.alpha=8"), CPU)
    assert PostTrainer(rl_config(init_run, tmp_path / "rl", *first[:3]), CPU).step == 1
