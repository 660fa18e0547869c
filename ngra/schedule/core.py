"""Schedule representation, checker, simulator, text printer and Gantt plot.

A :class:`Problem` is a set of :class:`Block` s (the forward or backward of one pipeline stage for
one micro-batch, or any other unit of work) with, for each, the devices it occupies, its duration,
its memory delta and the blocks it depends on. A :class:`Schedule` gives every block a start time.

Model (the same in the checker, the simulator and the solvers of :mod:`ngra.schedule.search`):

- a block ``b`` runs on all devices in ``b.devices`` during ``[start(b), start(b) + dur(b))``;
  two blocks sharing a device never overlap;
- for each dependency ``u -> b``: ``start(b) >= end(u) + delay(u, b)`` where ``delay`` is the
  problem's ``comm_delay`` when ``u`` and ``b`` share no device (a point-to-point transfer), else 0;
- memory: device ``d`` holds ``base_memory[d]`` plus the deltas of the blocks it has started
  (a forward allocates its activations, ``+a``; the matching backward frees them, ``-a``); the
  delta counts from the block's start, so the peak is
  ``peak(d) = base[d] + max(0, max_k sum_{i<=k} delta(b_i))`` over the blocks ``b_1, b_2, ...``
  of ``d`` in start order, and must be ``<= memory_limit[d]``.

Makespan ``T = max_b end(b)`` (starts are >= 0); bubble ratio
``1 - sum_b dur(b) * |devices(b)| / (n_devices * T)``, the idle fraction of the device-time
rectangle. With unit costs, GPipe over ``p`` stages and ``m`` micro-batches has
``T = 2 (m + p - 1)`` and bubble ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Block", "Problem", "Schedule", "ScheduleError", "check", "simulate", "peak_memory",
           "format_schedule", "plot_schedule"]


class ScheduleError(ValueError):
    """A schedule breaks a dependency, overlaps blocks on a device, exceeds memory, or deadlocks."""


@dataclass(frozen=True)
class Block:
    """One unit of work: ``name`` is unique in its problem; ``kind`` is ``"F"`` (forward), ``"B"``
    (backward) or anything else; ``stage`` and ``mb`` (micro-batch) are labels (-1 when unused)."""

    name: str
    devices: tuple[int, ...]
    duration: float
    memory: float = 0.0
    deps: tuple[str, ...] = ()
    kind: str = "F"
    stage: int = -1
    mb: int = -1

    def __post_init__(self):
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"block {self.name}: expected a non-empty tuple of distinct devices "
                             f"(got {self.devices!r})")
        if not self.duration > 0:
            raise ValueError(f"block {self.name}: expected a positive duration "
                             f"(got {self.duration!r})")


@dataclass(frozen=True)
class Problem:
    """Blocks to place on ``n_devices`` devices.

    ``memory_limit`` and ``base_memory`` are per device (a scalar applies to all; ``None`` limit:
    unlimited). ``comm_delay`` is added to a dependency between blocks on disjoint devices.
    """

    blocks: tuple[Block, ...]
    n_devices: int
    memory_limit: tuple[float, ...] | None = None
    base_memory: tuple[float, ...] = ()
    comm_delay: float = 0.0
    by_name: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        by_name = {}
        for b in self.blocks:
            if b.name in by_name:
                raise ValueError(f"two blocks are named {b.name!r}: names must be unique")
            by_name[b.name] = b
            bad = [d for d in b.devices if not 0 <= d < self.n_devices]
            if bad:
                raise ValueError(f"block {b.name}: expected devices in [0, {self.n_devices}) "
                                 f"(got {bad})")
        for b in self.blocks:
            for u in b.deps:
                if u not in by_name:
                    raise ValueError(f"block {b.name} depends on unknown block {u!r}")
        object.__setattr__(self, "by_name", by_name)
        for attr, default in (("memory_limit", None), ("base_memory", 0.0)):
            v = getattr(self, attr)
            if v is None or (attr == "base_memory" and v == ()):
                v = default
            if v is None:
                continue
            if isinstance(v, (int, float)):
                v = (float(v),) * self.n_devices
            v = tuple(float(x) for x in v)
            if len(v) != self.n_devices:
                raise ValueError(f"{attr}: expected one value per device ({self.n_devices}) "
                                 f"(got {len(v)})")
            object.__setattr__(self, attr, v)
        if self.base_memory is None or self.base_memory == ():
            object.__setattr__(self, "base_memory", (0.0,) * self.n_devices)
        self.topological()  # raises on a cycle

    def with_memory_limit(self, limit) -> "Problem":
        """The same blocks under another memory limit (scalar, per-device tuple or None)."""
        return Problem(self.blocks, self.n_devices, limit, self.base_memory, self.comm_delay)

    def delay(self, u: Block, v: Block) -> float:
        return 0.0 if set(u.devices) & set(v.devices) else self.comm_delay

    def on_device(self, d: int) -> list[Block]:
        return [b for b in self.blocks if d in b.devices]

    def ancestors(self) -> dict[str, set]:
        """Every block's transitive dependencies, by name."""
        anc: dict[str, set] = {}
        for b in self.topological():
            a: set = set()
            for u in b.deps:
                a |= anc[u] | {u}
            anc[b.name] = a
        return anc

    def topological(self) -> list[Block]:
        """Blocks in a dependency order (Kahn's algorithm, ties by position)."""
        indeg = {b.name: len(b.deps) for b in self.blocks}
        users: dict[str, list[str]] = {b.name: [] for b in self.blocks}
        for b in self.blocks:
            for u in b.deps:
                users[u].append(b.name)
        ready = [b.name for b in self.blocks if not b.deps]
        out = []
        while ready:
            n = ready.pop(0)
            out.append(self.by_name[n])
            for w in users[n]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    ready.append(w)
        if len(out) != len(self.blocks):
            stuck = sorted(n for n, k in indeg.items() if k > 0)[:5]
            raise ValueError(f"dependencies form a cycle through {stuck}")
        return out

    @property
    def work(self) -> float:
        """Device-time of all blocks, ``sum_b dur(b) |devices(b)|``."""
        return sum(b.duration * len(b.devices) for b in self.blocks)

    def lower_bound(self) -> float:
        """``max(max_d sum of durations on d, longest dependency chain)``: no schedule is shorter."""
        load = max((sum(b.duration for b in self.on_device(d)) for d in range(self.n_devices)),
                   default=0.0)
        finish: dict[str, float] = {}
        for b in self.topological():
            s = max((finish[u] + self.delay(self.by_name[u], b) for u in b.deps), default=0.0)
            finish[b.name] = s + b.duration
        return max(load, max(finish.values(), default=0.0))


@dataclass(frozen=True)
class Schedule:
    """Start times for every block of ``problem``; ``policy`` names what produced it."""

    problem: Problem
    start: dict
    policy: str = ""
    search_seconds: float | None = None

    def end(self, name: str) -> float:
        return self.start[name] + self.problem.by_name[name].duration

    @property
    def makespan(self) -> float:
        return max((self.end(n) for n in self.start), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction ``1 - work / (n_devices * makespan)``."""
        t = self.makespan
        return 0.0 if t == 0 else 1.0 - self.problem.work / (self.problem.n_devices * t)

    def orders(self) -> list[list[str]]:
        """Per device, its block names in start order (ties by end, then name)."""
        out = []
        for d in range(self.problem.n_devices):
            names = [b.name for b in self.problem.on_device(d)]
            out.append(sorted(names, key=lambda n: (self.start[n], self.end(n), n)))
        return out

    def peak_memory(self) -> list[float]:
        return peak_memory(self.problem, self.orders())


def peak_memory(problem: Problem, orders) -> list[float]:
    """Per device, ``base + max(0, max prefix sum of deltas)`` along its order."""
    peaks = []
    for d, order in enumerate(orders):
        run = best = 0.0
        for n in order:
            run += problem.by_name[n].memory
            best = max(best, run)
        peaks.append(problem.base_memory[d] + best)
    return peaks


def check(schedule: Schedule, *, memory_limit=None, tol: float = 1e-9) -> None:
    """Raise :class:`ScheduleError` naming the first offending block unless ``schedule`` runs every
    block of its problem exactly once, respects every dependency (with communication delay),
    never overlaps two blocks on a device, and stays within memory (``memory_limit``, default the
    problem's; a scalar or per-device tuple)."""
    p = schedule.problem
    names = set(p.by_name)
    given = set(schedule.start)
    if names - given:
        missing = sorted(names - given)
        raise ScheduleError(f"block {missing[0]} is not scheduled ({len(missing)} missing: "
                            f"{missing[:5]}); expected every block of the problem to get a start "
                            f"time")
    if given - names:
        extra = sorted(given - names)
        raise ScheduleError(f"block {extra[0]} is not in the problem; expected only the "
                            f"problem's {len(names)} blocks")
    for n, s in schedule.start.items():
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= -tol):
            raise ScheduleError(f"block {n} starts at {s!r}; expected a finite time >= 0")
    for b in p.blocks:
        for u in b.deps:
            need = schedule.end(u) + p.delay(p.by_name[u], b)
            if schedule.start[b.name] < need - tol:
                raise ScheduleError(
                    f"block {b.name} starts at {schedule.start[b.name]:g} before its dependency "
                    f"{u} is done: expected start >= {need:g} (end of {u}"
                    f"{' + comm delay' if p.delay(p.by_name[u], b) else ''}); move {b.name} later")
    orders = schedule.orders()
    for d, order in enumerate(orders):
        for a, b in zip(order, order[1:]):
            if schedule.start[b] < schedule.end(a) - tol:
                raise ScheduleError(
                    f"block {b} overlaps block {a} on device {d}: {b} starts at "
                    f"{schedule.start[b]:g}, expected >= {schedule.end(a):g} (end of {a})")
    limit = p.memory_limit if memory_limit is None else memory_limit
    if limit is not None:
        if isinstance(limit, (int, float)):
            limit = (float(limit),) * p.n_devices
        for d, order in enumerate(orders):
            run = 0.0
            for n in order:
                run += p.by_name[n].memory
                if p.base_memory[d] + run > limit[d] + tol:
                    raise ScheduleError(
                        f"block {n} raises device {d}'s memory to {p.base_memory[d] + run:g}, "
                        f"expected <= {limit[d]:g} (the limit); start a backward before it or "
                        f"allow more memory")


def simulate(problem: Problem, orders, *, policy: str = "") -> Schedule:
    """Earliest start times for per-device block orders (``orders[d]``: names on device ``d``, a
    multi-device block in the order of each of its devices).

    ``start(b) = max(end of b's predecessor on each of its devices,
    max over deps u of end(u) + delay(u, b))``. Given the orders these starts are the earliest
    possible, so the makespan is the best the orders allow. Raises :class:`ScheduleError` on a
    deadlock (orders that contradict the dependencies) or an order that does not list a
    device's blocks exactly once.
    """
    p = problem
    orders = [list(o) for o in orders]
    if len(orders) != p.n_devices:
        raise ScheduleError(f"expected one order per device ({p.n_devices}) (got {len(orders)})")
    for d, order in enumerate(orders):
        want = {b.name for b in p.on_device(d)}
        if len(order) != len(set(order)) or set(order) != want:
            extra = sorted(set(order) - want)
            missing = sorted(want - set(order))
            dup = sorted({n for n in order if order.count(n) > 1})
            what = (f"block {extra[0]} does not run on device {d}" if extra else
                    f"block {missing[0]} of device {d} is missing from its order" if missing else
                    f"block {dup[0]} appears twice in device {d}'s order")
            raise ScheduleError(f"{what}; expected each device's order to list exactly its "
                                f"{len(want)} blocks once")
    pos = [0] * p.n_devices
    avail = [0.0] * p.n_devices
    start: dict[str, float] = {}
    done = 0
    total = len(p.blocks)
    while done < total:
        progressed = False
        for d in range(p.n_devices):
            while pos[d] < len(orders[d]):
                b = p.by_name[orders[d][pos[d]]]
                if any(pos[e] >= len(orders[e]) or orders[e][pos[e]] != b.name
                       for e in b.devices):
                    break
                if any(u not in start for u in b.deps):
                    break
                s = max([avail[e] for e in b.devices]
                        + [start[u] + p.by_name[u].duration + p.delay(p.by_name[u], b)
                           for u in b.deps])
                start[b.name] = s
                for e in b.devices:
                    avail[e] = s + b.duration
                    pos[e] += 1
                done += 1
                progressed = True
        if not progressed:
            heads = [orders[d][pos[d]] for d in range(p.n_devices) if pos[d] < len(orders[d])]
            waits = {h: [u for u in p.by_name[h].deps if u not in start] for h in heads}
            raise ScheduleError(f"the orders deadlock: each device's next block waits "
                                f"({waits}); expected orders consistent with the dependencies")
    return Schedule(p, start, policy)


def format_schedule(schedule: Schedule, *, unit: float | None = None, width: int = 100) -> str:
    """A text Gantt chart: one line per device, one character per ``unit`` of time ('.' idle;
    a block shows its kind letter then its micro-batch's last digit), then makespan and bubble."""
    t = schedule.makespan
    if unit is None:
        durs = [b.duration for b in schedule.problem.blocks]
        unit = min(durs) if durs and t / min(durs) <= width else t / width
    cols = max(1, int(math.ceil(t / unit - 1e-9)))
    lines = []
    for d, order in enumerate(schedule.orders()):
        row = ["."] * cols
        for n in order:
            b = schedule.problem.by_name[n]
            a = int(round(schedule.start[n] / unit))
            z = max(a + 1, int(round(schedule.end(n) / unit)))
            label = (b.kind[:1] + (str(b.mb % 10) if b.mb >= 0 else "")) or "#"
            for i in range(a, min(z, cols)):
                row[i] = label[min(i - a, len(label) - 1)] if i - a < len(label) else "-"
        lines.append(f"dev{d:<2d} |{''.join(row)}|")
    lines.append(f"{schedule.policy or 'schedule'}: makespan {t:g}, bubble "
                 f"{schedule.bubble_ratio:.1%}, peak memory "
                 f"{[round(x, 3) for x in schedule.peak_memory()]}")
    return "\n".join(lines)


def plot_schedule(schedule: Schedule, path=None, *, ax=None, title: str | None = None):
    """A matplotlib Gantt chart (devices as rows, forwards light and backwards dark, coloured by
    stage, labelled by micro-batch). Writes ``path`` (PNG) when given; returns the axes."""
    import matplotlib

    if ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(10, 0.6 * schedule.problem.n_devices + 1.2))
    cmap = plt.get_cmap("tab10")
    for b in schedule.problem.blocks:
        s = schedule.start[b.name]
        color = cmap(max(b.stage, 0) % 10)
        alpha = 0.45 if b.kind == "F" else 0.95
        for d in b.devices:
            ax.barh(d, b.duration, left=s, height=0.8, color=color, alpha=alpha,
                    edgecolor="black", linewidth=0.5)
            if b.mb >= 0:
                ax.text(s + b.duration / 2, d, f"{b.kind}{b.mb}", ha="center", va="center",
                        fontsize=7)
    ax.set_yticks(range(schedule.problem.n_devices))
    ax.set_yticklabels([f"dev {d}" for d in range(schedule.problem.n_devices)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title or f"{schedule.policy}: makespan {schedule.makespan:g}, "
                          f"bubble {schedule.bubble_ratio:.1%}")
    if own and path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return ax
