"""Time-sharing devices between data-parallel jobs, after CrossoverScheduler: a simulator.

Each of ``J`` data-parallel jobs runs on the same ``K`` devices. One iteration of job ``j`` is

- **compute** ``c_j`` seconds of device time (forward, backward, optimizer step), then
- **all-reduce** of its gradients: a fixed part ``l_j`` (latencies, no shared resource) and a
  transfer part ``m_j`` seconds when the job has the link to itself. A ring all-reduce of ``n``
  bytes over ``K`` devices with per-device link bandwidth ``B`` (bytes/s) and per-step latency
  ``a`` sends ``2 (K-1)/K n`` bytes per device in ``2 (K-1)`` steps, so (:func:`ring_allreduce`)
  ``m = 2 (K-1)/K * n / B`` and ``l = 2 (K-1) a``.

The next iteration's compute starts when the all-reduce is done. Resources (fluid model):

- the **link** is shared by processor sharing: ``k`` transfers in flight each progress at rate
  ``1/k`` (TCP-like fair share of the bandwidth);
- the **device** depends on the policy:

  ``back_to_back``  jobs run one after the other (job ``j+1`` starts when job ``j`` is done);
  ``naive``         all jobs at once, compute shared by processor sharing: ``k`` computing jobs
                    each progress at rate ``e/k`` (``e = share_efficiency``, 1 for ideal time
                    slicing; ``e < 1`` models cache/context-switch losses), no coordination;
  ``crossover``     all jobs at once, compute exclusive and passed round-robin (a token ring per
                    device: job ``j`` computes, hands the device to job ``j+1`` and all-reduces
                    while ``j+1`` computes), so one job's compute fills another's communication.

Data-parallel workers of a job are identical and run in lock step, and every device holds the
same jobs, so one device and its link stand for all ``K`` (no stragglers, no jitter: a
deterministic model). ``K`` enters through the all-reduce cost.

Steady state of ``J`` identical jobs (``c``, ``m``, ``l``), throughput in iterations/s summed over
jobs, checked against the event simulation in the tests:

- back to back: ``1 / (c + l + m)``;
- crossover: ``J / max(J c, c + l + m)`` when ``m <= c`` (transfers never overlap: they are
  separated by computes); when ``m > c`` transfers overlap and share the link, and the fluid
  sharing can leave the link idle while all jobs compute, so ``J / max(J c, c + l + m, J m)`` is
  then only an upper bound (the simulation gives the value). Gain over back to back, two jobs,
  ``l = 0``: ``(c + m) / max(c, m)``, up to 2x at ``c = m`` and tending to 1 when either side
  dominates (``m << c``: nothing to hide; ``m >> c``: the link is the bottleneck either way);
- naive, jobs started together: they stay in phase (compute together at rate ``e/J``, then
  communicate together), period ``J c / e + l + J m``, no better than back to back when
  ``e = 1``. A job started later keeps its lag ``d`` forever in the fluid model (processor
  sharing preserves it), so naive co-location gains exactly what the offsets happen to give
  (``offsets=`` shows it: offset ``c`` with ``c = m`` is a perfect crossover). Crossover makes
  the interleaving a rule instead of luck.

Crossover (and naive with ``e = 1``) is never slower than back to back for jobs started
together: at every instant some phase progresses at total rate >= 1 (the device's holder, the
link's transfers together, or a latency; the token waits only for a job that is communicating),
so the makespan is at most the total work ``sum_j N_j (c_j + l_j + m_j)``.

:func:`simulate_crossover` returns a :class:`CrossoverResult` (timeline, combined throughput,
per-job iteration time, device and link utilization); :func:`plot_crossover` draws timelines
(shared phases as stacked fractions); :func:`to_schedule` turns an exclusive timeline into an
:class:`ngra.schedule.Schedule` (device and link as its two "devices") so that
:func:`ngra.schedule.check` proves no two jobs overlap and ``format_schedule`` prints it;
:func:`cluster_sweep` scales the model to 8-1024 devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Job", "Piece", "CrossoverResult", "POLICIES", "ring_allreduce", "simulate_crossover",
           "steady_throughput", "compare_policies", "plot_crossover", "to_schedule",
           "cluster_sweep", "format_sweep"]

POLICIES = ("back_to_back", "naive", "crossover")


def _nonneg(name, value, *, positive=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"expected {name} to be a finite number "
                         f"{'> 0' if positive else '>= 0'} (got {value!r})")
    return float(value)


def ring_allreduce(nbytes: float, devices: int, bandwidth: float,
                   latency: float = 0.0) -> tuple[float, float]:
    """``(transfer, fixed)`` seconds of a ring all-reduce of ``nbytes`` over ``devices`` devices:
    ``transfer = 2 (K-1)/K * nbytes / bandwidth`` (bandwidth in bytes/s per device link) and
    ``fixed = 2 (K-1) * latency`` (one latency per step). One device: ``(0, 0)``."""
    nbytes = _nonneg("nbytes", nbytes)
    bandwidth = _nonneg("bandwidth", bandwidth, positive=True)
    latency = _nonneg("latency", latency)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"expected devices to be an int >= 1 (got {devices!r})")
    k = devices
    return 2 * (k - 1) / k * nbytes / bandwidth, 2 * (k - 1) * latency


@dataclass(frozen=True)
class Job:
    """A data-parallel job: ``compute`` seconds of device time per iteration, then an all-reduce
    of ``latency`` seconds (unshared) plus ``comm`` seconds of link transfer (alone on the link),
    ``iterations`` times."""

    name: str
    compute: float
    comm: float
    latency: float = 0.0
    iterations: int = 10

    def __post_init__(self):
        _nonneg(f"job {self.name}: compute", self.compute, positive=True)
        _nonneg(f"job {self.name}: comm", self.comm)
        _nonneg(f"job {self.name}: latency", self.latency)
        n = self.iterations
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"job {self.name}: expected iterations to be an int >= 1 (got {n!r})")

    @classmethod
    def ring(cls, name: str, compute: float, grad_bytes: float, devices: int, bandwidth: float,
             latency: float = 0.0, iterations: int = 10) -> "Job":
        """A job whose all-reduce is a ring over ``devices`` (see :func:`ring_allreduce`)."""
        m, l = ring_allreduce(grad_bytes, devices, bandwidth, latency)
        return cls(name, compute, m, l, iterations)

    @property
    def solo_iteration(self) -> float:
        """``c + l + m``: one iteration with the devices to itself."""
        return self.compute + self.latency + self.comm


@dataclass(frozen=True)
class Piece:
    """Job ``job`` in phase ``phase`` (``"compute"``, ``"latency"`` or ``"comm"``) of its
    iteration ``iteration`` during ``[start, end)``, progressing at ``rate`` (1: alone; ``1/k``:
    sharing with ``k - 1`` others)."""

    job: int
    iteration: int
    phase: str
    start: float
    end: float
    rate: float


@dataclass(frozen=True)
class CrossoverResult:
    """What :func:`simulate_crossover` gives: ``pieces`` (the timeline), per job its
    ``arrival`` (when it was started) and ``iteration_ends`` (when each iteration's all-reduce
    finished)."""

    policy: str
    jobs: tuple[Job, ...]
    pieces: tuple[Piece, ...]
    arrival: tuple[float, ...]
    iteration_ends: tuple[tuple[float, ...], ...]
    share_efficiency: float = 1.0

    @property
    def makespan(self) -> float:
        return max(e[-1] for e in self.iteration_ends)

    @property
    def throughput(self) -> float:
        """Combined throughput: iterations of all jobs per second, ``sum_j N_j / makespan``."""
        return sum(j.iterations for j in self.jobs) / self.makespan

    @property
    def iteration_time(self) -> tuple[float, ...]:
        """Per job, ``(finish - arrival) / N``: its mean iteration time as its user sees it."""
        return tuple((e[-1] - a) / j.iterations
                     for j, a, e in zip(self.jobs, self.arrival, self.iteration_ends))

    @property
    def utilization(self) -> float:
        """Device busy fraction, ``sum_j c_j N_j / makespan`` (useful compute only)."""
        return sum(j.compute * j.iterations for j in self.jobs) / self.makespan

    @property
    def link_utilization(self) -> float:
        """Link busy fraction, ``sum_j m_j N_j / makespan``."""
        return sum(j.comm * j.iterations for j in self.jobs) / self.makespan

    def summary(self) -> str:
        its = ", ".join(f"{j.name} {t * 1e3:.3g} ms" for j, t in zip(self.jobs,
                                                                      self.iteration_time))
        return (f"{self.policy:<12} throughput {self.throughput:.4g} it/s, makespan "
                f"{self.makespan:.4g} s, iteration {its}, device {self.utilization:.0%}, "
                f"link {self.link_utilization:.0%}")


def simulate_crossover(jobs, policy: str = "crossover", *, share_efficiency: float = 1.0,
                       offsets=None) -> CrossoverResult:
    """Event simulation of ``jobs`` (a sequence of :class:`Job`) under ``policy`` (one of
    :data:`POLICIES`, see the module docstring for the model).

    Between two events every running phase progresses at a constant rate: compute at 1 (alone or
    holding the device) or ``share_efficiency / k`` (naive, ``k`` computing), latency at 1, link
    transfer at ``1/k`` (``k`` transferring). The next event is the earliest phase end (or
    arrival); a phase ends when its remaining work reaches 0. Crossover passes each device in
    round-robin order: after job ``j`` computes, the device waits for the next unfinished job in
    the ring (even if another is ready: the token ring of ``benchmarks/crossover.py``).

    ``offsets`` (co-located policies only): per job, when it starts (default all 0).
    """
    jobs = tuple(jobs)
    if not jobs or not all(isinstance(j, Job) for j in jobs):
        raise ValueError(f"expected a non-empty sequence of Job (got {jobs!r})")
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError(f"expected distinct job names (got {[j.name for j in jobs]})")
    if policy not in POLICIES:
        raise ValueError(f"expected policy in {POLICIES} (got {policy!r})")
    eff = _nonneg("share_efficiency", share_efficiency, positive=True)
    if eff > 1:
        raise ValueError(f"expected share_efficiency in (0, 1] (got {share_efficiency!r})")
    n = len(jobs)
    if offsets is None:
        offsets = (0.0,) * n
    else:
        offsets = tuple(_nonneg("offset", o) for o in offsets)
        if len(offsets) != n:
            raise ValueError(f"expected one offset per job ({n}) (got {len(offsets)})")
        if policy == "back_to_back" and any(offsets):
            raise ValueError("expected no offsets for back_to_back (each job starts when the "
                             f"previous one ends) (got {offsets})")

    phases = [[(p, w) for p, w in (("compute", j.compute), ("latency", j.latency),
                                   ("comm", j.comm)) if w > 0] for j in jobs]
    arrival = list(offsets)
    active = [policy != "back_to_back" or i == 0 for i in range(n)]
    it = [0] * n
    ph = [0] * n
    rem = [phases[i][0][1] for i in range(n)]
    done = [False] * n
    ends: list[list[float]] = [[] for _ in range(n)]
    pieces: list[Piece] = []
    holder = None   # crossover / back_to_back: the job computing on the device
    turn = 0        # crossover: whose turn the device is
    t = 0.0
    scale = max(max(j.solo_iteration for j in jobs), 1e-300)
    eps = 1e-12 * scale

    def arrived(i):
        return active[i] and not done[i] and arrival[i] <= t + eps

    while not all(done):
        # Which running phases progress at what rate.
        state = [phases[i][ph[i]][0] if arrived(i) else None for i in range(n)]
        rate = [0.0] * n
        computing = [i for i in range(n) if state[i] == "compute"]
        if policy == "naive":
            for i in computing:
                rate[i] = 1.0 if len(computing) == 1 else eff / len(computing)
        else:
            if holder is None and computing:
                if policy == "crossover":
                    while done[turn]:
                        turn = (turn + 1) % n
                    if turn in computing:
                        holder = turn
                else:
                    holder = computing[0]
            if holder is not None:
                rate[holder] = 1.0
        talking = [i for i in range(n) if state[i] == "comm"]
        for i in talking:
            rate[i] = 1.0 / len(talking)
        for i in range(n):
            if state[i] == "latency":
                rate[i] = 1.0
        steps = [rem[i] / rate[i] for i in range(n) if rate[i] > 0]
        steps += [arrival[i] - t for i in range(n)
                  if active[i] and not done[i] and arrival[i] > t + eps]
        if not steps:  # cannot happen with valid jobs; a guard against an endless loop
            raise RuntimeError(f"simulation stuck at t={t}: states {state}")
        dt = min(steps)
        for i in range(n):
            if rate[i] > 0:
                pieces.append(Piece(i, it[i], state[i], t, t + dt, rate[i]))
                rem[i] -= rate[i] * dt
        t += dt
        for i in range(n):
            if rate[i] <= 0 or rem[i] > eps:
                continue
            if state[i] == "compute" and holder == i:
                holder = None
                turn = (i + 1) % n
            ph[i] += 1
            if ph[i] == len(phases[i]):
                ends[i].append(t)
                it[i] += 1
                ph[i] = 0
                if it[i] == jobs[i].iterations:
                    done[i] = True
                    if policy == "back_to_back" and i + 1 < n:
                        active[i + 1] = True
                        arrival[i + 1] = t
            rem[i] = phases[i][ph[i]][1]
    return CrossoverResult(policy, jobs, tuple(pieces), tuple(arrival),
                           tuple(tuple(e) for e in ends), eff)


def steady_throughput(c: float, m: float, l: float = 0.0, *, jobs: int = 2,
                      policy: str = "crossover", share_efficiency: float = 1.0) -> float:
    """Closed-form steady-state combined throughput of ``jobs`` identical jobs (see the module
    docstring): exact for back to back, for naive jobs started in phase, and for crossover when
    ``m <= c``; for crossover with ``m > c`` an upper bound."""
    c = _nonneg("c", c, positive=True)
    m, l = _nonneg("m", m), _nonneg("l", l)
    if policy == "back_to_back":
        return 1.0 / (c + l + m)
    if policy == "crossover":
        return jobs / max(jobs * c, c + l + m, jobs * m)
    if policy == "naive":
        return jobs / ((c if jobs == 1 else jobs * c / share_efficiency) + l + jobs * m)
    raise ValueError(f"expected policy in {POLICIES} (got {policy!r})")


def compare_policies(jobs, *, share_efficiency: float = 1.0, offsets=None) -> dict:
    """``{policy: CrossoverResult}`` for every policy (``offsets`` apply to naive and
    crossover)."""
    return {p: simulate_crossover(jobs, p, share_efficiency=share_efficiency,
                                  offsets=None if p == "back_to_back" else offsets)
            for p in POLICIES}


def to_schedule(result: CrossoverResult):
    """The timeline as an :class:`ngra.schedule.Schedule`: device 0 is the compute device,
    device 1 the link; a block ``"<job>.c<i>"`` (kind ``F``) per compute and ``"<job>.m<i>"``
    (kind ``B``) per transfer, ``stage`` = job index, ``mb`` = iteration, each depending on the
    job's previous phase. Only for exclusive timelines (every piece at rate 1): otherwise a
    :class:`~ngra.schedule.ScheduleError` (processor sharing has no block form)."""
    from .core import Block, Problem, Schedule, ScheduleError

    shared = [p for p in result.pieces if p.rate < 1 - 1e-12 and p.phase != "latency"]
    if shared:
        p = shared[0]
        raise ScheduleError(f"expected an exclusive timeline (every phase alone on its "
                            f"resource) (got job {result.jobs[p.job].name} {p.phase} of "
                            f"iteration {p.iteration} at rate {p.rate:g} from {p.start:g})")
    spans: dict[tuple, list[float]] = {}
    for p in result.pieces:
        if p.phase == "latency":
            continue
        s = spans.setdefault((p.job, p.iteration, p.phase), [p.start, p.end])
        s[0], s[1] = min(s[0], p.start), max(s[1], p.end)
    blocks, start = [], {}
    for (j, i, phase), (s, e) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        name = f"{result.jobs[j].name}.{'c' if phase == 'compute' else 'm'}{i}"
        prev = [k for k in ((j, i, "compute") if phase == "comm" else (j, i - 1, "comm"),
                            (j, i - 1, "compute")) if k in spans]
        dep = ()
        if prev:
            pj, pi, pp = prev[0]
            dep = (f"{result.jobs[pj].name}.{'c' if pp == 'compute' else 'm'}{pi}",)
        blocks.append(Block(name, (0 if phase == "compute" else 1,), e - s, deps=dep,
                            kind="F" if phase == "compute" else "B", stage=j, mb=i))
        start[name] = s
    return Schedule(Problem(tuple(blocks), 2), start, result.policy)


def plot_crossover(results, path=None, *, title: str | None = None, measured=None):
    """Timelines, one panel per result (a :class:`CrossoverResult` or a ``{policy: result}``
    dict): rows ``device`` and ``link``, one colour per job; a phase shared by ``k`` jobs is
    drawn as a stacked fraction of the row (its rate). ``measured``: extra panels from real
    runs, ``{label: [(row, job, start, end), ...]}`` with row a string. Writes ``path`` (PNG)
    when given; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(results, CrossoverResult):
        results = {results.policy: results}
    measured = measured or {}
    panels = len(results) + len(measured)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 1.6 * panels + 0.6), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (label, res) in zip(axes[:, 0], results.items()):
        rows = {"compute": 0, "comm": 1}
        # Stack pieces that run at the same time on the same resource, by job index.
        for p in sorted(res.pieces, key=lambda p: (p.start, p.job)):
            if p.phase not in rows:
                continue
            below = sum(q.rate for q in res.pieces
                        if q.phase == p.phase and q.job < p.job and q.start < p.end - 1e-15
                        and q.end > p.start + 1e-15)
            y = rows[p.phase] - 0.4 + 0.8 * below
            ax.broken_barh([(p.start, p.end - p.start)], (y, 0.8 * p.rate),
                           facecolors=cmap(p.job % 10),
                           alpha=0.55 if p.phase == "compute" else 0.9,
                           edgecolor="black", linewidth=0.3)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["device", "link"])
        ax.invert_yaxis()
        ax.set_title(f"{label}: {res.throughput:.3g} it/s, device {res.utilization:.0%}",
                     fontsize=9)
    for ax, (label, bars) in zip(axes[len(results):, 0], measured.items()):
        names = sorted({b[0] for b in bars})
        for row, job, s, e in bars:
            ax.broken_barh([(s, e - s)], (names.index(row) - 0.4, 0.8),
                           facecolors=cmap(job % 10), alpha=0.7, edgecolor="black",
                           linewidth=0.3)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(label, fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def cluster_sweep(devices=(8, 16, 32, 64, 128, 256, 512, 1024), *, compute: float,
                  grad_bytes: float, bandwidth: float, latency: float = 0.0,
                  strong_scaling: bool = False, base_devices: int = 8, jobs: int = 2,
                  iterations: int = 40, share_efficiency: float = 1.0) -> list[dict]:
    """The three policies for ``jobs`` identical jobs on ``K`` devices for each ``K`` in
    ``devices``. ``compute``: seconds per iteration per device at ``base_devices`` devices;
    weak scaling (default) keeps it, strong scaling (a fixed global batch) gives
    ``compute * base_devices / K``. Rows: ``K``, ``c``, ``m``, ``l``, ``comm/compute`` =
    ``(l + m)/c``, throughput per policy and the gains of crossover over back to back and over
    naive."""
    rows = []
    for k in devices:
        c = compute * base_devices / k if strong_scaling else compute
        js = [Job.ring(f"J{i}", c, grad_bytes, k, bandwidth, latency, iterations)
              for i in range(jobs)]
        res = compare_policies(js, share_efficiency=share_efficiency)
        thr = {p: r.throughput for p, r in res.items()}
        rows.append({"devices": k, "c": c, "m": js[0].comm, "l": js[0].latency,
                     "comm/compute": (js[0].comm + js[0].latency) / c, **thr,
                     "gain_vs_b2b": thr["crossover"] / thr["back_to_back"],
                     "gain_vs_naive": thr["crossover"] / thr["naive"]})
    return rows


def format_sweep(rows) -> str:
    """A text table of :func:`cluster_sweep` rows."""
    out = [f"{'K':>5} {'c ms':>8} {'l+m ms':>8} {'comm/c':>7} {'b2b it/s':>9} {'naive':>8} "
           f"{'crossover':>9} {'x b2b':>6} {'x naive':>7}"]
    for r in rows:
        out.append(f"{r['devices']:>5} {r['c'] * 1e3:>8.3g} {(r['l'] + r['m']) * 1e3:>8.3g} "
                   f"{r['comm/compute']:>7.2f} {r['back_to_back']:>9.4g} {r['naive']:>8.4g} "
                   f"{r['crossover']:>9.4g} {r['gain_vs_b2b']:>5.2f}x {r['gain_vs_naive']:>6.2f}x")
    return "\n".join(out)
