"""Graphs and slow, obviously correct references (dense matrices, python loops) for kernel tests."""

from __future__ import annotations

import math

import torch
from numba import config as numba_config

from kernels import CSR


# Where the numba_cuda backend's tests compute: CPU tensors in the CUDA simulator (CI, no GPU), or
# CUDA tensors on a real GPU (run the suite with NUMBA_ENABLE_CUDASIM=0 on a GPU machine).
CUDA_SIM = bool(numba_config.ENABLE_CUDASIM)
CUDA_DEVICE = "cpu" if CUDA_SIM else "cuda"


def _g(name, src, dst, num_nodes):
    return name, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), num_nodes


def _random(name, n_src, n_dst, e, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n_src, (e,), generator=gen)
    dst = torch.randint(0, n_dst, (e,), generator=gen)
    return name, src, dst, (n_src, n_dst) if n_src != n_dst else n_src


# (name, src, dst, num_nodes): hand-made edge cases plus small random graphs.
GRAPHS = [
    _g("empty", [], [], 4),
    _g("no_nodes", [], [], 0),
    _g("isolated", [0, 1, 3], [1, 3, 1], 5),  # vertices 0, 2, 4 have no in-edges
    _g("self_loops", [0, 1, 2, 2, 1], [0, 1, 2, 0, 2], 3),
    _g("multi_edges", [0, 0, 0, 1, 1, 2], [1, 1, 1, 2, 2, 0], 3),
    _g("in_star", [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0], 7),
    _g("out_star", [0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 6),
    _g("bipartite", [0, 4, 2, 4, 1, 3], [2, 0, 0, 1, 2, 2], (5, 3)),  # a chunk: 5 sources, 3 dsts
    _random("random", 30, 30, 150, 0),
    _random("random_bipartite", 17, 9, 60, 1),
]
GRAPH_IDS = [g[0] for g in GRAPHS]


def make_csr(graph, index_dtype=torch.int64):
    _, src, dst, n = graph
    return CSR.from_coo(src.to(index_dtype), dst.to(index_dtype), n)


def rand(shape, dtype, seed, positive=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if positive:  # divisors kept away from 0 so u_div_e is well conditioned
        x = x.abs() + 0.5
    return x.to(dtype)


def one_hot(index, n, dtype):
    """[len(index), n] dense selection matrix."""
    m = torch.zeros(len(index), n, dtype=dtype)
    m[torch.arange(len(index)), index] = 1
    return m


def _pad(x, nd):
    f = x.shape[1:]
    return x.reshape((x.shape[0],) + (1,) * (nd - len(f)) + tuple(f))


def _apply(op, a, b):
    return {"copy_u": lambda: a, "copy_e": lambda: b, "copy_v": lambda: b,
            "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
            "div": lambda: a / b, "dot": lambda: (a * b).sum(-1, keepdim=True)}[op]()


def dense_gather(csr, x, target):
    """Rows of x per edge in original order, by a dense one-hot matrix product."""
    src, dst = coo(csr)
    if target == "e":
        return x
    idx, n = (src, csr.num_src) if target == "u" else (dst, csr.num_dst)
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return (one_hot(idx, n, x.dtype) @ flat).reshape((len(idx),) + tuple(x.shape[1:]))


def coo(csr):
    """(src, dst) in original edge order, rebuilt from the CSR with a python loop."""
    E = csr.num_edges
    src = [0] * E
    dst = [0] * E
    indptr, eids, indices = csr.indptr.tolist(), csr.eids.tolist(), csr.indices.tolist()
    for v in range(csr.num_dst):
        for p in range(indptr[v], indptr[v + 1]):
            src[eids[p]] = indices[p]
            dst[eids[p]] = v
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


SPMM_BINOP = {"copy_u": "copy_u", "copy_e": "copy_e", "u_add_e": "add", "u_sub_e": "sub",
              "u_mul_e": "mul", "u_div_e": "div"}


def ref_messages(csr, op, u, e):
    a = dense_gather(csr, u, "u") if u is not None else None
    fo = torch.broadcast_shapes(*(t.shape[1:] for t in (u, e) if t is not None))
    nd = len(fo)
    a = _pad(a, nd) if a is not None else None
    b = _pad(e, nd) if e is not None else None
    m = _apply(SPMM_BINOP[op], a, b)
    return m.expand((csr.num_edges,) + tuple(fo))


def ref_gspmm(csr, op, reduce, u, e):
    """sum/mean by a dense [num_dst, E] incidence product; max/min by a python loop."""
    msg = ref_messages(csr, op, u, e)
    fo = tuple(msg.shape[1:])
    _, dst = coo(csr)
    inc = one_hot(dst, csr.num_dst, msg.dtype).T  # [num_dst, E]
    if reduce in ("sum", "mean"):
        out = inc @ msg.reshape(csr.num_edges, math.prod(fo))
        if reduce == "mean":
            out = out / inc.sum(1, keepdim=True).clamp(min=1)
        return out.reshape((csr.num_dst,) + fo)
    out = torch.zeros((csr.num_dst,) + fo, dtype=msg.dtype)
    dst = dst.tolist()
    for v in range(csr.num_dst):
        ks = [k for k in range(csr.num_edges) if dst[k] == v]
        if ks:
            stack = msg[ks]
            out[v] = stack.max(0).values if reduce == "max" else stack.min(0).values
    return out


SDDMM_SPEC = {
    "u_add_v": ("add", "u", "v"), "u_sub_v": ("sub", "u", "v"), "u_mul_v": ("mul", "u", "v"),
    "u_dot_v": ("dot", "u", "v"), "u_add_e": ("add", "u", "e"), "u_mul_e": ("mul", "u", "e"),
    "u_dot_e": ("dot", "u", "e"), "copy_u": ("copy_u", "u", None), "copy_v": ("copy_v", None, "v"),
}


def ref_gsddmm(csr, op, u=None, v=None, e=None):
    binop, lt, rt = SDDMM_SPEC[op]
    given = {"u": u, "v": v, "e": e}
    a = dense_gather(csr, given[lt], lt) if lt else None
    b = dense_gather(csr, given[rt], rt) if rt else None
    if binop == "copy_u":
        return a
    if binop == "copy_v":
        return b
    nd = max(a.dim(), b.dim()) - 1
    return _apply(binop, _pad(a, nd), _pad(b, nd))


def ref_edge_softmax(csr, scores):
    _, dst = coo(csr)
    out = torch.zeros_like(scores)
    dst = dst.tolist()
    for v in range(csr.num_dst):
        ks = [k for k in range(csr.num_edges) if dst[k] == v]
        if ks:
            out[ks] = torch.softmax(scores[ks], dim=0)
    return out


def offered_and_declined(monkeypatch, model, g, x):
    """``[(out, grads), (out2, grads2)]``: ``model(g, x)`` and the gradients of its parameters
    (of ``out.square().sum()``) with relu_dropout's offer to the next layer, then with every
    offer declined (``kernels._dropout.relu_dropout_of`` patched), the same seeds drawn."""
    from kernels import _dropout
    runs = []
    for offered in (True, False):
        if not offered:
            monkeypatch.setattr(_dropout, "relu_dropout_of", lambda t: None)
        torch.manual_seed(5)
        out = model(g, x)
        runs.append((out.detach(), torch.autograd.grad(out.square().sum(),
                                                       list(model.parameters()))))
    return runs
