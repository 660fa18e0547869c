"""A cache of freed CPU kernel outputs, so that the next output of that size reuses warm pages.

glibc serves every allocation above its mmap threshold (at most 32 MiB) from new pages and
unmaps them on free, so each large tensor's first write page-faults once per 4 KiB page: on the
project's machine that was 25-40% of a g-SpMM call (``benchmarks/fresh_memory.py``). A training
loop allocates the same output sizes every step, so the numba backend takes its large outputs
and scratch arrays from this cache instead, and so do the layers' dense ops of
``kernels/_dense.py`` (outputs and gradients). A block handed out is owned by its tensor (or
numpy array) like any other memory; when the last tensor, view or array using it is freed, the
block comes back here instead of going back to the OS, up to :func:`set_output_cache_limit` bytes
(default: 1/8 of physical memory, at most 4 GiB; ``NGRA_KERNEL_OUTPUT_CACHE`` in the
environment, a byte count, sets it at import, ``0`` turns the cache off). Blocks beyond the
limit are released, oldest first; :func:`empty_output_cache` releases them all. A request no
cached block serves (a miss) releases as many cached bytes as it maps, oldest first: blocks kept
for other sizes would otherwise sit on top of the memory in use while it grows (GAT's epoch on
R-MAT 1M / 16M, whose outputs outnumber what the cache holds, peaked 0.16 GiB higher).

Requests are rounded up to size classes of 1/8 of a power of two (a 100 MB output takes a piece
of at most 12.5% more), and only requests of at least 1 MiB use the cache (smaller ones come from
glibc's heap, which reuses memory anyway). A request takes the smallest free piece at least its
size (of those, the most recently freed), and where that is larger, only its start: the rest
stays cached. A freed piece merges with the free pieces beside it in its mapping, so the whole
block serves its own size again. A step's sizes vary while their total does not (GAT on R-MAT:
[N, 64], [E, 4], [E, 1], [N, 16] outputs): cached only for their own size, 23 of its 42 requests
per epoch missed, each fresh pages (1-2 s of system time per epoch); split, 3 missed. A piece
released while another part of its mapping is in use has its pages given back
(``MADV_DONTNEED``); a mapping is unmapped when its last piece goes. The memory is returned to
the cache by a ``weakref.finalize`` on the numpy array the tensor was made from
(``torch.from_numpy``), which runs, with the GIL, in whichever thread frees the last reference
(autograd's included). Such a tensor behaves like any other, except that its storage cannot grow
in place: ``resize_`` to more elements (or an ``out=`` argument of another size) raises torch's
"Trying to resize storage that is not resizable"; ``.clone()`` it first, or turn the cache off.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

MIN_BYTES = 1 << 20  # smaller requests bypass the cache
# new blocks get transparent huge pages when torch's tensors do (THP_MEM_ALLOC_ENABLE)
_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("THP_MEM_ALLOC_ENABLE", "0") \
    not in ("", "0")
_ENV = "NGRA_KERNEL_OUTPUT_CACHE"
# a piece larger than a request is split (the rest stays cached) where its pages can be emptied
_SPLIT = hasattr(mmap, "MADV_DONTNEED")

_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32,
             torch.int64: np.int64, torch.int16: np.int16, torch.int8: np.int8,
             torch.uint8: np.uint8, torch.bool: np.bool_}


def _default_limit() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return min(4 << 30, ram // 8)


def _check_limit(nbytes, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"{what} must be a byte count >= 0, e.g. {1 << 30} for 1 GiB, or 0 to "
                         f"turn the output cache off (got {nbytes!r})")
    return int(nbytes)


def size_class(nbytes: int) -> int:
    """The block size serving a request of ``nbytes``: rounded up to a multiple of 1/8 of the
    largest power of two not above it (at most 12.5% more)."""
    step = max(1, (1 << (int(nbytes).bit_length() - 1)) // 8)
    return -(-int(nbytes) // step) * step


class _Segment:
    """One anonymous mapping, with its free pieces by start and by end offset (for merging)."""
    __slots__ = ("mapping", "size", "free_at", "free_end")

    def __init__(self, mapping, size: int):
        self.mapping, self.size = mapping, size
        self.free_at: dict = {}
        self.free_end: dict = {}


class _Piece:
    """``size`` bytes at ``off`` in a segment: handed out to one array, or free in the cache."""
    __slots__ = ("seg", "off", "size")

    def __init__(self, seg: _Segment, off: int, size: int):
        self.seg, self.off, self.size = seg, off, size

    def view(self) -> np.ndarray:
        return np.frombuffer(self.seg.mapping, dtype=np.uint8, count=self.size, offset=self.off)


class OutputCache:
    """Free pieces of mapped segments, oldest release first (see the module docstring)."""

    def __init__(self, limit: int):
        self._lock = threading.RLock()
        self._order: OrderedDict = OrderedDict()  # id(piece) -> free piece, oldest first
        self.limit = _check_limit(limit, "the output cache limit")
        self.cached = 0  # bytes held for reuse
        self.hits = self.misses = 0
        self._local = threading.local()  # .bypass: depth of bypassed() blocks on this thread

    @contextlib.contextmanager
    def bypassed(self):
        """Within the block, this thread's requests get fresh memory and do not count."""
        self._local.bypass = getattr(self._local, "bypass", 0) + 1
        try:
            yield
        finally:
            self._local.bypass -= 1

    def set_limit(self, limit: int) -> None:
        limit = _check_limit(limit, "the output cache limit")
        with self._lock:
            self.limit = limit
            self._trim(0)

    def clear(self) -> None:
        with self._lock:
            self._shrink_to(0)

    def stats(self) -> dict:
        with self._lock:
            return {"limit": self.limit, "cached_bytes": self.cached,
                    "cached_blocks": len(self._order), "hits": self.hits, "misses": self.misses}

    def _free_views(self) -> list:
        """uint8 views of the free pieces (for tests)."""
        with self._lock:
            return [p.view() for p in self._order.values()]

    def _trim(self, incoming: int) -> None:
        """Release the oldest pieces until ``incoming`` more bytes fit under the limit."""
        self._shrink_to(self.limit - incoming)

    def _shrink_to(self, target: int) -> None:
        """Release the oldest pieces until at most ``target`` bytes are cached."""
        while self._order and self.cached > target:
            _, piece = self._order.popitem(last=False)
            self._unlink(piece)
            self._discard(piece)

    def _add(self, piece: _Piece) -> None:
        self._order[id(piece)] = piece
        piece.seg.free_at[piece.off] = piece
        piece.seg.free_end[piece.off + piece.size] = piece
        self.cached += piece.size

    def _unlink(self, piece: _Piece) -> None:
        """Take a free piece out of its segment's maps and the byte count (not out of _order)."""
        del piece.seg.free_at[piece.off]
        del piece.seg.free_end[piece.off + piece.size]
        self.cached -= piece.size

    @staticmethod
    def _discard(piece: _Piece) -> None:
        """Give a piece's memory back to the OS: a whole segment is unmapped when its last
        reference goes (here); part of one is emptied in place (MADV_DONTNEED)."""
        if piece.size < piece.seg.size:
            try:
                piece.seg.mapping.madvise(mmap.MADV_DONTNEED, piece.off, piece.size)
            except (OSError, ValueError):  # the pages stay resident until the segment goes
                pass

    def _release(self, piece: _Piece) -> None:
        with self._lock:
            seg = piece.seg
            # merged with its free neighbours, so that larger requests find it again
            for nb in (seg.free_end.get(piece.off), seg.free_at.get(piece.off + piece.size)):
                if nb is not None:
                    self._unlink(nb)
                    del self._order[id(nb)]
                    piece = _Piece(seg, min(piece.off, nb.off), piece.size + nb.size)
            if piece.size > self.limit:
                self._discard(piece)
                return
            self._trim(piece.size)
            self._add(piece)

    def _fit(self, cls: int):
        """The smallest free piece of at least ``cls`` bytes (of those, the most recently freed:
        likeliest still in cache), taken out of the cache, or None."""
        best = None
        for piece in reversed(self._order.values()):
            if (piece.size >= cls if _SPLIT else piece.size == cls) \
                    and (best is None or piece.size < best.size):
                best = piece
                if piece.size == cls:
                    break
        if best is not None:
            self._unlink(best)
            del self._order[id(best)]
        return best

    def _take(self, shape: tuple, dtype: np.dtype):
        """An uninitialized C-contiguous numpy array over a cached (or new) piece, or None where
        the cache does not serve the request (too small, turned off, bypassed, out of memory)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self.limit == 0 or getattr(self._local, "bypass", 0):
            return None
        cls = size_class(nbytes)
        with self._lock:
            piece = self._fit(cls)
            if piece is not None:
                self.hits += 1
                if piece.size - cls >= MIN_BYTES and _SPLIT:  # the rest stays cached
                    self._add(_Piece(piece.seg, piece.off + cls, piece.size - cls))
                    piece = _Piece(piece.seg, piece.off, cls)
            else:
                self.misses += 1
                # A miss maps new memory: as many cached bytes go first (oldest first), so that
                # pieces kept for other sizes do not add to the footprint while it grows.
                self._shrink_to(self.cached - cls)
        if piece is None:
            # its own anonymous mapping: page-aligned, and unmapped when its last piece goes
            try:
                mapping = mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError:  # out of address space or memory: the caller's allocator says so
                self.clear()
                return None
            if _HUGE_PAGES:  # as torch's own large tensors (kernels/__init__.py)
                try:
                    mapping.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # a kernel without THP: 4 KiB pages
                    pass
            piece = _Piece(_Segment(mapping, cls), 0, cls)
        arr = piece.view()[:nbytes].view(dtype).reshape(shape)
        # the last reference to arr (the tensor's storage, a view, ...) returns the piece
        weakref.finalize(arr, self._release, piece).atexit = False
        return arr

    def empty_numpy(self, shape, dtype) -> np.ndarray:
        """An uninitialized C-contiguous numpy array, its memory from the cache when it is large."""
        dtype = np.dtype(dtype)
        arr = self._take(tuple(shape), dtype)
        return np.empty(shape, dtype=dtype) if arr is None else arr

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Like ``torch.empty(shape, dtype=dtype)`` on the CPU, its memory from the cache."""
        np_dtype = _NP_DTYPE.get(dtype)
        arr = None if np_dtype is None else self._take(tuple(shape), np.dtype(np_dtype))
        if arr is None:
            return torch.empty(shape, dtype=dtype)  # a torch op, which dispatch modes see
        return torch.from_numpy(arr)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()


def _limit_from_env() -> int:
    raw = os.environ.get(_ENV)
    if raw is None or raw.strip() == "":
        return _default_limit()
    try:
        return _check_limit(int(raw.strip()), _ENV)
    except ValueError:
        raise ValueError(f"{_ENV}={raw!r} in the environment must be a byte count >= 0, e.g. "
                         f"{1 << 30} for 1 GiB, or 0 to turn the kernels' output cache "
                         f"off") from None


CACHE = OutputCache(_limit_from_env())


def set_output_cache_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of freed CPU kernel outputs for reuse (0 turns the cache off and
    releases what it holds). See :mod:`kernels._outcache`."""
    CACHE.set_limit(nbytes)


def output_cache_limit() -> int:
    """The current limit in bytes (see :func:`set_output_cache_limit`)."""
    return CACHE.limit


def empty_output_cache() -> None:
    """Release every freed block the output cache holds (blocks in use stay with their tensors)."""
    CACHE.clear()


def no_output_cache():
    """Context manager: within it, this thread's kernel calls allocate fresh memory, as torch
    ops do (for measuring memory, e.g. ``ngra.engine.TensorMemory``, which uses it)."""
    return CACHE.bypassed()


def output_cache_stats() -> dict:
    """``limit`` and ``cached_bytes`` (bytes), ``cached_blocks``, and the ``hits`` and ``misses``
    of requests large enough to use the cache, since the process started."""
    return CACHE.stats()
