"""The streaming engine: run vertex programs one destination column at a time.

Inside ``with ngra.Engine(num_chunks=4):`` (or ``memory_budget="256MiB"``) every vertex-program
call is streamed; outside, it runs in memory. Both run the same optimized IR and give the same
results and gradients.

How a program is streamed
-------------------------
The IR is cut into three parts by domain:

- *pre*: vertex and parameter values that do not depend on a Gather (inputs, lifted
  projections, ...); computed once for all vertices;
- *edge part*: Scatter, ApplyEdge, edge softmax and the Gather itself (``gather`` / ``gspmm``);
  run once per destination column;
- *post*: ApplyVertex, run once on all vertices after every column is gathered (ApplyVertex
  may hold operations that are not row-wise, such as batch norm, so it is not split).

Vertices are cut into P intervals (by default intervals of equal in-edge counts,
:func:`balanced_bounds`). *Column* ``j`` is every edge whose destination lies in interval ``j``:
the chunks ``(0, j), (1, j), ..., (P-1, j)`` of the P x P grid (``partition.grid``), read
together. Columns stream in order; the edge part runs on a column as it would on a whole graph
whose destinations are interval ``j`` (a bipartite CSR: all N sources, the interval's
destinations). Source operands are the full vertex values, destination operands their rows of
interval ``j``, edge operands ``e[column edge ids]``.

Why whole columns, not single chunks: a column holds *every* in-edge of its destinations, so
each reduction (sum, mean over the full in-degree, max, min) and each edge softmax is complete
within it and runs as the same fused kernel as in memory: no partial accumulators to combine,
no second pass over the chunks for the softmax normalizer. Splitting a column into its P chunks
would not lower the peak either: backward recomputes a column at a time (below), so the
column, not the chunk, is the unit of edge-level memory.

Memory and backward
-------------------
Nothing edge-sized is kept from one column to the next. Backward rebuilds a column's edge
values when it reaches the column (in reverse column order) and runs the column's kernel
gradients on them. The rebuilding is done by saved-tensor hooks (:class:`_Replay`): autograd
keeps a token instead of each edge-level tensor it saves, and the first token unpacked re-runs
the column's edge part up to the last node whose value is needed (a GAT column re-runs its
scores, leaky ReLU and edge softmax, not the weighted sum: a reduction's backward needs its
inputs, not its output). Random ops replay with the column's random state. An edge part with
in-place ops, which would change values after they were saved, falls back to
``torch.utils.checkpoint`` (the whole column re-run). So the edge-level working set is one
column's edge values, their gradients and, while columns are still being prepared, its index
arrays (:meth:`Engine.estimate`); vertex-level data (features, lifted projections, gathered
results and their gradients) stays resident (:meth:`Engine.vertex_bytes`); pre and post values
are dropped after their last reader, as in the in-memory executor.

Backward order: NGra streams backward row by row (source interval ``i`` resident, its out-edges
streaming in), so that a source's gradient is accumulated while its row is loaded. Here every
vertex-level gradient buffer is resident anyway, so the order in which columns add into it does
not change memory; what matters is that the per-destination quantities of backward (the
gradient of a column's gathered rows, the softmax term ``sum_k y_k dy_k`` over a destination's
in-edges) are complete before the edges that need them, which a column at a time gives without
a second pass. Row order is kept where it matters, inside a column: gradients to sources run
source-major over the column's transposed CSR. So column order is equivalent in memory and
cheaper in passes.

Where the columns come from
---------------------------
- an in-memory graph in its own vertex order: column ``j`` is rows ``bounds[j]:bounds[j+1]`` of
  the graph's destination CSR (``Graph.in_csr()``, which the in-memory executor builds too),
  sliced without a sort of the graph;
- a reordered graph (``ordering="rcm"`` / ``"metis"``): the chunks of ``partition.grid``, merged
  per column;
- a chunk store: the column's chunks read from disk at every pass (forward, and the rebuilding
  in backward), on a prefetch thread that loads the next column while this one computes (in
  backward, the column before). On CUDA the thread copies the column to the device from pinned
  memory on a side stream, and the compute stream waits on an event for it (:func:`_upload`);
  that path has not yet run on a GPU (none was lent to this project so far).

- a worker's piece of a distributed graph (``ngra.distributed.DistGraph``): row slices of its
  in-edge CSR, whose sources are the worker's own vertices followed by its halo. Each source
  operand of the edge part gets its halo rows once per call, before the first column
  (``DistGraph.exchange_sources``, the same values in the same order on every worker), and
  every column reads the extended value; backward returns the halo rows' gradients to their
  owners once, after the last column. Each worker chooses its own P under its own budget.
  ``Engine(column_order="overlap" | "searched")`` posts the exchange without waiting (gloo
  point-to-point) and runs each column once the peers it reads have arrived, in column order or
  in the order :mod:`ngra.schedule.streaming` finds shortest; results are bit for bit those of
  the default ``"fixed"`` (blocking exchange, then columns 0..P-1). The default stays
  ``"fixed"``: over loopback on 2 shared cores the other orders gained nothing measurable
  (``benchmarks/streaming_order.py``).

Columns of in-memory graphs (their CSR, and the transposed CSR the kernels cache on it in
backward) are prepared by the first calls and cached by the engine, as the graph caches its own
CSR; graphs with equal edge lists share them. A store's columns are never kept.

What streams, and what P is
---------------------------
An edge part that mixes rows across edges (batch norm in training, softmax / norm / cumsum /
flip / mean over dim 0, random draws other than dropout) would see only one column's edges, so
it is refused with an error naming the op and its source line (:func:`_check_rowwise`); such a
layer runs correctly in memory. Edge dropout streams: an edge's mask is a hash of the call's seed
and its global edge id (``executor.edge_dropout``), so results do not depend on P. Under
``memory_budget``, P is the smallest number of intervals whose :meth:`Engine.estimate` (one
column's edge-level working set, with the bytes per edge measured on a small probe graph) fits
the budget; the estimate is ``partition.CostModel.peak`` of the model :meth:`Engine.cost_model`
builds, the same cost model ``partition.grid`` chooses its P with.

The package, by concern: :mod:`~ngra.engine.plan` (the IR cut into parts), :mod:`~ngra.engine.columns`
(where columns come from), :mod:`~ngra.engine.cost` (the memory meter and the per-edge probe),
:mod:`~ngra.engine.run` (one streamed call), :mod:`~ngra.engine.replay` (backward without kept
edge values) and :mod:`~ngra.engine.core` (the :class:`Engine` itself).
"""

from .columns import balanced_bounds
from .core import MAX_INTERVALS, Engine, current_engine
from .cost import TensorMemory
from .plan import StreamPlan

__all__ = ["Engine", "current_engine", "StreamPlan", "TensorMemory", "balanced_bounds",
           "MAX_INTERVALS"]
