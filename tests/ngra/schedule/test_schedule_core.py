"""ngra.schedule.core and baselines: the checker catches each kind of violation, the simulator
matches hand-computed makespans, and the standard schedules have their known bubbles."""

from __future__ import annotations

import pytest

from ngra.schedule import (Block, Problem, Schedule, ScheduleError, brute_force, check,
                           format_schedule, gpipe, greedy, interleaved_1f1b, linear, loop, mshape,
                           one_f_one_b, pipeline_problem, plot_schedule, simulate, standard,
                           vshape)

GPIPE_2x2 = [["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "F1.1", "B1.0", "B1.1"]]


def two_stage(**kw):
    return pipeline_problem(linear(2), micro_batches=2, forward=1, backward=2, **kw)


def test_simulator_matches_a_hand_computed_gpipe():
    s = simulate(two_stage(), GPIPE_2x2)
    # F0.0 [0,1) F0.1 [1,2) | F1.0 [1,2) F1.1 [2,3) B1.0 [3,5) B1.1 [5,7) | B0.0 [5,7) B0.1 [7,9)
    assert s.start == {"F0.0": 0, "F0.1": 1, "F1.0": 1, "F1.1": 2, "B1.0": 3, "B1.1": 5,
                       "B0.0": 5, "B0.1": 7}
    assert s.makespan == 9 and s.bubble_ratio == pytest.approx(1 / 3)
    assert s.peak_memory() == [2.0, 2.0]
    check(s)


def test_simulator_adds_the_communication_delay_between_devices():
    s = simulate(two_stage(comm_delay=1), GPIPE_2x2)
    # F1.0 waits for F0.0's output to arrive (1 + 1); B0.0 for B1.0's gradient (6 + 1).
    assert (s.start["F1.0"], s.start["B0.0"], s.start["B0.1"], s.makespan) == (2, 7, 9, 11)
    check(s)


def test_simulator_reports_deadlocks_and_bad_orders():
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(two_stage(), [["B0.0", "F0.0", "F0.1", "B0.1"], GPIPE_2x2[1]])
    with pytest.raises(ScheduleError, match="block F1.0 does not run on device 0"):
        simulate(two_stage(), [GPIPE_2x2[0] + ["F1.0"], GPIPE_2x2[1]])
    with pytest.raises(ScheduleError, match="block B0.1 of device 0 is missing"):
        simulate(two_stage(), [GPIPE_2x2[0][:3], GPIPE_2x2[1]])


def _ok():
    return simulate(two_stage(), GPIPE_2x2)


def _with(**moves):
    s = _ok()
    return Schedule(s.problem, {**s.start, **moves})


@pytest.mark.parametrize("start, match", [
    (lambda: {k: v for k, v in _ok().start.items() if k != "B1.1"},
     r"block B1.1 is not scheduled"),
    (lambda: {**_ok().start, "X9": 0}, r"block X9 is not in the problem"),
    (lambda: {**_ok().start, "F0.0": -1}, r"block F0.0 starts at -1; expected a finite time"),
    (lambda: {**_ok().start, "F1.0": 0.5},
     r"block F1.0 starts at 0.5 before its dependency F0.0 is done: expected start >= 1"),
    (lambda: {**_ok().start, "F0.1": 0.5},
     r"block F0.1 overlaps block F0.0 on device 0: F0.1 starts at 0.5, expected >= 1"),
])
def test_checker_names_the_offending_block(start, match):
    with pytest.raises(ScheduleError, match=match):
        check(Schedule(_ok().problem, start()))


def test_checker_catches_memory_and_comm_delay():
    s = _ok()
    check(s, memory_limit=2)
    with pytest.raises(ScheduleError, match=r"block F0.1 raises device 0's memory to 2, "
                                            r"expected <= 1.5"):
        check(s, memory_limit=1.5)
    with pytest.raises(ScheduleError, match=r"block F1.1 raises device 1's memory to 2, "
                                            r"expected <= 1.5"):
        check(s, memory_limit=(2, 1.5))
    delayed = Schedule(two_stage(comm_delay=1), s.start)
    with pytest.raises(ScheduleError, match=r"block F1.0 starts at 1 before its dependency F0.0 "
                                            r"is done: expected start >= 2 \(end of F0.0 \+ comm"):
        check(delayed)


def test_problem_validation():
    with pytest.raises(ValueError, match="positive duration"):
        Block("x", (0,), 0)
    with pytest.raises(ValueError, match="unknown block 'y'"):
        Problem((Block("x", (0,), 1, deps=("y",)),), 1)
    with pytest.raises(ValueError, match="cycle"):
        Problem((Block("x", (0,), 1, deps=("y",)), Block("y", (0,), 1, deps=("x",))), 1)
    with pytest.raises(ValueError, match=r"expected devices in \[0, 1\) \(got \[3\]\)"):
        Problem((Block("x", (3,), 1),), 1)
    with pytest.raises(ValueError, match=r"memory_limit: expected one value per device \(2\)"):
        two_stage(memory_limit=(1, 2, 3))


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 5), (4, 8), (5, 3)])
def test_gpipe_and_1f1b_have_the_known_bubble(p, m):
    prob = pipeline_problem(linear(p), micro_batches=m, forward=1, backward=1)
    for s in (gpipe(prob), one_f_one_b(prob)):
        check(s)
        assert s.makespan == 2 * (m + p - 1)
        assert s.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    # The point of 1F1B: stage s keeps at most p - s micro-batches, GPipe keeps all m.
    assert gpipe(prob).peak_memory() == [float(m)] * p
    assert one_f_one_b(prob).peak_memory() == [float(min(m, p - s)) for s in range(p)]


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 4), (3, 2, 6), (4, 2, 8)])
def test_interleaved_1f1b_bubble_shrinks_by_v(p, v, m):
    prob = pipeline_problem(loop(p, v), micro_batches=m, forward=1, backward=1)
    s = interleaved_1f1b(prob)
    check(s)
    # Unit-cost chunks: 2 v m of work per device and 2 (p - 1) of fill and drain.
    assert s.makespan == 2 * (v * m + p - 1)
    assert s.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))
    with pytest.raises(ValueError, match="multiple of"):
        interleaved_1f1b(pipeline_problem(loop(p, v), micro_batches=m + 1))


def test_memory_limit_makes_gpipe_run_in_rounds_and_1f1b_shallower():
    prob = pipeline_problem(linear(3), micro_batches=6, forward=1, backward=2, memory_limit=2)
    g = gpipe(prob)
    assert "rounds of 2" in g.policy and max(g.peak_memory()) == 2
    f = one_f_one_b(prob)
    assert f.peak_memory() == [2, 2, 1]
    for s in (g, f, greedy(prob)):
        check(s)
    with pytest.raises(ScheduleError, match="does not fit"):
        gpipe(prob.with_memory_limit(0.5))


@pytest.mark.parametrize("placement", [vshape(2), mshape(2), vshape(3)])
def test_greedy_fits_memory_on_any_placement(placement):
    prob = pipeline_problem(placement, micro_batches=4, forward=1, backward=2)
    need = max(gpipe(prob, group=1).peak_memory())  # one micro-batch's activations
    s = greedy(prob.with_memory_limit(need))
    check(s)
    assert max(s.peak_memory()) <= need


def test_brute_force_is_optimal_among_the_standard_schedules():
    for prob in (pipeline_problem(linear(2), micro_batches=3, forward=1, backward=2),
                 pipeline_problem(linear(2), micro_batches=3, forward=[1, 3], backward=[2, 3]),
                 pipeline_problem(linear(3), micro_batches=2, forward=1, backward=2,
                                  memory_limit=1)):
        best = brute_force(prob)
        check(best)
        assert best.makespan >= prob.lower_bound()
        assert all(best.makespan <= s.makespan for s in standard(prob).values())
    # Two stages, f=1, b=2, 3 micro-batches: one pipeline fill and drain, (m + p - 1)(f + b).
    assert brute_force(pipeline_problem(linear(2), micro_batches=3)).makespan == 12
    with pytest.raises(ValueError, match="max_candidates"):
        brute_force(pipeline_problem(linear(4), micro_batches=4), max_candidates=1000)


def test_text_and_plot(tmp_path):
    s = _ok()
    text = format_schedule(s)
    assert text.splitlines()[0] == "dev0  |FF...B0B1|"
    assert text.splitlines()[1] == "dev1  |.FFB0B1..|"
    assert "makespan 9, bubble 33.3%" in text
    pytest.importorskip("matplotlib")
    plot_schedule(s, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 5000
