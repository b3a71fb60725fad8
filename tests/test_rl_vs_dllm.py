"""scripts/rl_vs_dllm.py without dllm or TRL: the matched settings reach difflm-rl's config and TRL's arguments
with the same values, the reward handed to dllm is difflm's reward=gsm8k, the summary leaves the warm-up step out."""
from __future__ import annotations

import pytest
from conftest import load_script, script_usage_error
from hydra import compose, initialize_config_dir

import difflm.config
from difflm.config.schema import register_schema
from difflm.posttrain.loglik import build_estimator
from difflm.posttrain.rewards import build_reward
from difflm.posttrain.runner import check_rl_config

script = load_script("rl_vs_dllm")


def compose_rl(overrides):
    register_schema()
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        return compose("rl", ["init.run_dir=x", *overrides])


def test_matched_settings_reach_both_trainers():
    m = script.Matched(prompts_per_step=3, group_size=4, prompt_tokens=48, gen_length=64, gen_steps=32,
                       block_length=16, num_inner=3, temperature=0.7, prompt_mask_prob=0.3, beta=0.02, clip=0.3,
                       lr=2e-6).check()
    cfg = compose_rl(m.difflm_overrides() + ["data.answer_field=answer"])  # as run_difflm passes it
    check_rl_config(cfg)
    a, g, d = cfg.algorithm, cfg.gen, m.dllm_args()
    assert (a.prompts_per_step, a.group_size, a.num_inner) == (3, 4, 3)
    assert d["per_device_train_batch_size"] == 12 and d["gradient_accumulation_steps"] == 1
    assert (d["num_generations"], d["num_iterations"]) == (a.group_size, a.num_inner)
    assert (g.length, g.steps, g.block_length, g.cache, g.threshold, g.remasking) == \
        (64, 32, 16, "none", None, "low_confidence")
    assert (d["max_completion_length"], d["steps"], d["block_size"], d["remasking"]) == \
        (g.length, g.steps, g.block_length, g.remasking)
    assert d["temperature"] == g.temperature == 0.7 and d["cfg_scale"] == g.cfg_scale == 0.0
    assert cfg.data.max_prompt_tokens == d["max_prompt_length"] == 48
    est = build_estimator(cfg.estimator)
    assert cfg.estimator.name == "one_step" and est.forwards == 1
    assert cfg.estimator.prompt_mask_prob == d["p_mask_prompt"] == 0.3
    assert a.clip_low == a.clip_high == d["epsilon"] == 0.3 and a.beta == d["beta"] == 0.02
    assert (a.reference, a.scale_rewards, a.loss_norm) == ("frozen_copy", False, "token")
    assert d["scale_rewards"] is False and d["loss_type"] == "bnpo"  # bnpo: mean over every completion token
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.beta1, o.beta2, o.grad_clip) == \
        (d["learning_rate"], d["weight_decay"], d["adam_beta1"], d["adam_beta2"], d["max_grad_norm"])
    assert cfg.schedule.name == d["lr_scheduler_type"] == "constant" and cfg.schedule.warmup_steps == 0


@pytest.mark.parametrize("kw, flag", [(dict(gen_steps=33), "--gen-steps"),
                                      (dict(gen_steps=64, gen_length=32), "--gen-steps"),
                                      (dict(gen_length=40, block_length=16), "--block-length"),
                                      (dict(group_size=1), "--group")])
def test_unmatchable_settings_are_refused(kw, flag):
    with pytest.raises(ValueError, match=flag):
        script.Matched(**kw).check()


def test_cli_errors(capsys):
    assert "--gen-steps" in script_usage_error(script, capsys, "--gen-steps", "3", "--skip-dllm")
    assert "--dllm-path" in script_usage_error(script, capsys)
    assert "--steps" in script_usage_error(script, capsys, "--steps", "1", "--skip-dllm")


def test_dllm_reward_is_difflms_gsm8k_reward():
    ours = build_reward(compose_rl(["reward=gsm8k"]).reward)
    theirs = script.gsm8k_reward_fn()
    gold = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    completions = ["so 9 * 2 = 18\n#### 18", "<answer>18</answer>", "it is 17", "#### 17", "#### 1,018",
                   "18 eggs\n#### 18.", "no number"]
    want = [1.1, 1.0, 0.0, 0.1, 0.1, 1.0, 0.0]
    n = len(completions)
    assert theirs(["q"] * n, completions, [gold] * n) == pytest.approx(want)
    assert ours(["q"] * n, completions, [gold] * n) == pytest.approx(want)


def test_summary_leaves_the_warmup_step_out():
    row = script.summarize("x", [10.0, 2.0, 4.0], [5.0, 1.0, 1.0], tokens_per_rollout=64)
    assert row["median_step_s"] == 3.0 and row["steps_per_h"] == 1200.0
    assert row["median_rollout_s"] == 1.0 and row["rollout_tokens_per_s"] == 64.0 and row["update_s"] == 2.0


def test_difflm_side_alone_keeps_the_stored_comparison(tmp_path):
    """Without --json a comparison goes to benchmarks/results/; --skip-dllm (no dllm row, no ratio) goes to the work
    folder, so it never replaces the stored comparison of the same model and device."""
    from argparse import Namespace

    args = Namespace(json=None, skip_dllm=False, model="tiny")
    assert script.result_path(args, "cpu", tmp_path) == script.ROOT / "benchmarks/results/rl_vs_dllm_tiny_cpu.json"
    args.skip_dllm = True
    assert script.result_path(args, "cpu", tmp_path) == tmp_path / "rl_vs_dllm.json"
    args.json = tmp_path / "mine.json"
    assert script.result_path(args, "cpu", tmp_path) == tmp_path / "mine.json"
