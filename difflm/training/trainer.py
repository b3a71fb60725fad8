"""The training loop: steps with gradient accumulation, evaluation of the NELBO bound, samples, checkpoints."""
from __future__ import annotations

import math
import resource
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from difflm.checkpoint.store import latest_checkpoint, load_checkpoint, save_checkpoint
from difflm.config.validate import check_batch
from difflm.data import GlobalBatchSampler, build_datasets, build_tokenizer
from difflm.model import build_model, resolve_model_config
from difflm.objectives import build_objective, step_length, weighted_ce_sum
from difflm.objectives.keyed_rng import STREAM_TRAIN
from difflm.training.flops import flops_per_token, mfu, peak_flops
from difflm.training.optimizer import build_optimizer
from difflm.training.precision import autocast_context
from difflm.training.schedule import build_scheduler
from difflm.training.sinks import ConsoleSink, JsonlSink, WandbSink


def memory_gib(device: torch.device) -> float:
    """Peak memory: CUDA allocator peak on GPUs, the process's max resident set on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Trainer:
    """Builds tokenizer, data, model, objective and optimizer from a validated run config, then trains.

    Args:
        cfg: the composed :class:`difflm.config.schema.RunConfig` (OmegaConf node); ``model.vocab_size``
            and ``model.head_dim`` are filled in here.
        run_dir: where config.yaml, metrics.jsonl and checkpoints/ go. A run_dir that already holds a
            checkpoint resumes from the latest one.
        device: from :func:`difflm.config.validate.check_run`.
    """

    def __init__(self, cfg, run_dir: Path, device: torch.device):
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), device
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        self.accum_steps = check_batch(cfg)
        self.tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
        resolve_model_config(cfg.model, self.tok.padded_vocab_size)
        cache_dir = cfg.data.cache_dir or str(self.run_dir / "data_cache")
        self.train_set, self.valid_set = build_datasets(cfg.data, self.tok, cache_dir)
        self.sampler = GlobalBatchSampler(len(self.train_set), t.global_batch_size, t.seed)
        self.objective = build_objective(cfg.objective, self.tok.mask_id)
        torch.manual_seed(t.seed)
        self.model = build_model(cfg.model, causal=self.objective.causal, device=device, seed=t.seed)
        self.optimizer = build_optimizer(self.model, cfg.optim, device)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, t.max_steps)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision.name == "fp16")
        self.flops_per_token = flops_per_token(self.model.num_params(), cfg.model.num_layers,
                                               cfg.model.hidden_size, cfg.data.seq_len)
        self.peak = peak_flops(device)
        self.step = 0
        self.resumed_from: Optional[int] = None
        self._resume()
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    # ------------------------------------------------------------------ state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(self.step),
            "torch_rng": torch.get_rng_state(),
        }

    def _resume(self) -> None:
        found = latest_checkpoint(self.run_dir)
        if found is None:
            return
        step, path = found
        state = load_checkpoint(path, self.model, self.optimizer)
        self.sampler.check_state(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])
        self.step = self.resumed_from = state["step"]

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.trainer_state())

    # ------------------------------------------------------------------ steps
    def train_step(self) -> dict:
        """One optimizer step over the global batch of step ``self.step``; returns its scalar metrics."""
        cfg, t = self.cfg, self.cfg.train
        seq_len = step_length(cfg.data.seq_len, self.step, t.seed, cfg.objective.random_length_prob,
                              cfg.objective.length_multiple)
        windows = self.sampler.indices(self.step)
        self.model.train()
        loss = torch.zeros((), device=self.device)
        for micro in range(self.accum_steps):
            ids = range(micro * t.micro_batch_size, (micro + 1) * t.micro_batch_size)
            tokens = self.train_set.get(windows[list(ids)])[:, :seq_len]
            batch = self.objective.noise(tokens, ids, (t.seed, STREAM_TRAIN, self.step), t.global_batch_size)
            batch = batch.to(self.device)
            with autocast_context(cfg.precision.name, self.device):
                logits = self.model(batch.input_ids, batch.loss_mask)
            micro_loss = weighted_ce_sum(logits, batch, cfg.objective.loss_norm, t.global_batch_size)
            self.scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": t.global_batch_size * seq_len}

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """NELBO bound on fixed validation windows, nats/token (exact NLL for ``ar``); None without a valid split.

        Uses ``train.eval_batches`` micro-batches and ``train.eval_mc_samples`` antithetic draws of t per window.
        """
        cfg, t = self.cfg, self.cfg.train
        count = min(len(self.valid_set), t.eval_batches * t.micro_batch_size)
        if count == 0:
            return None
        draws = 1 if cfg.objective.name == "ar" else t.eval_mc_samples
        self.model.eval()
        total = 0.0
        for start in range(0, count, t.micro_batch_size):
            ids = list(range(start, min(count, start + t.micro_batch_size)))
            tokens = self.valid_set.get(ids)
            for draw in range(draws):
                batch = self.objective.eval_noise(tokens, ids, draw, draws, t.seed).to(self.device)
                with autocast_context(cfg.precision.name, self.device):
                    logits = self.model(batch.input_ids, batch.loss_mask)
                total += float(weighted_ce_sum(logits, batch, "token", 1))  # summed over sequences
        self.model.train()
        return total / (count * draws)

    @torch.no_grad()
    def generate_samples(self, prompt: str, num: int) -> list[str]:
        """Continuations of ``prompt`` with the run's sampler settings (``gen.*``), decoded to text."""
        from difflm.generate import generate_ids

        self.model.eval()
        ids = self.tok.tokenizer(prompt, add_special_tokens=False)["input_ids"] or [self.tok.eos_id]
        prompt_ids = torch.tensor([ids] * num, device=self.device)
        out = generate_ids(self.model, self.tok, prompt_ids, self.cfg.gen, self.objective.causal,
                           precision=self.cfg.precision.name)
        self.model.train()
        return [prompt + self.tok.decode(row.tolist()) for row in out]

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train to ``train.max_steps``; returns the last metrics dict."""
        cfg, t, lg = self.cfg, self.cfg.train, self.cfg.logger
        sinks = [JsonlSink(self.run_dir), ConsoleSink(t.max_steps, self.step, lg.progress_bar)]
        if lg.name == "wandb" and lg.mode != "disabled":
            wandb_id = self.run_dir / "wandb_id.txt"
            sinks.append(WandbSink(lg, self.run_dir, OmegaConf.to_container(cfg, resolve=True),
                                   wandb_id.read_text().strip() if wandb_id.exists() else None))
        metrics: dict = {}
        try:
            if self.step == 0 and t.eval_every > 0:
                metrics = self._eval_metrics({"step": 0, "loss": None, "lr": None, "tokens_per_s": None, "mfu": None})
                self._emit(sinks, metrics)
            window_tokens, window_start = 0, time.perf_counter()
            while self.step < t.max_steps:
                out = self.train_step()
                window_tokens += out["tokens"]
                last = self.step == t.max_steps
                do_eval = t.eval_every > 0 and (self.step % t.eval_every == 0 or last)
                if self.step % lg.log_every == 0 or do_eval or last:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = window_tokens / elapsed
                    metrics = {
                        "step": self.step,
                        "loss": float(out["loss"]),
                        "grad_norm": float(out["grad_norm"]),
                        "lr": out["lr"],
                        "tokens_per_s": tokens_per_s,
                        "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak),
                        "mem_gib": memory_gib(self.device),
                    }
                    if do_eval:
                        metrics = self._eval_metrics(metrics)
                        if lg.num_samples > 0 and lg.name == "wandb":
                            self._emit_samples(sinks, lg.num_samples)
                    self._emit(sinks, metrics)
                    window_tokens, window_start = 0, time.perf_counter()
                if t.save_every > 0 and (self.step % t.save_every == 0 or last):
                    self.save()
            if t.sample_at_end and lg.num_samples > 0:
                self._emit_samples(sinks, lg.num_samples)
        finally:
            for sink in sinks:
                sink.close()
        return metrics

    def _eval_metrics(self, metrics: dict) -> dict:
        nelbo = self.evaluate()
        if nelbo is not None:
            metrics = dict(metrics, val_nelbo=nelbo, val_ppl_bound=math.exp(min(nelbo, 50.0)))
        return metrics

    def _emit(self, sinks, metrics: dict) -> None:
        for sink in sinks:
            sink.log(metrics)

    def _emit_samples(self, sinks, num: int) -> None:
        samples = self.generate_samples(self.cfg.logger.sample_prompt, num)
        for sink in sinks:
            sink.log_samples(self.step, samples)
        (self.run_dir / "samples.txt").write_text(
            "".join(f"--- step {self.step} sample {i} ---\n{s}\n" for i, s in enumerate(samples)), encoding="utf-8")
