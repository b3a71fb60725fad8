"""SFT on prompt/response pairs: tokenization and EOS padding, masking that never touches the prompt, the loss
normalisation, and a short training run on real GSM8K lines."""
from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from difflm.data import build_tokenizer
from difflm.data.batch import TokenBatch
from difflm.data.sft import build_sft_datasets
from difflm.errors import DifflmError
from difflm.objectives import SFTObjective, weighted_ce_sum
from tests.conftest import SHARED_DATA
from tests.dlm_helpers import objective_cfg

GSM8K = SHARED_DATA / "corpora" / "gsm8k" / "test.jsonl"
TOKENIZER = str(__import__("difflm.config", fromlist=["ASSETS"]).ASSETS / "tokenizers" / "gpt-neox-20b")
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason="GSM8K not present under /work/shared/data")


@pytest.fixture
def pairs_file(tmp_path):
    if not GSM8K.exists():
        pytest.skip("GSM8K not present under /work/shared/data")
    path = tmp_path / "gsm8k.jsonl"
    with open(GSM8K) as f:
        path.write_text("".join(itertools.islice(f, 12)))
    return path


def data_cfg(path, seq_len=160, **kw):
    return OmegaConf.create(dict(dict(path=str(path), prompt_field="question", response_field="answer", seq_len=seq_len,
                                      chat_template=False, valid_fraction=0.25), **kw))


def test_pairs_are_prompt_then_response_then_eos(pairs_file):
    tok = build_tokenizer(TOKENIZER)
    train, valid = build_sft_datasets(data_cfg(pairs_file), tok)
    assert len(train) == 9 and len(valid) == 3
    batch = train.get([0, 1])
    assert isinstance(batch, TokenBatch) and batch.tokens.shape == (2, 160)
    first = OmegaConf.create  # noqa: F841
    import json

    rec = json.loads(pairs_file.read_text().splitlines()[0])
    q = tok.tokenizer(rec["question"], add_special_tokens=False)["input_ids"]
    a = tok.tokenizer(rec["answer"], add_special_tokens=False)["input_ids"]
    row, n = batch.tokens[0].tolist(), int(batch.prompt_lengths[0])
    assert n == len(q) and row[:n] == q and row[n:n + len(a)] == a
    assert set(row[n + len(a):]) == {tok.eos_id}  # EOS after the answer and as padding
    sliced = batch[:, :10]
    assert sliced.tokens.shape == (2, 10) and int(sliced.prompt_lengths.max()) <= 10


def test_chat_template_without_template_names_key(pairs_file):
    tok = build_tokenizer(TOKENIZER)
    with pytest.raises(DifflmError, match="data.chat_template"):
        build_sft_datasets(data_cfg(pairs_file, chat_template=True), tok)


def test_missing_field_names_key(pairs_file):
    with pytest.raises(DifflmError, match="data.prompt_field='prompt'"):
        build_sft_datasets(data_cfg(pairs_file, prompt_field="prompt"), build_tokenizer(TOKENIZER))


def test_masking_never_touches_prompt_and_normalises_per_response():
    obj = SFTObjective(objective_cfg(name="sft", loss_norm="sequence"), 47)
    tokens = torch.randint(0, 40, (4, 24))
    lengths = torch.tensor([3, 10, 23, 0])
    for step in range(25):
        batch = obj.noise(TokenBatch(tokens, lengths), [0, 1, 2, 3], (1, 0, step), 4)
        for r, n in enumerate(lengths.tolist()):
            assert torch.equal(batch.input_ids[r, :n], tokens[r, :n])
            assert not batch.loss_mask[r, :n].any() and not batch.weights[r, :n].any()
        assert batch.num_tokens.tolist() == [21.0, 14.0, 1.0, 24.0]
    full = obj.noise(TokenBatch(tokens, lengths), [0, 1, 2, 3], (1, 0, 0), 4, t_sampling="stratified")
    assert full.loss_mask.any()
    # sequence normalisation: each row's weighted CE sum / its response length, averaged over the batch
    logits_all = torch.randn(4, 24, 50)
    got = weighted_ce_sum(logits_all[full.loss_mask], full, "sequence", 4)
    ce = torch.nn.functional.cross_entropy(logits_all.transpose(1, 2), tokens, reduction="none")
    want = ((ce * full.weights).sum(1) / torch.tensor([21.0, 14.0, 1.0, 24.0])).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_sft_needs_pairs():
    obj = SFTObjective(objective_cfg(name="sft"), 47)
    with pytest.raises(DifflmError, match="data.prompt_field"):
        obj.noise(torch.zeros(2, 8, dtype=torch.long), [0, 1], (0, 0, 0), 2)


def test_sft_config_checks(fast_cfg):
    from difflm.config.validate import check_run

    with pytest.raises(DifflmError, match="data.prompt_field"):
        check_run(fast_cfg("objective=sft", "device=cpu"))
    with pytest.raises(DifflmError, match="objective=sft"):
        check_run(fast_cfg("data.prompt_field=question", "device=cpu"))


@needs_gsm8k
def test_sft_trains_on_gsm8k(fast_cfg, pairs_file, tmp_path):
    from difflm.config.validate import check_run
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("objective=sft", f"data.path={pairs_file}", "data.prompt_field=question",
                   "data.response_field=answer", "data.seq_len=96", "data.valid_fraction=0.25",
                   "train.max_steps=2", "train.eval_every=2", "train.save_every=0", "device=cpu")
    device = check_run(cfg)
    metrics = Trainer(cfg, tmp_path / "run", device).fit()
    assert metrics["step"] == 2 and 0 < metrics["loss"] < 30 and "val_nelbo" in metrics
