"""Tests for difflm.data: tokenizer, Megatron .bin/.idx, preprocessing cache, windows, sampler."""
import json
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from difflm.config.schema import DataConfig
from difflm.data import (
    GlobalBatchSampler, IndexedDataset, IndexedDatasetBuilder, PackedWindows, build_datasets,
    build_tokenizer, build_windows, tokenize_corpus,
)
from difflm.errors import DifflmError

REPO = Path(__file__).resolve().parents[1]
NEOX = REPO / "difflm/assets/tokenizers/gpt-neox-20b"
SHAKESPEARE = REPO / "difflm/assets/corpora/tinyshakespeare/input.txt"
SHARED = REPO.parent / "shared" / "data"  # CI puts ../shared beside the clone

DOCS_A = ["First story.\nIt has two lines.", "Second  story, with   spaces\tand tabs.", "Ünïcödé — “quotes” 你好 🙂"]
DOCS_B = ["A jsonl document.", "Another one\nwith a newline.", "x"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(str(NEOX))


def cfg_for(path, **kw):
    return DataConfig(path=str(path), **kw)


def write_sep_txt(path, docs, newline="\n"):
    # separator lines, plus an empty document that must be skipped
    text = "\n<|endoftext|>\n".join(docs) + "\n<|endoftext|>\n\n<|endoftext|>\n"
    with open(path, "w", encoding="utf-8", newline=newline) as f:
        f.write(text)


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")


def decoded_docs(ds, tok):
    return [tok.decode(ds[i]) for i in range(len(ds))]


# ---------------------------------------------------------------- tokenizer
def test_neox_tokenizer(tok):
    assert (tok.eos_id, tok.mask_id, tok.padded_vocab_size) == (0, 50277, 50304)
    ids = tok.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert ids == [12092, 1533]
    assert tok.decode([12092, tok.mask_id, 1533]) == "Hello world"
    assert tok.decode(torch.tensor([12092, 1533])) == "Hello world"


def test_gpt2_tokenizer():
    path = SHARED / "tokenizers" / "gpt2"
    if not path.is_dir():
        pytest.skip(f"GPT-2 tokenizer not found at {path} (../shared beside the repo)")
    t = build_tokenizer(str(path))
    assert (t.eos_id, t.mask_id, t.padded_vocab_size) == (50256, 50257, 50304)
    assert build_tokenizer(str(path), vocab_multiple=64).padded_vocab_size == 50304
    assert build_tokenizer(str(path), vocab_multiple=1).padded_vocab_size == 50258


def test_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(DifflmError, match="data.tokenizer"):
        build_tokenizer(str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DifflmError, match="data.tokenizer=.*HF_HUB_OFFLINE=0"):
        build_tokenizer("no-such-org/no-such-tokenizer")
    # same tokenizer with its eos removed
    d = tmp_path / "noeos"
    d.mkdir()
    shutil.copy(NEOX / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(DifflmError, match="data.tokenizer=.*no eos") as err:
        build_tokenizer(str(d))
    assert f'{d / "tokenizer_config.json"} sets no eos_token; add "eos_token": "<|endoftext|>" to it' in str(err.value)


def test_tokenizer_json_alone_names_the_tokenizer_config_to_add(tmp_path):
    """A directory with only GPT-2's tokenizer.json: the error names the file to add and what to put in it, and
    doing what it says loads the tokenizer with GPT-2's EOS."""
    src = SHARED / "tokenizers" / "gpt2" / "tokenizer.json"
    if not src.is_file():
        pytest.skip(f"GPT-2 tokenizer not found at {src} (../shared beside the repo)")
    d = tmp_path / "gpt2"
    d.mkdir()
    shutil.copy(src, d / "tokenizer.json")
    with pytest.raises(DifflmError) as err:
        build_tokenizer(str(d), key="tokenizer")
    config = d / "tokenizer_config.json"
    assert str(err.value) == (
        f"tokenizer={str(d)!r} has no eos token, which difflm puts after every document: {d} has a tokenizer but no "
        f"tokenizer_config.json, which names the special tokens' roles; add {config} holding "
        '{"eos_token": "<|endoftext|>"} (its special tokens: <|endoftext|>)')
    from transformers import AutoTokenizer

    from difflm.data.tokenizer import missing_eos_message

    hub = missing_eos_message(AutoTokenizer.from_pretrained(str(d)), "some-org/some-tokenizer", None)
    assert hub.endswith('add {"eos_token": "<|endoftext|>"} to dir/tokenizer_config.json (its special tokens: '
                        '<|endoftext|>) and set data.tokenizer=dir')  # a hub tokenizer: save it, then the same fix
    config.write_text('{"eos_token": "<|endoftext|>"}')  # the fix, as the message gives it
    assert build_tokenizer(str(d)).eos_id == 50256


@pytest.mark.parametrize("extra,roles", [
    ({"mask_token": "<|endoftext|>"}, "bos_token and eos_token and unk_token"),  # NeoX: bos = eos = unk = id 0
    ({"mask_token": "<|padding|>"}, "pad_token"),  # NeoX's pad token
])
def test_mask_token_that_is_another_special_token_is_refused(tmp_path, extra, roles):
    """A fault report: ``"mask_token": "<|endoftext|>"`` gave mask_id = eos_id = 0 and training went on; the sampler
    forbids the mask id, so the model could never end a text."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(NEOX / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((NEOX / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
    with pytest.raises(DifflmError) as err:
        build_tokenizer(str(d))
    msg = str(err.value)
    assert f"data.tokenizer='{d}' sets mask_token" in msg and f"which is also its {roles}:" in msg
    assert "remove mask_token from its tokenizer_config.json (difflm then uses the first free id, 50277)" in msg
    assert "\n" not in msg
    # a mask token of its own is kept (a new token: the first free id)
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "mask_token": "<|mask|>"}))
    assert build_tokenizer(str(d)).mask_id == 50277


# ---------------------------------------------------------------- preprocessing
def test_roundtrip_txt_jsonl_dir(tmp_path, tok):
    txt = tmp_path / "a.txt"
    write_sep_txt(txt, DOCS_A, newline="\r\n")  # CRLF must come back as LF
    ds = tokenize_corpus(cfg_for(txt), tok, str(tmp_path / "c"))
    assert decoded_docs(ds, tok) == DOCS_A

    js = tmp_path / "b.jsonl"
    write_jsonl(js, DOCS_B + [""])  # empty doc skipped
    ds = tokenize_corpus(cfg_for(js), tok, str(tmp_path / "c"))
    assert decoded_docs(ds, tok) == DOCS_B

    d = tmp_path / "dir" / "sub"
    d.mkdir(parents=True)
    shutil.copy(js, d / "1.jsonl")
    shutil.copy(txt, tmp_path / "dir" / "0.txt")
    (tmp_path / "dir" / "ignored.md").write_text("not a corpus file")
    ds = tokenize_corpus(cfg_for(tmp_path / "dir"), tok, str(tmp_path / "c"))
    assert decoded_docs(ds, tok) == DOCS_A + DOCS_B  # sorted paths: dir/0.txt < dir/sub/1.jsonl
    ds_glob = tokenize_corpus(cfg_for(tmp_path / "dir" / "**" / "*.jsonl"), tok, str(tmp_path / "c"))
    assert decoded_docs(ds_glob, tok) == DOCS_B

    # no separator: the whole file is one document
    ds = tokenize_corpus(cfg_for(txt, doc_separator=None), tok, str(tmp_path / "c"))
    assert len(ds) == 1 and "<|endoftext|>" in tok.decode(ds[0])

    # the cache is keyed by content and format: a moved corpus reuses it, the same bytes read as JSONL do not
    cached = set(os.listdir(tmp_path / "c"))
    moved = tmp_path / "moved" / "renamed.txt"
    moved.parent.mkdir()
    shutil.copy(txt, moved)
    assert decoded_docs(tokenize_corpus(cfg_for(moved), tok, str(tmp_path / "c")), tok) == DOCS_A
    assert set(os.listdir(tmp_path / "c")) == cached
    shutil.copy(js, tmp_path / "moved" / "b.txt")  # JSONL bytes in a .txt: text, another entry
    assert decoded_docs(tokenize_corpus(cfg_for(tmp_path / "moved" / "b.txt"), tok, str(tmp_path / "c")), tok) != DOCS_B
    assert len(set(os.listdir(tmp_path / "c")) - cached) == 2


def test_a_directory_follows_links_to_folders_as_a_glob_does(tmp_path):
    """A corpus folder whose parts are symbolic links to folders elsewhere reads them (as ``**`` does), a folder
    reached twice once, and a link to nothing is one line naming it."""
    from difflm.data.documents import resolve_sources

    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere" / "web"
    corpus.mkdir()
    elsewhere.mkdir(parents=True)
    (corpus / "a.txt").write_text("a")
    (elsewhere / "b.jsonl").write_text('{"text": "b"}\n')
    (corpus / "web").symlink_to(elsewhere)
    (corpus / "web_again").symlink_to(elsewhere)
    (corpus / "loop").symlink_to(corpus)
    want = [str(corpus / "a.txt"), str(corpus / "web" / "b.jsonl")]
    assert resolve_sources(str(corpus)) == want
    assert want[1] in resolve_sources(str(corpus / "**" / "b.jsonl"))
    (corpus / "gone.txt").symlink_to(tmp_path / "missing.txt")
    for path in (str(corpus), str(corpus / "*.txt")):
        with pytest.raises(DifflmError, match=r"gone\.txt is a symbolic link to .*missing\.txt, which does not exist"):
            resolve_sources(path)


def test_roundtrip_hf_saved_dataset(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": DOCS_B + [""]}).save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(hf_dataset=str(tmp_path / "hf"), text_field="body")
    assert decoded_docs(tokenize_corpus(cfg, tok, str(tmp_path / "c")), tok) == DOCS_B
    with pytest.raises(DifflmError, match="data.text_field='text'.*body"):
        tokenize_corpus(replace(cfg, text_field="text"), tok, str(tmp_path / "c"))
    # a DatasetDict: its split is read; a split it lacks is named with the ones it has
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS_A}),
                          "validation": datasets.Dataset.from_dict({"body": DOCS_B})}).save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(hf_dataset=str(tmp_path / "dd"), text_field="body", hf_split="validation")
    assert decoded_docs(tokenize_corpus(cfg, tok, str(tmp_path / "c")), tok) == DOCS_B
    with pytest.raises(DifflmError, match=r"data.hf_split='test' is not a split of data.hf_dataset=.*dd': set "
                                          r"data.hf_split to one of \['train', 'validation'\]"):
        tokenize_corpus(replace(cfg, hf_split="test"), tok, str(tmp_path / "c"))


def test_null_and_non_text_values_read_alike_in_every_format(tmp_path, tok):
    """A null text field is an empty document (no tokens) in JSONL, parquet and datasets alike; a number, list or
    object is refused with the key, the record and the fix (``str()`` of it would train on its Python spelling)."""
    js = tmp_path / "n.jsonl"
    js.write_text("".join(json.dumps({"text": v}) + "\n" for v in ["first doc", None, "second doc"]))
    assert decoded_docs(tokenize_corpus(cfg_for(js), tok, str(tmp_path / "c")), tok) == ["first doc", "second doc"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["first doc", None, "second doc"]}), tmp_path / "n.parquet")
    assert decoded_docs(tokenize_corpus(cfg_for(tmp_path / "n.parquet"), tok, str(tmp_path / "c")), tok) == \
        ["first doc", "second doc"]
    for value, what in ((["a", "b"], r"a value of type list \(\"\['a', 'b'\]\"\)"), ({"x": 1}, "a value of type dict"),
                        (7, "a value of type int")):
        bad = tmp_path / f"bad_{type(value).__name__}.jsonl"
        bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(DifflmError, match=rf"data.text_field='text' is {what} .*in .*{bad.name}:2, not text: "
                                              "point data.text_field at a text field"):
            tokenize_corpus(cfg_for(bad), tok, str(tmp_path / "c"))
    pq.write_table(pa.table({"text": ["a", "b"], "n": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DifflmError, match=r"data.text_field='n' is a value of type int .*ints.parquet row 0"):
        tokenize_corpus(cfg_for(tmp_path / "ints.parquet", text_field="n"), tok, str(tmp_path / "c"))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["first doc", None, "second doc"]}).save_to_disk(str(tmp_path / "hf"))
    cfg = DataConfig(hf_dataset=str(tmp_path / "hf"), text_field="body")
    assert decoded_docs(tokenize_corpus(cfg, tok, str(tmp_path / "c")), tok) == ["first doc", "second doc"]


def test_real_corpora_snippets(tmp_path, tok):
    ts = SHARED / "corpora" / "tinystories" / "tinystories_sample.txt"
    gsm = SHARED / "corpora" / "gsm8k" / "test.jsonl"
    if not (ts.is_file() and gsm.is_file()):
        pytest.skip(f"shared corpora not found under {SHARED}")
    lines = ts.read_text(encoding="utf-8").splitlines(keepends=True)[:60]
    (tmp_path / "ts.txt").write_text("".join(lines), encoding="utf-8")
    expected = [d.strip() for d in "".join(lines).split("<|endoftext|>\n") if d.strip()]
    ds = tokenize_corpus(cfg_for(tmp_path / "ts.txt"), tok, str(tmp_path / "c"))
    assert len(ds) > 2 and decoded_docs(ds, tok) == expected
    recs = [json.loads(x) for x in gsm.read_text(encoding="utf-8").splitlines()[:5]]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    ds = tokenize_corpus(cfg_for(tmp_path / "g.jsonl", text_field="question"), tok, str(tmp_path / "c"))
    assert decoded_docs(ds, tok) == [r["question"].strip() for r in recs]
    with pytest.raises(DifflmError, match=r"data.text_field='text'.*\['answer', 'question'\]"):
        tokenize_corpus(cfg_for(tmp_path / "g.jsonl"), tok, str(tmp_path / "c"))


def test_megatron_header_layout(tmp_path):
    docs = [[1, 2, 3], [4], [65535, 0]]
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    for d in docs:
        b.add_document(d)
    b.finalize()
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temp files left
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, 3, 4)  # 8 = uint16; Megatron stores len(document_indices)
    off = 34
    assert np.frombuffer(raw, np.int32, 3, off).tolist() == [3, 1, 2]
    assert np.frombuffer(raw, np.int64, 3, off + 12).tolist() == [0, 6, 8]  # byte offsets
    assert np.frombuffer(raw, np.int64, 4, off + 36).tolist() == [0, 1, 2, 3]
    assert len(raw) == off + 36 + 32
    assert np.frombuffer((tmp_path / "d.bin").read_bytes(), np.uint16).tolist() == [1, 2, 3, 4, 65535, 0]
    ds = IndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 3 and ds.num_tokens == 6 and [ds[i].tolist() for i in range(3)] == docs
    with pytest.raises(ValueError):
        IndexedDatasetBuilder(str(tmp_path / "e"), np.uint16).add_document([70000])
    # damaged pairs: the fix names both writers (difflm-preprocess re-run; a training cache deleted), not one
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:4])
    (tmp_path / "e.idx").write_bytes(b"not an index")
    (tmp_path / "e.bin").write_bytes(b"")
    for prefix, fault in (("d", "it is truncated or corrupt"), ("e", "is not a Megatron .idx file"),
                          ("missing", "missing")):
        with pytest.raises(DifflmError, match=rf"{fault}: shards of difflm-preprocess: re-run the same "
                                              r"difflm-preprocess command .*delete that cache directory"):
            IndexedDataset(str(tmp_path / prefix))


def test_cache_reuse_and_rebuild(tmp_path, tok):
    src = tmp_path / "a.txt"
    write_sep_txt(src, DOCS_A)
    cache = tmp_path / "cache"
    ds1 = tokenize_corpus(cfg_for(src), tok, str(cache))
    assert ds1.tokens.dtype == np.uint16
    files = sorted(cache.iterdir())
    assert [f.suffix for f in files] == [".bin", ".idx"]
    mtimes = [f.stat().st_mtime_ns for f in files]
    ds2 = tokenize_corpus(cfg_for(src), tok, str(cache))
    assert ds2.prefix == ds1.prefix and [f.stat().st_mtime_ns for f in files] == mtimes
    # a changed text_field/separator gives a new key too
    assert tokenize_corpus(cfg_for(src, doc_separator=None), tok, str(cache)).prefix != ds1.prefix
    write_sep_txt(src, DOCS_A + ["A new story."])
    ds3 = tokenize_corpus(cfg_for(src), tok, str(cache))
    assert ds3.prefix != ds1.prefix and decoded_docs(ds3, tok) == DOCS_A + ["A new story."]


def test_preprocess_errors(tmp_path, tok):
    c = str(tmp_path / "c")
    with pytest.raises(DifflmError, match="data.path=.*does not exist"):
        tokenize_corpus(cfg_for(tmp_path / "nope.txt"), tok, c)
    with pytest.raises(DifflmError, match="data.path=.*matches nothing"):
        tokenize_corpus(cfg_for(tmp_path / "*.txt"), tok, c)
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "x.csv").write_text("a,b")
    with pytest.raises(DifflmError, match="data.path=.*no .txt, .jsonl or .parquet"):
        tokenize_corpus(cfg_for(tmp_path / "empty_dir"), tok, c)
    write_jsonl(tmp_path / "j.jsonl", ["hi"], field="content")
    with pytest.raises(DifflmError, match=r"data.text_field='text'.*\['content', 'id'\]"):
        tokenize_corpus(cfg_for(tmp_path / "j.jsonl"), tok, c)
    (tmp_path / "blank.txt").write_text("\n<|endoftext|>\n  \n")
    with pytest.raises(DifflmError, match="data.path=.*empty corpus"):
        tokenize_corpus(cfg_for(tmp_path / "blank.txt"), tok, c)


# ---------------------------------------------------------------- windows
def test_windows_stream_and_split(tmp_path, tok):
    src = tmp_path / "a.txt"
    write_sep_txt(src, DOCS_A * 20)
    ds = tokenize_corpus(cfg_for(src), tok, str(tmp_path / "c"))
    expected = np.concatenate([np.append(np.asarray(ds[i], np.int64), tok.eos_id) for i in range(len(ds))])
    L = 16
    train, valid = build_windows(ds, tok.eos_id, L, 0.1)
    n = len(expected) // L
    assert len(valid) == round(0.1 * n) and len(train) == n - len(valid)
    got = torch.cat([train.get(range(len(train))), valid.get(range(len(valid)))]).reshape(-1)
    assert got.dtype == torch.int64 and got.tolist() == expected[: n * L].tolist()
    assert train.get([0, 2]).shape == (2, L)
    # valid = the last windows, disjoint from train
    assert torch.equal(valid.get([len(valid) - 1]).reshape(-1), torch.from_numpy(expected[(n - 1) * L : n * L]))
    assert len(build_windows(ds, tok.eos_id, L, 0.0)[1]) == 0
    assert len(build_windows(ds, tok.eos_id, L, 1e-6)[1]) == 1
    with pytest.raises(IndexError):
        train.get([len(train)])
    pw = PackedWindows(np.arange(10), 3)
    assert len(pw) == 3 and pw.get([2]).tolist() == [[6, 7, 8]]


def test_shards_with_ids_of_another_tokenizer_are_refused_naming_the_shard(tmp_path, tok, monkeypatch):
    """Megatron shards made with another tokenizer (they carry no record of it): an id past the model's embedding rows
    or equal to the mask id is one DifflmError naming the shard, before the run when it is among the first tokens,
    and when its window is read otherwise (not an embedding IndexError or a device-side assert)."""
    from difflm.data import windows
    from difflm.data.datasets import build_datasets

    def shard(name, docs):
        b = IndexedDatasetBuilder(str(tmp_path / name / "s"), np.uint16)
        for d in docs:
            b.add_document(np.asarray(d, np.uint16))
        b.finalize()
        return tmp_path / name

    good = [list(range(2, 40))] * 8
    for name, bad_id in (("wide", tok.padded_vocab_size + 9), ("mask", tok.mask_id)):
        path = shard(name, good + [[5, bad_id, 6]] + good)
        with pytest.raises(DifflmError, match=rf"{name}/s\.bin holds token id {bad_id}, .*set data.tokenizer"):
            build_datasets(cfg_for(path, seq_len=8), tok, str(tmp_path / "c"))
        monkeypatch.setattr(windows, "CHECK_AT_START", 8)  # past the first window: found when its window is read
        train, valid = build_datasets(cfg_for(path, seq_len=8), tok, str(tmp_path / "c"))
        assert train.get([0]).max() < 40
        with pytest.raises(DifflmError, match=rf"holds token id {bad_id}"):
            train.get(range(len(train)))
        monkeypatch.undo()
    train, _ = build_datasets(cfg_for(shard("fine", good), seq_len=8), tok, str(tmp_path / "c"))
    assert len(train) > 0 and int(train.get(range(len(train))).max()) == max(39, tok.eos_id)


def test_window_errors(tmp_path, tok):
    src = tmp_path / "a.txt"
    write_sep_txt(src, DOCS_A)
    ds = tokenize_corpus(cfg_for(src), tok, str(tmp_path / "c"))
    for bad in (1.0, -0.1):
        with pytest.raises(DifflmError, match="data.valid_fraction"):
            build_windows(ds, tok.eos_id, 8, bad)
    with pytest.raises(DifflmError, match=r"data.seq_len=100000.*corpus of \d+ tokens"):
        build_windows(ds, tok.eos_id, 100000, 0.05)
    total = ds.num_tokens + len(ds)
    with pytest.raises(DifflmError, match="data.seq_len"):  # exactly 2 windows, 0.9 -> no train left
        build_windows(ds, tok.eos_id, total // 2, 0.9)
    with pytest.raises(DifflmError, match="data.valid_fraction"):
        build_datasets(cfg_for(src, valid_fraction=1.5), tok, str(tmp_path / "c"))


def test_build_datasets_default_corpus(tmp_path, tok):
    train, valid = build_datasets(cfg_for(SHAKESPEARE, seq_len=128), tok, str(tmp_path / "c"))
    assert len(train) > 1000 and len(valid) >= 1
    assert tok.decode(train.get([0])[0]).startswith("First Citizen:\nBefore we proceed")


# ---------------------------------------------------------------- sampler
def test_sampler_deterministic_and_epochs():
    n, gbs = 10, 4
    s = GlobalBatchSampler(n, gbs, seed=3)
    seq = np.concatenate([s.indices(step) for step in range(10)])  # 40 samples = 4 epochs
    for e in range(4):
        assert sorted(seq[e * n : (e + 1) * n].tolist()) == list(range(n))
    # a fresh sampler (resume) gives the same indices at any step, in any query order
    s2 = GlobalBatchSampler(n, gbs, seed=3)
    for step in (7, 2, 9, 0):
        np.testing.assert_array_equal(s2.indices(step), s.indices(step))
    assert s.indices(0).dtype == np.int64 and s.indices(0).shape == (gbs,)
    assert any(not np.array_equal(GlobalBatchSampler(n, gbs, seed=4).indices(k), s.indices(k)) for k in range(3))
    big = GlobalBatchSampler(3, 7, seed=0).indices(0)  # a batch spanning several epochs
    assert sorted(big[:6].tolist()) == [0, 0, 1, 1, 2, 2]


def test_sampler_state():
    s = GlobalBatchSampler(100, 8, seed=1)
    st = s.state_dict(5)
    assert st == {"consumed_samples": 40, "num_windows": 100, "seed": 1, "global_batch_size": 8}
    s.check_state(st)
    # a resume with another data.seq_len was told "num_windows changed" without the setting behind it
    for key, other, setting in (("num_windows", GlobalBatchSampler(99, 8, 1), "data.seq_len"),
                                ("seed", GlobalBatchSampler(100, 8, 2), "train.seed"),
                                ("global_batch_size", GlobalBatchSampler(100, 16, 1), "train.global_batch_size")):
        with pytest.raises(DifflmError, match=f"{key} changed since the checkpoint") as err:
            other.check_state(st)
        assert setting in str(err.value) and "start a new run.dir" in str(err.value)
    with pytest.raises(DifflmError):
        GlobalBatchSampler(0, 8, 1)


# ---------------------------------------------------------------- special-token text and encodings
LITERAL = "the literal token <|endoftext|> inside"
LITERAL_IDS = [783, 22436, 10669, 654, 93, 423, 1171, 1156, 49651, 3304]  # GPT-NeoX: the text, not EOS (id 0)


def test_special_token_text_in_documents_is_text(tmp_path, tok):
    assert tok.encode(LITERAL) == LITERAL_IDS
    assert tok.tokenizer(LITERAL, add_special_tokens=False)["input_ids"] == [783, 22436, 10669, 209, 0, 3304]  # the fault
    # .txt: a separator LINE still splits documents; the same text inside a line is text
    (tmp_path / "a.txt").write_text(f"doc one\n<|endoftext|>\n{LITERAL}\n", encoding="utf-8")
    ds = tokenize_corpus(cfg_for(tmp_path / "a.txt"), tok, str(tmp_path / "c"))
    assert len(ds) == 2 and ds[1].tolist() == LITERAL_IDS
    write_jsonl(tmp_path / "b.jsonl", [LITERAL])
    assert tokenize_corpus(cfg_for(tmp_path / "b.jsonl"), tok, str(tmp_path / "c"))[0].tolist() == LITERAL_IDS
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [LITERAL]}).save_to_disk(str(tmp_path / "hf"))
    hf = tokenize_corpus(DataConfig(hf_dataset=str(tmp_path / "hf")), tok, str(tmp_path / "c"))
    assert hf[0].tolist() == LITERAL_IDS
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [LITERAL]}), tmp_path / "d.parquet")
    assert tokenize_corpus(cfg_for(tmp_path / "d.parquet"), tok, str(tmp_path / "c"))[0].tolist() == LITERAL_IDS
    # SFT prompts and responses: EOS comes only after the response
    from difflm.data.sft import tokenize_pair

    ids, n = tokenize_pair(tok, LITERAL, LITERAL, 24, False)
    assert n == 10 and ids[:20] == LITERAL_IDS * 2 and set(ids[20:]) == {tok.eos_id}


def test_mask_token_text_is_never_the_mask_id(tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(NEOX))
    hf.add_special_tokens({"mask_token": "<|mdm_mask|>"})  # as difflm-import adds it
    hf.save_pretrained(str(tmp_path / "tok"))
    t = build_tokenizer(str(tmp_path / "tok"))
    assert t.mask_id == 50277 and 50277 in t.tokenizer("a <|mdm_mask|> b", add_special_tokens=False)["input_ids"]
    assert t.mask_id not in t.encode("a <|mdm_mask|> b")


def test_caches_of_the_old_tokenization_are_rebuilt(tmp_path, tok, monkeypatch):
    import difflm.data.preprocess as pre

    (tmp_path / "a.txt").write_text(LITERAL, encoding="utf-8")
    new = tokenize_corpus(cfg_for(tmp_path / "a.txt"), tok, str(tmp_path / "c")).prefix
    monkeypatch.setattr(pre, "FORMAT_VERSION", 1)  # the cache key of the version that read specials as specials
    assert tokenize_corpus(cfg_for(tmp_path / "a.txt"), tok, str(tmp_path / "c")).prefix != new


def test_text_that_is_not_utf8_is_one_line(tmp_path, tok):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    path = tmp_path / "latin1.txt"
    with pytest.raises(DifflmError) as err:
        tokenize_corpus(cfg_for(path), tok, str(tmp_path / "c"))
    assert str(err.value).startswith(f"data.path: {path} is not UTF-8 text (byte 0xe9 at offset 3): ")
    assert "data.encoding=latin-1" in str(err.value)
    ds = tokenize_corpus(cfg_for(path, encoding="latin-1"), tok, str(tmp_path / "c"))
    assert decoded_docs(ds, tok) == ["café"]
    # the offset counts from the start of the file (JSONL, second line), also with a separator-split .txt
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DifflmError, match=r"data.path: .*b.jsonl is not UTF-8 text \(byte 0xe9 at offset 28\)"):
        tokenize_corpus(cfg_for(tmp_path / "b.jsonl"), tok, str(tmp_path / "c"))
    (tmp_path / "c.txt").write_bytes(b"ok\n<|endoftext|>\nna\xefve\n")
    with pytest.raises(DifflmError, match=r"c.txt is not UTF-8 text \(byte 0xef at offset 19\)"):
        tokenize_corpus(cfg_for(tmp_path / "c.txt"), tok, str(tmp_path / "c"))
    # SFT JSONL pairs
    from omegaconf import OmegaConf

    from difflm.data.sft import read_pairs

    (tmp_path / "pairs.jsonl").write_bytes(b'{"q": "caf\xe9", "a": "x"}\n')
    sft = OmegaConf.create(dict(path=str(tmp_path / "pairs.jsonl"), prompt_field="q", response_field="a",
                                text_field="text", doc_separator=None, encoding="utf-8"))
    with pytest.raises(DifflmError, match=r"data.path: .*pairs.jsonl is not UTF-8 text \(byte 0xe9 at offset 10\)"):
        read_pairs(sft)
    sft.encoding = "latin-1"
    assert read_pairs(sft) == [("café", "x")]
    for bad, needle in (("nope", "data.encoding='nope' is not a known text encoding"),
                        ("utf-16", "data.encoding='utf-16' is not ASCII-compatible")):
        with pytest.raises(DifflmError, match=needle):
            tokenize_corpus(cfg_for(path, encoding=bad), tok, str(tmp_path / "c"))


def test_builder_removes_the_temporaries_of_a_killed_builder_only(tmp_path):
    """``kill -9`` during tokenization leaves ``<prefix>.bin.tmp-<host>-<pid>``; the next builder of that prefix on
    this host removes it when that process is gone and the file is old, and leaves every file it cannot prove dead:
    a live process's, another host's, a fresh one (another PID namespace may own it), other prefixes'."""
    import socket
    import subprocess
    import sys
    import time

    from difflm.data.indexed_dataset import STALE_AFTER_S

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host, old = socket.gethostname(), time.time() - 2 * STALE_AFTER_S
    prefix = tmp_path / "key"
    names = {"stale_bin": f"key.bin.tmp-{host}-{dead}", "stale_idx": f"key.idx.tmp-{host}-{dead}",
             "alive": f"key.bin.tmp-{host}-{os.getppid()}", "other_host": f"key.bin.tmp-elsewhere-{dead}",
             "fresh": f"key.bin.tmp-{host}-{dead}".replace("key.bin", "key.idx") + "0",
             "other_prefix": f"key2.bin.tmp-{host}-{dead}", "legacy": f"key.bin.tmp{dead}"}
    for label, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if label != "fresh":
            os.utime(tmp_path / name, (old, old))
    b = IndexedDatasetBuilder(str(prefix), np.uint16)
    b.add_document([1, 2])
    b.finalize()
    left = set(os.listdir(tmp_path))
    assert names["stale_bin"] not in left and names["stale_idx"] not in left
    assert {names[k] for k in ("alive", "other_host", "fresh", "other_prefix", "legacy")} <= left
    assert {"key.bin", "key.idx"} <= left


def test_a_complete_cache_still_removes_a_killed_builds_temporaries(tmp_path, tok):
    """kill -9 mid-tokenization, then a rerun that built the cache: the partial copy goes at a later start too."""
    import socket
    import subprocess
    import sys
    import time

    from difflm.data.indexed_dataset import STALE_AFTER_S

    src = tmp_path / "a.txt"
    write_sep_txt(src, DOCS_A)
    ds = tokenize_corpus(cfg_for(src), tok, str(tmp_path / "cache"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = Path(ds.prefix + f".bin.tmp-{socket.gethostname()}-{dead}")
    stale.write_bytes(b"partial")
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(stale, (old, old))
    assert tokenize_corpus(cfg_for(src), tok, str(tmp_path / "cache")).prefix == ds.prefix
    assert not stale.exists()


def test_a_dropped_tail_of_a_small_corpus_gets_a_notice(tmp_path, capsys):
    """Packed windows drop the tokens after the last full window: said when that is >= 1% of the corpus."""
    from difflm.data.windows import build_windows, tail_notice

    assert tail_notice(100_000, 128) is None  # 32 tokens: 0.03%
    assert tail_notice(1_024, 128) is None  # no tail
    text = tail_notice(1_000, 128, "data.blend source 'a'")
    assert text.startswith("data.seq_len=128 packs the 1,000 tokens of data.blend source 'a' into 7 windows and "
                           "drops the last 104 tokens (10.4%)") and "lower data.seq_len" in text
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    b.add_document(list(range(1, 1000)))  # 999 tokens + the EOS build_windows appends: 1,000
    b.finalize()
    train, valid = build_windows(IndexedDataset(str(tmp_path / "d")), 0, 128, 0.2)
    assert (len(train), len(valid)) == (6, 1)
    err = capsys.readouterr().err
    assert err.count("difflm: notice:") == 1 and "drops the last 104 tokens (10.4%)" in err
    build_windows(IndexedDataset(str(tmp_path / "d")), 0, 100, 0.2)  # 10 full windows: no tail, no notice
    assert "notice" not in capsys.readouterr().err


def test_a_utf8_byte_order_mark_is_not_text(tmp_path, tok):
    """A file that starts with EF BB BF read '\\ufeffhello world', one token more than the same file without it, in
    every reader: the trainer's cache (and difflm-eval's windows), difflm-preprocess's pieces, SFT pairs, prompts."""
    from omegaconf import OmegaConf

    from difflm.data.documents import DocFormat, file_pieces, iter_documents
    from difflm.data.sft import read_pairs
    from difflm.generate import read_prompt

    bom = b"\xef\xbb\xbf"
    plain = tok.encode("hello world")
    for name, body, sep in (("sep.txt", b"hello world\n<|endoftext|>\nsecond\n", "<|endoftext|>"),
                            ("whole.txt", b"hello world\n", None),
                            ("crlf.txt", b"hello world\r\n<|endoftext|>\r\nsecond\r\n", "<|endoftext|>"),
                            ("a.jsonl", b'{"text": "hello world"}\n{"text": "second"}\n', None)):
        (tmp_path / name).write_bytes(bom + body)
        ds = tokenize_corpus(cfg_for(tmp_path / name, doc_separator=sep), tok, str(tmp_path / "c"))
        assert ds[0].tolist() == plain, name
        fmt = DocFormat(doc_separator=sep, key="input")
        docs = [d for p in file_pieces(str(tmp_path / name), fmt, 8) for d in iter_documents(p, fmt)]
        assert docs[0] == "hello world" and "\ufeff" not in "".join(docs), name
    # a BOM is only a marker at the very start: elsewhere it stays the text it is
    (tmp_path / "mid.txt").write_bytes(b"a\n<|endoftext|>\n" + bom + b"b\n")
    assert tok.decode(tokenize_corpus(cfg_for(tmp_path / "mid.txt"), tok, str(tmp_path / "c"))[1]) == "\ufeffb"
    (tmp_path / "pairs.jsonl").write_bytes(bom + b'{"q": "hi", "a": "there"}\n')
    sft = OmegaConf.create(dict(path=str(tmp_path / "pairs.jsonl"), prompt_field="q", response_field="a",
                                text_field="text", doc_separator=None, encoding="utf-8"))
    assert read_pairs(sft) == [("hi", "there")]
    (tmp_path / "prompt.txt").write_bytes(bom + b"Once upon a time\n")
    assert read_prompt(OmegaConf.create({"prompt": None, "prompt_file": str(tmp_path / "prompt.txt")})) == \
        "Once upon a time"


def test_corpus_shapes_a_pipeline_leaves_are_said_in_one_line(tmp_path, tok, capsys):
    """One notice per tokenization pass, naming the source and the fix, for the shapes difflm would otherwise read
    without a word: NUL bytes (UTF-16 read as UTF-8), a separator inside a line, CR left in JSONL text, mostly empty
    documents. A clean corpus (a trailing separator leaves one empty document) gets none."""
    from difflm.data.shards import run_preprocess
    from tests.conftest import compose_run

    (tmp_path / "clean.txt").write_bytes(b"first\r\n<|endoftext|>\r\nsecond\r\n<|endoftext|>\r\n")
    tokenize_corpus(cfg_for(tmp_path / "clean.txt"), tok, str(tmp_path / "c"))
    assert "notice" not in capsys.readouterr().err
    (tmp_path / "utf16.txt").write_bytes("hello world\n".encode("utf-16-le"))
    tokenize_corpus(cfg_for(tmp_path / "utf16.txt"), tok, str(tmp_path / "c"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "utf16.txt'" in err and "1 of 1 documents hold NUL bytes" in err
    assert "iconv -f utf-16 -t utf-8" in err
    (tmp_path / "inline.txt").write_text("doc one<|endoftext|>doc two\n<|endoftext|>\ndoc three\n")
    ds = tokenize_corpus(cfg_for(tmp_path / "inline.txt"), tok, str(tmp_path / "c"))
    assert len(ds) == 2  # as documented: only a separator line splits
    err = capsys.readouterr().err
    assert "1 documents hold data.doc_separator='<|endoftext|>' inside a line" in err and err.count("\n") == 1
    (tmp_path / "crlf.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                 ["line one\r\nline two", None, None, "ok"]))
    tokenize_corpus(cfg_for(tmp_path / "crlf.jsonl"), tok, str(tmp_path / "c"))
    err = capsys.readouterr().err
    assert "1 documents hold carriage returns" in err and "2 of 4 documents are empty" in err
    assert err.count("\n") == 1
    run_preprocess(compose_run([f"input={tmp_path / 'utf16.txt'}", f"output={tmp_path / 'shards'}", "workers=1",
                                "progress_bar=false"], config_name="preprocess"))
    assert "1 of 1 documents hold NUL bytes" in capsys.readouterr().err


def test_a_local_tokenizers_ids_are_kept_and_it_loads_on_first_use(tmp_path, monkeypatch):
    """``build_tokenizer`` keeps a local tokenizer's derived ids (in ``DIFFLM_CACHE_DIR``); a later call with the same
    files returns the same ids and fingerprint without loading the tokenizer, which loads when first used; a changed
    file or another ``vocab_multiple`` is a new key, loaded and checked again."""
    import transformers

    from difflm.data.tokenizer import build_tokenizer, definition_fingerprint

    monkeypatch.setenv("DIFFLM_CACHE_DIR", str(tmp_path / "cache"))
    tok_dir = tmp_path / "tok"
    shutil.copytree(NEOX, tok_dir)
    loads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    first = build_tokenizer(str(tok_dir))
    assert len(loads) == 1 and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    second = build_tokenizer(str(tok_dir))
    assert len(loads) == 1  # the ids from the record
    assert (second.eos_id, second.mask_id, second.padded_vocab_size) == (0, 50277, 50304)
    assert (second.eos_id, second.mask_id, second.padded_vocab_size, second.fingerprint) == (
        first.eos_id, first.mask_id, first.padded_vocab_size, definition_fingerprint(first.tokenizer))
    assert second.decode(second.encode("To be, or not to be")) == "To be, or not to be" and len(loads) == 2
    assert build_tokenizer(str(tok_dir), 256).padded_vocab_size == 50432 and len(loads) == 3
    config = tok_dir / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert build_tokenizer(str(tok_dir)).mask_id == 50277 and len(loads) == 4  # new files: loaded and checked again
