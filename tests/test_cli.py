"""Free text on the command line: prompts reach Hydra as one string whatever they hold; prompt_file=."""
from __future__ import annotations

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from difflm.cli import hydra_quoted, quote_free_text
from difflm.errors import DifflmError
from difflm.generate import read_prompt

TEXTS = ["a, b", "ROMEO: my lord (aside) [exit]", "it's", "say \"hi\", ok", "back\\", "a\\'b", "${oc.env:HOME}",
         "k=v, w", "two\nlines", "", "{x: 1}"]


@pytest.mark.parametrize("text", TEXTS)
def test_quoted_text_parses_back_to_itself(text):
    value = OverridesParser.create().parse_override("prompt=" + hydra_quoted(text)).value()
    assert OmegaConf.create({"p": value}).p == text


def test_only_values_hydra_cannot_take_are_quoted():
    argv = ["run.dir=x", "prompt=a, b", "gen.length=8"]
    assert quote_free_text(argv, ("prompt",)) == ["run.dir=x", "prompt='a, b'", "gen.length=8"]
    for kept in (["prompt=ROMEO:"], ["prompt='a, b'"], ["prompt=${oc.env:USER}"], ["prompt=hello world"]):
        assert quote_free_text(kept, ("prompt",)) == kept
    assert quote_free_text(["prompt=x: (y)"], ("prompt",)) == ["prompt='x: (y)'"]
    assert quote_free_text(["-m", "prompt=a,b"], ("prompt",)) == ["-m", "prompt=a,b"]  # a sweep on purpose
    assert quote_free_text(["gen.cache=a,b"], ("prompt",)) == ["gen.cache=a,b"]  # other keys: Hydra's rules


def test_prompt_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("First line, with a comma\nsecond: (line)\n", encoding="utf-8")
    args = OmegaConf.create({"prompt": "", "prompt_file": str(path)})
    assert read_prompt(args) == "First line, with a comma\nsecond: (line)"
    assert read_prompt(OmegaConf.create({"prompt": "hi", "prompt_file": None})) == "hi"
    with pytest.raises(DifflmError, match="not both"):
        read_prompt(OmegaConf.create({"prompt": "hi", "prompt_file": str(path)}))
    with pytest.raises(DifflmError, match="prompt_file="):
        read_prompt(OmegaConf.create({"prompt": "", "prompt_file": str(tmp_path / "missing.txt")}))
