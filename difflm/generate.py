"""``difflm-generate``: continue a prompt with a trained run's latest (or chosen) checkpoint.

    difflm-generate run.dir=DIR prompt="ROMEO:" gen.length=64 gen.steps=64 gen.block_length=32 \
        gen.remasking=low_confidence gen.temperature=0
    difflm-generate run.dir=DIR prompt="Once upon a time, in (a) land: far away"   # any text, commas too
    difflm-generate run.dir=DIR prompt_file=prompt.txt                              # the file's text is the prompt
    difflm-generate run.dir=DIR prompt="The <|mask|> sat on the <|mask|>."          # infilling (diffusion runs)
    difflm-generate run.dir=DIR prompt="What is 2 plus 3?" chat_template=false      # an SFT chat run, raw prompt

Masked-diffusion runs sample with LLaDA's iterative unmasking (:func:`difflm.sampling.diffusion_generate`;
``gen.remasking``, ``gen.cfg_scale``, ``gen.top_k``/``gen.top_p``, Fast-dLLM's ``gen.threshold`` and
``gen.cache``); ``bd3lm`` runs block by block (:func:`difflm.sampling.block_diffusion_generate`);
``ar`` runs decode left to right. The defaults of ``gen.*`` are the run's own (its ``config.yaml``, which the HF
export and the lm-eval harness also read); keys typed on the command line replace them. A run trained on chat-template
prompts (``objective=sft data.chat_template=true``) is prompted the same way unless ``chat_template=false``; each
``mask_placeholder`` (``<|mask|>``) in the prompt is a mask token the diffusion samplers fill (infilling). The text
printed ends at the first EOS. See docs/objectives_and_sampling.md.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Sequence

import torch

from difflm.checkpoint.store import load_trained_weights, trained_settings
from difflm.cli import hydra_app, quote_free_text
from difflm.config.validate import check_choices, resolve_device
from difflm.data import TokenizerInfo, build_tokenizer
from difflm.errors import DifflmError
from difflm.model import build_model
from difflm.model.masks import padded_row_spans
from difflm.sampling import (GenerationOptions, autoregressive_generate, block_diffusion_generate,
                             diffusion_generate)
from difflm.sampling.diffusion import check_generation_config, check_sampler_settings
from difflm.training.allocator import use_expandable_segments
from difflm.training.precision import autocast_context


def forbidden_ids(tok: TokenizerInfo, vocab_size: int) -> list[int]:
    """Ids a sampler must never emit: the mask token and the embedding's padding rows."""
    return sorted({tok.mask_id, *range(len(tok.tokenizer), vocab_size)})


def generation_options(model: torch.nn.Module, tok: TokenizerInfo, gen, causal: bool = False,
                       objective=None) -> GenerationOptions:
    """The sampler settings of a run: ``gen.*`` plus the tokenizer's mask id, the ids never to emit
    (:func:`forbidden_ids`), ``model.shift_logits`` and, for ``bd3lm``, ``objective.block_size`` and ``objective.clean_attention``.
    ``gen.block_length=null`` is the run's block size (:func:`difflm.sampling.options.resolve_block_length`: a bd3lm
    run's ``objective.block_size``, else the largest divisor of ``gen.length`` up to 64), ``gen.steps=null``
    ``min(64, gen.length)`` rounded to the block count (:func:`difflm.sampling.options.resolve_steps`).

    Raises: GenerationConfigError for a bad ``gen.*``: settings a ``bd3lm`` run cannot sample with
    (:meth:`GenerationOptions.check_block_diffusion`), block and step counts the LLaDA sampler refuses (the other
    diffusion objectives) and, for an ``ar`` (``causal``) run, a diffusion-only ``gen.*`` setting it would ignore.
    """
    from difflm.sampling.options import run_block_size

    bd3lm = not causal and objective is not None and objective.name == "bd3lm"
    opts = GenerationOptions.from_config(
        gen, mask_id=tok.mask_id, forbid_ids=forbidden_ids(tok, model.cfg.vocab_size),
        shift_logits=bool(getattr(model.cfg, "shift_logits", False)),
        block_size=run_block_size(objective) if bd3lm else None,
        causal_prefix=bd3lm and getattr(objective, "clean_attention", "block_causal") == "causal")
    # checked here for callers that check before sampling
    check_sampler_settings(opts, "ar" if causal else "bd3lm" if bd3lm else None)
    return opts


def pad_to_multiple(x: torch.Tensor, multiple: int, causal: bool, kw: dict) -> tuple[torch.Tensor, dict]:
    """``x`` [B, S] int64 right-padded to a multiple of ``multiple`` tokens, and the model keywords that keep the
    real positions' logits exact: a :class:`difflm.model.masks.DocumentMask` in which the real tokens are one
    document and the pads another (every attention backend takes it; ``causal`` for ``ar`` models), so no real query
    sees a pad. Under sequence parallelism a forward needs a length that ``parallel.tp`` divides, while a sampler's
    length is the prompt's plus what it has generated so far.

    Raises: DifflmError when the call already carries an attention mask, positions or a KV cache (the BD3-LM
    sampler's), which the padding cannot extend: the message names the lengths to choose instead.
    """
    from difflm.model.masks import DocumentMask

    s = x.shape[1]
    pad = -s % multiple
    if not pad:
        return x, kw
    if any(kw.get(k) is not None for k in ("attn_mask", "position_ids", "kv_cache")):
        raise DifflmError(f"a sampler call of {s} tokens under sequence parallelism needs a length that "
                          f"parallel.tp={multiple} divides, and this sampler's own attention mask cannot be padded: "
                          f"choose logger.sample_prompt / gen.length so that prompt + gen.length tokens are a multiple "
                          f"of {multiple}, or set parallel.sequence_parallel=false")
    doc = torch.zeros(x.shape[0], s + pad, dtype=torch.long, device=x.device)
    doc[:, s:] = 1
    return torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1), {**kw, "attn_mask": DocumentMask(doc, causal=causal)}


def check_padded_sampling(objective: str, prompt_tokens: int, block_size: int, multiple: int) -> None:
    """Refuse, before training, end-of-training samples that :func:`pad_to_multiple` could not pad: a ``bd3lm``
    sampler calls the model with its own mask, positions and KV cache at lengths ``prompt + k * block``, so under
    sequence parallelism (``multiple`` = ``parallel.tp``) the prompt and the block must be multiples of it; the other
    samplers are padded. Raises: DifflmError naming the keys and the ways out."""
    if objective != "bd3lm" or multiple <= 1 or (prompt_tokens % multiple == 0 and block_size % multiple == 0):
        return
    raise DifflmError(f"objective=bd3lm samples at the end of training call the model at prompt + k x block tokens, "
                      f"which sequence parallelism needs to be multiples of parallel.tp={multiple}, and "
                      f"logger.sample_prompt is {prompt_tokens} tokens with objective.block_size={block_size}: give a "
                      f"prompt of a multiple of {multiple} tokens (and such a block size), logger.num_samples=0, or "
                      "parallel.sequence_parallel=false")


def padded_block_generate(logits_fn, prompt_ids: torch.Tensor, opts: GenerationOptions, generator,
                          prompt_mask: torch.Tensor | None, stats: dict | None) -> torch.Tensor:
    """:func:`difflm.sampling.block_diffusion_generate` of a batch of prompts padded to one width (``prompt_mask``
    [B, P], True at real tokens, each row's real tokens contiguous: left or right padding): a bd3lm model's blocks
    sit at absolute positions, so the rows of each prompt length are sampled together without their padding, and put
    back in the batch's layout ([B, P + gen.length], the padding kept). ``generator``: one generator (drawn from group
    by group, in the order of the prompt lengths) or a list of one per row (each row's noise its own, so a row samples
    as it would alone). ``stats["nfe"]`` counts the model calls of every group."""
    if prompt_mask is None or bool(prompt_mask.all()):
        return block_diffusion_generate(logits_fn, prompt_ids, opts, generator=generator, stats=stats)
    starts, lengths = padded_row_spans(prompt_mask, "objective=bd3lm samples blocks at absolute positions: pad each "
                                       "prompt on one side only (its real tokens contiguous)")
    width = prompt_ids.shape[1]
    out = torch.cat([prompt_ids, prompt_ids.new_full((prompt_ids.shape[0], opts.length), opts.mask_id)], dim=1)
    nfe = 0
    for n in sorted(set(lengths.tolist())):
        rows = (lengths == n).nonzero().flatten()
        cols = starts[rows, None] + torch.arange(n, device=prompt_ids.device)[None]
        gens = generator if generator is None or isinstance(generator, torch.Generator) else [
            generator[int(r)] for r in rows]
        group: dict = {}
        sampled = block_diffusion_generate(logits_fn, prompt_ids[rows[:, None], cols], opts, generator=gens,
                                           stats=group)
        nfe += int(group.get("nfe", 0))
        out[rows[:, None], cols] = sampled[:, :n]
        out[rows, width:] = sampled[:, n:]
    if stats is not None:
        stats["nfe"] = nfe
    return out


@torch.no_grad()
def generate_ids(model: torch.nn.Module, tok: TokenizerInfo, prompt_ids: torch.Tensor, gen, causal: bool,
                 precision: str = "fp32", objective=None, prompt_mask: torch.Tensor | None = None,
                 stats: dict | None = None, seq_multiple: int = 1, infill: bool = False,
                 generator=None) -> torch.Tensor:
    """Generated ids only, [B, gen.length] int64, for a prompt [B, P] on the model's device; with ``infill``,
    [B, P + gen.length]: the prompt with its ``mask_id`` positions sampled, then the generated ids.

    Args:
        gen: the ``gen`` config (:class:`difflm.config.schema.GenerateConfig`), turned into one
            :class:`difflm.sampling.GenerationOptions` (:func:`generation_options`).
        causal: an ``ar`` model (left-to-right decoding).
        objective: the run's ``objective`` config; ``bd3lm`` runs sample block by block
            (:func:`difflm.sampling.block_diffusion_generate`, ``gen.steps * block_size / gen.length`` steps
            per block, exact KV cache unless ``gen.cache=none``).
        prompt_mask: [B, P] bool, True at real tokens of left- or right-padded prompts (``bd3lm``: the rows of each
            prompt length are sampled together, :func:`padded_block_generate`).
        stats: receives ``nfe`` (model calls) when given (diffusion samplers).
        seq_multiple: every model call's length is padded to a multiple of this (:func:`pad_to_multiple`): the
            tensor-parallel degree of a model under sequence parallelism (the trainer's samples), else 1.
        infill: sample the prompt's mask positions too (:attr:`GenerationOptions.infill`; diffusion samplers).
        generator: in place of ``gen.seed``'s generator: one ``torch.Generator``, or a list of one per row (each row's
            noise from its own, :func:`difflm.sampling.diffusion.uniform`; the autoregressive sampler's draws too).
    Raises: GenerationConfigError (a DifflmError) for a bad ``gen.*``, and for ``infill`` with an ``ar`` run.
    """
    device = prompt_ids.device

    def logits_fn(x: torch.Tensor, **kw) -> torch.Tensor:
        s = x.shape[1]
        x, kw = pad_to_multiple(x, seq_multiple, causal, kw)
        with autocast_context(precision, device):
            return model(x, **kw).float()[:, :s]

    opts = generation_options(model, tok, gen, causal, objective)
    if infill:
        opts = opts.replace(infill=True)
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(gen.seed)
    if causal:
        out = autoregressive_generate(logits_fn, prompt_ids, opts, generator=generator, prompt_mask=prompt_mask)
    elif opts.block_size is not None:
        out = padded_block_generate(logits_fn, prompt_ids, opts, generator, prompt_mask, stats)
    else:
        out = diffusion_generate(logits_fn, prompt_ids, opts, generator=generator, prompt_mask=prompt_mask,
                                 stats=stats)
    return out if infill else out[:, prompt_ids.shape[1]:]


def cut_at_eos(ids, eos_id: int) -> list[int]:
    """The generated ids ``ids`` (a sequence or a 1-D tensor of int) up to their first ``eos_id``, which is dropped:
    the text ends there (an SFT model pads its answer with EOS, a pretrained one starts another document)."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def decode_generated(tok: TokenizerInfo, ids) -> str:
    """The text of generated ids ``ids`` (1-D), cut at the end of text (:func:`cut_at_eos`): what every output path
    prints (``difflm-generate``, the samples of ``difflm-train``, the lm-eval adapter's ``generate_until``)."""
    return tok.decode(cut_at_eos(ids, tok.eos_id))


def run_chat_template(cfg) -> bool:
    """Whether a run trained on prompts wrapped in its tokenizer's chat template: an ``objective=sft`` run with
    ``data.chat_template=true`` (:func:`difflm.data.sft.chat_prompt_ids`). Its samplers must wrap prompts alike."""
    return cfg.objective.name == "sft" and bool(cfg.data.get("chat_template", False))


def mask_placeholders(tok: TokenizerInfo, placeholder: str | None) -> list[str]:
    """The texts that stand for one mask token in a ``difflm-generate`` prompt (infilling): ``mask_placeholder``
    (unless null or empty) and the tokenizer's own mask token text, if it has one (e.g. ``<|mdm_mask|>`` of an
    export's tokenizer)."""
    own = getattr(tok.tokenizer, "mask_token", None)
    return [p for p in dict.fromkeys([placeholder, own if isinstance(own, str) else None]) if p]


def split_at_placeholders(text: str, placeholders: Sequence[str]) -> list[str]:
    """``text`` cut at each occurrence of any of ``placeholders`` (the pieces between them; one piece if none)."""
    if not placeholders:
        return [text]
    return re.split("|".join(re.escape(p) for p in sorted(placeholders, key=len, reverse=True)), text)


def encode_prompt(tok: TokenizerInfo, text: str, chat_template: bool, placeholders: Sequence[str] = ()) -> list[int]:
    """The prompt ids a sampler starts from: ``text`` as one user turn of the tokenizer's chat template with the
    generation prompt (``chat_template``; as SFT training built its prompts, :func:`difflm.data.sft.chat_prompt_ids`),
    else the plain text (:meth:`TokenizerInfo.encode`; ``[EOS]`` for an empty text). Special-token text inside
    ``text`` stays text either way, except ``placeholders`` (:func:`mask_placeholders`): each occurrence becomes
    one ``tok.mask_id`` (infilling), the text between them encoded piece by piece.

    Raises: DifflmError with ``chat_template`` when the tokenizer has no chat template.
    """
    pieces = split_at_placeholders(text, placeholders)
    if len(pieces) == 1:
        if chat_template:
            from difflm.data.sft import chat_prompt_ids

            return chat_prompt_ids(tok.tokenizer, text)
        return tok.encode(text) or [tok.eos_id]
    body = tok.encode(pieces[0])
    for piece in pieces[1:]:
        body += [tok.mask_id] + tok.encode(piece)
    if not chat_template:
        return body
    from difflm.data.sft import chat_prompt_ids

    chat_prompt_ids(tok.tokenizer, "")  # the same refusal without a template
    sentinel = "\x00difflm-infill\x00"
    rendered = tok.tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], add_generation_prompt=True,
                                                 tokenize=False)
    before, after = rendered.split(sentinel, 1)
    piece = lambda t: tok.tokenizer(t, add_special_tokens=False)["input_ids"] if t else []  # noqa: E731
    return piece(before) + body + piece(after)


def infilled_text(tok: TokenizerInfo, text: str, placeholders: Sequence[str], fills) -> str:
    """``text`` with its placeholders (:func:`split_at_placeholders`) replaced, in order, by the decoded ``fills``
    (the sampled ids of the prompt's mask positions, 1-D). The fills of adjacent placeholders are decoded together,
    as the generated ids are: a character whose UTF-8 bytes span several tokens (an emoji of byte-level BPE) prints
    as itself, not as one replacement character per token."""
    pieces = split_at_placeholders(text, placeholders)
    fills = fills.tolist() if hasattr(fills, "tolist") else list(fills)
    out, adjacent = pieces[0], []
    for fill, piece in zip(fills, pieces[1:]):
        adjacent.append(fill)
        if piece:  # text follows: the run of adjacent placeholders ends here
            out += tok.decode(adjacent) + piece
            adjacent = []
    return out + (tok.decode(adjacent) if adjacent else "")


def load_run(run_dir: str, step: int | None, device: torch.device, kernels=None,
             keys: tuple[str, str] = ("run.dir", "step")):
    """(run config, model with checkpoint weights in eval mode, tokenizer info, checkpoint step) of a trained run:
    checkpoint ``step``, or the newest when None (the step is returned so that results can say which one was read).

    ``kernels`` (:class:`difflm.config.schema.KernelOverrides`) replaces the run's ``model.backend`` /
    ``model.attention_backend`` where set; the checkpoint loads into either kernel set.
    Raises: DifflmError without config.yaml or checkpoint (naming ``keys``, the command's keys of the run directory
    and the step), or when the kernels cannot run on ``device``.
    """
    cfg, ckpt, step = trained_settings(run_dir, step, keys)
    # the run's allocator mode: evaluation's masked-row counts change per draw as training's did
    use_expandable_segments(cfg.train.expandable_segments, device)
    apply_kernel_overrides(cfg, kernels, device)
    tok = build_tokenizer(cfg.data.tokenizer, cfg.model.vocab_multiple)
    model = build_model(cfg.model, causal=cfg.objective.name == "ar", device=device, seed=0)
    load_trained_weights(run_dir, ckpt, model, cfg)  # a LoRA run's: base + adapters (docs/lora.md)
    return cfg, model.eval(), tok, step


def apply_kernel_overrides(cfg, kernels, device: torch.device) -> None:
    """Set ``model.backend`` / ``model.attention_backend`` from ``kernels`` (None entries keep the run's), then check
    that they run on ``device``, naming the override that fixes it."""
    from difflm.config.validate import CHOICES
    from difflm.model.attention import attention_unavailable_reason

    for key in ("backend", "attention_backend"):
        value = None if kernels is None else kernels.get(key)
        if value is not None:
            if value not in CHOICES[f"model.{key}"]:
                raise DifflmError(f"kernels.{key}={value!r} is not one of: {', '.join(CHOICES[f'model.{key}'])}")
            cfg.model[key] = value
    # forward-only reads run the kernels every host has: no compiled blocks, TE's own MLP for a run trained with the
    # fused one (model.fused_mlp: same parameters, BF16-rounding-level agreement, quack's gains are in training), the
    # grouped-GEMM experts for a run trained with quack's (model.moe.fused_experts: the same, and their main_grad)
    cfg.model.compile, cfg.model.fused_mlp, cfg.model.fused_mlp_autotune = False, False, False
    if cfg.model.get("moe") is not None:
        cfg.model.moe.fused_experts = False
    _choose_again(cfg, kernels, device)
    if cfg.model.backend == "te" and device.type != "cuda":
        if kernels is not None and kernels.get("backend") == "te":  # the override asked for it, not the run
            raise DifflmError(f"kernels.backend=te needs CUDA and the device is {device.type}: drop it or set "
                              "kernels.backend=torch")
        raise DifflmError(f"the run's model.backend=te needs CUDA and the device is {device.type}: add "
                          "kernels.backend=torch (checkpoints load into either kernel set)")
    backend = cfg.model.attention_backend
    reason = attention_unavailable_reason(backend, device, "bf16", training=False, key="kernels.attention_backend")
    if reason is not None:
        if kernels is None or kernels.get("attention_backend") is None:  # the run's own choice, not an override
            reason = f"the run's model.attention_backend={backend} cannot run here; {reason}"
        raise DifflmError(reason)


def _choose_again(cfg, kernels, device: torch.device) -> None:
    """Kernels that ``auto`` chose for training (named in ``model.auto_reason``) are chosen again for this device, unless
    ``kernels.*`` names them: a run trained on a GPU with the TE kernels samples on a CPU with the torch ones.
    Explicit training choices are kept (and refused below, naming the override that fixes them)."""
    from difflm.model.auto_kernels import AUTO, choose_kernels

    picked = cfg.model.get("auto_reason") or ""
    for key in ("backend", "attention_backend"):
        if f"model.{key}=" in picked and (kernels is None or kernels.get(key) is None):
            cfg.model[key] = AUTO
    choose_kernels(cfg, device, forward_only=True)


def beyond_trained_length(prompt_tokens: int, length: int, seq_len: int) -> str | None:
    """A warning when the prompt and ``gen.length`` new tokens need more positions than the run's ``data.seq_len``:
    the model never saw such positions (RoPE beyond the trained length) and its text degrades. None otherwise."""
    total = prompt_tokens + length
    if total <= seq_len:
        return None
    return (f"difflm: warning: the prompt ({prompt_tokens} tokens) and gen.length={length} make {total} positions, "
            f"more than the run's data.seq_len={seq_len} it was trained on: expect poor text; shorten the prompt or "
            "gen.length")


def typed_keys(overrides: list[str], group: str) -> set[str]:
    """The keys of ``group`` given on the command line: ``length`` for ``gen.length=32`` (Hydra's ``+``/``++``/``~``
    prefixes allowed) among ``overrides`` (``HydraConfig.get().overrides.task``)."""
    prefix = group + "."
    keys = (o.split("=", 1)[0].lstrip("+~") for o in overrides)
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}


def run_generation_config(run_gen, cli_gen, typed: set[str], causal: bool, objective: str | None = None):
    """The ``gen.*`` a command samples a run with: the run's own settings (its ``config.yaml``, as the HF export and
    the lm-eval harness read them), the keys typed on the command line (``typed``, values in ``cli_gen``) over them.
    Keys the run's own sampler never read are reset first (:func:`difflm.sampling.options.unread_stored_settings`):
    for an ``ar`` run (``causal``) its diffusion-only keys, left at their defaults (typed ones are kept, for
    :meth:`GenerationOptions.check_autoregressive` to refuse); for a ``bd3lm`` run (``objective``, the run's
    objective name) its ``block_length``, null: its own block size (a typed one is kept, for
    :meth:`GenerationOptions.check_block_diffusion` to judge). A stored ``steps`` or ``block_length`` of 64, the
    schema's former default, is read as null: fitted to the ``gen.length`` sampled
    (:data:`difflm.sampling.options.FORMER_DEFAULTS`)."""
    from omegaconf import OmegaConf

    from difflm.sampling.options import unread_stored_settings

    stored = {k: v for k, v in (run_gen or {}).items() if k in cli_gen}  # keys this schema still has
    # the lm-eval harness's order too: the run's, the keys its sampler never read reset, then the caller's
    return OmegaConf.merge(cli_gen, stored, unread_stored_settings("ar" if causal else objective, stored),
                           {k: cli_gen[k] for k in typed})


def read_prompt(args) -> str:
    """The prompt text: ``prompt=`` or the UTF-8 contents of ``prompt_file=`` (one trailing newline dropped).

    Raises:
        DifflmError: both are given, ``prompt_file`` is a ``.jsonl`` / ``.json`` / ``.parquet`` file (records, not
        a prompt), or it cannot be read.
    """
    if not args.get("prompt_file"):
        return args.prompt
    if args.prompt:
        raise DifflmError("give prompt= or prompt_file=, not both")
    suffix = Path(args.prompt_file).suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):  # its whole text would become one prompt, braces and all
        raise DifflmError(f"prompt_file={args.prompt_file!r} is a {suffix} file: prompt_file is one prompt as plain "
                          "text (the whole file): give a .txt file holding the prompt, or prompt=TEXT")
    try:
        text = Path(args.prompt_file).read_text(encoding="utf-8-sig")  # a byte-order mark is not prompt text
    except (OSError, UnicodeDecodeError) as err:
        raise DifflmError(f"prompt_file={args.prompt_file!r} cannot be read ({err}): give a UTF-8 text file") from err
    return text[:-1] if text.endswith("\n") else text


@hydra_app("generate")
def _main(args) -> None:
    from hydra.core.hydra_config import HydraConfig

    print(generate_text(args, typed_keys(list(HydraConfig.get().overrides.task), "gen")))


def generate_text(args, typed_gen: set[str]) -> str:
    """What ``difflm-generate`` prints: the prompt and the generated text, for its command line ``args``
    (:class:`difflm.config.schema.GenerateRunConfig`); ``typed_gen``: the ``gen.*`` keys typed on the command line
    (:func:`typed_keys`), which replace the run's own. Notices go to stderr."""
    check_choices(args, ["gen.remasking", "gen.remdm_schedule", "gen.cache", "device"])
    prompt = read_prompt(args)
    device = resolve_device(args.device)
    # the sampler settings first, from the run's config alone: a bad gen.* is refused before the model loads
    cfg, _, _ = trained_settings(args.run.dir, args.step)
    causal = cfg.objective.name == "ar"
    gen = run_generation_config(cfg.get("gen"), args.gen, typed_gen, causal, cfg.objective.name)
    check_generation_config(gen, cfg.objective, typed_gen)
    cfg, model, tok, step = load_run(args.run.dir, args.step, device, args.kernels)
    # which checkpoint wrote the text (the newest when step= is not given); stderr: stdout is the text alone
    print(f"difflm-generate: {args.run.dir} at checkpoint step {step}", file=sys.stderr, flush=True)
    chat = run_chat_template(cfg) if args.get("chat_template") is None else bool(args.chat_template)
    if chat and not run_chat_template(cfg) and not getattr(tok.tokenizer, "chat_template", None):
        raise DifflmError(f"chat_template=true but the run's tokenizer ({cfg.data.tokenizer}) has no chat template: "
                          "drop chat_template")
    placeholders = mask_placeholders(tok, args.get("mask_placeholder"))
    ids = encode_prompt(tok, prompt, chat, placeholders)  # special-token text in the prompt stays text
    infill = tok.mask_id in ids
    if infill and causal:
        raise DifflmError(f"the prompt holds mask placeholders ({', '.join(placeholders)}), and infilling needs a "
                          "diffusion sampler: an objective=ar run decodes left to right; remove them, or set "
                          "mask_placeholder=null to keep them as text")
    if (warning := beyond_trained_length(len(ids), gen.length, cfg.data.seq_len)) is not None:
        print(warning, file=sys.stderr, flush=True)
    out = generate_ids(model, tok, torch.tensor([ids], device=device), gen, causal,
                       objective=cfg.objective, infill=infill,
                       precision="bf16" if cfg.precision.name in ("bf16", "fp8") and device.type == "cuda" else "fp32")
    if not infill:
        return prompt + decode_generated(tok, out[0])
    fills = out[0, :len(ids)][torch.tensor(ids, device=out.device) == tok.mask_id]
    return infilled_text(tok, prompt, placeholders, fills) + decode_generated(tok, out[0, len(ids):])


def main() -> None:
    """Entry point: ``prompt=`` takes any text (commas, colons, brackets; see :func:`difflm.cli.quote_free_text`)."""
    sys.argv[1:] = quote_free_text(sys.argv[1:], ("prompt",))
    _main()


if __name__ == "__main__":
    main()
