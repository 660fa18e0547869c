"""The memory-region transport on 1-4 real gloo worker processes: one-sided reads and writes
through shared memory, static exchange plans on both paths (shared memory and the process
group) against a plain reference, and the errors of bad use, dead peers and hung peers."""

from __future__ import annotations

import time

import pytest
import torch

import distutil


def _value(rank: int, rows: int, width: int = 3) -> torch.Tensor:
    """Rank ``rank``'s region content: row r of rank k is k * 1000 + r * 10 + [0, 1, 2, ...]."""
    return (rank * 1000 + torch.arange(rows).unsqueeze(1) * 10
            + torch.arange(width).unsqueeze(0)).float()


def _rows(rank: int) -> int:
    return [5, 0, 7, 3][rank]  # rank 1 owns no rows at all


def _one_sided(rank, world):
    from ngra.distributed import Transport, TransportError

    t = Transport(timeout=30)
    assert t.shared_memory
    region = t.register("h", _value(rank, _rows(rank)))
    assert region.shared and region.rows == [_rows(r) for r in range(world)]
    t.fence()
    for peer in range(world):
        if _rows(peer):
            rows = torch.tensor([_rows(peer) - 1, 0])
            got = t.read(region, rows, peer)
            torch.testing.assert_close(got, _value(peer, _rows(peer))[rows], rtol=0, atol=0)
    t.fence()
    # Each rank writes one row into the next rank that has rows: its own id, negated.
    peer = next(p for p in [(rank + k) % world for k in range(1, world + 1)] if _rows(p))
    if peer != rank or world == 1:
        t.write(region, torch.tensor([0]), peer, torch.full((1, 3), -float(rank) - 1))
    t.fence()
    writers = [w for w in range(world)
               if next(p for p in [(w + k) % world for k in range(1, world + 1)] if _rows(p))
               == rank]
    errors = []
    try:
        t.read(region, torch.tensor([_rows(rank)]), rank)
    except TransportError as e:
        errors.append(str(e))
    try:
        t.write(region, torch.tensor([0]), 0, torch.zeros(1, 4))
    except TransportError as e:
        errors.append(str(e))
    return region.local.clone(), writers, errors, t._prefix


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_one_sided_read_and_write_through_shared_memory(world):
    import glob

    results = distutil.run(_one_sided, world, timeout=180)
    # Every shared-memory file was unlinked once mapped: nothing is left in /dev/shm.
    assert results[0][3].startswith("/dev/shm/ngra-transport-")
    assert glob.glob(results[0][3] + "*") == []
    for rank, (local, writers, errors, _) in enumerate(results):
        want = _value(rank, _rows(rank))
        if writers:  # the last writer to row 0 wins; every writer wrote -(its rank + 1)
            assert float(local[0, 0]) in [-(w + 1.0) for w in writers]
            want[0] = local[0]
        torch.testing.assert_close(local, want, rtol=0, atol=0)
        n = _rows(rank)
        assert f"row {n} is out of range for region 'h' of rank {rank}, which has {n} rows" \
            in errors[0]
        assert "values must have shape (1, 3) and dtype torch.float32 (got (1, 4)" in errors[1]


def _need(rank: int, world: int) -> dict:
    """Seeded halo: every rank asks for a few rows of every peer (duplicates and self included)."""
    gen = torch.Generator().manual_seed(rank)
    need = {}
    for p in range(world):
        if _rows(p) and (world < 3 or p != (rank + 1) % world):  # a peer it needs nothing from
            count = int(torch.randint(1, 6, (1,), generator=gen))
            need[p] = torch.randint(0, _rows(p), (count,), generator=gen)
    return need


def _exchange(rank, world):
    from ngra.distributed import Transport

    out = {}
    modes = [False, True] if world > 1 else [False]
    for shm in modes:
        t = Transport(timeout=30, shared_memory=shm)
        region = t.register("x", _value(rank, _rows(rank)))
        plan = t.plan(region, _need(rank, world))
        got = plan.pull().clone()
        again = plan.pull().clone()  # the plan is reused; the data moves again
        grad = torch.arange(got.numel(), dtype=torch.float32).reshape(got.shape) + rank * 100
        into = torch.zeros_like(region.local)
        plan.push_add(grad, into)
        out[shm] = (got, again, into, plan.recv_offsets, plan.bytes_received)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_exchange_plan_pulls_and_pushes_like_a_plain_reference(world):
    results = distutil.run(_exchange, world, timeout=240)
    needs = [_need(r, world) for r in range(world)]
    # Reference: the needed rows gathered from the full tensors; gradients summed per owner row.
    want_into = [torch.zeros(_rows(r), 3) for r in range(world)]
    for rank in range(world):
        want = torch.cat([_value(p, _rows(p))[needs[rank][p]] if p in needs[rank]
                          else torch.zeros(0, 3) for p in range(world)])
        n = want.shape[0]
        grad = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + rank * 100
        off = 0
        for p in range(world):
            k = needs[rank][p].numel() if p in needs[rank] else 0
            want_into[p].index_add_(0, needs[rank][p] if k else torch.zeros(0, dtype=torch.long),
                                    grad[off:off + k])
            off += k
        for shm, (got, again, into, offsets, nbytes) in results[rank].items():
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(again, want, rtol=0, atol=0)
            assert offsets[-1] == n and nbytes == n * 3 * 4
    for rank in range(world):
        for shm, (_, _, into, _, _) in results[rank].items():
            torch.testing.assert_close(into, want_into[rank], rtol=1e-6, atol=0,
                                       msg=f"push_add into rank {rank}, shared_memory={shm}")
    assert any(sum(v.numel() for v in n.values()) for n in needs)  # something moved


def _misuse(rank, world, case):
    from ngra.distributed import Transport, TransportError

    t = Transport(timeout=20, shared_memory=False)
    try:
        if case == "layout":
            t.alloc("h", 4, (3,) if rank == 0 else (4,))
        elif case == "rows":
            region = t.register("h", _value(rank, 4))
            t.plan(region, {1 - rank: torch.tensor([0, 9])})
        elif case == "unwritten":
            region = t.alloc("h", 4, (3,))
            if rank == 0:
                region.set(torch.ones(4, 3))
            t.plan(region, {1 - rank: torch.tensor([1])}).pull()
        elif case == "no-shm":
            region = t.register("h", _value(rank, 4))
            t.read(region, torch.tensor([0]), 1 - rank)
    except TransportError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,msg", [
    ("layout", "region layouts differ: rank {rank} allocates 'h' with rows of shape"),
    ("rows", "row 9 is out of range for region 'h' of rank {peer}, which has 4 rows"),
    ("unwritten", "region 'h' of rank(s) [1] was read before anything was written to it"),
    ("no-shm", "one-sided access needs a co-located peer with shared memory"),
])
def test_bad_use_is_a_clear_error_on_every_worker(case, msg):
    results = distutil.run(_misuse, 2, case, timeout=120)
    for rank, text in enumerate(results):
        assert msg.format(rank=rank, peer=1 - rank) in text, (rank, text)


def _dead_or_hung_peer(rank, world, how, shm):
    import os

    from ngra.distributed import Transport, TransportError

    t = Transport(timeout=3, shared_memory=shm)
    region = t.register("h", _value(rank, 4))
    plan = t.plan(region, {1 - rank: torch.tensor([0, 1])})
    plan.pull()
    if rank == 1:
        if how == "dead":
            os._exit(0)
        time.sleep(8)  # hung: never joins the next exchange
        return "slept"
    start = time.monotonic()
    try:
        plan.pull()
        t.fence()
    except TransportError as e:
        return (time.monotonic() - start, str(e))
    return "no error"


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
# A hung peer is found by the timeout itself (~10 s a case): slow.
@pytest.mark.parametrize("how", ["dead", pytest.param("hung", marks=pytest.mark.slow)])
def test_dead_or_hung_peer_is_an_error_within_the_timeout(how, shm):
    results = distutil.run(_dead_or_hung_peer, 2, how, shm, timeout=120, may_die=(1,))
    elapsed, text = results[0]
    assert elapsed < 3 + 6, elapsed  # the 3 s timeout, plus slack for a loaded machine
    assert "failed waiting for peers (timeout 3 s): a worker died, hung" in text
    if shm:  # the shared-memory fence tells which
        assert ("worker(s) [1] exited" if how == "dead" else
                "worker(s) [1] did not arrive within 3 s") in text, text
