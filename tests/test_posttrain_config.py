"""difflm-rl's config groups compose and build; the reference is pluggable (frozen copy or adapters off)."""
import contextlib

import pytest
import torch
from hydra import compose, initialize_config_dir

import difflm.config
from difflm.config.schema import register_schema
from difflm.errors import DifflmError
from difflm.posttrain.loglik import build_estimator
from difflm.posttrain.reference import AdaptersOffReference, FrozenCopyReference, build_reference
from difflm.posttrain.rewards import build_reward
from difflm.posttrain.runner import check_rl_config

RL_GROUPS = {g: sorted(p.stem for p in (difflm.config.CONF_DIR / g).glob("*.yaml"))
             for g in ("algorithm", "estimator", "reward")}


def compose_rl(overrides):
    register_schema()
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        return compose("rl", ["init.run_dir=x", *overrides])


def test_rl_presets_compose_and_build():
    assert RL_GROUPS == {"algorithm": ["dpo", "grpo"], "estimator": ["coupled", "mc_elbo", "one_step"],
                         "reward": ["format", "gsm8k"]}
    for est in RL_GROUPS["estimator"]:
        cfg = compose_rl([f"estimator={est}"])
        assert type(build_estimator(cfg.estimator)).__name__.lower().startswith(est.replace("_", "")[:4])
    for reward in RL_GROUPS["reward"]:
        r = build_reward(compose_rl([f"reward={reward}"]).reward)
        assert r(["q"], ["so #### 4"], ["#### 4"]) == [1.1 if reward == "gsm8k" else 1.0]
    for algo in RL_GROUPS["algorithm"]:
        # reward=gsm8k compares grpo's completions with the answer; dpo reads no answer
        cfg = compose_rl([f"algorithm={algo}"] + (["data.answer_field=answer"] if algo == "grpo" else []))
        check_rl_config(cfg)
        assert cfg.algorithm.name == algo


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.group_size=1"], "algorithm.group_size=1 must be >= 2"),
    (["algorithm.reference=none"], "algorithm.beta=0.04 needs a reference"),
    (["algorithm=dpo", "algorithm.reference=none"], "algorithm=dpo needs a reference"),
    (["algorithm.name=ppo"], "algorithm='ppo' is unknown"),
    # values out of range, each named in one line (a negative clip or KL weight, 0 prompt tokens, an unknown
    # loss_norm, a negative learning rate)
    (["algorithm.loss_norm=mean"], r"^algorithm.loss_norm='mean' is not one of token, sequence$"),
    (["algorithm.clip_low=-1"], r"^algorithm.clip_low=-1.0 must be in \[0, 1\): the ratio is clipped to "
                                r"\[1 - clip_low, 1 \+ clip_high\]"),
    (["algorithm.clip_high=-0.1"], r"^algorithm.clip_high=-0.1 must be >= 0: the ratio"),
    (["algorithm.beta=-0.5"], r"^algorithm.beta=-0.5 must be >= 0 \(grpo: the KL weight"),
    (["algorithm=dpo", "algorithm.beta=0"], r"^algorithm.beta=0.0 must be > 0 .*the loss at log 2"),
    (["data.max_prompt_tokens=0"], r"^data.max_prompt_tokens=0 must be >= 1 \(the tokens kept\)$"),
    (["algorithm=dpo", "data.max_response_tokens=0"], r"^data.max_response_tokens=0 must be >= 1"),
    (["data.eval_records=-1"], r"^data.eval_records=-1 must be >= 0"),
    (["train.save_every=-1"], r"^train.save_every=-1 must be >= 0 \(0 = never\)$"),
    (["train.keep_last=-2"], r"^train.keep_last=-2 must be >= 0"),
    (["optim.lr=-1e-5"], r"^optim.lr=-1e-05 must be positive$"),
    (["schedule.warmup_steps=-3"], r"^schedule.warmup_steps=-3 must be >= 0"),
    # a template without {prompt} would give every record the same prompt (GRPO and DPO alike)
    (["data.prompt_template=Question: Answer:"], r"^data.prompt_template='Question: Answer:' holds no \{prompt\}: "
                                                r"every record's prompt would be replaced by that text"),
    (["algorithm=dpo", "data.prompt_template='Q: {question}'"], r"^data.prompt_template='Q: \{question\}' holds no "
                                                                 r"\{prompt\}"),
    # rollout settings the others leave unread (greedy rollouts ignore the filters; ReMDM needs remasking=remdm)
    (["gen.temperature=0", "gen.top_k=5"], r"^gen.top_k=5 has no effect with gen.temperature=0 \(greedy\): set "
                                           r"gen.temperature>0 or drop it$"),
    (["gen.temperature=0", "gen.top_p=0.9"], r"^gen.top_p=0.9 has no effect with gen.temperature=0 \(greedy\)"),
    (["gen.remdm_sigma=0.5"], r"^gen.remdm_sigma=0.5 has no effect without gen.remasking=remdm: set "
                              r"gen.remasking=remdm or drop it$"),
    (["gen.remdm_schedule=rescale"], r"^gen.remdm_schedule=rescale has no effect without gen.remasking=remdm"),
    # greedy rollouts without random remasking: a group's completions are one decode, so no advantage
    (["gen.temperature=0"], r"^gen.temperature=0 with algorithm=grpo: the 4 completions of a prompt are one greedy "
                            r"decode \(gen.remasking=low_confidence draws no noise\), so every advantage is 0"),
    (["gen.temperature=0", "gen.remasking=remdm"], r"^gen.temperature=0 with algorithm=grpo: .*gen.remasking=remdm"),
    (["gen.top_k=1"], r"^gen.top_k=1 with algorithm=grpo: the 4 completions of a prompt are one greedy decode "
                      r"\(gen.remasking=low_confidence draws no noise\), so every advantage is 0 and nothing trains: "
                      r"set gen.top_k=0 \(off\) or above 1 or gen.remasking=random"),
    (["algorithm.reference=base"], r"^algorithm.reference='base' is not one of frozen_copy, adapters_off, none$"),
    # two sources of records: a run would read one and drop the other without a word
    (["data.path=a.jsonl", "data.hf_dataset=gsm8k"], r"^data.path='a.jsonl' and data.hf_dataset='gsm8k' both name "
                                                     r"the records, and a run reads only one: keep one"),
])
def test_rl_config_errors_name_the_key(overrides, message):
    with pytest.raises(DifflmError, match=message):
        check_rl_config(compose_rl(overrides))


def test_rl_rollout_settings_that_are_read_pass():
    """The defaults (gen.temperature=1.0), the filters at a temperature, ReMDM with remasking=remdm, greedy rollouts
    with random remasking (their completions differ), and (dpo) no rollouts at all pass the check of settings left
    unread."""
    for overrides in ([], ["gen.top_k=5", "gen.top_p=0.9"], ["gen.remasking=remdm", "gen.remdm_sigma=0.5"],
                      ["gen.temperature=0", "gen.remasking=random"], ["gen.top_k=1", "gen.remasking=random"],
                      ["gen.top_k=2"], ["algorithm=dpo"]):
        check_rl_config(compose_rl(overrides + (["data.answer_field=answer"] if "algorithm=dpo" not in overrides
                                                 else [])))


class Adapted(torch.nn.Module):
    """A linear model with one 'adapter' that a context manager switches off."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(3, 3)
        self.adapter = torch.nn.Linear(3, 3)
        self.adapters_on = True

    def forward(self, x):
        return self.base(x) + (self.adapter(x) if self.adapters_on else 0.0)


@contextlib.contextmanager
def adapters_disabled(model):
    model.adapters_on = False
    try:
        yield
    finally:
        model.adapters_on = True


def test_reference_is_pluggable():
    model = Adapted()
    x = torch.randn(2, 3)
    off = build_reference("adapters_off", model, adapters_disabled)
    assert isinstance(off, AdaptersOffReference)
    assert torch.allclose(off(x), model.base(x)) and model.adapters_on and model.training
    frozen = build_reference("frozen_copy", model)
    assert isinstance(frozen, FrozenCopyReference)
    with torch.no_grad():
        model.base.weight.add_(1.0)  # the policy moves; the frozen copy does not
    assert not torch.allclose(frozen(x), model(x))
    assert not any(p.requires_grad for p in frozen.model.parameters())
    assert build_reference("none", model) is None
    with pytest.raises(DifflmError, match="algorithm.reference='lora'"):
        build_reference("lora", model)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm=dpo", "data.answer_field=answer"],
     "data.answer_field='answer' is a grpo key (the reward's reference answer); algorithm=dpo does not use it: drop it"),
    (["data.answer_field=answer", "data.chosen_field=good"],
     "data.chosen_field='good' is a dpo key; algorithm=grpo does not use it: drop it (or set algorithm=dpo)"),
    (["data.answer_field=answer", "data.rejected_field=bad"],
     "data.rejected_field='bad' is a dpo key; algorithm=grpo does not use it: drop it (or set algorithm=dpo)"),
])
def test_data_fields_of_the_other_algorithm_are_refused(overrides, message):
    with pytest.raises(DifflmError) as info:
        check_rl_config(compose_rl(overrides))
    assert str(info.value) == message
    check_rl_config(compose_rl(["algorithm=dpo", "data.chosen_field=good", "data.rejected_field=bad"]))


@pytest.mark.parametrize("algorithm,fields", [("grpo", "data.prompt_field, data.answer_field"),
                                              ("dpo", "data.prompt_field, data.chosen_field, data.rejected_field")])
def test_rl_data_path_of_plain_text_names_the_records_it_needs(tmp_path, algorithm, fields):
    from difflm.posttrain.data import read_records
    from difflm.posttrain.runner import DPO_FIELDS, GRPO_FIELDS

    (tmp_path / "prompts.txt").write_text("What is 2 + 2?\n")
    cfg = compose_rl([f"algorithm={algorithm}", f"data.path={tmp_path / 'prompts.txt'}"])
    with pytest.raises(DifflmError) as info:
        read_records(cfg.data, GRPO_FIELDS if algorithm == "grpo" else DPO_FIELDS)
    assert str(info.value) == (f"data.path: {tmp_path / 'prompts.txt'} is not .jsonl: difflm-rl reads one JSON record "
                               f"a line with the fields {fields}: convert the file to JSONL or set data.hf_dataset")


def test_rl_hf_dataset_dict_reads_its_split(tmp_path):
    """A ``save_to_disk`` DatasetDict as data.hf_dataset: data.hf_split picks its split; a split it lacks (the default
    ``train`` of a test-only dict) is refused in one line naming the splits."""
    import datasets

    from difflm.posttrain.data import read_records
    from difflm.posttrain.runner import GRPO_FIELDS

    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(4)]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    base = [f"data.hf_dataset={tmp_path / 'dd'}", "data.prompt_field=question", "data.answer_field=answer",
            "data.eval_records=1"]
    records = read_records(compose_rl([*base, "data.hf_split=test"]).data, GRPO_FIELDS)
    assert records[3] == {"prompt_field": "What is 3 + 3?", "answer_field": "#### 6"}
    with pytest.raises(DifflmError) as info:
        read_records(compose_rl(base).data, GRPO_FIELDS)
    assert str(info.value) == (f"data.hf_split='train' is not a split of data.hf_dataset='{tmp_path / 'dd'}': set "
                               "data.hf_split to one of ['test']")


def test_dpo_with_one_field_for_both_responses_is_refused():
    with pytest.raises(DifflmError) as info:
        check_rl_config(compose_rl(["algorithm=dpo", "data.rejected_field=chosen"]))
    assert str(info.value) == ("data.chosen_field and data.rejected_field are both 'chosen': every pair would hold "
                               "one response twice (loss log 2, no gradient); point data.rejected_field at the "
                               "records' rejected response")


GRPO_ROWS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(4)]
DPO_ROWS = [{"prompt": f"What is {i} + {i}?", "chosen": str(2 * i), "rejected": str(i)} for i in range(4)]


@pytest.mark.parametrize("algorithm,field,key,why", [
    ("grpo", "answer", "answer_field", "the reward compares every completion with it"),
    ("dpo", "chosen", "chosen_field", "an empty response scores its EOS only"),
    ("dpo", "rejected", "rejected_field", "an empty response scores its EOS only"),
])
@pytest.mark.parametrize("empty", ["", "  \n"])
def test_rl_records_with_an_empty_answer_or_response_are_refused(tmp_path, algorithm, field, key, why, empty):
    """An empty reference answer made every completion's reward fail (a GRPO run that trains on nothing); an empty
    chosen / rejected response is scored as its EOS alone. Either is refused naming the field and the line."""
    import json

    from difflm.posttrain.data import read_records
    from difflm.posttrain.runner import DPO_FIELDS, GRPO_FIELDS

    rows = [dict(r) for r in (GRPO_ROWS if algorithm == "grpo" else DPO_ROWS)]
    rows[2][field] = empty
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = ["data.prompt_field=question", "data.answer_field=answer"] if algorithm == "grpo" else ["algorithm=dpo"]
    cfg = compose_rl([*over, f"data.path={path}", "data.eval_records=1"])
    fields = GRPO_FIELDS if algorithm == "grpo" else DPO_FIELDS
    with pytest.raises(DifflmError) as info:
        read_records(cfg.data, fields)
    assert str(info.value) == (f"data.{key}='{field}' is empty in {path}:3 ({why}): fill in or remove that record, or "
                               f"point data.{key} at the field that holds the text")
    rows[2][field] = "5"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_records(cfg.data, fields)) == 4


@pytest.mark.parametrize("algorithm", ["grpo", "dpo"])
def test_rl_records_that_are_not_text_or_absent_name_the_fix(tmp_path, algorithm):
    """An empty file names data.path (not data.eval_records); a null field names the field and the fix; a line that
    holds no JSON object names the line."""
    import json

    from difflm.posttrain.data import read_records
    from difflm.posttrain.runner import DPO_FIELDS, GRPO_FIELDS

    over = ["data.prompt_field=question", "data.answer_field=answer"] if algorithm == "grpo" else ["algorithm=dpo"]
    fields = GRPO_FIELDS if algorithm == "grpo" else DPO_FIELDS
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DifflmError) as info:
        read_records(compose_rl([*over, f"data.path={empty}"]).data, fields)
    named = ("data.prompt_field='question', data.answer_field='answer'" if algorithm == "grpo" else
             "data.prompt_field='prompt', data.chosen_field='chosen', data.rejected_field='rejected'")
    assert str(info.value) == f"data.path='{empty}' holds no records: point it at JSONL records with the fields {named}"
    rows = [dict(r) for r in (GRPO_ROWS if algorithm == "grpo" else DPO_ROWS)]
    prompt = "question" if algorithm == "grpo" else "prompt"
    rows[1][prompt] = None
    path = tmp_path / "null.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DifflmError) as info:
        read_records(compose_rl([*over, f"data.path={path}", "data.eval_records=1"]).data, fields)
    assert str(info.value) == (f"data.prompt_field='{prompt}' is null in {path}:2, not text: point data.prompt_field "
                               "at a text field or fix that record")
    # a line that is JSON but no object: the line named, not a field to set
    rows[1] = ["a list", 1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DifflmError) as info:
        read_records(compose_rl([*over, f"data.path={path}", "data.eval_records=1"]).data, fields)
    assert str(info.value) == (f"{path}:2 is an array, not a record: difflm-rl reads one JSON object a line with the "
                               f"fields {named}: fix or remove that line")
