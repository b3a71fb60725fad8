"""A file of the wrong kind for the run (plain text where prompt/response JSONL is read, JSONL records as a prompt, a
JSONL file without the text field) is refused in one line naming the key and what to pass."""
import json

import pytest
from omegaconf import OmegaConf

from conftest import compose_run
from difflm.config.validate import check_objective_data
from difflm.errors import DifflmError


def refusal(call, *args) -> str:
    with pytest.raises(DifflmError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("data,message", [
    ({"prompt_field": "question", "response_field": "answer"},
     "data.path: {path} is not .jsonl: objective=sft runs train and evaluate on prompt/response pairs, one JSON "
     "record a line with the fields data.prompt_field='question' and data.response_field='answer': set data.path to "
     "such a .jsonl file (plain text trains with objective=mdlm)"),
    ({"prompt_field": None, "response_field": None, "messages_field": "messages"},
     "data.path: {path} is not .jsonl: data.messages_field='messages' reads conversations, one JSON record a line "
     "holding a list of {{role, content}} turns: set data.path to such a .jsonl file"),
])
def test_eval_of_an_sft_run_on_plain_text_says_what_to_pass(tmp_path, data, message):
    """difflm-eval's rows of an sft run (:func:`difflm.evaluate.eval_dataset`) from a .txt file: refused before any
    tokenizer or model is needed."""
    from difflm.evaluate import eval_dataset

    path = tmp_path / "valid.txt"
    path.write_text("To be, or not to be.\n")
    args = OmegaConf.create({"data": {"path": str(path), "prompt_field": None, "response_field": None,
                                      "chat_template": None, "messages_field": None}})
    run = OmegaConf.create({"objective": {"name": "sft"},
                            "data": {"prompt_field": None, "response_field": None, "chat_template": False, **data}})
    assert refusal(eval_dataset, args, run, None, 64, str(tmp_path)) == message.format(path=path)


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "p.parquet"])
def test_generate_prompt_file_of_records_is_refused(tmp_path, name):
    from difflm.generate import read_prompt

    path = tmp_path / name
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    suffix = name[1:]
    assert refusal(read_prompt, OmegaConf.create({"prompt": "", "prompt_file": str(path)})) == (
        f"prompt_file={str(path)!r} is a {suffix} file: prompt_file is one prompt as plain text (the whole file): "
        "give a .txt file holding the prompt, or prompt=TEXT")


@pytest.mark.parametrize("path", ["corpus.txt", "shards/corpus.parquet"])
def test_train_sft_on_a_plain_text_corpus_is_refused_at_compose_time(path):
    cfg = compose_run(["objective=sft", "data.prompt_field=q", "data.response_field=a", f"data.path={path}"])
    kind = path[path.rindex("."):]
    assert refusal(check_objective_data, cfg) == (
        f"data.path={path!r} is a {kind} file: objective=sft trains on prompt/response pairs, one JSON record a line "
        "with the fields data.prompt_field / data.response_field: set data.path to such a .jsonl file (plain text "
        "trains with objective=mdlm)")
    check_objective_data(compose_run(["objective=sft", "data.prompt_field=q", "data.response_field=a",
                                      "data.path=pairs.jsonl"]))


def test_train_mdlm_on_jsonl_without_the_text_field_names_the_key(tmp_path):
    from difflm.data.documents import DocFormat, file_pieces, iter_documents

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    fmt = DocFormat.of(compose_run([f"data.path={path}"]).data)
    piece = file_pieces(str(path), fmt, 1 << 20)[0]
    assert refusal(lambda: list(iter_documents(piece, fmt))) == (
        f"data.text_field='text' not found in {path}:1 (keys: ['answer', 'question']): set data.text_field to one "
        "of them")


@pytest.mark.parametrize("sep", [" ###", "### ", "\t<|endoftext|>"])
def test_a_separator_no_stripped_line_can_equal_is_refused_by_every_reader(tmp_path, sep):
    """Lines are compared with their whitespace stripped, so data.doc_separator=' ###' could match no line (each
    .txt file one document, "###" lines included): refused by difflm-train, -preprocess and -eval alike."""
    from difflm.config.validate import check_run
    from difflm.data.documents import DocFormat, Piece, iter_documents

    fix = f"has whitespace at its ends, but lines are compared with theirs stripped, so no line would match and each " \
          f".txt file would be one document: give "
    with pytest.raises(DifflmError) as err:
        check_run(compose_run([f"data.doc_separator='{sep}'"]))
    assert str(err.value) == f"data.doc_separator={sep!r} {fix}data.doc_separator={sep.strip()!r}"
    with pytest.raises(DifflmError) as err:
        DocFormat.of(OmegaConf.create({"doc_separator": sep}), key="input")  # difflm-preprocess's spelling
    assert str(err.value) == f"doc_separator={sep!r} {fix}doc_separator={sep.strip()!r}"
    with pytest.raises(DifflmError, match="holds a line break, but a separator is one line of its own"):
        DocFormat.of(OmegaConf.create({"doc_separator": "###\n"}))
    corpus = tmp_path / "docs.txt"
    corpus.write_text("one\n  ###  \ntwo\n\nthree\n")
    for given, docs in (("###", ["one", "two\n\nthree"]), ("", ["one\n  ###  \ntwo", "three"]),
                        (None, ["one\n  ###  \ntwo\n\nthree"])):
        fmt = DocFormat.of(OmegaConf.create({"doc_separator": given}))
        assert list(iter_documents(Piece(str(corpus)), fmt)) == docs
