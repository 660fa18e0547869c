"""Host time per call of ngra's numba_cuda kernels on a small graph, where launching, not GPU work,
sets the time: numba-cuda's own launch path against ngra's direct launch (kernels/_numba_cuda.py,
``direct_launch``), with torch's index_add_ / scatter as the floor, the variants taking turns in
one process.

Each case runs ``--calls`` times back to back after a warm-up (which also compiles and plans the
kernels), then waits for the GPU; time per call = wall time / calls, best of ``--rounds``. On a
graph this small the GPU finishes each kernel long before the host has launched the next, so the
figure is host time. Writes ``cuda_launch.csv`` to ``--out``.

    python benchmarks/cuda_launch.py                      # on a GPU machine
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/cuda_launch.py --tiny   # smoke run in the simulator
        # (CPU tensors; there is no direct launch there, and its numbers mean nothing)
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import kernels  # noqa: E402
from kernels import CSR, _numba_cuda  # noqa: E402

VARIANTS = ("numba launch", "direct launch")


def cases(csr, n, feats, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, feats, generator=gen).to(device)
    s = torch.randn(csr.num_edges, 1, generator=gen).to(device)
    src, dst = (t.long() for t in csr.coo())
    g = torch.randn(n, feats, generator=gen).to(device)
    xg = x.detach().requires_grad_()
    sg = s.detach().requires_grad_()

    def spmm_fwd_bwd():
        out = kernels.gspmm(csr, "copy_u", "sum", u=xg)
        torch.autograd.grad(out, xg, g)

    def softmax_fwd_bwd():
        out = kernels.edge_softmax(csr, sg)
        torch.autograd.grad(out, sg, torch.ones_like(out))

    def torch_fwd_bwd():
        out = torch.zeros_like(x).index_add_(0, dst, xg.index_select(0, src))
        torch.autograd.grad(out, xg, g)

    ngra = {
        "gspmm copy_u/sum fwd": lambda: kernels.gspmm(csr, "copy_u", "sum", u=x),
        "gspmm copy_u/sum fwd+bwd": spmm_fwd_bwd,
        "gsddmm u_dot_v fwd": lambda: kernels.gsddmm(csr, "u_dot_v", u=x, v=x),
        "edge_softmax fwd+bwd": softmax_fwd_bwd,
    }
    floor = {
        "gspmm copy_u/sum fwd": lambda: torch.zeros_like(x).index_add_(0, dst, x[src]),
        "gspmm copy_u/sum fwd+bwd": torch_fwd_bwd,
        "gsddmm u_dot_v fwd": lambda: (x[src] * x[dst]).sum(-1, keepdim=True),
        "edge_softmax fwd+bwd": lambda: kernels.edge_softmax(csr, s, backend="torch"),
    }
    return ngra, floor


def per_call_us(fn, calls, sync):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vertices", type=int, default=2000)
    ap.add_argument("--edges", type=int, default=20000)
    ap.add_argument("--feats", type=int, default=16)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true",
                    help="30 vertices, 90 edges, F = 4, 2 calls, 1 round")
    ap.add_argument("--out", default=str(REPO / "results" / "cuda_launch"))
    args = ap.parse_args()
    if args.tiny:
        args.vertices, args.edges, args.feats, args.calls, args.rounds = 30, 90, 4, 2, 1
    sim = _numba_cuda.simulated()
    if not sim and not torch.cuda.is_available():
        sys.exit("cuda_launch: torch sees no GPU; run on a GPU machine, or with "
                 "NUMBA_ENABLE_CUDASIM=1 and --tiny for a smoke run")
    device = torch.device("cpu" if sim else "cuda")
    sync = (lambda: None) if sim else torch.cuda.synchronize
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(args.vertices, (args.edges,), generator=gen)
    dst = torch.randint(args.vertices, (args.edges,), generator=gen)
    csr = CSR.from_coo(src, dst, args.vertices).to(device)
    ngra, floor = cases(csr, args.vertices, args.feats, device)
    where = "CUDA SIMULATOR (numbers mean nothing)" if sim else torch.cuda.get_device_name()
    print(f"{where}; graph {args.vertices} vertices / {args.edges} edges, F = {args.feats}, "
          f"{args.calls} calls, best of {args.rounds} rounds; host us per call")
    best = {}
    with kernels.use_backend("numba_cuda"):
        for _ in range(args.rounds):
            for name in ngra:
                for variant in VARIANTS:
                    _numba_cuda.direct_launch = variant == "direct launch"
                    t = per_call_us(ngra[name], args.calls, sync)
                    best[name, variant] = min(t, best.get((name, variant), t))
                t = per_call_us(floor[name], args.calls, sync)
                best[name, "torch"] = min(t, best.get((name, "torch"), t))
    _numba_cuda.direct_launch = True
    direct_used = any(p is not None for p in _numba_cuda._PLANS.values())
    rows = []
    print(f"{'case':28s} {'numba launch':>13s} {'direct':>9s} {'torch':>9s} {'numba/direct':>13s}"
          f" {'direct/torch':>13s}")
    for name in ngra:
        a, b, c = best[name, VARIANTS[0]], best[name, VARIANTS[1]], best[name, "torch"]
        rows.append({"case": name, "numba_launch_us": f"{a:.1f}", "direct_launch_us": f"{b:.1f}",
                     "torch_us": f"{c:.1f}", "numba_over_direct": f"{a / b:.2f}",
                     "direct_over_torch": f"{b / c:.2f}"})
        print(f"{name:28s} {a:13.1f} {b:9.1f} {c:9.1f} {a / b:13.2f} {b / c:13.2f}")
    if not direct_used:
        print("no direct launch happened (simulator, or a numba-cuda without cuda.core): both "
              "columns are numba's own launch path")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cuda_launch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
