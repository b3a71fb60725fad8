"""Tokens/s of ``difflm-preprocess`` against a plain ``datasets.map`` tokenization of the same files, in one run.

    python scripts/preprocess_speed.py --data /work/shared/data/corpora/gutenberg [--workers 0] [--repeat 1]

Both sides read the same .txt files with the same tokenizer (``--tokenizer``, default the embedded GPT-NeoX-20B),
the same number of processes (difflm ``workers=N``; ``datasets.map(num_proc=N)``) and the same encoding call
(``add_special_tokens=False, split_special_tokens=True``), and both are timed from the text files to tokens on disk:

* difflm: ``run_preprocess`` (hash the sources, plan pieces, tokenize, write .bin/.idx shards and the manifest);
* datasets: ``load_dataset("text", sample_by="document")`` (one row per file, as a .txt without separator lines is
  one document for difflm) into a fresh cache, then ``map(tokenize, batched=True)`` into its Arrow cache.

``--repeat K`` links every file K times (a bigger corpus of the same text); ``--trials T`` alternates the two T
times and keeps each side's fastest. Prints the tokens, seconds and tokens/s of each side and the ratio.
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import difflm.config  # noqa: E402,F401 - registers the schemas and the difflm_asset resolver
from difflm import script_cli  # noqa: E402
from difflm.config.schema import PreprocessConfig  # noqa: E402
from difflm.data.shards import run_preprocess  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402


def corpus(src: Path, root: Path, repeat: int) -> Path:
    """``root/corpus`` holding ``repeat`` links to every .txt of ``src``."""
    out = root / "corpus"
    out.mkdir()
    for f in sorted(src.glob("*.txt")):
        for k in range(repeat):
            os.symlink(f.resolve(), out / f"{f.stem}_{k}.txt")
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_difflm(files_dir: Path, out: Path, tokenizer: str, workers: int) -> tuple[int, float]:
    cfg = OmegaConf.merge(OmegaConf.structured(PreprocessConfig),
                          {"input": str(files_dir), "output": str(out), "tokenizer": tokenizer, "workers": workers,
                           "progress_bar": False})
    start = time.perf_counter()
    summary = run_preprocess(cfg)
    return summary["tokens"], time.perf_counter() - start


def run_datasets_map(files_dir: Path, cache: Path, tokenizer: str, workers: int) -> tuple[int, float]:
    import datasets

    from difflm.data import build_tokenizer

    datasets.disable_progress_bars()
    start = time.perf_counter()
    tok = build_tokenizer(tokenizer).tokenizer
    files = sorted(str(f) for f in files_dir.glob("*.txt"))
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train", cache_dir=str(cache))

    def encode(batch):
        return {"input_ids": tok(batch["text"], add_special_tokens=False, split_special_tokens=True,
                                 verbose=False)["input_ids"]}

    out = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    seconds = time.perf_counter() - start
    tokens = sum(len(x) for x in out["input_ids"])
    return tokens, seconds


@script_cli.script_main
def main(argv=None) -> int:
    """Time both tokenizations ``--trials`` times and print each side's fastest and their ratio."""
    p = script_cli.parser(__file__, __doc__)
    p.add_argument("--data", type=script_cli.caller_path,
                   default=str(Path(__file__).resolve().parents[2] / "shared/data/corpora/gutenberg"),
                   help="a folder of .txt files (default: the shared Gutenberg books beside the checkout)")
    p.add_argument("--tokenizer", default=str(difflm.config.ASSETS / "tokenizers" / "gpt-neox-20b"),
                   help="a tokenizer folder (tokenizer.json) or hub name (default: the embedded GPT-NeoX-20B)")
    p.add_argument("--workers", type=script_cli.int_at_least(0), default=0,
                   help="processes on both sides; 0 = one per CPU core")
    p.add_argument("--repeat", type=script_cli.int_at_least(1), default=1,
                   help="links to every file, K times the corpus (default 1)")
    p.add_argument("--trials", type=script_cli.int_at_least(1), default=1,
                   help="alternations of the two sides; each side's fastest is kept (default 1)")
    args = p.parse_args(argv)
    src = args.data
    if not src.is_dir() or not any(src.glob("*.txt")):
        raise DifflmError(f"--data {src}: no .txt files there: give a folder of .txt files (the shared Gutenberg "
                          "books: /work/shared/data/corpora/gutenberg)")
    from difflm.data import build_tokenizer

    build_tokenizer(args.tokenizer, key="--tokenizer")  # one that does not load is refused before any timing
    workers = args.workers or len(os.sched_getaffinity(0))
    best: dict[str, tuple[int, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = corpus(src, root, args.repeat)
        for trial in range(args.trials):
            for name, fn in (("difflm-preprocess", run_difflm), ("datasets.map", run_datasets_map)):
                target = root / f"{name}_{trial}"
                cpu = cpu_seconds()
                tokens, seconds = fn(files, target, args.tokenizer, workers)
                cpu = cpu_seconds() - cpu
                shutil.rmtree(target, ignore_errors=True)
                print(f"trial {trial}: {name:17s} {tokens:>12,} tokens {seconds:8.2f} s ({cpu:7.2f} CPU s) "
                      f"{tokens / seconds:>12,.0f} tok/s", flush=True)
                if name not in best or seconds < best[name][1]:
                    best[name] = (tokens, seconds, cpu)
    rate = {name: tokens / seconds for name, (tokens, seconds, _) in best.items()}
    cpu_rate = {name: tokens / cpu for name, (tokens, _, cpu) in best.items()}
    print(f"corpus: {src} x {args.repeat}, {workers} worker(s), fastest of {args.trials} trial(s); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, (tokens, seconds, cpu) in best.items():
        print(f"  {name:17s} {tokens:>12,} tokens in {seconds:7.2f} s = {rate[name]:>10,.0f} tokens/s "
              f"({cpu:.1f} CPU s = {cpu_rate[name]:,.0f} tokens per CPU second)")
    print(f"ratio difflm-preprocess / datasets.map: {rate['difflm-preprocess'] / rate['datasets.map']:.2f}x tokens/s, "
          f"{cpu_rate['difflm-preprocess'] / cpu_rate['datasets.map']:.2f}x tokens per CPU second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
