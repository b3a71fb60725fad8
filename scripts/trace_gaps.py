"""Where the GPU waits: busy share and the largest idle gaps of a torch.profiler Chrome trace, with the CPU ops and
CUDA runtime calls running during each gap. Usage: python scripts/trace_gaps.py TRACE.json[.gz] [--top 12]

The trace may be gzipped (read by its magic bytes, whatever its suffix). Only complete events (``"ph": "X"``, with
``ts`` and ``dur`` in microseconds) are read; GPU time is the union of the kernel, memcpy and memset events.
A trace without GPU events (recorded on a CPU), a missing path or a file that is not a Chrome trace ends with one
line on stderr and exit status 2."""
import collections
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from difflm import script_cli  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "cuda_runtime", "python_function", "user_annotation")


class TraceError(Exception):
    """A trace this script cannot read; the message is the one line printed."""


def load_events(path) -> list[dict]:
    """The complete (``ph == "X"``) events of the Chrome trace at ``path`` (JSON, gzipped or not)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{'is a directory' if path.is_dir() else 'no such file'}; "
                         "give a torch.profiler trace, TRACE.json or TRACE.json.gz")
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, ValueError) as err:  # bad gzip, not UTF-8, not JSON
        raise TraceError(f"not a JSON trace ({type(err).__name__}: {str(err)[:80]})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data  # a Chrome trace may be a bare list
    if not isinstance(events, list):
        raise TraceError("no 'traceEvents' list: not a Chrome trace (torch.profiler's export_chrome_trace)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]


def gpu_gaps(events: list[dict]) -> dict:
    """The GPU's window (first start to last end), busy time (union of GPU events) and idle gaps between them,
    all in microseconds: ``{"start", "span", "busy", "gaps": [(length, gap_start, gap_end), ...]}`` in time
    order. Raises :class:`TraceError` when there are no GPU events."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)
    if not gpu:
        raise TraceError("no GPU kernel events: was it recorded on a CPU run? (needs a trace with CUDA activity)")
    busy, (cur_s, cur_e), gaps = 0.0, gpu[0], []
    for s, e in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return {"start": gpu[0][0], "span": cur_e - gpu[0][0], "busy": busy, "gaps": gaps}


def report(events: list[dict], top: int = 12) -> list[str]:
    """The printed lines: window, busy share and idle time, idle per gap size, then the ``top`` largest gaps
    with the longest CPU events overlapping each (those lasting over 30 % of the gap)."""
    g = gpu_gaps(events)
    start, span, busy, gaps = g["start"], g["span"], g["busy"], g["gaps"]
    share = busy / span if span else 1.0  # one zero-length kernel: nothing to wait for
    lines = [f"window {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({share:.1%}), "
             f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps; "
             f"gaps > 100 us: {sum(n for n, _, _ in gaps if n > 100) / 1e3:.1f} ms"]
    by_size = collections.Counter()
    for n, _, _ in gaps:
        by_size["<10us" if n < 10 else "<100us" if n < 100 else "<1ms" if n < 1000 else ">=1ms"] += n
    lines.append(f"idle by gap size (ms): {({k: round(v / 1e3, 1) for k, v in by_size.items()})}")
    cpu = [e for e in events if e.get("cat") in CPU_CATS]
    for n, s, e in sorted(gaps, reverse=True)[:top]:
        during = sorted((c for c in cpu if c["ts"] < e and c["ts"] + c["dur"] > s and c["dur"] > 0.3 * n),
                        key=lambda c: -c["dur"])
        names = ", ".join(f"{str(c.get('name', '?'))[:50]} ({c['dur'] / 1e3:.1f} ms)" for c in during[:6])
        lines.append(f"gap {n / 1e3:7.2f} ms at +{(s - start) / 1e3:8.1f} ms: {names}")
    return lines


def main(argv=None) -> int:
    """Print the report of one trace; 0, or 2 with one line on stderr for a trace it cannot read."""
    ap = script_cli.parser(__file__, __doc__)
    ap.add_argument("trace", metavar="TRACE", help="a torch.profiler Chrome trace, TRACE.json or TRACE.json.gz")
    ap.add_argument("--top", type=script_cli.int_at_least(0), default=12, help="largest gaps listed (default 12)")
    a = ap.parse_args(argv)
    try:
        lines = report(load_events(a.trace), a.top)
    except TraceError as err:
        print(f"{ap.prog}: error: {a.trace}: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
