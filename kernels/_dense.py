"""A GNN layer's dense ops (``Linear``, ReLU, LeakyReLU, ``addcmul``, ``+``, ``*``) with their
outputs and input gradients in the output cache (``kernels/_outcache.py``).

Torch allocates every result afresh, and each large CPU tensor is new pages that page-fault on
their first write: a GIN epoch on R-MAT 1M / 16M made fourteen [N, 64] tensors (3.5 GiB) in its
MLPs and their backward, 2036 huge-page faults and 1.1-3.3 s of system time a 2.3-3.7 s epoch on
the project's machine. Here each op is an autograd Function that calls the same aten kernels
with ``out=`` a cached block (forward and backward), so the values are torch's to the bit, and a
training loop's [N, F] results reuse warm pages (``benchmarks/README.md``, e2e). Two exceptions:
a Linear's weight gradient, the same sums in another order (see ``_weight_grad``); and float32
Linears on many rows (``kernels._gemm.applies``), whose products and input gradients come
from ``kernels._gemm``'s register tiles (faster than MKL's GEMM here): each sum in k order, one
rounding per term, which is MKL's order here too for up to 128 terms, but equal to torch's only
up to rounding in general.

A Linear whose input is the output of ``kernels._dropout.dropout`` (a model's dropout of its input
features) keeps the dropout's input, which the caller keeps anyway, and the dropout's byte mask
(``kernels._dropout.mask_of``) instead of its output, and its backward makes the dropout again
for the weight gradient, a block of rows at a time (in the weight-gradient kernel
``kernels._dropout.weight_grads`` where it applies, else 16 MiB of rows at a time for torch's
GEMMs): three quarters of a float32 [N, in] tensor less from the forward to the end of backward
(384 MiB for R-MAT's 1M x 128 features; the e2e benchmark's peak RSS), and no [N, in] block to
find in backward.

:func:`call` is what ``ngra``'s interpreter calls for a traced module, function or method: the
value through this module, or ``NotImplemented`` where it does not apply. It applies to plain
CPU tensors of one dtype (float32 / float64) whose result is at least 1 MiB (smaller ones come
from glibc's heap, which reuses memory anyway), outside autocast, forward-mode AD, functorch
transforms and torch function / dispatch modes (those see torch's own op). Backward under
``create_graph=True`` computes with torch's differentiable ops, so higher-order gradients work.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.nn.modules import module as mm
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _dropout
from . import _gemm as _rows_gemm
from ._outcache import CACHE as _CACHE
from ._outcache import MIN_BYTES

__all__ = ["call", "call_module", "linear", "linear_group", "relu_linear", "linear_relu_linear",
           "relu", "leaky_relu", "addcmul", "add", "mul"]

_DTYPES = (torch.float32, torch.float64)


def _plain(t) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _autocast_cpu() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def usable(shape, *tensors) -> bool:
    """Whether a result of ``shape`` computed from ``tensors`` (all tensors) takes the cached
    path (see the module docstring)."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or _CACHE.limit == 0:
        return False
    if math.prod(shape) * tensors[0].element_size() < MIN_BYTES:
        return False
    if not all(_plain(t) and t.dtype == dtype for t in tensors):
        return False
    if _autocast_cpu() or torch.autograd.forward_ad._current_level >= 0:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    return _get_current_dispatch_mode() is None


def _out(fn, shape, dtype, *args, out_name="out"):
    """``fn(*args)`` into a cached block (passed as ``out_name``: ``grad_input`` for aten's
    backward ops); under grad mode (a backward with ``create_graph=True``) a plain
    differentiable call."""
    if torch.is_grad_enabled():
        return fn(*args)
    return fn(*args, **{out_name: _CACHE.empty(tuple(shape), dtype)})


def _reduce(g: torch.Tensor, shape) -> torch.Tensor:
    """A gradient of the broadcast result summed to an operand's ``shape`` (as autograd does)."""
    return g if g.shape == shape else g.sum_to_size(shape)


# -- Linear ---------------------------------------------------------------------------------------
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        need = ctx.needs_input_grad  # x's gradient needs the weight, the weight's needs x
        # x the dropout of a tensor kept anyway (a model's input features): that tensor is kept
        # instead, and x made again in backward (an [N, in] tensor less from here to there)
        ctx.remat = _dropout.recipe(x) if need[1] else None
        ctx.mask = _dropout.mask_of(x) if ctx.remat is not None else None
        keep = ctx.remat[0] if ctx.remat is not None else x
        ctx.save_for_backward(keep if need[1] else None, weight if need[0] else None)
        ctx.has_bias = bias is not None
        return _gemm(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm(g, weight)
        if ctx.needs_input_grad[1]:
            if ctx.remat is None:
                gw = _weight_grad(x, g)
            else:
                gw = _weight_grad_dropped(x, *ctx.remat[1:], g, ctx.mask)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


def _mm(a, w, bias=None):
    """``a @ w`` (``+ bias``) into a cached block: in ``kernels._gemm``'s register tiles where
    they apply (float32, many rows: faster than MKL's here), else with torch's mm / addmm (under
    grad mode, a backward with ``create_graph=True``, differentiable)."""
    shape = (a.shape[0], w.shape[1])
    if _rows_gemm.applies(a, w):
        return _rows_gemm.mm(a, w, _CACHE.empty(shape, a.dtype), bias)
    if bias is None:
        return _out(torch.mm, shape, a.dtype, a, w)
    return _out(torch.addmm, shape, a.dtype, bias, a, w)


def _gemm(x, weight, bias):
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` (see :func:`_mm`)."""
    return _mm(x, weight.t(), bias)


def _linear_form(x, weight, bias) -> bool:
    """Whether ``F.linear(x, weight, bias)`` has the form the cached Linears take: tensors, a 2-D
    ``x`` and ``weight`` of matching width, no bias or a 1-D one."""
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))
            and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and (bias is None or bias.dim() == 1))


def _weight_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A Linear's weight gradient ``g^T x`` ([out, in]) for a long ``x`` [N, in], ``g`` [N, out].

    The GEMM ``a^T b`` over a long N is fast when ``b`` has at least ~16 columns and several
    times slower when it is narrow and ``a`` wide (MKL, 2 cores, N = 1M: [1M, 64]^T [1M, 4]
    233 ms against 31 ms the other way, which GAT's per-head score projections hit). So
    ``(x^T g)^T`` where ``g`` is wide enough (the same sums in another order, equal up to
    rounding, and faster for a long, narrow x: [18K, 6805] / [18K, 64] 144 -> 122 ms, [1M, 64] /
    [1M, 16] 46 -> 41 ms) and torch's ``g^T x`` otherwise (``benchmarks/gemm_orientation.py``).
    """
    if _wide(x, g):
        return x.t().mm(g).t().contiguous()
    return g.t().mm(x)


def _wide(x: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether a weight gradient of ``x`` [N, in] and ``g`` [N, out] is computed as
    ``(x^T g)^T`` (see :func:`_weight_grad`)."""
    return g.shape[1] >= min(x.shape[1], 16)


def _accumulator(width_in, width_out, wide, dtype):
    """Zeros for a weight gradient [out, in] summed over blocks, held as [in, out] where
    :func:`_weight_grad` would take ``(x^T g)^T`` (``wide``)."""
    return torch.zeros((width_in, width_out) if wide else (width_out, width_in), dtype=dtype)


def _accumulate(acc, wide, x, g):
    """``acc += x^T g`` (wide) or ``g^T x``: a block's share of a weight gradient."""
    if wide:
        acc.addmm_(x.t(), g)
    else:
        acc.addmm_(g.t(), x)


def _finish(acc, wide):
    return acc.t().contiguous() if wide else acc


def _weight_grad_dropped(x: torch.Tensor, p: float, seed: int, rows, g: torch.Tensor, mask=None):
    """:func:`_weight_grad` of ``dropout(x, p, seed, rows)`` (``kernels._dropout``) and ``g``, the
    dropout made again 16 MiB of rows at a time (``_dropout.chunks``) and each chunk's
    product accumulated in row order: no [N, in] tensor (fresh pages, or a cached block held
    for it), its writes and reads in cache. The same sums as :func:`_weight_grad`'s GEMM in
    another grouping (equal up to rounding). ``mask``: the dropout's keep flags
    (``_dropout.mask_of``), read instead of hashing each element again. Under grad mode (a
    backward with ``create_graph=True``): the GEMM of the differentiable dropout made again."""
    if torch.is_grad_enabled():
        return _weight_grad(_dropout.recompute(x, p, seed, rows), g)
    return _weight_grads_dropped(x, p, seed, rows, [g], mask)[0]


def _weight_grads_dropped(x: torch.Tensor, p: float, seed: int, rows, gs, mask=None) -> list:
    """:func:`_weight_grad_dropped` for several gradients ``gs`` of Linears sharing the dropout
    ``x``: the dropout made again once for all of them, each chunk's products for every ``g``
    while the chunk is in cache. Where it applies (float32, gradients 16 to 192 wide in all, the
    whole tensor's dropout), one numba kernel makes the dropout again a block of rows at a time
    and takes the products in register tiles (``kernels._dropout.weight_grads``)."""
    if rows is None:
        fused = _dropout.weight_grads(x, p, seed, gs, mask)
        if fused is not None:
            return fused
    wide = [_wide(x, g) for g in gs]
    accs = [_accumulator(x.shape[1], g.shape[1], w, g.dtype) for g, w in zip(gs, wide)]
    for r0, r1, xd in _dropout.chunks(x, p, seed, rows, mask):
        for acc, g, w in zip(accs, gs, wide):
            _accumulate(acc, w, xd, g[r0:r1])
    return [_finish(acc, w) for acc, w in zip(accs, wide)]


def _linear(x, weight, bias=None):
    operands = (x, weight) if bias is None else (x, weight, bias)
    if _linear_form(x, weight, bias) and usable((x.shape[0], weight.shape[0]), *operands):
        act = _offered(x, weight.shape[0])
        if act is not None:
            return _ReluDropoutLinear.apply(act[0], x.detach(), act[1], weight, bias)[0]
        return _Linear.apply(x, weight, bias)
    return NotImplemented


class _DropoutLinear(torch.autograd.Function):
    """``F.linear(dropout(x, p, seed), weight, bias)`` with the dropout made a block of rows at a
    time inside the product (``kernels._dropout.dropout_mm``): no [N, in] tensor for it, its
    write and read back saved. Backward is :class:`_Linear`'s on a dropout it can make again:
    the weight gradient from ``x`` and the keep flags, ``x``'s gradient the dropout of ``g W``
    from the same flags. The same bits as the dropout followed by the cached Linear."""

    @staticmethod
    def forward(ctx, x, p, seed, weight, bias):
        out, keep = _dropout.dropout_mm(x, p, seed, weight.t(), bias)
        ctx.p, ctx.seed, ctx.keep, ctx.has_bias = p, seed, keep, bias is not None
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = gw = gb = None
        if need[0]:  # the dropout's backward of g W (differentiable under create_graph)
            gm = _mm(g, weight)
            gx = (_dropout.recompute(gm, ctx.p, ctx.seed) if torch.is_grad_enabled()
                  else _dropout.masked(gm, ctx.p, ctx.keep))
        if need[3]:
            gw = _weight_grad_dropped(x, ctx.p, ctx.seed, None, g, ctx.keep)
        if ctx.has_bias and need[4]:
            gb = g.sum(0)
        return gx, None, None, gw, gb


def dropout_linear(x: torch.Tensor, p: float, seed: int, weight: torch.Tensor,
                   bias: torch.Tensor | None = None):
    """``linear(dropout(x, p, seed), weight, bias)`` (``kernels._dropout.dropout``: the same
    mask, the same bits) in one kernel where it applies (float32 on the CPU, C-contiguous ``x``
    of many rows, an output width that is a multiple of 8: see ``_dropout.dropout_mm``), else
    ``NotImplemented``: the caller then makes the dropout with this seed itself."""
    if not (0.0 < p < 1.0 and _linear_form(x, weight, bias)
            and usable((x.shape[0], weight.shape[0]),
                       *((x, weight) if bias is None else (x, weight, bias)))
            and _dropout.dropout_mm_applies(x, weight.t())):
        return NotImplemented
    return _DropoutLinear.apply(x, float(p), int(seed), weight, bias)


def _side_by_side(gs, idx):
    """The gradients ``gs[i]`` of Linears ``i in idx`` as one [N, sum out] tensor (the one
    gradient itself for a single Linear)."""
    if len(idx) == 1:
        return gs[idx[0]]
    parts = [gs[i] for i in idx]
    width = sum(g.shape[1] for g in parts)
    return _out(torch.cat, (parts[0].shape[0], width), parts[0].dtype, parts, 1)


def _cut_rows(stacked, gs, idx):
    """The weight gradients of Linears ``idx`` from one GEMM over their gradients side by side
    (``stacked`` [sum out, in]): each Linear's rows, its own tensor where there are several."""
    bounds = [0]
    for i in idx:
        bounds.append(bounds[-1] + gs[i].shape[1])
    gw = [stacked[a:b] for a, b in zip(bounds, bounds[1:])]
    return [t.clone() for t in gw] if len(idx) > 1 else gw


class _ReluDropoutLinear(torch.autograd.Function):
    """``F.linear(a, w_i, b_i)`` for one or more Linears (``wb`` = ``w_0, b_0, ...``, a bias may
    be None) on ``a = relu_dropout(z, p, seed)`` (``kernels._dropout``, offered as fusable),
    differentiable with respect to ``z`` rather than ``a``: the backward makes ``a``'s gradient
    (the gradients side by side times the weights stacked, as :class:`_LinearGroup`) a block of
    rows at a time, into a buffer in cache, and takes the ReLU's and dropout's backward there
    (``* scale`` where ``a > 0``, 0 elsewhere; where ``kernels._gemm`` applies, in its register
    tiles' epilogue, with no buffer), so that gradient [N, in] never goes to memory
    and relu_dropout's backward does not read it back: one pass over [N, in] less each way.
    relu_dropout's own backward then runs only for ``a``'s other consumers. Forward is
    :class:`_LinearGroup`'s (``a`` is kept, as relu_dropout keeps it anyway); where
    :func:`_together` applies, the weight and bias gradients come from the same pass as ``z``'s
    (``kernels._gemm.mlp_backward``), elsewhere from :class:`_LinearGroup`'s GEMM. ``z``'s
    gradient has the values of relu_dropout's backward of ``a``'s, except where that is NaN or
    infinite at an element ``a`` is not positive: 0 here (as torch's ReLU), ``grad * 0``
    there."""

    @staticmethod
    def forward(ctx, z, a, scale, *wb):
        ws, bs = wb[0::2], wb[1::2]
        need = ctx.needs_input_grad
        ctx.scale, ctx.has_bias = scale, tuple(b is not None for b in bs)
        ctx.save_for_backward(a, *(ws if need[0] else ()))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return tuple(_gemm(a, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *gs):
        a, *ws = ctx.saved_tensors
        need = ctx.needs_input_grad
        live = [i for i, g in enumerate(gs) if g is not None]
        grads = [None] * len(need)
        wanted = [i for i in live if need[3 + 2 * i]]
        if need[0] and live:
            gc = _side_by_side(gs, live)
            w = ws[live[0]] if len(live) == 1 else torch.cat([ws[i] for i in live])
            if torch.is_grad_enabled():  # create_graph: torch's differentiable ops
                grads[0] = gc.mm(w).mul(ctx.scale) * (a > 0).to(gc.dtype)
            elif wanted and _together(a, w, gc):
                # z's gradient, the weight gradients and the bias sums in one pass over a and g
                grads[0] = _CACHE.empty(tuple(a.shape), gc.dtype)
                _, _, _, gw, gb = _rows_gemm.mlp_backward(
                    a, None, a, w, gc, grads[0], (True, False, False, True, True), ctx.scale)
                for i, gwi, gbi in zip(live, _cut_rows(gw, gs, live), _cut_rows(gb, gs, live)):
                    if need[3 + 2 * i]:
                        grads[3 + 2 * i] = gwi
                    if ctx.has_bias[i] and need[4 + 2 * i]:
                        grads[4 + 2 * i] = gbi
                return tuple(grads)
            elif _rows_gemm.applies(gc, w):  # the mask and scale in the tiles' epilogue
                grads[0] = _rows_gemm.mm_relu_grad(gc, w, a, ctx.scale,
                                                   _CACHE.empty(tuple(a.shape), gc.dtype))
            else:
                n = a.shape[0]
                step = _mlp_rows(a.shape[1], a.element_size())
                buf = _CACHE.empty((min(step, n), a.shape[1]), gc.dtype)
                gz = grads[0] = _CACHE.empty(tuple(a.shape), gc.dtype)
                for r0 in range(0, n, step):
                    r1 = min(n, r0 + step)
                    ga = torch.mm(gc[r0:r1], w, out=buf[:r1 - r0]).mul_(ctx.scale)
                    torch.ops.aten.threshold_backward.grad_input(ga, a[r0:r1], 0,
                                                                 grad_input=gz[r0:r1])
        if wanted:  # one weight-gradient GEMM over a, cut into the Linears' rows
            gw = _cut_rows(_weight_grad(a, _side_by_side(gs, wanted)), gs, wanted)
            for i, t in zip(wanted, gw):
                grads[3 + 2 * i] = t
        for i in live:
            if ctx.has_bias[i] and need[4 + 2 * i]:
                grads[4 + 2 * i] = gs[i].sum(0)
        return tuple(grads)


# the widest Linears (their outputs summed) that take relu_dropout's backward. Backward of Linears
# on relu_dropout(z), z [1M, 64], the offer taken or not, taking turns (10-14 rounds, medians,
# scratch script, 2026-11-28): one Linear to 16 features 177 -> 141 ms (0.80), 32 0.85, 48 0.86,
# 64 0.87; two to 16 each 229 -> 200 (0.87); to 64 + 16, 405 -> 412 (1.02).
RELU_LINEAR_MAX_WIDTH = 64


def _together(a, w, gc):
    """Whether :class:`_ReluDropoutLinear`'s backward takes z's gradient and the weight and bias
    gradients in one pass (``kernels._gemm.mlp_backward``, the weight-gradient products in
    register tiles of 16 columns of ``gc``): many float32 rows, widths multiples of 8, ``gc``'s
    of 16. Backward of one Linear [1M, 64] -> 16 (scratch timing, 9 rounds taking turns,
    2026-11-29): 127 ms for the tiles' input gradient, MKL's ``a^T g`` and ``g.sum(0)``, 93 in
    one pass."""
    return _rows_gemm.mlp_applies(a, None, w) and gc.shape[1] % _rows_gemm._JT == 0


def _offered(x, width):
    """``(z, scale)`` where ``x`` is an offered relu_dropout output that Linears of ``width``
    outputs in all take (see :class:`_ReluDropoutLinear`); else None. The offer ends here either
    way: ``z`` need not outlive this call (the Function keeps only ``x``), nor, declined, wait
    for the layer to return."""
    act = _dropout.relu_dropout_of(x)
    if act is None:
        return None
    _dropout.forget(x)
    if not (x.requires_grad and torch.is_grad_enabled()) or width > RELU_LINEAR_MAX_WIDTH:
        return None
    return act


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``; cached for a 2-D ``x``."""
    out = _linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is NotImplemented else out


# -- Linears sharing their input ------------------------------------------------------------------
class _LinearGroup(torch.autograd.Function):
    """``F.linear(x, w_i, b_i)`` for several Linears on one ``x`` (``wb`` = ``w_0, b_0, w_1, b_1,
    ...``, a bias may be None). The forward is :class:`_Linear`'s, one GEMM per Linear into its
    own block (the separate Linears' values to the bit). The backward takes all the gradients at
    once (autograd calls it when every output's gradient is in): ``x``'s gradient as one GEMM of
    the gradients side by side ([N, sum out]) and the weights stacked, instead of one [N, in]
    product per Linear and their sums; the weight gradients in one pass over ``x`` (over the
    dropout made again once, where ``x`` is a dropout of the input features, not once per
    Linear). Both are the same sums as the separate Linears' in another grouping (equal up to
    rounding)."""

    @staticmethod
    def forward(ctx, x, *wb):
        ws, bs = wb[0::2], wb[1::2]
        need = ctx.needs_input_grad
        need_w = any(need[1::2])
        ctx.remat = _dropout.recipe(x) if need_w else None
        ctx.mask = _dropout.mask_of(x) if ctx.remat is not None else None
        keep = ctx.remat[0] if ctx.remat is not None else x
        ctx.save_for_backward(keep if need_w else None, *(ws if need[0] else ()))
        ctx.has_bias = tuple(b is not None for b in bs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return tuple(_gemm(x, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *gs):
        x, *ws = ctx.saved_tensors
        need = ctx.needs_input_grad
        live = [i for i, g in enumerate(gs) if g is not None]
        grads = [None] * len(need)
        gc = None
        if need[0] and live:
            gc = _side_by_side(gs, live)
            w = ws[live[0]] if len(live) == 1 else torch.cat([ws[i] for i in live])
            grads[0] = _mm(gc, w)
        wanted = [i for i in live if need[1 + 2 * i]]
        if wanted:
            if ctx.remat is None:  # one weight-gradient GEMM over x, cut into the Linears' rows
                if gc is None or len(wanted) != len(live):
                    gc = _side_by_side(gs, wanted)
                gw = _cut_rows(_weight_grad(x, gc), gs, wanted)
            elif torch.is_grad_enabled():  # create_graph: through the differentiable dropout
                xd = _dropout.recompute(x, *ctx.remat[1:])
                gw = [_weight_grad(xd, gs[i]) for i in wanted]
            else:
                gw = _weight_grads_dropped(x, *ctx.remat[1:], [gs[i] for i in wanted], ctx.mask)
            for i, t in zip(wanted, gw):
                grads[1 + 2 * i] = t
        for i in live:
            if ctx.has_bias[i] and need[2 + 2 * i]:
                grads[2 + 2 * i] = gs[i].sum(0)
        return tuple(grads)


def linear_group(x: torch.Tensor, *linears) -> tuple:
    """``(linear_0(x), linear_1(x), ...)`` for Linears reading the same ``x``, each a
    ``torch.nn.Linear`` or a ``(weight, bias)`` pair of ``F.linear`` (bias may be None), as
    ``ngra.passes.group_linears`` groups them in a compiled program. The values are the separate
    Linears' to the bit; their backward runs once for all of them (:class:`_LinearGroup`). If a
    module among them has hooks, every Linear is called on its own (a module through its own
    call), so that the hooks run; so is a module other than a plain ``torch.nn.Linear``."""
    if not linears:
        raise ValueError("linear_group needs at least one Linear after x: a torch.nn.Linear or "
                         "a (weight, bias) pair")
    wb = []
    for k, lin in enumerate(linears):
        if isinstance(lin, torch.nn.Linear):
            wb += [lin.weight, lin.bias]
        elif isinstance(lin, (tuple, list)) and len(lin) == 2:
            wb += list(lin)
        else:
            raise TypeError(f"linear_group: Linear {k} must be a torch.nn.Linear or a (weight, "
                            f"bias) pair with bias None for none (got {type(lin).__name__})")
    ws, bs = wb[0::2], wb[1::2]
    operands = [x, *ws, *(b for b in bs if b is not None)]
    if (not any(isinstance(m, torch.nn.Module) and (type(m) is not torch.nn.Linear or _hooked(m))
                for m in linears)
            and all(_linear_form(x, w, b) and (b is None or b.shape[0] == w.shape[0])
                    for w, b in zip(ws, bs))
            and usable((x.shape[0], sum(w.shape[0] for w in ws)), *operands)):
        act = _offered(x, sum(w.shape[0] for w in ws))
        if act is not None:
            return _ReluDropoutLinear.apply(act[0], x.detach(), act[1], *wb)
        return _LinearGroup.apply(x, *wb)
    return tuple(m(x) if isinstance(m, torch.nn.Module) else linear(x, w, b)
                 for m, w, b in zip(linears, ws, bs))


# -- ReLU then Linear, and a Linear before them ---------------------------------------------------
# bytes of the ReLU's input per block of rows in :class:`_BlockedMlp` (its output, the Linears'
# results and in backward the gradients beside it stay in the L2 / L3 caches). ReLU -> Linear on
# [1M, 64], forward and backward, one process, the two forms taking turns (scratch script,
# 2026-11-28, 16 rounds, medians): to 64 features 435 ms as separate ops, 326 in blocks of 8192
# rows; to 16 features 234 and 161. In earlier, noisier runs blocks of 4096 rows did as well as
# 8192, 16384 less well, and 32768 or 65536 no better than the separate ops.
RELU_LINEAR_BYTES = 2 << 20


class _BlockedMlp(torch.autograd.Function):
    """``F.linear(relu(F.linear(x, w1, b1)), w2, b2)`` -- with ``w1`` None, ``F.linear(relu(x),
    w2, b2)`` -- a block of rows at a time: each block's ReLU goes to a reused buffer and
    straight into its rows' second GEMM, so the [N, hidden] ReLU output is never written out,
    read back, nor kept (the first Linear's output ``h`` is, in place of it). Backward makes
    each block's ReLU again from ``h`` and takes, while the block is in cache, the second
    Linear's weight-gradient GEMM and bias sum, the hidden gradient (a GEMM, then the ReLU's
    mask) and from it the first Linear's weight gradient, bias sum and input gradient: the
    hidden gradient is never written out either. Torch's ops would make a ReLU pass, a mask pass,
    a bias sum pass per Linear and the hidden gradient's write and reads, each over [N, hidden]
    in memory, and a bias copy into each Linear's output. The forward's values are the separate
    ops' (the same aten kernels on blocks of rows; equal up to rounding where MKL groups a
    block's sums otherwise); weight and bias gradients are sums over the blocks (equal up to
    rounding).

    Where ``kernels._gemm.mlp_applies`` (float32, many rows, widths multiples of 8), forward and
    backward are each one numba kernel over blocks of 96 rows, every product in register tiles
    (``kernels._gemm``): no torch call per block, and the weight and bias gradients summed in
    float64. GIN's two MLPs on R-MAT 1M / 16M under ``torch.profiler`` (scratch, 2026-11-29):
    forward 304 -> 194 ms, backward 895 -> 480 ms."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        n = x.shape[0]
        first = w1 is not None
        hidden = w1.shape[0] if first else x.shape[1]
        h = _CACHE.empty((n, hidden), x.dtype) if first else x
        out = _CACHE.empty((n, w2.shape[0]), x.dtype)
        ctx.save_for_backward(x, w1, b1, h if first else None, w2)
        if _rows_gemm.mlp_applies(x, w1, w2):  # one numba kernel, its blocks in register tiles
            return _rows_gemm.mlp_forward(x, w1, b1, w2, b2, h, out)
        step = _mlp_rows(hidden, x.element_size())
        buf = _CACHE.empty((min(step, n), hidden), x.dtype)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            if first:
                _affine(x[r0:r1], w1, b1, h[r0:r1])
            a = torch.clamp_min(h[r0:r1], 0, out=buf[:r1 - r0])  # aten's relu on the CPU
            _affine(a, w2, b2, out[r0:r1])
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, b1, h, w2 = ctx.saved_tensors
        first = w1 is not None
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        need_h = need_x or need_w1 or need_b1
        if torch.is_grad_enabled():  # create_graph: torch's differentiable ops, whole tensors
            h = F.linear(x, w1, b1) if first else x
            a = torch.relu(h)
            gh = torch.ops.aten.threshold_backward(g.mm(w2), a, 0) if need_h else None
            gx = (gh.mm(w1) if first else gh) if need_x else None
            return (gx, gh.t().mm(x) if need_w1 else None, gh.sum(0) if need_b1 else None,
                    g.t().mm(a) if need_w2 else None, g.sum(0) if need_b2 else None)
        if not first:
            h = x
        if _rows_gemm.mlp_applies(x, w1, w2):
            gx = _CACHE.empty(tuple(x.shape), g.dtype) if need_x else None
            return _rows_gemm.mlp_backward(x, w1, h, w2, g, gx, ctx.needs_input_grad)
        n, hidden = h.shape
        step = _mlp_rows(hidden, h.element_size())
        rows = min(step, n)
        buf = _CACHE.empty((rows, hidden), h.dtype)
        gabuf = _CACHE.empty((rows, hidden), g.dtype) if need_h else None
        ghbuf = _CACHE.empty((rows, hidden), g.dtype) if need_h and first else None
        gx = _CACHE.empty(tuple(x.shape), g.dtype) if need_x else None
        wide2 = _wide(h, g)
        gw2 = _accumulator(hidden, g.shape[1], wide2, g.dtype) if need_w2 else None
        gb2 = torch.zeros(g.shape[1], dtype=g.dtype) if need_b2 else None
        wide1 = first and _wide(x, h)
        gw1 = _accumulator(x.shape[1], hidden, wide1, g.dtype) if need_w1 else None
        gb1 = torch.zeros(hidden, dtype=g.dtype) if need_b1 else None
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            a = torch.clamp_min(h[r0:r1], 0, out=buf[:r1 - r0])
            gy = g[r0:r1]
            if need_w2:
                _accumulate(gw2, wide2, a, gy)
            if need_b2:
                gb2 += gy.sum(0)
            if not need_h:
                continue
            ga = torch.mm(gy, w2, out=gabuf[:r1 - r0])
            gh = ghbuf[:r1 - r0] if first else gx[r0:r1]
            torch.ops.aten.threshold_backward.grad_input(ga, a, 0, grad_input=gh)
            if need_w1:
                _accumulate(gw1, wide1, x[r0:r1], gh)
            if need_b1:
                gb1 += gh.sum(0)
            if need_x and first:
                torch.mm(gh, w1, out=gx[r0:r1])
        return (gx, _finish(gw1, wide1) if need_w1 else None, gb1,
                _finish(gw2, wide2) if need_w2 else None, gb2)


def _affine(x, w, b, out):
    """``F.linear(x, w, b)`` into ``out`` with F.linear's kernels (mm, or addmm with a bias)."""
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def _mlp_rows(hidden: int, itemsize: int) -> int:
    return max(64, RELU_LINEAR_BYTES // max(1, hidden * itemsize))


def relu_linear(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(torch.relu(z), weight, bias)``, a block of rows at a time for a 2-D CPU ``z``
    (:class:`_BlockedMlp`), else through :func:`relu` and :func:`linear`."""
    operands = (z, weight) if bias is None else (z, weight, bias)
    if _linear_form(z, weight, bias) and usable(z.shape, *operands):  # the [N, hidden] passes
        return _BlockedMlp.apply(z, None, None, weight, bias)
    return linear(relu(z), weight, bias)


def linear_relu_linear(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                       w2: torch.Tensor, b2: torch.Tensor | None = None):
    """``F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)`` (an MLP Linear -> ReLU -> Linear),
    a block of rows at a time for a 2-D CPU ``x`` (:class:`_BlockedMlp`), else through
    :func:`linear` and :func:`relu_linear`."""
    ops1 = (x, w1) if b1 is None else (x, w1, b1)
    ops2 = (w2,) if b2 is None else (w2, b2)
    if (_linear_form(x, w1, b1) and isinstance(w2, torch.Tensor) and w2.dim() == 2
            and w2.shape[1] == w1.shape[0] and (b2 is None or (isinstance(b2, torch.Tensor)
                                                             and b2.dim() == 1))
            and usable((x.shape[0], w1.shape[0]), *ops1, *ops2)):  # the [N, hidden] passes
        return _BlockedMlp.apply(x, w1, b1, w2, b2)
    return relu_linear(linear(x, w1, b1), w2, b2)


# -- ReLU -----------------------------------------------------------------------------------------
class _Relu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = _out(torch.clamp_min, x.shape, x.dtype, x, 0)  # aten's relu on the CPU
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        out, = ctx.saved_tensors
        return _out(torch.ops.aten.threshold_backward, g.shape, g.dtype, g, out, 0,
                    out_name="grad_input")


def _relu(x):
    return _Relu.apply(x) if isinstance(x, torch.Tensor) and usable(x.shape, x) else NotImplemented


def relu(x: torch.Tensor) -> torch.Tensor:
    """``torch.relu(x)``, cached."""
    out = _relu(x)
    return torch.relu(x) if out is NotImplemented else out


# -- LeakyReLU ------------------------------------------------------------------------------------
class _LeakyRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slope):
        ctx.save_for_backward(x)  # torch's gradient reads the input (self_is_result=False)
        ctx.slope = slope
        return _out(torch.ops.aten.leaky_relu, x.shape, x.dtype, x, slope)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return _out(torch.ops.aten.leaky_relu_backward, g.shape, g.dtype, g, x, ctx.slope, False,
                    out_name="grad_input"), None


def _leaky_relu(x, negative_slope=0.01):
    if (isinstance(x, torch.Tensor) and isinstance(negative_slope, (int, float))
            and not isinstance(negative_slope, bool) and usable(x.shape, x)):
        return _LeakyRelu.apply(x, float(negative_slope))
    return NotImplemented


def leaky_relu(x: torch.Tensor, negative_slope: float = 0.01) -> torch.Tensor:
    """``F.leaky_relu(x, negative_slope)``, cached."""
    out = _leaky_relu(x, negative_slope)
    return F.leaky_relu(x, negative_slope) if out is NotImplemented else out


# -- element-wise: addcmul, add, mul --------------------------------------------------------------
class _Addcmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, t1, t2):
        need = ctx.needs_input_grad
        # t1's gradient needs t2, t2's needs t1
        ctx.save_for_backward(t2 if need[1] else None, t1 if need[2] else None)
        ctx.shapes = a.shape, t1.shape, t2.shape
        shape = torch.broadcast_shapes(*ctx.shapes)
        return _out(torch.addcmul, shape, a.dtype, a, t1, t2)

    @staticmethod
    def backward(ctx, g):
        t2, t1 = ctx.saved_tensors
        need, (sa, s1, s2) = ctx.needs_input_grad, ctx.shapes
        ga = _reduce(g, sa) if need[0] else None
        g1 = _reduce(_out(torch.mul, g.shape, g.dtype, g, t2), s1) if need[1] else None
        g2 = _reduce(_out(torch.mul, g.shape, g.dtype, g, t1), s2) if need[2] else None
        return ga, g1, g2


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        return _out(torch.add, torch.broadcast_shapes(a.shape, b.shape), a.dtype, a, b)

    @staticmethod
    def backward(ctx, g):
        need, (sa, sb) = ctx.needs_input_grad, ctx.shapes
        return (_reduce(g, sa) if need[0] else None), (_reduce(g, sb) if need[1] else None)


class _Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        need = ctx.needs_input_grad
        ctx.save_for_backward(b if need[0] else None, a if need[1] else None)
        ctx.shapes = a.shape, b.shape
        return _out(torch.mul, torch.broadcast_shapes(a.shape, b.shape), a.dtype, a, b)

    @staticmethod
    def backward(ctx, g):
        b, a = ctx.saved_tensors
        need, (sa, sb) = ctx.needs_input_grad, ctx.shapes
        ga = _reduce(_out(torch.mul, g.shape, g.dtype, g, b), sa) if need[0] else None
        gb = _reduce(_out(torch.mul, g.shape, g.dtype, g, a), sb) if need[1] else None
        return ga, gb


def _elementwise(fn, *operands):
    """``fn.apply(*operands)`` when they are tensors that broadcast to a result the cached path
    takes, else NotImplemented."""
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return NotImplemented
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in operands))
    except RuntimeError:  # torch's own op says why
        return NotImplemented
    return fn.apply(*operands) if usable(shape, *operands) else NotImplemented


def addcmul(a, t1, t2):
    """``torch.addcmul(a, t1, t2)`` (``value=1``), cached."""
    out = _elementwise(_Addcmul, a, t1, t2)
    return torch.addcmul(a, t1, t2) if out is NotImplemented else out


def add(a, b):
    """``a + b``, cached for two tensors."""
    out = _elementwise(_Add, a, b)
    return a + b if out is NotImplemented else out


def mul(a, b):
    """``a * b``, cached for two tensors."""
    out = _elementwise(_Mul, a, b)
    return a * b if out is NotImplemented else out


# -- what the interpreter calls -------------------------------------------------------------------
# each: its cached form (returning NotImplemented where it does not apply) and the names of its
# parameters by position (the first ``required`` of them required); ``inplace`` may be given as
# False to the functions that take it
_LINEAR = (_linear, ("input", "weight", "bias"), 2)
_RELU = (_relu, ("input",), 1)
_LEAKY = (_leaky_relu, ("input", "negative_slope"), 1)
_ADDCMUL = (lambda a, t1, t2: _elementwise(_Addcmul, a, t1, t2), ("input", "tensor1", "tensor2"), 3)
_ADD = (lambda a, b: _elementwise(_Add, a, b), ("input", "other"), 2)
_MUL = (lambda a, b: _elementwise(_Mul, a, b), ("input", "other"), 2)
_FUNCTIONS = {F.linear: _LINEAR, torch.relu: _RELU, F.relu: _RELU, F.leaky_relu: _LEAKY,
              torch.addcmul: _ADDCMUL, torch.add: _ADD, operator.add: _ADD, torch.mul: _MUL,
              operator.mul: _MUL}
_METHODS = {"relu": _RELU, "add": _ADD, "mul": _MUL, "addcmul": _ADDCMUL}
_INPLACE_ARG = (F.relu, F.leaky_relu)


def _hooked(m: torch.nn.Module) -> bool:
    """Whether calling ``m`` runs hooks (its own or global ones) that the cached form would skip."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or mm._global_forward_hooks
                or mm._global_forward_pre_hooks or mm._global_backward_hooks
                or mm._global_backward_pre_hooks)


def call(kind: str, target, args: tuple, kwargs: dict):
    """The value of a traced call through this module, or ``NotImplemented`` (the caller then
    makes the call itself): ``kind`` is ``"module"`` (``target`` the module), ``"function"``
    (the function) or ``"method"`` (its name); ``args`` / ``kwargs`` its operand values."""
    if kind == "module":
        if kwargs or len(args) != 1 or _hooked(target):
            return NotImplemented
        if type(target) is torch.nn.Linear:
            return _linear(args[0], target.weight, target.bias)
        if type(target) is torch.nn.ReLU and not target.inplace:
            return _relu(args[0])
        if type(target) is torch.nn.LeakyReLU and not target.inplace:
            return _leaky_relu(args[0], target.negative_slope)
        return NotImplemented
    entry = (_FUNCTIONS if kind == "function" else _METHODS).get(target)
    if entry is None:
        return NotImplemented
    fn, names, required = entry
    kwargs = dict(kwargs)
    if target in _INPLACE_ARG and kwargs.pop("inplace", False) is not False:
        return NotImplemented
    if len(args) > len(names) or any(k not in names[len(args):] for k in kwargs):
        return NotImplemented  # more operands or keywords than the cached form has
    args = list(args)
    for name in names[len(args):]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    if kwargs or len(args) < required:  # a keyword after a gap: torch's own call sorts it out
        return NotImplemented
    return fn(*args)


def call_module(module: torch.nn.Module, *args, **kwargs):
    """``module(*args, **kwargs)``, through this module's cached form where :func:`call` has one
    (a plain Linear, ReLU or LeakyReLU without hooks)."""
    out = call("module", module, args, kwargs)
    return module(*args, **kwargs) if out is NotImplemented else out
