"""Multi-worker pieces of ngra on torch.distributed (gloo on CPU, NCCL on GPU, torchrun).

- :mod:`ngra.distributed.transport`: the memory-region transport (one-sided reads and writes
  between co-located workers through shared memory, static exchange plans over the process
  group), after "RDMA-capable network for distributed deep learning".
- :mod:`ngra.distributed.graph`: a worker's piece of a partitioned graph (:class:`DistGraph`),
  on which every vertex program runs unchanged with a halo exchange where values cross
  Scatter; :func:`partition` (contiguous, METIS, random) and :func:`sync_gradients`.
"""

from .graph import PARTITION_METHODS, DistGraph, partition, sync_gradients
from .transport import ExchangePlan, Region, Transport, TransportError

__all__ = ["Transport", "Region", "ExchangePlan", "TransportError", "DistGraph", "partition",
           "sync_gradients", "PARTITION_METHODS"]
