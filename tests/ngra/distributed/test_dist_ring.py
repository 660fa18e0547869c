"""The ring exchange (NGra's chunk sharing, ``DistGraph.with_exchange("ring")``) is exact: on
1-4 real gloo workers every zoo model's outputs, loss and parameter gradients equal the
single-process run (float32, 1e-5 relative), the hand-made edge cases included, and its
transfers are what the ring should move."""

from __future__ import annotations

import pytest
import torch

import distutil
from test_dist_graph import N, _check, _problem, _run_models


def _ring_worker(rank, world, method, parts):
    from ngra.distributed import DistGraph, Transport, partition

    g = _problem()[0]
    t = Transport(timeout=60)
    if parts is None:
        parts = partition(g, world, method=method)
    dg = DistGraph.from_global(g, parts, t, exchange="ring")
    results = _run_models(dg)
    stats = dg.exchange_stats()
    sizes = dg.ring().sizes
    return dg.global_ids, dg.num_halo, results, stats, sizes


@pytest.mark.slow
@pytest.mark.parametrize("world,method", [(1, "metis"), (2, "metis"), (3, "random"),
                                          (4, "contiguous")])
def test_ring_mode_every_zoo_model_equals_the_single_process_run(world, method):
    out = distutil.run(_ring_worker, world, method, None, timeout=300)
    _check([(ids, halo, res) for ids, halo, res, _, _ in out])
    for rank, (_, _, _, stats, sizes) in enumerate(out):
        assert sum(sizes) == N
        if world == 1:
            assert stats.get("bytes_in", 0) == 0
            continue
        # Every pass brings every other worker's block once; nothing goes through the halo
        # plans in ring mode.
        assert stats["ring_passes"] > 0 and stats.get("pulls", 0) == 0, stats
        assert stats["bytes_in"] > 0 and stats["bytes_out"] > 0, stats


@pytest.mark.slow
def test_ring_mode_edge_cases_worker_without_vertices_and_worker_without_edges():
    parts = torch.zeros(N, dtype=torch.long)
    parts[36:] = 1  # worker 1: only the isolated vertices (no in-edges at all)
    parts[1:36:2] = 3  # worker 3 holds the odd vertices below 36; worker 2 holds nothing
    out = distutil.run(_ring_worker, 4, None, parts, timeout=300)
    assert out[2][0].numel() == 0 and out[2][4][2] == 0
    _check([(ids, halo, res) for ids, halo, res, _, _ in out])


def _bytes_worker(rank, world):
    """One sum-Gather pass of a [n, 3] float32 value: forward and backward ring bytes."""
    from ngra.distributed import DistGraph, Transport, partition

    g = _problem()[0]
    dg = DistGraph.from_global(g, partition(g, world, method="random"), Transport(timeout=60),
                               exchange="ring")
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(5))
    mine = x[dg.global_ids].clone().requires_grad_()
    out = dg.graph_ops().gspmm("copy_u", "sum", mine, None)
    out.pow(2).sum().backward()
    want_out = torch.zeros(N, 3).index_add_(0, g.dst, x[g.src])
    return dg.global_ids, out.detach(), mine.grad, dg.exchange_stats(), dg.ring().sizes, \
        want_out


def test_ring_moves_every_block_once_each_way_and_sums_like_a_dense_reference():
    out = distutil.run(_bytes_worker, 3, timeout=300)
    g, *_ = _problem()
    want_out = out[0][5]
    # Reference gradient of sum(out^2) wrt x: A^T (2 out), dense.
    A = torch.zeros(N, N)
    A.index_put_((g.dst, g.src), torch.ones(g.num_edges), accumulate=True)
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(5))
    want_grad = A.t() @ (2 * (A @ x))
    for rank, (ids, got, grad, stats, sizes, _) in enumerate(out):
        torch.testing.assert_close(got, want_out[ids], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad[ids], rtol=1e-5, atol=1e-5)
        K, row = len(sizes), 3 * 4
        others = sum(sizes) - sizes[rank]
        # Forward: the K - 1 other blocks come in; this worker sends its own and every block
        # it received but the last (all but the next worker's). Backward: the same rows back.
        moved = (others + sum(sizes) - sizes[(rank + 1) % K]) * row
        assert stats["bytes_in"] == moved and stats["bytes_out"] == moved, (rank, stats)
        assert stats["ring_passes"] == 1
