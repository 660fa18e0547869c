"""Input checks shared by reordering, the chunk grid and the chunk store."""

from __future__ import annotations

import numbers

import numpy as np


def check_count(value, name: str, *, minimum: int = 0) -> int:
    """An int >= minimum (numpy ints accepted, bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value})")
    return int(value)


def as_index_array(x, name: str) -> np.ndarray:
    """A 1-D integer array as int64 numpy (torch tensors are moved to host; no copy if int64)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.size == 0 and arr.ndim == 1:
        return arr.astype(np.int64)  # [] parses as float64; an empty list of ids is still fine
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer vertex ids (got dtype {arr.dtype})")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [E] (got shape {arr.shape})")
    return arr.astype(np.int64, copy=False)


def check_ids(ids: np.ndarray, num_nodes: int, name: str, *, offset: int = 0) -> None:
    """Raise if any id lies outside [0, num_nodes); ``offset`` numbers edges across blocks."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_nodes:
        k = int(np.flatnonzero((ids < 0) | (ids >= num_nodes))[0])
        raise ValueError(
            f"edge {k + offset} has {name} id {int(ids[k])}, out of range for a graph with "
            f"{num_nodes} nodes; ids must lie in [0, {num_nodes})"
        )


def as_edges(src, dst, num_nodes, *, offset: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Validated ``(src [E] int64, dst [E] int64, num_nodes)``."""
    num_nodes = check_count(num_nodes, "num_nodes")
    src = as_index_array(src, "src")
    dst = as_index_array(dst, "dst")
    if src.shape != dst.shape:
        raise ValueError(
            f"src and dst must have the same length (got {src.shape[0]} and {dst.shape[0]})"
        )
    check_ids(src, num_nodes, "source", offset=offset)
    check_ids(dst, num_nodes, "destination", offset=offset)
    return src, dst, num_nodes
