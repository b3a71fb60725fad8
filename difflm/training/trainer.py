"""The training loop: steps with gradient accumulation, evaluation of the NELBO bound, samples, checkpoints."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import resource
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from difflm.checkpoint.store import CheckpointMismatch, checkpoint_config_path, latest_checkpoint, load_checkpoint, \
    prune_checkpoints, remove_incomplete_saves, resume_checkpoint, save_checkpoint
from difflm.config.validate import check_batch, check_length, check_parallel, check_validation_split
from difflm.data import build_datasets, build_sampler, build_tokenizer
from difflm.data.tokenizer import tokenizer_reference
from difflm.model import build_model, resolve_model_config
from difflm.model.lora import apply_lora, check_lora, check_lora_layout, init_adapters_, lora_enabled
from difflm.model.masks import to_device
from difflm.model.moe import (moe_config, moe_inactive_params, moe_metrics_of, moe_step, moe_step_stats,
                              set_moe_balance_group, set_moe_loss_scale)
from difflm.objectives import build_objective, loss_normaliser, shortest_step_length, step_length, weighted_ce_sum
from difflm.training.allocator import use_expandable_segments
from difflm.training.flops import mfu, objective_flops_per_token, peak_flops
from difflm.training.optimizer import build_optimizer, skips_on_device, step_unless_nonfinite
from difflm.training.precision import autocast_context
from difflm.training.schedule import build_scheduler, restore_scheduler, short_run_warning
from difflm.parallel import distributed as pdist
from difflm.training.preemption import StopRequest, process_age_s
from difflm.training.profiling import Profiler
from difflm.training.run_config import check_resume_tokenizer, check_steps_to_train, model_settings_hint, \
    record_run_config
from difflm.training.run_dir import set_aside_run_records
from difflm.training.sinks import ConsoleSink, JsonlSink, wandb_sinks
from difflm.training.watchdog import StepWatchdog
from difflm.errors import DifflmError


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`memory_gib`'s peak here, so that a run reports its own: the jobs of a ``-m`` sweep run one after
    another in one process, whose peak would otherwise carry the earlier jobs' (a sweep of micro-batch sizes would
    show the largest one's memory for every later job). CUDA: the allocator's peak; CPU: the peak resident set
    (Linux's ``/proc/self/clear_refs``; elsewhere the process's peak since its start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
    except OSError:
        pass


def memory_gib(device: torch.device) -> float:
    """Peak memory since :func:`reset_peak_memory` (GiB): the CUDA allocator's peak on GPUs, the peak resident set on
    CPU (``VmHWM``; the process's ``ru_maxrss`` where /proc is not there)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
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
        t = cfg.train
        check_length(t)  # train.max_steps / train.epochs (also checked by check_run, which tests may skip)
        check_validation_split(cfg.data, t)  # before a possibly long tokenization
        use_expandable_segments(t.expandable_segments, device)  # before the model's allocations
        reset_peak_memory(device)  # mem_gib: this run's peak, not an earlier sweep job's in this process
        # layout: several processes (torchrun) get a mesh (difflm.parallel); one process is the layout of degree 1
        from difflm.training.auto_batch import choose_micro_batch, is_auto

        auto_batch = is_auto(cfg)  # callers that build a Trainer directly skip check_run, which chooses it first
        if (line := choose_micro_batch(cfg, device, pdist.world_size_from_env())) and pdist.is_rank0():
            print(f"difflm: {line}", flush=True)
        self.dims = check_parallel(cfg, pdist.world_size_from_env(), device)
        self.accum_steps = check_batch(cfg, self.dims.world_size)
        self.lora = lora_enabled(cfg.get("lora"))
        self.lora_base: Optional[int] = None  # LoRA: the step of the checkpoint holding the base (None: the keyed init)
        if self.lora:  # also in check_run; here for callers that build a Trainer directly
            check_lora(cfg.lora, cfg.model)
            check_lora_layout(cfg.lora, self.dims, cfg.model)
        self.mesh, self.pipeline, self.coords = None, None, {"dp": 0, "tp": 0, "pp": 0, "cp": 0}
        self.te_tp = None  # (TP group, sequence parallel, ids of TP-sharded params) of the TE backend under TP
        self.vocab_group = None  # TP group of the vocab-parallel LM head and cross-entropy (tp > 1)
        if self.dims.distributed:
            self.device = device = pdist.init_distributed(device, timeout_s=t.collective_timeout)
            from difflm.parallel.mesh import build_mesh, mesh_coordinates

            self.mesh = build_mesh(self.dims, device.type)
            self.coords = mesh_coordinates(self.mesh)
            self.vocab_group = self.mesh["tp"].get_group() if self.dims.tp_enabled else None
        self.is_rank0 = pdist.is_rank0()
        if self.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        # a local tokenizer directory is recorded by its absolute path: config.yaml is read by difflm-generate, -eval,
        # -export and -rl from any folder, where a relative one would name nothing (or a hub repository)
        cfg.data.tokenizer = tokenizer_reference(cfg.data.tokenizer)
        self.tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
        check_resume_tokenizer(self.run_dir, cfg.data.tokenizer, self.tok, cfg.model.vocab_multiple)
        resolve_model_config(cfg.model, self.tok.padded_vocab_size)
        cache_dir = cfg.data.cache_dir or str(self.run_dir / "data_cache")
        self._build_datasets(cache_dir)
        if t.epochs is not None:  # train.epochs: passes over the training windows set the length
            steps = max(1, math.ceil(t.epochs * len(self.train_set) / t.global_batch_size))
            replaced = "" if t.max_steps is None else f", in place of the default train.max_steps={t.max_steps}"
            self._report(f"difflm: train.epochs={t.epochs} sets train.max_steps={steps} ({len(self.train_set)} "
                         f"training windows per epoch / train.global_batch_size={t.global_batch_size}{replaced})")
            t.max_steps = steps
        self.sampler = build_sampler(self.train_set, t.global_batch_size, t.seed)
        self.objective = build_objective(cfg.objective, self.tok.mask_id)
        if cfg.logger.num_samples > 0 and self.dims.tp_enabled:  # before training, not after it
            from difflm.generate import check_padded_sampling
            from difflm.parallel.parallelize import layout_length_multiple

            check_padded_sampling(cfg.objective.name, len(self.tok.encode(cfg.logger.sample_prompt) or [0]),
                                  int(cfg.objective.get("block_size", 1) or 1),
                                  layout_length_multiple(cfg.parallel, self.dims))
        if self.lora:
            if cfg.model.backend == "te":  # frozen weights have no gradient for TE to accumulate in place
                cfg.model.fuse_wgrad_accumulation = False
        torch.manual_seed(t.seed)
        if self.dims.distributed:
            num_params = self._build_parallel_model()
        else:
            self.model = self._build_single_model()
            self.model_parts = [self.model]
            num_params = self.model.num_params()
        # each micro-batch's MoE aux loss enters the step's objective with weight micro / global (docs/moe.md)
        set_moe_loss_scale(self.model_parts, t.micro_batch_size / t.global_batch_size)
        self.moe_group = None
        if self.dims.distributed:
            from difflm.parallel.expert_parallel import moe_stat_group

            self.moe_group = moe_stat_group(self.mesh, self.dims)
        set_moe_balance_group(self.model_parts, self.moe_group)  # model.moe.balance_over=global_batch
        self.optimizer = build_optimizer(torch.nn.ModuleList(self.model_parts) if self.dims.distributed else self.model,
                                         cfg.optim, device)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, t.max_steps)
        if (warning := short_run_warning(cfg.schedule, t.max_steps, cfg.optim.lr)) is not None:
            self._report(warning)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision.name == "fp16")
        if (auto_batch or cfg.train.get("auto_batch_reason")) and device.type == "cuda" and self.pipeline is None:
            self._probe_micro_batch()  # train.micro_batch_size=auto: the planned size confirmed by a step
        # MFU's FLOPs per data token, as the benchmark counts them (bd3lm runs [x_t ; x_0]: difflm.training.flops;
        # mixture of experts: the active parameters, docs/moe.md)
        self.flops_per_token = objective_flops_per_token(cfg.objective, cfg.model,
                                                         num_params - moe_inactive_params(cfg.model), cfg.data.seq_len)
        self.peak = peak_flops(device)
        self.step = 0
        self.data_offset = 0  # steps of data skipped after loss spikes: step s trains on data step s + offset
        self.skipped_steps = 0  # non-finite steps skipped so far (all time)
        self._told_no_samples = False  # the console said once that this layout draws no samples
        self._told_beyond_window = False  # the console said once that samples run past data.seq_len
        self.resumed_from: Optional[int] = None
        self.resumed_checkpoint: Optional[Path] = None
        self.stop_reason: Optional[str] = None
        self._pending_save = None
        # (data step, Future of its host batches): on a GPU the next step's data and noise are prepared on a thread
        # while this step's kernels are launched, so the host work never leaves the device idle (numpy and torch's
        # CPU ops release the GIL). On the CPU the host is the device: the thread would only compete with it.
        self._prefetched = None
        self.block_graphs = None  # train.cuda_graphs: captured at the first step (difflm.training.cuda_graphs)
        self._data_thread = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="difflm-data")
                             if device.type == "cuda" else None)
        self._data_lock = threading.Lock()  # one _host_batches at a time (the samplers cache epoch orders)
        if device.type != "cuda":
            self.settle_lag = 0  # the host is the device: reading a step's outcome costs nothing
        self._resume()
        if self.is_rank0:  # a resume with other settings than its checkpoint's names them and keeps those
            record_run_config(self.run_dir, cfg, self.resumed_from, self.resumed_checkpoint, report=self._report)

    def _build_single_model(self):
        """The whole model on this process's device, with the layout keys that apply to one process as
        :func:`difflm.parallel.parallelize.parallelize` applies them to a rank's part: LoRA adapters (``lora``), activation checkpointing
        (``parallel.activation_checkpointing``), then compiled blocks (``parallel.compile`` or ``model.compile``)."""
        from difflm.parallel.fsdp import apply_activation_checkpointing, apply_compile

        cfg = self.cfg
        model_cfg = cfg.model.copy()
        model_cfg.compile = False  # compiled per block after activation checkpointing, as under a layout
        model = build_model(model_cfg, causal=self.objective.causal, device=self.device, seed=cfg.train.seed,
                            precision=cfg.precision)
        if self.lora:  # the converter runs before the layout keys, as under a layout
            apply_lora(model, cfg.lora, seed=cfg.train.seed)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpointing)
        if cfg.parallel.compile or cfg.model.get("compile", False):
            apply_compile(model)
        return model

    def _probe_micro_batch(self) -> None:
        """``train.micro_batch_size=auto`` on CUDA: forward and backward of a batch of random tokens at the planned size
        (twice under gradient accumulation: the second with the first's gradients held), with as many loss rows as
        the memory plan's heaviest micro-batch and AdamW's moments held, halving on out-of-memory
        (:func:`difflm.training.auto_batch.probe_micro_batch`); the ranks keep the smallest size any of them could
        run, and the config (``config.yaml``) records it. The memory peak restarts after it (:func:`reset_peak_memory`):
        ``mem_gib`` is the peak of the run's steps, not of the probe's tries (one that ran out of memory filled the
        GPU)."""
        from difflm.plan.memory import peak_loss_fraction
        from difflm.plan.trace import noised_batch
        from difflm.training.auto_batch import probe_micro_batch

        t = self.cfg.train
        per_rank = t.global_batch_size // self.dims.dp
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)

        def step(size: int) -> None:  # at the planned share of loss rows of the micro-batch that has the most
            share = peak_loss_fraction(self.cfg.objective, size, t.global_batch_size, self.cfg.data.seq_len)
            batch = noised_batch(self.cfg, self.objective, size, share).to(self.device)
            moments = torch.empty(2 * local, dtype=torch.float32, device=self.device)  # AdamW's, from its 1st step
            try:
                for _ in range(2 if per_rank // size > 1 else 1):
                    self._local_loss(batch, self.cfg.objective.loss_norm, 1.0, backward=True)
                torch.cuda.synchronize(self.device)
            finally:
                del moments
                self.optimizer.zero_grad(set_to_none=True)

        size, failed = probe_micro_batch(step, int(t.micro_batch_size), per_rank)
        if self.dims.distributed:
            agreed = torch.tensor(size, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            size = int(agreed)
        if size != t.micro_batch_size:
            t.micro_batch_size = size
            self.accum_steps = check_batch(self.cfg, self.dims.world_size)
            set_moe_loss_scale(self.model_parts, size / t.global_batch_size)
            t.auto_batch_reason = f"{t.auto_batch_reason}; the probe ran out of memory at {failed}: {size}"
            self._report(f"difflm: train.micro_batch_size=auto: out of memory at {failed}, the run takes {size} "
                         f"({self.accum_steps} accumulation step{'s' if self.accum_steps != 1 else ''})")
        reset_peak_memory(self.device)

    def _build_parallel_model(self) -> int:
        """This rank's part of the model, built on the meta device, laid out over the mesh and materialised shard by
        shard with the single-process init (:func:`difflm.parallel.parallelize.build_parallel_model`): no rank ever
        holds the whole model. Returns the full model's parameter count without the input embedding (for MFU)."""
        from difflm.parallel.parallelize import build_parallel_model

        self.model_parts, self.pipeline, num_params, te_groups = build_parallel_model(
            self.cfg, self.mesh, self.dims, self.device, self.objective.causal, self.accum_steps)
        if te_groups.get("tp_group") is not None:
            from difflm.parallel.te_tensor_parallel import sharded_param_ids

            self.te_tp = (te_groups["tp_group"], te_groups["sequence_parallel"],
                          frozenset(sharded_param_ids(self.model_parts)))
        self.model = self.model_parts[0] if self.pipeline is None else None
        return num_params

    # ------------------------------------------------------------------ state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(self.data_step),
            "torch_rng": torch.get_rng_state(),
            "data_offset": self.data_offset,
            "skipped_steps": self.skipped_steps,
            **({"lora_base": -1 if self.lora_base is None else self.lora_base} if self.lora else {}),
        }

    @property
    def data_step(self) -> int:
        """The step whose data (windows, noise keys) the current step trains on."""
        return self.step + self.data_offset

    def _resume(self) -> None:
        if self.is_rank0:  # this run holds run.dir (difflm.training.run_dir): no save of another one is in flight
            for name in remove_incomplete_saves(self.run_dir):
                self._report(f"removed {name}: a checkpoint save that never finished")
        found = resume_checkpoint(self.run_dir, report=print if self.is_rank0 else (lambda _: None))
        if found is None:
            # Nothing to resume: a run that saved no checkpoint (train.save_every=0, a crash before the first save)
            # may have left its records; this run starts afresh, so it must not append to that run's metrics or
            # log into its W&B run. Rank 0 moves them (it holds run.dir) while the other ranks wait.
            if self.is_rank0 and (kept := set_aside_run_records(self.run_dir)) is not None:
                self._report(f"difflm: run.dir={self.run_dir} has no checkpoint to resume from but holds an earlier "
                             f"run's records: moved them to {kept}; this run starts afresh")
            pdist.barrier()  # before any other rank writes into run.dir (profile/, hang_rank<r>.txt)
            return
        trained_with = checkpoint_config_path(self.run_dir, found[1])
        check_steps_to_train(found[0], self.cfg, found[1], trained_with)
        try:
            self._load(found[1])
        except CheckpointMismatch as err:  # another model's checkpoint: name the model.* settings it was trained with
            hint = model_settings_hint(trained_with, self.cfg)
            if hint is None:
                raise
            raise DifflmError(f"{err}; {hint}") from err
        self.resumed_checkpoint = found[1]

    def _load(self, path: Path) -> None:
        pending, self._prefetched = self._prefetched, None
        if pending is not None:  # let the data thread finish before the sampler state is replaced
            concurrent.futures.wait([pending[1]])
        fresh_adapters = False
        if self.lora:
            state = self._load_lora(path)
            fresh_adapters = "lora_base" not in state
        else:
            from difflm.checkpoint.store import read_trainer_state

            if "lora_base" in read_trainer_state(path):
                raise DifflmError(f"checkpoint {path} holds LoRA adapters only (lora.rank=0 here): resume it with the "
                                  "lora.* settings it was trained with, or export it merged (difflm-export) and "
                                  "difflm-import that export to train every weight")
            state = load_checkpoint(path, self.model_parts, self.optimizer)
        # adapters on a full run's weights start a new phase, usually on other data (SFT); a difflm-rl checkpoint
        # (its trainer state: step, scheduler, seed) was trained on prompts, not on this run's windows
        if not fresh_adapters and "sampler" in state:
            self.sampler.check_state(state["sampler"])
        restore_scheduler(self.scheduler, state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        self.step = self.resumed_from = state["step"]
        self.data_offset = state.get("data_offset", 0)
        self.skipped_steps = state.get("skipped_steps", 0)

    def _load_lora(self, path: Path) -> dict:
        """A LoRA run's load (docs/lora.md): a LoRA checkpoint holds the adapters and their optimizer state and names
        its base (``lora_base``: the step of a checkpoint in this run.dir, -1 for the keyed init of train.seed, which
        the model was built with); any other checkpoint (``difflm-import``'s step_0, a full run's) is the base
        itself, read model-only, and the adapters start fresh, or from the adapters it holds as well (a difflm-rl run
        of a LoRA run). Returns the trainer state."""
        from difflm.checkpoint.store import checkpoint_keys, load_base_weights, read_settings, read_trainer_state
        from difflm.model.lora import is_adapter

        state = read_trainer_state(path)
        if "lora_base" in state:
            from difflm.model.lora import check_resume_lora

            saved = read_settings(checkpoint_config_path(self.run_dir, path))
            check_resume_lora(saved.get("lora"), self.cfg.lora, f"checkpoint {path}")
            base = int(state["lora_base"])
            if base >= 0:
                load_base_weights(self.run_dir / "checkpoints" / f"step_{base}", self.model_parts)
            self.lora_base = None if base < 0 else base
            return load_checkpoint(path, self.model_parts, self.optimizer, trainable_only=True)
        load_base_weights(path, self.model_parts)
        self.lora_base = int(state["step"])
        inline = any(is_adapter(k) for k in (checkpoint_keys(path) or ()))  # a difflm-rl run's: base and adapters
        locate = None
        if self.dims.distributed:
            from difflm.parallel.materialize import ShardLocator

            locate = ShardLocator(self.model_parts)
        for part in self.model_parts:  # fresh adapters (also when a loss spike rolls back to the base)
            init_adapters_(part, self.cfg.train.seed, locate)
        if inline:  # the adapters trained there go on training
            load_checkpoint(path, self.model_parts, None)
        self.optimizer.state.clear()  # and a fresh optimizer
        return state

    def save(self) -> Path:
        """Checkpoint the current step (collective under parallel layouts). With ``train.async_save`` the previous
        asynchronous save is finished first and this one is left in flight (see :meth:`finish_saves`)."""
        self.finish_saves()
        t = self.cfg.train
        out = save_checkpoint(self.run_dir, self.step, self.model_parts, self.optimizer, self.trainer_state(),
                              async_save=t.async_save, checksums=t.checkpoint_checksums,
                              config=OmegaConf.to_yaml(self.cfg, resolve=True), trainable_only=self.lora)
        if isinstance(out, Path):
            prune_checkpoints(self.run_dir, t.keep_last, t.keep_every, keep=self._kept_steps())
            return out
        self._pending_save = out
        return out.path

    def finish_saves(self) -> None:
        """Wait for an asynchronous checkpoint in flight and publish it (rename to ``step_<N>``)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            pending.wait()
            prune_checkpoints(self.run_dir, self.cfg.train.keep_last, self.cfg.train.keep_every,
                              keep=self._kept_steps())

    def _kept_steps(self) -> tuple:
        """Checkpoints retention never deletes: a LoRA run's base."""
        return (self.lora_base,) if self.lora and self.lora_base is not None else ()

    # ------------------------------------------------------------------ steps
    def _autocast(self):
        """The precision context of a forward pass; FP8 amaxes are reduced over the ranks that hold the same layers
        (the data, context and tensor parallel peers of this pipeline stage, as Megatron-LM's amax group)."""
        group = self.mesh["stage"].get_group() if self.dims.distributed else None
        return autocast_context(self.cfg.precision, self.device, amax_reduction_group=group)

    def _finish_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int, clip=None) -> dict:
        """Optimizer and schedule step, which changes no weight when the loss or gradient norm is not finite (the
        step and its data still count). A fused AdamW (the default on GPUs) skips on the device: the host does not
        wait for the step's outcome (:func:`difflm.training.optimizer.step_unless_nonfinite`), and applies the
        gradient clipping ``clip`` = (parameters, coefficient), or None, inside its kernel; fp16's GradScaler
        skips non-finite gradients itself (and rescales); other optimizers read the finite check first. Those
        paths clip the gradients in place first. The returned ``finite`` (a bool scalar tensor, or a bool) is read
        when the step is settled (:meth:`fit`)."""
        from difflm.parallel.parallelize import scale_grads_

        lr = self.scheduler.get_last_lr()[0]
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        fused = skips_on_device(self.optimizer) and not self.scaler.is_enabled()
        if clip is not None and not fused:
            scale_grads_(*clip)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif fused:  # the clipping coefficient multiplies the gradients inside the fused kernel: no pass of its own
            step_unless_nonfinite(self.optimizer, finite, grad_factor=None if clip is None else clip[1])
        else:
            finite = bool(finite)  # a host sync: only optimizers without a device-side skip take it
            if finite:
                self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens, "finite": finite}

    def train_step(self) -> dict:
        """One optimizer step over the global batch of step ``self.step``; returns its scalar metrics.

        One path for every layout (one process is the layout with every degree 1; docs/parallel.md).
        Data-parallel rank d takes global samples ``[d * local, (d + 1) * local)`` of the step (local =
        global batch / dp), micro-batch m the ids ``d * local + m * mb ...``: the noise is keyed by these GLOBAL
        ids, so every layout trains on the same noised batch as one process. Each rank's loss is divided by the
        normaliser of the whole global batch (:meth:`_step_normaliser`, counted before the first forward), so the
        step's loss does not depend on the split; FSDP sums gradients (divide factor 1), pipeline schedules do not
        rescale them.
        """
        from difflm.parallel.fsdp import FSDPModule
        from difflm.parallel.parallelize import clip_coefficient, global_grad_norm
        from difflm.parallel.te_tensor_parallel import all_reduce_partial_grads

        cfg, t, dims = self.cfg, self.cfg.train, self.dims
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == self.data_step:
            host = prefetched[1].result()
        else:  # the first step, or the data step moved (a resume, a roll-back): prepare it here
            host = self._host_batches(self.data_step)
        if t.cuda_graphs and self.block_graphs is None:  # after any resume: the weights are final in place
            # before the data thread gets its first work: no other thread may call CUDA (pin memory) during a capture
            self._capture_block_graphs()
        if self.step + 1 < t.max_steps and self._data_thread is not None:
            self._prefetched = (self.data_step + 1, self._data_thread.submit(self._host_batches, self.data_step + 1))
        batches, normaliser, seq_len = self._device_batches(*host)
        every_sync = cfg.parallel.get("grad_sync", "last") == "every"
        for part in self.model_parts:
            part.train()
        loss = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            with self._autocast():
                loss += self.pipeline.step(batches[0], normaliser).detach()
        else:
            for micro, batch in enumerate(batches):
                if isinstance(self.model, FSDPModule):  # parallel.grad_sync=last: reduce once, in the last backward
                    self.model.set_requires_gradient_sync(micro == len(batches) - 1 or every_sync)
                loss += self._local_loss(batch, cfg.objective.loss_norm, normaliser, backward=True)
        moe_step(self.model_parts, self.moe_group)  # MoE load statistics over the step, aux-loss-free bias update
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.mesh["pp"].get_group() if dims.pp_enabled else None
        self.scaler.unscale_(self.optimizer)  # fp16 only (refused for sharded layouts); a no-op otherwise
        tp_group, sp, tp_sharded = self.te_tp or (None, False, frozenset())
        if tp_group is not None:  # TE's TP shards are plain tensors: partial gradients need the TP group
            all_reduce_partial_grads(self.model_parts, tp_group, sp)
        grad_norm = global_grad_norm(params, pp_group, tp_group=tp_group, tp_sharded=tp_sharded)
        coef = clip_coefficient(grad_norm, max_norm)
        loss = pdist.all_reduce_sum(loss) / dims.tp  # tp ranks hold the same loss; pp: only the last stage's
        return self._finish_step(loss, grad_norm, t.global_batch_size * seq_len,
                                 clip=None if coef is None else (params, coef))

    def _capture_block_graphs(self) -> None:
        """``train.cuda_graphs``: capture the blocks at the run's micro-batch shape (one process; checked by
        :func:`difflm.config.validate.check_cuda_graphs`)."""
        from difflm.training.cuda_graphs import capture_block_graphs

        t = self.cfg.train
        self.block_graphs = capture_block_graphs(self.model, self.cfg.precision, t.micro_batch_size,
                                                 self.cfg.data.seq_len)
        self._report(f"CUDA graphs: {len(self.block_graphs.blocks)} blocks captured for micro-batches of "
                     f"{t.micro_batch_size} x {self.cfg.data.seq_len} tokens in {self.block_graphs.seconds:.1f} s")

    def _build_datasets(self, cache_dir: str) -> None:
        """``self.train_set`` / ``self.valid_set``: rank 0 tokenizes and caches first, then the other ranks read its
        cache. A refusal on rank 0 (a data path, tokenizer or window count the run cannot use) is sent to every rank
        and ends each with the same one line, not with the others' collective failing under them."""
        if not self.dims.distributed:
            self.train_set, self.valid_set = build_datasets(self.cfg.data, self.tok, cache_dir)
            return
        refused = None
        if self.is_rank0:
            try:
                self.train_set, self.valid_set = build_datasets(self.cfg.data, self.tok, cache_dir)
            except DifflmError as err:
                refused = err
        message = pdist.broadcast_object(None if refused is None else str(refused))
        if refused is not None:
            raise refused
        if message is not None:
            raise DifflmError(message)
        if not self.is_rank0:
            self.train_set, self.valid_set = build_datasets(self.cfg.data, self.tok, cache_dir)
        pdist.barrier()

    def _host_batches(self, data_step: int) -> tuple[list, list, int]:
        """The token windows and noised micro-batches of ``data_step`` on the host, pinned (one local batch for a
        pipeline, which splits it itself), and its sequence length. Host work only, no collective: it runs on the
        data thread while the device is busy with the previous step."""
        from difflm.parallel.parallelize import effective_length_multiple

        cfg, t, dims = self.cfg, self.cfg.train, self.dims
        seq_len = step_length(cfg.data.seq_len, data_step, t.seed, cfg.objective.random_length_prob,
                              effective_length_multiple(cfg, dims), shortest_step_length(cfg.objective))
        local = t.global_batch_size // dims.dp
        start = self.coords["dp"] * local
        key = (t.seed, data_step)  # the step's noise key (difflm.objectives.keyed_rng)
        n_micro = 1 if self.pipeline is not None else self.accum_steps  # a pipeline splits its local batch itself
        size = local // n_micro  # train.micro_batch_size without a pipeline
        ids = [range(start + m * size, start + (m + 1) * size) for m in range(n_micro)]
        with self._data_lock:
            windows = self.sampler.indices(data_step)
            tokens = [self.train_set.get(windows[list(r)])[:, :seq_len] for r in ids]
            batches = [self.objective.noise(tb, r, key, t.global_batch_size).pinned(self.device.type == "cuda")
                       for tb, r in zip(tokens, ids)]
        return tokens, batches, seq_len

    def _device_batches(self, tokens, batches, seq_len: int) -> tuple[list, torch.Tensor, int]:
        """:meth:`_host_batches` on the device (asynchronous copies), with the step's loss normaliser
        (:meth:`_step_normaliser`, a collective over data-parallel ranks) and the sequence length."""
        return [b.to(self.device) for b in batches], self._step_normaliser(tokens), seq_len

    def _step_normaliser(self, token_batches) -> torch.Tensor:
        """The loss normaliser of the whole global batch (:func:`difflm.objectives.base.loss_normaliser`): this
        rank's micro-batches ``token_batches`` counted, then summed over the data-parallel ranks (tp / cp / pp
        ranks of one dp rank hold the same samples). Float64 scalar on the device; the same on every rank."""
        norm = self.cfg.objective.loss_norm
        local = sum(float(loss_normaliser(norm, self.objective.num_tokens(tb))) for tb in token_batches)
        total = to_device(torch.tensor(local, dtype=torch.float64), self.device)  # asynchronous copy
        if self.dims.dp > 1:
            pdist.all_reduce_sum(total, group=self.mesh["dp"].get_group())
        return total

    def _local_loss(self, batch, norm: str, normaliser, backward: bool) -> torch.Tensor:
        """This rank's share of the weighted CE of ``batch`` (its sequence chunks under CP) divided by the step's
        ``normaliser`` (:meth:`_step_normaliser`), backward if asked."""
        from difflm.parallel.context_parallel import shard_sequence, torch_cp_context

        cfg, dims = self.cfg, self.dims
        kwargs = batch.model_kwargs()
        ctx = contextlib.nullcontext()
        if dims.cp_enabled and cfg.model.backend == "te":  # TE's ring attention: feed each rank its chunks
            cp, r = dims.cp, self.coords["cp"]
            positions = shard_sequence(torch.arange(batch.input_ids.shape[1], device=self.device), cp, r, dim=0)
            batch = type(batch)(**{**batch.__dict__, "loss_index": None,  # the index was of the full sequence
                                    **{k: shard_sequence(getattr(batch, k), cp, r) for k in
                                       ("input_ids", "targets", "loss_mask", "weights")}})
            kwargs = dict(kwargs, position_ids=positions)
        elif dims.cp_enabled:  # torch: context_parallel shards the buffers in place and patches SDPA
            batch.loss_index = None  # the index was of the full sequence
            positions = torch.arange(batch.input_ids.shape[1], device=self.device)
            kwargs = dict(kwargs, position_ids=positions)
            ctx = torch_cp_context(self.mesh["cp"], [batch.input_ids, batch.targets, batch.loss_mask, batch.weights,
                                                     positions], [1, 1, 1, 1, 0], causal=self.objective.causal)
        with ctx:
            with self._autocast():
                logits = self.model(batch.input_ids, batch.logits_selector(), **kwargs)
            loss = weighted_ce_sum(logits, batch, norm, normaliser, vocab_group=self.vocab_group,
                                   fused=cfg.model.fused_cross_entropy, consume_logits=backward)
            if backward:
                self.scaler.scale(loss).backward()
        if batch.aux is not None:  # the hybrid adaptation loss's second forward (difflm.objectives.hybrid)
            return loss.detach() + self._local_loss(batch.aux, norm, normaliser, backward)
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, valid_set=None) -> Optional[float]:
        """NELBO bound on fixed validation windows, nats/token (exact NLL for ``ar``); None without a valid split.

        Uses the first ``train.eval_windows`` windows (null: sized by :func:`difflm.training.eval_size.eval_windows`)
        of ``valid_set`` (default: the run's validation windows), in
        micro-batches, and ``train.eval_mc_samples`` antithetic draws of t per window. The weighted CE of every
        window and draw is summed and divided by their loss tokens (``num_tokens``: the window length, L - 1 for ``ar``, the response length
        for ``sft``), however the windows are batched.
        """
        cfg, t = self.cfg, self.cfg.train
        valid_set = self.valid_set if valid_set is None else valid_set
        from difflm.training.eval_size import eval_windows

        count = min(len(valid_set), eval_windows(t, cfg.objective.name, self.device.type))
        if count == 0:
            return None
        draws = 1 if cfg.objective.name == "ar" else t.eval_mc_samples
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        num_tokens = 0.0
        for start in range(0, count, t.micro_batch_size):
            ids = list(range(start, min(count, start + t.micro_batch_size)))
            tokens = valid_set.get(ids)
            num_tokens += draws * float(self.objective.num_tokens(tokens).double().sum())
            for draw in range(draws):
                batch = self.objective.eval_noise(tokens, ids, draw, draws, t.seed).to(self.device)
                if self.pipeline is not None:
                    with self._autocast():
                        total += self.pipeline.evaluate(batch, 1.0).double()
                else:
                    total += self._local_loss(batch, "token", 1.0, backward=False).double()
        for part in self.model_parts:
            part.train()
        # every data-parallel rank evaluated all windows (the same forwards, as FSDP needs) and TP ranks hold
        # the same loss: the sum over ranks counts each dp * tp times
        total = pdist.all_reduce_sum(total) / (self.dims.tp * self.dims.dp)
        return float(total) / num_tokens

    @torch.no_grad()
    def generate_samples(self, prompt: str, num: int) -> list[str]:
        """``num`` continuations of ``prompt`` with the run's sampler settings (``gen.*``), decoded to text.

        Sample 0 is what ``difflm-generate`` prints with the same ``gen.*``: it is drawn alone, from a generator
        seeded by ``gen.seed``. The others are drawn together after it, from the same generator (noise of their
        own); at ``gen.temperature=0`` (greedy, deterministic) they would be copies of it, so they sample at
        ``logger.sample_temperature`` instead.
        """
        from difflm.generate import generate_ids
        from difflm.parallel.parallelize import layout_length_multiple

        if self.sampling_unavailable_reason() is not None:
            return []
        from difflm.parallel.vocab_parallel import gather_logits
        self.model.eval()
        from difflm.generate import beyond_trained_length, decode_generated, encode_prompt, run_chat_template

        ids = encode_prompt(self.tok, prompt, run_chat_template(self.cfg))  # as the run's SFT prompts
        gen = self.cfg.gen
        warning = beyond_trained_length(len(ids), gen.length, self.cfg.data.seq_len)
        if warning is not None and self.is_rank0 and not self._told_beyond_window:
            self._report(warning)
            self._told_beyond_window = True
        batches = [(1, gen)]
        if num > 1:  # a row's noise depends on the rows drawn with it: sample 0 alone, as difflm-generate draws it
            rest = gen if gen.temperature > 0 else OmegaConf.merge(
                gen, {"temperature": self.cfg.logger.sample_temperature})
            batches.append((num - 1, rest))
        generator = torch.Generator(device=self.device).manual_seed(gen.seed)
        rows = []
        with gather_logits(self.model_parts):  # the sampler reads full-vocabulary logits
            for count, settings in batches:
                prompt_ids = torch.tensor([ids] * count, device=self.device)
                rows += generate_ids(self.model, self.tok, prompt_ids, settings, self.objective.causal,
                                     precision=self.cfg.precision, objective=self.cfg.objective,
                                     seq_multiple=layout_length_multiple(self.cfg.parallel, self.dims),
                                     generator=generator)
        self.model.train()
        return [prompt + decode_generated(self.tok, row) for row in rows]  # each cut at the end of text

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        """Train to ``train.max_steps``; returns the last metrics dict.

        Stops early, after saving a checkpoint, on SIGTERM/SIGUSR1 or ``train.time_limit``
        (``self.stop_reason`` says why; ``difflm-train`` then exits with status 75), and with a DifflmError
        after ``train.max_skipped_steps`` non-finite steps in a row. A run that trains no step (a finished run
        launched again) draws no end-of-training samples: ``samples.txt`` keeps the ones of its last step.

        On a GPU the host reads a step's outcome (loss, gradient norm, finite check) only after it has launched the
        next step (``self.settle_lag`` = 1), so that read never leaves the device idle; a step whose outcome the
        host needs at once (evaluation, a checkpoint, the last step, a stop, ``train.spike_threshold``) is settled
        before anything else is launched; a logging step's MoE statistics travel with its outcome. So a run of
        non-finite steps stops at most one step after the ``train.max_skipped_steps``-th, and ``tokens_per_s`` is
        timed by the device's end of each step.
        """
        cfg, t, lg = self.cfg, self.cfg.train, self.cfg.logger
        sinks = [JsonlSink(self.run_dir, objective=cfg.objective.name),
                 ConsoleSink(t.max_steps, self.step, lg.progress_bar)] if self.is_rank0 else []
        if self.is_rank0:
            sinks += wandb_sinks(lg, self.run_dir, cfg, report=self._report)
        stop = StopRequest(t.time_limit, elapsed_s=process_age_s())  # the limit counts from the process's start
        watchdog = StepWatchdog(self.run_dir, t.step_timeout, pdist.rank())
        profiler = Profiler(cfg.profile, self.run_dir, self.device, pdist.rank())
        has_moe = moe_config(cfg.model) is not None  # every rank: a pipeline stage may hold no MoE block
        pending: list[_StepRecord] = []
        metrics: dict = {}
        slowest_step = 0.0
        start_step = self.step  # a finished run launched again trains no step: it draws no samples either
        failed = True  # until the loop and the end-of-training samples are through (W&B records the outcome)
        try:
            if self.step == 0 and t.eval_every > 0:
                metrics = self._eval_metrics({"step": 0, "loss": None, "lr": None, "tokens_per_s": None, "mfu": None})
                self._emit(sinks, metrics)
            # after the evaluation: not training time
            self._progress = _Progress(window_start=time.perf_counter(), window_start_event=self._device_mark())
            while self.step < t.max_steps:
                step_start = time.perf_counter()
                watchdog.arm()  # train.step_timeout: the step and the wait for its outcome, not evaluation or saving
                out = self.train_step()
                profiler.step(self.step)
                last = self.step == t.max_steps
                do_eval = t.eval_every > 0 and (self.step % t.eval_every == 0 or last)
                do_save = t.save_every > 0 and (self.step % t.save_every == 0 or last)
                log = self.step % lg.log_every == 0 or do_eval or last
                pending.append(self._record(out, log))
                now = last or do_eval or do_save or t.spike_threshold > 0
                rolled_back = False
                while len(pending) > (0 if now else self.settle_lag):
                    record = pending.pop(0)
                    self._settle(record)
                    if self._progress.skipped_in_a_row >= t.max_skipped_steps:
                        watchdog.disarm_step()
                        self._stop_after_skips(record, pending, sinks, has_moe)
                    if t.spike_threshold > 0 and not self._progress.skipped_in_a_row:
                        watchdog.disarm_step()  # a roll-back loads a checkpoint
                        if self._spiked(record):  # only the newest record is settled with a spike threshold
                            rolled_back = True
                            break
                    if record.log:
                        evaluate = do_eval and not pending
                        if evaluate:
                            watchdog.disarm_step()
                        metrics = self._log_row(record, sinks, has_moe, evaluate)
                watchdog.disarm_step()
                if rolled_back:
                    continue
                if do_save:
                    self.save()
                slowest_step = max(slowest_step, time.perf_counter() - step_start)
                stop.margin_s = 2 * slowest_step  # leave time for one more step and the save
                if not last and stop.should_stop():
                    self.stop_reason = stop.reason
                    while pending:  # every launched step's outcome is counted (and logged) before the checkpoint
                        record = pending.pop(0)
                        self._settle(record)
                        if record.log:
                            metrics = self._log_row(record, sinks, has_moe, evaluate=False)
                    self._report(f"stop requested ({stop.reason}): saving step {self.step} and exiting")
                    if not do_save:
                        self.save()
                    break
            self.finish_saves()
            if self.stop_reason is None and t.sample_at_end and lg.num_samples > 0 and self.step > start_step:
                self._emit_samples(sinks, lg.num_samples)
            failed = False
        finally:
            watchdog.close()
            profiler.close()
            stop.restore()
            for sink in sinks:
                sink.close(failed=failed)
        return metrics

    settle_lag = 1  # steps launched before the host reads a step's outcome; 0 on the CPU (__init__), where it is free

    def _record(self, out: dict, log: bool) -> "_StepRecord":
        """The launched step's outcome as a pending record: its loss, gradient norm and finite check, and on a
        logging step its MoE statistics (:func:`difflm.model.moe.moe_step_stats`, which the next step overwrites),
        copied to the host asynchronously behind a CUDA event (on the CPU: copied at once), with what the host knows
        now."""
        finite = out["finite"]
        values = torch.stack([out["loss"].double(), out["grad_norm"].double(),
                              finite.double() if torch.is_tensor(finite) else
                              torch.tensor(float(finite), dtype=torch.float64, device=out["loss"].device)])
        moe_ids, moe_stats = moe_step_stats(self.model_parts) if log else ([], None)
        event = None
        if values.device.type == "cuda":
            values, moe_stats = (_to_host(t) for t in (values, moe_stats))
            event = self._device_mark()  # also times the step on the device (_log_metrics)
        return _StepRecord(step=self.step, data_step=self.data_step, lr=out["lr"], tokens=out["tokens"], log=log,
                           values=values, event=event, moe=(moe_ids, moe_stats),
                           graph_replays=self.block_graphs.replays if self.block_graphs else None)

    def _settle(self, record: "_StepRecord") -> None:
        """Wait for ``record``'s step to finish on the device and account for it: a skipped update is reported and
        counted (``skipped_steps``, and the run of them in ``self._progress``)."""
        progress = self._progress
        if record.event is not None:
            record.event.synchronize()  # this step only: the steps launched after it keep the device busy
        record.end_time = time.perf_counter()
        record.loss, record.grad_norm, finite = (float(v) for v in record.values.tolist())
        progress.window_tokens += record.tokens
        if finite:
            progress.skipped_in_a_row = 0
            return
        self.skipped_steps += 1
        progress.skipped_in_a_row += 1
        self._report(f"step {record.step}: non-finite loss or gradient norm, update skipped "
                     f"({progress.skipped_in_a_row} in a row, {self.skipped_steps} in all)")

    def _stop_after_skips(self, record: "_StepRecord", pending: list, sinks, has_moe: bool) -> None:
        """``train.max_skipped_steps`` non-finite steps in a row, the last of them ``record`` (settled): count the
        steps launched since (``pending``), write the rows of those that log and, in any case, of the run's last step
        (its ``skipped_steps`` and null loss are the record of why it stopped, as the last step of a finished run is
        always logged), save the last weights and raise DifflmError."""
        t = self.cfg.train
        while True:
            if record.log or not pending:
                self._log_row(record, sinks, has_moe, evaluate=False)
            if not pending:
                break
            record = pending.pop(0)
            self._settle(record)
        self.save()
        self.finish_saves()
        raise DifflmError(f"{self._progress.skipped_in_a_row} non-finite steps in a row (train.max_skipped_steps="
                          f"{t.max_skipped_steps}) at step {self.step}; saved the last weights: "
                          "lower optim.lr, raise optim.grad_clip, or inspect the data at this step")

    def _log_row(self, record: "_StepRecord", sinks, has_moe: bool, evaluate: bool) -> dict:
        """Emit the metrics row of a settled step (with the evaluation, and W&B samples, when ``evaluate``) and start
        the next tokens/s window: where the device finished this step (the steps launched after it kept the device
        busy while the host logged), or after the evaluation, which is not training time. Returns the row."""
        lg = self.cfg.logger
        metrics = self._log_metrics(record, has_moe)
        window_start, window_event = record.end_time, record.event
        if evaluate:
            metrics = self._eval_metrics(metrics)
            if lg.num_samples > 0 and lg.name == "wandb":
                self._emit_samples(sinks, lg.num_samples)
            window_start, window_event = time.perf_counter(), self._device_mark()
        self._emit(sinks, metrics)
        progress = self._progress
        progress.window_tokens, progress.window_start, progress.window_start_event = 0, window_start, window_event
        return metrics

    def _device_mark(self) -> Optional[torch.cuda.Event]:
        """A timing event recorded now on the device's stream (where a tokens/s window starts), None on the CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _spiked(self, record: "_StepRecord") -> bool:
        """``train.spike_threshold``: the settled step's loss above threshold x its running mean rolls the run back
        (:meth:`_roll_back`); True when it did. The mean stays the pre-spike one, so a loss that stays above it (a
        mean set by one lucky step after a start or resume, a threshold too close to 1) would roll back forever:
        after ``train.max_skipped_steps`` roll-backs in a row the next spike stops the run with a DifflmError."""
        progress, loss, t = self._progress, record.loss, self.cfg.train
        if progress.loss_mean is not None and loss > t.spike_threshold * progress.loss_mean:
            if progress.roll_backs_in_a_row >= t.max_skipped_steps:
                first = record.data_step - 1 - progress.roll_backs_in_a_row  # the data step of the first spike
                raise DifflmError(
                    f"the loss stayed above train.spike_threshold={t.spike_threshold:g} x its running mean "
                    f"{progress.loss_mean:.4g} ({loss:.4g} at step {record.step}) after {progress.roll_backs_in_a_row} "
                    f"roll-backs in a row to step {record.step - 1} (train.max_skipped_steps={t.max_skipped_steps}), "
                    "so the run would reload and skip data without end: raise train.spike_threshold (0 turns it off), "
                    f"lower optim.lr, or inspect the data from data step {first} on")
            if self._roll_back():
                progress.roll_backs_in_a_row += 1
                return True  # the mean stays the pre-spike one: the first step after the roll-back is checked too
        progress.roll_backs_in_a_row = 0
        progress.loss_mean = loss if progress.loss_mean is None else 0.9 * progress.loss_mean + 0.1 * loss
        return False

    def _log_metrics(self, record: "_StepRecord", has_moe: bool) -> dict:
        """The metrics row of a settled step; tokens/s over the steps settled since the last row."""
        progress = self._progress
        seconds = record.end_time - progress.window_start
        if record.event is not None and progress.window_start_event is not None:
            # the device's time between the window's ends: the host sees a step end only when it has queued the next
            # one, late by as much as it runs ahead (~1 s at model=1.7b), except for a step settled at once (the
            # last, a save), whose host-timed window would be short by that much
            seconds = progress.window_start_event.elapsed_time(record.event) / 1e3
        tokens_per_s = progress.window_tokens / max(seconds, 1e-9)
        per_gpu = tokens_per_s / self.dims.world_size
        return {
            "step": record.step,
            "loss": record.loss,
            "grad_norm": record.grad_norm,
            "lr": record.lr,
            "tokens_per_s": tokens_per_s,  # all ranks together
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu(per_gpu, self.flops_per_token, self.peak),  # per device = of the whole job
            "mem_gib": memory_gib(self.device),
            **({"cuda_graph_replays": record.graph_replays} if record.graph_replays is not None else {}),
            "skipped_steps": self.skipped_steps,
            **(moe_metrics_of(*record.moe, self.mesh["pp"].get_group() if self.dims.pp_enabled else None)
               if has_moe else {}),
            **self.sampler.report(record.data_step),  # epochs (and each blend source's share)
        }

    def _roll_back(self) -> bool:
        """Loss spike (``train.spike_threshold``): reload the latest checkpoint and skip the data window from
        its step to the spike (LLaDA, Nie et al. 2025, sec. 2.3, describe this recovery). False without a checkpoint."""
        found = latest_checkpoint(self.run_dir, report=self._report)
        if found is None:
            return False
        spike_data_step = self.data_step
        self._load(found[1])
        self.data_offset = spike_data_step - self.step  # the next step trains on data after the spike
        self._report(f"loss spike at data step {spike_data_step - 1}: reloaded step {self.step}, "
                     f"data continues at step {self.data_step}")
        return True

    def _report(self, message: str) -> None:
        if self.is_rank0:
            print(message, flush=True)

    def _eval_metrics(self, metrics: dict) -> dict:
        sources = getattr(self.valid_set, "sources", None)  # data.blend: each source, then their weighted mean
        if sources:
            per = {name: (w, self.evaluate(part)) for name, w, part in sources}
            metrics = dict(metrics, **{f"val_nelbo/{n}": v for n, (_, v) in per.items() if v is not None})
            scored = [(w, v) for w, v in per.values() if v is not None]
            nelbo = sum(w * v for w, v in scored) / sum(w for w, _ in scored) if scored else None
        else:
            nelbo = self.evaluate()
        if nelbo is not None:
            metrics = dict(metrics, val_nelbo=nelbo, val_ppl_bound=math.exp(min(nelbo, 50.0)))
        return metrics

    def _emit(self, sinks, metrics: dict) -> None:
        for sink in sinks:
            sink.log(metrics)

    def sampling_unavailable_reason(self):
        """Why this layout draws no samples during training (None: it does): pipeline stages and context-parallel
        chunks hold parts of the model or the sequence, and TE's userbuffers (``parallel.tp_comm_overlap``) are
        sized for the training micro-batch."""
        p = self.cfg.parallel
        if self.pipeline is not None:
            return f"parallel.pp={self.dims.pp} splits the model into stages"
        if self.dims.cp_enabled:
            return f"parallel.cp={self.dims.cp} splits the sequence"
        if p.get("tp_comm_overlap", False) and self.cfg.model.backend == "te":
            return "parallel.tp_comm_overlap=true sizes TE's buffers for the training micro-batch"
        return None

    def _emit_samples(self, sinks, num: int) -> None:
        reason = self.sampling_unavailable_reason()
        if reason is not None:  # once a run: the docs say so, the console did not
            if self.is_rank0 and not self._told_no_samples:
                self._report(f"difflm: logger.num_samples={num}: no samples during training here ({reason}); "
                             "sample a checkpoint with difflm-generate")
                self._told_no_samples = True
            return
        samples = self.generate_samples(self.cfg.logger.sample_prompt, num)
        if not samples or not self.is_rank0:
            return
        for sink in sinks:
            sink.log_samples(self.step, samples)
        (self.run_dir / "samples.txt").write_text(
            "".join(f"--- step {self.step} sample {i} ---\n{s}\n" for i, s in enumerate(samples)), encoding="utf-8")


@dataclasses.dataclass
class _StepRecord:
    """A launched optimizer step whose outcome the host has not read yet (:meth:`Trainer.fit`)."""

    step: int
    data_step: int
    lr: float
    tokens: int
    log: bool
    values: torch.Tensor  # float64 [3] on the host once ``event`` has passed: loss, gradient norm, finite (1/0)
    event: Optional[torch.cuda.Event]
    graph_replays: Optional[int]
    moe: tuple = ([], None)  # a logging step's (MoE block indices, float64 [L, 4] statistics on the host)
    end_time: float = 0.0  # perf_counter when the host saw the step finish
    loss: float = math.nan
    grad_norm: float = math.nan


def _to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A pinned host copy of device tensor ``t``, made asynchronously (valid once the stream passes this point)."""
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclasses.dataclass
class _Progress:
    """What :meth:`Trainer.fit` carries from one settled step to the next."""

    window_start: float  # perf_counter where the tokens/s window started
    window_start_event: Optional[torch.cuda.Event] = None  # the same point on the device (GPU runs)
    window_tokens: int = 0
    skipped_in_a_row: int = 0
    loss_mean: Optional[float] = None
    roll_backs_in_a_row: int = 0  # train.spike_threshold: roll-backs since the last step that passed the check
