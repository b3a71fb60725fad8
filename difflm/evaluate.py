"""``difflm-eval``: the likelihood bound of a trained run on a text file.

    difflm-eval run.dir=DIR data.path=FILE eval.mc_samples=8

The file is tokenized with the run's tokenizer and packed into the run's ``data.seq_len`` windows (documents
separated by EOS, as in training; the last partial window is dropped). Per window and draw the objective's
``eval_noise`` gives one unbiased estimate of the window's NELBO; ``eval.mc_samples`` draws per window use
antithetic times t_d = (u + d / K) mod 1, which lowers the variance (MDLM, Sahoo et al. 2024, sec. 3.5).

* ``mdlm`` / ``sft``: the continuous-time NELBO (MDLM eq. 10 / LLaDA eq. 3 with ``objective.schedule``'s weight),
  an upper bound on the NLL for the ``linear`` and ``cosine`` schedules; under ``loglinear`` (MDLM's published
  convention) it lies about ``eps`` below the continuous-time bound and can fall under the NLL
  (docs/objectives_and_sampling.md).
* ``bd3lm``: the block-diffusion NELBO (Arriola et al. 2025, eq. 6), one t per block.
* ``ar``: the exact NLL of the L - 1 predicted tokens (one draw).

* ``sft``: the response-only NELBO of prompt/response pairs (a JSONL file with the run's ``data.prompt_field`` /
  ``data.response_field``, or ``data.prompt_field=... data.response_field=...``): the prompt is never masked and
  carries no loss, the response is padded with EOS to ``data.seq_len`` as in training.

Reports the evaluated checkpoint's training ``step`` (``step=N``, or the newest checkpoint), nats per loss token
(``nelbo``: the sum over windows and draws / ``tokens``, the window length, L - 1 for ``ar``, the response lengths for
``sft``), its standard error over windows (``null`` for one window), the
perplexity bound ``exp(nelbo)``, and nats / bits per UTF-8 byte (tokenizer-independent, e.g. Gao et al. 2020, The
Pile): the loss of every scored token (EOS separators and padding included) over ``bytes``, the UTF-8 bytes of the
document text only (no EOS or other special-token text; for ``sft`` the responses), as the lm-evaluation-harness
counts them.
"""
from __future__ import annotations

import math
import tempfile

import torch
from omegaconf import OmegaConf

from difflm import strict_json
from difflm.cli import hydra_app, writable_output
from difflm.config.validate import resolve_device
from difflm.data.batch import TokenBatch, split_batch
from difflm.data.sft import load_pairs
from difflm.data.shards import OtherTokenizerShards
from difflm.data.windows import build_windows, token_datasets
from difflm.errors import DifflmError
from difflm.objectives import build_objective
from difflm.objectives.cross_entropy import token_cross_entropy
from difflm.training.precision import autocast_context


@torch.no_grad()
def sequence_nelbo(model, objective, tokens, sample_ids, draws: int, seed: int, precision: str = "fp32",
                   fused: bool = True) -> torch.Tensor:
    """Per-sequence NELBO estimates in nats (sums over the sequence), ``[draws, B]`` float64.

    Args:
        tokens: [B, L] int64 (or a TokenBatch) on the CPU; ``sample_ids`` key the noise of each row.
        fused: the run's ``model.fused_cross_entropy`` (:func:`difflm.objectives.cross_entropy.token_cross_entropy`).
    """
    device = next(model.parameters()).device
    out = []
    for draw in range(draws):
        batch = objective.eval_noise(tokens, sample_ids, draw, draws, seed).to(device)
        with autocast_context(precision, device):
            logits = model(batch.input_ids, batch.logits_selector(), **batch.model_kwargs())
        ce = token_cross_entropy(logits, batch.targets[batch.loss_mask], fused=fused)
        per_pos = torch.zeros_like(batch.weights, dtype=torch.float64)
        per_pos[batch.loss_mask] = (ce * batch.weights[batch.loss_mask]).double()
        out.append(per_pos.sum(dim=1).cpu())
    return torch.stack(out)


def document_bytes(tok, ids) -> int:
    """UTF-8 bytes of the document text in ``ids`` (1-D): every special token (EOS, padding, mask, ...) and id
    outside the tokenizer is left out, and each run of text tokens between them is decoded on its own.

    This is the byte count of bits per byte as the lm-evaluation-harness defines it (the UTF-8 bytes of the
    documents; Gao et al. 2020, The Pile, sec. 4): the text of an EOS separator (13 bytes for ``<|endoftext|>``)
    is not document text, although its prediction is part of the loss.
    """
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    n = len(tok.tokenizer)
    special = set(tok.tokenizer.all_special_ids) | {tok.eos_id, tok.mask_id}
    total, run = 0, []
    for i in [*map(int, ids), -1]:
        if 0 <= i < n and i not in special:
            run.append(i)
        elif run:
            total += len(tok.tokenizer.decode(run, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False).encode("utf-8"))
            run = []
    return total


def pair_windows(batch: TokenBatch, eos_id: int) -> TokenBatch:
    """``objective=sft`` evaluation rows ``[prompt, response, EOS, EOS...]`` (one pair a row, prompt lengths) as
    windows of exactly ``prompt + response + EOS``: the padding EOS after the first one are marked prompt (never
    masked, no loss) and made a document of their own (``doc_ids`` 1: no real token attends to them), so the NELBO
    scores the response and its stop token as LLaDA's conditional likelihood does (Nie et al. 2025, sec. 2.4: the
    sequence is the prompt and the answer, no padding) and does not change with ``data.seq_len``.
    Training's loss also scores the padding (it teaches the model to fill the window); a cut pair has no padding.
    """
    tokens = batch.tokens
    b, s = tokens.shape
    pos = torch.arange(s)[None, :]
    if batch.prompt_lengths is None:  # conversations (a prompt mask): the trailing run of EOS is the padding
        not_eos = torch.where(tokens != eos_id, pos, torch.full_like(pos, -1)).amax(dim=1)
        end = (not_eos + 1).clamp(max=s - 1)  # the first EOS after the conversation scores, as a pair's stop token
        pad = pos > end[:, None]
        return TokenBatch(tokens, prompt_mask=batch.prompt_mask | pad, doc_ids=pad.long())
    is_eos = (tokens == eos_id) & (pos >= batch.prompt_lengths[:, None])
    # the first EOS of the response ends the pair (none: the pair was cut at the window, all of it scores)
    end = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full((b,), s - 1))
    pad = pos > end[:, None]
    return TokenBatch(tokens, prompt_mask=(pos < batch.prompt_lengths[:, None]) | pad, doc_ids=pad.long())


def scored_ids(name: str, tokens) -> list:
    """Per row of ``tokens`` (tensor [B, L] or TokenBatch) the ids whose prediction the NELBO scores: all for the
    diffusion objectives, all but the first for ``ar``, the response for ``sft``."""
    ids, extras = split_batch(tokens)
    if name == "ar":
        return [row[1:] for row in ids]
    if name == "sft":
        return [row[response] for row, response in zip(ids, extras.response_mask())]
    return list(ids)


AS_THE_RUN = "<as the run>"  # data.doc_separator's default: the run's separator (null means none)


def eval_dataset(args, cfg, tok, seq_len: int, tmp: str):
    """The evaluation rows: packed ``seq_len`` windows of ``data.path``'s documents (read with the run's
    ``data.text_field``, ``data.doc_separator`` and ``data.encoding`` unless ``data.*`` gives others), or for an
    ``sft`` run the prompt/response pairs of a JSONL file (fields and chat template from ``data.*`` or the run's
    config)."""
    if cfg.objective.name == "sft":
        d = args.data
        return load_pairs(OmegaConf.create({
            "path": d.path, "prompt_field": d.prompt_field or cfg.data.prompt_field,
            "response_field": d.response_field or cfg.data.response_field, "seq_len": seq_len,
            "chat_template": cfg.data.chat_template if d.chat_template is None else d.chat_template,
            "messages_field": d.get("messages_field") or cfg.data.get("messages_field")}), tok)
    # the text is read as the run read its own unless data.* says otherwise (a separator or field of its own would
    # change the windows, hence the NELBO, without a word)
    d, run = args.data, cfg.data
    separator = run.get("doc_separator", "<|endoftext|>") if d.doc_separator == AS_THE_RUN else d.doc_separator
    data_cfg = OmegaConf.create({"path": d.path, "hf_dataset": None, "hf_split": "train",
                                 "text_field": d.text_field or run.get("text_field", "text"), "doc_separator": separator,
                                 "encoding": d.get("encoding") or run.get("encoding", "utf-8"), "num_proc": 0})
    try:
        ds = token_datasets(data_cfg, tok, args.data.cache_dir or tmp)
    except OtherTokenizerShards as err:
        raise shard_tokenizer_error(err, cfg) from None
    return build_windows(ds, tok.eos_id, seq_len, 0.0)[0]


def shard_tokenizer_error(err: OtherTokenizerShards, cfg) -> DifflmError:
    """:func:`difflm.data.shards.find_shards`' refusal of shards made with another tokenizer, with the fix for
    ``difflm-eval``: it always reads with the run's tokenizer (it has no ``data.tokenizer`` key), so the corpus must
    be preprocessed again with the run's ``data.tokenizer``."""
    sources = err.manifest.get("sources") or []
    corpus = "input=<the corpus>"
    if len(sources) == 1 and sources[0].get("path"):
        corpus = f"input={sources[0]['path']}"
    elif len(sources) == 1 and sources[0].get("hf_dataset"):
        corpus = f"hf_dataset={sources[0]['hf_dataset']}"
    made_with = err.manifest.get("tokenizer", {}).get("name")
    return DifflmError(f"data.path={err.path!r} was tokenized with another tokenizer ({made_with}) than the run's "
                       f"data.tokenizer={cfg.data.tokenizer}, and difflm-eval always uses the run's tokenizer: rerun "
                       f"difflm-preprocess {corpus} output=<a new folder> tokenizer={cfg.data.tokenizer} and pass "
                       "that folder as data.path (or pass the text itself)")


def min_seq_len(name: str) -> int:
    """The shortest window with a loss token: ``ar`` predicts each token from the previous ones (L - 1 of them)."""
    return 2 if name == "ar" else 1


def json_safe(result: dict) -> dict:
    """``result`` with non-finite floats (the standard error of one window, NaN) as None: JSON has no NaN
    (:func:`difflm.strict_json.finite`)."""
    from difflm.strict_json import finite

    return finite(result)


def bound_kind(objective_cfg) -> str:
    """What the reported figure is: the exact NLL (``ar``), an upper bound on it, or MDLM's loglinear estimate."""
    if objective_cfg.name == "ar":
        return "exact NLL"
    if objective_cfg.get("schedule", "linear") == "loglinear":
        return "NELBO estimate (loglinear schedule: not a strict upper bound on the NLL)"
    return "NELBO (upper bound on the NLL)"


def evaluate_file(args, device: torch.device) -> dict:
    """The metrics dict of ``difflm-eval`` (see the module docstring)."""
    from difflm.generate import load_run

    cfg, model, tok, step = load_run(args.run.dir, args.step, device, args.get("kernels"))
    e = args.eval
    if e.mc_samples < 1 or e.batch_size < 1:
        raise DifflmError(f"eval.mc_samples={e.mc_samples} and eval.batch_size={e.batch_size} must be >= 1")
    name = cfg.objective.name
    for key in ("prompt_field", "response_field", "chat_template", "messages_field"):
        if name != "sft" and args.data.get(key) is not None:
            raise DifflmError(f"data.{key} applies to objective=sft runs and this run is objective={name}: drop it")
    objective = build_objective(cfg.objective, tok.mask_id)
    seq_len = cfg.data.seq_len if args.data.seq_len is None else args.data.seq_len
    if seq_len < min_seq_len(name):
        raise DifflmError(f"data.seq_len={seq_len} leaves no loss token for objective={name}: give data.seq_len >= "
                          f"{min_seq_len(name)}" + (" (ar predicts each token from the ones before it)"
                                                    if name == "ar" else "")
                          + f", or drop it for the run's {cfg.data.seq_len}")
    if name == "bd3lm" and seq_len % cfg.objective.block_size:
        raise DifflmError(f"data.seq_len={seq_len} must be a multiple of the run's objective.block_size="
                          f"{cfg.objective.block_size}")
    with tempfile.TemporaryDirectory() as tmp:  # text is tokenized into tmp; shards are read in place
        windows = eval_dataset(args, cfg, tok, seq_len, tmp)
    n = len(windows) if e.max_windows <= 0 else min(e.max_windows, len(windows))
    if n == 0:
        raise DifflmError(f"data.path={args.data.path!r} gives no full window of data.seq_len={seq_len} tokens: "
                          "give more text or a smaller data.seq_len")
    draws = 1 if name == "ar" else e.mc_samples
    precision = "bf16" if cfg.precision.name in ("bf16", "fp8") and device.type == "cuda" else "fp32"
    per_window, num_tokens, nbytes = [], 0.0, 0
    for start in range(0, n, e.batch_size):
        ids = list(range(start, min(n, start + e.batch_size)))
        tokens = windows.get(ids)
        if name == "sft":
            tokens = pair_windows(tokens, tok.eos_id)
        est = sequence_nelbo(model, objective, tokens, ids, draws, e.seed, precision,  # [K, B]
                             fused=cfg.model.fused_cross_entropy)  # load_run's schema merge: true for older runs
        per_window.append(est.mean(dim=0))
        num_tokens += float(objective.num_tokens(tokens).double().sum())  # loss tokens: L, L - 1 (ar), response
        nbytes += sum(document_bytes(tok, row) for row in scored_ids(name, tokens))
    per_window_t = torch.cat(per_window)
    total = float(per_window_t.sum())
    nelbo = total / num_tokens
    stderr = float(per_window_t.std() / (num_tokens / n) / math.sqrt(n)) if n > 1 else float("nan")
    return {
        "run_dir": str(args.run.dir), "step": step,  # the checkpoint's training step (the newest without step=)
        "data_path": str(args.data.path), "objective": name,
        "bound": bound_kind(cfg.objective),
        "windows": n, "seq_len": seq_len, "mc_samples": draws, "tokens": int(num_tokens), "bytes": nbytes,
        "nelbo": nelbo, "nelbo_stderr": stderr, "ppl_bound": math.exp(min(nelbo, 50.0)),
        "nats_per_byte": total / max(nbytes, 1), "bits_per_byte": total / max(nbytes, 1) / math.log(2),
    }


@hydra_app("eval")
def main(args) -> None:
    device = resolve_device(args.device)
    output = writable_output("eval.output", args.eval.output) if args.eval.output else None  # before the work
    result = evaluate_file(args, device)
    text = strict_json.dumps(result, flag=True, indent=2)  # one window: nelbo_stderr null (and flagged), not NaN
    print(text)
    if output is not None:
        output.write_text(text + "\n")


if __name__ == "__main__":
    main()
