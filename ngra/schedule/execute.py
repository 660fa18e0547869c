"""Run a pipeline schedule for real: a GPT cut into stages, one process per device, activations and
gradients over torch.distributed point-to-point (gloo on CPU); and measure the costs the search
needs (:func:`calibrate`).

Each rank walks its device's block order (:meth:`Schedule.orders`). ``F{s}.{i}`` takes micro-batch
``i``'s input of stage ``s`` (token ids for stage 0, else the previous stage's output: received
from its rank, or handed over in memory when the previous stage is on the same rank), runs the
stage and sends the output on with a non-blocking ``isend``. ``B{s}.{i}`` back-propagates the
stage (from ``loss_i / m`` at the last stage, else from the gradient received from stage ``s+1``)
and sends the gradient of its input to stage ``s-1``. Sends never block, and a block waits only
for the messages of its dependencies, so an order the simulator accepts (no deadlock) runs
without deadlock. Every message has its own tag (``2 (s m + i)`` for activations, ``+1`` for
gradients), so messages between the same two ranks can't be confused.

Receives are posted ahead: by default every receive of a step at its start
(``ExecConfig.lookahead=None``; an int ``k`` posts each one ``k`` blocks before the block that
needs it). Why: gloo's TCP transport is a rendezvous. An ``isend`` whose receive is not yet
posted only sends a notification; the data leaves when the receiver posts its receive, which
sends a notification back that the *sender's* gloo thread must wake up to answer. A receive
posted at the block itself (``lookahead=0``, what this executor did before) therefore costs a
round trip that waits for the sender's process to be scheduled while it computes, not the
transfer the simulator models. On the shared 2-core machine with other jobs running
(2026-11-25) such late receives waited 3.9-4.7 ms (median) against blocks of 1.5-12 ms: 13-16 ms
per step for 1F1B, greedy and the searched schedule on the linear placement, 17-82 ms on the
V-shape, while GPipe lost 7 and 0.2 ms (its receivers mostly wait for the message: receive
first, no round trip). Posted at the step's start, the same waits were 0.02-0.23 ms (one block
ahead: 0.02-2.1 ms, too late when blocks are short). With nothing else running, receives at
the block lost 0.6-22 ms per step on the tight schedules and posted ahead 0.1-3.3 ms; the step
times differed within the noise on the linear and V placements but were 7-22% longer on the
interleaved one, whose every stage boundary crosses ranks (benchmarks/README.md). When the
receive is posted first, ``isend`` writes the data at once from the sender's thread. The price
is memory: a rank holds a buffer for every message of the step from its start (``lookahead``
bounds that).

A stage may span several devices (``stage_devices[s]`` a tuple), the first or the last one:
then it is the embedding or the head alone, split by vocabulary over those devices (the shared
embedding of Tessel's M-shape; ``mshape(p)`` on ``p`` ranks), and its blocks are in each of
their orders. A stage's output is the sum of its devices' outputs (the embedding's rows outside
a device's shard give zero; the head's input gradient is a sum over its shards), and every
device of the next stage receives every term and adds them (the same for gradients, backwards).
The split head's cross-entropy all-reduces the logits' max, the sum of exponentials and the
target's logit over its devices (:func:`vocab_parallel_cross_entropy`) after a barrier of its
devices, so that its block starts on all of them at once, as in the simulator. Runs on 2-4 gloo
ranks are tested (linear, V-shape, loop and M-shape placements, every standard schedule and the
searched one give the single-device loss and gradients).

The gradient is that of ``mean_i loss_i`` = the full batch's mean cross-entropy when micro-batches
have equal size, so the result matches single-device ``GPT(idx, targets)`` up to rounding.

Calibration (:func:`calibrate`): every rank runs its stages' forward and backward on one
micro-batch at the same time as the others (a few warm-up, then timed iterations), or, given
block orders, runs that schedule's steps and times every block inside them; each pair of ranks
whose stages exchange messages ping-pongs one activation. The medians give a
:class:`Calibration`, whose :meth:`~Calibration.problem` is the pipeline problem in seconds (for
the simulator's prediction) or in integer units (for the z3 search, which needs integers), and
whose :meth:`~Calibration.expected_makespan` averages the simulated makespan over durations drawn
from the samples. On the idle 2-core machine, backwards timed inside a greedy schedule's steps
took a median 6% longer than alone (-12% to +11%) and forwards 13% less to 13% more (likely
other stages' weights and activations in between, and the gloo threads handling messages on the
same two cores), and they vary more; a schedule with many nearly critical paths pays for the
variance, which the deterministic simulation does not see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTStage", "split_gpt", "stage_shards", "vocab_parallel_cross_entropy",
           "merge_grads", "ExecConfig", "ExecResult", "pipeline_worker",
           "schedules_worker", "reference_step", "make_model", "measured_problem", "Calibration",
           "calibrate", "calibrate_worker", "calibration_from", "spawn"]


class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a GPT, with the embeddings if ``first``, the final norm if ``norm``
    (default: ``last``) and the head if ``last``. Holds the model's own submodules (parameters
    shared, not copied).

    ``vocab=(a, b)``: a tensor-parallel shard of a stage without blocks (the embedding or the
    head alone, as the shared embedding of Tessel's M-shape, split over the devices). The
    embedding shard looks up only tokens ``a <= t < b`` (rows ``a:b`` of the token table; zero
    for the others) and adds the positions if ``positions``: the full embedding is the sum of
    the shards' outputs. The head shard gives logits ``[..., b - a]`` of those tokens; the
    cross-entropy over the shards is :func:`vocab_parallel_cross_entropy`."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, *, norm=None,
                 vocab=None, positions: bool = True):
        super().__init__()
        self.first, self.last = first, last
        self.norm = last if norm is None else norm
        if vocab is not None and (hi > lo or first == last):
            raise ValueError(f"vocab: a shard is the embedding or the head alone, without blocks "
                             f"(got blocks [{lo}, {hi}), first={first}, last={last})")
        self.vocab, self.positions = vocab, positions
        self.emb = nn.ModuleDict({"tok": model.tok, "pos": model.pos}) if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.ln_f = model.ln_f if self.norm else None
        self.head = model.head if last else None

    def forward(self, x):
        if self.first:
            if self.vocab is None:
                x = self.emb["tok"](x)
            else:
                a, b = self.vocab
                inside = (x >= a) & (x < b)
                w = self.emb["tok"].weight[a:b]
                x = F.embedding((x - a).clamp(0, b - a - 1), w) * inside.unsqueeze(-1)
            if self.positions:
                x = x + self.emb["pos"](torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.norm:
            x = self.ln_f(x)
        if self.last:
            x = self.head(x) if self.vocab is None else \
                F.linear(x, self.head.weight[self.vocab[0]:self.vocab[1]])
        return x


def split_gpt(model, n_stages: int, *, embed_alone: bool = False,
              head_alone: bool = False) -> list[GPTStage]:
    """``n_stages`` stages with the GPT's blocks spread as evenly as possible (earlier stages get
    the extra block). ``embed_alone`` / ``head_alone``: the first / last stage is the embedding
    / the head alone (the final norm stays with the stage before), as when it spans several
    devices (M-shape)."""
    n = len(model.blocks)
    a, z = int(embed_alone), int(head_alone)
    k = n_stages - a - z
    if not 1 <= k <= n:
        raise ValueError(f"n_stages: expected {1 + a + z}..{n + a + z} (the model's blocks"
                         f"{', + 1 for the embedding alone' if a else ''}"
                         f"{', + 1 for the head alone' if z else ''}) (got {n_stages})")
    cuts = [n * j // k for j in range(k + 1)]
    out = [GPTStage(model, 0, 0, True, False)] if a else []
    out += [GPTStage(model, cuts[j], cuts[j + 1], j == 0 and not a, j == k - 1 and not z,
                     norm=j == k - 1) for j in range(k)]
    if z:
        out.append(GPTStage(model, n, n, False, True, norm=False))
    return out


def stage_shards(stage_devices) -> list[tuple]:
    """Each stage's devices as a tuple (an int ``d`` is ``(d,)``)."""
    return [tuple(int(x) for x in d) if isinstance(d, (tuple, list)) else (int(d),)
            for d in stage_devices]


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary over the ranks of ``group``: the global
    max, the sum of exponentials and the target's logit are all-reduced (forward only; the
    gradient ``(softmax - onehot) / N`` of each shard is local)."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):
        import torch.distributed as dist

        v = logits.shape[1]
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        z = logits - top.unsqueeze(-1)
        e = z.exp()
        inside = (target >= lo) & (target < lo + v)
        local = (target - lo).clamp(0, v - 1)
        sums = torch.stack([e.sum(-1), torch.where(inside, z.gather(-1, local[:, None])[:, 0],
                                                   torch.zeros(()))])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(e / sums[0].unsqueeze(-1), local, inside)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, g):
        soft, local, inside = ctx.saved_tensors
        grad = soft.clone()
        rows = inside.nonzero()[:, 0]
        grad[rows, local[rows]] -= 1.0
        return grad * (g / soft.shape[0]), None, None, None


def vocab_parallel_cross_entropy(logits, target, lo: int, group=None):
    """``F.cross_entropy(full_logits, target)`` (mean) when this rank holds the columns
    ``[lo, lo + logits.shape[1])`` of ``full_logits [N, V]`` and the other ranks of ``group``
    the rest; every rank of the group must call it at once. ``target [N]`` is the same on
    all."""
    return _VocabParallelCE.apply(logits, target, lo, group)


@dataclass(frozen=True)
class ExecConfig:
    """What every rank needs: the model, the data, and the block orders to run."""

    orders: tuple          # per device, block names (F{s}.{i} / B{s}.{i})
    stage_devices: tuple   # device (rank) of each stage, or a tuple of them (split: M-shape)
    micro_batches: int
    batch: int = 8
    seq: int = 16
    vocab: int = 32
    d_model: int = 32
    n_layer: int = 4
    n_head: int = 2
    seed: int = 0
    steps: int = 1         # timed repetitions (the first is also a warm-up when steps > 1)
    lookahead: int | None = None  # receives posted this many blocks ahead (None: all at once)


@dataclass(frozen=True)
class ExecResult:
    rank: int
    loss: float | None            # the mean loss (on the rank of the last stage)
    grads: dict                   # parameter name -> gradient, for this rank's stages
    #                               (split ones: whole, zero outside this rank's rows)
    step_seconds: list            # wall time of each step (barrier to barrier)
    block_seconds: dict           # (kind, stage) -> list of measured durations
    trace: list = ()   # per step (t0, [(name, begin, compute, end, sent)]), perf_counter seconds


def make_model(cfg: ExecConfig):
    from ngra.nn.transformer import GPT

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.vocab, cfg.seq, cfg.d_model, cfg.n_layer, cfg.n_head)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    tgt = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return model, idx, tgt


def reference_step(cfg: ExecConfig):
    """Single-device loss and gradients of the same model and batch."""
    model, idx, tgt = make_model(cfg)
    _, loss = model(idx, tgt)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _parse(name: str):
    kind, rest = name[0], name[1:]
    s, i = rest.split(".")
    return kind, int(s), int(i)


class _Pipeline:
    """One rank's share of the staged GPT and its data, and one step of a block order.

    A stage on several devices (the embedding or the head alone, first or last: M-shape) is
    split by vocabulary over them (:class:`GPTStage` ``vocab``); its blocks run on each of its
    devices. A stage's output is the sum of what each of its devices computes (one term for a
    stage on one device), and every device of the next stage receives every term (the local one
    in memory) and sums them; gradients flow back the same way."""

    def __init__(self, rank: int, world: int, cfg: ExecConfig):
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.model, idx, tgt = make_model(cfg)
        self.devs = stage_shards(cfg.stage_devices)
        self.n_stages = n = len(self.devs)
        m = cfg.micro_batches
        if cfg.batch % m:
            raise ValueError(f"batch {cfg.batch} must split into {m} equal micro-batches")
        if max(max(d) for d in self.devs) >= world:
            raise ValueError(f"stage devices {cfg.stage_devices} need more than {world} ranks")
        wide = [s for s in range(n) if len(self.devs[s]) > 1]
        if any(0 < s < n - 1 for s in wide) or (n == 1 and wide):
            raise ValueError(f"stage devices {cfg.stage_devices}: only the first (embedding) and "
                             f"the last (head) of at least 2 stages can span several devices")
        self.stages = split_gpt(self.model, n, embed_alone=0 in wide,
                                head_alone=n - 1 in wide)
        self.groups = {}
        for s in wide:  # every rank creates every group, in the same order
            d = self.devs[s]
            if len(set(d)) != len(d):
                raise ValueError(f"stage {s}: devices {d} repeat one")
            if cfg.vocab < len(d):
                raise ValueError(f"vocab {cfg.vocab} can't be split over {len(d)} devices")
            if d not in self.groups:
                self.groups[d] = dist.new_group(sorted(d))
            if rank in d:
                j, v = d.index(rank), cfg.vocab
                lo, hi = v * j // len(d), v * (j + 1) // len(d)
                self.stages[s] = GPTStage(self.model, 0, 0, s == 0, s == n - 1, norm=False,
                                          vocab=(lo, hi), positions=j == 0)
        mb = cfg.batch // m
        self.xs, self.ys = idx.split(mb), tgt.split(mb)
        self.shape = (mb, cfg.seq, cfg.d_model)
        self.mine = {s for s, d in enumerate(self.devs) if rank in d}

    def _sources(self, kind: str, s: int, i: int) -> list:
        """``[(rank, tag)]`` of the messages block ``kind s.i`` needs from other ranks."""
        m = self.cfg.micro_batches
        if kind == "F" and s > 0:
            return [(d, 2 * ((s - 1) * m + i)) for d in self.devs[s - 1] if d != self.rank]
        if kind == "B" and s < self.n_stages - 1:
            return [(d, 2 * (s * m + i) + 1) for d in self.devs[s + 1] if d != self.rank]
        return []

    def _loss(self, s: int, out, i: int):
        m, y = self.cfg.micro_batches, self.ys[i].flatten()
        st = self.stages[s]
        if st.vocab is None:
            return F.cross_entropy(out.flatten(0, 1), y) / m
        return vocab_parallel_cross_entropy(out.flatten(0, 1), y, st.vocab[0],
                                            self.groups[self.devs[s]]) / m

    def step(self, order, times: dict, lookahead):
        """Run ``order`` once, receives posted ``lookahead`` blocks ahead (None: all at the
        start): ``(mean loss or None, seconds barrier to barrier, (t0, events))`` with events
        ``(name, begin, compute start, end, first isend call or None)`` in
        ``time.perf_counter`` seconds (system-wide, so comparable across ranks on one
        machine)."""
        import torch.distributed as dist

        rank, m, stages = self.rank, self.cfg.micro_batches, self.stages
        devs, last_stage = self.devs, self.n_stages - 1
        parsed = []
        for name in order:
            kind, s, i = _parse(name)
            if s not in self.mine:
                d = devs[s][0] if len(devs[s]) == 1 else devs[s]
                raise ValueError(f"block {name} is in rank {rank}'s order but stage {s} is on "
                                 f"device {d}")
            parsed.append((name, kind, s, i, self._sources(kind, s, i)))
        self.model.zero_grad(set_to_none=True)
        inputs, outputs, local, pending, posted = {}, {}, {}, [], {}
        loss_total = 0.0

        events = []
        if lookahead is not None and lookahead < 0:
            raise ValueError(f"lookahead: expected None or >= 0 (got {lookahead})")
        ahead = len(parsed) if lookahead is None else lookahead
        next_post = 0  # blocks before it have their receives posted (if they need any)
        dist.barrier()
        t0 = time.perf_counter()
        for j, (name, kind, s, i, srcs) in enumerate(parsed):
            ta = time.perf_counter()
            while next_post < min(j + ahead + 1, len(parsed)):
                bufs = []
                for peer, tag in parsed[next_post][4]:
                    buf = torch.empty(self.shape)
                    bufs.append((buf, dist.irecv(buf, src=peer, tag=tag)))
                if bufs:
                    posted[next_post] = bufs
                next_post += 1
            got = []
            for buf, work in posted.pop(j, ()):
                work.wait()
                got.append(buf)
            if kind == "F" and s == last_stage and stages[s].vocab is not None:
                # The split head all-reduces: start it on all its devices at once (as the
                # simulator does), so that waiting for the last one is not counted as work.
                dist.barrier(group=self.groups[devs[s]])
            tb = time.perf_counter()  # compute only: waiting for a message is not work
            sent = None  # when its first message to another rank was handed to isend
            if kind == "F":
                if s == 0:
                    x = self.xs[i]
                else:
                    if rank in devs[s - 1]:
                        got.append(local.pop(("act", s, i)).detach())
                    x = (got[0] if len(got) == 1 else sum(got[1:], got[0])).requires_grad_()
                out = stages[s](x)
                inputs[s, i] = x
                if s == last_stage:
                    out = self._loss(s, out, i)
                    loss_total += float(out.detach())
                else:
                    data = None
                    for d in devs[s + 1]:
                        if d == rank:
                            local["act", s + 1, i] = out
                            continue
                        if data is None:
                            sent, data = time.perf_counter(), out.detach().contiguous()
                        pending.append(dist.isend(data, dst=d, tag=2 * (s * m + i)))
                outputs[s, i] = out
            else:
                out = outputs.pop((s, i))
                if s == last_stage:
                    out.backward()
                else:
                    if rank in devs[s + 1]:
                        got.append(local.pop(("grad", s, i)))
                    out.backward(got[0] if len(got) == 1 else sum(got[1:], got[0]))
                x = inputs.pop((s, i))
                if s > 0:
                    data = None
                    for d in devs[s - 1]:
                        if d == rank:
                            local["grad", s - 1, i] = x.grad
                            continue
                        if data is None:
                            sent, data = time.perf_counter(), x.grad.contiguous()
                        pending.append(dist.isend(data, dst=d, tag=2 * ((s - 1) * m + i) + 1))
            te = time.perf_counter()
            times.setdefault((kind, s), []).append(te - tb)
            events.append((name, ta, tb, te, sent))
        for w in pending:
            w.wait()
        dist.barrier()
        seconds = time.perf_counter() - t0
        return (loss_total if devs[-1][0] == rank else None), seconds, (t0, events)

    def grads(self) -> dict:
        """Parameter name -> gradient for this rank's stages. A parameter split by vocabulary
        (token table, head) comes whole, zero outside this rank's rows: :func:`merge_grads`
        sums the ranks'. The positions of a split embedding are on its first device only."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: p.grad.clone() for s in self.mine
                for p in self.stages[s].parameters() if p.grad is not None}


def merge_grads(results) -> dict:
    """The whole model's gradients from every rank's :class:`ExecResult`: a parameter reported
    by several ranks (split by vocabulary over a stage's devices) is the sum of theirs."""
    out = {}
    for r in results:
        for n, g in r.grads.items():
            out[n] = g.clone() if n not in out else out[n] + g
    return out


def pipeline_worker(rank: int, world: int, cfg: ExecConfig) -> ExecResult:
    """Run ``cfg.orders[rank]`` ``cfg.steps`` times over the default process group."""
    if len(cfg.orders) != world:
        raise ValueError(f"expected one order per rank ({world}) (got {len(cfg.orders)})")
    pipe = _Pipeline(rank, world, cfg)
    times: dict = {}
    step_s, trace, loss = [], [], None
    for _ in range(cfg.steps):
        loss, sec, events = pipe.step(cfg.orders[rank], times, cfg.lookahead)
        step_s.append(sec)
        trace.append(events)
    return ExecResult(rank, loss, pipe.grads(), step_s, times, trace)


def schedules_worker(rank: int, world: int, cfg: ExecConfig, named_orders,
                     calibrate: bool = False) -> dict:
    """Several schedules on the same workers, in turns: ``cfg.steps`` rounds, each running one
    step of every schedule of ``named_orders`` (``((name, orders), ...)``, or
    ``(name, orders, lookahead)`` to override ``cfg.lookahead``), so that they share the
    machine's conditions (load, frequency) instead of each its own run. Returns
    ``{name: ExecResult}`` (gradients of each schedule's last step). ``calibrate``: each round
    also starts with a calibration round (:func:`calibrate_worker`), whose samples come back
    under ``"calibration"`` (for :func:`calibration_from`): the stage costs under the same
    conditions as the schedules' steps."""
    pipe = _Pipeline(rank, world, cfg)
    runs = []
    for entry in named_orders:
        name, orders = entry[0], entry[1]
        lookahead = entry[2] if len(entry) > 2 else cfg.lookahead
        if name == "calibration":
            raise ValueError("'calibration' is reserved for the calibration's samples")
        if len(orders) != world:
            raise ValueError(f"{name}: expected one order per rank ({world}) (got "
                             f"{len(orders)})")
        runs.append((name, orders, lookahead))
    state = {name: ({}, [], [], None, None) for name, _, _ in runs}
    gen = torch.Generator().manual_seed(cfg.seed + 2 + rank)
    samples: dict = {}
    for k in range(cfg.steps):
        if calibrate:
            _calibration_round(pipe, gen, samples if k > 0 else None)
        for name, orders, lookahead in runs:
            times, step_s, trace, _, _ = state[name]
            loss, sec, events = pipe.step(orders[rank], times, lookahead)
            step_s.append(sec)
            trace.append(events)
            state[name] = (times, step_s, trace, loss,
                           pipe.grads() if k == cfg.steps - 1 else None)
    out = {name: ExecResult(rank, loss, grads, step_s, times, trace)
           for name, (times, step_s, trace, loss, grads) in state.items()}
    if calibrate:
        out["calibration"] = samples
    return out


def measured_problem(results, cfg: ExecConfig, *, resolution: float = 1e-4):
    """The pipeline problem with each block's measured median duration (seconds), for the
    simulator's prediction of the step time."""
    import statistics

    from .placements import pipeline_problem

    per = {}
    for r in results:
        for key, v in r.block_seconds.items():
            per.setdefault(key, []).extend(v)
    n = len(cfg.stage_devices)
    f = [max(resolution, statistics.median(per["F", s])) for s in range(n)]
    b = [max(resolution, statistics.median(per["B", s])) for s in range(n)]
    return pipeline_problem(list(cfg.stage_devices), micro_batches=cfg.micro_batches,
                            forward=f, backward=b)


@dataclass(frozen=True)
class Calibration:
    """Measured costs of a staged GPT on its workers: per stage the median forward and backward
    seconds of one micro-batch, and ``comm``, the median one-way seconds of one activation (or
    gradient: the same shape) between two ranks, from a ping-pong (0 when no two stages on
    different ranks exchange messages). ``samples`` keeps every timed value under ``("F", s)``,
    ``("B", s)`` and ``("comm", a, b)``. ``source``: ``"isolated"`` (each stage timed on its
    own, every rank busy at once) or ``"pipeline"`` (the blocks of a schedule run for real)."""

    stage_devices: tuple
    micro_batches: int
    forward: tuple
    backward: tuple
    comm: float
    samples: dict
    source: str = "isolated"

    def expected_makespan(self, orders, *, draws: int = 200, seed: int = 0) -> float:
        """The mean simulated makespan of ``orders`` when every block's duration is drawn from
        its stage's samples (with replacement; the transfer stays ``comm``): a Monte Carlo
        estimate of the step time under the measured variability, which costs a schedule more
        the more nearly critical paths it has (the makespan is a max of sums)."""
        import random

        from .core import Block, Problem, simulate

        base = self.problem()
        rng = random.Random(seed)
        total = 0.0
        for _ in range(draws):
            blocks = tuple(Block(b.name, b.devices, rng.choice(self.samples[b.kind, b.stage]),
                                 b.memory, b.deps, b.kind, b.stage, b.mb) for b in base.blocks)
            total += simulate(Problem(blocks, base.n_devices, None, base.base_memory,
                                      base.comm_delay), orders).makespan
        return total / draws

    def unit(self, steps: int = 10) -> float:
        """Seconds per integer time unit for the solvers: the shortest block is ``steps``
        units, so rounding moves a block by at most ``1 / (2 steps)`` of the shortest one."""
        return min(self.forward + self.backward) / steps

    def problem(self, *, memory_limit=None, unit: float | None = None, activation=1.0):
        """The pipeline problem of these costs (``pipeline_problem``): in seconds when ``unit``
        is None (for the simulator's prediction), else in integer multiples of ``unit``
        seconds (each block at least 1) for the solvers of :mod:`ngra.schedule.search`."""
        from .placements import pipeline_problem

        f, b, c = list(self.forward), list(self.backward), self.comm
        if unit is not None:
            if not unit > 0:
                raise ValueError(f"unit: expected seconds > 0 (got {unit!r})")
            f = [max(1, round(x / unit)) for x in f]
            b = [max(1, round(x / unit)) for x in b]
            c = round(c / unit)
        return pipeline_problem(list(self.stage_devices), micro_batches=self.micro_batches,
                                forward=f, backward=b, activation=activation,
                                memory_limit=memory_limit, comm_delay=c)


def _calibration_round(pipe: "_Pipeline", gen, samples: dict | None,
                       stages: bool = True) -> None:
    """One calibration iteration on every rank at once: this rank's stages' forward and backward
    on one micro-batch (every rank busy, as in a pipeline; not when ``stages`` is False), then a
    ping-pong of one activation between each two ranks whose stages exchange messages (lower
    rank starts and times it; the others wait). Appends the seconds to ``samples`` unless it is
    None (a warm-up)."""
    import torch.distributed as dist

    rank, last = pipe.rank, pipe.n_stages - 1
    mine = sorted(pipe.mine) if stages else []
    dist.barrier()
    outs, took = {}, {}
    for s in mine:
        x = pipe.xs[0] if s == 0 else torch.randn(pipe.shape, generator=gen).requires_grad_()
        if s == last and pipe.stages[s].vocab is not None:  # as in a step: its devices at once
            dist.barrier(group=pipe.groups[pipe.devs[s]])
        t = time.perf_counter()
        out = pipe.stages[s](x)
        if s == last:
            out = pipe._loss(s, out, 0)
        took["F", s] = time.perf_counter() - t
        outs[s] = out
    for s in reversed(mine):
        grad = None if s == last else torch.randn(pipe.shape, generator=gen)
        t = time.perf_counter()
        outs[s].backward(grad)
        took["B", s] = time.perf_counter() - t
    pipe.model.zero_grad(set_to_none=True)
    devs = pipe.devs
    pairs = sorted({tuple(sorted((a, b))) for s in range(len(devs) - 1) for a in devs[s]
                    for b in devs[s + 1] if a != b})
    buf, back = torch.randn(pipe.shape, generator=gen), torch.empty(pipe.shape)
    for a, b in pairs:
        dist.barrier()
        if rank == a:
            t = time.perf_counter()
            dist.send(buf, dst=b, tag=0)
            dist.recv(back, src=b, tag=0)
            took["comm", a, b] = (time.perf_counter() - t) / 2
        elif rank == b:
            dist.recv(back, src=a, tag=0)
            dist.send(buf, dst=a, tag=0)
    dist.barrier()
    if samples is not None:
        for k, v in took.items():
            samples.setdefault(k, []).append(v)


def calibrate_worker(rank: int, world: int, cfg: ExecConfig, warmup: int = 3,
                     iters: int = 10, orders=None) -> dict:
    """This rank's samples for :func:`calibrate`: ``warmup`` + ``iters`` calibration rounds, the
    first ``warmup`` not recorded. Without ``orders``: forward and backward of its stages with
    every rank busy at once, then a ping-pong with the ranks its stages exchange messages with.
    With ``orders`` (one block order per rank): ``warmup`` + ``iters`` steps of that schedule
    (receives posted as ``cfg.lookahead`` says), each block's compute time a sample of its
    stage, then the ping-pongs."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"expected warmup >= 0 and iters >= 1 (got {warmup}, {iters})")
    if orders is not None and len(orders) != world:
        raise ValueError(f"orders: expected one order per rank ({world}) (got {len(orders)})")
    pipe = _Pipeline(rank, world, cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 2 + rank)
    samples: dict = {}
    for it in range(warmup + iters):
        if orders is not None:
            times: dict = {}
            pipe.step(orders[rank], times, cfg.lookahead)
            if it >= warmup:
                for k, v in times.items():
                    samples.setdefault(k, []).extend(v)
        _calibration_round(pipe, gen, samples if it >= warmup else None, orders is None)
    return samples


def calibrate(cfg: ExecConfig, world: int, *, warmup: int = 3, iters: int = 10,
              orders=None, timeout: float = 120.0) -> Calibration:
    """Measure ``cfg``'s stages (placed by ``cfg.stage_devices``) on ``world`` gloo workers:
    medians of :func:`calibrate_worker`'s samples, each stage timed on its own or, given
    ``orders``, inside that schedule's steps (``cfg.orders`` is not used)."""
    samples = spawn(calibrate_worker, world, cfg, warmup, iters,
                    None if orders is None else tuple(tuple(o) for o in orders), timeout=timeout)
    return calibration_from(samples, cfg, "isolated" if orders is None else "pipeline")


def calibration_from(per_rank_samples, cfg: ExecConfig, source: str = "isolated") -> Calibration:
    """The :class:`Calibration` (medians) of every rank's samples (:func:`calibrate_worker`'s
    results, or the ``"calibration"`` entry of :func:`schedules_worker`'s)."""
    import statistics

    samples: dict = {}
    for r in per_rank_samples:
        for k, v in r.items():
            samples.setdefault(k, []).extend(v)
    n = len(cfg.stage_devices)
    f = tuple(statistics.median(samples["F", s]) for s in range(n))
    b = tuple(statistics.median(samples["B", s]) for s in range(n))
    comm = [v for k, v in samples.items() if k[0] == "comm"]
    c = statistics.median([x for v in comm for x in v]) if comm else 0.0
    return Calibration(tuple(cfg.stage_devices), cfg.micro_batches, f, b, c, samples, source)


def spawn(fn, world: int, *args, timeout: float = 300.0) -> list:
    """``[fn(rank, world, *args)]`` on ``world`` fresh processes joined by gloo: see
    :func:`ngra.distributed.launch.spawn` (raises its SpawnError if a worker fails or the run
    exceeds ``timeout`` seconds)."""
    from ngra.distributed.launch import spawn as _spawn

    return _spawn(fn, world, *args, timeout=timeout, pg_timeout=120.0)
