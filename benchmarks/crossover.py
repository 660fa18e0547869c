"""Time-sharing two data-parallel jobs on the same cores, after CrossoverScheduler, for real.

Two Linux network namespaces joined by a veth pair whose both ends are rate limited by ``tc tbf``
are the "network"; two jobs, each a 2-worker gloo data-parallel MLP, share it and the machine's
two cores: rank 0 of each job runs in namespace A pinned to core 0, rank 1 in namespace B pinned
to core 1, so every gradient all-reduce crosses the rate-limited link (real, not faked, gaps).
An iteration is: compute (the previous iteration's SGD step, forward, backward, flattening the
gradients and the loss into one buffer) then one ``all_reduce`` of that buffer.

Policies (the same processes, 1 torch thread each, only the timing differs):

- ``back_to_back``: job B starts its (untimed) warm-up when job A is done;
- ``naive``: both jobs at once, the OS time-slices each core between them;
- ``crossover``: both jobs at once, each core passed between the jobs by a token ring (a FIFO
  per core and job: a worker reads the token before its compute and hands it to the other job's
  worker on its core right after, before its all-reduce), so one job computes while the other
  communicates.

Reported: combined throughput (timed iterations of both jobs / wall time from the common start,
after a barrier of all four workers), each job's iteration time, the gains of crossover, the
simulator's prediction (``ngra.schedule.crossover``) for the compute and all-reduce times
measured in the back-to-back run, and a check that every job's loss curve (and final
parameters) are bit-identical across policies. Then a simulated sweep to 8-1024 devices.

The rate is chosen so that one all-reduce takes about ``--comm-ratio`` times one compute phase
(measured first in this process), unless ``--rate`` (Mbit/s) is given. Needs root and
``ip netns``; prints ``skipped: ...`` and exits 0 (77 with ``--check``) where namespaces cannot
be created. Namespaces and the veth are named with this process id and always removed.

    .venv/bin/python benchmarks/crossover.py                       # ~20 s
    .venv/bin/python benchmarks/crossover.py --quick --plot /tmp/x  # tiny, + timelines PNG
    .venv/bin/python benchmarks/crossover.py --check                # can namespaces be made?

Measured here (2 cores, AMD EPYC, torch 2.13, another engineer's test suite running at the same
time; MLP 256-384x3-256, batch 1024, 1.97 MB of gradients, compute ~32 ms, ~510 Mbit/s so that
the all-reduce takes ~29 ms; 30 timed iterations per job), crossover / back to back: 1.72x,
1.66x, 1.84x over three runs (simulated 1.84-1.92x); crossover / naive: 1.35x, 0.97x, 1.27x
(naive's gain is luck of phase: the OS sometimes drifts the jobs into alternation). With
``--comm-ratio 0.25``: 1.08x vs back to back (simulated 1.17x); ``--comm-ratio 4``: 1.25x
(simulated 1.24x), 1.04x vs naive. Losses and parameters bit-identical in every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("back_to_back", "naive", "crossover")
JOBS = ("A", "B")
ADDR = ("10.77.0.1", "10.77.0.2")


# --------------------------------------------------------------------------------------------
# The link: two namespaces, a veth pair, tbf on both ends.

def _sh(*cmd):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with status {res.returncode}: "
                           f"{res.stderr.strip()}")
    return res.stdout


class Link:
    """Namespaces ``ngx<pid>a`` / ``ngx<pid>b`` holding veth ends of the same names, addresses
    10.77.0.1 / 10.77.0.2, each end's egress limited to ``rate_mbit`` by tbf (so each direction
    is). A context manager: leaving it deletes both namespaces (and with them the veth)."""

    def __init__(self, rate_mbit: float | None):
        tag = f"ngx{os.getpid()}"
        self.ns = (tag + "a", tag + "b")
        self.dev = self.ns  # veth end names (<= 15 chars: 'ngx' + pid + 1)
        self.rate = rate_mbit
        self._made: list[str] = []

    def __enter__(self):
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                self._made.append(ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, ADDR):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                self.set_rate(self.rate)
        except BaseException:
            self.__exit__()
            raise
        return self

    def set_rate(self, rate_mbit: float) -> None:
        # burst: at least 32 kbit and one 4 ms tick of traffic (tbf needs a bucket that one timer
        # tick can refill, else it undershoots the rate).
        burst = max(32_000, int(rate_mbit * 1e6 * 0.004))
        for ns, dev in zip(self.ns, self.dev):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{rate_mbit:.3f}mbit", "burst", f"{burst // 1000}kbit", "latency", "50ms")
        self.rate = rate_mbit

    def __exit__(self, *exc):
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        # A veth not yet moved into a namespace lives in the root namespace.
        subprocess.run(["ip", "link", "del", self.dev[0]], capture_output=True, timeout=30)
        self._made = []


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when a throwaway pair can be made."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    try:
        with Link(100.0):
            pass
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create network namespaces / veth / tbf: {e}"
    return None


# --------------------------------------------------------------------------------------------
# The worker (run as `ip netns exec NS python crossover.py --worker spec.json`).

def build(cfg: dict, seed: int):
    import torch

    torch.manual_seed(seed)
    w, d = cfg["width"], cfg["features"]
    layers, last = [], d
    for _ in range(cfg["depth"]):
        layers += [torch.nn.Linear(last, w), torch.nn.Tanh()]
        last = w
    layers.append(torch.nn.Linear(last, d))
    return torch.nn.Sequential(*layers)


def data(cfg: dict, seed: int, rank: int):
    """Four fixed batches per rank: x and a teacher's (fixed random MLP) output y."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    teacher = torch.randn(cfg["features"], cfg["features"], generator=g) / cfg["features"] ** 0.5
    xs = [torch.randn(cfg["batch"], cfg["features"], generator=g) for _ in range(4)]
    return [(x, torch.tanh(x @ teacher)) for x in xs]


def _file_barrier(folder: Path, name: str, n: int, me: str) -> float:
    """Wait until ``n`` workers wrote ``<name>.*``; return the latest arrival (monotonic clock,
    one clock for every process of the machine)."""
    tmp = folder / f".{name}.{me}.tmp"
    tmp.write_text(repr(time.monotonic()))
    tmp.rename(folder / f"{name}.{me}")
    while True:
        got = list(folder.glob(f"{name}.*"))
        if len(got) >= n:
            return max(float(p.read_text()) for p in got)
        time.sleep(0.002)


def _wait_for(folder: Path, pattern: str, n: int) -> None:
    while len(list(folder.glob(pattern))) < n:
        time.sleep(0.005)


def worker(spec_path: str) -> None:
    """One worker of one job: joins its job's gloo group, then runs every policy in turn (a
    fresh model and optimizer each time) and writes ``result.<job><rank>``."""
    spec = json.loads(Path(spec_path).read_text())
    os.sched_setaffinity(0, {spec["core"]})
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    folder = Path(spec["folder"])
    job, rank = spec["job"], spec["rank"]
    me = f"{job}{rank}"
    store = dist.FileStore(str(folder / f"store.{job}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    out = {}
    for policy in spec["policies"]:
        out[policy] = _train(spec, policy, folder, me)
    tmp = folder / f"result.{me}.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(folder / f"result.{me}")
    _file_barrier(folder, f"end.{job}", 2, me)  # the peer has its last all-reduce's data
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown (see ngra.distributed.launch.wait_for_peers)


def _train(spec: dict, policy: str, folder: Path, me: str) -> dict:
    import torch
    import torch.distributed as dist

    job, cfg = spec["job"], spec["cfg"]
    model = build(cfg, spec["seed"])
    params = list(model.parameters())
    batches = data(cfg, spec["seed"], spec["rank"])
    opt = torch.optim.SGD(params, lr=cfg["lr"])
    sizes = [p.numel() for p in params]
    buf = torch.zeros(sum(sizes) + 1)

    def unflatten():
        off = 0
        for p, k in zip(params, sizes):
            p.grad.copy_(buf[off:off + k].view_as(p))
            off += k

    tok_in = tok_out = None
    if policy == "crossover":
        other = JOBS[(JOBS.index(job) + 1) % len(JOBS)]
        tok_in = os.open(folder / f"token.{spec['core']}.{job}", os.O_RDWR)
        tok_out = os.open(folder / f"token.{spec['core']}.{other}", os.O_RDWR)
        if job == JOBS[0]:
            os.write(tok_in, b"t")  # job A computes first on every core

    # All four here (the previous policy is over everywhere, no import steals the timed part).
    _file_barrier(folder, f"{policy}.start", 4, me)
    if policy == "back_to_back" and job != JOBS[0]:
        _wait_for(folder, f"{policy}.done.{JOBS[0]}.*", 2)  # job A's two workers are done

    losses, records, pending, go = [], [], False, None
    for i in range(spec["warmup"] + spec["iterations"]):
        if i == spec["warmup"]:
            n = 2 if policy == "back_to_back" else 4
            go = _file_barrier(folder, f"{policy}.go.{job if n == 2 else 'all'}", n, me)
        t0 = time.monotonic()
        if tok_in is not None:
            os.read(tok_in, 1)
        t1 = time.monotonic()
        # -- compute: the previous step, forward, backward, flatten --
        if pending:
            unflatten()
            opt.step()
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)], out=buf)
        t2 = time.monotonic()
        if tok_out is not None:
            os.write(tok_out, b"t")
        # -- communicate --
        dist.all_reduce(buf)
        buf.div_(2)
        pending = True
        t3 = time.monotonic()
        losses.append(float(buf[-1]))
        if i >= spec["warmup"]:
            records.append((t0, t1, t2, t3))
    unflatten()
    opt.step()
    if tok_in is not None:
        os.close(tok_in)
        os.close(tok_out)
    if policy == "back_to_back" and job == JOBS[0]:
        _file_barrier(folder, f"{policy}.done.{job}", 2, me)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
    return {"job": job, "rank": spec["rank"], "go": go, "records": records, "losses": losses,
            "params_sha256": digest}


# --------------------------------------------------------------------------------------------
# The parent.

def run_all(link: Link, policies, cfg: dict, args) -> dict:
    """Start the four workers (each runs every policy in turn); ``{policy: {worker: result}}``."""
    folder = Path(tempfile.mkdtemp(prefix="ngx-crossover-"))
    procs = []
    try:
        for core in (0, 1):
            for job in JOBS:
                os.mkfifo(folder / f"token.{core}.{job}")
        for seed, job in enumerate(JOBS):
            for rank in (0, 1):
                spec = {"job": job, "rank": rank, "core": rank, "folder": str(folder),
                        "policies": list(policies), "cfg": cfg, "seed": seed,
                        "warmup": args.warmup, "iterations": args.iterations,
                        "timeout": args.timeout}
                path = folder / f"spec.{job}{rank}.json"
                path.write_text(json.dumps(spec))
                env = dict(os.environ, GLOO_SOCKET_IFNAME=link.dev[rank], OMP_NUM_THREADS="1",
                           PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                log = open(folder / f"log.{job}{rank}", "w")
                procs.append((f"{job}{rank}", log, subprocess.Popen(
                    ["ip", "netns", "exec", link.ns[rank], sys.executable, str(Path(__file__)),
                     "--worker", str(path)], env=env, stdout=log, stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + args.timeout
        for name, log, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        hung = [name for name, _, p in procs if p.poll() is None]
        for _, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()
        bad = [(name, p.returncode) for name, _, p in procs if p.returncode != 0]
        if hung or bad:
            tails = "\n".join(f"--- worker {n}:\n" + (folder / f"log.{n}").read_text()[-1500:]
                              for n, _, _ in procs)
            raise RuntimeError(f"workers {hung} did not finish within {args.timeout:g} s and "
                               f"{bad} exited with an error; expected all four to exit 0\n"
                               f"{tails}")
        per_worker = {name: json.loads((folder / f"result.{name}").read_text())
                      for name, _, _ in procs}
        return {p: {w: r[p] for w, r in per_worker.items()} for p in policies}
    finally:
        for _, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def summarize(policy: str, res: dict, n: int) -> dict:
    """Wall time, throughput, per-job iteration time, medians of compute / all-reduce."""
    spans = {}
    for job in JOBS:
        ws = [res[f"{job}{r}"] for r in (0, 1)]
        go = ws[0]["go"]
        spans[job] = (go, max(w["records"][-1][3] for w in ws))
    if policy == "back_to_back":
        wall = sum(e - s for s, e in spans.values())
    else:
        wall = max(e for _, e in spans.values()) - min(s for s, _ in spans.values())
    comp = {job: statistics.median(r[2] - r[1] for k in (0, 1) for r in res[f"{job}{k}"]["records"])
            for job in JOBS}
    comm = {job: statistics.median(r[3] - r[2] for k in (0, 1) for r in res[f"{job}{k}"]["records"])
            for job in JOBS}
    return {"policy": policy, "wall": wall, "throughput": 2 * n / wall,
            "iteration": {j: (e - s) / n for j, (s, e) in spans.items()},
            "compute": comp, "comm": comm}


def overlaps(res: dict, core: int) -> float:
    """Seconds during which both jobs' workers on ``core`` were in their compute phase."""
    a = [(r[1], r[2]) for r in res[f"A{core}"]["records"]]
    b = [(r[1], r[2]) for r in res[f"B{core}"]["records"]]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def calibrate(cfg: dict, reps: int = 5) -> tuple[float, int]:
    """(median seconds of one compute phase on one thread, gradient bytes)."""
    import torch

    torch.set_num_threads(1)
    model = build(cfg, 0)
    (x, y), = data(cfg, 0, 0)[:1]
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        times.append(time.perf_counter() - t)
    nbytes = 4 * (sum(p.numel() for p in model.parameters()) + 1)
    return statistics.median(times[1:]), nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true",
                    help="only test whether namespaces can be made (exit 0, or 77 and why)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few iterations")
    ap.add_argument("--iterations", type=int, default=None, help="timed iterations per job")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per job")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None, help="link rate, Mbit/s (default: auto)")
    ap.add_argument("--comm-ratio", type=float, default=1.0,
                    help="auto rate: all-reduce time / compute time to aim for")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for all policies")
    ap.add_argument("--plot", help="folder for crossover_timelines.png")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        ap.error(f"--policies: expected a subset of {','.join(POLICIES)} (got unknown {unknown})")
    if policies[0] != "back_to_back":
        policies = ["back_to_back"] + [p for p in policies if p != "back_to_back"]
    why = netns_unavailable()
    if why is not None:
        print(f"skipped: {why}")
        return 77 if args.check else 0
    if args.check:
        print("network namespaces, veth and tbf work here")
        return 0
    args.iterations = args.iterations or (6 if args.quick else 30)
    cfg = {"features": 128 if args.quick else 256,
           "width": args.width or (256 if args.quick else 384), "depth": args.depth,
           "batch": args.batch or (512 if args.quick else 1024), "lr": 0.05}

    from ngra.schedule.crossover import Job, cluster_sweep, format_sweep, simulate_crossover

    c0, nbytes = calibrate(cfg)
    # gloo's ring all-reduce over 2 ranks sends each rank's whole buffer once (2 (K-1)/K = 1).
    rate = args.rate or nbytes * 8 / (args.comm_ratio * c0) / 1e6
    print(f"model: MLP {cfg['features']}-{cfg['width']}x{cfg['depth']}-{cfg['features']}, batch "
          f"{cfg['batch']}, gradient {nbytes / 1e6:.3g} MB; compute ~{c0 * 1e3:.3g} ms (1 thread, "
          f"this process); link rate {rate:.4g} Mbit/s each way (tbf)")
    rows = {}
    with Link(rate) as link:
        results = run_all(link, policies, cfg, args)
    for policy in policies:
        rows[policy] = summarize(policy, results[policy], args.iterations)
    # Same loss curves and parameters, whatever the policy.
    ref = results["back_to_back"]
    mismatch = [f"{p} job {w}: losses {r[w]['losses'][:3]}... params {r[w]['params_sha256'][:12]}"
                f" (expected {ref[w]['losses'][:3]}... {ref[w]['params_sha256'][:12]})"
                for p, r in results.items() for w in r
                if r[w]["losses"] != ref[w]["losses"]
                or r[w]["params_sha256"] != ref[w]["params_sha256"]]
    b2b = rows["back_to_back"]
    jobs = [Job(j, b2b["compute"][j], b2b["comm"][j], iterations=args.iterations) for j in JOBS]
    sims = {p: simulate_crossover(jobs, p) for p in policies}
    comp = ", ".join(f"{j} {b2b['compute'][j] * 1e3:.1f} ms" for j in JOBS)
    comm = ", ".join(f"{j} {b2b['comm'][j] * 1e3:.1f} ms" for j in JOBS)
    print(f"measured alone (back to back), median per iteration: compute {comp}; all-reduce "
          f"{comm}")
    print(f"{'policy':<13}{'wall s':>8}{'it/s':>8}{'A it ms':>9}{'B it ms':>9}"
          f"{'sim it/s':>10}{'meas/sim':>9}{'overlap s':>10}")
    for p in policies:
        r, s = rows[p], sims[p]
        ov = overlaps(results[p], 0) + overlaps(results[p], 1)
        print(f"{p:<13}{r['wall']:>8.3f}{r['throughput']:>8.2f}{r['iteration']['A'] * 1e3:>9.1f}"
              f"{r['iteration']['B'] * 1e3:>9.1f}{s.throughput:>10.2f}"
              f"{r['throughput'] / s.throughput:>9.2f}{ov:>10.3f}")
        r["overlap"] = ov
        r["sim_throughput"] = s.throughput
    if "crossover" in rows:
        x = rows["crossover"]["throughput"]
        for p in ("back_to_back", "naive"):
            if p in rows:
                print(f"crossover vs {p}: {x / rows[p]['throughput']:.3f}x measured, "
                      f"{sims['crossover'].throughput / sims[p].throughput:.3f}x simulated")
    print(f"losses and final parameters bit-identical across {', '.join(policies)}: "
          f"{'yes' if not mismatch else 'NO'} ({args.iterations + args.warmup} iterations x "
          f"2 jobs)")
    for m in mismatch:
        print("  mismatch:", m)

    print("\nsimulated, 2 jobs of a 124M-parameter model (fp16 gradients, 248 MB), ring "
          "all-reduce, 10 us per step; compute 0.4 s per iteration at 8 devices:")
    for gbit in (10, 100):
        for strong in (False, True):
            print(f"-- {gbit} Gbit/s per device, {'strong' if strong else 'weak'} scaling")
            print(format_sweep(cluster_sweep(compute=0.4, grad_bytes=248e6,
                                             bandwidth=gbit * 1e9 / 8, latency=1e-5,
                                             strong_scaling=strong, iterations=20)))
    if args.plot:
        from ngra.schedule.crossover import plot_crossover

        Path(args.plot).mkdir(parents=True, exist_ok=True)
        measured = {}
        for p in policies:
            res, bars = results[p], []
            t0 = min(w["go"] for w in res.values())
            for w, v in res.items():
                ji = JOBS.index(v["job"])
                for r in v["records"]:
                    bars.append((f"core {v['rank']} compute", ji, r[1] - t0, r[2] - t0))
                    bars.append((f"{v['job']} all-reduce", ji, r[2] - t0, r[3] - t0))
            measured[f"measured {p}: {rows[p]['throughput']:.2f} it/s"] = bars
        out = Path(args.plot) / "crossover_timelines.png"
        plot_crossover({f"simulated {p}": s for p, s in sims.items()}, out, measured=measured,
                       title="two data-parallel jobs, 2 cores, tbf-limited veth")
        print(f"wrote {out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cfg": cfg, "rate_mbit": rate, "rows": rows,
                                               "identical": not mismatch}, indent=1))
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
