"""Chunk store integrity (issue 20): ids checked before a chunk is handed on, every damaged header
a StoreError, concurrent writers, and a kill between the two renames of an overwrite."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from partition import ChunkStore, StoreError, grid
from partition_testutil import planted_partition
from store_testutil import resign

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store_path(tmp_path):
    src, dst, n, _ = planted_partition(blocks=3, size=20, seed=4)
    x = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    ChunkStore.write(tmp_path / "s", grid(src, dst, n, num_intervals=3, ordering="rcm"),
                     vertex_arrays={"x": x}, progress=False)
    return tmp_path / "s"


def everything(s):
    """All a reader can get from a store, as plain arrays."""
    out = [s.bounds, s.counts, s.ordering.perm]
    for c in s.chunks(skip_empty=False):
        out += [np.array(c.src), np.array(c.dst), np.array(c.eids)]
    out += [np.array(s.vertex_array(v)) for v in s.vertex_arrays]
    return out


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(a, b))


# ---------------------------------------------------------------- ids checked before use
def busiest_chunk(path):
    s = ChunkStore.open(path)
    i, j = (int(v) for v in np.unravel_index(np.argmax(s.counts), s.counts.shape))
    k = j * s.num_intervals + i
    lo = int(s._offsets[k])
    return s, i, j, lo


def poke(path, rel, slot, value):
    a = np.load(path / rel, mmap_mode="r+")
    a[slot] = value
    a.flush()
    del a


# (file, value written at the chunk's first slot (or a function of the store), expected message)
BAD_IDS = [
    ("src.npy", lambda s, i, j, lo: int(np.diff(s.bounds)[i]),
     r"local source id (\d+) at edge slot \d+; expected ids in \[0, \1\)"),
    ("src.npy", lambda s, i, j, lo: -1, r"local source id -1 at edge slot"),
    ("dst.npy", lambda s, i, j, lo: 2**31 - 1, r"local destination id 2147483647 at edge slot"),
    ("eids.npy", lambda s, i, j, lo: s.num_edges, r"edge id (\d+) at edge slot \d+; expected ids "
                                                  r"in \[0, \1\)"),
    ("eids.npy", lambda s, i, j, lo: -5, "edge id -5 at edge slot"),
    ("eids.npy", lambda s, i, j, lo: int(s._eids[lo + 1]),
     r"edge ids (\d+), \1 at edge slots \d+, \d+; expected strictly increasing ids in a chunk"),
]


@pytest.mark.parametrize("rel, value, match", BAD_IDS)
@pytest.mark.parametrize("verify, mmap", [("full", True), ("full", False), ("lazy", True),
                                          ("lazy", False)])
def test_out_of_range_id_is_refused_even_with_recomputed_checksums(store_path, rel, value,
                                                                   match, verify, mmap):
    s, i, j, lo = busiest_chunk(store_path)
    poke(store_path, rel, lo, value(s, i, j, lo))
    del s
    resign(store_path)  # the checksums all match: only the ids' own check can refuse it
    where = rf"{rel}: chunk \({i}, {j}\), edge slots \[{lo}, \d+\) in offsets.npy, holds "
    if verify == "full":
        with pytest.raises(StoreError, match=where + match):
            ChunkStore.open(store_path, verify=verify, mmap=mmap)
        return
    s = ChunkStore.open(store_path, verify=verify, mmap=mmap)
    p = s.num_intervals
    for a, b in np.ndindex(p, p):  # every other chunk loads
        if (a, b) != (i, j):
            assert s.chunk(a, b).num_edges == s.counts[a, b]
    for _ in range(2):  # refused at every load, not once
        with pytest.raises(StoreError, match=where + match):
            s.chunk(i, j)
    with pytest.raises(StoreError, match=where + match):
        s.reversed().chunk(j, i)
    with pytest.raises(StoreError, match=where + match):
        list(s.chunks("row"))


def test_moved_chunk_boundaries_are_refused(store_path):
    # offsets still rise from 0 to E, but chunk 0 now claims every edge: its ids come from
    # several chunks, so edge ids fall (and ids may leave interval 0).
    off = np.load(store_path / "offsets.npy")
    off[1:] = off[-1]
    np.save(store_path / "offsets.npy", off)
    resign(store_path)
    with pytest.raises(StoreError, match=r"chunk \(0, 0\), edge slots \[0, \d+\) in offsets.npy"):
        ChunkStore.open(store_path)
    s = ChunkStore.open(store_path, verify="lazy")
    with pytest.raises(StoreError, match=r"offsets.npy, holds .*; expected"):
        s.chunk(0, 0)


def test_in_range_edit_with_recomputed_checksums_loads(store_path):
    # What the checks cannot see (a valid id replaced by another valid one) loads as written:
    # the checks are about memory safety, the checksums about accidents.
    s, i, j, lo = busiest_chunk(store_path)
    poke(store_path, "src.npy", lo, 0)
    resign(store_path)
    assert ChunkStore.open(store_path).chunk(i, j).src[0] == 0


# ---------------------------------------------------------------- damaged .npy headers
def header_end(path):
    return path.read_bytes().index(b"\n") + 1


def test_header_that_numpy_cannot_tokenize_is_a_store_error(store_path):
    # numpy retries a header that ast cannot parse through tokenize: '(' in the padding escaped
    # as tokenize.TokenError ("EOF in multi-line statement").
    path = store_path / "src.npy"
    data = bytearray(path.read_bytes())
    data[header_end(path) - 2] = ord("(")
    path.write_bytes(data)
    with pytest.raises(StoreError, match=r"src.npy: damaged .npy header \(TokenError"):
        ChunkStore.open(store_path, verify="lazy")


@pytest.mark.parametrize("rel", ["src.npy", "eids.npy", "offsets.npy", "vertex/x.npy"])
def test_every_bit_flip_in_a_header_is_refused_or_harmless(store_path, rel):
    # Before: 642 of the 2 x 1024 flips of src.npy and vertex/x.npy escaped as TokenError or
    # SyntaxError.
    clean = everything(ChunkStore.open(store_path))
    path = store_path / rel
    data = path.read_bytes()
    refused = 0
    for pos in range(header_end(path)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[pos] ^= 1 << bit
            path.write_bytes(damaged)
            try:
                got = everything(ChunkStore.open(store_path, verify="lazy"))
            except StoreError as e:
                assert rel in str(e), (pos, bit, e)
                refused += 1
            else:
                assert same(got, clean), (pos, bit)
    path.write_bytes(data)
    assert refused > 0.9 * 8 * header_end(path)


# ---------------------------------------------------------------- concurrent writers
RACER = r"""
import sys, time
from pathlib import Path
import numpy as np
from partition import ChunkStore, grid

base, me = Path(sys.argv[1]), int(sys.argv[2])
rounds, overwrite = int(sys.argv[3]), sys.argv[4] == "1"
src, dst = np.random.default_rng(me).integers(0, 300, (2, 3000 + me))
g = grid(src, dst, 300, num_intervals=2)
for k in range(rounds):
    (base / f"ready-{k}-{me}").touch()
    deadline = time.monotonic() + 60
    while not all((base / f"ready-{k}-{w}").exists() for w in (0, 1)):  # a barrier
        if time.monotonic() > deadline:
            sys.exit("barrier timed out")
        time.sleep(0.0002)
    try:
        ChunkStore.write(base / f"s{k}", g, overwrite=overwrite, progress=False)
        print(k, "ok", flush=True)
    except FileExistsError as e:
        print(k, "exists", e, flush=True)
    except Exception as e:  # reported, and the next round still meets the other writer
        print(k, "error", type(e).__name__, e, flush=True)
"""


def race(base, rounds, overwrite):
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(base), str(me), str(rounds),
                               "1" if overwrite else "0"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for me in (0, 1)]
    outcomes = {}
    try:
        for me, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            for line in out.splitlines():
                k, what = line.split()[:2]
                outcomes[int(k), me] = what
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outcomes


def test_two_writers_without_overwrite_one_wins_and_its_store_stays(tmp_path):
    # Before: both writers succeeded in 16 of 16 rounds, the second replacing the first's store.
    rounds = 12
    outcomes = race(tmp_path, rounds, overwrite=False)
    for k in range(rounds):
        got = sorted(outcomes[k, me] for me in (0, 1))
        assert got == ["exists", "ok"], (k, got)
        winner = [me for me in (0, 1) if outcomes[k, me] == "ok"][0]
        assert ChunkStore.open(tmp_path / f"s{k}").num_edges == 3000 + winner
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_two_writers_with_overwrite_both_succeed_and_one_store_stays(tmp_path):
    rounds = 6
    outcomes = race(tmp_path, rounds, overwrite=True)
    assert set(outcomes.values()) == {"ok"}
    for k in range(rounds):
        assert ChunkStore.open(tmp_path / f"s{k}").num_edges in (3000, 3001)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- killed writers
KILLED = r"""
import os, sys
from pathlib import Path
import numpy as np
from partition import ChunkStore, grid

target = Path(sys.argv[1])
real_rename = os.rename

def rename(a, b):
    if Path(a).parent == target.parent and Path(a).name.startswith(f".{target.name}.tmp-"):
        os._exit(7)  # killed just before the finished store would move to its path
    real_rename(a, b)

os.rename = rename
src, dst = np.random.default_rng(1).integers(0, 100, (2, 400))
ChunkStore.write(target, grid(src, dst, 100, num_intervals=2), overwrite=True, progress=False)
"""


def killed_writer(target):
    run = subprocess.run([sys.executable, "-c", KILLED, str(target)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 7, run.stderr


def hidden(path):
    return sorted(p.name.split("-")[0] for p in path.parent.iterdir() if p.name.startswith("."))


def test_kill_between_the_renames_of_an_overwrite_keeps_the_old_store(store_path):
    clean = everything(ChunkStore.open(store_path))
    killed_writer(store_path)  # the old store was renamed aside, the new one not yet in place
    assert not store_path.exists()
    assert hidden(store_path) == [".s.old", ".s.tmp"]
    # Before: StoreError "no chunk store at ...: the directory does not exist".
    s = ChunkStore.open(store_path)
    assert same(everything(s), clean)
    assert hidden(store_path) == [".s.tmp"]  # the killed writer's folder, for the next writer


def test_next_writer_restores_the_old_store_and_removes_leftovers(store_path):
    clean = everything(ChunkStore.open(store_path))
    killed_writer(store_path)
    src, dst = np.random.default_rng(2).integers(0, 10, (2, 30))
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        ChunkStore.write(store_path, grid(src, dst, 10), progress=False)
    assert same(everything(ChunkStore.open(store_path)), clean)
    assert hidden(store_path) == []
    killed_writer(store_path)
    assert ChunkStore.write(store_path, grid(src, dst, 10), overwrite=True,
                            progress=False).num_edges == 30
    assert hidden(store_path) == []


def test_temporary_folders_never_open_as_a_store(tmp_path):
    target = tmp_path / "s"
    killed_writer(target)  # nothing to set aside: killed just before the only rename
    assert not target.exists()
    [tmp] = [p for p in tmp_path.iterdir()]
    assert (tmp / "manifest.json").is_file()  # the folder is complete...
    with pytest.raises(StoreError, match=rf"incomplete store: .*{tmp.name} is the temporary "
                                         rf"folder of a write to .*s \(unfinished"):
        ChunkStore.open(tmp)  # ...but only ever a store under its final name
    with pytest.raises(StoreError, match="the directory does not exist"):
        ChunkStore.open(target)
    aside = tmp_path / ".s.old-123-0123abcd"
    tmp.rename(aside)
    with pytest.raises(StoreError, match="is the previous store that an overwrite of .* set aside"):
        ChunkStore.open(aside)


SLOW = r"""
import sys, time
from pathlib import Path
import numpy as np
from partition import ChunkStore

target, go = Path(sys.argv[1]), Path(sys.argv[2])

def blocks():  # a one-shot stream that stalls halfway until the test says go
    yield np.arange(50), np.arange(50)[::-1]
    (go.parent / "waiting").touch()
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit("never told to go on")
        time.sleep(0.01)
    yield np.arange(50), np.zeros(50, dtype=np.int64)

ChunkStore.write_from_blocks(target, blocks(), 50, num_intervals=2, overwrite=True,
                             progress=False)
"""


def test_a_running_writers_folder_is_left_alone(tmp_path):
    target, go = tmp_path / "stores" / "s", tmp_path / "go"
    target.parent.mkdir()
    slow = subprocess.Popen([sys.executable, "-c", SLOW, str(target), str(go)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "waiting").exists():
            assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
            time.sleep(0.01)
        [running] = [p for p in target.parent.iterdir()]
        src, dst = np.random.default_rng(3).integers(0, 10, (2, 30))
        ChunkStore.write(target, grid(src, dst, 10), overwrite=True, progress=False)
        assert running.is_dir() and hidden(target) == [".s.tmp"]
        go.touch()
        out, err = slow.communicate(timeout=60)
        assert slow.returncode == 0, err
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.communicate()
    assert ChunkStore.open(target).num_edges == 100
    assert hidden(target) == []


def test_deeply_nested_manifest_is_a_store_error(store_path):
    # Before: RecursionError from json.loads.
    (store_path / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(StoreError, match=r"manifest.json: not valid JSON \(RecursionError"):
        ChunkStore.open(store_path)
