"""numba.cuda backend: destination rows cut into segments of at most ``_SEG_EDGES`` CSR positions,
one group of ``g`` lanes per segment with the lanes across the feature dim (``g`` = the row width
rounded up to a power of two, at most a warp), so that a warp reads whole feature rows at a time
(coalesced) and rows narrower than a warp share one.

Why segments: on power-law graphs a few rows hold a large share of the edges (an R-MAT graph with
2M vertices has rows of ~100K in-edges), and a lane group that walks such a row alone finishes
long after every other. Rows longer than ``_SEG_EDGES`` are split; their segments write partial
results to a scratch buffer that a second, tiny kernel combines in segment order. Each output
element is thus reduced in a fixed order by fixed threads: no atomics, and results are bitwise
reproducible run to run (the sums that go to cuSPARSE instead, see ``_cusparse_sum``, are not,
except under ``torch.use_deterministic_algorithms(True)``, where this kernel takes them).
Edge-parallel stages (g-SDDMM, the last pass of edge softmax) use one thread per output element;
dot products use one lane group per edge whose partial sums meet through a butterfly of warp
shuffles (the CUDA simulator, where CI tests this backend, has no shuffles: there the same
butterfly goes through shared memory, see ``_xor_add``). The edge
softmax's per-edge passes run in edge-id order (scores read and written in order); the g-SDDMM
walks CSR positions (a destination's row is read once per run of its edges) and writes through
``eids``.

Torch CUDA tensors go to the kernels zero-copy through ``__cuda_array_interface__`` and the kernels
run on torch's current stream. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) CPU tensors
are accepted and passed as numpy arrays. Operand broadcasting goes through the offset maps of
:func:`kernels._ops.bcast_offsets` (cached per shape).

The op codes and the scalar helpers ``_bop`` and ``_row`` are those of ``kernels/_scalar.py``, which
the CPU backend compiles too. The kernels are cached on disk (``cache=True``) and numba checks a
cached kernel against this file only: after editing ``kernels/_scalar.py``, remove the cache
(``make clean``), as for the CPU backend's helper modules (``kernels/_cpu/__init__.py``).
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings

import numpy as np
import torch
from numba import config as _numba_config
from numba import cuda, float64

from . import _scalar
from ._ops import bcast_offsets, out_feat_shape, reduce_to
from ._scalar import _CODE, _TARGET, COPY_LHS, COPY_RHS, DIV, MUL, SUB

NAME = "numba_cuda"
DTYPES = (torch.float32, torch.float64)

# Longest run of CSR positions one lane group reduces alone. 128 keeps the partial-result traffic
# of split rows under 1% of the edge traffic while bounding a group's serial walk.
_SEG_EDGES = 128
_BLOCK = 256  # threads per block on a GPU
_SIM_BLOCK = 8  # the simulator runs one Python thread per GPU thread
_MAX_GRID = 1 << 16  # blocks per launch; kernels stride over the rest


def simulated() -> bool:
    return bool(_numba_config.ENABLE_CUDASIM)


# the simulator's stand-in for warp shuffles needs a block's worth of shared memory (see _xor_add)
_XOR_SHARED = _SIM_BLOCK if simulated() else 1


def unusable_reason():
    if simulated():
        return None
    try:
        if not cuda.is_available():
            return "numba.cuda finds no usable GPU/driver"
    except Exception as err:  # a broken driver install raises rather than returning False
        return f"numba.cuda failed to initialise: {type(err).__name__}: {err}"
    try:
        # numba.cuda loads its numpy support at a kernel's first compile, where a numpy newer than
        # it knows fails deep inside (numba-cuda 0.30.4 with numpy 2.5: np.row_stack is gone);
        # loading it here turns that into a reason, and "auto" into the torch backend
        import numba.cuda.cudaimpl  # noqa: F401
    except Exception as err:
        return (f"numba.cuda cannot load its numpy support with numpy {np.__version__} "
                f"({type(err).__name__}: {err}); install a numpy release that your numba-cuda "
                f"supports (numpy<2.5 for numba-cuda 0.30) or a newer numba-cuda")
    return None


def check_device(device):
    if device.type == "cuda":
        return
    if device.type == "cpu" and simulated():
        return
    raise ValueError(f"backend 'numba_cuda' runs on CUDA tensors (got device {device}); CPU "
                     f"tensors are accepted only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")


# ----------------------------------------------------------------------------------------------
# device functions (the scalar helpers the CPU kernels share, then this backend's own)

_bop = cuda.jit(device=True, inline=True)(_scalar.bop)
_row = cuda.jit(device=True, inline=True)(_scalar.row)


@cuda.jit(device=True, inline=True)
def _msg(op, U, W, s, eid, a, b):
    # copy ops read only their own operand (the other may be a stand-in of another shape)
    if op == COPY_LHS:
        return U[s, a]
    if op == COPY_RHS:
        return W[eid, b]
    return _bop(op, U[s, a], W[eid, b])


@cuda.jit(device=True, inline=True)
def _beats(m, best, is_max):
    """Whether m replaces best, scanning in edge-id order: strict comparisons keep the first
    (smallest edge id) of tied edges, and NaN wins and stays, as in torch's amax/amin."""
    if best != best:
        return False
    if m != m:
        return True
    return (is_max and m > best) or (not is_max and m < best)


# ----------------------------------------------------------------------------------------------
# segmented row kernels: segs[s] = (row, first CSR position, end position, scratch slot or -1)

@cuda.jit(cache=True)
def _spmm_sum(segs, indices, eids, U, W, out, part, op, loff, roff, mean, zero, g):
    lo = out.shape[1]
    per = cuda.blockDim.x // g
    lane = cuda.threadIdx.x % g
    for s in range(cuda.blockIdx.x * per + cuda.threadIdx.x // g, segs.shape[0],
                   cuda.gridDim.x * per):
        v, beg, end, slot = segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3]
        for f in range(lane, lo, g):
            a = loff[f]
            b = roff[f]
            acc = zero
            for k in range(beg, end):
                acc += _msg(op, U, W, indices[k], eids[k], a, b)
            if slot >= 0:
                part[slot, f] = acc
            else:
                if mean and end > beg:
                    acc /= end - beg
                out[v, f] = acc


@cuda.jit(cache=True)
def _merge_sum(hrows, hptr, indptr, part, out, mean, zero):
    """Rows that were split: out[v] = sum of their segments' partials, in segment order."""
    lo = out.shape[1]
    for t in range(cuda.grid(1), hrows.shape[0] * lo, cuda.gridsize(1)):
        h = t // lo
        f = t - h * lo
        v = hrows[h]
        acc = zero
        for s in range(hptr[h], hptr[h + 1]):
            acc += part[s, f]
        if mean:
            acc /= indptr[v + 1] - indptr[v]
        out[v, f] = acc


@cuda.jit(cache=True)
def _spmm_maxmin(segs, indices, eids, U, W, out, arg, pbest, parg, op, loff, roff, is_max,
                 need_arg, zero, g):
    lo = out.shape[1]
    per = cuda.blockDim.x // g
    lane = cuda.threadIdx.x % g
    for s in range(cuda.blockIdx.x * per + cuda.threadIdx.x // g, segs.shape[0],
                   cuda.gridDim.x * per):
        v, beg, end, slot = segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3]
        for f in range(lane, lo, g):
            if beg == end:  # only a row without in-edges has an empty segment
                out[v, f] = zero
                if need_arg:
                    arg[v, f] = -1
                continue
            a = loff[f]
            b = roff[f]
            best = _msg(op, U, W, indices[beg], eids[beg], a, b)
            besti = eids[beg]
            for k in range(beg + 1, end):
                m = _msg(op, U, W, indices[k], eids[k], a, b)
                if _beats(m, best, is_max):
                    best = m
                    besti = eids[k]
            if slot >= 0:
                pbest[slot, f] = best
                parg[slot, f] = besti
            else:
                out[v, f] = best
                if need_arg:
                    arg[v, f] = besti


@cuda.jit(cache=True)
def _merge_maxmin(hrows, hptr, pbest, parg, out, arg, is_max, need_arg):
    lo = out.shape[1]
    for t in range(cuda.grid(1), hrows.shape[0] * lo, cuda.gridsize(1)):
        h = t // lo
        f = t - h * lo
        v = hrows[h]
        first = hptr[h]
        best = pbest[first, f]
        besti = parg[first, f]
        for s in range(first + 1, hptr[h + 1]):
            m = pbest[s, f]
            if _beats(m, best, is_max):  # segments come in edge-id order
                best = m
                besti = parg[s, f]
        out[v, f] = best
        if need_arg:
            arg[v, f] = besti


@cuda.jit(cache=True)
def _maxmin_grad_e(arg, src, G, U, W, GE, op, loff, roff):
    """grad of max/min w.r.t. e, in the broadcast output shape [E, lo] (zeroed by the caller):
    element (v, f) writes only at its own winning edge, which no other row shares."""
    lo = G.shape[1]
    for t in range(cuda.grid(1), G.shape[0] * lo, cuda.gridsize(1)):
        v = t // lo
        f = t - v * lo
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
def _maxmin_grad_u(tsegs, tindices, teids, arg, G, W, GU, part, op, roff, zero, g):
    """grad of max/min w.r.t. u, [num_src, lo]: over the transposed CSR's segments, one lane per
    (segment, feature) sums, in edge-id order, the elements that each of the source's out-edges
    won; no atomics."""
    lo = G.shape[1]
    per = cuda.blockDim.x // g
    lane = cuda.threadIdx.x % g
    for s in range(cuda.blockIdx.x * per + cuda.threadIdx.x // g, tsegs.shape[0],
                   cuda.gridDim.x * per):
        u, beg, end, slot = tsegs[s, 0], tsegs[s, 1], tsegs[s, 2], tsegs[s, 3]
        for f in range(lane, lo, g):
            b = roff[f]
            acc = zero
            for k in range(beg, end):
                v = tindices[k]
                eid = teids[k]
                if arg[v, f] == eid:
                    if op == MUL:
                        acc += G[v, f] * W[eid, b]
                    elif op == DIV:
                        acc += G[v, f] / W[eid, b]
                    else:
                        acc += G[v, f]
            if slot >= 0:
                part[slot, f] = acc
            else:
                GU[u, f] = acc


# ----------------------------------------------------------------------------------------------
# edge kernels

@cuda.jit(cache=True)
def _sddmm(dst_ids, indices, eids, L, lt, R, rt, out, op, loff, roff):
    lo = out.shape[1]
    for t in range(cuda.grid(1), indices.shape[0] * lo, cuda.gridsize(1)):
        k = t // lo
        j = t - k * lo
        eid = eids[k]
        li = _row(lt, indices[k], dst_ids[k], eid)
        ri = _row(rt, indices[k], dst_ids[k], eid)
        out[eid, j] = _bop(op, L[li, loff[j]], R[ri, roff[j]])


if simulated():
    @cuda.jit(device=True, inline=True)
    def _xor_add(acc, sh, tid, o):
        """acc + the value of lane ``tid ^ o``: the simulator's stand-in for a warp shuffle (it
        has none), through shared memory between block barriers, with the same order of
        additions, so that the simulator runs the GPU's reduction tree."""
        sh[tid] = acc
        cuda.syncthreads()
        acc += sh[tid ^ o]
        cuda.syncthreads()
        return acc
else:
    @cuda.jit(device=True, inline=True)
    def _xor_add(acc, sh, tid, o):
        return acc + cuda.shfl_xor_sync(0xFFFFFFFF, acc, o)


@cuda.jit(cache=True)
def _sddmm_dot(dst_ids, indices, eids, L, lt, R, rt, out, loff, roff, red, zero, g):
    """One group of g lanes (a power of two, at most a warp) per (edge, output element): lanes
    stride the dot's ``red`` elements, then a butterfly of warp shuffles adds the g partial sums
    (offsets g/2, ..., 1: a fixed tree, so results are deterministic) and the group's first lane
    writes. Every lane of a block runs the same number of rounds (a shuffle needs all 32 lanes
    of its warp); lanes past the last item add zeros."""
    sh = cuda.shared.array(_XOR_SHARED, float64)
    lo = out.shape[1]
    total = indices.shape[0] * lo
    per = cuda.blockDim.x // g
    tid = cuda.threadIdx.x
    lane = tid % g
    for base in range(cuda.blockIdx.x * per, total, cuda.gridDim.x * per):
        t = base + tid // g
        acc = zero
        if t < total:
            k = t // lo
            j = t - k * lo
            eid = eids[k]
            li = _row(lt, indices[k], dst_ids[k], eid)
            ri = _row(rt, indices[k], dst_ids[k], eid)
            a = loff[j]
            b = roff[j]
            for d in range(lane, red, g):
                acc += L[li, a + d] * R[ri, b + d]
        o = g // 2
        while o > 0:
            acc = _xor_add(acc, sh, tid, o)
            o //= 2
        if t < total and lane == 0:
            out[eids[t // lo], t % lo] = acc


@cuda.jit(cache=True)
def _softmax_rows(segs, eids, S, M, Z, pm, pz, zero, g):
    """Per segment and feature: the max score m and sum of exp(s - m) (0 where every score is
    -inf, so that a masked segment adds nothing when segments are combined)."""
    F = S.shape[1]
    per = cuda.blockDim.x // g
    lane = cuda.threadIdx.x % g
    for s in range(cuda.blockIdx.x * per + cuda.threadIdx.x // g, segs.shape[0],
                   cuda.gridDim.x * per):
        v, beg, end, slot = segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3]
        if beg == end:
            continue
        for f in range(lane, F, g):
            mx = S[eids[beg], f]
            for k in range(beg + 1, end):
                x = S[eids[k], f]
                if x > mx:
                    mx = x
            z = zero
            if mx != -math.inf:
                for k in range(beg, end):
                    z += math.exp(S[eids[k], f] - mx)
            if slot >= 0:
                pm[slot, f] = mx
                pz[slot, f] = z
            else:
                M[v, f] = mx
                Z[v, f] = z


@cuda.jit(cache=True)
def _softmax_merge(hrows, hptr, pm, pz, M, Z, zero):
    F = M.shape[1]
    for t in range(cuda.grid(1), hrows.shape[0] * F, cuda.gridsize(1)):
        h = t // F
        f = t - h * F
        v = hrows[h]
        mx = pm[hptr[h], f]
        for s in range(hptr[h] + 1, hptr[h + 1]):
            if pm[s, f] > mx:
                mx = pm[s, f]
        z = zero
        for s in range(hptr[h], hptr[h + 1]):
            if pm[s, f] != -math.inf:
                z += pz[s, f] * math.exp(pm[s, f] - mx)
        M[v, f] = mx
        Z[v, f] = z


@cuda.jit(cache=True)
def _softmax_edges(edst, S, M, Z, Y):
    """In edge-id order (``edst``: each edge's destination, ``CSR.coo()``'s), so that the [E, F]
    scores are read and written in order and only the rows' [V, F] (M, Z) are gathered; CSR
    order read and wrote them through ``eids``, scattered (on an H200, R-MAT 2M / 33.5M: this
    order 1.2-2.3x faster over the forward and backward, one and four heads)."""
    F = S.shape[1]
    for t in range(cuda.grid(1), S.shape[0] * F, cuda.gridsize(1)):
        e = t // F
        f = t - e * F
        v = edst[e]
        m = M[v, f]
        if m == -math.inf:  # every score of the row masked: 0/0, NaN as in the torch reference
            Y[e, f] = math.nan
        else:
            Y[e, f] = math.exp(S[e, f] - m) / Z[v, f]


@cuda.jit(cache=True)
def _softmax_bwd_rows(segs, eids, Y, G, T, part, zero, g):
    F = Y.shape[1]
    per = cuda.blockDim.x // g
    lane = cuda.threadIdx.x % g
    for s in range(cuda.blockIdx.x * per + cuda.threadIdx.x // g, segs.shape[0],
                   cuda.gridDim.x * per):
        v, beg, end, slot = segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3]
        for f in range(lane, F, g):
            acc = zero
            for k in range(beg, end):
                acc += Y[eids[k], f] * G[eids[k], f]
            if slot >= 0:
                part[slot, f] = acc
            else:
                T[v, f] = acc


@cuda.jit(cache=True)
def _softmax_bwd_edges(edst, Y, G, T, GS):
    F = Y.shape[1]
    for t in range(cuda.grid(1), Y.shape[0] * F, cuda.gridsize(1)):
        e = t // F
        f = t - e * F
        GS[e, f] = Y[e, f] * (G[e, f] - T[edst[e], f])


# ----------------------------------------------------------------------------------------------
# host side

def _dev(t):
    """A tensor as numba's kernel argument: a CUDA array view (zero-copy) or, under the simulator
    for CPU tensors, a numpy view."""
    t = t.detach()
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t)
    return t.numpy()


def _flat(x, rows):
    return x.detach().reshape(rows, math.prod(x.shape[1:])).contiguous()


def _group(width):
    """Lanes per row: the row width rounded up to a power of two, at most a warp (or block)."""
    g = 1
    while g < min(width, 32, _block()):
        g *= 2
    return g


def _block():
    return _SIM_BLOCK if simulated() else _BLOCK


def _run(kernel, grid, device, args):
    """Launches ``kernel`` over ``grid`` blocks on torch's current stream. ``args`` holds torch
    tensors and scalars; a GPU launch goes through :func:`_direct` where it can."""
    block = _block()
    grid = max(1, min(grid, _MAX_GRID if not simulated() else 2))
    if device.type != "cuda":
        kernel[grid, block](*[_dev(a) if isinstance(a, torch.Tensor) else a for a in args])
        return
    with torch.cuda.device(device):
        handle = torch.cuda.current_stream(device).cuda_stream
        key = (kernel, device.index, tuple(
            (a.dtype, a.dim()) if isinstance(a, torch.Tensor) else type(a) for a in args))
        plan = _PLANS.get(key, _NO_PLAN)
        if (direct_launch and plan is not None and plan is not _NO_PLAN
                and _direct(plan, grid, block, handle, args)):
            return
        devargs = [_dev(a) if isinstance(a, torch.Tensor) else a for a in args]
        with warnings.catch_warnings():
            # numba-cuda warns of every grid under 128 blocks; a small graph's kernels are small
            warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU")
            kernel[grid, block, cuda.external_stream(handle)](*devargs)
        if plan is _NO_PLAN:
            _PLANS[key] = _plan(kernel, devargs)


# Direct launches. numba-cuda's own launch path (``kernel[grid, block, stream](*args)``) costs
# ~70 us of host time per kernel with prepared device arrays, and ~14 us more for each torch
# tensor made a CUDA array first (a 2K-vertex graph's g-SpMM: ~450 us forward against torch's
# index_add_ at ~45 us; NVIDIA/numba-cuda#98): it types every argument, builds a launch
# configuration and marshals each argument anew on every call. After a kernel's first launch
# through numba (which compiles it), :func:`_plan` keeps what that launch found for the same
# argument types -- the compiled function and one converter per argument, as numba-cuda's
# ``_Kernel._prepare_args`` does it -- and later calls hand torch's pointers, shapes and strides
# straight to ``cuda.core.launch``. It needs numba-cuda on cuda.core (0.2x and later); anything
# else, a non-contiguous tensor, or ``NGRA_CUDA_LAUNCH=numba`` (``direct_launch = False``) keeps
# numba's own path.
direct_launch = os.environ.get("NGRA_CUDA_LAUNCH", "direct") != "numba"
_NO_PLAN = object()
_PLANS: dict = {}  # (kernel, device index, argument kinds) -> (function, converters) or None
_API: list = []  # cuda.core's (launch, LaunchConfig, Stream), or [None] where not available
_STREAMS: dict = {}  # torch stream handle -> cuda.core Stream (non-owning)
_CONFIGS: dict = {}  # (grid, block) -> cuda.core LaunchConfig


def _array_arg(t, out):
    # numba-cuda's array argument: meminfo, parent, size, itemsize, data, shape, strides (bytes)
    size = t.element_size()
    out += (0, 0, t.numel(), size, t.data_ptr(), *t.shape, *(s * size for s in t.stride()))


def _plain_arg(v, out):
    out.append(v)


def _scalar_arg(ctype):
    return lambda v, out: out.append(ctype(v))


_SCALARS = {"bool": _plain_arg, "float32": _scalar_arg(ctypes.c_float),
            "float64": _scalar_arg(ctypes.c_double), "int64": _scalar_arg(ctypes.c_int64),
            "int32": _scalar_arg(ctypes.c_int32), "uint64": _scalar_arg(ctypes.c_uint64)}


def _launch_api():
    if not _API:
        try:
            from cuda.core import LaunchConfig, Stream, launch
            _API.append((launch, LaunchConfig, Stream))
        except ImportError:
            _API.append(None)
    return _API[0]


def _plan(kernel, devargs):
    """The compiled function and argument converters of ``kernel`` for the argument types of
    ``devargs`` (just launched through numba), or None where a direct launch does not apply."""
    if _launch_api() is None or getattr(kernel, "_launch_config_sensitive", True):
        return None
    try:
        compiled = kernel.overloads.get(tuple(kernel.typeof_pyval(a) for a in devargs))
        if (compiled is None or getattr(compiled, "extensions", None)
                or getattr(compiled, "debug", True) or getattr(compiled, "cooperative", True)
                or getattr(compiled, "launch_config_sensitive", False)):
            return None
        converters = []
        for ty in compiled.argument_types:
            if type(ty).__name__ == "Array":
                if ty.layout != "C":
                    return None
                converters.append(_array_arg)
            elif str(ty) in _SCALARS:
                converters.append(_SCALARS[str(ty)])
            else:
                return None
        function = compiled._codelibrary.get_cufunc().kernel
    except (AttributeError, KeyError, TypeError):  # another numba-cuda's internals
        return None
    return function, tuple(converters)


def _direct(plan, grid, block, handle, args):
    """Launches a planned kernel through cuda.core; False (nothing launched) where it cannot."""
    function, converters = plan
    params = []
    for conv, a in zip(converters, args):
        if conv is _array_arg and not a.is_contiguous():
            return False
        conv(a, params)
    launch, LaunchConfig, Stream = _API[0]
    stream = _STREAMS.get(handle)
    if stream is None:
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        stream = _STREAMS[handle] = Stream.from_handle(handle)
    config = _CONFIGS.get((grid, block))
    if config is None:
        if len(_CONFIGS) > 4096:
            _CONFIGS.clear()
        config = _CONFIGS[(grid, block)] = LaunchConfig(grid=(grid, 1, 1), block=(block, 1, 1),
                                                         shmem_size=0)
    launch(stream, config, function, *params)
    return True


def _launch_groups(kernel, items, g, device, *args):
    """``items`` units of work (segments, edges), ``g`` lanes each."""
    if items > 0:
        per = _block() // g
        _run(kernel, -(-items // per), device, args)


def _launch_flat(kernel, items, device, *args):
    """One thread per item."""
    if items > 0:
        _run(kernel, -(-items // _block()), device, args)


def _zero(dtype):
    return {torch.float32: np.float32(0), torch.float64: np.float64(0)}[dtype]


def _check_dtype(*xs):
    for x in xs:
        if x is not None and x.dtype not in DTYPES:
            raise TypeError(f"backend 'numba_cuda' supports float32 and float64 (got {x.dtype}); "
                            f"use backend='torch' for half precision")


class _Graph:
    """One CSR's arrays and its row segments on the device, built once per CSR (and per
    ``_SEG_EDGES``)."""

    def __init__(self, csr):
        indptr = csr.indptr
        dev = indptr.device
        n = csr.num_dst
        L = _SEG_EDGES
        deg = indptr[1:] - indptr[:-1]
        nseg = torch.clamp((deg + L - 1) // L, min=1)  # a row without edges keeps one segment
        total = int(nseg.sum()) if n else 0
        rows = torch.repeat_interleave(torch.arange(n, device=dev), nseg, output_size=total)
        first = torch.cumsum(nseg, 0) - nseg
        beg = indptr[rows] + (torch.arange(total, device=dev) - first[rows]) * L
        end = torch.minimum(beg + L, indptr[rows + 1])
        split = nseg > 1
        in_split = split[rows]
        slot = torch.where(in_split, torch.cumsum(in_split, 0) - 1, torch.full_like(rows, -1))
        segs = torch.stack([rows, beg, end, slot], 1).contiguous()
        hrows = torch.nonzero(split).flatten()
        hptr = torch.zeros(hrows.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(nseg[hrows], 0, out=hptr[1:])
        dst_ids = csr.dst_ids()
        self.seg_edges = L
        self.num_segs = total
        self.num_slots = int(hptr[-1])
        self.num_split = int(hrows.numel())
        if dev.type == "cuda":
            # Built on this call's stream; a later call may run on another stream, which must
            # not start reading these before they are written. Once per CSR.
            torch.cuda.current_stream(dev).synchronize()
        self.indptr, self.indices, self.eids = indptr, csr.indices, csr.eids
        self.dst_ids = dst_ids
        self.segs, self.hrows, self.hptr = segs, hrows, hptr
        self._sparse_index, self._ones, self._degrees = None, {}, {}

    def sparse_index(self):
        """(crow, col) of one index dtype for ``torch.sparse_csr_tensor``: int32 both where the
        edges fit, else int64 both (cached)."""
        if self._sparse_index is None:
            small = self.indptr.numel() and int(self.indptr[-1]) < 2 ** 31 - 1
            dtype = torch.int32 if small else torch.int64
            self._sparse_index = (self.indptr.to(dtype).contiguous(),
                                  self.indices.to(dtype).contiguous())
        return self._sparse_index

    def ones(self, dtype):
        """[E] ones, the values of a copy_u sum's sparse matrix (cached per dtype)."""
        if dtype not in self._ones:
            self._ones[dtype] = torch.ones(self.indices.numel(), dtype=dtype,
                                           device=self.indices.device)
        return self._ones[dtype]

    def degrees(self, dtype):
        """[num_dst, 1] in-degrees, at least 1 (a mean's divisor; cached per dtype)."""
        if dtype not in self._degrees:
            deg = (self.indptr[1:] - self.indptr[:-1]).clamp_(min=1)
            self._degrees[dtype] = deg.to(dtype).unsqueeze(1)
        return self._degrees[dtype]

    def scratch(self, lo, dtype, device):
        """[num_slots, lo] partial results of split rows (a 1-row stand-in when none)."""
        return torch.empty((max(1, self.num_slots), lo), dtype=dtype, device=device)


def _graph(csr):
    g = csr._backend_cache.get(NAME)
    if g is None or g.seg_edges != _SEG_EDGES:
        g = csr._backend_cache[NAME] = _Graph(csr)
    return g


_OFFSETS: dict = {}


def _offsets(binop, fl, fr, fo, device):
    """Device copies of the broadcast offset maps, cached: building and copying them each call
    would add a host-to-device copy (and a sync) to every launch."""
    key = (binop, fl, fr, fo, device)
    hit = _OFFSETS.get(key)
    if hit is None:
        loff, roff, red = bcast_offsets(binop, fl, fr, fo)
        tens = (torch.from_numpy(loff).to(device), torch.from_numpy(roff).to(device))
        if device.type == "cuda":  # as in _Graph: later calls may run on other streams
            torch.cuda.current_stream(device).synchronize()
        hit = (tens[0], tens[1], red)
        if len(_OFFSETS) > 256:  # a long-running process with many shapes: keep it bounded
            _OFFSETS.clear()
        _OFFSETS[key] = hit
    return hit


# Sums of source rows, each scaled by at most one number per edge (copy_u, u_mul_e with a scalar
# edge weight, sum or mean; GCN's, GraphSAGE's and GIN's aggregations and their backward on the
# transposed graph) go through cuSPARSE's CSR SpMM (``torch.sparse.mm``): on an H200 1.2-3.9x
# ahead of ``_spmm_sum`` on R-MAT, forward and backward, 0.94-1.6x on a uniform graph
# (benchmarks/README.md, kernels_cuda.py). Its results are not bitwise reproducible run to run
# on rows of many edges (seen there), as torch's own scatter ops: under
# ``torch.use_deterministic_algorithms(True)`` this backend's own kernel, which is, takes them.
# ``cusparse_sums = False``, or ``NGRA_CUDA_CUSPARSE=0``, keeps the kernel always. The sparse
# matrix's indices are int32 where the edges fit (a copy of the CSR's, cached with the graph).
cusparse_sums = os.environ.get("NGRA_CUDA_CUSPARSE", "1") != "0"


def _use_cusparse() -> bool:
    return cusparse_sums and not torch.are_deterministic_algorithms_enabled()


def _cusparse_sum(csr, gr, U, W, mean):
    """``sum_{k in row v} w_k U[indices[k]]`` (``w`` = 1 without ``W``) for every destination
    ``v`` through ``torch.sparse.mm``, divided by the in-degree for a mean (0 for none)."""
    crow, col = gr.sparse_index()
    vals = gr.ones(U.dtype) if W is None else W.reshape(-1)[csr.eids]
    with warnings.catch_warnings():  # torch's one-time note that sparse CSR is in beta
        warnings.simplefilter("ignore", UserWarning)
        a = torch.sparse_csr_tensor(crow, col, vals, (csr.num_dst, csr.num_src),
                                    check_invariants=False)
    out = torch.sparse.mm(a, U)
    if mean:
        out.div_(gr.degrees(U.dtype))
    return out


def spmm(csr, binop, reduce, lhs, rhs, need_arg=True):
    _check_dtype(lhs, rhs)
    gr = _graph(csr)
    dev = csr.device
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fu, fe)
    dtype = (lhs if lhs is not None else rhs).dtype
    lo = math.prod(fo)
    U = _flat(lhs, csr.num_src) if lhs is not None else None
    W = _flat(rhs, csr.num_edges) if rhs is not None else None
    U = U if U is not None else W
    W = W if W is not None else U
    if (reduce in ("sum", "mean") and dev.type == "cuda" and _use_cusparse() and lhs is not None
            and lo and csr.num_dst and csr.num_src and csr.num_edges
            and (binop == "copy_lhs" or (binop == "mul" and math.prod(fe) == 1
                                         and W.dtype == U.dtype))):
        out = _cusparse_sum(csr, gr, U, None if binop == "copy_lhs" else W, reduce == "mean")
        return out.reshape((csr.num_dst,) + fo), None
    loff, roff, _ = _offsets(binop, fu, fe, fo, dev)
    out = torch.empty((csr.num_dst, lo), dtype=dtype, device=dev)
    g = _group(lo)
    arg = None
    if lo == 0 or csr.num_dst == 0:
        if reduce in ("max", "min") and need_arg:
            arg = torch.empty((csr.num_dst,) + fo, dtype=torch.int64, device=dev)
        return out.reshape((csr.num_dst,) + fo), arg
    if reduce in ("sum", "mean"):
        part = gr.scratch(lo, dtype, dev)
        _launch_groups(_spmm_sum, gr.num_segs, g, dev, gr.segs, gr.indices, gr.eids, U, W, out,
                       part, _CODE[binop], loff, roff, reduce == "mean", _zero(dtype), g)
        if gr.num_split:
            _launch_flat(_merge_sum, gr.num_split * lo, dev, gr.hrows, gr.hptr, gr.indptr,
                         part, out, reduce == "mean", _zero(dtype))
    else:
        arg = torch.empty((csr.num_dst, lo) if need_arg else (1, 1), dtype=torch.int64,
                          device=dev)
        pbest = gr.scratch(lo, dtype, dev)
        parg = torch.empty(pbest.shape, dtype=torch.int64, device=dev)
        is_max = reduce == "max"
        _launch_groups(_spmm_maxmin, gr.num_segs, g, dev, gr.segs, gr.indices, gr.eids, U, W,
                       out, arg, pbest, parg, _CODE[binop], loff, roff, is_max, need_arg,
                       _zero(dtype), g)
        if gr.num_split:
            _launch_flat(_merge_maxmin, gr.num_split * lo, dev, gr.hrows, gr.hptr, pbest, parg,
                         out, arg, is_max, need_arg)
        arg = arg.reshape((csr.num_dst,) + fo) if need_arg else None
    return out.reshape((csr.num_dst,) + fo), arg


def spmm_arg_backward(csr, binop, arg, g, lhs, rhs, need_lhs, need_rhs):
    """Gradients of max/min through the arg edges (``arg`` [num_dst, *fo] int64 from
    :func:`spmm`). Computed in the broadcast output shape with one writer per element (no
    atomics, deterministic), then summed down to the operands' shapes by torch."""
    _check_dtype(g, lhs, rhs)
    dev = csr.device
    fo = tuple(g.shape[1:])
    lo = math.prod(fo)
    G = _flat(g, csr.num_dst)
    A = arg.reshape(csr.num_dst, lo)
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    U = _flat(lhs, csr.num_src) if lhs is not None else G
    W = _flat(rhs, csr.num_edges) if rhs is not None else G
    loff, roff, _ = _offsets(binop, fu, fe, fo, dev)
    op = _CODE[binop]
    gu = ge = None
    if need_lhs:
        t = _graph(csr.transpose())
        gu = torch.empty((csr.num_src, lo), dtype=g.dtype, device=dev)
        if lo and csr.num_src:
            part = t.scratch(lo, g.dtype, dev)
            grp = _group(lo)
            _launch_groups(_maxmin_grad_u, t.num_segs, grp, dev, t.segs, t.indices, t.eids, A,
                           G, W, gu, part, op, roff, _zero(g.dtype), grp)
            if t.num_split:
                _launch_flat(_merge_sum, t.num_split * lo, dev, t.hrows, t.hptr, t.indptr,
                             part, gu, False, _zero(g.dtype))
        gu = reduce_to(gu.reshape((csr.num_src,) + fo), fu)
    if need_rhs:
        src, _ = csr.coo()
        ge = torch.zeros((csr.num_edges, lo), dtype=g.dtype, device=dev)
        _launch_flat(_maxmin_grad_e, csr.num_dst * lo, dev, A, src, G, U, W, ge, op, loff,
                     roff)
        ge = reduce_to(ge.reshape((csr.num_edges,) + fo), fe)
    return gu, ge


def sddmm(csr, binop, lhs, lhs_target, rhs, rhs_target):
    _check_dtype(lhs, rhs)
    gr = _graph(csr)
    dev = csr.device
    rows = {"u": csr.num_src, "v": csr.num_dst, "e": csr.num_edges}
    fl = tuple(lhs.shape[1:])
    fr = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fl, fr)
    L = _flat(lhs, rows[lhs_target])
    if rhs is None:
        R, rhs_target = L, lhs_target
    else:
        R = _flat(rhs, rows[rhs_target])
    loff, roff, red = _offsets(binop, fl, fr, fo, dev)
    lo = math.prod(fo)
    out = torch.empty((csr.num_edges, lo), dtype=lhs.dtype, device=dev)
    common = (gr.dst_ids, gr.indices, gr.eids, L, _TARGET[lhs_target], R, _TARGET[rhs_target],
              out)
    if binop == "dot":
        grp = _group(red)
        _launch_groups(_sddmm_dot, csr.num_edges * lo, grp, dev, *common, loff, roff, red,
                       _zero(lhs.dtype), grp)
    else:
        _launch_flat(_sddmm, csr.num_edges * lo, dev, *common, _CODE[binop], loff, roff)
    return out.reshape((csr.num_edges,) + fo)


def edge_softmax(csr, scores):
    _check_dtype(scores)
    gr = _graph(csr)
    dev = csr.device
    S = _flat(scores, csr.num_edges)
    F = S.shape[1]
    Y = torch.empty_like(S)
    if csr.num_edges and F:
        M = torch.empty((csr.num_dst, F), dtype=S.dtype, device=dev)
        Z = torch.empty_like(M)
        pm, pz = gr.scratch(F, S.dtype, dev), gr.scratch(F, S.dtype, dev)
        grp = _group(F)
        zero = _zero(S.dtype)
        _launch_groups(_softmax_rows, gr.num_segs, grp, dev, gr.segs, gr.eids, S, M, Z, pm, pz,
                       zero, grp)
        if gr.num_split:
            _launch_flat(_softmax_merge, gr.num_split * F, dev, gr.hrows, gr.hptr, pm, pz, M,
                         Z, zero)
        _launch_flat(_softmax_edges, csr.num_edges * F, dev, csr.coo()[1], S, M, Z, Y)
    return Y.reshape(scores.shape)


def edge_softmax_backward(csr, y, grad_y):
    _check_dtype(y, grad_y)
    gr = _graph(csr)
    dev = csr.device
    Y, G = _flat(y, csr.num_edges), _flat(grad_y, csr.num_edges)
    F = Y.shape[1]
    GS = torch.empty_like(Y)
    if csr.num_edges and F:
        T = torch.empty((csr.num_dst, F), dtype=Y.dtype, device=dev)
        part = gr.scratch(F, Y.dtype, dev)
        grp = _group(F)
        zero = _zero(Y.dtype)
        _launch_groups(_softmax_bwd_rows, gr.num_segs, grp, dev, gr.segs, gr.eids, Y, G, T,
                       part, zero, grp)
        if gr.num_split:
            _launch_flat(_merge_sum, gr.num_split * F, dev, gr.hrows, gr.hptr, gr.indptr,
                         part, T, False, zero)
        _launch_flat(_softmax_bwd_edges, csr.num_edges * F, dev, csr.coo()[1], Y, G, T, GS)
    return GS.reshape(y.shape)
