"""scripts/flash_tiles.py on CPU: usage errors before any timing, and the scoped swap of FA4's SM90 tile tables
(against a stand-in for ``flash_attn.cute.interface``: FA4 runs on Hopper GPUs only)."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch
from conftest import load_script, script_usage_error


@dataclass(frozen=True)
class _Cfg:
    m_block_size: int
    n_block_size: int


class _Cache(dict):
    pass


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in FA4 interface module: tile tables, config classes, calls with their compile caches."""
    interface = types.ModuleType("flash_attn.cute.interface")
    interface.BwdConfig = interface.FwdConfig = _Cfg
    interface._tile_size_bwd_sm90 = lambda *a, **k: _Cfg(80, 128)
    interface._tile_size_fwd_sm90 = lambda *a, **k: _Cfg(128, 128)
    interface._flash_attn_bwd = types.SimpleNamespace(compile_cache=_Cache(cached="bwd kernel"))
    interface._flash_attn_fwd = types.SimpleNamespace(compile_cache=_Cache(cached="fwd kernel"))
    cache_utils = types.ModuleType("flash_attn.cute.cache_utils")
    cache_utils.JITCache = _Cache
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.cute, cute.interface, cute.cache_utils = cute, interface, cache_utils
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface), ("flash_attn.cute.cache_utils", cache_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    return interface


@pytest.mark.parametrize("kind", ["bwd", "fwd"])
def test_tiles_answers_the_row_then_restores_table_and_cache(fake_fa4, kind):
    tiles = load_script("flash_tiles").tiles
    table, call = f"_tile_size_{kind}_sm90", getattr(fake_fa4, f"_flash_attn_{kind}")
    default, cache = getattr(fake_fa4, table)(), call.compile_cache
    with tiles(kind, dict(m_block_size=64, n_block_size=96)):
        assert getattr(fake_fa4, table)(128, 128, False, False) == _Cfg(64, 96)
        assert "cached" not in call.compile_cache  # a kernel compiled for other tiles cannot answer
        call.compile_cache["swept"] = "kernel of the row"
    assert getattr(fake_fa4, table)() == default and call.compile_cache is cache and "swept" not in cache
    with pytest.raises(RuntimeError), tiles(kind, dict(m_block_size=48, n_block_size=128)):
        raise RuntimeError("FA4 could not build the tile")
    assert getattr(fake_fa4, table)() == default and call.compile_cache is cache
    with tiles(kind, None):  # the default row changes nothing
        assert getattr(fake_fa4, table)() == default and call.compile_cache is cache


def test_configurations_are_named_once_and_cover_both_directions():
    configs = load_script("flash_tiles").CONFIGS
    names = [name for name, _, _ in configs]
    assert len(names) == len(set(names))
    assert {kind for _, kind, _ in configs} == {"bwd", "fwd"}
    assert [name for name, _, fields in configs if fields is None] == ["bwd-default", "fwd-default"]


@pytest.mark.parametrize("cuda", [False, True])
def test_usage_errors_come_before_the_cuda_check_and_any_timing(monkeypatch, capsys, tmp_path, cuda):
    script = load_script("flash_tiles")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(script, "time_config", lambda *a, **k: pytest.fail("timed a row before the checks"))
    out = tmp_path / "rows.json"
    for argv, message in ((["--shape", "8,4096,16"], "--shape '8,4096,16': expected four positive integers"),
                          (["--shape", "8,0,16,128"], "expected four positive integers B,S,H,D"),
                          (["--iters", "0"], "--iters must be >= 1, --warmup >= 0 and --gemm-between >= 0"),
                          (["--only", "bwd-nonesuch"], "invalid choice: 'bwd-nonesuch'")):
        err = script_usage_error(script, capsys, *argv, "--json", str(out))
        assert message in err and "CUDA GPU" not in err, (argv, err)
    assert not out.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = script_usage_error(script, capsys)
    assert err.splitlines()[-1].endswith("error: flash_tiles.py needs a CUDA GPU (torch.cuda.is_available() is False)")
