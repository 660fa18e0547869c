"""Suite-wide test setup: CUDA simulator switch, shared datasets, the ``dgl`` marker, seeds."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

# Before torch starts its OpenMP runtime: idle OpenMP threads must not spin on the cores that
# numba's threads need (see kernels/__init__.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# numba reads NUMBA_ENABLE_CUDASIM once, at its first import, so this must run before any test
# module imports numba: without a GPU, numba.cuda kernels then run in the CUDA simulator.
if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Without it, the first `import dgl` writes a backend choice into ~/.dgl/config.json.
os.environ.setdefault("DGLBACKEND", "pytorch")

REPO_ROOT = Path(__file__).resolve().parent.parent

# Multi-worker tests start their workers by forking a server that imported torch and ngra once,
# instead of a fresh interpreter that imports them again (3-4 s of CPU a worker; the files of
# multi-worker tests took 421 s instead of 813 on a 2-core machine). NGRA_TEST_START_METHOD=spawn
# runs them the way users' scripts and the benchmarks start them.
from ngra.distributed.launch import set_spawn_start_method  # noqa: E402

set_spawn_start_method(os.environ.get("NGRA_TEST_START_METHOD", "forkserver"),
                       preload=["torch", "torch.distributed", "ngra", "kernels"])


def shared_datasets_dir() -> Path:
    """Where the shared real datasets live: ``$NGRA_DATA_DIR``, else ``<repo>/../shared/datasets``."""
    override = os.environ.get("NGRA_DATA_DIR")
    return Path(override) if override else REPO_ROOT.parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """The shared datasets folder; the test is skipped, saying where it looked, when it is absent."""
    path = shared_datasets_dir()
    if not path.is_dir():
        pytest.skip(f"shared datasets not found at {path}; put shared/ next to the repository "
                    "or set NGRA_DATA_DIR to the datasets folder")
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed numpy Generator; also seeds torch, numpy's global RNG and `random` with 0."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    return np.random.default_rng(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # find_spec, not import: importing dgl takes seconds and fails loudly in a broken env, which
    # the DGL environment's run should report as an error rather than as a skip.
    if importlib.util.find_spec("dgl") is not None:
        return
    skip = pytest.mark.skip(reason="dgl is not installed here; DGL tests run in .venv-dgl "
                                   "(`make test-dgl`)")
    for item in items:
        if item.get_closest_marker("dgl") is not None:
            item.add_marker(skip)


# The `slow` marker keeps a test out of the torch-2.2 floor session of `make test`; a test that is
# not marked and takes longer than this is named at the end of the run, so that the floor session
# stays shorter than the main one it runs beside (CI has 90 minutes; tests/README.md has the
# times). A kernel test's first call compiles numba kernels (cached in __pycache__ afterwards),
# so on a fresh clone some kernel tests show here once: mark what is slow with a warm cache.
SLOW_UNMARKED_S = 8.0
_slow_unmarked: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "slow" not in report.keywords \
            and report.duration > SLOW_UNMARKED_S:
        _slow_unmarked.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    if _slow_unmarked:
        terminalreporter.section(f"tests not marked slow that took over {SLOW_UNMARKED_S:g} s")
        for duration, nodeid in sorted(_slow_unmarked, reverse=True):
            terminalreporter.write_line(f"{duration:7.1f} s  {nodeid}")
        terminalreporter.write_line("mark such a test @pytest.mark.slow or make it faster, unless "
                                    "it was slow only for compiling numba kernels (a first run on "
                                    "a fresh clone, whose __pycache__ is empty)")
