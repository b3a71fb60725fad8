"""What a newcomer's command-line mistakes and --help give: one line with the fix, and help that lists only what the
command takes."""
import functools

import pytest

from conftest import run_cli, run_cli_batch
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


HELP = [("difflm.generate", "gen:"), ("difflm.evaluate", "eval:")]


@pytest.fixture(scope="module")
def helps():
    """``<module> --help`` of each command of :data:`HELP`, in one process."""
    return run_cli_batch([(module, ["--help"]) for module, _ in HELP])


@pytest.mark.slow  # starts processes: make test-fast leaves it out
@pytest.mark.parametrize("module,key", HELP)
def test_help_lists_only_what_the_command_takes(module, key, helps):
    out = helps[HELP.index((module, key))]
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
    ("train", ["objective=ar", "objective.schedule=cosine"],  # the fix offered: the default objective first
     "objective.schedule is a bd3lm/mdlm/sft key; objective=ar does not use it: drop it (or set objective=mdlm)"),
    ("train", ["objective=ar", "objective.weighting=cart"],  # not bd3lm, which refuses cart
     "objective.weighting is a bd3lm/mdlm/sft key; objective=ar does not use it: drop it (or set objective=mdlm)"),
    ("train", ["objective=sft", "objective.block_size=8"],  # the only preset that reads it, default or not
     "objective.block_size is a bd3lm key; objective=sft does not use it: drop it (or set objective=bd3lm)"),
    ("train", ["experiment=mdlm_owt", "objective.block_size=8"],  # the preset a recipe selects counts
     "objective.block_size is a bd3lm key; objective=mdlm does not use it: drop it (or set objective=bd3lm)"),
])
def test_a_key_of_another_preset_is_refused_naming_key_and_preset(config_name, argv, message):
    assert refusal(argv, config_name) == message


NO_ROLLOUTS = "has no effect with algorithm=dpo (no rollouts: it scores given preference pairs); remove it or use " \
    "algorithm=grpo"
NO_PAIRS = "has no effect with algorithm=grpo (no preference pairs: it samples completions of the prompts); remove " \
    "it or use algorithm=dpo"
NO_ADAPTERS = "has no effect with lora=none (no adapters: lora.rank=0); remove it or choose lora=attn or lora=attn_mlp"


def test_the_fix_offered_is_a_preset_that_accepts_the_value():
    """The presets a key-of-another-preset message may offer: those under which the rest of the command line composes
    and passes the group's checks, the default first (``objective.weighting=cart`` is refused under bd3lm)."""
    from hydra import initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from difflm.config import CONF_DIR
    from difflm.config.job_check import _presets_that_accept

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        parser = OverridesParser.create()
        offer = functools.partial(_presets_that_accept, "train", group="objective", parser=parser,
                                  presets=["bd3lm", "mdlm", "sft"])
        assert offer(["objective=ar", "objective.weighting=cart"]) == ["mdlm", "sft"]
        assert offer(["objective=ar", "objective.schedule=cosine"]) == ["mdlm", "bd3lm", "sft"]
        assert offer(["objective=ar", "objective.weighting=cart", "objective.block_schedule=[[10,4]]"]) == []


@pytest.mark.parametrize("config_name,argv,message", [
    ("rl", ["algorithm=dpo", "gen.steps=64"], f"gen.steps=64 {NO_ROLLOUTS}"),
    ("rl", ["gen.threshold=0.9", "algorithm=dpo", "estimator=mc_elbo"], f"gen.threshold=0.9 {NO_ROLLOUTS}"),
    ("rl", ["algorithm=dpo", "reward=format"],
     "reward=format has no effect with algorithm=dpo (no rewards: it learns from preference pairs); remove it or use "
     "algorithm=grpo"),
    ("rl", ["reward.terms=[]", "algorithm=dpo"],
     "reward.terms=[] has no effect with algorithm=dpo (no rewards: it learns from preference pairs); remove it or "
     "use algorithm=grpo"),
    ("rl", ["algorithm=dpo", "data.answer_field=answer"],
     "data.answer_field=answer has no effect with algorithm=dpo (no reward reads a reference answer); remove it or "
     "use algorithm=grpo"),
    ("rl", ["data.chosen_field=good"], f"data.chosen_field=good {NO_PAIRS}"),
    ("rl", ["algorithm=grpo", "data.rejected_field=bad"], f"data.rejected_field=bad {NO_PAIRS}"),
    ("rl", ["data.max_response_tokens=64"], f"data.max_response_tokens=64 {NO_PAIRS}"),
    ("rl", ["algorithm.beta=0", "algorithm.reference=frozen_copy"],
     "algorithm.reference=frozen_copy has no effect with algorithm.beta=0 (no KL term: no reference is built or "
     "read); remove it or set algorithm.beta > 0"),
    ("rl", ["lora.alpha=32"], f"lora.alpha=32 {NO_ADAPTERS}"),
    ("rl", ["lora=none", "lora.targets=[qkv]"], f"lora.targets=[qkv] {NO_ADAPTERS}"),
    ("train", ["model=tiny", "lora.dropout=0.1"], f"lora.dropout=0.1 {NO_ADAPTERS}"),
    ("train", ["logger.project=mine"],
     "logger.project=mine has no effect with logger=console (no W&B run); remove it or use logger=wandb"),
    ("rl", ["logger=wandb", "logger.num_samples=4"],
     "logger.num_samples=4 has no effect with difflm-rl (it logs no generated samples; its rollouts use gen.*); "
     "remove it"),
])
def test_a_key_the_chosen_settings_never_read_is_refused(config_name, argv, message):
    """A key that composes but that the run, as the other keys set it, never reads: one line naming it and the fix."""
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
    ("rl", ["gen.steps=64", "gen.threshold=0.9"]),  # grpo rolls out
    ("rl", ["algorithm=dpo", "data.chosen_field=good", "data.max_response_tokens=64"]),
    ("rl", ["algorithm.beta=0", "algorithm.reference=none"]),
    ("rl", ["algorithm.beta=0.1", "algorithm.reference=frozen_copy"]),
    ("rl", ["lora=attn", "lora.alpha=8"]),
    ("rl", ["lora.rank=4", "lora.alpha=8"]),  # a rank turns adapters on
    ("rl", ["logger=wandb", "logger.project=mine", "logger.mode=offline"]),
    ("train", ["logger.num_samples=0"]),  # the trainer logs samples with either logger
    ("rl", ["-m", "algorithm=grpo,dpo", "algorithm.prompts_per_step=2,4"]),
    ("rl", ["-m", "gen.steps=16,32", "algorithm.group_size=range(2,4)"]),
])
def test_keys_the_selected_preset_reads_are_accepted(config_name, argv):
    check_overrides(argv, config_name)


@pytest.mark.parametrize("argv,message", [
    (["-m", "algorithm=grpo,dpo", "gen.steps=64"],
     f"gen.steps=64 {NO_ROLLOUTS} (in the sweep's job algorithm=dpo)"),
    (["-m", "algorithm=glob(*)", "algorithm.group_size=8"],  # Hydra expands the glob to dpo and grpo
     "algorithm.group_size is a grpo key; algorithm=dpo does not use it: drop it (or set algorithm=grpo) "
     "(in the sweep's job algorithm=dpo)"),
    (["--multirun", "algorithm.beta=0.1,0", "algorithm.reference=frozen_copy"],
     "algorithm.reference=frozen_copy has no effect with algorithm.beta=0 (no KL term: no reference is built or "
     "read); remove it or set algorithm.beta > 0 (in the sweep's job algorithm.beta=0)"),
    (["-m", "train.max_steps=2,x"],
     "train.max_steps=x: Value 'x' of type 'str' could not be converted to Integer; give a value of the key's type "
     "(e.g. train.max_steps=100, the default) (in the sweep's job train.max_steps=x)"),
])
def test_a_sweep_is_refused_when_one_of_its_jobs_would_be(argv, message):
    """Every job of a -m sweep passes the single run's checks before Hydra launches the first."""
    assert refusal(argv, "rl") == message


def test_a_sweep_is_expanded_into_hydras_jobs():
    from difflm.config.job_check import check_job, jobs_to_check, sweep_jobs

    assert sweep_jobs(["algorithm=grpo,dpo", "gen.steps=range(1,3)"]) == [
        ["algorithm=grpo", "gen.steps=1"], ["algorithm=grpo", "gen.steps=2"],
        ["algorithm=dpo", "gen.steps=1"], ["algorithm=dpo", "gen.steps=2"]]
    assert sweep_jobs(["optim.lr=interval(0.1,0.2)"]) is None  # the basic sweeper takes no interval: Hydra says so
    assert check_job(["algorithm=grpo", "gen.steps=1"], "rl") is None
    # composed: every override once and every combination of what decides whether a key is read (the algorithm)
    jobs = sweep_jobs(["algorithm=grpo,dpo", "train.seed=1,2,3", "optim.lr=0.1,0.2"])
    assert jobs_to_check(jobs, ["algorithm", "estimator"]) == [
        ["algorithm=grpo", "train.seed=1", "optim.lr=0.1"], ["algorithm=grpo", "train.seed=1", "optim.lr=0.2"],
        ["algorithm=grpo", "train.seed=2", "optim.lr=0.1"], ["algorithm=grpo", "train.seed=3", "optim.lr=0.1"],
        ["algorithm=dpo", "train.seed=1", "optim.lr=0.1"]]
    assert check_job(["algorithm=dpo", "gen.steps=1"], "rl") == f"gen.steps=1 {NO_ROLLOUTS}"


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_a_sweep_with_a_dead_key_ends_before_any_job_starts(tmp_path):
    r = run_cli("difflm.rl", "-m", "algorithm=grpo,dpo", "gen.steps=64", f"init.run_dir={tmp_path / 'none'}",
                f"run.dir={tmp_path / 'rl'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"difflm: error: gen.steps=64 {NO_ROLLOUTS} (in the sweep's job "
                                                 "algorithm=dpo)")
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "rl").exists()  # no job was launched


def test_a_line_that_composes_is_composed_once_and_its_config_handed_on(monkeypatch):
    """A single run's command line that Hydra composes is checked by that one compose, and
    ``compose_train_config`` uses the config it gave instead of composing again: the same config as a plain
    ``compose``. A line with a mistyped key still gets its fix, from the composes that find it."""
    import hydra._internal.hydra as hydra_internal
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from difflm.config import CONF_DIR
    from difflm.config.compose import compose_train_config

    line = ["model=tiny", "optim.lr=2e-4", "data.seq_len=64", "objective=bd3lm"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        plain = compose("train", overrides=line)
    composes = []
    real = hydra_internal.Hydra.compose_config
    monkeypatch.setattr(hydra_internal.Hydra, "compose_config",
                        lambda self, *a, **k: composes.append(k["config_name"]) or real(self, *a, **k))
    cfg = compose_train_config(line)
    assert composes == ["train"]
    assert "hydra" not in cfg and OmegaConf.to_container(cfg) == OmegaConf.to_container(plain)
    assert check_overrides(["model=tiny", "-m", "optim.lr=1e-4,2e-4"], "train") is None  # a sweep: jobs checked
    # an override the check leaves to Hydra (++, ~, hydra.*) is composed by Hydra, not dropped from the config
    assert check_overrides(["model=tiny", "++train.max_steps=7"], "train") is None
    assert compose_train_config(["model=tiny", "++train.max_steps=7"]).train.max_steps == 7
    assert refusal(["model=tiny", "optim.lrr=2e-4"]).startswith("optim.lrr is not a config key; did you mean optim.lr?")
