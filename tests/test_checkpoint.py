"""Atomic checkpoints and exact resume: a resumed run reproduces the uninterrupted run bit for bit (CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import straight_and_resumed
from difflm.checkpoint.store import latest_checkpoint, list_checkpoints
from difflm.errors import DifflmError
from difflm.training.trainer import Trainer

CPU = torch.device("cpu")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def test_resume_is_bit_exact(fast_cfg, tmp_path):
    common = ["train.max_steps=6", "train.save_every=3", "logger.log_every=1", "train.eval_every=0",
              "objective.random_length_prob=0.3", "objective.t_sampling=antithetic"]
    dir_a, dir_b, resumed = straight_and_resumed(fast_cfg, tmp_path, common)
    a, b = losses(dir_a), losses(dir_b)
    assert sorted(b) == [4, 5, 6]
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # bit-exact
    straight_again = Trainer(fast_cfg(*common, f"run.dir={tmp_path / 'a'}"), tmp_path / "a", CPU)
    for (name, p), q in zip(resumed.model.state_dict().items(), straight_again.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_checkpoint_is_atomic_and_listed(fast_cfg, tmp_path):
    cfg = fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    root = Path(cfg.run.dir) / "checkpoints"
    assert [s for s, _ in list_checkpoints(cfg.run.dir)] == [1, 2]
    assert sorted(os.listdir(root / "step_2")) == sorted(["trainer_state.pt", ".metadata", "__0_0.distcp", "config.yaml",
                                                          "manifest.json"])
    assert (root / "step_2" / "config.yaml").read_text() == (Path(cfg.run.dir) / "config.yaml").read_text()
    # an interrupted save (temporary directory) is never taken for a checkpoint
    (root / ".step_3.tmp").mkdir()
    assert latest_checkpoint(cfg.run.dir)[0] == 2
    state = torch.load(root / "step_2" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["sampler"]["consumed_samples"] == 2 * cfg.train.global_batch_size


def test_resume_with_other_model_is_refused(fast_cfg):
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    with pytest.raises(DifflmError, match="does not match this model"):
        Trainer(fast_cfg("model.hidden_size=32", "train.max_steps=2"), cfg.run.dir, CPU)


@pytest.mark.parametrize("smaller", ["model.num_layers=1", "model.tie_embeddings=true", "model.qk_norm=false"])
def test_resume_with_a_smaller_model_is_refused(fast_cfg, smaller):
    """A model with no place for some checkpoint tensors would drop their trained values without a word."""
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0", "model.qk_norm=true")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    saved = (Path(cfg.run.dir) / "config.yaml").read_text()
    with pytest.raises(DifflmError, match=r"does not match this model: it holds [1-9]\d* tensor\(s\) this model has "
                                          r"no place for \((layers\.1\.|output\.weight|.*norm)"):
        Trainer(fast_cfg("train.max_steps=2", "model.qk_norm=true", smaller), cfg.run.dir, CPU)
    assert (Path(cfg.run.dir) / "config.yaml").read_text() == saved  # the run's record still names its model


def test_resume_with_other_batch_is_refused(fast_cfg):
    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    with pytest.raises(DifflmError, match="global_batch_size"):
        Trainer(fast_cfg("train.global_batch_size=8", "train.max_steps=2"), cfg.run.dir, CPU)


def test_scheduler_resumes_with_another_number_of_parameter_groups():
    """A layout's optimizer may hold 3 groups (TP without FSDP: DTensor and plain tensors apart) and another 2:
    the schedule position carries over and every group gets the lr LambdaLR.step would have set."""
    from omegaconf import OmegaConf

    from difflm.training.schedule import build_scheduler, restore_scheduler

    cfg = OmegaConf.create({"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1, "decay_fraction": 0.2})
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    three = torch.optim.AdamW([{"params": [w]} for w in weights], lr=1e-3)
    source = build_scheduler(three, cfg, max_steps=10)
    for _ in range(5):
        three.step()
        source.step()
    two = torch.optim.AdamW([{"params": weights[:2]}, {"params": weights[2:]}], lr=1e-3)
    resumed = build_scheduler(two, cfg, max_steps=10)
    restore_scheduler(resumed, source.state_dict())
    assert resumed.last_epoch == 5
    assert [g["lr"] for g in two.param_groups] == [three.param_groups[0]["lr"]] * 2
    for _ in range(3):
        two.step()
        resumed.step()
        three.step()
        source.step()
    assert resumed.get_last_lr() == source.get_last_lr()[:2]


def test_resume_applies_changed_optimizer_and_schedule_settings(fast_cfg):
    """A resume with other optim.weight_decay / beta1 / beta2 / eps runs with them (the resume line names them as
    changed): the checkpoint gives the moments and step counts, the run's config the hyperparameters, per group
    (decay on the matrices only). Changed schedule.* settings set the learning rate from the resumed step on."""
    from difflm.training.schedule import lr_multiplier

    common = ("train.save_every=2", "train.eval_every=0", "objective.random_length_prob=0")
    cfg = fast_cfg("train.max_steps=2", *common)
    first = Trainer(cfg, cfg.run.dir, CPU)
    first.fit()
    saved = {name: {k: v.clone() for k, v in first.optimizer.state[p].items()}
             for name, p in first.model.named_parameters()}
    changed = ("optim.weight_decay=0.02", "optim.beta1=0.8", "optim.beta2=0.9", "optim.eps=1e-6",
               "schedule.warmup_steps=0", "schedule.name=wsd", "schedule.min_lr_ratio=0.5", "optim.lr=1e-3")
    resumed = Trainer(fast_cfg("train.max_steps=4", *common, *changed), cfg.run.dir, CPU)
    assert resumed.resumed_from == 2
    groups = resumed.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.02, 0.0]  # matrices decay, norm scales do not
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert [(g["betas"], g["eps"], g["initial_lr"]) for g in groups] == [((0.8, 0.9), 1e-6, 1e-3)] * 2
    expected_lr = 1e-3 * lr_multiplier(2, resumed.cfg.schedule, 4)
    assert expected_lr != 3e-4 * lr_multiplier(2, cfg.schedule, 4)  # the new schedule gives another rate
    assert [g["lr"] for g in groups] == pytest.approx([expected_lr] * 2)
    for name, p in resumed.model.named_parameters():  # the moments and step counts came from the checkpoint
        state = resumed.optimizer.state[p]
        assert float(state["step"]) == 2.0, name
        assert torch.equal(state["exp_avg"], saved[name]["exp_avg"]), name
        assert torch.equal(state["exp_avg_sq"], saved[name]["exp_avg_sq"]), name
    resumed.fit()  # and the next save records the settings the run trained with
    again = Trainer(fast_cfg("train.max_steps=4", *common, *changed), cfg.run.dir, CPU)
    assert [(g["weight_decay"], g["betas"], g["eps"]) for g in again.optimizer.param_groups] == [
        (0.02, (0.8, 0.9), 1e-6), (0.0, (0.8, 0.9), 1e-6)]


def test_resume_with_other_settings_names_them_and_keeps_the_earlier_config(fast_cfg, capsys):
    """Changed settings are allowed on a resume (a lower lr, another objective: AR-to-diffusion adaptation), but named
    in one line against the settings the checkpoint was trained with (its own config.yaml), which stay next to the
    run as config.step_<N>.yaml; a later step=N reads those, not the newest config.yaml."""
    from omegaconf import OmegaConf

    from difflm.checkpoint.store import checkpoint_config_path

    common = ("train.save_every=1", "train.eval_every=0")
    cfg = fast_cfg("train.max_steps=1", *common)
    Trainer(cfg, cfg.run.dir, CPU).fit()
    run = Path(cfg.run.dir)
    first = (run / "config.yaml").read_text()
    capsys.readouterr()
    Trainer(fast_cfg("train.max_steps=2", *common), run, CPU)  # the same settings but the length
    line = next(x for x in capsys.readouterr().out.splitlines() if "changed settings" in x)
    assert line == ("difflm: resuming at step 1 with changed settings: train.max_steps: 1 -> 2 (the settings step 1 "
                    f"was trained with are kept in {run / 'config.step_1.yaml'})")
    assert (run / "config.step_1.yaml").read_text() == first
    # a second resume from step 1 compares against step 1's settings, not against the abandoned attempt's
    resumed = Trainer(fast_cfg("train.max_steps=2", *common, "optim.lr=1e-4", "objective=ar"), run, CPU)
    line = next(x for x in capsys.readouterr().out.splitlines() if "changed settings" in x)
    assert line.startswith("difflm: resuming at step 1 with changed settings: objective.name: 'mdlm' -> 'ar', ")
    assert "optim.lr: 0.0003 -> 0.0001" in line and "train.max_steps: 1 -> 2" in line
    assert line.endswith(f"(the settings step 1 was trained with are kept in {run / 'config.step_1.yaml'})")
    assert sorted(p.name for p in run.glob("config.step_*")) == ["config.step_1.yaml"]
    assert OmegaConf.load(run / "config.yaml").objective.name == "ar" and resumed.resumed_from == 1
    resumed.fit()  # trains step 2 as ar; step 1 still names mdlm, step 2 ar
    from difflm.plot import _stretches, read_metrics

    rows = read_metrics(run)  # each record names its objective, so a plot can tell the two stretches apart
    assert [(r["step"], r["objective"]) for r in rows] == [(1, "mdlm"), (2, "ar")]
    assert [(name, [s for s, _ in points]) for name, points in _stretches(rows, "loss", "run")] == [
        ("run (mdlm)", [1]), ("run (ar)", [2])]
    ckpts = run / "checkpoints"
    assert OmegaConf.load(checkpoint_config_path(run, ckpts / "step_1")).objective.name == "mdlm"
    assert OmegaConf.load(checkpoint_config_path(run, ckpts / "step_2")).objective.name == "ar"
    capsys.readouterr()
    Trainer(fast_cfg("train.max_steps=3", *common, "optim.lr=1e-4", "objective=ar"), run, CPU)
    assert "changed settings: train.max_steps: 2 -> 3 (" in capsys.readouterr().out


def test_step_n_is_read_with_the_settings_it_was_trained_with(fast_cfg, tmp_path):
    """difflm-eval / -generate / -export with step=N build the model step N was trained with (bidirectional for
    an mdlm step), though a resume switched the run to objective=ar since."""
    from difflm.generate import load_run
    from difflm.interop.export import load_run_for_export

    common = ("train.save_every=1", "train.eval_every=0")
    cfg = fast_cfg("train.max_steps=1", *common)
    Trainer(cfg, cfg.run.dir, CPU).fit()
    Trainer(fast_cfg("train.max_steps=2", *common, "objective=ar"), cfg.run.dir, CPU).fit()
    for step, name, causal in ((1, "mdlm", False), (2, "ar", True), (None, "ar", True)):
        run_cfg, model, _, loaded = load_run(cfg.run.dir, step, CPU)
        assert (run_cfg.objective.name, model.causal, loaded) == (name, causal, step or 2), step  # None: the newest
        run_cfg, model, _, loaded = load_run_for_export(cfg.run.dir, step)
        assert (run_cfg.objective.name, model.causal, loaded) == (name, causal, step or 2), step


def test_resume_that_would_train_nothing_is_refused(fast_cfg):
    """train.max_steps below the checkpoint's step, or at it with other settings, is refused before anything is
    loaded or written; the same settings at the same step pass and train nothing."""
    cfg = fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    saved = (Path(cfg.run.dir) / "config.yaml").read_text()
    fix = (r"raise train.max_steps \(steps count on from the checkpoint's: train.max_steps=12 trains 10 more\), or "
           r"read that step with difflm-eval / difflm-generate step=2$")
    with pytest.raises(DifflmError, match=r"^train.max_steps=1 is below the step of the checkpoint this run resumes "
                                          r"from \(.*step_2\): nothing would train; " + fix):
        Trainer(fast_cfg("train.max_steps=1", "train.eval_every=0"), cfg.run.dir, CPU)
    assert (Path(cfg.run.dir) / "config.yaml").read_text() == saved
    # at the checkpoint's step with new settings (LoRA added to the finished run): nothing would train with them
    with pytest.raises(DifflmError, match=r"^train.max_steps=2 is the step of the checkpoint this run resumes from "
                                          r"\(.*step_2\), so nothing would train with the changed settings "
                                          r"\(lora.alpha, lora.name, lora.rank, optim.lr\): " + fix):
        Trainer(fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0", "lora=attn_mlp",
                         "optim.lr=1e-3"), cfg.run.dir, CPU)
    assert (Path(cfg.run.dir) / "config.yaml").read_text() == saved
    # the same command again: a finished run launched again, nothing to do
    again = Trainer(fast_cfg("train.max_steps=2", "train.save_every=1", "train.eval_every=0"), cfg.run.dir, CPU)
    assert again.step == 2
    again.fit()
    assert again.step == 2 and sorted(p.name for p in (Path(cfg.run.dir) / "checkpoints").iterdir()) == \
        ["step_1", "step_2"]


def test_a_finished_run_launched_again_draws_no_samples(fast_cfg, monkeypatch):
    """A finished run launched again trains no step and draws no end-of-training samples: its samples.txt keeps
    those of its last step, even when the new command asks for other sampling settings."""
    common = ("train.max_steps=1", "train.save_every=1", "train.eval_every=0", "logger.num_samples=1",
              "gen.length=8")
    cfg = fast_cfg(*common)
    Trainer(cfg, cfg.run.dir, CPU).fit()
    samples = Path(cfg.run.dir) / "samples.txt"
    first = samples.read_text()
    assert first.startswith("--- step 1 sample 0 ---")

    def no_sampling(self, prompt, num):
        raise AssertionError("a run that trained no step drew samples")

    monkeypatch.setattr(Trainer, "generate_samples", no_sampling)
    again = Trainer(fast_cfg(*common, "gen.temperature=1.0", "logger.sample_prompt=JULIET:"), cfg.run.dir, CPU)
    again.fit()
    assert again.step == 1 and samples.read_text() == first


def test_only_what_a_step_trains_makes_a_finished_run_launched_again_a_refusal(tmp_path):
    """At the checkpoint's step, a finished run launched again from a copied folder, with auto-chosen kernels and
    micro-batch written by another machine, other logging and another cache passes (nothing to train); another
    objective or LoRA is refused. A run sized by train.epochs is told to raise train.epochs, not train.max_steps
    (which the epochs set)."""
    from omegaconf import OmegaConf

    from conftest import FAST, compose_run
    from difflm.training.run_config import check_steps_to_train

    saved = tmp_path / "config.yaml"
    saved.write_text(OmegaConf.to_yaml(compose_run([*FAST, f"run.dir={tmp_path / 'a'}", "train.max_steps=5"]),
                                       resolve=True))
    elsewhere = compose_run([*FAST, f"run.dir={tmp_path / 'copy'}", "train.max_steps=5", "logger.log_every=3",
                             "train.save_every=7", f"data.cache_dir={tmp_path / 'c2'}", "model.backend=te",
                             "model.fused_mlp=true", "train.micro_batch_size=4"])
    OmegaConf.update(elsewhere, "train.auto_batch_reason", "micro-batch 4 fits 70.1 GiB free")
    OmegaConf.update(elsewhere, "model.auto_reason", "TE installed")
    check_steps_to_train(5, elsewhere, tmp_path / "step_5", saved)  # nothing to train, nothing refused
    for extra, named in ((["objective=ar"], "objective.name"), (["lora=attn_mlp"], "lora.alpha, lora.name"),
                         (["model.num_layers=3"], "model.num_layers")):
        with pytest.raises(DifflmError, match=rf"^train.max_steps=5 is the step of .* changed settings \({named}"):
            check_steps_to_train(5, compose_run([*FAST, "train.max_steps=5", *extra]), tmp_path / "step_5", saved)
    by_epochs = compose_run([*FAST, "train.max_steps=null", "train.epochs=0.01"])
    OmegaConf.update(by_epochs, "train.max_steps", 36)  # what the epochs give this corpus
    with pytest.raises(DifflmError, match=r"^train.epochs=0.01 \(train.max_steps=36\) is below the step of the "
                                          r"checkpoint .*: nothing would train; raise train.epochs \(steps count on "
                                          r"from the checkpoint's\), or read that step"):
        check_steps_to_train(40, by_epochs, tmp_path / "step_40", saved)


def test_unfinished_saves_are_removed_and_a_stopped_save_cleans_up(fast_cfg, monkeypatch, capsys):
    """A save stopped part-way (a second Ctrl-C inside DCP, which wraps the KeyboardInterrupt) leaves no temporary
    directory and raises KeyboardInterrupt (the entry point's 'difflm: interrupted', exit 130); one left by kill -9
    is removed when the next run starts."""
    import torch.distributed.checkpoint as dcp

    from difflm.checkpoint import store

    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0")
    trainer = Trainer(cfg, cfg.run.dir, CPU)
    trainer.fit()
    root = Path(cfg.run.dir) / "checkpoints"

    def interrupted_save(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("rank 0 failed: Traceback ... KeyboardInterrupt")  # DCP's CheckpointException text

    monkeypatch.setattr(dcp, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    monkeypatch.undo()
    (root / ".step_7.tmp").mkdir()  # what kill -9 mid-save leaves
    capsys.readouterr()
    Trainer(fast_cfg("train.max_steps=2", "train.eval_every=0"), cfg.run.dir, CPU)
    assert "removed .step_7.tmp: a checkpoint save that never finished" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert store._interrupted(RuntimeError("x")) is False


def test_changed_settings_lists_every_differing_leaf():
    from difflm.training.run_config import changed_settings

    old = {"a": {"b": 1, "c": [1, 2]}, "d": "x", "gone": 3}
    new = {"a": {"b": 2, "c": [1, 2]}, "d": "x", "new": {"e": None}}
    assert changed_settings(old, new) == [("a.b", 1, 2), ("gone", 3, "<absent>"), ("new.e", "<absent>", None)]
    assert changed_settings(old, old) == []


def test_a_rank_of_several_pipeline_stages_saves_and_loads_them_under_full_model_names(tmp_path):
    """Virtual stages / V schedules: a pipeline rank holds several stage modules; DCP's helpers take one module, so
    the store saves them through one view under the full model's names, and a load fills the stages' own tensors."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from difflm.checkpoint.store import load_checkpoint, save_checkpoint
    from difflm.config.schema import ModelConfig
    from difflm.model import build_model

    cfg = OmegaConf.structured(ModelConfig(num_layers=4, hidden_size=32, num_heads=2, num_kv_heads=2,
                                           ffn_hidden_size=64, head_dim=16, vocab_size=64))
    models = [build_model(cfg, causal=False, device=torch.device("cpu"), seed=s) for s in (0, 1)]
    stages = [[m.pipeline_stage([0], first=True, last=False), m.pipeline_stage([3], first=False, last=True)]
              for m in models]
    save_checkpoint(tmp_path, 1, stages[0], None, {"step": 1})
    keys = {k[len("model."):] for k in dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step_1"))
            .read_metadata().state_dict_metadata if k.startswith("model.")}
    held = {k for part in stages[0] for k in part.state_dict()}
    assert keys == held and "layers.3.attention.qkv.weight" in keys and not any(k.startswith("layers.1.") for k in keys)
    load_checkpoint(tmp_path / "checkpoints" / "step_1", stages[1])
    ref, got = models[0].state_dict(), models[1].state_dict()
    for k in held:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
    assert not torch.equal(got["layers.1.attention.qkv.weight"], ref["layers.1.attention.qkv.weight"])


def test_a_chosen_step_whose_save_has_not_finished_is_named_as_such(tmp_path):
    """difflm-generate / -eval / -export step=N where checkpoints/step_N is still being written (no manifest.json
    yet): the step is named as incomplete, with the problem and the complete steps, not as a step without a
    checkpoint; without step= the newest complete one is read."""
    from difflm.checkpoint.manifest import write_manifest
    from difflm.checkpoint.store import find_checkpoint

    root = tmp_path / "checkpoints"
    for step in (3, 5):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "trainer_state.pt").write_bytes(b"x")
    write_manifest(root / "step_3")
    assert find_checkpoint(tmp_path) == (3, root / "step_3")
    with pytest.raises(DifflmError, match=rf"^step=5: checkpoint {root / 'step_5'} is not complete \(no "
                                          r"manifest.json \(the save did not finish\)\): choose one of \[3\], or let "
                                          "its save finish$"):
        find_checkpoint(tmp_path, 5)
    with pytest.raises(DifflmError, match=rf"^step=7 has no checkpoint in {tmp_path}: choose one of \[3\]$"):
        find_checkpoint(tmp_path, 7)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_the_disk_refuses_is_one_line_and_leaves_the_last_checkpoint(tmp_path, async_save):
    """A full disk (here a file-size limit, RLIMIT_FSIZE: the write fails with EFBIG as with ENOSPC) mid-save: one
    DifflmError naming the folder, the OS's reason and the step a rerun resumes from; the temporary directory is
    removed and the earlier checkpoint stays complete."""
    import resource

    from difflm.checkpoint.manifest import manifest_problem
    from difflm.checkpoint.store import save_checkpoint

    model = torch.nn.Linear(8, 8)
    save_checkpoint(tmp_path, 1, model, None, {"step": 1})
    big = torch.nn.Linear(512, 512)  # a 1 MiB shard
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
    try:
        with pytest.raises(DifflmError) as err:
            out = save_checkpoint(tmp_path, 2, big, None, {"step": 2}, async_save=async_save)
            out.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(err.value)
    assert "\n" not in message and "checkpoint step_2 could not be written to" in message
    assert "File too large" in message and "resume from step 1" in message
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1"] and manifest_problem(root / "step_1") is None


@pytest.mark.parametrize("text", ["null", "[]", '{"files": []}', '{"files": {}}', '{"files": {"trainer_state.pt": 3}}',
                                  '{"files": {"trainer_state.pt": {}}}', "{}", ""])
def test_a_manifest_of_another_shape_is_a_problem_not_a_crash(tmp_path, text):
    """A manifest.json that parses but does not list the files as {name: {size}} (overwritten, edited by hand) marks
    the checkpoint incomplete, as an unparsable one does, instead of raising out of the resume or find_checkpoint."""
    from difflm.checkpoint.manifest import MANIFEST, manifest_problem

    (tmp_path / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / MANIFEST).write_text(text)
    assert manifest_problem(tmp_path).startswith("unreadable manifest.json (")
    (tmp_path / MANIFEST).write_text('{"files": {"trainer_state.pt": {"size": 1}}}')
    assert manifest_problem(tmp_path) is None


@pytest.mark.parametrize("damage", [b"\x00", b"a: [", b"- "])
def test_a_checkpoint_config_with_overwritten_bytes_is_one_line(fast_cfg, damage):
    """A checkpoint's config.yaml whose bytes were overwritten (same size, so its manifest still matches) is refused
    in one line naming the file and the step to move away, by the resume and by what difflm-eval / -generate /
    -export read, instead of a YAML parser's traceback (or a RecursionError)."""
    from difflm.checkpoint.store import trained_settings

    cfg = fast_cfg("train.max_steps=1", "train.save_every=1", "train.eval_every=0", "logger.num_samples=0")
    Trainer(cfg, cfg.run.dir, CPU).fit()
    config = Path(cfg.run.dir) / "checkpoints" / "step_1" / "config.yaml"
    size = config.stat().st_size
    config.write_bytes((damage * size)[:size])
    wanted = f"{config} cannot be read ("
    with pytest.raises(DifflmError, match="restore it from a copy, or move step_1 away") as err:
        trained_settings(cfg.run.dir)
    assert str(err.value).startswith(wanted) and "\n" not in str(err.value)
    with pytest.raises(DifflmError) as err:
        Trainer(fast_cfg("train.max_steps=2", "train.eval_every=0"), cfg.run.dir, CPU)
    assert str(err.value).startswith(wanted)
