"""NGra's multi-device chunk sharing: source blocks circulate around a ring of workers.

The second exchange mode of a :class:`~ngra.distributed.DistGraph` (``exchange="ring"``; the
first, ``"halo"``, pulls exactly the halo rows each worker needs from their owners). Worker r
owns destination vertices and their in-edges, as in the halo mode; its in-edges are cut by the
owner of their source into K *chunks* (chunk o: the edges whose source worker o owns, a
bipartite CSR from worker o's ``n_o`` vertices to worker r's). A source operand ``u`` (each
worker's own rows of it, a *block*) then travels around the ring r -> r + 1: at step s worker r
holds the block of worker ``(r - s) mod K``, computes its chunk of that block while the block
goes on to r + 1 and the next one comes in from r - 1 (double-buffered: two blocks live, the one
computed on and the one arriving), and after K - 1 steps it has seen every block. Every block
crosses every link once, so each worker receives ``sum_{o != r} n_o`` rows per operand, against
the halo mode's halo rows only: the ring moves more bytes on a well-partitioned graph, but needs
no row lists, no gather on the sender, and its transfers overlap compute by construction.
Memory: two blocks live at a time, except that in training a chunked g-SpMM whose gradient
reads the source rows (``u_mul_e`` and the like; not ``copy_u``) keeps every block it received
until backward (all N rows of the operand, where the halo mode keeps its ``n + halo`` rows).

Which ops compute chunk by chunk (:class:`RingOps`): a g-SpMM with a sum or mean reducer reading
``u`` (``copy_u``, ``u_mul_e``, ...): each chunk's partial sum is added as its block arrives (a
mean divides by the whole in-degree at the end). Partial sums are added in another order than
the single-process kernel adds the same products, so results agree to float rounding (about
1e-7 relative in float32), not bit for bit. Everything else that reads ``u`` (a g-SDDMM, a max or
min reducer, whose gradient goes to the smallest edge id among ties over all the in-edges, an
explicit Scatter) needs the whole ``[u; halo rows]`` at once: the blocks still come around the
ring and the halo rows are picked from them as they pass, then the op runs once, exactly as in
the halo mode (bit for bit).

Backward runs the ring the other way: a block's gradient follows the block back, each worker
adding its chunk's contribution, so after K - 1 hops it is home. For the chunked g-SpMM this is
one autograd node (:class:`_RingGSpMM`) whose backward computes a chunk's gradient while the
previous block's accumulated gradient travels; for the blocks picked into ``[u; halo rows]``,
autograd chains the ring steps (:class:`_RingStep`), each waiting for its transfer. Every
worker builds the same autograd graph (empty chunks included), so the steps pair up.

Transfers are torch.distributed point-to-point (``isend`` / ``irecv`` on the transport's group:
gloo on CPU, NCCL on GPU), one pair per step with the two ring neighbours, every wait bounded by
the transport's timeout (a dead or hung neighbour raises :class:`TransportError` naming it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import kernels
from .graph import DistOps
from .transport import TransportError

__all__ = ["Ring", "RingOps", "EXCHANGE_MODES"]

EXCHANGE_MODES = ("halo", "ring")
_CHUNKED_REDUCERS = ("sum", "mean")


class _Handle:
    """One step's transfers in flight: the block going to r + 1 and the one coming from r - 1."""

    def __init__(self, ring: "Ring", works: list, recv: torch.Tensor, what: str):
        self.ring, self.works, self.recv, self.what = ring, works, recv, what

    def wait(self) -> torch.Tensor:
        ring = self.ring
        for w in self.works:
            ring.stats["wait_s"] += ring.transport.wait_work(
                w, f"ring {self.what} with neighbour ranks {ring.prev} and {ring.next}",
                "a worker died, hung, or did not run the same layers")
        return self.recv


class Ring:
    """The ring of one worker's piece: its neighbours, every worker's vertex count, and the
    piece's in-edges cut into per-owner chunks (made on first use; collective, since every
    worker runs the same layers)."""

    def __init__(self, dg):
        t = dg.transport
        self.transport = t
        self.rank, self.world = t.rank, t.world_size
        K = self.world
        self.next, self.prev = (self.rank + 1) % K, (self.rank - 1) % K
        self.sizes = dg._halo.sizes()
        n = dg.num_nodes
        src, dst = dg.src.cpu(), dg.dst.cpu()
        own = src < n
        owner = torch.full_like(src, self.rank)
        local = src.clone()
        if dg.num_halo:
            h = src[~own] - n
            owner[~own] = dg.halo_owner[h]
            local[~own] = dg.halo_local_ids[h]
        dev = dg.device
        # owner -> (CSR from the owner's rows to mine, positions of its edges among the piece's).
        # Every owner has one, empty or not, so that every worker builds the same autograd
        # graph: backward's ring steps then run in the same order everywhere.
        self.chunks: dict[int, tuple] = {}
        for o in range(K):
            pos = torch.nonzero(owner == o).flatten()
            # int32 indices where they fit, as the piece's own CSR (half the index bytes).
            small = max(self.sizes[o], n, pos.numel()) <= torch.iinfo(torch.int32).max
            csr = kernels.CSR.from_coo(local[pos].to(dev), dst[pos].to(dev), (self.sizes[o], n),
                                       index_dtype=torch.int32 if small else torch.int64)
            self.chunks[o] = (csr, pos.to(dev))
        self.in_degree = torch.bincount(dst, minlength=n).to(dev)
        # The halo rows (grouped by owner, ascending) as rows of each owner's block.
        ho, hl = dg.halo_owner, dg.halo_local_ids
        self.halo_rows = {o: hl[ho == o].to(dev) for o in range(K) if o != self.rank}
        self.stats = dg._halo.ring_stats  # shared by the pieces derived from one
        self._peer = (lambda p: dist.get_global_rank(t.group, p)) if t.group is not None \
            else (lambda p: p)

    def post(self, block: torch.Tensor, owner_next: int, what: str) -> _Handle:
        """Send ``block`` to the next worker and receive the block of worker ``owner_next``
        from the previous one (both posted, not waited for)."""
        block = block.contiguous()
        recv = torch.empty((self.sizes[owner_next], *block.shape[1:]), dtype=block.dtype,
                           device=block.device)
        return _Handle(self, self._transfer(block, recv, self.next, self.prev, what), recv, what)

    def _transfer(self, send: torch.Tensor, recv: torch.Tensor, to: int, frm: int,
                  what: str) -> list:
        """Post ``send`` -> rank ``to`` and ``recv`` <- rank ``frm``; empty ones are skipped
        (both ends know every block's size, so they skip the same ones)."""
        g = self.transport.group
        works = []
        try:
            if send.numel():
                works.append(dist.isend(send, self._peer(to), group=g))
            if recv.numel():
                works.append(dist.irecv(recv, self._peer(frm), group=g))
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank}: ring {what}: posting the transfer to rank "
                                 f"{to} / from rank {frm} failed: {e}") from e
        self.stats["bytes_out"] += send.numel() * send.element_size()
        self.stats["bytes_in"] += recv.numel() * recv.element_size()
        return works

    def blocks(self, u: torch.Tensor):
        """Yield ``(owner, block)`` for every worker's block of ``u`` in ring order (own block
        first). While the caller works on a block, the next one is already in flight; blocks
        after the first are differentiable functions of ``u`` across the workers
        (:class:`_RingStep`)."""
        if u.shape[0] != self.sizes[self.rank]:
            raise ValueError(f"a source operand must have one row per vertex of this worker "
                             f"({self.sizes[self.rank]}) (got shape {tuple(u.shape)})")
        K, r = self.world, self.rank
        self.stats["passes"] += 1
        cur = u
        for s in range(K):
            owner = (r - s) % K
            handle = self.post(cur.detach(), (r - s - 1) % K, "forward") if s < K - 1 else None
            yield owner, cur
            if handle is not None:
                cur = _RingStep.apply(cur, _Box(handle.wait(), self))

    def extend(self, u: torch.Tensor) -> torch.Tensor:
        """``[u; halo rows of u]`` (the halo mode's layout), the halo rows picked from the blocks
        as they come around the ring."""
        parts = {}
        for owner, block in self.blocks(u):
            if owner != self.rank:
                # Every owner's rows, even none: the same autograd graph on every worker.
                parts[owner] = block.index_select(0, self.halo_rows[owner])
        return torch.cat([u, *(parts[o] for o in sorted(parts))], 0)


class _Box:
    """A received block, carried past autograd's input handling (it is the step's output)."""

    __slots__ = ("tensor", "ring")

    def __init__(self, tensor, ring):
        self.tensor, self.ring = tensor, ring


class _RingStep(torch.autograd.Function):
    """``cur`` (the block this worker holds) -> the block received from the previous worker,
    which is that worker's ``cur``. Backward: the received block's gradient goes back to the
    previous worker, and the next worker's gradient for our ``cur`` comes in."""

    @staticmethod
    def forward(ctx, cur, box: _Box):
        ctx.ring = box.ring
        ctx.cur_shape = cur.shape
        return box.tensor

    @staticmethod
    def backward(ctx, grad):
        ring = ctx.ring
        grad = grad.contiguous()
        back = torch.empty(ctx.cur_shape, dtype=grad.dtype, device=grad.device)
        works = ring._transfer(grad, back, ring.prev, ring.next, "backward")
        _Handle(ring, works, back, "backward").wait()
        return back, None


class _RingGSpMM(torch.autograd.Function):
    """A sum g-SpMM over the ring, chunk by chunk, with the transfers overlapped both ways.

    Forward: the blocks come around the ring (:meth:`Ring.blocks` without autograd); each
    chunk's kernel runs on its block while the next block is in flight, under a small autograd
    graph of its own (detached leaves for the block and the chunk's edge values), kept for
    backward. Backward walks the steps in reverse: at step s the gradient of the block held at
    step s is this worker's chunk gradient plus what the next worker accumulated for the same
    block, and goes on to the previous worker; the next step's chunk gradient is computed while
    it travels. After K - 1 hops every block's gradient is home."""

    @staticmethod
    def forward(ctx, u, e, ring: "Ring", op: str, backend: str):
        r, K = ring.rank, ring.world
        need_u = u.requires_grad
        need_e = e is not None and e.requires_grad
        parts, out = [], None
        for owner, block in ring.blocks(u.detach()):  # (autograd is off in a forward)
            csr, pos = ring.chunks[owner]
            if e is None and op == "copy_u":
                # A sum of source rows: its gradient needs no block (the transposed chunk sums
                # grad_out instead), so no block is kept past its step.
                part = kernels.gspmm(csr, op, "sum", u=block, backend=backend)
                parts.append(None)
                out = part if out is None else out.add_(part)
                continue
            with torch.enable_grad():
                leaf = block.detach().requires_grad_(need_u)
                ec = None if e is None else e.detach().index_select(0, pos).requires_grad_(need_e)
                part = kernels.gspmm(csr, op, "sum", u=leaf, e=ec, backend=backend)
            parts.append((leaf, ec, part))
            out = part.detach().clone() if out is None else out.add_(part.detach())
        ctx.ring, ctx.parts, ctx.need = ring, parts, (need_u, need_e)
        ctx.e_shape = None if e is None else (e.shape, e.dtype, e.device)
        ctx.rank, ctx.world, ctx.backend, ctx.u_row = r, K, backend, tuple(u.shape[1:])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ring, parts = ctx.ring, ctx.parts
        need_u, need_e = ctx.need
        r, K = ctx.rank, ctx.world
        grad_out = grad_out.contiguous()
        grad_e = None
        if need_e:
            shape, dtype, device = ctx.e_shape
            grad_e = torch.zeros(shape, dtype=dtype, device=device)
        grad_u, sending = None, []
        for s in range(K - 1, -1, -1):
            owner = (r - s) % K
            incoming = None
            if need_u and s < K - 1:  # the next worker's sum for this block, posted first
                acc = grad_out.new_empty((ring.sizes[owner], *ctx.u_row))
                incoming = _Handle(ring, ring._transfer(acc.new_empty(0), acc, ring.prev,
                                                        ring.next, "backward"), acc, "backward")
            if parts[s] is None:  # copy_u: the transposed chunk's sum of grad_out
                csr = ring.chunks[owner][0]
                grads = [kernels.gspmm(csr.transpose(), "copy_u", "sum", u=grad_out,
                                       backend=ctx.backend)]
            else:
                leaf, ec, part = parts[s]
                wrt = [t for t, need in ((leaf, need_u), (ec, need_e)) if need]
                grads = torch.autograd.grad(part, wrt, grad_out, allow_unused=True) if wrt else ()
                grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
            if need_e:
                grad_e.index_copy_(0, ring.chunks[owner][1], grads[-1])
            if need_u:
                g = grads[0]
                if incoming is not None:
                    g = g.add_(incoming.wait())
                if s > 0:  # on to the worker that held this block one step earlier
                    g = g.contiguous()
                    sending.append((g, _Handle(ring, ring._transfer(g, g.new_empty(0),
                                                                    ring.prev, ring.next,
                                                                    "backward"), g, "backward")))
                else:
                    grad_u = g
        for _, h in sending:
            h.wait()
        return grad_u, grad_e, None, None, None


class RingOps(DistOps):
    """Graph ops of a worker in ring mode (see the module docstring): ``[u; halo rows]`` comes
    around the ring, and a sum / mean g-SpMM reading ``u`` runs chunk by chunk."""

    def __init__(self, csr, backend: str, halo, ring: Ring):
        super().__init__(csr, backend, halo)
        self.ring = ring

    def _exchange(self, u):
        return self.ring.extend(u)

    def gspmm(self, op, reduce, u, e):
        if u is None or reduce not in _CHUNKED_REDUCERS:
            return super().gspmm(op, reduce, u, e)
        out = _RingGSpMM.apply(u, e, self.ring, op, self.backend)
        if reduce == "mean":
            deg = self.ring.in_degree.clamp(min=1).to(out.dtype)
            out = out / deg.view(-1, *([1] * (out.dim() - 1)))
        return out
