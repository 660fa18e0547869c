"""Run a function on K real worker processes joined by a gloo process group, for tests.

Each worker is a fresh interpreter (multiprocessing "spawn"), with one torch thread, joined
through a FileStore in a temporary folder (no port to pick, so no port clash between tests), on
the loopback interface. The parent waits at most ``timeout`` seconds: a worker that hangs or
dies fails the test with its rank and its traceback or exit status, and every worker is killed,
so a test never hangs CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path


def _worker(fn, rank: int, world_size: int, folder: str, args: tuple, pg_timeout: float,
            dump_after: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import datetime
    import faulthandler

    # A worker still running just before the parent kills it prints where it is stuck.
    faulthandler.dump_traceback_later(dump_after, exit=False)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(folder) / f"result.{rank}"
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        payload = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    tmp = out.with_name(f"{out.name}.tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(out)
    # Exit at once, without tearing the process group down: that waits for peers (torch 2.2's
    # gloo destructor hangs when a peer has already gone), and a test of a dead peer must not.
    os._exit(0)


class WorkerError(AssertionError):
    """A worker raised, died or hung."""


def run(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
        expect_errors: bool = False, may_die: tuple = ()) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each on its own process.

    With ``expect_errors``, a worker that raised gives its traceback (a str) in its slot instead
    of failing the call. Ranks in ``may_die`` may exit without reporting (their slot is None);
    any other worker dying, and any worker hanging, fails.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ngra-dist-") as folder:
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, folder, args, pg_timeout,
                                                   max(1.0, timeout - 5.0)),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise WorkerError(f"worker(s) {hung} of {world_size} did not finish within "
                              f"{timeout:g} s (killed)")
        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(folder) / f"result.{r}"
            if not path.exists():
                if r not in may_die:
                    errors.append(f"worker {r} died with exit status {p.exitcode} before reporting")
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error" and not expect_errors:
                errors.append(f"worker {r} raised:\n{value}")
            results.append(value)
        if errors:
            raise WorkerError("\n".join(errors))
        return results
