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
