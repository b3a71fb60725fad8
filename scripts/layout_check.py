"""Multi-GPU checks of one host in one script and ONE table: layout correctness, throughput, resharding.

    python scripts/layout_check.py --gpus 2 --parts correctness,throughput,reshard --steps 20 --out /tmp/lc \\
        -- model=125m precision=bf16 data.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=16

Every run is its own launch of ``python -m difflm.train`` (one process) or ``python -m torch.distributed.run
--standalone --nproc-per-node=N -m difflm.train`` (NCCL on CUDA, gloo with ``--device cpu``), in
``<out>/<part>/<backend>/<run>`` with logging every step (``metrics.jsonl``), no evaluation, no samples and
``objective.random_length_prob=0`` (every step at full length, so layouts whose sequence split rounds lengths
see the same batches). NVLink multicast stays off in every process started here (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, UB_SKIPMC=1 for TE's userbuffers): it can take a
shared host's GPUs down. TE runs under a tensor-parallel layout also get CUDA_DEVICE_MAX_CONNECTIONS=1 (one work
queue, so TP collectives are scheduled before the GEMMs they overlap; TE warns without it). With several GPUs the
1-GPU runs (the correctness references of all backends, the throughput baselines of all backends and precisions)
run side by side, one per GPU.

Parts (``--parts``, comma-separated; correctness and reshard run backend by backend, then throughput, then big):

* ``correctness``: for each backend (``--backends``: ``torch``; ``te`` = ``model.backend=te
  model.attention_backend=te``) one ``parallel=single`` reference, then each layout of ``--gpus`` (``--layouts``;
  default 2: ddp fsdp tp2 pp2 cp2 / 4: ddp fsdp tp2 tp4 tp2pp2 cp2 / 8: ddp fsdp tp2 tp4 tp8 tp4pp2 cp2) on all
  ``--gpus`` ranks (the presets fill the data-parallel dimension), ``--steps`` steps, same seed, global batch
  and data (the positional overrides after ``--``). Columns: max over steps 1..N of |loss - loss_ref| / |loss_ref|
  and the same for grad_norm. Status FAIL when the loss difference exceeds ``--tol`` (default 1e-2 for
  bf16/fp8/fp16, where FSDP's BF16 parameters and different reduction orders give ~1e-3; 1e-4 for fp32, where
  layouts agree to ~1e-6). The grad-norm difference is reported, not judged. Where a layout needs another
  micro-batch (global batch / dp, pipeline micro-batches a multiple of pp), the largest micro-batch that fits is
  used and the note says so (the loss is normalised by the global batch, so the numbers do not change).
  Not run (a "skipped" row says why): cp and the te backend under ``--device cpu`` (CUDA only), layouts needing
  more ranks than ``--gpus``.
* ``reshard``: each ``--reshard-from`` run (default tp2pp2 on 4+ GPUs; tp2 and pp2 on 2) trains all N steps with
  ``train.save_every=N/2`` (the same run is its correctness row: saving changes nothing; the LR schedule is
  built from ``train.max_steps=N`` as in the reference); its step-N/2 checkpoint is copied into a fresh run
  dir that resumes under ``--reshard-to`` (default fsdp) to step N, as tests/test_parallel.py does (a run dir
  holding a checkpoint resumes from it; difflm has no "stop at step" key, so the saving run simply goes on).
  Columns: max relative loss / grad-norm difference of the resumed steps N/2+1..N against the single-process
  reference; the note adds the difference against the uninterrupted source run.
* ``throughput``: ``model=--tput-model data.seq_len=--tput-seq`` for each backend (``--tput-backends``: ``te``,
  ``torch``, ``torch-compile`` = torch + ``model.compile=true``) x precision (``--precisions``; fp8 only with
  te). Data parallelism (``--dp-layout``, default fsdp) on 1, 2, 4, 8 GPUs up to ``--gpus`` (1 GPU: parallel=
  single), weak scaling: micro-batch ``--tput-micro`` and ``--tput-accum`` accumulation steps fixed, so
  ``train.global_batch_size = micro x accum x dp``; then tp2 / tp4 (``--tp-layouts``) on all ``--gpus`` ranks.
  Tokens/s/GPU and MFU are the medians of the per-step ``tokens_per_s_per_gpu`` and ``mfu`` in metrics.jsonl
  over the steps after ``--warmup`` (one logged value per step); efficiency = tokens/s/GPU / that of the 1-GPU
  run of the same backend and precision (target >= 97 % for data parallelism). MFU is against the BF16 dense
  peak, FP8 too. ``--tput-variants`` adds rows on all GPUs with extra overrides, ``preset:key=value:...``
  (e.g. ``ddp:parallel.reduce_dtype=bf16``, shown as ``ddp+bf16red``; ``tp2:parallel.tp_comm_overlap=true`` as
  ``tp2+overlap``); an entry of ``--tp-layouts`` / ``--tput-variants`` prefixed ``bf16@`` or ``fp8@`` runs for
  that precision only.
* ``big``: ``--big-model`` (default 8b) under ``--big-layout`` (default fsdp) on all ``--gpus``, micro-batch
  ``--big-micro``, extra ``--big-overrides``, for ``--big-backends`` x ``--precisions``: tokens/s/GPU and MFU as above.

A failing run does not stop the script: its row says ``failed`` with the last error line (or ``timeout``: each
launch is limited to ``--timeout`` seconds, then its processes get SIGTERM and, 20 s later, SIGKILL), and the
end of its stderr (at most 40 lines: difflm's one-line errors, else the root-cause rank's traceback) is printed,
saved to ``<out>/<run>/stderr.txt`` (the whole of it: ``stderr.log``) and kept in the JSON. ``--time-budget S``:
runs that would start after S seconds are skipped ("skipped: time budget") and no launch runs past S (a
throughput launch stopped there still reports the steps it logged). Each row is printed as it completes and
``<out>/layout_check.json`` is rewritten after every run, so a killed script leaves its results; the whole
table is printed at the end. ``--plan`` prints the launches without running them and writes nothing. Exit status: 0,
or 1 when a row failed, timed out or exceeded the tolerance; a usage error (a count, preset, backend or precision
that does not exist, ``--device cuda`` without ``--gpus`` CUDA GPUs) is one line ``layout_check.py: error: ...``,
exit 2, before anything runs.

The launches run in the current folder (``--out`` and every relative path of the overrides are relative to it) with
this checkout's difflm first on ``PYTHONPATH``. They end with the script: SIGTERM, SIGINT or SIGHUP to it stops each
running launch (SIGTERM to its processes, SIGKILL 20 s later), and on Linux a launch whose parent died of SIGKILL gets
SIGTERM from the kernel (torchrun then stops its workers).

The layout and scaling measurements on 2 H200s (each call stays under the device tool's 10 minutes; the launch times are estimates, ~25 s of
start-up per launch plus the steps; ``--time-budget`` cuts what would not fit, its rows say "skipped: time budget"):

    # A. throughput + 8B (~7.5 min: 2 baselines side by side, 7 two-GPU 1.7b launches, one 8b launch)
    python scripts/layout_check.py --gpus 2 --parts throughput,big --out /root/lc_a --time-budget 560 \
        --timeout 170 --tput-backends te --precisions bf16,fp8 --tput-model 1.7b --tput-seq 4096 --tput-micro 4 \
        --tput-accum 4 --tput-steps 8 --warmup 3 --dp-layout ddp --tp-layouts bf16@tp2 \
        --tput-variants ddp:parallel.reduce_dtype=bf16,tp2:parallel.tp_comm_overlap=true \
        --big-model 8b --big-layout fsdp --big-micro 1 --big-precisions bf16
    # B. correctness of ddp fsdp tp2 pp2 cp2 for both backends vs one GPU (~5 min: 2 references side by side,
    #    10 two-GPU 125m launches of 4 steps)
    python scripts/layout_check.py --gpus 2 --parts correctness --out /root/lc_b --time-budget 560 --timeout 120 \
        --steps 4 --backends te,torch --layouts ddp,fsdp,tp2,pp2,cp2 \
        -- model=125m precision=bf16 data.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=16
    # C. (optional) the torch backend's throughput: compiled blocks, async TP (~6 min, compilation)
    python scripts/layout_check.py --gpus 2 --parts throughput --out /root/lc_c --time-budget 560 --timeout 240 \
        --tput-backends torch-compile --precisions bf16 --tput-steps 8 --warmup 4 --dp-layout ddp --tp-layouts tp2 \
        --tput-variants tp2:parallel.tp_comm_overlap=true

4 and 8 GPUs (no such machine yet): the same calls with ``--gpus 4`` / ``--gpus 8``; the layout sets become
ddp fsdp tp2 tp4 tp2pp2 cp2 / ddp fsdp tp2 tp4 tp8 tp4pp2 cp2, throughput adds the 2- and 4-GPU scaling rows:

    python scripts/layout_check.py --gpus 8 --parts correctness,reshard --steps 8 --out /root/lc8b --timeout 150 \
        -- model=125m precision=bf16 data.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=32
    python scripts/layout_check.py --gpus 8 --parts throughput --out /root/lc8t --timeout 200 --tput-backends te \
        --precisions bf16,fp8 --tput-steps 8 --warmup 3 --dp-layout fsdp --tp-layouts tp2,tp4,tp8 \
        --tput-variants fsdp:parallel.reduce_dtype=bf16,tp4:parallel.tp_comm_overlap=true,tp4pp2
    python scripts/layout_check.py --gpus 8 --parts big --big-backends te --precisions bf16,fp8 --big-model 8b \
        --big-layout fsdp --big-micro 2 --out /root/lc8big
    # 4 GPUs: --gpus 4, --tp-layouts tp2,tp4 and
    #   --tput-variants fsdp:parallel.reduce_dtype=bf16,tp4:parallel.tp_comm_overlap=true,tp2pp2

Any of them with ``--plan`` prints the launches and runs nothing. CPU dry run (gloo; with ``--device cpu`` the
throughput and big rows default to ``model=tiny``, S=64, fp32 and the torch backend):

    python scripts/layout_check.py --device cpu --gpus 2 --parts correctness,reshard,throughput --steps 4 \
        -- model=tiny data.seq_len=32 train.micro_batch_size=2 train.global_batch_size=8
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402

from difflm import script_cli, strict_json  # noqa: E402
from difflm.config import CONF_DIR  # noqa: E402
from difflm.config.schema import TrainConfig  # noqa: E402
from difflm.errors import DifflmError  # noqa: E402

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "UB_SKIPMC": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", "TOKENIZERS_PARALLELISM": "false"}
# TE's tensor parallelism: one CUDA work queue, so each TP collective is scheduled before the GEMM it overlaps
# (TE warns without it; Megatron-LM requires it for TP communication overlap)
TE_TP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
VARIANT_TAGS = {  # short names of the override variants in the layout column (--tput-variants)
    "parallel.reduce_dtype=bf16": "bf16red", "parallel.tp_comm_overlap=true": "overlap",
    "parallel.reshard_after_forward=false": "noreshard", "parallel.grad_sync=every": "syncall",
    "parallel.activation_checkpointing=full": "ac", "parallel.activation_checkpointing=selective": "sac",
}
LAYOUTS = {
    2: ["ddp", "fsdp", "tp2", "pp2", "cp2"],
    4: ["ddp", "fsdp", "tp2", "tp4", "tp2pp2", "cp2"],
    8: ["ddp", "fsdp", "tp2", "tp4", "tp8", "tp4pp2", "cp2"],
}
BACKENDS = {"torch": ["model.backend=torch"], "te": ["model.backend=te", "model.attention_backend=te"]}
TPUT_BACKENDS = {**BACKENDS, "torch-compile": ["model.backend=torch", "model.compile=true"]}
COMMON = ["train.eval_every=0", "train.save_every=0", "logger.log_every=1", "logger.progress_bar=false",
          "logger.num_samples=0", "objective.random_length_prob=0"]
PARTS = ("correctness", "reshard", "throughput", "big")
STDERR_TAIL = 40
KILL_GRACE_S = 20


# ------------------------------------------------------------------ overrides and layouts
def override_value(overrides: list[str], key: str, default=None):
    """The value the last ``key=value`` of ``overrides`` sets (a string), else ``default``."""
    value = default
    for item in overrides:
        name, _, rest = item.lstrip("+").partition("=")
        if name == key:
            value = rest
    return value


def layout_degrees(name: str) -> dict[str, int]:
    """tp, pp, cp, dp_replicate, dp_shard of the preset ``conf/parallel/<name>.yaml`` (-1 = fill)."""
    preset = OmegaConf.load(CONF_DIR / "parallel" / f"{name}.yaml")
    return {k: int(preset.get(k, 1)) for k in ("tp", "pp", "cp", "dp_replicate", "dp_shard")}


def min_ranks(name: str) -> int:
    """Fewest processes the preset runs on (its fixed degrees; a fill degree counts 1)."""
    return math.prod(max(v, 1) for v in layout_degrees(name).values())


def dp_degree(name: str, ranks: int) -> int:
    """Data-parallel ranks (dp_replicate x dp_shard) of the preset on ``ranks`` processes."""
    d = layout_degrees(name)
    return max(ranks // (d["tp"] * d["pp"] * d["cp"]), 1)


def fit_micro_batch(global_batch: int, micro: int, dp: int, pp: int) -> int:
    """The largest micro-batch <= ``micro`` with global_batch % (mb x dp) == 0 and, with a pipeline
    (pp > 1), the accumulation steps global_batch / (mb x dp) a multiple of pp; ``micro`` if none fits
    (difflm then refuses the run with its own message)."""
    for mb in range(micro, 0, -1):
        if global_batch % (mb * dp) == 0 and (global_batch // (mb * dp)) % pp == 0:
            return mb
    return micro


def skip_reason(layout: str, backend: str, device: str, gpus: int) -> Optional[str]:
    """Why ``layout`` x ``backend`` is not run here (None: it is)."""
    d = layout_degrees(layout)
    if device == "cpu" and backend.startswith("te"):
        return "te backend: CUDA only"
    if device == "cpu" and d["cp"] > 1:
        return "cp: CUDA only"
    if min_ranks(layout) > gpus:
        return f"needs {min_ranks(layout)} GPUs"
    return None


def parse_variant(entry: str) -> tuple[str, list[str], str]:
    """``preset[:key=value...]`` -> (preset, overrides, label for the layout column), e.g. ``tp2:parallel.
    tp_comm_overlap=true`` -> ("tp2", ["parallel.tp_comm_overlap=true"], "tp2+overlap")."""
    preset, *overrides = [x for x in entry.split(":") if x]
    tags = [VARIANT_TAGS.get(o, o.rsplit(".", 1)[-1]) for o in overrides]
    return preset, overrides, "+".join([preset, *tags])


def for_precision(entry: str, precision: str) -> Optional[str]:
    """``--tp-layouts`` / ``--tput-variants`` entries may start with ``<precision>@`` to run for that precision only:
    the entry without it when it applies to ``precision``, else None."""
    only, sep, rest = entry.partition("@")
    if not sep:
        return entry
    return rest if only == precision else None


def launch_env(overrides: list[str]) -> dict[str, str]:
    """Extra environment of one launch: :data:`TE_TP_ENV` for the TE backend under a tensor-parallel layout."""
    if override_value(overrides, "model.backend", "torch") != "te":
        return {}
    tp = override_value(overrides, "parallel.tp")
    if tp is None:
        tp = layout_degrees(override_value(overrides, "parallel", "single"))["tp"]
    return dict(TE_TP_ENV) if int(tp) > 1 else {}


def max_memory(metrics: dict[int, dict]) -> Optional[float]:
    """Peak ``mem_gib`` over the logged steps (rank 0's CUDA allocator peak: per GPU), None if not logged."""
    values = [r["mem_gib"] for r in metrics.values() if r.get("mem_gib") is not None]
    return max(values) if values else None


# ------------------------------------------------------------------ metrics
def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Logged training steps of ``<run_dir>/metrics.jsonl`` by step (rows with a loss)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r.get("loss") is not None}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def max_rel_diffs(got: dict[int, dict], ref: dict[int, dict], steps) -> tuple[float, float]:
    """Max relative loss and grad_norm differences of ``got`` vs ``ref`` over ``steps``.
    Raises KeyError naming the missing steps."""
    steps = list(steps)
    missing = [s for s in steps if s not in got or s not in ref]
    if missing:
        raise KeyError(f"steps {missing} not logged")
    return (max(rel_diff(got[s]["loss"], ref[s]["loss"]) for s in steps),
            max(rel_diff(got[s]["grad_norm"], ref[s]["grad_norm"]) for s in steps))


def summarize_throughput(metrics: dict[int, dict], warmup: int) -> dict:
    """Medians of the per-step ``tokens_per_s_per_gpu`` and ``mfu`` over the steps after ``warmup``
    (log_every=1: each logged value covers one step). ``mfu`` is None where the device peak is unknown.
    Raises ValueError when no step follows the warmup."""
    steps = [s for s in sorted(metrics) if s > warmup]
    if not steps:
        raise ValueError(f"no logged step after the {warmup} warmup steps")
    mfus = [metrics[s].get("mfu") for s in steps]
    return {"tokens_per_s_per_gpu": statistics.median(metrics[s]["tokens_per_s_per_gpu"] for s in steps),
            "mfu": statistics.median(mfus) if all(m is not None for m in mfus) else None,
            "steps": len(steps)}


def scaling_efficiency(tokens_per_s_per_gpu: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """Per-GPU throughput over the 1-GPU baseline's (None without both)."""
    if tokens_per_s_per_gpu is None or not baseline:
        return None
    return tokens_per_s_per_gpu / baseline


# ------------------------------------------------------------------ table
@dataclass
class Row:
    part: str
    backend: str
    precision: str
    layout: str
    gpus: int
    loss_diff: Optional[float] = None
    grad_diff: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None
    efficiency: Optional[float] = None
    mfu: Optional[float] = None
    mem_gib: Optional[float] = None
    status: str = "ok"  # ok | FAIL (tolerance) | failed | timeout | skipped | reference | planned
    note: str = ""
    run: str = ""
    wall_s: Optional[float] = None
    stderr_tail: str = ""


COLUMNS = [  # header, width, Row -> text
    ("part", 11, lambda r: r.part),
    ("backend", 13, lambda r: r.backend),
    ("prec", 5, lambda r: r.precision),
    ("layout", 17, lambda r: r.layout),
    ("GPUs", 4, lambda r: str(r.gpus)),
    ("loss diff", 9, lambda r: _num(r.loss_diff, "{:.2e}")),
    ("gnorm diff", 10, lambda r: _num(r.grad_diff, "{:.2e}")),
    ("tok/s/GPU", 10, lambda r: _num(r.tokens_per_s_per_gpu, "{:,.0f}")),
    ("eff", 6, lambda r: _num(r.efficiency, "{:.1%}")),
    ("MFU", 6, lambda r: _num(r.mfu, "{:.1%}")),
    ("mem GiB", 7, lambda r: _num(r.mem_gib, "{:.1f}")),
]


def skipped(row: Row, reason: str) -> Row:
    row.status, row.note = "skipped", reason
    return row


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def format_row(row: Row) -> str:
    cells = [f"{fn(row):>{w}}" if i >= 4 else f"{fn(row):<{w}}" for i, (_, w, fn) in enumerate(COLUMNS)]
    status = row.status + (f": {row.note}" if row.note else "")
    return " ".join(cells) + "  " + status


def format_header() -> str:
    cells = [f"{h:>{w}}" if i >= 4 else f"{h:<{w}}" for i, (h, w, _) in enumerate(COLUMNS)]
    return " ".join(cells) + "  status/note"


# ------------------------------------------------------------------ launching
@dataclass
class RunResult:
    name: str
    run_dir: Path
    ok: bool
    status: str = "ok"  # ok | failed | timeout | skipped | planned
    note: str = ""
    metrics: dict = field(default_factory=dict)
    stdout: str = ""
    stderr_tail: str = ""
    wall_s: float = 0.0

    @property
    def usable(self) -> bool:
        """Finished well, or only planned (``--plan``: the launches that would depend on it are planned too)."""
        return self.ok or self.status == "planned"


def error_excerpt(stderr: str, n: int = STDERR_TAIL) -> str:
    """The informative end of a failed launch's stderr (at most ``n`` lines).

    difflm's own one-line errors (``difflm: error: ...``) when there are any; under torchrun, whose last lines
    are its own ChildFailedError report, the last ``n`` lines of the root-cause rank's output (``[rankK]:``
    prefix; the rank torchrun names under "Root Cause", else the first one with a traceback); else the
    last ``n`` lines.
    """
    lines = stderr.splitlines()
    errors = list(dict.fromkeys(line for line in lines if "difflm: error:" in line))
    if errors:
        return "\n".join(errors[-n:])
    rank = None
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            rank = next((x.split(":", 1)[1].split()[0] for x in lines[i:i + 8] if x.strip().startswith("rank ")), None)
            break
    if rank is None:
        rank = next((line[5:line.index("]")] for line in lines if line.startswith("[rank") and "Traceback" in line),
                    None)
    mine = [line for line in lines if rank is not None and line.startswith(f"[rank{rank}]:")]
    return "\n".join((mine or lines)[-n:])


def last_error_line(excerpt: str, width: int = 100) -> str:
    """The last line of :func:`error_excerpt`'s text without its rank and difflm prefixes, for the table."""
    line = excerpt.splitlines()[-1].split("]: ", 1)[-1]
    return line.removeprefix("difflm: error: ").strip()[:width]


class Runner:
    """Launches ``difflm.train`` runs into ``<out>/<name>``, each at most once per (name, command), with a
    per-run timeout and an overall time budget."""

    def __init__(self, out: Path, device: str, timeout: float, budget: Optional[float], plan: bool = False):
        self.out, self.device, self.timeout, self.budget, self.plan = out, device, timeout, budget, plan
        self.start = time.monotonic()
        self.done: dict[str, tuple[list[str], RunResult]] = {}

    def remaining(self) -> float:
        return math.inf if self.budget is None else self.budget - (time.monotonic() - self.start)

    def command(self, ranks: int, run_dir: Path, overrides: list[str]) -> list[str]:
        args = ["-m", "difflm.train", *COMMON, f"device={self.device}", f"run.dir={run_dir}",
                f"data.cache_dir={self.out / 'cache'}", *overrides]
        if ranks == 1:
            return [sys.executable, *args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]

    def env(self, ranks: int, overrides: list[str], gpu: Optional[int] = None) -> dict[str, str]:
        threads = str(max(1, min(4, (os.cpu_count() or 1) // ranks)))
        env = script_cli.difflm_env({"OMP_NUM_THREADS": threads, **os.environ, **SAFE_ENV, **launch_env(overrides)})
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        return env

    def run(self, name: str, ranks: int, overrides: list[str], resume_from: Optional[Path] = None) -> RunResult:
        """Launch (or return the earlier result of the same launch). The run dir starts empty, except for
        ``resume_from`` (a ``checkpoints/step_<N>`` dir), copied in so the run resumes from it."""
        return self.run_concurrent([(name, ranks, overrides, resume_from)])[0]

    def run_concurrent(self, jobs: list[tuple], gpus: int = 1) -> list[RunResult]:
        """Launches of ``(name, ranks, overrides, resume_from)``; when all are 1-rank CUDA runs and ``gpus`` > 1 they
        run side by side, ``gpus`` at a time, each on its own GPU (``CUDA_VISIBLE_DEVICES``): the 1-GPU references
        and baselines of a multi-GPU machine. Earlier identical launches are not repeated."""
        results: list[Optional[RunResult]] = [None] * len(jobs)
        pending = []
        for i, (name, ranks, overrides, resume_from) in enumerate(jobs):
            cmd = self.command(ranks, self.out / name, overrides)
            if name in self.done and self.done[name][0] == cmd:
                results[i] = self.done[name][1]
            else:
                pending.append((i, name, ranks, overrides, resume_from, cmd))
        side_by_side = self.device == "cuda" and gpus > 1 and all(job[2] == 1 for job in pending)
        width = gpus if side_by_side else 1
        for first in range(0, len(pending), width):
            started = []
            for slot, (i, name, ranks, overrides, resume_from, cmd) in enumerate(pending[first:first + width]):
                env = self.env(ranks, overrides, slot if side_by_side else None)
                started.append((i, name, cmd, self._start(name, self.out / name, ranks, cmd, resume_from, env)))
            for i, name, cmd, handle in started:
                results[i] = self._finish(*handle)
                self.done[name] = (cmd, results[i])
        return results

    def _start(self, name: str, run_dir: Path, ranks: int, cmd: list[str], resume_from: Optional[Path], env: dict):
        extra = {k: v for k, v in env.items() if k in (*TE_TP_ENV, "CUDA_VISIBLE_DEVICES")}
        print(f"# {name} ({ranks} proc{', ' + shlex.join(f'{k}={v}' for k, v in extra.items()) if extra else ''}): "
              f"{shlex.join(cmd)}", flush=True)
        if self.plan:
            return (name, run_dir, None, 0.0, 0.0, "planned")
        limit = min(self.timeout, self.remaining())
        if limit < 10:
            return (name, run_dir, None, 0.0, 0.0, "skipped")
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: never mix with an earlier run
        run_dir.mkdir(parents=True)
        if resume_from is not None:
            shutil.copytree(resume_from, run_dir / "checkpoints" / resume_from.name)
        (run_dir / "cmd.txt").write_text(shlex.join(cmd) + "\n")
        with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
            proc = script_cli.start(cmd, env=env, stdout=out, stderr=err)
        return (name, run_dir, proc, time.monotonic(), limit, "started")

    def _finish(self, name: str, run_dir: Path, proc, start: float, limit: float, state: str) -> RunResult:
        if state == "planned":
            return RunResult(name, run_dir, ok=False, status="planned")
        if state == "skipped":
            return RunResult(name, run_dir, ok=False, status="skipped", note="time budget")
        try:
            proc.wait(timeout=max(1.0, limit - (time.monotonic() - start)))
            status = "ok" if proc.returncode == 0 else "failed"
            note = "" if status == "ok" else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            script_cli.stop_tree([proc], KILL_GRACE_S)
            status, note = "timeout", f"killed after {limit:.0f} s"
        result = RunResult(name, run_dir, ok=status == "ok", status=status, note=note,
                           metrics=read_metrics(run_dir), stdout=(run_dir / "stdout.log").read_text(errors="replace"),
                           wall_s=time.monotonic() - start)
        if not result.ok:
            result.stderr_tail = error_excerpt((run_dir / "stderr.log").read_text(errors="replace"))
            if status == "failed" and result.stderr_tail:
                result.note += ": " + last_error_line(result.stderr_tail)
            (run_dir / "stderr.txt").write_text(result.stderr_tail + "\n")
            print(f"# {name} {status} ({note}); end of stderr ({run_dir / 'stderr.txt'}, whole: stderr.log):\n"
                  f"{result.stderr_tail}", flush=True)
        return result


# ------------------------------------------------------------------ the checks
class LayoutCheck:
    """Builds the rows of every part; prints each as it completes and rewrites the JSON after each."""

    def __init__(self, args: argparse.Namespace, runner: Runner):
        self.args, self.runner = args, runner
        self.rows: list[Row] = []
        self.shared = list(args.overrides)
        self.precision = override_value(self.shared, "precision", "fp32")
        self.global_batch = int(override_value(self.shared, "train.global_batch_size", TrainConfig.global_batch_size))
        self.micro = int(override_value(self.shared, "train.micro_batch_size", TrainConfig.micro_batch_size))
        self.tol = args.tol if args.tol is not None else (1e-4 if self.precision == "fp32" else 1e-2)
        self.half = args.steps // 2
        self.reshard_from = args.reshard_from or (["tp2pp2"] if args.gpus >= 4 else ["tp2", "pp2"])
        print(format_header(), flush=True)

    # -------------------------------------------------------------- rows
    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.write_json()
        return row

    def write_json(self) -> None:
        """Rewrite ``<out>/layout_check.json`` with the rows so far; with ``--plan`` nothing is written (an earlier
        run's results there stay)."""
        if self.args.plan:
            return
        payload = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
                   "tolerance": self.tol, "elapsed_s": time.monotonic() - self.runner.start,
                   "rows": [asdict(r) for r in self.rows]}
        self.args.out.mkdir(parents=True, exist_ok=True)
        tmp = self.args.out / "layout_check.json.tmp"
        tmp.write_text(strict_json.dumps(payload, indent=1))
        tmp.replace(self.args.out / "layout_check.json")

    def row_from(self, row: Row, result: RunResult) -> Row:
        """Copy a launch's status, note, name, wall time, peak memory and stderr excerpt into ``row``."""
        row.status, row.note, row.run, row.wall_s = result.status, result.note, result.name, result.wall_s
        row.stderr_tail, row.mem_gib = result.stderr_tail, max_memory(result.metrics)
        return row

    def judge(self, row: Row) -> None:
        if row.loss_diff is not None and not row.loss_diff <= self.tol:
            row.status = "FAIL"
            row.note = (row.note + "; " if row.note else "") + f"loss diff > {self.tol:g}"

    # -------------------------------------------------------------- correctness
    def layout_overrides(self, layout: str) -> tuple[list[str], str]:
        """``parallel=<layout>`` plus a fitted micro-batch; returns (overrides, note)."""
        if layout == "single":
            return ["parallel=single"], ""
        pp = layout_degrees(layout)["pp"]
        mb = fit_micro_batch(self.global_batch, self.micro, dp_degree(layout, self.args.gpus), pp)
        if mb == self.micro:
            return [f"parallel={layout}"], ""
        return [f"parallel={layout}", f"train.micro_batch_size={mb}"], f"micro-batch {mb}"

    def correctness_job(self, backend: str, layout: str) -> tuple[tuple, str]:
        """The correctness launch of ``layout`` as a Runner job (the reshard source also saves at step N/2)."""
        overrides, note = self.layout_overrides(layout)
        saves = "reshard" in self.args.parts and layout in self.reshard_from and self.half > 0
        save = [f"train.save_every={self.half}"] if saves else []
        ranks = 1 if layout == "single" else self.args.gpus
        job = (f"correctness/{backend}/{layout}", ranks,
               [*BACKENDS[backend], *self.shared, f"train.max_steps={self.args.steps}", *overrides, *save], None)
        return job, note

    def correctness_run(self, backend: str, layout: str) -> tuple[RunResult, str]:
        job, note = self.correctness_job(backend, layout)
        return self.runner.run(*job), note

    def reference(self, backend: str) -> RunResult:
        return self.correctness_run(backend, "single")[0]

    def check_correctness(self, backend: str) -> None:
        """The ``parallel=single`` reference row, then one row per layout."""
        row = Row("correctness", backend, self.precision, "single", 1)
        reason = skip_reason("single", backend, self.args.device, 1)
        if reason is not None:
            self.add(skipped(row, reason))
            return
        ref = self.reference(backend)
        self.row_from(row, ref)
        if ref.ok:
            self.throughput_columns(row, ref)
            row.status = "reference"
        self.add(row)
        for layout in self.args.layouts:
            self.add(self.correctness_row(backend, layout, ref))

    def correctness_row(self, backend: str, layout: str, ref: RunResult) -> Row:
        row = Row("correctness", backend, self.precision, layout, self.args.gpus)
        reason = skip_reason(layout, backend, self.args.device, self.args.gpus)
        if reason is not None or not ref.usable:
            return skipped(row, reason or "no reference")
        result, note = self.correctness_run(backend, layout)
        self.row_from(row, result)
        row.note = "; ".join(x for x in (note, row.note) if x)
        if result.ok:
            self.compare(row, result.metrics, ref.metrics, range(1, self.args.steps + 1))
            self.throughput_columns(row, result)
        return row

    def compare(self, row: Row, got: dict, ref: dict, steps) -> None:
        try:
            row.loss_diff, row.grad_diff = max_rel_diffs(got, ref, steps)
            self.judge(row)
        except KeyError as err:
            row.status, row.note = "failed", str(err).strip("'\"")

    def throughput_columns(self, row: Row, result: RunResult) -> Row:
        """Informative tokens/s/GPU and MFU of a correctness run (median after ``--warmup`` steps)."""
        try:
            summary = summarize_throughput(result.metrics, min(self.args.warmup, self.args.steps - 1))
            row.tokens_per_s_per_gpu, row.mfu = summary["tokens_per_s_per_gpu"], summary["mfu"]
        except ValueError:
            pass
        return row

    # -------------------------------------------------------------- reshard
    def check_reshard(self, backend: str) -> None:
        for src in self.reshard_from:
            self.add(self.reshard_row(backend, src, self.args.reshard_to))

    def reshard_row(self, backend: str, src: str, dst: str) -> Row:
        """Save under ``src`` at step N/2 (its correctness run), resume under ``dst`` to N, compare."""
        n, half, gpus = self.args.steps, self.half, self.args.gpus
        row = Row("reshard", backend, self.precision, f"{src}>{dst}", gpus)
        reason = (skip_reason(src, backend, self.args.device, gpus) or skip_reason(dst, backend, self.args.device, gpus)
                  or (f"--steps {n} leaves no step to resume" if half < 1 else None))
        if reason is not None:
            return skipped(row, reason)
        ref = self.reference(backend)
        if not ref.usable:
            return skipped(row, f"no reference ({ref.status})")
        source, _ = self.correctness_run(backend, src)
        ckpt = source.run_dir / "checkpoints" / f"step_{half}"
        if not source.usable:
            return skipped(row, f"no source run {src} ({source.status})")
        if not (ckpt.is_dir() or self.runner.plan):
            return skipped(row, f"no checkpoint {ckpt}")
        overrides, note = self.layout_overrides(dst)
        resumed = self.runner.run(f"reshard/{backend}/{src}-to-{dst}", gpus,
                                  [*BACKENDS[backend], *self.shared, f"train.max_steps={n}", *overrides],
                                  resume_from=ckpt)
        self.row_from(row, resumed)
        if resumed.ok:
            self.reshard_columns(row, resumed, source, ref, note, src)
        return row

    def reshard_columns(self, row: Row, resumed: RunResult, source: RunResult, ref: RunResult, note: str,
                        src: str) -> None:
        steps = range(self.half + 1, self.args.steps + 1)
        if f"from step {self.half}" not in resumed.stdout or min(resumed.metrics, default=0) != self.half + 1:
            row.status, row.note = "failed", f"did not resume from step {self.half}"
            return
        self.compare(row, resumed.metrics, ref.metrics, steps)
        try:
            vs_source, _ = max_rel_diffs(resumed.metrics, source.metrics, steps)
            row.note = "; ".join(x for x in (note, f"vs uninterrupted {src}: {vs_source:.2e}",
                                             row.note) if x)
        except KeyError:
            pass

    # -------------------------------------------------------------- throughput
    def tput_job(self, label: str, backend: str, precision: str, layout: str, ranks: int, model: str,
                 micro: int, extra: list[str]) -> tuple:
        """One throughput launch as a Runner job: weak scaling, global batch = micro x accum x dp. ``layout`` is a
        preset or a variant ``preset:key=value...`` (:func:`parse_variant`)."""
        preset, variant, tag = parse_variant(layout)
        dp = 1 if preset == "single" else dp_degree(preset, ranks)
        overrides = [*TPUT_BACKENDS[backend], f"precision={precision}", f"model={model}",
                     f"data.seq_len={self.args.tput_seq}", f"train.micro_batch_size={micro}",
                     f"train.global_batch_size={micro * self.args.tput_accum * dp}",
                     f"train.max_steps={self.args.tput_steps}", f"parallel={preset}", *extra, *variant]
        return (f"{label}/{backend}-{precision}/{model}-{tag}-{ranks}", ranks, overrides, None)

    def tput_row(self, label: str, backend: str, precision: str, layout: str, ranks: int, result: RunResult,
                 micro: int) -> Row:
        preset, _, tag = parse_variant(layout)
        dp = 1 if preset == "single" else dp_degree(preset, ranks)
        row = self.row_from(Row(label, backend, precision, tag, ranks), result)
        try:  # a launch stopped by its timeout still reports the steps it logged
            summary = summarize_throughput(result.metrics, self.args.warmup)
            row.tokens_per_s_per_gpu, row.mfu = summary["tokens_per_s_per_gpu"], summary["mfu"]
            what = f"median of {summary['steps']} steps, global batch {micro * self.args.tput_accum * dp}"
            row.note = "; ".join(x for x in (row.note, what) if x)
        except ValueError as err:
            if result.ok:
                row.status, row.note = "failed", str(err)
        return row

    def tput_run(self, label: str, backend: str, precision: str, layout: str, ranks: int, model: str,
                 micro: int, extra: list[str]) -> tuple[Row, RunResult]:
        result = self.runner.run(*self.tput_job(label, backend, precision, layout, ranks, model, micro, extra))
        return self.tput_row(label, backend, precision, layout, ranks, result, micro), result

    def check_throughput(self) -> None:
        """1-GPU baselines (side by side on the machine's GPUs), then per backend and precision: data-parallel
        scaling (``--dp-layout`` on 2, 4, 8 GPUs up to ``--gpus``), the TP layouts and the variants on all GPUs."""
        a = self.args
        extra = list(a.tput_overrides)
        combos = []
        for backend in a.tput_backends:
            for precision in a.precisions:
                if precision == "fp8" and backend != "te":
                    continue  # FP8 runs through Transformer Engine only
                reason = skip_reason("single", backend, a.device, 1)
                if reason is not None:
                    self.add(skipped(Row("throughput", backend, precision, "-", 1), reason))
                    continue
                combos.append((backend, precision))
        baselines = self.runner.run_concurrent(
            [self.tput_job("throughput", b, p, "single", 1, a.tput_model, a.tput_micro, extra) for b, p in combos],
            a.gpus)
        for (backend, precision), base in zip(combos, baselines):
            row = self.tput_row("throughput", backend, precision, "single", 1, base, a.tput_micro)
            baseline = row.tokens_per_s_per_gpu
            self.add(row)
            entries = [for_precision(e, precision) for e in (*a.tp_layouts, *a.tput_variants)]
            plan = [(a.dp_layout, n) for n in (2, 4, 8) if n <= a.gpus] + \
                [(e, a.gpus) for e in entries if e is not None and min_ranks(parse_variant(e)[0]) <= a.gpus]
            for layout, ranks in plan:
                row, _ = self.tput_run("throughput", backend, precision, layout, ranks, a.tput_model, a.tput_micro,
                                       extra)
                row.efficiency = scaling_efficiency(row.tokens_per_s_per_gpu, baseline)
                self.add(row)

    def check_big_model(self) -> None:
        a = self.args
        extra = [*a.tput_overrides, *a.big_overrides]
        for backend in a.big_backends:
            for precision in a.big_precisions or a.precisions:
                if precision == "fp8" and backend != "te":
                    continue
                reason = skip_reason(a.big_layout, backend, a.device, a.gpus)
                if reason is not None:
                    self.add(skipped(Row("big", backend, precision, a.big_layout, a.gpus), reason))
                    continue
                row, _ = self.tput_run("big", backend, precision, a.big_layout, a.gpus, a.big_model,
                                       a.big_micro, extra)
                row.note = "; ".join(x for x in (f"model={a.big_model}", row.note) if x)
                self.add(row)

    # -------------------------------------------------------------- all
    def run(self) -> list[Row]:
        """The parts in ``--parts`` order, correctness and reshard together, backend by backend (a time budget then
        cuts the last parts or backend, not a whole part); the final table lists the rows part by part."""
        per_backend = [p for p in ("correctness", "reshard") if p in self.args.parts]
        order = list(dict.fromkeys("per_backend" if p in per_backend else p for p in self.args.parts))
        for part in order:
            if part == "per_backend":
                # the 1-GPU references of every backend side by side, one GPU each
                self.runner.run_concurrent([self.correctness_job(b, "single")[0] for b in self.args.backends
                                            if skip_reason("single", b, self.args.device, 1) is None], self.args.gpus)
                for backend in self.args.backends:
                    for name in per_backend:
                        getattr(self, f"check_{name}")(backend)
            elif part == "throughput":
                self.check_throughput()
            elif part == "big":
                self.check_big_model()
        self.rows.sort(key=lambda r: PARTS.index(r.part))  # stable: run order within a part
        self.write_json()
        written = "--plan: nothing written" if self.args.plan else self.args.out / "layout_check.json"
        print(f"\n# layout_check: {len(self.rows)} rows in {time.monotonic() - self.runner.start:.0f} s, "
              f"loss tolerance {self.tol:g}; {written}")
        print(format_header())
        for row in self.rows:
            print(format_row(row))
        sys.stdout.flush()
        return self.rows


def presets(group: str) -> list[str]:
    """The presets of ``conf/<group>/`` by name."""
    return sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything runs: every count, preset, backend and precision it names. Usage
    errors end as one line, ``layout_check.py: error: ...``, exit 2."""
    ap = script_cli.parser(__file__, __doc__)
    layouts, precisions, models = presets("parallel"), presets("precision"), presets("model")
    csv = script_cli.comma_list
    ap.add_argument("--gpus", type=int, default=2, choices=sorted(LAYOUTS),
                    help="ranks of the multi-process runs: 2, 4 or 8 (with --device cuda: GPUs of this host)")
    ap.add_argument("--parts", type=csv(PARTS, "part"), default=["correctness", "reshard", "throughput"],
                    help="comma-separated, run in this order: correctness, reshard (both backend by backend), "
                         "throughput, big (default: correctness,reshard,throughput)")
    ap.add_argument("--out", type=script_cli.output_dir, default="layout_check",
                    help="folder of the run folders and layout_check.json, relative to the current folder "
                         "(default: ./layout_check)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (NCCL; needs --gpus CUDA GPUs) or cpu (a gloo dry run)")
    ap.add_argument("--timeout", type=script_cli.positive_number, default=300,
                    help="seconds per launch before it is stopped (default 300)")
    ap.add_argument("--time-budget", type=script_cli.positive_number, default=None,
                    help="seconds for the whole call; later runs are skipped (default: no limit)")
    ap.add_argument("--plan", action="store_true", help="print the launches, run nothing (no GPU needed)")
    g = ap.add_argument_group("correctness and reshard")
    g.add_argument("--steps", type=script_cli.int_at_least(1), default=20,
                   help="training steps of each correctness run (reshard: saved at half of them; default 20)")
    g.add_argument("--backends", type=csv(BACKENDS, "backend"), default=["torch", "te"],
                   help="comma-separated: torch, te (default: both)")
    g.add_argument("--layouts", type=csv(layouts, "parallel preset"), default=None,
                   help="parallel presets, comma-separated (default: the set for --gpus)")
    g.add_argument("--tol", type=script_cli.positive_number, default=None,
                   help="max relative loss difference (default 1e-2; fp32: 1e-4)")
    g.add_argument("--reshard-from", type=csv(layouts, "parallel preset"), default=None,
                   help="source layouts, comma-separated (default tp2pp2 on 4+ GPUs, tp2,pp2 on 2)")
    g.add_argument("--reshard-to", default="fsdp", choices=layouts, metavar="PRESET",
                   help="the parallel preset the saved checkpoints resume under (default fsdp)")
    g = ap.add_argument_group("throughput")
    g.add_argument("--tput-backends", type=csv(TPUT_BACKENDS, "backend"), default=None,
                   help="te, torch, torch-compile (default te,torch-compile; --device cpu: torch)")
    g.add_argument("--precisions", type=csv(precisions, "precision preset"), default=None,
                   help="precision presets, comma-separated (default bf16,fp8; --device cpu: fp32)")
    g.add_argument("--tput-model", default=None, choices=models, metavar="PRESET",
                   help="model preset of the throughput rows (default 1.7b; --device cpu: tiny)")
    g.add_argument("--tput-seq", type=script_cli.int_at_least(1), default=None,
                   help="data.seq_len of the throughput rows (default 4096; --device cpu: 64)")
    g.add_argument("--tput-micro", type=script_cli.int_at_least(1), default=4,
                   help="micro-batch per GPU of the throughput rows (default 4)")
    g.add_argument("--tput-accum", type=script_cli.int_at_least(1), default=4,
                   help="accumulation steps of the throughput rows (default 4)")
    g.add_argument("--tput-steps", type=script_cli.int_at_least(1), default=12,
                   help="training steps of each throughput launch (default 12)")
    g.add_argument("--warmup", type=script_cli.int_at_least(0), default=4,
                   help="steps left out of the medians (default 4)")
    g.add_argument("--dp-layout", default="fsdp", choices=layouts, metavar="PRESET",
                   help="data-parallel preset of the scaling rows (default fsdp)")
    g.add_argument("--tp-layouts", type=csv(what="layout"), default=["tp2", "tp4"],
                   help="rows on all GPUs, [prec@]preset each, comma-separated (default tp2,tp4)")
    g.add_argument("--tput-variants", type=csv(what="variant"), default=[],
                   help="more rows on all GPUs, [prec@]preset[:key=value...] each, e.g. "
                        "ddp:parallel.reduce_dtype=bf16 or bf16@tp2:parallel.tp_comm_overlap=true")
    g.add_argument("--tput-overrides", type=script_cli.shell_words, default="",
                   help="extra overrides of every throughput run (one string)")
    g = ap.add_argument_group("big (one large model under one layout)")
    g.add_argument("--big-model", default=None, choices=models, metavar="PRESET",
                   help="model preset (default 8b; --device cpu: tiny)")
    g.add_argument("--big-layout", default="fsdp", choices=layouts, metavar="PRESET",
                   help="parallel preset of the big run on all --gpus (default fsdp)")
    g.add_argument("--big-micro", type=script_cli.int_at_least(1), default=1,
                   help="micro-batch per GPU of the big run (default 1)")
    g.add_argument("--big-backends", type=csv(TPUT_BACKENDS, "backend"), default=None,
                   help="default: the first of --tput-backends")
    g.add_argument("--big-precisions", type=csv(precisions, "precision preset"), default=None,
                   help="default: --precisions")
    g.add_argument("--big-overrides", type=script_cli.shell_words, default="",
                   help='e.g. "parallel.activation_checkpointing=full"')
    ap.add_argument("overrides", nargs="*", help="difflm-train overrides of the correctness and reshard runs (after "
                    "--; relative paths are relative to the current folder)")
    args = ap.parse_intermixed_args(argv)  # the overrides may come before, between or after the flags
    for flag in ("tp_layouts", "tput_variants"):
        for entry in getattr(args, flag):
            only, sep, rest = entry.partition("@")
            preset = (rest if sep else entry).split(":")[0]
            name = f"--{flag.replace('_', '-')}"
            if sep and only not in precisions:
                ap.error(f"{name} {entry}: {only!r} is not a precision preset (choose from {', '.join(precisions)})")
            if preset not in layouts:
                ap.error(f"{name} {entry}: {preset!r} is not a parallel preset (choose from {', '.join(layouts)})")
    cpu = args.device == "cpu"
    defaults = {"tput_model": "tiny" if cpu else "1.7b", "tput_seq": 64 if cpu else 4096,
                "big_model": "tiny" if cpu else "8b", "precisions": ["fp32"] if cpu else ["bf16", "fp8"]}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.layouts is None:
        args.layouts = LAYOUTS[args.gpus]
    if args.tput_backends is None:
        args.tput_backends = ["torch"] if cpu else ["te", "torch-compile"]
    if args.big_backends is None:
        args.big_backends = args.tput_backends[:1]
    return args


def check_devices(args: argparse.Namespace) -> None:
    """With ``--device cuda`` (and not ``--plan``): CUDA and at least ``--gpus`` GPUs. Raises DifflmError."""
    if args.device != "cuda" or args.plan:
        return
    script_cli.require_cuda(instead="--device cpu runs a gloo dry run, --plan prints the launches")
    import torch

    count = torch.cuda.device_count()
    if count < args.gpus:
        fits = max((n for n in LAYOUTS if n <= count), default=None)
        fix = f"pass --gpus {fits}" if fits else "run on a host with 2 or more (--device cpu runs a gloo dry run)"
        raise DifflmError(f"--gpus {args.gpus}: this host has {count} CUDA GPU{'s' if count != 1 else ''}; {fix}")


@script_cli.script_main
def main(argv=None) -> list[Row]:
    """Run (or with ``--plan`` list) the parts of the command line and print the table; the rows."""
    args = parse_args(argv)
    check_devices(args)
    runner = Runner(args.out, args.device, args.timeout, args.time_budget, plan=args.plan)
    return LayoutCheck(args, runner).run()


if __name__ == "__main__":
    sys.exit(1 if any(row.status in ("failed", "FAIL", "timeout") for row in main()) else 0)
