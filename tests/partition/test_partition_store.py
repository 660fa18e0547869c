import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition import ChunkStore, CostModel, Ordering, StoreError, grid, reorder
from partition.store import _manifest_digest
from partition_testutil import METIS, planted_partition, random_graph

REPO = Path(__file__).resolve().parents[2]


def same_chunks(a, b):
    assert (a.num_nodes, a.num_edges, a.num_intervals) == (b.num_nodes, b.num_edges, b.num_intervals)
    assert np.array_equal(a.bounds, b.bounds) and np.array_equal(a.counts, b.counts)
    assert np.array_equal(a.ordering.perm, b.ordering.perm)
    assert a.index_dtype == b.index_dtype
    for ca, cb in zip(a.chunks(skip_empty=False), b.chunks(skip_empty=False)):
        assert (ca.i, ca.j) == (cb.i, cb.j)
        for name in ("src", "dst", "eids"):
            x, y = getattr(ca, name), getattr(cb, name)
            assert x.dtype == y.dtype and np.array_equal(x, y)


def blocks_of(src, dst, size):
    def factory():
        for lo in range(0, len(src), size):
            yield src[lo:lo + size], dst[lo:lo + size]
    return factory


@pytest.fixture
def graph():
    src, dst, n, _ = planted_partition(blocks=3, size=20, seed=4)
    x = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    return src, dst, n, x


@pytest.fixture
def store_path(tmp_path, graph):
    src, dst, n, x = graph
    g = grid(src, dst, n, num_intervals=3, ordering="rcm")
    ChunkStore.write(tmp_path / "s", g, vertex_arrays={"x": x}, progress=False)
    return tmp_path / "s"


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("ordering", ["rcm", METIS])
@pytest.mark.parametrize("verify", ["full", "lazy"])
def test_write_then_open_gives_the_same_grid(tmp_path, graph, verify, ordering):
    src, dst, n, x = graph
    g = grid(src, dst, n, num_intervals=4, ordering=ordering)
    ChunkStore.write(tmp_path / "s", g, vertex_arrays={"x": x, "deg": np.bincount(dst, minlength=n)},
                     progress=False)
    s = ChunkStore.open(tmp_path / "s", verify=verify)
    same_chunks(g, s)
    assert s.ordering.method == ordering and s.ordering.num_parts == g.ordering.num_parts
    if ordering == "metis":
        assert np.array_equal(s.ordering.bounds, g.ordering.bounds)
    assert s.stats() == g.stats()
    assert s.vertex_arrays == ("x", "deg")
    # Vertex rows are stored in new-id order, so interval i is a contiguous row range.
    assert np.array_equal(s.vertex_array("x"), x[g.ordering.perm])
    assert np.array_equal(s.vertex_array("deg"), np.bincount(dst, minlength=n)[g.ordering.perm])
    c = s.chunk(*np.unravel_index(np.argmax(s.counts), s.counts.shape))
    assert c.num_edges > 0 and isinstance(c.src, np.memmap) and not c.src.flags.writeable
    assert isinstance(s.vertex_array("x"), np.memmap)
    assert repr(s) == (f"ChunkStore({str(tmp_path / 's')!r}, num_nodes={n}, num_edges={len(src)}, "
                       f"num_intervals=4, ordering={ordering!r}, vertex_arrays=('x', 'deg'))")
    s.verify()


def test_write_from_blocks_matches_grid(tmp_path, graph):
    src, dst, n, x = graph
    o = reorder(src, dst, n, method="rcm")
    g = grid(src, dst, n, num_intervals=3, ordering=o)
    made = {
        "factory": ChunkStore.write_from_blocks(tmp_path / "a", blocks_of(src, dst, 37), n,
                                                num_intervals=3, ordering=o, progress=False),
        "generator": ChunkStore.write_from_blocks(tmp_path / "b", blocks_of(src, dst, 37)(), n,
                                                  num_intervals=3, ordering=o, block_size=50,
                                                  progress=False),
        "list": ChunkStore.write_from_blocks(tmp_path / "c", list(blocks_of(src, dst, 500)()), n,
                                             num_intervals=3, ordering=o, progress=False),
    }
    for s in made.values():
        same_chunks(g, s)
        same_chunks(g, ChunkStore.open(s.path))  # and it verifies in full
    assert not list(tmp_path.glob(".*"))  # no temporary directories or spill files left


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 30), e=st.integers(0, 80), p=st.integers(1, 12),
       block=st.integers(1, 40), seed=st.integers(0, 10), spill=st.booleans())
def test_streamed_store_equals_in_memory_grid(tmp_path_factory, n, e, p, block, seed, spill):
    src, dst = random_graph(n, e if n else 0, seed=seed)
    perm = np.random.default_rng(seed).permutation(n)
    o = Ordering(perm, method="custom")
    path = tmp_path_factory.mktemp("s") / "store"
    blocks = blocks_of(src, dst, block)
    s = ChunkStore.write_from_blocks(path, blocks() if spill else blocks, n, num_intervals=p,
                                     ordering=o, block_size=block, progress=False)
    same_chunks(grid(src, dst, n, num_intervals=p, ordering=o), s)


def test_write_from_blocks_with_memory_budget(tmp_path):
    src, dst = random_graph(300, 2000, seed=5)
    cost = CostModel.for_layer(8, edge_width=1)
    s = ChunkStore.write_from_blocks(tmp_path / "s", blocks_of(src, dst, 300), 300,
                                     memory_budget=9_000, cost=cost, progress=False)
    g = grid(src, dst, 300, memory_budget=9_000, cost=cost)
    assert s.num_intervals == g.num_intervals == 9
    same_chunks(g, s)


def test_vertex_arrays_from_blocks_and_tensors(tmp_path, graph):
    src, dst, n, x = graph
    o = reorder(src, dst, n, method="rcm")
    g = grid(src, dst, n, num_intervals=2, ordering=o)
    rows = [x[lo:lo + 7] for lo in range(0, n, 7)]
    s = ChunkStore.write(tmp_path / "s", g, progress=False, vertex_arrays={
        "gen": (r for r in rows), "factory": lambda: iter(rows), "tensor": torch.from_numpy(x),
        "labels": np.arange(n, dtype=np.int16)})
    for name in ("gen", "factory", "tensor"):
        assert np.array_equal(s.vertex_array(name), x[o.perm])
    assert s.vertex_array("labels").dtype == np.int16
    assert np.array_equal(s.vertex_array("labels"), o.perm)
    with pytest.raises(KeyError, match=r"no vertex array 'y' .* \['gen', 'factory', 'tensor', 'labels'\]"):
        s.vertex_array("y")


@pytest.mark.parametrize("arrays, err, match", [
    ({"x": np.zeros((5, 2))}, ValueError, r"must have 60 rows \[N, \.\.\.\] \(got shape \(5, 2\)\)"),
    ({"x": [np.zeros((50, 2))]}, ValueError, "blocks hold 50 rows; expected num_nodes=60"),
    ({"x": [np.zeros((50, 2)), np.zeros((20, 2))]}, ValueError, "more than num_nodes=60"),
    ({"x": [np.zeros((30, 2)), np.zeros((30, 3))]}, ValueError, r"block at row 30 has shape \(30, 3\)"),
    ({"x": [np.zeros((30, 2)), np.zeros((30, 2), np.float32)]}, ValueError, "dtype float32"),
    ({"../x": np.zeros(60)}, ValueError, "becomes a file name"),
    ({"x": np.array(["a"] * 60)}, TypeError, "must be numeric"),
    ([("x", np.zeros(60))], TypeError, "vertex_arrays must be a mapping name -> data"),
])
def test_bad_vertex_arrays_are_refused_and_leave_nothing(tmp_path, graph, arrays, err, match):
    src, dst, n, _ = graph
    with pytest.raises(err, match=match):
        ChunkStore.write(tmp_path / "s", grid(src, dst, n), vertex_arrays=arrays, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_empty_graph_store(tmp_path):
    s = ChunkStore.write_from_blocks(tmp_path / "s", [], 0, num_intervals=2, progress=False)
    assert (s.num_nodes, s.num_edges, s.num_intervals) == (0, 0, 2)
    assert list(s.chunks()) == [] and s.chunk(1, 0).num_edges == 0
    s2 = ChunkStore.write_from_blocks(tmp_path / "t", iter([]), 4, num_intervals=6, progress=False)
    assert s2.bounds.tolist() == [0, 0, 1, 2, 2, 3, 4]
    ChunkStore.open(tmp_path / "t")


# ---------------------------------------------------------------- stream checks
def test_bad_edge_blocks(tmp_path):
    with pytest.raises(ValueError, match=r"edge 5 has source id 9, out of range for a graph with 4 nodes"):
        ChunkStore.write_from_blocks(tmp_path / "s", [([0, 1, 2], [0, 1, 2]), ([0, 1, 9], [0, 0, 0])], 4,
                                     progress=False)
    with pytest.raises(TypeError, match=r"edge block 0 must be a \(src, dst\) pair"):
        ChunkStore.write_from_blocks(tmp_path / "s", [np.arange(3)], 4, progress=False)
    with pytest.raises(TypeError, match="ordering must be None or a partition.Ordering .*reorder"):
        ChunkStore.write_from_blocks(tmp_path / "s", [], 4, ordering="metis", progress=False)
    with pytest.raises(ValueError, match="cost is only used to choose P from memory_budget"):
        ChunkStore.write_from_blocks(tmp_path / "s", [], 4, num_intervals=2, cost=CostModel(1, 1),
                                     progress=False)
    with pytest.raises(ValueError, match="not both"):
        ChunkStore.write_from_blocks(tmp_path / "s", [], 4, num_intervals=2, memory_budget="1GB",
                                     cost=CostModel(1, 1), progress=False)
    with pytest.raises(ValueError, match="ordering is for 3 nodes but num_nodes is 4"):
        ChunkStore.write_from_blocks(tmp_path / "s", [], 4, ordering=Ordering.identity(3), progress=False)
    with pytest.raises(TypeError, match="grid must be a partition.ChunkGrid"):
        ChunkStore.write(tmp_path / "s", [([0], [0])], progress=False)
    assert list(tmp_path.iterdir()) == []


def count_passes(src, dst):
    calls = []

    def factory():
        calls.append(1)
        yield src, dst

    return calls, factory


@pytest.mark.parametrize("budget", [None, 3_000])
def test_number_of_passes(tmp_path, budget):
    src, dst = random_graph(20, 100, seed=1)
    calls, factory = count_passes(src, dst)
    kwargs = dict(num_intervals=2) if budget is None else \
        dict(memory_budget=budget, cost=CostModel(bytes_per_vertex=8, bytes_per_edge=16))
    s = ChunkStore.write_from_blocks(tmp_path / "s", factory, 20, progress=False, **kwargs)
    if budget is None:
        assert len(calls) == 2  # check + count, then write
    else:
        assert s.num_intervals > 1 and len(calls) >= 3  # check, count per P tried, write


@pytest.mark.parametrize("change", ["more", "fewer", "moved"])
@pytest.mark.parametrize("budget", [None, 3_000])
@pytest.mark.parametrize("on_pass", ["second", "last"])
def test_nondeterministic_factory_is_refused(tmp_path, change, budget, on_pass):
    src, dst = random_graph(20, 100, seed=1)
    kwargs = dict(num_intervals=2) if budget is None else \
        dict(memory_budget=budget, cost=CostModel(bytes_per_vertex=8, bytes_per_edge=16))
    calls, factory = count_passes(src, dst)
    ChunkStore.write_from_blocks(tmp_path / "ok", factory, 20, progress=False, **kwargs)
    change_on = 2 if on_pass == "second" else len(calls)
    calls = []

    def changing():
        calls.append(1)
        if len(calls) < change_on:
            yield src, dst
        elif change == "more":
            yield np.concatenate([src, [0]]), np.concatenate([dst, [0]])
        elif change == "fewer":
            yield src[:-1], dst[:-1]
        else:  # same count, but one edge lands in another chunk
            yield np.concatenate([src[:-1], [(src[-1] + 10) % 20]]), dst

    with pytest.raises(ValueError, match="must be deterministic"):
        ChunkStore.write_from_blocks(tmp_path / "s", changing, 20, progress=False, **kwargs)
    assert [p.name for p in tmp_path.iterdir()] == ["ok"]


def test_streaming_write_does_not_hold_the_edge_list(tmp_path):
    # 1M edges = 16 MB as int64 pairs; blocks of 10k edges. Python-side allocations (numpy
    # buffers are traced by tracemalloc) must stay far below the edge list: chunks go through
    # memory-mapped files, the spill through a file.
    n, e, b = 5_000, 1_000_000, 10_000

    def factory():
        rng = np.random.default_rng(0)
        for _ in range(e // b):
            yield rng.integers(0, n, b), rng.integers(0, n, b)

    for name, edges in (("factory", factory), ("spill", factory())):
        tracemalloc.start()
        s = ChunkStore.write_from_blocks(tmp_path / name, edges, n, num_intervals=8,
                                         block_size=b, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert s.num_edges == e
        assert peak < 16 * e / 5, f"{name}: traced peak {peak} bytes"
    same_chunks(ChunkStore.open(tmp_path / "factory"), ChunkStore.open(tmp_path / "spill"))


# ---------------------------------------------------------------- corruption
def data_offset(path):
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def flip_byte(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


BIG = ["src.npy", "dst.npy", "eids.npy", "perm.npy", "vertex/x.npy"]
ALL = BIG + ["offsets.npy", "chunk_sha256.npy"]


@pytest.mark.parametrize("rel", ALL)
def test_flipped_data_byte_is_refused_on_full_open(store_path, rel):
    flip_byte(store_path / rel, os.path.getsize(store_path / rel) - 3)
    with pytest.raises(StoreError, match=rf"{rel}: sha256 mismatch"):
        ChunkStore.open(store_path)


@pytest.mark.parametrize("rel", ["src.npy", "dst.npy", "eids.npy"])
def test_flipped_chunk_byte_is_refused_when_the_chunk_is_loaded(store_path, rel):
    s = ChunkStore.open(store_path, verify="lazy")
    item = np.dtype(s.manifest["files"][rel]["dtype"]).itemsize
    slot = s.num_edges // 2
    flip_byte(store_path / rel, data_offset(store_path / rel) + slot * item)
    s = ChunkStore.open(store_path, verify="lazy")  # sizes and headers are still fine
    p = s.num_intervals
    k = int(np.searchsorted(s._offsets, slot, side="right")) - 1
    bad = (k % p, k // p)
    for i in range(p):
        for j in range(p):
            if (i, j) != bad:
                assert s.chunk(i, j).num_edges == s.counts[i, j]  # every other chunk still loads
    with pytest.raises(StoreError, match=rf"chunk \({bad[0]}, {bad[1]}\) failed its sha256 check"):
        s.chunk(*bad)
    with pytest.raises(StoreError, match=f"{rel}: sha256 mismatch"):
        s.verify()


def test_lazy_mode_checks_perm_and_vertex_arrays_on_first_use(store_path):
    for rel in ("perm.npy", "vertex/x.npy"):
        flip_byte(store_path / rel, data_offset(store_path / rel) + 1)
    s = ChunkStore.open(store_path, verify="lazy")
    with pytest.raises(StoreError, match="perm.npy: sha256 mismatch"):
        s.ordering
    with pytest.raises(StoreError, match="vertex/x.npy: sha256 mismatch"):
        s.vertex_array("x")


@pytest.mark.parametrize("rel", ALL)
@pytest.mark.parametrize("verify", ["full", "lazy"])
def test_truncated_file_is_refused(store_path, rel, verify):
    path = store_path / rel
    size = os.path.getsize(path)
    os.truncate(path, size - 1)
    with pytest.raises(StoreError, match=rf"{rel}: truncated: {size - 1} bytes on disk, the manifest "
                                         rf"records {size}"):
        ChunkStore.open(store_path, verify=verify)


def test_appended_bytes_are_refused(store_path):
    with open(store_path / "eids.npy", "ab") as f:
        f.write(b"\0")
    with pytest.raises(StoreError, match="eids.npy: longer than written"):
        ChunkStore.open(store_path, verify="lazy")


@pytest.mark.parametrize("rel", ALL)
@pytest.mark.parametrize("verify", ["full", "lazy"])
def test_missing_file_is_refused(store_path, rel, verify):
    os.remove(store_path / rel)
    with pytest.raises(StoreError, match=rf"{rel}: missing \(the manifest lists it\)"):
        ChunkStore.open(store_path, verify=verify)


@pytest.mark.parametrize("position, match", [(0, "damaged .npy header"),  # magic string
                                             (30, "damaged .npy header|the file holds shape")])
def test_damaged_npy_header_is_refused(store_path, position, match):
    flip_byte(store_path / "src.npy", position)
    with pytest.raises(StoreError, match=match):
        ChunkStore.open(store_path, verify="lazy")


def test_header_swapped_for_another_shape_is_refused(store_path):
    # Same byte size, different header: an int64 [E/2] array in place of int32 [E].
    s = ChunkStore.open(store_path)
    e = s.num_edges
    if e % 2:
        pytest.skip("needs an even edge count")
    np.save(store_path / "src.npy", np.zeros(e // 2, dtype=np.int64))
    with pytest.raises(StoreError, match=rf"src.npy: the file holds shape \[{e // 2}\] dtype int64 "
                                         rf"but the manifest records shape \[{e}\] dtype int32"):
        ChunkStore.open(store_path, verify="lazy")


def edit_manifest(path, edit, resign=True):
    mpath = path / "manifest.json"
    m = json.loads(mpath.read_text())
    edit(m)
    if resign:
        m["manifest_sha256"] = _manifest_digest(m)
    mpath.write_text(json.dumps(m))


def set_files(rel, key, value):
    def edit(m):
        m["files"][rel][key] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(num_intervals=4), r"bounds must be 5 non-decreasing ints .* num_intervals=4"),
    (lambda m: m.update(num_intervals=2, bounds=[0, 30, 60]), r"offsets.npy is listed with shape \[10\]; .*require \[5\]"),
    (lambda m: m.update(num_nodes=61), "bounds must be"),
    (lambda m: m.update(num_edges=m["num_edges"] + 1), r"src.npy is listed with shape"),
    (lambda m: m.update(bounds=[0, 40, 20, 60]), "non-decreasing"),
    (lambda m: m.update(format_version=2), "format version 2 is not supported; this reader reads version 1"),
    (lambda m: m.update(format="zarr"), "not a chunk store manifest"),
    (lambda m: m.update(index_dtype="<f4"), "index_dtype must be int32 or int64"),
    (lambda m: m.update(index_dtype="<i8"), "src.npy is listed with dtype int32; this format stores it as int64"),
    (set_files("eids.npy", "dtype", "<i4"), "eids.npy is listed with dtype int32; this format stores it as int64"),
    (set_files("src.npy", "shape", [3]), r"src.npy is listed with shape \[3\]"),
    (set_files("src.npy", "bytes", 10), "src.npy: longer than written: .* the manifest records 10"),
    (set_files("src.npy", "bytes", 10**6), "src.npy: truncated: .* the manifest records 1000000"),
    (set_files("perm.npy", "sha256", "0" * 64), "perm.npy: sha256 mismatch"),
    (set_files("vertex/x.npy", "shape", [60, 4]), r"vertex/x.npy: the file holds shape \[60, 3\]"),
    (set_files("vertex/x.npy", "shape", [59, 3]), "first dimension must be num_nodes=60"),
    (lambda m: m["files"].pop("perm.npy"), "files has no entry for perm.npy"),
    (lambda m: m["files"].update({"extra.npy": {}}), r"unknown entries \['extra.npy'\]"),
    (lambda m: m.update(vertex_arrays=["x", "y"]), "vertex array 'y' has no entry"),
    (lambda m: m.update(vertex_arrays=["../../etc/passwd"]), "vertex_arrays must be a list of plain names"),
    (lambda m: m.update(ordering=None), "ordering must be the name of the ordering method"),
    (lambda m: m.update(ordering_parts=[0, 5]), "ordering_parts must be null or bounds from 0 to 60"),
])
def test_mismatched_manifest_is_refused(store_path, edit, match):
    edit_manifest(store_path, edit)
    with pytest.raises(StoreError, match=match):
        ChunkStore.open(store_path)


def test_edited_manifest_fails_its_own_checksum(store_path):
    edit_manifest(store_path, lambda m: m.update(num_nodes=61), resign=False)
    with pytest.raises(StoreError, match="manifest's own checksum does not match"):
        ChunkStore.open(store_path)


def test_damaged_manifest_json_is_refused(store_path):
    mpath = store_path / "manifest.json"
    mpath.write_bytes(mpath.read_bytes()[:-20])
    with pytest.raises(StoreError, match="manifest.json: not valid JSON"):
        ChunkStore.open(store_path)


def test_open_errors(tmp_path, store_path):
    with pytest.raises(StoreError, match="the directory does not exist"):
        ChunkStore.open(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        ChunkStore.open(tmp_path / "file")
    with pytest.raises(ValueError, match="verify must be 'full' or 'lazy'"):
        ChunkStore.open(store_path, verify="size")


# ---------------------------------------------------------------- atomic writes
def test_directory_without_manifest_is_incomplete(store_path):
    os.remove(store_path / "manifest.json")
    with pytest.raises(StoreError, match="incomplete store: .* has no manifest.json"):
        ChunkStore.open(store_path)


def test_exception_mid_write_leaves_nothing(tmp_path, graph):
    src, dst, n, x = graph

    def rows():
        yield x[:10]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        ChunkStore.write(tmp_path / "s", grid(src, dst, n), vertex_arrays={"x": rows()},
                         progress=False)
    assert list(tmp_path.iterdir()) == []


CRASH = """
import os, sys
import numpy as np
from partition import ChunkStore

passes = [0]

def blocks():
    passes[0] += 1
    rng = np.random.default_rng(0)
    for k in range(10):
        if passes[0] == {crash_pass} and k == 5:
            os._exit(3)  # a hard crash: no exception handler, no cleanup
        yield rng.integers(0, 100, 50), rng.integers(0, 100, 50)

ChunkStore.write_from_blocks(sys.argv[1], {edges}, 100, num_intervals=3, progress=False,
                             overwrite=True)
"""


def crash_writer(target, edges, crash_pass):
    code = CRASH.format(edges=edges, crash_pass=crash_pass)
    run = subprocess.run([sys.executable, "-c", code, str(target)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr


# A factory's passes with P given: 1 checks and counts, 2 writes the memory-mapped chunk files;
# a generator is spilled in its only pass.
@pytest.mark.parametrize("edges, crash_pass", [("blocks", 1), ("blocks", 2), ("blocks()", 1)])
def test_crash_mid_write_never_leaves_a_valid_looking_store(tmp_path, edges, crash_pass):
    target = tmp_path / "s"
    crash_writer(target, edges, crash_pass)
    assert not target.exists()
    leftovers = list(tmp_path.glob(".s.tmp-*"))
    assert len(leftovers) == 1
    with pytest.raises(StoreError, match="incomplete store"):
        ChunkStore.open(leftovers[0])


def test_crash_while_overwriting_keeps_the_old_store(tmp_path):
    target = tmp_path / "s"
    src, dst = random_graph(100, 300)
    ChunkStore.write_from_blocks(target, [(src, dst)], 100, num_intervals=2, progress=False)
    before = (target / "manifest.json").read_bytes()
    crash_writer(target, "blocks", 2)
    assert (target / "manifest.json").read_bytes() == before
    assert ChunkStore.open(target).num_edges == 300


def test_overwrite_rules(tmp_path, graph):
    src, dst, n, _ = graph
    g2, g3 = grid(src, dst, n, num_intervals=2), grid(src, dst, n, num_intervals=3)
    ChunkStore.write(tmp_path / "s", g2, progress=False)
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        ChunkStore.write(tmp_path / "s", g3, progress=False)
    assert ChunkStore.write(tmp_path / "s", g3, overwrite=True, progress=False).num_intervals == 3
    assert ChunkStore.open(tmp_path / "s").num_intervals == 3
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(FileExistsError, match="refusing to overwrite .*photos: it is not a chunk store"):
        ChunkStore.write(other, g2, overwrite=True, progress=False)
    assert (other / "cat.jpg").read_bytes() == b"meow"
    (tmp_path / "empty").mkdir()
    ChunkStore.write(tmp_path / "empty", g2, overwrite=True, progress=False)
    with pytest.raises(FileNotFoundError, match="parent directory .* does not exist"):
        ChunkStore.write(tmp_path / "a" / "b", g2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "photos", "s"]
