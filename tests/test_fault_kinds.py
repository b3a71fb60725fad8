"""Neighbouring paths of known fault kinds, each against a value computed independently: sampling under
``model.shift_logits`` with right padding, ``difflm-eval`` on small inputs (every window, the partial last one
included) and bits per byte at window edges (each byte of the text counted once)."""
from __future__ import annotations

import itertools

import pytest
import torch

from difflm.errors import DifflmError
from difflm.sampling import GenerationOptions, diffusion_generate
from tests.dlm_helpers import model_fn, tiny_model

MASK = 47
TEXT = "Tōkyō 東京 🙂 ok"  # 22 UTF-8 bytes; the NeoX tokenizer splits 東 over two tokens (ids 5 and 6)


# ------------------------------------------------------------------ shift_logits: padded rows as if alone

def test_shift_logits_right_padded_rows_generate_as_alone():
    """Right- and left-padded rows beside a longer row give the tokens of the prompt alone, for two block
    lengths, threshold decoding, guidance and every cache (a 1-layer model, for which the caches are exact)."""
    model = tiny_model(std=1.0, shift_logits=True, layers=1, seed=2)
    g = torch.Generator().manual_seed(0)
    for (length, block, steps), v in itertools.product([(4, 4, 4), (8, 2, 4)],
                                                       [dict(), dict(threshold=0.3), dict(cfg_scale=1.0)]):
        p = torch.randint(0, 40, (2,), generator=g).tolist()
        other = torch.randint(0, 40, (4,), generator=g).tolist()
        for cache in ("none", "prefix", "dual"):
            o = GenerationOptions(mask_id=MASK, length=length, steps=steps, block_length=block, forbid_ids=[MASK],
                                  shift_logits=True, cache=cache, **v)
            alone = diffusion_generate(model_fn(model), torch.tensor([p]), o)[0, 2:].tolist()
            for side in ("right", "left"):
                row = p + [0, 0] if side == "right" else [0, 0] + p
                real = [True, True, False, False] if side == "right" else [False, False, True, True]
                got = diffusion_generate(model_fn(model), torch.tensor([row, other]), o,
                                         prompt_mask=torch.tensor([real, [True] * 4]))
                assert got[0, 4:].tolist() == alone, (length, block, v, cache, side)


# ------------------------------------------------------------------ bits per byte: each byte once

@pytest.fixture(scope="module")
def tok():
    from difflm.data.tokenizer import build_tokenizer
    from tests.conftest import compose_run

    return build_tokenizer(compose_run([]).data.tokenizer)


def test_token_bytes_count_each_byte_once_at_every_cut(tok):
    from difflm.evaluate import document_bytes, token_bytes

    ids = tok.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream = [*ids, tok.eos_id, *ids, tok.eos_id]
    want = 2 * len(TEXT.encode("utf-8"))
    assert tok.tokenizer.decode(ids[:6]).endswith("\ufffd")  # the cut after id 5 splits a character
    assert sum(token_bytes(tok, stream, p) for p in range(len(stream))) == want
    for k in range(len(stream) + 1):  # a window edge at k: the bytes before it and those after it
        before = document_bytes(tok, stream[:k], cut_end=True)
        assert before + sum(token_bytes(tok, stream, p) for p in range(k, len(stream))) == want, k
        assert document_bytes(tok, stream[:k], cut_end=True) <= document_bytes(tok, stream[:k])
    assert token_bytes(tok, stream, len(ids)) == 0  # the EOS


from test_eval import _train  # noqa: E402 - the one-step run with a checkpoint


def _evaluate(*overrides):
    from difflm.evaluate import evaluate_file
    from tests.conftest import compose_run

    return evaluate_file(compose_run(["device=cpu", "eval.mc_samples=2", *overrides], config_name="eval"),
                         torch.device("cpu"))


def test_eval_bytes_and_small_inputs(fast_cfg, tmp_path, tok):
    """A character split across two windows counted once (it was counted in both: 3 + 3 bytes of U+FFFD for 3);
    a file of one full window and a partial one is evaluated whole (it was refused: no validation split exists in
    an eval of a file); an empty file is refused in one line."""
    ids = tok.tokenizer(TEXT, add_special_tokens=False)["input_ids"]  # 11 ids + EOS = 12
    data = tmp_path / "tokyo.txt"
    data.write_text(TEXT + "\n")
    mdlm = _train(fast_cfg, f"run.dir={tmp_path / 'mdlm'}")
    run = f"run.dir={mdlm.run_dir}"
    for seq_len, windows in ((6, 2), (5, 3), (4, 3), (64, 1)):  # 6: the edge at 6 splits 東; 64: one partial window
        got = _evaluate(run, f"data.path={data}", f"data.seq_len={seq_len}")
        assert (got["windows"], got["tokens"], got["bytes"]) == (windows, len(ids) + 1, 22), seq_len
    # eval.max_windows=1 ends the evaluated text inside 東: the window holds its first bytes, not all of them
    got = _evaluate(run, f"data.path={data}", "data.seq_len=6", "eval.max_windows=1")
    assert (got["windows"], got["tokens"], got["bytes"]) == (1, 6, len("Tōkyō ".encode()))
    # the partial window is batched alone: the estimate does not depend on eval.batch_size
    one, four = (_evaluate(run, f"data.path={data}", "data.seq_len=5", f"eval.batch_size={b}") for b in (1, 4))
    assert one["nelbo"] == pytest.approx(four["nelbo"], rel=1e-6) and one["windows"] == 3
    # one full window of 64 tokens and a partial one: every token scored
    line = "To be, or not to be, that is the question:"
    k = 9
    doc = "\n".join([line] * k)  # a text file is one document (its last newline is not text)
    total = len(tok.tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1  # + EOS
    assert 64 < total < 128
    data = tmp_path / "small.txt"
    data.write_text(doc + "\n")
    got = _evaluate(run, f"data.path={data}", "data.seq_len=64")
    assert (got["windows"], got["tokens"], got["bytes"]) == (2, total, len(doc.encode()))
    assert got["nelbo"] > 0 and got["nelbo_stderr"] is not None
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DifflmError, match="gives an empty corpus"):
        _evaluate(run, f"data.path={empty}")
    # ar: the first token of each window is not predicted, and its bytes are not counted: windows of 6 score
    # "ōkyō " (7 bytes; 東's first bytes end the window and complete in the unscored id 6) and "京 🙂 ok" (11)
    ar = _train(fast_cfg, "objective=ar", f"run.dir={tmp_path / 'ar'}")
    got = _evaluate(f"run.dir={ar.run_dir}", f"data.path={tmp_path / 'tokyo.txt'}", "data.seq_len=6")
    assert (got["windows"], got["tokens"], got["bytes"]) == (2, 10, len("ōkyō ".encode()) + len("京 🙂 ok".encode()))
    got = _evaluate(f"run.dir={ar.run_dir}", f"data.path={tmp_path / 'tokyo.txt'}", "data.seq_len=11")
    assert (got["windows"], got["tokens"]) == (1, 10)  # the partial window of 1 token has nothing to predict


def test_window_spans_cover_the_stream():
    from difflm.evaluate import window_spans

    assert window_spans(123, 64) == [(0, 64), (64, 123)]
    assert window_spans(128, 64) == [(0, 64), (64, 128)]
    assert window_spans(10, 4, multiple=4) == [(0, 4), (4, 8)]  # bd3lm: whole blocks of the tail
    assert window_spans(13, 4, multiple=2) == [(0, 4), (4, 8), (8, 12)]
    assert window_spans(9, 4, min_len=2) == [(0, 4), (4, 8)]  # ar: a 1-token tail predicts nothing
    assert window_spans(0, 4) == []


def test_a_response_cut_inside_a_character_counts_its_whole_characters_only(tok):
    """An sft pair cut at data.seq_len inside a character: its scored response counts the whole characters."""
    from difflm.evaluate import document_bytes

    ids = tok.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert document_bytes(tok, ids[:6], cut_end=True) == len("Tōkyō ".encode())  # 東 starts in id 5, ends in id 6
    assert document_bytes(tok, [*ids, tok.eos_id], cut_end=True) == 22  # a response ended by its EOS: all of it


# ------------------------------------------------------------------ lm-eval request fields

@pytest.mark.parametrize("objective", ["mdlm", "bd3lm", "ar"])
def test_request_gen_for_every_block_length(objective):
    """max_gen_toks gives a setting every sampler accepts, generating at least max_gen_toks (exactly that many for
    ar and bd3lm), and the request returns at most max_gen_toks (a bd3lm run with max_gen_toks under its
    gen.block_length got a block_length it refuses)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    pytest.importorskip("lm_eval")
    from difflm.eval_harness import DifflmHarnessLM
    from difflm.sampling.diffusion import _validate
    from difflm.sampling.options import unread_stored_settings

    lm = DifflmHarnessLM.__new__(DifflmHarnessLM)
    lm.objective, lm.causal = objective, objective == "ar"
    lm.tok = SimpleNamespace(eos_id=0, tokenizer=SimpleNamespace(decode=lambda ids: "<|endoftext|>"))
    for run_block, block, want in itertools.product([64, 8], [None, 1, 4, 32, 64], [1, 5, 40, 64]):
        stored = OmegaConf.create(dict(length=64, steps=64, block_length=run_block, remasking="low_confidence",
                                       temperature=0.0, seed=0, top_k=0, top_p=1.0, cfg_scale=0.0, threshold=None,
                                       cache="none"))
        lm.gen = OmegaConf.merge(stored, unread_stored_settings(objective, stored))  # as the harness reads a run
        if objective != "mdlm" and block is not None or objective == "ar" and run_block != 64:
            continue  # ar and bd3lm runs do not read block_length (an ar run's is reset to the default)
        if objective == "bd3lm" and run_block != 8:
            continue  # the harness holds a bd3lm run's block_length as its block size (null resolved, __init__)
        kwargs = {"max_gen_toks": want, "until": ["\n"], **({} if block is None else {"block_length": block})}
        gen, until, limit = lm._request_gen(kwargs)
        assert limit == want and until == ["\n", "<|endoftext|>"]
        o = GenerationOptions.from_config(gen, mask_id=MASK, block_size=8 if objective == "bd3lm" else None)
        if objective == "mdlm":
            _validate(o)
            assert want <= o.length < want + o.block_length
        elif objective == "bd3lm":
            o.check_block_diffusion()
            assert o.length == want
        else:
            o.check_autoregressive()
            assert o.length == want
