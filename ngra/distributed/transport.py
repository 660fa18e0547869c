"""A memory-region transport over torch.distributed, after "RDMA-capable network for distributed
deep learning": a remote worker is seen as a device with a memory interface.

Every worker allocates the same named **regions** (a tensor ``[rows, *row_shape]`` of one dtype;
``rows`` may differ per worker, ``row_shape`` and dtype may not). Then:

- between **co-located** workers (same host), a region lives in shared memory (``/dev/shm``) and
  is mapped by every worker of the host, so :meth:`Transport.read` and :meth:`Transport.write`
  are true one-sided operations: the caller copies rows straight out of, or into, the peer's
  memory; the peer does nothing. :meth:`Transport.fence` (a barrier) orders them with the
  peers' own accesses, as an RDMA fence does.
- because a graph's exchange pattern is static, the bulk traffic goes through an
  :class:`ExchangePlan`, built once from "which rows of which peer this worker needs" (sizes and
  row ids exchanged once, receive buffers preallocated). Each :meth:`ExchangePlan.pull` then moves
  raw rows only: on shared memory one ``index_select`` from the peer's mapped region into the
  receive buffer; between hosts (or with ``shared_memory=False``) one gather into a preallocated
  send buffer, then the rows go straight into the receive buffer (gloo on CPU: point-to-point
  with each peer that has rows to move; NCCL on GPU: ``all_to_all_single``).
  No pickling, no per-message metadata. :meth:`ExchangePlan.push_add` is the reverse (halo
  gradients summed into their owners' rows). :meth:`ExchangePlan.pull_async` starts a pull and
  returns at once (a :class:`PendingPull`): on the gloo point-to-point path each peer's rows
  arrive in the background, and ``wait(peer)`` waits for one peer only, so a caller can compute
  on the rows it already has (the streaming engine's overlapped halo exchange).

A dead or hung peer raises :class:`TransportError` within ``timeout`` seconds instead of hanging;
bad use (mismatched layouts, rows out of range, a region read before anything was written to it)
raises :class:`TransportError` naming the region, the rank and the fix.

Setup steps (region layouts, host names, the shared-memory folder) use object collectives once;
nothing on the data path does.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import socket
import time
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["Transport", "Region", "ExchangePlan", "PendingPull", "TransportError",
           "pull_extended"]

_HEADER = 64  # bytes before a shared region's rows: int64 write count, then padding


class TransportError(RuntimeError):
    """A transport failure or misuse: a dead or hung peer, mismatched layouts, bad rows."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is still running (an exited, not yet reaped one is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # zombie or dead


class Region:
    """A named tensor ``[rows, *row_shape]`` owned by one worker, with a known layout on every
    worker. ``local`` is this worker's own rows (shared memory when co-located peers exist).

    Writes through :meth:`set` (or a peer's :meth:`Transport.write`) count as writes; a region
    nobody wrote to cannot be read. After writing to ``local`` directly, call
    :meth:`mark_written`.
    """

    def __init__(self, transport: "Transport", name: str, rows: list[int], row_shape: tuple,
                 dtype: torch.dtype, local: torch.Tensor, header: torch.Tensor | None,
                 peer_views: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self._transport = weakref.proxy(transport)
        self.name = name
        self.rows = rows  # rows of every rank's region
        self.row_shape = row_shape
        self.dtype = dtype
        self.local = local
        self._header = header  # int64 [8] in shared memory, or None
        self._written = 0  # without shared memory
        self._peers = peer_views  # rank -> (header, rows) of co-located peers' regions

    @property
    def shared(self) -> bool:
        """Whether this region lives in shared memory (one-sided access by co-located peers)."""
        return self._header is not None

    def set(self, values: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Write ``values`` into this worker's own rows (all of them, or ``rows``)."""
        if rows is None:
            self.local.copy_(values)
        else:
            self.local[self._transport._check_rows(self, self._transport.rank, rows)] = values
        self.mark_written()

    def mark_written(self) -> None:
        """Record that this worker's rows hold data (after writing to :attr:`local` directly)."""
        if self._header is not None:
            self._header[0] += 1
        else:
            self._written += 1

    def written(self, rank: int | None = None) -> bool:
        """Whether rank's copy of the region (default: this worker's) was ever written."""
        me = self._transport.rank
        if rank is None or rank == me:
            return bool(self._header[0] > 0) if self._header is not None else self._written > 0
        if rank not in self._peers:
            raise TransportError(f"rank {rank}'s region {self.name!r} is not mapped here; only "
                                 "co-located peers can be inspected")
        return bool(self._peers[rank][0][0] > 0)

    def __repr__(self) -> str:
        return (f"Region({self.name!r}, rows={self.rows}, row_shape={self.row_shape}, "
                f"dtype={self.dtype}, shared={self.shared})")


class Transport:
    """The memory-region transport of one worker in ``group`` (default: the whole world).

    ``torch.distributed`` must be initialized (gloo on CPU, NCCL on GPU; ``torchrun`` does it
    with ``dist.init_process_group()``). ``timeout`` (seconds) bounds every wait for a peer.
    ``shared_memory`` (default: when co-located peers exist and tensors are on the CPU) maps
    co-located peers' regions for one-sided access; ``False`` sends everything through the
    process group.
    """

    def __init__(self, group=None, *, timeout: float = 60.0, shared_memory: bool | None = None,
                 device: torch.device | str = "cpu"):
        if not dist.is_available() or not dist.is_initialized():
            raise TransportError("torch.distributed is not initialized; call "
                                 "torch.distributed.init_process_group('gloo') first (torchrun "
                                 "sets the rank and address)")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise TransportError(f"timeout must be a positive number of seconds (got {timeout!r})")
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        # A group of our own, with our timeout: the default group's may be 30 minutes.
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        self.group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout),
                                    backend=backend)
        self.backend = backend
        self._cpu_group = self.group if backend == "gloo" else dist.new_group(
            ranks, timeout=datetime.timedelta(seconds=self.timeout), backend="gloo")
        hosts = [None] * self.world_size
        self._collective("setup", dist.all_gather_object, hosts,
                         (socket.gethostname(), _boot_id()), group=self._cpu_group)
        self.hosts = hosts
        local = [r for r in range(self.world_size) if hosts[r] == hosts[self.rank]]
        want_shm = self.device.type == "cpu" and len(local) > 1 and Path("/dev/shm").is_dir()
        if shared_memory and not want_shm:
            raise TransportError(f"shared_memory=True needs co-located CPU workers and /dev/shm "
                                 f"(got {len(local)} worker(s) on this host, device {self.device})")
        self.shared_memory = want_shm if shared_memory is None else bool(shared_memory)
        self.colocated = set(local) if self.shared_memory else {self.rank}
        self._regions: dict[str, Region] = {}
        self._plans = 0  # plans made so far: names their outboxes alike on every worker
        self._prefix = None  # shared-memory file names: f"{prefix}.{what}"
        self._fence_slots = None  # shared-memory fence, when every worker is on this host
        self._fence_gen = 0
        if self.shared_memory:
            # One file-name prefix per job and host, chosen by the host's lowest rank. No folder:
            # each file is unlinked as soon as every worker has mapped it, so nothing is left in
            # /dev/shm however the workers end.
            leader = min(local)
            mine = f"/dev/shm/ngra-transport-{uuid.uuid4().hex}" if self.rank == leader else None
            every = [None] * self.world_size
            self._collective("setup", dist.all_gather_object, every, mine, group=self._cpu_group)
            self._prefix = every[leader]
            if self.colocated == set(range(self.world_size)):
                self._fence_slots = self._map_fence()

    def _map_fence(self) -> torch.Tensor:
        """int64 [2, world]: row 0 the fence generation each worker reached, row 1 its pid (to
        tell a dead peer from a slow one). Shared by every worker of the host."""
        path = Path(f"{self._prefix}.fence")
        slots = torch.from_file(str(path), shared=True, size=2 * self.world_size,
                                dtype=torch.int64).view(2, self.world_size)
        slots[1, self.rank] = os.getpid()
        self._collective("setup", dist.barrier, group=self._cpu_group)
        if self.rank == min(self.colocated):
            path.unlink()  # every worker has it mapped; nothing is left behind on a crash
        return slots

    # ---------------------------------------------------------------------------------------
    def _collective(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TransportError:
            raise
        except RuntimeError as e:  # gloo / NCCL report dead peers and time-outs as RuntimeError
            raise TransportError(
                f"rank {self.rank}: {what} failed waiting for peers (timeout {self.timeout:g} s): "
                f"a worker died, hung, or did not make the same call ({e})") from e

    def fence(self) -> None:
        """Order one-sided reads and writes with the peers' accesses (a barrier).

        With every worker on this host it is a barrier in shared memory (each worker bumps its
        generation counter and waits until every counter has reached it; microseconds instead
        of a process-group round trip); a peer that does not arrive within the timeout, or whose
        process is gone, is a TransportError naming it. On x86 the stores before the counter
        bump are visible to a peer that sees the bump (total store order)."""
        if self._fence_slots is not None:
            self._shm_fence()
        elif self.backend == "gloo":
            # monitored_barrier names the ranks that did not arrive.
            self._collective("fence", dist.monitored_barrier, group=self._cpu_group,
                             timeout=datetime.timedelta(seconds=self.timeout))
        else:
            self._collective("fence", dist.barrier, group=self.group)

    def _shm_fence(self) -> None:
        slots = self._fence_slots
        self._fence_gen += 1
        gen = self._fence_gen
        slots[0, self.rank] = gen
        start = time.monotonic()
        spins = 0
        while True:
            behind = (slots[0] < gen).nonzero().flatten().tolist()
            if not behind:
                return
            spins += 1
            if spins < 200:
                os.sched_yield()
                continue
            time.sleep(50e-6)  # the peer may need this core
            if spins % 1000 == 0:
                waited = time.monotonic() - start
                dead = [r for r in behind if not _alive(int(slots[1, r]))]
                if dead or waited > self.timeout:
                    why = (f"worker(s) {dead} exited" if dead else
                           f"worker(s) {behind} did not arrive within {self.timeout:g} s")
                    raise TransportError(
                        f"rank {self.rank}: fence failed waiting for peers (timeout "
                        f"{self.timeout:g} s): a worker died, hung, or did not make the same "
                        f"call ({why})")

    def alloc(self, name: str, rows: int, row_shape=(), dtype: torch.dtype = torch.float32) -> Region:
        """Collective: every worker allocates region ``name`` with its own ``rows`` and the same
        ``row_shape`` and ``dtype``. Returns the zero-filled region."""
        if not isinstance(name, str) or not name or "/" in name:
            raise TransportError(f"region name must be a non-empty string without '/' (got {name!r})")
        if name in self._regions:
            raise TransportError(f"region {name!r} is already allocated on rank {self.rank}; "
                                 "pick another name or free() it first")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise TransportError(f"rows must be an int >= 0 (got {rows!r}) for region {name!r}")
        row_shape = tuple(int(d) for d in row_shape)
        layouts = [None] * self.world_size
        self._collective(f"alloc({name!r})", dist.all_gather_object, layouts,
                         (name, rows, row_shape, str(dtype)), group=self._cpu_group)
        for r, (n, _, shape, dt) in enumerate(layouts):
            if (n, shape, dt) != (name, row_shape, str(dtype)):
                raise TransportError(
                    f"region layouts differ: rank {self.rank} allocates {name!r} with rows of "
                    f"shape {row_shape} and {dtype}, rank {r} allocates {n!r} with {shape} and "
                    f"{dt}; every worker must allocate the same regions in the same order")
        all_rows = [lay[1] for lay in layouts]
        row_numel = math.prod(row_shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not self.shared_memory:
            local = torch.zeros((rows, *row_shape), dtype=dtype, device=self.device)
            region = Region(self, name, all_rows, row_shape, dtype, local, None, {})
        else:
            def mapping(rank):
                path = f"{self._prefix}.{name}.{rank}"
                nbytes = _HEADER + all_rows[rank] * row_numel * itemsize
                buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
                header = buf[:_HEADER].view(torch.int64)
                data = buf[_HEADER:].view(dtype).view(all_rows[rank], *row_shape)
                return header, data

            header, local = mapping(self.rank)  # created zero-filled (a sparse file)
            self.fence()  # every file exists before any peer maps it
            peers = {r: mapping(r) for r in self.colocated if r != self.rank}
            self.fence()
            # Mapped everywhere: unlink now, so nothing is left behind if a worker dies later.
            Path(f"{self._prefix}.{name}.{self.rank}").unlink()
            region = Region(self, name, all_rows, row_shape, dtype, local, header, peers)
        self._regions[name] = region
        return region

    def register(self, name: str, tensor: torch.Tensor) -> Region:
        """Collective: a region holding a copy of ``tensor`` (its rows are this worker's rows).
        Use the returned region's ``local`` from then on: with shared memory the rows must live
        in the shared mapping, so they are copied there once."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise TransportError(f"register({name!r}) needs a tensor with at least one dim "
                                 f"(got {type(tensor).__name__})")
        region = self.alloc(name, tensor.shape[0], tuple(tensor.shape[1:]), tensor.dtype)
        region.set(tensor)
        return region

    def free(self, region: Region) -> None:
        """Forget a region (its memory goes when the last reference to it does)."""
        self._regions.pop(region.name, None)

    # ---------------------------------------------------------------------------------------
    def _check_rows(self, region: Region, rank: int, rows) -> torch.Tensor:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TransportError(f"peer {rank!r} is not a rank of this group (ranks 0.."
                                 f"{self.world_size - 1})")
        rows = torch.as_tensor(rows)
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise TransportError(f"rows must be a 1-D integer tensor (got shape "
                                 f"{tuple(rows.shape)}, dtype {rows.dtype}) for region "
                                 f"{region.name!r}")
        rows = rows.to(torch.int64)
        n = region.rows[rank]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            bad = rows[(rows < 0) | (rows >= n)][0]
            raise TransportError(f"row {int(bad)} is out of range for region {region.name!r} of "
                                 f"rank {rank}, which has {n} rows; rows must lie in [0, {n})")
        return rows

    def _peer(self, region: Region, peer: int, op: str):
        if peer == self.rank:
            return region._header, region.local
        if peer not in region._peers:
            raise TransportError(
                f"{op}({region.name!r}, peer={peer}): one-sided access needs a co-located peer "
                f"with shared memory (rank {peer} is on {self.hosts[peer][0]!r}, this is rank "
                f"{self.rank} on {self.hosts[self.rank][0]!r}, shared_memory="
                f"{self.shared_memory}); use an ExchangePlan (Transport.plan) instead")
        return region._peers[peer]

    def read(self, region: Region, rows, peer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One-sided: rows ``rows`` of ``peer``'s copy of ``region``, copied once into ``out``
        (or a new tensor). Sees the peer's writes up to its last :meth:`fence`."""
        rows = self._check_rows(region, peer, rows)
        header, data = self._peer(region, peer, "read")
        written = bool(header[0] > 0) if header is not None else region._written > 0
        if not written:
            raise TransportError(f"region {region.name!r} of rank {peer} was read before anything "
                                 "was written to it; write it (Region.set, Transport.write or "
                                 "Region.mark_written) and fence() first")
        if out is None:
            return data.index_select(0, rows)
        return torch.index_select(data, 0, rows, out=out)

    def write(self, region: Region, rows, peer: int, values: torch.Tensor) -> None:
        """One-sided: copy ``values`` [len(rows), *row_shape] into rows ``rows`` of ``peer``'s
        copy of ``region``. Visible to the peer after the next :meth:`fence`."""
        rows = self._check_rows(region, peer, rows)
        header, data = self._peer(region, peer, "write")
        want = (rows.numel(), *region.row_shape)
        if tuple(values.shape) != want or values.dtype != region.dtype:
            raise TransportError(f"write({region.name!r}): values must have shape {want} and "
                                 f"dtype {region.dtype} (got {tuple(values.shape)}, {values.dtype})")
        data[rows] = values
        if header is not None:
            header[0] += 1
        else:
            region._written += 1

    def gather_objects(self, obj) -> list:
        """Collective: every worker's ``obj`` (picklable; small things such as RNG states), in
        rank order, on every worker."""
        out = [None] * self.world_size
        self._collective("all_gather_object", dist.all_gather_object, out, obj,
                         group=self._cpu_group)
        return out

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a small CPU tensor over the workers in place (through the gloo group, whatever
        the data backend); for counts and metrics."""
        self._collective("all_reduce", dist.all_reduce, tensor, group=self._cpu_group)
        return tensor

    def _exchange(self, recv: torch.Tensor, send: torch.Tensor, recv_counts: list,
                  send_counts: list) -> None:
        """``all_to_all_single(recv, send, recv_counts, send_counts)`` of rows. On gloo it is
        point-to-point per peer instead, skipping the peers with nothing to move (gloo's
        all-to-all costs a round with every peer), with every wait bounded by the timeout."""
        if self.backend != "gloo":
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
            return
        recvs, sends = self._post(recv, send, recv_counts, send_counts, range(self.world_size),
                                  "exchange")
        limit = datetime.timedelta(seconds=self.timeout)
        for w in [*(w for _, w in sends), *recvs.values()]:
            w.wait(limit)

    def wait_work(self, work, what: str, why: str) -> float:
        """Wait for one asynchronous transfer (a ``torch.distributed`` work) at most the
        timeout; returns the seconds waited. A transfer that fails or does not complete in time
        is a :class:`TransportError`: "rank r: ``what`` failed within the timeout of T s:
        ``why``"."""
        start = time.perf_counter()
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:  # gloo reports a dead peer or a time-out as RuntimeError
            raise TransportError(f"rank {self.rank}: {what} failed within the timeout of "
                                 f"{self.timeout:g} s: {why} ({e})") from e
        if ok is False:
            raise TransportError(f"rank {self.rank}: {what} did not complete within the timeout "
                                 f"of {self.timeout:g} s: {why}")
        return time.perf_counter() - start

    def _post(self, recv: torch.Tensor, send: torch.Tensor, recv_counts: list,
              send_counts: list, order, what: str) -> tuple[dict, list]:
        """Gloo point-to-point rows of an exchange, posted and not waited for: this worker's own
        rows copied, then per peer in ``order`` (those with rows to move) one ``isend`` and one
        ``irecv``. Returns ``({peer: irecv work}, [(peer, isend work)])``; a transfer that cannot
        be posted is a :class:`TransportError` naming ``what`` and the peer."""
        r_off = [0] + list(itertools.accumulate(recv_counts))
        s_off = [0] + list(itertools.accumulate(send_counts))
        me = self.rank
        if recv_counts[me]:
            recv[r_off[me]:r_off[me + 1]].copy_(send[s_off[me]:s_off[me + 1]])
        recvs: dict = {}
        sends: list = []
        for p in order:
            if p == me:
                continue
            peer = dist.get_global_rank(self.group, p) if self.group is not None else p
            try:
                if send_counts[p]:
                    sends.append((p, dist.isend(send[s_off[p]:s_off[p + 1]], peer,
                                                group=self.group)))
                if recv_counts[p]:
                    recvs[p] = dist.irecv(recv[r_off[p]:r_off[p + 1]], peer, group=self.group)
            except RuntimeError as e:
                raise TransportError(f"rank {me}: {what} could not post the transfer with peer "
                                     f"{p}: {e}") from e
        return recvs, sends

    def plan(self, region: Region, need: dict[int, torch.Tensor]) -> "ExchangePlan":
        """Collective: an exchange that gives this worker rows ``need[peer]`` of each peer's
        copy of ``region`` (peers left out: none). Sizes and row ids are exchanged now, once."""
        return ExchangePlan(self, region, need)


class ExchangePlan:
    """A static halo exchange of one region (see :meth:`Transport.plan`).

    ``recv`` [sum of needed rows, *row_shape] holds, after :meth:`pull`, the needed rows peer by
    peer (ascending rank), each peer's rows in the order asked; ``recv_offsets[p]`` is where peer
    ``p``'s rows start. ``serve[p]`` are the rows of this worker that peer ``p`` needs.
    """

    def __init__(self, transport: Transport, region: Region, need: dict[int, torch.Tensor]):
        t = self.transport = transport
        self.region = region
        W = t.world_size
        if not isinstance(need, dict):
            raise TransportError(f"need must be a dict {{peer: rows}} (got {type(need).__name__})")
        for p in need:
            if not isinstance(p, int) or not 0 <= p < W:
                raise TransportError(f"need names peer {p!r}, not a rank of this group (0..{W - 1})")
        self.need = [t._check_rows(region, p, need.get(p, torch.zeros(0, dtype=torch.int64)))
                     for p in range(W)]
        counts = torch.tensor([n.numel() for n in self.need], dtype=torch.int64)
        # counts_matrix[a, b]: rows of b's region that a needs.
        matrix = [torch.zeros(W, dtype=torch.int64) for _ in range(W)]
        t._collective(f"plan({region.name!r})", dist.all_gather, matrix, counts,
                      group=t._cpu_group)
        self.counts = torch.stack(matrix)
        serve_counts = self.counts[:, t.rank]
        ids = torch.empty(int(serve_counts.sum()), dtype=torch.int64)
        t._collective(f"plan({region.name!r})", dist.all_to_all_single, ids,
                      torch.cat(self.need), serve_counts.tolist(), counts.tolist(),
                      group=t._cpu_group)
        self.serve = list(ids.split(serve_counts.tolist()))
        self._serve_ids = ids.to(t.device)
        self.recv_offsets = [0] + torch.cumsum(counts, 0).tolist()
        self._send_counts = serve_counts.tolist()
        self._recv_counts = counts.tolist()
        shape = region.row_shape
        self.recv = torch.empty((int(counts.sum()), *shape), dtype=region.dtype, device=t.device)
        # Bytes one pull brings from / sends to other workers (not this one's own rows).
        row_bytes = math.prod(shape) * self.recv.element_size()
        self._foreign_recv = row_bytes * (sum(self._recv_counts) - self._recv_counts[t.rank])
        self._foreign_send = row_bytes * (sum(self._send_counts) - self._send_counts[t.rank])
        self._need_dev = [n.to(t.device) for n in self.need]
        self._checked = False
        self._outbox = None
        # Seconds and bytes moved so far: ``wait_s`` is the part spent waiting for peers to
        # arrive (shared memory: the fence before the copy), ``pull_s`` / ``push_s`` the whole
        # calls. Benchmarks read them; they cost two clock reads per call.
        self.stats = {"pulls": 0, "pushes": 0, "pull_s": 0.0, "push_s": 0.0, "wait_s": 0.0,
                      "cpu_s": 0.0, "bytes_in": 0, "bytes_out": 0}
        if t.shared_memory and t.colocated != set(range(W)):
            raise TransportError("exchange plans over workers on several hosts with shared "
                                 "memory are not supported yet; create the Transport with "
                                 "shared_memory=False")
        if t.shared_memory:
            # The reverse (push_add) goes through a shared outbox that owners read from.
            t._plans += 1
            self._outbox = t.alloc(f"{region.name}.outbox{t._plans}", self.recv.shape[0], shape,
                                   region.dtype)
            self._outbox_offsets = torch.cumsum(self.counts, 1) - self.counts  # [a, b] start
        else:
            self._send = torch.empty((int(serve_counts.sum()), *shape), dtype=region.dtype,
                                     device=t.device)

    @property
    def bytes_received(self) -> int:
        """Bytes one :meth:`pull` brings to this worker."""
        return self.recv.numel() * self.recv.element_size()

    def _check_written_once(self) -> None:
        if self._checked:
            return
        t = self.transport
        mine = torch.tensor([int(self.region.written())], dtype=torch.int64)
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(t.world_size)]
        t._collective(f"pull({self.region.name!r})", dist.all_gather, flags, mine,
                      group=t._cpu_group)
        empty = [r for r, f in enumerate(flags) if int(f) == 0 and int(self.counts[:, r].sum())]
        if empty:
            raise TransportError(f"region {self.region.name!r} of rank(s) {empty} was read before "
                                 "anything was written to it; write it (Region.set or "
                                 "Region.mark_written) on every worker before pull()")
        self._checked = True

    def pull(self) -> torch.Tensor:
        """Collective: fill and return :attr:`recv` with the needed rows of every peer."""
        t = self.transport
        self._check_written_once()
        start, cpu = time.perf_counter(), time.process_time()
        if t.shared_memory:
            t.fence()  # peers finished writing their rows
            self.stats["wait_s"] += time.perf_counter() - start
            for p in range(t.world_size):
                a, b = self.recv_offsets[p], self.recv_offsets[p + 1]
                if b > a:
                    data = self.region.local if p == t.rank else self.region._peers[p][1]
                    torch.index_select(data, 0, self._need_dev[p], out=self.recv[a:b])
            t.fence()  # nobody overwrites rows that a peer is still reading
        else:
            torch.index_select(self.region.local, 0, self._serve_ids, out=self._send)
            t._collective(f"pull({self.region.name!r})", t._exchange, self.recv, self._send,
                          self._recv_counts, self._send_counts)
        self._account("pulls", "pull_s", start, cpu, self._foreign_recv, self._foreign_send)
        return self.recv

    def pull_async(self, out: torch.Tensor | None = None, *, peers=None) -> "PendingPull":
        """Collective: start filling ``out`` (default :attr:`recv`; same shape, dtype and device)
        with the needed rows of every peer, and return at once.

        The returned :class:`PendingPull` waits per peer: after ``wait(p)`` the rows of peer
        ``p``, ``out[recv_offsets[p]:recv_offsets[p + 1]]``, hold their values; ``finish()``
        waits for every peer and for this worker's own rows to be sent (call it before the next
        pull of the same rows is needed; a pending pull that is never finished keeps its
        buffers). ``peers`` (optional): the order in which the per-peer transfers are posted,
        a permutation of some ranks (the rest follow in ascending order); each worker may choose
        its own.

        Only the gloo point-to-point path is asynchronous: the rows this worker serves are
        gathered into a send buffer of the pull's own (so several pulls of one plan may be in
        flight at once, posted in the same order on every worker), then one ``isend`` and one
        ``irecv`` per peer with rows to move are posted, and the rows arrive while the caller
        computes. On shared memory (a fence-ordered copy that every worker makes together) and
        on NCCL (one ``all_to_all_single``) the pull completes before this returns: the handle
        is already complete. Every wait is bounded by the transport's timeout and a peer that
        does not deliver is a :class:`TransportError` naming it."""
        t = self.transport
        if out is None:
            out = self.recv
        elif tuple(out.shape) != tuple(self.recv.shape) or out.dtype != self.recv.dtype \
                or out.device != self.recv.device:
            raise TransportError(
                f"pull_async({self.region.name!r}): out must have shape "
                f"{tuple(self.recv.shape)}, dtype {self.recv.dtype} and device "
                f"{self.recv.device} (got {tuple(out.shape)}, {out.dtype}, {out.device})")
        order = self._peer_order(peers)
        self._check_written_once()
        start, cpu = time.perf_counter(), time.process_time()
        if t.shared_memory or t.backend != "gloo":
            recv = self.pull()
            if out is not recv:
                out.copy_(recv)
            return PendingPull(self, {}, [], ())
        send = torch.index_select(self.region.local, 0, self._serve_ids)
        recvs, sends = t._post(out, send, self._recv_counts, self._send_counts, order,
                               f"pull_async({self.region.name!r})")
        self._account("pulls", "pull_s", start, cpu, self._foreign_recv, self._foreign_send)
        return PendingPull(self, recvs, sends, (send, out))

    def _peer_order(self, peers) -> list[int]:
        W = self.transport.world_size
        if peers is None:
            return list(range(W))
        order = [int(p) for p in peers]
        bad = [p for p in order if not 0 <= p < W]
        if bad or len(set(order)) != len(order):
            raise TransportError(f"pull_async({self.region.name!r}): peers must be distinct ranks "
                                 f"in [0, {W}) (got {list(peers)!r})")
        return order + [p for p in range(W) if p not in set(order)]

    def _account(self, calls: str, seconds: str, start: float, cpu: float, bytes_in: int,
                 bytes_out: int) -> None:
        st = self.stats
        st[calls] += 1
        st[seconds] += time.perf_counter() - start
        st["cpu_s"] += time.process_time() - cpu
        st["bytes_in"] += bytes_in
        st["bytes_out"] += bytes_out

    def push_add(self, grad: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Collective, the reverse of :meth:`pull`: ``grad`` [rows of recv, *row_shape] holds a
        value per received row; each owner adds them into its rows of ``into`` (shape of the
        region's ``local``). Returns ``into``."""
        t = self.transport
        if tuple(grad.shape) != tuple(self.recv.shape) or grad.dtype != self.region.dtype:
            raise TransportError(f"push_add({self.region.name!r}): grad must have shape "
                                 f"{tuple(self.recv.shape)} and dtype {self.region.dtype} "
                                 f"(got {tuple(grad.shape)}, {grad.dtype})")
        if tuple(into.shape) != tuple(self.region.local.shape):
            raise TransportError(f"push_add({self.region.name!r}): into must have this worker's "
                                 f"region shape {tuple(self.region.local.shape)} "
                                 f"(got {tuple(into.shape)})")
        start, cpu = time.perf_counter(), time.process_time()
        if t.shared_memory:
            self._outbox.local.copy_(grad)
            wait = time.perf_counter()
            t.fence()
            self.stats["wait_s"] += time.perf_counter() - wait
            for p in range(t.world_size):
                n = int(self.counts[p, t.rank])
                if n:
                    box = self._outbox.local if p == t.rank else self._outbox._peers[p][1]
                    at = int(self._outbox_offsets[p, t.rank])
                    into.index_add_(0, self.serve[p].to(into.device), box[at:at + n])
            t.fence()
        else:
            back = torch.empty((self._send.shape[0], *self.region.row_shape),
                               dtype=grad.dtype, device=grad.device)
            t._collective(f"push_add({self.region.name!r})", t._exchange, back,
                          grad.contiguous(), self._send_counts, self._recv_counts)
            into.index_add_(0, self._serve_ids.to(into.device), back)
        # The reverse of a pull: the received rows' gradients go out, the served rows' come in.
        self._account("pushes", "push_s", start, cpu, self._foreign_send, self._foreign_recv)
        return into


class PendingPull:
    """A pull in flight (:meth:`ExchangePlan.pull_async`): ``wait(peer)`` waits for one peer's
    rows, ``finish()`` for everything; ``waited_s`` is the time spent blocked in both so far
    (also added to the plan's ``stats["wait_s"]`` and ``stats["pull_s"]``)."""

    def __init__(self, plan: ExchangePlan, recvs: dict, sends: list, keep: tuple):
        self.plan = plan
        self._recvs = recvs  # peer -> gloo work of its irecv, until waited for
        self._sends = sends  # (peer, work) of this worker's isends
        self._keep = keep  # the send buffer and the receive buffer stay alive until finished
        self.waited_s = 0.0

    @property
    def pending(self) -> list[int]:
        """Peers whose rows were not waited for yet."""
        return sorted(self._recvs)

    def arrived(self, peer: int) -> bool:
        """Whether peer's rows are in (without waiting; True for a peer with no rows)."""
        w = self._recvs.get(peer)
        return w is None or w.is_completed()

    def wait(self, peer: int) -> None:
        """Wait (at most the transport's timeout) until peer's rows are in."""
        w = self._recvs.pop(peer, None)
        if w is not None:
            self._wait(w, peer, "receiving the rows of")

    def finish(self) -> None:
        """Wait for every peer's rows and for this worker's sends."""
        for p in sorted(self._recvs):
            self.wait(p)
        sends, self._sends = self._sends, []
        for p, w in sends:
            self._wait(w, p, "sending rows to")
        self._keep = ()

    @property
    def done(self) -> bool:
        return not self._recvs and not self._sends

    def _wait(self, work, peer: int, what: str) -> None:
        plan = self.plan
        waited = plan.transport.wait_work(
            work, f"{what} peer {peer} (region {plan.region.name!r})",
            f"peer {peer} died, hung, or did not make the same pull")
        self.waited_s += waited
        plan.stats["wait_s"] += waited
        plan.stats["pull_s"] += waited


class PendingPulls:
    """Several :class:`PendingPull` s waited for together (one per exchanged value)."""

    def __init__(self, pulls):
        self.pulls = list(pulls)

    def arrived(self, peer: int) -> bool:
        return all(p.arrived(peer) for p in self.pulls)

    def wait(self, peer: int) -> None:
        for p in self.pulls:
            p.wait(peer)

    def finish(self) -> None:
        for p in self.pulls:
            p.finish()

    @property
    def waited_s(self) -> float:
        return sum(p.waited_s for p in self.pulls)

    @property
    def done(self) -> bool:
        return all(p.done for p in self.pulls)


class _PullExtended(torch.autograd.Function):
    """``x`` [n, ...] -> ``[x; rows pulled by plan]`` [n + h, ...], the last h rows filled as
    they arrive (see :func:`pull_extended`); backward returns their gradients to their owners
    (summed into theirs), as a synchronous halo exchange does."""

    @staticmethod
    def forward(ctx, x, plan, peers, box):
        n = x.shape[0]
        ext = x.new_empty((n + plan.recv.shape[0], *x.shape[1:]))
        ext[:n].copy_(x)
        plan.region.set(x.detach())
        box.append(plan.pull_async(ext[n:], peers=peers))
        ctx.plan, ctx.n = plan, n
        return ext

    @staticmethod
    def backward(ctx, grad):
        mine = grad[:ctx.n].clone()
        ctx.plan.push_add(grad[ctx.n:].contiguous(), mine)
        return mine, None, None, None


def pull_extended(x: torch.Tensor, plan: ExchangePlan, *, peers=None):
    """Collective and differentiable: ``(ext, pending)`` with ``ext = [x; pulled rows]``
    [n + h, ...] (``x`` [n, ...], the region's own rows, is written to the region first) and
    ``pending`` the :class:`PendingPull` whose ``wait(p)`` makes peer p's rows of ``ext`` valid
    (at ``n + recv_offsets[p]``). Backward sends the pulled rows' gradients back to their owners
    (:meth:`ExchangePlan.push_add`) and adds the ones it receives to ``x``'s gradient. On shared
    memory and NCCL the pull is synchronous (see :meth:`ExchangePlan.pull_async`)."""
    box: list = []
    ext = _PullExtended.apply(x, plan, peers, box)
    return ext, box[0]
