"""The post-training loop of ``difflm-rl``: GRPO or DPO steps on a trained run, with the trainer's sinks,
checkpoints and exact resume.

It reads the trained run (``init.run_dir``: model, tokenizer, precision, objective) through
:func:`difflm.generate.load_run`, and writes its own run directory: ``metrics.jsonl`` (one dict per logged step, also
to the console and W&B), ``checkpoints/step_<n>`` (policy, optimizer, scheduler; the trained run's settings as the
checkpoint's ``config.yaml``, so difflm-generate / -eval / -export read an RL run like any other),
``reference.pt`` (the frozen reference, written once, whole tensors) and ``rl_config.yaml``. Randomness is keyed by
(train.seed, step): the prompts of a step, its rollouts' per-sample sampler seeds and its estimates' noise, so a
resumed run repeats the uninterrupted one without storing generator state.

Layouts (``parallel=``, launched with torchrun as difflm-train): data parallelism (FSDP2) and tensor parallelism,
with the mesh and :func:`difflm.parallel.parallelize.parallelize` of difflm-train (:mod:`difflm.posttrain.layout`:
how the step is split over ranks). Every rank loads the trained run whole and lays it out; rank 0 writes the run's
files and metrics.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from difflm.checkpoint.store import load_checkpoint, prune_checkpoints, read_settings, read_trainer_state, \
    resume_checkpoint, save_checkpoint, trained_settings
from difflm.config.schema import PosttrainDataConfig
from difflm.config.validate import check_logger, check_logger_keys, check_optim, check_schedule
from difflm.errors import DifflmError
from difflm.model.lora import apply_lora, check_lora, check_resume_lora, lora_enabled
from difflm.model.moe import moe_step, set_moe_balance_group, set_moe_loss_scale
from difflm.objectives.keyed_rng import check_seed
from difflm.parallel import distributed as pdist
from difflm.posttrain.data import answer_of, cut_notice, full_preference_ids, full_prompt_ids, prompt_text, \
    read_records, tokenize_preference, tokenize_prompt
from difflm.posttrain.forward import block_objective, estimator_logits_fn
from difflm.posttrain.layout import build_layout, check_rl_layout, full_logits, lay_out, sampling_view
from difflm.posttrain.loglik import build_estimator
from difflm.posttrain.reference import REFERENCES, build_reference
from difflm.posttrain.rewards import build_reward
from difflm.training.optimizer import build_optimizer
from difflm.training.precision import autocast_context
from difflm.training.run_config import check_steps_to_train, record_rl_config
from difflm.training.run_dir import set_aside_run_records
from difflm.training.schedule import build_scheduler, restore_scheduler
from difflm.training.sinks import ConsoleSink, JsonlSink, wandb_sinks

ALGORITHMS = ("grpo", "dpo")
GRPO_FIELDS = ("prompt_field", "answer_field")
LOSS_NORMS = ("token", "sequence")
DPO_FIELDS = ("prompt_field", "chosen_field", "rejected_field")


def check_rl_config(cfg) -> None:
    """Cross-key checks of a difflm-rl config (DifflmError naming the key and the fix)."""
    a = cfg.algorithm
    if a.name not in ALGORITHMS:
        raise DifflmError(f"algorithm={a.name!r} is unknown: choose one of {', '.join(ALGORITHMS)}")
    if a.prompts_per_step < 1:
        raise DifflmError(f"algorithm.prompts_per_step={a.prompts_per_step} must be >= 1")
    if a.name == "grpo":
        if a.group_size < 2:
            raise DifflmError(f"algorithm.group_size={a.group_size} must be >= 2 (advantages compare a group)")
        if a.num_inner < 1:
            raise DifflmError(f"algorithm.num_inner={a.num_inner} must be >= 1")
        if a.beta > 0 and a.reference == "none":
            raise DifflmError(f"algorithm.beta={a.beta} needs a reference: set algorithm.reference=frozen_copy, "
                              "or algorithm.beta=0")
        if a.loss_norm not in LOSS_NORMS:
            raise DifflmError(f"algorithm.loss_norm={a.loss_norm!r} is not one of {', '.join(LOSS_NORMS)}")
        if not 0 <= a.clip_low < 1:
            raise DifflmError(f"algorithm.clip_low={a.clip_low} must be in [0, 1): the ratio is clipped to "
                              "[1 - clip_low, 1 + clip_high] (PPO: 0.2)")
        if not a.clip_high >= 0:
            raise DifflmError(f"algorithm.clip_high={a.clip_high} must be >= 0: the ratio is clipped to "
                              "[1 - clip_low, 1 + clip_high] (PPO: 0.2)")
    if a.beta < 0 or (a.name == "dpo" and a.beta == 0):
        raise DifflmError(f"algorithm.beta={a.beta} must be {'> 0' if a.name == 'dpo' else '>= 0'} (grpo: the KL "
                          "weight, 0 = none; dpo: the DPO temperature, whose 0 leaves the loss at log 2: e.g. 0.1)")
    if a.name == "dpo" and a.reference == "none":
        raise DifflmError("algorithm=dpo needs a reference: set algorithm.reference=frozen_copy")
    if a.reference not in REFERENCES:
        raise DifflmError(f"algorithm.reference={a.reference!r} is not one of {', '.join(REFERENCES)}")
    if cfg.train.max_steps < 1:
        raise DifflmError(f"train.max_steps={cfg.train.max_steps} must be >= 1")
    for key in ("save_every", "eval_every", "keep_last"):
        if cfg.train[key] < 0:
            raise DifflmError(f"train.{key}={cfg.train[key]} must be >= 0 (0 = never)" if key != "keep_last" else
                              f"train.keep_last={cfg.train.keep_last} must be >= 0 (0 = keep every checkpoint)")
    if cfg.data.path and cfg.data.hf_dataset:
        raise DifflmError(f"data.path={cfg.data.path!r} and data.hf_dataset={cfg.data.hf_dataset!r} both name the "
                          "records, and a run reads only one: keep one (data.path=null or data.hf_dataset=null drops "
                          "the other)")
    if "{prompt}" not in cfg.data.prompt_template:
        raise DifflmError(f"data.prompt_template={cfg.data.prompt_template!r} holds no {{prompt}}: every record's "
                          "prompt would be replaced by that text; put {prompt} where the record's prompt goes, e.g. "
                          "'Question: {prompt} Answer:'")
    for key in ("max_prompt_tokens", "max_response_tokens"):
        if cfg.data[key] < 1:
            raise DifflmError(f"data.{key}={cfg.data[key]} must be >= 1 (the tokens kept)")
    if cfg.data.eval_records < 0:
        raise DifflmError(f"data.eval_records={cfg.data.eval_records} must be >= 0 (0 = no held-out evaluation)")
    check_optim(cfg.optim)
    check_schedule(cfg.schedule)
    check_logger_keys(cfg.logger)
    check_logger(cfg.logger)  # wandb importable, its server reachable: before the trained run is read
    check_seed(cfg.train.seed, "train.seed")
    if a.name == "grpo":  # a rollout setting the others leave unread (greedy top_k, ReMDM without remdm)
        from difflm.sampling.options import check_read_settings

        check_read_settings(cfg.gen, cfg.gen.keys())
        check_seed(cfg.gen.seed, "gen.seed", generator_only=True)
        # a greedy token choice (temperature 0, or top-k of 1) with a deterministic unmasking order
        greedy = "gen.temperature=0" if float(cfg.gen.temperature) == 0 else \
            "gen.top_k=1" if int(cfg.gen.get("top_k", 0) or 0) == 1 else None
        if greedy is not None and cfg.gen.remasking != "random":
            fix = "set gen.temperature>0 (d1, DiffuCoder: 1.0)" if greedy == "gen.temperature=0" else \
                "set gen.top_k=0 (off) or above 1"
            raise DifflmError(f"{greedy} with algorithm=grpo: the {a.group_size} completions of a prompt are "
                              f"one greedy decode (gen.remasking={cfg.gen.remasking} draws no noise), so every "
                              f"advantage is 0 and nothing trains: {fix} or gen.remasking=random (the held-out "
                              "eval_reward decodes greedily either way)")
    if a.name == "dpo" and cfg.data.chosen_field == cfg.data.rejected_field:
        raise DifflmError(f"data.chosen_field and data.rejected_field are both {cfg.data.chosen_field!r}: every pair "
                          "would hold one response twice (loss log 2, no gradient); point data.rejected_field at the "
                          "records' rejected response")
    # the record fields of the other algorithm would be read by nobody: say so rather than ignore them
    if a.name == "dpo" and cfg.data.answer_field is not None:
        raise DifflmError(f"data.answer_field={cfg.data.answer_field!r} is a grpo key (the reward's reference answer); "
                          "algorithm=dpo does not use it: drop it")
    if a.name == "grpo":
        for key in ("chosen_field", "rejected_field"):
            if cfg.data[key] != getattr(PosttrainDataConfig, key):
                raise DifflmError(f"data.{key}={cfg.data[key]!r} is a dpo key; algorithm=grpo does not use it: drop "
                                  "it (or set algorithm=dpo)")
    if a.name == "grpo" and cfg.data.answer_field is None and (needs := build_reward(cfg.reward).needs_answer()):
        raise DifflmError(f"reward term {needs[0]} compares completions with the reference answer and "
                          "data.answer_field is null: set data.answer_field (GSM8K: data.answer_field=answer)")


def reference_in_use(algorithm) -> str:
    """The reference the run builds (``algorithm.reference``), ``none`` for GRPO with ``algorithm.beta=0``: without
    the KL term no reference is read, so no frozen copy is held, saved or laid out."""
    if algorithm.name == "grpo" and algorithm.beta == 0:
        return "none"
    return str(algorithm.reference)


def with_rl_lora(cfg, init_cfg):
    """The init run's settings ``init_cfg`` with the adapters difflm-rl adds (``lora=attn|attn_mlp`` on a full
    run: :func:`difflm.model.lora.apply_lora` after the init weights load, before the layout); ``init_cfg`` itself
    when ``lora`` is off. What the RL run's checkpoints carry as their ``config.yaml``, so difflm-generate / -export
    add the adapters and read them with the base from the checkpoint (``lora_whole``).

    Raises: DifflmError for ``lora`` on a LoRA init run (its adapters already train) or bad ``lora`` keys."""
    lora = cfg.get("lora")
    if not lora_enabled(lora):
        if lora is not None and int(lora.get("rank", 0) or 0) < 0:
            check_lora(lora, init_cfg.model)  # refuses a negative rank (0 is "off")
        return init_cfg
    own = init_cfg.get("lora")
    if lora_enabled(own):
        given = f"lora={lora.name}" if lora.name != "none" else f"lora.rank={lora.rank}"
        raise DifflmError(f"{given} with init.run_dir={cfg.init.run_dir}, a LoRA run (lora.rank={own.rank}): "
                          "difflm-rl trains that run's adapters; drop lora=... and lora.*, or post-train its "
                          "difflm-export merged model")
    check_lora(lora, init_cfg.model)
    return OmegaConf.merge(init_cfg, {"lora": OmegaConf.to_container(lora, resolve=True)})


def check_resume_init(run_dir: Path, cfg) -> None:
    """Refuse resuming ``run_dir`` from another ``init.run_dir`` than the one its ``rl_config.yaml`` names (while
    that one still exists): the checkpoints and ``reference.pt`` hold that run's model, whose shape, tokenizer and
    objective the new one need not share; and with other adapter shapes (``lora.rank``, ``targets``, ``moe``) than
    it names (:func:`difflm.model.lora.check_resume_lora`). DifflmError naming the key and the fix."""
    import os

    path = Path(run_dir) / "rl_config.yaml"
    if not path.is_file():
        return
    recorded = read_settings(path)
    old = OmegaConf.select(recorded, "init.run_dir", default=None)
    new = str(cfg.init.run_dir)
    if old and old != new and Path(old).is_dir() and not os.path.samefile(old, new):
        raise DifflmError(f"init.run_dir={new}: run.dir={run_dir} was started from init.run_dir={old} (its "
                          f"rl_config.yaml), whose model its checkpoints hold: pass init.run_dir={old} to resume it, "
                          "or start a new run.dir")
    # fresh adapters on a full init run (lora=...): its checkpoints and reference.pt hold adapters of those shapes
    check_resume_lora(recorded.get("lora"), cfg.get("lora"), f"run.dir={run_dir} (its rl_config.yaml)")


class PostTrainer:
    """Builds the policy, reference, estimator, reward, data and optimizer from an ``rl`` config, then runs
    :meth:`fit` (module docstring). ``adapters_disabled``: the LoRA converter's context manager for
    ``algorithm.reference=adapters_off`` (default: imported from ``difflm.model.lora``)."""

    def __init__(self, cfg, device: torch.device, adapters_disabled=None):
        from difflm.generate import load_run

        init_keys = ("init.run_dir", "init.step")
        fields = GRPO_FIELDS if cfg.algorithm.name == "grpo" else DPO_FIELDS
        try:  # the checks every rank runs alike on the same config and files, before any process group exists
            check_rl_config(cfg)
            reward = build_reward(cfg.reward) if cfg.algorithm.name == "grpo" else None
            records = read_records(cfg.data, fields)
            init_settings = with_rl_lora(cfg, trained_settings(cfg.init.run_dir, cfg.init.step, init_keys)[0])
            if init_settings.objective.name == "ar":
                raise DifflmError(f"init.run_dir={cfg.init.run_dir} is an objective=ar run: difflm-rl post-trains "
                                  "masked-diffusion models (mdlm, sft, bd3lm)")
            check_rl_layout(cfg, init_settings, pdist.world_size_from_env())
        except DifflmError:
            if pdist.launch_env()["rank"] != 0:  # every rank failed the same check: rank 0 says it once
                raise SystemExit(2) from None
            raise
        self.cfg = cfg
        self.reward = reward
        self._reports: list[str] = []
        self.layout, device = build_layout(cfg, init_settings, device)
        self.device = device
        self.is_rank0 = pdist.is_rank0()
        self.run_dir = Path(pdist.agree_run_dir(cfg.run.dir))
        if self.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.init_cfg, model, self.tok, self.init_step = load_run(cfg.init.run_dir, cfg.init.step, device,
                                                                  keys=init_keys)
        if lora_enabled(cfg.get("lora")):  # fresh adapters (B = 0: the init model's outputs) on a full run
            self.init_cfg = with_rl_lora(cfg, self.init_cfg)
            apply_lora(model, self.init_cfg.lora, seed=int(cfg.train.seed))
        self._resolve_chat_template()
        self._check_gen(model)
        model.train()
        self.precision = self.init_cfg.precision.name
        self.autocast = lambda: autocast_context(self.precision, device)
        self.estimator = build_estimator(cfg.estimator)
        self.blocks = block_objective(self.init_cfg.objective, self.tok.mask_id)  # None unless bd3lm
        n_eval = cfg.data.eval_records
        self.eval_records, self.train_records = records[:n_eval], records[n_eval:]
        self._check_lengths(records)
        self.step = 0
        ref_path = self.run_dir / "reference.pt"
        # a frozen copy is taken and saved / restored whole, before the layout: reference.pt is layout-free
        reference = reference_in_use(cfg.algorithm)
        frozen = reference == "frozen_copy"
        self.reference = build_reference("frozen_copy", model) if frozen else None
        found = resume_checkpoint(self.run_dir, report=print if self.is_rank0 else (lambda _: None))
        # a run that saved no checkpoint may have left its records: this run starts afresh, so it must not append to
        # that run's metrics.jsonl; rank 0 moves them (as difflm-train does), before anything is written here
        if found is None and self.is_rank0 and (kept := set_aside_run_records(self.run_dir)) is not None:
            self.report(f"difflm: run.dir={self.run_dir} has no checkpoint to resume from but holds an earlier run's "
                        f"records: moved them to {kept}; this run starts afresh")
        if found is not None:
            check_resume_init(self.run_dir, cfg)
            check_steps_to_train(found[0], cfg, found[1], self.run_dir / "rl_config.yaml")
            self._check_resume_lora(found[1])
        if self.reference is not None:
            if found is not None and ref_path.exists():
                self.reference.load_state_dict(torch.load(ref_path, map_location=device, weights_only=True))
            elif found is None and self.is_rank0:
                torch.save(self.reference.state_dict(), ref_path)
            self.reference.model = lay_out(self.reference.model, self.layout, cfg, self.init_cfg, device)
        self.model = lay_out(model, self.layout, cfg, self.init_cfg, device)
        # MoE layers (none: no-ops): each data-parallel rank's auxiliary losses weigh 1 / dp, so the summed gradients
        # hold their mean, and model.moe.balance_over=global_batch counts the experts' tokens over those ranks
        set_moe_loss_scale([self.model], 1.0 / self.layout.dp)
        set_moe_balance_group([self.model], self.layout.dp_group)
        if not frozen:
            self.reference = build_reference(reference, self.model, adapters_disabled)
        self.optimizer = build_optimizer(self.model, cfg.optim, device)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, cfg.train.max_steps)
        if found is not None:
            state = load_checkpoint(found[1], self.model, self.optimizer)
            restore_scheduler(self.scheduler, state["scheduler"])  # its position; optim.lr and schedule.* are the run's
            self.step = int(state["step"])
            if state.get("seed") != cfg.train.seed:
                raise DifflmError(f"train.seed={cfg.train.seed} differs from the resumed run's {state.get('seed')}: "
                                  "keep the run's seed to resume it exactly")
        if self.is_rank0:
            record_rl_config(self.run_dir, cfg, self.step if found is not None else None, report=self.report)
            if not (self.run_dir / "config.yaml").exists():  # the model's settings: difflm-generate reads the run
                (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.init_cfg))

    def _resolve_chat_template(self) -> None:
        """``data.chat_template``: null takes the init run's (:func:`difflm.generate.run_chat_template`), so the
        rollouts and scores see prompts as that run's SFT saw them. A value that differs from an ``objective=sft``
        init run's goes into the RL run's ``config.yaml`` (difflm-generate / -eval then prompt as the RL run trained);
        ``true`` on another objective, which that file cannot express, is reported."""
        from difflm.generate import run_chat_template

        data, own = self.cfg.data, run_chat_template(self.init_cfg)
        if data.get("chat_template") is None:
            data.chat_template = own
        elif bool(data.chat_template) != own:
            if self.init_cfg.objective.name == "sft":
                self.init_cfg = OmegaConf.merge(self.init_cfg, {"data": {"chat_template": bool(data.chat_template)}})
            else:
                self.report(f"difflm: notice: data.chat_template=true on an objective={self.init_cfg.objective.name} "
                            "init run: difflm-generate and difflm-eval of this run read raw prompts unless given "
                            "chat_template=true")

    def _check_gen(self, model) -> None:
        """The rollout sampler's ``gen.*``: ``gen.block_length=null`` resolved to the init run's block size (a
        ``bd3lm`` run's ``objective.block_size``, else the largest divisor of ``gen.length`` up to
        :data:`difflm.config.schema.RL_BLOCK_LENGTH`) and ``gen.steps=null`` to ``min(RL_STEPS, gen.length)``
        rounded down to a multiple of the blocks (values given are kept as given:
        :func:`difflm.sampling.options.resolve_block_length` and :func:`~difflm.sampling.options.resolve_steps`,
        the rules difflm-generate follows with 64 for 32), so ``rl_config.yaml`` records what the rollouts decode
        in; then (grpo) checked before anything runs as difflm-generate checks them
        (:func:`difflm.generate.generation_options`): a ``bd3lm`` init run samples only in its own blocks, and
        another ``gen.block_length`` is refused in one line."""
        from difflm.config.schema import RL_BLOCK_LENGTH, RL_STEPS
        from difflm.generate import generation_options
        from difflm.sampling.options import resolve_block_length, resolve_steps, run_block_size

        obj, gen = self.init_cfg.objective, self.cfg.gen
        size = run_block_size(obj)
        gen.block_length = resolve_block_length(gen.get("block_length"), size, RL_BLOCK_LENGTH, length=gen.length)
        gen.steps = resolve_steps(gen.get("steps"), gen.length, gen.block_length if size is None else None, RL_STEPS)
        if self.cfg.algorithm.name == "grpo":
            generation_options(model, self.tok, gen, objective=obj)

    def _check_resume_lora(self, path: Path) -> None:
        """Refuse resuming ``path`` with other adapters than it holds: ``lora=...`` given or dropped against the run's
        first start on a full init run (DifflmError naming the key and the fix)."""
        held, wanted = bool(read_trainer_state(path).get("lora_whole")), lora_enabled(self.init_cfg.get("lora"))
        if held != wanted:
            fix = "drop lora=..." if wanted else "pass the lora=... (and lora.*) it was started with"
            raise DifflmError(f"run.dir={self.run_dir}: checkpoint {path.name} holds {'' if held else 'no '}LoRA "
                              f"adapters and lora.rank={int(self.cfg.lora.rank)} here: {fix} to resume it")

    # ------------------------------------------------------------------ layout
    def _modules(self) -> list:
        """The laid-out modules the run calls: the policy and a frozen copy's model."""
        ref = getattr(self.reference, "model", None)
        return [self.model] + ([ref] if ref is not None else [])

    def full_logits(self):
        """Context: full-vocabulary logits from the policy and the reference (:func:`difflm.posttrain.layout.
        full_logits`), what the estimators read."""
        return full_logits(self._modules())

    @contextlib.contextmanager
    def whole_models(self):
        """Context: the policy and the reference all-gathered and whole, with full logits (:func:`difflm.posttrain.
        layout.sampling_view`): for rollouts and evaluations, whose number of model calls may differ between
        ranks. Collective on entry."""
        reshard = bool(self.cfg.parallel.get("reshard_after_forward", True))
        with sampling_view(self._modules(), reshard):
            yield

    def logits_fn(self, model, valid: torch.Tensor):
        """The estimators' forward of ``model`` (the policy or the reference) over rows laid out as ``valid`` [B, S]
        bool, in the init run's layout (:func:`difflm.posttrain.forward.estimator_logits_fn`: BD3-LM's
        ``[x_t ; x_0]`` forward on a bd3lm run), under the run's autocast."""
        return estimator_logits_fn(model, valid, self.autocast, self.blocks)

    # ------------------------------------------------------------------ data
    def prompt_ids(self, record: dict) -> list[int]:
        return tokenize_prompt(self.tok, self.cfg.data, record)

    def prompt_text(self, record: dict) -> str:
        return prompt_text(self.cfg.data, record)

    def answer(self, record: dict) -> Optional[str]:
        return answer_of(record)

    def preference_ids(self, record: dict):
        return tokenize_preference(self.tok, self.cfg.data, record)

    def records_of_step(self, step: int) -> tuple[list[dict], list[int]]:
        """The training records of ``step`` and their ids: epoch-wise permutations keyed by (seed, epoch)."""
        n, k = len(self.train_records), self.cfg.algorithm.prompts_per_step
        ids = []
        for j in range(step * k, step * k + k):
            epoch, pos = divmod(j, n)
            ids.append(int(np.random.default_rng([self.cfg.train.seed, epoch]).permutation(n)[pos]))
        return [self.train_records[i] for i in ids], ids

    def _check_lengths(self, records: list[dict]) -> None:
        """A notice of the records ``data.max_prompt_tokens`` / ``data.max_response_tokens`` cut
        (:func:`difflm.posttrain.data.cut_notice`), and one warning (as difflm-generate's) when the longest prompt and
        ``gen.length`` (grpo), or prompt and response (dpo), as cut, need more positions than the init run's
        ``data.seq_len``: positions its model never saw."""
        grpo, seq_len = self.cfg.algorithm.name == "grpo", int(self.init_cfg.data.seq_len)
        d = self.cfg.data
        if grpo:
            full = [len(full_prompt_ids(self.tok, d, r)) for r in records]
            notice = cut_notice(d, full)
            prompt, length = min(max(full), int(d.max_prompt_tokens)), int(self.cfg.gen.length)
        else:
            full = [tuple(map(len, full_preference_ids(self.tok, d, r))) for r in records]
            notice = cut_notice(d, [p for p, _, _ in full], [n for _, c, r in full for n in (c, r)])
            prompt, length = max(((min(p, int(d.max_prompt_tokens)), min(max(c, r), int(d.max_response_tokens)))
                                  for p, c, r in full), key=sum)
        if notice:
            self.report(notice)
        if prompt + length > seq_len:
            what = f"gen.length={length}" if grpo else f"the longest response ({length} tokens)"
            self.report(f"difflm: warning: the longest prompt ({prompt} tokens) and {what} make {prompt + length} "
                        f"positions, more than the data.seq_len={seq_len} init.run_dir was trained on: expect poor "
                        f"{'rollouts' if grpo else 'likelihoods'}; lower data.max_prompt_tokens or "
                        f"{'gen.length' if grpo else 'data.max_response_tokens'}")

    # ------------------------------------------------------------------ updates
    def update(self, loss: torch.Tensor) -> float:
        """One optimizer update from ``loss``: backward, the MoE layers' end of step (:func:`difflm.model.moe.moe_step`,
        as difflm-train's: the update's expert counts summed over the data-parallel ranks, the aux-loss-free bias
        moved, the counters zeroed), gradient clipping (``optim.grad_clip``), step. Returns the gradient norm before
        clipping (a non-finite norm skips the update)."""
        from difflm.parallel.parallelize import grad_norm_and_clip

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        moe_step([self.model], self.layout.dp_group)
        clip = self.cfg.optim.grad_clip
        # the global norm of sharded (DTensor) and plain gradients alike, clipped as torch's clip_grad_norm_
        norm = grad_norm_and_clip(self.model.parameters(), clip if clip > 0 else float("inf"))
        if torch.isfinite(norm):
            self.optimizer.step()
        else:
            # self.step still counts the steps before this update; the log numbers this one self.step + 1
            self.report(f"difflm: step {self.step + 1}: non-finite gradient norm, update skipped")
        return float(norm)

    def report(self, message: str, every_rank: bool = False) -> None:
        """Print a notice or warning: on rank 0 only (the same line on every rank), or with ``every_rank`` on each
        rank (a line about that rank's own share of the step, e.g. its reward failures)."""
        self._reports.append(message)
        if every_rank or self.is_rank0:
            print(message, flush=True)

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> dict:
        """Held-out figure: ``eval_reward`` (grpo, greedy completions) or ``eval_elbo_margin`` (dpo)."""
        if not self.eval_records:
            return {}
        if self.cfg.algorithm.name == "grpo":
            from difflm.posttrain.grpo_step import held_out_reward

            return {"eval_reward": held_out_reward(self, self.eval_records)}
        from difflm.posttrain.dpo_step import held_out_margin

        return {"eval_elbo_margin": held_out_margin(self, self.eval_records)}

    def save(self) -> Path:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "seed": self.cfg.train.seed}
        if lora_enabled(self.init_cfg.get("lora")):  # the base and the adapters, both written here
            state["lora_whole"] = True
        path = save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state,
                               config=OmegaConf.to_yaml(self.init_cfg))  # collective: every rank writes its shards
        if self.cfg.train.keep_last > 0:
            prune_checkpoints(self.run_dir, self.cfg.train.keep_last, 0)
        return path

    def fit(self) -> dict:
        """Steps until ``train.max_steps``; evaluates at the start, every ``train.eval_every`` steps and at the end;
        saves every ``train.save_every`` steps and at the end. Returns the last metrics dict."""
        from difflm.posttrain.dpo_step import dpo_step
        from difflm.posttrain.grpo_step import grpo_step

        t, lg = self.cfg.train, self.cfg.logger
        sinks = [ConsoleSink(t.max_steps, self.step, lg.progress_bar),
                 JsonlSink(self.run_dir, self.cfg.algorithm.name)] if self.is_rank0 else []
        if self.is_rank0:
            sinks += wandb_sinks(lg, self.run_dir, self.cfg, resume=self.step > 0, report=self.report)
        last: dict = {}
        failed = True  # until the last step is through (W&B records the outcome)
        try:
            if self.step == 0:
                last = {"step": 0, **self.evaluate()}
                for s in sinks:
                    s.log(last)
            while self.step < t.max_steps:
                records, ids = self.records_of_step(self.step)
                lr = self.scheduler.get_last_lr()[0]  # the learning rate of this step's updates
                if self.cfg.algorithm.name == "grpo":
                    metrics = grpo_step(self, self.step, records)
                else:
                    metrics = dpo_step(self, self.step, records, ids)
                self.scheduler.step()
                self.step += 1
                metrics = {"step": self.step, "lr": lr, **metrics}
                if not math.isfinite(metrics["loss"]):
                    self.report(f"difflm: step {self.step}: non-finite loss {metrics['loss']}")
                if (t.eval_every > 0 and self.step % t.eval_every == 0) or self.step == t.max_steps:
                    metrics.update(self.evaluate())
                if self.step % max(lg.log_every, 1) == 0 or self.step == t.max_steps or "eval_reward" in metrics \
                        or "eval_elbo_margin" in metrics:
                    for s in sinks:
                        s.log(metrics)
                if (t.save_every > 0 and self.step % t.save_every == 0) or self.step == t.max_steps:
                    self.save()
                last = metrics
            failed = False
        finally:
            for s in sinks:
                s.close(failed=failed)
        return last


__all__ = ["ALGORITHMS", "PostTrainer", "check_resume_init", "check_rl_config", "with_rl_lora"]
