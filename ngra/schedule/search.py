"""Schedule search with the z3 SMT solver: an exact job-shop solve, and Tessel's two phases.

Exact (:func:`solve_exact`): integer start ``s_b >= 0`` per block; dependencies
``s_v >= s_u + d_u + delay(u, v)``; for two blocks ``a, b`` sharing a device and not ordered by the
dependencies, a Boolean ``o_ab``: ``o_ab => s_a + d_a <= s_b`` and ``!o_ab => s_b + d_b <= s_a``;
memory, for every block ``j`` with ``delta_j > 0`` on device ``d`` (the peak is reached right
after such a block starts): ``base_d + delta_j + sum_{k on d, k before j} delta_k <= limit_d``;
makespan ``T >= s_b + d_b``. We ask for a schedule with ``T <= bound - 1`` (durations are
integers, so makespans are too) until the solver says no (``optimal``) or the limits run out.

Limits: every search takes ``timeout_s`` (wall-clock seconds in all) and / or ``rlimit`` (z3
resource units per solver check). z3 counts resources deterministically, so a search bounded by
``rlimit`` alone finds the same schedule on every machine and under any load (for one z3
build); one bounded by time finds what the machine had time for.

Tessel, phase 1 (:func:`find_repetend`): a repetend covers ``r`` micro-batches; each block type
``j`` (a block of micro-batch 0, i.e. a stage's forward or backward) appears ``r`` times per
period, instance ``q`` of period ``i`` processing micro-batch ``(i - o_jq) r + q`` where the
integer offset ``o_jq >= 0`` says how many periods behind the first block it lags. With period
``P`` and start ``t_jq in [0, P)`` inside the period, a dependency ``u -> v`` becomes
``o_vq P + t_vq >= o_uq P + t_uq + d_u + delay``; blocks sharing a device do not overlap modulo
``P`` (a block may run past the period's end into the next period's start: if ``a`` starts before
``b`` then ``t_a + d_a <= t_b`` and ``t_b + d_b <= t_a + P``); the memory at a period's start is ``base_d - sum_{jq on d} delta_j o_jq`` (each
micro-batch's deltas on a device sum to 0, so the micro-batches a block type has already done,
``i - o_jq``, contribute ``-delta_j o_jq`` net of the common ``i``), plus the deltas of the blocks
started earlier in the period. For a fixed ``P`` this is linear; we try ``P`` upward from the
lower bound ``max_d sum_{jq on d} d_j`` (each period runs every block type ``r`` times), so the
first satisfiable ``P`` is the shortest period, then minimise the largest offset (a shallower
repetend has a shorter warm-up and cool-down), then, of a few distinct repetends of that period
and depth, keep the one whose unrolled schedule is shortest. Throughput is ``r / P``
micro-batches per time.

Phase 2 (:func:`tessel`): unroll the repetend over the ``m`` micro-batches (period ``i`` runs
instance ``jq`` when its micro-batch exists), giving per-device orders; earliest starts compact the
warm-up and cool-down; then the solver re-orders the warm-up and cool-down blocks (the steady
periods keep the repetend's order) within a time limit, keeping the result only if shorter.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from .core import Problem, Schedule, ScheduleError, check, simulate

__all__ = ["solve_exact", "ExactResult", "Repetend", "find_repetend", "tessel", "TesselResult"]


def _z3():
    try:
        import z3
    except ImportError as e:  # pragma: no cover - z3 is in the `schedule` extra
        raise ImportError("ngra.schedule.search needs z3-solver: pip install 'ngra[schedule]'") \
            from e
    return z3


def _int_durations(problem: Problem) -> None:
    for b in problem.blocks:
        if float(b.duration) != int(b.duration):
            raise ValueError(f"block {b.name}: the solver needs integer durations (got "
                             f"{b.duration!r}); scale the costs to integer time units")
    if float(problem.comm_delay) != int(problem.comm_delay):
        raise ValueError(f"the solver needs an integer comm_delay (got {problem.comm_delay!r})")


class _Budget:
    """A search's limits: ``timeout_s`` wall-clock seconds for the whole search (None: none) and
    ``rlimit`` z3 resource units for each solver check (None: none). The resource count is
    deterministic for a given z3 build, so a search under ``rlimit`` alone gives the same result
    on every machine and under any load; under ``timeout_s`` it depends on the machine's
    speed."""

    def __init__(self, timeout_s, rlimit):
        if timeout_s is None and rlimit is None:
            raise ValueError("the search needs a limit: give timeout_s (seconds) or rlimit (z3 "
                             "resource units per solver check), or both")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds or None (got {timeout_s!r})")
        if rlimit is not None and (isinstance(rlimit, bool) or not isinstance(rlimit, int)
                                   or rlimit < 1):
            raise ValueError(f"rlimit must be a positive int of z3 resource units or None (got "
                             f"{rlimit!r})")
        self.timeout_s, self.rlimit = timeout_s, rlimit
        self.t0 = time.monotonic()

    def spent(self) -> bool:
        """Whether the wall-clock time is (all but) used up; never under ``rlimit`` alone."""
        return self.timeout_s is not None and self.left() <= 0.01

    def left(self) -> float:
        return self.timeout_s - (time.monotonic() - self.t0)

    def arm(self, solver) -> None:
        """Set the solver's limits for its next check: what is left of the time, the rlimit."""
        if self.timeout_s is not None:
            solver.set("timeout", max(1, int(self.left() * 1000)))
        if self.rlimit is not None:
            solver.set("rlimit", self.rlimit)

    def __str__(self) -> str:
        parts = ([f"{self.timeout_s:g} s"] if self.timeout_s is not None else []) \
            + ([f"rlimit {self.rlimit} per check"] if self.rlimit is not None else [])
        return " and ".join(parts)

    def larger(self) -> str:
        return " or ".join((["a larger timeout_s"] if self.timeout_s is not None else [])
                           + (["a larger rlimit"] if self.rlimit is not None else []))


@dataclass(frozen=True)
class ExactResult:
    """The best schedule found; ``optimal`` when the solver proved nothing shorter exists."""

    schedule: Schedule
    optimal: bool
    seconds: float
    solver_calls: int


def solve_exact(problem: Problem, *, timeout_s: float | None = 10.0, upper: Schedule | None = None,
                fixed_orders=None, policy: str = "exact (z3)",
                rlimit: int | None = None) -> ExactResult:
    """The shortest schedule (see the module docstring), proved optimal unless the limits run
    out: ``timeout_s`` seconds in all and / or ``rlimit`` z3 resource units per solver check
    (deterministic: the same result on any machine; see :class:`_Budget`).

    ``upper``: a known schedule to beat (also the answer if the solver finds nothing better in
    time). ``fixed_orders``: pairs ``(a, b)`` meaning ``a`` runs before ``b`` (a device's order
    kept from another schedule).
    """
    z3 = _z3()
    _int_durations(problem)
    budget = _Budget(timeout_s, rlimit)
    p = problem
    t0 = budget.t0
    anc = p.ancestors()
    fixed = set(fixed_orders or ())
    s = {b.name: z3.Int(f"s_{b.name}") for b in p.blocks}
    dur = {b.name: int(b.duration) for b in p.blocks}
    solver = z3.Solver()
    horizon = int(sum(dur.values()) + p.comm_delay * len(p.blocks))
    for b in p.blocks:
        solver.add(s[b.name] >= 0)
        for u in b.deps:
            solver.add(s[b.name] >= s[u] + dur[u] + int(p.delay(p.by_name[u], b)))
    before: dict = {}  # (a, b) -> z3 Bool or Python bool: a runs before b

    def order_var(a, b):
        if (a, b) in before:
            return before[a, b]
        if a in anc[b] or (a, b) in fixed:
            v = True
        elif b in anc[a] or (b, a) in fixed:
            v = False
        else:
            v = z3.Bool(f"o_{a}_{b}")
            solver.add(z3.Implies(v, s[a] + dur[a] <= s[b]))
            solver.add(z3.Implies(z3.Not(v), s[b] + dur[b] <= s[a]))
        before[a, b] = v
        before[b, a] = (not v) if isinstance(v, bool) else z3.Not(v)
        if isinstance(v, bool):
            x, y = (a, b) if v else (b, a)
            solver.add(s[x] + dur[x] <= s[y])
        return v

    for d in range(p.n_devices):
        names = [b.name for b in p.on_device(d)]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                order_var(a, b)
        if p.memory_limit is not None:
            for j in names:
                dj = p.by_name[j].memory
                if dj <= 0:
                    continue
                terms = []
                for k in names:
                    if k == j or p.by_name[k].memory == 0:
                        continue
                    v = before[k, j]
                    dk = p.by_name[k].memory
                    if v is True:
                        terms.append(z3.RealVal(dk))
                    elif v is not False:
                        terms.append(z3.If(v, z3.RealVal(dk), z3.RealVal(0)))
                total = z3.RealVal(p.base_memory[d] + dj)
                if terms:
                    total = total + z3.Sum(terms)
                solver.add(total <= z3.RealVal(p.memory_limit[d]))
    T = z3.Int("makespan")
    for b in p.blocks:
        solver.add(T >= s[b.name] + dur[b.name])
    best = upper
    bound = int(math.ceil(upper.makespan)) - 1 if upper is not None else horizon
    lower = int(math.ceil(p.lower_bound() - 1e-9))
    optimal = False
    calls = 0
    while bound >= lower:
        if budget.spent():
            break
        budget.arm(solver)
        solver.push()
        solver.add(T <= bound)
        calls += 1
        res = solver.check()
        if res == z3.sat:
            model = solver.model()
            start = {n: model.eval(v, model_completion=True).as_long() for n, v in s.items()}
            cand = Schedule(p, start, policy)
            # Earliest starts for the orders found: the same or shorter, and a check.
            cand = simulate(p, cand.orders(), policy=policy)
            best = cand
            bound = int(math.ceil(cand.makespan)) - 1
            solver.pop()
            continue
        solver.pop()
        optimal = res == z3.unsat
        break
    else:
        optimal = best is not None  # the bound reached the lower bound
    if best is None:
        raise ScheduleError(f"the solver found no schedule within {budget} (memory limit "
                            f"{p.memory_limit}); expected a larger memory limit, or "
                            f"{budget.larger()}")
    seconds = time.monotonic() - t0
    sched = Schedule(p, dict(best.start), best.policy if best is upper and not
                     (optimal and calls) else policy, seconds)
    return ExactResult(sched, optimal, seconds, calls)


@dataclass(frozen=True)
class Repetend:
    """A steady-state pattern: ``period`` time units for ``instances`` micro-batches.

    ``offset[(name, q)]`` and ``time[(name, q)]`` for each block type ``name`` (a block of
    micro-batch 0) and instance ``q``: the lag in periods and the start within the period.
    """

    period: int
    instances: int
    offset: dict
    time: dict
    peak_memory: tuple
    seconds: float

    @property
    def depth(self) -> int:
        return max(self.offset.values())

    @property
    def time_per_micro_batch(self) -> float:
        return self.period / self.instances


def _template(problem: Problem):
    """Block types (micro-batch 0's blocks) and a map ``(type, mb) -> name``; checks every
    micro-batch has the same blocks, devices, durations, memory and dependencies."""
    by_key = {}
    for b in problem.blocks:
        if b.mb < 0:
            raise ValueError(f"block {b.name}: expected a micro-batch label (got mb {b.mb})")
        by_key[(b.kind, b.stage, b.mb)] = b
    mbs = sorted({b.mb for b in problem.blocks})
    if mbs != list(range(len(mbs))):
        raise ValueError(f"expected micro-batches 0..{len(mbs) - 1} (got {mbs[:8]})")
    types = [b for b in problem.blocks if b.mb == 0]
    key_of = {b.name: (b.kind, b.stage) for b in problem.blocks}
    names = {}
    for m in mbs:
        for t in types:
            b = by_key.get((t.kind, t.stage, m))
            if b is None or (b.devices, b.duration, b.memory) != (t.devices, t.duration, t.memory) \
                    or sorted(key_of[u] for u in b.deps) != sorted(key_of[u] for u in t.deps) \
                    or any(problem.by_name[u].mb != m for u in b.deps):
                raise ValueError(f"micro-batch {m} differs from micro-batch 0 at {t.kind}"
                                 f"{t.stage}; expected identical micro-batches for a repetend")
            names[t.name, m] = b.name
    if len(names) != len(problem.blocks):
        raise ValueError("expected every block to be one of micro-batch 0's block types")
    for d in range(problem.n_devices):
        net = sum(t.memory for t in types if d in t.devices)
        if abs(net) > 1e-9:
            raise ValueError(f"a micro-batch's memory deltas on device {d} sum to {net:g}; "
                             f"expected 0 (every allocation freed) for a steady state")
    return types, names, len(mbs)


def find_repetend(problem: Problem, *, instances: int = 1, timeout_s: float | None = 10.0,
                  max_depth: int | None = None, candidates: int = 32,
                  rlimit: int | None = None) -> Repetend:
    """The shortest-period repetend of ``instances`` micro-batches (module docstring), within
    ``timeout_s`` seconds in all and / or ``rlimit`` z3 resource units per solver check (see
    :func:`solve_exact`).

    Many repetends share the shortest period and the smallest depth, and their unrolled
    schedules differ (3 stages under a memory limit: 30 or 33 time units for the same period);
    which one z3 returns first depends on its search state. So up to ``candidates`` distinct
    ones (per-device orders and offsets) are unrolled and the shortest kept, the first found on
    a tie. ``candidates=1`` takes z3's first."""
    if candidates < 1:
        raise ValueError(f"candidates must be at least 1 (got {candidates!r})")
    z3 = _z3()
    _int_durations(problem)
    budget = _Budget(timeout_s, rlimit)
    p = problem
    t0 = budget.t0
    types, _, _ = _template(p)
    r = instances
    keys = [(t.name, q) for t in types for q in range(r)]
    blk = {t.name: t for t in types}
    depth = max_depth if max_depth is not None else 2 * len(types)
    load = max((sum(int(t.duration) for t in types if d in t.devices) * r
                for d in range(p.n_devices)), default=1)
    upper = int(sum(t.duration for t in types) * r + p.comm_delay * len(types) * r)

    def attempt(period):
        if budget.spent():
            raise TimeoutError(f"no repetend found within {budget} (period {period} open); "
                               f"expected {budget.larger()}")
        solver = z3.Solver()
        budget.arm(solver)
        o = {k: z3.Int(f"o_{k[0]}_{k[1]}") for k in keys}
        t = {k: z3.Int(f"t_{k[0]}_{k[1]}") for k in keys}
        for k in keys:
            solver.add(o[k] >= 0, o[k] <= depth, t[k] >= 0, t[k] <= period - 1)
        first = types[0].name
        solver.add(z3.Or([o[(first, q)] == 0 for q in range(r)]))
        for v in types:
            for u in v.deps:
                delay = int(p.delay(blk[u], v))
                for q in range(r):
                    solver.add(o[(v.name, q)] * period + t[(v.name, q)]
                               >= o[(u, q)] * period + t[(u, q)] + int(blk[u].duration) + delay)
        # Instance q + 1 of a block type never runs before instance q (symmetry breaking and
        # the natural micro-batch order).
        for tname in blk:
            for q in range(r - 1):
                solver.add(o[(tname, q)] * period + t[(tname, q)]
                           <= o[(tname, q + 1)] * period + t[(tname, q + 1)])
        before = {}
        order_vars = []
        for d in range(p.n_devices):
            on = [k for k in keys if d in blk[k[0]].devices]
            for i, a in enumerate(on):
                for b in on[i + 1:]:
                    if (a, b) not in before:
                        v = z3.Bool(f"b_{a}_{b}")
                        da, db = int(blk[a[0]].duration), int(blk[b[0]].duration)
                        # a before b in the period, and (wrapping) b done before the next a.
                        solver.add(z3.Implies(v, z3.And(t[a] + da <= t[b],
                                                        t[b] + db <= t[a] + period)))
                        solver.add(z3.Implies(z3.Not(v), z3.And(t[b] + db <= t[a],
                                                                t[a] + da <= t[b] + period)))
                        before[a, b], before[b, a] = v, z3.Not(v)
                        order_vars.append(v)
            if p.memory_limit is not None:
                m0 = z3.RealVal(p.base_memory[d]) - z3.Sum(
                    [z3.ToReal(o[k]) * blk[k[0]].memory for k in on] or [z3.RealVal(0)])
                for j in on:
                    if blk[j[0]].memory <= 0:
                        continue
                    terms = [z3.If(before[k, j], z3.RealVal(blk[k[0]].memory), z3.RealVal(0))
                             for k in on if k != j and blk[k[0]].memory != 0]
                    solver.add(m0 + blk[j[0]].memory + z3.Sum(terms or [z3.RealVal(0)])
                               <= p.memory_limit[d])
        res = solver.check()
        if res == z3.unknown:
            raise TimeoutError(f"the solver gave up at period {period} within {budget}; "
                               f"expected {budget.larger()}")
        return (solver, o, t, order_vars) if res == z3.sat else None

    # Feasibility is monotone in the period (a longer period keeps every constraint: offsets
    # only grow dependencies' slack, and the modular non-overlap keeps its gaps), so bisect:
    # first the lower bound itself (often the answer), then halve [lo, hi].
    found = attempt(load)
    period = load
    if found is None:
        hi_found = attempt(upper)
        if hi_found is None:
            raise ScheduleError(f"no repetend of {r} micro-batch(es) fits the memory limit "
                                f"{p.memory_limit}; expected a larger limit")
        lo, hi = load + 1, upper
        found = hi_found
        while lo < hi:
            mid = (lo + hi) // 2
            got = attempt(mid)
            if got is None:
                lo = mid + 1
            else:
                hi, found = mid, got
        period = hi
    solver, o, t, order_vars = found
    # Shallowest repetend at this period: lower the largest offset while satisfiable.
    model = solver.model()
    while True:
        cur = max(model.eval(o[k]).as_long() for k in keys)
        if cur == 0 or budget.spent():
            break
        solver.push()
        budget.arm(solver)
        solver.add(z3.And([o[k] <= cur - 1 for k in keys]))
        if solver.check() != z3.sat:
            solver.pop()
            break
        model = solver.model()
        solver.pop()

    def repetend(model):
        off = {k: model.eval(o[k]).as_long() for k in keys}
        tim = {k: model.eval(t[k]).as_long() for k in keys}
        peaks = []
        for d in range(p.n_devices):
            on = sorted((k for k in keys if d in blk[k[0]].devices), key=lambda k: tim[k])
            run = p.base_memory[d] - sum(off[k] * blk[k[0]].memory for k in on)
            peak = run
            for k in on:
                run += blk[k[0]].memory
                peak = max(peak, run)
            peaks.append(peak)
        return Repetend(period, r, off, tim, tuple(peaks), time.monotonic() - t0)

    # Among the repetends of this period and depth, the one whose unrolled schedule is shortest:
    # each further candidate differs from all before it in an offset or a device's order.
    best = repetend(model)
    best_span = unroll(p, best).makespan
    solver.add(z3.And([o[k] <= best.depth for k in keys]))
    for _ in range(candidates - 1):
        if budget.spent():
            break
        solver.add(z3.Or([o[k] != model.eval(o[k]) for k in keys]
                         + [v != model.eval(v, model_completion=True) for v in order_vars]))
        budget.arm(solver)
        if solver.check() != z3.sat:
            break
        model = solver.model()
        rep = repetend(model)
        span = unroll(p, rep).makespan
        if span < best_span:
            best, best_span = rep, span
    return dataclasses.replace(best, seconds=time.monotonic() - t0)


def unroll(problem: Problem, rep: Repetend) -> Schedule:
    """Phase 2 without the solver: the repetend repeated over every micro-batch, compacted to
    earliest starts (warm-up and cool-down are the periods where some instances have no
    micro-batch)."""
    types, names, m = _template(problem)
    r = rep.instances
    periods = -(-m // r) + rep.depth
    seq = []  # (period, time in period, device-independent tiebreak, name)
    for (tname, q), off in rep.offset.items():
        for i in range(periods):
            mb = (i - off) * r + q
            if 0 <= mb < m:
                seq.append((i, rep.time[tname, q], q, names[tname, mb]))
    seq.sort()
    orders = [[] for _ in range(problem.n_devices)]
    for *_, n in seq:
        for d in problem.by_name[n].devices:
            orders[d].append(n)
    return simulate(problem, orders, policy=f"Tessel repetend x{r} (unrolled)")


@dataclass(frozen=True)
class TesselResult:
    """The searched schedule, its repetend, and where the time went."""

    schedule: Schedule
    repetend: Repetend
    unrolled_makespan: float
    repetend_seconds: float
    completion_seconds: float
    completion_optimal: bool

    @property
    def search_seconds(self) -> float:
        return self.repetend_seconds + self.completion_seconds


def _steady_pairs(problem: Problem, rep: Repetend, unrolled: Schedule) -> set:
    """``(a, b)`` order pairs among blocks of full periods (all instances busy), kept fixed."""
    types, names, m = _template(problem)
    r = rep.instances
    lo, hi = rep.depth, -(-m // r) - 1  # periods with every instance's micro-batch present
    steady = set()
    for (tname, q), off in rep.offset.items():
        for i in range(lo, hi + 1):
            mb = (i - off) * r + q
            if 0 <= mb < m:
                steady.add(names[tname, mb])
    pairs = set()
    for order in unrolled.orders():
        st = [n for n in order if n in steady]
        pairs |= {(a, b) for i, a in enumerate(st) for b in st[i + 1:]}
    return pairs


def tessel(problem: Problem, *, instances=(1, 2), timeout_s: float | None = 20.0,
           completion_timeout_s: float | None = None, rlimit: int | None = None) -> TesselResult:
    """Tessel's search: the repetend with the best time per micro-batch over ``instances``
    (phase 1), unrolled over the problem's micro-batches and its warm-up and cool-down re-solved
    (phase 2). ``timeout_s`` bounds phase 1 per instance count; phase 2 gets
    ``completion_timeout_s`` (default ``timeout_s``). ``rlimit``: z3 resource units per solver
    check in both phases; with ``timeout_s=None`` the search is deterministic (the same schedule
    on every machine, however loaded; see :func:`solve_exact`)."""
    t0 = time.monotonic()
    _, _, m = _template(problem)
    best = None
    reasons = []
    for r in instances:
        if r > m:
            continue
        try:
            rep = find_repetend(problem, instances=r, timeout_s=timeout_s, rlimit=rlimit)
        except (ScheduleError, TimeoutError) as e:
            reasons.append(f"{r} per period: {e}")
            continue
        sched = unroll(problem, rep)
        key = (sched.makespan, rep.time_per_micro_batch)
        if best is None or key < best[0]:
            best = (key, rep, sched)
    if best is None:
        raise ScheduleError(f"no repetend found with {list(instances)} micro-batches per "
                            f"period: {'; '.join(reasons)}")
    _, rep, unrolled = best
    t1 = time.monotonic()
    fixed = _steady_pairs(problem, rep, unrolled)
    res = solve_exact(problem, timeout_s=completion_timeout_s or timeout_s, upper=unrolled,
                      fixed_orders=fixed, policy="Tessel search", rlimit=rlimit)
    sched = Schedule(problem, dict(res.schedule.start), "Tessel search",
                     time.monotonic() - t0)
    check(sched)
    return TesselResult(sched, rep, unrolled.makespan, t1 - t0, time.monotonic() - t1,
                        res.optimal)
