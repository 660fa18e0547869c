"""Plain-text tables (optionally gzipped): OGB's csv.gz files and SNAP-style edge lists."""

from __future__ import annotations

import gzip
import io
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ngra.graph import Graph

from ._record import DatasetError, check_allocation

__all__ = ["read_table", "read_edge_list"]

_BLOCK_CHARS = 1 << 22  # text is parsed in blocks of about this many characters
_MAX_LINE_CHARS = 1 << 24  # a longer line is refused before it is held in memory


def read_table(path, *, dtype, columns: int | None = None, delimiter=None, comments="#",
               desc: str | None = None) -> np.ndarray:
    """Read a whitespace- or ``delimiter``-separated numeric text file (``.gz`` allowed) as [rows, cols].

    Lines end in ``\\n``, ``\\r\\n`` or ``\\r``; text is UTF-8. Reads and parses blocks of about
    4 Mi characters with a tqdm bar (shown on a terminal), so multi-GB files such as OGB features
    need no second in-memory copy of the text. ``columns`` (when given) must match every row.
    A line over 16 Mi characters (e.g. a gzip bomb without newlines), or a table that would
    outgrow the memory available, is refused as soon as it is seen. Errors are
    :class:`DatasetError` naming the file and the lines.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    chunks, first_line, parsed_bytes = [], 1, 0
    try:
        raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
        with raw, io.TextIOWrapper(raw, encoding="utf-8") as f, \
                tqdm(desc=desc or path.name, unit=" lines", disable=None, leave=False) as bar:
            carry = ""
            while True:
                block = f.read(_BLOCK_CHARS)
                if not block:
                    lines = [carry] if carry else []
                else:
                    lines = (carry + block).split("\n")
                    carry = lines.pop()
                    if len(carry) > _MAX_LINE_CHARS:
                        raise DatasetError(f"{path}: line {first_line + len(lines)} is longer than "
                                           f"{_MAX_LINE_CHARS} characters; not a table of numbers")
                if lines:
                    block_rows = _parse(lines, path, first_line, dtype, columns, delimiter, comments)
                    if block_rows.shape[0]:
                        if chunks and block_rows.shape[1] != chunks[0].shape[1]:
                            raise DatasetError(f"{path}: rows have {chunks[0].shape[1]} columns up to line "
                                               f"{first_line - 1} but {block_rows.shape[1]} after it")
                        chunks.append(block_rows)
                        parsed_bytes += block_rows.nbytes
                        # the final concatenation holds everything twice
                        check_allocation(2 * parsed_bytes, path,
                                         f"the table up to line {first_line + len(lines) - 1}")
                    first_line += len(lines)
                    bar.update(len(lines))
                if not block:
                    break
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read (truncated or corrupt?): {type(e).__name__}: {e}") from e
    if not chunks:
        return np.zeros((0, columns or 0), dtype=dtype)
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def _parse(lines, path, first_line, dtype, columns, delimiter, comments) -> np.ndarray:
    last = first_line + len(lines) - 1
    try:
        with warnings.catch_warnings():
            # a block of only comments is fine; numpy warns "input contained no data"
            warnings.simplefilter("ignore", UserWarning)
            # numpy 1.x parses "2.5" as the integer 2 with only a DeprecationWarning;
            # numpy 2 refuses it. Refuse it everywhere: nothing is silently changed.
            warnings.simplefilter("error", DeprecationWarning)
            block = np.loadtxt(lines, dtype=dtype, delimiter=delimiter, comments=comments, ndmin=2)
    except (ValueError, DeprecationWarning, OverflowError) as e:
        raise DatasetError(f"{path}: cannot parse lines {first_line}-{last}: {e}") from e
    if block.shape[0] and columns is not None and block.shape[1] != columns:
        raise DatasetError(f"{path}: expected {columns} column(s) per line, found "
                           f"{block.shape[1]} (lines {first_line}-{last})")
    return block


def check_num_nodes(num_nodes: int, path, what: str) -> None:
    """Refuse a vertex count whose per-vertex arrays (CSR row pointers, degrees, masks: about 32
    bytes a vertex) would not fit in memory, e.g. one implied by a corrupt id like 2**40."""
    check_allocation(32 * num_nodes, path, f"{what} (N = {num_nodes} vertices, ~32 bytes each)")


def read_edge_list(path, *, num_nodes: int | None = None, delimiter=None, comments="#") -> Graph:
    """Read a plain edge list (SNAP style: one ``src dst`` pair per line, ``#`` comments, ``.gz``
    allowed) as a directed :class:`ngra.graph.Graph`, edges in file order, nothing dropped.

    Vertex ids must be integers >= 0; ``num_nodes`` defaults to the largest id + 1 (an id so
    large that the graph's per-vertex arrays would not fit in memory is refused). Lines must
    have exactly two columns (a weight or timestamp column is an error rather than being
    silently ignored). For an undirected file call ``.to_undirected()`` on the result.
    A malformed file raises :class:`DatasetError` naming it.
    """
    table = read_table(path, dtype=np.int64, columns=2, delimiter=delimiter, comments=comments)
    if num_nodes is None and table.size and int(table.min()) >= 0:
        top = int(table.max())
        line = int(np.flatnonzero((table == top).any(axis=1))[0])
        check_num_nodes(top + 1, path, f"vertex id {top} (edge {line} of the file)")
    try:
        return Graph(torch.from_numpy(np.ascontiguousarray(table[:, 0])),
                     torch.from_numpy(np.ascontiguousarray(table[:, 1])), num_nodes)
    except ValueError as e:
        raise DatasetError(f"{path}: {e}") from e
