r"""Expert parallelism: an :class:`~ngra.nn.MoE` whose E experts are spread over K workers.

Worker r (of the K in ``group``) holds experts ``r E/K .. (r+1) E/K - 1`` and its own batch of
tokens; the gate is replicated. One forward on every worker:

1. route the local tokens (the gate, with capacity counted on the local tokens, as GShard does
   per device), and sort the dispatched (token, expert) pairs by expert, so the rows for the
   experts of worker d form one block;
2. exchange the counts first: ``all_to_all_single`` of the per-expert counts [E] (viewed
   [K, E/K]), so each worker knows how many rows it receives from each peer for each of its
   experts;
3. ``all_to_all_single`` of the rows (uneven splits), run each local expert on the rows it
   received from all peers, and ``all_to_all_single`` the results back along the reverse
   splits;
4. combine: ``y_n = sum_e C[n, e] * out[n, e]`` on the token's own worker.

Backward goes through :class:`AllToAll`, an autograd Function whose backward is the reverse
all-to-all (splits swapped). Its forward takes the gate weight as an extra "anchor" input that
always requires grad, so every worker's autograd graph holds both all-to-alls and every worker
joins both backward collectives, even a worker whose tokens need no gradient or that received
no rows. Every worker must call forward and backward the same number of times (collectives).

The output on worker r equals the single-process ``MoE`` (same weights) applied to worker r's
tokens; an expert's gradient is the sum over every worker's tokens, and the gate's gradient is
the per-worker gradient, to be summed with :func:`sync_replicated_gradients` (which leaves the
expert parameters, owned by one worker each, alone). Transport: gloo on CPU tensors (its
all-to-all takes uneven splits; checked with torch 2.2.1 and 2.13), NCCL on CUDA tensors (not
tested here: no GPU).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from ..nn.moe import MoE

__all__ = ["ExpertParallelMoE", "AllToAll", "sync_replicated_gradients"]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x`` [sum(send), ...] -> [sum(recv), ...]: the first
    ``send[0]`` rows go to worker 0, and so on; backward sends the gradients back. ``anchor`` is
    any tensor that requires grad (see the module docstring); it gets no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None, None


class ExpertParallelMoE(MoE):
    r"""An :class:`~ngra.nn.MoE` whose experts are spread over the workers of ``group`` (default
    the whole world): [..., d_model] -> [..., d_model] on each worker's own tokens.

    Construct it like ``MoE`` (same options, plus keyword ``group``) after
    ``dist.init_process_group``; every worker builds all E experts from the same seed and keeps
    its E/K, so the weights equal those of a ``MoE`` built from that seed. Or shard an existing
    layer with :meth:`from_moe`. ``num_experts`` must be a multiple of the group size.

    After a forward, ``last_comm`` holds ``rows_out`` (rows this worker sent to other workers in
    the two all-to-alls), ``rows_in`` (received) and ``bytes_out`` / ``bytes_in`` (rows times
    d_model times the element size; the count exchange, E int64, not included). Backward moves
    the same bytes again.
    """

    def __init__(self, d_model: int, num_experts: int, *, group=None, **options):
        world, rank = _world(group)
        _check_divisible(num_experts, world)
        super().__init__(d_model, num_experts, **options)
        self.group, self.world_size, self.rank = group, world, rank
        self.experts_per_worker = num_experts // world
        ids = self.local_experts
        # Built all, kept ours: same weights as a single-process MoE made from the same seed.
        self.experts = nn.ModuleList(self.experts[i] for i in ids)
        self.last_comm: dict = {}

    @classmethod
    def from_moe(cls, moe: MoE, *, group=None) -> "ExpertParallelMoE":
        """This worker's shard of ``moe`` (copies of its gate and of its E/K experts)."""
        if not isinstance(moe, MoE) or isinstance(moe, ExpertParallelMoE):
            raise TypeError(f"ExpertParallelMoE.from_moe: expected a single-process ngra.nn.MoE "
                            f"(got {type(moe).__name__})")
        _check_divisible(moe.num_experts, _world(group)[0])
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.d_model, new.num_experts, new.hidden = moe.d_model, moe.num_experts, moe.hidden
        new.gate = copy.deepcopy(moe.gate)
        new.group, (new.world_size, new.rank) = group, _world(group)
        new.experts_per_worker = moe.num_experts // new.world_size
        new.experts = nn.ModuleList(copy.deepcopy(moe.experts[i]) for i in new.local_experts)
        new.aux_loss, new.last_stats, new.last_comm = None, {}, {}
        return new

    @property
    def local_experts(self) -> range:
        return range(self.rank * self.experts_per_worker,
                     (self.rank + 1) * self.experts_per_worker)

    def _mix(self, tokens, dispatch, combine):
        k, el = self.world_size, self.experts_per_worker
        tok, exp, counts = self._slots(dispatch)  # rows for worker d: one block, by expert
        # Sizes first: recv[s, j] = rows worker s sends for our local expert j.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send_split = counts.view(k, el).sum(1).tolist()
        recv = recv.view(k, el)
        recv_split = recv.sum(1).tolist()
        anchor = self.gate.wg.weight
        rows = AllToAll.apply(tokens[tok], anchor, send_split, recv_split, self.group)
        # Received rows are ordered (source, expert); each expert runs once on its rows from all
        # sources: permute to (expert, source), run, and permute back.
        start = (recv.flatten().cumsum(0) - recv.flatten()).view(k, el)
        perm = [torch.arange(int(start[s, j]), int(start[s, j] + recv[s, j]),
                             device=tokens.device) for j in range(el) for s in range(k)]
        perm = torch.cat(perm) if perm else torch.zeros(0, dtype=torch.int64,
                                                        device=tokens.device)
        out = self._run_experts(rows[perm], recv.sum(0).tolist(), self.experts)
        out = out[torch.argsort(perm)]
        back = AllToAll.apply(out, anchor, recv_split, send_split, self.group)
        weight = combine[tok, exp].unsqueeze(1)
        mine = self.rank
        row_bytes = tokens.shape[1] * tokens.element_size()
        rows_out = 2 * (sum(send_split) - send_split[mine])  # dispatch and return trips
        rows_in = 2 * (sum(recv_split) - recv_split[mine])
        self.last_comm = {"rows_out": rows_out, "rows_in": rows_in,
                          "bytes_out": rows_out * row_bytes, "bytes_in": rows_in * row_bytes}
        return tokens.new_zeros(tokens.shape).index_add(0, tok, back * weight)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, worker={self.rank}/{self.world_size}, "
                f"experts={self.local_experts.start}..{self.local_experts.stop - 1}")


def _check_divisible(num_experts: int, world: int) -> None:
    if num_experts % world:
        options = sorted({v for v in ((num_experts // world) * world,
                                      -(-num_experts // world) * world) if v > 0})
        raise ValueError(
            f"ExpertParallelMoE: num_experts must be divisible by the number of workers: "
            f"expected a multiple of {world} (got num_experts={num_experts}); use "
            f"{' or '.join(map(str, options))} experts, or a process group whose size divides "
            "num_experts")


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ExpertParallelMoE needs torch.distributed: call "
                           "dist.init_process_group(...) first (gloo on CPU, nccl on GPU)")
    return dist.get_world_size(group), dist.get_rank(group)


def sync_replicated_gradients(model: nn.Module, group=None) -> None:
    """Sum over the workers the gradient of every parameter of ``model`` except the experts of
    its :class:`ExpertParallelMoE` layers (each owned by one worker, whose gradient already sums
    every worker's tokens). With the loss divided by the global batch, the replicated
    parameters then hold the single-process gradient."""
    owned = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
             for p in m.experts.parameters()}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in owned]
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for ps in by_kind.values():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in ps:
            g = flat[offset:offset + p.numel()].view_as(p)
            p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
            offset += p.numel()
