"""Fault injection into every file of a chunk store (manifest, .npy headers, edge and vertex data).

Each fault (a seeded byte flip, overwrite, truncation or extension of one file; see fuzzutil) is
loaded in a child process by one target below, which opens the store and reads all of it. A
fault must be refused with a StoreError naming the file, or load exactly the clean content: never
a signal, never another exception, never a silent change.

- ``Full``, ``Lazy``, ``LazyPread``: the open modes (``verify="full"`` hashes every file at open;
  ``"lazy"`` checks each chunk, vertex array and the ordering at first use; ``mmap=False`` reads
  with pread instead of memory maps).
- ``ResignedFull``, ``ResignedLazy``: the adversary of issue 20: after the damage every checksum
  is recomputed (``store_testutil.resign``), so only the store's own checks of ids and offsets
  stand between the damage and a kernel. A valid-looking edit cannot be told from the original
  there, so these targets return what the store promises about what it hands on (each chunk's
  ids inside its intervals, edge ids rising in [0, E), the ordering a permutation, every edge in
  one chunk) and each chunk's CSR is built as the engine would; out-of-range ids must be refused.

Run alone: ``.venv/bin/python -m pytest tests/fuzz/test_fuzz_store.py -q -s`` (prints the figures).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import fuzzutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "partition"))  # store_testutil

from partition import ChunkStore, StoreError, grid  # noqa: E402
from store_testutil import resign  # noqa: E402

THIS = Path(__file__).resolve()
NUM_NODES, NUM_EDGES, NUM_INTERVALS = 600, 3000, 3


def _write(directory: Path) -> None:
    rng = np.random.default_rng(7)
    # Two dense blocks and a few edges between them: full and near-empty chunks, some empty.
    src = rng.integers(0, NUM_NODES, NUM_EDGES)
    dst = np.where(rng.random(NUM_EDGES) < 0.9, src // 300 * 300 + rng.integers(0, 300, NUM_EDGES),
                   rng.integers(0, NUM_NODES, NUM_EDGES))
    g = grid(src, dst, NUM_NODES, num_intervals=NUM_INTERVALS, ordering="rcm")
    vertex = {"feat": rng.standard_normal((NUM_NODES, 4)).astype(np.float32),
              "label": rng.integers(0, 7, NUM_NODES)}
    # The store is the folder itself, so each file's path names only that file.
    ChunkStore.write(directory, g, vertex_arrays=vertex, overwrite=True, progress=False)


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


class _Store:
    errors = (StoreError,)
    verify, mmap = "full", True

    def make(self, directory: Path) -> list[str]:
        _write(directory)
        return _files(directory)

    def load(self, directory: Path):
        s = ChunkStore.open(directory, verify=self.verify, mmap=self.mmap)
        chunks = [(c.i, c.j, c.src_start, c.src_stop, c.dst_start, c.dst_stop,
                   np.array(c.src), np.array(c.dst), np.array(c.eids))
                  for c in s.chunks(skip_empty=False)]
        flipped = [(c.i, c.j, np.array(c.src), np.array(c.dst)) for c in s.reversed().chunks()]
        return {
            "meta": (s.num_nodes, s.num_edges, s.num_intervals, s.index_dtype.str,
                     s.ordering_method, s.vertex_arrays, repr(s).replace(str(directory), "<dir>")),
            "bounds": s.bounds, "counts": s.counts, "stats": repr(s.stats()),
            "perm": s.ordering.perm, "parts": s.ordering.bounds, "inv": s.ordering.inv,
            "chunks": chunks, "reversed": flipped,
            "vertex": {v: np.array(s.vertex_array(v)) for v in s.vertex_arrays},
            "rows": {v: s.read_rows(v, 100, 400) for v in s.vertex_arrays},
        }


class Full(_Store):
    verify, mmap = "full", True


class Lazy(_Store):
    verify, mmap = "lazy", True


class LazyPread(_Store):
    verify, mmap = "lazy", False


class _Resigned:
    errors = (StoreError,)
    verify = "full"

    def make(self, directory: Path) -> list[str]:
        _write(directory)
        return ["src.npy", "dst.npy", "eids.npy", "offsets.npy", "perm.npy"]

    def load(self, directory: Path):
        resign(directory)  # the damage now passes every checksum
        s = ChunkStore.open(directory, verify=self.verify)
        sizes = np.diff(s.bounds)
        e = s.num_edges
        ok, total = [], 0
        for c in s.chunks(skip_empty=False):
            src, dst, eids = (np.asarray(a, dtype=np.int64) for a in (c.src, c.dst, c.eids))
            ok.append(bool(c.num_src == sizes[c.i] and c.num_dst == sizes[c.j]
                           and np.all((src >= 0) & (src < c.num_src))
                           and np.all((dst >= 0) & (dst < c.num_dst))
                           and np.all((eids >= 0) & (eids < e)) and np.all(np.diff(eids) > 0)))
            total += c.num_edges
            c.csr()  # what the engine builds from it (kernels.CSR checks its ids too)
        perm = s.ordering.perm
        return {"chunks_ok": ok, "every_edge_once": total == e,
                "permutation": bool(np.array_equal(np.sort(perm), np.arange(s.num_nodes)))}


class ResignedFull(_Resigned):
    verify = "full"


class ResignedLazy(_Resigned):
    verify = "lazy"


# (target, faults, seed): 1000 faults in all.
RUNS = [("Full", 250, 101), ("Lazy", 200, 102), ("LazyPread", 150, 103),
        ("ResignedFull", 250, 104), ("ResignedLazy", 150, 105)]


@pytest.mark.parametrize("target, count, seed", RUNS, ids=[r[0] for r in RUNS])
def test_store_faults_are_refused_or_harmless(target, count, seed):
    report = fuzzutil.check(f"{THIS}::{target}", count=count, seed=seed)
    assert report.counts["refused"] > 0
