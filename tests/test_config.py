"""Config composition of every group option, schema errors at compose time, cross-key validation."""
from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException as HydraCompositionError

import difflm.config
from difflm.config.validate import check_batch, check_run
from difflm.errors import DifflmError

from conftest import compose_run, run_cli_batch

GROUPS = {
    group: sorted(p.stem for p in (difflm.config.CONF_DIR / group).glob("*.yaml"))
    for group in ("model", "parallel", "precision", "data", "objective", "optim", "schedule", "logger")
}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    cfg = compose_run([f"{group}={option}"])
    assert cfg[group].name == option


def test_group_presets_exist():
    assert GROUPS["model"] == ["1.7b", "125m", "350m", "8b", "dense-1b", "llada-moe-7b-a1b", "llada-moe-tiny",
                              "llada2-mini", "llada2-tiny", "moe-1b-7b", "moe-tiny", "tiny"]
    assert {"mdlm", "ar"} <= set(GROUPS["objective"])
    assert {"cosine", "wsd", "constant"} <= set(GROUPS["schedule"])
    assert {"console", "wandb"} <= set(GROUPS["logger"])
    assert {"fp32", "bf16"} <= set(GROUPS["precision"])


def test_1_7b_preset_has_megadlm_dimensions():
    # MegaDLMs' examples/dlm_training/dlm_pretrain_1.7b.sh: no --group-query-attention, so 16 KV heads
    m = compose_run(["model=1.7b"]).model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (28, 2048, 16, 16, 6144)
    assert m.qk_norm and not m.tie_embeddings and m.rope_base == 10000.0 and m.norm_eps == 1e-6


def test_default_data_is_embedded_corpus():
    d = compose_run().data
    assert d.path.endswith("difflm/assets/corpora/tinyshakespeare/input.txt")
    assert open(d.path).read(11) == "First Citiz"


def test_typo_in_key_fails_at_compose_time():
    with pytest.raises(HydraCompositionError, match="num_layer"):
        compose_run(["model.num_layer=3"])


@pytest.mark.parametrize("override,message", [
    ("+train.max_stepz=5", "+train.max_stepz: train has no key max_stepz (did you mean max_steps?); the keys of "
                           "train are listed in difflm/config/schema.py (TrainConfig)"),
    ("+optim.lrr=1e-3", "+optim.lrr: optim has no key lrr (did you mean lr?); the keys of optim are listed in "
                        "difflm/config/schema.py (OptimConfig)"),
    ("++model.moe.topk=1", "+model.moe.topk: model.moe has no key topk (did you mean top_k?); the keys of model.moe "
                           "are listed in difflm/config/schema.py (MoEConfig)"),
    ("+foo=1", "+foo: the config has no key foo; the keys of the config are listed in difflm/config/schema.py "
               "(RunConfig)"),
])
def test_key_added_with_plus_must_be_in_the_schema(override, message):
    """Hydra's + and ++ add a key whatever the schema (struct mode is lifted for them), so it is checked after."""
    from difflm.config.schema import check_known_keys

    with pytest.raises(DifflmError) as err:
        check_known_keys(compose_run([override]))
    assert str(err.value) == message


@pytest.mark.parametrize("caller", ["compose", "benchmark", "moe_balance", "megadlms_baseline"])
def test_scripts_compose_with_the_entry_points_checks(caller, tmp_path):
    """Every place that composes the train config outside difflm-train (difflm.config.compose, the benchmark, the MoE
    balance sweep, the MegaDLMs flags, difflm-import) refuses a mistyped key or preset with difflm-train's one line,
    naming the closest, before anything runs."""
    from conftest import load_script

    from difflm.config.compose import compose_train_config

    preset = "model=tinyy is not a model preset; did you mean model=tiny? (presets: "
    key = ("model.hiden_size is not a config key; did you mean model.hidden_size? (difflm-train --cfg job prints "
           "every key)")
    if caller == "megadlms_baseline":  # composes model=<preset> only
        calls = [(lambda: load_script(caller).model_config("tinyy"), preset)]
    elif caller == "moe_balance":  # its extra overrides go on every run
        balance = load_script(caller)
        calls = [(lambda: balance.run("aux_free", 1, tmp_path, ["model.hiden_size=8"]), key)]
    else:
        compose = compose_train_config if caller == "compose" else load_script(caller).compose
        calls = [(lambda: compose(["model=tinyy"]), preset),
                 (lambda: compose(["model=tiny", "model.hiden_size=8"]), key)]
    for call, message in calls:
        with pytest.raises(DifflmError) as err:
            call()
        assert str(err.value).startswith(message), str(err.value)
    assert not list(tmp_path.iterdir())  # refused before a run directory was made


def test_known_key_added_with_plus_and_free_form_dicts_are_kept():
    from dataclasses import dataclass, field

    from omegaconf import OmegaConf

    from difflm.config.schema import check_known_keys, unknown_keys

    cfg = compose_run(["+train.epochs=2", "++model.head_dim=32", "+data.hf_dataset=x"])  # null by default: + sets it
    check_known_keys(cfg)
    assert (cfg.train.epochs, cfg.model.head_dim, cfg.data.hf_dataset) == (2, 32, "x")

    @dataclass
    class WithOptions:
        options: dict = field(default_factory=dict)  # free-form: any key

    assert list(unknown_keys(OmegaConf.merge(OmegaConf.structured(WithOptions), {"options": {"any": 1}}))) == []


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(HydraCompositionError, match="max_steps"):
        compose_run(["train.max_steps=abc"])


@pytest.mark.parametrize("overrides,needle", [
    (["model.num_kv_heads=3"], "model.num_kv_heads=3"),
    (["model.num_heads=5"], "model.num_heads=5"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"], "train.global_batch_size=10"),
    (["precision=fp16", "device=cpu"], "precision=fp16"),
    (["precision=fp8", "device=cpu"], "precision=fp8"),
    (["objective.t_sampling=sobol"], "objective.t_sampling"),
    (["schedule.name=linear"], "schedule.name"),
    (["data.valid_fraction=1.5"], "data.valid_fraction"),
    (["parallel.tp=2"], "parallel.dp_replicate*dp_shard*tp*pp*cp=2"),
    (["objective.length_multiple=5"], "objective.length_multiple=5"),
    (["logger.sample_temperature=-1"], "logger.sample_temperature=-1"),
    (["logger.sample_temperature=inf"], "logger.sample_temperature=inf must be >= 0 and finite"),
    (["objective=ar", "model.shift_logits=true"], "model.shift_logits=true is for masked diffusion"),
    (["objective=bd3lm", "model.shift_logits=true"], "model.shift_logits=true with objective=bd3lm"),
    (["objective=bd3lm", "gen.cfg_scale=1.5", "logger.num_samples=2"],
     "gen.cfg_scale=1.5: classifier-free guidance is not implemented"),
    (["objective=ar", "gen.threshold=0.9", "gen.cache=prefix", "logger.num_samples=2"],
     "gen.threshold=0.9, gen.cache=prefix: objective=ar runs decode left to right and read only gen.length, "
     "gen.temperature, gen.top_k, gen.top_p and gen.seed: drop gen.threshold gen.cache"),
    (["profile.enabled=true", "profile.active=0"], "profile.active=0"),
    (["profile.enabled=true", "train.max_steps=3"], "profile.wait + profile.warmup + profile.active = 10 steps, "
     "more than train.max_steps=3"),
])
def test_validation_errors_name_the_key(overrides, needle):
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(overrides))
    assert needle in str(err.value)


# (overrides, the keys whose values are wrong): each refusal spells key=value for those keys only, so the note on
# where a value came from (difflm.config.provenance.name_sources) is about a key the user has to change
WRONG_KEYS = [
    (["objective=bd3lm", "objective.ar_loss_weight=-1"], {"objective.ar_loss_weight"}),
    (["objective=bd3lm", "objective.diffusion_loss_weight=-0.5"], {"objective.diffusion_loss_weight"}),
    (["objective=mdlm", "objective.ar_loss_weight=0", "objective.diffusion_loss_weight=0"],
     {"objective.ar_loss_weight", "objective.diffusion_loss_weight"}),
    (["objective=bd3lm", "objective.t_lo=-0.1"], {"objective.t_lo"}),
    (["objective=mdlm", "objective.t_hi=1.5"], {"objective.t_hi"}),
    (["objective=bd3lm", "objective.t_lo=1.0"], {"objective.t_lo", "objective.t_hi"}),
    (["objective=bd3lm", "objective.block_size=0"], {"objective.block_size"}),
    (["objective=bd3lm", "objective.block_size=5"], {"objective.block_size", "data.seq_len"}),
    (["objective.length_multiple=0"], {"objective.length_multiple"}),
    (["model=moe-tiny", "model.moe.top_k=0"], {"model.moe.top_k"}),
    (["model=moe-tiny", "model.moe.n_group=0"], {"model.moe.n_group"}),
    (["model=moe-tiny", "model.moe.n_group=2", "model.moe.topk_group=0"], {"model.moe.topk_group"}),
    (["model=moe-tiny", "model.moe.first_k_dense=-1"], {"model.moe.first_k_dense"}),
    (["train.save_every=-1"], {"train.save_every"}),
    (["profile.enabled=true", "profile.warmup=-1"], {"profile.warmup"}),
    (["objective=sft", "data.prompt_field=q", "data.response_field=a", "data.path=x.jsonl", "data.hf_dataset=y",
      "objective.random_length_prob=0"], {"data.hf_dataset"}),
]


@pytest.mark.parametrize("overrides,wrong", WRONG_KEYS)
def test_refusals_name_and_trace_only_the_wrong_keys(overrides, wrong):
    """``objective=bd3lm objective.ar_loss_weight=-1``: the refusal named both loss weights with their values, so the
    note on where values came from said that objective=bd3lm set objective.diffusion_loss_weight, which is not the
    key to change. The keys a refusal names with a value are the wrong ones, and so are those its note traces."""
    import re

    from hydra import initialize_config_dir

    from difflm.config.provenance import _KEY_RE, key_sources, name_sources

    with pytest.raises(DifflmError) as err:
        check_run(compose_run(overrides))
    message = str(err.value)
    assert set(_KEY_RE.findall(message)) == wrong, message
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        sources = key_sources("train", overrides)
    traced = set(re.findall(r"([\w.]+) is set by ", name_sources(message, sources)))
    assert traced == {k for k in wrong if k in sources}


def test_a_relation_of_two_keys_traces_the_one_a_preset_set():
    """t_lo >= t_hi is the pair's fault: the note names where t_hi (not typed) came from."""
    from hydra import initialize_config_dir

    from difflm.config.provenance import key_sources, name_sources

    overrides = ["objective=bd3lm", "objective.t_lo=1.0"]
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(overrides))
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        note = name_sources(str(err.value), key_sources("train", overrides))
    assert note.endswith("(objective.t_hi is set by objective=bd3lm in conf/objective/bd3lm.yaml: pass the key on the "
                         "command line to change it)")


def test_a_key_a_recipe_leaves_unset_gets_no_note():
    """experiment=llada_8b leaves data.path null for the user's corpus: the refusal says so, and no note adds that the
    recipe 'sets' data.path (the key is in the recipe's file, with nothing in it to change)."""
    from hydra import initialize_config_dir

    from difflm.config.provenance import key_sources, name_sources

    overrides = ["experiment=llada_8b"]
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(overrides))
    message = str(err.value)
    assert message.startswith("data.path is not set (this experiment leaves the corpus to you)"), message
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        sources = key_sources("train", overrides)
    assert "data.path" in sources  # the recipe's file names the key
    assert name_sources(message, sources) == message


@pytest.fixture(scope="module")
def train_lines(tmp_path_factory):
    """The difflm-train command lines of this module's process tests, in one process (``run_cli_batch``), each with
    a folder of its own: name -> (folder, CompletedProcess)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("shift_logits", "cfg_job", "typo", "recipe")}
    calls = {"shift_logits": ["objective=ar", "model.shift_logits=true", f"run.dir={folders['shift_logits'] / 'run'}"],
             "cfg_job": ["--cfg", "job", "model=1.7b"],
             "typo": ["model.num_layer=3"],
             "recipe": ["experiment=megadlm_1.7b", "model=tiny", "data.path=x.txt", "run.dir=unused"]}
    outs = run_cli_batch([("difflm.train", args, folders[name]) for name, args in calls.items()])
    return {name: (folders[name], out) for name, out in zip(calls, outs)}


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_ar_with_shift_logits_is_one_line_exit_2(train_lines):
    """A fault report: ``objective=ar model.shift_logits=true`` trained (exit 0) though difflm-import refuses it."""
    tmp_path, out = train_lines["shift_logits"]
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("difflm: error: model.shift_logits=true"), lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sft_is_allowed_under_pipeline_layouts():
    from difflm.config.validate import check_parallel, resolve_device

    cfg = compose_run(["objective=sft", "data.prompt_field=q", "data.response_field=a", "parallel=pp2",
                       "model.num_layers=2", "train.global_batch_size=8", "train.micro_batch_size=2", "device=cpu"])
    assert check_parallel(cfg, 2, resolve_device("cpu")).pp == 2


def test_cuda_on_cpu_machine_refused():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DifflmError, match="device=cuda"):
        check_run(compose_run(["device=cuda"]))


def test_accumulation_steps():
    assert check_batch(compose_run(["train.global_batch_size=32", "train.micro_batch_size=8"])) == 4


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cfg_job_prints_composed_run(train_lines):
    _, out = train_lines["cfg_job"]
    assert out.returncode == 0, out.stderr
    assert "num_layers: 28" in out.stdout and "hidden_size: 2048" in out.stdout


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_cli_typo_is_one_line_without_traceback(train_lines):
    _, out = train_lines["typo"]
    assert out.returncode != 0
    assert "num_layer" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("overrides,message", [
    (["gen.length=16"], "gen.length=16 must be a multiple of gen.block_length=64; e.g. gen.length=16 "
                        "gen.block_length=16 gen.steps=16"),
    (["gen.steps=2"], "gen.steps=2 must be >= the number of blocks, 4 (gen.length=256 / gen.block_length=64)"),
    (["gen.length=0"], "gen.length=0 must be >= 1"),
])
def test_end_of_training_sampler_settings_are_checked_before_training(overrides, message):
    """A run that samples at the end (logger.num_samples > 0) used to train to the end, then fail on gen.*."""
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(["logger.num_samples=2", "gen.block_length=64", "gen.length=256", *overrides]))
    assert str(err.value).startswith(message)
    assert str(err.value).endswith("(this run samples with gen.* after training, logger.num_samples=2: fix gen.* or "
                                   "set logger.num_samples=0)")
    check_run(compose_run(["logger.num_samples=0", *overrides]))  # no samples drawn: not this run's concern
    check_run(compose_run(["logger.num_samples=2", "objective=bd3lm", "gen.length=48", "gen.steps=48"]))  # per block


def test_sampler_settings_are_checked_only_for_runs_that_sample():
    """An ar run that draws no samples (train.sample_at_end=false, no W&B) is not refused for diffusion-only gen.*;
    one that samples at the end, or at each evaluation for W&B, is."""
    ar = ["objective=ar", "gen.steps=8", "logger.num_samples=2"]
    check_run(compose_run([*ar, "train.sample_at_end=false"]))
    for extra in ([], ["train.sample_at_end=false", "logger=wandb", "logger.mode=offline", "train.eval_every=5"]):
        with pytest.raises(DifflmError, match=r"^gen.steps=8: objective=ar runs decode left to right"):
            check_run(compose_run([*ar, *extra]))
    check_run(compose_run(["objective=bd3lm", "gen.cfg_scale=1.5", "logger.num_samples=2", "train.sample_at_end=false"]))


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", r"^optim.lr=-1.0 must be positive$"),
    ("optim.beta1=1.5", r"^optim.beta1=1.5 must be in \[0, 1\): AdamW's moment decay"),
    ("optim.beta2=1", r"^optim.beta2=1.0 must be in \[0, 1\)"),
    ("optim.eps=-1", r"^optim.eps=-1.0 must be >= 0"),
    ("optim.weight_decay=-0.1", r"^optim.weight_decay=-0.1 must be >= 0 \(0 = no decay\)$"),
])
def test_optimizer_values_torch_would_refuse_mid_start_are_refused_first(override, message):
    """AdamW's own checks raise once the run has started (a traceback, its folders written); difflm-train and
    difflm-rl refuse the same values in one line before anything is built."""
    from test_posttrain_config import compose_rl

    from difflm.posttrain.runner import check_rl_config

    with pytest.raises(DifflmError, match=message):
        check_run(compose_run([override]))
    with pytest.raises(DifflmError, match=message):
        check_rl_config(compose_rl([override]))
    check_run(compose_run(["optim.beta1=0", "optim.eps=0", "optim.weight_decay=0"]))  # the edges are legal


SEED_FIX = "must be an integer in [0, 2**63) (it keys every random draw)"


@pytest.mark.parametrize("value", ["-1", "9223372036854775808", "99999999999999999999"])
def test_a_seed_out_of_range_is_refused_naming_its_key_at_every_entry_point(value):
    """train.seed and eval.seed key every random draw: outside [0, 2**63) they are refused before any work, naming the
    key; gen.seed only seeds torch's generator and is refused outside its range [-2**63, 2**64)."""
    from omegaconf import OmegaConf
    from test_posttrain_config import compose_rl

    from difflm.evaluate import check_eval_settings
    from difflm.posttrain.runner import check_rl_config
    from difflm.sampling.diffusion import check_generation_config

    with pytest.raises(DifflmError) as err:
        check_run(compose_run([f"train.seed={value}"]))
    assert str(err.value) == f"train.seed={value} {SEED_FIX}: e.g. train.seed=0"
    with pytest.raises(DifflmError, match=rf"^train.seed={value} must be an integer in"):
        check_rl_config(compose_rl([f"train.seed={value}"]))
    args = OmegaConf.create({"eval": {"mc_samples": 8, "batch_size": 8, "max_windows": 0, "seed": int(value)}})
    with pytest.raises(DifflmError, match=rf"^eval.seed={value} must be an integer in"):
        check_eval_settings(args)
    objective = OmegaConf.create({"name": "mdlm"})
    if int(value) >= 2**64:
        with pytest.raises(DifflmError) as err:
            check_rl_config(compose_rl([f"gen.seed={value}", "data.answer_field=answer"]))
        assert str(err.value) == (f"gen.seed={value} must be an integer in [-2**63, 2**64) (it seeds torch's "
                                  "generator): e.g. gen.seed=0")
        with pytest.raises(DifflmError, match=rf"^gen.seed={value} must be an integer in"):
            check_generation_config(OmegaConf.create({"length": 8, "seed": int(value)}), objective)
    else:  # torch.Generator.manual_seed takes it
        check_generation_config(OmegaConf.create({"length": 8, "seed": int(value)}), objective)
        torch.Generator().manual_seed(int(value))


def test_the_seeds_edges_are_accepted():
    from omegaconf import OmegaConf

    from difflm.evaluate import check_eval_settings
    from difflm.objectives.keyed_rng import check_seed

    assert check_seed(0, "train.seed") == 0 and check_seed(2**63 - 1, "train.seed") == 2**63 - 1
    check_run(compose_run([f"train.seed={2**63 - 1}"]))
    check_eval_settings(OmegaConf.create({"eval": {"mc_samples": 1, "batch_size": 1, "max_windows": 0, "seed": 0}}))


@pytest.mark.parametrize("project, shown", [("team/proj", "/"), ("a?b%c", "% ?")])
def test_a_wandb_project_name_wandb_refuses_is_refused_before_the_run_is_built(project, shown):
    """wandb.init refuses such a name (a traceback after the data and the model are built): refused first."""
    from test_posttrain_config import compose_rl

    from difflm.posttrain.runner import check_rl_config

    message = (f"logger.project={project!r} holds {shown}, which W&B refuses in a project name (any of / \\ # ? % :): "
               "name the team with logger.entity and the project alone")
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(["logger=wandb", "logger.mode=offline", f"logger.project={project}"]))
    assert str(err.value).startswith(message)
    with pytest.raises(DifflmError) as err:
        check_rl_config(compose_rl(["logger=wandb", "logger.mode=offline", f"logger.project={project}"]))
    assert str(err.value).startswith(message)
    with pytest.raises(DifflmError, match="more than the 128 W&B takes"):
        check_run(compose_run(["logger=wandb", "logger.mode=offline", f"logger.project={'p' * 129}"]))
    check_run(compose_run(["logger=wandb", "logger.mode=offline", f"logger.project={'p' * 128}"]))
    for empty in ("", "' '"):  # logger.project=$PROJECT with the variable unset
        with pytest.raises(DifflmError, match=r"^logger.project='\s*' is empty: W&B would file the run under "
                                              r'"Uncategorized"; name the project \(default logger.project=difflm\)$'):
            check_run(compose_run(["logger=wandb", "logger.mode=offline", f"logger.project={empty}"]))
        with pytest.raises(DifflmError, match="is empty"):
            check_rl_config(compose_rl(["logger=wandb", "logger.mode=offline", f"logger.project={empty}"]))
    check_run(compose_run(["logger.mode=offline", f"logger.project={project}"]))  # logger=console: never sent


def test_two_corpora_for_one_run_are_refused():
    """data.path given beside data.blend or data.hf_dataset was dropped without a word (the run reads one source);
    each alone, with data.path left at its default (the embedded corpus), is a run."""
    blend = "data.blend=[{path:/corpora/a.txt,weight:1}]"
    for overrides, named in (([blend, "data.path=/corpora/b.txt"], "data.path and data.blend"),
                             (["+data.hf_dataset=wikitext", "data.path=/corpora/b.txt"], "data.path and data.hf_dataset"),
                             (["+data.hf_dataset=wikitext", blend], "data.hf_dataset and data.blend")):
        with pytest.raises(DifflmError, match=rf"^{named} both name the training corpus, and a run reads only one: "
                                              r"keep one \(data.path=null, data.hf_dataset=null or data.blend=\[\] "
                                              r"drops the others\)$"):
            check_run(compose_run(overrides))
    for alone in ([blend], ["+data.hf_dataset=wikitext"], ["data.path=/corpora/b.txt"]):
        try:
            check_run(compose_run(alone))
        except DifflmError as err:  # later checks may read the files; the corpus count is not what refuses
            assert "both name the training corpus" not in str(err)


@pytest.mark.parametrize("key, value", [("logger.log_every", 0), ("train.max_skipped_steps", 0)])
def test_step_counts_below_one_are_refused(key, value):
    with pytest.raises(DifflmError, match=rf"^{key}={value} must be >= 1"):
        check_run(compose_run([f"{key}={value}"]))


@pytest.mark.parametrize("overrides,message", [
    (["train.epochs=2", "train.max_steps=50"], "train.epochs=2.0 and train.max_steps=50 both set the run's length (the "
     "epochs would replace the steps): set train.max_steps=null to train 2.0 epochs, or train.epochs=null to train "
     "50 steps"),
    (["experiment=data_constrained", "data.path=/books", "train.max_steps=100"], "train.epochs=16.0 and "
     "train.max_steps=100 both set the run's length"),
    (["train.max_steps=null"], "train.max_steps=null needs train.epochs (passes over the training windows) to set the "
     "run's length: set train.max_steps=<steps> or train.epochs=<passes>"),
    (["train.epochs=0"], "train.epochs=0.0 must be > 0"),
])
def test_max_steps_and_epochs_together_are_refused(overrides, message):
    """train.epochs used to replace an explicit train.max_steps without a word."""
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(["device=cpu", *overrides]))
    assert str(err.value).startswith(message)


def test_epochs_set_the_length_in_place_of_a_null_or_default_max_steps(fast_cfg, capsys):
    """train.max_steps=null or its schema default (300, which cannot be told from an explicit 300) with train.epochs:
    the epochs set the length, and the run says so."""
    import math

    import torch

    from difflm.training.trainer import Trainer

    for extra, note in ((["train.max_steps=null"], ")"), ([], ", in place of the default train.max_steps=300)")):
        cfg = fast_cfg("train.epochs=1.5", "train.eval_every=0", "device=cpu", *extra)
        assert check_run(cfg).type == "cpu"
        trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
        windows = len(trainer.train_set)
        assert trainer.cfg.train.max_steps == math.ceil(1.5 * windows / 4) > 1  # global batch 4 (conftest FAST)
        assert (f"difflm: train.epochs=1.5 sets train.max_steps={trainer.cfg.train.max_steps} ({windows} training "
                f"windows per epoch / train.global_batch_size=4{note}") in capsys.readouterr().out.splitlines()
    with pytest.raises(DifflmError, match=r"^train.epochs=1.5 and train.max_steps=7 both set"):  # without check_run
        Trainer(fast_cfg("train.epochs=1.5", "train.max_steps=7"), cfg.run.dir, torch.device("cpu"))


@pytest.mark.parametrize("extra", [[], ["objective=sft", "data.prompt_field=q", "data.response_field=a",
                                        "data.path=pairs.jsonl"],
                                   ["data.blend=[{path: a.txt, weight: 1}]"]], ids=["text", "sft", "blend"])
def test_evaluation_without_validation_windows_is_refused(extra):
    """data.valid_fraction=0 with train.eval_every > 0 used to train without a word and never evaluate (every data
    kind takes its validation windows from data.valid_fraction: text, shards, blends and SFT pairs)."""
    with pytest.raises(DifflmError) as err:
        check_run(compose_run(["device=cpu", "data.valid_fraction=0", "train.eval_every=25", *extra]))
    assert str(err.value) == ("data.valid_fraction=0 holds out no validation windows and train.eval_every=25 evaluates "
                              "on them: set train.eval_every=0 (no evaluation) or a positive data.valid_fraction "
                              "(e.g. 0.05)")
    check_run(compose_run(["device=cpu", "data.valid_fraction=0", "train.eval_every=0", *extra]))  # no evaluation


def test_a_tiny_valid_fraction_still_evaluates_one_window_and_zero_is_refused_by_the_trainer(fast_cfg, tmp_path):
    """A valid_fraction far below one window at this seq_len holds out one window (never an empty split that would
    skip evaluation); a Trainer built without check_run refuses valid_fraction=0 before reading the data."""
    import math

    import torch

    from difflm.training.trainer import Trainer

    cfg = fast_cfg("data.valid_fraction=1e-9", "train.max_steps=1", "train.eval_every=1", "train.save_every=0",
                   "device=cpu")
    check_run(cfg)
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    assert len(trainer.valid_set) == 1 and len(trainer.train_set) > 1000
    metrics = trainer.fit()
    assert metrics["step"] == 1 and math.isfinite(metrics["val_nelbo"]) and metrics["val_nelbo"] > 0
    with pytest.raises(DifflmError, match=r"^data.valid_fraction=0 holds out no validation windows and "
                                          r"train.eval_every=100 evaluates on them"):
        Trainer(fast_cfg("data.valid_fraction=0", f"data.cache_dir={tmp_path / 'unread'}"), cfg.run.dir,
                torch.device("cpu"))
    assert not (tmp_path / "unread").exists()  # refused before any tokenization


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_errors_name_the_recipe_or_preset_that_set_a_value(train_lines):
    """``experiment=megadlm_1.7b model=tiny``: num_kv_heads=16 comes from the recipe and num_heads=4 from the tiny
    preset; the error said neither. Sources come from Hydra's defaults list; a key typed on the command line is the
    user's own and is not annotated."""
    from hydra import initialize_config_dir

    import difflm.config
    from difflm.config.provenance import key_sources, name_sources
    message = "model.num_kv_heads=16 does not divide model.num_heads=4: pick a divisor"
    with initialize_config_dir(str(difflm.config.CONF_DIR), version_base="1.3"):
        sources = key_sources("train", ["experiment=megadlm_1.7b", "model=tiny"])
        assert sources["model.num_kv_heads"] == "experiment/megadlm_1.7b"
        assert sources["model.num_heads"] == "model/tiny" and sources["optim.lr"] == "experiment/megadlm_1.7b"
        assert "train.max_steps" not in key_sources("train", ["experiment=megadlm_1.7b", "train.max_steps=3"])
        typed = key_sources("train", ["experiment=megadlm_1.7b", "model=tiny", "model.num_kv_heads=16"])
        assert "model.num_kv_heads" not in typed and typed["model.num_heads"] == "model/tiny"
        assert key_sources("train", [])["model.num_heads"] == "model/tiny"  # the default preset is a file too
    assert name_sources(message, sources) == (
        f"{message} (model.num_kv_heads is set by experiment=megadlm_1.7b in conf/experiment/megadlm_1.7b.yaml; "
        "model.num_heads is set by model=tiny in conf/model/tiny.yaml: pass the key on the command line to change it)")
    assert "run.dir" not in sources
    assert name_sources("run.dir=x is not writable", sources) == "run.dir=x is not writable"
    _, res = train_lines["recipe"]
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "model.num_kv_heads is set by experiment=megadlm_1.7b in conf/experiment/megadlm_1.7b.yaml" in res.stderr
