"""Typed schema of a difflm run.

Every YAML file under ``conf/`` (shipped in the wheel as ``difflm/conf``) is composed by Hydra into one :class:`RunConfig`. The schema is
registered in Hydra's ConfigStore (see :func:`register_schema`) and named first in the primary config's
defaults list, so a misspelt key or a value of the wrong type fails at compose time with OmegaConf's
message naming the key (Hydra docs, "Structured Configs: Config Store API" and "Schema"). On the command line
:func:`difflm.cli.check_overrides` refuses a misspelt key or preset first, naming the closest one. A key added with
``+`` or ``++`` is let through by Hydra; :func:`check_known_keys` refuses it in every entry point.
Cross-key checks that a schema cannot express live in :mod:`difflm.config.validate`.
"""
from __future__ import annotations

import dataclasses
import difflib
import glob
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from difflm.errors import DifflmError


@dataclass
class MoEConfig:
    """Mixture-of-experts MLP (``model.moe.*``; docs/moe.md). ``num_experts=0`` keeps the dense SwiGLU MLP.

    Every block's MLP becomes ``num_experts`` SwiGLU experts of width ``ffn_hidden_size`` with a top-``top_k``
    token-choice router, plus ``num_shared_experts`` always-on experts (one fused SwiGLU of width
    ``num_shared_experts * ffn_hidden_size``). Balancing: the Switch/GShard auxiliary loss
    (``aux_loss_coeff``), DeepSeek-V3's auxiliary-loss-free bias (``bias_update_rate``), or both.
    """

    num_experts: int = 0  # 0 = dense MLP (model.ffn_hidden_size)
    top_k: int = 2  # experts per token
    ffn_hidden_size: int = 0  # width of each expert; 0 = model.ffn_hidden_size
    num_shared_experts: int = 0  # always-on experts (DeepSeekMoE), fused into one SwiGLU
    score_func: str = "softmax"  # softmax | sigmoid (router scores)
    norm_topk_prob: bool = False  # renormalise the top-k scores to sum to 1
    aux_loss_coeff: float = 0.01  # Switch/GShard load-balancing loss coefficient (0 = off)
    z_loss_coeff: float = 0.001  # ST-MoE router z-loss coefficient (0 = off)
    bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free bias step gamma (0 = off)
    capacity_factor: Optional[float] = None  # null = no token dropping; else tokens per expert <= cf * T * k / E
    # what the aux loss balances: each micro-batch's own expert counts, or the counts of the step's global batch
    # so far (all micro-batches and data-parallel ranks; Qiu et al. 2025, Megatron-LM's global_aux_loss)
    balance_over: str = "micro_batch"  # micro_batch | global_batch
    # Group-limited routing (DeepSeek-V3 tech report sec. 2.1.2 "node-limited routing"; HF DeepseekV3TopkRouter,
    # LLaDA 2's n_group / topk_group): experts split into n_group groups, each scored by the sum of its top-2
    # (score + bias) values, top-k experts taken among the topk_group best groups. n_group=1: plain top-k.
    n_group: int = 1  # expert groups (divides num_experts); 1 = no group limit
    topk_group: int = 1  # groups kept per token (1 <= topk_group <= n_group); unused when n_group=1
    routed_scaling_factor: float = 1.0  # gate weights x this (DeepSeek-V3 / LLaDA 2 configs: 2.5)
    first_k_dense: int = 0  # first k blocks keep the dense SwiGLU of model.ffn_hidden_size (HF first_k_dense_replace)
    shared_ffn_hidden_size: int = 0  # width of the fused shared experts; 0 = num_shared_experts * expert width
    # the gating weights are the chosen (scores + bias), not the scores alone: LLaDA-MoE's expert_bias (its
    # OLMoE-style block adds the bias to the softmax probabilities before top-k and keeps it in the weights)
    bias_in_weights: bool = False
    # with precision=fp8, the routed experts' forward and input-gradient GEMMs in FP8 (row-wise scales, through
    # torch._scaled_grouped_mm; weight gradients BF16); false: the experts run BF16 inside the FP8 region
    fp8_experts: bool = False
    # the routed experts on quack's variable-length grouped GEMMs: SwiGLU and its derivative in the GEMM epilogues,
    # the weight gradients accumulated into FP32 main_grad by the GEMMs (Hopper/Blackwell, quack, the TE kernel set)
    fused_experts: Any = False  # auto | true | false (difflm.model.auto_kernels; conf/train.yaml sets auto)
    # on CUDA, the gate-weighted sum of each token's k expert outputs as one Triton kernel each way, reading the
    # expert-sorted rows (difflm.kernels.moe_combine); false: a gather to [T, k, d] and a batched GEMM
    fused_combine: bool = True


EMBEDDED_CORPUS = "corpora/tinyshakespeare/input.txt"  # data.path's default, shipped in difflm/assets


# the model.* keys that difflm-import writes and prints for an imported checkpoint: the architecture its tensors
# depend on (and for MoE the routing's training settings); the other model.* keys choose kernels, compilation, memory
MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "head_dim", "rope_base",
              "partial_rotary_factor", "norm_eps", "qk_norm", "qkv_bias", "tie_embeddings", "shift_logits",
              "vocab_multiple")
MOE_KEYS = ("num_experts", "top_k", "ffn_hidden_size", "num_shared_experts", "shared_ffn_hidden_size", "score_func",
            "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense", "aux_loss_coeff",
            "z_loss_coeff", "bias_update_rate", "bias_in_weights", "capacity_factor", "balance_over")


def override_value(value) -> str:
    """``value`` as it is written on a Hydra command line (``key=<this>``): null, true / false, lists as [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    return str(value)


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
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * f dims of each head (LLaDA 2.0: 0.5)
    norm_eps: float = 1e-5
    qk_norm: bool = True
    tie_embeddings: bool = False
    init_std: float = 0.02
    # auto (conf/train.yaml's default): the fastest kernels installed and valid for the run, chosen once before the
    # model is built (difflm.model.auto_kernels.choose_kernels; the run's config.yaml records the choice). The values
    # here are those of a model built in Python without a run (plain PyTorch).
    backend: str = "torch"  # auto | torch | te
    attention_backend: str = "sdpa"  # auto | sdpa | te | flash | flex
    compile: bool = False  # torch.compile each block (backend=torch); see docs/performance.md
    fused_qkv: bool = True  # split/QK-norm/RoPE as Triton kernels on CUDA (difflm.kernels.qkv_triton); false: eager
    fused_mlp: Any = False  # auto | true | false. backend=te, BF16: norm + SwiGLU MLP + residual adds on quack's fused GEMMs (difflm.kernels.quack_mlp)
    fused_mlp_autotune: Any = False  # auto | true | false. fused_mlp: quack autotunes each training GEMM shape once (minutes; disk cache)
    fused_cross_entropy: bool = True  # CUDA + TE installed: TE's fused CE kernel, no FP32 [N, V] logits (objectives.cross_entropy)
    fuse_wgrad_accumulation: bool = True  # backend=te: weight-grad GEMMs accumulate into FP32 .grad (not under FSDP/PP)
    qkv_bias: bool = False  # bias on the fused QKV projection (Qwen2 imports)
    shift_logits: bool = False  # Dream: logits at i come from position i - 1 (AR-initialised diffusion)
    last_block_loss_rows: bool = True  # diffusion: the last block's queries and MLP at the loss rows only (same logits)
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts (num_experts > 0)
    auto_reason: Optional[str] = None  # written by auto: what it chose for the keys above and why (read-only)


@dataclass
class ParallelConfig:
    """Parallel layout over a DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); see docs/parallel.md. Expert
    parallelism (``ep``) is not a sixth dimension: it splits ``dp_shard x cp`` into (efsdp, ep) for the experts.

    The degrees multiply to the number of processes; ``dp_shard=-1`` (or ``dp_replicate=-1``) fills the ranks
    the others leave.
    """

    name: str = "single"
    dp_replicate: int = 1  # replicas (DDP; HSDP with dp_shard > 1)
    dp_shard: int = 1  # FSDP2 shard group size; -1 = the remaining ranks
    tp: int = 1  # tensor parallel (DTensor; TE's tp_group with model.backend=te)
    pp: int = 1  # pipeline stages (torch.distributed.pipelining)
    cp: int = 1  # context parallel (sequence split for attention; CUDA only)
    ep: int = 1  # expert parallel (model.moe): experts split over ep ranks of dp_shard x cp (docs/moe.md)
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved schedules: >= 2)
    sequence_parallel: bool = True  # with tp > 1: norms/residuals sharded over the sequence (Megatron SP)
    activation_checkpointing: str = "none"  # none | selective (every 2nd block) | full
    compile: bool = False  # torch.compile each block after TP/AC, before FSDP
    # data-parallel levers (docs/parallel.md "Data-parallel levers"); the defaults keep the measured behaviour
    reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of FSDP2's gradient reduce-scatter / all-reduce
    reshard_after_forward: bool = True  # FSDP2: free gathered blocks after forward (false: keep them to backward)
    fsdp_prefetch: int = 0  # 0: FSDP2's implicit prefetch; n >= 1: all-gather the next n blocks explicitly
    grad_sync: str = "last"  # last: reduce gradients in the last micro-batch's backward | every: in every one
    tp_comm_overlap: bool = False  # overlap SP all-gather/reduce-scatter with the GEMMs (TE userbuffers / async TP)


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
class BlendSource:
    """One corpus of a ``data.blend`` (docs/data.md): read like ``data.path``, drawn with probability ``weight``."""

    path: str = "???"  # .txt/.jsonl/.parquet file, directory or glob, or difflm-preprocess shards
    weight: float = 1.0  # > 0; weights are normalised to sum to 1
    name: Optional[str] = None  # in metrics (val_nelbo/<name>, data_share/<name>); default: the path's base name


def _default_name(path: str) -> str:
    """The last path component before any glob, without its extension: ``/d/web/*.jsonl`` -> ``web``."""
    kept = []
    for part in os.path.normpath(path).split(os.sep):
        if glob.has_magic(part):
            break
        kept.append(part)
    return os.path.splitext(kept[-1])[0] if kept else ""


def blend_entries(blend) -> list[tuple[str, str, float]]:
    """(name, path, weight) of every ``data.blend`` entry; names default to the path's base name (made unique).

    Raises: DifflmError for an entry without a path, a weight that is not > 0, or a repeated name.
    """
    out, seen = [], set()
    for i, entry in enumerate(blend):
        entry = dataclasses.asdict(entry) if dataclasses.is_dataclass(entry) else dict(entry)
        path, weight, name = entry.get("path"), entry.get("weight", 1.0), entry.get("name")
        if not path or path == "???":
            raise DifflmError(f"data.blend[{i}] has no path: give each entry {{path: ..., weight: ...}}")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            weight = float("nan")
        if not weight > 0 or weight == float("inf"):
            raise DifflmError(f"data.blend[{i}].weight={entry.get('weight')!r} must be a number > 0 (weights are "
                              "normalised to sum to 1)")
        if name is None:
            name = _default_name(str(path)) or f"source{i}"
            candidate, n = name, 1
            while candidate in seen:
                n += 1
                candidate = f"{name}_{n}"
            name = candidate
        elif name in seen:
            raise DifflmError(f"data.blend[{i}].name={name!r} is used twice: give every source its own name")
        seen.add(name)
        out.append((str(name), str(path), weight))
    return out


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut into training windows."""

    name: str = "tinyshakespeare"
    # .txt/.jsonl/.parquet file, directory or glob; or difflm-preprocess output / Megatron .bin/.idx shards;
    # null (the experiments that leave the corpus to you) is refused unless hf_dataset or blend is given
    path: Optional[str] = f"${{difflm_asset:{EMBEDDED_CORPUS}}}"
    hf_dataset: Optional[str] = None  # a `datasets` name or saved-dataset directory instead of path
    hf_split: str = "train"
    tokenizer: str = "${difflm_asset:tokenizers/gpt-neox-20b}"  # HF hub name or local directory
    text_field: str = "text"  # JSONL / HF datasets column
    doc_separator: Optional[str] = "<|endoftext|>"  # splits .txt files into documents; null: one per file
    seq_len: int = 128
    valid_fraction: float = 0.05
    cache_dir: Optional[str] = None  # default: <run.dir>/data_cache
    num_proc: int = 0  # tokenizer threads, 0 = all cores
    intra_document_attention: bool = False  # packed documents do not attend to each other (block-diagonal mask)
    prompt_field: Optional[str] = None  # SFT: JSONL field of the prompt (objective=sft); null = plain text
    response_field: str = "response"  # SFT: JSONL field of the response
    chat_template: bool = False  # SFT: wrap the prompt with the tokenizer's apply_chat_template
    sft_packing: bool = False  # SFT: pack several pairs into each window (with intra_document_attention: kept apart)
    # SFT: JSONL field holding multi-turn conversations, a list of {role, content} turns (TRL's conversational
    # format); the loss is on the assistant turns only (difflm/data/conversations.py); null = prompt/response pairs
    messages_field: Optional[str] = None
    encoding: str = "utf-8"  # text encoding of the data files (strict: undecodable bytes are an error)
    blend: list[BlendSource] = field(default_factory=list)  # a mixture of corpora; replaces path when non-empty
    max_train_tokens: Optional[int] = None  # unique training tokens: the first N // seq_len windows; null = all


@dataclass
class ObjectiveConfig:
    """Training objective: ``mdlm`` (masked diffusion, LLaDA/MDLM), ``ar`` (next token), ``bd3lm`` (block
    diffusion, Arriola et al. 2025) or ``sft`` (masked diffusion on responses). See docs/objectives_and_sampling.md."""

    name: str = "mdlm"
    eps: float = 1e-3  # time floor: t' = (1 - eps) t + eps (linear: minimum mask probability)
    schedule: str = "linear"  # linear | cosine | loglinear (masking schedule and its NELBO weight)
    block_size: int = 16  # bd3lm: tokens per block (1 = AR, data.seq_len = MDLM)
    t_sampling: str = "iid"  # iid | antithetic | stratified (across the global batch)
    loss_norm: str = "token"  # token | sequence
    random_length_prob: float = 0.01
    length_multiple: int = 1  # random lengths are rounded to a multiple of this (for SP/CP splits)
    # AR-to-diffusion adaptation (docs/adaptation.md; difflm/objectives/adaptation.py). Defaults leave the objective as is.
    attention_anneal_steps: int = 0  # DiffuLLaMA (Gong et al. 2025, sec. 3.2): causal -> bidirectional over N steps
    block_schedule: Optional[List[List[int]]] = None  # bd3lm: [[steps, block_size], ...] phases (LLaDA 2.0 WSD)
    complementary_masks: bool = False  # Fast-dLLM v2 / LLaDA 2.0: each row under mask M and its complement ~M
    weighting: str = "nelbo"  # nelbo (1/p) | cart (Dream, Ye et al. 2025, eq. 3: w = 1/2 sum_i [x_t^i clean] Geo(p,|n-i|-1))
    cart_p: float = 0.1  # CART's geometric parameter p in (0, 1]
    diffusion_loss_weight: float = 1.0  # hybrid: weight of the diffusion CE on x_t
    ar_loss_weight: float = 0.0  # hybrid (Megatron-Bridge ar_to_dlm): weight of the AR CE on the clean copy x_0
    # bd3lm: how the clean half x_0 of [x_t ; x_0] attends: block_causal (BD3-LM) | causal (Megatron-Bridge sbd_block_diff)
    clean_attention: str = "block_causal"
    t_lo: float = 0.0  # truncated noise range: t ~ U(t_lo, t_hi) in training (evaluation keeps U(0, 1))
    t_hi: float = 1.0


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
    sample_temperature: float = 1.0  # samples 1.. when gen.temperature=0 (else all would copy greedy sample 0)


@dataclass
class TrainConfig:
    # the run's length in optimizer steps; null (or left at this default) when train.epochs sets it
    max_steps: Optional[int] = 300
    epochs: Optional[float] = None  # passes over the training windows; sets max_steps = ceil(epochs * windows / batch)
    global_batch_size: int = 8
    micro_batch_size: Any = 8  # samples per micro-batch and rank, or auto (difflm.training.auto_batch)
    auto_batch_budget_gib: Optional[float] = None  # micro_batch_size=auto: plan against this many GiB (null: free memory)
    auto_batch_margin: float = 0.1  # micro_batch_size=auto: share of the free memory kept out of the budget
    auto_batch_reason: Optional[str] = None  # written by micro_batch_size=auto: what it chose and why (read-only)
    eval_every: int = 100
    # validation windows per evaluation (however train.micro_batch_size batches them); null: 64 on a GPU, sized to
    # the run on a CPU (difflm.training.eval_size)
    eval_windows: Optional[int] = None
    eval_batches: Optional[int] = None  # removed (counted micro-batches): refused with the eval_windows to set
    eval_mc_samples: int = 4
    save_every: int = 100
    seed: int = 1234
    sample_at_end: bool = True
    # the run must continue a checkpoint in run.dir (difflm-import's step_0, an earlier run's): the adaptation recipes
    # set it, so that a run.dir without the imported AR model is refused instead of training from random weights
    require_checkpoint: bool = False
    async_save: bool = False  # checkpoints with torch.distributed.checkpoint.async_save (staged, written in background)
    expandable_segments: bool = True  # CUDA allocator: expandable segments (difflm.training.allocator)
    cuda_graphs: bool = False  # TE blocks replayed from CUDA graphs (difflm.training.cuda_graphs); one process
    # operating long runs (docs/operations.md, "Operating long runs")
    keep_last: int = 0  # keep this many most recent checkpoints (0 = keep all)
    keep_every: int = 0  # ... plus every checkpoint whose step is a multiple of this, for good
    checkpoint_checksums: bool = False  # SHA-256 of every checkpoint file in its manifest (sizes always)
    time_limit: float = 0.0  # wall-clock seconds from the process's start; save and exit (status 75) before it. 0 = none
    step_timeout: float = 0.0  # seconds; a slower step dumps every thread's stack to run.dir and ends. 0 = off
    collective_timeout: int = 1800  # seconds before a stuck collective (NCCL/gloo) fails
    max_skipped_steps: int = 5  # consecutive non-finite steps (skipped) before the run saves and stops
    spike_threshold: float = 0.0  # loss > threshold x running mean: reload last checkpoint, skip that data. 0 = off


@dataclass
class ProfileConfig:
    """torch.profiler traces and CUDA memory snapshots in ``<run.dir>/profile`` (see difflm.training.profiling)."""

    enabled: bool = False
    wait: int = 5
    warmup: int = 2
    active: int = 3
    memory_snapshot: bool = False
    memory_snapshot_step: int = 3


@dataclass
class RunDirConfig:
    dir: str = "outputs/${now:%Y-%m-%d_%H-%M-%S}-${difflm_run_id:}"  # unique per process: same-second starts differ


@dataclass
class GenerateConfig:
    """Sampling settings (LLaDA, Nie et al. 2025, Alg. 4-5)."""

    length: int = 64
    # denoising steps in all; null: min(64, length) (difflm-rl: 32, RL_STEPS), rounded down to a multiple of the
    # LLaDA blocks (difflm.sampling.options.resolve_steps); a value given is honoured, or refused where it does not fit
    steps: Optional[int] = None
    # LLaDA's semi-autoregressive blocks; null: the run's block size, i.e. objective.block_size of a bd3lm run (which
    # decodes only in its own blocks: another value is refused), else the largest divisor of length up to 64
    # (difflm-rl: 32, RL_BLOCK_LENGTH): length itself up to 64, 64 for 128, 48 for 96; a value given is honoured
    # (difflm.sampling.options.resolve_block_length)
    block_length: Optional[int] = None
    remasking: str = "low_confidence"  # low_confidence | random | margin | entropy | remdm
    # remasking=remdm (ReMDM, Wang et al. 2025, arXiv:2503.00307, difflm.sampling.remdm): eta of the sigma_t schedule,
    # the cap of sigma_t (cap) or its share of sigma_t^max (rescale, <= 1); 0 = no remasking
    remdm_sigma: float = 0.0
    remdm_schedule: str = "cap"  # cap | rescale
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off (nucleus sampling, Holtzman et al. 2020)
    cfg_scale: float = 0.0  # classifier-free guidance (LLaDA): unconditional = prompt masked; 0 = off
    threshold: Optional[float] = None  # Fast-dLLM parallel decoding: unmask every token above this confidence
    cache: str = "none"  # none | prefix | dual: Fast-dLLM block-level KV cache (bd3lm: exact prefix cache)


@dataclass
class LoraConfig:
    """LoRA adapters (``lora.*``; docs/lora.md, :mod:`difflm.model.lora`): Hu et al. 2021, "LoRA: Low-Rank Adaptation
    of Large Language Models", eq. 3, ``h = W x + (alpha / rank) B A x`` with W frozen. ``rank=0`` trains every weight.

    A group of its own (``lora=none|attn|attn_mlp``), not ``model.*``: the adapters are a converter of the built model
    that the export merges away (the network a checkpoint and an export describe is the ``model``), and not
    ``train.*``: eval, generate and export read them from the run too."""

    name: str = "none"
    rank: int = 0  # r; 0 = off (full fine-tuning)
    alpha: float = 16.0  # scaling = alpha / rank (peft LoraConfig.lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input (peft lora_dropout); model.backend=torch only
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])  # subset of these four
    moe: str = "freeze_experts"  # freeze_experts | adapt_experts (routed + shared experts); the router is frozen


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters (rank 0: off)
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class KernelOverrides:
    """Kernels to run a trained checkpoint with (null: the run's own ``model.backend`` / ``model.attention_backend``).
    Checkpoints move between kernel sets, so e.g. a run trained with ``te`` samples on a CPU with
    ``kernels.backend=torch kernels.attention_backend=sdpa``."""

    backend: Optional[str] = None  # torch | te
    attention_backend: Optional[str] = None  # sdpa | te | flash | flex


@dataclass
class GenerateRunConfig:
    """Command line of ``difflm-generate``: the model, tokenizer and objective come from ``run.dir``."""

    run: RunDirConfig = field(default_factory=lambda: RunDirConfig(dir="???"))
    prompt: str = ""  # any text: commas and brackets need no Hydra quoting (difflm.cli.quote_free_text)
    prompt_file: Optional[str] = None  # a UTF-8 text file whose contents are the prompt (instead of prompt=)
    # wrap the prompt in the tokenizer's chat template (difflm.data.sft.chat_prompt_ids); null: as the run trained
    # (objective=sft with data.chat_template=true), false: the raw prompt
    chat_template: Optional[bool] = None
    # infilling: each occurrence in the prompt (and of the tokenizer's own mask token text) is one mask token that
    # the diffusion samplers fill, the rest of the prompt kept (Dream's mask tokens in the input); null: off
    mask_placeholder: Optional[str] = "<|mask|>"
    step: Optional[int] = None  # checkpoint step; default the latest
    gen: GenerateConfig = field(default_factory=GenerateConfig)
    device: str = "auto"
    kernels: KernelOverrides = field(default_factory=lambda: KernelOverrides())


@dataclass
class ExportRunConfig:
    """Command line of ``difflm-export`` (:mod:`difflm.interop.export`): a run's checkpoint -> a HF directory."""

    run: RunDirConfig = field(default_factory=lambda: RunDirConfig(dir="???"))
    out: str = "???"  # the Hugging Face directory to write
    step: Optional[int] = None  # checkpoint step; default the latest
    dtype: str = "fp32"  # fp32 | bf16 | fp16: dtype of the saved weights
    max_shard_size: str = "5GB"  # larger exports are split into shards + model.safetensors.index.json
    overwrite: bool = False  # replace an earlier difflm-export output in out (never another folder)
    lora_format: str = "merge"  # LoRA runs: merge (adapters into the weights) | peft (base + out/adapter, docs/lora.md)
    format: str = "difflm"  # difflm (own names + modeling file) | llada_moe | llada2 (the releases' layouts, MoE runs)


# the objectives difflm-import writes a run for (``objective=``; null: ar for a causal difflm export, else mdlm)
IMPORT_OBJECTIVES = ("mdlm", "ar")


def import_objective_error(name: str) -> Optional[str]:
    """The one-line refusal of ``objective=<name>`` on difflm-import's command line, or None for one it writes
    (:data:`IMPORT_OBJECTIVES`): the same answer for another preset of the objective group (``bd3lm``, ``sft``:
    trained from an ``mdlm`` import) and for a name that is no preset."""
    if name in IMPORT_OBJECTIVES:
        return None
    accepted = " or ".join(f"objective={o}" for o in IMPORT_OBJECTIVES)
    message = (f"objective={name} is not an objective difflm-import writes: it writes {accepted} runs (without "
               "objective=: ar for a causal difflm export, else mdlm)")
    if name in ("bd3lm", "sft"):
        article = "an" if name == "sft" else "a"
        return (f"{message}; for {article} {name} run, import with objective=mdlm and add objective={name} to the "
                "difflm-train command it prints")
    close = difflib.get_close_matches(name, IMPORT_OBJECTIVES, n=1)
    return message + (f"; did you mean objective={close[0]}?" if close else f": set {accepted}, or drop objective=")


@dataclass
class ImportRunConfig:
    """Command line of ``difflm-import`` (:mod:`difflm.interop.hf_import`): a HF causal LM -> a difflm run dir."""

    hf: str = "???"  # local directory or hub name (Llama, Qwen2, Qwen3 or a difflm export)
    revision: Optional[str] = None  # hub revision
    run: RunDirConfig = field(default_factory=lambda: RunDirConfig(dir="???"))
    objective: Optional[ObjectiveConfig] = None  # group objective=mdlm|ar; null: ar for a causal difflm export, else mdlm
    shift_logits: bool = False  # Dream's shifted logits (mdlm from an AR model)
    vocab_multiple: int = 128  # the embedding is padded to a multiple of this (model.vocab_multiple)
    mask_token: str = "<|mdm_mask|>"  # added to the tokenizer when it has no mask token
    overwrite: bool = False  # replace a run dir that already holds checkpoints


@dataclass
class EvalConfig:
    """Settings of ``difflm-eval``."""

    mc_samples: int = 8  # antithetic draws of t per window (1 for ar: the NLL is exact)
    batch_size: int = 8
    max_windows: int = 0  # 0 = every window of the file
    seed: int = 0
    output: Optional[str] = None  # also write the result as JSON here


@dataclass
class EvalDataConfig:
    """Text to evaluate on; the tokenizer, window length and objective come from the run."""

    path: str = "???"  # .txt/.jsonl file, directory or glob (sft runs: a JSONL file of prompt/response pairs)
    text_field: Optional[str] = None  # JSONL / parquet column (default: the run's data.text_field)
    # splits .txt files into documents (default "<as the run>": the run's data.doc_separator; null: one per file)
    doc_separator: Optional[str] = "<as the run>"
    seq_len: Optional[int] = None  # default: the run's data.seq_len
    cache_dir: Optional[str] = None  # default: a temporary directory
    encoding: Optional[str] = None  # text encoding of the files (default: the run's data.encoding)
    prompt_field: Optional[str] = None  # sft runs: JSONL prompt field (default: the run's data.prompt_field)
    response_field: Optional[str] = None  # sft runs: JSONL response field (default: the run's data.response_field)
    chat_template: Optional[bool] = None  # sft runs: wrap prompts in the chat template (default: as the run)
    messages_field: Optional[str] = None  # sft runs: JSONL conversations field (default: the run's data.messages_field)


@dataclass
class EvalRunConfig:
    """Command line of ``difflm-eval``: the NELBO / perplexity bound of a trained run on a text file."""

    run: RunDirConfig = field(default_factory=lambda: RunDirConfig(dir="???"))
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    step: Optional[int] = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"
    kernels: KernelOverrides = field(default_factory=lambda: KernelOverrides())


@dataclass
class PreprocessConfig:
    """Command line of ``difflm-preprocess`` (:mod:`difflm.data.shards`): text -> Megatron .bin/.idx shards."""

    input: Optional[str] = None  # .txt/.jsonl/.parquet file, directory or glob
    hf_dataset: Optional[str] = None  # or a `datasets` hub name / save_to_disk directory
    hf_split: str = "train"
    output: str = "???"  # directory of the shards and manifest.json; data.path=<output> trains on it
    tokenizer: str = "${difflm_asset:tokenizers/gpt-neox-20b}"  # as data.tokenizer
    text_field: str = "text"  # JSONL / parquet / datasets column
    doc_separator: Optional[str] = "<|endoftext|>"  # splits .txt files into documents; null: one per file
    encoding: str = "utf-8"
    workers: int = 0  # tokenizer processes; 0 = one per CPU core
    shard_mb: float = 256.0  # input megabytes per shard (whole documents; small files share one)
    overwrite: bool = False  # replace the shards of other inputs/settings in output (only difflm-preprocess files)
    progress_bar: bool = True


@dataclass
class InitConfig:
    """The trained run a post-training run starts from (its model, tokenizer and objective)."""

    run_dir: str = "???"  # a difflm-train / difflm-import run directory
    step: Optional[int] = None  # its checkpoint step; default the latest


@dataclass
class AlgorithmConfig:
    """``algorithm=grpo|dpo`` of difflm-rl (docs/post_training.md)."""

    name: str = "grpo"  # grpo (Shao et al. 2024, eq. 3) | dpo (Rafailov et al. 2023, eq. 7, on ELBOs: VRPO)
    prompts_per_step: int = 2  # grpo: prompts per rollout batch; dpo: preference pairs per step
    group_size: int = 4  # grpo: completions per prompt (G)
    num_inner: int = 2  # grpo: optimizer updates per rollout batch (mu), each with a fresh estimate key
    clip_low: float = 0.2  # grpo: eps_low of the clipped ratio (PPO's 0.2)
    clip_high: float = 0.2  # grpo: eps_high (DAPO's clip-higher: 0.28)
    beta: float = 0.04  # grpo: k3 KL weight (0: no reference); dpo: the DPO temperature
    loss_norm: str = "token"  # grpo: token (d1 / DiffuCoder) | sequence (GRPO eq. 3)
    scale_rewards: bool = True  # grpo: divide advantages by the group std (false: Dr. GRPO)
    reference: str = "frozen_copy"  # frozen_copy | adapters_off (LoRA: the base with adapters off) | none


@dataclass
class EstimatorConfig:
    """``estimator=one_step|coupled|mc_elbo``: the sequence log-likelihood estimator (difflm.posttrain.loglik)."""

    name: str = "coupled"
    prompt_mask_prob: float = 0.15  # one_step: d1's prompt masking probability
    t_min: float = 0.2  # coupled: t ~ U[t_min, t_max] (DiffuCoder: [0.2, 0.8])
    t_max: float = 0.8
    full_mask_weight: float = 0.0  # coupled: weight of the fully masked pass (DiffuCoder's code: 0.5)
    num_t: int = 2  # mc_elbo: timesteps, one mask each (VRPO)
    eps: float = 1e-3  # mc_elbo: time floor t' = (1 - eps) t + eps, as objective.eps
    antithetic: bool = True  # mc_elbo: stratified t_k = (u + k / num_t) mod 1


@dataclass
class RewardConfig:
    """``reward=gsm8k|format``: weighted reward terms, each a Hydra ``_target_`` callable (difflm.posttrain.rewards)."""

    terms: list = field(default_factory=list)


@dataclass
class PosttrainDataConfig:
    """Prompts (grpo) or preference triples (dpo): JSONL files or a HF dataset (difflm.posttrain.data)."""

    path: Optional[str] = None  # .jsonl file, directory or glob
    hf_dataset: Optional[str] = None  # or a datasets hub name / save_to_disk directory
    hf_split: str = "train"
    prompt_field: str = "prompt"
    answer_field: Optional[str] = None  # grpo: the reference answer handed to the reward (GSM8K: answer)
    chosen_field: str = "chosen"  # dpo
    rejected_field: str = "rejected"  # dpo
    prompt_template: str = "{prompt}"  # the prompt text; {prompt} is the record's prompt
    # wrap prompts in the tokenizer's chat template (as data.chat_template of sft); null: as init.run_dir was trained
    # (difflm.generate.run_chat_template: an objective=sft run with data.chat_template=true)
    chat_template: Optional[bool] = None
    max_prompt_tokens: int = 256  # prompts keep their last tokens
    max_response_tokens: int = 256  # dpo: responses are cut to this
    eval_records: int = 8  # the first records are held out for evaluation (held-out reward / ELBO margin)


@dataclass
class PosttrainRunConfig:
    """``train.*`` of difflm-rl."""

    max_steps: int = 100
    seed: int = 1234
    save_every: int = 50
    eval_every: int = 50
    keep_last: int = 0


# difflm-rl's gen.block_length=null on an init run without blocks of its own (mdlm, sft): the rollouts' LLaDA blocks
# are the largest divisor of gen.length up to this (a bd3lm init run's are its objective.block_size)
RL_BLOCK_LENGTH = 32
# difflm-rl's gen.steps=null: min(RL_STEPS, gen.length), rounded down to a multiple of the rollouts' blocks
RL_STEPS = 32


@dataclass
class RLRunConfig:
    """Command line of ``difflm-rl`` (:mod:`difflm.rl`): GRPO or DPO on a trained run."""

    init: InitConfig = field(default_factory=InitConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: PosttrainDataConfig = field(default_factory=PosttrainDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(name="constant", warmup_steps=0))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: PosttrainRunConfig = field(default_factory=PosttrainRunConfig)
    gen: GenerateConfig = field(default_factory=lambda: GenerateConfig(length=64, temperature=1.0))
    run: RunDirConfig = field(default_factory=RunDirConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # layout (docs/post_training.md "Layouts")
    lora: LoraConfig = field(default_factory=LoraConfig)  # fresh adapters on a full init run (rank 0: none)
    device: str = "auto"


def register_schema() -> None:
    """Register the schemas of the entry points: ``run_schema`` (:class:`RunConfig`), ``generate_schema``,
    ``export_schema`` and ``import_schema``."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(name="generate_schema", node=GenerateRunConfig)
    cs.store(name="eval_schema", node=EvalRunConfig)
    cs.store(name="export_schema", node=ExportRunConfig)
    cs.store(name="import_schema", node=ImportRunConfig)
    cs.store(name="preprocess_schema", node=PreprocessConfig)
    cs.store(name="rl_schema", node=RLRunConfig)


def unknown_keys(node, path: str = ""):
    """Yield ``(dotted key, schema class)`` for every key under ``node`` that the dataclass typing its node lacks.

    A node typed ``dict`` (a free-form mapping in a schema) takes any key; only the nodes below it are checked.
    """
    schema = OmegaConf.get_type(node)
    if schema is None:  # null or ???
        return
    names = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    for key in range(len(node)) if schema is list else node.keys():
        dotted = f"{path}.{key}" if path else str(key)
        if names is not None and key not in names:
            yield dotted, schema
            continue
        child = node._get_node(key)  # not node[key]: that would resolve interpolations and raise on ???
        if OmegaConf.is_config(child):
            yield from unknown_keys(child, dotted)


def check_known_keys(cfg) -> None:
    """Refuse a composed config holding a key its schema does not have.

    Hydra's ``+key=value`` and ``++key=value`` add a key even to a struct structured config (``OmegaConf.update``
    with ``force_add=True`` lifts the struct flag), so ``+train.max_stepz=5`` would compose, be saved with the run
    and never be read. Every entry point calls this on its composed config (:func:`difflm.cli.exits_cleanly`,
    scripts/benchmark.py's ``compose``).

    Raises: DifflmError naming the first unknown key, a close match among its group's keys when there is one, and
    where the keys are listed.
    """
    if not isinstance(cfg, DictConfig):
        return
    for dotted, schema in unknown_keys(cfg):
        group, _, name = dotted.rpartition(".")
        close = difflib.get_close_matches(name, [f.name for f in fields(schema)], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DifflmError(f"+{dotted}: {group or 'the config'} has no key {name}{hint}; the keys of "
                          f"{group or 'the config'} are listed in difflm/config/schema.py ({schema.__name__})")
