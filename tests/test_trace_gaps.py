"""scripts/trace_gaps.py on synthetic Chrome traces: the busy share and gaps by hand, and one-line errors."""
from __future__ import annotations

import gzip
import json

import pytest
from conftest import load_script


def X(cat, ts, dur, name="k"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


# GPU intervals (us): [0, 2000] (two overlapping kernels and one nested), gap 200, [2200, 4200] (a memcpy),
# gap 4800, [9000, 10000]: window 10 ms, busy 5 ms, idle 5 ms in 2 gaps.
GPU_EVENTS = [X("kernel", 0, 1000), X("kernel", 600, 1400), X("kernel", 100, 400), X("gpu_memcpy", 2200, 2000),
              X("kernel", 9000, 1000)]
# during the 4800 us gap: a long host op (listed) and a short one (under 30 % of the gap: not listed)
CPU_EVENTS = [X("cpu_op", 4300, 4200, "aten::item"), X("cuda_runtime", 4250, 300, "cudaLaunchKernel"),
              X("cpu_op", 1900, 1500, "aten::mm")]
OTHER = [{"ph": "M", "name": "process_name", "pid": 1}, {"ph": "i", "cat": "kernel", "ts": 5000, "name": "instant"},
         {"ph": "s", "cat": "fwdbwd", "ts": 1, "id": 1}]


def write(path, events, gz=False):
    text = json.dumps({"schemaVersion": 1, "traceEvents": events})
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_busy_share_and_gaps_by_hand(tmp_path, capsys):
    tg = load_script("trace_gaps")
    events = tg.load_events(write(tmp_path / "t.json", GPU_EVENTS + CPU_EVENTS + OTHER))
    assert len(events) == len(GPU_EVENTS + CPU_EVENTS)  # only complete ("X") events
    g = tg.gpu_gaps(events)
    assert (g["start"], g["span"], g["busy"]) == (0, 10000, 5000)
    assert g["gaps"] == [(200, 2000, 2200), (4800, 4200, 9000)]
    lines = tg.report(events, top=1)
    assert lines == ["window 10.0 ms, GPU busy 5.0 ms (50.0%), idle 5.0 ms in 2 gaps; gaps > 100 us: 5.0 ms",
                     "idle by gap size (ms): {'<1ms': 0.2, '>=1ms': 4.8}",
                     "gap    4.80 ms at +     4.2 ms: aten::item (4.2 ms)"]
    # the same trace gzipped, under a name without .gz: read by its magic bytes
    assert tg.main([str(write(tmp_path / "t2.json", GPU_EVENTS + CPU_EVENTS, gz=True)), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == lines and out[3] == "gap    0.20 ms at +     2.0 ms: aten::mm (1.5 ms)"


def test_cpu_only_trace_is_one_line_error(tmp_path, capsys):
    tg = load_script("trace_gaps")
    path = write(tmp_path / "cpu.json", CPU_EVENTS + OTHER + [X("user_annotation", 0, 9000, "step")])
    assert tg.main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"trace_gaps.py: error: {path}: no GPU kernel events: was it recorded on a CPU run? "
                            "(needs a trace with CUDA activity)\n")


@pytest.mark.parametrize("name,content,why", [
    ("missing.json", None, "no such file"),
    ("", None, "is a directory"),  # tmp_path itself
    ("a.txt", b"not json", "not a JSON trace (JSONDecodeError"),
    ("b.json.gz", b"\x1f\x8b not gzip", "not a JSON trace (BadGzipFile"),
    ("c.json", b'{"rows": []}', "no 'traceEvents' list"),
])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, name, content, why):
    tg = load_script("trace_gaps")
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert tg.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trace_gaps.py: error: {path}: {why}") and err.count("\n") == 1
