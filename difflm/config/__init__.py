"""Run configuration: the typed schema, the Hydra config tree and the cross-key checks."""
from pathlib import Path

from omegaconf import OmegaConf

from difflm.config.schema import RunConfig, register_schema

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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
