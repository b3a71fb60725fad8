"""``data.blend``: shares within 2 % of the weights over 1,000 sampled windows, per-source epochs, exact resume with
per-source validation NELBO in metrics.jsonl, and the same windows under every parallel layout (gloo ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, straight_and_resumed
from difflm.config.schema import DataConfig
from difflm.data import build_datasets, build_sampler, build_tokenizer
from difflm.data.blend import BlendedSampler, BlendedWindows, blend_entries
from difflm.errors import DifflmError

NEOX = REPO / "difflm/assets/tokenizers/gpt-neox-20b"
SHAKESPEARE = REPO / "difflm/assets/corpora/tinyshakespeare/input.txt"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(str(NEOX))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    """Two corpora: the first 8,000 lines of tinyshakespeare and the next 12,000 (different text)."""
    root = tmp_path_factory.mktemp("corpora")
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "a.txt").write_text("".join(lines[:8000]), encoding="utf-8")
    (root / "b.txt").write_text("".join(lines[8000:20000]), encoding="utf-8")
    return root / "a.txt", root / "b.txt"


def blend_override(a: Path, b: Path, wa: float = 0.25, wb: float = 0.75) -> str:
    return f"data.blend=[{{path:{a},weight:{wa}}},{{path:{b},weight:{wb}}}]"


def sources_of(train: BlendedWindows, indices: np.ndarray) -> np.ndarray:
    return np.searchsorted(train.offsets, indices, side="right") - 1


def test_shares_of_1000_windows_within_2_percent(corpora, tok, tmp_path):
    a, b = corpora
    cfg = DataConfig(blend=[{"path": str(a), "weight": 0.25}, {"path": str(b), "weight": 0.75}], seq_len=32)
    train, valid = build_datasets(cfg, tok, str(tmp_path / "cache"))
    assert isinstance(train, BlendedWindows) and train.names == ["a", "b"] and len(valid.sources) == 2
    sampler = build_sampler(train, 8, seed=1234)
    drawn = np.concatenate([sampler.indices(step) for step in range(125)])  # 1,000 windows
    shares = np.bincount(sources_of(train, drawn), minlength=2) / len(drawn)
    print(f"measured shares over 1000 windows: {shares.tolist()}")
    assert abs(shares[0] - 0.25) < 0.02 and abs(shares[1] - 0.75) < 0.02
    report = sampler.report(125)
    assert report["data_share/a"] == pytest.approx(shares[0]) and report["data_share/b"] == pytest.approx(shares[1])
    assert report["data_epochs/a"] == pytest.approx(shares[0] * 1000 / train.sizes[0])
    # each sampled window is that source's own window: the blend serves the source's tokens
    rows = train.get(drawn[:16])
    for row, flat, src in zip(rows, drawn[:16], sources_of(train, drawn[:16])):
        assert torch.equal(row, train.parts[src].get([flat - train.offsets[src]])[0])
    # other weights, three sources, other seeds: every share within 2 % as well
    for weights, seed in (([0.1, 0.9], 0), ([0.5, 0.3, 0.2], 7), ([1, 1, 2], 99)):
        s = BlendedSampler([300, 500, 700][: len(weights)], weights, list("xyz")[: len(weights)], 10, seed)
        src = np.searchsorted(s.offsets, np.concatenate([s.indices(k) for k in range(100)]), side="right") - 1
        got = np.bincount(src, minlength=len(weights)) / 1000
        assert np.abs(got - np.asarray(weights) / sum(weights)).max() < 0.02, (weights, got)


def test_each_source_passes_over_its_windows_once_per_epoch():
    s = BlendedSampler([5, 7], [0.4, 0.6], ["x", "y"], 4, seed=3)
    drawn = np.concatenate([s.indices(k) for k in range(60)])
    for i, n in enumerate((5, 7)):
        local = drawn[(drawn >= s.offsets[i]) & (drawn < s.offsets[i + 1])] - s.offsets[i]
        for e in range(len(local) // n):
            assert sorted(local[e * n:(e + 1) * n].tolist()) == list(range(n))
    # a fresh sampler (resume) gives the same indices at any step, in any order, also past the cached block
    again = BlendedSampler([5, 7], [0.4, 0.6], ["x", "y"], 4, seed=3)
    for step in (59, 2, 40000, 17, 0):
        np.testing.assert_array_equal(again.indices(step), s.indices(step))
    assert not np.array_equal(BlendedSampler([5, 7], [0.4, 0.6], ["x", "y"], 4, seed=4).indices(1), s.indices(1))


def test_blend_state_and_config_errors(corpora, tok, tmp_path):
    s = BlendedSampler([5, 7], [1, 3], ["x", "y"], 4, seed=3)
    state = s.state_dict(10)
    assert state["blend"] == {"names": ["x", "y"], "weights": [0.25, 0.75], "windows": [5, 7]}
    s.check_state(state)
    with pytest.raises(DifflmError, match="blend changed since the checkpoint"):
        BlendedSampler([5, 7], [1, 1], ["x", "y"], 4, seed=3).check_state(state)
    assert [n for n, _, _ in blend_entries([{"path": "/d/web/*.jsonl"}, {"path": "/e/web"}, {"path": "b.txt"}])] == \
        ["web", "web_2", "b"]
    for bad, needle in (([{"weight": 1}], r"data.blend\[0\] has no path"),
                        ([{"path": "a", "weight": 0}], r"data.blend\[0\].weight=0 must be a number > 0"),
                        ([{"path": "a", "name": "n"}, {"path": "b", "name": "n"}], "used twice")):
        with pytest.raises(DifflmError, match=needle):
            blend_entries(bad)
    a, _ = corpora
    missing = tmp_path / "nope"  # a source that is not there is named by its blend key, not data.path
    with pytest.raises(DifflmError, match=r"data.blend source 'nope' .*data.blend\[1\].path=.* does not exist") as err:
        build_datasets(DataConfig(blend=[{"path": str(a)}, {"path": str(missing)}]), tok, str(tmp_path))
    assert "data.path" not in str(err.value)
    with pytest.raises(DifflmError, match="data.blend is not supported with objective=sft"):
        build_datasets(DataConfig(blend=[{"path": str(a)}], prompt_field="question"), tok, str(tmp_path))


def test_a_later_missing_source_is_refused_before_the_first_is_tokenized(corpora, tok, tmp_path, monkeypatch):
    """A mistyped second path is refused before the first source is tokenized (hours on a large corpus)."""
    import difflm.data.blend as blend

    a, _ = corpora
    monkeypatch.setattr(blend, "token_datasets", lambda *args: pytest.fail("a source was tokenized"))
    with pytest.raises(DifflmError) as err:
        build_datasets(DataConfig(blend=[{"path": str(a)}, {"path": str(tmp_path / "nope")}]), tok, str(tmp_path))
    assert str(err.value) == (f"data.blend source 'nope' ({tmp_path / 'nope'}): data.blend[1].path="
                              f"'{tmp_path / 'nope'}' does not exist: point data.blend[1].path at a "
                              ".txt/.jsonl/.parquet file, a directory or a glob")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DifflmError, match=r"^data.blend source 'empty' .*data.blend\[1\].path=.* is a directory with "
                                          r"no .txt, .jsonl or .parquet files"):
        build_datasets(DataConfig(blend=[{"path": str(a)}, {"path": str(tmp_path / "empty")}]), tok, str(tmp_path))


def test_a_bad_blend_entry_is_refused_naming_its_index_before_the_run_starts():
    """A weight of the wrong type and a misspelt entry key are named as ``data.blend[i].<key>`` in one line, and a
    weight <= 0 is refused before the device and the kernels are chosen."""
    from test_command_line_errors import refusal

    from difflm.config.validate import check_config
    from conftest import compose_run

    assert refusal(["data.blend=[{path:a,weight:1},{path:b,weight:abc}]"]) == (
        "data.blend[1].weight=abc: Value 'abc' of type 'str' could not be converted to Float; give a value of the "
        "key's type")
    assert refusal(["data.blend=[{path:a,wieght:1}]"]) == (
        "data.blend[0].wieght is not a key of this entry; did you mean weight? (an entry takes path, weight, name)")
    with pytest.raises(DifflmError, match=r"^data.blend\[1\].weight=-2.0 must be a number > 0"):
        check_config(compose_run(["data.blend=[{path:a,weight:1},{path:b,weight:-2}]"]))


def val_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_blend_resume_is_bit_exact_with_per_source_val_nelbo(corpora, fast_cfg, tmp_path):
    a, b = corpora
    common = [blend_override(a, b), "train.max_steps=6", "train.save_every=3", "logger.log_every=1",
              "train.eval_every=3", "objective.random_length_prob=0.3"]
    dir_a, dir_b, _ = straight_and_resumed(fast_cfg, tmp_path, common)
    ra, rb = val_rows(dir_a), val_rows(dir_b)
    for step in (4, 5, 6):
        assert ra[step]["loss"] == rb[step]["loss"]  # bit-exact
        assert ra[step]["data_share/a"] == rb[step]["data_share/a"]
    last = ra[6]
    assert last["val_nelbo/b"] == rb[6]["val_nelbo/b"] and last["val_nelbo/a"] == rb[6]["val_nelbo/a"]
    # val_nelbo is the weight-averaged per-source NELBO; shares are those of the 6 x 4 samples drawn
    assert last["val_nelbo"] == pytest.approx(0.25 * last["val_nelbo/a"] + 0.75 * last["val_nelbo/b"], rel=1e-12)
    assert last["data_share/a"] + last["data_share/b"] == pytest.approx(1.0)
    assert 0 < last["val_nelbo/a"] < 20 and ra[0]["val_nelbo/a"] > 0  # the step-0 evaluation has them too


@pytest.mark.slow  # starts processes: make test-fast leaves it out
def test_every_layout_sees_the_same_windows(corpora, tmp_path):
    """tp2pp2, dp2 x tp2 and fsdp (dp4) on 4 gloo ranks: each rank's data-parallel slice of every step holds the
    windows of the same slice of the single-process batch."""
    a, b = corpora
    overrides = [blend_override(a, b), "data.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "model.num_layers=4", f"data.cache_dir={tmp_path / 'cache'}", "train.seed=5"]
    steps, layouts = 6, ["tp2pp2", "tp2", "fsdp"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(REPO / "tests/fixtures/layout_windows.py"), str(tmp_path), str(steps), ",".join(layouts), *overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    from conftest import compose_run

    cfg = compose_run(["parallel=single", *overrides])
    train, _ = build_datasets(cfg.data, build_tokenizer(str(NEOX)), cfg.data.cache_dir)
    sampler = build_sampler(train, 8, 5)
    single = [train.get(sampler.indices(step)) for step in range(steps)]
    for layout in layouts:
        seen = set()
        for rank in range(4):
            got = torch.load(tmp_path / f"{layout}_rank{rank}.pt", weights_only=True)
            local, d = 8 // got["dp"], got["coords"]["dp"]
            seen.add(d)
            for step in range(steps):
                assert torch.equal(got["windows"][step], single[step][d * local:(d + 1) * local]), (layout, rank, step)
        assert seen == set(range({"tp2pp2": 1, "tp2": 2, "fsdp": 4}[layout]))  # every slice of the batch is covered
