"""Graph partitioning: vertex reordering, 2D chunk grid, on-disk chunk store. Never imports ngra.

- :func:`reorder` -> :class:`Ordering`: identity, reverse Cuthill-McKee or METIS k-way.
- :func:`grid` -> :class:`ChunkGrid`: P vertex intervals and P x P edge chunks (:class:`Chunk`),
  P chosen from a memory budget with a :class:`CostModel`.
- :class:`ChunkStore`: the same grid on disk (``.npy`` files, memory-mapped, JSON manifest
  with checksums); refusals raise :class:`StoreError`.
- :func:`compare_orderings` / :func:`format_stats_table`: edge cut and chunk density
  (:class:`GridStats`) of several orderings; :func:`plot_chunk_counts` draws a grid.
"""

from .chunk_grid import (Chunk, ChunkGrid, ChunkSource, CostModel, GridStats, compare_orderings,
                         format_stats_table, grid)
from .ordering import Ordering, metis_parts, reorder
from .plot import plot_chunk_counts
from .store import ChunkStore, StoreError
from .units import format_bytes, parse_bytes

__all__ = ["Ordering", "reorder", "grid", "ChunkGrid", "ChunkSource", "Chunk", "CostModel",
           "GridStats", "compare_orderings", "format_stats_table", "plot_chunk_counts",
           "ChunkStore", "StoreError", "parse_bytes", "format_bytes"]
