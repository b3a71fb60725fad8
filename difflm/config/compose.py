"""The ``train`` config composed outside ``difflm-train``'s Hydra app (scripts, converters), checked as the entry
points check their command lines, so a mistyped key says the same one line everywhere."""
from __future__ import annotations

from difflm.config import CONF_DIR
from difflm.config.schema import check_known_keys
from difflm.errors import DifflmError


def compose_train_config(overrides: list[str], device=None):
    """``conf/train.yaml`` composed with ``overrides`` (Hydra's ``compose``; inside a running Hydra app its own
    search path, difflm's ``conf/``, serves, and the app has checked its command line already).

    Raises: DifflmError, before composing, naming a mistyped key or preset with the closest one
    (:func:`difflm.cli.check_overrides`: ``model.hiden_size is not a config key; did you mean model.hidden_size?``);
    for any other Hydra or OmegaConf error, with Hydra's message on one line (:func:`hydra_message`); and for a key
    added with ``+`` that the schema lacks (:func:`difflm.config.schema.check_known_keys`).

    With ``device`` (a ``torch.device``), every kernel key left ``auto`` is chosen for it
    (:func:`difflm.model.auto_kernels.choose_kernels`), as ``difflm-train`` chooses before building its model; without
    it the config keeps ``auto`` (``--cfg job``, planning) and :func:`difflm.model.build_model` refuses to build it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from difflm.cli import check_overrides

    overrides = list(overrides)
    try:
        if GlobalHydra.instance().is_initialized():  # within @hydra.main (difflm-import), which checked its own line
            cfg = compose("train", overrides=overrides)
        else:
            cfg = check_overrides(overrides, "train")  # the composed line, or None: compose it here
            if cfg is not None:
                with open_dict(cfg):
                    del cfg["hydra"]  # what compose(..., return_hydra_config=False) returns
            else:
                with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                    cfg = compose("train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise DifflmError(hydra_message(e)) from None  # names the key or option at fault
    check_known_keys(cfg)
    if device is not None:
        from difflm.model.auto_kernels import choose_kernels

        choose_kernels(cfg, device)
    return cfg


def hydra_message(err: BaseException) -> str:
    """Hydra's multi-line message on one line: its first line, the first line of its cause, the rest, the
    available options comma-separated; without the search path, the grammar link and OmegaConf's key dump."""
    def lines(text: str) -> list[str]:
        out = []
        for raw in text.splitlines():
            line = raw.strip().rstrip(".")
            if line.startswith("Config search path"):
                break
            if not line or line.startswith(("See https://", "full_key:", "reference_type=", "object_type=")):
                continue
            if raw.startswith("\t") and out:  # one option of an "Available options in 'model':" list
                out[-1] += (" " if out[-1].endswith(":") else ", ") + line
            else:
                out.append(line)
        return out

    own, cause = lines(str(err)), lines(str(err.__cause__ or ""))
    return ". ".join(own[:1] + cause[:1] + own[1:]) or type(err).__name__



__all__ = ["compose_train_config", "hydra_message"]
