"""Multi-worker pieces of ngra on torch.distributed (gloo on CPU, NCCL on GPU, torchrun).

- :mod:`ngra.distributed.transport`: the memory-region transport (one-sided reads and writes
  between co-located workers through shared memory, static exchange plans over the process
  group), after "RDMA-capable network for distributed deep learning".
"""

from .transport import ExchangePlan, Region, Transport, TransportError

__all__ = ["Transport", "Region", "ExchangePlan", "TransportError"]
