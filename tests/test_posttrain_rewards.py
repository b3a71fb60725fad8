"""Rewards: GSM8K answer match on the shipped data, the format reward, _target_ callables, weights and failures."""
import json

import pytest
from omegaconf import OmegaConf

from difflm.errors import DifflmError
from difflm.posttrain.rewards import build_reward
from difflm.posttrain.rewards.gsm8k import extract_number, gsm8k_answer_match
from difflm.posttrain.rewards.format import TAG_FORMAT, format_match

from difflm.posttrain.rewards.gsm8k import GSM8K_SAMPLE


def test_gsm8k_answer_match_on_real_rows():
    rows = [json.loads(line) for line in open(GSM8K_SAMPLE)]
    assert len(rows) == 32
    for row in rows:  # the reference solution itself scores 1; an off-by-one answer scores 0
        assert gsm8k_answer_match(row["question"], row["answer"], row["answer"]) == 1.0
        wrong = extract_number(row["answer"]) + 1
        assert gsm8k_answer_match(row["question"], f"so #### {wrong:g}", row["answer"]) == 0.0
    assert extract_number("Janet makes $1,234.") == 1234.0
    assert extract_number("<reasoning>2+2</reasoning><answer> 4 </answer> then 7") == 4.0
    assert extract_number("no digits") is None


def test_format_reward():
    assert format_match("", "9 * 2 = 18\n#### 18") == 1.0
    assert format_match("", "the answer is 18") == 0.0
    assert format_match("", "<answer>18</answer>", pattern=TAG_FORMAT) == 1.0


def bad_reward(prompt, completion, answer=None):
    if "boom" in completion:
        raise RuntimeError("boom")
    return float("nan") if "nan" in completion else 2.0


def test_weighted_reward_reports_failures_and_goes_on():
    cfg = OmegaConf.create({"terms": [
        {"_target_": "difflm.posttrain.rewards.format.format_match", "_partial_": True, "weight": 0.5},
        {"_target_": "tests.test_posttrain_rewards.bad_reward", "_partial_": True, "weight": 3.0}]})
    reward = build_reward(cfg)
    r = reward(["p1", "p2", "p3"], ["#### 1", "boom #### 2", "nan"], None)
    assert r == [0.5 + 6.0, 0.5, 0.0]
    failures = reward.take_failures()
    assert [f.prompt for f in failures] == ["p2", "p3"]
    assert "RuntimeError: boom" in str(failures[0]) and "returned nan" in str(failures[1])
    assert reward.take_failures() == []


def test_build_reward_errors_name_the_key():
    with pytest.raises(DifflmError, match="reward.terms is empty"):
        build_reward(OmegaConf.create({"terms": []}))
    with pytest.raises(DifflmError, match=r"reward.terms\[0\]._target_=no.such.fn"):
        build_reward(OmegaConf.create({"terms": [{"_target_": "no.such.fn", "_partial_": True}]}))


def two_args_reward(prompt, completion):
    """A reward of the wrong shape: it takes no answer."""
    return float(len(completion))


@pytest.mark.parametrize("term,message", [
    # a term without _partial_: Hydra calls the function at build time; one line, and the fix
    ({"_target_": "difflm.posttrain.rewards.format.format_match"},
     "reward.terms[0]._target_=difflm.posttrain.rewards.format.format_match cannot be instantiated: Error in call to "
     "target 'difflm.posttrain.rewards.format.format_match': TypeError(\"format_match() missing 2 required positional "
     "arguments: 'prompt' and 'completion'\") (a reward function of (prompt, completion, answer) is bound, not called, "
     "with _partial_: true on its term)"),
    # a key the function does not take: every completion's call would fail and score 0
    ({"_target_": "difflm.posttrain.rewards.format.format_match", "_partial_": True, "max_len": 3},
     "reward.terms[0]._target_=difflm.posttrain.rewards.format.format_match does not take the keyword arguments its "
     "term binds (max_len): drop the keys it does not take"),
    ({"_target_": "test_posttrain_rewards.two_args_reward", "_partial_": True},
     "reward.terms[0]._target_=test_posttrain_rewards.two_args_reward cannot be called as fn(prompt, completion, "
     "answer) (too many positional arguments): give it the parameters (prompt, completion, answer)"),
])
def test_a_reward_term_that_every_completion_would_fail_is_refused(term, message):
    with pytest.raises(DifflmError) as info:
        build_reward(OmegaConf.create({"terms": [{**term, "weight": 1.0}]}))
    assert str(info.value) == message
