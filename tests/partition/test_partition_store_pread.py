"""ChunkStore.open(mmap=False) (chunks read with pread) and ChunkStore.read_rows."""

import numpy as np
import pytest

from partition import ChunkStore, StoreError, grid, reorder
from partition_testutil import edge_case_graphs, random_graph

GRAPHS = edge_case_graphs() + [("random", *random_graph(40, 300, seed=3), 40)]


def _store(tmp_path, src, dst, n, p=3, ordering=None):
    rng = np.random.default_rng(0)
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    order = reorder(src, dst, n, method=ordering) if ordering else None
    g = grid(src, dst, n, num_intervals=max(1, min(p, n)), ordering=order)
    arrays = {"x": rng.standard_normal((n, 3)).astype(np.float32), "y": np.arange(n)}
    ChunkStore.write(tmp_path / "s", g, vertex_arrays=arrays, progress=False)
    return tmp_path / "s", arrays


@pytest.mark.parametrize("graph", GRAPHS, ids=[g[0] for g in GRAPHS])
@pytest.mark.parametrize("ordering", [None, "rcm"])
def test_pread_chunks_equal_mapped_chunks(tmp_path, graph, ordering):
    name, src, dst, n = graph
    path, _ = _store(tmp_path, src, dst, n, ordering=ordering)
    mapped = ChunkStore.open(path)
    read = ChunkStore.open(path, verify="lazy", mmap=False)
    assert read.mmap is False and mapped.mmap is True
    assert np.array_equal(read.ordering.perm, mapped.ordering.perm)
    for a, b in zip(mapped.chunks(skip_empty=False), read.chunks(skip_empty=False)):
        assert (a.i, a.j) == (b.i, b.j)
        for field in ("src", "dst", "eids"):
            x, y = getattr(a, field), getattr(b, field)
            assert isinstance(x, np.memmap) or x.size == 0
            assert not isinstance(y, np.memmap) and y.flags.writeable and y.flags.owndata
            assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("mmap", [True, False])
def test_read_rows(tmp_path, mmap):
    src, dst = random_graph(40, 300, seed=1)
    path, arrays = _store(tmp_path, src, dst, 40, ordering="rcm")
    s = ChunkStore.open(path, mmap=mmap)
    perm = s.ordering.perm
    for lo, hi in ((0, 40), (3, 17), (39, 40), (5, 5)):
        for name in ("x", "y"):
            got = s.read_rows(name, lo, hi)
            assert not isinstance(got, np.memmap) and got.flags.writeable
            assert np.array_equal(got, s.vertex_array(name)[lo:hi])
            assert np.array_equal(got, arrays[name][perm[lo:hi]])  # new-id order
    with pytest.raises(KeyError, match="no vertex array 'z'"):
        s.read_rows("z", 0, 1)
    with pytest.raises(ValueError, match=r"rows 3:41 out of range for vertex array 'x' with 40 "
                                         r"rows; need 0 <= start <= stop <= 40"):
        s.read_rows("x", 3, 41)
    with pytest.raises(ValueError, match="rows 5:4 out of range"):
        s.read_rows("x", 5, 4)
    with pytest.raises(TypeError, match="start must be an int"):
        s.read_rows("x", 1.0, 4)


def test_open_mmap_must_be_bool(tmp_path):
    path, _ = _store(tmp_path, *random_graph(10, 20), 10)
    with pytest.raises(TypeError, match="mmap must be True or False"):
        ChunkStore.open(path, mmap="no")
    assert repr(ChunkStore.open(path, mmap=False)).endswith(", mmap=False)")


def _flip(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_pread_store_still_checks_chunks_and_rows(tmp_path):
    path, _ = _store(tmp_path, *random_graph(40, 300, seed=2), 40)
    size = (path / "dst.npy").stat().st_size
    _flip(path / "dst.npy", size - 2)  # the last chunk in storage order
    _flip(path / "vertex" / "x.npy", (path / "vertex" / "x.npy").stat().st_size - 1)
    s = ChunkStore.open(path, verify="lazy", mmap=False)
    p = s.num_intervals
    with pytest.raises(StoreError, match=rf"chunk \({p - 1}, {p - 1}\) failed its sha256 check"):
        s.chunk(p - 1, p - 1)
    with pytest.raises(StoreError, match="vertex/x.npy: sha256 mismatch"):
        s.read_rows("x", 0, 1)


def _rss_file():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


def test_pread_chunks_leave_no_file_pages_resident(tmp_path):
    """Streaming every chunk through the maps leaves the files' pages in RssFile while the store
    is open; with mmap=False they never enter this process's resident set."""
    src, dst = random_graph(1 << 16, 2_000_000, seed=4)  # 32 MB of edge files
    g = grid(src, dst, 1 << 16, num_intervals=4)
    ChunkStore.write(tmp_path / "s", g, progress=False)
    edge_bytes = 2_000_000 * (2 * 4 + 8)
    resident = {}
    for mmap in (False, True):
        s = ChunkStore.open(tmp_path / "s", mmap=mmap)  # full verify: the page cache is warm
        before = _rss_file()
        total = 0
        for ch in s.chunks():
            total += int(ch.eids.sum()) + int(ch.src.sum()) + int(ch.dst.sum())  # every page
        resident[mmap] = _rss_file() - before
        assert total > 0
        del s, ch
    assert resident[True] > 0.8 * edge_bytes
    assert resident[False] < 0.05 * edge_bytes


@pytest.mark.parametrize("graph", GRAPHS, ids=[g[0] for g in GRAPHS])
@pytest.mark.parametrize("ordering", [None, "rcm"])
@pytest.mark.parametrize("mmap", [True, False])
def test_reversed_view_is_the_grid_of_the_reversed_graph(tmp_path, graph, ordering, mmap):
    name, src, dst, n = graph
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    path, arrays = _store(tmp_path, src, dst, n, ordering=ordering)
    s = ChunkStore.open(path, mmap=mmap)
    rev = s.reversed()
    assert isinstance(rev, ChunkStore) and rev.reversed() is s
    assert repr(rev) == repr(s) + ".reversed()"
    ref = grid(dst, src, n, num_intervals=s.num_intervals, ordering=s.ordering)
    assert (rev.num_nodes, rev.num_edges, rev.num_intervals) == (n, len(src), s.num_intervals)
    assert np.array_equal(rev.counts, ref.counts) and np.array_equal(rev.counts, s.counts.T)
    assert np.array_equal(rev.ordering.perm, s.ordering.perm)
    for a, b in zip(rev.chunks("row", skip_empty=False), ref.chunks("row", skip_empty=False)):
        assert (a.i, a.j, a.src_start, a.dst_start) == (b.i, b.j, b.src_start, b.dst_start)
        for field in ("src", "dst", "eids"):
            assert np.array_equal(getattr(a, field), getattr(b, field))
    assert np.array_equal(rev.read_rows("x", 0, n), s.read_rows("x", 0, n))
    with pytest.raises(IndexError):
        rev.chunk(s.num_intervals, 0)
