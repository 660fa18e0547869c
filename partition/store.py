"""On-disk chunk store: a chunk grid (and vertex arrays) as memory-mapped ``.npy`` files.

Layout of a store directory (format version 1)::

    manifest.json         everything below, with shapes, dtypes, sizes and sha256 of each file
    offsets.npy           [P*P + 1] int64: chunk (i, j) is edge slot range offsets[k]:offsets[k+1]
                          with k = j * P + i (column-major, the order forward streaming reads)
    src.npy, dst.npy      [E] int32/int64: local source / destination id of each edge slot
    eids.npy              [E] int64: original edge id of each edge slot (increasing in a chunk)
    chunk_sha256.npy      [P*P, 32] uint8: sha256 of chunk k's bytes src || dst || eids
    perm.npy              [N] int64: the ordering, new id -> original id
    vertex/<name>.npy     [N, ...]: vertex arrays, rows in new-id order (interval i is
                          rows bounds[i]:bounds[i+1])

Integrity: opening always checks the manifest's own checksum, that every listed file exists with
the recorded byte size, a parseable ``.npy`` header, shape and dtype, and that the shapes agree
with N, E and P. ``verify="full"`` (default) also checks every file's sha256 and every chunk's
ids; ``verify="lazy"`` defers the sha256 of big files to their first use (a chunk's own checksum
when it is first loaded, a vertex array's or the ordering's when first requested). Checksums
only catch accidents: a store whose checksums were recomputed after an edit passes them. So
every chunk load also checks the ids before the arrays are handed on (to a kernel that does not
range-check them): local ``src`` in ``[0, |interval i|)``, ``dst`` in ``[0, |interval j|)``,
``eids`` strictly increasing in ``[0, E)``. That costs about 1 ns per edge plus ~10 us per chunk
(measured on 4M edges in 16 chunks: loading all chunks takes +2.6 ms on 35 ms with
``mmap=False``, +6.4 ms with ``mmap=True``, where the check is the first touch of the mapped
pages; a full open 41 -> 46 ms, the check sharing the hashing pass). Any failure raises
:class:`StoreError` naming the file.

Memory: by default (``open(..., mmap=True)``) the edge files are memory-mapped and chunks are
views into them. Pages of a mapping that were touched count in the process's resident set
(``RssFile``) for as long as the file stays mapped, so streaming a store bigger than RAM through
the maps makes the measured peak RSS grow to the store's size even though the kernel could drop
those pages. ``open(..., mmap=False)`` maps nothing big: each chunk is read with ``pread`` into
fresh arrays, which are freed with the chunk, so the resident set holds only the chunks in use
(the file data sits in the page cache, which is not part of any process's RSS).
:meth:`ChunkStore.read_rows` reads a row block of a vertex array the same way, in either mode.

Atomicity: a store is written into a hidden sibling directory ``.<name>.tmp-<pid>-<token>``, each
file is fsynced, ``manifest.json`` is written last, and only then is the directory renamed to its
final name; an overwrite first renames the previous store aside (``.<name>.old-<pid>-<token>``).
Writers take an exclusive ``flock`` on the parent directory to re-check the final path and swap,
so of two writers with ``overwrite=False`` exactly one succeeds. A crash leaves either no store or
the previous store at the final path, or, killed between the two renames of an overwrite, the
previous store aside: :meth:`ChunkStore.open` and the next writer rename it back. The next writer
deletes leftovers: folders set aside and temporary folders whose writer is gone (each running
writer holds a ``flock`` on its own). A hidden folder never opens as a store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ._edges import as_edges, check_count
from .chunk_grid import (Chunk, ChunkGrid, ChunkSource, CostModel, chunk_order, count_keys,
                         index_dtype_for, interval_bounds, interval_of, search_num_intervals)
from .ordering import Ordering
from .units import parse_bytes

__all__ = ["ChunkStore", "StoreError", "FORMAT", "FORMAT_VERSION"]

FORMAT = "ngra-chunk-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_HASH_BLOCK = 1 << 20  # bytes hashed per read, and bytes per block when copying vertex arrays
# Files read whole at open and always hash-checked: they are O(P^2) and everything depends on them.
_SMALL_FILES = ("offsets.npy", "chunk_sha256.npy")
_EDGE_FILES = ("src.npy", "dst.npy", "eids.npy")
_CHECK_BLOCK = 1 << 16  # edge slots read per block by verify(): hashed and id-checked together
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
# The hidden siblings of a store at <dir>/<name> while it is written: .<name>.tmp-<pid>-<token>
# (being written) and .<name>.old-<pid>-<token> (the previous store, set aside by an overwrite).
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


class StoreError(ValueError):
    """A chunk store that is incomplete, damaged or inconsistent with its manifest."""


def _progress(enabled: bool, **kw):
    # disable=None lets tqdm show bars on a terminal only, so logs and CI stay clean.
    return tqdm(disable=None if enabled else True, **kw)


class ChunkStore(ChunkSource):
    """A chunk grid on disk. Same reading interface as :class:`~partition.ChunkGrid`
    (``num_nodes``, ``num_edges``, ``num_intervals``, ``bounds``, ``counts``, ``ordering``,
    ``chunk(i, j)``, ``chunks(order)``, ``stats()``), with memory-mapped, read-only arrays.

    Make one with :meth:`write` (from an in-memory grid) or :meth:`write_from_blocks` (from a
    stream of edge blocks, never holding the edge list in memory); read it with :meth:`open`.
    """

    # ------------------------------------------------------------------ reading
    def __init__(self, path: Path, manifest: dict, verify: str, mmap: bool = True):
        self.path = path
        self.manifest = manifest
        self.verify_mode = verify
        self.mmap = mmap
        self.num_nodes = manifest["num_nodes"]
        self.num_edges = manifest["num_edges"]
        self.num_intervals = manifest["num_intervals"]
        self.bounds = np.asarray(manifest["bounds"], dtype=np.int64)
        self._sizes = np.diff(self.bounds).tolist()  # interval sizes, as ints for quick compares
        self.index_dtype = np.dtype(manifest["index_dtype"])
        self._offsets = self._load("offsets.npy")
        self._chunk_sha = self._load("chunk_sha256.npy")
        p = self.num_intervals
        self.counts = np.diff(self._offsets).reshape(p, p).T.copy()
        big = self._load if mmap else self._reader
        self._src = big("src.npy")
        self._dst = big("dst.npy")
        self._eids = big("eids.npy")
        # In lazy mode a chunk is hash-checked the first time it is read; in full mode the whole
        # files already were.
        self._chunk_ok = np.full(p * p, verify == "full", dtype=bool)
        self._file_ok = {name: verify == "full" or name in _SMALL_FILES  # open() hashed these
                         for name in manifest["files"]}
        self._ordering = None

    @classmethod
    def open(cls, path, *, verify: str = "full", mmap: bool = True) -> "ChunkStore":
        """Open the store at ``path``; ``verify`` is ``"full"`` or ``"lazy"`` (module docstring).

        ``mmap=False`` reads chunks with ``pread`` into fresh arrays instead of mapping the edge
        files, so the resident memory holds only the chunks in use (module docstring).

        Raises :class:`StoreError` naming the file and the problem when the store is incomplete
        (no manifest), damaged (size, header or checksum mismatch, missing file) or inconsistent.
        """
        if verify not in ("full", "lazy"):
            raise ValueError(f"verify must be 'full' or 'lazy' (got {verify!r})")
        if not isinstance(mmap, bool):
            raise TypeError(f"mmap must be True or False (got {mmap!r})")
        path = Path(path)
        hidden = _HIDDEN.match(path.name)
        if hidden:
            final = path.parent / hidden["name"]
            if hidden["kind"] == "tmp":
                raise StoreError(f"incomplete store: {path} is the temporary folder of a write "
                                 f"to {final} (unfinished, crashed or still running), never a "
                                 f"store; open {final}")
            raise StoreError(f"{path} is the previous store that an overwrite of {final} set "
                             f"aside, not a store to open; open {final} (which moves it back "
                             f"if that overwrite was interrupted)")
        if not (path.exists() or path.is_symlink()):
            _restore_for_reader(path)
        manifest = _read_manifest(path)
        _check_files(path, manifest)
        for rel in _SMALL_FILES:
            _check_sha(path, manifest, rel)
        store = cls(path, manifest, verify, mmap)
        store._check_offsets()
        if verify == "full":
            store.verify()
        return store

    def verify(self) -> None:
        """Check the sha256 of every file and the ids of every chunk now (what
        ``open(verify="full")`` does)."""
        for rel in self.manifest["files"]:
            if rel not in _EDGE_FILES:
                _check_sha(self.path, self.manifest, rel)
                self._file_ok[rel] = True
        self._verify_edges()
        for rel in _EDGE_FILES:
            self._file_ok[rel] = True
        self._chunk_ok[:] = True

    @property
    def ordering(self) -> Ordering:
        """The vertex ordering (``perm`` read from ``perm.npy``, ``inv`` computed once)."""
        if self._ordering is None:
            self._require_sha("perm.npy")
            parts = self.manifest["ordering_parts"]
            try:
                perm = (np.array(self._load("perm.npy")) if self.mmap
                        else self._reader("perm.npy").read(0, self.num_nodes))
                self._ordering = Ordering(perm,
                                          method=self.manifest["ordering"], bounds=parts)
            except ValueError as e:
                raise StoreError(f"{self.path / 'perm.npy'}: not a valid ordering ({e})") from e
        return self._ordering

    @property
    def vertex_arrays(self) -> tuple[str, ...]:
        """Names of the stored vertex arrays."""
        return tuple(self.manifest["vertex_arrays"])

    def vertex_array(self, name: str) -> np.ndarray:
        """Vertex array ``name`` [N, ...], read-only memory map, rows in new-id order."""
        if name not in self.manifest["vertex_arrays"]:
            raise KeyError(f"no vertex array {name!r} in {self.path}; it has "
                           f"{list(self.manifest['vertex_arrays'])}")
        rel = f"vertex/{name}.npy"
        self._require_sha(rel)
        return self._load(rel)

    def reversed(self) -> "ChunkStore":
        """This store's graph with every edge ``u -> v`` read as ``v -> u`` (the transpose).

        A view, nothing is copied: chunk ``(i, j)`` of the view is chunk ``(j, i)`` of this store
        with ``src`` and ``dst`` swapped (same edge ids, same ordering, intervals and vertex
        arrays, same checksum checks); ``counts`` is transposed. ``view.reversed()`` is this
        store. Streaming a vertex program over the view computes with ``A^T``, e.g. the
        backward of a linear propagation ``A h``.
        """
        return _ReversedStore(self)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of vertex array ``name`` (new-id order) as a new, writable array
        [stop - start, ...], read with ``pread``: nothing stays mapped, so unlike slicing
        :meth:`vertex_array` the pages read do not stay in this process's resident set."""
        if name not in self.manifest["vertex_arrays"]:
            raise KeyError(f"no vertex array {name!r} in {self.path}; it has "
                           f"{list(self.manifest['vertex_arrays'])}")
        n = self.num_nodes
        for what, v in (("start", start), ("stop", stop)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what} must be an int (got {v!r})")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"rows {start}:{stop} out of range for vertex array {name!r} with "
                             f"{n} rows; need 0 <= start <= stop <= {n}")
        rel = f"vertex/{name}.npy"
        self._require_sha(rel)
        return self._reader(rel).read(int(start), int(stop))

    def _chunk_arrays(self, i, j):
        lo, hi = self._chunk_slice(i, j)
        if self.mmap:
            src, dst, eids = self._src[lo:hi], self._dst[lo:hi], self._eids[lo:hi]
        else:
            src, dst, eids = (f.read(lo, hi) for f in (self._src, self._dst, self._eids))
        k = j * self.num_intervals + i
        if not self._chunk_ok[k]:
            h = hashlib.sha256()
            for a in (src, dst, eids):
                h.update(memoryview(a).cast("B"))
            if h.digest() != self._chunk_sha[k].tobytes():
                raise StoreError(
                    f"{self.path}: chunk ({i}, {j}) failed its sha256 check: edge slots "
                    f"[{lo}, {hi}) of src.npy, dst.npy or eids.npy were changed on disk"
                )
            self._chunk_ok[k] = True
        # Every load, not once: the arrays are what is handed on, and a mapped file can change.
        if hi > lo:
            s, d, e = np.asarray(src), np.asarray(dst), np.asarray(eids)
            # One max per array: read as unsigned, a negative id is huge. Rising edge ids lie
            # in [eids[0], eids[-1]]. On any doubt _check_ids finds the culprit and raises.
            if (_unsigned(s).max() >= self._sizes[i] or _unsigned(d).max() >= self._sizes[j]
                    or e[0] < 0 or e[-1] >= self.num_edges or not (e[1:] > e[:-1]).all()):
                self._check_ids(np.array([k]), np.zeros(1, dtype=np.int64), lo, s, d, e)
        return src, dst, eids

    def _check_ids(self, ks: np.ndarray, starts: np.ndarray, lo: int, src, dst, eids,
                   before: int | None = None) -> None:
        """Refuse ids that would take a kernel out of bounds: ``0 <= src < |interval i|``,
        ``0 <= dst < |interval j|`` and ``eids`` strictly increasing in ``[0, E)`` within each
        chunk ``(i, j)``. The arrays hold edge slots ``lo:lo + len``; segment
        ``starts[s]:starts[s + 1]`` of them lies in chunk ``ks[s]`` (``k = j * P + i``), and
        every segment but the first starts its chunk. ``before``: the edge id in slot
        ``lo - 1`` when it is in the same chunk as slot ``lo``.

        The checksums cannot promise this: they only say the bytes are those the manifest
        describes, and a manifest can be rewritten with new ones. Cost: a min and a max per
        array and one comparison of neighbouring edge ids, ~1 ns per edge (module docstring)."""
        if src.shape[0] == 0:
            return
        p, e = self.num_intervals, self.num_edges
        sizes = np.diff(self.bounds)
        src, dst, eids = np.asarray(src), np.asarray(dst), np.asarray(eids)
        for rel, a, iv, role in (("src.npy", src, ks % p, "source"),
                                 ("dst.npy", dst, ks // p, "destination")):
            n = sizes[iv]
            bad = np.maximum.reduceat(_unsigned(a), starts) >= n.astype(np.uint64)
            if bad.any():
                s = int(np.flatnonzero(bad)[0])
                at = int(starts[s]) + int(np.flatnonzero((a[starts[s]:] < 0)
                                                         | (a[starts[s]:] >= n[s]))[0])
                raise StoreError(self._bad_chunk(
                    rel, int(ks[s]), f"local {role} id {int(a[at])} at edge slot {lo + at}; "
                    f"expected ids in [0, {int(n[s])}), the size of interval {int(iv[s])}"))
        bad = (np.minimum.reduceat(eids, starts) < 0) | (np.maximum.reduceat(eids, starts) >= e)
        rising = eids[1:] > eids[:-1]
        rising[starts[1:] - 1] = True  # the first edge of a chunk may have any id
        if before is not None and not eids[0] > before:
            raise StoreError(self._bad_chunk("eids.npy", int(ks[0]), self._falling(
                before, int(eids[0]), lo - 1)))
        if bad.any() or not rising.all():
            at = int(np.flatnonzero((eids < 0) | (eids >= e) | np.append(~rising, False))[0])
            k = int(ks[np.searchsorted(starts, at, side="right") - 1])
            what = (f"edge id {int(eids[at])} at edge slot {lo + at}; expected ids in [0, {e})"
                    if not 0 <= eids[at] < e else
                    self._falling(int(eids[at]), int(eids[at + 1]), lo + at))
            raise StoreError(self._bad_chunk("eids.npy", k, what))

    @staticmethod
    def _falling(a: int, b: int, slot: int) -> str:
        return (f"edge ids {a}, {b} at edge slots {slot}, {slot + 1}; expected strictly "
                f"increasing ids in a chunk")

    def _bad_chunk(self, rel: str, k: int, what: str) -> str:
        p = self.num_intervals
        lo, hi = int(self._offsets[k]), int(self._offsets[k + 1])
        return (f"{self.path / rel}: chunk ({k % p}, {k // p}), edge slots [{lo}, {hi}) in "
                f"offsets.npy, holds {what}. The store is damaged although its checksums "
                f"match (they were recomputed, or its writer was faulty); write it again")

    def _verify_edges(self) -> None:
        """The sha256 of the edge files and :meth:`_check_ids` of every chunk in one pass,
        reading the files in blocks of ``_CHECK_BLOCK`` slots with ``pread`` (nothing stays
        mapped, and a block stays in cache while it is hashed and checked). A checksum
        mismatch is reported before a bad id: it says more."""
        readers = [self._reader(rel) for rel in _EDGE_FILES]
        hashes = []
        for r in readers:
            with open(r.path, "rb") as f:
                hashes.append(hashlib.sha256(f.read(r.offset)))
        off = np.asarray(self._offsets)
        bad_ids, last = None, None
        for lo in range(0, self.num_edges, _CHECK_BLOCK):
            hi = min(lo + _CHECK_BLOCK, self.num_edges)
            arrays = [r.read(lo, hi) for r in readers]
            for h, arr in zip(hashes, arrays):
                h.update(memoryview(arr).cast("B"))
            if bad_ids is None:
                # Segments: the block split where chunks start (empty chunks start nowhere).
                inner = off[np.searchsorted(off, lo, side="right"):
                            np.searchsorted(off, hi, side="left")]
                starts = np.unique(np.append(inner - lo, 0))
                ks = np.searchsorted(off, lo + starts, side="right") - 1
                try:
                    self._check_ids(ks, starts, lo, *arrays,
                                    before=None if off[ks[0]] == lo else last)
                except StoreError as e:
                    bad_ids = e
            last = int(arrays[2][-1])
        for rel, h in zip(_EDGE_FILES, hashes):
            _compare_sha(self.path, self.manifest, rel, h.hexdigest())
        if bad_ids is not None:
            raise bad_ids

    def _load(self, rel: str) -> np.ndarray:
        try:
            return np.load(self.path / rel, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - header parsing escapes in many types (_npy_header)
            raise StoreError(f"{self.path / rel}: cannot be read as .npy ({e})") from e

    def _reader(self, rel: str) -> "_RowReader":
        info = self.manifest["files"][rel]
        try:
            with open(self.path / rel, "rb") as f:
                offset = _npy_data_offset(f)
        except (OSError, ValueError) as e:
            raise StoreError(f"{self.path / rel}: cannot be read as .npy ({e})") from e
        return _RowReader(self.path / rel, offset, tuple(info["shape"]), np.dtype(info["dtype"]))

    def _require_sha(self, rel: str) -> None:
        if not self._file_ok[rel]:
            _check_sha(self.path, self.manifest, rel)
            self._file_ok[rel] = True

    @property
    def ordering_method(self) -> str:
        return self.manifest["ordering"]

    def _check_offsets(self) -> None:
        off = np.asarray(self._offsets)
        if off[0] != 0 or off[-1] != self.num_edges or np.any(np.diff(off) < 0):
            raise StoreError(f"{self.path / 'offsets.npy'}: chunk offsets must rise from 0 to "
                             f"num_edges={self.num_edges}")

    def __repr__(self) -> str:
        return (f"ChunkStore({str(self.path)!r}, num_nodes={self.num_nodes}, "
                f"num_edges={self.num_edges}, num_intervals={self.num_intervals}, "
                f"ordering={self.manifest['ordering']!r}, vertex_arrays={self.vertex_arrays}"
                f"{'' if self.mmap else ', mmap=False'})")

    # ------------------------------------------------------------------ writing
    @classmethod
    def write(cls, path, grid: ChunkGrid, *, vertex_arrays=None, overwrite: bool = False,
              progress: bool = True) -> "ChunkStore":
        """Write an in-memory :class:`~partition.ChunkGrid` (and vertex arrays) to ``path``.

        ``vertex_arrays``: mapping name -> data in *original* vertex order, either an array
        [N, ...] (numpy, memmap or CPU tensor) or an iterable of row blocks / a callable
        returning one; rows are permuted to new-id order as they are written.
        ``overwrite`` replaces an existing store (only a chunk store, never another directory).
        Returns the store opened with ``verify="lazy"`` (it was just hashed while writing).
        """
        if not isinstance(grid, ChunkGrid):
            raise TypeError(f"grid must be a partition.ChunkGrid (got {type(grid).__name__}); "
                            f"for edge streams use ChunkStore.write_from_blocks")
        with _Writer(path, overwrite) as w:
            e, idx = grid.num_edges, grid.index_dtype
            arrays = {name: w.create(f"{name}.npy", (e,), dtype)
                      for name, dtype in (("src", idx), ("dst", idx), ("eids", np.int64))}
            for name, source in (("src", grid._src), ("dst", grid._dst), ("eids", grid._eids)):
                arrays[name][:] = source
            w.finish_edges(arrays, grid._offsets, progress)
            w.finish(grid.num_nodes, grid.bounds, grid.ordering, vertex_arrays, progress)
        return w.store

    @classmethod
    def write_from_blocks(cls, path, edge_blocks, num_nodes: int, *,
                          num_intervals: int | None = None, memory_budget=None,
                          cost: CostModel | None = None, ordering: Ordering | None = None,
                          vertex_arrays=None, overwrite: bool = False, block_size: int = 1 << 20,
                          progress: bool = True) -> "ChunkStore":
        """Write a store from edge blocks without holding the edge list in memory.

        ``edge_blocks`` yields ``(src, dst)`` pairs of 1-D integer arrays (original vertex ids);
        edge ids are positions in the concatenation of the blocks. It is either

        - a callable returning a fresh iterator (e.g. a generator function with its arguments
          bound): it is run once per pass over the edges and must yield the same edges each
          time (checked: a different stream is refused), or
        - a one-shot iterable (a generator): its blocks are spilled once to temporary files
          next to the store (16 bytes per edge), and the passes read the spill.

        Passes: one to check ids and count edges per chunk, with ``memory_budget`` one more per
        P tried (as in :func:`partition.grid`: budget + :class:`CostModel`), then one that
        writes each edge straight into its slot of the memory-mapped ``src/dst/eids.npy``.
        Memory: O(N) for the ordering, O(P**2) for chunk counts, O(block) for one block.

        ``ordering``: ``None`` (user ids) or an :class:`~partition.Ordering` computed beforehand
        (orderings need the whole adjacency, so none is computed from a stream). Exactly one of
        ``num_intervals`` / ``memory_budget`` may be given (neither: P = 1). ``block_size``
        is the number of edges per block read back from a spill. Returns the store opened
        with ``verify="lazy"``.
        """
        num_nodes = check_count(num_nodes, "num_nodes")
        if num_intervals is not None and memory_budget is not None:
            raise ValueError(f"give num_intervals ({num_intervals}) or memory_budget "
                             f"({memory_budget!r}), not both")
        if memory_budget is not None and not isinstance(cost, CostModel):
            raise ValueError("memory_budget needs a cost model: pass cost=CostModel(...)")
        if memory_budget is None and cost is not None:
            raise ValueError("cost is only used to choose P from memory_budget; pass "
                             "memory_budget too, or leave cost out")
        if ordering is None:
            ordering = Ordering.identity(num_nodes)
        elif not isinstance(ordering, Ordering):
            raise TypeError(
                f"ordering must be None or a partition.Ordering (got {type(ordering).__name__} "
                f"{ordering!r}); compute one with partition.reorder(src, dst, num_nodes, "
                f"method=...) first: orderings need the whole adjacency, not a stream")
        elif ordering.num_nodes != num_nodes:
            raise ValueError(f"ordering is for {ordering.num_nodes} nodes but num_nodes is "
                             f"{num_nodes}")
        block_size = check_count(block_size, "block_size", minimum=1)
        if num_intervals is not None:
            num_intervals = check_count(num_intervals, "num_intervals", minimum=1)
        budget = None if memory_budget is None else parse_bytes(memory_budget)

        relabel = ordering.relabel_array
        counts_for: dict[int, np.ndarray] = {}

        def counter(p: int):
            bounds = interval_bounds(num_nodes, p, ordering)
            counts = counts_for[p] = np.zeros(p * p, dtype=np.int64)

            def count(s, d):  # storage order: chunk (i, j) is entry j * P + i
                key = interval_of(relabel(d), bounds) * p + interval_of(relabel(s), bounds)
                counts[...] += count_keys(key, p * p)
            return count

        def counts_at(p: int) -> np.ndarray:
            if p not in counts_for:
                count = counter(p)
                for s, d, _ in blocks("counting edges per chunk", p):
                    count(s, d)
            return counts_for[p]

        with _Writer(path, overwrite) as w:
            # With P given, the checking pass counts the chunks too: one pass fewer.
            observe = counter(num_intervals or 1) if budget is None else None
            blocks, num_edges = _replayable(edge_blocks, num_nodes, w.tmp, block_size, progress,
                                            observe)

            if budget is not None:
                def peak_at(p: int) -> int:
                    bounds = interval_bounds(num_nodes, p, ordering)
                    return cost.peak(p, int(np.diff(bounds).max()), int(counts_at(p).max()))

                p = search_num_intervals(num_nodes, num_edges, budget, cost, peak_at)
            else:
                p = 1 if num_intervals is None else num_intervals
            bounds = interval_bounds(num_nodes, p, ordering)
            offsets = np.zeros(p * p + 1, dtype=np.int64)
            np.cumsum(counts_at(p), out=offsets[1:])
            idx = index_dtype_for(bounds)
            arrays = {name: w.create(f"{name}.npy", (num_edges,), dtype)
                      for name, dtype in (("src", idx), ("dst", idx), ("eids", np.int64))}
            _scatter_edges(blocks, arrays, offsets, bounds, relabel)
            w.drop_spill()
            w.finish_edges(arrays, offsets, progress)
            w.finish(num_nodes, bounds, ordering, vertex_arrays, progress)
        return w.store


# ---------------------------------------------------------------------- writing helpers
def _replayable(edge_blocks, num_nodes: int, tmp: Path, block_size: int, progress: bool,
                observe=None):
    """``(blocks, E)``: ``blocks(desc, p)`` replays the validated edge stream as
    ``(src, dst, first_edge_id)`` triples; ``E`` is counted in a first, checking pass, which
    also calls ``observe(src, dst)`` on each block."""
    if callable(edge_blocks):
        factory = edge_blocks
    elif isinstance(edge_blocks, (list, tuple)):
        factory = lambda: iter(edge_blocks)  # noqa: E731  (re-iterable as it is)
    else:
        factory = None

    first_pass: list[tuple[int, int]] = []

    def checked(iterator, desc: str, expected: int | None):
        # CRC32s of each pass's src and dst streams catch a factory that does not replay the
        # same edges (an accident, not an attack, so a fast non-cryptographic check will do).
        offset, crc_s, crc_d = 0, 0, 0
        with _progress(progress, desc=desc, total=expected, unit="edge", unit_scale=True) as bar:
            for n_block, block in enumerate(iterator):
                try:
                    s, d = block
                except (TypeError, ValueError) as e:
                    raise TypeError(f"edge block {n_block} must be a (src, dst) pair of arrays "
                                    f"(got {type(block).__name__})") from e
                s, d, _ = as_edges(s, d, num_nodes, offset=offset)
                if factory is not None:
                    crc_s = zlib.crc32(np.ascontiguousarray(s), crc_s)
                    crc_d = zlib.crc32(np.ascontiguousarray(d), crc_d)
                yield s, d, offset
                offset += s.shape[0]
                bar.update(s.shape[0])
        if expected is not None and offset != expected:
            raise ValueError(f"the edge stream yielded {offset} edges on a later pass but "
                             f"{expected} on the first; edge_blocks() must be deterministic")
        if factory is not None:
            if not first_pass:
                first_pass.append((crc_s, crc_d))
            elif (crc_s, crc_d) != first_pass[0]:
                raise ValueError("the edge stream yielded different edges on a later pass than "
                                 "on the first; edge_blocks() must be deterministic")

    if factory is not None:
        num_edges = 0
        for s, d, _ in checked(factory(), "checking edges", None):
            num_edges += s.shape[0]
            if observe is not None:
                observe(s, d)

        def blocks(desc, p=None):
            return checked(factory(), f"{desc} (P={p})" if p else desc, num_edges)
        return blocks, num_edges

    spill = {name: tmp / f".spill-{name}.bin" for name in ("src", "dst")}
    num_edges = 0
    with open(spill["src"], "wb") as fs, open(spill["dst"], "wb") as fd:
        for s, d, _ in checked(iter(edge_blocks), "spilling edges", None):
            fs.write(s.tobytes())
            fd.write(d.tobytes())
            num_edges += s.shape[0]
            if observe is not None:
                observe(s, d)

    def blocks(desc, p=None):
        if num_edges == 0:
            return
        src = np.memmap(spill["src"], dtype=np.int64, mode="r")
        dst = np.memmap(spill["dst"], dtype=np.int64, mode="r")
        with _progress(progress, desc=f"{desc} (P={p})" if p else desc, total=num_edges,
                       unit="edge", unit_scale=True) as bar:
            for lo in range(0, num_edges, block_size):
                hi = min(lo + block_size, num_edges)
                yield np.asarray(src[lo:hi]), np.asarray(dst[lo:hi]), lo
                bar.update(hi - lo)
    return blocks, num_edges


def _scatter_edges(blocks, arrays, offsets, bounds, relabel) -> None:
    """Write every edge into the next free slot of its chunk (stream order inside a chunk)."""
    p = bounds.shape[0] - 1
    cursor = offsets[:-1].copy()
    for s, d, first in blocks("writing chunks", p):
        if s.shape[0] == 0:
            continue
        ns, nd = relabel(s), relabel(d)
        iv_s, iv_d = interval_of(ns, bounds), interval_of(nd, bounds)
        order = chunk_order(iv_s, iv_d, p)
        ks = (iv_d * p + iv_s)[order]
        start = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))  # runs of a chunk
        uk = ks[start]
        uc = np.diff(np.append(start, ks.shape[0]))
        end = cursor[uk] + uc
        if np.any(end > offsets[uk + 1]):
            raise ValueError("the edge stream yielded more edges for a chunk on the writing pass "
                             "than on the counting pass; edge_blocks() must be deterministic")
        # Slot of each edge: its chunk's cursor plus its rank among this block's edges of the chunk.
        rank = np.arange(ks.shape[0]) - np.repeat(start, uc)
        slot = np.repeat(cursor[uk], uc) + rank
        cursor[uk] = end
        arrays["src"][slot] = (ns - bounds[iv_s])[order]
        arrays["dst"][slot] = (nd - bounds[iv_d])[order]
        arrays["eids"][slot] = first + order
    if not np.array_equal(cursor, offsets[1:]):
        raise ValueError("the edge stream yielded fewer edges for some chunk on the writing pass "
                         "than on the counting pass; edge_blocks() must be deterministic")


class _Writer:
    """A store being written in a hidden temporary directory; leaving the ``with`` block
    commits it (manifest last, then the rename) or, on an exception, deletes it."""

    def __init__(self, path, overwrite: bool):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"cannot write a chunk store to {self.path}: the parent "
                                    f"directory {self.path.parent} does not exist")
        with _locked(self.path.parent):
            _restore_aside(self.path)
            _remove_leftovers(self.path)
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{self.path} already exists; pass overwrite=True to "
                                      f"replace a chunk store there")
            _check_replaceable(self.path)
        self.overwrite = overwrite
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp_fd: int | None = None
        self.store: ChunkStore | None = None  # the committed store, opened with verify="lazy"
        self.files: dict[str, dict] = {}
        self.manifest: dict | None = None

    def __enter__(self):
        # Created and flocked under the directory lock, so another writer's clean-up (which
        # deletes only temporary folders that nobody holds) never sees it unheld.
        with _locked(self.path.parent):
            self.tmp.mkdir()
            self._tmp_fd = _hold(self.tmp)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._commit()
        finally:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if self._tmp_fd is not None:
                os.close(self._tmp_fd)
                self._tmp_fd = None
        return False

    def create(self, rel: str, shape, dtype) -> np.memmap:
        target = self.tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        return np.lib.format.open_memmap(target, mode="w+", dtype=dtype, shape=tuple(shape))

    def save(self, rel: str, array: np.ndarray) -> None:
        mm = self.create(rel, array.shape, array.dtype)
        mm[...] = array
        self.close(rel, mm)

    def close(self, rel: str, mm: np.memmap, sha: str | None = None) -> None:
        mm.flush()
        shape, dtype = list(mm.shape), mm.dtype.str
        del mm
        target = self.tmp / rel
        _fsync(target)
        self.files[rel] = {"shape": shape, "dtype": dtype, "bytes": target.stat().st_size,
                           "sha256": sha or _sha256_file(target)}

    def drop_spill(self) -> None:
        for spill in self.tmp.glob(".spill-*.bin"):
            spill.unlink()

    def finish_edges(self, arrays, offsets: np.ndarray, progress: bool) -> None:
        """Hash the edge files and every chunk in one read pass; write offsets and chunk hashes."""
        for mm in arrays.values():
            mm.flush()
        p2 = offsets.shape[0] - 1
        chunk_sha = np.zeros((p2, 32), dtype=np.uint8)
        file_sha = {}
        for name in arrays:
            h = hashlib.sha256()
            with open(self.tmp / f"{name}.npy", "rb") as f:
                h.update(f.read(_npy_data_offset(f)))
            file_sha[name] = h
        empty = np.frombuffer(hashlib.sha256().digest(), dtype=np.uint8)
        total = int(sum(mm.nbytes for mm in arrays.values()))
        with _progress(progress, desc="hashing chunks", total=total, unit="B",
                       unit_scale=True) as bar:
            for k in range(p2):
                lo, hi = int(offsets[k]), int(offsets[k + 1])
                if lo == hi:
                    chunk_sha[k] = empty
                    continue
                h = hashlib.sha256()
                for name, mm in arrays.items():
                    view = memoryview(mm[lo:hi]).cast("B")
                    h.update(view)
                    file_sha[name].update(view)
                    bar.update(view.nbytes)
                chunk_sha[k] = np.frombuffer(h.digest(), dtype=np.uint8)
        for name in list(arrays):
            self.close(f"{name}.npy", arrays.pop(name), file_sha[name].hexdigest())
        self.save("offsets.npy", offsets.astype(np.int64))
        self.save("chunk_sha256.npy", chunk_sha)

    def finish(self, num_nodes: int, bounds: np.ndarray, ordering: Ordering, vertex_arrays,
               progress: bool) -> None:
        """Write perm and vertex arrays and prepare the manifest (committed on context exit)."""
        self.save("perm.npy", ordering.perm)
        if vertex_arrays is not None and not isinstance(vertex_arrays, Mapping):
            raise TypeError(f"vertex_arrays must be a mapping name -> data (got "
                            f"{type(vertex_arrays).__name__})")
        names = []
        for name, data in (vertex_arrays or {}).items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"vertex array name {name!r} must be letters, digits, '_', '.' "
                                 f"or '-' (it becomes a file name)")
            self._write_vertex_array(name, data, ordering, progress)
            names.append(name)
        p = bounds.shape[0] - 1
        num_edges = self.files["eids.npy"]["shape"][0]
        self.manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "num_nodes": int(num_nodes),
            "num_edges": int(num_edges),
            "num_intervals": int(p),
            "bounds": [int(b) for b in bounds],
            "index_dtype": self.files["src.npy"]["dtype"],
            "ordering": ordering.method,
            "ordering_parts": None if ordering.bounds is None
            else [int(b) for b in ordering.bounds],
            "vertex_arrays": names,
            "files": self.files,
        }

    def _write_vertex_array(self, name: str, data, ordering: Ordering, progress: bool) -> None:
        n = ordering.num_nodes
        rel = f"vertex/{name}.npy"
        if hasattr(data, "detach") and hasattr(data, "cpu"):
            data = data.detach().cpu().numpy()
        if hasattr(data, "shape") and hasattr(data, "dtype"):
            data = np.asarray(data) if not isinstance(data, np.ndarray) else data
            if data.ndim == 0 or data.shape[0] != n:
                raise ValueError(f"vertex array {name!r} must have {n} rows [N, ...] "
                                 f"(got shape {data.shape})")
            _check_vertex_dtype(name, data.dtype)
            mm = self.create(rel, data.shape, data.dtype)
            rows = max(1, _HASH_BLOCK // max(1, data[:1].nbytes))
            with _progress(progress, desc=f"writing {name}", total=n, unit="row") as bar:
                for lo in range(0, n, rows):
                    hi = min(lo + rows, n)
                    mm[lo:hi] = data[ordering.perm[lo:hi]]  # new row k = original row perm[k]
                    bar.update(hi - lo)
            self.close(rel, mm)
            return
        iterator = data() if callable(data) else iter(data)
        mm, lo = None, 0
        with _progress(progress, desc=f"writing {name}", total=n, unit="row") as bar:
            for block in iterator:
                block = np.asarray(block.detach().cpu().numpy() if hasattr(block, "detach")
                                   else block)
                if mm is None:
                    if block.ndim == 0:
                        raise ValueError(f"vertex array {name!r}: blocks must be [rows, ...] "
                                         f"arrays (got a scalar)")
                    _check_vertex_dtype(name, block.dtype)
                    mm = self.create(rel, (n,) + block.shape[1:], block.dtype)
                if block.shape[1:] != mm.shape[1:] or block.dtype != mm.dtype:
                    raise ValueError(
                        f"vertex array {name!r}: block at row {lo} has shape {block.shape} and "
                        f"dtype {block.dtype}; expected shape (rows, *{mm.shape[1:]}) and dtype "
                        f"{mm.dtype} like the first block")
                hi = lo + block.shape[0]
                if hi > n:
                    raise ValueError(f"vertex array {name!r}: blocks hold more than "
                                     f"num_nodes={n} rows")
                mm[ordering.inv[lo:hi]] = block  # original row v goes to new row inv[v]
                bar.update(hi - lo)
                lo = hi
        if mm is None or lo != n:
            raise ValueError(f"vertex array {name!r}: blocks hold {lo} rows; expected "
                             f"num_nodes={n}")
        self.close(rel, mm)

    def _commit(self) -> None:
        if self.manifest is None:
            raise RuntimeError("internal: store finished without a manifest")
        body = dict(self.manifest)
        body["manifest_sha256"] = _manifest_digest(self.manifest)
        tmp_manifest = self.tmp / (MANIFEST + ".partial")
        with open(tmp_manifest, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_manifest, self.tmp / MANIFEST)
        if (self.tmp / "vertex").is_dir():
            _fsync(self.tmp / "vertex")
        _fsync(self.tmp)
        # Under the directory lock the check that the path is free (or replaceable) and the
        # renames are one step for every other writer and reader of this path: without it two
        # writers with overwrite=False both saw a free path and the second replaced the first.
        try:
            with _locked(self.path.parent):
                _restore_aside(self.path)
                if self.path.exists() or self.path.is_symlink():
                    if not self.overwrite:
                        raise FileExistsError(
                            f"{self.path} was created by another writer while this one ran; "
                            f"this store was discarded; pass overwrite=True to replace it")
                    _check_replaceable(self.path)
                    token = f"{os.getpid()}-{secrets.token_hex(4)}"
                    old = self.path.parent / f".{self.path.name}.old-{token}"
                    # A kill between these renames leaves no store at the path and the previous
                    # one at `old`: the next open() or writer renames it back (_restore_aside).
                    try:
                        os.rename(self.path, old)
                        os.rename(self.tmp, self.path)
                    except OSError as e:
                        raise OSError(f"could not move the finished store into {self.path}: "
                                      f"{e}") from e
                    finally:
                        _restore_aside(self.path)  # a failed second rename puts the old back
                    _fsync(self.path.parent)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    try:
                        os.rename(self.tmp, self.path)
                    except OSError as e:
                        raise OSError(f"could not move the finished store into {self.path}: "
                                      f"{e}") from e
                    _fsync(self.path.parent)
                # Opened before the lock is released: another writer's overwrite cannot swap
                # the files while this one is read.
                self.store = ChunkStore.open(self.path, verify="lazy")
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


class _ReversedStore(ChunkStore):
    """See :meth:`ChunkStore.reversed`."""

    def __init__(self, base: ChunkStore):  # noqa: D107 (a view: shares base's state)
        self.__dict__.update(base.__dict__)
        self._base = base
        self.counts = base.counts.T.copy()

    def chunk(self, i: int, j: int) -> Chunk:
        c = self._base.chunk(j, i)
        i, j = c.j, c.i
        return Chunk(i, j, self.bounds[i:i + 2], self.bounds[j:j + 2], c.dst, c.src, c.eids)

    def _chunk_arrays(self, i, j):
        c = self.chunk(i, j)
        return c.src, c.dst, c.eids

    def reversed(self) -> ChunkStore:
        return self._base

    def __repr__(self) -> str:
        return f"{self._base!r}.reversed()"


class _RowReader:
    """Rows of a C-order ``.npy`` file read with ``os.pread`` into fresh arrays (no mapping).

    A new file descriptor per read keeps it safe to use from the engine's prefetch thread."""

    def __init__(self, path: Path, offset: int, shape: tuple, dtype: np.dtype):
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    def read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo,) + self.shape[1:], dtype=self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done, start = 0, self.offset + lo * self.row_bytes
            while done < view.nbytes:
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise StoreError(f"{self.path}: ends before byte {start + done}; the file "
                                     f"was truncated after the store was opened")
                done += n
        finally:
            os.close(fd)
        return out


def _unsigned(ids: np.ndarray) -> np.ndarray:
    """``ids`` (signed ints) viewed as unsigned: ``0 <= v < n`` is ``unsigned(v) < n``."""
    return ids.view(np.dtype(ids.dtype.str.replace("i", "u")))


def _check_vertex_dtype(name: str, dtype: np.dtype) -> None:
    if dtype.hasobject or dtype.kind not in "biufc":
        raise TypeError(f"vertex array {name!r} must be numeric (got dtype {dtype})")


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite anything but a chunk store (or an empty directory)."""
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            return
        try:
            with open(path / MANIFEST) as f:
                if json.load(f).get("format") == FORMAT:
                    return
        except (OSError, ValueError, AttributeError):
            pass
    raise FileExistsError(f"refusing to overwrite {path}: it is not a chunk store (no valid "
                          f"{MANIFEST} with format {FORMAT!r}); remove it yourself if intended")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold an exclusive ``flock`` on ``directory`` (a store's parent) for the ``with`` block.

    Writers hold it to check and swap their final path and to clean up; :meth:`ChunkStore.open`
    holds it to move back a store that an interrupted overwrite set aside. The kernel drops
    the lock of a process that dies, so a crash never leaves it held. Filesystems without
    ``flock`` support (some network ones) are used unlocked."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


def _hold(folder: Path) -> int:
    """A file descriptor holding an exclusive ``flock`` on the temporary ``folder`` of a
    running writer, until it is closed (or the kernel drops it when the writer dies)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            os.close(fd)
            raise
    return fd


def _writer_alive(folder: Path, pid: int) -> bool:
    """Whether the writer of the temporary ``folder`` still runs: someone holds its flock (or,
    where flock is not supported, process ``pid`` exists on this machine)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True  # gone already, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    finally:
        os.close(fd)


def _hidden_siblings(path: Path) -> list[tuple[str, int, Path]]:
    """``(kind, pid, folder)`` of the ``.<name>.tmp-*`` / ``.<name>.old-*`` folders of ``path``."""
    prefix = f".{path.name}."
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return []
    found = []
    for entry in entries:
        m = _HIDDEN.match(entry) if entry.startswith(prefix) else None
        if m and m["name"] == path.name:
            found.append((m["kind"], int(m["pid"]), path.parent / entry))
    return found


def _restore_aside(path: Path) -> Path | None:
    """Under :func:`_locked`: if nothing is at ``path`` but an overwrite set the previous store
    aside (it was killed between its two renames), rename that store back to ``path`` and
    return where it was. With several (not made by this code), the newest goes back."""
    if path.exists() or path.is_symlink():
        return None
    aside = [folder for kind, _, folder in _hidden_siblings(path) if kind == "old"]
    if not aside:
        return None
    old = max(aside, key=lambda folder: folder.stat().st_mtime_ns)
    os.rename(old, path)
    _fsync(path.parent)
    return old


def _restore_for_reader(path: Path) -> None:
    """:func:`_restore_aside` for :meth:`ChunkStore.open`, as a StoreError if it cannot."""
    if not any(kind == "old" for kind, _, _ in _hidden_siblings(path)):
        return
    try:
        with _locked(path.parent):
            _restore_aside(path)
    except OSError as e:
        aside = [str(folder) for kind, _, folder in _hidden_siblings(path) if kind == "old"]
        raise StoreError(f"no chunk store at {path}: an overwrite was interrupted and set the "
                         f"previous store aside at {aside}, and it could not be moved back "
                         f"({e}); rename it to {path} yourself") from e


def _remove_leftovers(path: Path) -> None:
    """Under :func:`_locked`, after :func:`_restore_aside`: delete what crashed writers left
    next to ``path``: previous stores set aside by overwrites that finished (the path holds
    the new one) and temporary folders whose writer is gone."""
    for kind, pid, folder in _hidden_siblings(path):
        if kind == "old" or not _writer_alive(folder, pid):
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------- reading helpers
def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _check_sha(path: Path, manifest: dict, rel: str) -> None:
    _compare_sha(path, manifest, rel, _sha256_file(path / rel))


def _compare_sha(path: Path, manifest: dict, rel: str, got: str) -> None:
    want = manifest["files"][rel]["sha256"]
    if got != want:
        raise StoreError(f"{path / rel}: sha256 mismatch, the file was changed after it was "
                         f"written (manifest {want[:16]}..., file {got[:16]}...)")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _npy_header(f) -> tuple[tuple, bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, data_offset)`` of the ``.npy`` file ``f``; ValueError if
    the header cannot be parsed.

    numpy parses the header dict with ``ast.literal_eval`` and, for versions 1 and 2, retries
    through ``tokenize``, so damaged bytes escape as SyntaxError, tokenize.TokenError,
    RecursionError, MemoryError, UnicodeDecodeError...: all of them mean "not a valid header"
    here, so every exception is turned into one ValueError."""
    f.seek(0)
    try:
        with warnings.catch_warnings():  # e.g. a damaged descr naming a deprecated dtype alias
            warnings.simplefilter("ignore")
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}; expected 1.0 or 2.0")
    except Exception as e:  # noqa: BLE001 - see the docstring
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"{type(e).__name__}: {e}") from e
    offset = f.tell()
    f.seek(0)
    return shape, fortran, dtype, offset


def _npy_data_offset(f) -> int:
    return _npy_header(f)[3]


def _read_manifest(path: Path) -> dict:
    if not path.exists():
        raise StoreError(f"no chunk store at {path}: the directory does not exist")
    if not path.is_dir():
        raise StoreError(f"no chunk store at {path}: not a directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise StoreError(f"incomplete store: {path} has no {MANIFEST}; its write never "
                         f"finished (crashed or still running), or it is not a chunk store")
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # deep nesting
        raise StoreError(f"{mpath}: not valid JSON ({type(e).__name__}: {e}); the manifest is "
                         f"damaged") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{mpath}: not a chunk store manifest (expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{mpath}: format version {manifest.get('format_version')!r} is not "
                         f"supported; this reader reads version {FORMAT_VERSION}")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise StoreError(f"{mpath}: the manifest's own checksum does not match its content; "
                         f"it was edited or damaged")
    _check_manifest(mpath, manifest)
    return manifest


def _check_manifest(mpath: Path, m: dict) -> None:
    """The manifest must describe a self-consistent grid (its files are checked afterwards)."""
    def bad(msg):
        raise StoreError(f"{mpath}: {msg}")

    for key in ("num_nodes", "num_edges", "num_intervals"):
        if not isinstance(m.get(key), int) or isinstance(m.get(key), bool) or m[key] < 0:
            bad(f"{key} must be an int >= 0 (got {m.get(key)!r})")
    n, e, p = m["num_nodes"], m["num_edges"], m["num_intervals"]
    if p < 1:
        bad(f"num_intervals must be >= 1 (got {p})")
    bounds = m.get("bounds")
    if (not isinstance(bounds, list) or len(bounds) != p + 1
            or not all(isinstance(b, int) for b in bounds)
            or bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:]))):
        shown = bounds if not isinstance(bounds, list) or len(bounds) < 12 \
            else str(bounds[:12])[:-1] + ", ...]"
        bad(f"bounds must be {p + 1} non-decreasing ints from 0 to num_nodes={n} for "
            f"num_intervals={p} (got {shown})")
    try:
        idx = np.dtype(m.get("index_dtype"))
    except TypeError as e:
        raise StoreError(f"{mpath}: index_dtype {m.get('index_dtype')!r} is not a dtype") from e
    if idx not in (np.dtype(np.int32), np.dtype(np.int64)):
        bad(f"index_dtype must be int32 or int64 (got {idx})")
    names = m.get("vertex_arrays")
    if not isinstance(names, list) or not all(isinstance(v, str) and _NAME.match(v) for v in names):
        bad(f"vertex_arrays must be a list of plain names (got {names!r})")
    if not isinstance(m.get("ordering"), str):
        bad(f"ordering must be the name of the ordering method (got {m.get('ordering')!r})")
    parts = m.get("ordering_parts")
    if parts is not None and (not isinstance(parts, list) or len(parts) < 2
                              or parts[0] != 0 or parts[-1] != n):
        bad(f"ordering_parts must be null or bounds from 0 to {n} (got {parts!r})")
    expected = {
        "offsets.npy": ([p * p + 1], np.dtype(np.int64)),
        "chunk_sha256.npy": ([p * p, 32], np.dtype(np.uint8)),
        "src.npy": ([e], idx), "dst.npy": ([e], idx), "eids.npy": ([e], np.dtype(np.int64)),
        "perm.npy": ([n], np.dtype(np.int64)),
    }
    files = m.get("files")
    if not isinstance(files, dict):
        bad("files must be an object")
    for v in names:
        if f"vertex/{v}.npy" not in files:
            bad(f"vertex array {v!r} has no entry vertex/{v}.npy in files")
    unexpected = set(files) - set(expected) - {f"vertex/{v}.npy" for v in names}
    if unexpected:
        bad(f"files lists unknown entries {sorted(unexpected)}")
    for rel, (shape, dtype) in expected.items():
        if rel not in files:
            bad(f"files has no entry for {rel}")
        info = files[rel]
        if not isinstance(info, dict) or info.get("shape") != shape:
            listed = info.get("shape") if isinstance(info, dict) else info
            bad(f"{rel} is listed with shape {listed!r}; N={n}, E={e}, P={p} require {shape}")
        try:
            listed = np.dtype(info.get("dtype"))
        except TypeError as err:
            raise StoreError(f"{mpath}: {rel} has an invalid dtype {info.get('dtype')!r}") from err
        if listed != dtype:
            bad(f"{rel} is listed with dtype {listed}; this format stores it as {dtype}")
    for v in names:
        info = files[f"vertex/{v}.npy"]
        shape = info.get("shape") if isinstance(info, dict) else None
        try:
            np.dtype(info.get("dtype"))
        except (TypeError, AttributeError) as err:
            raise StoreError(f"{mpath}: vertex/{v}.npy has an invalid dtype entry") from err
        if not isinstance(shape, list) or not shape or shape[0] != n:
            bad(f"vertex/{v}.npy is listed with shape {shape!r}; its first dimension must be "
                f"num_nodes={n}")
    for rel, info in files.items():
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int)
                and isinstance(info.get("sha256"), str)):
            bad(f"{rel} needs an int 'bytes' and a str 'sha256' entry")


def _check_files(path: Path, m: dict) -> None:
    """Every listed file exists with the recorded size, header, shape and dtype."""
    for rel, info in m["files"].items():
        fpath = path / rel
        if not fpath.is_file():
            raise StoreError(f"{fpath}: missing (the manifest lists it); the store is damaged")
        size = fpath.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise StoreError(f"{fpath}: {what}: {size} bytes on disk, the manifest records "
                             f"{info['bytes']}")
        try:
            with open(fpath, "rb") as f:
                shape, fortran, dtype, data_offset = _npy_header(f)
        except ValueError as e:
            raise StoreError(f"{fpath}: damaged .npy header ({e})") from e
        if list(shape) != info["shape"] or dtype != np.dtype(info["dtype"]) or fortran:
            raise StoreError(
                f"{fpath}: the file holds shape {list(shape)} dtype {dtype}"
                f"{' (Fortran order)' if fortran else ''} but the manifest records shape "
                f"{info['shape']} dtype {np.dtype(info['dtype'])}")
        want = data_offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if size != want:
            raise StoreError(f"{fpath}: {size} bytes on disk but its header needs {want}; "
                             f"the file is truncated or padded")
