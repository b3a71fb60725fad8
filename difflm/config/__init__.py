"""Run configuration: the typed schema, the Hydra config tree and the cross-key checks."""
from pathlib import Path

from omegaconf import OmegaConf

from difflm.config.schema import RunConfig, register_schema

_PACKAGE = Path(__file__).resolve().parent.parent
ASSETS = _PACKAGE / "assets"


def _conf_dir() -> Path:
    """The Hydra config tree: ``conf/`` beside the package in a source checkout (plain or editable), else
    the copy a wheel ships as ``difflm/conf`` (pyproject.toml maps ``conf/`` to the package ``difflm.conf``)."""
    checkout = _PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "conf" / "train.yaml").is_file():
        return checkout / "conf"
    return _PACKAGE / "conf"


CONF_DIR = _conf_dir()


def asset_path(relative: str) -> str:
    """Absolute path of a file shipped in ``difflm/assets`` (the ``${difflm_asset:...}`` resolver)."""
    return str(ASSETS / relative)


if not OmegaConf.has_resolver("difflm_asset"):
    OmegaConf.register_new_resolver("difflm_asset", asset_path)
if not OmegaConf.has_resolver("difflm_run_id"):  # the unique suffix of default run dirs
    from difflm.training.run_dir import run_id

    OmegaConf.register_new_resolver("difflm_run_id", run_id)
register_schema()

__all__ = ["ASSETS", "CONF_DIR", "RunConfig", "asset_path"]
