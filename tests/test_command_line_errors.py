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


@pytest.mark.parametrize("argv,moved", [
    (["model=tiny", "-m", "optim.lr=1e-4,3e-4"], ["-m", "model=tiny", "optim.lr=1e-4,3e-4"]),
    (["run.dir=r", "--cfg", "job", "data.path=x"], ["--cfg", "job", "run.dir=r", "data.path=x"]),
    (["a=1", "--info", "config", "b=2"], ["--info", "config", "a=1", "b=2"]),  # an optional word of its choices
    (["a=1", "-cd", "my_conf", "--multirun", "b=2"], ["-cd", "my_conf", "--multirun", "a=1", "b=2"]),
    (["a=1", "--config-dir=my_conf", "b=2"], ["--config-dir=my_conf", "a=1", "b=2"]),
])
def test_hydras_flags_after_an_override_are_read_as_if_typed_first(argv, moved):
    """Hydra's parser takes its flags only before the overrides: ``difflm-train model=tiny -m optim.lr=...`` ended in
    its usage text and ``train.py: error: unrecognized arguments``."""
    from difflm.cli import hydra_flags_first

    assert hydra_flags_first(argv) == moved
    for kept in (["-m", "a=1"], ["a=1", "b=2"], ["a=1", "--bogus", "b=2"], ["a=1", "--", "-m", "b=2"]):
        assert hydra_flags_first(kept) == kept  # read already, or not Hydra's to read


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_a_flag_after_an_override_reaches_the_command(tmp_path):
    evaluate, cfg = run_cli_batch([("difflm.evaluate", ["run.dir=r", "-m", "data.path=x"], tmp_path),
                                   ("difflm.train", ["model=tiny", "--cfg", "job", "train.max_steps=7"], tmp_path)])
    assert evaluate.returncode == 2 and evaluate.stderr.strip() == (
        "difflm: error: difflm-eval takes no -m: it runs one job (only difflm-train and difflm-rl sweep); drop -m "
        "and run difflm-eval once per setting")
    assert cfg.returncode == 0, cfg.stderr[-2000:]
    assert "max_steps: 7" in cfg.stdout and "num_layers: 4" in cfg.stdout


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
    # an adapter preset with rank 0 would silently train every weight (full fine-tuning), in either order
    ("train", ["lora=attn_mlp", "lora.rank=0"],
     "lora=attn_mlp has no effect with lora.rank=0 (no adapters: every weight would train); remove it or set "
     "lora.rank >= 1"),
    ("rl", ["lora.rank=0", "lora=attn"],
     "lora=attn has no effect with lora.rank=0 (no adapters: every weight would train); remove it or set "
     "lora.rank >= 1"),
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
    ("train", ["lora=none", "lora.rank=0"]),
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


@pytest.fixture
def my_conf(tmp_path):
    """A folder of a user's own presets, laid out like conf/ (``--config-dir``): good ones and broken ones."""
    files = {
        "model/mine.yaml": "defaults:\n  - tiny\n  - _self_\nname: mine\nnum_layer: 4\n",
        "model/good.yaml": "defaults:\n  - tiny\n  - _self_\nname: good\nnum_layers: 2\n",
        "model/typed.yaml": "defaults:\n  - tiny\n  - _self_\nnum_layers: abc\n",
        "model/stray.yaml": "defaults:\n  - tiny\n  - _self_\nzzz: 1\n",
        "model/experts.yaml": "defaults:\n  - moe-tiny\n  - _self_\nmoe:\n  num_expert: 4\n",
        "model/unknown_base.yaml": "defaults:\n  - tinyy\n  - _self_\n",
        "model/broken.yaml": "num_layers: [2\n",
        "experiment/mine.yaml": "# @package _global_\ntrain:\n  max_step: 3\n",
        "experiment/uses_mine.yaml": "# @package _global_\ndefaults:\n  - override /model: mine\n",
        "algorithm/mine.yaml": "defaults:\n  - grpo\n  - _self_\ngroup_sise: 4\n",
        "objective/mine.yaml": "defaults:\n  - mdlm\n  - _self_\nschedul: cosine\n",
    }
    for name, text in files.items():
        (tmp_path / "my_conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "my_conf" / name).write_text(text)
    return tmp_path / "my_conf"


KEYS_LISTED = "(difflm-train --cfg job prints every key)"


@pytest.mark.parametrize("config_name,argv,message", [
    ("train", ["model=mine"],
     "num_layer in {d}/model/mine.yaml (model=mine) is not a config key; did you mean num_layers? " + KEYS_LISTED),
    ("train", ["model=experts"], "moe.num_expert in {d}/model/experts.yaml (model=experts) is not a config key; did "
                                 "you mean moe.num_experts? " + KEYS_LISTED),
    ("train", ["model=stray"],
     "zzz in {d}/model/stray.yaml (model=stray) is not a config key: remove it from the file " + KEYS_LISTED),
    ("train", ["experiment=mine"], "train.max_step in {d}/experiment/mine.yaml (experiment=mine) is not a config "
                                   "key; did you mean train.max_steps? " + KEYS_LISTED),
    ("train", ["experiment=uses_mine"],  # the file a recipe selects is the one named
     "num_layer in {d}/model/mine.yaml (model=mine) is not a config key; did you mean num_layers? " + KEYS_LISTED),
    ("train", ["model=typed"], "num_layers in {d}/model/typed.yaml (model=typed): Value 'abc' of type 'str' could "
                               "not be converted to Integer; give a value of the key's type (e.g. num_layers: 4, the "
                               "default)"),
    ("train", ["model=unknown_base"], "{d}/model/unknown_base.yaml (model=unknown_base): Could not load "
                                      "'model/tinyy': fix the file"),
    ("train", ["model=broken"], "{d}/model/broken.yaml, line 2, column 1: not valid YAML (while parsing a flow "
                                "sequence; expected ',' or ']', but got '<stream end>'): fix the file"),
    ("train", ["-m", "model=tiny,mine"], "num_layer in {d}/model/mine.yaml (model=mine) is not a config key; did you "
                                         "mean num_layers? " + KEYS_LISTED + " (in the sweep's job model=mine)"),
    ("rl", ["algorithm=mine"], "group_sise in {d}/algorithm/mine.yaml (algorithm=mine) is not a config key; did you "
                               "mean group_size? (difflm-rl --cfg job prints every key)"),
    ("import", ["objective=mine", "model=x", "output=y"],
     "schedul in {d}/objective/mine.yaml (objective=mine) is not a config key; did you mean schedule? "
     "(difflm-import --cfg job prints every key)"),
    ("train", ["model=good", "model.hiden_size=3"],  # the command line under --config-dir: checked as without it
     "model.hiden_size is not a config key; did you mean model.hidden_size? " + KEYS_LISTED),
])
def test_a_broken_preset_of_your_own_is_refused_naming_file_key_and_fix(my_conf, config_name, argv, message):
    """A preset file of a ``--config-dir`` folder that does not compose: one line naming the file, the selection,
    the key and the closest key, as a mistyped key on the command line is named."""
    assert refusal(["--config-dir", str(my_conf), *argv], config_name) == message.format(d=my_conf)


def test_presets_on_hydras_search_path_are_checked_as_difflms(my_conf):
    """``hydra.searchpath=[...]`` adds the same folders: a good preset of your own is accepted (not "no model
    preset"), a broken one named; a --config-dir that is not a folder is refused in one line."""
    searchpath = f"hydra.searchpath=[file://{my_conf}]"
    check_overrides([searchpath, "model=good", "train.max_steps=3"], "train")
    check_overrides(["--config-dir", str(my_conf), "model=good", "train.max_steps=3"], "train")
    assert refusal([searchpath, "model=mine"]).startswith(f"num_layer in {my_conf}/model/mine.yaml (model=mine) is "
                                                          "not a config key; did you mean num_layers?")
    assert refusal(["--config-dir", str(my_conf / "none"), "model=good"]) == (
        f"--config-dir {my_conf / 'none'} is not a folder: give the folder of your presets, laid out like difflm's "
        "conf/ (model/mine.yaml, experiment/mine.yaml, ...)")


def test_a_dash_word_that_is_no_flag_is_refused_naming_the_closest_flag():
    """A mistyped flag ends in one line with the closest of Hydra's flags, instead of Hydra's usage text; flags and
    negative numbers Hydra reads pass."""
    from difflm.cli import check_flags

    def said(argv, prog="difflm-train"):
        with pytest.raises(DifflmError) as info:
            check_flags(argv, prog)
        return str(info.value)

    tail = "Settings are key=value words ({p} --cfg job prints every key); {p} --help lists its flags (--cfg job, " \
           "-m, --config-dir DIR, --config-name NAME, ...)"
    assert said(["--cfgg", "job"], "difflm-eval") == ("--cfgg is not a flag of difflm-eval; did you mean --cfg? "
                                                      + tail.format(p="difflm-eval"))
    assert said(["model=tiny", "--multirn"]).startswith("--multirn is not a flag of difflm-train; did you mean "
                                                        "--multirun? ")
    assert said(["--bogus"]) == "--bogus is not a flag of difflm-train. " + tail.format(p="difflm-train")
    assert said(["model=tiny", "--cfg", "job", "--bogus"]) == said(["--bogus"])  # a flag's value is no split value
    assert said(["run.dir=r", "prompt=Explain", "the", "-v", "flag"], "difflm-generate") == (
        "-v is not a flag of difflm-generate: the shell split prompt= at a space; quote the value: "
        "prompt='Explain the -v flag'")
    for argv in (["--cfg", "job", "model=tiny"], ["-m", "optim.lr=1e-4,2e-4"], ["--config-dir=x", "-cn", "train"],
                 ["model=tiny", "-cd=x", "-cn=mine"], ["optim.lr=-1e-4"], ["model=tiny"], []):
        check_flags(argv, "difflm-train")


def test_two_of_hydras_mode_flags_end_in_one_line_naming_both():
    """``-m`` with ``--cfg``, ``--cfg`` with ``--info``, ...: Hydra runs one of them and ends any pair with a
    ValueError traceback; the command line is refused naming the two flags as typed, and ``--help`` still prints."""
    from difflm.cli import check_flags

    def said(argv, prog="difflm-train"):
        with pytest.raises(DifflmError) as info:
            check_flags(argv, prog)
        return str(info.value)

    modes = "takes one of --run, --multirun (-m), --cfg, --info and --shell-completion at a time"
    assert said(["--cfg", "hydra", "-m", "optim.lr=1e-4,3e-4"]) == (
        f"-m and --cfg cannot be given together: difflm-train {modes}; to print one job's config drop -m and give "
        "that job's values (one per swept key)")
    assert said(["--multirun", "-c", "job"]).startswith("--multirun and -c cannot be given together")
    assert said(["--cfg", "job", "--info"], "difflm-eval") == f"--cfg and --info cannot be given together: " \
                                                              f"difflm-eval {modes}"
    assert said(["-m", "--info", "searchpath"]).startswith("-m and --info cannot be given together")
    for argv in (["--help", "-m", "--cfg", "job"], ["-m", "optim.lr=1e-4,3e-4"], ["--cfg", "hydra"], ["--info"]):
        check_flags(argv, "difflm-train")


@pytest.mark.parametrize("argv,message", [
    (["model=tiny", "+optim.lr=1e-3"], "+optim.lr=1e-3: Could not append to config. An item is already at "
     "'optim.lr'. Either remove + prefix: 'optim.lr=1e-3'. Or add a second + to add or override 'optim.lr': "
     "'++optim.lr=1e-3'"),
    (["~run.dir", "--cfg", "job"], "~run.dir: run.dir cannot be removed: it is a key of the schema every "
     "difflm-train config holds (difflm/config/schema.py); give it a value instead (run.dir=...)"),
    (["optim.lr=1e-3", "~data.path"], "~data.path: data.path cannot be removed: it is a key of the schema every "
     "difflm-train config holds (difflm/config/schema.py); give it a value instead (data.path=...)"),
    (["+experiment=mdlm_owt"], "+experiment=mdlm_owt: experiment is a group of difflm-train's config already (one "
     "preset each): select it without +: experiment=mdlm_owt"),
    (["--cfg", "job", "+train.max_stepz=5"], "+train.max_stepz: train has no key max_stepz (did you mean "
     "max_steps?); the keys of train are listed in difflm/config/schema.py (TrainConfig)"),
    (["-m", "+optim.lr=1e-3,3e-4"], "+optim.lr=0.001: Could not append to config. An item is already at "
     "'optim.lr'. Either remove + prefix: 'optim.lr=0.001'. Or add a second + to add or override 'optim.lr': "
     "'++optim.lr=0.001'"),
])
def test_a_key_added_or_removed_against_the_schema_ends_in_one_line(argv, message):
    """``+key`` of a key that exists, ``~key`` of a key the schema always has, ``+group=`` of a group the config
    selects already, which Hydra ends in its multi-line message with exit status 1, end in one line naming the
    override. A ``+`` key the schema lacks is refused rather than printed by ``--cfg job``."""
    from difflm.cli import check_edits

    with pytest.raises(DifflmError) as info:
        check_edits(argv, "train")
    assert str(info.value) == message
    for fine in (["++train.max_steps=5"], ["~model", "--cfg", "job"], ["model=tiny"]):
        check_edits(fine, "train")


def test_a_launcher_that_cannot_launch_here_ends_in_one_line(monkeypatch, tmp_path):
    """``hydra/launcher=`` mistyped, one of the submitit plugin's without the plugin, and SLURM's launcher on a
    machine without ``srun`` (Hydra's multi-line errors, or submitit's traceback once the sweep folder is made)
    end in one line before Hydra starts."""
    import difflm.cli
    from difflm.cli import check_launcher

    def said(argv):
        with pytest.raises(DifflmError) as info:
            check_launcher(argv, "train")
        return str(info.value)

    assert said(["-m", "hydra/launcher=slurmm", "optim.lr=1e-4,3e-4"]).startswith(
        "hydra/launcher=slurmm is not a launcher; did you mean hydra/launcher=slurm? (launchers: basic, slurm")
    monkeypatch.setattr(difflm.cli, "submitit_installed", lambda: False)
    plugin = ("needs Hydra's submitit launcher plugin, which is not installed: pip install hydra-submitit-launcher "
              "(from a clone: pip install '.[slurm]'), or drop hydra/launcher= to run the jobs one after the other in "
              "this process")
    assert said(["-m", "hydra/launcher=slurm", "optim.lr=1e-4,3e-4"]) == f"hydra/launcher=slurm {plugin}"
    assert said(["--cfg", "hydra", "hydra/launcher=submitit_local"]) == f"hydra/launcher=submitit_local {plugin}"
    check_launcher(["-m", "hydra/launcher=basic", "optim.lr=1e-4,3e-4"], "train")
    monkeypatch.undo()

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[slurm]'")
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    assert said(["-m", "hydra/launcher=slurm", "optim.lr=1e-4,3e-4"]) == (
        "hydra/launcher=slurm submits each job to SLURM, and this machine has no srun (SLURM's commands are not on "
        "PATH): start the sweep on a SLURM login node, or run its jobs here with hydra/launcher=submitit_local (each "
        "its own process) or without hydra/launcher= (one after the other)")
    for fine in (["--cfg", "hydra", "hydra/launcher=slurm"], ["-m", "hydra/launcher=submitit_local", "optim.lr=1,2"]):
        check_launcher(fine, "train")  # nothing is submitted
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    check_launcher(["-m", "hydra/launcher=slurm", "optim.lr=1e-4,3e-4"], "train")


def test_your_preset_under_the_name_of_a_shipped_one_is_refused_not_left_unread(my_conf):
    """Hydra finds difflm's conf/ before your folder, so a my_conf/model/tiny.yaml of your own would go unread and
    the run take difflm's model=tiny. Selected by default, typed, or swept, it is refused naming both files; a copy
    with the same contents passes."""
    import shutil

    from difflm.cli import check_shadowed_presets
    from difflm.config import CONF_DIR

    (my_conf / "model" / "tiny.yaml").write_text("name: tiny\nnum_layers: 7\n")
    message = (f"model=tiny: your {my_conf}/model/tiny.yaml is not read: difflm's own {CONF_DIR}/model/tiny.yaml has "
               "that name and is found first; give your file a new name (model/tiny_mine.yaml) and select it "
               "(model=tiny_mine)")
    for argv in (["--config-dir", str(my_conf), "--cfg", "job"], [f"hydra.searchpath=[file://{my_conf}]", "model=tiny"],
                 ["-m", "--config-dir", str(my_conf), "model=good,tiny"]):
        with pytest.raises(DifflmError) as info:
            check_shadowed_presets(argv, "train")
        assert str(info.value) == message
    check_shadowed_presets(["--config-dir", str(my_conf), "model=good"], "train")
    shutil.copy(f"{CONF_DIR}/model/tiny.yaml", my_conf / "model" / "tiny.yaml")  # a copy as it is: read the same
    check_shadowed_presets(["--config-dir", str(my_conf)], "train")


def test_a_primary_config_of_your_own_is_named_by_config_name_under_config_dir(my_conf):
    """``--config-name NAME`` must be the command's own config or a NAME.yaml of ``--config-dir`` (another command's
    config in difflm's conf/ is refused too); a ``--config-path`` without difflm's groups is refused in one line
    naming ``--config-dir``."""
    from difflm.config import CONF_DIR

    (my_conf / "mine.yaml").write_text((CONF_DIR / "train.yaml").read_text())
    assert check_overrides(["--config-dir", str(my_conf), "--config-name", "mine", "model=good"], "train") is None
    assert check_overrides(["--config-name", "train", "model=tiny"], "train") is None
    fix = (f"Put {{n}}.yaml in a folder and pass --config-dir FOLDER (start from a copy of {CONF_DIR}/train.yaml: its "
           f"defaults list composes the groups), or leave --config-name out")
    assert refusal(["--config-dir", str(my_conf), "--config-name", "mine2"]) == (
        "--config-name mine2: no mine2.yaml in --config-dir (the configs there: mine). " + fix.format(n="mine2"))
    assert refusal(["-cn", "rl", "model=tiny"]) == "--config-name rl: no rl.yaml in --config-dir. " + fix.format(n="rl")
    for path in ("conf", str(my_conf / "experiment")):  # relative (read as a package by Hydra), or without groups
        assert refusal(["--config-path", path, "--config-name", "mine"]) == (
            f"--config-path {path} is not an absolute folder holding difflm's config groups (model/, objective/, ...), "
            "which every config composes: put your configs in a folder and pass --config-dir FOLDER (and "
            "--config-name NAME for a NAME.yaml of your own there), or give the absolute path of a whole copy of "
            "difflm's conf/")
    (my_conf / "objective").mkdir(exist_ok=True)  # a tree of its own with the groups: Hydra's to compose
    assert check_overrides(["--config-path", str(my_conf), "--config-name", "mine"], "train") is None


def test_compose_and_the_planner_name_a_broken_preset_of_your_own(my_conf, capsys):
    """``compose_train_config(..., config_dir=)`` (scripts) and ``difflm-plan --config-dir`` compose your presets as
    difflm-train does, and refuse a broken one in the same line."""
    from difflm.config.compose import compose_train_config
    from difflm.plan.cli import main as plan

    assert compose_train_config(["model=good"], config_dir=my_conf).model.num_layers == 2
    with pytest.raises(DifflmError) as info:
        compose_train_config(["model=mine"], config_dir=my_conf)
    assert str(info.value) == (f"num_layer in {my_conf}/model/mine.yaml (model=mine) is not a config key; did you "
                               f"mean num_layers? {KEYS_LISTED}")
    assert plan(["--config-dir", str(my_conf), "model=mine"]) == 2
    assert capsys.readouterr().err.strip() == f"difflm: error: {info.value}"


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_a_broken_preset_of_your_own_ends_in_one_line(my_conf, tmp_path):
    calls = [("difflm.train", ["--config-dir", my_conf, "model=mine", f"run.dir={tmp_path / 'run'}"]),
             ("difflm.rl", ["--config-dir", my_conf, "algorithm=mine", f"init.run_dir={tmp_path / 'none'}",
                            f"run.dir={tmp_path / 'rl'}"])]
    train, rl = run_cli_batch(calls, timeout=300)
    assert train.returncode == 2 and rl.returncode == 2, (train.stderr[-2000:], rl.stderr[-2000:])
    assert train.stderr.strip() == (f"difflm: error: num_layer in {my_conf}/model/mine.yaml (model=mine) is not a "
                                    f"config key; did you mean num_layers? {KEYS_LISTED}")
    assert rl.stderr.strip() == (f"difflm: error: group_sise in {my_conf}/algorithm/mine.yaml (algorithm=mine) is not "
                                 "a config key; did you mean group_size? (difflm-rl --cfg job prints every key)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "rl").exists()


def sweep_refusal(argv, config_name="train") -> str:
    """The one line :func:`difflm.cli.check_sweep` refuses a sweep with, under the entry point's own job checks."""
    from difflm.cli import check_sweep
    from difflm.rl import check_job_config as rl_job
    from difflm.train import check_job_config as train_job

    with pytest.raises(DifflmError) as info:
        check_sweep(argv, config_name, {"train": train_job, "rl": rl_job}[config_name])
    message = str(info.value)
    assert "\n" not in message
    return message


TP3 = ("parallel.tp=3 does not divide model.num_heads=4: pick a tp that divides the attention heads, KV heads, FFN "
       "width and the vocabulary padding (model.vocab_multiple)")


@pytest.mark.parametrize("config_name,argv,message", [
    ("train", ["-m", "model=tiny", "parallel.tp=1,3"], f"{TP3} (in the sweep's job parallel.tp=3)"),
    ("train", ["-m", "optim.lr=0.001,0.002", "parallel.tp=1,3"],  # the second job of four
     f"{TP3} (in the sweep's job optim.lr=0.001 parallel.tp=3)"),
    ("train", ["--multirun", "train.global_batch_size=4,6", "train.micro_batch_size=4"],
     "train.global_batch_size=6 is not a multiple of train.micro_batch_size=4 x data-parallel ranks=1: set "
     "train.global_batch_size to a multiple of 4, or train.micro_batch_size to a divisor of 6 (the batch of each "
     "data-parallel rank) (gradient accumulation fills the rest) (in the sweep's job train.global_batch_size=6)"),
    ("train", ["hydra.mode=MULTIRUN", "objective=mdlm,bd3lm", "objective.block_size=5", "data.seq_len=64"],
     "objective.block_size=5 does not divide data.seq_len=64 (in the sweep's job objective=bd3lm)"),
    ("train", ["-m", "++train.max_steps=10", "profile.enabled=true", "profile.active=1,4"],  # ++ keys compose too
     "profile.wait + profile.warmup + profile.active = 11 steps, more than train.max_steps=10: no trace would be "
     "written; lower profile.wait (or warmup, active) or raise train.max_steps (in the sweep's job profile.active=4)"),
    ("rl", ["-m", "algorithm.group_size=4,1", "data.answer_field=answer", "init.run_dir=runs/sft"],
     "algorithm.group_size=1 must be >= 2 (advantages compare a group) (in the sweep's job algorithm.group_size=1)"),
])
def test_a_sweep_is_refused_before_its_first_job_when_a_later_job_fails_its_checks(config_name, argv, message):
    """The multi-key checks a job runs at its start (difflm-train's check_run, difflm-rl's check_rl_config) run for
    every job of a -m sweep before Hydra launches the first, naming the job that fails by its swept values."""
    assert sweep_refusal(argv, config_name) == message


def test_a_sweep_whose_jobs_all_pass_is_left_to_run():
    from difflm.cli import check_sweep
    from difflm.config.job_check import sweep_job_configs
    from difflm.train import check_job_config

    check_sweep(["-m", "optim.lr=0.001,0.002", "parallel.tp=1"], "train", check_job_config)
    check_sweep(["parallel.tp=3"], "train", check_job_config)  # a single run: its own start checks it
    sweep = sweep_job_configs("train", ["++train.max_steps=7", "optim.lr=0.001,0.002", "hydra.job.chdir=false"])
    assert sweep.here and [job for job, _, _ in sweep.jobs] == [["++train.max_steps=7", "optim.lr=0.001"],
                                                               ["++train.max_steps=7", "optim.lr=0.002"]]
    assert [(cfg.train.max_steps, cfg.optim.lr) for _, _, cfg in sweep.jobs] == [(7, 0.001), (7, 0.002)]
    assert all("hydra" not in cfg for _, _, cfg in sweep.jobs)  # as the task function receives it


def test_a_sweep_whose_jobs_would_not_each_get_a_folder_in_the_sweeps_is_refused():
    """Hydra resolves the sweep's folder once with no job's values but each job's folder with its own: a run.dir
    naming a swept key would scatter the jobs (sweeps/lr_0.001/0, sweeps/lr_0.0003/1, multirun.yaml in a third), and
    a hydra.sweep.subdir that does not tell the jobs apart would put two in one folder. Both end before the first
    job."""
    scattered = sweep_refusal(["-m", "optim.lr=1e-3,3e-4", "run.dir=sweeps/lr_${optim.lr}"])
    assert scattered.startswith("the sweep's folder changes with its values: run.dir (hydra.sweep.dir) is "
                                "'sweeps/lr_0.0003' for the sweep, but 'sweeps/lr_0.001' for its job optim.lr=0.001, "
                                "so its jobs would be scattered over several folders: give run.dir without the swept "
                                "keys (every job runs in <run.dir>/<job number>)")
    assert "for its job objective=ar," in sweep_refusal(["-m", "objective=mdlm,ar", "run.dir=r_${objective.name}"])
    assert sweep_refusal(["-m", "optim.lr=1e-3,3e-4", "train.seed=1,2", "run.dir=sw",
                          "hydra.sweep.subdir=lr_${optim.lr}"]) == (
        "the sweep's jobs optim.lr=0.001 train.seed=1 and optim.lr=0.001 train.seed=2 would both run in sw/lr_0.001 "
        "(hydra.sweep.subdir gives 'lr_0.001' for both): each job needs a folder of its own; let hydra.sweep.subdir "
        "tell every job apart (the default ${hydra.job.num}, the job's number, does)")
    from difflm.cli import check_sweep
    from difflm.train import check_job_config

    for fine in (["run.dir=sw_${now:%H-%M-%S}"], ["run.dir=sw", "hydra.sweep.subdir=lr_${optim.lr}"],
                 ["run.dir=sw_${model.name}"]):  # the same for every job, or a folder per job
        check_sweep(["-m", "optim.lr=1e-3,3e-4", *fine], "train", check_job_config)


def test_jobs_that_run_elsewhere_are_checked_for_the_launchers_world_size():
    """Under the SLURM launcher each job is nodes x tasks_per_node processes on other machines: the checks the
    config alone decides run for that world size (not this machine's devices)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install '.[slurm]'")
    launched = "launched as hydra.launcher.nodes=1 x hydra.launcher.tasks_per_node=8 processes"
    assert sweep_refusal(["-m", "hydra/launcher=slurm", "optim.lr=0.001,0.002"]) == (
        "parallel.dp_replicate*dp_shard*tp*pp*cp=1 but the world size is 8: this layout (dp_replicate=1 dp_shard=1 "
        "tp=1 pp=1 cp=1) runs on 1 process(es); launch with torchrun --nproc-per-node 1 or pick a layout whose "
        f"degrees multiply to the world size (dp_shard=-1 fills it) (in the sweep's job optim.lr=0.001, {launched})")
    assert sweep_refusal(["-m", "hydra/launcher=slurm", "parallel=tp2", "parallel.tp=2,3", "parallel.dp_shard=4",
                          "train.micro_batch_size=2", "device=cuda", "precision=bf16"]) == (
        f"{TP3} (in the sweep's job parallel.tp=3, {launched})")  # job 0 (tp2 x dp4 = 8 GPUs) passes
    from difflm.cli import check_sweep
    from difflm.train import check_job_config

    # device=cuda on a machine without one: the job runs on the cluster's GPUs, so it is not refused here
    check_sweep(["-m", "hydra/launcher=slurm", "parallel=fsdp", "train.micro_batch_size=1", "device=cuda",
                 "optim.lr=0.001,0.002"], "train", check_job_config)


def test_the_config_checks_of_a_run_elsewhere_are_the_config_part_of_check_run():
    from difflm.config.validate import check_config, check_run

    from conftest import compose_run

    for overrides in (["parallel.tp=3"], ["train.global_batch_size=6", "train.micro_batch_size=4"],
                      ["objective=bd3lm", "objective.block_size=5"], ["optim.beta1=1.5"]):
        with pytest.raises(DifflmError) as here:
            check_run(compose_run(overrides))
        with pytest.raises(DifflmError) as elsewhere:
            check_config(compose_run(overrides, auto=True))
        assert str(here.value) == str(elsewhere.value)
    check_config(compose_run(["device=cuda", "precision=bf16"], auto=True))  # the device is the run's, not ours
    with pytest.raises(DifflmError, match="world size is 2"):
        check_config(compose_run([], auto=True), world_size=2)


@pytest.mark.slow  # starts a process: make test-fast leaves it out
def test_a_sweep_with_a_bad_later_job_trains_none(tmp_path):
    r = run_cli("difflm.train", "-m", "model=tiny", "train.max_steps=1", "parallel.tp=1,3", "logger.num_samples=0",
                "train.eval_every=0", "logger.progress_bar=false", f"run.dir={tmp_path / 'sweep'}", timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == f"difflm: error: {TP3} (in the sweep's job parallel.tp=3)"
    assert "done:" not in r.stdout and not (tmp_path / "sweep").exists()  # job 0 did not train
