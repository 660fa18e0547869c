"""Mixture-of-experts: dense vs Switch vs Dense-To-Sparse (DTS) gates, and expert parallelism.

Three parts (``--parts lm,gnn,ep``):

- ``lm``: a small character-level GPT on Tiny Shakespeare (``text/tinyshakespeare.txt`` under
  ``--data-dir``, the fixed train/validation split of ``ngra.datasets.corpus``), trained three
  times with the same seed, steps, batches and learning rate: a dense FFN per block
  (``FeedForward(d, hidden)``), a Switch MoE (E experts, each that same FFN, top-1, capacity
  1.25) and a DTS MoE (the same experts; Gumbel-softmax routing, temperature annealed 2.0 ->
  0.3 with a cosine schedule over the run, threshold 0.02, top-1 at evaluation). Both MoEs add
  ``--aux-weight`` times the balance loss. Reported: validation perplexity against steps and
  against training wall-clock, the steps / seconds / expert-FFN FLOPs each model needs to reach
  the target perplexity (default: the Switch model's final validation perplexity, as the
  DTS-Gate paper compares), the active experts per token over training, and the expert load
  balance (max load / mean load, 1.0 = even) at the end.
- ``gnn``: the same gates as the ApplyVertex network of ``ngra.nn.MoEConv`` (GraphSAGE-mean,
  then ``z + MoE(z)``) in a 2-layer GNN on Amazon Computers (or ``--gnn-dataset coauthor-cs``:
  6805 features, several times slower),
  against the dense model (``num_experts=1``: ``z + FFN(z)``); test accuracy at the best
  validation accuracy.
- ``ep``: one MoE layer (forward, backward, gradient sync) on a fixed global batch of tokens,
  by one process (plain ``MoE``) and by 2 and 4 gloo worker processes
  (``ngra.distributed.moe.ExpertParallelMoE``, the tokens split evenly); median step time and
  the bytes each worker sends per step (all-to-all rows to other workers, forward and backward).

FLOPs count only the expert FFNs (2 matmuls of d x hidden per routed token, times 3 for forward
plus backward); attention and the rest are the same in all models. Timings are wall-clock on a
shared machine (``torch.set_num_threads(--threads)``): compare them within one run only.

    .venv/bin/python benchmarks/moe.py --plot moe.png          # ~10-15 min on 2 cores
    .venv/bin/python benchmarks/moe.py --quick                 # ~1 min
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["dense", "switch", "dts"]


def _tqdm(iterable, **kw):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return iterable
    return tqdm(iterable, file=sys.stderr, leave=False, **kw)


# -- the language model ----------------------------------------------------------------------
def _ffn(kind, args):
    from ngra.nn import MoE
    from ngra.nn.transformer import FeedForward

    def make(d, layer):
        if kind == "dense":
            return FeedForward(d, args.hidden)
        if kind == "switch":
            return MoE(d, args.experts, hidden=args.hidden, gate="switch", capacity_factor=1.25)
        return MoE(d, args.experts, hidden=args.hidden, gate="dts", temperature=args.tau_start,
                   threshold=args.threshold)
    return make


@torch.no_grad()
def _evaluate(model, batches) -> float:
    model.eval()
    losses = [float(model(x, y)[1]) for x, y in batches]
    model.train()
    return math.exp(statistics.fmean(losses))


def train_lm(kind, corpus, args) -> dict:
    from ngra.nn.moe import aux_loss, dts_temperature, moe_layers, set_temperature
    from ngra.nn.transformer import GPT

    torch.manual_seed(args.seed)
    model = GPT(corpus.vocab_size, args.block, args.d_model, args.layers, args.heads,
                ffn=_ffn(kind, args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    vgen = torch.Generator().manual_seed(args.seed + 1)
    val = [corpus.batch("val", args.batch, args.block, vgen) for _ in range(args.val_batches)]
    moes = moe_layers(model)
    ffn_cost = 3 * 2 * 2 * args.d_model * args.hidden  # fwd+bwd, 2 matmuls, 2 flops/MAC
    tokens = args.batch * args.block
    curve, active_curve, flops, elapsed = [], [], 0.0, 0.0
    load = torch.zeros(args.experts)
    curve.append((0, 0.0, 0.0, _evaluate(model, val)))
    for step in _tqdm(range(1, args.steps + 1), desc=kind):
        if kind == "dts":
            set_temperature(model, dts_temperature(step - 1, args.steps, start=args.tau_start,
                                                   end=args.tau_end))
        x, y = corpus.batch("train", args.batch, args.block, gen)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        if moes:
            loss = loss + args.aux_weight * aux_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        elapsed += time.perf_counter() - t0
        if moes:
            active = statistics.fmean(m.last_stats["active"] for m in moes)
            flops += sum(int(m.last_stats["load"].sum()) for m in moes) * ffn_cost
            if step > args.steps * 0.9:  # balance over the last 10% of training
                load += sum(m.last_stats["load"].float() for m in moes)
        else:
            active = 1.0
            flops += args.layers * tokens * ffn_cost
        if step % args.eval_every == 0 or step == args.steps:
            active_curve.append((step, active))
            curve.append((step, elapsed, flops, _evaluate(model, val)))
    balance = float(load.max() / load.mean()) if moes and load.sum() > 0 else float("nan")
    return {"curve": curve, "active": active_curve, "balance": balance,
            "params": model.num_parameters(), "final": curve[-1][3]}


def _reach(curve, target):
    """First (step, seconds, flops) whose validation perplexity is <= target, else None."""
    for step, secs, flops, ppl in curve:
        if ppl <= target:
            return step, secs, flops
    return None


def run_lm(args) -> dict:
    from ngra.datasets.corpus import load_corpus

    corpus = load_corpus(root=args.data_dir)
    results = {kind: train_lm(kind, corpus, args) for kind in MODELS}
    target = args.target_ppl if args.target_ppl is not None else results["switch"]["final"]
    print(f"\n## GPT on Tiny Shakespeare: d_model={args.d_model}, layers={args.layers}, "
          f"experts={args.experts} x FFN({args.d_model}->{args.hidden}), batch={args.batch}x"
          f"{args.block}, {args.steps} steps, lr={args.lr}")
    print(f"target validation perplexity: {target:.3f}"
          f"{'' if args.target_ppl is not None else ' (the Switch model at the end)'}\n")
    print("| model | params | final val ppl | steps to target | s to target | expert GFLOPs "
          "to target | s/step | active experts/token (start -> end) | load max/mean |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in MODELS:
        r = results[kind]
        hit = _reach(r["curve"], target)
        r["reach"] = hit
        last = r["curve"][-1]
        cells = ("-", "-", "-") if hit is None else (str(hit[0]), f"{hit[1]:.1f}",
                                                     f"{hit[2] / 1e9:.1f}")
        act = r["active"]
        balance = "-" if kind == "dense" else f"{r['balance']:.2f}"
        print(f"| {kind} | {r['params']:,} | {r['final']:.3f} | {cells[0]} | {cells[1]} | "
              f"{cells[2]} | {last[1] / args.steps * 1e3:.0f} ms | {act[0][1]:.2f} -> "
              f"{act[-1][1]:.2f} | {balance} |")
    sw, dts = results["switch"]["reach"], results["dts"]["reach"]
    if sw and dts:
        print(f"\nDTS vs Switch to ppl {target:.3f}: {sw[0] / dts[0]:.2f}x fewer steps, "
              f"{sw[1] / dts[1]:.2f}x less time, {sw[2] / dts[2]:.2f}x fewer expert FLOPs "
              "(> 1: DTS faster; the paper reports 2.0x and 1.42x FLOPs efficiency)")
    elif sw and not dts:
        print(f"\nDTS did not reach ppl {target:.3f} within {args.steps} steps (Switch did at "
              f"step {sw[0]})")
    print("\nvalidation perplexity by step:")
    print("| step | " + " | ".join(MODELS) + " | DTS temperature | DTS active/token |")
    print("| --- | " + " | ".join("---" for _ in MODELS) + " | --- | --- |")
    act = dict(results["dts"]["active"])
    from ngra.nn.moe import dts_temperature
    for i, point in enumerate(results["dense"]["curve"]):
        step = point[0]
        tau = dts_temperature(max(0, step - 1), args.steps, start=args.tau_start, end=args.tau_end)
        row = " | ".join(f"{results[k]['curve'][i][3]:.3f}" for k in MODELS)
        print(f"| {step} | {row} | {tau:.2f} | {act.get(step, float('nan')):.2f} |")
    results["target"] = target
    return results


# -- the GNN ---------------------------------------------------------------------------------
def run_gnn(args) -> dict:
    import ngra
    from ngra.nn import MoEConv, SAGEConv
    from ngra.nn.moe import aux_loss, dts_temperature, set_temperature

    # Row-normalized bag-of-words features (raw counts made training erratic: 0.11-0.66 test).
    data = ngra.datasets.load(args.gnn_dataset, root=args.data_dir, normalize_features=True)
    g, x, y = data.graph, data.x, data.y
    classes = int(y.max()) + 1
    out = {}
    for kind in MODELS:
        torch.manual_seed(args.seed)
        experts = 1 if kind == "dense" else args.experts
        gate = "switch" if kind == "dense" else kind
        conv1 = MoEConv(x.shape[1], args.gnn_hidden, num_experts=experts, gate=gate,
                        hidden=2 * args.gnn_hidden,
                        **({} if kind == "dts" else {"capacity_factor": None}))
        conv2 = SAGEConv(args.gnn_hidden, classes)
        params = list(conv1.parameters()) + list(conv2.parameters())
        opt = torch.optim.Adam(params, lr=0.01, weight_decay=5e-4)

        def forward(train: bool):
            conv1.train(train)
            h = F.dropout(F.relu(conv1(g, x)), 0.5, training=train)
            return conv2(g, h)

        best, t0 = (-1.0, 0.0), time.perf_counter()
        for epoch in _tqdm(range(args.gnn_epochs), desc=f"gnn {kind}"):
            if kind == "dts":
                set_temperature(conv1, dts_temperature(epoch, args.gnn_epochs))
            logits = forward(True)
            loss = F.cross_entropy(logits[data.train_mask], y[data.train_mask])
            if kind != "dense":
                loss = loss + args.aux_weight * aux_loss(conv1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                pred = forward(False).argmax(1)
            acc = [float((pred[m] == y[m]).float().mean()) for m in (data.val_mask,
                                                                      data.test_mask)]
            if acc[0] > best[0]:
                best = tuple(acc)
        out[kind] = {"val": best[0], "test": best[1], "seconds": time.perf_counter() - t0}
    print(f"\n## MoE as ApplyVertex network: 2-layer GNN on {args.gnn_dataset} "
          f"({g.num_nodes} vertices, {g.num_edges} edges), {args.gnn_epochs} epochs, hidden "
          f"{args.gnn_hidden}, {args.experts} experts (dense: 1)\n")
    print("| model | best val acc | test acc at best val | seconds |")
    print("| --- | --- | --- | --- |")
    for kind in MODELS:
        r = out[kind]
        print(f"| {kind} | {r['val']:.4f} | {r['test']:.4f} | {r['seconds']:.1f} |")
    return out


# -- expert parallelism ----------------------------------------------------------------------
def _ep_layer(args):
    from ngra.nn import MoE
    torch.manual_seed(args.seed)
    return MoE(args.ep_d, args.ep_experts, hidden=4 * args.ep_d, gate="switch",
               capacity_factor=1.25)


def _ep_tokens(args):
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randn(args.ep_tokens, args.ep_d, generator=gen)


def _ep_worker(rank, world, args):
    import torch.distributed as dist

    from ngra.distributed.moe import ExpertParallelMoE, sync_replicated_gradients

    ep = ExpertParallelMoE.from_moe(_ep_layer(args))
    x = _ep_tokens(args).chunk(world)[rank].clone().requires_grad_(True)
    times = []
    for _ in range(args.ep_warmup + args.ep_reps):
        dist.barrier()
        t0 = time.perf_counter()
        ep.zero_grad(set_to_none=True)
        y = ep(x)
        (y.square().mean() + 0.01 * ep.aux_loss).backward()
        sync_replicated_gradients(ep)
        times.append(time.perf_counter() - t0)
    step = torch.tensor([statistics.median(times[args.ep_warmup:])])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a step ends when the slowest worker does
    return float(step), 2 * ep.last_comm["bytes_out"]


def _ep_single(args) -> float:
    moe = _ep_layer(args)
    x = _ep_tokens(args).requires_grad_(True)
    times = []
    for _ in range(args.ep_warmup + args.ep_reps):
        t0 = time.perf_counter()
        moe.zero_grad(set_to_none=True)
        (moe(x).square().mean() + 0.01 * moe.aux_loss).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[args.ep_warmup:])


def run_ep(args) -> dict:
    from ngra.distributed.launch import spawn

    rows = [(1, _ep_single(args), 0, 0)]
    for world in args.ep_workers:
        got = spawn(_ep_worker, world, args, timeout=args.ep_timeout)
        step = max(s for s, _ in got)
        per_worker = [b for _, b in got]
        rows.append((world, step, statistics.fmean(per_worker), sum(per_worker)))
    print(f"\n## Expert parallelism: one MoE layer, {args.ep_tokens} tokens x d={args.ep_d}, "
          f"{args.ep_experts} experts (hidden {4 * args.ep_d}), Switch capacity 1.25; step = "
          "forward + backward + gradient sync, median of "
          f"{args.ep_reps}\n")
    print("| workers | step ms | speedup vs 1 | KiB sent per worker per step | KiB all workers |")
    print("| --- | --- | --- | --- | --- |")
    for world, step, mean_b, total_b in rows:
        print(f"| {world} | {step * 1e3:.1f} | {rows[0][1] / step:.2f}x | {mean_b / 1024:.1f} | "
              f"{total_b / 1024:.1f} |")
    return {"rows": rows}


# -- main ------------------------------------------------------------------------------------
def _plot(lm, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for kind in MODELS:
        c = lm[kind]["curve"]
        axes[0].plot([p[0] for p in c], [p[3] for p in c], label=kind)
        axes[1].plot([p[1] for p in c], [p[3] for p in c], label=kind)
        a = lm[kind]["active"]
        axes[2].plot([p[0] for p in a], [p[1] for p in a], label=kind)
    for ax in axes[:2]:
        ax.axhline(lm["target"], color="grey", ls=":", lw=1, label="target")
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("active experts per token")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("GPT on Tiny Shakespeare: dense vs Switch vs DTS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (about a minute)")
    p.add_argument("--parts", default="lm,gnn,ep", help="comma list of lm, gnn, ep")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "datasets"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--val-batches", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=None, help="FFN / expert hidden width")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--tau-start", type=float, default=2.0)
    p.add_argument("--tau-end", type=float, default=0.3)
    p.add_argument("--threshold", type=float, default=0.02)
    p.add_argument("--target-ppl", type=float, default=None,
                   help="default: the Switch model's final validation perplexity")
    p.add_argument("--gnn-dataset", default="amazon-computers",
                   choices=["coauthor-cs", "amazon-computers"])
    p.add_argument("--gnn-epochs", type=int, default=None)
    p.add_argument("--gnn-hidden", type=int, default=64)
    p.add_argument("--ep-workers", default="2,4")
    p.add_argument("--ep-tokens", type=int, default=None)
    p.add_argument("--ep-d", type=int, default=None)
    p.add_argument("--ep-experts", type=int, default=8)
    p.add_argument("--ep-reps", type=int, default=None)
    p.add_argument("--ep-timeout", type=float, default=180.0)
    p.add_argument("--plot", default=None, metavar="PNG")
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in parts if s not in ("lm", "gnn", "ep")]
    if unknown:
        p.error(f"--parts: unknown {unknown}; expected a comma list of lm, gnn, ep")
    quick = args.quick
    defaults = dict(steps=(60, 1200), eval_every=(20, 100), val_batches=(4, 16),
                    batch=(8, 32), block=(32, 64), d_model=(32, 64), layers=(1, 2),
                    hidden=(64, 128), experts=(4, 4), gnn_epochs=(8, 150),
                    ep_tokens=(512, 4096), ep_d=(32, 128), ep_reps=(3, 10))
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    args.ep_warmup = 1 if quick else 3
    args.ep_workers = [int(w) for w in args.ep_workers.split(",") if w.strip()]
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = run_lm(args) if "lm" in parts else None
    if "gnn" in parts:
        run_gnn(args)
    if "ep" in parts:
        run_ep(args)
    if args.plot and lm is not None:
        _plot(lm, args.plot)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
