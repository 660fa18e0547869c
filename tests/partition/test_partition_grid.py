import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition import ChunkGrid, CostModel, GridStats, Ordering, grid, reorder
from partition.chunk_grid import (TABLE_BYTES_PER_CHUNK, chunk_order, double_and_bisect,
                                  interval_bounds, interval_of, search_num_intervals)
from partition_testutil import (HAVE_METIS, METIS, edge_case_graphs, needs_metis,
                                planted_partition, random_graph)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def graphs(draw, max_nodes=25, max_edges=60):
    n = draw(st.integers(0, max_nodes))
    e = draw(st.integers(0, max_edges)) if n else 0
    ids = st.integers(0, max(n - 1, 0))
    src = draw(st.lists(ids, min_size=e, max_size=e))
    dst = draw(st.lists(ids, min_size=e, max_size=e))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), n


@st.composite
def orderings(draw, n):
    kind = draw(st.sampled_from(["none", "identity", "rcm", "random"] + ["metis"] * HAVE_METIS))
    if kind == "none":
        return None
    if kind == "random":
        return Ordering(draw(st.permutations(range(n))) if n else [], method="custom")
    return kind


def check_grid(g: ChunkGrid, src, dst, n):
    """Every vertex in exactly one interval; every edge in exactly one chunk, in the right one."""
    p = g.num_intervals
    assert g.bounds.shape == (p + 1,) and g.bounds[0] == 0 and g.bounds[-1] == n
    assert np.all(np.diff(g.bounds) >= 0)
    seen = np.zeros(n, dtype=np.int64)
    for i in range(p):
        start, stop = g.interval(i)
        seen[g.ordering.perm[start:stop]] += 1
    assert np.all(seen == 1)

    perm = g.ordering.perm
    found = np.zeros(len(src), dtype=np.int64)
    for c in g.chunks(skip_empty=False):
        assert c.num_edges == g.counts[c.i, c.j]
        assert c.src.dtype == g.index_dtype and c.eids.dtype == np.int64
        if c.num_edges:
            assert np.all((0 <= c.src) & (c.src < c.num_src))
            assert np.all((0 <= c.dst) & (c.dst < c.num_dst))
            assert np.all(np.diff(c.eids) > 0)  # original edge order inside a chunk
        # Local ids map back to the original endpoints of each edge.
        assert np.array_equal(perm[c.global_src()], src[c.eids])
        assert np.array_equal(perm[c.global_dst()], dst[c.eids])
        found[c.eids] += 1
    assert np.all(found == 1)
    assert g.counts.sum() == len(src) == g.num_edges


@FAST
@given(data=st.data(), graph=graphs(), p=st.integers(1, 40))
def test_every_vertex_in_one_interval_every_edge_in_one_chunk(data, graph, p):
    src, dst, n = graph
    ordering = data.draw(orderings(n))
    g = grid(src, dst, n, num_intervals=p, ordering=ordering)
    assert g.num_intervals == p
    check_grid(g, src, dst, n)


@pytest.mark.parametrize("name, src, dst, n", edge_case_graphs(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("p", [1, 2, 3, 9])
def test_edge_case_graphs(name, src, dst, n, p):
    src, dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
    g = grid(src, dst, n, num_intervals=p)
    check_grid(g, src, dst, n)


def test_hand_made_grid():
    # 4 vertices, 2 intervals {0,1} {2,3}; edges numbered by position.
    src = [0, 2, 1, 3, 0, 2]
    dst = [1, 3, 2, 0, 3, 2]
    g = grid(src, dst, 4, num_intervals=2)
    assert g.bounds.tolist() == [0, 2, 4]
    assert g.counts.tolist() == [[1, 2], [1, 2]]
    c = g.chunk(0, 1)  # sources {0,1} -> destinations {2,3}: edges 2 (1->2) and 4 (0->3)
    assert c.eids.tolist() == [2, 4] and c.src.tolist() == [1, 0] and c.dst.tolist() == [0, 1]
    assert (c.num_src, c.num_dst) == (2, 2)
    assert repr(c) == "Chunk(i=0, j=1, src=[0, 2), dst=[2, 4), num_edges=2)"
    assert g.chunk(1, 1).eids.tolist() == [1, 5]
    assert [(c.i, c.j) for c in g.chunks("column")] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(c.i, c.j) for c in g.chunks("row")] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert repr(g) == "ChunkGrid(num_nodes=4, num_edges=6, num_intervals=2, ordering='identity')"


def test_empty_intervals_and_p_larger_than_n():
    g = grid([0, 1, 2], [2, 0, 1], 3, num_intervals=7)
    assert g.bounds.tolist() == [0, 0, 0, 1, 1, 2, 2, 3]
    empties = [i for i in range(7) if g.interval(i)[0] == g.interval(i)[1]]
    assert empties == [0, 1, 3, 5]
    assert g.counts[empties].sum() == 0 and g.counts[:, empties].sum() == 0
    assert [c.num_edges for c in g.chunks()] == [1, 1, 1]
    assert len(list(g.chunks(skip_empty=False))) == 49


def test_chunks_skip_empty_uses_counts():
    src, dst = random_graph(50, 40, seed=4)
    g = grid(src, dst, 50, num_intervals=10)
    assert len(list(g.chunks())) == np.count_nonzero(g.counts)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ordering", [None, "rcm", METIS])
def test_chunk_csr_matches_dense_reference(seed, ordering):
    src, dst = random_graph(40, 300, seed=seed)
    g = grid(src, dst, 40, num_intervals=3, ordering=ordering)
    eid_weight = np.arange(1, 301, dtype=np.float64)  # tells edges apart, incl. multi-edges
    for c in g.chunks():
        csr = c.csr()
        assert csr is c.csr()  # built once
        assert (csr.num_src, csr.num_dst, csr.num_edges) == (c.num_src, c.num_dst, c.num_edges)
        assert csr.index_dtype == torch.int32
        # Dense [num_dst, num_src] sum of original edge ids, from the CSR and from the chunk.
        dense_csr = np.zeros((c.num_dst, c.num_src))
        indptr, indices, eids = (t.numpy() for t in (csr.indptr, csr.indices, csr.eids))
        for v in range(c.num_dst):
            for k in range(indptr[v], indptr[v + 1]):
                dense_csr[v, indices[k]] += eid_weight[c.eids[eids[k]]]
        dense_ref = np.zeros((c.num_dst, c.num_src))
        np.add.at(dense_ref, (c.dst, c.src), eid_weight[c.eids])
        assert np.array_equal(dense_csr, dense_ref)


@needs_metis
def test_metis_ordering_parts_become_intervals():
    src, dst, n, _ = planted_partition(blocks=4, size=30, seed=2)
    o = reorder(src, dst, n, method="metis", num_parts=4)
    assert np.array_equal(grid(src, dst, n, num_intervals=4, ordering=o).bounds, o.bounds)
    # Another P: an equal split of the METIS order (documented), not the parts.
    assert grid(src, dst, n, num_intervals=3, ordering=o).bounds.tolist() == [0, 40, 80, 120]
    g = grid(src, dst, n, num_intervals=4, ordering="metis")
    assert g.ordering.method == "metis" and np.array_equal(g.bounds, o.bounds)
    assert g.stats().edge_cut < grid(src, dst, n, num_intervals=4).stats().edge_cut


def test_grid_stats_hand_made():
    g = grid([0, 2, 1, 3, 0, 2], [1, 3, 2, 0, 3, 2], 4, num_intervals=2)
    s = g.stats()
    assert s == GridStats(method="identity", num_intervals=2, num_edges=6, edge_cut=3,
                          cut_fraction=0.5, nonempty_chunks=4, density=1.0, max_chunk_edges=2,
                          mean_chunk_edges=1.5, max_interval_size=2)
    s = grid([0, 0], [0, 1], 4, num_intervals=4).stats()
    assert (s.edge_cut, s.nonempty_chunks, s.density, s.mean_chunk_edges) == (1, 2, 2 / 16, 1.0)


def test_grid_argument_errors():
    src, dst = [0, 1], [1, 0]
    with pytest.raises(ValueError, match="not both"):
        grid(src, dst, 2, num_intervals=2, memory_budget="1MiB", cost=CostModel(1, 1))
    with pytest.raises(ValueError, match="memory_budget needs a cost model"):
        grid(src, dst, 2, memory_budget="1MiB")
    with pytest.raises(ValueError, match="num_intervals must be >= 1"):
        grid(src, dst, 2, num_intervals=0)
    with pytest.raises(TypeError, match="num_intervals must be an int"):
        grid(src, dst, 2, num_intervals=2.0)
    with pytest.raises(ValueError, match="ordering is for 3 nodes but the graph has 2"):
        grid(src, dst, 2, ordering=Ordering.identity(3))
    with pytest.raises(ValueError, match="unknown ordering method 'bfs'"):
        grid(src, dst, 2, ordering="bfs")
    with pytest.raises(TypeError, match="cost must be a partition.CostModel"):
        grid(src, dst, 2, memory_budget=100, cost={"bytes_per_vertex": 1})
    with pytest.raises(ValueError, match="edge 0 has source id -1"):
        grid([-1], [0], 2)
    with pytest.raises(ValueError, match=r"cannot parse memory size '3 parsecs'"):
        grid(src, dst, 2, memory_budget="3 parsecs", cost=CostModel(1, 1))
    g = grid(src, dst, 2, num_intervals=2)
    with pytest.raises(IndexError, match=r"interval index j=2 out of range .* \[0, 2\)"):
        g.chunk(0, 2)
    with pytest.raises(ValueError, match="order must be 'column' or 'row'"):
        list(g.chunks("diagonal"))


def test_default_is_one_interval():
    src, dst = random_graph(10, 30)
    g = grid(src, dst, 10)
    assert g.num_intervals == 1 and g.peak_bytes is None
    assert g.chunk(0, 0).eids.tolist() == list(range(30))


# ---------------------------------------------------------------- cost model
def test_cost_model_peak_formula_by_hand():
    m = CostModel(bytes_per_vertex=10, bytes_per_edge=3, fixed=100, dst_bytes_per_vertex=7)
    # fixed + 8 P^2 + dst V + 2 (src V + edge C), P=2, V=5, C=4
    assert m.peak(2, 5, 4) == 100 + 8 * 4 + 7 * 5 + 2 * (10 * 5 + 3 * 4)
    m1 = CostModel(bytes_per_vertex=10, bytes_per_edge=3, prefetch=False)
    assert m1.peak(2, 5, 4) == 8 * 4 + 10 * 5 + (10 * 5 + 3 * 4)  # dst side defaults to src side
    assert CostModel(0.5, 0.25).peak(1, 3, 3) == 14  # 8 + 1.5 + 2 * (1.5 + 0.75)
    assert CostModel(0.5, 0.25).peak(1, 3, 1) == 13  # 8 + 1.5 + 2 * (1.5 + 0.25) = 13.0
    assert CostModel(0.5, 0.3).peak(1, 3, 1) == 14  # 13.1 rounds up
    assert m.lower_bound(3, 10, 20) == m.peak(3, 4, 3)  # ceil(10/3), ceil(20/9)


def test_cost_model_for_layer():
    m = CostModel.for_layer(16, 8, edge_width=2, itemsize=4, index_itemsize=4, fixed=5)
    assert m == CostModel(bytes_per_vertex=16 * 4 + 8, bytes_per_edge=2 * 4 + 4 * 4 + 8,
                          fixed=5, dst_bytes_per_vertex=8 * 4, prefetch=True)
    assert CostModel.for_layer(3).dst_bytes_per_vertex == 12
    with pytest.raises(ValueError, match="src_width must be >= 0"):
        CostModel.for_layer(-1)


def test_cost_model_work_and_loading_terms_by_hand():
    # Column-at-a-time (the engine's model): work on one column plus the columns' index arrays.
    work = dict(bytes_per_vertex=0, dst_bytes_per_vertex=0, table_bytes_per_chunk=0,
                work_bytes_per_edge=50.5, unit="column")
    # loaded while the work runs, two copies with prefetch: (50.5 + 2 * 96) * 10
    assert CostModel(bytes_per_edge=96, **work).peak(4, 7, 10) == 2425
    assert CostModel(bytes_per_edge=96, prefetch=False, **work).peak(4, 7, 10) == 1465
    # loaded before the work, not beside it: the larger of the two per edge
    assert CostModel(bytes_per_edge=96, prefetch=False, overlap=False, **work).peak(4, 7, 10) \
        == 960
    assert CostModel(bytes_per_edge=10, prefetch=False, overlap=False, **work).peak(4, 7, 10) \
        == 505
    # every term at once: 3 + 2 * 4 + 1 * 5 + 2 * 2 * 5 + (7 + 2 * 6) * 11
    m = CostModel(2, 6, fixed=3, dst_bytes_per_vertex=1, work_bytes_per_edge=7,
                  table_bytes_per_chunk=2)
    assert m.peak(2, 5, 11) == 3 + 8 + 5 + 20 + 19 * 11
    # the even share of a column is E / P, of a chunk E / P**2
    col = CostModel(1, 1, unit="column")
    assert col.lower_bound(3, 10, 20) == col.peak(3, 4, 7)
    assert CostModel(1, 1).lower_bound(3, 10, 20) == CostModel(1, 1).peak(3, 4, 3)


def test_cost_model_repr_shows_only_set_streaming_fields():
    assert repr(CostModel(1, 2)) == ("CostModel(bytes_per_vertex=1, bytes_per_edge=2, fixed=0, "
                                     "dst_bytes_per_vertex=None, prefetch=True)")
    assert repr(CostModel(1, 2, work_bytes_per_edge=3.5, unit="column")) == (
        "CostModel(bytes_per_vertex=1, bytes_per_edge=2, fixed=0, dst_bytes_per_vertex=None, "
        "prefetch=True, work_bytes_per_edge=3.5, unit='column')")
    with pytest.raises(ValueError, match=r"CostModel.unit must be one of 'chunk', 'column' "
                                         r"\(got 'row'\)"):
        CostModel(1, 1, unit="row")


def test_partition_refuses_a_column_model():
    src, dst = random_graph(20, 50)
    col = CostModel(1, 1, unit="column")
    with pytest.raises(ValueError, match="unit='chunk' \\(got 'column'\\)"):
        grid(src, dst, 20, num_intervals=2, cost=col)
    with pytest.raises(ValueError, match="unit='chunk'"):
        grid(src, dst, 20, memory_budget=10**6, cost=col)


def test_search_without_a_table_term_is_bounded_by_the_vertices():
    # No chunk table: nothing limits P but one vertex per interval.
    cost = CostModel(0, 1, prefetch=False, table_bytes_per_chunk=0)
    src, dst = random_graph(50, 2500, seed=1)
    g = grid(src, dst, 50, memory_budget=40, cost=cost)
    assert g.peak_bytes <= 40 < grid(src, dst, 50, num_intervals=g.num_intervals - 1,
                                      cost=cost).peak_bytes
    peaks = {p: max(0, 100 - p) for p in range(1, 11)}
    assert search_num_intervals(10, 0, 95, cost, peaks.__getitem__) == 5


def test_double_and_bisect_tries_doubling_points_then_bisects():
    tried = []

    def fits(p):
        tried.append(p)
        return p >= 11

    assert double_and_bisect(fits, 1, 100, lambda t: None) == 11
    assert tried == [1, 2, 4, 8, 16, 12, 10, 11]
    tried.clear()
    assert double_and_bisect(fits, 3, 100, lambda t: None) == 11
    assert tried[:4] == [3, 6, 12, 9]

    def give_up(t):
        if t[-1] >= 6:
            raise ValueError(f"no P up to {t[-1]}")

    with pytest.raises(ValueError, match="no P up to 6"):
        double_and_bisect(fits, 1, 6, give_up)


@pytest.mark.parametrize("field", ["bytes_per_vertex", "bytes_per_edge", "fixed", "dst_bytes_per_vertex",
                                   "work_bytes_per_edge", "table_bytes_per_chunk"])
@pytest.mark.parametrize("bad", [-1, float("inf"), "8", True])
def test_cost_model_rejects_bad_fields(field, bad):
    kwargs = dict(bytes_per_vertex=1, bytes_per_edge=1)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=f"CostModel.{field} must be a finite number >= 0"):
        CostModel(**kwargs)


@pytest.mark.parametrize("ordering", [None, "rcm"])
@pytest.mark.parametrize("budget", [6_000, 6_500, 9_000, 20_000, "30KiB", 200_000])
def test_budget_gives_smallest_fitting_p(budget, ordering):
    src, dst = random_graph(300, 2000, seed=5)
    cost = CostModel.for_layer(8, edge_width=1)
    limit = budget if isinstance(budget, int) else 30 * 1024
    # Reference: exact peaks of every P up to where the 8 P^2 table alone exceeds the budget.
    peaks = {q: grid(src, dst, 300, num_intervals=q, cost=cost, ordering=ordering).peak_bytes
             for q in range(1, math.isqrt(limit // 8) + 1)}
    fitting = [q for q, peak in peaks.items() if peak <= limit]
    if not fitting:
        with pytest.raises(ValueError, match="too small"):
            grid(src, dst, 300, memory_budget=budget, cost=cost, ordering=ordering)
        return
    g = grid(src, dst, 300, memory_budget=budget, cost=cost, ordering=ordering)
    assert g.num_intervals == min(fitting)
    assert g.peak_bytes == peaks[g.num_intervals] <= limit
    check_grid(g, src, dst, 300)


def test_budget_cases_above_cover_both_outcomes():
    # Guards the test above: with RCM, 6000 bytes fits no P, while the user's order fits one.
    src, dst = random_graph(300, 2000, seed=5)
    cost = CostModel.for_layer(8, edge_width=1)
    assert grid(src, dst, 300, memory_budget=6_000, cost=cost).num_intervals == 15
    with pytest.raises(ValueError, match=r"smallest measured peak is .* at P=18"):
        grid(src, dst, 300, memory_budget=6_000, cost=cost, ordering="rcm")


def test_budget_peak_is_measured_not_estimated():
    # Half of the edges are one repeated pair, so one chunk is far above the E / P^2 average:
    # the even-split lower bound fits at a smaller P than the real layout does.
    src, dst = random_graph(400, 1000, seed=6)
    src = np.concatenate([src, np.zeros(1000, np.int64)])
    dst = np.concatenate([dst, np.ones(1000, np.int64)])
    cost = CostModel(bytes_per_vertex=4, bytes_per_edge=16, prefetch=False)
    budget = 20_000
    g = grid(src, dst, 400, memory_budget=budget, cost=cost)
    p = g.num_intervals
    assert g.peak_bytes <= budget and g.counts.max() >= 1000
    assert cost.lower_bound(p - 1, 400, 2000) <= budget  # an estimate would have stopped earlier
    assert grid(src, dst, 400, num_intervals=p - 1, cost=cost).peak_bytes > budget


@needs_metis
def test_budget_with_metis_runs_metis_at_the_chosen_p():
    src, dst, n, _ = planted_partition(blocks=4, size=40, seed=3)
    cost = CostModel.for_layer(8)
    g = grid(src, dst, n, memory_budget=60_000, cost=cost, ordering="metis")
    assert g.ordering.method == "metis" and g.ordering.num_parts == g.num_intervals
    assert g.peak_bytes <= 60_000
    check_grid(g, src, dst, n)


def test_budget_too_small_names_budget_and_minimum():
    src, dst = random_graph(100, 500, seed=7)
    cost = CostModel.for_layer(64)
    with pytest.raises(ValueError, match=r"memory budget 1.00 KiB \(1024 bytes\) is too small .* "
                                         r"needs at least .* Raise memory_budget"):
        grid(src, dst, 100, memory_budget="1KiB", cost=cost)
    # fixed alone exceeds the budget
    with pytest.raises(ValueError, match="too small"):
        grid(src, dst, 100, memory_budget=10**6, cost=CostModel(1, 1, fixed=2 * 10**6))


def test_budget_failure_after_measuring_reports_smallest_measured_peak():
    # Every edge is the same pair, so no P splits it: all measured peaks stay above the budget.
    src = np.zeros(10_000, np.int64)
    dst = np.ones(10_000, np.int64)
    cost = CostModel(bytes_per_vertex=0, bytes_per_edge=1, prefetch=False)
    with pytest.raises(ValueError, match=r"smallest measured peak is .* at P="):
        grid(src, dst, 1000, memory_budget=5_000, cost=cost)


def test_table_term_limits_p():
    # With free vertices and edges only the 8 P^2 table counts, so the largest P that fits
    # is floor(sqrt(budget / 8)); the smallest fitting P is 1.
    cost = CostModel(0, 0)
    src, dst = random_graph(1000, 100)
    assert grid(src, dst, 1000, memory_budget=8 * 9, cost=cost).num_intervals == 1
    assert TABLE_BYTES_PER_CHUNK == 8


def test_cost_without_budget_reports_peak():
    src, dst = random_graph(20, 50)
    cost = CostModel(1, 2)
    g = grid(src, dst, 20, num_intervals=4, cost=cost)
    assert g.peak_bytes == cost.peak(4, 5, int(g.counts.max()))
    assert repr(g).endswith(f"peak={g.peak_bytes} B)")


def test_plot_chunk_counts():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from partition import plot_chunk_counts

    g = grid([0, 1, 2, 3, 0], [1, 0, 3, 2, 0], 4, num_intervals=2)
    ax = plot_chunk_counts(g)
    shown = ax.images[0].get_array()
    assert np.array_equal(shown.filled(0), g.counts)  # i rows, j columns
    assert shown.mask.tolist() == [[False, True], [True, False]]  # empty chunks stay blank
    assert ax.get_title() == "identity, P=2: cut 0.0%, density 0.50"
    assert ax.get_xlabel() == "destination interval j"
    plt.close(ax.figure)
    with pytest.raises(TypeError, match="source must be a ChunkGrid or ChunkStore"):
        plot_chunk_counts(g.counts)


@pytest.mark.parametrize("p", [1, 7, 256, 257, 300, 70_000])  # one 16-bit pass, two, int64 key
def test_chunk_order_is_a_stable_sort_by_chunk_key(p):
    rng = np.random.default_rng(p)
    iv_src, iv_dst = rng.integers(0, p, 3000), rng.integers(0, p, 3000)
    iv_src[:100], iv_dst[:100] = p - 1, p - 1  # the largest key, many ties
    key = iv_dst * p + iv_src
    assert np.array_equal(chunk_order(iv_src, iv_dst, p), np.argsort(key, kind="stable"))


@given(n=st.integers(0, 300), p=st.integers(1, 400), seed=st.integers(0, 5))
@FAST
def test_interval_of_matches_binary_search(n, p, seed):
    ids = np.random.default_rng(seed).integers(0, max(n, 1), 200) if n else np.zeros(0, np.int64)
    bounds = interval_bounds(n, p, None)  # equal split: closed form
    assert np.array_equal(interval_of(ids, bounds), np.searchsorted(bounds, ids, "right") - 1)
    uneven = np.sort(np.random.default_rng(seed).integers(0, n + 1, p + 1))
    uneven[0], uneven[-1] = 0, n
    assert np.array_equal(interval_of(ids, uneven), np.searchsorted(uneven, ids, "right") - 1)


def test_grid_with_many_intervals_uses_two_radix_passes():
    src, dst = random_graph(1000, 5000, seed=8)
    g = grid(src, dst, 1000, num_intervals=300)
    check_grid(g, src, dst, 1000)


@pytest.mark.parametrize("ordering", [None, "rcm", METIS])
@pytest.mark.parametrize("p", [1, 3, 8])
def test_streaming_chunk_csrs_reproduce_the_whole_graph_spmm(ordering, p):
    # The contract the streaming engine relies on: for each destination interval j, summing the
    # messages of chunks (0, j) .. (P-1, j) through their CSRs, with edge weights taken by
    # original edge id and vertex rows in new-id order, gives out[v] = sum_{u->v} w_e x[u].
    src, dst = random_graph(50, 400, seed=p)
    rng = np.random.default_rng(p)
    x = torch.from_numpy(rng.standard_normal((50, 3)))
    w = torch.from_numpy(rng.standard_normal(400))
    reference = torch.zeros(50, 3, dtype=torch.float64)
    reference.index_add_(0, torch.from_numpy(dst), w[:, None] * x[torch.from_numpy(src)])

    g = grid(src, dst, 50, num_intervals=p, ordering=ordering)
    x_new = x[torch.from_numpy(g.ordering.perm)]
    out_new = torch.zeros_like(x_new)
    for j in range(p):
        d0, d1 = g.interval(j)
        acc = torch.zeros(d1 - d0, 3, dtype=torch.float64)
        for c in (c for c in g.chunks("column") if c.j == j):
            csr = c.csr()
            w_chunk = w[torch.from_numpy(c.eids)]  # edge features of the chunk, chunk order
            msg = w_chunk[csr.eids.long()][:, None] * x_new[c.src_start + csr.indices.long()]
            acc.index_add_(0, csr.dst_ids(), msg)
        out_new[d0:d1] = acc
    out = out_new[torch.from_numpy(g.ordering.inv)]
    torch.testing.assert_close(out, reference)
