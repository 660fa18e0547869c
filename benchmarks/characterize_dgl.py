"""DGL side of the characterization benchmark; runs in the DGL environment (torch 2.2, DGL 2.1):

    DGLBACKEND=pytorch .venv-dgl/bin/python benchmarks/characterize_dgl.py SPEC.json

``SPEC.json``: ``{"task": "gate", "data_dir", "items": [[model, "dgl"], ...], "out",
"mem_limit_gb"}`` or ``{"task": "time", "data_dir", "plan": [[model, [modes]], ...], "repeats",
"max_seconds", "out", "mem_limit_gb"}``. It reads the graph (``graph.npz``) and each model's
weights (``weights_<model>.npz``, ngra's ``state_dict`` names, which the models below share)
written by ``characterize.py``. ``gate`` writes ``<out>/dgl_<model>.npy`` (eval-mode output)
and ``<out>/dgl_<model>_grad.npz`` (parameter gradients), or ``.skipped`` files saying what did
not fit in memory; ``time`` appends a start marker and one JSON line per model and mode to
``out`` (see ``characterize_common.measure``).

The models are written with DGL's message-passing API (``apply_edges``, ``update_all`` with
built-in functions, ``edge_softmax``), as DGL's own layers are, so that each stage can be timed:

- ``update_all`` with built-in message and reducer is one fused kernel (Scatter + ApplyEdge +
  Gather): counted as Gather, as ngra's g-SpMM is; DGL has no separate Scatter.
- ``apply_edges`` and ``edge_softmax`` (and vertex-side projections whose only use is the
  edge computation, as in ngra's lifted ApplyEdge) count as ApplyEdge; GCN's source transform
  ``W x d^-1/2`` counts as Scatter (ngra's ``scatter()``).
- Everything else (degrees, activations, dropout, MLPs, GRU, root/skip terms) is ApplyVertex,
  as the residual of the forward total.

Backward: every stage block also records the sequence numbers of the autograd nodes it creates
(``StageTimer.backward``), whose backward is then timed under that stage, as for ngra and PyG
(``characterize_common.BackwardStages``); DGL's own kernels (``GSpMM``, ``GSDDMM``,
``EdgeSoftmax``) are ordinary autograd Functions, so this works without changes to DGL.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("DGLBACKEND", "pytorch")
import dgl  # noqa: E402
import dgl.function as fn  # noqa: E402
from dgl.nn.functional import edge_softmax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from characterize_common import (StageTimer, append_jsonl, gate_gradients, inference_step,  # noqa: E402
                                 is_oom, limit_memory, load_graph, mark_start, measure,
                                 tiny_subgraph, training_step)

HIDDEN, GAT_HIDDEN, GAT_HEADS, NUM_LAYERS, NUM_RELATIONS = 16, 8, 8, 2, 4


class GCN(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.lin = torch.nn.Linear(i, o, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(o))

    def forward(self, G, x, T):
        g = G["loop"]
        norm = g.in_degrees().to(x.dtype).clamp(min=1).pow(-0.5).unsqueeze(1)
        with g.local_scope():
            with T("Scatter"):
                g.srcdata["h"] = self.lin(x) * norm
            with T("Gather"):
                g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                acc = g.dstdata["h"]
        return acc * norm + self.bias


class SAGE(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.lin_l = torch.nn.Linear(i, o)
        self.lin_r = torch.nn.Linear(i, o, bias=False)

    def forward(self, G, x, T):
        g = G["plain"]
        with g.local_scope():
            with T("Gather"):
                g.srcdata["h"] = x
                g.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
                acc = g.dstdata["h"]
        return self.lin_l(acc) + self.lin_r(x)


class GAT(torch.nn.Module):
    def __init__(self, i, o, heads, concat, dropout):
        super().__init__()
        self.heads, self.out, self.concat, self.dropout = heads, o, concat, dropout
        self.lin = torch.nn.Linear(i, heads * o, bias=False)
        self.att_src = torch.nn.Parameter(torch.zeros(1, heads, o))
        self.att_dst = torch.nn.Parameter(torch.zeros(1, heads, o))
        self.bias = torch.nn.Parameter(torch.zeros(heads * o if concat else o))

    def forward(self, G, x, T):
        g = G["loop"]
        with g.local_scope():
            with T("ApplyEdge"):
                z = self.lin(x).view(-1, self.heads, self.out)
                g.srcdata.update(z=z, el=(z * self.att_src).sum(-1, keepdim=True))
                g.dstdata["er"] = (z * self.att_dst).sum(-1, keepdim=True)
                g.apply_edges(fn.u_add_v("el", "er", "e"))
                a = edge_softmax(g, F.leaky_relu(g.edata.pop("e"), 0.2))
                g.edata["a"] = F.dropout(a, self.dropout, self.training)
            with T("Gather"):
                g.update_all(fn.u_mul_e("z", "a", "m"), fn.sum("m", "z"))
                acc = g.dstdata["z"]
        out = acc.reshape(-1, self.heads * self.out) if self.concat else acc.mean(1)
        return out + self.bias


class GIN(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.nn = torch.nn.Sequential(torch.nn.Linear(i, HIDDEN), torch.nn.ReLU(),
                                      torch.nn.Linear(HIDDEN, o))
        self.register_buffer("eps", torch.zeros(1))

    def forward(self, G, x, T):
        g = G["plain"]
        with g.local_scope():
            with T("Gather"):
                g.srcdata["h"] = x
                g.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                acc = g.dstdata["h"]
        return self.nn((1 + self.eps) * x + acc)


class GGCN(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.lin_key, self.lin_query, self.lin_value = (torch.nn.Linear(i, o) for _ in range(3))
        self.lin_skip = torch.nn.Linear(i, o, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(o))

    def forward(self, G, x, T):
        g = G["plain"]
        with g.local_scope():
            with T("ApplyEdge"):
                g.dstdata["k"] = self.lin_key(x)
                g.srcdata.update(q=self.lin_query(x), v=self.lin_value(x))
                g.apply_edges(fn.u_add_v("q", "k", "s"))
                g.edata["gate"] = torch.sigmoid(g.edata.pop("s"))
            with T("Gather"):
                g.update_all(fn.u_mul_e("v", "gate", "m"), fn.sum("m", "h"))
                acc = g.dstdata["h"]
        return acc + self.lin_skip(x) + self.bias


class GGNN(torch.nn.Module):
    def __init__(self, o):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUM_LAYERS, o, o))
        self.rnn = torch.nn.GRUCell(o, o)

    def forward(self, G, x, T):
        g = G["plain"]
        h = x
        for t in range(NUM_LAYERS):
            m = h @ self.weight[t]
            with g.local_scope():
                with T("Gather"):
                    g.srcdata["m"] = m
                    g.update_all(fn.copy_u("m", "x"), fn.sum("x", "m"))
                    acc = g.dstdata["m"]
            h = self.rnn(acc, h)
        return h


class RGCN(torch.nn.Module):
    """As DGL's ``RelGraphConv``: each edge's message is ``x_src W_type`` (``gather_mm``) times
    ``1 / |N_type(dst)|``, summed; plus the root term. (PyG and ngra aggregate first and
    transform after.)"""

    def __init__(self, i, o):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUM_RELATIONS, i, o))
        self.root = torch.nn.Parameter(torch.zeros(i, o))
        self.bias = torch.nn.Parameter(torch.zeros(o))

    def forward(self, G, x, T):
        g = G["plain"]
        et = g.edata["etype"]
        # 1 / (in-edges of the same type at the destination), per edge.
        key = g.edges()[1] * NUM_RELATIONS + et
        cnt = torch.bincount(key, minlength=g.num_nodes() * NUM_RELATIONS).to(x.dtype)
        norm = (1.0 / cnt[key]).unsqueeze(1)
        with g.local_scope():
            with T("ApplyEdge"):
                g.srcdata["h"] = x
                g.edata["norm"] = norm
                W = self.weight
                g.apply_edges(lambda e: {"m": dgl.ops.gather_mm(e.src["h"], W, idx_b=e.data["etype"])
                                         * e.data["norm"]})
            with T("Gather"):
                g.update_all(fn.copy_e("m", "m"), fn.sum("m", "h"))
                acc = g.dstdata["h"]
        return acc + x @ self.root + self.bias


class CommNet(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.lin_self = torch.nn.Linear(i, o)
        self.lin_comm = torch.nn.Linear(i, o, bias=False)

    def forward(self, G, x, T):
        g = G["plain"]
        with g.local_scope():
            with T("Gather"):
                g.srcdata["h"] = x
                g.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
                acc = g.dstdata["h"]
        return self.lin_self(x) + self.lin_comm(acc)


class DglGNN(torch.nn.Module):
    """Twin of ngra's ``GNN`` (dropout on every layer's input, activation between layers)."""

    def __init__(self, layers, dropout, activation="relu", encoder=None, decoder=None):
        super().__init__()
        self.dropout, self.act = dropout, {"relu": F.relu, "elu": F.elu}[activation]
        self.encoder, self.layers, self.decoder = encoder, torch.nn.ModuleList(layers), decoder

    def forward(self, G, x, T):
        if self.encoder is not None:
            x = self.encoder(F.dropout(x, self.dropout, self.training))
        for i, layer in enumerate(self.layers):
            x = layer(G, F.dropout(x, self.dropout, self.training), T)
            if i < len(self.layers) - 1:
                x = self.act(x)
        if self.decoder is not None:
            x = self.decoder(F.dropout(x, self.dropout, self.training))
        return x


def build(name, in_dim, out_dim):
    dropout = 0.6 if name == "gat" else 0.5
    if name == "ggnn":
        return DglGNN([GGNN(HIDDEN)], dropout, encoder=torch.nn.Linear(in_dim, HIDDEN),
                      decoder=torch.nn.Linear(HIDDEN, out_dim))
    if name == "gat":
        layers, d = [], in_dim
        for _ in range(NUM_LAYERS - 1):
            layers.append(GAT(d, GAT_HIDDEN, GAT_HEADS, True, dropout))
            d = GAT_HEADS * GAT_HIDDEN
        layers.append(GAT(d, out_dim, 1, False, dropout))
        return DglGNN(layers, dropout, activation="elu")
    dims = [in_dim] + [HIDDEN] * (NUM_LAYERS - 1) + [out_dim]
    cls = {"gcn": GCN, "sage": SAGE, "gin": GIN, "ggcn": GGCN, "rgcn": RGCN, "commnet": CommNet}[name]
    return DglGNN([cls(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout)


def load_weights(model, path):
    z = np.load(path)
    state = {k: torch.from_numpy(z[k]) for k in z.files}
    model.load_state_dict(state, strict=True)  # same names as ngra: a missing weight is an error


def graphs(gd):
    g = dgl.graph((torch.from_numpy(gd["src"]), torch.from_numpy(gd["dst"])),
                  num_nodes=gd["num_nodes"])
    g.edata["etype"] = torch.from_numpy(gd["edge_type"])
    loop = dgl.add_self_loop(g)  # the benchmark graphs have no self loops (removed when saved)
    for h in (g, loop):
        h.create_formats_()
    return {"plain": g, "loop": loop}


def make_runner(model, gd):
    """``(run(mode) -> run record, forward() -> output)`` on graph ``gd``."""
    G = graphs(gd)
    x = torch.from_numpy(gd["x"])
    y = torch.from_numpy(gd["y"])
    T = StageTimer()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def forward():
        T.reset()
        t0 = time.perf_counter()
        out = model(G, x, T)
        fwd = time.perf_counter() - t0
        return out, fwd, T.stages(fwd)

    def run(mode):
        if mode == "inference":
            return inference_step(model, forward)
        # forward() resets T (and its backward ranges) after training_step's reset.
        return training_step(model, forward, lambda out: F.cross_entropy(out, y), opt, T.backward)
    return run, lambda: model(G, x, StageTimer())


def _oom_reason(spec, e):
    return f"skipped: out of memory under the {spec.get('mem_limit_gb')} GB limit ({e})"[:300]


def gate_one(spec, name, gd, weights_path):
    out_dir = Path(spec["out"])
    model = build(name, gd["x"].shape[1], gd["num_classes"])
    load_weights(model, weights_path)
    _, forward = make_runner(model, gd)
    got = {}

    def eval_forward():
        got["out"] = forward()
        return got["out"]
    try:
        grads = gate_gradients(model, eval_forward, torch.from_numpy(gd["y"]))
        np.savez(out_dir / f"dgl_{name}_grad.npz", **grads)
    except Exception as e:  # noqa: BLE001 - recorded as skipped, never hidden
        if not is_oom(e):
            raise
        (out_dir / f"dgl_{name}_grad.skipped").write_text(_oom_reason(spec, e))
    if "out" in got:
        np.save(out_dir / f"dgl_{name}.npy", got.pop("out").detach().numpy())
        return
    try:
        model.eval()
        with torch.no_grad():
            np.save(out_dir / f"dgl_{name}.npy", forward().numpy())
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        (out_dir / f"dgl_{name}.skipped").write_text(_oom_reason(spec, e))


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    limit_memory(spec.get("mem_limit_gb"))
    gd = load_graph(spec["data_dir"])
    data_dir = Path(spec["data_dir"])
    if spec["task"] == "gate":
        for name, _ in spec["items"]:
            gate_one(spec, name, gd, data_dir / f"weights_{name}.npz")
        return
    in_dim, out_dim = gd["x"].shape[1], gd["num_classes"]
    for name, modes in spec["plan"]:
        mark_start(spec["out"], "dgl", name)
        done = set()
        try:
            model = build(name, in_dim, out_dim)
            load_weights(model, data_dir / f"weights_{name}.npz")
            warm, _ = make_runner(model, tiny_subgraph(gd))
            for mode in modes:
                warm(mode)
            del warm
            load_weights(model, data_dir / f"weights_{name}.npz")  # undo the warm-up's steps
            run, _ = make_runner(model, gd)
            for mode in modes:
                rec = measure(run, mode, spec["repeats"], spec["max_seconds"])
                append_jsonl(spec["out"], {"framework": "dgl", "model": name, **rec})
                done.add(mode)
            del run, model
        except Exception as e:  # noqa: BLE001 - recorded as a skipped row, never hidden
            if not is_oom(e):
                raise
            for mode in modes:
                if mode not in done:
                    append_jsonl(spec["out"], {"framework": "dgl", "model": name, "mode": mode,
                                               "status": _oom_reason(spec, e)})


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
