"""Plain-text tables (optionally gzipped): OGB's csv.gz files and SNAP-style edge lists."""

from __future__ import annotations

import gzip
import itertools
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ngra.graph import Graph

__all__ = ["read_table", "read_edge_list"]

_CHUNK_ROWS = 1 << 18


def read_table(path, *, dtype, columns: int | None = None, delimiter=None, comments="#",
               desc: str | None = None) -> np.ndarray:
    """Read a whitespace- or ``delimiter``-separated numeric text file (``.gz`` allowed) as [rows, cols].

    Reads in chunks of 2**18 lines with a tqdm bar (shown on a terminal), so multi-GB files
    such as OGB features need no second in-memory copy of the text. ``columns`` (when given)
    must match every row. Errors name the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    chunks, first_line = [], 1
    try:
        with opener(path, "rt", encoding="utf-8") as f, \
                tqdm(desc=desc or path.name, unit=" lines", disable=None, leave=False) as bar:
            while True:
                lines = list(itertools.islice(f, _CHUNK_ROWS))
                if not lines:
                    break
                try:
                    with warnings.catch_warnings():
                        # a chunk of only comments is fine; numpy warns "input contained no data"
                        warnings.simplefilter("ignore", UserWarning)
                        # numpy 1.x parses "2.5" as the integer 2 with only a DeprecationWarning;
                        # numpy 2 refuses it. Refuse it everywhere: nothing is silently changed.
                        warnings.simplefilter("error", DeprecationWarning)
                        block = np.loadtxt(lines, dtype=dtype, delimiter=delimiter, comments=comments, ndmin=2)
                except (ValueError, DeprecationWarning) as e:
                    raise ValueError(f"{path}: cannot parse lines {first_line}-{first_line + len(lines) - 1}: {e}") from e
                if block.shape[0]:
                    if columns is not None and block.shape[1] != columns:
                        raise ValueError(f"{path}: expected {columns} column(s) per line, found "
                                         f"{block.shape[1]} (lines {first_line}-{first_line + len(lines) - 1})")
                    if chunks and block.shape[1] != chunks[0].shape[1]:
                        raise ValueError(f"{path}: rows have {chunks[0].shape[1]} columns up to line "
                                         f"{first_line - 1} but {block.shape[1]} after it")
                    chunks.append(block)
                first_line += len(lines)
                bar.update(len(lines))
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read (truncated or corrupt?): {e}") from e
    if not chunks:
        return np.zeros((0, columns or 0), dtype=dtype)
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def read_edge_list(path, *, num_nodes: int | None = None, delimiter=None, comments="#") -> Graph:
    """Read a plain edge list (SNAP style: one ``src dst`` pair per line, ``#`` comments, ``.gz``
    allowed) as a directed :class:`ngra.graph.Graph`, edges in file order, nothing dropped.

    Vertex ids must be integers >= 0; ``num_nodes`` defaults to the largest id + 1. Lines must
    have exactly two columns (a weight or timestamp column is an error rather than being
    silently ignored). For an undirected file call ``.to_undirected()`` on the result.
    """
    table = read_table(path, dtype=np.int64, columns=2, delimiter=delimiter, comments=comments)
    try:
        return Graph(torch.from_numpy(np.ascontiguousarray(table[:, 0])),
                     torch.from_numpy(np.ascontiguousarray(table[:, 1])), num_nodes)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
