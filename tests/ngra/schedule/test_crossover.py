"""ngra.schedule.crossover: the simulator against hand-computed timelines, the closed forms, the
policies' invariants (crossover never slower than back to back, processor sharing in naive
co-location), the block-schedule view checked by ngra.schedule.check, and bad inputs."""

from __future__ import annotations

import random

import pytest

from ngra.schedule import ScheduleError, check, format_schedule
from ngra.schedule.crossover import (POLICIES, Job, cluster_sweep, compare_policies,
                                     format_sweep, plot_crossover, ring_allreduce,
                                     simulate_crossover, steady_throughput, to_schedule)


def two(c=1.0, m=1.0, n=2, l=0.0):
    return [Job("A", c, m, l, n), Job("B", c, m, l, n)]


def timeline(res):
    return [(res.jobs[p.job].name, p.iteration, p.phase, p.start, p.end, p.rate)
            for p in res.pieces]


def test_back_to_back_hand_timeline():
    r = simulate_crossover(two(), "back_to_back")
    assert timeline(r) == [
        ("A", 0, "compute", 0, 1, 1), ("A", 0, "comm", 1, 2, 1),
        ("A", 1, "compute", 2, 3, 1), ("A", 1, "comm", 3, 4, 1),
        ("B", 0, "compute", 4, 5, 1), ("B", 0, "comm", 5, 6, 1),
        ("B", 1, "compute", 6, 7, 1), ("B", 1, "comm", 7, 8, 1)]
    # A period of 2 per iteration, one job at a time: 4 iterations in 8.
    assert r.makespan == 8 and r.throughput == 0.5
    assert r.arrival == (0, 4) and r.iteration_time == (2, 2)
    assert r.utilization == 0.5 and r.link_utilization == 0.5


def test_naive_hand_timeline_processor_sharing():
    r = simulate_crossover(two(), "naive")
    # In phase: both compute at half speed, then both share the link.
    assert timeline(r) == [
        ("A", 0, "compute", 0, 2, 0.5), ("B", 0, "compute", 0, 2, 0.5),
        ("A", 0, "comm", 2, 4, 0.5), ("B", 0, "comm", 2, 4, 0.5),
        ("A", 1, "compute", 4, 6, 0.5), ("B", 1, "compute", 4, 6, 0.5),
        ("A", 1, "comm", 6, 8, 0.5), ("B", 1, "comm", 6, 8, 0.5)]
    assert r.makespan == 8 and r.iteration_time == (4, 4)


def test_crossover_hand_timeline_hides_communication():
    r = simulate_crossover(two(), "crossover")
    assert timeline(r) == [
        ("A", 0, "compute", 0, 1, 1),
        ("A", 0, "comm", 1, 2, 1), ("B", 0, "compute", 1, 2, 1),
        ("A", 1, "compute", 2, 3, 1), ("B", 0, "comm", 2, 3, 1),
        ("A", 1, "comm", 3, 4, 1), ("B", 1, "compute", 3, 4, 1),
        ("B", 1, "comm", 4, 5, 1)]
    assert r.makespan == 5 and r.iteration_ends == ((2, 4), (3, 5))
    # Long run: the device is never idle except the last all-reduce: makespan 2N + 1.
    r = simulate_crossover(two(n=50), "crossover")
    assert r.makespan == 101 and r.utilization == pytest.approx(100 / 101)
    b = simulate_crossover(two(n=50), "back_to_back")
    assert r.throughput / b.throughput == pytest.approx(200 / 101)


def test_crossover_with_link_contention_hand_timeline():
    # c=1, m=2: A's transfer [1,2) alone, then shares with B's from 2; A ends at 2 + 2*1 = 4,
    # B got 1 unit by 4 and finishes alone at 5 while A computes [4,5).
    r = simulate_crossover(two(c=1, m=2, n=30), "crossover")
    assert r.iteration_ends[0][0] == 4 and r.iteration_ends[1][0] == 5
    assert [p.rate for p in r.pieces if p.job == 0 and p.iteration == 0
            and p.phase == "comm"] == [1, 0.5]
    # Steady state: link-bound, one iteration per m in total.
    e = r.iteration_ends[0]
    assert 2 / ((e[-1] - e[9]) / 20) == pytest.approx(1 / 2)


def test_latency_is_not_shared():
    r = simulate_crossover(two(c=1, m=0, l=1, n=1), "naive")
    lat = [p for p in r.pieces if p.phase == "latency"]
    assert [(p.start, p.end, p.rate) for p in lat] == [(2, 3, 1), (2, 3, 1)]


def test_naive_processor_sharing_with_unequal_jobs_and_efficiency():
    jobs = [Job("A", 1, 0, iterations=1), Job("B", 3, 0, iterations=1)]
    r = simulate_crossover(jobs, "naive")
    # Both at 1/2 until A is done at 2; B's remaining 2 alone.
    assert timeline(r) == [("A", 0, "compute", 0, 2, 0.5), ("B", 0, "compute", 0, 2, 0.5),
                           ("B", 0, "compute", 2, 4, 1)]
    r = simulate_crossover(jobs, "naive", share_efficiency=0.8)
    assert timeline(r)[:2] == [("A", 0, "compute", 0, 2.5, 0.4), ("B", 0, "compute", 0, 2.5, 0.4)]
    assert r.makespan == pytest.approx(2.5 + 2)


def test_naive_keeps_its_initial_lag():
    # Fluid processor sharing preserves a lag: B started c later runs a perfect crossover.
    r = simulate_crossover(two(n=20), "naive", offsets=(0, 1))
    a, b = r.iteration_ends
    assert all(y - x == pytest.approx(1) for x, y in zip(a, b))
    assert r.makespan == simulate_crossover(two(n=20), "crossover").makespan == 41
    lag = simulate_crossover(two(n=20), "naive", offsets=(0, 0.3))
    assert all(y - x == pytest.approx(0.3) for x, y in zip(*lag.iteration_ends))
    assert lag.makespan > 41


def test_closed_forms_match_the_simulation():
    rng = random.Random(0)
    for _ in range(60):
        c, m = rng.uniform(0.1, 2), rng.uniform(0, 3)
        l = rng.choice([0.0, rng.uniform(0, 1)])
        k = rng.choice([2, 3, 4])
        jobs = [Job(f"J{i}", c, m, l, 200) for i in range(k)]
        for policy in POLICIES:
            r = simulate_crossover(jobs, policy)
            e = r.iteration_ends[0]
            steady = (1 if policy == "back_to_back" else k) / ((e[-1] - e[99]) / 100)
            want = steady_throughput(c, m, l, jobs=k, policy=policy)
            if policy == "crossover" and m > c:
                assert steady <= want * 1.01, (c, m, l, k)  # an upper bound only
            else:
                assert steady == pytest.approx(want, rel=1e-9), (policy, c, m, l, k)


def test_crossover_and_ideal_naive_never_slower_than_back_to_back():
    rng = random.Random(1)
    for _ in range(100):
        jobs = [Job(f"J{i}", rng.uniform(0.05, 3), rng.choice([0, rng.uniform(0, 3)]),
                    rng.choice([0, rng.uniform(0, 1)]), rng.randint(1, 12))
                for i in range(rng.randint(1, 4))]
        res = compare_policies(jobs)
        b2b = res["back_to_back"].makespan
        assert b2b == pytest.approx(sum(j.solo_iteration * j.iterations for j in jobs))
        assert res["crossover"].makespan <= b2b * (1 + 1e-9), jobs
        assert res["naive"].makespan <= b2b * (1 + 1e-9), jobs
        # Exclusive device: no two jobs ever compute at the same time.
        s = to_schedule(res["crossover"]) if all(
            p.rate == 1 for p in res["crossover"].pieces if p.phase != "latency") else None
        if s is not None:
            check(s)


def test_crossover_passes_the_device_round_robin():
    jobs = [Job("A", 1, 5, iterations=3), Job("B", 1, 0.5, iterations=3),
            Job("C", 1, 0.5, iterations=3)]
    r = simulate_crossover(jobs, "crossover")
    order = [r.jobs[p.job].name for p in r.pieces if p.phase == "compute"]
    # B and C are ready long before A's transfer ends, but the ring waits for A.
    assert "".join(order) == "ABCABCABC"


def test_to_schedule_is_a_checked_block_schedule():
    s = to_schedule(simulate_crossover(two(n=3), "crossover"))
    check(s)
    assert s.makespan == 7 and s.start["B.c0"] == 1 and s.start["A.m0"] == 1
    assert s.problem.by_name["A.c1"].deps == ("A.m0",)
    text = format_schedule(s)
    assert text.splitlines()[0].startswith("dev0  |FFFFFF.|")
    with pytest.raises(ScheduleError, match=r"expected an exclusive timeline .* rate 0.5"):
        to_schedule(simulate_crossover(two(), "naive"))


def test_ring_allreduce_cost():
    m, l = ring_allreduce(8e6, 4, 1e9, latency=1e-5)
    assert m == pytest.approx(2 * 3 / 4 * 8e6 / 1e9) and l == pytest.approx(6e-5)
    assert ring_allreduce(8e6, 1, 1e9, 1.0) == (0, 0)
    j = Job.ring("X", 0.1, 8e6, 4, 1e9, 1e-5, iterations=3)
    assert (j.comm, j.latency, j.iterations) == (m, l, 3)


def test_sweep_gain_peaks_where_communication_matches_compute():
    rows = cluster_sweep(compute=0.4, grad_bytes=248e6, bandwidth=100e9 / 8, latency=0.0,
                         strong_scaling=True, iterations=20)
    best = max(rows, key=lambda r: r["gain_vs_b2b"])
    assert 0.5 <= best["comm/compute"] <= 2 and best["gain_vs_b2b"] > 1.6
    for r in rows:  # the model's bound (c + m) / max(c, m), less the ramp of 20 iterations
        c, m = r["c"], r["m"]
        assert 1 <= r["gain_vs_b2b"] <= (c + m) / max(c, m) + 1e-9
    # Compute-bound (fast link): little to hide.
    fast = cluster_sweep((8,), compute=0.4, grad_bytes=248e6, bandwidth=1e13, iterations=20)
    assert fast[0]["gain_vs_b2b"] < 1.05
    assert len(format_sweep(rows).splitlines()) == len(rows) + 1


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.png"
    plot_crossover(compare_policies(two(n=3)), path,
                   measured={"real": [("core 0", 0, 0.0, 1.0), ("core 0", 1, 1.0, 2.0)]})
    assert path.stat().st_size > 5_000


@pytest.mark.parametrize("make, match", [
    (lambda: Job("A", 0, 1), r"expected job A: compute to be a finite number > 0 \(got 0\)"),
    (lambda: Job("A", 1, -1), r"expected job A: comm to be a finite number >= 0 \(got -1\)"),
    (lambda: Job("A", 1, float("nan")), r"job A: comm .* \(got nan\)"),
    (lambda: Job("A", 1, 1, iterations=0), r"expected iterations to be an int >= 1 \(got 0\)"),
    (lambda: Job("A", 1, 1, iterations=2.0), r"int >= 1 \(got 2.0\)"),
    (lambda: simulate_crossover(two(), "fifo"), r"expected policy in .* \(got 'fifo'\)"),
    (lambda: simulate_crossover([], "naive"), r"expected a non-empty sequence of Job"),
    (lambda: simulate_crossover([Job("A", 1, 1)] * 2), r"expected distinct job names"),
    (lambda: simulate_crossover(two(), "naive", offsets=(0,)),
     r"expected one offset per job \(2\) \(got 1\)"),
    (lambda: simulate_crossover(two(), "back_to_back", offsets=(0, 1)),
     r"expected no offsets for back_to_back"),
    (lambda: simulate_crossover(two(), "naive", share_efficiency=1.5),
     r"expected share_efficiency in \(0, 1\] \(got 1.5\)"),
    (lambda: ring_allreduce(1e6, 0, 1e9), r"expected devices to be an int >= 1 \(got 0\)"),
    (lambda: ring_allreduce(1e6, 4, 0), r"expected bandwidth to be a finite number > 0"),
])
def test_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()
