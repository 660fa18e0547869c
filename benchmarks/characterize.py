"""GNN characterization: per-SAGA-stage time, peak memory and FLOPs/bytes estimates of GCN,
GraphSAGE, GAT, GIN, G-GCN, GG-NN, R-GCN and CommNet on ngra, PyG and DGL (after "Architectural
Implications of Graph Neural Networks").

    .venv/bin/python benchmarks/characterize.py --out results/char --quick     # minutes
    .venv/bin/python benchmarks/characterize.py --out results/char             # full run

Steps: (1) every dataset is saved once as ``graph.npz`` (edge list without self loops, features,
labels, random edge types for R-GCN) and every model's ngra weights as ``weights_<model>.npz``;
(2) correctness gate: each framework computes the eval-mode output from those files in a worker
process and the run stops with an error unless all agree with ngra within ``--tol``;
(3) timing: one worker process per framework x dataset runs, for each model, an inference
forward and a training step (forward, cross-entropy, backward, Adam), best of ``--repeats``,
with per-stage forward times and the peak memory of the first run; (4) ``results.csv`` (long
form), ``report.md`` and PNG figures under ``--out``.

Frameworks: ``ngra`` (optimized IR: lifted and fused), ``ngra-unfused`` (the raw traced IR:
separate Scatter / ApplyEdge / Gather nodes), ``pyg`` (PyG 2.8 built-in layers, same process
environment), ``dgl`` (DGL 2.1 in its own environment, ``characterize_dgl.py``). Stage
attribution differs by framework and is described in the report.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# benchmarks/ holds kernels.py, which would shadow the `kernels` package (ngra's editable
# install resolves it after the path entries): import the package first, then look here.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import kernels  # noqa: E402,F401
sys.path.append(str(HERE))
from characterize_common import STAGES, append_jsonl, load_graph, measure, tiny_subgraph  # noqa: E402

FRAMEWORKS = ("ngra", "ngra-unfused", "pyg", "dgl")
# name -> (loader, description); R-MAT: (num_nodes, num_edges) with Graph500 parameters.
RMAT = {"rmat-10k": (10_000, 160_000), "rmat-100k": (100_000, 1_600_000),
        "rmat-1m": (1 << 20, 1 << 24)}
REAL = {"cora": "cora", "amazon-computers": "amazon-computers", "coauthor-cs": "coauthor-cs"}
DATASETS = (*REAL, *RMAT)
RMAT_FEATURES, RMAT_CLASSES = 64, 16
QUICK = dict(datasets=["cora", "rmat-10k"], repeats=2)
MODES = ("inference", "training")
STAGE_NOTES = {
    ("dgl", "Scatter"): "no separate Scatter: update_all/apply_edges fuse it",
}


# =============================================================================================
# worker (main environment): gate outputs and timings for ngra, ngra-unfused and pyg
# =============================================================================================
def _limit_memory(gb: float | None):
    if not gb:
        return
    import resource
    lim = int(gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or "alloc" in text or "memory" in text


def _ngra_runner(name, gd, weights, framework):
    import torch
    import torch.nn.functional as F

    import ngra
    from characterize_models import build_ngra, needs_edge_type

    model = build_ngra(name, gd["x"].shape[1], gd["num_classes"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    g = ngra.Graph(torch.from_numpy(gd["src"]), torch.from_numpy(gd["dst"]), gd["num_nodes"])
    g.in_csr()  # built once and cached on the graph (as DGL's create_formats_)
    x, y = torch.from_numpy(gd["x"]), torch.from_numpy(gd["y"])
    kw = {"edge_type": torch.from_numpy(gd["edge_type"])} if needs_edge_type(name) else {}
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def forward():
        with ngra.profile.stages() as prof:
            t0 = time.perf_counter()
            out = model(g, x, **kw)
            fwd = time.perf_counter() - t0
        tot = prof.totals()
        stages = {s: tot.pop(s) for s in STAGES}
        stages["ApplyVertex"] += sum(tot.values())  # "Eager"/"Other" (none expected)
        # prepare(), activations and dropout run outside the IR: the residual is ApplyVertex.
        stages["ApplyVertex"] += max(0.0, fwd - sum(stages.values()))
        return out, fwd, stages

    def run(mode):
        if mode == "inference":
            model.eval()
            with torch.no_grad():
                _, fwd, stages = forward()
            return fwd, stages, 0.0
        model.train()
        opt.zero_grad()
        out, fwd, stages = forward()
        t1 = time.perf_counter()
        F.cross_entropy(out, y).backward()
        opt.step()
        return fwd, stages, time.perf_counter() - t1

    def output():
        model.eval()
        with torch.no_grad():
            return model(g, x, **kw).numpy()
    return run, output


def _pyg_runner(name, gd, weights):
    import torch
    import torch.nn.functional as F

    from characterize_models import PygStageTimer, build_pyg, needs_edge_type

    model = build_pyg(name, gd["x"].shape[1], gd["num_classes"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    ei = torch.stack([torch.from_numpy(gd["src"]), torch.from_numpy(gd["dst"])])
    x, y = torch.from_numpy(gd["x"]), torch.from_numpy(gd["y"])
    args = (x, ei, torch.from_numpy(gd["edge_type"])) if needs_edge_type(name) else (x, ei)
    timer = PygStageTimer(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def forward():
        timer.reset()
        t0 = time.perf_counter()
        out = model(*args)
        fwd = time.perf_counter() - t0
        return out, fwd, timer.stages(fwd)

    def run(mode):
        if mode == "inference":
            model.eval()
            with torch.no_grad():
                _, fwd, stages = forward()
            return fwd, stages, 0.0
        model.train()
        opt.zero_grad()
        out, fwd, stages = forward()
        t1 = time.perf_counter()
        F.cross_entropy(out, y).backward()
        opt.step()
        return fwd, stages, time.perf_counter() - t1

    def output():
        model.eval()
        with torch.no_grad():
            return model(*args).numpy()
    return run, output


def _unfuse_ngra():
    """Make every ngra layer run its raw traced IR (separate Scatter/ApplyEdge/Gather nodes)."""
    from ngra.program import Program
    orig = Program.run

    def run(self, g, vdata, edata=None, *, fused=True, **kw):
        return orig(self, g, vdata, edata, fused=False, **kw)
    Program.run = run


def worker(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    _limit_memory(spec.get("mem_limit_gb"))
    import torch
    torch.manual_seed(0)
    data_dir = Path(spec["data_dir"])
    gd = load_graph(data_dir)
    fws = spec["frameworks"]
    if spec["task"] == "time" and fws == ["ngra-unfused"]:
        _unfuse_ngra()
    for name in spec["models"]:
        weights = dict(np.load(data_dir / f"weights_{name}.npz"))
        for fw in fws:
            try:
                if spec["task"] == "gate":
                    if fw == "ngra-unfused":
                        continue  # handled by the 'ngra' output with fused=False below
                    run, output = (_pyg_runner(name, gd, weights) if fw == "pyg"
                                   else _ngra_runner(name, gd, weights, fw))
                    np.save(Path(spec["out"]) / f"{fw}_{name}.npy", output())
                    if fw == "ngra" and "ngra-unfused" in fws:
                        _unfuse_ngra_once(lambda: np.save(Path(spec["out"]) / f"ngra-unfused_{name}.npy",
                                                          output()))
                    continue
                make = _pyg_runner if fw == "pyg" else (lambda n, d, w: _ngra_runner(n, d, w, fw))
                warm, _ = make(name, tiny_subgraph(gd), weights)
                for mode in spec["modes"]:
                    warm(mode)
                run, _ = make(name, gd, weights)
                for mode in spec["modes"]:
                    rec = measure(run, mode, spec["repeats"], spec["max_seconds"])
                    append_jsonl(spec["out"], {"framework": fw, "model": name, **rec})
                del run, warm
            except Exception as e:  # noqa: BLE001 - recorded as a skipped row, never hidden
                if not _is_oom(e):
                    raise
                reason = f"skipped: out of memory under the {spec.get('mem_limit_gb')} GB limit ({e})"[:300]
                if spec["task"] == "gate":
                    (Path(spec["out"]) / f"{fw}_{name}.skipped").write_text(reason)
                else:
                    for mode in spec["modes"]:
                        append_jsonl(spec["out"], {"framework": fw, "model": name, "mode": mode,
                                                   "status": reason})


def _unfuse_ngra_once(fn):
    from ngra.program import Program
    orig = Program.run
    _unfuse_ngra()
    try:
        fn()
    finally:
        Program.run = orig


# =============================================================================================
# driver
# =============================================================================================
def _tqdm():
    from tqdm.auto import tqdm
    return tqdm


def prepare_dataset(name, root, work: Path, seed=0) -> dict:
    """Save ``graph.npz`` for ``name`` (self loops removed, multi-edges kept) and return stats."""
    import torch

    import ngra
    work.mkdir(parents=True, exist_ok=True)
    if name in REAL:
        ds = ngra.datasets.load(REAL[name], root=root)
        g, x, y, c = ds.graph, ds.x, ds.y, ds.num_classes
        y = y.clamp(min=0)  # unlabeled vertices (-1) get class 0: the loss only needs a target
    else:
        n, e = RMAT[name]
        g = ngra.datasets.rmat(num_edges=e, num_nodes=n, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, RMAT_FEATURES, generator=gen)
        c = RMAT_CLASSES
        y = torch.randint(0, c, (n,), generator=gen)
    g = g.remove_self_loops()
    from characterize_models import NUM_RELATIONS
    et = torch.randint(0, NUM_RELATIONS, (g.num_edges,), generator=torch.Generator().manual_seed(seed + 1))
    np.savez(work / "graph.npz", src=g.src.numpy(), dst=g.dst.numpy(), num_nodes=g.num_nodes,
             x=x.float().contiguous().numpy(), y=y.numpy(), edge_type=et.numpy(), num_classes=c)
    return {"dataset": name, "num_nodes": g.num_nodes, "num_edges": g.num_edges,
            "features": int(x.shape[1]), "classes": int(c)}


def save_weights(models, stats, work: Path, seed=0):
    import torch

    from characterize_models import build_ngra
    for name in models:
        torch.manual_seed(seed)
        model = build_ngra(name, stats["features"], stats["classes"])
        with torch.no_grad():  # PyG-style zero biases would hide a missing bias in the gate
            for k, p in model.named_parameters():
                if k.endswith("bias"):
                    p.normal_(0.0, 0.1)
        np.savez(work / f"weights_{name}.npz",
                 **{k: v.detach().numpy() for k, v in model.state_dict().items()})


def _spawn(framework, spec: dict, spec_path: Path, args):
    spec_path.write_text(json.dumps(spec))
    # One OpenMP wait policy for every framework: ngra sets PASSIVE when imported before torch
    # (kernels/__init__.py); the PyG and DGL workers must not get spinning threads instead.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONUNBUFFERED="1",
               OMP_WAIT_POLICY="PASSIVE")
    if framework == "dgl":
        env["DGLBACKEND"] = "pytorch"
        cmd = [args.dgl_python, str(HERE / "characterize_dgl.py"), str(spec_path)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc, timeout, progress=None):
    """Wait for ``proc``; ``progress()`` is polled to advance bars. Returns (rc, output)."""
    import threading
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    start = time.time()
    while proc.poll() is None:
        if progress:
            progress()
        if time.time() - start > timeout:
            proc.kill()
            proc.wait()
            reader.join(5)
            return "timeout", "".join(chunks)
        time.sleep(0.5)
    reader.join(10)
    if progress:
        progress()
    return proc.returncode, "".join(chunks)


def gate(args, frameworks, models, stats, work: Path, bar):
    """Eval-mode outputs of every framework vs ngra; returns rows and the set of (fw, model)
    that could not be gated (skipped, with reason). Raises SystemExit on a disagreement."""
    out_dir = work / "gate"
    out_dir.mkdir(exist_ok=True)
    groups = []
    main = [f for f in frameworks if f != "dgl"]
    if "ngra" not in main:
        main = ["ngra", *main]  # the reference
    groups.append(("main", main))
    if "dgl" in frameworks:
        groups.append(("dgl", ["dgl"]))
    for kind, fws in groups:
        spec = {"task": "gate", "data_dir": str(work), "models": models, "frameworks": fws,
                "out": str(out_dir), "mem_limit_gb": args.mem_limit_gb}
        proc = _spawn("dgl" if kind == "dgl" else "main", spec, work / f"gate_{kind}.json", args)
        rc, text = _wait(proc, args.worker_timeout)
        if rc != 0:
            raise SystemExit(f"correctness gate: the {kind} worker for {stats['dataset']} failed "
                             f"(exit {rc}):\n{text[-3000:]}")
        bar.update(1)
    return compare_outputs(out_dir, frameworks, models, stats["dataset"], args.tol)


def compare_outputs(out_dir: Path, frameworks, models, dataset: str, tol: float):
    """The gate's check on the saved outputs ``<fw>_<model>.npy`` (``.skipped`` holds why one is
    missing): every framework's output against ngra's, ``max |out - ngra| / max |ngra| <= tol``.
    Returns (rows, skipped); raises SystemExit listing every disagreement."""
    rows, skipped = [], {}
    for name in models:
        ref_path = out_dir / f"ngra_{name}.npy"
        if not ref_path.exists():
            reason = (out_dir / f"ngra_{name}.skipped").read_text()
            for fw in frameworks:
                skipped[(fw, name)] = "gate " + reason
            continue
        ref = np.load(ref_path)
        scale = float(np.abs(ref).max()) or 1.0
        for fw in frameworks:
            if fw == "ngra":
                continue
            path = out_dir / f"{fw}_{name}.npy"
            if not path.exists():
                skipped[(fw, name)] = "gate " + (out_dir / f"{fw}_{name}.skipped").read_text()
                continue
            other = np.load(path)
            err = float(np.abs(other - ref).max()) / scale if other.shape == ref.shape else math.inf
            rows.append({"framework": fw, "model": name, "dataset": dataset,
                         "max_rel_error": err, "ok": bool(err <= tol)})
    bad = [r for r in rows if not r["ok"]]
    if bad:
        lines = "\n".join(f"  {r['framework']} {r['model']} on {r['dataset']}: max |out - ngra| / "
                          f"max |ngra| = {r['max_rel_error']:.3g} > --tol {tol}" for r in bad)
        raise SystemExit(f"correctness gate failed; no timings taken:\n{lines}")
    return rows, skipped


def time_dataset(args, frameworks, models, stats, work: Path, skipped, bar):
    records = []
    for fw in frameworks:
        todo = [m for m in models if (fw, m) not in skipped]
        for m in models:
            if (fw, m) in skipped:
                records += [{"framework": fw, "model": m, "mode": mode, "status": skipped[(fw, m)]}
                            for mode in args.modes]
                bar.update(len(args.modes))
        if not todo:
            continue
        out = work / f"time_{fw}.jsonl"
        out.unlink(missing_ok=True)
        spec = {"task": "time", "data_dir": str(work), "models": todo, "frameworks": [fw],
                "modes": args.modes, "repeats": args.repeats, "max_seconds": args.max_seconds,
                "out": str(out), "mem_limit_gb": args.mem_limit_gb}
        bar.set_postfix_str(f"{fw} on {stats['dataset']}")
        done = [0]

        def progress():
            n = len(out.read_text().splitlines()) if out.exists() else 0
            if n > done[0]:
                bar.update(n - done[0])
                done[0] = n
        rc, text = _wait(_spawn(fw, spec, work / f"time_{fw}.json", args), args.worker_timeout, progress)
        got = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        records += got
        seen = {(r["model"], r["mode"]) for r in got}
        if rc != 0:
            why = (f"skipped: worker timed out after {args.worker_timeout} s" if rc == "timeout"
                   else f"skipped: worker failed (exit {rc}): {text.strip().splitlines()[-1][:200] if text.strip() else ''}")
            for m in todo:
                for mode in args.modes:
                    if (m, mode) not in seen:
                        records.append({"framework": fw, "model": m, "mode": mode, "status": why})
                        bar.update(1)
    for r in records:
        r["dataset"] = stats["dataset"]
    return records


def long_rows(records, stats_by_ds):
    """One row per framework x model x dataset x mode x stage (+ Backward, Total)."""
    from characterize_models import estimate
    rows = []
    for r in records:
        st = stats_by_ds[r["dataset"]]
        base = {"framework": r["framework"], "model": r["model"], "dataset": r["dataset"],
                "mode": r["mode"], "num_nodes": st["num_nodes"], "num_edges": st["num_edges"]}
        if "status" in r:
            rows.append({**base, "stage": "Total", "seconds": "", "flops_est": "", "bytes_est": "",
                         "peak_mem_mb": "", "repeats": 0, "status": r["status"], "note": ""})
            continue
        est = estimate(r["model"], st["num_nodes"], st["num_edges"], st["features"], st["classes"])
        peak = "" if r["peak_bytes"] is None else round(r["peak_bytes"] / 2**20, 2)
        common = {"peak_mem_mb": peak, "repeats": r["repeats"], "status": "ok"}
        stages = list(STAGES) + (["Backward"] if r["mode"] == "training" else []) + ["Total"]
        fwd_f = sum(f for f, _ in est.values())
        fwd_b = sum(b for _, b in est.values())
        for s in stages:
            if s in STAGES:
                sec, (fl, by) = r["stages"][s], est[s]
            elif s == "Backward":
                sec, fl, by = r["backward"], 2 * fwd_f, 2 * fwd_b
            else:
                k = 3 if r["mode"] == "training" else 1
                sec, fl, by = r["total"], k * fwd_f, k * fwd_b
            rows.append({**base, "stage": s, "seconds": sec, "flops_est": fl, "bytes_est": by,
                         **common, "note": STAGE_NOTES.get((r["framework"], s), "")})
    return rows


CSV_COLUMNS = ["framework", "model", "dataset", "mode", "stage", "seconds", "flops_est",
               "bytes_est", "peak_mem_mb", "repeats", "num_nodes", "num_edges", "status", "note"]


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)


# -- report and figures -------------------------------------------------------------------------
def _index(rows):
    tot, stage, mem = {}, {}, {}
    for r in rows:
        if r["status"] != "ok":
            continue
        key = (r["framework"], r["model"], r["dataset"], r["mode"])
        if r["stage"] == "Total":
            tot[key] = r["seconds"]
            mem[key] = r["peak_mem_mb"]
        else:
            stage.setdefault(key, {})[r["stage"]] = r["seconds"]
    return tot, stage, mem


def _gmean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def findings(rows, frameworks, models, datasets):
    """Headline findings computed from the rows (the same text goes to the report)."""
    from characterize_models import MODELS
    tot, stage, _ = _index(rows)
    lines = []
    for mode in MODES:
        dom = []
        for m in models:
            counts = {}
            for d in datasets:
                st = stage.get(("ngra", m, d, mode))
                if st:
                    top = max(STAGES, key=lambda s: st[s])
                    counts[top] = counts.get(top, 0) + 1
            if counts:
                top = max(counts, key=counts.get)
                dom.append(f"{MODELS[m][1]}: {top} ({counts[top]}/{sum(counts.values())})")
        if dom:
            lines.append(f"- **{mode}**, dominant forward stage on ngra (datasets where it is the "
                         f"largest): " + "; ".join(dom) + ".")
        for other in ("pyg", "dgl", "ngra-unfused"):
            if other not in frameworks:
                continue
            ratios = {(m, d): tot[(other, m, d, mode)] / tot[("ngra", m, d, mode)]
                      for m in models for d in datasets
                      if ("ngra", m, d, mode) in tot and (other, m, d, mode) in tot}
            if not ratios:
                continue
            best = max(ratios, key=ratios.get)
            worst = min(ratios, key=ratios.get)
            wins = sum(v > 1 for v in ratios.values())
            lines.append(f"- **{mode}**, {other} time / ngra time: geometric mean "
                         f"{_gmean(ratios.values()):.2f}x over {len(ratios)} model x dataset pairs; "
                         f"ngra faster in {wins}; best for ngra {ratios[best]:.2f}x "
                         f"({MODELS[best[0]][1]} on {best[1]}), worst {ratios[worst]:.2f}x "
                         f"({MODELS[worst[0]][1]} on {worst[1]}).")
    return lines


def write_report(path, rows, gate_rows, stats, frameworks, models, args, wall, command):
    import torch

    from characterize_models import GAT_HEADS, GAT_HIDDEN, HIDDEN, MODELS, NUM_LAYERS, NUM_RELATIONS
    tot, stage, mem = _index(rows)
    datasets = [s["dataset"] for s in stats]
    L = [f"# GNN characterization: ngra vs PyG vs DGL", "",
         f"Command: `{command}`  ", f"Wall time: {wall / 60:.1f} min on {os.cpu_count()} CPU cores "
         f"({platform.processor() or platform.machine()}), torch {torch.__version__}; "
         f"one untimed warm-up run (its peak memory is reported) then best of {args.repeats} timed "
         f"run(s) per configuration (the `repeats` column says how many ran; they stop after "
         f"{args.max_seconds} s; 0 means only the warm-up ran and its time is reported). The "
         "machine was shared with other jobs: expect noise.", "",
         f"Models: {', '.join(MODELS[m][1] for m in models)}; {NUM_LAYERS} graph layers, hidden "
         f"{HIDDEN} (GAT: {GAT_HEADS} heads x {GAT_HIDDEN}), R-GCN with {NUM_RELATIONS} random edge "
         "types. Inference = one eval-mode forward; training step = train-mode forward, "
         "cross-entropy over all vertices, backward, Adam step.", "",
         "## Datasets", "", "| dataset | vertices | edges | features | classes |", "|---|---|---|---|---|"]
    L += [f"| {s['dataset']} | {s['num_nodes']:,} | {s['num_edges']:,} | {s['features']} | "
          f"{s['classes']} |" for s in stats]
    L += ["", "Self loops are removed from every graph when it is saved (multi-edges kept); GCN and "
          "GAT add one self loop per vertex. R-MAT: Graph500 parameters, random N(0,1) features "
          "and random labels.", "", "## Correctness gate", "",
          f"Eval-mode outputs from the same weights; max |out - ngra| / max |ngra| must be <= "
          f"{args.tol} or the run stops before any timing.", "",
          "| framework | model | dataset | max rel. error |", "|---|---|---|---|"]
    L += [f"| {g['framework']} | {MODELS[g['model']][1]} | {g['dataset']} | {g['max_rel_error']:.2e} |"
          for g in gate_rows]
    L += ["", "## Headline findings", ""] + findings(rows, frameworks, models, datasets)
    for mode in args.modes:
        L += ["", f"## {mode.capitalize()}: total time (ms), dominant stage, peak memory (MiB)", ""]
        for d in datasets:
            L += [f"### {d}", "", "| model | " + " | ".join(frameworks) + " | "
                  + " | ".join(f"{f} / ngra" for f in frameworks if f != "ngra") + " |",
                  "|---" * (1 + 2 * len(frameworks) - 1) + "|"]
            for m in models:
                cells = []
                for f in frameworks:
                    k = (f, m, d, mode)
                    if k in tot:
                        st = stage[k]
                        top = max(STAGES, key=lambda s: st[s])
                        mm = mem.get(k)
                        cells.append(f"{tot[k] * 1e3:.1f} ({top} {st[top] / max(sum(st[s] for s in STAGES), 1e-12):.0%}; "
                                     f"{mm if mm != '' else '?'} MiB)")
                    else:
                        cells.append("skipped")
                ratios = []
                for f in frameworks:
                    if f == "ngra":
                        continue
                    a, b = tot.get((f, m, d, mode)), tot.get(("ngra", m, d, mode))
                    ratios.append(f"{a / b:.2f}x" if a and b else "-")
                L.append(f"| {MODELS[m][1]} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
            L.append("")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        L += ["## Skipped", "", "| framework | model | dataset | mode | reason |", "|---|---|---|---|---|"]
        L += [f"| {r['framework']} | {r['model']} | {r['dataset']} | {r['mode']} | {r['status']} |"
              for r in skipped]
        L.append("")
    L += ["## How stages are attributed", "",
          "- **ngra**: the stage tag of every IR node (`ngra.profile.stages()`). After fusion a "
          "g-SpMM does Scatter + ApplyEdge + Gather and counts as Gather; lifted ApplyEdge work "
          "that runs on vertices (GAT's and G-GCN's projections) counts as ApplyEdge; work in a "
          "layer's `scatter()` (GCN's `W x d^-1/2`) counts as Scatter. Work outside the IR "
          "(`prepare()`: degrees, GG-NN's `h W_t`; dropout and activations between layers) is "
          "the residual of the forward total and counts as ApplyVertex.",
          "- **ngra-unfused**: the raw traced IR (`Program.run(fused=False)`): explicit Scatter "
          "([E, F] copies), ApplyEdge on edges, Gather (segment reduction); no lifting.",
          "- **pyg**: PyG 2.8 `MessagePassing` hooks: Scatter = `propagate` start to `message` "
          "(`_collect`'s index_selects; also in `edge_updater`), ApplyEdge = `message` and "
          "`edge_update` (GAT attention), Gather = `aggregate`, ApplyVertex = `update` plus "
          "everything outside `propagate` (the layers' linear transforms, including GAT's and "
          "G-GCN's projections that ngra counts as lifted ApplyEdge). The attribution is "
          "therefore not identical to ngra's for the same computation.",
          "- **dgl**: the models are written with DGL's message-passing API (characterize_dgl.py); "
          "`update_all` with built-in functions is one fused kernel and counts as Gather (DGL has "
          "no separate Scatter: 0), `apply_edges`/`edge_softmax` and the vertex projections that "
          "feed them count as ApplyEdge, GCN's source transform as Scatter (as in ngra), the rest "
          "is ApplyVertex (residual). DGL's R-GCN transforms per edge (`gather_mm`, as "
          "`RelGraphConv`) where ngra and PyG aggregate first.",
          "- **Training step**: the forward is broken down by stage as above; loss + backward + "
          "optimizer step is one `Backward` row (no per-stage backward profiler exists in any of "
          "the three); `Total` = forward + backward.", "",
          "## Memory", "",
          "`peak_mem_mb`: resident-set high-water mark during the first run of a configuration "
          "minus the resident set just before it (graph, features, weights, compiled programs and "
          "optimizer already loaded), in a worker process per framework x dataset with "
          "`MALLOC_MMAP_THRESHOLD_=65536` (freed tensors return to the OS) and the high-water mark "
          "reset through `/proc/self/clear_refs` before each configuration. A training step's "
          "peak includes its forward. Workers run under an address-space data limit of "
          f"{args.mem_limit_gb} GB (RLIMIT_DATA); a configuration that exceeds it is recorded as "
          "skipped.", "",
          "## FLOPs and bytes estimates", "",
          "Columns `flops_est` / `bytes_est` come from a simple analytic model of each model's "
          "SAGA dataflow (`characterize_models.estimate`), the same for every framework: Linear "
          "`rows x in -> out` = 2 rows in out FLOPs; element-wise on n values = k n FLOPs and "
          "(reads + 1) 4n bytes; Scatter of F features = E (8F + 8) bytes; Gather (sum/mean) = E F "
          "FLOPs and E (4F + 8) + 4 N F bytes; float32 values and int64 indices. It counts the "
          "algorithm's work, not an implementation's (fusion saves bytes that the estimate still "
          "counts). Backward = 2x the forward estimate.", "",
          "## Figures", "", *[f"![{p}]({p})" for p in sorted(x.name for x in Path(path).parent.glob("*.png"))]]
    Path(path).write_text("\n".join(L) + "\n")


STAGE_COLORS = {"Scatter": "#4C72B0", "ApplyEdge": "#DD8452", "Gather": "#55A868",
                "ApplyVertex": "#C44E52", "Backward": "#8172B3"}


def plot(rows, frameworks, models, datasets, modes, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from characterize_models import MODELS
    tot, stage, mem = _index(rows)
    cols = min(3, len(datasets))
    nrow = math.ceil(len(datasets) / cols)
    for mode in modes:
        parts = list(STAGES) + (["Backward"] if mode == "training" else [])
        fig, axes = plt.subplots(nrow, cols, figsize=(6 * cols, 3.8 * nrow), squeeze=False)
        width = 0.8 / len(frameworks)
        for ax, d in zip(axes.flat, datasets):
            for j, f in enumerate(frameworks):
                bottom = np.zeros(len(models))
                for s in parts:
                    vals = np.array([(stage.get((f, m, d, mode), {}).get(s, 0.0) if s != "Backward"
                                      else (tot.get((f, m, d, mode), 0.0)
                                            - sum(stage.get((f, m, d, mode), {}).values()))) * 1e3
                                     for m in models])
                    ax.bar(np.arange(len(models)) + (j - (len(frameworks) - 1) / 2) * width, vals,
                           width, bottom=bottom, color=STAGE_COLORS[s],
                           label=s if j == 0 else None, edgecolor="white", linewidth=0.3)
                    bottom += vals
            ax.set_xticks(range(len(models)), [MODELS[m][1] for m in models], rotation=30, fontsize=8)
            ax.set_title(f"{d}: bars = {' | '.join(frameworks)}", fontsize=8)
            ax.set_ylabel("ms")
        for ax in list(axes.flat)[len(datasets):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"Per-stage time, {mode} (one bar per framework, in the order of the title)")
        fig.tight_layout()
        fig.savefig(out / f"stages_{mode}.png", dpi=110)
        plt.close(fig)

        for what, table, fname, ylabel in (
                ("speedup", tot, f"speedup_{mode}.png", "other framework time / ngra time"),
                ("memory", mem, f"memory_{mode}.png", "peak memory (MiB)")):
            fws = [f for f in frameworks if f != "ngra"] if what == "speedup" else frameworks
            fig, axes = plt.subplots(nrow, cols, figsize=(6 * cols, 3.6 * nrow), squeeze=False)
            width = 0.8 / max(1, len(fws))
            for ax, d in zip(axes.flat, datasets):
                for j, f in enumerate(fws):
                    vals = []
                    for m in models:
                        a = table.get((f, m, d, mode))
                        if what == "speedup":
                            b = table.get(("ngra", m, d, mode))
                            vals.append(a / b if a and b else np.nan)
                        else:
                            vals.append(float(a) if a not in (None, "") else np.nan)
                    ax.bar(np.arange(len(models)) + (j - (len(fws) - 1) / 2) * width, vals, width, label=f)
                if what == "speedup":
                    ax.axhline(1.0, color="black", linewidth=0.8)
                ax.set_yscale("log")
                ax.set_xticks(range(len(models)), [MODELS[m][1] for m in models], rotation=30, fontsize=8)
                ax.set_title(d, fontsize=9)
                ax.set_ylabel(ylabel, fontsize=8)
            for ax in list(axes.flat)[len(datasets):]:
                ax.axis("off")
            axes.flat[0].legend(fontsize=7)
            title = ("ngra speedup (>1: ngra faster)" if what == "speedup" else "Peak memory") + f", {mode}"
            fig.suptitle(title)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=110)
            plt.close(fig)


def _list(value, allowed, what):
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: unknown {bad or value!r}; choose from {', '.join(allowed)} "
                         "(comma-separated)")
    return items


def main(argv=None):
    from characterize_models import MODELS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (CSV, report.md, PNGs, work/)")
    p.add_argument("--quick", action="store_true",
                   help=f"datasets {','.join(QUICK['datasets'])}, best of {QUICK['repeats']} (a few minutes)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all)")
    p.add_argument("--datasets", default=None, help=f"comma-separated from {', '.join(DATASETS)} "
                   "(default: all; --quick: cora,rmat-10k)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=None, help="best of N timed runs after one warm-up (default 3; --quick: 2)")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop repeating a configuration after this many seconds")
    p.add_argument("--worker-timeout", type=float, default=3600.0,
                   help="seconds per framework x dataset worker before it is killed")
    p.add_argument("--mem-limit-gb", type=float, default=12.0,
                   help="RLIMIT_DATA of each worker; configurations beyond it are skipped")
    p.add_argument("--tol", type=float, default=1e-4, help="correctness gate tolerance")
    p.add_argument("--root", default="../shared/datasets", help="dataset folder")
    p.add_argument("--dgl-python", default=os.environ.get("NGRA_DGL_PYTHON",
                                                          str(REPO / ".venv-dgl/bin/python")))
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.out is None:
        p.error("--out DIR is required")
    models = _list(args.models, list(MODELS), "models")
    datasets = _list(args.datasets or (",".join(QUICK["datasets"]) if args.quick else ",".join(DATASETS)),
                     DATASETS, "datasets")
    frameworks = _list(args.frameworks, FRAMEWORKS, "frameworks")
    if "ngra" not in frameworks:
        raise SystemExit("--frameworks must include ngra (the reference of the gate and the ratios)")
    args.modes = _list(args.modes, MODES, "modes")
    if args.repeats is None:
        args.repeats = QUICK["repeats"] if args.quick else 3
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1 (got {args.repeats})")
    if "dgl" in frameworks and not Path(args.dgl_python).exists():
        raise SystemExit(f"DGL environment not found at {args.dgl_python}; pass --dgl-python or "
                         "leave dgl out with --frameworks ngra,ngra-unfused,pyg")
    command = " ".join([".venv/bin/python", "benchmarks/characterize.py", *(argv or sys.argv[1:])])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tqdm = _tqdm()
    start = time.time()
    stats, gate_rows, records = [], [], []
    # Phase 1: data and the gate for every dataset, before any timing.
    skipped_by_ds = {}
    with tqdm(total=len(datasets) * (2 + ("dgl" in frameworks)), desc="data + gate") as bar:
        for d in datasets:
            work = out / "work" / d
            bar.set_postfix_str(d)
            st = prepare_dataset(d, args.root, work)
            save_weights(models, st, work)
            stats.append(st)
            bar.update(1)
            rows, skipped = gate(args, frameworks, models, st, work, bar)
            gate_rows += rows
            skipped_by_ds[d] = skipped
    # Phase 2: timings.
    total = len(datasets) * len(frameworks) * len(models) * len(args.modes)
    with tqdm(total=total, desc="timing") as bar:
        for st in stats:
            d = st["dataset"]
            records += time_dataset(args, frameworks, models, st, out / "work" / d,
                                    skipped_by_ds[d], bar)
    rows = long_rows(records, {s["dataset"]: s for s in stats})
    write_csv(rows, out / "results.csv")
    with open(out / "gate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["framework", "model", "dataset", "max_rel_error", "ok"])
        w.writeheader()
        w.writerows(gate_rows)
    plot(rows, frameworks, models, datasets, args.modes, out)
    wall = time.time() - start
    write_report(out / "report.md", rows, gate_rows, stats, frameworks, models, args, wall, command)
    print(f"wrote {out / 'results.csv'}, {out / 'report.md'} and figures in {wall / 60:.1f} min")
    for line in findings(rows, frameworks, models, datasets):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
