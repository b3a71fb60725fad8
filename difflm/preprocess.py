"""``difflm-preprocess``: tokenize a corpus once into Megatron .bin/.idx shards that ``data.path=`` reads.

    difflm-preprocess input=corpus/ output=shards/ workers=8         # .txt/.jsonl/.parquet files, dir or glob
    difflm-preprocess hf_dataset=saved_dir/ text_field=text output=shards/
    difflm-train data.path=shards/ ...

The counterpart of Megatron-LM's ``tools/preprocess_data.py``; the tokens are those of the in-trainer path.
Parallel workers, a progress bar, atomic shards, resume after a crash and a manifest: :mod:`difflm.data.shards`.
"""
from __future__ import annotations

import shlex

from difflm.cli import hydra_app
from difflm.data.shards import run_preprocess


@hydra_app("preprocess")
def main(cfg) -> None:
    s = run_preprocess(cfg)
    docs = f"{s['documents']:,} document{'s' if s['documents'] != 1 else ''}"
    print(f"difflm-preprocess: {s['shards']} shard(s) ({s['skipped']} already done), {docs}, "
          f"{s['tokens']:,} tokens; tokenized {s['new_tokens']:,} tokens in {s['tokenize_seconds']:.1f} s "
          f"({s['tokens_per_s']:,.0f} tokens/s, {s['workers']} worker(s)) -> {s['output']}\n"
          f"train on it with: difflm-train {shlex.quote('data.path=' + s['output'])} "
          f"{shlex.quote('data.tokenizer=' + s['tokenizer'])}", flush=True)


if __name__ == "__main__":
    main()
