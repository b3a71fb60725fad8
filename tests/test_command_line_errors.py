"""What a newcomer's command-line mistakes and --help give: one line with the fix, and help that lists only what the
command takes."""
import pytest

from conftest import run_cli
from difflm.cli import check_overrides, quote_free_text
from difflm.errors import DifflmError


def refusal(argv, config_name="train") -> str:
    with pytest.raises(DifflmError) as info:
        check_overrides(argv, config_name)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_value_of_the_wrong_type_names_the_key_and_its_default():
    assert refusal(["train.max_steps=abc"]) == (
        "train.max_steps=abc: Value 'abc' of type 'str' could not be converted to Integer; give a value of the key's "
        "type (e.g. train.max_steps=300, the default)")
    assert refusal(["model=tiny", "optim.lr=fast"]).startswith("optim.lr=fast: Value 'fast' of type 'str' could not "
                                                               "be converted to Float")
    assert "eval.mc_samples=many" in refusal(["run.dir=x", "data.path=y", "eval.mc_samples=many"], "eval")
    check_overrides(["train.max_steps=5", "optim.lr=1e-3"], "train")  # right types pass


def test_an_unquoted_prompt_split_by_the_shell_says_quote_the_prompt():
    # the shell gives `prompt=Hello, big world` as three words; the entry point quotes the first for Hydra
    argv = quote_free_text(["run.dir=x", "prompt=Hello,", "big", "world"], ("prompt",))
    assert refusal(argv, "generate") == ("'big' is not key=value: the shell split prompt= at a space; quote the "
                                         "prompt: prompt='Hello, big world'")
    argv = quote_free_text(["logger.sample_prompt=To", "be"], ("logger.sample_prompt",))
    assert "quote the prompt: logger.sample_prompt='To be'" in refusal(argv)
    assert "quote the value: data.path='a b'" in refusal(["data.path=a", "b"])
    assert refusal(["data.path=a: (b)"]).endswith("""quote it inside shell quotes as Hydra's grammar says: """
                                                  """data.path='"a: (b)"'""")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("module,key", [("difflm.generate", "gen:"), ("difflm.evaluate", "eval:")])
def test_help_lists_only_what_the_command_takes(module, key):
    out = run_cli(module, "--help", timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    assert key in out.stdout and "run:" in out.stdout and "Example: difflm-" in out.stdout
    assert "Configuration groups" not in out.stdout
    keys = {line.strip().split(":")[0] for line in out.stdout.splitlines() if ":" in line}  # each line's key
    assert not keys & {"parallel", "objective", "optim", "schedule"}, keys


@pytest.mark.parametrize("config_name,argv,message", [
    ("rl", ["algorithm=dpo", "algorithm.group_size=8"],
     "algorithm.group_size is a grpo key; algorithm=dpo does not use it: drop it (or set algorithm=grpo)"),
    ("rl", ["algorithm=dpo", "algorithm.num_inner=3"],
     "algorithm.num_inner is a grpo key; algorithm=dpo does not use it: drop it (or set algorithm=grpo)"),
    ("rl", ["algorithm=dpo", "algorithm.scale_rewards=false"],
     "algorithm.scale_rewards is a grpo key; algorithm=dpo does not use it: drop it (or set algorithm=grpo)"),
    ("rl", ["estimator=mc_elbo", "estimator.prompt_mask_prob=0.3"],
     "estimator.prompt_mask_prob is a one_step key; estimator=mc_elbo does not use it: drop it "
     "(or set estimator=one_step)"),
    ("rl", ["estimator.num_t=4"],  # the default estimator is coupled
     "estimator.num_t is a mc_elbo key; estimator=coupled does not use it: drop it (or set estimator=mc_elbo)"),
    ("rl", ["estimator=one_step", "estimator.t_min=0.1"],
     "estimator.t_min is a coupled key; estimator=one_step does not use it: drop it (or set estimator=coupled)"),
    ("train", ["objective=mdlm", "objective.block_size=8"],
     "objective.block_size is a bd3lm key; objective=mdlm does not use it: drop it (or set objective=bd3lm)"),
    ("train", ["objective=ar", "objective.schedule=cosine"],
     "objective.schedule is a bd3lm/mdlm/sft key; objective=ar does not use it: drop it (or set objective=bd3lm)"),
    ("train", ["experiment=mdlm_owt", "objective.block_size=8"],  # the preset a recipe selects counts
     "objective.block_size is a bd3lm key; objective=mdlm does not use it: drop it (or set objective=bd3lm)"),
    ("rl", ["algorithm=dpo", "reward=format"],
     "reward is a grpo setting; algorithm=dpo does not use it (it learns from preference pairs, not rewards): drop it "
     "(or set algorithm=grpo)"),
    ("rl", ["reward.terms=[]", "algorithm=dpo"],
     "reward.terms is a grpo setting; algorithm=dpo does not use it (it learns from preference pairs, not rewards): "
     "drop it (or set algorithm=grpo)"),
])
def test_a_key_of_another_preset_is_refused_naming_key_and_preset(config_name, argv, message):
    assert refusal(argv, config_name) == message


@pytest.mark.parametrize("config_name,argv", [
    ("rl", ["algorithm=dpo", "algorithm.beta=0.2", "algorithm.prompts_per_step=2", "algorithm.reference=none"]),
    ("rl", ["algorithm.group_size=8", "algorithm.beta=0"]),
    ("rl", ["estimator=mc_elbo", "estimator.num_t=4", "estimator.eps=0.01"]),
    ("rl", ["estimator=one_step", "estimator.prompt_mask_prob=0.3"]),
    ("train", ["objective=bd3lm", "objective.block_size=8"]),
    ("train", ["objective=ar", "objective.loss_norm=sequence", "objective.length_multiple=2"]),
    ("train", ["objective=sft", "objective.loss_norm=token"]),
    ("rl", ["reward=format", "algorithm.group_size=8"]),
    ("rl", ["-m", "algorithm=grpo,dpo", "algorithm.group_size=8"]),  # a sweep is Hydra's to compose
])
def test_keys_the_selected_preset_reads_are_accepted(config_name, argv):
    check_overrides(argv, config_name)
