"""Standard pipeline schedules and a brute-force optimum, on :mod:`ngra.schedule.placements`
problems (blocks labelled ``F``/``B`` with a stage and a micro-batch).

- :func:`gpipe`: every forward (micro-batch by micro-batch), then every backward. Under a memory
  limit, the micro-batches run in consecutive groups of the largest size ``k`` that fits (gradient
  accumulation over GPipe rounds), since one round holds ``k`` micro-batches' activations.
- :func:`one_f_one_b`: PipeDream-flush / ``Schedule1F1B``: stage ``s`` of ``S`` runs
  ``min(S-s-1, m)`` warm-up forwards, then alternates one forward and one backward, then the
  remaining backwards; at most ``S-s`` micro-batches in flight (fewer when the memory limit says
  so). Needs one stage per device.
- :func:`interleaved_1f1b`: ``ScheduleInterleaved1F1B`` on a :func:`loop` placement (``v``
  stages per device, ``m`` a multiple of ``p``): device ``r`` warms up with
  ``(v-1) p + 2 (p-1-r)`` forwards (capped at ``v m``), taking stages round-robin ``p``
  micro-batches at a time, then alternates forward/backward, then cools down.
- :func:`greedy`: list scheduling for any placement: an idle device starts the ready block with
  the highest priority (backward first, then the earliest micro-batch, then the deepest stage),
  admitting a new micro-batch on a device only when the memory for all its forwards there is free
  (so it cannot deadlock on memory).
- :func:`brute_force`: every combination of per-device orders (each consistent with the
  dependencies among that device's blocks), simulated; the shortest within memory is optimal for
  the model, since earliest starts are optimal for fixed orders. Tiny problems only.
"""

from __future__ import annotations

import itertools
import math

from .core import Problem, Schedule, ScheduleError, peak_memory, simulate
from .placements import bwd, fwd

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "greedy", "brute_force", "standard",
           "best_standard", "pipeline_shape"]


def pipeline_shape(problem: Problem):
    """``(n_stages, micro_batches, stage_devices)`` of a pipeline problem, or ValueError."""
    stages = {}
    mbs = set()
    for b in problem.blocks:
        if b.kind not in ("F", "B") or b.stage < 0 or b.mb < 0:
            raise ValueError(f"block {b.name}: expected a pipeline block (kind F/B with a stage "
                             f"and a micro-batch) (got kind {b.kind!r}, stage {b.stage}, mb "
                             f"{b.mb}); build the problem with pipeline_problem")
        stages.setdefault(b.stage, b.devices)
        mbs.add(b.mb)
    n, m = len(stages), len(mbs)
    if sorted(stages) != list(range(n)) or sorted(mbs) != list(range(m)) or \
            len(problem.blocks) != 2 * n * m:
        raise ValueError("expected every stage's forward and backward for every micro-batch")
    return n, m, [stages[s] for s in range(n)]


def _project(problem: Problem, global_order, policy: str) -> Schedule:
    """Simulate the per-device projections of one global dependency-respecting order."""
    orders = [[] for _ in range(problem.n_devices)]
    for name in global_order:
        for d in problem.by_name[name].devices:
            orders[d].append(name)
    return simulate(problem, orders, policy=policy)


def _fits(problem: Problem, schedule: Schedule) -> bool:
    if problem.memory_limit is None:
        return True
    return all(p <= lim + 1e-9 for p, lim in zip(schedule.peak_memory(), problem.memory_limit))


def gpipe(problem: Problem, *, group: int | None = None) -> Schedule:
    """GPipe; ``group`` micro-batches per round (default: the most that fit in memory)."""
    n, m, _ = pipeline_shape(problem)
    sizes = [group] if group is not None else range(m, 0, -1)
    for k in sizes:
        order = []
        for g0 in range(0, m, k):
            mbs = range(g0, min(m, g0 + k))
            order += [fwd(s, i) for i in mbs for s in range(n)]
            order += [bwd(s, i) for i in mbs for s in reversed(range(n))]
        sched = _project(problem, order, f"GPipe" + (f" (rounds of {k})" if k < m else ""))
        if _fits(problem, sched):
            return sched
    raise ScheduleError(f"GPipe does not fit: even one micro-batch per round needs peak memory "
                        f"{sched.peak_memory()} (expected <= {problem.memory_limit})")


def one_f_one_b(problem: Problem) -> Schedule:
    """1F1B with one stage per device (in-flight micro-batches capped by the memory limit)."""
    n, m, devs = pipeline_shape(problem)
    if any(len(d) != 1 for d in devs) or len({d[0] for d in devs}) != n:
        raise ValueError(f"1F1B needs one stage per device (got stage devices {devs})")
    orders = [[] for _ in range(problem.n_devices)]
    for s in range(n):
        d = devs[s][0]
        act = problem.by_name[fwd(s, 0)].memory
        cap = n - s
        if problem.memory_limit is not None and act > 0:
            cap = min(cap, int(math.floor((problem.memory_limit[d] - problem.base_memory[d])
                                          / act + 1e-9)))
        if cap < 1:
            raise ScheduleError(f"1F1B does not fit: stage {s} needs {act:g} for one micro-batch "
                                f"on device {d} (expected <= {problem.memory_limit[d]:g})")
        warm = min(cap - 1, m)
        o = [fwd(s, i) for i in range(warm)]
        for i in range(m - warm):
            o += [fwd(s, warm + i), bwd(s, i)]
        o += [bwd(s, i) for i in range(m - warm, m)]
        orders[d] = o
    return simulate(problem, orders, policy="1F1B")


def interleaved_1f1b(problem: Problem) -> Schedule:
    """Interleaved 1F1B on a loop placement (stage ``s`` on device ``s mod p``, ``p | m``)."""
    n, m, devs = pipeline_shape(problem)
    p = problem.n_devices
    if any(len(d) != 1 or d[0] != s % p for s, d in enumerate(devs)) or n % p:
        raise ValueError(f"interleaved 1F1B needs stage s on device s mod {p} and a multiple of "
                         f"{p} stages (got stage devices {devs})")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro_batches a multiple of {p} (got {m})")
    v = n // p
    orders = []
    for r in range(p):
        total = v * m
        warm = min((v - 1) * p + 2 * (p - 1 - r), total)
        f_next = {s: 0 for s in range(r, n, p)}
        b_next = dict(f_next)
        fs = [r + p * ((k // p) % v) for k in range(total)]
        bs = [r + p * (v - 1 - ((k // p) % v)) for k in range(total)]

        def take_f(k):
            s = fs[k]
            f_next[s] += 1
            return fwd(s, f_next[s] - 1)

        def take_b(k):
            s = bs[k]
            b_next[s] += 1
            return bwd(s, b_next[s] - 1)

        o = [take_f(k) for k in range(warm)]
        for k in range(total - warm):
            o += [take_f(warm + k), take_b(k)]
        o += [take_b(k) for k in range(total - warm, total)]
        orders.append(o)
    sched = simulate(problem, orders, policy="interleaved 1F1B")
    if not _fits(problem, sched):
        raise ScheduleError(f"interleaved 1F1B needs peak memory {sched.peak_memory()} "
                            f"(expected <= {problem.memory_limit})")
    return sched


def greedy(problem: Problem) -> Schedule:
    """Backward-first list scheduling with memory reservation, for any placement."""
    p = problem
    limit = p.memory_limit or (math.inf,) * p.n_devices
    need: dict = {}  # (device, mb) -> memory all that mb's forwards take on the device
    for b in p.blocks:
        if b.memory > 0:
            for d in b.devices:
                need[d, b.mb] = need.get((d, b.mb), 0.0) + b.memory
    for (d, mb), x in need.items():
        if p.base_memory[d] + x > limit[d] + 1e-9:
            raise ScheduleError(f"one micro-batch needs {p.base_memory[d] + x:g} on device {d} "
                                f"(expected <= {limit[d]:g}, the limit)")
    committed = list(p.base_memory)
    admitted: set = set()
    free_at = [0.0] * p.n_devices
    end: dict = {}
    start: dict = {}
    t = 0.0
    left = list(p.blocks)
    while left:
        ready = []
        for b in left:
            if any(free_at[d] > t + 1e-12 for d in b.devices):
                continue
            if all(u in end and end[u] + p.delay(p.by_name[u], b) <= t + 1e-12 for u in b.deps):
                ready.append(b)
        ready.sort(key=lambda b: (b.kind != "B", b.mb, -b.stage, b.name))
        for b in ready:
            if any(free_at[d] > t + 1e-12 for d in b.devices):
                continue
            new = [d for d in b.devices if (d, b.mb) not in admitted and (d, b.mb) in need]
            if any(committed[d] + need[d, b.mb] > limit[d] + 1e-9 for d in new):
                continue
            for d in new:
                admitted.add((d, b.mb))
                committed[d] += need[d, b.mb]
            start[b.name] = t
            end[b.name] = t + b.duration
            for d in b.devices:
                free_at[d] = end[b.name]
            if b.memory < 0:
                for d in b.devices:
                    committed[d] += b.memory
        left = [b for b in left if b.name not in start]
        if not left:
            break
        future = [x for x in list(end.values()) + free_at if x > t + 1e-12]
        future += [end[u] + p.delay(p.by_name[u], b) for b in left for u in b.deps
                   if u in end and end[u] + p.delay(p.by_name[u], b) > t + 1e-12]
        if not future:
            raise ScheduleError(f"greedy schedule is stuck at time {t:g} with {len(left)} blocks "
                                f"left (first {left[0].name}); expected more memory")
        t = min(future)
    # Re-simulate the orders found: the same starts, and a check of the simulator.
    return simulate(p, Schedule(p, start).orders(), policy="greedy 1F1B")


def standard(problem: Problem) -> dict:
    """Every standard schedule that applies and fits: ``{policy: Schedule}``."""
    out = {}
    for fn in (gpipe, one_f_one_b, interleaved_1f1b, greedy):
        try:
            s = fn(problem)
        except (ValueError, ScheduleError):
            continue
        if _fits(problem, s):
            out[s.policy] = s
    return out


def best_standard(problem: Problem) -> Schedule:
    """The standard schedule with the shortest makespan within the memory limit."""
    found = standard(problem)
    if not found:
        raise ScheduleError("no standard schedule fits the memory limit; expected a larger limit")
    return min(found.values(), key=lambda s: (s.makespan, s.policy))


def _linear_extensions(names, before):
    """All orders of ``names`` in which ``a`` precedes ``b`` whenever ``a in before[b]``."""
    names = list(names)

    def rec(placed, rest):
        if not rest:
            yield list(placed)
            return
        for i, n in enumerate(rest):
            if before[n] & set(rest):
                continue
            placed.append(n)
            yield from rec(placed, rest[:i] + rest[i + 1:])
            placed.pop()

    return list(rec([], names))


def brute_force(problem: Problem, *, max_candidates: int = 200_000) -> Schedule:
    """The optimal schedule by exhaustive search over per-device orders (tiny problems)."""
    p = problem
    anc = p.ancestors()
    per_dev = []
    for d in range(p.n_devices):
        names = [b.name for b in p.on_device(d)]
        per_dev.append(_linear_extensions(names, {n: anc[n] for n in names}))
    count = math.prod(len(x) for x in per_dev)
    if count > max_candidates:
        raise ValueError(f"brute force would try {count} order combinations (expected <= "
                         f"max_candidates={max_candidates}); use a smaller problem")
    best = None
    for orders in itertools.product(*per_dev):
        if p.memory_limit is not None and any(
                pk > lim + 1e-9 for pk, lim in zip(peak_memory(p, orders), p.memory_limit)):
            continue
        try:
            s = simulate(p, orders, policy="brute force")
        except ScheduleError:
            continue
        if best is None or s.makespan < best.makespan - 1e-12:
            best = s
    if best is None:
        raise ScheduleError("no schedule fits the memory limit; expected a larger limit")
    return best
