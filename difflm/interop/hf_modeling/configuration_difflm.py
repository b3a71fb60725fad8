"""Configuration of a difflm model exported for Hugging Face ``transformers`` (written by ``difflm-export``).

Self-contained (torch + transformers only): copied next to ``config.json`` and loaded with
``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` through ``auto_map``.
"""
from __future__ import annotations

from transformers import PretrainedConfig


class DiffLMConfig(PretrainedConfig):
    """Dimensions of difflm's Llama-style transformer plus what its sampler needs.

    Args (difflm ``model.*`` key in brackets):
        vocab_size: rows of the embedding, padded [model.vocab_size].
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
        head_dim: dimensions [hidden_size, num_layers, num_heads, num_kv_heads, ffn_hidden_size, head_dim].
        rope_theta: RoPE base [rope_base]. rms_norm_eps: every RMSNorm's eps [norm_eps].
        partial_rotary_factor: RoPE rotates the first ``int(head_dim * f)`` dims of each head [partial_rotary_factor].
        qk_norm: RMSNorm on queries and keys per head [qk_norm]. qkv_bias: bias on the fused QKV [qkv_bias].
        tie_word_embeddings: LM head = input embedding [tie_embeddings].
        causal: causal attention (an ``ar`` run) instead of bidirectional (masked diffusion).
        shift_logits: Dream's shifted logits: position i's logits come from position i - 1 [shift_logits].
        mask_token_id: the [MASK] id used by the sampler.
        tokenizer_vocab_size: ids >= this (and ``mask_token_id``) are never sampled (embedding padding).
        gen_length, gen_steps, gen_block_length, gen_remasking, gen_temperature, gen_cfg_scale, gen_top_k,
        gen_top_p, gen_threshold, gen_remdm_sigma, gen_remdm_schedule: default sampler settings (difflm's ``gen.*``;
        ``gen_steps`` / ``gen_block_length`` None: fitted to each call's ``gen_length`` as difflm's null, the
        largest divisor of the length up to 64 and ``min(64, length)`` steps rounded to the blocks).
        gen_seed, gen_cache: the run's ``gen.seed`` and ``gen.cache``, kept so that ``difflm-import`` restores the
        run's ``gen.*`` (``generate`` takes a ``generator`` instead of a seed and has no KV cache).
        train_seq_len: the run's training window ``data.seq_len`` (None: unknown, e.g. an older export), restored
        by ``difflm-import``.
        train_step: the training step of the exported checkpoint (None: unknown, e.g. an older export).
        moe_num_experts, moe_top_k, moe_intermediate_size, moe_num_shared_experts, moe_score_func,
        moe_norm_topk_prob: mixture of experts [model.moe.num_experts, top_k, ffn_hidden_size (resolved),
        num_shared_experts, score_func, norm_topk_prob]; ``moe_num_experts=0`` is the dense MLP.
        moe_n_group, moe_topk_group, moe_routed_scaling_factor, moe_first_k_dense, moe_shared_intermediate_size:
        [model.moe.n_group, topk_group, routed_scaling_factor, first_k_dense, the resolved shared-expert width]
        (group-limited routing of DeepSeek-V3 sec. 2.1.2; the first blocks dense).
        moe_bias_in_weights: the gating weights are the chosen scores + router bias [model.moe.bias_in_weights].
        moe_aux_loss_coeff, moe_z_loss_coeff, moe_bias_update_rate, moe_capacity_factor, moe_balance_over: the run's
        balancing settings [model.moe.*], unused here, kept so that ``difflm-import`` restores the run's ``model.moe``.
    """

    model_type = "difflm"

    def __init__(self, vocab_size: int = 50304, hidden_size: int = 128, num_hidden_layers: int = 4,
                 num_attention_heads: int = 4, num_key_value_heads: int = 4, intermediate_size: int = 512,
                 head_dim: int | None = None, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5,
                 partial_rotary_factor: float = 1.0, qk_norm: bool = True, qkv_bias: bool = False,
                 tie_word_embeddings: bool = False,
                 causal: bool = False, shift_logits: bool = False, mask_token_id: int | None = None,
                 tokenizer_vocab_size: int | None = None, gen_length: int = 64, gen_steps: int | None = None,
                 gen_block_length: int | None = None, gen_remasking: str = "low_confidence",
                 gen_temperature: float = 0.0,
                 gen_cfg_scale: float = 0.0, gen_top_k: int = 0, gen_top_p: float = 1.0,
                 gen_threshold: float | None = None, gen_seed: int = 0, gen_cache: str = "none",
                 gen_remdm_sigma: float = 0.0, gen_remdm_schedule: str = "cap",
                 train_seq_len: int | None = None, train_step: int | None = None, initializer_range: float = 0.02,
                 moe_num_experts: int = 0, moe_top_k: int = 2, moe_intermediate_size: int | None = None,
                 moe_num_shared_experts: int = 0, moe_score_func: str = "softmax", moe_norm_topk_prob: bool = False,
                 moe_n_group: int = 1, moe_topk_group: int = 1, moe_routed_scaling_factor: float = 1.0,
                 moe_first_k_dense: int = 0, moe_shared_intermediate_size: int | None = None,
                 moe_bias_in_weights: bool = False, moe_aux_loss_coeff: float | None = None,
                 moe_z_loss_coeff: float | None = None, moe_bias_update_rate: float | None = None,
                 moe_capacity_factor: float | None = None, moe_balance_over: str | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        self.rms_norm_eps = rms_norm_eps
        self.qk_norm = qk_norm
        self.qkv_bias = qkv_bias
        self.causal = causal
        self.shift_logits = shift_logits
        self.mask_token_id = mask_token_id
        self.tokenizer_vocab_size = tokenizer_vocab_size if tokenizer_vocab_size is not None else vocab_size
        self.gen_length = gen_length
        self.gen_steps = gen_steps
        self.gen_block_length = gen_block_length
        self.gen_remasking = gen_remasking
        self.gen_temperature = gen_temperature
        self.gen_cfg_scale = gen_cfg_scale
        self.gen_top_k = gen_top_k
        self.gen_top_p = gen_top_p
        self.gen_threshold = gen_threshold
        self.gen_seed = gen_seed
        self.gen_cache = gen_cache
        self.gen_remdm_sigma = gen_remdm_sigma
        self.gen_remdm_schedule = gen_remdm_schedule
        self.train_seq_len = train_seq_len
        self.train_step = train_step
        self.initializer_range = initializer_range
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_intermediate_size = moe_intermediate_size if moe_intermediate_size is not None else intermediate_size
        self.moe_num_shared_experts = moe_num_shared_experts
        self.moe_score_func = moe_score_func
        self.moe_norm_topk_prob = moe_norm_topk_prob
        self.moe_n_group, self.moe_topk_group = moe_n_group, moe_topk_group
        self.moe_routed_scaling_factor, self.moe_first_k_dense = moe_routed_scaling_factor, moe_first_k_dense
        self.moe_shared_intermediate_size = moe_shared_intermediate_size
        self.moe_bias_in_weights = moe_bias_in_weights
        self.moe_aux_loss_coeff, self.moe_z_loss_coeff = moe_aux_loss_coeff, moe_z_loss_coeff
        self.moe_bias_update_rate, self.moe_capacity_factor = moe_bias_update_rate, moe_capacity_factor
        self.moe_balance_over = moe_balance_over
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings
