"""The run's ``config.yaml``: written at every start, and on a resume with other settings the earlier one is kept.

Every checkpoint also carries the settings it was trained with (``checkpoints/step_<N>/config.yaml``,
:func:`difflm.checkpoint.store.checkpoint_config_path`), which is what ``step=N`` reads in difflm-eval,
difflm-generate and difflm-export, and what a resume compares against.

A resumed run may change settings on purpose (a lower ``optim.lr`` after a spike, more ``train.max_steps``, an
autoregressive checkpoint continued with ``objective=mdlm`` as in AR-to-diffusion adaptation), or by mistake (a
forgotten override, another experiment preset). The model's shape and the batch are checked by the checkpoint load;
everything else is allowed, so it is made visible instead: the resume names every changed key with its old and new
value, and the settings the earlier steps ran with stay next to the run as ``config.step_<N>.yaml`` (N: the step
resumed from) rather than being overwritten. One exception: another tokenizer than the checkpoint's is refused
(:func:`check_resume_tokenizer`), since its ids would silently mean other tokens in an embedding of the same shape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from difflm.config.schema import MODEL_KEYS, MOE_KEYS, override_value
from difflm.data.indexed_dataset import write_text_atomic
from difflm.errors import DifflmError
from difflm.hydra_folders import accept_records

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


# The settings that say what a step trains. A resume at the checkpoint's step that changes one of these asks for
# training that would not happen; the rest (paths, kernels and the micro-batch, auto or not, logging, the save and
# evaluation cadence, the run's length) say how or where, and differ on a finished run launched again elsewhere.
WHAT_TRAINS = ("lora.", "objective.", "optim.", "schedule.", "algorithm.", "estimator.", "reward.", "data.path",
               "data.hf_dataset", "data.hf_split", "data.prompt_field", "data.response_field", "data.messages_field",
               "data.chosen_field", "data.rejected_field", "data.answer_field", "data.prompt_template", "data.seq_len",
               "train.global_batch_size", *(f"model.{k}" for k in MODEL_KEYS), *(f"model.moe.{k}" for k in MOE_KEYS))
HOW_IT_TRAINS = ("optim.fused",)  # None: fused where the device supports it


def _trains(key: str) -> bool:
    return key not in HOW_IT_TRAINS and any(key == k or (k.endswith(".") and key.startswith(k)) for k in WHAT_TRAINS)


def _settings(path: Path) -> dict:
    """A saved ``config.yaml`` / ``rl_config.yaml`` as a plain nested dict (DifflmError naming a damaged one,
    :func:`difflm.checkpoint.store.read_settings`)."""
    from difflm.checkpoint.store import read_settings

    return OmegaConf.to_container(read_settings(path)) or {}


def _listed(items: list[str]) -> str:
    """The first :data:`SHOWN` of ``items``, comma-separated, then how many more."""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def check_steps_to_train(step: int, cfg: DictConfig, checkpoint: Path, earlier_path: Optional[Path]) -> None:
    """Refuse a resume from checkpoint ``checkpoint`` (at ``step``) that would train nothing while the command asks
    for something: ``train.max_steps`` below ``step``, or equal to it while a setting of :data:`WHAT_TRAINS` differs
    from ``earlier_path``'s (difflm-train: the settings the checkpoint was trained with; difflm-rl: its
    ``rl_config.yaml``, the settings of the last start). Steps count on from the checkpoint's, so adding LoRA, an
    objective or data to a finished run needs a longer run. A finished run launched again with what it trained
    unchanged (on another machine, from a copied folder, with other logging) passes and trains nothing.

    Raises: DifflmError naming the key that sets the run's length (``train.epochs`` where it does,
    else ``train.max_steps``), the checkpoint and the changed keys."""
    max_steps = int(cfg.train.max_steps)
    epochs = cfg.train.get("epochs")
    length = f"train.epochs={epochs} (train.max_steps={max_steps})" if epochs else f"train.max_steps={max_steps}"
    longer = ("raise train.epochs (steps count on from the checkpoint's)" if epochs else
              f"raise train.max_steps (steps count on from the checkpoint's: train.max_steps={step + 10} trains 10 "
              "more)")
    fix = f"{longer}, or read that step with difflm-eval / difflm-generate step={step}"
    if step > max_steps:
        raise DifflmError(f"{length} is below the step of the checkpoint this run resumes from ({checkpoint}): "
                          f"nothing would train; {fix}")
    if step < max_steps or earlier_path is None or not earlier_path.exists():
        return
    changed = [k for k, _, _ in changed_settings(_settings(earlier_path), OmegaConf.to_container(cfg, resolve=True))
               if _trains(k)]
    if changed:
        raise DifflmError(f"{length} is the step of the checkpoint this run resumes from ({checkpoint}), so nothing "
                          f"would train with the changed settings ({_listed(changed)}): {fix}")


def check_start_checkpoint(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """``train.require_checkpoint=true``: ``run_dir`` must hold a complete checkpoint to continue (an adaptation
    recipe starts from ``difflm-import``'s ``step_0``). Read from the files alone, before anything is built.

    Returns a warning for a LoRA run (``lora.rank > 0``) without a checkpoint to continue: its adapters would train
    on random base weights (the base comes from a checkpoint in ``run.dir``); None otherwise.
    Raises: DifflmError (one line) naming ``run.dir``, ``difflm-import`` and ``train.require_checkpoint=false``."""
    from difflm.checkpoint.store import latest_checkpoint

    if latest_checkpoint(run_dir, report=lambda _: None) is not None:  # the trainer reports damaged ones itself
        return None
    if not cfg.train.get("require_checkpoint", False):
        rank = int(cfg.get("lora", {}).get("rank", 0) or 0)
        if rank > 0:
            return (f"difflm: warning: lora.rank={rank} trains adapters on random base weights: run.dir={run_dir} "
                    f"holds no checkpoint to continue (difflm-import hf=<model> run.dir={run_dir} writes one; "
                    f"set train.require_checkpoint=true to refuse such a run)")
        return None
    raise DifflmError(f"train.require_checkpoint=true and run.dir={run_dir} holds no complete checkpoint to start "
                      f"from: import the AR model into it first (difflm-import hf=<model folder or hub id> "
                      f"run.dir={run_dir}, docs/adaptation.md), or set train.require_checkpoint=false to train "
                      f"from random weights")


def model_settings_hint(earlier_path: Optional[Path], cfg: DictConfig) -> Optional[str]:
    """For a checkpoint that does not load into this run's model: the keys of
    :data:`difflm.config.schema.MODEL_KEYS` (and ``MOE_KEYS`` for a mixture of experts) whose value in
    ``earlier_path`` (the settings the checkpoint was trained with, e.g. a ``difflm-import`` run's) differs from
    ``cfg``'s, as the overrides to pass, or None when none differs or there is no such file."""
    if earlier_path is None or not earlier_path.exists():
        return None
    earlier = _settings(earlier_path).get("model") or {}
    here = OmegaConf.to_container(cfg.model, resolve=True)
    pairs = [(f"model.{k}", earlier.get(k), here.get(k)) for k in MODEL_KEYS if k in earlier]
    moe_then, moe_now = earlier.get("moe") or {}, here.get("moe") or {}
    if moe_then.get("num_experts"):
        pairs += [(f"model.moe.{k}", moe_then.get(k), moe_now.get(k)) for k in MOE_KEYS if k in moe_then]
    wanted = [f"{key}={override_value(then)}" for key, then, now in pairs if then != now]
    if not wanted:
        return None
    imported = earlier.get("name") == "imported"
    return (f"it was trained with other model settings ({earlier_path}): pass {' '.join(wanted)}"
            + (" (the model.* overrides difflm-import printed)" if imported else ""))


def _keep(run_dir: Path, step: int, text: str, stem: str = "config") -> Path:
    """The file holding ``text`` among ``<stem>.step_<step>[.<k>].yaml``, written under the first free name if none
    does."""
    k = 1
    while True:
        path = run_dir / (f"{stem}.step_{step}.yaml" if k == 1 else f"{stem}.step_{step}.{k}.yaml")
        if not path.exists():
            write_text_atomic(path, text)
            return path
        if path.read_text() == text:
            return path
        k += 1


def _record(run_dir: Path, stem: str, text: str, earlier_path: Optional[Path], resumed_from: Optional[int],
            kept_as: str, report: Callable[[str], None]) -> Optional[Path]:
    """Write ``text`` as ``run_dir/<stem>.yaml``; on a resume (``resumed_from``: the step) whose settings differ from
    ``earlier_path``'s, first report the changed keys in one line and keep the earlier text as
    ``<stem>.step_<resumed_from>[.<k>].yaml`` (:func:`_keep`), the report calling it ``kept_as``. Returns the path of
    the kept file, or None."""
    kept = None
    if resumed_from is not None and earlier_path is not None and earlier_path.exists():
        earlier = earlier_path.read_text()
        changes = changed_settings(_settings(earlier_path), OmegaConf.to_container(OmegaConf.create(text)) or {})
        if changes:
            kept = _keep(run_dir, resumed_from, earlier, stem=stem)
            shown = _listed([f"{k}: {old!r} -> {new!r}" for k, old, new in changes])
            report(f"difflm: resuming at step {resumed_from} with changed settings: {shown} ({kept_as} are "
                   f"kept in {kept})")
    write_text_atomic(run_dir / f"{stem}.yaml", text)
    accept_records(run_dir)  # the run took these settings: Hydra's .hydra/ of this invocation describes it now
    return kept


def record_run_config(run_dir: Path, cfg: DictConfig, resumed_from: Optional[int] = None,
                      checkpoint: Optional[Path] = None, report: Callable[[str], None] = print) -> Optional[Path]:
    """Write ``cfg`` (resolved) as ``run_dir/config.yaml``. On a resume (``resumed_from``: the step, ``checkpoint``:
    its directory) whose settings differ from the ones that checkpoint was trained with (its own ``config.yaml``, or
    the run's for checkpoints that carry none), first report the changed keys in one line and keep those settings as
    ``config.step_<resumed_from>.yaml`` (``config.step_<N>.<k>.yaml`` when resumes from the same step found
    different ones; none is ever replaced). Returns the path of the kept file, or None."""
    from difflm.checkpoint.store import checkpoint_config_path

    run_dir = Path(run_dir)
    source = checkpoint_config_path(run_dir, checkpoint) if checkpoint else run_dir / "config.yaml"
    return _record(run_dir, "config", OmegaConf.to_yaml(cfg, resolve=True), source, resumed_from,
                   f"the settings step {resumed_from} was trained with", report)


def record_rl_config(run_dir: Path, cfg: DictConfig, resumed_from: Optional[int] = None,
                     report: Callable[[str], None] = print) -> Optional[Path]:
    """Write a difflm-rl command line ``cfg`` as ``run_dir/rl_config.yaml``, as :func:`record_run_config` writes
    difflm-train's: on a resume (``resumed_from``: the step) with other settings than the earlier ``rl_config.yaml``,
    report the changed keys in one line and keep the earlier file as ``rl_config.step_<resumed_from>.yaml``. Returns
    the path of the kept file, or None."""
    run_dir = Path(run_dir)
    return _record(run_dir, "rl_config", OmegaConf.to_yaml(cfg, resolve=True), run_dir / "rl_config.yaml",
                   resumed_from, "the settings of the steps before", report)


def check_resume_tokenizer(run_dir: Path, name: str, tok, vocab_multiple: int) -> None:
    """Refuse a resume whose ``data.tokenizer`` (``name``, loaded as ``tok``: a
    :class:`difflm.data.tokenizer.TokenizerInfo`) is another tokenizer than the newest checkpoint of ``run_dir`` was
    trained with (e.g. the default one where a
    ``difflm-import`` run needs ``data.tokenizer=<run.dir>/tokenizer``). The same tokenizer under another path (a
    copied or moved run) passes: definitions are compared (:attr:`difflm.data.tokenizer.TokenizerInfo.fingerprint`).
    A checkpoint whose tokenizer cannot be read any more is not judged.

    Raises: DifflmError naming both tokenizers and the override that restores the checkpoint's."""
    from difflm.checkpoint.store import checkpoint_config_path, latest_checkpoint, read_settings
    from difflm.data.tokenizer import build_tokenizer

    found = latest_checkpoint(Path(run_dir), report=lambda _: None)
    source = None if found is None else checkpoint_config_path(Path(run_dir), found[1])
    if source is None or not source.is_file():
        return
    old = OmegaConf.select(read_settings(source), "data.tokenizer", default=None)
    if not old or old == name:
        return
    try:
        before = build_tokenizer(old, vocab_multiple)
    except Exception:  # noqa: BLE001 - gone or unreadable: the resume report still names the change
        return
    if (before.mask_id, before.fingerprint) != (tok.mask_id, tok.fingerprint):
        raise DifflmError(f"data.tokenizer={name} is another tokenizer than {found[1]} was trained with "
                          f"({old}): its ids would mean other tokens; pass data.tokenizer={old}")
