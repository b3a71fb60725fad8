"""difflm-rl end to end on CPU: a tiny random run post-trained by GRPO and by DPO, its metrics, checkpoints and an
exact resume."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_cli


def completion_length_reward(prompt, completion, answer=None):
    """A reward that varies between completions of a random model: the number of characters, scaled."""
    return len(completion) / 10.0


@pytest.fixture(scope="module")
def init_run(tmp_path_factory):
    """A difflm run dir holding a randomly initialised one-layer tiny model (config.yaml + checkpoint step 0)."""
    return make_init_run(tmp_path_factory.mktemp("init"))


def make_init_run(path, *overrides, model="tiny"):
    """:func:`init_run` in ``path``, with extra training ``overrides`` (also the start of
    tests/test_posttrain_layouts.py's runs); ``model`` the model preset it shrinks."""
    from difflm.checkpoint.store import save_checkpoint
    from difflm.config.compose import compose_train_config
    from difflm.data import build_tokenizer
    from difflm.model import build_model, resolve_model_config

    cfg = compose_train_config([f"model={model}", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                                "model.num_kv_heads=2", "model.ffn_hidden_size=64", f"run.dir={path}", *overrides],
                               device=torch.device("cpu"))  # the kernels difflm-train would choose here
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    resolve_model_config(cfg.model, tok.padded_vocab_size)
    model = build_model(cfg.model, causal=False, device=torch.device("cpu"), seed=0)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    save_checkpoint(path, 0, model, None, {"step": 0}, config=OmegaConf.to_yaml(cfg))
    return path


def rl_config(init, run_dir, *overrides):
    from hydra import compose, initialize_config_dir

    from difflm.config import CONF_DIR
    from difflm.config.schema import register_schema

    register_schema()
    base = [f"init.run_dir={init}", f"run.dir={run_dir}", "device=cpu", f"data.path={GSM8K}",
            "data.prompt_field=question", "data.answer_field=answer", "data.eval_records=2",
            "data.max_prompt_tokens=8", "gen.length=4", "gen.steps=2", "gen.block_length=4", "gen.temperature=1.0",
            "algorithm.prompts_per_step=1", "algorithm.group_size=2", "estimator=one_step",
            "train.max_steps=2", "train.save_every=1", "train.eval_every=0", "logger.progress_bar=false",
            "logger.log_every=1", "optim.lr=1e-2", "reward.terms=[{_target_: test_posttrain_runtime."
            "completion_length_reward, _partial_: true, weight: 1.0}]"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("rl", base + list(overrides))


from difflm.posttrain.rewards.gsm8k import GSM8K_SAMPLE as GSM8K  # noqa: E402


def test_grpo_runs_logs_and_resumes_exactly(init_run, tmp_path):
    from difflm.posttrain.runner import PostTrainer

    full = PostTrainer(rl_config(init_run, tmp_path / "full"), torch.device("cpu"))
    last = full.fit()
    for key in ("loss", "reward_mean", "reward_std", "kl", "clip_fraction", "completion_len", "rollout_tokens_per_s",
                "forwards_per_token", "eval_reward", "lr"):
        assert key in last, key
    assert last["forwards_per_token"] == 2 / 4  # gen.steps model calls for gen.length tokens
    rows = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["objective"] == "grpo"
    assert rows[1]["reward_std"] > 0  # the length reward varies, so the step moves the policy
    # stop after step 1, resume to step 2: the same weights as the uninterrupted run
    PostTrainer(rl_config(init_run, tmp_path / "cut", "train.max_steps=1"), torch.device("cpu")).fit()
    resumed = PostTrainer(rl_config(init_run, tmp_path / "cut"), torch.device("cpu"))
    assert resumed.step == 1
    resumed.fit()
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert (tmp_path / "full" / "reference.pt").exists()
    # a resume that would train nothing is refused, as difflm-train refuses it: below the checkpoint's step, or at it
    # with other settings; the same command again trains nothing
    from difflm.errors import DifflmError

    with pytest.raises(DifflmError, match=r"^train.max_steps=1 is below the step of the checkpoint this run resumes "
                                          r"from \(.*step_2\): nothing would train; raise train.max_steps"):
        PostTrainer(rl_config(init_run, tmp_path / "full", "train.max_steps=1"), torch.device("cpu"))
    with pytest.raises(DifflmError, match=r"^train.max_steps=2 is the step of the checkpoint this run resumes from "
                                          r"\(.*step_2\), so nothing would train with the changed settings "
                                          r"\(algorithm.beta\): raise train.max_steps"):
        PostTrainer(rl_config(init_run, tmp_path / "full", "algorithm.beta=0"), torch.device("cpu"))
    again = PostTrainer(rl_config(init_run, tmp_path / "full"), torch.device("cpu"))
    again.fit()
    assert again.step == 2 and len(open(tmp_path / "full" / "metrics.jsonl").readlines()) == len(rows)
    ref = full.reference.model.state_dict()
    init = torch.load(tmp_path / "full" / "reference.pt", weights_only=True)
    assert all(torch.equal(ref[k], init[k]) for k in init)  # the reference stays the initial policy


def test_logged_lr_is_the_steps_and_a_resume_takes_the_new_optim_lr(init_run, tmp_path):
    """``lr`` in the metrics is the learning rate the step's updates ran with (the warmup's first step: half of
    optim.lr at schedule.warmup_steps=2), and a resume with another ``optim.lr`` trains with it: the schedule's
    position comes from the checkpoint, its base from the run's optim.lr."""
    from difflm.posttrain.runner import PostTrainer

    used = []

    def record(run):
        update = run.update

        def wrapped(loss):
            used.append(run.optimizer.param_groups[0]["lr"])
            return update(loss)
        run.update = wrapped
        return run

    warm = ("schedule.warmup_steps=2", "algorithm.num_inner=1", "algorithm.beta=0")
    first = record(PostTrainer(rl_config(init_run, tmp_path / "run", "train.max_steps=1", "optim.lr=1e-2", *warm),
                               torch.device("cpu")))
    assert first.fit()["lr"] == pytest.approx(5e-3) and used == [pytest.approx(5e-3)]
    resumed = record(PostTrainer(rl_config(init_run, tmp_path / "run", "train.max_steps=2", "optim.lr=1e-4", *warm),
                                 torch.device("cpu")))
    assert resumed.step == 1
    assert resumed.fit()["lr"] == pytest.approx(1e-4) and used[1:] == [pytest.approx(1e-4)]


def test_grpo_on_a_moe_run_ends_each_update_as_training_does_and_resumes_exactly(tmp_path):
    """A MoE init run (model.moe.balance_over=global_batch, the aux-loss-free bias on): each update ends as a
    difflm-train step does (:func:`difflm.model.moe.moe_step`: the bias moves, the expert counts restart), so a run
    stopped and resumed ends with the uninterrupted run's weights."""
    from difflm.model.moe import moe_layers
    from difflm.posttrain.runner import PostTrainer

    (tmp_path / "init").mkdir()
    init = make_init_run(tmp_path / "init", "model.moe.balance_over=global_batch", "model.moe.bias_update_rate=0.01",
                         "model.moe.num_shared_experts=0", model="moe-tiny")
    length = "reward.terms=[{_target_: test_posttrain_runtime.completion_length_reward, _partial_: true, weight: 1}]"
    settings = (length, "algorithm.beta=0", "data.eval_records=0")
    full = PostTrainer(rl_config(init, tmp_path / "full", *settings), torch.device("cpu"))
    full.fit()
    layers = [m for _, m in moe_layers([full.model])]
    assert layers and all(bool(m.router.bias.abs().sum() > 0) for m in layers)
    assert all(not m.balance_tokens.any() and not m.step_tokens.any() for m in layers)
    PostTrainer(rl_config(init, tmp_path / "cut", *settings, "train.max_steps=1"), torch.device("cpu")).fit()
    resumed = PostTrainer(rl_config(init, tmp_path / "cut", *settings), torch.device("cpu"))
    resumed.fit()
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_grpo_without_kl_holds_no_reference(init_run, tmp_path):
    """``algorithm.beta=0``: no KL term, so the default ``frozen_copy`` is neither built, saved nor laid out."""
    from difflm.posttrain.runner import PostTrainer

    run = PostTrainer(rl_config(init_run, tmp_path / "run", "algorithm.beta=0", "train.max_steps=1"),
                      torch.device("cpu"))
    assert run.reference is None and run._modules() == [run.model]
    last = run.fit()
    assert last["kl"] == 0 and not (tmp_path / "run" / "reference.pt").exists()


def test_dpo_runs(init_run, tmp_path):
    from difflm.posttrain.runner import PostTrainer

    prefs = tmp_path / "prefs.jsonl"
    with open(prefs, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"{i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"}) + "\n")
    cfg = rl_config(init_run, tmp_path / "dpo", "algorithm=dpo", "estimator=mc_elbo", f"data.path={prefs}",
                    "data.prompt_field=prompt", "data.answer_field=null", "algorithm.prompts_per_step=2")
    last = PostTrainer(cfg, torch.device("cpu")).fit()
    assert {"loss", "margin", "accuracy", "elbo_margin", "eval_elbo_margin"} <= set(last)
    rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
    first = next(r for r in rows if r["step"] == 1)
    # at the first step the policy is the reference and both see the same noise (VRPO): every score difference is
    # exactly 0, so the loss is log 2 and the margin 0
    assert abs(first["loss"] - 0.693147) < 1e-5 and abs(first["margin"]) < 1e-6


def test_dpo_one_step_masks_only_prompt_tokens(init_run, tmp_path, monkeypatch):
    """DPO with ``estimator=one_step``: its random mask reaches the real prompt tokens (and the whole completion),
    never the EOS padding after the shorter responses of a batch nor the prompts' left padding."""
    from difflm.model.transformer import Transformer
    from difflm.posttrain.dpo_step import preference_batch
    from difflm.posttrain.runner import PostTrainer

    prefs = tmp_path / "prefs.jsonl"
    with open(prefs, "w") as f:
        for i in range(4):
            prompt = "one two three four five six" if i % 2 else "hi"
            f.write(json.dumps({"prompt": prompt, "chosen": " yes" * (4 * i + 1), "rejected": " no"}) + "\n")
    cfg = rl_config(init_run, tmp_path / "dpo", "algorithm=dpo", "estimator.prompt_mask_prob=0.9",
                    f"data.path={prefs}", "data.prompt_field=prompt", "data.answer_field=null",
                    "algorithm.prompts_per_step=4", "data.eval_records=0", "train.max_steps=1")
    run = PostTrainer(cfg, torch.device("cpu"))
    seen, forward = [], Transformer.forward
    monkeypatch.setattr(Transformer, "forward", lambda self, x, **kw: seen.append(x.clone()) or forward(self, x, **kw))
    run.fit()
    _, _, cc, rc, _, prompt = preference_batch(run, run.records_of_step(0)[0])
    masked = torch.cat([prompt, prompt]) | torch.cat([cc, rc])
    assert len(seen) == 2 and all(x.shape == masked.shape for x in seen)  # the policy's estimate, the reference's
    for x in seen:
        hit = x == run.tok.mask_id
        assert hit[torch.cat([cc, rc])].all() and hit[torch.cat([prompt, prompt])].any()
        assert not hit[~masked].any()


def test_records_and_the_init_runs_objective_are_checked_before_its_model_loads(tmp_path, monkeypatch):
    """An ar init run and an empty record file are refused before the init model is read (a large model takes
    minutes to load), each in one line naming the key."""
    import difflm.generate
    from difflm.errors import DifflmError
    from difflm.posttrain.runner import PostTrainer

    (tmp_path / "ar").mkdir()
    ar = make_init_run(tmp_path / "ar", "objective=ar")
    monkeypatch.setattr(difflm.generate, "load_run", lambda *a, **k: pytest.fail("the init model was read"))
    with pytest.raises(DifflmError) as info:
        PostTrainer(rl_config(ar, tmp_path / "rl"), torch.device("cpu"))
    assert str(info.value) == (f"init.run_dir={ar} is an objective=ar run: difflm-rl post-trains masked-diffusion "
                               "models (mdlm, sft, bd3lm)")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DifflmError, match=r"^data.path='.*empty.jsonl' holds no records"):
        PostTrainer(rl_config(ar, tmp_path / "rl", f"data.path={tmp_path / 'empty.jsonl'}"), torch.device("cpu"))


def test_a_fresh_start_sets_an_earlier_runs_records_aside(init_run, tmp_path, capsys):
    """A run.dir without a checkpoint but with an earlier run's records (it stopped before its first save): the new
    run moves them into previous/<time>/, as difflm-train does, instead of appending its rows to their metrics.jsonl,
    resuming their W&B run or writing its rl_config.yaml over theirs."""
    from difflm.posttrain.runner import PostTrainer

    run = tmp_path / "run"
    run.mkdir()
    old = json.dumps({"step": 1, "loss": 5.0, "objective": "grpo"}) + "\n"
    (run / "metrics.jsonl").write_text(old)
    (run / "wandb_id.txt").write_text("oldrun01")
    (run / "rl_config.yaml").write_text("optim:\n  lr: 0.5\n")  # the earlier run's settings stay with its records
    (run / "rl_config.step_3.yaml").write_text("optim:\n  lr: 0.7\n")
    PostTrainer(rl_config(init_run, run, "train.max_steps=1"), torch.device("cpu")).fit()
    (kept,) = (run / "previous").iterdir()
    assert (kept / "metrics.jsonl").read_text() == old and (kept / "wandb_id.txt").read_text() == "oldrun01"
    assert (kept / "rl_config.yaml").read_text() == "optim:\n  lr: 0.5\n"
    assert (kept / "rl_config.step_3.yaml").read_text() == "optim:\n  lr: 0.7\n"
    assert "lr: 0.5" not in (run / "rl_config.yaml").read_text() and not (run / "rl_config.step_3.yaml").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert f"holds an earlier run's records: moved them to {kept}; this run starts afresh" in capsys.readouterr().out


def test_wandb_logger_keys_are_read_as_difflm_train_reads_them(init_run, tmp_path, monkeypatch):
    """logger=wandb without wandb importable is refused before the init model is read; logger.mode=disabled
    needs no wandb and starts no W&B run (no wandb_id.txt for a later run to resume), as in difflm-train."""
    import sys

    import difflm.generate
    from difflm.errors import DifflmError
    from difflm.posttrain.runner import PostTrainer

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    load_run = difflm.generate.load_run
    monkeypatch.setattr(difflm.generate, "load_run", lambda *a, **k: pytest.fail("the init model was read"))
    with pytest.raises(DifflmError, match=r"^logger=wandb needs the wandb package.*pip install wandb"):
        PostTrainer(rl_config(init_run, tmp_path / "offline", "logger=wandb", "logger.mode=offline"),
                    torch.device("cpu"))
    monkeypatch.setattr(difflm.generate, "load_run", load_run)
    run = PostTrainer(rl_config(init_run, tmp_path / "disabled", "logger=wandb", "logger.mode=disabled",
                                "train.max_steps=1"), torch.device("cpu"))
    assert run.fit()["step"] == 1
    assert not (tmp_path / "disabled" / "wandb_id.txt").exists() and not (tmp_path / "disabled" / "wandb").exists()


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cli_grpo_and_errors(init_run, tmp_path):
    out = run_cli("difflm.rl", f"init.run_dir={init_run}", f"run.dir={tmp_path / 'cli'}", "device=cpu",
                  f"data.path={GSM8K}", "data.prompt_field=question", "data.answer_field=answer",
                  "data.eval_records=1", "data.max_prompt_tokens=8", "gen.length=4", "gen.steps=2",
                  "gen.block_length=4", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
                  "algorithm.num_inner=1", "train.max_steps=1", "logger.progress_bar=false", "reward=format",
                  cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reward_mean=" in out.stdout + out.stderr
    assert (tmp_path / "cli" / "checkpoints" / "step_1").is_dir()
    bad = run_cli("difflm.rl", f"init.run_dir={init_run}", f"run.dir={tmp_path / 'bad'}", "device=cpu",
                  f"data.path={GSM8K}", "algorithm.group_size=1", cwd=str(tmp_path))
    assert bad.returncode == 2 and "algorithm.group_size=1 must be >= 2" in bad.stderr
