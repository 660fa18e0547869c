"""Training epochs with ngra's fused vertex work on and off, alternating in one process.

    .venv/bin/python benchmarks/fusion_ab.py --model gcn            # R-MAT 1M / 16M (e2e.py's graph)
    .venv/bin/python benchmarks/fusion_ab.py --model sage --scale 16 --edges 1000000
    .venv/bin/python benchmarks/fusion_ab.py --model gcn --fusion weight-grad
    .venv/bin/python benchmarks/fusion_ab.py --model gcn --fusion relu-linear
    .venv/bin/python benchmarks/fusion_ab.py --model gcn --fusion dropout-mask

``--fusion layers`` (the default) switches two fusions together: GCNConv's one-kernel path
(``kernels.gspmm_norm``: the self loop, both normalizations and the bias in the g-SpMM's pass,
and its own gradient) and ``ngra.nn.GNN``'s ReLU + dropout between layers
(``kernels._dropout.relu_dropout``). "off" runs the compiled vertex program and
``dropout(relu(x))``: the same values and gradients. ``--fusion weight-grad`` switches the
weight gradient of the Linear reading the input dropout between one kernel
(``kernels._dropout.weight_grads``, "on") and the dropout made again in chunks for torch's GEMMs
("off"): the same sums, grouped otherwise. ``--fusion relu-linear`` switches the next layer's
Linear taking the ReLU + dropout's backward into its own (``kernels._dense._ReluDropoutLinear``:
``g W`` and the mask a block of rows at a time, "on") against the Linear's backward then
relu_dropout's ("off"), and GIN's sum taking it into its transposed pass: the same values (GCN's
and GraphSAGE's layer-2 Linears, GIN's layer-2 sum; GAT's ELU is not offered).
``--fusion dropout-mask`` switches the weight-gradient kernel's dropout between made again from
the keep flags the input dropout's forward wrote (``kernels._dropout.mask_of``, "on") and made
again by hashing each element ("off"): the same bits. ``--fusion prescale`` switches
``kernels.gspmm_norm``'s source scale between a pass of its own over narrow rows
(``kernels._numba_cpu.PRESCALE_MAX_ROW_BYTES``, "on") and the kernel's own per-edge scale
("off", every width): the same bits (GCN's layer 2 and its gradient, 16 wide, and GraphSAGE's
mean gradient where 32 wide or less).

A whole-epoch comparison across processes on a shared machine swings by 20-40%; here the two
settings take turns epoch by epoch (off/on, then on/off) in one process, on one graph, model
and optimizer, after a warm-up epoch of each, and the medians of wall, user and system time per
epoch are compared. System time is mostly the kernel zeroing fresh pages for new tensors, which
the fusions allocate fewer of. Model: ``ngra.nn.build_model`` with e2e.py's widths (hidden 64,
16 classes, 128 features), training mode, cross-entropy over every vertex and one Adam step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE.parent)]

import ngra  # noqa: E402  (before torch: sets the OpenMP wait policy)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernels import _dropout, _numba_cpu  # noqa: E402
from ngra.nn import GCNConv, build_model, models  # noqa: E402


def _plain_act_dropout(x, activation, p, training, g=None, fusable=False):
    return models._dropout(models._ACTIVATIONS[activation](x), p, training, g)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gcn", choices=["gcn", "sage", "gin"])
    ap.add_argument("--scale", type=int, default=20, help="R-MAT vertices = 2**scale")
    ap.add_argument("--edges", type=int, default=16 << 20)
    ap.add_argument("--rounds", type=int, default=8, help="timed (off, on) pairs")
    ap.add_argument("--fusion", default="layers",
                    choices=["layers", "weight-grad", "relu-linear", "dropout-mask", "prescale"],
                    help="what is switched (see the module docstring)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    g = ngra.datasets.rmat(num_nodes=1 << args.scale, num_edges=args.edges, seed=0).remove_self_loops()
    n = g.num_nodes
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 128, generator=gen)
    y = torch.randint(0, 16, (n,), generator=gen)
    torch.manual_seed(0)
    model = build_model(args.model, 128, 64, 16)
    model.train()
    g.in_csr()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    fused_gcn, fused_act = GCNConv._fusable, models._act_dropout
    wg_width = _dropout.WG_MAX_WIDTH
    relu_dropout_of = _dropout.relu_dropout_of
    mask_of = _dropout.mask_of
    prescale_bytes = _numba_cpu.PRESCALE_MAX_ROW_BYTES

    def setting(on: bool):
        if args.fusion == "weight-grad":
            _dropout.WG_MAX_WIDTH = wg_width if on else 0
            return
        if args.fusion == "relu-linear":
            _dropout.relu_dropout_of = relu_dropout_of if on else (lambda t: None)
            return
        if args.fusion == "dropout-mask":
            _dropout.mask_of = mask_of if on else (lambda t: None)
            return
        if args.fusion == "prescale":
            _numba_cpu.PRESCALE_MAX_ROW_BYTES = prescale_bytes if on else -1
            return
        GCNConv._fusable = fused_gcn if on else (lambda *a: False)
        models._act_dropout = fused_act if on else _plain_act_dropout

    def epoch():
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(g, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return t1 - t0, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime

    print(f"R-MAT N={n:,} E={g.num_edges:,}, {args.model}, fusion {args.fusion}, {args.rounds} rounds")
    res = {False: [], True: []}
    try:
        for on in (False, True):  # warm-up: JIT, caches
            setting(on)
            epoch()
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                setting(on)
                res[on].append(epoch())
    finally:
        setting(True)
    med = {on: [statistics.median(e[i] for e in res[on]) for i in range(3)] for on in res}
    for on in (False, True):
        w, u, s = med[on]
        print(f"fusions {'on ' if on else 'off'}: median epoch {w:.3f} s (user {u:.2f} s, system "
              f"{s:.2f} s); epochs {' '.join(f'{e[0]:.2f}' for e in res[on])}")
    print(f"on/off: wall {med[True][0] / med[False][0]:.2f}, user {med[True][1] / med[False][1]:.2f}")


if __name__ == "__main__":
    main()
