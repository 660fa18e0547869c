"""The streaming-order model (ngra.schedule.streaming): the searched order is the optimum of
the model (brute force over every pair of per-device orders on small problems), never worse
than the fixed order with a blocking exchange, and the cost fit recovers known lines."""

from __future__ import annotations

import pytest
import torch

from ngra.schedule import StreamCosts, brute_force, check, plan_streaming_order
from ngra.schedule.streaming import search_order, streaming_problem

UNIT = StreamCosts(per_edge_s=1.0, per_column_s=0.0, per_byte_s=1.0, latency_s=0.0)


def _random_case(seed: int, columns: int, peers: int):
    gen = torch.Generator().manual_seed(seed)
    edges = torch.randint(1, 10, (columns,), generator=gen).tolist()
    ranks = list(range(1, peers + 1))
    reads = [{p for p in ranks if bool(torch.rand(1, generator=gen) < 0.4)}
             for _ in range(columns)]
    nbytes = {p: int(torch.randint(1, 10, (1,), generator=gen)) for p in ranks}
    return edges, reads, nbytes


@pytest.mark.parametrize("seed", range(12))
def test_the_search_finds_the_optimum_of_the_model(seed):
    edges, reads, nbytes = _random_case(seed, columns=4, peers=2 + seed % 2)
    order = plan_streaming_order(edges, reads, nbytes, UNIT)
    best = brute_force(streaming_problem(edges, reads, nbytes, UNIT))
    check(order.schedule)
    assert order.exact
    assert order.predicted_s == pytest.approx(best.makespan)
    assert order.predicted_s <= order.overlap_s + 1e-12 <= order.fixed_s + 1e-12
    assert sorted(order.columns) == list(range(4)) and sorted(order.peers) == sorted(nbytes)


def test_a_hand_made_case():
    """Peer 1 sends 4 units, peer 2 sends 2; columns of 2, 6, 1, 4 edges need {1}, {}, {1, 2},
    {2}. Fixed (blocking exchange, then 0..3): 6 + 13 = 19; fixed order with per-peer waits:
    column 0 waits for peer 1 (4), then 2 + 6 + 1 + 4: 17. Searched: column 1 (needs nothing)
    runs while the rows travel, then the others as their peers arrive: 13, the compute alone."""
    order = plan_streaming_order([2, 6, 1, 4], [{1}, set(), {1, 2}, {2}], {1: 4, 2: 2}, UNIT)
    assert order.fixed_s == pytest.approx(19)
    assert order.overlap_s == pytest.approx(17)
    assert order.predicted_s == pytest.approx(13)
    assert order.columns[0] == 1
    assert "columns=[1," in repr(order) and "exact=True" in repr(order)


def test_many_peers_fall_back_to_list_scheduling():
    edges, reads, nbytes = _random_case(3, columns=10, peers=8)
    order = plan_streaming_order(edges, reads, nbytes, UNIT, exact_peers=4)
    assert not order.exact
    check(order.schedule)
    assert order.predicted_s <= order.fixed_s + 1e-12
    edges, reads, nbytes = _random_case(4, columns=6, peers=5)
    problem = streaming_problem(edges, reads, nbytes, UNIT)
    listed, exact = search_order(problem)  # 5 peers > the default 4: list scheduling
    assert not exact
    best, exact = search_order(problem, exact_peers=5)
    assert exact and best.makespan <= listed.makespan + 1e-12


def test_cost_fit_recovers_known_costs_and_refuses_bad_input():
    edges = [100, 200, 400, 800] * 2
    widths = [512] * 4 + [40] * 4  # two layers: rows of 512 and of 40 bytes
    secs = [1e-3 + e * (2e-9 + w * 3e-10) for e, w in zip(edges, widths)]
    costs = StreamCosts.fit(edges, secs, [10_000, 40_000],
                            [5e-4 + b * 1e-8 for b in (10_000, 40_000)], column_row_bytes=widths)
    assert costs.per_column_s == pytest.approx(1e-3)
    assert costs.per_edge_s == pytest.approx(2e-9, abs=1e-15)
    assert costs.per_edge_byte_s == pytest.approx(3e-10)
    assert costs.per_byte_s == pytest.approx(1e-8) and costs.latency_s == pytest.approx(5e-4)
    # A column cost that falls with size is not a cost: the coefficients stay >= 0.
    flat = StreamCosts.fit([100, 200], [2e-3, 1e-3])
    assert flat.per_edge_s == 0 and flat.per_column_s == pytest.approx(1.5e-3)
    # No transfers measured: the defaults stay.
    assert flat.latency_s == StreamCosts().latency_s
    with pytest.raises(ValueError, match="as many sizes as times"):
        StreamCosts.fit([1, 2], [1.0])
    with pytest.raises(ValueError, match="per_edge_s must be a finite number >= 0"):
        StreamCosts(per_edge_s=-1.0)
    with pytest.raises(ValueError, match=r"column 0 reads peer\(s\) \[3\]"):
        streaming_problem([1], [{3}], {1: 10}, UNIT)


def test_engine_refuses_an_unknown_column_order():
    import ngra

    with pytest.raises(ValueError, match="column_order must be one of 'fixed', 'overlap', "
                                         "'searched' \\(got 'best'\\)"):
        ngra.Engine(num_chunks=2, column_order="best")


def test_a_worker_without_peers_or_columns():
    alone = plan_streaming_order([5, 0, 3], [set(), set(), set()], {}, UNIT)
    assert alone.columns == (0, 1, 2) and alone.peers == ()
    assert alone.predicted_s == pytest.approx(8, abs=1e-9) == pytest.approx(alone.fixed_s)
    empty = plan_streaming_order([], [], {1: 4}, UNIT)  # a worker with no vertices still serves
    assert empty.columns == () and empty.predicted_s == pytest.approx(4)
