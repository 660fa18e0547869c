"""AdamA: Adam whose moments accumulate the micro-batch gradients, so no gradient buffer lives
across micro-batches.

After Zhang et al., "Adam Accumulation to Reduce Memory Footprints of both Activations and
Gradients for Large-scale DNN Training" (2023). With gradient accumulation, a step over N
micro-batches keeps a full gradient buffer alive from the first micro-batch's backward to
``step()``, alongside the next micro-batches' activations. AdamA folds each parameter's gradient
into Adam's moments as soon as backward has produced it (``Tensor.register_post_accumulate_grad_
hook``) and frees it, so gradients live one parameter at a time.

The math
--------
Write ``g_i = p.grad`` after micro-batch ``i``'s backward, i = 1..N. As with gradient
accumulation, each micro-batch's loss is scaled by ``1/N`` (``(loss_i / N).backward()``), so
``G = sum_i g_i`` is the gradient of the mean loss, the gradient Adam + accumulation steps with.
A step t does (the paper's update)::

    m_t = b1 m_{t-1} + (1 - b1) sum_i g_i                     (= Adam + accumulation's m_t)
    v_t = b2 v_{t-1} + (1 - b2) sum_i g_i^2                   (Adam + accumulation: G^2)
    p  -= lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)

The first moment is exactly Adam with gradient accumulation. The second moment cannot be: the
square of the sum needs the sum, which is the buffer AdamA removes, so it accumulates the squared
micro-batch gradients instead. Exactly::

    N sum_i g_i^2 - G^2 = N^2 Var_i(g_i)        (population variance over the N micro-batches)

In expectation, for unscaled micro-batch gradients ``d_i = N g_i = grad(loss_i)`` drawn
independently with mean ``mu`` and variance ``s2`` per coordinate: Adam + accumulation adds
``E[G^2] = mu^2 + s2/N`` per step (s2/N is the noise of the mean), AdamA adds ``E[sum_i g_i^2] =
(mu^2 + s2) / N``. The two agree when the micro-batch gradients are noise-dominated (``mu^2 <<
s2``, as late in training on the GPT measured below); when they agree with each other (``s2 =
0``, e.g. N copies of one micro-batch) AdamA's v is N times smaller and its step up to
``sqrt(N)`` times larger (less where ``eps`` matters). For N = 1 AdamA is Adam.

``second_moment="mean"`` folds ``N sum_i g_i^2 = mean_i d_i^2`` (expectation ``mu^2 + s2``)
instead, the squared gradient of one micro-batch (as in "Batch size invariant Adam", Wang and
Aitchison 2024): equal to Adam + accumulation when the micro-batches agree, up to N times larger
than its v when noise dominates (smaller steps).

Since ``v_mean = N v_sum`` step by step, ``"sum"`` with ``(lr, eps)`` takes exactly the steps of
``"mean"`` with ``(lr sqrt(N), eps sqrt(N))`` (tested): the choice is how a learning rate tuned
for Adam carries over. With ``"mean"`` (``N sum_i g_i^2 >= G^2`` by Cauchy-Schwarz) a step's
contribution to v is never below Adam + accumulation's, so its steps are never larger; with
``"sum"`` they may be up to ``sqrt(N)`` times larger.

Neither form is Adam + accumulation at another learning rate: per element, the ratio of AdamA's v
increment to Adam's, ``N sum_i g_i^2 / G^2`` (1 when the micro-batches agree, about N when their
noise dominates), differs between elements and drifts during training. Written with the
per-example gradient variance ``s1`` and a global batch of B examples, Adam + accumulation's v
estimates ``mu^2 + s1 / B`` and ``"mean"``'s ``mu^2 + s1 N / B``: the second moment of a batch of
B / N, the micro-batch (the batch size invariance of Wang and Aitchison). Elements whose
gradient is mostly noise get relatively smaller steps than under Adam, by up to ``sqrt(N)``, and
no single learning rate undoes that reweighting.

Measured (``benchmarks/adama.py --tasks gpt --micro 8 --steps 300 --sweep ...``; char GPT,
d_model 128, batch 32 x 64, N = 8, so micro-batches of 4 sequences; learning rates 3.75e-4 to
1.2e-2 by factors of 2, then 3 seeds at each method's best; see benchmarks/README.md):

- at one learning rate the gap is mostly step size: at 3e-3, +0.14 nats ("mean") and +0.28
  ("sum") in final validation loss; at 1.5e-3, +0.10 and +0.18 (seed 0);
- each at its best (Adam + accumulation 1.5e-3, "mean" 1.5e-3, "sum" 7.5e-4, the same as "mean"
  at 2.1e-3), over 3 seeds: Adam + accumulation 2.173 (seed std 0.025), "sum" +0.060 nats,
  "mean" +0.090, AdamA behind on every seed (paired: same weights and batches). So AdamA
  converges a little more slowly than Adam + accumulation on this task even when tuned: 2.4
  and 3.6 seed standard deviations, not within noise;
- the ratio ``N sum_i g_i^2 / G^2`` (Adam + accumulation's weights, median over elements) is 2.3
  at the start and 8.5 after 300 steps: the micro-batch gradients mostly agree early and are
  noise-dominated later, so "sum" steps up to ``sqrt(8)`` times larger than Adam's early and
  "mean" about ``sqrt(8)`` times smaller late;
- a plain-torch reference of the update on this GPT (tests/ngra/optim/test_adama.py) matches
  AdamA to 1e-10 with weight decay (L2 and AdamW) and amsgrad: the gap is the definition, not a
  bug in the bias correction, the 1/N scaling or the hooks;
- on a GCN on Cora (30 steps, N = 8, micro-batches of disjoint training vertices, dropout), whose
  micro-batch gradients are noise-dominated from the start (median ratio 8.0), AdamA tuned is
  as good or a little better: "mean" -0.037 nats (every seed), "sum" -0.015 (mixed), against a
  seed std of 0.010.

Where the 1/N loss scaling enters: m is linear and v quadratic in the g_i, so scaling every g_i
by a common c scales m by c and sqrt(v) by c, and the update m / sqrt(v) does not change (apart
from ``eps``, as in Adam). Leaving the losses unscaled therefore gives the same steps except for
``eps`` and for the L2 term below, whose per-micro-batch share ``wd p / N`` assumes the 1/N.
The factor N of ``"mean"`` is the declared micro-batch count, not taken from the gradients.
Options, as ``torch.optim.Adam``:

- ``weight_decay`` (L2): the penalty ``wd/2 |p|^2`` is part of every micro-batch's loss, so each
  micro-batch adds ``wd p / N`` to its gradient: ``g_i + wd p / N`` above (for N = 1, Adam's
  ``g + wd p``; micro-batches in which ``p`` got no gradient still count their share);
- ``decoupled_weight_decay=True`` (AdamW): ``p *= 1 - lr wd`` before the update;
- ``amsgrad``: ``vmax_t = max(vmax_{t-1}, v_t)`` replaces ``v_t`` in the denominator.

A parameter that received no gradient in any of the step's micro-batches is left alone, state
included (as Adam skips a parameter whose ``.grad`` is None).

Using it
--------
::

    opt = AdamA(model.parameters(), lr=1e-3)
    for batch in loader:
        with opt.micro_batches(4):          # the next 4 backward passes are one step
            for mb in batch.chunk(4):
                (loss_fn(model(mb)) / 4).backward()
        opt.step()

Outside ``micro_batches(N)``, one backward is one step (N = 1: a drop-in Adam); a second backward
before ``step()`` is an error. Every backward pass is one micro-batch (counted at its end), so a
parameter may receive only one gradient per micro-batch: sum a micro-batch's losses before
calling backward. Gradients that do not come from a backward (set by hand, or with
``hooks=False``) are folded by :meth:`AdamA.accumulate`, one micro-batch per call. Because
``p.grad`` is gone after backward, gradient clipping and AMP's GradScaler (which need all
gradients at once) do not apply.

Several processes
-----------------
With ``process_group=``, each micro-batch gradient is summed over the group *before* it is
folded (an asynchronous all-reduce started in the hook, waited for and folded at the end of the
backward), so ``g_i`` above is the gradient of the global micro-batch ``i`` (every rank's part of
it) and ``v`` gets the square of the global micro-batch gradient: K processes with N
micro-batches each equal one process with N micro-batches that hold all K parts (tested). The
gradients are *summed*, as ngra's ``sync_gradients``: scale each rank's loss so that the sum over
ranks is the global micro-batch's loss divided by N. The alternative of all-reducing the
accumulated ``sum g`` and ``sum g^2`` once per step costs less communication but squares each
rank's local gradient: it equals one process with K*N micro-batches, not N, and is not done here.
Every rank must produce gradients for the same parameters in the same backward passes. Costs:
a micro-batch's gradients live until its backward ends (waiting for their collectives), not one
parameter at a time; and a step communicates N gradients (per-parameter collectives, no
bucketing), where DDP + accumulation under ``no_sync()`` communicates one.

``shard=True`` (ZeRO stage 2 at parameter granularity): each parameter is owned by one rank
(parameters assigned greedily by size, in order); the micro-batch gradient is *reduced* to its
owner only, only the owner keeps that parameter's moments, and ``step()`` updates the owned
parameters and broadcasts each from its owner (the all-gather of the updated parameters). Results
equal the unsharded run; a rank's ``state_dict()`` holds its own shard.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

__all__ = ["AdamA"]


def _check_number(name: str, value, low: float, high: float | None, *, low_open: bool = False,
                  fix: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and < {high:g}" if high is not None
                                                          else "")
        raise ValueError(f"AdamA: expected {name} a finite number {bound} (got {value!r}); "
                         f"{fix}")
    return float(value)


class AdamA(torch.optim.Optimizer):
    """Adam with optimizer-state accumulation over micro-batches (see the module docstring for
    the math and the data-parallel rules).

    ``AdamA(params, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
    decoupled_weight_decay=False, amsgrad=False, second_moment="sum", hooks=True,
    process_group=None, shard=False)``. Per-parameter state is Adam's (``step``, ``exp_avg``,
    ``exp_avg_sq``, ``max_exp_avg_sq``) plus ``micro_batches`` (how many micro-batches of the
    step in progress were folded into it).
    """

    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
                 amsgrad: bool = False, second_moment: str = "sum", hooks: bool = True,
                 process_group=None, shard: bool = False):
        lr = _check_number("lr", lr, 0.0, None, low_open=True, fix="pass e.g. lr=1e-3")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"AdamA: expected betas a pair (beta1, beta2) (got {betas!r}); "
                             "pass e.g. betas=(0.9, 0.999)")
        b1 = _check_number("betas[0]", betas[0], 0.0, 1.0, fix="pass e.g. betas=(0.9, 0.999)")
        b2 = _check_number("betas[1]", betas[1], 0.0, 1.0, fix="pass e.g. betas=(0.9, 0.999)")
        eps = _check_number("eps", eps, 0.0, None, fix="pass e.g. eps=1e-8")
        weight_decay = _check_number("weight_decay", weight_decay, 0.0, None,
                                     fix="pass 0 for none, e.g. 1e-2")
        for name, flag in (("decoupled_weight_decay", decoupled_weight_decay),
                           ("amsgrad", amsgrad), ("hooks", hooks), ("shard", shard)):
            if not isinstance(flag, bool):
                raise TypeError(f"AdamA: expected {name} True or False (got {flag!r})")
        if second_moment not in ("sum", "mean"):
            raise ValueError(f"AdamA: expected second_moment 'sum' (the paper's) or 'mean' (got "
                             f"{second_moment!r})")
        if shard and process_group is None:
            raise ValueError("AdamA: shard=True needs a process group to shard over (got "
                             "process_group=None); pass process_group=torch.distributed.group."
                             "WORLD")
        if process_group is not None and not dist.is_initialized():
            raise RuntimeError("AdamA: process_group was given but torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group first")
        if hooks and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            raise RuntimeError(f"AdamA: hooks=True needs torch >= 2.1 (got {torch.__version__}); "
                               "pass hooks=False and call opt.accumulate() after each backward")
        defaults = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad,
                        second_moment=second_moment)
        self._hooks_enabled = hooks
        self._group = process_group
        self._shard = shard
        self._handles: dict[torch.Tensor, object] = {}  # every parameter added (hook or None)
        self._group_index: dict[torch.Tensor, int] = {}  # parameter -> its param_groups index
        self._owner: dict[torch.Tensor, int] = {}
        self._owned_bytes: list[int] = []
        # The step in progress: N declared for it (None: none started), micro-batches completed.
        self._plan: int | None = None  # N of an open micro_batches(N) block
        self._n: int | None = None
        self._k = 0
        self._in_backward = False  # a backward pass has folded something; its end is queued
        self._seen: set[int] = set()  # parameters folded in the current micro-batch
        self._pending: list = []  # (param, gradient, work) waiting for a collective
        self._broken: str | None = None
        super().__init__(params, defaults)

    # -- parameters ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._group is not None:
            world = dist.get_world_size(self._group)
            if not self._owned_bytes:
                self._owned_bytes = [0] * world
        for p in self.param_groups[-1]["params"]:
            if not p.requires_grad:
                raise ValueError("AdamA: expected parameters that require grad (got a tensor of "
                                 f"shape {tuple(p.shape)} with requires_grad=False); leave it out "
                                 "of the optimizer")
            if not p.is_leaf:
                raise ValueError("AdamA: expected leaf tensors (got a non-leaf of shape "
                                 f"{tuple(p.shape)}); pass the model's parameters")
            if p.is_complex():
                raise TypeError(f"AdamA: complex parameters are not supported (got {p.dtype}); "
                                "optimize torch.view_as_real(p) instead")
            self._handles[p] = (p.register_post_accumulate_grad_hook(self._on_grad)
                                if self._hooks_enabled else None)
            self._group_index[p] = len(self.param_groups) - 1
            if self._group is not None:
                # Greedy by size, in parameter order: every rank computes the same owners.
                r = min(range(len(self._owned_bytes)), key=lambda i: (self._owned_bytes[i], i))
                self._owner[p] = r if self._shard else -1
                self._owned_bytes[r] += p.numel() * p.element_size()

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _check_params(self) -> None:
        params = self._params()
        known = self._handles
        if len(params) != len(known) or any(p not in known for p in params):
            raise RuntimeError(
                f"AdamA: the parameter list changed since construction: expected the "
                f"{len(known)} parameters AdamA registered (got {len(params)} in "
                "param_groups, not all of them registered); add parameters with "
                "add_param_group(), never by editing param_groups")

    def _global(self, rank: int) -> int:
        """The global rank of ``rank`` in the group (collectives take global ranks)."""
        if self._group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self._group, rank)

    def _mine(self, p) -> bool:
        return not self._shard or self._owner[p] == dist.get_rank(self._group)

    # -- accumulation -------------------------------------------------------------------------

    @contextlib.contextmanager
    def micro_batches(self, n: int):
        """The backward passes in this block are micro-batches of steps of ``n`` each; call
        ``step()`` after every ``n`` of them (inside or after the block; a step's micro-batches
        may also be spread over several blocks of the same ``n``). Scale each micro-batch's
        loss by ``1/n``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"AdamA.micro_batches: expected n an int >= 1 (got {n!r}); pass "
                             "the number of backward passes per step")
        if self._plan is not None:
            raise RuntimeError(f"AdamA.micro_batches({n}): already inside micro_batches("
                               f"{self._plan}); blocks do not nest")
        if self._n is not None and self._n != n:
            raise RuntimeError(f"AdamA.micro_batches({n}): a step of {self._n} micro-batches "
                               f"is in progress ({self._k} done); call step() first")
        self._plan = n
        try:
            yield self
        finally:
            self._plan = None

    def _begin_micro_batch(self) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        if self._n is None:
            self._n = self._plan if self._plan is not None else 1
        if self._k >= self._n:
            if self._plan is None:
                raise RuntimeError(
                    f"AdamA: a second backward pass before step() (expected 1 micro-batch per "
                    f"step outside a micro_batches block, got {self._k + 1}); wrap the "
                    "micro-batches in `with opt.micro_batches(N):`, or call step()")
            raise RuntimeError(f"AdamA: micro-batch {self._k + 1} of a step declared with "
                               f"micro_batches({self._n}) (expected at most {self._n}); call "
                               "step() after every N backward passes")
        self._seen.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: fold ``p.grad`` (this micro-batch's) and free it."""
        if not self._in_backward:
            try:
                self._begin_micro_batch()
            except RuntimeError:
                p.grad = None  # nothing of this refused backward is kept (it stops here)
                raise
            self._in_backward = True
            # Runs once when this backward pass ends: that is where a micro-batch ends (the
            # engine's end-of-backward callback, as DDP and FSDP use it).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_batch)
        grad = p.grad
        if grad is None:
            return  # another hook on p (a second optimizer over it) took the gradient already
        p.grad = None
        self._take(p, grad)

    def _take(self, p, grad) -> None:
        if grad.is_sparse:
            self._broken = ("AdamA: the step's accumulation was interrupted by an error during "
                            "backward; restore a state_dict to continue")
            raise RuntimeError(f"AdamA: sparse gradients are not supported (got a sparse "
                               f"gradient for a parameter of shape {tuple(p.shape)}); use "
                               "nn.Embedding(sparse=False) or torch.optim.SparseAdam")
        if id(p) in self._seen:
            self._broken = ("AdamA: the step's accumulation was interrupted by an error during "
                            "backward; restore a state_dict to continue")
            raise RuntimeError(
                f"AdamA: a parameter of shape {tuple(p.shape)} received a second gradient in "
                "one micro-batch (expected one per backward pass); sum the micro-batch's losses "
                "and call backward once, or use hooks=False and opt.accumulate()")
        self._seen.add(id(p))
        if self._group is None:
            self._fold(p, grad)
            return
        if self._shard:
            work = dist.reduce(grad, dst=self._global(self._owner[p]), group=self._group,
                               async_op=True)
        else:
            work = dist.all_reduce(grad, group=self._group, async_op=True)
        self._pending.append((p, grad, work))

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for p, grad, work in pending:
            work.wait()
            if self._mine(p):
                self._fold(p, grad)

    def _end_micro_batch(self) -> None:
        self._in_backward = False
        self._drain()
        self._k += 1

    @torch.no_grad()
    def _fold(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """m += (1-b1) g, v += (1-b2) g^2 (times N for "mean"), after decaying both once per
        step."""
        group = self._group_of(p)
        b1, b2 = group["betas"]
        wd, n = group["weight_decay"], self._n
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["micro_batches"] = 0
        if state["micro_batches"] == 0:
            state["exp_avg"].mul_(b1)
            state["exp_avg_sq"].mul_(b2)
        if wd and not group["decoupled_weight_decay"]:
            grad = grad.add(p, alpha=wd / n)
        state["exp_avg"].add_(grad, alpha=1 - b1)
        state["exp_avg_sq"].addcmul_(grad, grad, value=(1 - b2) * self._v_factor(group))
        state["micro_batches"] += 1

    def _v_factor(self, group) -> int:
        return self._n if group["second_moment"] == "mean" else 1

    def _group_of(self, p):
        i = self._group_index.get(p)
        if i is not None and i < len(self.param_groups):
            return self.param_groups[i]
        raise RuntimeError("AdamA: the parameter list changed since construction: a gradient "
                           f"arrived for a parameter of shape {tuple(p.shape)} that is in no "
                           "param group; add parameters with add_param_group()")

    def accumulate(self) -> int:
        """Fold every parameter's current ``.grad`` as one micro-batch and free it (for
        gradients set by hand, or ``hooks=False``); returns how many were folded."""
        self._check_params()
        if self._in_backward:
            raise RuntimeError("AdamA.accumulate(): called during a backward pass")
        ready = [p for p in self._params() if p.grad is not None]
        if not ready:
            raise RuntimeError("AdamA.accumulate(): expected at least one parameter with a "
                               "gradient (got none: every .grad is None); run backward first "
                               "(with hooks=True, backward has folded and freed them already)")
        self._begin_micro_batch()
        for p in ready:
            grad = p.grad
            p.grad = None
            self._take(p, grad)
        self._drain()
        self._k += 1
        return len(ready)

    # -- the update ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Apply the accumulated step (with bias correction); needs all N micro-batches."""
        if closure is not None:
            raise TypeError("AdamA.step(): closures are not supported (got one); run the "
                            "forward and backward passes before step()")
        self._check_params()
        if self._broken:
            raise RuntimeError(self._broken)
        if self._in_backward:
            raise RuntimeError("AdamA.step(): called during a backward pass")
        if self._n is None or self._k == 0:
            raise RuntimeError("AdamA.step(): no micro-batch was accumulated since the last step "
                               "(expected >= 1 backward pass, got 0); run backward() before "
                               "step() (gradients set by hand: call opt.accumulate())")
        if self._k != self._n:
            raise RuntimeError(f"AdamA.step(): expected {self._n} micro-batches before step() "
                               f"(got {self._k}); run the remaining backward passes")
        leftover = [p for p in self._params() if p.grad is not None]
        if leftover:
            raise RuntimeError(f"AdamA.step(): {len(leftover)} parameter(s) hold a .grad that was "
                               "never folded (set by hand after backward?); call "
                               "opt.accumulate() for them as a micro-batch, or zero_grad()")
        n = self._n
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state.get(p)
                if not self._mine(p) or not state or state["micro_batches"] == 0:
                    continue  # no gradient this step (or another rank's shard): as Adam, skip
                if wd and not group["decoupled_weight_decay"] and state["micro_batches"] < n:
                    # The L2 share of the micro-batches in which p got no gradient.
                    missing = n - state["micro_batches"]
                    share = p * (wd / n)
                    state["exp_avg"].add_(share, alpha=(1 - b1) * missing)
                    state["exp_avg_sq"].addcmul_(share, share,
                                                 value=(1 - b2) * self._v_factor(group) * missing)
                state["micro_batches"] = 0
                state["step"] += 1
                t = state["step"].item()
                if wd and group["decoupled_weight_decay"]:
                    p.mul_(1 - lr * wd)
                bc1 = 1 - b1 ** t
                bc2_sqrt = math.sqrt(1 - b2 ** t)
                v = state["exp_avg_sq"]
                if group["amsgrad"]:
                    torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
                    v = state["max_exp_avg_sq"]
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)
        if self._shard:
            # The all-gather of the updated parameters: each from its owner, in a fixed order.
            for p in self._params():
                dist.broadcast(p.data, src=self._global(self._owner[p]), group=self._group)
        self._n = None
        self._k = 0
        return None

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's optimizer state dict plus ``"adama"``: the step in progress (``n`` declared
        micro-batches, ``k`` done), so a checkpoint taken between micro-batches resumes the
        accumulation. Refused after an error during backward left the moments half-folded."""
        if self._broken:
            raise RuntimeError(self._broken)
        sd = super().state_dict()
        sd["adama"] = {"n": self._n, "k": self._k}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        progress = state_dict.pop("adama", None)
        if not isinstance(progress, dict) or set(progress) != {"n", "k"}:
            raise ValueError(f"AdamA.load_state_dict: expected an AdamA state dict with an "
                             f"'adama' entry {{'n', 'k'}} (got {progress!r}); load a state dict "
                             "saved by AdamA.state_dict()")
        n, k = progress["n"], progress["k"]
        if not ((n is None and k == 0) or (isinstance(n, int) and isinstance(k, int)
                                           and 0 <= k <= n)):
            raise ValueError(f"AdamA.load_state_dict: expected 0 <= k <= n micro-batches (got "
                             f"n={n!r}, k={k!r})")
        super().load_state_dict(state_dict)
        for st in self.state.values():
            st.setdefault("micro_batches", 0)
        self._n, self._k = n, k
        # Loading is also how a step broken by an error during backward is recovered.
        self._broken = None
        self._in_backward = False
        self._pending = []
