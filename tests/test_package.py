"""Packaging smoke tests: the three import packages are installed from this checkout, and the
dependency direction (kernels and partition never import ngra) holds."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", ["ngra", "kernels", "partition"])
def test_package_comes_from_this_checkout(name):
    # PyPI has unrelated packages called `kernels` and `partition`; make sure ours is the one found.
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == REPO_ROOT / name


def test_installed_version_matches_source():
    import ngra

    # A mismatch means the environment holds a stale install: rerun `make env`.
    assert importlib.metadata.version("ngra") == ngra.__version__


@pytest.mark.parametrize("name", ["kernels", "partition"])
def test_low_level_packages_do_not_import_ngra(name, tmp_path):
    # A fresh interpreter outside the checkout: the import must work from the installed package,
    # and whatever it pulls in transitively must not include ngra.
    code = (f"import sys, {name}\n"
            "bad = sorted(m for m in sys.modules if m == 'ngra' or m.startswith('ngra.'))\n"
            f"print('{name} imported ' + ', '.join(bad) if bad else 'ok')\n")
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_numba_cuda_simulator_is_on_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: numba.cuda runs on it, not in the simulator")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM was set to something else before the tests started")
    from numba import config

    # Fails if numba was imported before tests/conftest.py could set the switch.
    assert config.ENABLE_CUDASIM
