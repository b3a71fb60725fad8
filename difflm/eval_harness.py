"""An lm-evaluation-harness (``lm-eval``, EleutherAI) model adapter for difflm runs.

    python -m difflm.eval_harness --model difflm --model_args run_dir=outputs/run,mc_samples=128 --tasks piqa

or from Python::

    import lm_eval
    from difflm.eval_harness import DifflmHarnessLM
    lm_eval.simple_evaluate(model=DifflmHarnessLM(run_dir="outputs/run"), tasks=["piqa"])

Importing this module registers the model name ``difflm`` (``lm_eval --model difflm`` needs the import, which
``python -m difflm.eval_harness`` does before handing over to lm-eval's command line).

* ``loglikelihood``: ``ar`` runs give the exact sum of next-token log-probabilities of the continuation.
  Masked-diffusion runs (``mdlm``, ``sft``) use LLaDA's Monte-Carlo estimator (Nie et al. 2025, "Large Language
  Diffusion Models", eq. 6 and App. B.6, the reference ``get_log_likelihood.py``): for a continuation of L tokens
  after a never-masked prompt, each of ``mc_samples`` draws masks l uniformly chosen continuation positions and
  scores ``(L / l) * sum_{masked i} log p(x_i | x_t)``; the estimate is the mean over draws. The counts l are
  stratified as in LLaDA, l_k = s + offset_k wrapped into 1..L with a random start s, so K = L draws use every
  l = 1..L exactly once, and each draw's l is uniform on 1..L for every K (:func:`stratified_mask_counts`; LLaDA's
  half-to-even rounding is not), so the estimate's expectation is eq. 6 exactly: a lower bound on
  log p(continuation | prompt) (eq. 6 is the NELBO's discrete-l form). ``is_greedy``: whether
  the argmax at every position of the *fully masked* continuation equals the continuation (one forward pass; a
  simple choice, documented here, since a diffusion model has no single greedy decoding order).
  Draws are keyed by ``seed`` per request (a fresh ``torch.Generator``), so results are deterministic and do not
  depend on the order or grouping of requests.
* ``loglikelihood_rolling``: exact for ``ar`` runs (lm-eval's rolling windows of the run's ``data.seq_len``);
  not implemented for diffusion runs (use ``difflm-eval``, the NELBO of packed windows).
* ``generate_until``: :func:`difflm.generate.generate_ids` with the run's ``gen`` settings, overridden by the
  constructor's ``gen_kwargs`` and then by each request's ``gen_kwargs`` (``max_gen_toks`` -> ``gen.length``
  rounded up to a multiple of ``gen.block_length`` (null: 64, or ``max_gen_toks`` when shorter), exactly
  ``max_gen_toks`` for ``ar`` and ``bd3lm`` runs; a ``gen.steps`` given keeps its steps per token, null is fitted to the
  length). The constructor's ``gen_kwargs`` are checked at once as difflm-generate checks ``gen.*`` (e.g. ``top_k`` at
  ``temperature=0`` is refused); a request's own are lm-eval's task settings. A request returns at most ``max_gen_toks``
  tokens (the decoded text of the first ``max_gen_toks`` generated ids), cut at the first ``until`` string or the EOS
  text. Requests with equal settings are sampled ``batch_size`` at a time (``bd3lm``: the rows of each prompt length
  together, unpadded), each row with a generator of its own seeded with ``gen.seed``, so a request's text does not
  depend on the batching, at ``temperature > 0`` too.
``bd3lm`` runs generate, but their likelihood needs the block-diffusion bound: ``loglikelihood`` raises.
* Chat templates: contexts are wrapped as one user turn of the tokenizer's chat template when the run trained so
  (``objective=sft data.chat_template=true``; model_args ``chat_template=false`` skips it); lm-eval's
  ``--apply_chat_template`` renders them through :meth:`DifflmHarnessLM.apply_chat_template` instead. Generated text
  ends at the first EOS id, and a prompt plus ``max_gen_toks`` beyond the run's ``data.seq_len`` is warned about once.
"""
from __future__ import annotations

import logging
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from difflm.errors import DifflmError, exception_chain

LM_EVAL_MISSING = ("difflm.eval_harness needs lm-eval (EleutherAI's lm-evaluation-harness), which is not installed: "
                   "pip install lm-eval; difflm-eval gives the validation NELBO "
                   "without it")
try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as _err:
    if __name__ == "__main__":  # python -m difflm.eval_harness: one line, as the other entry points
        print(f"difflm: error: {LM_EVAL_MISSING}", file=sys.stderr)
        sys.exit(2)
    raise DifflmError(LM_EVAL_MISSING) from _err
from difflm.generate import (beyond_trained_length, decode_generated, encode_prompt, forbidden_ids, generate_ids,
                             load_run, run_chat_template)
from difflm.objectives.keyed_rng import check_seed
from difflm.sampling.options import (DEFAULT_BLOCK_LENGTH, GenerationConfigError, GenerationOptions,
                                     check_read_settings, resolve_block_length, run_block_size,
                                     unread_stored_settings)
from difflm.training.precision import autocast_context

eval_logger = logging.getLogger(__name__)


def truncated_prompts_warning(cut: list[tuple[int, int, int]], total: int, max_length: int) -> str:
    """The warning for ``generate_until`` prompts cut from the left to fit ``max_length`` beside their new tokens.

    Args:
        cut: (tokens dropped, prompt tokens, gen.length) of each cut request.
        total: the number of requests.
        max_length: positions the prompt and the generated tokens share (the run's ``data.seq_len`` by default).
    """
    dropped, prompt, length = max(cut)
    share = sum(d for d, _, _ in cut) / sum(p for _, p, _ in cut)
    return (f"generate_until: {len(cut)} of {total} prompts were cut from the left to fit max_length={max_length} "
            f"beside their gen.length new tokens ({share:.0%} of their tokens dropped; the worst lost {dropped} of "
            f"{prompt} tokens beside gen.length={length}): pass a smaller max_gen_toks (the task's generation_kwargs) "
            f"or a larger max_length in model_args")


def truncated_loglikelihood_warning(cut: list[tuple[int, int, int, int]], total: int, max_length: int) -> str:
    """The warning for ``loglikelihood`` requests cut from the left to fit ``max_length``.

    Args:
        cut: (context tokens dropped, context tokens, continuation tokens not scored, continuation tokens) of each
            cut request.
        total: the number of requests.
        max_length: the positions a request's context and continuation share (the run's ``data.seq_len`` by
            default).
    """
    contexts = [(d, n) for d, n, _, _ in cut if d]
    conts = [(d, n) for _, _, d, n in cut if d]
    parts = []
    if contexts:
        share = sum(d for d, _ in contexts) / sum(n for _, n in contexts)
        worst = max(contexts)
        parts.append(f"{len(contexts)} context{'s' if len(contexts) > 1 else ''} lost {share:.0%} of their tokens, "
                     f"the worst {worst[0]} of {worst[1]}")
    if conts:
        worst = max(conts)
        many = len(conts) > 1
        parts.append(f"{len(conts)} continuation{'s are' if many else ' is'} longer than max_length and only the last "
                     f"tokens are scored "
                     f"(the worst: {worst[1] - worst[0]} of {worst[1]} tokens), so their log-likelihoods are too high")
    return (f"loglikelihood: {len(cut)} of {total} requests were cut from the left to fit max_length={max_length} "
            f"({'; '.join(parts)}): pass a larger max_length in model_args, or pick tasks with shorter contexts")


GEN_KEYS = ("length", "steps", "block_length", "remasking", "temperature", "seed", "top_k", "top_p", "cfg_scale",
            "threshold", "cache", "remdm_sigma", "remdm_schedule")


def stratified_mask_counts(length: int, num: int, generator: torch.Generator | None = None,
                           start: int | None = None) -> torch.Tensor:
    """Stratified numbers of masked tokens, ``[num]`` int64 in 1..``length``, each draw's count uniform on 1..L.

    LLaDA's ``_forward_process`` (``get_log_likelihood.py``, Nie et al. 2025, App. B.6) takes a random start s in
    1..L and l_k = round(linspace(s, s + (num - 1) L / num, num)), wrapped into 1..L. Its ``round`` is half to
    even, so where k L / num is a half-integer the offset depends on the parity of s and l_k is not uniform
    (L = 3, num = 2: the second count is 1 with probability 2/3), which biases the estimate against eq. 6. Here
    the offsets c_k = round_half_up(k L / num) do not depend on s, and l_k = ((s - 1 + c_k) mod L) + 1 is
    uniform on 1..L for every k (the same counts as LLaDA wherever k L / num is not a half-integer). With
    ``num = L`` every count 1..L appears exactly once; with ``num = m L`` each appears m times.

    Args:
        generator: draws s when ``start`` is None.
        start: s itself (1..L), for enumeration in tests.
    """
    if start is None:
        start = int(torch.randint(1, length + 1, (), generator=generator))
    k = torch.arange(num, dtype=torch.long)
    offsets = (2 * k * length + num) // (2 * num)  # round half up of k L / num, in integers
    return (start - 1 + offsets) % length + 1


def mc_loglikelihood(logits_fn, seq: list[int], length: int, mask_id: int, counts: torch.Tensor,
                     generator: torch.Generator, batch_size: int) -> float:
    """LLaDA's Monte-Carlo estimate of log p(continuation | prompt) (Nie et al. 2025, eq. 6, App. B.6).

    ``seq`` is prompt + continuation, the continuation its last ``length`` tokens. Draw k masks ``counts[k]``
    continuation positions (a uniform subset, ``torch.randperm`` on ``generator``) and scores
    ``(L / l) * sum_{masked i} log p(x_i | x_t)``; the estimate is the mean over draws. When every count is
    uniform on 1..L (:func:`stratified_mask_counts`) its expectation is eq. 6 exactly.
    ``logits_fn``: x [B, S] int64 -> logits [B, S, V] float.
    """
    x0 = torch.tensor(seq)
    prompt_len = len(seq) - length
    target = x0[prompt_len:]
    estimates = []
    for first in range(0, len(counts), batch_size):
        ls = counts[first:first + batch_size]
        rows = x0.repeat(len(ls), 1)
        masked = torch.zeros(len(ls), len(seq), dtype=torch.bool)
        for r, l in enumerate(ls.tolist()):
            masked[r, prompt_len + torch.randperm(length, generator=generator)[:l]] = True
        rows[masked] = mask_id
        logp = F.log_softmax(logits_fn(rows)[:, prompt_len:].float(), dim=-1).cpu()  # [B, L, V]
        tok_logp = logp.gather(2, target.expand(len(ls), length)[..., None])[..., 0]  # [B, L]
        estimates.append((tok_logp.double() * masked[:, prompt_len:]).sum(dim=1) * (length / ls.double()))
    return float(torch.cat(estimates).mean())


def _flag(value: Any, key: str) -> bool:
    """A model_args switch: a bool, or its text (``true``/``false``, ``1``/``0``) from lm-eval's ``--model_args``.
    Raises: DifflmError naming ``key`` for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise DifflmError(f"model_args {key}={value!r} is not true or false")


@register_model("difflm")
class DifflmHarnessLM(LM):
    """lm-eval ``LM`` over a difflm run directory (see the module docstring for the estimators).

    Args:
        run_dir: a ``difflm-train`` output directory (``config.yaml`` + ``checkpoints/``).
        step: checkpoint step (default: the latest).
        device: ``cpu``, ``cuda``, ``cuda:1``... (default: cuda when available; ``cuda`` without CUDA falls back to
            the CPU with a warning). On lm-eval's command line ``--device`` or ``device=`` in ``--model_args``,
            which wins (as ``batch_size=`` there wins over ``--batch_size``).
        mc_samples: Monte-Carlo draws per request for diffusion runs (LLaDA uses 128).
        batch_size: rows per forward pass (draws of one request; prompts in ``generate_until``).
        seed: keys the estimator's draws.
        max_length: longest sequence fed to the model (default: the run's ``data.seq_len``); contexts are
            truncated on the left.
        chat_template: wrap each context as one user turn of the tokenizer's chat template, as SFT training wrapped
            its prompts (:func:`difflm.generate.encode_prompt`); None (default): as the run trained (``objective=sft``
            with ``data.chat_template=true``), false: the raw context. Contexts that lm-eval already rendered
            (``--apply_chat_template``, through :meth:`apply_chat_template`) are not wrapped again.
        **gen_kwargs: ``gen.*`` overrides for ``generate_until`` (``steps``, ``block_length``, ``remasking``...).
    """

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "DifflmHarnessLM":
        """The model of lm-eval's ``--model_args`` (``key=value,...``), with its own flags: see
        :meth:`create_from_arg_obj`."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "DifflmHarnessLM":
        """The model of ``arg_dict`` (the ``model_args``) and lm-eval's own ``--batch_size`` / ``--device``
        (``additional_config``). lm-eval's command line passes those always (1 and ``cuda:0`` when not typed), so a
        ``batch_size`` or ``device`` given in ``model_args`` wins over them instead of reaching the constructor
        twice."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    def __init__(self, run_dir: str, step: int | None = None, device: str | None = None, mc_samples: int = 128,
                 batch_size: int | str = 16, seed: int = 0, max_length: int | None = None,
                 chat_template: bool | str | None = None, **gen_kwargs: Any):
        super().__init__()
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            eval_logger.warning("device=%s requested but CUDA is unavailable: using the CPU", device)
            device = "cpu"  # lm_eval's CLI passes --device cuda by default
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.mc_samples = int(mc_samples)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        for key, value, low in (("mc_samples", self.mc_samples, 1), ("batch_size", self.batch_size, 1),
                                ("max_length", int(max_length) if max_length else None, 2)):
            if value is not None and value < low:  # before the run is read
                raise DifflmError(f"{key}={value} must be >= {low}")
        check_seed(int(seed) if str(seed).lstrip("-").isdigit() else seed, "seed")
        self.cfg, self.model, self.tok, self.step = load_run(str(run_dir), None if step in (None, "") else int(step),
                                                             self._device, keys=("run_dir", "step"))  # model_args
        self.run_dir = str(run_dir)
        # the step is not in model_args when the newest checkpoint was taken: log it and put it in the results
        eval_logger.info("difflm: evaluating %s at checkpoint step %d", self.run_dir, self.step)
        self.objective = self.cfg.objective.name
        self.causal = self.objective == "ar"
        self.seed = int(seed)
        self.max_length = int(max_length or self.cfg.data.seq_len)
        if self.max_length < 2:
            raise DifflmError(f"max_length={self.max_length} must be >= 2")
        unknown = sorted(set(gen_kwargs) - set(GEN_KEYS))
        if unknown:
            raise DifflmError(f"unknown model_args {unknown}: gen settings are {', '.join(GEN_KEYS)}")
        # the run's own gen.* its sampler never read (an ar run's diffusion-only keys, a bd3lm run's block_length)
        # do not count, and its steps / block_length at the former default 64 are null (fitted to each request's
        # length): only the caller's, and those are refused now, not at the first generate_until
        self.gen = OmegaConf.merge(self.cfg.gen, unread_stored_settings(self.objective, self.cfg.gen), gen_kwargs)
        if (size := run_block_size(self.cfg.objective)) is not None:  # a bd3lm run's block_length null: its blocks
            self.gen.block_length = resolve_block_length(self.gen.get("block_length"), size)
        try:
            check_read_settings(self.gen, gen_kwargs, self.causal, prefix="")  # e.g. top_k at temperature=0
            if self.causal:
                GenerationOptions.from_config(self.gen, mask_id=self.tok.mask_id).check_autoregressive(prefix="")
        except GenerationConfigError as err:
            raise GenerationConfigError(f"model_args {err}") from None
        self.precision = ("bf16" if self.cfg.precision.name in ("bf16", "fp8") and self._device.type == "cuda"
                          else "fp32")
        self.forbid = forbidden_ids(self.tok, self.model.cfg.vocab_size)
        self.wrap_chat = run_chat_template(self.cfg) if chat_template in (None, "") else _flag(chat_template,
                                                                                               "chat_template")
        self.lm_eval_templated = False  # set once lm-eval renders contexts through apply_chat_template
        self.told_beyond_window = False  # the log said once that prompt + gen.length exceed data.seq_len

    def get_model_info(self) -> dict:
        """What lm-eval adds to its results' ``config`` (``simple_evaluate``): the run directory, the evaluated
        checkpoint's training step (also when ``step`` was not given: the newest) and the objective."""
        return {"difflm_run_dir": self.run_dir, "difflm_step": self.step, "difflm_objective": self.objective}

    # ---- helpers -------------------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.cfg.data.tokenizer).replace("/", "__")

    def tok_encode(self, text: str) -> list[int]:
        return self.tok.encode(text)  # special-token text in the task stays text

    # ---- lm-eval's chat-template hooks (``--apply_chat_template``)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's hook: the chat ``[{"role", "content"}, ...]`` rendered as text by the run tokenizer's template
        (``continue_final_message`` when not ``add_generation_prompt``, as lm-eval's HF model). The contexts lm-eval
        then sends are read with the template's special tokens as special tokens, and not wrapped again.

        Raises: DifflmError when the run's tokenizer has no chat template.
        """
        tokenizer = self.tok.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise DifflmError(f"--apply_chat_template: the run's tokenizer ({self.cfg.data.tokenizer}) has no chat "
                              "template: drop --apply_chat_template")
        self.lm_eval_templated = True
        return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """lm-eval's hook: the template text it records in its results (None when off or the tokenizer has none)."""
        if not chat_template:
            return None
        return getattr(self.tok.tokenizer, "chat_template", None) or None

    def context_ids(self, context: str) -> list[int]:
        """The ids of a request's context: read with its special tokens when lm-eval rendered the chat template,
        else wrapped in the run's chat template when :attr:`wrap_chat` (the run's or ``chat_template``), else the
        plain text (:func:`difflm.generate.encode_prompt`; an empty context is [EOS])."""
        if self.lm_eval_templated:
            ids = self.tok.tokenizer(context, add_special_tokens=False, verbose=False)["input_ids"]
            return ids or [self.tok.eos_id]
        return encode_prompt(self.tok, context, self.wrap_chat)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids): trailing spaces of the context move to the continuation, the pair is
        encoded as one text and split (as lm-eval's HF models); an empty context becomes [EOS]. A context in a chat
        template (:meth:`context_ids`) is encoded apart from its continuation."""
        if self.wrap_chat or self.lm_eval_templated:
            return self.context_ids(context), self.tok_encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if not context:
            return [self.tok.eos_id], self.tok_encode(continuation)
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return ctx, whole[len(ctx):]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast_context(self.precision, self._device):
            return self.model(x.to(self._device)).float()

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., self.forbid] = float("-inf")
        return logits.argmax(dim=-1)

    def _window(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        """(the tokens a request is scored on, how many continuation tokens are scored): ``ctx + cont`` cut from the
        left to ``max_length`` model inputs. An AR run predicts the token after each input, so its window holds one
        more token (the last target); both score at most ``max_length`` continuation tokens."""
        seq = (ctx + cont)[-(self.max_length + (1 if self.causal else 0)):]
        return seq, min(len(cont), len(seq) - (1 if self.causal else 0))

    def _cut(self, ctx: list[int], cont: list[int]) -> tuple[int, int]:
        """(context tokens dropped, continuation tokens not scored) by :meth:`_window`'s left truncation."""
        seq, scored = self._window(ctx, cont)
        return len(ctx) - max(0, len(seq) - len(cont)), len(cont) - scored

    def _ar_score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        """Exact sum of next-token log-probs of ``cont`` after ``ctx`` (left-truncated to ``max_length``)."""
        seq, n = self._window(ctx, cont)
        x = torch.tensor([seq[:-1]])
        logp = F.log_softmax(self._logits(x)[0, -n:], dim=-1).cpu()
        target = torch.tensor(seq[-n:])
        greedy = bool((self._greedy(logp) == target).all())
        return float(logp.gather(1, target[:, None]).sum()), greedy

    def _diffusion_score(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        """LLaDA's Monte-Carlo estimate of log p(cont | ctx) (:func:`mc_loglikelihood`) and ``is_greedy``."""
        seq, L = self._window(ctx, cont)
        P = len(seq) - L
        gen = torch.Generator().manual_seed(self.seed)
        counts = stratified_mask_counts(L, self.mc_samples, gen)
        estimate = mc_loglikelihood(self._logits, seq, L, self.tok.mask_id, counts, gen, self.batch_size)
        all_masked = torch.tensor(seq)
        all_masked[P:] = self.tok.mask_id
        greedy = bool((self._greedy(self._logits(all_masked[None])[0, P:].cpu()) == torch.tensor(seq[P:])).all())
        return estimate, greedy

    # ---- lm-eval API ---------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context) or its LLaDA MC estimate, is_greedy) per ``(context, continuation)``.

        A pair longer than ``max_length`` is cut from the left (the context first, then the continuation's start,
        which is then not scored); one warning per call counts the cut requests."""
        if self.objective == "bd3lm":
            raise NotImplementedError("loglikelihood of objective=bd3lm runs needs the block-diffusion bound, "
                                      "which the lm-eval adapter does not implement: use difflm-eval")
        out, cut = [], []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self.encode_pair(context, continuation)
            ctx_cut, cont_cut = self._cut(ctx, cont)
            if ctx_cut or cont_cut:  # said once for the whole call, with counts (as generate_until does)
                cut.append((ctx_cut, len(ctx), cont_cut, len(cont)))
            if not cont:
                res = (0.0, True)
            else:
                res = self._ar_score(ctx, cont) if self.causal else self._diffusion_score(ctx, cont)
            self.cache_hook.add_partial("loglikelihood", (context, continuation), res)
            out.append(res)
        if cut:
            eval_logger.warning(truncated_loglikelihood_warning(cut, len(out), self.max_length))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Exact log-likelihood of whole texts for ``ar`` runs (rolling windows of ``max_length``)."""
        if not self.causal:
            raise NotImplementedError(
                f"loglikelihood_rolling (perplexity tasks) is not implemented for objective={self.objective} runs: "
                "a diffusion model has no exact token-by-token likelihood; use difflm-eval for the NELBO bound")
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args[:1]
            total = 0.0
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.tok.eos_id, max_seq_len=self.max_length,
                context_len=1))
            for ctx, cont in windows:
                total += self._ar_score(list(ctx), list(cont))[0]
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def _request_gen(self, kwargs: dict) -> tuple[Any, list[str], int]:
        """(gen config for one request, stop strings, most tokens to return) from lm-eval's ``gen_kwargs``.

        ``max_gen_toks`` is the most tokens a request returns: the LLaDA sampler generates ``gen.length`` rounded up
        to whole blocks (``gen.block_length``, capped at ``max_gen_toks``; null: 64) and the surplus is cut; a
        ``bd3lm`` run samples in its model's blocks and generates exactly ``max_gen_toks`` (its ``gen.block_length``
        is its block size, resolved at construction). ``gen.steps`` given keeps its steps per token; null is fitted
        to the request's length (:func:`difflm.sampling.options.resolve_steps`)."""
        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos_text = self.tok.tokenizer.decode([self.tok.eos_id])
        if eos_text and eos_text not in until:
            until.append(eos_text)
        gen = OmegaConf.merge(self.gen, {k: v for k, v in kwargs.items() if k in GEN_KEYS})
        if kwargs.get("do_sample") is False:
            gen.temperature = 0.0
        if "max_gen_toks" in kwargs:
            base_len, base_steps = gen.length, gen.get("steps")
            scale = base_steps is not None and "steps" not in kwargs  # null steps: fitted to the new length
            want = int(kwargs["max_gen_toks"])
            if self.causal or self.objective == "bd3lm":
                gen.length = want
                if not self.causal and scale:
                    gen.steps = min(want, max(1, math.ceil(base_steps * want / base_len)))
            else:
                given = gen.get("block_length")
                block = given if "block_length" in kwargs and given else min(given or DEFAULT_BLOCK_LENGTH, want)
                gen.block_length = block
                gen.length = -(-want // block) * block
                if scale:
                    blocks = gen.length // block
                    steps = math.ceil(base_steps * gen.length / base_len)
                    gen.steps = max(blocks, -(-steps // blocks) * blocks)
        limit = int(kwargs["max_gen_toks"]) if "max_gen_toks" in kwargs else int(gen.length)
        return gen, until, limit

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of ``(context, gen_kwargs)`` requests, cut at the first ``until`` string."""
        out = []
        # group requests with equal gen settings into left-padded batches, each row sampled with a generator of its
        # own seeded with gen.seed (bd3lm: the rows of each prompt length together, unpadded,
        # difflm.generate.padded_block_generate), so a request gets the text it would get alone
        todo, cut = [], []
        for req in requests:
            context, kwargs = req.args
            gen, until, limit = self._request_gen(kwargs)
            ids = self.context_ids(context)
            keep = max(1, self.max_length - gen.length)  # the prompt and the new tokens share max_length positions
            if len(ids) > keep:
                cut.append((len(ids) - keep, len(ids), gen.length))
            todo.append((ids[-keep:], gen, until, context, kwargs, limit))
            if not self.told_beyond_window:  # max_length (model_args) or gen.length may exceed the trained window
                warning = beyond_trained_length(len(ids[-keep:]), gen.length, self.cfg.data.seq_len)
                if warning is not None:
                    eval_logger.warning(warning)
                    self.told_beyond_window = True
        if cut:
            eval_logger.warning(truncated_prompts_warning(cut, len(todo), self.max_length))
        bs = self.batch_size
        i = 0
        while i < len(todo):
            gen = todo[i][1]
            j = i + 1
            while j < len(todo) and j - i < bs and todo[j][1] == gen:
                j += 1
            group = todo[i:j]
            width = max(len(g[0]) for g in group)
            prompt = torch.full((len(group), width), self.tok.eos_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.bool)
            for r, (ids, *_rest) in enumerate(group):
                prompt[r, width - len(ids):] = torch.tensor(ids)
                mask[r, width - len(ids):] = True
            rows = [torch.Generator(device=self._device).manual_seed(int(gen.seed)) for _ in group]
            ids_out = generate_ids(self.model, self.tok, prompt.to(self._device), gen, self.causal,
                                   precision=self.precision, objective=self.cfg.objective,
                                   prompt_mask=None if bool(mask.all()) else mask.to(self._device), generator=rows)
            for r, (_ids, _gen, until, context, kwargs, limit) in enumerate(group):
                # at most max_gen_toks, cut at the end of text (EOS id), then at until
                text = decode_generated(self.tok, ids_out[r, :limit].cpu())
                for stop in until:
                    if stop and stop in text:
                        text = text[:text.index(stop)]
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
                out.append(text)
            i = j
        return out


def hub_unreachable(err: BaseException, tasks: str) -> str | None:
    """The one-line message for an lm-eval task whose dataset had to come from the Hugging Face hub and could not
    (offline mode, or no network): the task, the dataset and the fix. None for any other error.

    ``datasets.load_dataset`` raises ``ConnectionError("Couldn't reach 'NAME' on the Hub (OfflineModeIsEnabled)")``
    when ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1`` and the dataset is not cached.
    """
    import os
    import re

    for cause in exception_chain(err):
        text = str(cause)
        if isinstance(cause, ConnectionError) or type(cause).__name__ == "OfflineModeIsEnabled":
            match = re.search(r"reach '([^']+)'", text)
            dataset = f"dataset {match.group(1)!r}" if match else "its dataset"
            offline = [k for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(k, "") not in ("", "0")]
            fix = (f"run it once with network access and without {' / '.join(offline)}=1, so the dataset is cached"
                   if offline else "run it once with network access, so the dataset is cached")
            return f"lm-eval task(s) {tasks}: {dataset} is not cached and the Hugging Face hub cannot be reached: {fix}"
    return None


def difflm_error_in(err: BaseException) -> DifflmError | None:
    """The :class:`difflm.errors.DifflmError` that ``err`` is or was raised from (lm-eval may wrap what the model's
    constructor or requests raise; :func:`difflm.errors.exception_chain`), or None."""
    return next((e for e in exception_chain(err) if isinstance(e, DifflmError)), None)


def main() -> None:
    """``python -m difflm.eval_harness``: lm-eval's own command line with the ``difflm`` model registered. A
    difflm refusal (:class:`difflm.errors.DifflmError`: a bad ``model_args`` value, a run directory without a run)
    and a task whose dataset is not cached while the hub is unreachable (:func:`hub_unreachable`) end in one line,
    exit 2, as every ``difflm-*`` command's mistakes do."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv[1:]
    tasks = next((a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "?") for i, a in enumerate(argv)
                  if a == "--tasks" or a.startswith("--tasks=")), "?")
    try:
        cli_evaluate()
    except Exception as err:  # noqa: BLE001 - difflm's refusals and the hub case are reworded; the rest propagates
        refusal = difflm_error_in(err)
        message = str(refusal) if refusal is not None else hub_unreachable(err, tasks)
        if message is None:
            raise
        print(f"difflm: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
