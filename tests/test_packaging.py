"""The package builds with the oldest setuptools pyproject.toml allows (a wheel, as
../shared/gpu/prepare.sh and pip build one)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib

import pytest

import finetune
from conftest import REPO

pytestmark = pytest.mark.slow  # a virtual environment and a wheel build


def test_wheel_builds_with_the_lowest_setuptools_named(tmp_path):
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    [requirement] = [r for r in build["requires"] if r.startswith("setuptools")]
    lowest = re.fullmatch(r"setuptools>=([0-9.]+)", requirement).group(1)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", f"setuptools=={lowest}.*"], check=True,
                   capture_output=True)
    # A copy of the source: a build in place would write build/ and egg-info into the tree.
    source = tmp_path / "source"
    shutil.copytree(REPO / "finetune", source / "finetune")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    result = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                             str(tmp_path / "dist"), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    # The version is written once, in finetune/__init__.py; pyproject.toml reads it.
    wheel = f"finetune-{finetune.__version__}-py3-none-any.whl"
    assert [p.name for p in (tmp_path / "dist").iterdir()] == [wheel]
