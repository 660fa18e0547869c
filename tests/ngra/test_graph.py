"""ngra.Graph: construction, validation, degrees, CSR caches, transformations, conversions."""

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from ngra.graph import Graph

# Hand-made graphs: (src, dst, num_nodes, expected in-degrees, expected out-degrees).
CASES = {
    "empty": ([], [], 0, [], []),
    "empty_with_nodes": ([], [], 3, [0, 0, 0], [0, 0, 0]),
    "isolated_vertex": ([0, 1], [1, 2], 4, [0, 1, 1, 0], [1, 1, 0, 0]),
    "self_loops": ([0, 1, 1, 2], [0, 1, 2, 2], 3, [1, 1, 2], [1, 2, 1]),
    "multi_edges": ([0, 0, 0, 1, 2], [1, 1, 1, 0, 1], 3, [1, 4, 0], [3, 1, 1]),
    "star": ([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 6, [0, 1, 1, 1, 1, 1], [5, 0, 0, 0, 0, 0]),
    "star_in": ([1, 2, 3, 4], [0, 0, 0, 0], 5, [4, 0, 0, 0, 0], [0, 1, 1, 1, 1]),
}


def make(name):
    src, dst, n, _, _ = CASES[name]
    return Graph(src, dst, num_nodes=n)


def edges(g):
    return list(zip(g.src.tolist(), g.dst.tolist()))


def random_graph(seed, n=30, e=120):
    rng = np.random.default_rng(seed)
    return Graph(rng.integers(0, n, e), rng.integers(0, n, e), num_nodes=n)


# -- construction ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_fields_and_degrees(name):
    src, dst, n, indeg, outdeg = CASES[name]
    g = make(name)
    assert g.num_nodes == n and g.num_edges == len(src)
    assert g.src.dtype == torch.int64 and g.dst.dtype == torch.int64
    assert g.src.tolist() == src and g.dst.tolist() == dst
    assert g.in_degrees().tolist() == indeg
    assert g.out_degrees().tolist() == outdeg
    assert g.device == torch.device("cpu")
    loops = [k for k, (u, v) in enumerate(zip(src, dst)) if u == v]
    assert g.self_loop_edges().tolist() == loops and g.self_loop_edges().dtype == torch.int64
    g.in_csr()  # once built, the degrees come from its row pointers: the same values and dtype
    assert g.in_degrees().tolist() == indeg and g.in_degrees().dtype == torch.int64
    assert g._held_as_csr().in_degrees().tolist() == indeg
    assert g._held_as_csr().self_loop_edges().tolist() == loops


@pytest.mark.parametrize("convert", [
    lambda a: a,
    lambda a: np.array(a, dtype=np.int32),
    lambda a: np.array(a, dtype=np.uint16),
    lambda a: torch.tensor(a, dtype=torch.int32),
    lambda a: torch.tensor(a, dtype=torch.int64),
    lambda a: tuple(a),
], ids=["list", "np_int32", "np_uint16", "torch_int32", "torch_int64", "tuple"])
def test_input_kinds(convert):
    g = Graph(convert([0, 2, 1]), convert([1, 0, 2]))
    assert g.src.dtype == torch.int64
    assert edges(g) == [(0, 1), (2, 0), (1, 2)]


def test_num_nodes_inferred():
    assert Graph([0, 5], [2, 1]).num_nodes == 6
    assert Graph([], []).num_nodes == 0
    assert Graph(torch.zeros(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)).num_nodes == 0
    assert Graph([3], [3]).num_nodes == 4
    assert Graph([0], [1], num_nodes=np.int64(10)).num_nodes == 10


def test_int64_tensor_is_not_copied():
    # Documented: large edge lists are stored without a copy.
    src = torch.tensor([0, 1, 2])
    assert Graph(src, torch.tensor([1, 2, 0])).src.data_ptr() == src.data_ptr()


def test_repr():
    assert repr(Graph([0, 1, 2, 3, 4, 0, 1], [1, 2, 3, 4, 0, 2, 3], num_nodes=5)) == "Graph(num_nodes=5, num_edges=7)"
    assert repr(Graph([], [])) == "Graph(num_nodes=0, num_edges=0)"


# -- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("src, dst, num_nodes, exc, match", [
    ([0, 7], [1, 2], 5, ValueError,
     r"edge index 7 out of range for a graph with 5 nodes; indices must lie in \[0, 5\) "
     r"\(found at src\[1\]; num_nodes must be at least 8"),
    ([0, 1], [1, 5], 5, ValueError, r"edge index 5 out of range .* 5 nodes; .*\[0, 5\) \(found at dst\[1\]"),
    ([0, -1], [1, 2], 5, ValueError, r"edge index -1 out of range .* \[0, 5\) \(found at src\[1\]; vertex ids cannot be negative"),
    ([0, 1], [-3, 2], None, ValueError, r"edge index -3 is negative \(found at dst\[0\]\)"),
    ([0, 1, 2], [1, 2], None, ValueError, r"src and dst must have the same length \(got 3 and 2\)"),
    ([0, 1], [1, 2], -1, ValueError, r"num_nodes must be >= 0 \(got -1\)"),
    ([0, 1], [1, 2], 2.0, TypeError, r"num_nodes must be an int \(got 2.0 of type float\)"),
    ([0, 1], [1, 2], True, TypeError, r"num_nodes must be an int \(got bool True\)"),
    ([0.0, 1.0], [1, 2], None, TypeError, r"src must hold integer vertex ids \(got dtype float64\)"),
    ([0, 1], [1, 2.5], None, TypeError, r"dst must hold integer vertex ids \(got dtype float64\)"),
    (torch.tensor([0.0, 1.0]), [1, 2], None, TypeError, r"src must hold integer vertex ids \(got dtype torch.float32\)"),
    (np.array([0.0, 1.0]), [1, 2], None, TypeError, r"src must hold integer vertex ids \(got dtype float64\)"),
    (torch.tensor([True, False]), [1, 2], None, TypeError, r"src must hold integer vertex ids \(got a bool tensor\)"),
    (np.array([True, False]), [1, 2], None, TypeError, r"src must hold integer vertex ids \(got bool values\)"),
    (["a", "b"], [1, 2], None, TypeError, r"src must hold integer vertex ids \(got dtype <U1\)"),
    ({0, 1}, [1, 2], None, TypeError, r"src must be a torch tensor, numpy array or list of ints \(got set\)"),
    (torch.tensor([[0, 1], [1, 2]]), [1, 2], None, ValueError,
     r"src must be 1-D with one entry per edge \(got shape \[2, 2\]\) \(for a \[2, E\] edge_index use Graph.from_edge_index\)"),
    (torch.tensor(3), torch.tensor(4), None, ValueError, r"src must be 1-D .* \(got shape \[\]\)"),
    (np.array([2**64 - 1], dtype=np.uint64), [0], None, ValueError, r"src holds id 18446744073709551615, which does not fit in int64"),
])
def test_bad_input(src, dst, num_nodes, exc, match):
    with pytest.raises(exc, match=match):
        Graph(src, dst, num_nodes=num_nodes)


def test_num_nodes_too_small_for_empty_is_fine_but_negative_is_not():
    assert Graph([], [], num_nodes=0).num_nodes == 0
    with pytest.raises(ValueError, match=r"num_nodes must be >= 0 \(got -2\)"):
        Graph([], [], num_nodes=-2)


# -- CSR caches -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES) + ["random"])
def test_csr_matches_dense_reference(name):
    g = random_graph(0) if name == "random" else make(name)
    n = g.num_nodes
    csr_in, csr_out = g.in_csr(), g.out_csr()
    assert g.in_csr() is csr_in and g.out_csr() is csr_out  # cached
    assert (csr_in.num_dst, csr_in.num_src, csr_in.num_edges) == (n, n, g.num_edges)
    assert (csr_out.indptr[1:] - csr_out.indptr[:-1]).tolist() == g.out_degrees().tolist()
    assert (csr_in.indptr[1:] - csr_in.indptr[:-1]).tolist() == g.in_degrees().tolist()
    # Rebuild the edge list from each CSR and compare with the original edge ids.
    e = edges(g)
    for csr, by_dst in ((csr_in, True), (csr_out, False)):
        rows = csr.dst_ids().tolist()
        cols = csr.indices.tolist()
        for row, col, eid in zip(rows, cols, csr.eids.tolist()):
            assert e[eid] == ((col, row) if by_dst else (row, col))
        # Within each row, edge ids ascend (deterministic reduction order).
        ptr = csr.indptr.tolist()
        for r in range(n):
            ids = csr.eids[ptr[r]:ptr[r + 1]].tolist()
            assert ids == sorted(ids)


# -- transformations ------------------------------------------------------------------------

def test_reverse():
    g = make("multi_edges")
    r = g.reverse()
    assert edges(r) == [(1, 0), (1, 0), (1, 0), (0, 1), (1, 2)]
    assert r.num_nodes == 3
    assert r.in_degrees().tolist() == g.out_degrees().tolist()
    assert edges(r.reverse()) == edges(g)
    assert edges(g) == [(0, 1), (0, 1), (0, 1), (1, 0), (2, 1)]  # original untouched


def test_self_loops():
    g = make("self_loops")  # (0,0) (1,1) (1,2) (2,2)
    added = g.add_self_loops()
    assert edges(added) == edges(g) + [(0, 0), (1, 1), (2, 2)]
    removed, eids = g.remove_self_loops(return_eids=True)
    assert edges(removed) == [(1, 2)] and eids.tolist() == [2]
    assert edges(g.add_self_loops().remove_self_loops()) == [(1, 2)]
    assert edges(make("isolated_vertex").add_self_loops())[-4:] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert make("empty").add_self_loops().num_edges == 0
    assert make("empty_with_nodes").add_self_loops().num_edges == 3


def test_to_simple_keeps_first_occurrence():
    g = Graph([2, 0, 2, 0, 1, 0, 3, 3], [1, 1, 1, 1, 1, 2, 3, 3], num_nodes=5)
    s, eids = g.to_simple(return_eids=True)
    assert eids.tolist() == [0, 1, 4, 5, 6]
    assert edges(s) == [(2, 1), (0, 1), (1, 1), (0, 2), (3, 3)]
    assert s.num_nodes == 5
    assert make("empty").to_simple().num_edges == 0


@pytest.mark.parametrize("seed", range(3))
def test_to_simple_random_against_python_reference(seed):
    g = random_graph(seed, n=8, e=60)
    seen, expected = set(), []
    for k, edge in enumerate(edges(g)):
        if edge not in seen:
            seen.add(edge)
            expected.append(k)
    assert g.to_simple(return_eids=True)[1].tolist() == expected


def test_to_undirected():
    g = Graph([0, 1, 1, 2, 3, 0], [1, 0, 2, 2, 1, 1], num_nodes=5)
    u = g.to_undirected()
    # originals (first occurrences) in order, then missing reverses in order of their edges
    assert edges(u) == [(0, 1), (1, 0), (1, 2), (2, 2), (3, 1), (2, 1), (1, 3)]
    assert u.num_nodes == 5
    assert u.in_degrees().tolist() == u.out_degrees().tolist()


@pytest.mark.parametrize("seed", range(3))
def test_to_undirected_random_is_symmetric_and_simple(seed):
    g = random_graph(seed)
    u = g.to_undirected()
    a = g.to_scipy().toarray() > 0
    expected = a | a.T
    assert (u.to_scipy().toarray() == expected).all()  # every pair exactly once, both ways


def test_to_device_same_device_is_identity():
    g = make("star")
    assert g.to("cpu") is g


# -- conversions ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES) + ["random"])
def test_edge_index_round_trip(name):
    g = random_graph(1) if name == "random" else make(name)
    ei = g.edge_index
    assert ei.shape == (2, g.num_edges) and ei.dtype == torch.int64
    back = Graph.from_edge_index(ei, num_nodes=g.num_nodes)
    assert edges(back) == edges(g) and back.num_nodes == g.num_nodes


def test_from_edge_index_inputs_and_errors():
    assert edges(Graph.from_edge_index([[0, 1], [1, 2]])) == [(0, 1), (1, 2)]
    assert edges(Graph.from_edge_index(np.array([[0, 1], [1, 2]]))) == [(0, 1), (1, 2)]
    assert Graph.from_edge_index([[], []], num_nodes=2).num_edges == 0
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\] .* got shape \[3, 2\]; for a \[E, 2\] array pass its transpose"):
        Graph.from_edge_index(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got shape \[4\]"):
        Graph.from_edge_index([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"edge index 9 out of range for a graph with 3 nodes"):
        Graph.from_edge_index([[0, 9], [1, 2]], num_nodes=3)


@pytest.mark.parametrize("name", list(CASES) + ["random"])
def test_scipy_round_trip(name):
    g = random_graph(2) if name == "random" else make(name)
    a = g.to_scipy()
    assert a.shape == (g.num_nodes, g.num_nodes) and a.dtype == np.float32
    dense = np.zeros((g.num_nodes, g.num_nodes), dtype=np.float32)
    for u, v in edges(g):
        dense[u, v] += 1  # parallel edges are counted
    assert (a.toarray() == dense).all()
    back = Graph.from_scipy(a)
    assert back.num_nodes == g.num_nodes
    # scipy holds a simple graph in row-major order
    assert edges(back) == sorted(set(edges(g)))


def test_from_scipy_semantics_and_errors():
    # Stored zeros are not edges; duplicate COO entries are one edge.
    a = sp.coo_matrix((np.array([1.0, 0.0, 2.0, 3.0]), (np.array([2, 0, 1, 2]), np.array([0, 1, 1, 0]))), shape=(4, 4))
    g = Graph.from_scipy(a)
    assert edges(g) == [(1, 1), (2, 0)] and g.num_nodes == 4
    # duplicates that cancel to zero are not an edge either
    b = sp.coo_array((np.array([1.0, -1.0]), (np.array([0, 0]), np.array([1, 1]))), shape=(2, 2))
    assert Graph.from_scipy(b).num_edges == 0
    with pytest.raises(ValueError, match=r"adjacency matrix must be square \(got shape \(2, 3\)\)"):
        Graph.from_scipy(sp.csr_array((2, 3)))
    with pytest.raises(TypeError, match=r"expects a scipy.sparse matrix or array \(got ndarray\)"):
        Graph.from_scipy(np.eye(3))


@pytest.mark.parametrize("name", list(CASES) + ["random"])
def test_networkx_round_trip(name):
    g = random_graph(3) if name == "random" else make(name)
    nxg = g.to_networkx()
    assert isinstance(nxg, nx.MultiDiGraph)
    assert nxg.number_of_nodes() == g.num_nodes and nxg.number_of_edges() == g.num_edges
    back = Graph.from_networkx(nxg)
    assert back.num_nodes == g.num_nodes
    # networkx iterates edges grouped by source, so compare multisets
    assert sorted(edges(back)) == sorted(edges(g))


def test_from_networkx_undirected_and_labels():
    ug = nx.Graph()
    ug.add_nodes_from(range(4))
    ug.add_edges_from([(0, 1), (1, 2), (2, 2)])
    g = Graph.from_networkx(ug)
    assert g.num_nodes == 4
    assert edges(g) == [(0, 1), (1, 2), (2, 2), (1, 0), (2, 1)]
    # Integer nodes 0..N-1 keep their ids even when inserted out of order.
    dg = nx.DiGraph([(3, 1), (1, 0), (2, 3)])
    assert edges(Graph.from_networkx(dg)) == [(3, 1), (1, 0), (2, 3)]
    # Other labels are numbered in node order.
    lg = nx.DiGraph([("b", "a"), ("a", "c")])
    assert edges(Graph.from_networkx(lg)) == [(0, 1), (1, 2)]
    assert Graph.from_networkx(nx.Graph()).num_nodes == 0


@pytest.mark.dgl
@pytest.mark.parametrize("name", list(CASES) + ["random"])
def test_dgl_round_trip(name):
    dgl = pytest.importorskip("dgl")
    g = random_graph(4) if name == "random" else make(name)
    d = g.to_dgl()
    assert d.num_nodes() == g.num_nodes and d.num_edges() == g.num_edges
    s, t = d.edges(order="eid")
    assert s.tolist() == g.src.tolist() and t.tolist() == g.dst.tolist()
    assert d.in_degrees().tolist() == g.in_degrees().tolist()
    back = Graph.from_dgl(d)
    assert edges(back) == edges(g) and back.num_nodes == g.num_nodes
    hetero = dgl.heterograph({("a", "r", "b"): ([0], [0]), ("b", "s", "a"): ([0], [0])})
    with pytest.raises(ValueError, match=r"from_dgl needs a homogeneous graph"):
        Graph.from_dgl(hetero)


def test_to_simple_on_huge_vertex_ids_matches_keyed_path():
    # num_nodes**2 overflows int64 here, so the lexicographic two-sort path runs.
    big = 4_000_000_000
    g = Graph([3_999_999_999, 0, 3_999_999_999, 5, 0], [1, 2, 1, 3_999_999_998, 2], num_nodes=big)
    s, eids = g.to_simple(return_eids=True)
    assert eids.tolist() == [0, 1, 3]
    small = Graph([4, 0, 4, 5, 0], [1, 2, 1, 3, 2], num_nodes=6)
    assert small.to_simple(return_eids=True)[1].tolist() == eids.tolist()
    assert edges(g.to_undirected()) == [(3_999_999_999, 1), (0, 2), (5, 3_999_999_998), (1, 3_999_999_999),
                                        (2, 0), (3_999_999_998, 5)]


def test_csr_indices_are_int32_when_they_fit():
    """The graph's CSR keeps indices and edge ids in int32 (row pointers int64): half the memory
    of int64 edge lists, in the CSR and in every copy the kernels derive from it."""
    g = random_graph(0)
    for csr in (g.in_csr(), g.out_csr()):
        assert csr.indices.dtype == torch.int32 and csr.eids.dtype == torch.int32
        assert csr.indptr.dtype == torch.int64
    assert g.src.dtype == torch.int64  # the edge lists the user gave are not changed


def test_a_graph_held_as_its_csr_is_the_same_graph():
    """``_held_as_csr`` (GAT's graph with self loops) keeps no int64 edge lists: num_edges,
    device and the CSR need none, and src / dst come back from the CSR equal to the graph's;
    every method, pickling and copying work as on the graph itself."""
    import copy
    import pickle

    gen = torch.Generator().manual_seed(0)
    g = Graph(torch.randint(0, 30, (200,), generator=gen), torch.randint(0, 30, (200,), generator=gen),
              32).remove_self_loops().add_self_loops()
    h = g._held_as_csr()
    assert isinstance(h, Graph) and h.in_csr() is g.in_csr()
    assert (h.num_nodes, h.num_edges, h.device, repr(h)) == (g.num_nodes, g.num_edges, g.device,
                                                             repr(g))
    assert h.in_csr()._coo is None  # nothing rebuilt so far
    assert torch.equal(h.src, g.src) and torch.equal(h.dst, g.dst)
    assert h.src.dtype == torch.int64 and h.in_csr()._dst_ids is None  # only the pair is kept
    assert torch.equal(h.in_degrees(), g.in_degrees()) and torch.equal(h.edge_index, g.edge_index)
    for m in ("reverse", "add_self_loops", "remove_self_loops", "to_simple", "to_undirected"):
        a, b = getattr(h, m)(), getattr(g, m)()
        assert torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst), m
    for c in (pickle.loads(pickle.dumps(h)), copy.deepcopy(h)):
        assert type(c) is Graph and torch.equal(c.src, g.src) and torch.equal(c.dst, g.dst)
    assert h.to("cpu") is h
