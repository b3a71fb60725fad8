"""The run's ``config.yaml``: written at every start, and on a resume with other settings the earlier one is kept.

Every checkpoint also carries the settings it was trained with (``checkpoints/step_<N>/config.yaml``,
:func:`difflm.checkpoint.store.checkpoint_config_path`), which is what ``step=N`` reads in difflm-eval,
difflm-generate and difflm-export, and what a resume compares against.

A resumed run may change settings on purpose (a lower ``optim.lr`` after a spike, more ``train.max_steps``, an
autoregressive checkpoint continued with ``objective=mdlm`` as in AR-to-diffusion adaptation), or by mistake (a
forgotten override, another experiment preset). The model's shape and the batch are checked by the checkpoint load;
everything else is allowed, so it is made visible instead: the resume names every changed key with its old and new
value, and the settings the earlier steps ran with stay next to the run as ``config.step_<N>.yaml`` (N: the step
resumed from) rather than being overwritten.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from difflm.data.indexed_dataset import write_text_atomic

SHOWN = 8  # changed keys named in the report line; the rest are counted


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def changed_settings(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs between two resolved configs (plain nested
    dicts); a key present on one side only has ``"<absent>"`` on the other. Sorted by key."""
    a, b = _flat(old), _flat(new)
    missing = "<absent>"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


def _keep(run_dir: Path, step: int, text: str) -> Path:
    """The file holding ``text`` among ``config.step_<step>[.<k>].yaml``, written under the first free name if none
    does."""
    k = 1
    while True:
        path = run_dir / (f"config.step_{step}.yaml" if k == 1 else f"config.step_{step}.{k}.yaml")
        if not path.exists():
            write_text_atomic(path, text)
            return path
        if path.read_text() == text:
            return path
        k += 1


def record_run_config(run_dir: Path, cfg: DictConfig, resumed_from: Optional[int] = None,
                      checkpoint: Optional[Path] = None, report: Callable[[str], None] = print) -> Optional[Path]:
    """Write ``cfg`` (resolved) as ``run_dir/config.yaml``. On a resume (``resumed_from``: the step, ``checkpoint``:
    its directory) whose settings differ from the ones that checkpoint was trained with (its own ``config.yaml``, or
    the run's for checkpoints that carry none), first report the changed keys in one line and keep those settings as
    ``config.step_<resumed_from>.yaml`` (``config.step_<N>.<k>.yaml`` when resumes from the same step found
    different ones; none is ever replaced). Returns the path of the kept file, or None."""
    from difflm.checkpoint.store import checkpoint_config_path

    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    text = OmegaConf.to_yaml(cfg, resolve=True)
    kept = None
    source = None if resumed_from is None else (checkpoint_config_path(run_dir, checkpoint) if checkpoint else path)
    if source is not None and source.exists():
        earlier = source.read_text()
        changes = changed_settings(OmegaConf.to_container(OmegaConf.create(earlier)) or {},
                                   OmegaConf.to_container(OmegaConf.create(text)) or {})
        if changes:
            kept = _keep(run_dir, resumed_from, earlier)
            shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes[:SHOWN])
            more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
            report(f"difflm: resuming at step {resumed_from} with changed settings: {shown}{more} (the settings "
                   f"step {resumed_from} was trained with are kept in {kept})")
    write_text_atomic(path, text)
    return kept
