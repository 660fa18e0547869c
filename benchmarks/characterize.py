"""GNN characterization: per-SAGA-stage time, peak memory and FLOPs/bytes estimates of GCN,
GraphSAGE, GAT, GIN, G-GCN, GG-NN, R-GCN and CommNet on ngra, PyG and DGL (after "Architectural
Implications of Graph Neural Networks").

    .venv/bin/python benchmarks/characterize.py --out results/char --quick     # minutes
    .venv/bin/python benchmarks/characterize.py --out results/char             # full run

Steps: (1) every dataset is saved once as ``graph.npz`` (edge list without self loops, features,
labels, random edge types for R-GCN) and every model's ngra weights as ``weights_<model>.npz``;
(2) correctness gate: each framework computes the eval-mode output and the parameter gradients
of the cross-entropy from those files in a worker process, and the run stops with an error
unless all agree with ngra within ``--tol`` (outputs) and ``--grad-tol`` (gradients);
(3) timing: one worker process per framework x dataset runs, for each model, an inference
forward and a training step (forward, cross-entropy + backward, Adam step), best of
``--repeats``, with per-stage forward and backward times and the peak memory of the first run;
a worker that stops making progress is killed and a fresh one goes on with the next model;
(4) ``results.csv`` (long form), ``gate.csv``, ``report.md`` and PNG figures under ``--out``.

Frameworks: ``ngra`` (optimized IR: lifted and fused), ``ngra-unfused`` (the raw traced IR:
separate Scatter / ApplyEdge / Gather nodes), ``pyg`` (PyG 2.8 built-in layers, same process
environment), ``dgl`` (DGL 2.1 in its own environment, ``characterize_dgl.py``). Stage
attribution differs by framework and is described in the report.
"""

from __future__ import annotations

import argparse
import contextlib
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
from characterize_common import (STAGES, append_jsonl, gate_gradients, inference_step, is_oom,  # noqa: E402
                                  limit_memory, load_graph, mark_start, measure, tiny_subgraph,
                                  training_step)

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
# worker (main environment): gate outputs/gradients and timings for ngra, ngra-unfused and pyg
# =============================================================================================
class _NgraBackward:
    """``training_step``'s attribution for ngra: ``ngra.profile`` hooks the backward itself."""

    def __init__(self):
        self.prof = None

    def reset(self):
        self.prof = None

    def hook(self, out):
        pass

    @property
    def acc(self):
        return self.prof.backward_totals()


def _ngra_runner(name, gd, weights):
    """``(run(mode) -> run record, forward() -> output tensor)`` for ngra's model ``name``."""
    import torch
    import torch.nn.functional as F

    import ngra
    from characterize_models import build_ngra, needs_edge_type
    from ngra.nn import GCNConv, GINConv

    model = build_ngra(name, gd["x"].shape[1], gd["num_classes"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    for m in model.modules():  # the SAGA stages are the compiled program's: GCN's one kernel has none
        if isinstance(m, (GCNConv, GINConv)):
            m.fuse = False
        if isinstance(m, ngra.VertexProgram):  # each Linear under its own stage, not one group
            m.group_linears = False
    g = ngra.Graph(torch.from_numpy(gd["src"]), torch.from_numpy(gd["dst"]), gd["num_nodes"])
    g.in_csr()  # built once and cached on the graph (as DGL's create_formats_)
    x, y = torch.from_numpy(gd["x"]), torch.from_numpy(gd["y"])
    kw = {"edge_type": torch.from_numpy(gd["edge_type"])} if needs_edge_type(name) else {}
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    attribution = _NgraBackward()

    def forward():
        with ngra.profile.stages(backward=torch.is_grad_enabled()) as prof:
            t0 = time.perf_counter()
            out = model(g, x, **kw)
            fwd = time.perf_counter() - t0
        attribution.prof = prof
        tot = prof.totals()
        stages = {s: tot.pop(s) for s in STAGES}
        stages["ApplyVertex"] += sum(tot.values())  # "Eager"/"Other" (none expected)
        # prepare(), activations and dropout run outside the IR: the residual is ApplyVertex.
        stages["ApplyVertex"] += max(0.0, fwd - sum(stages.values()))
        return out, fwd, stages

    def run(mode):
        if mode == "inference":
            return inference_step(model, forward)
        return training_step(model, forward, lambda out: F.cross_entropy(out, y), opt, attribution)

    return model, run, lambda: model(g, x, **kw), y


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
            return inference_step(model, forward)
        # forward() resets the timer (and its backward ranges) itself: training_step's reset
        # comes first, so the ranges recorded by this forward are the ones hooked.
        return training_step(model, forward, lambda out: F.cross_entropy(out, y), opt,
                             timer.backward)

    return model, run, lambda: model(*args), y


@contextlib.contextmanager
def _unfused():
    """Every ngra layer runs its raw traced IR (separate Scatter / ApplyEdge / Gather nodes)."""
    from ngra.program import Program
    orig = Program.run

    def run(self, g, vdata, edata=None, *, fused=True, **kw):
        return orig(self, g, vdata, edata, fused=False, **kw)
    Program.run = run
    try:
        yield
    finally:
        Program.run = orig


def _make(fw, name, gd, weights):
    """PyG's or ngra's runner; call it for "ngra-unfused" inside ``_unfused()``."""
    return _pyg_runner(name, gd, weights) if fw == "pyg" else _ngra_runner(name, gd, weights)


def _oom_reason(spec, e) -> str:
    return f"skipped: out of memory under the {spec.get('mem_limit_gb')} GB limit ({e})"[:300]


def _gate_one(spec, fw, name, gd, weights):
    """Save ``<fw>_<model>.npy`` (eval output) and ``<fw>_<model>_grad.npz`` (parameter
    gradients); what does not fit in memory leaves a ``.skipped`` file saying so."""
    import torch
    out_dir = Path(spec["out"])
    model, _, forward, y = _make(fw, name, gd, weights)
    got = {}

    def eval_forward():
        got["out"] = forward()
        return got["out"]
    try:
        grads = gate_gradients(model, eval_forward, y)
        np.savez(out_dir / f"{fw}_{name}_grad.npz", **grads)
    except Exception as e:  # noqa: BLE001 - recorded as skipped, never hidden
        if not is_oom(e):
            raise
        (out_dir / f"{fw}_{name}_grad.skipped").write_text(_oom_reason(spec, e))
    if "out" in got:
        np.save(out_dir / f"{fw}_{name}.npy", got.pop("out").detach().numpy())
        return
    try:  # the backward did not fit: the output alone may
        model.eval()
        with torch.no_grad():
            np.save(out_dir / f"{fw}_{name}.npy", forward().numpy())
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        (out_dir / f"{fw}_{name}.skipped").write_text(_oom_reason(spec, e))


def worker(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    limit_memory(spec.get("mem_limit_gb"))
    import torch
    torch.manual_seed(0)
    data_dir = Path(spec["data_dir"])
    gd = load_graph(data_dir)
    if spec["task"] == "gate":
        for name, fw in spec["items"]:
            weights = dict(np.load(data_dir / f"weights_{name}.npz"))
            with _unfused() if fw == "ngra-unfused" else contextlib.nullcontext():
                _gate_one(spec, fw, name, gd, weights)
        return
    (fw,) = spec["frameworks"]
    with _unfused() if fw == "ngra-unfused" else contextlib.nullcontext():
        for name, modes in spec["plan"]:
            mark_start(spec["out"], fw, name)
            weights = dict(np.load(data_dir / f"weights_{name}.npz"))
            done, run = set(), None
            try:
                _, warm, _, _ = _make(fw, name, tiny_subgraph(gd), weights)
                for mode in modes:
                    warm(mode)
                del warm
                _, run, _, _ = _make(fw, name, gd, weights)
                for mode in modes:
                    rec = measure(run, mode, spec["repeats"], spec["max_seconds"])
                    append_jsonl(spec["out"], {"framework": fw, "model": name, **rec})
                    done.add(mode)
            except Exception as e:  # noqa: BLE001 - recorded as a skipped row, never hidden
                if not is_oom(e):
                    raise
                for mode in modes:
                    if mode not in done:
                        append_jsonl(spec["out"], {"framework": fw, "model": name, "mode": mode,
                                                   "status": _oom_reason(spec, e)})
            run = None  # the next model's baseline memory must not include this one's


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


def _wait(proc, idle_timeout, progress):
    """Wait for ``proc``. ``progress()`` returns a count of finished pieces of work (polled
    twice a second); the worker is killed when it has not grown for ``idle_timeout`` seconds.
    Returns (exit code or "timeout", output)."""
    import threading
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    last, seen = time.time(), progress()
    while proc.poll() is None:
        now_seen = progress()
        if now_seen != seen:
            last, seen = time.time(), now_seen
        if time.time() - last > idle_timeout:
            proc.kill()
            proc.wait()
            reader.join(5)
            return "timeout", "".join(chunks)
        time.sleep(0.5)
    reader.join(10)
    progress()
    return proc.returncode, "".join(chunks)


def _run_items(kind, items, make_spec, finished, progress, spec_path, args, *, fatal=False):
    """Work through ``items`` (in the order a worker takes them) in worker processes: a worker
    that makes no progress for ``--worker-timeout`` seconds, fails, or dies of a signal (e.g.
    the kernel's OOM killer) loses the item it was on, and a fresh worker takes the rest.
    ``finished()`` is the set of items done. Returns ``{item: reason}`` for the lost ones (the
    reason ends with the worker's last output line, e.g. a traceback's). With ``fatal``, a
    worker that exits with a Python error (a bug, not a resource limit: out-of-memory errors
    are caught in the worker) stops the run with SystemExit and the worker's output."""
    lost = {}
    todo = list(items)
    while todo:
        proc = _spawn(kind, make_spec(todo), spec_path, args)
        rc, text = _wait(proc, args.worker_timeout, progress)
        done = finished()
        todo = [i for i in todo if i not in done]
        if not todo:
            break
        last = text.strip().splitlines()[-1][:200] if text.strip() else ""
        if fatal and rc != "timeout" and rc > 0:
            raise SystemExit(f"the {kind} worker failed (exit {rc}) on {todo[0]}:\n{text[-3000:]}")
        if rc == "timeout":
            why = f"worker made no progress for {args.worker_timeout:g} s (killed)"
        elif rc < 0:
            why = f"worker killed by signal {-rc}"
        else:
            why = f"worker failed (exit {rc}): {last}"
        lost[todo.pop(0)] = why
        sys.stderr.write(f"\n{kind} worker: {why}\n{text[-2000:] if rc not in ('timeout',) and rc > 0 else ''}")
    return lost


def gate(args, frameworks, models, stats, work: Path, bar):
    """Eval-mode outputs and parameter gradients of every framework vs ngra (from the saved
    graph and weights, in worker processes). Returns ``(rows, skipped)``: one row per
    framework x model x check (output, gradient), and ``{(framework, model): {mode: reason}}``
    for what could not be checked (out of memory, timed out), which is then not timed.
    Raises SystemExit on a disagreement, before any timing."""
    out_dir = work / "gate"
    out_dir.mkdir(exist_ok=True)
    for f in out_dir.iterdir():
        f.unlink()  # results of an earlier run must not pass for this one's
    main = [f for f in frameworks if f != "dgl"]
    if "ngra" not in main:
        main = ["ngra", *main]  # the reference
    groups = [("main", main)] + ([("dgl", ["dgl"])] if "dgl" in frameworks else [])
    lost = {}
    for kind, fws in groups:
        items = [(m, f) for m in models for f in fws]

        def finished():
            return {(m, f) for m, f in items if (out_dir / f"{f}_{m}.npy").exists()
                    or (out_dir / f"{f}_{m}.skipped").exists()}

        def make_spec(todo):
            return {"task": "gate", "data_dir": str(work), "items": todo, "out": str(out_dir),
                    "mem_limit_gb": args.mem_limit_gb}
        bar.set_postfix_str(f"gate {kind} on {stats['dataset']}")
        got = _run_items("dgl" if kind == "dgl" else "main", items, make_spec, finished,
                         lambda: len(finished()), work / f"gate_{kind}.json", args, fatal=True)
        lost.update({(f, m): why for (m, f), why in got.items()})
        bar.update(1)
    for (f, m), why in lost.items():
        (out_dir / f"{f}_{m}.skipped").write_text(f"skipped: {why}")
    rows, skipped = compare_outputs(out_dir, frameworks, models, stats["dataset"], args.tol)
    grows, gskipped = compare_gradients(out_dir, frameworks, models, stats["dataset"], args.grad_tol)
    for key, why in gskipped.items():
        skipped.setdefault(key, {}).setdefault("training", why)
    return rows + grows, skipped


def _gate_failure(bad, what, tol_flag):
    lines = "\n".join(f"  {r['framework']} {r['model']} on {r['dataset']}: {r['detail']} = "
                      f"{r['max_rel_error']:.3g} > {tol_flag}" for r in bad)
    return SystemExit(f"correctness gate failed ({what}); no timings taken:\n{lines}")


def compare_outputs(out_dir: Path, frameworks, models, dataset: str, tol: float):
    """The gate's check on the saved outputs ``<fw>_<model>.npy`` (``.skipped`` holds why one is
    missing): every framework's output against ngra's, ``max |out - ngra| / max |ngra| <= tol``.
    Returns ``(rows, {(fw, model): {mode: reason}})``; raises SystemExit listing every
    disagreement."""
    rows, skipped = [], {}
    for name in models:
        ref_path = out_dir / f"ngra_{name}.npy"
        if not ref_path.exists():
            reason = "gate " + (out_dir / f"ngra_{name}.skipped").read_text()
            for fw in frameworks:
                skipped[(fw, name)] = {"inference": reason, "training": reason}
            continue
        ref = np.load(ref_path)
        scale = float(np.abs(ref).max()) or 1.0
        for fw in frameworks:
            if fw == "ngra":
                continue
            path = out_dir / f"{fw}_{name}.npy"
            if not path.exists():
                reason = "gate " + (out_dir / f"{fw}_{name}.skipped").read_text()
                skipped[(fw, name)] = {"inference": reason, "training": reason}
                continue
            other = np.load(path)
            err = float(np.abs(other - ref).max()) / scale if other.shape == ref.shape else math.inf
            if math.isnan(err):
                err = math.inf
            rows.append({"framework": fw, "model": name, "dataset": dataset, "check": "output",
                         "max_rel_error": err, "ok": bool(err <= tol),
                         "detail": "max |out - ngra| / max |ngra|"})
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise _gate_failure(bad, "outputs", f"--tol {tol}")
    return rows, skipped


def compare_gradients(out_dir: Path, frameworks, models, dataset: str, tol: float):
    """The gate's check on the saved parameter gradients ``<fw>_<model>_grad.npz`` (eval mode,
    mean cross-entropy over all vertices): the same parameter names as ngra's, and for each
    parameter ``max |g - g_ngra| / max |g_ngra| <= tol`` (each tensor at its own scale; a tensor
    whose ngra gradient is all zero is compared absolutely). Returns ``(rows, {(fw, model):
    reason})`` for gradients that are missing (the training step is then not timed); raises
    SystemExit listing every disagreement."""
    rows, skipped = [], {}
    for name in models:
        ref_path = out_dir / f"ngra_{name}_grad.npz"
        if not ref_path.exists():
            why = out_dir / f"ngra_{name}_grad.skipped"
            reason = "gradient gate: ngra's " + (why.read_text() if why.exists() else "gradient is missing")
            for fw in frameworks:
                skipped[(fw, name)] = reason
            continue
        ref = dict(np.load(ref_path))
        for fw in frameworks:
            if fw == "ngra":
                continue
            path = out_dir / f"{fw}_{name}_grad.npz"
            if not path.exists():
                why = out_dir / f"{fw}_{name}_grad.skipped"
                if not why.exists():
                    why = out_dir / f"{fw}_{name}.skipped"
                skipped[(fw, name)] = "gradient gate " + (why.read_text() if why.exists() else "missing")
                continue
            other = dict(np.load(path))
            if set(other) != set(ref):
                err, detail = math.inf, (f"parameters differ: missing {sorted(set(ref) - set(other))}, "
                                         f"extra {sorted(set(other) - set(ref))}")
            else:
                errs = {}
                for k, r in ref.items():
                    scale = float(np.abs(r).max()) or 1.0
                    e = (float(np.abs(other[k] - r).max()) / scale if other[k].shape == r.shape
                         else math.inf)
                    errs[k] = math.inf if math.isnan(e) else e
                worst = max(errs, key=errs.get)
                err, detail = errs[worst], f"max |grad - ngra| / max |ngra| of {worst}"
            rows.append({"framework": fw, "model": name, "dataset": dataset, "check": "gradient",
                         "max_rel_error": err, "ok": bool(err <= tol), "detail": detail})
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise _gate_failure(bad, "gradients", f"--grad-tol {tol}")
    return rows, skipped


def time_dataset(args, frameworks, models, stats, work: Path, skipped, bar):
    """Timing records of every framework x model x mode on one dataset, one worker process per
    framework (restarted past a model that hangs or kills it); what the gate skipped and what
    was lost is recorded with its reason."""
    records = []
    for fw in frameworks:
        plan = []
        for m in models:
            modes = [mode for mode in args.modes if mode not in skipped.get((fw, m), {})]
            for mode in args.modes:
                if mode not in modes:
                    records.append({"framework": fw, "model": m, "mode": mode,
                                    "status": skipped[(fw, m)][mode]})
                    bar.update(1)
            if modes:
                plan.append((m, modes))
        if not plan:
            continue
        out = work / f"time_{fw}.jsonl"
        out.unlink(missing_ok=True)
        bar.set_postfix_str(f"{fw} on {stats['dataset']}")
        counted = [0]

        def lines():
            return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

        def progress():
            got = lines()
            n = sum("event" not in r for r in got)
            if n > counted[0]:
                bar.update(n - counted[0])
                counted[0] = n
            return len(got)

        def finished():
            seen = {(r["model"], r["mode"]) for r in lines() if "event" not in r}
            return {(m, tuple(modes)) for m, modes in plan if all((m, x) in seen for x in modes)}

        def make_spec(todo):
            return {"task": "time", "data_dir": str(work), "plan": [[m, list(ms)] for m, ms in todo],
                    "frameworks": [fw], "repeats": args.repeats, "max_seconds": args.max_seconds,
                    "out": str(out), "mem_limit_gb": args.mem_limit_gb}
        items = [(m, tuple(modes)) for m, modes in plan]
        lost = _run_items(fw, items, make_spec, finished, progress, work / f"time_{fw}.json", args)
        got = [r for r in lines() if "event" not in r]
        records += got
        seen = {(r["model"], r["mode"]) for r in got}
        for (m, modes), why in lost.items():
            for mode in modes:
                if (m, mode) not in seen:
                    records.append({"framework": fw, "model": m, "mode": mode,
                                    "status": f"skipped: {why}"})
                    bar.update(1)
    for r in records:
        r["dataset"] = stats["dataset"]
    return records


PHASES = ("forward", "backward", "step", "total")


def long_rows(records, stats_by_ds):
    """One row per framework x model x dataset x mode x phase x stage: ``forward`` and (training)
    ``backward`` rows for each of the four stages, a ``step`` row (stage ``Optimizer``, training)
    and a ``total`` row (stage ``Total``). A configuration that did not run has only its Total
    row, with the reason in ``status``."""
    from characterize_models import estimate
    rows = []
    for r in records:
        st = stats_by_ds[r["dataset"]]
        base = {"framework": r["framework"], "model": r["model"], "dataset": r["dataset"],
                "mode": r["mode"], "num_nodes": st["num_nodes"], "num_edges": st["num_edges"]}
        if "status" in r:
            rows.append({**base, "phase": "total", "stage": "Total", "seconds": "", "flops_est": "",
                         "bytes_est": "", "peak_mem_mb": "", "repeats": 0, "status": r["status"],
                         "note": ""})
            continue
        est = estimate(r["model"], st["num_nodes"], st["num_edges"], st["features"], st["classes"])
        peak = "" if r["peak_bytes"] is None else round(r["peak_bytes"] / 2**20, 2)
        common = {"peak_mem_mb": peak, "repeats": r["repeats"], "status": "ok"}
        training = r["mode"] == "training"

        def row(phase, stage, sec, fl, by, note=""):
            rows.append({**base, "phase": phase, "stage": stage, "seconds": sec, "flops_est": fl,
                         "bytes_est": by, **common, "note": note})
        for s in STAGES:
            row("forward", s, r["stages"][s], *est[s], STAGE_NOTES.get((r["framework"], s), ""))
        if training:
            for s in STAGES:
                note = STAGE_NOTES.get((r["framework"], s), "")
                if s == "ApplyVertex":
                    note = BACKWARD_RESIDUAL_NOTE
                row("backward", s, r["backward_stages"][s], 2 * est[s][0], 2 * est[s][1], note)
            row("step", "Optimizer", r["step"], "", "", "Adam step; not estimated")
        k = 3 if training else 1
        row("total", "Total", r["total"], k * sum(f for f, _ in est.values()),
            k * sum(b for _, b in est.values()), "estimates exclude the optimizer" if training else "")
    return rows


BACKWARD_RESIDUAL_NOTE = ("backward total minus the attributed Scatter/ApplyEdge/Gather nodes: "
                          "vertex-side work, loss, gradient accumulation, autograd overhead")
CSV_COLUMNS = ["framework", "model", "dataset", "mode", "phase", "stage", "seconds", "flops_est",
               "bytes_est", "peak_mem_mb", "repeats", "num_nodes", "num_edges", "status", "note"]


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)


# -- report and figures -------------------------------------------------------------------------
def _index(rows):
    """``(total seconds, {phase: {stage: seconds}}, peak MiB)``, each keyed by (framework,
    model, dataset, mode), for the configurations that ran."""
    tot, stage, mem = {}, {}, {}
    for r in rows:
        if r["status"] != "ok":
            continue
        key = (r["framework"], r["model"], r["dataset"], r["mode"])
        if r["phase"] == "total":
            tot[key] = r["seconds"]
            mem[key] = r["peak_mem_mb"]
        else:
            stage.setdefault(key, {}).setdefault(r["phase"], {})[r["stage"]] = r["seconds"]
    return tot, stage, mem


def _gmean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _dominant(stages: dict) -> str:
    return max(STAGES, key=lambda s: stages[s])


def findings(rows, frameworks, models, datasets):
    """Headline findings computed from the rows (the same text goes to the report)."""
    from characterize_models import MODELS
    tot, stage, _ = _index(rows)
    lines = []
    for mode in MODES:
        for phase in ("forward", "backward") if mode == "training" else ("forward",):
            dom = []
            for m in models:
                counts = {}
                for d in datasets:
                    st = stage.get(("ngra", m, d, mode), {}).get(phase)
                    if st:
                        top = _dominant(st)
                        counts[top] = counts.get(top, 0) + 1
                if counts:
                    top = max(counts, key=counts.get)
                    dom.append(f"{MODELS[m][1]}: {top} ({counts[top]}/{sum(counts.values())})")
            if dom:
                lines.append(f"- **{mode}**, dominant {phase} stage on ngra (datasets where it is "
                             f"the largest): " + "; ".join(dom) + ".")
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
                         f"{_gmean(ratios.values()):.2f}x over {len(ratios)} model x dataset pairs "
                         f"that both ran; ngra faster in {wins}; best for ngra {ratios[best]:.2f}x "
                         f"({MODELS[best[0]][1]} on {best[1]}), worst {ratios[worst]:.2f}x "
                         f"({MODELS[worst[0]][1]} on {worst[1]}).")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        by_fw = {}
        for r in skipped:
            by_fw[r["framework"]] = by_fw.get(r["framework"], 0) + 1
        lines.append("- Not measured (see Skipped): " + ", ".join(f"{f} {n}" for f, n in by_fw.items())
                     + " model x dataset x mode configurations.")
    return lines


def _cell(tot, stage, mem, key):
    """``total ms (dominant forward stage share[, dominant backward stage share]; peak MiB)``."""
    if key not in tot:
        return "skipped"
    parts = []
    for phase in ("forward", "backward"):
        st = stage[key].get(phase)
        if st:
            top = _dominant(st)
            share = st[top] / max(sum(st[s] for s in STAGES), 1e-12)
            parts.append(f"{'bwd ' if phase == 'backward' else ''}{top} {share:.0%}")
    mm = mem.get(key)
    return f"{tot[key] * 1e3:.1f} ({', '.join(parts)}; {mm if mm != '' else '?'} MiB)"


def write_report(path, rows, gate_rows, stats, frameworks, models, args, wall, command,
                 resumed=()):
    import torch

    from characterize_models import GAT_HEADS, GAT_HIDDEN, HIDDEN, MODELS, NUM_LAYERS, NUM_RELATIONS
    tot, stage, mem = _index(rows)
    datasets = [s["dataset"] for s in stats]
    L = ["# GNN characterization: ngra vs PyG vs DGL", "",
         f"Command: `{command}`  ", f"Wall time: {wall / 60:.1f} min on {os.cpu_count()} CPU cores "
         f"({platform.processor() or platform.machine()}), torch {torch.__version__}; "
         f"one untimed warm-up run per configuration (its peak memory is reported; its time, "
         "which holds one-time work such as building a transposed CSR on first use, is not), "
         + ("then one timed run. A " if args.repeats == 1 else
            f"then the best of 1 to {args.repeats} timed runs (the `repeats` column says how many "
            f"ran; no new one starts after {args.max_seconds:g} s). A ")
         + f"worker that made no progress for {args.worker_timeout:g} s was killed and the "
         f"configuration recorded as skipped; workers ran under a {args.mem_limit_gb:g} GiB "
         "data-segment limit. The machine was shared with other jobs: expect noise."
         + (f" Resumed (`--resume`): the timings of {', '.join(resumed)} come from an earlier "
            "invocation and the wall time above does not include them." if resumed else ""), "",
         f"Models: {', '.join(MODELS[m][1] for m in models)}; {NUM_LAYERS} graph layers, hidden "
         f"{HIDDEN} (GAT: {GAT_HEADS} heads x {GAT_HIDDEN}), R-GCN with {NUM_RELATIONS} random edge "
         "types. Inference = one eval-mode forward; training step = train-mode forward, "
         "cross-entropy over all vertices and backward (phase `backward`), Adam step (phase "
         "`step`).", "",
         "## Datasets", "", "| dataset | vertices | edges | features | classes |", "|---|---|---|---|---|"]
    L += [f"| {s['dataset']} | {s['num_nodes']:,} | {s['num_edges']:,} | {s['features']} | "
          f"{s['classes']} |" for s in stats]
    L += ["", "Self loops are removed from every graph when it is saved (multi-edges kept); GCN and "
          "GAT add one self loop per vertex. R-MAT: Graph500 parameters, random N(0,1) features "
          "and random labels.", "", "## Correctness gate", "",
          "Before any timing, every framework computes, from the same saved graph and weights and "
          "in eval mode (no dropout), the model's output and the gradients of all parameters of "
          "the mean cross-entropy over all vertices. The run stops unless, against ngra, "
          f"max |out - ngra| / max |ngra| <= {args.tol:g} (output) and, for every parameter "
          f"tensor, max |grad - ngra| / max |ngra| <= {args.grad_tol:g} (gradient; the table "
          "shows the worst tensor). What did not fit in memory is not compared and not timed "
          "(see Skipped).", "",
          "| framework | model | dataset | check | max rel. error | worst |", "|---|---|---|---|---|---|"]
    L += [f"| {g['framework']} | {MODELS[g['model']][1]} | {g['dataset']} | {g['check']} | "
          f"{g['max_rel_error']:.2e} | {g['detail'].rsplit(' of ', 1)[-1] if g['check'] == 'gradient' else ''} |"
          for g in gate_rows]
    L += ["", "## Headline findings", ""] + findings(rows, frameworks, models, datasets)
    for mode in args.modes:
        what = ("dominant forward stage" if mode == "inference"
                else "dominant forward and backward stage")
        L += ["", f"## {mode.capitalize()}: total time (ms), {what}, peak memory (MiB)", ""]
        for d in datasets:
            L += [f"### {d}", "", "| model | " + " | ".join(frameworks) + " | "
                  + " | ".join(f"{f} / ngra" for f in frameworks if f != "ngra") + " |",
                  "|---" * (1 + 2 * len(frameworks) - 1) + "|"]
            for m in models:
                cells = [_cell(tot, stage, mem, (f, m, d, mode)) for f in frameworks]
                ratios = []
                for f in frameworks:
                    if f == "ngra":
                        continue
                    a, b = tot.get((f, m, d, mode)), tot.get(("ngra", m, d, mode))
                    ratios.append(f"{a / b:.2f}x" if a and b else "-")
                L.append(f"| {MODELS[m][1]} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
            L.append("")
    if "training" in args.modes:
        L += ["## Training step by phase and stage (ms)", "",
              "Forward (F) and backward (B) per stage, optimizer step, total.", ""]
        head = ("| dataset | model | framework | " + " | ".join(f"F {s}" for s in STAGES) + " | "
                + " | ".join(f"B {s}" for s in STAGES) + " | step | total |")
        L += [head, "|---" * (3 + 2 * len(STAGES) + 2) + "|"]
        for d in datasets:
            for m in models:
                for f in frameworks:
                    k = (f, m, d, "training")
                    if k not in tot:
                        continue
                    st = stage[k]
                    L.append(f"| {d} | {MODELS[m][1]} | {f} | "
                             + " | ".join(f"{st['forward'][s] * 1e3:.1f}" for s in STAGES) + " | "
                             + " | ".join(f"{st['backward'][s] * 1e3:.1f}" for s in STAGES)
                             + f" | {st['step']['Optimizer'] * 1e3:.1f} | {tot[k] * 1e3:.1f} |")
        L.append("")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        L += ["## Skipped", "", "Configurations that did not run, with the reason.", "",
              "| framework | model | dataset | mode | reason |", "|---|---|---|---|---|"]
        L += [f"| {r['framework']} | {r['model']} | {r['dataset']} | {r['mode']} | "
              f"{r['status'].replace('|', '/')} |" for r in skipped]
        L.append("")
    L += ["## How stages are attributed", "",
          "Forward:", "",
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
          "`RelGraphConv`) where ngra and PyG aggregate first.", "",
          "Backward (training step), the same way in all three frameworks: PyTorch numbers every "
          "autograd node it creates (the sequence number torch.profiler uses to link a backward "
          "op to its forward op). While a forward stage runs (an ngra IR node; a PyG hook "
          "segment; a DGL stage block), the numbers it hands out are recorded; every autograd "
          "node created in that range gets a pre-hook and a hook that time its backward under "
          "that stage (ngra: `ngra.profile.stages(backward=True)`, `backward_totals()`). So the "
          "backward of a fused g-SpMM counts as Gather, the weight gradient of a lifted "
          "projection as ApplyEdge. Backward Scatter, ApplyEdge and Gather are the hooked times; "
          "backward ApplyVertex is the rest of loss + backward (the vertex-side ops, the loss, "
          "gradient accumulation into the parameters and the autograd engine's overhead), as "
          "the forward's residual is. The optimizer step is its own row (`step`, `Optimizer`). "
          "`Total` = forward + backward + step. Checked on known cases in "
          "tests/ngra/test_profile.py (a layer that is only a g-SpMM puts all its backward in "
          "Gather; sleeps in a Scatter and an ApplyVertex backward land there).", "",
          "## Memory", "",
          "`peak_mem_mb`: resident-set high-water mark during the first run of a configuration "
          "minus the resident set just before it (graph, features, weights, compiled programs and "
          "optimizer already loaded), in a worker process per framework x dataset with "
          "`MALLOC_MMAP_THRESHOLD_=65536` (freed tensors return to the OS) and the high-water mark "
          "reset through `/proc/self/clear_refs` before each configuration. A training step's "
          "peak includes its forward. Workers run under a data-segment limit of "
          f"{args.mem_limit_gb:g} GiB (RLIMIT_DATA); a configuration that exceeds it is recorded "
          "as skipped.", "",
          "## FLOPs and bytes estimates", "",
          "Columns `flops_est` / `bytes_est` come from a simple analytic model of each model's "
          "SAGA dataflow (`characterize_models.estimate`), the same for every framework: Linear "
          "`rows x in -> out` = 2 rows in out FLOPs; element-wise on n values = k n FLOPs and "
          "(reads + 1) 4n bytes; Scatter of F features = E (8F + 8) bytes; Gather (sum/mean) = E F "
          "FLOPs and E (4F + 8) + 4 N F bytes; float32 values and int64 indices. It counts the "
          "algorithm's work, not an implementation's (fusion saves bytes that the estimate still "
          "counts). Backward of a stage = 2x its forward estimate; the optimizer step is not "
          "estimated.", "",
          "## Figures", "", *[f"![{p}]({p})" for p in sorted(x.name for x in Path(path).parent.glob("*.png"))]]
    Path(path).write_text("\n".join(L) + "\n")


STAGE_COLORS = {"Scatter": "#4C72B0", "ApplyEdge": "#DD8452", "Gather": "#55A868",
                "ApplyVertex": "#C44E52", "Optimizer": "#999999"}


def plot(rows, frameworks, models, datasets, modes, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from characterize_models import MODELS
    tot, stage, mem = _index(rows)
    cols = min(3, len(datasets))
    nrow = math.ceil(len(datasets) / cols)
    for mode in modes:
        parts = [("forward", s) for s in STAGES]
        if mode == "training":
            parts += [("backward", s) for s in STAGES] + [("step", "Optimizer")]
        fig, axes = plt.subplots(nrow, cols, figsize=(6 * cols, 3.8 * nrow), squeeze=False)
        width = 0.8 / len(frameworks)
        for ax, d in zip(axes.flat, datasets):
            for j, f in enumerate(frameworks):
                xs = np.arange(len(models)) + (j - (len(frameworks) - 1) / 2) * width
                bottom = np.zeros(len(models))
                for phase, s in parts:
                    vals = np.array([stage.get((f, m, d, mode), {}).get(phase, {}).get(s, 0.0) * 1e3
                                     for m in models])
                    label = (f"{s} ({phase})" if phase == "backward" else s) if j == 0 else None
                    ax.bar(xs, vals, width, bottom=bottom, color=STAGE_COLORS[s], label=label,
                           hatch="///" if phase == "backward" else None, edgecolor="white",
                           linewidth=0.3)
                    bottom += vals
                for x, m in zip(xs, models):
                    if (f, m, d, mode) not in tot:  # not measured: say so on the axis
                        ax.text(x, 0, "x", ha="center", va="bottom", fontsize=6, color="black")
            ax.set_xticks(range(len(models)), [MODELS[m][1] for m in models], rotation=30, fontsize=8)
            ax.set_title(f"{d}: bars = {' | '.join(frameworks)} (x: not measured)", fontsize=8)
            ax.set_ylabel("ms")
        for ax in list(axes.flat)[len(datasets):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=6, ncol=2)
        fig.suptitle(f"Per-stage time, {mode} (one bar per framework, in the order of the title"
                     + ("; hatched: backward, grey: optimizer step)" if mode == "training" else ")"))
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
                   help="no further timed run of a configuration starts after this many seconds "
                        "(there is always at least one after the warm-up)")
    p.add_argument("--worker-timeout", type=float, default=1800.0,
                   help="kill a worker that finishes nothing (one model x mode, or one gate "
                        "check) for this many seconds; the configuration is recorded as "
                        "skipped and a fresh worker goes on with the rest")
    p.add_argument("--mem-limit-gb", type=float, default=8.0,
                   help="data-segment limit (RLIMIT_DATA, GiB) of each worker; configurations "
                        "beyond it are recorded as skipped")
    p.add_argument("--tol", type=float, default=1e-4, help="correctness gate tolerance (outputs)")
    p.add_argument("--grad-tol", type=float, default=1e-3,
                   help="correctness gate tolerance (parameter gradients, per tensor)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the gate and timing results of datasets that an earlier run with "
                        "the same settings finished under --out")
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
    stats, gate_rows, records, resumed = [], [], [], []
    gate_key = {"models": models, "frameworks": frameworks, "tol": args.tol,
                "grad_tol": args.grad_tol, "mem_limit_gb": args.mem_limit_gb}
    time_key = {**gate_key, "modes": args.modes, "repeats": args.repeats,
                "max_seconds": args.max_seconds, "worker_timeout": args.worker_timeout}
    # Phase 1: data and the gate for every dataset, before any timing.
    skipped_by_ds = {}
    with tqdm(total=len(datasets) * (2 + ("dgl" in frameworks)), desc="data + gate") as bar:
        for d in datasets:
            work = out / "work" / d
            bar.set_postfix_str(d)
            done = _load_done(work / "gate_done.json", gate_key) if args.resume else None
            if done:
                st, rows, skipped = done["stats"], done["rows"], _skipped_from_json(done["skipped"])
                bar.update(2 + ("dgl" in frameworks))
            else:
                st = prepare_dataset(d, args.root, work)
                save_weights(models, st, work)
                bar.update(1)
                rows, skipped = gate(args, frameworks, models, st, work, bar)
                _save_done(work / "gate_done.json", gate_key, stats=st, rows=rows,
                           skipped=_skipped_to_json(skipped))
            stats.append(st)
            gate_rows += rows
            skipped_by_ds[d] = skipped
    # Phase 2: timings.
    total = len(datasets) * len(frameworks) * len(models) * len(args.modes)
    with tqdm(total=total, desc="timing") as bar:
        for st in stats:
            d = st["dataset"]
            work = out / "work" / d
            done = _load_done(work / "time_done.json", time_key) if args.resume else None
            if done:
                records += done["records"]
                resumed.append(d)
                bar.update(len(frameworks) * len(models) * len(args.modes))
                continue
            got = time_dataset(args, frameworks, models, st, work, skipped_by_ds[d], bar)
            _save_done(work / "time_done.json", time_key, records=got)
            records += got
    rows = long_rows(records, {s["dataset"]: s for s in stats})
    write_csv(rows, out / "results.csv")
    with open(out / "gate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["framework", "model", "dataset", "check", "max_rel_error",
                                          "ok", "detail"])
        w.writeheader()
        w.writerows(gate_rows)
    plot(rows, frameworks, models, datasets, args.modes, out)
    wall = time.time() - start
    write_report(out / "report.md", rows, gate_rows, stats, frameworks, models, args, wall,
                 command, resumed)
    print(f"wrote {out / 'results.csv'}, {out / 'report.md'} and figures in {wall / 60:.1f} min")
    for line in findings(rows, frameworks, models, datasets):
        print(line)
    return 0


def _save_done(path: Path, key: dict, **data):
    """A dataset's finished phase, for ``--resume`` (written only once the phase completed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, **data}))
    tmp.replace(path)


def _load_done(path: Path, key: dict):
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("key") != key:
        print(f"--resume: {path} was made with other settings; redoing it", file=sys.stderr)
        return None
    return data


def _skipped_to_json(skipped):
    return [[f, m, modes] for (f, m), modes in skipped.items()]


def _skipped_from_json(items):
    return {(f, m): modes for f, m, modes in items}


if __name__ == "__main__":
    sys.exit(main())
