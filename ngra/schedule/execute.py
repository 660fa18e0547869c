"""Run a pipeline schedule for real: a GPT cut into stages, one process per device, activations and
gradients over torch.distributed point-to-point (gloo on CPU).

Each rank walks its device's block order (:meth:`Schedule.orders`). ``F{s}.{i}`` takes micro-batch
``i``'s input of stage ``s`` (token ids for stage 0, else the previous stage's output: received
from its rank with a blocking ``recv``, or handed over in memory when the previous stage is on the
same rank), runs the stage and sends the output on with a non-blocking ``isend``. ``B{s}.{i}``
back-propagates the stage (from ``loss_i / m`` at the last stage, else from the gradient received
from stage ``s+1``) and sends the gradient of its input to stage ``s-1``. Sends never block, and a
block waits only for the messages of its dependencies, so an order the simulator accepts (no
deadlock) runs without deadlock. Every message has its own tag (``2 (s m + i)`` for activations,
``+1`` for gradients), so messages between the same two ranks can't be confused.

The gradient is that of ``mean_i loss_i`` = the full batch's mean cross-entropy when micro-batches
have equal size, so the result matches single-device ``GPT(idx, targets)`` up to rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTStage", "split_gpt", "ExecConfig", "ExecResult", "pipeline_worker",
           "reference_step", "make_model"]


class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of a GPT, with the embeddings if ``first`` and the final norm and head
    if ``last``. Holds the model's own submodules (parameters shared, not copied)."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.emb = nn.ModuleDict({"tok": model.tok, "pos": model.pos}) if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.tail = nn.ModuleDict({"ln_f": model.ln_f, "head": model.head}) if last else None

    def forward(self, x):
        if self.first:
            x = self.emb["tok"](x) + self.emb["pos"](torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.last:
            x = self.tail["head"](self.tail["ln_f"](x))
        return x


def split_gpt(model, n_stages: int) -> list[GPTStage]:
    """``n_stages`` stages with the GPT's blocks spread as evenly as possible (earlier stages get
    the extra block)."""
    n = len(model.blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages: expected 1..{n} (the model's blocks) (got {n_stages})")
    cuts = [n * s // n_stages for s in range(n_stages + 1)]
    return [GPTStage(model, cuts[s], cuts[s + 1], s == 0, s == n_stages - 1)
            for s in range(n_stages)]


@dataclass(frozen=True)
class ExecConfig:
    """What every rank needs: the model, the data, and the block orders to run."""

    orders: tuple          # per device, block names (F{s}.{i} / B{s}.{i})
    stage_devices: tuple   # device (rank) of each stage
    micro_batches: int
    batch: int = 8
    seq: int = 16
    vocab: int = 32
    d_model: int = 32
    n_layer: int = 4
    n_head: int = 2
    seed: int = 0
    steps: int = 1         # timed repetitions (the first is also a warm-up when steps > 1)


@dataclass(frozen=True)
class ExecResult:
    rank: int
    loss: float | None            # the mean loss (on the rank of the last stage)
    grads: dict                   # parameter name -> gradient, for this rank's stages
    step_seconds: list            # wall time of each step (barrier to barrier)
    block_seconds: dict           # (kind, stage) -> list of measured durations


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


def pipeline_worker(rank: int, world: int, cfg: ExecConfig) -> ExecResult:
    """Run ``cfg.orders[rank]`` ``cfg.steps`` times over the default process group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    model, idx, tgt = make_model(cfg)
    n_stages = len(cfg.stage_devices)
    stages = split_gpt(model, n_stages)
    m = cfg.micro_batches
    if cfg.batch % m:
        raise ValueError(f"batch {cfg.batch} must split into {m} equal micro-batches")
    if len(cfg.orders) != world:
        raise ValueError(f"expected one order per rank ({world}) (got {len(cfg.orders)})")
    mb = cfg.batch // m
    xs, ys = idx.split(mb), tgt.split(mb)
    shape = (mb, cfg.seq, cfg.d_model)
    mine = {s for s, d in enumerate(cfg.stage_devices) if d == rank}
    times: dict = {}
    step_s = []
    loss_total = None
    for _ in range(cfg.steps):
        model.zero_grad(set_to_none=True)
        inputs, outputs, local, pending = {}, {}, {}, []
        loss_total = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for name in cfg.orders[rank]:
            kind, s, i = _parse(name)
            if s not in mine:
                raise ValueError(f"block {name} is in rank {rank}'s order but stage {s} is on "
                                 f"device {cfg.stage_devices[s]}")
            if kind == "F":
                if s == 0:
                    x = xs[i]
                elif cfg.stage_devices[s - 1] == rank:
                    x = local.pop(("act", s, i)).detach().requires_grad_()
                else:
                    x = torch.empty(shape)
                    dist.recv(x, src=cfg.stage_devices[s - 1], tag=2 * ((s - 1) * m + i))
                    x.requires_grad_()
                tb = time.perf_counter()  # compute only: waiting for a message is not work
                out = stages[s](x)
                inputs[s, i] = x
                if s == n_stages - 1:
                    out = F.cross_entropy(out.flatten(0, 1), ys[i].flatten()) / m
                    loss_total += float(out.detach())
                elif cfg.stage_devices[s + 1] == rank:
                    local["act", s + 1, i] = out
                else:
                    pending.append(dist.isend(out.detach().contiguous(),
                                              dst=cfg.stage_devices[s + 1], tag=2 * (s * m + i)))
                outputs[s, i] = out
            else:
                out = outputs.pop((s, i))
                if s == n_stages - 1:
                    tb = time.perf_counter()
                    out.backward()
                else:
                    if cfg.stage_devices[s + 1] == rank:
                        g = local.pop(("grad", s, i))
                    else:
                        g = torch.empty(shape)
                        dist.recv(g, src=cfg.stage_devices[s + 1], tag=2 * (s * m + i) + 1)
                    tb = time.perf_counter()
                    out.backward(g)
                x = inputs.pop((s, i))
                if s > 0:
                    if cfg.stage_devices[s - 1] == rank:
                        local["grad", s - 1, i] = x.grad
                    else:
                        pending.append(dist.isend(x.grad.contiguous(),
                                                  dst=cfg.stage_devices[s - 1],
                                                  tag=2 * ((s - 1) * m + i) + 1))
            times.setdefault((kind, s), []).append(time.perf_counter() - tb)
        for w in pending:
            w.wait()
        dist.barrier()
        step_s.append(time.perf_counter() - t0)
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {}
    for s in mine:
        for p in stages[s].parameters():
            grads[names[id(p)]] = p.grad.clone()
    last = cfg.stage_devices[-1] == rank
    return ExecResult(rank, loss_total if last else None, grads, step_s, times)


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


def spawn(fn, world: int, *args, timeout: float = 300.0) -> list:
    """``[fn(rank, world, *args)]`` on ``world`` fresh processes joined by gloo: see
    :func:`ngra.distributed.launch.spawn` (raises its SpawnError if a worker fails or the run
    exceeds ``timeout`` seconds)."""
    from ngra.distributed.launch import spawn as _spawn

    return _spawn(fn, world, *args, timeout=timeout, pg_timeout=120.0)
