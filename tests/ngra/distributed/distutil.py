"""Run a function on K real worker processes joined by a gloo process group, for tests: a thin
wrapper of :func:`ngra.distributed.launch.spawn` (forks of a server that imported torch and ngra
once, as tests/conftest.py sets it; one torch thread each; a FileStore in a temporary folder;
every worker killed and the test failed after ``timeout`` seconds, so a test never hangs CI)
whose failures are test failures (:class:`WorkerError`).
"""

from __future__ import annotations

from ngra.distributed.launch import SpawnError, spawn


class WorkerError(AssertionError):
    """A worker raised, died or hung."""


def run(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
        expect_errors: bool = False, may_die: tuple = ()) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each on its own process (see
    :func:`ngra.distributed.launch.spawn` for ``expect_errors`` and ``may_die``)."""
    try:
        return spawn(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout,
                     expect_errors=expect_errors, may_die=may_die)
    except SpawnError as e:
        raise WorkerError(str(e)) from None
