"""Run configuration: the typed schema, the Hydra config tree and the cross-key checks."""
import functools
import secrets
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
@functools.lru_cache(maxsize=None)
def run_id() -> str:
    """A short random id, the same for the whole process (the ``${difflm_run_id:}`` resolver).

    The default ``run.dir`` is ``outputs/<date>_<time>-<run_id>``: two jobs started in the same second get
    different directories (``${now:}`` alone resolves to the second).
    """
    return secrets.token_hex(3)


if not OmegaConf.has_resolver("difflm_run_id"):  # the unique suffix of default run dirs
    OmegaConf.register_new_resolver("difflm_run_id", run_id)
register_schema()

__all__ = ["ASSETS", "CONF_DIR", "RunConfig", "asset_path", "run_id"]
