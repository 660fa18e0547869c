"""Searched (Tessel) vs standard pipeline schedules, simulated, under the same memory limit.

For each placement (stages on devices) and cost profile, builds the pipeline problem
(``ngra.schedule.pipeline_problem``), runs every standard schedule that applies (GPipe in rounds
that fit memory, 1F1B, interleaved 1F1B, greedy backward-first list scheduling) and Tessel's
search (shortest repetend with z3, unrolled, warm-up and cool-down re-solved), checks every
schedule (dependencies, overlaps, memory) and prints makespans, the ratio best standard / searched
(> 1: the search wins), the repetend's period and the search time.

Cases: ``linear`` (uniform stages, where 1F1B is already optimal: ratio 1 expected), ``unequal``
(one stage 3x slower), ``V`` (Tessel's V-shape: device 0 holds the first and last stages),
``M`` (a shared embedding split over all devices at both ends), ``loop`` (interleaved placement).

    .venv/bin/python benchmarks/schedule.py            # 4 devices, 8 micro-batches
    .venv/bin/python benchmarks/schedule.py --quick    # 2 devices, 4 micro-batches
    .venv/bin/python benchmarks/schedule.py --quick --plot /tmp/gantt   # + Gantt PNGs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ngra.schedule import (check, interleaved_1f1b, linear, loop, mshape,  # noqa: E402
                           pipeline_problem, plot_schedule, standard, vshape)
from ngra.schedule.search import tessel  # noqa: E402

CASES = ["linear", "unequal", "V", "M", "loop"]
STANDARD = ["GPipe", "1F1B", "interleaved 1F1B", "greedy 1F1B"]


def build(case: str, p: int, m: int):
    """``(problem, instances to try)``; memory limits are in activations of one stage."""
    if case == "linear":
        return pipeline_problem(linear(p), micro_batches=m, forward=1, backward=2,
                                memory_limit=p), (1,)
    if case == "unequal":
        f = [1] * p
        f[p // 2] = 3
        return pipeline_problem(linear(p), micro_batches=m, forward=f,
                                backward=[2 * x for x in f], memory_limit=p), (1, 2)
    if case == "V":
        return pipeline_problem(vshape(p), micro_batches=m, forward=1, backward=2,
                                memory_limit=p + 1), (1,)
    if case == "M":
        # Embedding / tied head: cheap per device since split p ways; the middle is a pipeline.
        return pipeline_problem(mshape(p), micro_batches=m, forward=[1] + [2] * p + [1],
                                backward=[2] + [4] * p + [2], memory_limit=p + 2), (1,)
    if case == "loop":
        # The limit is what interleaved 1F1B itself needs, so it competes.
        prob = pipeline_problem(loop(p, 2), micro_batches=m, forward=1, backward=2)
        return prob.with_memory_limit(max(interleaved_1f1b(prob).peak_memory())), (1,)
    raise ValueError(case)


def run_case(case: str, p: int, m: int, timeout_s: float) -> dict:
    prob, instances = build(case, p, m)
    std = standard(prob)
    for s in std.values():
        check(s)
    t0 = time.monotonic()
    res = tessel(prob, instances=instances, timeout_s=timeout_s, completion_timeout_s=timeout_s)
    wall = time.monotonic() - t0
    check(res.schedule)
    by_kind = {}
    for name, s in std.items():
        key = "GPipe" if name.startswith("GPipe") else name
        by_kind[key] = s
    best = min(std.values(), key=lambda s: s.makespan)
    return {
        "case": case, "devices": prob.n_devices, "micro_batches": m,
        "memory_limit": max(prob.memory_limit), "lower_bound": prob.lower_bound(),
        "standard": {k: s.makespan for k, s in by_kind.items()},
        "best_standard": best.policy, "best_makespan": best.makespan,
        "searched": res.schedule.makespan, "ratio": best.makespan / res.schedule.makespan,
        "period": res.repetend.period, "instances": res.repetend.instances,
        "repetend_s": res.repetend_seconds, "completion_s": res.completion_seconds,
        "search_s": wall, "peak": max(res.schedule.peak_memory()),
        "_schedules": {**by_kind, "Tessel": res.schedule},
    }


def execute(quick: bool, timeout: float) -> list:
    """Run GPipe, (greedy) 1F1B and the searched schedule on 2 gloo processes; check each against
    single-device loss and gradients; print measured step time against the simulator's prediction
    from the measured median block durations."""
    import statistics

    import torch

    from ngra.schedule import gpipe, greedy, one_f_one_b, simulate
    from ngra.schedule.execute import (ExecConfig, measured_problem, pipeline_worker,
                                       reference_step, spawn)

    m = 4
    size = dict(batch=8, seq=16, d_model=32, n_layer=4, steps=3) if quick else \
        dict(batch=16, seq=64, d_model=128, n_layer=4, n_head=4, steps=5)
    out = []
    print(f"\nExecuted on 2 gloo processes (GPT {size}, {m} micro-batches); step time = median "
          f"of steps after the first; predicted = simulator on measured median block times")
    head = f"{'placement':<10} {'schedule':<22} {'step ms':>9} {'predicted ms':>13} {'step/pred':>10}"
    print(head)
    print("-" * len(head))
    for pname, placement, limit in (("linear", linear(2), 2), ("V", vshape(2), 3)):
        prob = pipeline_problem(placement, micro_batches=m, forward=1, backward=2,
                                memory_limit=limit)
        scheds = [gpipe(prob), one_f_one_b(prob) if pname == "linear" else greedy(prob),
                  tessel(prob, instances=(1,), timeout_s=timeout).schedule]
        for sched in scheds:
            cfg = ExecConfig(orders=tuple(tuple(o) for o in sched.orders()),
                             stage_devices=tuple(placement), micro_batches=m, **size)
            res = spawn(pipeline_worker, 2, cfg, timeout=600)
            loss, grads = reference_step(cfg)
            got = {}
            for r in res:
                got.update(r.grads)
            assert abs([r.loss for r in res if r.loss is not None][0] - loss) < 1e-4 * abs(loss)
            for n, g in grads.items():
                torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6)
            step = statistics.median(max(r.step_seconds[k] for r in res)
                                     for k in range(1, cfg.steps))
            pred = simulate(measured_problem(res, cfg), sched.orders()).makespan
            out.append({"placement": pname, "schedule": sched.policy, "step_s": step,
                        "predicted_s": pred})
            print(f"{pname:<10} {sched.policy:<22} {1e3 * step:>9.2f} {1e3 * pred:>13.2f} "
                  f"{step / pred:>9.2f}x", flush=True)
    print("(every run matched single-device loss and gradients)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 devices, 4 micro-batches")
    ap.add_argument("--devices", type=int, default=None, help="pipeline devices (default 4)")
    ap.add_argument("--micro-batches", type=int, default=None, help="default 2 x devices")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    ap.add_argument("--timeout", type=float, default=None,
                    help="solver seconds per phase (default 5 quick, 20 full)")
    ap.add_argument("--plot", type=Path, help="write Gantt charts (PNG) into this folder")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--execute", action="store_true",
                    help="also run schedules for real on 2 gloo processes (a small GPT)")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; expected some of {CASES}")
    p = args.devices or (2 if args.quick else 4)
    m = args.micro_batches or 2 * p
    timeout = args.timeout or (5.0 if args.quick else 20.0)
    rows = []
    for case in cases:
        rows.append(run_case(case, p, m, timeout))
        print(f"  {case} done ({rows[-1]['search_s']:.1f} s)", flush=True)
    print(f"\nSimulated makespans (time units), {p} devices, {m} micro-batches; memory limit in "
          f"stage activations; every schedule checked")
    head = (f"{'case':<8} {'mem':>4} {'bound':>6} " + " ".join(f"{k:>13}" for k in STANDARD)
            + f" {'Tessel':>7} {'best/Tessel':>12} {'period':>7} {'search s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(f"{r['standard'][k]:>13g}" if k in r["standard"] else f"{'-':>13}"
                         for k in STANDARD)
        print(f"{r['case']:<8} {r['memory_limit']:>4g} {r['lower_bound']:>6g} {cells} "
              f"{r['searched']:>7g} {r['ratio']:>11.2f}x "
              f"{r['period']:>4d}/{r['instances']:<2d} {r['search_s']:>9.2f}")
    print("\nbest/Tessel: the best standard schedule's makespan over the searched one's "
          "(>1: search wins);\nperiod: the repetend's period / micro-batches per period; "
          "bound: max(device load, critical path).")
    if args.plot:
        args.plot.mkdir(parents=True, exist_ok=True)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        for r in rows:
            scheds = r["_schedules"]
            fig, axes = plt.subplots(len(scheds), 1, figsize=(11, 1.1 * p * len(scheds) + 1),
                                     squeeze=False)
            for ax, (name, s) in zip(axes[:, 0], scheds.items()):
                plot_schedule(s, ax=ax, title=f"{r['case']}: {s.policy} makespan "
                                              f"{s.makespan:g}")
            fig.tight_layout()
            out = args.plot / f"schedule_{r['case']}.png"
            fig.savefig(out, dpi=100)
            plt.close(fig)
            print(f"wrote {out}")
    if args.execute:
        rows_exec = execute(args.quick, timeout)
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")}
                                         for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
