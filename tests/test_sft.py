"""SFT on prompt/response pairs: tokenization and EOS padding, masking that never touches the prompt, the loss
normalisation, and a short training run on real GSM8K lines."""
from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from difflm.data import build_tokenizer
from difflm.data.batch import TokenBatch
from difflm.data.datasets import build_sft_datasets
from difflm.errors import DifflmError
from difflm.objectives import SFTObjective, loss_normaliser, weighted_ce_sum
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


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_IDS = [29, 93, 4537, 49651, 187, 1276, 310, 374, 5043, 495, 32, 187, 29, 93, 515, 5567, 49651, 187, 22, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("shape", ["native", "list (transformers 4.x)", "dict", "batch of one"])
def test_chat_template_prompt_for_every_return_type(shape, monkeypatch):
    """A fault report: transformers 5 returns a BatchEncoding from apply_chat_template, which gave the ids
    ['input_ids', 'attention_mask', 22, 0, ...] and prompt length 2. Right: prompt length 18 and CHAT_IDS, for the
    4.x list return too (transformers>=4.40 is allowed)."""
    from difflm.data.sft import tokenize_pair

    tok = build_tokenizer(TOKENIZER)
    tok.tokenizer.chat_template = CHAT_TEMPLATE
    native = tok.tokenizer.apply_chat_template
    wrap = {"native": lambda out: out, "list (transformers 4.x)": lambda out: list(out["input_ids"]),
            "dict": lambda out: {"input_ids": list(out["input_ids"])}, "batch of one": lambda out: [list(out["input_ids"])]}
    monkeypatch.setattr(tok.tokenizer, "apply_chat_template", lambda *a, **k: wrap[shape](native(*a, **k)))
    ids, n = tokenize_pair(tok, "What is 2 plus 3?", "5", 24, True)
    assert (ids, n) == (CHAT_IDS, 18)


def test_chat_template_keeps_special_token_text_of_the_prompt_as_text():
    """The prompt's own text never becomes a special token under the chat template either (the same kind of fault):
    the template keeps its special tokens, the prompt is encoded as plain text; ordinary prompts are unchanged."""
    from difflm.data.sft import chat_prompt_ids

    tok = build_tokenizer(TOKENIZER)
    tok.tokenizer.chat_template = CHAT_TEMPLATE
    plain = chat_prompt_ids(tok.tokenizer, "What is 2 plus 3?")
    assert plain == CHAT_IDS[:18]
    tricky = chat_prompt_ids(tok.tokenizer, "What is <|endoftext|> plus 3?")
    assert tok.eos_id not in tricky
    text_ids = tok.encode("What is <|endoftext|> plus 3?")
    assert tricky[:5] == plain[:5] and tricky[5:5 + len(text_ids)] == text_ids  # '<|user|>\n' then the text
    assert tricky[5 + len(text_ids):] == plain[-7:]  # '\n<|assistant|>\n'


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_chat_template_sft_cli_run_ends_well(tmp_path):
    """``difflm-train objective=sft data.chat_template=true`` with a tokenizer whose config holds a chat template."""
    import json
    import shutil

    from tests.conftest import FAST, run_cli

    tok_dir = tmp_path / "tok"
    shutil.copytree(TOKENIZER, tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"q": f"What is {i} plus 3?", "a": str(i + 3)}) + "\n" for i in range(8)))
    out = run_cli("difflm.train", *FAST, "objective=sft", f"data.path={pairs}", "data.prompt_field=q",
                  "data.response_field=a", "data.chat_template=true", f"data.tokenizer={tok_dir}", "data.seq_len=32",
                  "train.max_steps=2", "train.eval_every=2", "train.save_every=0", "device=cpu",
                  f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and 0 < rows[-1]["loss"] < 30 and rows[-1]["val_nelbo"] > 0


def test_missing_field_names_key(pairs_file):
    with pytest.raises(DifflmError, match="data.prompt_field='prompt'"):
        build_sft_datasets(data_cfg(pairs_file, prompt_field="prompt"), build_tokenizer(TOKENIZER))


def test_null_or_non_text_pair_fields_are_refused(tmp_path):
    """A null or non-text prompt / response is refused where it is, not trained on as the text "None" or "4"."""
    import json

    for rec, key in (({"question": None, "answer": "4"}, "prompt_field='question' is null"),
                     ({"question": "2+2?", "answer": 4}, "response_field='answer' is a value of type int")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps(rec) + "\n")
        with pytest.raises(DifflmError, match=rf"data.{key}.* in .*bad.jsonl:2, not text"):
            build_sft_datasets(data_cfg(bad), build_tokenizer(TOKENIZER))


@pytest.mark.parametrize("empty", ["", " \n"])
def test_sft_pair_with_an_empty_response_is_refused(tmp_path, empty):
    """A pair whose response is empty would train the model to end at once after its prompt (its only loss token
    is the EOS): refused naming the field and the line, as difflm-rl refuses an empty answer or response."""
    import json

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n"
                   + json.dumps({"question": "2+2?", "answer": empty}) + "\n")
    with pytest.raises(DifflmError) as info:
        build_sft_datasets(data_cfg(bad), build_tokenizer(TOKENIZER))
    assert str(info.value) == (f"data.response_field='answer' is empty in {bad}:2 (the pair would teach the model to "
                               "stop at once): fill in or remove that record, or point data.response_field at the "
                               "field that holds the text")


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


def test_token_normaliser_is_the_global_count_for_every_split():
    """A fault report: prompt lengths [2, 2, 12, 12] in rows of 16 give 14 + 14 + 4 + 4 = 36 response tokens. Each
    micro-batch used its own mean count, so micro-batches of 2 or 1 gave the ``sequence`` value."""
    from tests.dlm_helpers import tiny_model

    torch.manual_seed(3)
    tokens, lengths = torch.randint(0, 40, (4, 16)), torch.tensor([2, 2, 12, 12])
    obj, model = SFTObjective(objective_cfg(name="sft", t_sampling="stratified"), 47), tiny_model()
    key = (1234, 0)
    whole = obj.noise(TokenBatch(tokens, lengths), range(4), key, 4)
    assert obj.num_tokens(TokenBatch(tokens, lengths)).tolist() == [14.0, 14.0, 4.0, 4.0]
    assert float(loss_normaliser("token", whole.num_tokens)) == 36.0
    with torch.no_grad():
        logits = model(whole.input_ids, whole.loss_mask)
        ce = torch.nn.functional.cross_entropy(model(whole.input_ids).transpose(1, 2), tokens, reduction="none")
    want = float((ce * whole.weights).sum() / 36)
    per_seq = float(((ce * whole.weights).sum(1) / torch.tensor([14.0, 14.0, 4.0, 4.0])).mean())
    assert abs(want - per_seq) > 0.02 * want  # the two norms differ here, so the test can tell them apart
    for mb in (4, 2, 1):
        micro = [obj.noise(TokenBatch(tokens[i:i + mb], lengths[i:i + mb]), range(i, i + mb), key, 4)
                 for i in range(0, 4, mb)]
        normaliser = sum(loss_normaliser("token", b.num_tokens) for b in micro)
        with torch.no_grad():
            got = sum(float(weighted_ce_sum(model(b.input_ids, b.loss_mask), b, "token", normaliser)) for b in micro)
            seq = sum(float(weighted_ce_sum(model(b.input_ids, b.loss_mask), b, "sequence",
                                            sum(loss_normaliser("sequence", c.num_tokens) for c in micro)))
                      for b in micro)
        assert normaliser == 36.0
        assert got == pytest.approx(want, rel=1e-5), mb
        assert seq == pytest.approx(per_seq, rel=1e-5), mb
    assert float(weighted_ce_sum(logits, whole, "token", 36.0)) == pytest.approx(want, rel=1e-5)


@needs_gsm8k
@pytest.mark.parametrize("global_batch,micro_sizes", [(4, (4, 2, 1)), (3, (3, 1))])
def test_trainer_step_loss_does_not_depend_on_micro_batches(fast_cfg, pairs_file, tmp_path, global_batch, micro_sizes):
    """A fault report on the trainer: step-1 loss of objective=sft is the same for every micro-batch size (global
    batch 3: micro-batch 3 gave 11.2217, micro-batch 1 gave 10.1905), and so is the validation NELBO (total weighted
    CE / total response tokens, however the validation pairs are batched)."""
    from difflm.training.trainer import Trainer

    got = {}
    for mb in micro_sizes:
        cfg = fast_cfg("objective=sft", "objective.loss_norm=token", f"data.path={pairs_file}",
                       "data.prompt_field=question", "data.response_field=answer", "data.seq_len=96",
                       "data.valid_fraction=0.25", f"train.global_batch_size={global_batch}", f"train.micro_batch_size={mb}",
                       "train.eval_windows=3", f"train.max_steps=1", "train.eval_every=1", "train.save_every=0",
                       "device=cpu", f"run.dir={tmp_path / f'mb{mb}'}")
        trainer = Trainer(cfg, tmp_path / f"mb{mb}", torch.device("cpu"))
        out = trainer.train_step()
        got[mb] = (float(out["loss"]), trainer.evaluate())  # the 3 validation pairs in batches of mb
    ref = got[micro_sizes[0]]
    assert all(v[0] == pytest.approx(ref[0], rel=1e-5) for v in got.values()), got
    assert all(v[1] == pytest.approx(ref[1], rel=1e-5) for v in got.values()), got


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
    # a data budget would be ignored by the pair windows: refused, here and where the datasets are built
    with pytest.raises(DifflmError, match=r"data.max_train_tokens is not supported with objective=sft"):
        check_run(fast_cfg("objective=sft", "data.prompt_field=question", "data.max_train_tokens=4096",
                           "device=cpu"))
    from difflm.config.schema import DataConfig
    from difflm.data.datasets import build_datasets

    with pytest.raises(DifflmError, match=r"data.max_train_tokens is not supported with objective=sft"):
        build_datasets(DataConfig(path="pairs.jsonl", prompt_field="question", max_train_tokens=4096), None, "")


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


def test_pack_pairs_layout():
    """Greedy packing: pairs in order, none split, the last pair of a window owns the EOS padding."""
    from difflm.data.sft import pack_pairs

    eos = 0
    packed = pack_pairs([([1, 2], [3, eos]), ([4], [5, 6, eos]), ([7, 8, 9], [10, eos])], seq_len=8, eos_id=eos)
    assert packed.tokens.tolist() == [[1, 2, 3, eos, 4, 5, 6, eos], [7, 8, 9, 10, eos, eos, eos, eos]]
    assert packed.prompt_mask.astype(int).tolist() == [[1, 1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert packed.doc_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]]
    batch = packed.get([0, 1])
    assert batch.response_mask().sum(dim=1).tolist() == [5, 5]  # response + EOS (+ padding) tokens
    obj = SFTObjective(objective_cfg(name="sft"), 47)
    assert obj.num_tokens(batch).tolist() == [2.0, 3.0, 5.0]  # one response length per pair, padding to the last
    assert packed.pair_ids.tolist() == packed.doc_ids.tolist()


@pytest.mark.parametrize("intra_document_attention", [True, False])
def test_packed_sft_loss_is_the_per_pair_loss(intra_document_attention):
    """Packing is a compute saving only: 4 pairs in 2 rows give LLaDA's eq. 5 per pair (each pair's weighted CE sum
    over its own response length, averaged over the 4 pairs), computed here pair by pair from the same masks; the row
    normaliser gave a 2-token response 1/8 of its weight."""
    from difflm.data.sft import pack_pairs

    eos, vocab = 0, 50
    pairs = [([1, 2, 3], [4, 5, 6, 7, 8, 9, eos]), ([11, 12], [13, eos]),
             ([21], [22, 23, eos]), ([31, 32, 33, 34], [35, 36, 37, 38, eos])]
    packed = pack_pairs(pairs, seq_len=16, eos_id=eos)
    assert packed.tokens.shape == (2, 16)
    if not intra_document_attention:
        packed.doc_ids = None
    tb = packed.get([0, 1])
    obj = SFTObjective(objective_cfg(name="sft", loss_norm="sequence", t_sampling="stratified"), 47)
    lengths = obj.num_tokens(tb)
    assert lengths.tolist() == [7.0, 4.0, 3.0, 8.0]  # the last pair of a row owns its EOS padding
    assert float(loss_normaliser("sequence", lengths)) == 4.0  # pairs, not rows
    torch.manual_seed(0)
    for logits_all in (torch.zeros(2, 16, vocab), torch.randn(2, 16, vocab)):  # uniform, then random logits
        for step in range(4):
            batch = obj.noise(tb, [0, 1], (7, step), 2)
            got = weighted_ce_sum(logits_all[batch.loss_mask], batch, "sequence", 4.0, fused=False)
            ce = torch.nn.functional.cross_entropy(logits_all.transpose(1, 2), tb.tokens, reduction="none")
            # by hand: the mask and t of each row, the 1/p weight of each masked response token, per pair
            noised = super(SFTObjective, obj).noise(tb, [0, 1], (7, step), 2)
            response = tb.response_mask()
            want = 0.0
            for k in range(4):
                where = (tb.pair_ids == k)
                n = float((where & response).sum())
                m = where & response & noised.loss_mask
                want += float((ce[m] * noised.weights[m]).sum()) / n
            assert got.item() == pytest.approx(want / 4, rel=1e-5)


@pytest.mark.parametrize("options", [dict(t_lo=0.2, t_hi=0.9), dict(complementary_masks=True),
                                     dict(weighting="cart", cart_p=0.1), dict(diffusion_loss_weight=0.5)])
def test_adapted_packed_sft_loss_is_the_per_pair_loss(options):
    """The adaptation options (docs/adaptation.md) keep packed pairs' eq. 5: each pair's sum over its own response
    length, averaged over the pairs (not each row's sum over the row's response length, which would divide the 4
    pairs of 2 rows by their row)."""
    from difflm.data.sft import pack_pairs
    from difflm.objectives import build_objective

    eos, vocab = 0, 50
    pairs = [([1, 2, 3], [4, 5, 6, 7, 8, 9, eos]), ([11, 12], [13, eos]),
             ([21], [22, 23, eos]), ([31, 32, 33, 34], [35, 36, 37, 38, eos])]
    tb = pack_pairs(pairs, seq_len=16, eos_id=eos).get([0, 1])
    obj = build_objective(objective_cfg(name="sft", loss_norm="sequence", **options), 47)
    summed = build_objective(objective_cfg(name="sft", loss_norm="token", **options), 47)  # same noise, no 1/N
    assert float(loss_normaliser("sequence", obj.num_tokens(tb))) == 4.0
    torch.manual_seed(0)
    logits_all = torch.randn(2, 16, vocab)
    for step in range(3):
        batch = obj.noise(tb, [0, 1], (7, step), 2)
        rows = batch.input_ids.shape[0]  # 4 with complementary masks: both halves of every pair
        logits = logits_all.repeat(rows // 2, 1, 1)
        got = weighted_ce_sum(logits[batch.loss_mask], batch, "sequence", 4.0, fused=False)
        plain = summed.noise(tb, [0, 1], (7, step), 2)
        assert torch.equal(plain.loss_mask, batch.loss_mask)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tb.tokens.repeat(rows // 2, 1), reduction="none")
        pair_ids, response = tb.pair_ids.repeat(rows // 2, 1), tb.response_mask().repeat(rows // 2, 1)
        want = 0.0
        for k in range(4):
            n = float(((tb.pair_ids == k) & tb.response_mask()).sum())
            m = (pair_ids == k) & response & plain.loss_mask
            want += float((ce[m] * plain.weights[m]).sum()) / n
        assert got.item() == pytest.approx(want / 4, rel=1e-5)


@needs_gsm8k
def test_packed_pairs_see_only_themselves(pairs_file):
    """With intra-document attention a packed pair's logits equal those of the pair alone (RoPE is relative: the
    offset inside the window changes nothing the pair can see)."""
    from difflm.data.sft import load_pairs
    from difflm.model.masks import DocumentMask
    from tests.dlm_helpers import tiny_model

    tok = build_tokenizer(TOKENIZER)
    cfg = data_cfg(pairs_file, seq_len=256, sft_packing=True, intra_document_attention=True)
    packed = load_pairs(cfg, tok)
    assert packed.tokens.shape[0] < 12 and packed.doc_ids is not None  # several pairs a window
    row = packed.get([0])
    model = tiny_model(vocab=tok.padded_vocab_size)
    with torch.no_grad():
        logits = model(row.tokens, attn_mask=DocumentMask(row.doc_ids))
        for k in row.doc_ids[0].unique().tolist()[:2]:
            where = (row.doc_ids[0] == k).nonzero().flatten()
            alone = model(row.tokens[:, where])
            torch.testing.assert_close(logits[0, where], alone[0], atol=2e-5, rtol=1e-4)
    assert load_pairs(data_cfg(pairs_file, seq_len=256, sft_packing=True), tok).doc_ids is None  # no mask asked


def test_sft_packing_config_checks(fast_cfg):
    from difflm.config.validate import check_objective_data

    with pytest.raises(DifflmError, match="add data.sft_packing=true"):
        check_objective_data(fast_cfg("objective=sft", "data.path=pairs.jsonl",
                                      "data.prompt_field=q", "data.intra_document_attention=true",
                                      "objective.random_length_prob=0"))
    with pytest.raises(DifflmError, match="data.sft_packing=true packs prompt/response pairs"):
        check_objective_data(fast_cfg("data.sft_packing=true"))
    check_objective_data(fast_cfg("objective=sft", "data.path=pairs.jsonl",
                                  "data.prompt_field=q", "data.intra_document_attention=true",
                                  "data.sft_packing=true", "objective.random_length_prob=0"))


@needs_gsm8k
def test_packed_sft_trains_with_intra_document_attention(fast_cfg, pairs_file, tmp_path):
    from difflm.config.validate import check_run
    from difflm.training.trainer import Trainer

    cfg = fast_cfg("objective=sft", f"data.path={pairs_file}", "data.prompt_field=question",
                   "data.response_field=answer", "data.seq_len=256", "data.valid_fraction=0.25",
                   "data.sft_packing=true", "data.intra_document_attention=true", "train.global_batch_size=2",
                   "train.micro_batch_size=1", "train.max_steps=2", "train.eval_every=2", "train.save_every=0",
                   "device=cpu")
    metrics = Trainer(cfg, tmp_path / "run", check_run(cfg)).fit()
    assert metrics["step"] == 2 and 0 < metrics["loss"] < 30 and metrics["val_nelbo"] > 0


def test_sft_refuses_a_hub_dataset_it_would_not_read(tmp_path):
    """objective=sft reads pairs from data.path's JSONL files only: a data.hf_dataset would be silently ignored."""
    from conftest import compose_run
    from difflm.config.validate import check_objective_data

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text('{"prompt": "1+1?", "response": "2"}\n', encoding="utf-8")
    args = ["objective=sft", f"data.path={pairs_file}", "data.prompt_field=prompt", "data.response_field=response"]
    check_objective_data(compose_run(args))  # the JSONL file alone is fine
    with pytest.raises(DifflmError, match=r"^data.hf_dataset='org/pairs': objective=sft reads .* data.path: set data.path and data.hf_dataset=null"):
        check_objective_data(compose_run([*args, "data.hf_dataset=org/pairs"]))


def test_truncation_notice_counts_cut_pairs_and_prompts_that_fill_the_window():
    from difflm.data.sft import cut_pair, truncation_notice

    # (prompt, response + EOS) lengths at seq_len 8: fits exactly, fits, cut by one (loses only its EOS),
    # prompt fills the window (7 and 9 prompt tokens)
    pairs = [([1] * 4, [2] * 4), ([1] * 2, [2] * 3), ([1] * 5, [2] * 4), ([1] * 7, [2] * 3), ([1] * 9, [2] * 2)]
    assert truncation_notice(pairs[:2], 8) is None
    text = truncation_notice(pairs, 8)
    assert text.startswith("data.seq_len=8 cuts 3 of 5 prompt/response pairs (60.0%)")
    assert "in 2 of them the prompt alone fills the window" in text
    assert "The longest pair has 11 tokens: raise data.seq_len (data.seq_len=11 keeps every pair whole)" in text
    for p, r in pairs[3:]:  # what the notice says they keep: the end of the prompt and one response token
        kept_p, kept_r = cut_pair(p, r, 8)
        assert len(kept_p) == 7 and len(kept_r) == 1


@needs_gsm8k
def test_sft_says_how_many_gsm8k_pairs_seq_len_128_cuts(capsys):
    """The new-user case: 862 of GSM8K's 1,319 test pairs are longer than 128 tokens; the count is the one a direct
    tokenization gives, and the notice names the fix."""
    import json

    from difflm.data.sft import load_pairs

    tok = build_tokenizer(TOKENIZER)
    recs = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    enc = lambda t: tok.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    lengths = [len(enc(r["question"])) + len(enc(r["answer"])) + 1 for r in recs]  # + the response's EOS
    expected = sum(n > 128 for n in lengths)
    assert (expected, len(recs)) == (862, 1319)
    rows = load_pairs(data_cfg(GSM8K, seq_len=128), tok)
    err = capsys.readouterr().err
    assert len(rows) == 1319 and err.count("difflm: notice:") == 1
    assert f"data.seq_len=128 cuts 862 of 1,319 prompt/response pairs (65.4%)" in err
    assert f"raise data.seq_len (data.seq_len={max(lengths)} keeps every pair whole)" in err
    load_pairs(data_cfg(GSM8K, seq_len=max(lengths)), tok)  # every pair fits: no notice
    assert "notice" not in capsys.readouterr().err


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]


def _conversations_file(tmp_path, convs):
    import json

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(convs)))
    return path


def conv_cfg(path, seq_len=64, **kw):
    return OmegaConf.create(dict(dict(path=str(path), messages_field="messages", seq_len=seq_len, chat_template=False,
                                      valid_fraction=0.0), **kw))


def test_conversation_loss_is_on_assistant_turns_only_plain_format(tmp_path):
    """Plain format, built by hand: 'role: content\\n' turns; an assistant turn's header is prompt, its content and EOS
    are the loss tokens. The SFT objective never masks (or scores) a system or user token."""
    from difflm.data.datasets import load_sft_samples

    tok = build_tokenizer(TOKENIZER)
    enc, eos = tok.encode, tok.eos_id
    want = [(enc("system: Be brief.\n"), True), (enc("user: Hi\n"), True), (enc("assistant: "), True),
            (enc("Hello!") + [eos], False), (enc("user: 2+2?\n"), True), (enc("assistant: "), True),
            (enc("4") + [eos], False)]
    ids = [i for part, _ in want for i in part]
    prompt = [p for part, p in want for _ in part]
    rows = load_sft_samples(conv_cfg(_conversations_file(tmp_path, [CONVERSATION]), seq_len=len(ids) + 3), tok)
    assert rows.tokens.tolist() == [ids + [eos] * 3]
    assert rows.prompt_mask.tolist() == [prompt + [False] * 3]
    batch = rows.get([0])
    obj = SFTObjective(objective_cfg(name="sft", loss_norm="sequence", t_sampling="stratified"), 47)
    assert obj.num_tokens(batch).tolist() == [float(len(enc("Hello!")) + 1 + len(enc("4")) + 1 + 3)]
    masked = 0
    for step in range(20):
        noised = obj.noise(batch, [0], (5, step), 1)
        assert not noised.loss_mask[0][torch.tensor(prompt + [False] * 3)].any()
        masked += int(noised.loss_mask.sum())
        kept = torch.tensor(prompt + [False] * 3)
        assert torch.equal(noised.input_ids[0][kept], torch.tensor([i for i, p in zip(ids, prompt) if p]))
    assert masked > 0


def test_conversation_with_chat_template_and_packing(tmp_path, capsys):
    """Under the chat template the loss tokens are what each assistant turn adds to the template's rendering with
    the generation prompt ('Hello!\\n' and '4\\n' with this template); packed conversations keep one normaliser
    each; a conversation without an assistant turn is skipped with a notice; bad records are one line."""
    from difflm.data.conversations import templated_ids
    from difflm.data.datasets import load_sft_samples

    tok = build_tokenizer(TOKENIZER)
    tok.tokenizer.chat_template = CHAT_TEMPLATE
    ids, prompt = templated_ids(tok, CONVERSATION)
    text = tok.tokenizer.decode
    assert text([i for i, p in zip(ids, prompt) if not p]) == "Hello!\n4\n"
    assert text(ids) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!\n<|user|>\n2+2?\n<|assistant|>\n4\n"
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    silent = [{"role": "user", "content": "anyone?"}]
    path = _conversations_file(tmp_path, [CONVERSATION, short, silent, short])
    short_ids, short_prompt = templated_ids(tok, short)
    n = len(ids) + len(short_ids)
    packed = load_sft_samples(conv_cfg(path, seq_len=n, chat_template=True, sft_packing=True), tok)
    assert packed.tokens.shape[0] == 2 and packed.doc_ids is None
    assert packed.pair_ids.tolist()[0] == [0] * len(ids) + [1] * (n - len(ids))
    batch = packed.get([0, 1])
    lengths = SFTObjective(objective_cfg(name="sft"), 47).num_tokens(batch)
    yo = sum(not p for p in short_prompt)
    assert text([i for i, p in zip(short_ids, short_prompt) if not p]) == "Yo\n"
    # per conversation: its assistant tokens; the last of a row also owns the row's EOS padding
    assert lengths.tolist() == [float(len(tok.encode("Hello!\n4\n"))), float(yo), float(yo + n - len(short_ids))]
    assert "1 of 4 conversations in data.path=" in capsys.readouterr().err
    import json

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(DifflmError, match=r"data.messages_field='messages' is not a list of \{role, content\} turns "
                                          r"in .*bad.jsonl:1"):
        load_sft_samples(conv_cfg(bad), tok)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": None}]}) + "\n")
    with pytest.raises(DifflmError, match=r"is null in .*bad.jsonl:1 turn 0, not text"):
        load_sft_samples(conv_cfg(bad), tok)
    # an empty assistant turn: its only loss token would end the turn at once (a user turn may be empty)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}]})
                   + "\n")
    with pytest.raises(DifflmError) as info:
        load_sft_samples(conv_cfg(bad), tok)
    assert str(info.value) == (f"data.messages_field='messages': the assistant turn in {bad}:1 turn 1 is empty (its "
                               "only loss token would teach the model to end the turn at once): fill it in or remove "
                               "that record")



def test_messages_field_config_checks(fast_cfg):
    """data.messages_field makes SFT data: objective=sft takes it instead of prompt_field, not both, and no other
    objective takes it."""
    from difflm.config.validate import check_objective_data

    check_objective_data(fast_cfg("objective=sft", "data.path=pairs.jsonl",
                                  "data.messages_field=messages", "objective.random_length_prob=0"))
    with pytest.raises(DifflmError, match="name two kinds of SFT data: set one of them to null"):
        check_objective_data(fast_cfg("objective=sft", "data.path=pairs.jsonl",
                                      "data.messages_field=messages", "data.prompt_field=q",
                                      "objective.random_length_prob=0"))
    with pytest.raises(DifflmError, match="data.messages_field='messages' makes conversation data, which only "
                                          "objective=sft uses"):
        check_objective_data(fast_cfg("data.messages_field=messages"))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A 2-step ``objective=sft data.chat_template=true`` run (tokenizer with CHAT_TEMPLATE) that drew one sample at
    the end of training, with the prompt ids every sampler call received."""
    import json
    import shutil

    import difflm.generate
    from difflm.training.trainer import Trainer
    from tests.conftest import FAST, compose_run

    root = tmp_path_factory.mktemp("chat_run")
    tok_dir = root / "tok"
    shutil.copytree(TOKENIZER, tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"q": f"What is {i} plus 3?", "a": str(i + 3)}) + "\n" for i in range(8)))
    cfg = compose_run([*FAST, "objective=sft", f"data.path={pairs}", "data.prompt_field=q", "data.response_field=a",
                       "data.chat_template=true", f"data.tokenizer={tok_dir}", "train.max_steps=2",
                       "train.eval_every=0", "train.save_every=2", "logger.num_samples=1",
                       "logger.sample_prompt=What is 2 plus 3?", "gen.length=8", "gen.steps=8", "gen.block_length=8",
                       f"run.dir={root / 'run'}", f"data.cache_dir={root / 'cache'}", "device=cpu"])
    seen = []
    real = difflm.generate.generate_ids
    mp = pytest.MonkeyPatch()
    mp.setattr(difflm.generate, "generate_ids", lambda model, tok, ids, *a, **k: seen.append(ids.tolist())
               or real(model, tok, ids, *a, **k))
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    try:
        trainer.fit()
    finally:
        mp.undo()
    return root / "run", seen, trainer


def _recording(monkeypatch, module):
    """Record the prompt ids ``module``'s ``generate_ids`` receives (and still generate)."""
    seen, real = [], module.generate_ids
    monkeypatch.setattr(module, "generate_ids", lambda model, tok, ids, *a, **k: seen.append(ids.tolist())
                        or real(model, tok, ids, *a, **k))
    return seen


def test_chat_run_samples_with_its_template_on_every_path(chat_run, monkeypatch):
    """A run trained on chat-template prompts is sampled with the template: the samples at the end of training,
    difflm-generate and the lm-eval adapter's generate_until and loglikelihood; chat_template=false skips it."""
    import difflm.eval_harness
    import difflm.generate
    from lm_eval.api.instance import Instance

    from difflm.config.schema import GenerateRunConfig
    from difflm.eval_harness import DifflmHarnessLM

    run, trainer_seen, _ = chat_run
    templated, plain = CHAT_IDS[:18], build_tokenizer(TOKENIZER).encode("What is 2 plus 3?")
    assert trainer_seen == [[templated]]  # logger.num_samples=1 at gen.temperature=0: one row
    assert (run / "samples.txt").read_text().startswith("--- step 2 sample 0 ---\nWhat is 2 plus 3?")

    seen = _recording(monkeypatch, difflm.generate)
    for switch, want in [(None, templated), (True, templated), (False, plain)]:
        args = OmegaConf.merge(OmegaConf.structured(GenerateRunConfig), {
            "run": {"dir": str(run)}, "prompt": "What is 2 plus 3?", "chat_template": switch, "device": "cpu"})
        text = difflm.generate.generate_text(args, set())
        assert text.startswith("What is 2 plus 3?") and seen.pop() == [want], switch

    seen = _recording(monkeypatch, difflm.eval_harness)
    request = [Instance("generate_until", {}, ("What is 2 plus 3?", {"until": [], "max_gen_toks": 8}), 0)]
    for switch, want in [(None, templated), ("false", plain)]:
        lm = DifflmHarnessLM(run_dir=str(run), device="cpu", chat_template=switch)
        lm.generate_until(request)
        assert seen.pop() == [want], switch
        assert lm.encode_pair("What is 2 plus 3?", " 5") == (want, lm.tok_encode(" 5"))
    # lm-eval's --apply_chat_template: it renders the chat through the hook, and the context is not wrapped again
    lm = DifflmHarnessLM(run_dir=str(run), device="cpu")
    rendered = lm.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}])
    assert rendered == "<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n" and lm.chat_template(True) == CHAT_TEMPLATE
    lm.generate_until([Instance("generate_until", {}, (rendered, {"until": [], "max_gen_toks": 8}), 0)])
    assert seen.pop() == [templated]
    assert lm.chat_template(False) is None and lm.tokenizer_name


def test_generated_text_ends_at_eos_on_every_path_and_past_the_window_warns_once(chat_run, monkeypatch, capsys, caplog):
    """An SFT model pads its answer with EOS: difflm-generate, the samples of difflm-train and the lm-eval adapter
    print the text up to the first EOS id, not pages of <|endoftext|>; a prompt and gen.length beyond data.seq_len
    (32 here) draw one warning line per command."""
    import logging

    import difflm.eval_harness
    import difflm.generate
    from lm_eval.api.instance import Instance

    from difflm.config.schema import GenerateRunConfig
    from difflm.eval_harness import DifflmHarnessLM

    run, _, trainer = chat_run
    tok = trainer.tok
    answer = tok.encode(" 5, since 2 + 3 = 5")
    assert tok.eos_id not in answer and len(answer) < 16
    made = answer + [tok.eos_id] + tok.encode(" more") + [tok.eos_id] * (16 - len(answer) - 2)

    def fake(model, tk, ids, gen, *a, **k):  # every sampler's output goes through generate_ids
        assert gen.length == 16
        return torch.tensor([made] * ids.shape[0])

    for module in (difflm.generate, difflm.eval_harness):
        monkeypatch.setattr(module, "generate_ids", fake)
    assert difflm.generate.cut_at_eos(made, tok.eos_id) == answer
    assert difflm.generate.cut_at_eos(torch.tensor(answer), tok.eos_id) == answer  # no EOS: all of it

    args = OmegaConf.merge(OmegaConf.structured(GenerateRunConfig), {
        "run": {"dir": str(run)}, "prompt": "What is 2 plus 3?", "device": "cpu",
        "gen": {"length": 16, "steps": 16, "block_length": 16}})
    capsys.readouterr()
    typed = {"length", "steps", "block_length"}
    assert difflm.generate.generate_text(args, typed) == "What is 2 plus 3? 5, since 2 + 3 = 5"
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if "data.seq_len" in line]
    assert warned == ["difflm: warning: the prompt (18 tokens) and gen.length=16 make 34 positions, more than the "
                      "run's data.seq_len=32 it was trained on: expect poor text; shorten the prompt or gen.length"]

    trainer.cfg.gen.length, trainer.cfg.gen.steps, trainer.cfg.gen.block_length = 16, 16, 16
    assert trainer.generate_samples("What is 2 plus 3?", 2) == ["What is 2 plus 3? 5, since 2 + 3 = 5"] * 2
    trainer.generate_samples("What is 2 plus 3?", 1)
    assert capsys.readouterr().out.count("data.seq_len=32") == 1  # once per run

    lm = DifflmHarnessLM(run_dir=str(run), device="cpu", max_length=64)
    with caplog.at_level(logging.WARNING, logger="difflm.eval_harness"):
        request = ("What is 2 plus 3?", {"until": [], "max_gen_toks": 16})
        out = lm.generate_until([Instance("generate_until", {}, request, i) for i in range(2)])
    assert out == [" 5, since 2 + 3 = 5"] * 2
    assert sum("data.seq_len=32" in r.getMessage() for r in caplog.records) == 1


def test_generate_infills_a_placeholder_inside_the_chat_prompt(chat_run, monkeypatch):
    """difflm-generate prompt="What is <|mask|> plus 3?": the placeholder becomes one mask id inside the templated
    prompt, the sampler fills it and keeps the rest, and the printed prompt shows the sampled token in its place."""
    import difflm.generate
    from difflm.config.schema import GenerateRunConfig

    run, _, trainer = chat_run
    tok = trainer.tok
    calls = []
    real = difflm.generate.generate_ids

    def spy(model, tk, ids, *a, **k):
        out = real(model, tk, ids, *a, **k)
        calls.append((ids.tolist()[0], k.get("infill"), out[0].tolist()))
        return out

    monkeypatch.setattr(difflm.generate, "generate_ids", spy)
    args = OmegaConf.merge(OmegaConf.structured(GenerateRunConfig), {
        "run": {"dir": str(run)}, "prompt": "What is <|mask|> plus 3?", "device": "cpu"})
    text = difflm.generate.generate_text(args, set())
    (ids, infill, out), = calls
    m = tok.mask_id
    assert infill is True
    assert ids == CHAT_IDS[:5] + tok.encode("What is ") + [m] + tok.encode(" plus 3?") + CHAT_IDS[11:18]
    hole = ids.index(m)
    assert [o for i, o in enumerate(out[:len(ids)]) if i != hole] == [t for i, t in enumerate(ids) if i != hole]
    assert out[hole] != m and len(out) == len(ids) + 8
    assert text.startswith("What is " + tok.decode([out[hole]]) + " plus 3?")
    args.mask_placeholder = None  # off: the text is kept as text
    difflm.generate.generate_text(args, set())
    assert calls[-1][1] is False and m not in calls[-1][0]
