"""Small models and configs shared by the diffusion-LM tests (bd3lm, sft, schedules, fast sampling, eval)."""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from difflm.model.transformer import Transformer


def tiny_model(causal: bool = False, vocab: int = 48, std: float = 0.02, seed: int = 0, backend: str = "sdpa",
               layers: int = 2, shift_logits: bool = False):
    cfg = OmegaConf.create(dict(
        name="t", num_layers=layers, shift_logits=shift_logits, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, head_dim=8,
        vocab_size=vocab, vocab_multiple=1, rope_base=10000.0, norm_eps=1e-5, qk_norm=True, tie_embeddings=False,
        init_std=std, backend="torch", attention_backend=backend, compile=False))
    model = Transformer(cfg, causal=causal)
    model.init_weights(seed)
    return model.eval()


def objective_cfg(**kw):
    base = dict(name="mdlm", eps=1e-3, schedule="linear", t_sampling="iid", loss_norm="token", random_length_prob=0.0,
                length_multiple=1, block_size=4)
    return OmegaConf.create({**base, **kw})


def model_fn(model):
    """A sampler ``logits_fn`` over a Transformer, passing the optional keywords through."""
    def fn(x, **kw):
        return model(x, **kw).float()
    return fn


def set_threads():
    torch.set_num_threads(1)
