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
(``DistributedDataParallel.register_comm_hook``). Each parameter of ``n`` elements is cut into K
parts of ``n // K`` elements, rank ``r`` owning ``[r * (n // K), (r + 1) * (n // K))``, and a
tail of the last ``n % K`` (< K) elements that every rank owns. DDP calls the hook for bucket 0,
1, ... as each bucket's gradients are ready during backward, and the hook

1. copies the bucket's gradients into a send buffer ``[K, W]``: row ``r`` holds rank ``r``'s part
   of every parameter of the bucket (``W`` = the sum of the parts, so ``K W`` + the tails = the
   bucket's elements), divided by K as DDP does; and the tails, with ``P`` "used" flags (1 where
   this rank computed a gradient for the parameter), into a small tail buffer ``[T + P]``;
2. starts an asynchronous reduce-scatter of the send buffer (rank ``r`` receives ``sum_k
   send_k[r]``, the mean gradient of its parts) and an all-reduce of the tail buffer (the mean
   gradient of the tails and the number of ranks that used each parameter);
3. finishes every earlier bucket whose collectives have completed, in bucket order: Adam on the
   rank's parts and on the tails (exactly ``torch.optim.Adam``'s arithmetic, element by element),
   the updated parts written into row ``r`` of the send buffer, and starts an asynchronous
   all-gather of the rows into that same buffer (in place; on a second process group, so that the
   order of collectives on each group is the same on every rank whatever completes when).

So the communication of bucket k overlaps the backward of the buckets after it, and Adam of
bucket k runs as soon as its gradient shard has arrived. The last bucket's hook waits for the
remaining reduce-scatters. :meth:`FusedAdam.step` waits for the all-gathers and writes the
gathered parts and the tails into the parameters: writing them during backward would change
tensors that autograd may still need (a parameter used twice, tied weights), so the write is
deferred.

Why parts of every parameter and not a contiguous slice of the bucket: DDP rebuilds its buckets
after the first iteration (in the order gradients became ready) and can change their
membership; with per-parameter parts the optimizer state belongs to (parameter, rank) and does not
move when the buckets do. The tails are what keeps the send buffer no larger than the bucket
(``K * (n // K) <= n``; parts of ``ceil(n / K)`` would need padding); they cost each rank Adam's
state for at most K - 1 elements per parameter, the same on every rank.

Buffers (``buffers=``). The send buffer is also the all-gather's output, so it lives from the
bucket's hook to ``step()``: the size of the bucket, the model's size over all buckets.
``"bucket"`` (the default where possible) uses DDP's own bucket buffer for it, which already
holds a copy of the gradients that ``.grad`` also holds (``gradient_as_bucket_view=False``, DDP's
default): FusedAdam rearranges that copy in place (from ``.grad``) and puts DDP's reducer in its
optimizer-in-backward mode (the one ``torch.distributed.optim._apply_optimizer_in_backward``
uses), in which DDP does not copy the bucket back into ``.grad`` at the end of backward. Then
FusedAdam's own temporaries are the receive buffer of each reduce-scatter in flight (1/K of its
bucket with a native reduce-scatter; the whole bucket with the ``all_to_all`` emulation) and the
tails. ``"own"`` (the fallback with ``gradient_as_bucket_view=True``, where ``.grad`` *is* the
bucket buffer) allocates the ``[K, W]`` buffer: about the model's size more at the end of
backward. Measured (benchmarks/README.md, GPT of 10.7 M parameters, 2 ranks): optimizer state
plus the peak of the tensors a step creates, per rank, 160.0 MiB for DDP + Adam, 119.1 with
``"bucket"`` (the whole 40.9 MiB of state saved), 147.2 with ``"own"``, and 165.9 before either
(send, receive and all-gather buffers per bucket). Buffers that gloo allocates inside its
collectives (on its own threads) are not counted.

Parameters without a gradient: parameters with ``requires_grad=False`` are not in DDP's buckets
and are never touched. With ``find_unused_parameters=True``, a parameter no rank used in this
iteration gets no update, no moment decay and no step count, as ``torch.optim.Adam`` skips a
parameter whose ``.grad`` DDP left at ``None``; one used on some ranks only is updated with the
mean over all ranks (zeros where unused), as DDP averages it. The used flags travel with the
tails because DDP only learns which parameters are globally unused after the last bucket.

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

- after backward, ``.grad`` holds this rank's *local* gradient, not the mean over ranks (with
  ``"bucket"`` a parameter this rank did not use keeps ``.grad`` None, where DDP would give
  it zeros): the mean exists only as shards, so gradient clipping by global norm and anything
  else reading ``.grad`` between backward and ``step()`` sees local values; DDP's bucket buffers
  hold no gradient after backward;
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

__all__ = ["FusedAdam", "REDUCE_SCATTER_MODES", "ALL_GATHER_MODES", "BUFFER_MODES"]

REDUCE_SCATTER_MODES = ("auto", "native", "all_to_all", "all_reduce")
ALL_GATHER_MODES = ("native", "all_reduce")
BUFFER_MODES = ("auto", "bucket", "own")

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# "/sharded" (no suffix): the layout before the tails (ceil(n / K) parts, the last ones padded).
_FORMAT_SHARDED = "ngra.FusedAdam/sharded-2"


def _collective(new: str, old: str):
    # torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and warns on
    # the old names; torch 2.2 has only the old ones.
    return getattr(dist, new, None) or getattr(dist, old)


_reduce_scatter_single = _collective("reduce_scatter_single", "reduce_scatter_tensor")
_all_gather_single = _collective("all_gather_single", "all_gather_into_tensor")


@dataclass
class _Slot:
    """One parameter of a bucket: its K main parts are columns ``[col, col + part)`` of the K rows
    of the bucket's ``[K, W]`` send and all-gather buffers, its tail columns ``[tcol, tcol +
    tail)`` of the bucket's tail buffer.

    With ``part = numel // K`` and ``tail = numel % K``, rank ``r`` owns the elements ``[r * part,
    (r + 1) * part)`` of the flattened parameter; the last ``tail`` (< K) elements belong to every
    rank (each updates them alike from the all-reduced tail)."""

    index: int          # the parameter's index in param_groups[0]["params"]
    param: torch.Tensor
    numel: int
    part: int
    col: int
    tail: int
    tcol: int


@dataclass
class _Layout:
    slots: list
    width: int          # W = sum of parts: the [K, W] buffers hold numel - tails elements
    tails: int          # T = sum of tails; the tail buffer is [T + P]: tails, then P used flags
    dtype: torch.dtype


@dataclass
class _Pending:
    layout: _Layout
    rows: torch.Tensor  # [K, W]: the send buffer, then the all-gather buffer
    work: object
    result: object      # () -> [W] reduced main parts of this rank
    tail: torch.Tensor  # [T + P], all-reduced: mean tails, then the used counts
    tail_work: object
    launched: float
    nbytes: int         # FusedAdam's own buffers of this bucket alive until its Adam is done
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

    computed by rank r only for its parts (and by every rank for the tails of fewer than K
    elements per parameter). Memory per rank: ``m, v`` (and ``vmax``) for about N/K elements,
    plus a float32 master copy of the parts for low-precision parameters, plus the transient
    buffers of ``buffers`` (``"auto"``: ``"bucket"`` unless DDP has
    ``gradient_as_bucket_view=True``, then ``"own"``; see the module doc).

    Construction is collective (every rank of DDP's process group must call it): it creates a
    second process group for the all-gathers and, with ``reduce_scatter="auto"``, probes the
    backend once. ``lr`` and the other options live in ``param_groups[0]`` as usual, so LR
    schedulers work; they are read when the update runs (during the next backward).

    ``reduce_scatter`` (``"auto"``, ``"native"``, ``"all_to_all"``, ``"all_reduce"``) and
    ``all_gather`` (``"native"``, ``"all_reduce"``) pick how the collectives are done (module doc).
    ``profile=True`` records per step the launch and completion times of every collective, the
    time spent in Adam and the peak bytes of FusedAdam's own buffers (:attr:`stats`), with one
    waiter thread per collective.
    """

    def __init__(self, ddp_model: DistributedDataParallel, lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 amsgrad: bool = False, decoupled_weight_decay: bool = False,
                 reduce_scatter: str = "auto", all_gather: str = "native",
                 buffers: str = "auto", profile: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        if buffers not in BUFFER_MODES:
            raise ValueError(f"FusedAdam: buffers must be one of {BUFFER_MODES} (got {buffers!r})")
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
        buffers = _pick_buffers(buffers, ddp_model)
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
        self._buffers = buffers
        if buffers == "bucket":
            # DDP must not copy the bucket back into .grad at the end of backward: FusedAdam
            # has written the all-gathered parameters into it by then (torch's own optimizer in
            # backward sets the same flag). .grad keeps the local gradient autograd put there.
            ddp_model.reducer._set_optimizer_in_backward()
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
        k = self.world
        for layout, rows, work, *_, tail in self._gathers:
            if work is not None:
                work.wait()
            for s in layout.slots:
                # Rows r of columns [col, col + part) are rank r's parts, in order; then the
                # tail, the same on every rank.
                p = s.param.detach()
                flat = p.view(-1) if p.is_contiguous() else torch.empty_like(p).view(-1)
                flat[:k * s.part].view(k, s.part).copy_(rows[:, s.col:s.col + s.part])
                flat[k * s.part:].copy_(tail[s.tcol:s.tcol + s.tail])
                if not p.is_contiguous():
                    p.copy_(flat.view(p.shape))
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
        k, r = self.world, self.rank
        for i, p in enumerate(params):
            if self._steps[i] == 0:  # same on every rank, so every rank joins the same calls
                continue
            part, tail = _split(p.numel(), k)
            buf = torch.zeros(len(keys), p.numel(), dtype=_master_dtype(p.dtype),
                              device=p.device)
            mine = self._shard.get(i, {})
            for j, key in enumerate(keys):
                if key in mine:
                    buf[j, r * part:(r + 1) * part] = mine[key][:part]
                    if r == 0:  # the tail, the same on every rank: once
                        buf[j, k * part:] = mine[key][part:]
            # Every rank adds its parts into zeros: a sum all-reduce is the gather (works on
            # every backend; the state dict is not on a hot path).
            dist.all_reduce(buf, group=self._group)
            state[i] = {"step": torch.tensor(float(self._steps[i]))}
            for j, key in enumerate(keys):
                state[i][key] = buf[j].view(p.shape).to(p.dtype).clone()
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
        fmt = state_dict.get("format")
        if isinstance(fmt, str) and fmt.startswith("ngra.FusedAdam/") and fmt != _FORMAT_SHARDED:
            raise ValueError(f"FusedAdam.load_state_dict: a shard of format {fmt!r}, written by "
                             f"an earlier FusedAdam whose parts differ (expected "
                             f"{_FORMAT_SHARDED!r}); save it with full_state_dict() there")
        sharded = fmt == _FORMAT_SHARDED
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
            part, _ = _split(p.numel(), self.world)
            lo = self.rank * part
            new = {}
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
                if key not in st:
                    continue
                t = st[key]
                if not sharded:
                    if t.shape != p.shape:
                        raise ValueError(f"FusedAdam.load_state_dict: parameter {i} {key} has "
                                         f"shape {tuple(t.shape)} (expected {tuple(p.shape)})")
                    t = _mine(t.reshape(-1), lo, part, self.world)
                new[key] = t.detach().to(device=p.device, dtype=_master_dtype(p.dtype)).clone()
            if not sharded and p.dtype in _LOW_PRECISION:
                new["master"] = _mine(p.detach().reshape(-1), lo, part, self.world).float()
            if new:
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
        k, w, nt = self.world, layout.width, layout.tails
        if self._buffers == "bucket":
            # The send buffer is DDP's bucket: its copy of the gradients is not needed any more,
            # since .grad holds them too (gradient_as_bucket_view=False), and DDP will not copy
            # it back (optimizer-in-backward mode). It later receives the all-gather.
            rows = bucket.buffer()[:k * w].view(k, w)
            grads = [s.param.grad for s in layout.slots]
            for g in grads:
                if g is not None and _shares_storage(g, rows):
                    raise RuntimeError("FusedAdam: a .grad is a view of DDP's bucket buffer "
                                       "(expected gradient_as_bucket_view=False); pass "
                                       "buffers='own'")
        else:
            rows = torch.empty(k, w, dtype=layout.dtype, device=bucket.buffer().device)
            grads = bucket.gradients()
        tail = torch.empty(nt + len(layout.slots), dtype=layout.dtype, device=rows.device)
        for j, (s, g) in enumerate(zip(layout.slots, grads)):
            # Row r, columns [col, col + part): rank r's part; the tail after the K parts.
            if g is None:  # not used on this rank: DDP's bucket holds zeros for it
                rows[:, s.col:s.col + s.part].zero_()
                tail[s.tcol:s.tcol + s.tail].zero_()
            else:
                g = g.reshape(-1)
                rows[:, s.col:s.col + s.part].copy_(g[:k * s.part].view(k, s.part))
                tail[s.tcol:s.tcol + s.tail].copy_(g[k * s.part:])
            # Summed over the ranks: how many used the parameter.
            tail[nt + j] = float(self._used[s.index])
            self._used[s.index] = False
        # Divide by K as DDP does before its sum all-reduce (gloo has no AVG), flags excepted.
        rows.div_(k)
        tail[:nt].div_(k)
        self._inflight.append(self._launch_reduce_scatter(rows, tail, layout))
        if self.profile:
            self._cur["hooks"].append((t0, index))
            self._note_buffers()
        self._drain(block=bucket.is_last())
        if self.profile:
            self._note_buffers()
        if bucket.is_last():
            self._phase = "ready"
        fut = torch.futures.Future()
        # "own": DDP copies this back into .grad, which it holds already (the local gradient).
        # "bucket": DDP takes views of it and copies nothing.
        fut.set_result(bucket.buffer())
        return fut

    def _layout(self, bucket) -> _Layout:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            slots, col, tcol = [], 0, 0
            for p in params:
                i = self._index.get(id(p))
                if i is None:
                    raise RuntimeError("FusedAdam: DDP's bucket holds a parameter that is not in "
                                       "ddp_model.module.parameters() (expected the same model "
                                       "FusedAdam was created with)")
                part, tail = _split(p.numel(), self.world)
                slots.append(_Slot(i, p, p.numel(), part, col, tail, tcol))
                col += part
                tcol += tail
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise RuntimeError("FusedAdam: a DDP bucket mixes dtypes "
                                   f"{sorted(map(str, dtypes))} (expected one; DDP buckets by "
                                   "dtype)")
            numel = bucket.buffer().numel()
            if self._buffers == "bucket" and numel != self.world * col + tcol:
                raise RuntimeError(f"FusedAdam: DDP's bucket buffer has {numel} elements, not "
                                   f"the {self.world * col + tcol} of its parameters (expected "
                                   "no padding); pass buffers='own'")
            layout = self._layouts[key] = _Layout(slots, col, tcol, dtypes.pop())
        return layout

    def _launch_reduce_scatter(self, rows: torch.Tensor, tail: torch.Tensor,
                               layout: _Layout) -> _Pending:
        k, w = self.world, layout.width
        t0 = time.perf_counter()
        own = 0 if self._buffers == "bucket" else rows.numel()
        if w == 0:  # every parameter smaller than K: all in the tail
            work, result, recv = None, (lambda: rows[self.rank]), None  # noqa: E731
        elif self._mode == "native":
            recv = torch.empty(w, dtype=rows.dtype, device=rows.device)
            work = _reduce_scatter_single(recv, rows.view(-1), group=self._group, async_op=True)
            result = lambda: recv  # noqa: E731
        elif self._mode == "all_to_all":
            # Rank r sends row j to rank j and receives every rank's row r: then the sum over
            # the K received rows is the reduce-scatter's result.
            recv = torch.empty(k, w, dtype=rows.dtype, device=rows.device)
            work = dist.all_to_all_single(recv.view(-1), rows.view(-1), group=self._group,
                                          async_op=True)
            result = lambda: recv.sum(0)  # noqa: E731
        else:
            recv = None
            work = dist.all_reduce(rows, group=self._group, async_op=True)
            # A copy: row r becomes this rank's all-gather input, written before Adam is done.
            result = lambda: rows[self.rank].clone()  # noqa: E731
            own += w
        # Same order on every rank: the bucket's reduce-scatter, then its tail's all-reduce.
        tail_work = dist.all_reduce(tail, group=self._group, async_op=True)
        nbytes = (own + (0 if recv is None else recv.numel()) + tail.numel()) * \
            rows.element_size()
        pend = _Pending(layout, rows, work, result, tail, tail_work, time.perf_counter(), nbytes)
        if self.profile:
            self._cur["launch_s"] += pend.launched - t0
        self._watch(tail_work if work is None else work, pend.done_at)
        return pend

    def _drain(self, block: bool) -> None:
        """Adam + all-gather for the launched reduce-scatters that have completed, in launch
        order; with ``block``, for all of them."""
        while self._inflight:
            pend = self._inflight[0]
            if not block and not all(w is None or w.is_completed()
                                     for w in (pend.work, pend.tail_work)):
                break
            t0 = time.perf_counter()
            if pend.work is not None:
                pend.work.wait()
            pend.tail_work.wait()
            t1 = time.perf_counter()
            self._inflight.popleft()
            launched = self._cur.get("launch_s", 0.0)
            self._update_and_gather(pend)
            t2 = time.perf_counter()
            if self.profile:
                self._cur["blocked_s"] += t1 - t0
                # Adam on the parts and the copies around it, without the all-gather's launch.
                self._cur["adam_s"] += t2 - t1 - (self._cur["launch_s"] - launched)
                self._cur.setdefault("_pending", []).append((pend, t1))

    @torch.no_grad()
    def _update_and_gather(self, pend: _Pending):
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        wd, amsgrad, decoupled = (group["weight_decay"], group["amsgrad"],
                                  group["decoupled_weight_decay"])
        layout, rows, tail = pend.layout, pend.rows, pend.tail
        k, r, nt, dtype = self.world, self.rank, layout.tails, layout.dtype
        reduced = pend.result()  # [W]: this rank's mean parts
        # The rank's row receives its updated parts (the all-gather's input, in place) and the
        # tail buffer the updated tails (every rank computes the same).
        mine = rows[r]
        used = [u > 0 for u in tail[nt:].tolist()]  # identical on every rank
        for j, s in enumerate(layout.slots):
            if used[j]:
                self._steps[s.index] += 1  # on every rank, so step counts agree everywhere
            if s.numel == 0:
                continue
            p_flat = s.param.detach().reshape(-1)
            # This rank's elements: its part, then the tail (shared by all ranks).
            spans = ((mine[s.col:s.col + s.part], reduced[s.col:s.col + s.part],
                      p_flat[r * s.part:(r + 1) * s.part], 0, s.part),
                     (tail[s.tcol:s.tcol + s.tail], tail[s.tcol:s.tcol + s.tail],
                      p_flat[k * s.part:], s.part, s.part + s.tail))
            st = self._shard.get(s.index)
            if not used[j]:  # no rank has a gradient: torch.optim.Adam skips it (grad is None)
                for out, _, cur, lo, hi in spans:
                    out.copy_(st["master"][lo:hi] if st is not None and "master" in st else cur)
                continue
            if st is None:
                mdt = _master_dtype(dtype)
                st = self._shard[s.index] = {
                    "exp_avg": torch.zeros(s.part + s.tail, dtype=mdt, device=rows.device)}
                st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
                if dtype in _LOW_PRECISION:
                    st["master"] = torch.cat([sp[2] for sp in spans]).float()
            if amsgrad and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
            for out, grad, cur, lo, hi in spans:
                if hi == lo:
                    continue
                sub = {key: v[lo:hi] for key, v in st.items()}
                if "master" in sub:
                    param = sub["master"]
                else:
                    # The tail's gradient and its output share the tail buffer: Adam reads the
                    # gradient into a copy first (a few elements).
                    if grad.data_ptr() == out.data_ptr():
                        grad = grad.clone()
                    # Same dtype: the parameter itself holds the exact current value of the
                    # part (step() wrote it from the all-gather), so no master copy is kept.
                    param = out
                    param.copy_(cur)
                if grad.dtype != param.dtype:
                    grad = grad.to(param.dtype)
                _adam(param, grad, sub, self._steps[s.index], lr, beta1, beta2, eps, wd, amsgrad,
                      decoupled)
                if param is not out:
                    out.copy_(param)
        t = time.perf_counter()
        work = None
        if layout.width == 0:
            pass
        elif self._ag_mode == "native":
            work = _all_gather_single(rows.view(-1), mine, group=self._ag_group, async_op=True)
        else:
            # Each rank adds its row into zeros: the sum is the gather (x + 0 = x exactly).
            # Twice the bytes of an all-gather, but gloo's all-reduce is much faster than its
            # all-gather (see benchmarks/fused_comm.py).
            rows[:r].zero_()
            rows[r + 1:].zero_()
            work = dist.all_reduce(rows, group=self._ag_group, async_op=True)
        if self.profile:
            self._cur["launch_s"] += time.perf_counter() - t
        done: list = []
        if work is not None:
            self._watch(work, done)
        # Kept until step(): the [K, W] buffer (FusedAdam's own only in "own" mode) and the
        # updated tails.
        own = (0 if self._buffers == "bucket" else rows.numel()) + tail.numel()
        self._gathers.append((layout, rows, work, t, done, own * rows.element_size(), tail))

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
    def buffer_mode(self) -> str:
        """Where the send and all-gather buffers live: ``"bucket"`` or ``"own"``."""
        return self._buffers

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


def _split(numel: int, world: int) -> tuple:
    """(part, tail): every rank owns ``part = numel // K`` elements, ``[r * part, (r + 1) *
    part)``; the last ``tail = numel % K`` belong to every rank."""
    return numel // world, numel % world


def _mine(flat: torch.Tensor, lo: int, part: int, world: int) -> torch.Tensor:
    """A rank's elements of a flattened parameter-shaped tensor: its part, then the tail."""
    return torch.cat([flat[lo:lo + part], flat[world * part:]])


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pick_buffers(mode: str, ddp_model) -> str:
    """"bucket" where DDP's bucket buffer is free to use (module doc), else "own"."""
    as_view = bool(getattr(ddp_model, "gradient_as_bucket_view", False))
    flag = hasattr(ddp_model.reducer, "_set_optimizer_in_backward")
    if mode == "auto":
        return "bucket" if flag and not as_view else "own"
    if mode == "bucket" and as_view:
        raise ValueError("FusedAdam: buffers='bucket' needs DDP(gradient_as_bucket_view=False) "
                         "(got True: .grad is the bucket buffer there, which FusedAdam would "
                         "overwrite); pass buffers='own' or 'auto'")
    if mode == "bucket" and not flag:
        raise ValueError(f"FusedAdam: buffers='bucket' needs DDP's optimizer-in-backward mode, "
                         f"which this torch ({torch.__version__}) lacks; pass buffers='own'")
    return mode


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
