"""What fresh memory costs a CPU kernel call: with every output in fresh pages, with ngra's
cache of freed kernel outputs (the default), and with glibc keeping freed memory.

glibc serves every allocation above its mmap threshold (at most 32 MiB) from new pages and
returns them to the OS on free, so each large tensor's first write page-faults on every page.
Three settings, in child processes taking turns:

- ``fresh``: ``NGRA_KERNEL_OUTPUT_CACHE=0``, every kernel output in new pages;
- ``ngra output cache``: the default, freed kernel outputs kept for reuse (kernels/_outcache.py;
  torch's own tensors still get fresh pages);
- ``glibc keeps freed``: ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<large>`` and the ngra cache
  off: every freed allocation stays in the process (resident memory stays at its peak).

Each child times:

- ``touch fresh``: ``torch.empty`` of an F-wide [N, F] float32 tensor, then ``fill_``;
- ``touch reused``: ``fill_`` of one such tensor allocated before the rounds;
- ``gspmm``: ngra's copy_u/sum (numba) on a uniform random graph, whose output is such a tensor,
  with the minor page faults per call (getrusage).

Medians and best of ``--reps`` calls per child, ``--runs`` children per setting; only the
ratios between settings in this one run mean anything on a shared machine. The children inherit
the page size: ``import ngra`` puts torch's large tensors and the cache's blocks on transparent
huge pages (``THP_MEM_ALLOC_ENABLE=1``, one fault per 2 MiB); run with
``THP_MEM_ALLOC_ENABLE=0`` for 4 KiB pages.

    .venv/bin/python benchmarks/fresh_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the kernels package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent] + [
    str(Path(__file__).resolve().parent.parent)]  # the repo, for a checkout without an install

KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}
CACHE_ENV = "NGRA_KERNEL_OUTPUT_CACHE"


def child(n, e, f, reps):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import kernels  # before torch (OpenMP passive waiting)
    import torch

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, n, (e,), generator=gen, dtype=torch.int32)
    dst = torch.randint(0, n, (e,), generator=gen, dtype=torch.int32)
    csr = kernels.CSR.from_coo(src, dst, n)
    x = torch.randn(n, f, generator=gen)
    kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")  # compile / load, warm up
    reused = torch.empty(n, f)
    reused.fill_(0)
    out = {"touch fresh": [], "touch reused": [], "gspmm": [], "faults": []}
    for _ in range(reps):
        t = time.perf_counter()
        y = torch.empty(n, f)
        y.fill_(1)
        out["touch fresh"].append(time.perf_counter() - t)
        del y
        t = time.perf_counter()
        reused.fill_(1)
        out["touch reused"].append(time.perf_counter() - t)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        y = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
        out["gspmm"].append(time.perf_counter() - t)
        out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        del y
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200_000)
    p.add_argument("--edges", type=int, default=3_000_000)
    p.add_argument("--feats", type=int, default=64)
    p.add_argument("--reps", type=int, default=9, help="calls per child process")
    p.add_argument("--runs", type=int, default=2, help="child processes per setting")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    for name, v in (("--nodes", a.nodes), ("--edges", a.edges), ("--feats", a.feats),
                    ("--reps", a.reps), ("--runs", a.runs)):
        if v < 1:
            p.error(f"{name} must be >= 1 (got {v})")
    if a.child:
        return child(a.nodes, a.edges, a.feats, a.reps)
    base = {k: v for k, v in os.environ.items() if k not in KEEP and k != CACHE_ENV}
    settings = {"fresh": {**base, CACHE_ENV: "0"}, "ngra output cache": base,
                "glibc keeps freed": {**base, **KEEP, CACHE_ENV: "0"}}
    results = {s: [] for s in settings}
    cmd = [sys.executable, __file__, "--child", "--nodes", str(a.nodes), "--edges", str(a.edges),
           "--feats", str(a.feats), "--reps", str(a.reps)]
    mib = a.nodes * a.feats * 4 / 2**20
    print(f"uniform graph {a.nodes} vertices / {a.edges} edges, F = {a.feats} (each output "
          f"{mib:.0f} MiB); {a.runs} child processes per setting, {a.reps} calls each; load "
          f"average {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(a.runs):
        for s, env in settings.items():
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"child ({s}) failed:\n{res.stderr}")
            results[s].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"  run {r + 1}, {s}: done", flush=True)
    rows = {}
    print(f"\n{'':18} {'touch fresh':>20} {'touch reused':>20} {'gspmm':>20} {'faults/call':>12} "
          f"{'peak RSS':>9}")
    for s, runs in results.items():
        cols = []
        for k in ("touch fresh", "touch reused", "gspmm"):
            v = [x * 1e3 for run in runs for x in run[k]]
            rows.setdefault(k, {})[s] = statistics.median(v)
            cols.append(f"{statistics.median(v):8.1f} (best {min(v):6.1f})")
        faults = statistics.median(x for run in runs for x in run["faults"])
        rss = max(run["maxrss_mib"] for run in runs)
        print(f"{s:18} {cols[0]:>20} {cols[1]:>20} {cols[2]:>20} {faults:12.0f} {rss:6.0f} MiB")
    for s in list(settings)[1:]:
        print(f"median ms, {s} / fresh: " + ", ".join(
            f"{k} {v[s] / v['fresh']:.2f}" if v["fresh"] > 0 else f"{k} n/a"
            for k, v in rows.items()))


if __name__ == "__main__":
    main()
