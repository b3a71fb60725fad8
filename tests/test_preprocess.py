"""``difflm-preprocess``: shards with the in-trainer path's tokens, read by difflm-train; parallel workers; a crash
mid-shard leaves nothing that looks complete and a rerun resumes to identical shards; one-line errors."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED_DATA, compose_run, run_cli
from difflm.config.schema import DataConfig
from difflm.data import build_datasets, build_tokenizer, tokenize_corpus
from difflm.data.shards import KILL_ENV, find_shards, run_preprocess
from difflm.errors import DifflmError

REPO = Path(__file__).resolve().parents[1]
NEOX = REPO / "difflm/assets/tokenizers/gpt-neox-20b"
GUTENBERG = SHARED_DATA / "corpora" / "gutenberg"
# special-token text inside documents, CRLF, non-ASCII: all must come out as the in-trainer path reads them
DOCS = ["First story.\r\nIt has two lines.", "A <|endoftext|> inside a document stays text.", "Ünïcödé — “quotes” 你好",
        "x", "Last one\nwith\n\nblank lines."]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(str(NEOX))


def preprocess_cfg(*overrides):
    return compose_run(["progress_bar=false", *overrides], config_name="preprocess")


def make_corpus(root: Path, copies: int = 6) -> Path:
    """A directory with a .txt (separator lines), a .jsonl and a .parquet file, several documents each."""
    root.mkdir(parents=True)
    docs = [f"{d} (copy {i})" for i in range(copies) for d in DOCS]
    with open(root / "a.txt", "w", encoding="utf-8", newline="") as f:
        f.write("\r\n<|endoftext|>\r\n".join(docs) + "\r\n")
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in reversed(docs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[::2]}), root / "c.parquet", row_group_size=4)
    return root


def all_tokens(datasets) -> tuple[list[int], list[int]]:
    """(concatenated tokens, document lengths) of .bin/.idx datasets in order."""
    tokens = np.concatenate([np.asarray(ds.tokens[: ds.num_tokens], np.int64) for ds in datasets])
    lengths = np.concatenate([ds.document_lengths for ds in datasets])
    return tokens.tolist(), lengths.tolist()


def test_shards_hold_the_in_trainer_tokens(tmp_path, tok):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "shards"
    summary = run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", "workers=1", "shard_mb=0.0002"))
    assert summary["shards"] > 6  # several pieces per file (200 bytes each)
    cache = tokenize_corpus(DataConfig(path=str(corpus)), tok, str(tmp_path / "cache"))
    prefixes = find_shards(str(out), tok)
    from difflm.data.shards import open_shards

    shards = open_shards(prefixes, str(out))
    assert all_tokens(shards) == all_tokens([cache])
    # the manifest: tokenizer, sources with hashes, every shard with its counts
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and m["tokens"] == cache.num_tokens and m["documents"] == len(cache) == 30 + 30 + 15
    assert [s["path"] for s in m["sources"]] == [str(corpus / n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    assert all(len(s["sha256"]) == 64 for s in m["sources"]) and m["settings"]["split_special_tokens"]
    assert sum(s["tokens"] for s in m["shards"]) == m["tokens"]
    # data.path=<output> gives the same windows as data.path=<text>
    from_text = build_datasets(DataConfig(path=str(corpus), seq_len=16), tok, str(tmp_path / "cache"))
    from_shards = build_datasets(DataConfig(path=str(out), seq_len=16), tok, str(tmp_path / "unused"))
    for a, b in zip(from_text, from_shards):
        assert len(a) == len(b) > 0 and torch.equal(a.get(range(len(a))), b.get(range(len(b))))
    assert not (tmp_path / "unused").exists()  # shards are read in place, nothing is tokenized
    # a glob of .idx files and a single prefix read too
    assert find_shards(str(out / "shard_*.idx")) == prefixes
    assert find_shards(str(out / "shard_00000")) == [str(out / "shard_00000")]


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_gutenberg_shards_train(tmp_path, tok, fast_cfg):
    if not GUTENBERG.is_dir():
        pytest.skip(f"shared Gutenberg corpus not found at {GUTENBERG}")
    books = tmp_path / "books"
    books.mkdir()
    for name in ("pg11.txt", "pg5200.txt"):  # the two shortest books keep CI fast
        shutil.copy(GUTENBERG / name, books / name)
    out = tmp_path / "shards"
    res = run_cli("difflm.preprocess", f"input={books}", f"output={out}", "workers=1", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "1 shard(s) (0 already done), 2 documents" in res.stdout and "tokens/s" in res.stdout  # two small files
    cache = tokenize_corpus(DataConfig(path=str(books)), tok, str(tmp_path / "text_cache"))
    assert all_tokens(open_all(out)) == all_tokens([cache])
    # each book is one document (no separator lines): its text (universal newlines, stripped), tokenized directly
    direct = tok.tokenizer([(books / n).read_text(encoding="utf-8").strip() for n in ("pg11.txt", "pg5200.txt")],
                           add_special_tokens=False, verbose=False)["input_ids"]
    assert all_tokens([cache]) == (direct[0] + direct[1], [len(direct[0]), len(direct[1])])
    assert cache.num_tokens == 68091  # the README's 39,264 + 28,830 count CRLFs and the trailing newline
    from difflm.training.trainer import Trainer

    cfg = fast_cfg(f"data.path={out}", "train.max_steps=2", "train.eval_every=2", "train.save_every=0")
    trainer = Trainer(cfg, cfg.run.dir, torch.device("cpu"))
    metrics = trainer.fit()
    assert metrics["step"] == 2 and np.isfinite(metrics["val_nelbo"])
    assert not Path(cfg.data.cache_dir).exists()


def open_all(out: Path):
    from difflm.data.shards import open_shards

    return open_shards(find_shards(str(out)), str(out))


def test_workers_write_identical_shards(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", copies=3)
    one, two = tmp_path / "one", tmp_path / "two"
    run_preprocess(preprocess_cfg(f"input={corpus}", f"output={one}", "workers=1", "shard_mb=0.0003"))
    summary = run_preprocess(preprocess_cfg(f"input={corpus}", f"output={two}", "workers=2", "shard_mb=0.0003"))
    assert summary["workers"] == 2
    names = sorted(os.listdir(one))
    assert names == sorted(os.listdir(two)) and len(names) > 5
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_a_copied_tokenizer_and_moved_input_resume_the_same_output(tmp_path):
    """The output is keyed by what it tokenizes, not by paths: the tokenizer by its definition (as training compares
    it), the input by size and sha256. Another tokenizer or other text is still refused."""
    corpus = make_corpus(tmp_path / "corpus", copies=3)
    args = ["workers=1", "shard_mb=0.0003"]
    out = tmp_path / "out"
    first = run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", f"tokenizer={NEOX}", *args))
    tok_copy, corpus_copy = tmp_path / "my_tokenizer", tmp_path / "moved_corpus"
    shutil.copytree(NEOX, tok_copy)
    shutil.copytree(corpus, corpus_copy)
    again = run_preprocess(preprocess_cfg(f"input={corpus_copy}", f"output={out}", f"tokenizer={tok_copy}", *args))
    assert again["skipped"] == again["shards"] == first["shards"] > 5 and again["new_tokens"] == 0
    assert again["tokens"] == first["tokens"]
    (corpus_copy / "a.txt").write_text("other text\n", encoding="utf-8")
    with pytest.raises(DifflmError, match="holds shards of other sources"):
        run_preprocess(preprocess_cfg(f"input={corpus_copy}", f"output={out}", f"tokenizer={tok_copy}", *args))
    (tok_copy / "tokenizer.json").write_text((NEOX / "tokenizer.json").read_text().replace('"<|endoftext|>"',
                                                                                          '"<|end|>"', 1))
    with pytest.raises(DifflmError, match="holds shards of other tokenizer"):
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", f"tokenizer={tok_copy}", *args))


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_crash_mid_shard_then_resume_gives_identical_shards(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", copies=3)
    args = [f"input={corpus}", "workers=1", "shard_mb=0.0003", "progress_bar=false"]
    clean = tmp_path / "clean"
    run_preprocess(preprocess_cfg(*args, f"output={clean}"))
    crashed = tmp_path / "crashed"
    os.environ[KILL_ENV] = "2"  # SIGKILL while shard 2 is half written
    try:
        res = run_cli("difflm.preprocess", *args, f"output={crashed}", timeout=600)
    finally:
        del os.environ[KILL_ENV]
    assert res.returncode == -signal.SIGKILL
    names = set(os.listdir(crashed))
    assert {"shard_00000.bin", "shard_00000.idx", "shard_00001.bin", "shard_00001.idx"} <= names
    assert not {"shard_00002.idx", "shard_00002.bin"} & names  # nothing under the final name ...
    assert any(n.startswith("shard_00002.bin.tmp") for n in names)  # ... only the temporary file
    assert not json.loads((crashed / "manifest.json").read_text())["complete"]
    with pytest.raises(DifflmError, match="has not finished writing it.*rerun the same difflm-preprocess"):
        build_datasets(DataConfig(path=str(crashed)), build_tokenizer(str(NEOX)), str(tmp_path / "c"))
    kept = {n: (crashed / n).stat().st_mtime_ns for n in ("shard_00000.bin", "shard_00001.idx")}
    res = run_cli("difflm.preprocess", *args, f"output={crashed}", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "(2 already done)" in res.stdout
    assert {n: (crashed / n).stat().st_mtime_ns for n in kept} == kept  # finished shards were not rewritten
    assert sorted(os.listdir(crashed)) == sorted(os.listdir(clean))  # temporary files are gone
    for name in os.listdir(clean):
        a, b = (clean / name).read_bytes(), (crashed / name).read_bytes()
        if name == "manifest.json":
            a, b = a.replace(str(clean).encode(), b""), b.replace(str(crashed).encode(), b"")
        assert a == b, name


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_preprocess_errors_are_one_line(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", copies=1)
    out = tmp_path / "out"
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "latin1.txt").write_bytes(b"caf\xe9\n")
    res = run_cli("difflm.preprocess", f"input={tmp_path / 'latin1'}", f"output={out}", "workers=1", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(
        f"difflm: error: input: {tmp_path / 'latin1' / 'latin1.txt'} is not UTF-8 text (byte 0xe9 at offset 3)")
    latin = run_preprocess(preprocess_cfg(f"input={tmp_path / 'latin1'}", f"output={tmp_path / 'l1'}", "workers=1",
                                          "encoding=latin-1"))
    assert latin["documents"] == 1
    run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", "workers=1"))
    with pytest.raises(DifflmError, match="holds shards of other sources.*overwrite=true"):
        run_preprocess(preprocess_cfg(f"input={corpus / 'a.txt'}", f"output={out}", "workers=1"))
    assert run_preprocess(preprocess_cfg(f"input={corpus / 'a.txt'}", f"output={out}", "workers=1",
                                         "overwrite=true"))["shards"] == 1
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(DifflmError, match="not empty and holds no difflm-preprocess manifest"):
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={tmp_path / 'busy'}", "workers=1"))
    with pytest.raises(DifflmError, match="exactly one of input"):
        run_preprocess(preprocess_cfg(f"output={out}"))
    other = build_tokenizer(str(SHARED_DATA / "tokenizers" / "gpt2")) if (SHARED_DATA / "tokenizers/gpt2").is_dir() else None
    if other is not None:
        with pytest.raises(DifflmError, match="another tokenizer"):
            find_shards(str(out), other)


def test_hf_dataset_input_matches_the_in_trainer_path(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    docs = [f"{d} #{i}" for i in range(8) for d in DOCS] + [""]
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "shards"
    summary = run_preprocess(preprocess_cfg(f"hf_dataset={tmp_path / 'hf'}", "text_field=body", f"output={out}",
                                            "workers=1", "shard_mb=0.0005"))
    assert summary["shards"] >= 3 and summary["documents"] == 40  # the empty row is dropped
    cache = tokenize_corpus(DataConfig(hf_dataset=str(tmp_path / "hf"), text_field="body"), tok, str(tmp_path / "c"))
    assert all_tokens(open_all(out)) == all_tokens([cache])


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_unwritable_output_is_one_line_naming_output(tmp_path):
    """An output that cannot be written ends, before the tokenizer loads, in one line naming output= and the fix."""
    corpus = make_corpus(tmp_path / "corpus", copies=1)
    res = run_cli("difflm.preprocess", f"input={corpus}", "output=/proc/foo", "workers=1", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == ""
    line = res.stderr.strip()
    assert "\n" not in line, line
    assert re.fullmatch(r"difflm: error: output='/proc/foo' cannot be written \(No such file or directory: "
                        r"/proc/\.foo\.probe\d+\): choose a folder you can write in", line), line
    (tmp_path / "afile").write_text("not a directory")
    sub = tmp_path / "afile" / "sub"
    with pytest.raises(DifflmError) as err:  # checked up front: the bad tokenizer is never reached
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={sub}", "workers=1", "tokenizer=/nonexist/tok"))
    assert str(err.value) == (f"output={str(sub)!r} cannot be written (File exists: {tmp_path / 'afile'}): "
                              "choose a folder you can write in")
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={tmp_path / 'afile'}", "workers=1"))
    assert str(err.value) == f"output={str(tmp_path / 'afile')!r} is a file: give a directory path"


def test_an_empty_output_is_refused_not_taken_for_the_current_folder(tmp_path):
    """output= (empty) is the current folder to pathlib, and an empty eval.output= names no file: both are refused
    in one line naming the key."""
    from difflm.cli import writable_output

    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={tmp_path}", "output=", "workers=1"))
    assert str(err.value) == "output= is empty: give a directory path"
    with pytest.raises(DifflmError) as err:
        writable_output("eval.output", "")
    assert str(err.value) == "eval.output= is empty: give a file path"


def test_unwritable_existing_output_directory_is_one_line(tmp_path, monkeypatch):
    """An existing output directory that refuses the manifest (no write permission; root ignores modes, hence the
    patched write) ends in the same line, not an OSError traceback."""
    import difflm.data.shards as shards

    corpus = make_corpus(tmp_path / "corpus", copies=1)
    out = tmp_path / "readonly"
    out.mkdir()

    def refuse(path, obj):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shards, "_write_json", refuse)
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", "workers=1"))
    assert str(err.value) == (f"output={str(out)!r} cannot be written (Permission denied: {out / 'manifest.json'}): "
                              "choose a folder you can write in")


EMPTY_MESSAGE = "{}={!r} gives an empty corpus after tokenization: point it at non-empty text"


def test_input_without_text_is_refused_before_a_manifest(tmp_path, tok):
    """An empty file, or files whose documents are all empty, are refused with the in-trainer path's line (naming
    input=), and nothing is written: no manifest marked complete that training would only refuse later."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    # the trainer refuses the same file with the same words, naming its own key
    with pytest.raises(DifflmError) as err:
        tokenize_corpus(DataConfig(path=str(empty)), tok, str(tmp_path / "cache"))
    assert str(err.value) == EMPTY_MESSAGE.format("data.path", str(empty))
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "space.txt").write_text("  \n\n<|endoftext|>\n\t\n<|endoftext|>\n")  # separators and whitespace
    (blank / "rows.jsonl").write_text(json.dumps({"text": ""}) + "\n\n" + json.dumps({"text": "   "}) + "\n")
    for source, workers in ((empty, "workers=1"), (blank, "workers=2")):
        out = tmp_path / f"out_{source.name}"
        with pytest.raises(DifflmError) as err:
            run_preprocess(preprocess_cfg(f"input={source}", f"output={out}", workers))
        assert str(err.value) == EMPTY_MESSAGE.format("input", str(source))
        assert not out.exists()  # no manifest, no shards, not even the directory
    # text after the empty documents is found: the input is not refused
    (blank / "rows.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "late text"}) + "\n")
    summary = run_preprocess(preprocess_cfg(f"input={blank}", f"output={tmp_path / 'late'}", "workers=1"))
    assert summary["documents"] == 1 and summary["tokens"] == len(tok.encode("late text")) > 0
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["", " "]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"hf_dataset={tmp_path / 'hf'}", f"output={tmp_path / 'out_hf'}", "workers=1"))
    assert str(err.value) == EMPTY_MESSAGE.format("hf_dataset", str(tmp_path / "hf"))
    assert not (tmp_path / "out_hf").exists()


def test_messages_name_the_preprocess_keys(tmp_path):
    """tokenizer= and text_field= (difflm-preprocess's keys), not the trainer's data.tokenizer / data.text_field,
    also for an error raised in a worker process; the trainer keeps its own names."""
    corpus = make_corpus(tmp_path / "corpus", copies=1)
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={tmp_path / 'o'}", "tokenizer=/nonexist/tok"))
    assert str(err.value) == ("tokenizer='/nonexist/tok' is not a directory: give a local directory with "
                              "tokenizer.json or a hub name")
    with pytest.raises(DifflmError) as err:
        build_tokenizer("/nonexist/tok")
    assert str(err.value).startswith("data.tokenizer='/nonexist/tok' is not a directory")
    no_files = tmp_path / "data.tokenizer"  # a path holding the trainer's key name is named as it is
    no_files.mkdir()
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={tmp_path / 'o'}", f"tokenizer={no_files}"))
    assert str(err.value).startswith(f"tokenizer={str(no_files)!r} cannot be loaded: {no_files} has none of the "
                                     "tokenizer files")
    jsonl = corpus / "b.jsonl"
    with pytest.raises(DifflmError) as err:  # the first record, read in this process
        run_preprocess(preprocess_cfg(f"input={jsonl}", f"output={tmp_path / 'o'}", "workers=1", "text_field=body"))
    assert str(err.value) == (f"text_field='body' not found in {jsonl}:1 (keys: ['text']): "
                              "set text_field to one of them")
    later = tmp_path / "later.jsonl"
    later.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(DifflmError) as err:  # the second record, read by a worker process
        run_preprocess(preprocess_cfg(f"input={later}", f"output={tmp_path / 'o2'}", "workers=2"))
    assert str(err.value) == (f"text_field='text' not found in {later}:2 (keys: ['body']): "
                              "set text_field to one of them")
    with pytest.raises(DifflmError) as err:
        run_preprocess(preprocess_cfg(f"input={corpus / 'c.parquet'}", f"output={tmp_path / 'o3'}", "text_field=body"))
    assert str(err.value) == (f"text_field='body' is not a column of {corpus / 'c.parquet'} (columns: ['text']): "
                              "set text_field to one of them")


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_final_hint_names_the_real_tokenizer(tmp_path):
    """The last line is a command to copy: data.path=<output> data.tokenizer=<the tokenizer the shards were made
    with>, the default tokenizer's resolved path when none was given."""
    corpus = make_corpus(tmp_path / "corpus", copies=1)
    out = tmp_path / "shards"
    res = run_cli("difflm.preprocess", f"input={corpus / 'a.txt'}", f"output={out}", "workers=1",
                  "progress_bar=false", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == f"train on it with: difflm-train data.path={out} data.tokenizer={NEOX}"
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["name"] == str(NEOX)
    summary = run_preprocess(preprocess_cfg(f"input={corpus / 'a.txt'}", f"output={tmp_path / 'two'}", "workers=1",
                                            f"tokenizer={NEOX}/"))
    assert summary["tokenizer"] == str(NEOX)  # a local directory is named by its absolute path (the manifest's name)
    # a relative directory too: from another directory the relative name would be taken for a hub name
    import os

    here = os.getcwd()
    os.chdir(NEOX.parent)
    try:
        summary = run_preprocess(preprocess_cfg(f"input={corpus / 'a.txt'}", f"output={tmp_path / 'three'}",
                                                "workers=1", f"tokenizer={NEOX.name}"))
    finally:
        os.chdir(here)
    assert summary["tokenizer"] == str(NEOX)
    assert json.loads((tmp_path / "three" / "manifest.json").read_text())["tokenizer"]["name"] == str(NEOX)


def test_long_documents_are_tokenized_in_pieces_to_the_same_ids(tok, monkeypatch):
    """A document longer than BATCH_CHARS (a .txt without separator lines is one) is tokenized in pieces, cut only
    where the tokens do not change: the ids equal one call on the whole document, and no tokenizer call gets much more
    than BATCH_CHARS characters (a call holds ~700 bytes per token: one call on a 200 MB file needed ~33 GB)."""
    from difflm.data import preprocess
    from difflm.data.tokenizer import TokenizerInfo

    text = (REPO / "difflm/assets/corpora/tinyshakespeare/input.txt").read_text(encoding="utf-8")
    doc = text[:150_000].strip()
    whole = np.asarray(tok.encode([doc])[0])
    sizes, encode = [], TokenizerInfo.encode

    def recorded(self, texts):
        sizes.append(sum(map(len, texts)))
        return encode(self, texts)

    monkeypatch.setattr(TokenizerInfo, "encode", recorded)
    monkeypatch.setattr(preprocess, "BATCH_CHARS", 20_000)
    monkeypatch.setattr(preprocess, "PIECE_CHARS", 5_000)
    short, one_line = ["A short one.", "", "Another short one."], " ".join(doc.split())
    batches = list(preprocess.tokenized_batches(tok, short[:2] + [doc, one_line] + short[2:]))
    arrays = [a for arrays, _, _ in batches for a in arrays]
    assert [a.tolist() for a in arrays[:1] + arrays[-1:]] == encode(tok, short[::2])
    assert np.array_equal(arrays[1], whole)  # cut at line starts
    assert np.array_equal(arrays[2], np.asarray(encode(tok, [one_line])[0]))  # no line breaks: cut at spaces
    assert sum(r for _, r, _ in batches) == 5
    assert sum(c for _, _, c in batches) == sum(map(len, short + [doc, one_line]))
    assert len(sizes) > 20 and max(sizes) <= 2 * preprocess.BATCH_CHARS


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_shards_beyond_the_soft_open_file_limit_open(tmp_path, monkeypatch):
    """Each open shard holds one file (its memory map, not its index): a directory of more shards than the soft limit
    of open files (ulimit -n, often 1024) raises that limit towards the hard one and opens, and where the hard limit
    is too low too, the error is one line with the limit to set."""
    import resource

    from difflm.data import shards
    from difflm.data.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path / "many"
    for i in range(60):
        b = IndexedDatasetBuilder(str(root / f"s{i:03d}"), np.uint16)
        b.add_document(np.arange(5, dtype=np.uint16) + i)
        b.finalize()
    prefixes = find_shards(str(root))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 30
    if hard != resource.RLIM_INFINITY and hard < low + 60 + shards.OPEN_FILE_HEADROOM:
        pytest.skip("the hard limit of open files is too low to raise the soft one")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        opened = shards.open_shards(prefixes, str(root))
        assert [int(ds[0][0]) for ds in opened] == list(range(60))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low
        del opened
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        monkeypatch.setattr(shards, "make_room_for_open_files", lambda count: None)
        with pytest.raises(DifflmError, match=r"has 60 shards, one open file each, .* after \d+ of them: raise the "
                                              r"limit \(ulimit -n \d+\) or merge them"):
            shards.open_shards(prefixes, str(root))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_small_input_files_share_shards(tmp_path, tok):
    """Files smaller than shard_mb are joined into shards of about shard_mb (not a shard per file: a folder of 2,000
    small files made 2,000 shards, 4,000 open files for a run), with the in-trainer path's tokens; an output written
    with a shard per file is recognised as this input's tokens."""
    from difflm.data.shards import open_shards

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        write = DOCS[i % len(DOCS)] + f" (file {i})"
        (corpus / f"f{i:02d}.jsonl").write_text(json.dumps({"text": write}) + "\n" + json.dumps({"text": "x y"}) + "\n")
    cache = tokenize_corpus(DataConfig(path=str(corpus)), tok, str(tmp_path / "cache"))
    size = sum(f.stat().st_size for f in corpus.iterdir()) / 1e6
    for shard_mb, count in ((1.0, 1), (size / 3.5, 4)):
        out = tmp_path / f"out{count}"
        summary = run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", f"shard_mb={shard_mb}"))
        assert summary["shards"] == count and summary["documents"] == 60
        assert all_tokens(open_shards(find_shards(str(out), tok), str(out))) == all_tokens([cache])
    m = json.loads((tmp_path / "out1" / "manifest.json").read_text())
    assert [p["source"] for p in m["shards"][0]["pieces"]] == [str(p) for p in sorted(corpus.iterdir())]
    per_file = [{"name": f"shard_{i:05d}", **p} for i, p in enumerate(m["shards"][0]["pieces"])]
    (tmp_path / "out1" / "manifest.json").write_text(json.dumps({**m, "version": 1, "shards": per_file}))
    with pytest.raises(DifflmError, match=r"holds this input's tokens, written by an earlier difflm-preprocess with "
                                          r"another shard layout \(manifest version 1\): train on it as it is, or set "
                                          r"overwrite=true"):
        run_preprocess(preprocess_cfg(f"input={corpus}", f"output={tmp_path / 'out1'}", "shard_mb=1.0"))


def test_shards_picked_out_of_an_output_are_checked_as_the_output_is(tmp_path, tok):
    """A glob, a .bin/.idx file or a prefix inside a difflm-preprocess output is refused as the output itself is:
    while its manifest says incomplete, and when it was made with another tokenizer than data.tokenizer."""
    from difflm.data.shards import OtherTokenizerShards

    corpus = make_corpus(tmp_path / "corpus", copies=2)
    out = tmp_path / "shards"
    run_preprocess(preprocess_cfg(f"input={corpus}", f"output={out}", "workers=1", "shard_mb=0.0005"))
    picks = [str(out / "shard_*.idx"), str(out / "shard_00000.bin"), str(out / "shard_00000")]
    assert all(find_shards(p, tok) for p in picks)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": {**manifest["tokenizer"],
                                                                             "fingerprint": "another"}}))
    for p in picks:
        with pytest.raises(OtherTokenizerShards, match="was tokenized with another tokenizer"):
            find_shards(p, tok)
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    for p in picks:
        with pytest.raises(DifflmError, match="difflm-preprocess has not finished writing it"):
            find_shards(p, tok)
