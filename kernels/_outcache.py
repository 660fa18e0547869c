"""A cache of freed CPU kernel outputs, so that the next outputs reuse warm pages.

glibc serves every allocation above its mmap threshold (at most 32 MiB) from new pages and
unmaps them on free, so each large tensor's first write page-faults once per page: on the
project's machine that was 25-40% of a g-SpMM call (``benchmarks/fresh_memory.py``). A training
loop allocates the same outputs every step, so the numba backend takes its large outputs and
scratch arrays from this cache instead, and so do the layers' dense ops of ``kernels/_dense.py``
(outputs and gradients). A piece handed out is owned by its tensor (or numpy array) like any
other memory; when the last tensor, view or array using it is freed, the piece comes back here,
warm, instead of going back to the OS, up to :func:`set_output_cache_limit` bytes (default: 1/8
of physical memory, at most 4 GiB; ``NGRA_KERNEL_OUTPUT_CACHE`` in the environment, a byte
count, sets it at import, ``0`` turns the cache off). Warm pieces beyond the limit are emptied
(their pages given back with ``MADV_DONTNEED``), oldest first; :func:`empty_output_cache`
empties them all.

The pieces are carved from one arena: address space for the machine's memory, mapped once
(``MAP_NORESERVE``: pages exist only where written; where it cannot be mapped, each new piece
is its own mapping). Requests are rounded up to size classes of 1/8 of a power of two (a 100 MB
output takes at most 12.5% more), and only requests of at least 1 MiB use the cache (smaller
ones come from glibc's heap, which reuses memory anyway). A request takes the smallest warm
piece at least its size (of those, the most recently freed), only its start where it is larger
(the rest stays cached); a freed piece merges with the warm pieces beside it. Where no warm
piece is large enough (a miss), the request takes the free stretch (warm and emptied ranges side
by side) that holds the most warm bytes: its emptied part is new pages. A step's output sizes
vary while their total does not (GAT on R-MAT 1M / 16M: [N, 64], [E, 4], [E, 1], [N, 16]), so
pieces cached only for their own size missed 23 of GAT's 42 requests per epoch, each new pages
(1-2 s of system time per epoch on the project's machine); carved from the arena, none miss
after the first epochs.

A miss then empties warm pieces, oldest first, as far as the bytes in use plus cached would
pass the most ever in use plus an eighth: pieces kept for other sizes do not add to the
footprint while it grows (with pieces cached per size, GAT's peak was 0.16 GiB higher without
it), and the eighth leaves room for the pieces' fragmentation, which otherwise emptied and
refaulted 0.15-0.3 GiB per GAT epoch.

A piece comes back to the cache through a ``weakref.finalize`` on the numpy array the tensor was
made from (``torch.from_numpy``), which runs, with the GIL, in whichever thread frees the last
reference (autograd's included). Such a tensor behaves like any other, except that its storage
cannot grow in place: ``resize_`` to more elements (or an ``out=`` argument of another size)
raises torch's "Trying to resize storage that is not resizable"; ``.clone()`` it first, or turn
the cache off.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import platform
import sys
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
# Linux's MAP_NORESERVE (not in Python's mmap module; its value on x86 and Arm): the arena
# reserves address space only. Elsewhere the arena is mapped without it, or not at all.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and (
    platform.machine() in ("x86_64", "AMD64", "i386", "i686", "aarch64", "arm64")
    or platform.machine().startswith("arm")) else 0)
_CAN_EMPTY = hasattr(mmap, "MADV_DONTNEED")
_HUGE = 2 << 20  # the arena's pieces start at offsets from a 2 MiB-aligned base

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
    """An anonymous mapping and its free ranges, by start and by end offset: warm pieces
    (written, resident, cached: :class:`_Piece` objects) and cold ranges (never written, or
    emptied; offset -> size)."""
    __slots__ = ("mapping", "start", "size", "arena", "warm_at", "warm_end", "cold_at",
                 "cold_end")

    def __init__(self, mapping, start: int, size: int, arena: bool):
        self.mapping, self.start, self.size, self.arena = mapping, start, size, arena
        self.warm_at: dict = {}
        self.warm_end: dict = {}
        self.cold_at: dict = {start: size}
        self.cold_end: dict = {start + size: start}

    def add_cold(self, off: int, size: int) -> None:
        """Mark ``[off, off + size)`` cold, merged with the cold ranges beside it."""
        left = self.cold_end.pop(off, None)
        if left is not None:
            del self.cold_at[left]
            size += off - left
            off = left
        right = self.cold_at.pop(off + size, None)
        if right is not None:
            del self.cold_end[off + size + right]
            size += right
        self.cold_at[off] = size
        self.cold_end[off + size] = off

    def take_cold(self, off: int, size: int) -> None:
        """Remove ``[off, off + size)``, inside one cold range, from the cold ranges."""
        c0 = next(c for c, cs in self.cold_at.items() if c <= off and off + size <= c + cs)
        cs = self.cold_at.pop(c0)
        del self.cold_end[c0 + cs]
        for a, b in ((c0, off), (off + size, c0 + cs)):
            if b > a:
                self.cold_at[a] = b - a
                self.cold_end[b] = a

    def all_cold(self) -> bool:
        return self.cold_at.get(self.start) == self.size


class _Piece:
    """``size`` bytes at ``off`` in a segment: handed out to one array, or warm in the cache."""
    __slots__ = ("seg", "off", "size")

    def __init__(self, seg: _Segment, off: int, size: int):
        self.seg, self.off, self.size = seg, off, size

    def view(self) -> np.ndarray:
        return np.frombuffer(self.seg.mapping, dtype=np.uint8, count=self.size, offset=self.off)


def _overlap(a0, a1, b0, b1) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


class OutputCache:
    """Warm pieces of mapped segments, oldest release first (see the module docstring)."""

    def __init__(self, limit: int):
        self._lock = threading.RLock()
        self._order: OrderedDict = OrderedDict()  # id(piece) -> warm piece, oldest first
        self._segments: list = []
        self._arena_tried = False
        self.limit = _check_limit(limit, "the output cache limit")
        self.cached = 0  # warm bytes held for reuse
        self.in_use = 0  # bytes of the pieces handed out
        self.in_use_peak = 0  # the most in use at once (since clear())
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
            self.in_use_peak = self.in_use

    def stats(self) -> dict:
        with self._lock:
            return {"limit": self.limit, "cached_bytes": self.cached,
                    "cached_blocks": len(self._order), "hits": self.hits, "misses": self.misses}

    def _free_views(self) -> list:
        """uint8 views of the warm pieces (for tests)."""
        with self._lock:
            return [p.view() for p in self._order.values()]

    def _trim(self, incoming: int) -> None:
        """Empty the oldest warm pieces until ``incoming`` more bytes fit under the limit."""
        self._shrink_to(self.limit - incoming)

    def _shrink_to(self, target: int) -> None:
        """Empty the oldest warm pieces until at most ``target`` bytes are cached."""
        while self._order and self.cached > target:
            _, piece = self._order.popitem(last=False)
            self._unlink(piece)
            self._empty(piece.seg, piece.off, piece.size)

    def _add(self, piece: _Piece) -> None:
        self._order[id(piece)] = piece
        piece.seg.warm_at[piece.off] = piece
        piece.seg.warm_end[piece.off + piece.size] = piece
        self.cached += piece.size

    def _unlink(self, piece: _Piece) -> None:
        """Take a warm piece out of its segment and the byte count (not out of _order)."""
        del piece.seg.warm_at[piece.off]
        del piece.seg.warm_end[piece.off + piece.size]
        self.cached -= piece.size

    def _empty(self, seg: _Segment, off: int, size: int) -> None:
        """Give ``[off, off + size)``'s pages back to the OS (MADV_DONTNEED): it turns cold; a
        segment other than the arena goes when it is all cold (unmapped with its last view)."""
        if _CAN_EMPTY:
            try:
                seg.mapping.madvise(mmap.MADV_DONTNEED, off, size)
            except (OSError, ValueError):  # the pages stay resident until the segment goes
                pass
        seg.add_cold(off, size)
        if not seg.arena and seg.all_cold():
            self._segments.remove(seg)

    def _release(self, piece: _Piece) -> None:
        with self._lock:
            seg = piece.seg
            self.in_use -= piece.size
            # merged with its warm neighbours, so that larger requests find it again
            for nb in (seg.warm_end.get(piece.off), seg.warm_at.get(piece.off + piece.size)):
                if nb is not None:
                    self._unlink(nb)
                    del self._order[id(nb)]
                    piece = _Piece(seg, min(piece.off, nb.off), piece.size + nb.size)
            if piece.size > self.limit:  # more than the cache may hold: its start is emptied
                cut = min(piece.size, -(-(piece.size - self.limit) // mmap.PAGESIZE)
                          * mmap.PAGESIZE)
                self._empty(seg, piece.off, cut)
                if cut == piece.size:
                    return
                piece = _Piece(seg, piece.off + cut, piece.size - cut)
            self._trim(piece.size)
            self._add(piece)

    def _fit(self, cls: int):
        """The smallest warm piece of at least ``cls`` bytes (of those, the most recently freed:
        likeliest still in cache), taken out of the cache, or None."""
        best = None
        for piece in reversed(self._order.values()):
            if piece.size >= cls and (best is None or piece.size < best.size):
                best = piece
                if piece.size == cls:
                    break
        if best is not None:
            self._unlink(best)
            del self._order[id(best)]
        return best

    def _window(self, cls: int):
        """``(segment, offset)`` of ``cls`` free bytes in a row (warm and cold ranges side by
        side) holding the most warm bytes, or None."""
        best, most = None, -1
        for seg in self._segments:
            ranges = sorted([(o, p.size, True) for o, p in seg.warm_at.items()]
                            + [(o, s, False) for o, s in seg.cold_at.items()])
            i = 0
            while i < len(ranges):  # each run of free ranges side by side
                j, end = i, ranges[i][0] + ranges[i][1]
                while j + 1 < len(ranges) and ranges[j + 1][0] == end:
                    j += 1
                    end += ranges[j][1]
                run = ranges[i:j + 1]
                if end - ranges[i][0] >= cls:
                    for start in [o for o, _, _ in run] + [o + s - cls for o, s, _ in run]:
                        if ranges[i][0] <= start and start + cls <= end:
                            warm = sum(_overlap(start, start + cls, o, o + s)
                                       for o, s, w in run if w)
                            if warm > most:
                                best, most = (seg, start), warm
                i = j + 1
        return best

    def _claim(self, seg: _Segment, start: int, cls: int) -> None:
        """Take ``[start, start + cls)`` (free) out of the segment's warm and cold ranges; the
        parts of ranges outside it stay free."""
        end = start + cls
        warm = [(o, p) for o, p in seg.warm_at.items() if _overlap(start, end, o, o + p.size)]
        for off, piece in warm:
            self._unlink(piece)
            del self._order[id(piece)]
            for a, b in ((off, start), (end, off + piece.size)):
                if b > a:
                    self._add(_Piece(seg, a, b - a))
        for off, size in [(o, s) for o, s in seg.cold_at.items() if _overlap(start, end, o, o + s)]:
            a, b = max(off, start), min(off + size, end)
            seg.take_cold(a, b - a)

    def _new_segment(self, cls: int):
        """The arena (once: address space for the machine's memory, pages only where written),
        or where that cannot be mapped, a mapping of ``cls`` bytes. None if out of memory."""
        if not self._arena_tried:
            self._arena_tried = True
            try:
                size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                size = -(-size // _HUGE) * _HUGE
                mapping = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                    | _MAP_NORESERVE)
            except (OSError, ValueError, AttributeError, OverflowError):
                mapping = None
            if mapping is not None and _CAN_EMPTY:
                base = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
                seg = _Segment(mapping, (-base) % _HUGE, size, True)
                self._huge_pages(mapping)
                self._segments.append(seg)
                return seg
        try:
            mapping = mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            return None
        self._huge_pages(mapping)
        seg = _Segment(mapping, 0, cls, False)
        self._segments.append(seg)
        return seg

    @staticmethod
    def _huge_pages(mapping) -> None:
        if _HUGE_PAGES:  # as torch's own large tensors (kernels/__init__.py)
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without THP: 4 KiB pages
                pass

    def _hand_out(self, piece: _Piece) -> None:
        self.in_use += piece.size
        self.in_use_peak = max(self.in_use_peak, self.in_use)

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
                if piece.size - cls >= MIN_BYTES:  # the rest stays cached
                    self._add(_Piece(piece.seg, piece.off + cls, piece.size - cls))
                    piece = _Piece(piece.seg, piece.off, cls)
                self._hand_out(piece)
            else:
                self.misses += 1
                where = self._window(cls)
                if where is None:
                    seg = self._new_segment(cls)
                    if seg is None:  # out of address space or memory: the caller's allocator
                        self.clear()
                        return None
                    where = self._window(cls)
                seg, start = where
                self._claim(seg, start, cls)
                piece = _Piece(seg, start, cls)
                self._hand_out(piece)
                # New pages: cached bytes go (oldest first) as far as the footprint (in use +
                # cached) would pass the most ever in use, plus an eighth for the pieces'
                # fragmentation, so that pieces kept for other sizes do not add to the memory
                # while it grows; below that, they stay for the requests after (emptied, they
                # would be new pages again next step).
                self._shrink_to(self.in_use_peak + self.in_use_peak // 8 - self.in_use)
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
