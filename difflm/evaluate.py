"""``difflm-eval``: the likelihood bound of a trained run on a text file.

    difflm-eval run.dir=DIR data.path=FILE eval.mc_samples=8

The file is tokenized with the run's tokenizer and packed into the run's ``data.seq_len`` windows (documents
separated by EOS, as in training; the last partial window is dropped). Per window and draw the objective's
``eval_noise`` gives one unbiased estimate of the window's NELBO; ``eval.mc_samples`` draws per window use
antithetic times t_d = (u + d / K) mod 1, which lowers the variance (MDLM, Sahoo et al. 2024, sec. 3.5).

* ``mdlm`` / ``sft``: the continuous-time NELBO (MDLM eq. 10 / LLaDA eq. 3 with ``objective.schedule``'s weight),
  an upper bound on the NLL.
* ``bd3lm``: the block-diffusion NELBO (Arriola et al. 2025, eq. 6), one t per block.
* ``ar``: the exact NLL of the L - 1 predicted tokens (one draw).

Reports nats per token (``nelbo``), its standard error over windows, the perplexity bound ``exp(nelbo)``,
and nats / bits per UTF-8 byte of the decoded windows (tokenizer-independent, e.g. Gao et al. 2020, The Pile).
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

from difflm.cli import exits_cleanly
from difflm.config import CONF_DIR
from difflm.config.validate import resolve_device
from difflm.data.windows import build_windows, token_datasets
from difflm.errors import DifflmError
from difflm.objectives import build_objective
from difflm.training.precision import autocast_context


@torch.no_grad()
def sequence_nelbo(model, objective, tokens, sample_ids, draws: int, seed: int, precision: str = "fp32") -> torch.Tensor:
    """Per-sequence NELBO estimates in nats (sums over the sequence), ``[draws, B]`` float64.

    Args:
        tokens: [B, L] int64 (or a TokenBatch) on the CPU; ``sample_ids`` key the noise of each row.
    """
    device = next(model.parameters()).device
    out = []
    for draw in range(draws):
        batch = objective.eval_noise(tokens, sample_ids, draw, draws, seed).to(device)
        with autocast_context(precision, device):
            logits = model(batch.input_ids, batch.loss_mask, **batch.model_kwargs())
        ce = torch.nn.functional.cross_entropy(logits.float(), batch.targets[batch.loss_mask], reduction="none")
        per_pos = torch.zeros_like(batch.weights, dtype=torch.float64)
        per_pos[batch.loss_mask] = (ce * batch.weights[batch.loss_mask]).double()
        out.append(per_pos.sum(dim=1).cpu())
    return torch.stack(out)


def evaluate_file(args, device: torch.device) -> dict:
    """The metrics dict of ``difflm-eval`` (see the module docstring)."""
    from difflm.generate import load_run

    cfg, model, tok = load_run(args.run.dir, args.step, device, args.get("kernels"))
    e = args.eval
    if e.mc_samples < 1 or e.batch_size < 1:
        raise DifflmError(f"eval.mc_samples={e.mc_samples} and eval.batch_size={e.batch_size} must be >= 1")
    name = cfg.objective.name
    objective = build_objective(cfg.objective, tok.mask_id)
    seq_len = args.data.seq_len or cfg.data.seq_len
    if name == "bd3lm" and seq_len % cfg.objective.block_size:
        raise DifflmError(f"data.seq_len={seq_len} must be a multiple of the run's objective.block_size="
                          f"{cfg.objective.block_size}")
    data_cfg = OmegaConf.create({"path": args.data.path, "hf_dataset": None, "hf_split": "train",
                                 "text_field": args.data.text_field, "doc_separator": args.data.doc_separator,
                                 "encoding": args.data.get("encoding", "utf-8"), "num_proc": 0})
    with tempfile.TemporaryDirectory() as tmp:  # text is tokenized into tmp; shards are read in place
        ds = token_datasets(data_cfg, tok, args.data.cache_dir or tmp)
        windows, _ = build_windows(ds, tok.eos_id, seq_len, 0.0)
    n = len(windows) if e.max_windows <= 0 else min(e.max_windows, len(windows))
    draws = 1 if name == "ar" else e.mc_samples
    precision = "bf16" if cfg.precision.name in ("bf16", "fp8") and device.type == "cuda" else "fp32"
    per_window, nbytes = [], 0
    for start in range(0, n, e.batch_size):
        ids = list(range(start, min(n, start + e.batch_size)))
        tokens = windows.get(ids)
        est = sequence_nelbo(model, objective, tokens, ids, draws, e.seed, precision)  # [K, B]
        per_window.append(est.mean(dim=0))
        for row in tokens:  # bytes of the predicted tokens (all but the first for ar)
            nbytes += len(tok.decode(row[1:] if name == "ar" else row).encode("utf-8"))
    per_window_t = torch.cat(per_window)
    predicted = seq_len - 1 if name == "ar" else seq_len
    total = float(per_window_t.sum())
    nelbo = total / (n * predicted)
    stderr = float(per_window_t.std() / predicted / math.sqrt(n)) if n > 1 else float("nan")
    return {
        "run_dir": str(args.run.dir), "data_path": str(args.data.path), "objective": name,
        "bound": "exact NLL" if name == "ar" else "NELBO (upper bound on the NLL)",
        "windows": n, "seq_len": seq_len, "mc_samples": draws,
        "nelbo": nelbo, "nelbo_stderr": stderr, "ppl_bound": math.exp(min(nelbo, 50.0)),
        "nats_per_byte": total / max(nbytes, 1), "bits_per_byte": total / max(nbytes, 1) / math.log(2),
    }


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="eval")
@exits_cleanly
def main(args) -> None:
    device = resolve_device(args.device)
    result = evaluate_file(args, device)
    text = json.dumps(result, indent=2)
    print(text)
    if args.eval.output:
        Path(args.eval.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
