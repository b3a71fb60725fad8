"""Where the GPU waits: busy share and the largest idle gaps of a torch.profiler Chrome trace, with the CPU ops and
CUDA runtime calls running during each gap. Usage: python scripts/trace_gaps.py TRACE.json[.gz] [--top 12]"""
import argparse
import collections
import gzip
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation")]
    start, end = gpu[0][0], max(t for _, t in gpu)
    busy, cur_s, cur_e, gaps = 0.0, gpu[0][0], gpu[0][1], []
    for s, e in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = end - start
    print(f"window {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / span:.1%}), idle {(span - busy) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps; gaps > 100 us: {sum(g for g, _, _ in gaps if g > 100) / 1e3:.1f} ms")
    by_size = collections.Counter()
    for g, _, _ in gaps:
        by_size["<10us" if g < 10 else "<100us" if g < 100 else "<1ms" if g < 1000 else ">=1ms"] += g
    print("idle by gap size (ms):", {k: round(v / 1e3, 1) for k, v in by_size.items()})
    for g, s, e in sorted(gaps, reverse=True)[:a.top]:
        during = [c for c in cpu if c["ts"] < e and c["ts"] + c["dur"] > s and c["dur"] > 0.3 * g]
        during.sort(key=lambda c: -c["dur"])
        names = ", ".join(f"{c['name'][:50]} ({c['dur'] / 1e3:.1f} ms)" for c in during[:6])
        print(f"gap {g / 1e3:7.2f} ms at +{(s - start) / 1e3:8.1f} ms: {names}")


if __name__ == "__main__":
    main()
