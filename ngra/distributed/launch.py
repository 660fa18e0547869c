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

__all__ = ["WorkerInfo", "worker_info", "init_from_env", "wait_for_peers", "launch", "local_record"]


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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return info


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
