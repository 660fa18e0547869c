"""Fused reduce-scatter + sharded Adam + all-gather (``ngra.distributed.FusedAdam``) against DDP +
``torch.optim.Adam``, side by side in one run, on K gloo worker processes on this host.

Both variants train the same GPT (``ngra.nn.transformer.GPT``, random token ids, the same data on
each rank for both) from the same initial weights, step by step in alternation (which one goes
first alternates too), each step after a barrier, so that load from other processes on the
machine hits both alike. Per variant and per step, every worker measures:

- step time: forward + backward + ``opt.step()``; and backward and ``opt.step()`` alone;
- Adam time: for DDP + Adam, ``opt.step()`` (Adam on all N parameters); for fused, the time
  spent in Adam on the rank's parts inside the comm hook (during backward), reported apart;
- optimizer state per rank: bytes of the moments (and master copies) the optimizer holds; and
  for fused, the peak of its transient communication buffers (send, receive and all-gather
  buffers beyond DDP's own buckets, by FusedAdam's own count);
- memory of a whole step per rank, counted independently of FusedAdam: after the timed steps,
  one more step of each variant runs under ``ngra.engine.TensorMemory`` (every tensor a torch op
  creates on the worker's thread, from creation until freed: activations, gradients, buffers,
  Adam's temporaries; not what existed before the step, nor gloo's internal buffers on its own
  threads); its peak plus the optimizer state is what the choice of optimizer changes;
- share of communication overlapped with backward: every collective's interval, from its launch
  in the comm hook to its completion (a future callback for the all-reduce; a waiter thread for
  the reduce-scatter and all-gather), clipped at the moment the last bucket's hook is entered
  (all gradients computed: nothing left to overlap with), summed over collectives.

At the end the two variants' parameters are compared (the largest difference is printed; a
benchmark of a wrong result means nothing). Medians over the timed steps; on a shared 2-core
machine only the ratios within one run mean anything, and K workers share the cores.

    .venv/bin/python benchmarks/fused_comm.py --quick
    .venv/bin/python benchmarks/fused_comm.py --workers 2,4 --d-model 256 --layers 4 --steps 10

``--variants`` picks the variants (ddp+adam first); ``--variants ddp+adam,fused,fused-ar`` also runs
against a FusedAdam from before its ``buffers=`` option (a copy of an older tree: the script
imports ``ngra`` from the tree it sits in, and prints which file FusedAdam came from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("ddp+adam", "fused", "fused-own", "fused-ar")
# fused: the backend's reduce-scatter and all-gather (gloo: native in torch 2.13, reduce-scatter
# emulated by all_to_all in torch 2.2) in DDP's bucket buffers (FusedAdam's default); fused-own:
# the same in buffers of its own (its fallback for gradient_as_bucket_view=True, and the memory
# of FusedAdam before it used DDP's buckets); fused-ar: both collectives done by all-reduces (twice
# the bytes, but gloo's all-reduce is much faster than its reduce-scatter and all-gather).
FUSED_ALL = {"fused": {}, "fused-own": {"buffers": "own"},
             "fused-ar": {"reduce_scatter": "all_reduce", "all_gather": "all_reduce"}}
VOCAB = 65


def _overlap(intervals, end) -> tuple:
    """(seconds of communication before ``end``, total seconds of communication)."""
    total = sum(d - l for l, d in intervals)
    before = sum(max(0.0, min(d, end) - l) for l, d in intervals)
    return before, total


def _worker(rank, world, cfg):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ngra.distributed.fused as fused_module
    from ngra.distributed.fused import FusedAdam
    from ngra.engine import TensorMemory
    from ngra.nn.transformer import GPT

    variants = cfg["variants"]
    fused = {v: FUSED_ALL[v] for v in variants if v in FUSED_ALL}

    if cfg["bucket_cap_mb"] is not None:
        # torch 2.2 sizes the first bucket by this global instead of bucket_cap_mb.
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(cfg["bucket_cap_mb"] * 2 ** 20)
    ddp_kw = {} if cfg["bucket_cap_mb"] is None else {"bucket_cap_mb": cfg["bucket_cap_mb"]}

    def model():
        torch.manual_seed(0)
        return DDP(GPT(VOCAB, cfg["seq"], cfg["d_model"], cfg["layers"], cfg["heads"]), **ddp_kw)

    # DDP + Adam, with the default hook's arithmetic (divide by K, sum all-reduce) written out
    # so that it can note when each all-reduce completes.
    ref_model = model()
    ref_rec = {"hooks": [], "comm": []}

    def timed_allreduce(_state, bucket):
        t = time.perf_counter()
        ref_rec["hooks"].append(t)
        buf = bucket.buffer().div_(world)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            ref_rec["comm"].append((t, time.perf_counter()))
            return f.value()[0]
        return fut.then(done)

    ref_model.register_comm_hook(None, timed_allreduce)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=cfg["lr"])
    runs = {"ddp+adam": (ref_model, ref_opt)}
    for name, kw in fused.items():
        m = model()
        runs[name] = (m, FusedAdam(m, lr=cfg["lr"], profile=True, **kw))
    rows = {v: [] for v in variants}
    peaks = {}
    total = cfg["warmup"] + cfg["steps"]
    bar = None
    if rank == 0 and cfg["progress"]:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc=f"K={world}", unit="step", leave=False)
    for step in range(total + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        idx = torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"] + 1), generator=gen)
        x, y = idx[:, :-1], idx[:, 1:]
        for variant in (variants if step % 2 == 0 else variants[::-1]):
            m, opt = runs[variant]
            ref_rec["hooks"], ref_rec["comm"] = [], []
            dist.barrier()
            if step == total:  # the memory step, untimed
                with TensorMemory() as tm:
                    m(x, y)[1].backward()
                    opt.step()
                    opt.zero_grad()
                peaks[variant] = tm.peak
                continue
            t0 = time.perf_counter()
            _, loss = m(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            if variant in fused:
                st = opt.stats[-1]
                end = max(t for t, _ in st["hooks"])
                comm = st.get("scatters", []) + st["gathers"]
                adam = st["adam_s"]
                extra = {"buffer_bytes": st["peak_buffer_bytes"], "buckets": len(st["hooks"]),
                         "launch": st["launch_s"], "blocked": st["blocked_s"]}
            else:
                end = max(ref_rec["hooks"])
                comm = list(ref_rec["comm"])
                adam = t3 - t2
                extra = {"buffer_bytes": 0, "buckets": len(ref_rec["hooks"]), "launch": 0.0,
                         "blocked": 0.0}
            before, comm_s = _overlap(comm, end)
            rows[variant].append({"step": t3 - t0, "forward": t1 - t0, "backward": t2 - t1,
                                  "opt_step": t3 - t2, "adam": adam, "comm": comm_s,
                                  "overlapped": before, "loss": loss.item(), **extra})
        if bar is not None and step < total:
            bar.update(1)
    if bar is not None:
        bar.close()
    state = {"ddp+adam": sum(t.numel() * t.element_size() for s in ref_opt.state.values()
                             for t in s.values() if torch.is_tensor(t))}
    state.update({v: runs[v][1].state_bytes() for v in fused})
    diff = max((a - b).abs().max().item() for v in fused for a, b in
               zip(ref_model.module.parameters(), runs[v][0].module.parameters()))
    scale = max(a.abs().max().item() for a in ref_model.module.parameters())
    first = runs[next(iter(fused))][1]
    out = {"rows": {v: r[cfg["warmup"]:] for v, r in rows.items()}, "state": state,
           "step_peak": peaks, "max_diff": diff, "max_abs": scale,
           "mode": f"{first.reduce_scatter_mode}/{first.all_gather_mode}/"
                   f"{getattr(first, 'buffer_mode', 'own')}",
           "fused_py": fused_module.__file__,
           "params": sum(p.numel() for p in ref_model.module.parameters())}
    return json.loads(json.dumps(out))  # plain Python data for the parent


def _spawn(world, cfg, timeout) -> list:
    from ngra.distributed.launch import spawn

    return spawn(_worker, world, cfg, timeout=timeout, pg_timeout=600.0)


def _summary(results, variants) -> dict:
    """Per variant: medians over steps of the slowest rank (a step ends when all ranks do),
    the largest state bytes and step peak over ranks, overlap share over all steps and ranks."""
    out = {}
    for v in variants:
        steps = len(results[0]["rows"][v])
        worst = lambda key: [max(r["rows"][v][i][key] for r in results)  # noqa: E731
                             for i in range(steps)]
        before = sum(row["overlapped"] for r in results for row in r["rows"][v])
        comm = sum(row["comm"] for r in results for row in r["rows"][v])
        out[v] = {k: statistics.median(worst(k))
                  for k in ("step", "forward", "backward", "opt_step", "adam", "comm",
                            "launch", "blocked")}
        out[v]["overlap"] = before / comm if comm > 0 else float("nan")
        out[v]["state"] = max(r["state"][v] for r in results)
        out[v]["step_peak"] = max(r["step_peak"][v] for r in results)
        out[v]["total"] = max(r["state"][v] + r["step_peak"][v] for r in results)
        out[v]["buffers"] = max(row["buffer_bytes"] for r in results for row in r["rows"][v])
        out[v]["buckets"] = results[0]["rows"][v][-1]["buckets"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a tiny GPT (d_model 64, 2 layers) and 3 timed steps")
    ap.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    ap.add_argument("--d-model", type=int, default=None, help="GPT width (default 256)")
    ap.add_argument("--layers", type=int, default=None, help="GPT blocks (default 4)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank (default 8)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=2.0,
                    help="DDP bucket size in MB (default 2, so that a GPT of a few million "
                         "parameters has several buckets to overlap; DDP's own default is 25)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, ddp+adam first (default {','.join(VARIANTS)})")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per worker count")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the summaries here")
    args = ap.parse_args(argv)
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--workers must look like 2,4 (got {args.workers!r})")
    if not workers or any(w < 2 for w in workers):
        ap.error(f"--workers: expected worker counts >= 2 (got {args.workers!r})")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if (not variants or variants[0] != "ddp+adam" or len(variants) < 2
            or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants)):
        ap.error(f"--variants: expected ddp+adam, then one or more of {VARIANTS[1:]} (got "
                 f"{args.variants!r})")
    q = args.quick
    cfg = {"d_model": args.d_model or (64 if q else 256), "layers": args.layers or (2 if q else 4),
           "heads": args.heads, "seq": args.seq or (32 if q else 64),
           "batch": args.batch or (4 if q else 8), "steps": args.steps or (3 if q else 10),
           "warmup": args.warmup, "bucket_cap_mb": args.bucket_cap_mb, "lr": args.lr,
           "progress": not args.no_progress, "variants": variants}
    if cfg["d_model"] % cfg["heads"]:
        ap.error(f"--d-model {cfg['d_model']} must be divisible by --heads {cfg['heads']}")
    from tqdm.auto import tqdm

    print(f"==> fused reduce-scatter + sharded Adam + all-gather vs DDP + Adam: GPT d_model "
          f"{cfg['d_model']}, {cfg['layers']} layers, batch {cfg['batch']} x {cfg['seq']} per "
          f"rank, {cfg['steps']} timed steps after {cfg['warmup']}, gloo, K = {workers}",
          flush=True)
    summaries = {}
    for world in tqdm(workers, desc="worker counts", disable=args.no_progress):
        results = _spawn(world, cfg, args.timeout)
        s = summaries[world] = _summary(results, variants)
        s["mode"], s["params"] = results[0]["mode"], results[0]["params"]
        s["fused_py"] = results[0]["fused_py"]
        s["max_diff"] = max(r["max_diff"] for r in results)
        s["max_abs"] = results[0]["max_abs"]
        if not s["max_diff"] <= 1e-4 * max(1.0, s["max_abs"]):
            print(f"error: K={world}: fused and DDP + Adam parameters differ by "
                  f"{s['max_diff']:.3g} (expected rounding only)", file=sys.stderr)
            return 1
    _report(summaries, variants)
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in summaries.items()}, indent=1))
    return 0


def _report(summaries, variants) -> None:
    fused = [v for v in variants if v != "ddp+adam"]
    params = next(iter(summaries.values()))["params"]
    mib = 2 ** 20
    print(f"\nmodel: {params / 1e6:.2f} M parameters ({params * 4 / mib:.1f} MiB float32); "
          "times are medians (ms) of the slowest rank per step")
    head = (f"{'K':>2} | {'variant':<9} | {'step':>8} | {'backward':>8} | {'opt.step':>8} | "
            f"{'Adam':>8} | {'comm':>8} | {'overlap':>7} | {'state/rank':>10} | "
            f"{'buffers':>8} | {'step peak':>9} | {'state+peak':>10} | {'buckets':>7}")
    print(head)
    print("-" * len(head))
    for world, s in summaries.items():
        for v in variants:
            r = s[v]
            print(f"{world:>2} | {v:<9} | {r['step'] * 1e3:8.1f} | {r['backward'] * 1e3:8.1f} | "
                  f"{r['opt_step'] * 1e3:8.1f} | {r['adam'] * 1e3:8.1f} | {r['comm'] * 1e3:8.1f} | "
                  f"{100 * r['overlap']:6.1f}% | {r['state'] / mib:6.2f} MiB | "
                  f"{r['buffers'] / mib:4.1f} MiB | {r['step_peak'] / mib:5.1f} MiB | "
                  f"{r['total'] / mib:6.1f} MiB | {r['buckets']:>7}")
    for world, s in summaries.items():
        for v in fused:
            f = s[v]
            print(f"K={world} {v}, inside the hooks per step: launching collectives "
                  f"{f['launch'] * 1e3:.1f} ms, blocked on reduce-scatters "
                  f"{f['blocked'] * 1e3:.1f} ms; forward {f['forward'] * 1e3:.1f} ms vs "
                  f"{s['ddp+adam']['forward'] * 1e3:.1f} ms")
    print("\nAdam: DDP + Adam's opt.step(); fused*: Adam on the rank's parts inside the hooks "
          "(during backward). comm: summed collective time per rank and step; overlap: its "
          "share before the last bucket's hook. buffers: fused*'s peak transient send/receive/"
          "gather buffers (its own count). step peak: the peak of the tensors one step creates "
          "(ngra.engine.TensorMemory); state+peak: the optimizer state plus it, per rank (the "
          "largest over ranks).")
    print("\nratios (fused / DDP + Adam; < 1: fused smaller or faster)")
    for world, s in summaries.items():
        d = s["ddp+adam"]
        for v in fused:
            f = s[v]
            print(f"K={world} {v:<9}: step {f['step'] / d['step']:.2f}x, opt.step "
                  f"{f['opt_step'] / d['opt_step']:.2f}x, Adam compute "
                  f"{f['adam'] / d['adam']:.2f}x, optimizer state "
                  f"{f['state'] / d['state']:.3f}x, state + step peak "
                  f"{f['total'] / d['total']:.3f}x ({(f['total'] - d['total']) / mib:+.1f} MiB), "
                  f"overlap {100 * f['overlap']:.0f}% vs {100 * d['overlap']:.0f}%")
    first = next(iter(summaries.values()))
    print(f"FusedAdam from {first['fused_py']}; {fused[0]} used reduce-scatter/all-gather/"
          f"buffers {first['mode']}; largest |parameter difference| to DDP + Adam: "
          + ", ".join(f"K={w} {s['max_diff']:.2g}" for w, s in summaries.items()))


if __name__ == "__main__":
    sys.exit(main())
