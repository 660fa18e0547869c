"""Starting workers: under ``torchrun`` (or any launcher that sets ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``), or from ``ngra train --workers K``, which starts K local
workers through torch's own elastic launcher (``torch.distributed.launcher``), the machinery
behind ``torchrun``, with its restarts.
"""

from __future__ import annotations

import datetime
import os
import sys
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["WorkerInfo", "worker_info", "init_from_env", "wait_for_peers", "launch", "spawn",
           "set_spawn_start_method", "SpawnError", "local_record"]


@dataclass(frozen=True)
class WorkerInfo:
    """Where this process stands: ``rank`` of ``world_size`` workers (``local_rank`` on its
    host), and how many times the launcher restarted the group (``restart_count``)."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def worker_info() -> WorkerInfo:
    """This process's place in a launched group, from the launcher's environment (one worker
    when none is set)."""
    def env_int(name, default):
        value = os.environ.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} must be an integer (set by "
                             "torchrun; unset it to run one worker)") from None

    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} from the environment are "
                         "inconsistent: expected 0 <= RANK < WORLD_SIZE")
    return WorkerInfo(rank, world, env_int("LOCAL_RANK", rank),
                      env_int("TORCHELASTIC_RESTART_COUNT", 0))


def init_from_env(device: torch.device | str = "cpu", *, timeout: float = 300.0) -> WorkerInfo:
    """Join the launched group (gloo on the CPU, NCCL on CUDA), unless already joined."""
    info = worker_info()
    if info.distributed and not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        limit = datetime.timedelta(seconds=timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The launcher's store outlives a restart of the workers. torch 2.13's env://
            # setup uses it without a per-attempt prefix, so a restarted worker could read the
            # address a dead worker of the previous attempt published and fail to connect
            # ("Connection refused", seen in the restart test); keys go under the attempt.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  info.world_size, is_master=False, timeout=limit)
            store = dist.PrefixStore(f"/ngra/attempt_{info.restart_count}", store)
            _join(backend, store=store, rank=info.rank, world_size=info.world_size,
                  timeout=limit)
        else:
            _join(backend, timeout=limit)
    return info


def _join(backend: str, **kwargs) -> None:
    """``dist.init_process_group(backend, **kwargs)``, and on gloo a barrier: every worker is
    connected before any goes on. gloo's full-mesh connect can finish on one worker before a
    peer has finished its own, and a worker that then failed at once and exited made that
    peer's ``init_process_group`` fail ("Connection closed by peer", seen in CI on a test where
    every worker raises the same error)."""
    dist.init_process_group(backend, **kwargs)
    if backend == "gloo":
        dist.barrier()


def wait_for_peers(*, timeout: float = 300.0) -> None:
    """The end of a worker's run: wait until every worker of the default group is here, so none
    leaves while a peer still moves data to it (a peer that does not come within ``timeout``
    seconds is a RuntimeError naming it, on gloo). Then end the process with
    ``os._exit(status)`` after flushing what it printed, as ``ngra train`` does.

    Why not ``destroy_process_group()`` and a normal exit: with torch 2.2's gloo backend, tearing
    a group down races with its worker threads, which free the last collective's tensors under
    the group's lock and need the GIL for it, while the thread tearing the group down holds the
    GIL and waits for that lock (a deadlock, seen in this project's tests), and a group left
    alive at interpreter exit can abort the process ("terminate called without an active
    exception", SIGABRT, seen in CI)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.barrier()


def launch(argv: list[str], nproc: int, *, max_restarts: int = 0,
           module: str = "ngra") -> dict:
    """Run ``python -m <module> <argv>`` on ``nproc`` local workers with torch's elastic
    launcher (rendezvous on a free local port; a failed worker restarts the whole group up to
    ``max_restarts`` times, as ``torchrun --max-restarts`` does). Returns the launcher's result
    per local rank; raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``
    naming the failed rank when the workers fail for good."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1 (got {nproc!r})")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"ngra-{uuid.uuid4().hex[:12]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.5)
    return elastic_launch(config, sys.executable)("-m", module, *argv)


class SpawnError(RuntimeError):
    """A worker of :func:`spawn` raised, died or hung."""


_START = {"method": "spawn", "preload": ()}


def set_spawn_start_method(method: str, preload=()) -> None:
    """How :func:`spawn` starts its workers from now on, in this process.

    ``"spawn"`` (the default): a fresh interpreter each, which imports torch again (3-4 s of CPU
    a worker). ``"forkserver"``: workers fork from a server process that imported the modules
    in ``preload`` once (``multiprocessing``'s forkserver, started at the first call), which
    saves those imports on every call after the first; the test suite uses it. Two differences
    to know: the server keeps the environment of its start, so a worker gets the caller's
    ``os.environ`` copied in when it starts (enough for what is read at call time, not for
    what a preloaded module read at its import), and what a worker prints goes to a file that
    :func:`spawn` copies to the caller's stderr when the workers end (a forked worker cannot
    reach the caller's current output). Forked workers share the server's memory pages, so
    their RSS is not a fresh interpreter's: benchmarks that report it keep ``"spawn"``.
    """
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start method must be 'spawn' or 'forkserver' (got {method!r})")
    if isinstance(preload, str):
        raise TypeError(f"preload must be a list of module names (got the string {preload!r}; "
                        f"write [{preload!r}])")
    _START["method"], _START["preload"] = method, tuple(preload)


def spawn(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
          expect_errors: bool = False, may_die: tuple = (), threads: int = 1) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each on a fresh local process joined to
    the others by a gloo process group, for tests and benchmarks.

    Each worker is a new interpreter (multiprocessing "spawn", or a fork of a preloaded server:
    see :func:`set_spawn_start_method`) with ``threads`` torch threads, joined through a
    FileStore in a temporary folder (no port to pick, so none to clash) on the loopback
    interface, and a barrier after the group is made, so ``fn`` starts only once every worker
    is connected; ``fn`` must be importable (a module-level function) and its result picklable.
    Results come back as pickle files (a queue would pass tensors by file descriptors that die
    with the worker). The call waits at most ``timeout`` seconds: a worker that hangs or dies
    raises :class:`SpawnError` with its rank and its traceback or exit status, after every
    worker is killed, so nothing hangs. A worker still running shortly before the limit prints
    where it is stuck (faulthandler).

    ``expect_errors``: a worker that raised gives its traceback (a str) in its slot instead of
    failing the call. Ranks in ``may_die`` may exit without reporting (their slot is None).
    """
    import multiprocessing as mp
    import pickle
    import tempfile
    import time
    from pathlib import Path

    method = _START["method"]
    ctx = mp.get_context(method)
    forked = method == "forkserver"
    if forked:
        ctx.set_forkserver_preload(list(_START["preload"]))
    env = dict(os.environ) if forked else None
    with tempfile.TemporaryDirectory(prefix="ngra-spawn-") as folder:
        procs = [ctx.Process(target=_spawned, args=(fn, r, world_size, folder, args, pg_timeout,
                                                    max(1.0, timeout - 5.0), threads, env),
                             daemon=True) for r in range(world_size)]
        try:
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
        finally:
            if forked:
                _relay_output(folder, world_size)
        if hung:
            raise SpawnError(f"worker(s) {hung} of {world_size} did not finish within "
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
            raise SpawnError("\n".join(errors))
        return results


def _relay_output(folder: str, world_size: int) -> None:
    """What forked workers printed (their stdout and stderr went to ``output.<rank>``), on the
    caller's stderr, one block per worker that printed anything."""
    from pathlib import Path

    for r in range(world_size):
        path = Path(folder) / f"output.{r}"
        text = path.read_text(errors="replace") if path.exists() else ""
        if text:
            sys.stderr.write(f"--- output of worker {r} of {world_size} ---\n{text}")
            if not text.endswith("\n"):
                sys.stderr.write("\n")
    sys.stderr.flush()


def _spawned(fn, rank: int, world_size: int, folder: str, args: tuple, pg_timeout: float,
             dump_after: float, threads: int, env: dict | None = None) -> None:
    import faulthandler
    import pickle
    import traceback
    from pathlib import Path

    if env is not None:
        # A fork of the server: the caller's environment, and output to a file the caller
        # relays (the server's stdout and stderr are whatever the caller's were at its start).
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(os.path.join(folder, f"output.{rank}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    faulthandler.dump_traceback_later(dump_after, exit=False)
    torch.set_num_threads(threads)
    out = Path(folder) / f"result.{rank}"
    try:
        _join("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
              timeout=datetime.timedelta(seconds=pg_timeout))
        payload = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    tmp = out.with_name(f"{out.name}.tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(out)
    # Exit at once, without tearing the process group down (see wait_for_peers: torch 2.2's gloo
    # can hang or abort doing that, and a peer may already be gone).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local_record(data, dg):
    """The worker's rows of a dataset record (``graph``, ``x``, ``y``, split masks): its
    :class:`~ngra.distributed.DistGraph` ``dg`` and the vertex rows ``dg.global_ids``."""
    from types import SimpleNamespace

    ids = dg.global_ids
    fields = {"graph": dg, "name": getattr(data, "name", "dataset")}
    for attr in ("x", "y", "train_mask", "val_mask", "test_mask"):
        value = getattr(data, attr, None)
        fields[attr] = None if value is None else value[ids.to(value.device)]
    return SimpleNamespace(**fields)
