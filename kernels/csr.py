"""Compressed sparse row record shared by every kernel backend."""

from __future__ import annotations

import torch

__all__ = ["CSR"]


class CSR:
    """Edges grouped by destination row, built once per graph and reused by every kernel.

    For a graph with edges ``(src[k] -> dst[k])``, k = 0..E-1:

    - ``indptr``  [num_dst + 1] int64: in-edges of destination v sit at CSR positions
      ``indptr[v]:indptr[v+1]``.
    - ``indices`` [E] int32 or int64 (``index_dtype``): source vertex of each CSR position.
    - ``eids``    [E] same dtype as ``indices``: original edge id of each CSR position, so that
      edge-feature tensors stay in the user's edge order.
    - ``num_src``, ``num_dst``: sizes of the source and destination vertex sets. They are equal
      for an ordinary graph; a chunk of a partitioned graph is bipartite (sources of interval i,
      destinations of interval j).

    Inside a row, positions are sorted by original edge id (a stable sort), which makes every
    reduction order, and so every result, deterministic.

    ``blocking`` (default True) lets the numba CPU backend keep a copy of the edges grouped in
    source blocks (about E x (index + edge id) bytes plus blocks x num_dst pointers, cached per
    block count) where that speeds up a gather; a CSR whose memory is budgeted by its owner (the
    streaming engine's columns) sets it to False, and its transpose and device copies inherit it.
    """

    __slots__ = ("indptr", "indices", "eids", "num_src", "num_dst", "_transpose", "_dst_ids",
                 "__weakref__",
                 "_coo", "_deg", "_backend_cache", "blocking")

    def __init__(self, indptr, indices, eids, num_src, num_dst, *, check: bool = True):
        """Wrap CSR arrays as they are (no copy). With ``check`` (the default) every field is
        validated first: the kernels index memory with these ids and do not range-check them
        (a numba kernel given an id out of range reads or writes outside its arrays). Callers
        that built the arrays from an already checked CSR pass ``check=False``."""
        num_src, num_dst = _count("num_src", num_src), _count("num_dst", num_dst)
        if check:
            _check_csr(indptr, indices, eids, num_src, num_dst)
        self.indptr = indptr
        self.indices = indices
        self.eids = eids
        self.num_src = num_src
        self.num_dst = num_dst
        self._transpose = None
        self._dst_ids = None
        self._coo = None
        self._deg = None
        # Per-backend derived data (numpy views, row partitions, device copies), filled lazily by
        # the kernel backends so that it is computed once per graph rather than once per call.
        self._backend_cache = {}
        self.blocking = True

    @classmethod
    def from_coo(cls, src, dst, num_nodes, *, index_dtype=None) -> "CSR":
        """Build from edge lists ``src`` [E] and ``dst`` [E] (integer tensors, same device).

        ``num_nodes`` is an int (same vertex set on both sides) or a pair ``(num_src, num_dst)``.
        ``index_dtype`` (torch.int32 or torch.int64) defaults to the dtype of ``src``.
        Every id is checked: ``src`` in ``[0, num_src)``, ``dst`` in ``[0, num_dst)``.
        """
        return cls._from_coo(src, dst, num_nodes, index_dtype=index_dtype, check=True)

    @classmethod
    def _from_coo(cls, src, dst, num_nodes, *, index_dtype=None, check: bool) -> "CSR":
        if isinstance(num_nodes, (tuple, list)) and len(num_nodes) == 2:
            num_src, num_dst = (_count(k, n) for k, n in zip(("num_src", "num_dst"), num_nodes))
        elif isinstance(num_nodes, (tuple, list)):
            raise ValueError(f"num_nodes must be an int or a pair (num_src, num_dst) "
                             f"(got {num_nodes!r})")
        else:
            num_src = num_dst = _count("num_nodes", num_nodes)
        for name, t in (("src", src), ("dst", dst)):
            if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.is_complex() \
                    or t.dtype == torch.bool:
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be an integer tensor (got {what}); convert it with "
                                f"torch.as_tensor({name}, dtype=torch.int64)")
        if index_dtype is None:
            index_dtype = src.dtype if src.dtype in (torch.int32, torch.int64) else torch.int64
        if index_dtype not in (torch.int32, torch.int64):
            raise TypeError(f"index_dtype must be torch.int32 or torch.int64 (got {index_dtype})")
        if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
            raise ValueError(
                f"src and dst must be 1-D tensors of equal length (got shapes "
                f"{tuple(src.shape)} and {tuple(dst.shape)})"
            )
        if check:
            _check_ids("src", src, num_src, "num_src")
            _check_ids("dst", dst, num_dst, "num_dst")
        if index_dtype == torch.int32 and max(num_src, src.numel()) > _INT32_MAX:
            raise ValueError(f"index_dtype torch.int32 cannot hold {max(num_src, src.numel())} "
                             f"vertices or edges (at most {_INT32_MAX}); use torch.int64")
        # int32 ids sort as they are: an int64 copy would only add E x 8 bytes to the peak
        key = dst if dst.dtype in (torch.int32, torch.int64) else dst.to(torch.int64)
        order = torch.sort(key, stable=True).indices
        counts = torch.bincount(key, minlength=num_dst)
        indptr = torch.zeros(num_dst + 1, dtype=torch.int64, device=src.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        indices = src.index_select(0, order).to(index_dtype)
        return cls(indptr, indices.contiguous(), order.to(index_dtype).contiguous(), num_src, num_dst,
                   check=False)

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def index_dtype(self) -> torch.dtype:
        return self.indices.dtype

    def dst_ids(self) -> torch.Tensor:
        """Destination vertex of each CSR position [E] (int64), cached."""
        if self._dst_ids is None:
            self._dst_ids = self._position_rows(torch.int64)
        return self._dst_ids

    def _position_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """Destination vertex of each CSR position [E] in ``dtype``, not cached."""
        return torch.repeat_interleave(torch.arange(self.num_dst, dtype=dtype, device=self.device),
                                       self.in_degrees())

    def coo(self):
        """``(src, dst)`` [E] int64 in ORIGINAL edge order (edge k is ``src[k] -> dst[k]``), cached
        (without caching ``dst_ids()`` on the way: E x 8 bytes more than the pair itself)."""
        if self._coo is None:
            eids = self.eids.to(torch.int64)
            src = torch.empty(self.num_edges, dtype=torch.int64, device=self.device)
            dst = torch.empty_like(src)
            src[eids] = self.indices.to(torch.int64)
            dst[eids] = self._dst_ids if self._dst_ids is not None else \
                self._position_rows(torch.int64)
            if src.is_cuda:  # built on this call's stream; a later call may read it on another
                torch.cuda.current_stream(src.device).synchronize()
            self._coo = (src, dst)
        return self._coo

    def in_degrees(self) -> torch.Tensor:
        """Number of in-edges of each destination [num_dst] int64, cached."""
        if self._deg is None:
            self._deg = self.indptr[1:] - self.indptr[:-1]
        return self._deg

    def transpose(self) -> "CSR":
        """The same edges grouped by source (rows = sources), keeping original edge ids; cached."""
        if self._transpose is None:
            # Each edge's source and destination in original edge order, so that the stable sort
            # by source leaves every transposed row in edge-id order. Built in the index dtype
            # and without caching dst_ids(): int64 copies of the edges here were most of a
            # training run's peak memory on its first backward.
            idx = self.index_dtype
            dst = self._position_rows(idx if self.num_dst <= _INT32_MAX else torch.int64)
            src_e = torch.empty_like(self.indices)
            src_e[self.eids] = self.indices
            dst_e = torch.empty_like(dst)
            dst_e[self.eids] = dst
            del dst
            t = CSR._from_coo(dst_e, src_e, (self.num_dst, self.num_src), index_dtype=idx,
                              check=False)
            t._transpose = self
            t.blocking = self.blocking
            self._transpose = t
        return self._transpose

    def to(self, device) -> "CSR":
        device = torch.device(device)
        if device == self.device:
            return self
        out = CSR(self.indptr.to(device), self.indices.to(device), self.eids.to(device),
                  self.num_src, self.num_dst, check=False)
        out.blocking = self.blocking
        return out

    def __repr__(self) -> str:
        return (f"CSR(num_src={self.num_src}, num_dst={self.num_dst}, num_edges={self.num_edges}, "
                f"index_dtype={self.index_dtype}, device={self.device})")


_INT32_MAX = 2**31 - 1


def _count(name: str, value) -> int:
    """A vertex count: a non-negative integer (Python, numpy or 0-d integer tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer (got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype})")
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer (got {value!r} of type {type(value).__name__})")
    value = int(value.__index__())
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (got {value})")
    return value


def _check_ids(name: str, ids: torch.Tensor, n: int, bound: str) -> None:
    """Every entry of ``ids`` in ``[0, n)``, else a ValueError naming the first bad one."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= n)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{k}] = {int(ids[k])} is out of range for {bound} = {n}; "
                         f"ids must lie in [0, {n})")


def _check_csr(indptr, indices, eids, num_src: int, num_dst: int) -> None:
    """The CSR invariants the kernels rely on, each with the offending value in its error."""
    for name, t in (("indptr", indptr), ("indices", indices), ("eids", eids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (got shape {tuple(t.shape)})")
    if indptr.dtype != torch.int64:
        raise TypeError(f"indptr must be torch.int64 (got {indptr.dtype})")
    if indices.dtype not in (torch.int32, torch.int64) or eids.dtype != indices.dtype:
        raise TypeError(f"indices and eids must both be torch.int32 or both torch.int64 "
                        f"(got {indices.dtype} and {eids.dtype})")
    if not (indptr.device == indices.device == eids.device):
        raise ValueError(f"indptr, indices and eids must be on one device (got {indptr.device}, "
                         f"{indices.device}, {eids.device})")
    num_edges = indices.numel()
    if eids.numel() != num_edges:
        raise ValueError(f"eids must have one entry per edge: {num_edges} like indices "
                         f"(got {eids.numel()})")
    if indptr.numel() != num_dst + 1:
        raise ValueError(f"indptr must have num_dst + 1 = {num_dst + 1} entries "
                         f"(got {indptr.numel()})")
    first, last = int(indptr[0]), int(indptr[-1])
    if first != 0 or last != num_edges:
        raise ValueError(f"indptr must start at 0 and end at the number of edges {num_edges} "
                         f"(got indptr[0] = {first}, indptr[-1] = {last})")
    if num_dst > 0:
        step = indptr[1:] - indptr[:-1]
        if bool((step < 0).any()):
            v = int((step < 0).nonzero()[0, 0])
            raise ValueError(f"indptr must be non-decreasing (got indptr[{v}] = {int(indptr[v])} "
                             f"> indptr[{v + 1}] = {int(indptr[v + 1])})")
    _check_ids("indices", indices, num_src, "num_src")
    _check_ids("eids", eids, num_edges, "the number of edges")
