"""The config tree (top-level ``conf/``) is found from a source checkout and from a plain, non-editable install
of a built wheel run in an unrelated folder; users add their own config groups with ``--config-dir`` or
``hydra.searchpath``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException as HydraCompositionError

import difflm.config

from conftest import REPO, compose_run

# A user's own model preset: a new option of the `model` group, typed by the same schema.
USER_MODEL = """\
name: mine
num_layers: 3
hidden_size: 96
num_heads: 4
num_kv_heads: 4
ffn_hidden_size: 256
"""


def _user_conf(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model" / "mine.yaml").write_text(USER_MODEL)
    return root


def _env_without_checkout() -> dict:
    # no PYTHONPATH (it would import this checkout) and no repo-relative anything
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HYDRA_FULL_ERROR": "0"}


def _see_packages_of_this_interpreter(site_packages: Path) -> None:
    """Let a new venv import this interpreter's torch, hydra, ... : a ``.pth`` naming its site-packages directories.

    ``venv --system-site-packages`` would not do it when this interpreter is itself a venv (the usual ``make test``):
    it exposes the base Python's packages, not the venv's. A ``.pth`` line only adds a directory to ``sys.path``, after
    the new venv's own site-packages, and runs none of the ``.pth`` files in it, so this checkout's editable install
    stays out and the wheel installed in the new venv is the ``difflm`` that imports."""
    dirs = [p for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    assert dirs, f"no site-packages directory on this interpreter's sys.path: {sys.path}"
    (site_packages / "_this_interpreter.pth").write_text("\n".join(dirs) + "\n")


def test_conf_dir_is_the_top_level_tree_in_a_checkout():
    assert difflm.config.CONF_DIR == REPO / "conf"
    assert (REPO / "conf" / "train.yaml").is_file() and not (REPO / "difflm" / "conf").exists()


@pytest.mark.slow  # builds a wheel and starts 3 processes: about 40 s
def test_wheel_installed_outside_the_repo_finds_its_configs(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "outputs", "multirun", "wandb", ".pytest_cache"))
    env = _env_without_checkout()
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(wheels), str(src)], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("difflm-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    _see_packages_of_this_interpreter(site_packages)
    # --force-reinstall: the editable install of this checkout has the same name and version
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", "--force-reinstall", str(wheel)], env=env, capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = subprocess.run([str(python), "-c", "import difflm.config as c; print(c.CONF_DIR)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site_packages / "difflm" / "conf"), where.stderr

    out = subprocess.run([str(venv / "bin" / "difflm-train"), "--cfg", "job", "model=1.7b"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "num_layers: 28" in out.stdout and "hidden_size: 2048" in out.stdout

    user = _user_conf(tmp_path / "my_conf")
    out = subprocess.run([str(venv / "bin" / "difflm-train"), "--cfg", "job", "--config-dir", str(user), "model=mine",
                          "experiment=mdlm_owt"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "name: mine" in out.stdout and "hidden_size: 96" in out.stdout and "seq_len: 1024" in out.stdout


def test_user_group_composes_through_searchpath(tmp_path):
    # in-process (the CLI's --config-dir is exercised by the wheel test above)
    user = _user_conf(tmp_path / "my_conf")
    cfg = compose_run([f"hydra.searchpath=[file://{user}]", "model=mine"])
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.hidden_size) == ("mine", 3, 96)
    assert cfg.model.qk_norm is True  # unset keys keep the schema's defaults
    (user / "model" / "typo.yaml").write_text("name: typo\nnum_layer: 3\n")  # the schema still types user groups
    with pytest.raises(HydraCompositionError, match="num_layer"):
        compose_run([f"hydra.searchpath=[file://{user}]", "model=typo"])
