"""numba.cuda backend: one thread block per destination row (or per edge for g-SDDMM), threads
across the feature dim so that row reads coalesce.

Torch CUDA tensors go to the kernels zero-copy through ``__cuda_array_interface__`` and the kernels
run on torch's current stream. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, how CI tests
this backend without a GPU) CPU tensors are accepted and passed as numpy arrays.

Like the numba CPU backend, each output element is reduced by one thread in CSR order, so results
are deterministic (no atomics). Operand broadcasting always goes through the offset maps of
:func:`kernels._ops.bcast_offsets`: simple, and the maps are tiny.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import config as _numba_config
from numba import cuda

from ._ops import bcast_offsets, out_feat_shape, reduce_to

NAME = "numba_cuda"
DTYPES = (torch.float32, torch.float64)

COPY_LHS, COPY_RHS, ADD, SUB, MUL, DIV, DOT = range(7)
_CODE = {"copy_lhs": COPY_LHS, "copy_rhs": COPY_RHS, "add": ADD, "sub": SUB, "mul": MUL,
         "div": DIV, "dot": DOT}
_TARGET = {"u": 0, "v": 1, "e": 2}
_MAX_GRID = 1 << 20  # blocks per launch; kernels stride over the rest


def simulated() -> bool:
    return bool(_numba_config.ENABLE_CUDASIM)


def unusable_reason():
    if simulated():
        return None
    try:
        if not cuda.is_available():
            return "numba.cuda finds no usable GPU/driver"
    except Exception as err:  # a broken driver install raises rather than returning False
        return f"numba.cuda failed to initialise: {type(err).__name__}: {err}"
    return None


def check_device(device):
    if device.type == "cuda":
        return
    if device.type == "cpu" and simulated():
        return
    raise ValueError(f"backend 'numba_cuda' runs on CUDA tensors (got device {device}); CPU "
                     f"tensors are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")


# ----------------------------------------------------------------------------------------------
# kernels

@cuda.jit(device=True, inline=True)
def _bop(op, a, b):
    if op == ADD:
        return a + b
    if op == SUB:
        return a - b
    if op == MUL:
        return a * b
    if op == DIV:
        return a / b
    if op == COPY_RHS:
        return b
    return a


@cuda.jit(device=True, inline=True)
def _msg(op, U, W, s, eid, a, b):
    # copy ops read only their own operand (the other may be a stand-in of another shape)
    if op == COPY_LHS:
        return U[s, a]
    if op == COPY_RHS:
        return W[eid, b]
    return _bop(op, U[s, a], W[eid, b])


@cuda.jit(device=True, inline=True)
def _row(target, s, v, eid):
    if target == 0:
        return s
    if target == 1:
        return v
    return eid


@cuda.jit(cache=True)
def _spmm_sum(indptr, indices, eids, U, W, out, op, loff, roff, mean, zero):
    lo = out.shape[1]
    for v in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        beg = indptr[v]
        end = indptr[v + 1]
        for f in range(cuda.threadIdx.x, lo, cuda.blockDim.x):
            acc = zero
            a = loff[f]
            b = roff[f]
            for k in range(beg, end):
                acc += _msg(op, U, W, indices[k], eids[k], a, b)
            if mean and end > beg:
                acc /= end - beg
            out[v, f] = acc


@cuda.jit(cache=True)
def _spmm_maxmin(indptr, indices, eids, U, W, out, arg, op, loff, roff, is_max, zero):
    lo = out.shape[1]
    for v in range(cuda.blockIdx.x, out.shape[0], cuda.gridDim.x):
        beg = indptr[v]
        end = indptr[v + 1]
        for f in range(cuda.threadIdx.x, lo, cuda.blockDim.x):
            if beg == end:
                out[v, f] = zero
                arg[v, f] = -1
                continue
            a = loff[f]
            b = roff[f]
            best = _msg(op, U, W, indices[beg], eids[beg], a, b)
            besti = eids[beg]
            for k in range(beg + 1, end):
                m = _msg(op, U, W, indices[k], eids[k], a, b)
                # strict comparisons keep the first (smallest edge id) of tied edges
                if (is_max and m > best) or (not is_max and m < best):
                    best = m
                    besti = eids[k]
            out[v, f] = best
            arg[v, f] = besti


@cuda.jit(cache=True)
def _maxmin_grad_e(arg, src, G, U, W, GE, op, loff, roff):
    """grad of max/min w.r.t. e, in the broadcast output shape [E, lo] (zeroed by the caller):
    element (v, f) writes only at its own winning edge, which no other row shares."""
    lo = G.shape[1]
    for v in range(cuda.blockIdx.x, G.shape[0], cuda.gridDim.x):
        for f in range(cuda.threadIdx.x, lo, cuda.blockDim.x):
            eid = arg[v, f]
            if eid < 0:
                continue
            g = G[v, f]
            if op == SUB:
                GE[eid, f] = -g
            elif op == MUL:
                GE[eid, f] = g * U[src[eid], loff[f]]
            elif op == DIV:
                x = W[eid, roff[f]]
                GE[eid, f] = -g * U[src[eid], loff[f]] / (x * x)
            else:
                GE[eid, f] = g


@cuda.jit(cache=True)
def _maxmin_grad_u(tindptr, tindices, teids, arg, G, W, GU, op, roff, zero):
    """grad of max/min w.r.t. u, [num_src, lo]: one thread per (source, feature) sums over the
    source's out-edges (transposed CSR, edge id order) the elements that edge won; no atomics."""
    lo = G.shape[1]
    for s in range(cuda.blockIdx.x, GU.shape[0], cuda.gridDim.x):
        beg = tindptr[s]
        end = tindptr[s + 1]
        for f in range(cuda.threadIdx.x, lo, cuda.blockDim.x):
            acc = zero
            for k in range(beg, end):
                v = tindices[k]
                eid = teids[k]
                if arg[v, f] == eid:
                    if op == MUL:
                        acc += G[v, f] * W[eid, roff[f]]
                    elif op == DIV:
                        acc += G[v, f] / W[eid, roff[f]]
                    else:
                        acc += G[v, f]
            GU[s, f] = acc


@cuda.jit(cache=True)
def _sddmm(dst_ids, indices, eids, L, lt, R, rt, out, op, loff, roff, red, zero):
    lo = out.shape[1]
    for k in range(cuda.blockIdx.x, indices.shape[0], cuda.gridDim.x):
        s = indices[k]
        v = dst_ids[k]
        eid = eids[k]
        li = _row(lt, s, v, eid)
        ri = _row(rt, s, v, eid)
        for j in range(cuda.threadIdx.x, lo, cuda.blockDim.x):
            a = loff[j]
            b = roff[j]
            if op == DOT:
                acc = zero
                for d in range(red):
                    acc += L[li, a + d] * R[ri, b + d]
                out[eid, j] = acc
            else:
                out[eid, j] = _bop(op, L[li, a], R[ri, b])


@cuda.jit(cache=True)
def _edge_softmax(indptr, eids, S, Y, zero):
    F = S.shape[1]
    for v in range(cuda.blockIdx.x, indptr.shape[0] - 1, cuda.gridDim.x):
        beg = indptr[v]
        end = indptr[v + 1]
        if beg == end:
            continue
        for f in range(cuda.threadIdx.x, F, cuda.blockDim.x):
            mx = S[eids[beg], f]
            for k in range(beg + 1, end):
                x = S[eids[k], f]
                if x > mx:
                    mx = x
            sm = zero
            for k in range(beg, end):
                x = math.exp(S[eids[k], f] - mx)
                Y[eids[k], f] = x
                sm += x
            for k in range(beg, end):
                Y[eids[k], f] = Y[eids[k], f] / sm


@cuda.jit(cache=True)
def _edge_softmax_backward(indptr, eids, Y, G, GS, zero):
    F = Y.shape[1]
    for v in range(cuda.blockIdx.x, indptr.shape[0] - 1, cuda.gridDim.x):
        beg = indptr[v]
        end = indptr[v + 1]
        for f in range(cuda.threadIdx.x, F, cuda.blockDim.x):
            acc = zero
            for k in range(beg, end):
                acc += Y[eids[k], f] * G[eids[k], f]
            for k in range(beg, end):
                GS[eids[k], f] = Y[eids[k], f] * (G[eids[k], f] - acc)


# ----------------------------------------------------------------------------------------------
# host side

def _dev(t):
    """A tensor as a kernel argument: a CUDA array view (zero-copy) or, under the simulator for
    CPU tensors, a numpy view."""
    t = t.detach()
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t)
    return t.numpy()


def _flat(x, rows):
    return x.detach().reshape(rows, math.prod(x.shape[1:])).contiguous()


def _launch(kernel, rows, width, device, *args):
    if rows == 0:
        return
    block = 1
    while block < min(width, 128 if not simulated() else 8):
        block *= 2
    grid = max(1, min(rows, _MAX_GRID if not simulated() else 64))
    if device.type == "cuda":
        with torch.cuda.device(device):
            stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
            kernel[grid, block, stream](*args)
    else:
        kernel[grid, block](*args)


def _zero(dtype):
    return {torch.float32: np.float32(0), torch.float64: np.float64(0)}[dtype]


def _check_dtype(*xs):
    for x in xs:
        if x is not None and x.dtype not in DTYPES:
            raise TypeError(f"backend 'numba_cuda' supports float32 and float64 (got {x.dtype}); "
                            f"use backend='torch' for half precision")


def _graph(csr):
    key = "numba_cuda"
    if key not in csr._backend_cache:
        csr._backend_cache[key] = tuple(_dev(t) for t in (csr.indptr, csr.indices, csr.eids,
                                                          csr.dst_ids()))
    return csr._backend_cache[key]


def _offsets(arr, device):
    return _dev(torch.from_numpy(arr).to(device))


def spmm(csr, binop, reduce, lhs, rhs, need_arg=True):
    _check_dtype(lhs, rhs)
    indptr, indices, eids, _ = _graph(csr)
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fu, fe)
    dtype = (lhs if lhs is not None else rhs).dtype
    lo = math.prod(fo)
    U = _flat(lhs, csr.num_src) if lhs is not None else None
    W = _flat(rhs, csr.num_edges) if rhs is not None else None
    U = U if U is not None else W
    W = W if W is not None else U
    loff, roff, _ = bcast_offsets(binop, fu, fe, fo)
    loff, roff = _offsets(loff, csr.device), _offsets(roff, csr.device)
    out = torch.empty((csr.num_dst, lo), dtype=dtype, device=csr.device)
    arg = None
    if reduce in ("sum", "mean"):
        _launch(_spmm_sum, csr.num_dst, lo, csr.device, indptr, indices, eids, _dev(U), _dev(W),
                _dev(out), _CODE[binop], loff, roff, reduce == "mean", _zero(dtype))
    else:
        arg = torch.empty((csr.num_dst, lo), dtype=torch.int64, device=csr.device)
        _launch(_spmm_maxmin, csr.num_dst, lo, csr.device, indptr, indices, eids, _dev(U),
                _dev(W), _dev(out), _dev(arg), _CODE[binop], loff, roff, reduce == "max",
                _zero(dtype))
        arg = arg.reshape((csr.num_dst,) + fo)
    return out.reshape((csr.num_dst,) + fo), arg


def spmm_arg_backward(csr, binop, arg, g, lhs, rhs, need_lhs, need_rhs):
    """Gradients of max/min through the arg edges (``arg`` [num_dst, *fo] int64 from
    :func:`spmm`). Computed in the broadcast output shape with one writer per element (no
    atomics, deterministic), then summed down to the operands' shapes by torch."""
    _check_dtype(g, lhs, rhs)
    fo = tuple(g.shape[1:])
    lo = math.prod(fo)
    G = _flat(g, csr.num_dst)
    A = arg.reshape(csr.num_dst, lo)
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    U = _flat(lhs, csr.num_src) if lhs is not None else G
    W = _flat(rhs, csr.num_edges) if rhs is not None else G
    loff, roff, _ = bcast_offsets(binop, fu, fe, fo)
    loff, roff = _offsets(loff, csr.device), _offsets(roff, csr.device)
    op = _CODE[binop]
    gu = ge = None
    if need_lhs:
        t = csr.transpose()
        tindptr, tindices, teids, _ = _graph(t)
        gu = torch.empty((csr.num_src, lo), dtype=g.dtype, device=csr.device)
        _launch(_maxmin_grad_u, csr.num_src, lo, csr.device, tindptr, tindices, teids, _dev(A),
                _dev(G), _dev(W), _dev(gu), op, roff, _zero(g.dtype))
        gu = reduce_to(gu.reshape((csr.num_src,) + fo), fu)
    if need_rhs:
        src, _ = csr.coo()
        ge = torch.zeros((csr.num_edges, lo), dtype=g.dtype, device=csr.device)
        _launch(_maxmin_grad_e, csr.num_dst, lo, csr.device, _dev(A), _dev(src), _dev(G), _dev(U),
                _dev(W), _dev(ge), op, loff, roff)
        ge = reduce_to(ge.reshape((csr.num_edges,) + fo), fe)
    return gu, ge


def sddmm(csr, binop, lhs, lhs_target, rhs, rhs_target):
    _check_dtype(lhs, rhs)
    _, indices, eids, dst_ids = _graph(csr)
    rows = {"u": csr.num_src, "v": csr.num_dst, "e": csr.num_edges}
    fl = tuple(lhs.shape[1:])
    fr = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fl, fr)
    L = _flat(lhs, rows[lhs_target])
    if rhs is None:
        R, rhs_target = L, lhs_target
    else:
        R = _flat(rhs, rows[rhs_target])
    loff, roff, red = bcast_offsets(binop, fl, fr, fo)
    lo = math.prod(fo)
    out = torch.empty((csr.num_edges, lo), dtype=lhs.dtype, device=csr.device)
    _launch(_sddmm, csr.num_edges, lo, csr.device, dst_ids, indices, eids, _dev(L),
            _TARGET[lhs_target], _dev(R), _TARGET[rhs_target], _dev(out), _CODE[binop],
            _offsets(loff, csr.device), _offsets(roff, csr.device), red, _zero(lhs.dtype))
    return out.reshape((csr.num_edges,) + fo)


def edge_softmax(csr, scores):
    _check_dtype(scores)
    indptr, _, eids, _ = _graph(csr)
    S = _flat(scores, csr.num_edges)
    Y = torch.empty_like(S)
    _launch(_edge_softmax, csr.num_dst, S.shape[1], csr.device, indptr, eids, _dev(S), _dev(Y),
            _zero(scores.dtype))
    return Y.reshape(scores.shape)


def edge_softmax_backward(csr, y, grad_y):
    _check_dtype(y, grad_y)
    indptr, _, eids, _ = _graph(csr)
    Y, G = _flat(y, csr.num_edges), _flat(grad_y, csr.num_edges)
    GS = torch.empty_like(Y)
    _launch(_edge_softmax_backward, csr.num_dst, Y.shape[1], csr.device, indptr, eids, _dev(Y),
            _dev(G), _dev(GS), _zero(y.dtype))
    return GS.reshape(y.shape)
