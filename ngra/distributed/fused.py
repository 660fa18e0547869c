"""CoCoNet-style fused communication: reduce-scatter, Adam on a shard, all-gather, as a DDP hook.

Data-parallel training with ``DistributedDataParallel`` and ``torch.optim.Adam`` all-reduces every
gradient, then runs the same Adam update on every one of the K ranks, each holding the full
optimizer state. "Breaking the computation and communication abstraction barrier" (CoCoNet)
rewrites all-reduce as reduce-scatter + all-gather and moves the optimizer between them::

    all-reduce(g) ; Adam(p, g)      ->      reduce-scatter(g) ; Adam(p[r], g[r]) ; all-gather(p[r])

Each rank then updates only its shard ``r`` (1/K of the elements) and keeps Adam's moments only
for it (ZeRO stage 1/2: optimizer state 2N/K per rank instead of 2N), while the bytes on the wire
stay those of an all-reduce (a ring all-reduce *is* a reduce-scatter then an all-gather).

:class:`FusedAdam` does this per DDP gradient bucket in a comm hook
(``DistributedDataParallel.register_comm_hook``). DDP calls the hook for bucket 0, 1, ... as each
bucket's gradients are ready during backward, and the hook

1. copies the bucket into a send buffer ``[K, W + P]``: row ``r`` holds rank ``r``'s part of every
   parameter of the bucket (each parameter of ``n`` elements is cut into K parts of
   ``s = ceil(n / K)``, the last ones padded with zeros), divided by K as DDP does, plus ``P``
   "used" flags (1 where this rank computed a gradient for the parameter);
2. starts an asynchronous reduce-scatter of it: rank ``r`` receives ``sum_k send_k[r]``, the mean
   gradient of its parts and the number of ranks that used each parameter;
3. finishes every earlier bucket whose reduce-scatter has completed, in bucket order: Adam on the
   rank's parts (exactly ``torch.optim.Adam``'s arithmetic, element by element), and starts an
   asynchronous all-gather of the updated parts (on a second process group, so that the order
   of collectives on each group is the same on every rank whatever completes when).

So the communication of bucket k overlaps the backward of the buckets after it, and Adam of
bucket k runs as soon as its gradient shard has arrived. The last bucket's hook waits for the
remaining reduce-scatters. :meth:`FusedAdam.step` waits for the all-gathers and writes the
gathered values into the parameters: writing them during backward would change tensors that
autograd may still need (a parameter used twice, tied weights), so the write is deferred.

Why parts of every parameter and not a contiguous slice of the bucket: DDP rebuilds its buckets
after the first iteration (in the order gradients became ready) and can change their
membership; with per-parameter parts the optimizer state belongs to (parameter, rank) and does not
move when the buckets do. The padding costs at most K - 1 elements per parameter.

Parameters without a gradient: parameters with ``requires_grad=False`` are not in DDP's buckets
and are never touched. With ``find_unused_parameters=True``, a parameter no rank used in this
iteration gets no update, no moment decay and no step count, as ``torch.optim.Adam`` skips a
parameter whose ``.grad`` DDP left at ``None``; one used on some ranks only is updated with the
mean over all ranks (zeros where unused), as DDP averages it. The used flags travel with the
reduce-scatter because DDP only learns which parameters are globally unused after the last bucket.

Reduce-scatter on gloo: ``torch.distributed.reduce_scatter_tensor`` exists for gloo in both torch
2.2 and 2.13, but in torch 2.2 only as a synchronous fallback ("not supported with
async_op=True"), and gloo has no ``ReduceOp.AVG`` (so the hook divides by K itself). Mode
``"auto"`` probes once whether the asynchronous native one works (torch 2.13: yes) and otherwise
emulates it with ``all_to_all_single`` plus a local sum of the K received rows, which moves the
same (K - 1) / K of the bucket per rank as a ring reduce-scatter. ``"all_reduce"`` (all-reduce
the whole buffer, keep row r: twice the bytes) is there for comparison. Likewise
``all_gather="all_reduce"`` gathers by a sum all-reduce of a zero buffer holding the rank's row:
twice the bytes, yet on gloo (loopback, 2-4 processes) faster than gloo's all-gather, which
measured 2-4x slower than an all-reduce of the same output size (benchmarks/fused_comm.py).

What differs from DDP + Adam (documented, tested where it matters):

- after backward, ``.grad`` holds this rank's *local* gradient (DDP copies the bucket back), not
  the mean over ranks: the mean exists only as shards, so gradient clipping by global norm and
  anything else reading ``.grad`` between backward and ``step()`` sees local values;
- the mean gradient of K >= 3 ranks is summed in another order than gloo's all-reduce, so results
  equal DDP + Adam to rounding (bit for bit with K = 2 in float32 and float64 in our tests);
- one parameter group; parameters in bfloat16/float16 keep a float32 master copy of their parts
  (so they are updated in float32, unlike ``torch.optim.Adam`` on low-precision parameters);
- each backward must be followed by ``step()`` (the update is computed in backward);
  accumulate micro-batches inside ``ddp_model.no_sync()``.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["FusedAdam", "REDUCE_SCATTER_MODES", "ALL_GATHER_MODES"]

REDUCE_SCATTER_MODES = ("auto", "native", "all_to_all", "all_reduce")
ALL_GATHER_MODES = ("native", "all_reduce")

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_FORMAT_SHARDED = "ngra.FusedAdam/sharded"


def _collective(new: str, old: str):
    # torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and warns on
    # the old names; torch 2.2 has only the old ones.
    return getattr(dist, new, None) or getattr(dist, old)


_reduce_scatter_single = _collective("reduce_scatter_single", "reduce_scatter_tensor")
_all_gather_single = _collective("all_gather_single", "all_gather_into_tensor")


@dataclass
class _Slot:
    """One parameter inside a bucket's send buffer: columns ``[col, col + part)`` of every row.

    Rank ``r`` owns the elements ``[r * part, r * part + valid)`` of the flattened parameter
    (``valid = clamp(numel - r * part, 0, part)``)."""

    index: int          # the parameter's index in param_groups[0]["params"]
    param: torch.Tensor
    numel: int
    part: int           # s = ceil(numel / K)
    col: int
    lo: int             # rank's first element
    valid: int          # rank's element count (0 for a small parameter's last ranks)


@dataclass
class _Layout:
    slots: list
    width: int          # W = sum of parts; flags follow in columns [W, W + P)
    dtype: torch.dtype

    @property
    def row(self) -> int:
        return self.width + len(self.slots)


@dataclass
class _Pending:
    layout: _Layout
    work: object
    result: object      # () -> [W + P] reduced row of this rank
    launched: float
    nbytes: int         # send + receive buffers
    done_at: list = field(default_factory=list)  # profiling: completion time, set by a waiter


class FusedAdam(torch.optim.Optimizer):
    """Adam (or AdamW) fused with DDP's gradient communication, optimizer state sharded over ranks.

    ``FusedAdam(ddp_model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)`` registers a
    comm hook on ``ddp_model`` (a ``DistributedDataParallel`` that has no hook yet) and is used
    like any torch optimizer::

        opt = FusedAdam(ddp_model, lr=3e-4)
        for x, y in batches:
            loss = loss_fn(ddp_model(x), y)
            loss.backward()     # reduce-scatter, Adam on this rank's shard, all-gather
            opt.step()          # waits for the all-gathers, writes the parameters
            opt.zero_grad()

    The update is torch.optim.Adam's, per element of a parameter ``p`` with mean gradient ``g``
    over the K ranks at step ``t`` (``g += wd * p`` first for L2 decay, or ``p *= 1 - lr * wd``
    with ``decoupled_weight_decay=True``, which is AdamW)::

        m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2      (amsgrad: vmax = max(vmax, v))
        p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    computed by rank r only for its parts. Memory per rank: ``m, v`` (and ``vmax``) for about
    N/K elements, plus a float32 master copy of the parts for low-precision parameters.

    Construction is collective (every rank of DDP's process group must call it): it creates a
    second process group for the all-gathers and, with ``reduce_scatter="auto"``, probes the
    backend once. ``lr`` and the other options live in ``param_groups[0]`` as usual, so LR
    schedulers work; they are read when the update runs (during the next backward).

    ``reduce_scatter`` (``"auto"``, ``"native"``, ``"all_to_all"``, ``"all_reduce"``) and
    ``all_gather`` (``"native"``, ``"all_reduce"``) pick how the collectives are done (module doc).
    ``profile=True`` records per step the launch and completion times of every collective and
    the time spent in Adam (:attr:`stats`), with one waiter thread per collective.
    """

    def __init__(self, ddp_model: DistributedDataParallel, lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 amsgrad: bool = False, decoupled_weight_decay: bool = False,
                 reduce_scatter: str = "auto", all_gather: str = "native",
                 profile: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ValueError(f"FusedAdam: reduce_scatter must be one of {REDUCE_SCATTER_MODES} "
                             f"(got {reduce_scatter!r})")
        if all_gather not in ALL_GATHER_MODES:
            raise ValueError(f"FusedAdam: all_gather must be one of {ALL_GATHER_MODES} "
                             f"(got {all_gather!r})")
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError("FusedAdam: expected a torch.nn.parallel.DistributedDataParallel "
                            f"model (got {type(ddp_model).__name__}); wrap the module with "
                            "DistributedDataParallel(module) after init_process_group")
        params = list(ddp_model.module.parameters())
        if not any(p.requires_grad for p in params):
            raise ValueError("FusedAdam: the model has no parameter with requires_grad=True "
                             "(expected at least one to optimize)")
        for p in params:
            if p.requires_grad and not p.is_floating_point():
                raise TypeError(f"FusedAdam: expected floating-point parameters (got {p.dtype})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._ddp = ddp_model
        # First, before any side effect (tensor hooks, a new process group): DDP refuses a
        # second comm hook, on every rank alike.
        try:
            ddp_model.register_comm_hook(None, self._hook)
        except RuntimeError as e:
            raise RuntimeError("FusedAdam: could not register its comm hook on the DDP model "
                               f"({e}); a DDP model takes one comm hook, so create FusedAdam on "
                               "a model without register_comm_hook / another FusedAdam") from e
        self._group = ddp_model.process_group
        self.world = dist.get_world_size(self._group)
        self.rank = dist.get_rank(self._group)
        # All-gathers go on their own group: they start whenever a reduce-scatter is seen done,
        # which differs between ranks, and a group needs the same order of calls on every rank.
        self._ag_group = dist.new_group(dist.get_process_group_ranks(self._group))
        self._index = {id(p): i for i, p in enumerate(params)}
        self._used = [False] * len(params)
        for i, p in enumerate(params):
            if p.requires_grad:
                # A tensor hook runs before the gradient is accumulated, so before DDP's own
                # hook (on AccumulateGrad) can mark the parameter ready and call ours.
                p.register_hook(self._used_marker(i))
        self._mode = self._pick_mode(reduce_scatter)
        self._ag_mode = all_gather
        self._layouts: dict = {}
        self._shard: dict = {}          # param index -> {"exp_avg", ...} of this rank's part
        self._steps = [0] * len(params)  # Adam's step count per parameter (same on all ranks)
        self._inflight: deque = deque()  # reduce-scatters launched, Adam not done yet
        self._gathers: list = []        # (layout, out [K * W], work, launched, done_at)
        self._phase = "idle"            # idle -> backward (hooks running) -> ready -> step
        self.profile = profile
        self.stats: list = []           # one dict per step with profile=True
        self._cur: dict = {}
        self._waiters: list = []

    # -- user API --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the update computed during the last backward: wait for the all-gathers and
        write the gathered parts into the parameters. Returns ``closure()`` if given (called
        first, with grad enabled, and it must run the backward)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._phase != "ready":
            what = ("a backward pass is still running or was interrupted"
                    if self._phase == "backward" else "no backward pass through the DDP model "
                    "ran since the last step()")
            raise RuntimeError(f"FusedAdam.step(): expected loss.backward() through the DDP model "
                               f"before step() ({what}); the update is computed during "
                               "backward, so call step() once after each backward")
        t0 = time.perf_counter()
        self._drain(block=True)  # nothing left normally: the last hook drained
        for layout, out, work, *_ in self._gathers:
            work.wait()
            rows = out.view(self.world, layout.width)
            for s in layout.slots:
                # Rows r of columns [col, col + part) are rank r's parts, in order: the padded
                # flattened parameter.
                flat = rows[:, s.col:s.col + s.part].reshape(-1)[:s.numel]
                s.param.copy_(flat.view_as(s.param))
        if self.profile:
            for th in self._waiters:
                th.join()
            self._cur["step_wait_s"] = time.perf_counter() - t0
            # (launch, completion) of every collective; the waiters have all noted theirs.
            self._cur["scatters"] = [(p.launched, p.done_at[0] if p.done_at else seen)
                                     for p, seen in self._cur.pop("_pending", [])]
            self._cur["gathers"] = [(g[3], g[4][0] if g[4] else math.nan)
                                    for g in self._gathers]
            self.stats.append(self._cur)
        self._gathers = []
        self._waiters = []
        self._phase = "idle"
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ddp", None) is not None:
            raise ValueError("FusedAdam: expected exactly one parameter group, the DDP model's "
                             "parameters (got add_param_group); set per-group options on "
                             "separate DDP models instead")
        super().add_param_group(param_group)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (moments, amsgrad maxima, master copies)."""
        return sum(t.numel() * t.element_size() for st in self._shard.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

    def state_dict(self) -> dict:
        """This rank's shard: ``{"format", "world_size", "rank", "steps": [step per parameter],
        "state": {index: {"exp_avg", "exp_avg_sq", ["max_exp_avg_sq"], ["master"]}},
        "param_groups"}`` with only this rank's parts (1-D tensors). Load it on the same rank of
        the same world size; for a torch.optim.Adam-style state dict (full tensors, any number
        of ranks) use :meth:`full_state_dict` (collective)."""
        self._check_idle("state_dict")
        return {"format": _FORMAT_SHARDED, "world_size": self.world, "rank": self.rank,
                "steps": list(self._steps),
                "state": {i: {k: v.clone() for k, v in st.items()}
                          for i, st in self._shard.items()},
                "param_groups": [self._group_dict()]}

    def full_state_dict(self) -> dict:
        """The state as ``torch.optim.Adam(model.parameters()).state_dict()`` holds it
        (full-shape moments, ``step`` a float tensor), gathered from all ranks. Collective:
        every rank must call it (in the same order as its other collectives) and gets it all."""
        self._check_idle("full_state_dict")
        params = self.param_groups[0]["params"]
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(
            "max_exp_avg_sq" in st for st in self._shard.values())
            or self.param_groups[0]["amsgrad"] else [])
        state = {}
        for i, p in enumerate(params):
            if self._steps[i] == 0:  # same on every rank, so every rank joins the same calls
                continue
            s = _part(p.numel(), self.world)
            buf = torch.zeros(len(keys), self.world, s, dtype=_master_dtype(p.dtype),
                              device=p.device)
            _, valid = _own(p.numel(), s, self.rank)
            mine = self._shard.get(i, {})
            for k, key in enumerate(keys):
                if key in mine:
                    buf[k, self.rank, :valid] = mine[key]
            # Every rank adds its parts into zeros: a sum all-reduce is the gather (works on
            # every backend; the state dict is not on a hot path).
            dist.all_reduce(buf, group=self._group)
            state[i] = {"step": torch.tensor(float(self._steps[i]))}
            for k, key in enumerate(keys):
                state[i][key] = buf[k].reshape(-1)[:p.numel()].view(p.shape).to(p.dtype).clone()
        return {"state": state, "param_groups": [self._group_dict()]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict` (this rank's shard) or a full, torch.optim.Adam-style state
        dict (:meth:`full_state_dict`, or ``torch.optim.Adam(model.parameters()).state_dict()``
        of the same model); hyperparameters come from its single parameter group."""
        self._check_idle("load_state_dict")
        params = self.param_groups[0]["params"]
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError("FusedAdam.load_state_dict: expected a state dict with one parameter "
                             f"group (got {'none' if groups is None else len(groups)})")
        if len(groups[0].get("params", ())) != len(params):
            raise ValueError("FusedAdam.load_state_dict: expected a state for "
                             f"{len(params)} parameters (got {len(groups[0].get('params', ()))});"
                             " load the state dict of the same model")
        sharded = state_dict.get("format") == _FORMAT_SHARDED
        if sharded and (state_dict["world_size"], state_dict["rank"]) != (self.world, self.rank):
            raise ValueError("FusedAdam.load_state_dict: this shard was saved by rank "
                             f"{state_dict['rank']} of {state_dict['world_size']} (expected rank "
                             f"{self.rank} of {self.world}); load each rank's own shard, or save"
                             " with full_state_dict() to change the number of ranks")
        steps = list(state_dict["steps"]) if sharded else [0] * len(params)
        shard = {}
        for i, st in state_dict["state"].items():
            i = int(i)
            p = params[i]
            if not sharded:
                step = st["step"]
                steps[i] = int(step.item() if isinstance(step, torch.Tensor) else step)
            _, valid = _own(p.numel(), _part(p.numel(), self.world), self.rank)
            lo = self.rank * _part(p.numel(), self.world)
            new = {}
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
                if key not in st:
                    continue
                t = st[key]
                if not sharded:
                    if t.shape != p.shape:
                        raise ValueError(f"FusedAdam.load_state_dict: parameter {i} {key} has "
                                         f"shape {tuple(t.shape)} (expected {tuple(p.shape)})")
                    t = t.reshape(-1)[lo:lo + valid]
                new[key] = t.detach().to(device=p.device, dtype=_master_dtype(p.dtype)).clone()
            if not sharded and p.dtype in _LOW_PRECISION:
                new["master"] = p.detach().reshape(-1)[lo:lo + valid].float()
            if valid > 0 and new:
                shard[i] = new
        self._shard, self._steps = shard, steps
        g = self.param_groups[0]
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "decoupled_weight_decay"):
            if k in groups[0]:
                g[k] = tuple(groups[0][k]) if k == "betas" else groups[0][k]

    # -- the hook ---------------------------------------------------------------------------

    def _hook(self, _state, bucket):
        index = bucket.index()
        if index == 0:
            if self._phase == "ready":
                self._phase = "idle"  # step() must not commit a half-known update
                raise RuntimeError(
                    "FusedAdam: a second backward pass through the DDP model ran before step() "
                    "(expected step() after each backward); the Adam update is computed during "
                    "backward, so accumulate micro-batches inside ddp_model.no_sync() and call "
                    "step() after the last backward (DDP's reducer cannot go on after this "
                    "error: restart from a checkpoint)")
            if self._phase == "backward":  # an earlier backward was interrupted: drop it
                self._drain(block=True)
            self._gathers, self._waiters = [], []
            self._phase = "backward"
            self._cur = {"hooks": [], "adam_s": 0.0, "blocked_s": 0.0, "launch_s": 0.0,
                         "peak_buffer_bytes": 0}
        t0 = time.perf_counter()
        layout = self._layout(bucket)
        grads = bucket.gradients()
        send = torch.empty(self.world, layout.row, dtype=layout.dtype, device=grads[0].device)
        for j, (s, g) in enumerate(zip(layout.slots, grads)):
            _fill_rows(send[:, s.col:s.col + s.part], g.reshape(-1))
            # Every row carries the flag, so every rank receives the count of ranks that used it.
            send[:, layout.width + j] = float(self._used[s.index])
            self._used[s.index] = False
        # Divide by K as DDP does before its sum all-reduce (gloo has no AVG), flags excepted.
        send[:, :layout.width].div_(self.world)
        self._inflight.append(self._launch_reduce_scatter(send, layout))
        if self.profile:
            self._cur["hooks"].append((t0, index))
            self._note_buffers()
        self._drain(block=bucket.is_last())
        if self.profile:
            self._note_buffers()
        if bucket.is_last():
            self._phase = "ready"
        fut = torch.futures.Future()
        # DDP copies this back into the bucket: .grad keeps the local gradient (see module doc).
        fut.set_result(bucket.buffer())
        return fut

    def _layout(self, bucket) -> _Layout:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            slots, col = [], 0
            for p in params:
                i = self._index.get(id(p))
                if i is None:
                    raise RuntimeError("FusedAdam: DDP's bucket holds a parameter that is not in "
                                       "ddp_model.module.parameters() (expected the same model "
                                       "FusedAdam was created with)")
                s = _part(p.numel(), self.world)
                lo, valid = _own(p.numel(), s, self.rank)
                slots.append(_Slot(i, p, p.numel(), s, col, lo, valid))
                col += s
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise RuntimeError("FusedAdam: a DDP bucket mixes dtypes "
                                   f"{sorted(map(str, dtypes))} (expected one; DDP buckets by "
                                   "dtype)")
            layout = self._layouts[key] = _Layout(slots, col, dtypes.pop())
        return layout

    def _launch_reduce_scatter(self, send: torch.Tensor, layout: _Layout) -> _Pending:
        k, row = self.world, layout.row
        t0 = time.perf_counter()
        if self._mode == "native":
            recv = torch.empty(row, dtype=send.dtype, device=send.device)
            work = _reduce_scatter_single(recv, send.view(-1), group=self._group, async_op=True)
            result = lambda: recv  # noqa: E731
        elif self._mode == "all_to_all":
            # Rank r sends row j to rank j and receives every rank's row r: then the sum over
            # the K received rows is the reduce-scatter's result.
            recv = torch.empty(k, row, dtype=send.dtype, device=send.device)
            work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=self._group,
                                          async_op=True)
            result = lambda: recv.sum(0)  # noqa: E731
        else:
            work = dist.all_reduce(send, group=self._group, async_op=True)
            result = lambda: send[self.rank]  # noqa: E731
        nbytes = (send.numel() + (recv.numel() if self._mode != "all_reduce" else 0)) * \
            send.element_size()
        pend = _Pending(layout, work, result, time.perf_counter(), nbytes)
        if self.profile:
            self._cur["launch_s"] += pend.launched - t0
        self._watch(work, pend.done_at)
        return pend

    def _drain(self, block: bool) -> None:
        """Adam + all-gather for the launched reduce-scatters that have completed, in launch
        order; with ``block``, for all of them."""
        while self._inflight:
            pend = self._inflight[0]
            if not block and not pend.work.is_completed():
                break
            t0 = time.perf_counter()
            pend.work.wait()
            t1 = time.perf_counter()
            self._inflight.popleft()
            reduced = pend.result()
            launched = self._cur.get("launch_s", 0.0)
            self._update_and_gather(pend.layout, reduced)
            t2 = time.perf_counter()
            if self.profile:
                self._cur["blocked_s"] += t1 - t0
                # Adam on the parts and the copies around it, without the all-gather's launch.
                self._cur["adam_s"] += t2 - t1 - (self._cur["launch_s"] - launched)
                self._cur.setdefault("_pending", []).append((pend, t1))

    @torch.no_grad()
    def _update_and_gather(self, layout: _Layout, reduced: torch.Tensor):
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        wd, amsgrad, decoupled = (group["weight_decay"], group["amsgrad"],
                                  group["decoupled_weight_decay"])
        dtype = layout.dtype
        src = torch.empty(max(layout.width, 1), dtype=dtype, device=reduced.device)
        used = [u > 0 for u in reduced[layout.width:].tolist()]  # identical on every rank
        for j, s in enumerate(layout.slots):
            if used[j]:
                self._steps[s.index] += 1  # on every rank, so step counts agree everywhere
            if s.valid == 0:
                continue
            part = src[s.col:s.col + s.valid]
            p_flat = s.param.detach().reshape(-1)
            st = self._shard.get(s.index)
            if not used[j]:  # no rank has a gradient: torch.optim.Adam skips it (grad is None)
                part.copy_(st["master"] if st is not None and "master" in st
                           else p_flat[s.lo:s.lo + s.valid])
                continue
            if st is None:
                mdt = _master_dtype(dtype)
                st = self._shard[s.index] = {
                    "exp_avg": torch.zeros(s.valid, dtype=mdt, device=reduced.device)}
                st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
                if dtype in _LOW_PRECISION:
                    st["master"] = p_flat[s.lo:s.lo + s.valid].float()
            if amsgrad and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
            if "master" in st:
                param = st["master"]
            else:
                # Same dtype: the parameter itself holds the exact current value of the part
                # (step() wrote it from the all-gather), so no master copy is kept.
                param = part
                param.copy_(p_flat[s.lo:s.lo + s.valid])
            grad = reduced[s.col:s.col + s.valid]
            if grad.dtype != param.dtype:
                grad = grad.to(param.dtype)
            _adam(param, grad, st, self._steps[s.index], lr, beta1, beta2, eps, wd, amsgrad,
                  decoupled)
            if param is not part:
                part.copy_(param)
        t = time.perf_counter()
        if self._ag_mode == "native":
            out = torch.empty(self.world * layout.width, dtype=dtype, device=reduced.device)
            work = _all_gather_single(out, src[:layout.width], group=self._ag_group,
                                      async_op=True)
        else:
            # Each rank adds its row into zeros: the sum is the gather (x + 0 = x exactly).
            # Twice the bytes of an all-gather, but gloo's all-reduce is much faster than its
            # all-gather (see benchmarks/fused_comm.py).
            out = torch.zeros(self.world, layout.width, dtype=dtype, device=reduced.device)
            out[self.rank] = src[:layout.width]
            out = out.view(-1)
            work = dist.all_reduce(out, group=self._ag_group, async_op=True)
        if self.profile:
            self._cur["launch_s"] += time.perf_counter() - t
        done: list = []
        self._watch(work, done)
        self._gathers.append((layout, out, work, t, done,
                              (out.numel() + src.numel()) * out.element_size()))

    # -- helpers ----------------------------------------------------------------------------

    def _note_buffers(self) -> None:
        # Profiling: peak bytes of the communication buffers alive at once in this backward.
        alive = sum(p.nbytes for p in self._inflight) + sum(g[5] for g in self._gathers)
        self._cur["peak_buffer_bytes"] = max(self._cur.get("peak_buffer_bytes", 0), alive)

    def _used_marker(self, i: int):
        def mark(_grad):
            self._used[i] = True
        return mark

    def _watch(self, work, done_at: list) -> None:
        # Profiling only: a thread blocked in wait() (which releases the GIL) notes when the
        # collective completed, to measure how much of it ran during backward.
        if not self.profile:
            return

        def wait():
            work.wait()
            done_at.append(time.perf_counter())
        th = threading.Thread(target=wait, daemon=True)
        th.start()
        self._waiters.append(th)

    def _pick_mode(self, mode: str) -> str:
        if mode != "auto":
            return mode
        if dist.get_backend(self._group) != "gloo":
            return "native"
        # torch 2.2's gloo has reduce_scatter_tensor only synchronously and raises before any
        # communication when asked for async_op=True, on every rank alike (same torch).
        probe = torch.zeros(self.world)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _reduce_scatter_single(torch.empty(1), probe, group=self._group,
                                       async_op=True).wait()
            return "native"
        except RuntimeError:
            return "all_to_all"

    def _group_dict(self) -> dict:
        g = self.param_groups[0]
        return {"lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"],
                "weight_decay": g["weight_decay"], "amsgrad": g["amsgrad"],
                "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": None,
                "decoupled_weight_decay": g["decoupled_weight_decay"],
                "params": list(range(len(g["params"])))}

    def _check_idle(self, what: str) -> None:
        if self._phase != "idle":
            raise RuntimeError(f"FusedAdam.{what}: expected no update in flight (got one from a "
                               "backward without step()); call step() first")

    @property
    def all_gather_mode(self) -> str:
        """The all-gather used: ``"native"`` or ``"all_reduce"``."""
        return self._ag_mode

    @property
    def reduce_scatter_mode(self) -> str:
        """The reduce-scatter used: ``"native"``, ``"all_to_all"`` or ``"all_reduce"``."""
        return self._mode


def _adam(param, grad, st, step, lr, beta1, beta2, eps, wd, amsgrad, decoupled) -> None:
    """torch.optim.Adam's single-tensor update (torch 2.2 and 2.13), op for op, so that a float32
    part gets the same bits as the same elements of the full parameter."""
    if wd != 0:
        if decoupled:
            param.mul_(1 - lr * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = math.sqrt(bias_correction2)
    if amsgrad:
        torch.maximum(st["max_exp_avg_sq"], exp_avg_sq, out=st["max_exp_avg_sq"])
        denom = (st["max_exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _part(numel: int, world: int) -> int:
    """s = ceil(numel / K): every rank's part size of a parameter (the last ones padded)."""
    return -(-numel // world)


def _own(numel: int, part: int, rank: int) -> tuple:
    """(first element, element count) of ``rank``'s part: count = clamp(numel - r s, 0, s)."""
    lo = rank * part
    return lo, max(0, min(part, numel - lo))


def _fill_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` [K, s] (a strided view) <- ``src`` [n] cut into rows of s, zero-padded."""
    k, s = dst.shape
    if s == 0:
        return
    n = src.numel()
    q = n // s
    if q:
        dst[:q].copy_(src[:q * s].view(q, s))
    if q < k:
        rem = n - q * s
        dst[q, :rem].copy_(src[q * s:])
        dst[q, rem:].zero_()
        dst[q + 1:].zero_()


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"FusedAdam: expected lr >= 0 (got {lr!r})")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"FusedAdam: expected betas = (beta1, beta2) in [0, 1) (got {betas!r})")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"FusedAdam: expected eps >= 0 (got {eps!r})")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"FusedAdam: expected weight_decay >= 0 (got {weight_decay!r})")
