#!/usr/bin/env python3
"""GRPO steps per hour of difflm-rl against dllm's ``DiffuGRPOTrainer`` (TRL) on the same exported model.

    PYTHONPATH=. python scripts/rl_vs_dllm.py --dllm-path /tmp/dllm --dllm-site /tmp/dllm_site            # CPU smoke
    PYTHONPATH=. python scripts/rl_vs_dllm.py --model 125m --dllm-path D --dllm-site S --prompts 4 --group 8 \\
        --gen-length 256 --gen-steps 256 --block-length 32 --prompt-tokens 64 --steps 4               # one H200

One call, one device, one process at a time:

1. builds a randomly initialised difflm run of ``--model`` (``model=<name>``, ``model.backend=<--backend>``; BF16
   autocast on CUDA, FP32 on CPU),
   saves it as step 0 and exports it with ``difflm-export`` (:func:`difflm.interop.export.export_checkpoint`) to
   ``<work>/hf``;
2. runs ``--steps`` GRPO steps of ``python -m difflm.rl`` on that run (the weights the export holds);
3. runs the same number of GRPO steps of dllm's ``DiffuGRPOTrainer`` on ``<work>/hf`` in a subprocess whose
   ``PYTHONPATH`` is ``--dllm-site`` (TRL 0.19.1, transformers 4.57, ... : docs/post_training.md) then
   ``--dllm-path`` (a dllm checkout), loading the export through its own modeling file (``trust_remote_code``);
4. prints steps/hour, rollout tokens/s and the ratio, and writes ``--json`` (default
   ``benchmarks/results/rl_vs_dllm_<model>_<device>.json``; with ``--skip-dllm``, which has no ratio,
   ``<work>/rl_vs_dllm.json``, so the stored comparison stays).

Matched (:class:`Matched`, one value handed to both): the prompts (GSM8K questions of exactly ``--prompt-tokens``
tokens, so neither side pads), prompts per step, group size, completion length, total sampler steps (LLaDA
low-confidence remasking, semi-autoregressive blocks of ``--block-length``, ``steps / blocks`` per block, no KV
cache on either side), sampling temperature, the log-likelihood estimator (d1's one-step estimate: completion fully
masked, prompt tokens masked with probability ``--prompt-mask-prob``; one forward), inner iterations (difflm
``algorithm.num_inner`` = TRL ``num_iterations``), the clipped objective (epsilon, beta, k3 KL, frozen reference
copy, token-mean loss, advantages without std scaling), full fine-tuning (no LoRA on either side), AdamW
(lr, betas 0.9/0.999, no weight decay, constant schedule, global-norm clip 1.0), precision (FP32 weights, BF16
autocast on CUDA), the reward (difflm's ``reward=gsm8k`` functions, loaded by file in the dllm process).
One RL step = one rollout batch + ``num_inner`` optimizer updates: one difflm-rl step, ``num_inner`` TRL global
steps.

Not matched exactly (see docs/post_training.md): the random streams (prompt order, Gumbel noise, estimator masks);
difflm never samples the mask token (dllm's sampler may);
difflm's step time is measured inside its step, dllm's from TRL's ``on_step_begin`` of the first to ``on_step_end``
of the last global step of an RL step (neither counts logging). The first RL step of each side is warm-up and
is left out of the medians.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: the dllm worker (this script too) keeps its own packages first
from difflm import script_cli  # noqa: E402  (standard library only: nothing of difflm's environment)
GSM8K_SHARED = [base / "shared" / "data" / "corpora" / "gsm8k" / "test.jsonl" for base in (ROOT, ROOT.parent)]


@dataclass(frozen=True)
class Matched:
    """The settings handed to both trainers (module docstring). ``check`` raises ValueError naming the flag."""

    prompts_per_step: int = 2
    group_size: int = 4
    prompt_tokens: int = 32
    gen_length: int = 32
    gen_steps: int = 32
    block_length: int = 16
    num_inner: int = 2
    temperature: float = 1.0
    prompt_mask_prob: float = 0.15
    beta: float = 0.04
    clip: float = 0.2
    lr: float = 1e-6
    seed: int = 0

    def check(self) -> "Matched":
        """These settings, or ValueError naming the flag to change."""
        if min(self.gen_length, self.gen_steps, self.block_length) < 1:
            raise ValueError("--gen-length, --gen-steps and --block-length must be >= 1")
        if self.lr <= 0 or self.temperature <= 0 or not 0 <= self.prompt_mask_prob <= 1:
            raise ValueError("--lr and --temperature must be > 0, --prompt-mask-prob within [0, 1]")
        if self.group_size < 2:
            raise ValueError(f"--group={self.group_size} must be >= 2 (advantages compare a group)")
        if min(self.prompts_per_step, self.prompt_tokens, self.num_inner) < 1:
            raise ValueError("--prompts, --prompt-tokens and --num-inner must be >= 1")
        if self.gen_length % self.block_length:
            raise ValueError(f"--gen-length={self.gen_length} must be a multiple of --block-length={self.block_length}")
        blocks = self.gen_length // self.block_length
        if self.gen_steps % blocks or self.gen_steps > self.gen_length:
            raise ValueError(f"--gen-steps={self.gen_steps} must be a multiple of the {blocks} blocks and at most "
                             f"--gen-length={self.gen_length} (both samplers then take gen_steps / blocks steps per "
                             "block, the same number of tokens each)")
        return self

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def difflm_overrides(self) -> list[str]:
        """``difflm-rl`` keys (conf/rl.yaml) for these settings."""
        return [f"algorithm.prompts_per_step={self.prompts_per_step}", f"algorithm.group_size={self.group_size}",
                f"algorithm.num_inner={self.num_inner}", f"algorithm.beta={self.beta}",
                f"algorithm.clip_low={self.clip}", f"algorithm.clip_high={self.clip}",
                "algorithm.loss_norm=token", "algorithm.scale_rewards=false", "algorithm.reference=frozen_copy",
                "estimator=one_step", f"estimator.prompt_mask_prob={self.prompt_mask_prob}",
                f"data.max_prompt_tokens={self.prompt_tokens}", "data.eval_records=0",
                f"gen.length={self.gen_length}", f"gen.steps={self.gen_steps}",
                f"gen.block_length={self.block_length}", f"gen.temperature={self.temperature}",
                "gen.remasking=low_confidence", "gen.cache=none", "gen.threshold=null", "gen.cfg_scale=0.0",
                f"optim.lr={self.lr}", "optim.weight_decay=0.0", "optim.beta1=0.9", "optim.beta2=0.999",
                "optim.grad_clip=1.0", "schedule.name=constant", "schedule.warmup_steps=0", f"train.seed={self.seed}"]

    def dllm_args(self) -> dict:
        """``DiffuGRPOConfig`` (TRL ``GRPOConfig``) keyword arguments for these settings: one generation batch of
        ``prompts x group`` completions per optimizer step (no gradient accumulation), reused ``num_iterations``
        times."""
        return dict(num_generations=self.group_size, per_device_train_batch_size=self.completions_per_step,
                    gradient_accumulation_steps=1, num_iterations=self.num_inner,
                    max_prompt_length=self.prompt_tokens, max_completion_length=self.gen_length,
                    steps=self.gen_steps, block_size=self.block_length, temperature=self.temperature,
                    remasking="low_confidence", cfg_scale=0.0, p_mask_prompt=self.prompt_mask_prob,
                    beta=self.beta, epsilon=self.clip, loss_type="bnpo", scale_rewards=False,
                    learning_rate=self.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
                    lr_scheduler_type="constant", warmup_steps=0, seed=self.seed)


def steady_median(values: list[float], warmup: int = 1) -> float:
    """Median of ``values`` after the first ``warmup`` (all of them when that would leave none)."""
    rest = values[warmup:] or values
    return statistics.median(rest)


def summarize(name: str, step_s: list[float], rollout_s: list[float], tokens_per_rollout: int) -> dict:
    """Per-side figures from per-RL-step wall times (seconds): medians after warm-up, steps/h, rollout tokens/s."""
    step, roll = steady_median(step_s), steady_median(rollout_s)
    return {"name": name, "step_s": step_s, "rollout_s": rollout_s, "median_step_s": step,
            "median_rollout_s": roll, "steps_per_h": 3600.0 / step, "rollout_tokens_per_s": tokens_per_rollout / roll,
            "update_s": step - roll}


# ------------------------------------------------------------------------------------------ difflm side
def gsm8k_prompts(tokenizer_encode, n_tokens: int, limit: int = 256) -> list[dict]:
    """GSM8K records (question, answer) whose question is at least ``n_tokens`` tokens: difflm keeps the last
    ``n_tokens`` (``data.max_prompt_tokens``), TRL the last ``max_prompt_length``, so no prompt is padded."""
    from difflm.posttrain.rewards.gsm8k import GSM8K_SAMPLE

    rows = []
    for path in (*GSM8K_SHARED, Path(GSM8K_SAMPLE)):  # the shared test split, else difflm's 32-row sample
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            break
    keep = [r for r in rows if len(tokenizer_encode(r["question"])) >= n_tokens][:limit]
    if len(keep) < 2:
        raise SystemExit(f"--prompt-tokens={n_tokens}: fewer than 2 GSM8K questions are that long; lower it")
    return keep


def build_and_export(model: str, work: Path, device, backend: str = "torch") -> tuple[Path, Path]:
    """A random-init difflm run of ``model`` (step 0, kernels ``model.backend=backend``) under ``work/run`` and its
    export ``work/hf``."""
    import torch
    from omegaconf import OmegaConf

    from difflm.checkpoint.store import save_checkpoint
    from difflm.config.compose import compose_train_config
    from difflm.data import build_tokenizer
    from difflm.interop.export import export_checkpoint
    from difflm.model import build_model, resolve_model_config

    run = work / "run"
    precision = "bf16" if device.type == "cuda" else "fp32"
    cfg = compose_train_config([f"model={model}", f"precision={precision}", f"model.backend={backend}",
                                f"run.dir={run}"], device=device)
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    resolve_model_config(cfg.model, tok.padded_vocab_size)
    net = build_model(cfg.model, causal=False, device=device, seed=0)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    save_checkpoint(run, 0, net, None, {"step": 0}, config=OmegaConf.to_yaml(cfg))
    del net
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf, _ = export_checkpoint(run, work / "hf", overwrite=True)
    return run, hf


def run_difflm(m: Matched, run: Path, prompts: Path, steps: int, work: Path, device, extra: tuple = (),
               name: str = "difflm-rl") -> dict:
    out = work / ("difflm_rl" + "_".join(x.replace("=", "-").replace(".", "-") for x in ("",) + tuple(extra)))
    cmd = [sys.executable, "-m", "difflm.rl", f"init.run_dir={run}", f"run.dir={out}", f"device={device.type}",
           f"data.path={prompts}", "data.prompt_field=question", "data.answer_field=answer", "reward=gsm8k",
           f"train.max_steps={steps}", "train.save_every=0", "train.eval_every=0", "logger.progress_bar=false",
           "logger.log_every=1", *m.difflm_overrides(), *extra]
    script_cli.run(cmd, check=True, env=script_cli.difflm_env())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) > 0 and "step_time_s" in r]
    return summarize(name, [r["step_time_s"] for r in rows], [r["rollout_time_s"] for r in rows],
                     m.completions_per_step * m.gen_length) | {
        "forwards_per_token": rows[-1]["forwards_per_token"], "reward_mean": [r["reward_mean"] for r in rows]}


# ------------------------------------------------------------------------------------------ dllm side
def probe_difference(run: Path, probe: list[int], dllm_logits: Path) -> float:
    """Max |difference| of difflm's logits (the run's checkpoint, FP32, CPU) and the exported model's in the dllm
    process (transformers 4.57, its modeling file) on the ``probe`` ids: 0 up to float rounding for the same model."""
    import torch

    from difflm.interop.export import load_run_for_export

    _, model, _, _ = load_run_for_export(run)
    with torch.no_grad():
        ours = model(torch.tensor([probe])).float()
    return float((ours - torch.load(dllm_logits).float()).abs().max())


def run_dllm(m: Matched, hf: Path, prompts: Path, steps: int, work: Path, args, probe: list[int]) -> dict:
    spec = {"matched": dataclasses.asdict(m), "hf": str(hf), "prompts": str(prompts), "steps": steps,
            "out": str(work / "dllm_result.json"), "output_dir": str(work / "dllm_out"), "probe": probe,
            "probe_out": str(work / "dllm_probe_logits.pt")}
    (work / "dllm_spec.json").write_text(json.dumps(spec))
    paths = [p for p in (args.dllm_site, args.dllm_path) if p]  # nothing of difflm's environment
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(Path(p).resolve()) for p in paths))
    env.setdefault("WANDB_DISABLED", "true")
    script_cli.run([sys.executable, str(Path(__file__).resolve()), "--dllm-worker", str(work / "dllm_spec.json")],
                   check=True, env=env, cwd=work)
    res = json.loads((work / "dllm_result.json").read_text())
    return summarize("dllm DiffuGRPOTrainer", res["step_s"], res["rollout_s"], m.completions_per_step * m.gen_length) \
        | {"forwards_per_token": res["forwards_per_token"], "versions": res["versions"],
           "reward_mean": res["reward_mean"]}


def gsm8k_reward_fn():
    """difflm's ``reward=gsm8k`` (answer match, weight 1, + ``#### <number>`` format, weight 0.1) with TRL's
    reward-function signature. The two reward modules (standard library only) are loaded from their files, so the
    dllm process runs the very same rule without importing difflm."""
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(f"_difflm_reward_{name}",
                                                      ROOT / "difflm" / "posttrain" / "rewards" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    gsm8k, fmt = load("gsm8k"), load("format")

    def gsm8k_reward(prompts, completions, answer, **_) -> list[float]:
        return [gsm8k.gsm8k_answer_match(p, c, a) + 0.1 * fmt.format_match(p, c, a)
                for p, c, a in zip(prompts, completions, answer)]

    return gsm8k_reward


def dllm_worker(spec_path: str) -> None:
    """Runs in the dllm environment (TRL 0.19, transformers 4.57): ``steps`` RL steps of DiffuGRPOTrainer."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, TrainerCallback

    from dllm.core.samplers import MDLMSampler, MDLMSamplerConfig
    from dllm.pipelines.rl import DiffuGRPOConfig, DiffuGRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    m = Matched(**spec["matched"])
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(spec["hf"])
    model = AutoModelForMaskedLM.from_pretrained(spec["hf"], trust_remote_code=True, dtype=torch.float32)
    model.config.use_cache = False
    # Adapter (dllm registers its own diffusion models the same way): TRL 0.19 loads the frozen reference with
    # AutoModelForCausalLM.from_pretrained(path) and no trust_remote_code, so register the export's classes (a
    # bidirectional network whatever the auto class: forward(input_ids, attention_mask) -> .logits is all dllm calls).
    AutoConfig.register(model.config.model_type, type(model.config), exist_ok=True)
    AutoModelForCausalLM.register(type(model.config), type(model), exist_ok=True)
    with torch.no_grad():  # the logits dllm's model gives, to compare with difflm's (same model?)
        probe = torch.tensor([spec["probe"]])
        torch.save(model(probe, attention_mask=torch.ones_like(probe)).logits, spec["probe_out"])
    records = [json.loads(x) for x in Path(spec["prompts"]).read_text().splitlines() if x.strip()]
    data = Dataset.from_list([{"prompt": r["question"], "answer": r["answer"]} for r in records])
    mu = m.num_inner
    cfg = DiffuGRPOConfig(output_dir=spec["output_dir"], max_steps=spec["steps"] * mu, logging_steps=1,
                          save_strategy="no", report_to=[], bf16=cuda, use_cpu=not cuda,
                          optim="adamw_torch_fused" if cuda else "adamw_torch", dataloader_num_workers=0,
                          log_completions=False, **m.dllm_args())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sampler = MDLMSampler(model=model, tokenizer=tok)
    rollout_s, forwards = [], [0]
    counting = [False]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + counting[0]))
    inner_sample = sampler.sample

    def timed_sample(*a, **kw):
        sync()
        t0, counting[0] = time.perf_counter(), True
        out = inner_sample(*a, **kw)
        sync()
        counting[0] = False
        rollout_s.append(time.perf_counter() - t0)
        return out

    sampler.sample = timed_sample

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.step_s, self.rewards = None, [], []

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % mu == 0:
                sync()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % mu == 0:
                sync()
                self.step_s.append(time.perf_counter() - self.t0)

    timer = StepTimer()
    trainer = DiffuGRPOTrainer(model=model, reward_funcs=[gsm8k_reward_fn()], args=cfg, train_dataset=data,
                               processing_class=tok, sampler=sampler,
                               sampler_config=MDLMSamplerConfig(steps=m.gen_steps, max_new_tokens=m.gen_length,
                                                                block_size=m.block_length,
                                                                temperature=m.temperature, cfg_scale=0.0,
                                                                remasking="low_confidence"),
                               callbacks=[timer])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]  # one per rollout
    n_roll = len(rollout_s)
    Path(spec["out"]).write_text(json.dumps({
        "step_s": timer.step_s, "rollout_s": rollout_s, "reward_mean": rewards,
        "forwards_per_token": forwards[0] / max(n_roll, 1) / m.gen_length,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}))


# ------------------------------------------------------------------------------------------ driver
MATCHED_HELP = {  # the --help of each Matched field's flag
    "prompts_per_step": "prompts per RL step", "group_size": "completions per prompt (GRPO's group, >= 2)",
    "prompt_tokens": "tokens of every prompt (GSM8K questions of exactly this length)",
    "gen_length": "tokens per completion", "gen_steps": "sampler steps per completion (a multiple of the blocks)",
    "block_length": "semi-autoregressive block of the sampler (divides --gen-length)",
    "num_inner": "optimizer updates per rollout (TRL num_iterations)", "temperature": "sampling temperature",
    "prompt_mask_prob": "the estimator's prompt masking probability", "beta": "KL coefficient (k3, frozen reference)",
    "clip": "PPO clip epsilon", "lr": "AdamW learning rate (constant)", "seed": "seed of both sides",
}


def result_path(args, device_type: str, work: Path) -> Path:
    """Where the result is written: ``--json``; else benchmarks/results/rl_vs_dllm_<model>_<device>.json for a
    comparison, and ``<work>/rl_vs_dllm.json`` for ``--skip-dllm`` (difflm's side alone must not replace a stored
    comparison)."""
    if args.json:
        return Path(args.json)
    if args.skip_dllm:
        return work / "rl_vs_dllm.json"
    return ROOT / "benchmarks" / "results" / f"rl_vs_dllm_{args.model}_{device_type}.json"


@script_cli.script_main
def main(argv=None) -> None:
    """Build and export the model, run both trainers, print steps/hour and their ratio, write ``--json``."""
    p = script_cli.parser(__file__, __doc__)
    p.add_argument("--dllm-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", choices=sorted(f.stem for f in (ROOT / "conf" / "model").glob("*.yaml")),
                   metavar="PRESET", help="difflm model preset (conf/model): tiny, 125m, 1.7b, ...")
    p.add_argument("--dllm-path", type=script_cli.existing_path("folder", "a dllm checkout"), default=None,
                   help="a dllm checkout (the folder holding the dllm package)")
    p.add_argument("--dllm-site", type=script_cli.existing_path("folder", "a pip --target folder"), default=None,
                   help="a pip --target folder with TRL 0.19.1, transformers 4.57, ...")
    p.add_argument("--steps", type=int, default=3, help="RL steps per side (the first is warm-up)")
    p.add_argument("--backend", default="torch", choices=["torch", "auto", "te"],
                   help="difflm's kernels (model.backend): torch (default; PyTorch + SDPA like the export's modeling "
                        "file that dllm runs), auto or te")
    d = Matched()
    for f in dataclasses.fields(Matched):
        flag = {"prompts_per_step": "prompts", "group_size": "group"}.get(f.name, f.name).replace("_", "-")
        p.add_argument(f"--{flag}", dest=f.name, type=type(getattr(d, f.name)), default=getattr(d, f.name),
                       help=f"{MATCHED_HELP[f.name]} (default {getattr(d, f.name)})")
    p.add_argument("--work", type=script_cli.caller_path, default=None,
                   help="scratch folder (default: a new temporary one)")
    p.add_argument("--skip-dllm", action="store_true", help="difflm side only (no dllm environment)")
    p.add_argument("--difflm-extra", action="append", default=[], metavar="KEYS",
                   help="an extra difflm-rl row with these space-separated keys on top of the matched ones, e.g. "
                        "'gen.cache=dual' or 'gen.threshold=0.9': printed and saved, never in the headline ratio")
    p.add_argument("--json", type=script_cli.output_file, default=None,
                   help="write the result here (default benchmarks/results/rl_vs_dllm_<model>_<device>.json; "
                        "with --skip-dllm <work>/rl_vs_dllm.json)")
    args = p.parse_args(argv)
    if args.dllm_worker:
        return dllm_worker(args.dllm_worker)
    try:
        m = Matched(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Matched)}).check()
    except ValueError as e:
        p.error(str(e))
    if args.steps < 2:
        p.error(f"--steps={args.steps} must be >= 2 (the first RL step is warm-up)")
    if not args.skip_dllm and not args.dllm_path:
        p.error("--dllm-path is required (a dllm checkout), or --skip-dllm")

    import tempfile

    import torch

    from difflm.data import build_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work or tempfile.mkdtemp(prefix="rl_vs_dllm_"))
    work.mkdir(parents=True, exist_ok=True)
    run, hf = build_and_export(args.model, work, device, args.backend)
    from omegaconf import OmegaConf

    tcfg = OmegaConf.load(run / "config.yaml")
    tok = build_tokenizer(tcfg.data.tokenizer, tcfg.model.vocab_multiple)
    records = gsm8k_prompts(tok.encode, m.prompt_tokens)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                               for r in records))
    rows = [run_difflm(m, run, prompts, args.steps, work, device)]
    if not args.skip_dllm:
        probe = tok.encode(records[0]["question"])[:16]
        rows.append(run_dllm(m, hf, prompts, args.steps, work, args, probe))
        same_model = probe_difference(run, probe, work / "dllm_probe_logits.pt")
    for extra in args.difflm_extra:
        rows.append(run_difflm(m, run, prompts, args.steps, work, device, tuple(extra.split()),
                               name=f"difflm-rl + {extra}") | {"unmatched": extra})
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.model} on {dev}: {m.completions_per_step} completions/step ({m.prompts_per_step} prompts x "
          f"{m.group_size}), {m.gen_length} tokens, {m.gen_steps} sampler steps, blocks of {m.block_length}, "
          f"{m.num_inner} inner updates")
    for r in rows:
        print(f"  {r['name']:<24} step {r['median_step_s']:8.3f} s  ({r['steps_per_h']:9.1f} steps/h)  rollout "
              f"{r['median_rollout_s']:7.3f} s  ({r['rollout_tokens_per_s']:9.1f} tok/s, "
              f"{r['forwards_per_token']:.2f} forwards/token)  update {r['update_s']:.3f} s")
    result = {"model": args.model, "backend": args.backend, "device": dev, "smoke": device.type != "cuda",
              "steps": args.steps,
              "matched": dataclasses.asdict(m), "rows": rows,
              "command": "PYTHONPATH=. python scripts/rl_vs_dllm.py " + " ".join(argv or sys.argv[1:])}
    if not args.skip_dllm:  # the headline: matched difflm-rl (row 0) over dllm (row 1)
        result["export_logits_max_abs_diff"] = same_model
        print(f"  same model: max |difflm logits - dllm-loaded export logits| = {same_model:.2e}")
        result["steps_per_h_ratio"] = rows[0]["steps_per_h"] / rows[1]["steps_per_h"]
        result["rollout_tokens_per_s_ratio"] = rows[0]["rollout_tokens_per_s"] / rows[1]["rollout_tokens_per_s"]
        print(f"  matched difflm-rl / dllm: {result['steps_per_h_ratio']:.2f}x steps/h, "
              f"{result['rollout_tokens_per_s_ratio']:.2f}x rollout tokens/s")
        for r in rows[2:]:
            print(f"  ({r['name']} / dllm, settings not matched: {r['steps_per_h'] / rows[1]['steps_per_h']:.2f}x "
                  "steps/h)")
    out = result_path(args, device.type, work)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
