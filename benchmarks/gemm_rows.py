"""A Linear's product ``x W`` over many rows: ``kernels._gemm``'s register tiles against torch.

For ``x`` [N, in] and ``W`` [in, out], times ``kernels._gemm.mm`` and ``torch.mm(out=)`` (MKL)
into the same preallocated output, the two taking turns for ``--rounds`` rounds in one process,
and prints each one's median, their ratio (tiles / torch: below 1, the tiles are faster), the
largest difference between the two results relative to the largest entry (the script exits with
an error above 1e-4), and whether
``kernels._gemm.applies`` (the rule ``kernels._dense`` follows) takes the shape. The same for
``mm_relu_grad`` (a Linear's input gradient through a ReLU and dropout: the product, then the
mask and scale) against the torch ops it replaces (``mm``, ``mul_`` and ``threshold_backward``
in blocks of 8192 rows, as ``kernels._dense._ReluDropoutLinear`` does without it).

    .venv/bin/python benchmarks/gemm_rows.py            # N = 1M and Coauthor CS's shapes
    .venv/bin/python benchmarks/gemm_rows.py --quick    # N = 64K, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the kernels package: this folder leaves sys.path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE.parent)]

import torch  # noqa: E402

from kernels import _gemm  # noqa: E402

SHAPES = [  # (in, out): the e2e models' Linears and input gradients at their widths
    (128, 64), (128, 128), (128, 16), (64, 64), (64, 16), (64, 32), (16, 64), (32, 64), (64, 8)]
RELU_SHAPES = [(16, 64), (32, 64), (64, 64)]  # (out, in): z's gradient of Linears in -> out
BLOCK = 8192


def _relu_grad_torch(g, w, act, scale, out):
    n = act.shape[0]
    buf = torch.empty(min(BLOCK, n), act.shape[1])
    for r0 in range(0, n, BLOCK):
        r1 = min(n, r0 + BLOCK)
        ga = torch.mm(g[r0:r1], w, out=buf[:r1 - r0]).mul_(scale)
        torch.ops.aten.threshold_backward.grad_input(ga, act[r0:r1], 0, grad_input=out[r0:r1])
    return out


def _race(fa, fb, rounds):
    fa(), fb()  # compile, first touch
    ta, tb = [], []
    for _ in range(rounds):
        for f, ts in ((fa, ta), (fb, tb)):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def _row(label, rows, k, j, ta, tb, got, want, takes):
    rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    print(f"{label:<9} {rows:>8} {k:>5} {j:>4} {ta * 1e3:>9.1f} {tb * 1e3:>9.1f} {ta / tb:>6.2f} "
          f"{rel:>9.1e} {'yes' if takes else 'no':>6}", flush=True)
    if not rel <= 1e-4:
        raise SystemExit(f"{label} [{rows}, {k}] -> {j}: the tiles' result differs from torch's by "
                         f"{rel:.2g} of its largest entry")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1 << 20, help="N, the input's rows (default 1M)")
    ap.add_argument("--quick", action="store_true", help="N = 64K, 3 rounds")
    ap.add_argument("--rounds", type=int, default=9, help="rounds taking turns (median taken)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.rounds < 1:
        ap.error(f"--rows and --rounds must be >= 1 (got {args.rows}, {args.rounds})")
    n, rounds = (1 << 16, 3) if args.quick else (args.rows, args.rounds)
    shapes = [(n, k, j) for k, j in SHAPES]
    if not args.quick:
        shapes += [(18333, 6805, 64), (18333, 500, 64)]  # Coauthor CS's first layers
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {rounds} "
          f"rounds taking turns; 'taken': kernels._gemm.applies")
    print(f"{'op':<9} {'N':>8} {'in':>5} {'out':>4} {'tiles ms':>9} {'torch ms':>9} {'ratio':>6} "
          f"{'max diff':>9} {'taken':>6}")
    for rows, k, j in shapes:
        x, w = torch.randn(rows, k), torch.randn(k, j)
        o1, o2 = torch.empty(rows, j), torch.empty(rows, j)
        ta, tb = _race(lambda: _gemm.mm(x, w, o1), lambda: torch.mm(x, w, out=o2), rounds)
        _row("mm", rows, k, j, ta, tb, o1, o2, _gemm.applies(x, w))
    for j, k in RELU_SHAPES:  # g [N, j] times w [j, k], masked by act [N, k]
        g, w = torch.randn(n, j), torch.randn(j, k)
        act = torch.relu(torch.randn(n, k))
        o1, o2 = torch.empty(n, k), torch.empty(n, k)
        ta, tb = _race(lambda: _gemm.mm_relu_grad(g, w, act, 2.0, o1),
                       lambda: _relu_grad_torch(g, w, act, 2.0, o2), rounds)
        _row("relu_grad", n, j, k, ta, tb, o1, o2, _gemm.applies(g, w))


if __name__ == "__main__":
    main()
