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

    def __init__(self, indptr, indices, eids, num_src, num_dst):
        self.indptr = indptr
        self.indices = indices
        self.eids = eids
        self.num_src = int(num_src)
        self.num_dst = int(num_dst)
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
        Ids are not range-checked here (``ngra.Graph`` does that once for users).
        """
        if isinstance(num_nodes, (tuple, list)):
            num_src, num_dst = (int(n) for n in num_nodes)
        else:
            num_src = num_dst = int(num_nodes)
        if index_dtype is None:
            index_dtype = src.dtype if src.dtype in (torch.int32, torch.int64) else torch.int64
        if index_dtype not in (torch.int32, torch.int64):
            raise TypeError(f"index_dtype must be torch.int32 or torch.int64 (got {index_dtype})")
        if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
            raise ValueError(
                f"src and dst must be 1-D tensors of equal length (got shapes "
                f"{tuple(src.shape)} and {tuple(dst.shape)})"
            )
        dst64 = dst.to(torch.int64)
        order = torch.sort(dst64, stable=True).indices
        counts = torch.bincount(dst64, minlength=num_dst)
        indptr = torch.zeros(num_dst + 1, dtype=torch.int64, device=src.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        indices = src.index_select(0, order).to(index_dtype)
        return cls(indptr, indices.contiguous(), order.to(index_dtype).contiguous(), num_src, num_dst)

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
            counts = self.indptr[1:] - self.indptr[:-1]
            self._dst_ids = torch.repeat_interleave(
                torch.arange(self.num_dst, device=self.device), counts
            )
        return self._dst_ids

    def coo(self):
        """``(src, dst)`` [E] int64 in ORIGINAL edge order (edge k is ``src[k] -> dst[k]``), cached."""
        if self._coo is None:
            eids = self.eids.to(torch.int64)
            src = torch.empty(self.num_edges, dtype=torch.int64, device=self.device)
            dst = torch.empty_like(src)
            src[eids] = self.indices.to(torch.int64)
            dst[eids] = self.dst_ids()
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
            src = self.indices.to(torch.int64)
            dst = self.dst_ids()
            eids = self.eids.to(torch.int64)
            # Re-sort by original edge id first so the transposed rows are also in edge-id order.
            by_eid = torch.empty_like(eids)
            by_eid[eids] = torch.arange(eids.numel(), device=self.device)
            src_e, dst_e = src[by_eid], dst[by_eid]
            t = CSR.from_coo(dst_e, src_e, (self.num_dst, self.num_src), index_dtype=self.index_dtype)
            t._transpose = self
            t.blocking = self.blocking
            self._transpose = t
        return self._transpose

    def to(self, device) -> "CSR":
        device = torch.device(device)
        if device == self.device:
            return self
        out = CSR(self.indptr.to(device), self.indices.to(device), self.eids.to(device),
                  self.num_src, self.num_dst)
        out.blocking = self.blocking
        return out

    def __repr__(self) -> str:
        return (f"CSR(num_src={self.num_src}, num_dst={self.num_dst}, num_edges={self.num_edges}, "
                f"index_dtype={self.index_dtype}, device={self.device})")
