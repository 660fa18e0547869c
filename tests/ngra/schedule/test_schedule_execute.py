"""ngra.schedule.execute: a searched schedule, 1F1B and GPipe run for real on 2 gloo processes
(a GPT cut into stages, activations and gradients over point-to-point), each giving the
single-device loss and gradients; the calibration (measured stage costs and transfer) gives a
problem the search takes, and the schedule searched on it computes the same result. Every
multi-process test is tiny and fails after its timeout instead of hanging."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import distutil  # noqa: E402

from ngra.schedule import (check, gpipe, greedy, linear, one_f_one_b,  # noqa: E402
                           pipeline_problem, simulate, vshape)
from ngra.schedule.baselines import pipeline_shape  # noqa: E402
from ngra.schedule.execute import (Calibration, ExecConfig, calibrate,  # noqa: E402
                                   calibration_from, measured_problem, pipeline_worker,
                                   reference_step, schedules_worker, split_gpt, make_model)
from ngra.distributed.launch import SpawnError  # noqa: E402

# A GPT small enough that a calibration or a step takes milliseconds.
TINY = dict(batch=4, seq=8, d_model=16, n_layer=4, n_head=2)


def _config(schedule, placement, m, **kw):
    return ExecConfig(orders=tuple(tuple(o) for o in schedule.orders()),
                      stage_devices=tuple(placement), micro_batches=m, **kw)


def _check_against_single_device(cfg, results):
    loss, grads = reference_step(cfg)
    got_loss = [r.loss for r in results if r.loss is not None]
    assert len(got_loss) == 1 and got_loss[0] == pytest.approx(loss, rel=1e-5)
    merged = {}
    for r in results:
        assert not set(merged) & set(r.grads), "a parameter's gradient came from two ranks"
        merged.update(r.grads)
    assert set(merged) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(merged[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_split_gpt_computes_the_model():
    cfg = ExecConfig(orders=(), stage_devices=(0, 1, 1), micro_batches=1, n_layer=4)
    model, idx, _ = make_model(cfg)
    stages = split_gpt(model, 3)
    x = idx
    for st in stages:
        x = st(x)
    torch.testing.assert_close(x, model(idx))
    assert [len(s.blocks) for s in stages] == [1, 1, 2]
    with pytest.raises(ValueError, match=r"expected 1..4"):
        split_gpt(model, 5)


@pytest.mark.slow
def test_v_shape_searched_schedule_matches_single_device():
    pytest.importorskip("z3")
    from ngra.schedule.search import tessel

    placement, m = vshape(2), 4
    prob = pipeline_problem(placement, micro_batches=m, forward=1, backward=2, memory_limit=3)
    sched = tessel(prob, instances=(1,), timeout_s=10).schedule
    cfg = _config(sched, placement, m, steps=3)
    results = distutil.run(pipeline_worker, 2, cfg, timeout=120)
    _check_against_single_device(cfg, results)
    # The simulator, fed the measured block durations, predicts a step time of the same order.
    pred = simulate(measured_problem(results, cfg), sched.orders()).makespan
    # The first step pays for gloo's connections and lazy initialisation: the best later one.
    step = min(max(r.step_seconds[k] for r in results) for k in (1, 2))
    # Loose: two processes on a shared 2-core machine with millisecond blocks; it fails if
    # blocks go unmeasured or the executor serialises what the schedule overlaps by far.
    assert 0.2 < step / pred < 10, (step, pred)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [gpipe, one_f_one_b])
def test_standard_schedules_match_single_device(policy):
    placement, m = linear(2), 4
    sched = policy(pipeline_problem(placement, micro_batches=m))
    cfg = _config(sched, placement, m)
    _check_against_single_device(cfg, distutil.run(pipeline_worker, 2, cfg, timeout=120))


@pytest.mark.slow
def test_a_block_on_the_wrong_rank_is_an_error():
    placement, m = linear(2), 2
    sched = gpipe(pipeline_problem(placement, micro_batches=m))
    orders = sched.orders()
    cfg = ExecConfig(orders=(tuple(orders[1]), tuple(orders[0])), stage_devices=(0, 1),
                     micro_batches=m)
    out = distutil.run(pipeline_worker, 2, cfg, timeout=60, expect_errors=True)
    assert any(isinstance(r, str) and "stage 1 is on device 1" in r for r in out), out


def test_calibration_problem_in_seconds_and_in_solver_units():
    cal = Calibration(stage_devices=(0, 1, 1, 0), micro_batches=3,
                      forward=(0.002, 0.001, 0.0012, 0.003), backward=(0.004, 0.0021, 0.002, 0.005),
                      comm=0.00026, samples={})
    prob = cal.problem(memory_limit=3)
    assert pipeline_shape(prob) == (4, 3, [(0,), (1,), (1,), (0,)])
    assert prob.by_name["F3.2"].duration == 0.003 and prob.by_name["B1.0"].duration == 0.0021
    assert prob.comm_delay == 0.00026 and prob.memory_limit == (3.0, 3.0)
    unit = cal.unit()
    assert unit == pytest.approx(0.0001)  # a tenth of the shortest block
    ints = cal.problem(memory_limit=3, unit=unit)
    assert [ints.by_name[f"F{s}.0"].duration for s in range(4)] == [20, 10, 12, 30]
    assert [ints.by_name[f"B{s}.0"].duration for s in range(4)] == [40, 21, 20, 50]
    assert ints.comm_delay == 3
    # A coarse unit never gives a zero-length block.
    assert min(b.duration for b in cal.problem(unit=1.0).blocks) == 1
    with pytest.raises(ValueError, match="unit"):
        cal.problem(unit=0)


def test_expected_makespan_draws_block_durations_from_the_samples():
    cal = Calibration(stage_devices=(0, 1), micro_batches=2, forward=(1.0, 1.0),
                      backward=(2.0, 2.0), comm=0.5,
                      samples={("F", 0): [1.0], ("F", 1): [1.0], ("B", 0): [2.0],
                               ("B", 1): [2.0]})
    orders = one_f_one_b(cal.problem()).orders()
    # One sample per stage: every draw is the deterministic problem.
    assert cal.expected_makespan(orders, draws=5) == simulate(cal.problem(), orders).makespan
    # Stage 1's forward takes 1 or 3 (median 1 in a list 1, 1, 3): on the critical path of
    # both micro-batches, so the expectation exceeds the makespan of the median costs.
    noisy = Calibration(cal.stage_devices, 2, (1.0, 1.0), (2.0, 2.0), 0.5,
                        {**cal.samples, ("F", 1): [1.0, 1.0, 3.0]})
    e = noisy.expected_makespan(orders, draws=400, seed=1)
    assert e == noisy.expected_makespan(orders, draws=400, seed=1)  # seeded
    assert simulate(noisy.problem(), orders).makespan < e < \
        simulate(Calibration((0, 1), 2, (1.0, 3.0), (2.0, 2.0), 0.5, {}).problem(),
                 orders).makespan


@pytest.mark.slow
def test_calibration_inside_a_schedule_times_every_block():
    placement, m = vshape(2), 2
    cfg = ExecConfig(orders=(), stage_devices=tuple(placement), micro_batches=m, **TINY)
    orders = greedy(pipeline_problem(placement, micro_batches=m)).orders()
    try:
        cal = calibrate(cfg, 2, warmup=1, iters=2, orders=orders, timeout=60)
    except SpawnError as e:
        pytest.fail(f"calibration failed: {e}")
    assert cal.source == "pipeline"
    assert all(x > 0 for x in cal.forward + cal.backward) and cal.comm > 0
    # Every timed step gives one sample per micro-batch of every stage's forward and backward.
    assert all(len(cal.samples[k, s]) == 2 * m for k in "FB" for s in range(4))
    assert len(cal.samples["comm", 0, 1]) == 2


@pytest.fixture(scope="module")
def v_calibration():
    """The tiny GPT's V-shape (stages on ranks 0, 1, 1, 0) calibrated once on 2 workers."""
    cfg = ExecConfig(orders=(), stage_devices=tuple(vshape(2)), micro_batches=4, **TINY)
    try:
        return calibrate(cfg, 2, warmup=1, iters=3, timeout=60)
    except SpawnError as e:  # a hang or a worker's error: fail with its message
        pytest.fail(f"calibration failed: {e}")


@pytest.mark.slow
def test_calibration_on_two_workers_gives_a_problem_the_search_takes(v_calibration):
    pytest.importorskip("z3")
    from ngra.schedule.search import tessel

    cal = v_calibration
    assert cal.stage_devices == (0, 1, 1, 0) and cal.micro_batches == 4
    assert cal.source == "isolated"
    assert len(cal.forward) == len(cal.backward) == 4
    assert all(x > 0 for x in cal.forward + cal.backward) and cal.comm > 0
    assert all(len(cal.samples[k, s]) == 3 for k in "FB" for s in range(4))
    assert len(cal.samples["comm", 0, 1]) == 3
    prob = cal.problem(memory_limit=3)
    assert pipeline_shape(prob) == (4, 4, [(0,), (1,), (1,), (0,)])
    assert [prob.by_name[f"B{s}.1"].duration for s in range(4)] == list(cal.backward)
    ints = cal.problem(memory_limit=3, unit=cal.unit())
    assert all(isinstance(b.duration, int) and b.duration >= 1 for b in ints.blocks)
    res = tessel(ints, instances=(1,), timeout_s=10)
    check(res.schedule)
    # The orders searched in units run on the problem in seconds.
    check(simulate(prob, res.schedule.orders()))


@pytest.mark.slow
@pytest.mark.parametrize("lookahead", [0, 1, None])
def test_schedule_searched_on_measured_costs_matches_single_device(v_calibration, lookahead):
    """lookahead 0: each receive posted at its block; 1: one block ahead; None: every receive
    of a step at its start."""
    pytest.importorskip("z3")
    from ngra.schedule.search import tessel

    cal = v_calibration
    cfg = ExecConfig(orders=(), stage_devices=cal.stage_devices, micro_batches=4,
                     lookahead=lookahead, steps=2, **TINY)
    searched = tessel(cal.problem(memory_limit=3, unit=cal.unit(4)), instances=(1,),
                      timeout_s=10).schedule
    prob = cal.problem(memory_limit=3)
    named = (("searched", tuple(tuple(o) for o in searched.orders())),
             ("greedy", tuple(tuple(o) for o in greedy(prob).orders())))
    # With every receive posted at once, a calibration round also runs before each round of
    # steps (its samples after the first one come back).
    again = lookahead is None
    out = distutil.run(schedules_worker, 2, cfg, named, again, timeout=60)
    for name, _ in named:
        results = [r[name] for r in out]
        assert all(len(r.step_seconds) == 2 and len(r.trace) == 2 for r in results)
        _check_against_single_device(cfg, results)
    assert all(("calibration" in r) == again for r in out)
    if again:
        during = calibration_from([r["calibration"] for r in out], cfg)
        assert all(x > 0 for x in during.forward + during.backward) and during.comm > 0
        assert len(during.samples["F", 0]) == 1 and len(during.samples["comm", 0, 1]) == 1
