"""Multi-worker pieces of ngra on torch.distributed (gloo on CPU, NCCL on GPU, torchrun).

- :mod:`ngra.distributed.transport`: the memory-region transport (one-sided reads and writes
  between co-located workers through shared memory, static exchange plans over the process
  group), after "RDMA-capable network for distributed deep learning".
- :mod:`ngra.distributed.graph`: a worker's piece of a partitioned graph (:class:`DistGraph`),
  on which every vertex program runs unchanged with a halo exchange where values cross
  Scatter; :func:`partition` (contiguous, METIS, random) and :func:`sync_gradients`.
- :mod:`ngra.distributed.ring`: NGra's multi-device chunk sharing, the second exchange mode
  (``DistGraph.with_exchange("ring")``, ``ngra train --exchange ring``): every worker's rows
  circulate around a ring of workers while each computes a sum / mean Gather on the block it
  holds; the halo mode moves only the halo rows, the ring every block past every worker.
- :mod:`ngra.distributed.launch`: starting workers under ``torchrun`` or from ``ngra train
  --workers K`` (torch's elastic launcher).

Every zoo model's outputs, loss and parameter gradients equal the single-process run (tested on
1-4 workers, with random / contiguous / METIS partitions, a worker without vertices and one
without in-edges). Layers that mix rows across vertices or edges (batch norm in training, dim-0
reductions) are refused on a ``DistGraph``. Dropout masks do not depend on the partition: vertex
features are masked by global row (CPU), edge values (GAT's attention) by global edge id, self
loops added on a piece included, so K workers drop what one process drops with the same seed. ``ngra train --checkpoint`` works on several workers (rank 0 writes
the state, which is the same on every worker, with each worker's RNG states; every worker reads
it back on ``--resume``, bit for bit on the CPU, also after an elastic restart). Inside
``ngra.Engine(...)`` (``ngra train --workers K --num-chunks P`` / ``--memory-budget``) each worker
streams its own piece: its destination columns one at a time under its own budget, with each
source operand's halo rows exchanged once per layer call, on gloo point-to-point overlapped with
the columns that do not need them (``Engine(column_order=...)``). Not supported yet: the ring
mode inside the streaming engine (streamed
layers use the halo exchange); overlap in the in-memory halo mode (its exchange blocks).

``DistGraph.from_store`` reads a worker's piece from an on-disk chunk store (only the chunk
columns of its vertex intervals: their in-edges). ``ngra train --dataset FOLDER`` on a dataset
written by ``ngra partition`` (:mod:`ngra.datasets.stored`) does that in every worker, which
then reads only its rows of the features, labels and splits; on a dataset given by name each
worker still reads the whole graph and cuts it.
"""

from .fused import FusedAdam
from .graph import PARTITION_METHODS, DistGraph, partition, sync_gradients
from .transport import ExchangePlan, Region, Transport, TransportError

__all__ = ["Transport", "Region", "ExchangePlan", "TransportError", "DistGraph", "partition",
           "sync_gradients", "PARTITION_METHODS", "FusedAdam"]
