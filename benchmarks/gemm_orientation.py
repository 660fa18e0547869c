"""Which way to compute a Linear's weight gradient over a long input: ``g^T x`` or ``(x^T g)^T``.

For ``x`` [N, in] and the output gradient ``g`` [N, out], the weight gradient [out, in] is
``g^T x`` (torch's own ``F.linear`` backward) or, the same sums in another order, ``(x^T g)^T``
(plus a copy of the small [in, out] result). With N much larger than ``in`` and ``out``, the
GEMM ``a^T b`` is fast when ``b`` has enough columns and several times slower when ``b`` is
narrow and ``a`` wide. ``kernels/_dense.py`` (``_weight_grad``) takes ``(x^T g)^T`` where
``out >= min(in, 16)`` and ``g^T x`` otherwise; this script times both for each shape, side by
side in one process (best of ``--reps``), and prints which one the rule picks and the ratio of
the picked one to the faster one (1.00: the rule picked the faster).

    .venv/bin/python benchmarks/gemm_orientation.py            # N = 1M and Coauthor CS's shapes
    .venv/bin/python benchmarks/gemm_orientation.py --quick    # N = 64K
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the kernels package: this folder leaves sys.path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE.parent)]

import torch  # noqa: E402

from kernels._dense import _weight_grad  # noqa: E402

SHAPES = [  # (in, out): GCN / GraphSAGE / GIN / GAT layers at the benchmarks' widths
    (128, 64), (64, 64), (64, 16), (64, 4), (64, 1), (16, 1), (16, 4), (64, 8), (64, 12),
    (128, 8), (4, 64), (8, 64), (16, 16), (8, 8)]


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1 << 20, help="N, the input's rows (default 1M)")
    ap.add_argument("--quick", action="store_true", help="N = 64K")
    ap.add_argument("--reps", type=int, default=5, help="calls per orientation (best taken)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.reps < 1:
        ap.error(f"--rows and --reps must be >= 1 (got {args.rows}, {args.reps})")
    n = 1 << 16 if args.quick else args.rows
    shapes = [(n, i, o) for i, o in SHAPES]
    if not args.quick:
        shapes += [(18333, 6805, 64), (18333, 64, 15)]  # Coauthor CS's GCN layers
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.reps}")
    print(f"{'N':>8} {'in':>5} {'out':>4} {'g^T x ms':>9} {'(x^T g)^T ms':>13} {'picked':>10} "
          f"{'picked/best':>11}")
    for rows, i, o in shapes:
        x, g = torch.randn(rows, i), torch.randn(rows, o)
        a = best(lambda: g.t().mm(x), args.reps)
        b = best(lambda: x.t().mm(g).t().contiguous(), args.reps)
        picked_t = o >= min(i, 16)  # _weight_grad's rule
        want, got_w = g.t().mm(x), _weight_grad(x, g)
        err = float((got_w - want).abs().max() / want.abs().max())
        if err > 1e-4:
            raise SystemExit(f"_weight_grad differs from g^T x by {err:.2g} of its largest entry")
        got = b if picked_t else a
        print(f"{rows:>8} {i:>5} {o:>4} {a * 1e3:>9.1f} {b * 1e3:>13.1f} "
              f"{'(x^T g)^T' if picked_t else 'g^T x':>10} {got / min(a, b):>11.2f}")


if __name__ == "__main__":
    main()
