"""scripts/attention_speed.py on CPU: --shape parsing, and the order of its usage errors (no timing here)."""
from __future__ import annotations

import pytest
import torch
from conftest import load_script, script_usage_error


def test_parse_shape():
    speed = load_script("attention_speed")
    assert speed.parse_shape("1.7b-s4096=4,4096,16,128") == ("1.7b-s4096", (4, 4096, 16, 128))
    assert speed.parse_shape(" x = 1, 2,3 ,4") == ("x", (1, 2, 3, 4))
    for bad in ("=4,4096,16,128", "4,4096,16,128", "a=4,4096,16", "a=4,4096,16,128,1", "a=4,0,16,128",
                "a=4,-1,16,128", "a=4,x,16,128", "a=4,,16,128", "a="):
        with pytest.raises(ValueError, match="expected NAME=B,S,H,D with a name and four positive integers"):
            speed.parse_shape(bad)


@pytest.mark.parametrize("cuda", [False, True])
def test_bad_shape_is_reported_before_the_cuda_check(monkeypatch, capsys, tmp_path, cuda):
    """A bad second shape is a usage error before anything runs (also where CUDA is present: no row is timed)."""
    speed = load_script("attention_speed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(speed, "time_row", lambda *a, **k: pytest.fail("timed a row before checking every shape"))
    out = tmp_path / "rows.json"
    err = script_usage_error(speed, capsys, "--shape", "ok=1,16,2,8", "--shape", "bad=1,16,2", "--backend", "sdpa",
                             "--json", str(out))
    assert "error: --shape 'bad=1,16,2': expected NAME=B,S,H,D" in err and "CUDA" not in err
    assert not out.exists()


def test_without_cuda_exits_2_with_a_clear_message(monkeypatch, capsys):
    speed = load_script("attention_speed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = script_usage_error(speed, capsys, "--shape", "a=1,16,2,8", "--backend", "sdpa")
    assert err.splitlines()[-1].endswith(
        "error: attention_speed.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    err = script_usage_error(speed, capsys, "--shape", "a=1,16,2,8", "--backend", "sdpa", "--iters", "0")
    assert err.splitlines()[-1].endswith("error: --iters must be >= 1, --warmup >= 0 and --gemm-between >= 0")
