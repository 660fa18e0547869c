"""A picture of a chunk grid: edges per chunk as a P x P heat map (needs matplotlib)."""

from __future__ import annotations

import numpy as np

from .chunk_grid import ChunkSource

__all__ = ["plot_chunk_counts"]


def plot_chunk_counts(source: ChunkSource, *, ax=None, title: str | None = None):
    """Draw ``source.counts`` [P, P] (rows: source interval i, columns: destination interval j)
    on a log colour scale; empty chunks stay blank. The default title carries the ordering,
    edge cut and chunk density from ``source.stats()``. Returns the matplotlib ``Axes``.

    A good ordering shows a heavy diagonal and a mostly blank rest.
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("plot_chunk_counts needs matplotlib; pip install 'ngra[plot]'") from e
    if not isinstance(source, ChunkSource):
        raise TypeError(f"source must be a ChunkGrid or ChunkStore (got {type(source).__name__})")
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 4))
    counts = np.ma.masked_equal(source.counts, 0)
    vmax = max(int(source.counts.max()) if source.counts.size else 1, 1)
    image = ax.imshow(counts, norm=LogNorm(vmin=1, vmax=max(vmax, 2)), cmap="viridis",
                      interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="edges per chunk")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("destination interval j")
    ax.set_ylabel("source interval i")
    if title is None:
        s = source.stats()
        title = (f"{s.method}, P={s.num_intervals}: cut {s.cut_fraction:.1%}, "
                 f"density {s.density:.2f}")
    ax.set_title(title)
    return ax
