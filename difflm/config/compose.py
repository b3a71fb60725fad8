"""The ``train`` config composed outside ``difflm-train``'s Hydra app (scripts, converters), checked as the entry
points check their command lines, so a mistyped key says the same one line everywhere."""
from __future__ import annotations

from difflm.config.job_check import hydra_message, initialize_conf, search_path_of
from difflm.config.schema import check_known_keys
from difflm.errors import DifflmError


def compose_train_config(overrides: list[str], device=None, config_dir=None):
    """``conf/train.yaml`` composed with ``overrides`` (Hydra's ``compose``; inside a running Hydra app its own
    search path, difflm's ``conf/``, serves, and the app has checked its command line already). ``config_dir``: a
    folder of your own presets laid out like ``conf/`` (``--config-dir``), searched after difflm's.

    Raises: DifflmError, before composing, naming a mistyped key or preset with the closest one
    (:func:`difflm.cli.check_overrides`: ``model.hiden_size is not a config key; did you mean model.hidden_size?``);
    for a preset file that does not compose (:func:`difflm.config.job_check.preset_error`: a key of your own
    ``model/mine.yaml`` that the schema lacks); for any other Hydra or OmegaConf error, with Hydra's message on one
    line (:func:`difflm.config.job_check.hydra_message`); and for a key added with ``+`` that the schema lacks
    (:func:`difflm.config.schema.check_known_keys`).

    With ``device`` (a ``torch.device``), every kernel key left ``auto`` is chosen for it
    (:func:`difflm.model.auto_kernels.choose_kernels`), as ``difflm-train`` chooses before building its model; without
    it the config keeps ``auto`` (``--cfg job``, planning) and :func:`difflm.model.build_model` refuses to build it."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from difflm.cli import check_overrides
    from difflm.config.job_check import preset_error

    overrides = list(overrides)
    flags = ["--config-dir", str(config_dir)] if config_dir is not None else []
    try:
        if GlobalHydra.instance().is_initialized():  # within @hydra.main (difflm-import), which checked its own line
            cfg = compose("train", overrides=overrides)
        else:
            cfg = check_overrides(flags + overrides, "train")  # the composed line, or None: compose it here
            if cfg is not None:
                with open_dict(cfg):
                    del cfg["hydra"]  # what compose(..., return_hydra_config=False) returns
            else:
                with initialize_conf(search_path_of(config_dir, overrides) or ()):  # a bad hydra.searchpath: Hydra's
                    try:
                        cfg = compose("train", overrides=overrides)
                    except Exception as e:  # noqa: BLE001 - a broken preset file named in one line; else Hydra's
                        message = preset_error(e, "train", "difflm-train")
                        if message:
                            raise DifflmError(message) from None
                        raise
    except (HydraException, OmegaConfBaseException) as e:
        raise DifflmError(hydra_message(e)) from None  # names the key or option at fault
    check_known_keys(cfg)
    if device is not None:
        from difflm.model.auto_kernels import choose_kernels

        choose_kernels(cfg, device)
    return cfg


__all__ = ["compose_train_config", "hydra_message"]
