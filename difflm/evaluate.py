"""``difflm-eval``: the likelihood bound of a trained run on a text file.

    difflm-eval run.dir=DIR data.path=FILE eval.mc_samples=8

The file is tokenized with the run's tokenizer and packed into the run's ``data.seq_len`` windows (documents
separated by EOS, as in training). Every window is evaluated, the partial last one included (for ``bd3lm`` its
whole blocks: the block-diffusion bound needs whole blocks); nothing is held back for validation, so a file of any
length with a loss token is evaluable, as a log-likelihood tool evaluates any text. Per window and draw the objective's
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
counts them. Bytes are counted on the token stream, not window by window, so a character whose bytes are split
across two windows' tokens counts once.
"""
from __future__ import annotations

import math
import sys
import tempfile

import numpy as np
import torch
from omegaconf import OmegaConf

from difflm import strict_json
from difflm.cli import hydra_app, writable_output
from difflm.config.validate import resolve_device
from difflm.data.batch import TokenBatch, split_batch
from difflm.data.datasets import load_sft_samples
from difflm.data.shards import OtherTokenizerShards
from difflm.data.windows import PackedStream, token_datasets
from difflm.errors import DifflmError
from difflm.objectives import build_objective
from difflm.objectives.cross_entropy import token_cross_entropy
from difflm.objectives.keyed_rng import check_seed
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


REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder writes for the bytes of a character cut off by the end of the ids


def _text_ids(tok) -> tuple[int, set]:
    """(the tokenizer's size, its special ids): the ids :func:`document_bytes` leaves out."""
    return len(tok.tokenizer), set(tok.tokenizer.all_special_ids) | {tok.eos_id, tok.mask_id}


def _decoded_bytes(tok, run: list, cut: bool, cut_start: bool = False) -> int:
    """UTF-8 bytes of the text that ``run`` (text ids) decodes to; ``cut``: the ids end inside the text, and a
    character whose last bytes lie beyond them (decoded as U+FFFD) is not counted; ``cut_start``: likewise for a
    character whose first bytes lie before them."""
    text = tok.tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text = text.rstrip(REPLACEMENT_CHARACTER) if cut else text
    return len((text.lstrip(REPLACEMENT_CHARACTER) if cut_start else text).encode("utf-8"))


def document_bytes(tok, ids, cut_end: bool = False) -> int:
    """UTF-8 bytes of the document text in ``ids`` (1-D): every special token (EOS, padding, mask, ...) and id
    outside the tokenizer is left out, and each run of text tokens between them is decoded on its own.
    ``cut_end``: ``ids`` end inside a document (a slice of a token stream), and the bytes of a character that
    the last ids begin but do not finish are left to the ids after them (:func:`token_bytes`).

    This is the byte count of bits per byte as the lm-evaluation-harness defines it (the UTF-8 bytes of the
    documents; Gao et al. 2020, The Pile, sec. 4): the text of an EOS separator (13 bytes for ``<|endoftext|>``)
    is not document text, although its prediction is part of the loss.
    """
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    n, special = _text_ids(tok)
    total, run = 0, []
    for i in map(int, ids):
        if 0 <= i < n and i not in special:
            run.append(i)
        elif run:
            total += _decoded_bytes(tok, run, False)
            run = []
    return total + (_decoded_bytes(tok, run, cut_end) if run else 0)


def token_bytes(tok, ids, p: int, context: int = 8) -> int:
    """The UTF-8 bytes of the document text that token ``ids[p]`` adds (0 for a special token): the bytes of the
    characters it completes, decoded after up to ``context`` text tokens before it. A character split over several
    tokens (byte-level BPE) belongs to the token holding its last byte, so summing this over every token of a
    stream gives :func:`document_bytes` of the stream, whatever the cut points."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    n, special = _text_ids(tok)
    is_text = lambda i: 0 <= int(i) < n and int(i) not in special  # noqa: E731
    if not is_text(ids[p]):
        return 0
    s = p
    while s > 0 and p - s < context and is_text(ids[s - 1]):
        s -= 1
    run, cut_start = [int(i) for i in ids[s:p + 1]], s > 0 and is_text(ids[s - 1])
    before = _decoded_bytes(tok, run[:-1], True, cut_start) if len(run) > 1 else 0
    return _decoded_bytes(tok, run, True, cut_start) - before


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
        return load_sft_samples(OmegaConf.create({
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
    return PackedStream(ds, tok.eos_id, tok.padded_vocab_size, tok.mask_id)


def window_spans(num_tokens: int, seq_len: int, multiple: int = 1, min_len: int = 1) -> list[tuple[int, int]]:
    """Stream positions ``[a, b)`` of every evaluated window of a stream of ``num_tokens``: the full ``seq_len``
    windows and the partial last one, cut down to a multiple of ``multiple`` (``bd3lm``'s block size) and left out
    when shorter than ``min_len`` (:func:`min_seq_len`: it would hold no loss token)."""
    spans = [(a, a + seq_len) for a in range(0, num_tokens - seq_len + 1, seq_len)]
    a = len(spans) * seq_len
    tail = (num_tokens - a) // multiple * multiple
    if tail >= min_len:
        spans.append((a, a + tail))
    return spans


def stream_bytes(tok, stream, spans: list[tuple[int, int]], name: str) -> int:
    """Document bytes of the scored tokens of ``spans`` (contiguous from position 0 of ``stream``), counted on the
    stream so that a character split across two windows counts once: all of it for the diffusion objectives;
    for ``ar`` the first token of each window is not predicted and its bytes (:func:`token_bytes`) are left out."""
    end = spans[-1][1]
    total = document_bytes(tok, stream[0:end], cut_end=end < len(stream))
    if name == "ar":
        for a, _ in spans:
            lo = max(0, a - 8)
            total -= token_bytes(tok, stream[lo:a + 1], a - lo)
    return total


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


def longer_than_trained(seq_len: int, trained: int) -> str:
    """The warning for a ``data.seq_len`` above the run's: windows hold positions the model never saw (RoPE beyond
    the trained length), so the figures are worse than at the trained length and not comparable with its
    ``val_nelbo``."""
    return (f"difflm: warning: data.seq_len={seq_len} is longer than the run's data.seq_len={trained} it was trained "
            f"on: positions beyond {trained} were never seen in training, so expect worse figures than at {trained}, "
            "not comparable with the run's val_nelbo; drop data.seq_len to evaluate at the trained length")


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


def check_eval_settings(args) -> None:
    """The numeric ``eval.*`` keys of a ``difflm-eval`` command line ``args``, checked before the run is read:
    ``eval.mc_samples`` and ``eval.batch_size`` >= 1, ``eval.max_windows`` >= 0 (0 = every window; a negative count
    is no count), ``eval.seed`` in [0, 2**63). (``data.seq_len`` needs the run's objective: checked once it is read.)

    Raises: DifflmError naming the key, its meaning and the fix."""
    e = args.eval
    for key, meaning in (("mc_samples", "draws of t per window; ar runs take 1, their NLL is exact"),
                         ("batch_size", "windows per forward")):
        if e[key] < 1:
            raise DifflmError(f"eval.{key}={e[key]} must be >= 1 ({meaning}): e.g. eval.{key}=8")
    if e.max_windows < 0:
        raise DifflmError(f"eval.max_windows={e.max_windows} must be >= 0 (the first windows evaluated; 0 = every "
                          "window): set eval.max_windows=0 for all of them, or a positive count")
    check_seed(e.seed, "eval.seed")


def evaluate_file(args, device: torch.device) -> dict:
    """The metrics dict of ``difflm-eval`` (see the module docstring)."""
    from difflm.generate import load_run

    check_eval_settings(args)
    cfg, model, tok, step = load_run(args.run.dir, args.step, device, args.get("kernels"))
    e = args.eval
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
    if name != "sft" and seq_len > cfg.data.seq_len:  # as difflm-generate warns of positions beyond the training
        print(longer_than_trained(seq_len, cfg.data.seq_len), file=sys.stderr, flush=True)
    if name == "bd3lm" and seq_len % cfg.objective.block_size:
        raise DifflmError(f"data.seq_len={seq_len} must be a multiple of the run's block size, "
                          f"{cfg.objective.block_size} (its objective.block_size)")
    with tempfile.TemporaryDirectory() as tmp:  # text is tokenized into tmp; shards are read in place
        windows = eval_dataset(args, cfg, tok, seq_len, tmp)
    if name == "sft":
        spans = list(range(len(windows)))
    else:
        spans = window_spans(len(windows), seq_len, cfg.objective.block_size if name == "bd3lm" else 1,
                             min_seq_len(name))
    n = len(spans) if e.max_windows == 0 else min(e.max_windows, len(spans))
    if n == 0:
        what = "pairs" if name == "sft" else f"tokens ({len(windows)}; objective={name} needs {min_seq_len(name)}" + (
            f" and whole blocks of objective.block_size={cfg.objective.block_size}" if name == "bd3lm" else "") + ")"
        raise DifflmError(f"data.path={args.data.path!r} gives no {what} to evaluate: give more text")
    spans = spans[:n]
    draws = 1 if name == "ar" else e.mc_samples
    precision = "bf16" if cfg.precision.name in ("bf16", "fp8") and device.type == "cuda" else "fp32"
    per_window, per_window_tokens, nbytes = [], [], 0
    # batches of windows of one length (the partial last window alone); sample ids key each window's noise
    batches = [list(range(i, min(n, i + e.batch_size))) for i in range(0, n, e.batch_size)]
    if name != "sft" and spans[-1][1] - spans[-1][0] != seq_len and len(batches[-1]) > 1:
        batches[-1:] = [batches[-1][:-1], batches[-1][-1:]]
    for ids in batches:
        if name == "sft":
            tokens = pair_windows(windows.get(ids), tok.eos_id)
            # a pair cut at data.seq_len ends inside its response: a character cut there has no whole byte in it
            nbytes += sum(document_bytes(tok, row, cut_end=True) for row in scored_ids(name, tokens))
        else:
            tokens = torch.from_numpy(np.stack([windows[spans[i][0]:spans[i][1]] for i in ids]).astype(np.int64))
        est = sequence_nelbo(model, objective, tokens, ids, draws, e.seed, precision,  # [K, B]
                             fused=cfg.model.fused_cross_entropy)  # load_run's schema merge: true for older runs
        per_window.append(est.mean(dim=0))
        per_window_tokens.append(objective.num_tokens(tokens).double())  # loss tokens: L, L - 1 (ar), response
    if name != "sft":
        nbytes = stream_bytes(tok, windows, spans, name)
    per_window_t, tokens_t = torch.cat(per_window), torch.cat(per_window_tokens)
    total, num_tokens = float(per_window_t.sum()), float(tokens_t.sum())
    nelbo = total / num_tokens
    # the ratio estimator's standard error (delta method): windows of one length give std(sums) / length / sqrt(n)
    stderr = (float((per_window_t - nelbo * tokens_t).std() / (num_tokens / n) / math.sqrt(n)) if n > 1
              else float("nan"))
    return {
        "run_dir": str(args.run.dir), "step": step,  # the checkpoint's training step (the newest without step=)
        "data_path": str(args.data.path), "objective": name,
        "bound": bound_kind(cfg.objective),
        "windows": n, "seq_len": seq_len, "mc_samples": draws, "tokens": int(num_tokens), "bytes": nbytes,
        "nelbo": nelbo, "nelbo_stderr": stderr, "ppl_bound": math.exp(min(nelbo, 50.0)),
        # no scored bytes (tokens that decode to nothing): no per-byte figure, NaN (null and listed in the JSON)
        "nats_per_byte": total / nbytes if nbytes else float("nan"),
        "bits_per_byte": total / nbytes / math.log(2) if nbytes else float("nan"),
    }


RESULT_KEYS = ("run_dir", "step", "data_path", "objective", "nelbo")  # what every difflm-eval result holds


def other_than_a_result(path) -> str | None:
    """None when the file at ``path`` is an earlier ``difflm-eval`` result (a JSON object with :data:`RESULT_KEYS`)
    or empty (``mktemp``'s), which ``eval.output`` may replace; else what it is (the evaluated text, a run's
    config.yaml, any other file)."""
    import json

    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        if not head:
            return None
        record = json.loads(head)
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and all(k in record for k in RESULT_KEYS):
        return None
    return "not a difflm-eval result (an earlier result is replaced)"


@hydra_app("eval")
def main(args) -> None:
    check_eval_settings(args)  # before the device and the output file
    device = resolve_device(args.device)
    output = writable_output("eval.output", args.eval.output, replaceable=other_than_a_result) \
        if args.eval.output is not None else None  # before the work
    result = evaluate_file(args, device)
    text = strict_json.dumps(result, flag=True, indent=2)  # one window: nelbo_stderr null (and flagged), not NaN
    print(text)
    if output is not None:
        output.write_text(text + "\n")


if __name__ == "__main__":
    main()
