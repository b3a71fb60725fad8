"""Typed schema of a difflm run.

Every YAML file under ``difflm/conf`` is composed by Hydra into one :class:`RunConfig`. The schema is
registered in Hydra's ConfigStore (see :func:`register_schema`) and named first in the primary config's
defaults list, so a misspelt key or a value of the wrong type fails at compose time with OmegaConf's
message naming the key (Hydra docs, "Structured Configs: Config Store API" and "Schema").
Cross-key checks that a schema cannot express live in :mod:`difflm.config.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    """Llama-style transformer dimensions.

    ``vocab_size`` is filled in from the tokenizer at run time (padded to a multiple of
    ``vocab_multiple``), so model presets do not depend on the data.
    """

    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    ffn_hidden_size: int = 512
    head_dim: Optional[int] = None  # default hidden_size // num_heads
    vocab_size: Optional[int] = None  # from the tokenizer, padded
    vocab_multiple: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    tie_embeddings: bool = False
    init_std: float = 0.02
    backend: str = "torch"  # torch | te
    attention_backend: str = "sdpa"  # sdpa | te | flash | flex
    compile: bool = False  # torch.compile each block (backend=torch); see docs/performance.md


@dataclass
class ParallelConfig:
    """Parallel layout. Only ``single`` exists in v0; the keys are the ones later layouts use."""

    name: str = "single"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1


@dataclass
class PrecisionConfig:
    """Numeric precision of the training step (autocast dtype; parameters stay FP32)."""

    name: str = "fp32"  # fp32 | bf16 | fp16 | fp8
    fp8_recipe: str = "delayed"  # delayed | current | block | mxfp8 (see difflm.training.precision)
    fp8_amax_history_len: int = 1024  # delayed scaling: amax window (TE DelayedScaling default)
    fp8_weights: bool = False  # keep TE weights only in FP8 (te.quantized_model_init); benchmark only
    fp8_skip_first_last: bool = False  # run the first and the last block in BF16
    fp8_attention: bool = False  # FP8 inside te.DotProductAttention (recipe.fp8_dpa); attention_backend=te


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut into training windows."""

    name: str = "tinyshakespeare"
    path: str = "${difflm_asset:corpora/tinyshakespeare/input.txt}"  # file, directory or glob
    hf_dataset: Optional[str] = None  # a `datasets` name or saved-dataset directory instead of path
    hf_split: str = "train"
    tokenizer: str = "${difflm_asset:tokenizers/gpt-neox-20b}"  # HF hub name or local directory
    text_field: str = "text"  # JSONL / HF datasets column
    doc_separator: Optional[str] = "<|endoftext|>"  # splits .txt files into documents; null: one per file
    seq_len: int = 128
    valid_fraction: float = 0.05
    cache_dir: Optional[str] = None  # default: <run.dir>/data_cache
    num_proc: int = 0  # tokenizer threads, 0 = all cores


@dataclass
class ObjectiveConfig:
    """Training objective: ``mdlm`` (masked diffusion, LLaDA/MDLM) or ``ar`` (next token)."""

    name: str = "mdlm"
    eps: float = 1e-3  # minimum mask probability, p = (1 - eps) t + eps
    t_sampling: str = "iid"  # iid | antithetic | stratified (across the global batch)
    loss_norm: str = "token"  # token | sequence
    random_length_prob: float = 0.01
    length_multiple: int = 1  # random lengths are rounded to a multiple of this (for SP/CP splits)


@dataclass
class OptimConfig:
    """AdamW (decoupled weight decay; Loshchilov & Hutter 2019)."""

    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; <= 0 disables clipping
    fused: Optional[bool] = None  # None: fused where the device supports it


@dataclass
class ScheduleConfig:
    """Learning-rate schedule as a multiplier of ``optim.lr`` (see :mod:`difflm.training.schedule`)."""

    name: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly


@dataclass
class LoggerConfig:
    """Metrics sinks. ``metrics.jsonl`` is always written; ``wandb`` adds a Weights & Biases run."""

    name: str = "console"  # console | wandb
    log_every: int = 10
    progress_bar: bool = True
    project: str = "difflm"
    entity: Optional[str] = None
    mode: str = "offline"  # online | offline | disabled
    num_samples: int = 2  # generated samples logged at eval steps (wandb) and at the end
    sample_prompt: str = "ROMEO:"


@dataclass
class TrainConfig:
    max_steps: int = 300
    global_batch_size: int = 8
    micro_batch_size: int = 8
    eval_every: int = 100
    eval_batches: int = 8
    eval_mc_samples: int = 4
    save_every: int = 100
    seed: int = 1234
    sample_at_end: bool = True


@dataclass
class RunDirConfig:
    dir: str = "outputs/${now:%Y-%m-%d_%H-%M-%S}"


@dataclass
class GenerateConfig:
    """Sampling settings (LLaDA, Nie et al. 2025, Alg. 4-5)."""

    length: int = 64
    steps: int = 64
    block_length: int = 64
    remasking: str = "low_confidence"  # low_confidence | random
    temperature: float = 0.0
    seed: int = 0


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    gen: GenerateConfig = field(default_factory=GenerateConfig)
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class GenerateRunConfig:
    """Command line of ``difflm-generate``: the model, tokenizer and objective come from ``run.dir``."""

    run: RunDirConfig = field(default_factory=lambda: RunDirConfig(dir="???"))
    prompt: str = ""
    step: Optional[int] = None  # checkpoint step; default the latest
    gen: GenerateConfig = field(default_factory=GenerateConfig)
    device: str = "auto"


def register_schema() -> None:
    """Register :class:`RunConfig` as ``run_schema`` and :class:`GenerateRunConfig` as ``generate_schema``."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(name="generate_schema", node=GenerateRunConfig)
