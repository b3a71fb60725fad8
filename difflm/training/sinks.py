"""Metrics sinks. The trainer builds one metrics dict per logged step and hands it to every sink;
sinks only format and write, they never compute."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from tqdm.auto import tqdm

from difflm import strict_json
from difflm.errors import DifflmError

WANDB_MISSING = ("logger=wandb needs the wandb package, which is not installed: pip install wandb"
                 ", or use logger=console (metrics.jsonl; difflm-plot draws it)")


class JsonlSink:
    """Appends one JSON object per logged step to ``<run.dir>/metrics.jsonl`` (flushed each line; after a last line
    that an earlier process left without its newline, on a line of its own), with the run's
    ``objective`` name in each record: a run resumed with another objective (AR-to-diffusion adaptation) changes
    what ``val_nelbo`` measures (the NELBO bound, or AR's exact NLL), and difflm-plot draws each objective's stretch
    as its own line."""

    def __init__(self, run_dir: Path, objective: Optional[str] = None):
        path = Path(run_dir) / "metrics.jsonl"
        torn = False
        if path.is_file() and path.stat().st_size:  # a line cut short (disk full, a kill mid-write) stays alone
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self.file = open(path, "a", encoding="utf-8")
        if torn:
            self.file.write("\n")
        self.objective = objective

    def log(self, metrics: dict[str, Any]) -> None:
        record = metrics if self.objective is None else {**metrics, "objective": self.objective}
        self.file.write(strict_json.dumps(record, flag=True) + "\n")  # NaN/inf: null, listed under "nonfinite"
        self.file.flush()

    def log_samples(self, step: int, samples: list[str]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        self.file.close()


def _fmt(metrics: dict[str, Any], keys=None) -> dict[str, str]:
    """The metrics of ``keys`` (default: the progress bar's) that are set, formatted for the console."""
    out = {}
    for key, fmt in keys or BAR_KEYS:
        if metrics.get(key) is not None:
            out[key.replace("moe/load_max_mean", "load")] = fmt.format(metrics[key])
    return out


# what the progress bar's postfix shows
BAR_KEYS = (("loss", "{:.4f}"), ("val_nelbo", "{:.4f}"), ("lr", "{:.2e}"), ("tokens_per_s", "{:,.0f}"),
            ("mfu", "{:.1%}"), ("mem_gib", "{:.1f}"), ("moe/load_max_mean", "{:.2f}"),
            ("reward_mean", "{:.3f}"), ("kl", "{:.4f}"), ("margin", "{:.3f}"))  # the last three: difflm-rl
# the plain line without a bar: the bar's fields plus the ones a scrolling log is read for (the gradient norm,
# skipped steps, data epochs), as metrics.jsonl holds them
LINE_KEYS = (("loss", "{:.4f}"), ("grad_norm", "{:.3f}"), ("lr", "{:.2e}"), ("tokens_per_s", "{:,.0f}"),
             ("mfu", "{:.1%}"), ("mem_gib", "{:.1f}"), ("moe/load_max_mean", "{:.2f}"), ("data_epochs", "{:.3f}"),
             ("val_nelbo", "{:.4f}"), ("val_ppl_bound", "{:.2f}"),
             # difflm-rl (docs/post_training.md)
             ("reward_mean", "{:.3f}"), ("reward_std", "{:.3f}"), ("kl", "{:.4f}"), ("clip_fraction", "{:.3f}"),
             ("completion_len", "{:.1f}"), ("rollout_tokens_per_s", "{:,.0f}"), ("forwards_per_token", "{:.2f}"),
             ("margin", "{:.3f}"), ("accuracy", "{:.2f}"), ("eval_reward", "{:.3f}"), ("eval_elbo_margin", "{:.3f}"))


class ConsoleSink:
    """The console: with ``logger.progress_bar=true`` a tqdm bar with loss, tokens/s, MFU and memory plus a line per
    eval; with ``progress_bar=false`` (logs of batch jobs, where a bar is one ever-rewritten line) a plain line per
    logged step (every ``logger.log_every`` steps: step, loss, grad norm, lr, tokens/s, MFU, memory, epochs, and the
    validation NELBO at eval steps). Samples are printed in both modes."""

    def __init__(self, max_steps: int, start_step: int, progress_bar: bool):
        self.max_steps, self.progress_bar = max_steps, progress_bar
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True,
                        disable=not progress_bar)

    def log(self, metrics: dict[str, Any]) -> None:
        """Show one metrics dict: update the bar (and a line at an eval step), or print the plain line."""
        if not self.progress_bar:
            fields = _fmt(metrics, LINE_KEYS)
            skipped = metrics.get("skipped_steps")
            if skipped:  # 0 on a healthy run: only worth a field once a step was skipped
                fields["skipped_steps"] = str(skipped)
            self.bar.write(f"step {metrics['step']}/{self.max_steps}: "
                           + " ".join(f"{k}={v}" for k, v in fields.items()))
            return
        self.bar.n = metrics["step"]
        self.bar.set_postfix(_fmt(metrics), refresh=True)
        if "val_nelbo" in metrics:
            self.bar.write(f"step {metrics['step']}: " + " ".join(f"{k}={v}" for k, v in _fmt(metrics).items())
                           + f" val_ppl_bound={metrics['val_ppl_bound']:.2f}")

    def log_samples(self, step: int, samples: list[str]) -> None:
        for i, text in enumerate(samples):
            self.bar.write(f"--- sample {i} at step {step} ---\n{text}")

    def close(self, failed: bool = False) -> None:
        self.bar.close()


class WandbSink:
    """Weights & Biases run: what the dashboard shows, all from the trainer's metrics dicts.

    - config: the resolved run config (nested, as in ``config.yaml``);
    - history: every metrics dict (``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``tokens_per_s_per_gpu``,
      ``mfu``, ``mem_gib``, ``val_nelbo``, ``val_ppl_bound``, ...) against the trainer's ``step``, declared as
      the x-axis of every chart (``define_metric``), so the steps a resumed run logs again are kept, not
      dropped as out of order by W&B's own step counter;
    - summary: the last value of each metric, and (computed by W&B from the history) the lowest ``val_nelbo``
      and ``loss`` and the mean throughput ``tokens_per_s``/``tokens_per_s_per_gpu``/``mfu``;
    - samples: a table (columns ``step``, ``sample``) per sampling step.

    ``logger.mode=online`` falls back to ``offline`` (sync later with ``wandb sync``) when no API key is
    configured (``WANDB_API_KEY`` unset and no ``~/.netrc`` entry), with a note on the console. An offline run
    lives in ``<run.dir>/wandb/offline-run-*``; ``wandb leet inspect <that dir> --summary`` shows it without an
    account (W&B docs, "wandb leet").
    """

    SUMMARIES = {"val_nelbo": "min", "loss": "min", "tokens_per_s": "mean", "tokens_per_s_per_gpu": "mean",
                 "mfu": "mean"}

    def __init__(self, cfg, run_dir: Path, config_dict: dict, resume_id: Optional[str]):
        """Start (or resume, ``resume_id``) the W&B run in ``run_dir``.

        Raises:
            DifflmError: wandb is not installed, or the W&B server could not be reached in online mode.
        """
        try:
            import wandb
        except ImportError as err:
            raise DifflmError(WANDB_MISSING) from err

        mode = cfg.mode
        if mode == "online" and not _has_api_key():
            tqdm.write("logger.mode=online but no W&B API key is configured: logging offline "
                       "(run `wandb login`, then `wandb sync` the run dir's wandb/ folder)")
            mode = "offline"
        self.wandb = wandb
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=mode, dir=str(run_dir),
                                  config=config_dict, id=resume_id, resume="allow" if resume_id else None)
        except wandb.errors.CommError as err:
            # a server that cannot be reached (no network, firewall, timeout): one line with the offline way out
            # instead of wandb's traceback
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DifflmError(_unreachable(mode, first)) from err
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        for key, summary in self.SUMMARIES.items():
            self.run.define_metric(key, step_metric="step", summary=f"{summary},last")
        (run_dir / "wandb_id.txt").write_text(self.run.id)

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None})

    def log_samples(self, step: int, samples: list[str]) -> None:
        table = self.wandb.Table(columns=["step", "sample"], data=[[step, s] for s in samples])
        self.run.log({"step": step, "samples": table})

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run; ``failed`` (the run ended with an error: non-finite steps, a crash, a second Ctrl-C)
        records exit code 1, so the dashboard shows it failed rather than finished."""
        self.run.finish(exit_code=1 if failed else None)


WANDB_ID_REFUSED = ":;,#?/'"  # what W&B refuses in a run id (wandb.sdk.wandb_settings)


def saved_wandb_id(run_dir: Path, report=print) -> Optional[str]:
    """The id of the W&B run that a resumed run in ``run_dir`` logs into (``wandb_id.txt``, written by
    :class:`WandbSink`), None when there is none. An empty file (the process stopped while writing it) starts a new
    W&B run, said in one line through ``report``.

    Raises:
        DifflmError: the file holds an id W&B refuses (damaged or edited), naming the file and the fix."""
    path = Path(run_dir) / "wandb_id.txt"
    if not path.is_file():
        return None
    run_id = path.read_text(encoding="utf-8", errors="replace").strip()
    if not run_id:
        report(f"difflm: {path} is empty: this run starts a new W&B run")
        return None
    bad = "".join(sorted(set(run_id) & set(WANDB_ID_REFUSED)))
    if bad:
        raise DifflmError(f"{path} holds {run_id[:80]!r}, not a W&B run id (W&B refuses {bad}): put back the id "
                          "of the run's W&B run (the last part of its offline-run-* folder or its URL), or delete "
                          "the file to log into a new W&B run")
    return run_id


def wandb_sinks(lg, run_dir: Path, run_cfg, resume: bool = True, report=print) -> list:
    """``[WandbSink]`` for ``logger=wandb``, ``[]`` for another logger or ``logger.mode=disabled`` (which starts no
    W&B run and needs no wandb installed): what difflm-train and difflm-rl both log to W&B. ``run_cfg``: the run's
    DictConfig, logged resolved; ``resume``: log into the W&B run ``wandb_id.txt`` names, when there is one
    (:func:`saved_wandb_id`, which ``report`` tells of an empty file)."""
    if lg.name != "wandb" or lg.mode == "disabled":
        return []
    from omegaconf import OmegaConf

    resume_id = saved_wandb_id(run_dir, report=report) if resume else None
    return [WandbSink(lg, run_dir, OmegaConf.to_container(run_cfg, resolve=True), resume_id)]


def _netrc_has_wandb() -> bool:
    path = Path.home() / ".netrc"
    return path.exists() and "api.wandb.ai" in path.read_text(errors="ignore")


def _has_api_key() -> bool:
    return bool(os.environ.get("WANDB_API_KEY") or _netrc_has_wandb())


def _unreachable(mode: str, why: str) -> str:
    return (f"logger.mode={mode}: W&B could not reach its server ({why}): log offline with logger.mode=offline (or "
            "WANDB_MODE=offline) and `wandb sync` the run dir's wandb/ folder later, or use logger.mode=disabled")


def wandb_unreachable_reason(lg, timeout_s: float = 5.0) -> Optional[str]:
    """Why an online W&B run could not start, found in seconds before anything is built: the server
    (``WANDB_BASE_URL``, default https://api.wandb.ai) takes no TCP connection within ``timeout_s``. ``wandb.init``
    itself waits 90 s before it gives up, after the model and data are built. None when it can be reached, or when
    no server is needed: ``logger.mode`` offline or disabled, or no API key (the run then logs offline,
    :class:`WandbSink`)."""
    if lg.get("name") != "wandb" or lg.get("mode") != "online" or not _has_api_key():
        return None
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        return _unreachable("online", f"no connection to {url.hostname}:{port} in {timeout_s:g} s: "
                                      f"{type(err).__name__}: {err}".rstrip(": "))
    return None
