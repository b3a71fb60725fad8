"""The one thing pyproject.toml cannot say beside a package search: the Hydra config tree lives in ``conf/`` at
the top of the repository (beside ``difflm/``, ``scripts/``, ``tests/``), and a wheel ships it as the data-only
package ``difflm.conf`` (``site-packages/difflm/conf/``), where :data:`difflm.config.CONF_DIR` finds it."""
from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["difflm", "difflm.*"]), "difflm.conf"],
      package_dir={"difflm.conf": "conf"})
