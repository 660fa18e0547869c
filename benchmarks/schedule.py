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

``--measured`` (alias ``--execute``) also runs schedules for real on ``--ranks`` gloo processes
(default 2), a GPT (micro-batches of 4 x 64 tokens, 4 of them, 6 on 3 ranks; d_model 128,
max(4, 2 ranks) layers, ``--vocab`` tokens) cut into the stages of each placement of
``--placements`` (linear, V, loop, M: the M-shape's embedding and head alone, each split by
vocabulary over every rank): it calibrates the stages' forward and backward times and the
transfer of an activation on the real workers (each stage alone, and inside a greedy schedule's
steps: the latter is used), searches on those costs, then runs the standard schedules, the
searched one and the one searched on the assumed costs (forward 1, backward 2) in turns on the
same workers and prints, per schedule, the simulator's prediction next to the measured step
time, and the searched / best standard ratio predicted and measured. It also prints how many
cores other processes used meanwhile (timings under load are not comparable), and whether the
ranks outnumber the cores::

    .venv/bin/python benchmarks/schedule.py --cases linear --measured --lookahead 0,all
    .venv/bin/python benchmarks/schedule.py --cases linear --measured --ranks 4 --vocab 2048
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


def run_case(case: str, p: int, m: int, timeout_s: float | None, rlimit: int | None = None) -> dict:
    prob, instances = build(case, p, m)
    std = standard(prob)
    for s in std.values():
        check(s)
    t0 = time.monotonic()
    res = tessel(prob, instances=instances, timeout_s=timeout_s, completion_timeout_s=timeout_s,
                 rlimit=rlimit)
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


def _receive_stats(results, cfg):
    """From the traces of every step after the first: the seconds from a block's ``isend`` to
    the start of the dependent block on another rank when that one was already waiting (the
    transfer as the pipeline sees it), and per step the total time blocks waited for a message
    sent before they came to it (0 if every message were delivered while its receiver was
    busy: gloo's rendezvous when the receive is posted late, or a receiving process that gets
    no core while both compute)."""
    from ngra.schedule.execute import _parse, stage_shards

    devs = stage_shards(cfg.stage_devices)
    delays, late = [], []
    for k in range(1, len(results[0].trace)):
        sent, begins = {}, {}
        for r in results:
            for name, ta, tb, _te, ts in r.trace[k][1]:
                sent[name, r.rank], begins[name, r.rank] = ts, (ta, tb)
        waited = 0.0
        for (name, rank), (ta, tb) in begins.items():
            kind, s, i = _parse(name)
            u = (f"F{s - 1}.{i}" if kind == "F" and s > 0 else
                 f"B{s + 1}.{i}" if kind == "B" and s < len(devs) - 1 else None)
            # the last of its messages (a split stage sends one from each of its devices)
            last = None if u is None else max(
                (sent[u, d] for d in devs[_parse(u)[1]] if d != rank), default=None)
            if last is None:
                continue
            if ta < last:
                delays.append(tb - last)
            else:
                waited += tb - ta
        late.append(waited)
    return delays, late


class OtherLoad:
    """CPU the rest of the machine used meanwhile: busy time from /proc/stat (user, nice, system,
    irq, softirq and the hypervisor's steal) minus this process's and its finished children's
    (the gloo workers), in cores on average. Linux only (None elsewhere)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    @staticmethod
    def _busy():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        import os

        user, nice, system, _idle, _iowait, irq, softirq, steal = v + [0] * (8 - len(v))
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own():
        import resource

        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    def cores(self):
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return None
        wall = max(1e-9, time.monotonic() - self.t0)
        return max(0.0, (busy - self.busy0) - (self._own() - self.own0)) / wall


# placement of p ranks, memory limit (None: what interleaved 1F1B needs, so that it competes)
MEASURED = {"linear": (linear, lambda p: p), "V": (vshape, lambda p: p + 1),
            "loop": (lambda p: loop(p, 2), None), "M": (mshape, lambda p: p + 2)}


def _la(v) -> str:
    return "all" if v is None else str(v)


def _ms(xs) -> list:
    return [round(1e3 * x, 2) for x in xs]


def measured(quick: bool, timeout: float | None, placements, steps: int, lookaheads, ranks: int = 2,
             vocab: int = 32, rlimit: int | None = None) -> list:
    """On ``ranks`` gloo processes, per placement: calibrate the staged GPT twice, each stage
    timed on its own and inside the steps of a greedy schedule (the blocks of a real pipeline),
    build the pipeline problem from the second (median forward / backward per stage, ping-pong
    transfer), search it (Tessel on integer multiples of a tenth of the shortest block, at least
    a 30th of the longest), then run the standard schedules, the searched one and the one
    searched on assumed costs (forward 1, backward 2; skipped if the solver gives up) in turns
    on the same workers, once per receive lookahead; each schedule must give single-device loss
    and gradients. Prints the simulator's predictions (median costs; and the Monte Carlo mean
    over the calibration's samples) against the measured step times."""
    import statistics

    import torch

    from ngra.schedule import ScheduleError, greedy, simulate, standard
    from ngra.schedule.execute import (ExecConfig, calibrate, merge_grads, reference_step,
                                       schedules_worker, spawn)

    import os

    p = ranks
    # 4 micro-batches (6 on 3 ranks: interleaved 1F1B needs a multiple of p) of 2 / 4 sequences;
    # 2 p layers: a layer per stage of the V and loop placements
    m = 4 if 4 % p == 0 else 2 * p
    size = dict(batch=2 * m, seq=16, d_model=32, n_layer=max(4, 2 * p), n_head=2,
                vocab=vocab) if quick else \
        dict(batch=4 * m, seq=64, d_model=128, n_layer=max(4, 2 * p), n_head=4, vocab=vocab)
    out = []
    cores = os.cpu_count()
    print(f"\nOn measured costs, {p} gloo processes on {cores} cores"
          f"{' (oversubscribed: step times include waiting for a core)' if p > cores else ''} "
          f"(GPT {size}, {m} micro-batches). step: median "
          f"of {steps - 2} rounds after 2 warm-up rounds, every schedule taking turns on the same "
          f"workers; pred: the simulator on the calibration's median costs (what the search "
          f"used); pred~: its mean over 200 draws of every block's duration from the "
          f"calibration's samples; late: ms per step blocks waited for a message sent before "
          f"they came to it; recv: receives posted k blocks ahead (all: at the step's start; 0: "
          f"at the block)")
    head = (f"{'placement':<9} {'schedule':<22} {'recv':>4} {'pred ms':>8} {'pred~ ms':>8} "
            f"{'step ms':>8} {'step/pred':>9} {'step/pred~':>10} {'late':>6}")
    for pname in placements:
        make, limit = MEASURED[pname]
        placement = make(p)
        limit = None if limit is None else limit(p)
        cfg = ExecConfig(orders=(), stage_devices=tuple(placement), micro_batches=m,
                         steps=steps, **size)
        load = OtherLoad()
        alone = calibrate(cfg, p, warmup=3, iters=15, timeout=300)
        unit_costs = pipeline_problem(placement, micro_batches=m, forward=1, backward=2)
        cal = calibrate(cfg, p, warmup=2, iters=8, orders=greedy(unit_costs).orders(),
                        timeout=300)
        if limit is None:  # what interleaved 1F1B itself needs, so that it competes
            limit = max(interleaved_1f1b(cal.problem()).peak_memory())
        prob = cal.problem(memory_limit=limit)
        # A tenth of the shortest block, but at least a 30th of the longest: the M-shape's split
        # embedding takes microseconds, and a finer unit gives the solver periods of hundreds of
        # units, which it does not finish (rounding the tiny block up costs nothing that shows).
        unit = max(cal.unit(), max(cal.forward + cal.backward) / 30)
        t0 = time.monotonic()
        found = tessel(cal.problem(memory_limit=limit, unit=unit), instances=(1, 2),
                       timeout_s=timeout, rlimit=rlimit)
        search_s = time.monotonic() - t0
        scheds = dict(standard(prob))
        try:
            assumed = tessel(unit_costs.with_memory_limit(limit), instances=(1, 2),
                             timeout_s=timeout, rlimit=rlimit).schedule
            scheds["Tessel (assumed 1/2)"] = simulate(prob, assumed.orders(),
                                                      policy="Tessel (assumed 1/2)")
        except ScheduleError as e:  # only a comparison: the run goes on without it
            print(f"{pname}: no schedule searched on the assumed costs: {e}")
        scheds["Tessel (measured)"] = simulate(prob, found.schedule.orders(),
                                               policy="Tessel (measured)")
        for sch in scheds.values():
            check(sch)
        runs = [(name, la) for la in lookaheads for name in scheds]
        named = tuple((f"{name}@{_la(la)}", tuple(tuple(o) for o in scheds[name].orders()), la)
                      for name, la in runs)
        res = spawn(schedules_worker, p, cfg, named, timeout=900)
        other = load.cores()
        loss, grads = reference_step(cfg)
        print(f"\n{pname}: stage devices {list(placement)}, memory limit {limit:g}; search "
              f"{search_s:.1f} s (unit {1e3 * unit:.3f} ms); other processes used "
              f"{'?' if other is None else f'{other:.2f}'} cores meanwhile")
        for what, c in (("stages timed alone", alone), ("inside greedy's steps (used)", cal)):
            print(f"  calibrated, {what}: F {_ms(c.forward)} ms, B {_ms(c.backward)} ms, "
                  f"transfer {1e3 * c.comm:.3f} ms")
        print(head)
        print("-" * len(head))
        rows = []
        for (name, la), (key, _, _) in zip(runs, named):
            orders = scheds[name].orders()
            rr = [r[key] for r in res]
            got = merge_grads(rr)
            assert abs([r.loss for r in rr if r.loss is not None][0] - loss) < 1e-4 * abs(loss)
            for n, g in grads.items():
                torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6)
            step = statistics.median(max(r.step_seconds[k] for r in rr) for k in range(2, steps))
            pred = scheds[name].makespan
            pred_mc = cal.expected_makespan(orders)
            delays, late = _receive_stats(rr, cfg)
            rows.append({"placement": pname, "schedule": name, "lookahead": _la(la),
                         "predicted_s": pred, "predicted_mc_s": pred_mc, "step_s": step,
                         "late_s": statistics.median(late[1:]),
                         "transfer_s": statistics.median(delays) if delays else None,
                         "calibration": [cal.forward, cal.backward, cal.comm],
                         "calibration_alone": [alone.forward, alone.backward, alone.comm],
                         "memory_limit": limit, "other_load": other, "ranks": p,
                         "micro_batches": m, "size": size})
            print(f"{pname:<9} {name:<22} {_la(la):>4} {1e3 * pred:>8.2f} {1e3 * pred_mc:>8.2f} "
                  f"{1e3 * step:>8.2f} {step / pred:>8.2f}x {step / pred_mc:>9.2f}x "
                  f"{1e3 * rows[-1]['late_s']:>6.2f}", flush=True)
        for la in lookaheads:
            mine = [r for r in rows if r["lookahead"] == _la(la)]
            std = [r for r in mine if not r["schedule"].startswith("Tessel")]
            srch = next(r for r in mine if r["schedule"] == "Tessel (measured)")
            parts = []
            for col, what in (("predicted_s", "pred"), ("predicted_mc_s", "pred~"),
                              ("step_s", "measured")):
                best = min(std, key=lambda r: r[col])
                parts.append(f"{what} {srch[col] / best[col]:.2f} ({best['schedule']})")
            obs = [r["transfer_s"] for r in mine if r["transfer_s"] is not None]
            print(f"recv {_la(la)}: searched / best standard: {', '.join(parts)}; observed "
                  f"transfer (isend to the waiting receiver's start, median) "
                  f"{1e3 * statistics.median(obs) if obs else float('nan'):.3f} ms")
        out += rows
    print("(every run matched single-device loss and gradients)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 devices, 4 micro-batches")
    ap.add_argument("--devices", type=int, default=None, help="pipeline devices (default 4)")
    ap.add_argument("--micro-batches", type=int, default=None, help="default 2 x devices")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    ap.add_argument("--timeout", type=float, default=None,
                    help="solver seconds per phase (default 5 quick, 20 full; none with "
                         "--rlimit)")
    ap.add_argument("--rlimit", type=int, default=None,
                    help="z3 resource units per solver check: the searches then find the same "
                         "schedules on any machine, however loaded (e.g. 200000000)")
    ap.add_argument("--plot", type=Path, help="write Gantt charts (PNG) into this folder")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--measured", "--execute", action="store_true",
                    help="also calibrate a small GPT on --ranks gloo processes, search on "
                         "the measured costs and run standard and searched schedules for real")
    ap.add_argument("--ranks", type=int, default=2,
                    help="with --measured: gloo processes (default 2; more than the machine's "
                         "cores oversubscribe it)")
    ap.add_argument("--vocab", type=int, default=32,
                    help="with --measured: the GPT's vocabulary (default 32; the M-shape splits "
                         "the embedding and the head by it over every rank)")
    ap.add_argument("--placements", default=",".join(MEASURED),
                    help=f"with --measured: comma list of {list(MEASURED)}")
    ap.add_argument("--steps", type=int, default=None,
                    help="with --measured: rounds of every schedule (default 8 quick, 30)")
    ap.add_argument("--lookahead", default="all",
                    help="with --measured: comma list; post receives this many blocks ahead "
                         "(0: at the block, the executor's old way; all, the default: every "
                         "receive of a step at its start); each schedule runs with each")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; expected some of {CASES}")
    pls = [x for x in args.placements.split(",") if x]
    if set(pls) - set(MEASURED):
        ap.error(f"--placements: unknown {sorted(set(pls) - set(MEASURED))}; expected some of "
                 f"{list(MEASURED)}")
    try:
        las = [None if v == "all" else int(v) for v in args.lookahead.split(",") if v]
    except ValueError:
        las = []
    if not las or any(v is not None and v < 0 for v in las):
        ap.error(f"--lookahead: expected a comma list of ints >= 0 or 'all' (got "
                 f"{args.lookahead!r})")
    steps = args.steps or (8 if args.quick else 30)
    if args.ranks < 2 or args.vocab < args.ranks:
        ap.error(f"--ranks: expected >= 2 and <= --vocab (got {args.ranks}, vocab {args.vocab})")
    if steps < 4:
        ap.error(f"--steps: expected >= 4 (2 warm-up rounds, then timed ones) (got {steps})")
    p = args.devices or (2 if args.quick else 4)
    m = args.micro_batches or 2 * p
    if args.rlimit is not None and args.rlimit < 1:
        ap.error(f"--rlimit: expected a positive number of z3 resource units (got {args.rlimit})")
    timeout = args.timeout or (None if args.rlimit else 5.0 if args.quick else 20.0)
    rows = []
    for case in cases:
        rows.append(run_case(case, p, m, timeout, args.rlimit))
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
    rows_exec = []
    if args.measured:
        rows_exec = measured(args.quick, timeout, pls, steps, las, args.ranks, args.vocab,
                             rlimit=args.rlimit)
    if args.json:
        args.json.write_text(json.dumps({
            "simulated": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
            "measured": rows_exec}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
