"""Cross-entropy of class logits in one pass on the CPU (numba, all threads).

``cross_entropy(logits, target)`` is ``F.cross_entropy`` for ``[N, C]`` logits and ``[N]``
class indices (``reduction`` mean, sum or none; ``ignore_index``). torch's runs log_softmax
(one pass, an ``[N, C]`` output kept for backward), nll_loss, and in backward a zero-filled
``[N, C]`` gradient, nll's scatter into it and log_softmax's backward (another ``[N, C]``):
on GCN's 1M x 16 logits 150-180 ms of an epoch of about 1.8 s. Here one kernel reads each row
once and writes its loss and its gradient ``softmax(z) - onehot(t)`` (scaled by ``1 / count``
for the mean) while the row is in registers; backward hands that gradient on (multiplied by
the incoming gradient unless it is exactly 1), so nothing else is allocated or read. The
gradient comes from the output cache (warm pages).

The gradient is computed in the forward pass whenever autograd records it (logits that require
grad, grad mode on), whether or not backward follows; under ``torch.no_grad()`` (evaluation) or
for logits without grad only the loss is computed. A second backward through the same graph
(``retain_graph=True``) recomputes it from the saved logits; a backward with
``create_graph=True`` builds it from differentiable torch ops. Anything else (a GPU, half
precision, class weights, label smoothing, probability targets, more dimensions) is
``F.cross_entropy`` itself.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from ._cpu.fastmath import _vexp
from ._cpu.intrinsics import _fmax
from ._dropout import _scalar
from ._outcache import CACHE as _CACHE


@njit(parallel=True, cache=True, nogil=True)
def _check_targets(t, classes, ignore):
    """(rows not ignored, rows whose class is outside [0, classes) and not ignored)."""
    count = 0
    bad = 0
    for i in prange(t.shape[0]):
        c = t[i]
        if c != ignore:
            count += 1
            if c < 0 or c >= classes:
                bad += 1
    return count, bad


_ROWS = 1024  # rows per parallel task


# Reassociation lets the row's max and sum vectorize (C is small: GNN logits have 2-100
# columns); no flag that changes what NaN or inf give.
@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "nsz", "contract", "arcp"})
def _ce_kernel(z, t, ignore, scale, losses, sums, g, want_grad):
    """Row i's loss ``logsumexp(z_i) - z_i[t_i]`` (0 where ignored) into ``losses[i]`` (when
    ``losses`` has rows) and each block of ``_ROWS`` rows' sum (float64) into ``sums``; with
    ``want_grad``, ``scale * (softmax(z_i) - onehot(t_i))`` (0 where ignored) into ``g[i]``.
    The exps go to a buffer in a loop of their own and are summed in another (as in
    ``_cpu/softmax.py``). The blocks' sums are summed by the caller in order, so the loss does
    not depend on the number of threads."""
    n, c = z.shape
    zero = scale - scale
    for b in prange(sums.shape[0]):
        buf = np.empty(c, z.dtype)
        total = 0.0
        for i in range(b * _ROWS, min(n, (b + 1) * _ROWS)):
            k = t[i]
            loss = zero
            if k == ignore:
                if want_grad:
                    for j in range(c):
                        g[i, j] = zero
            else:
                zi = z[i]
                m = zi[0]
                for j in range(1, c):
                    m = _fmax(m, zi[j])
                e = g[i] if want_grad else buf
                for j in range(c):
                    e[j] = _vexp(zi[j] - m)
                s = zero
                for j in range(c):
                    s += e[j]
                if want_grad:
                    f = scale / s
                    for j in range(c):
                        e[j] *= f
                    e[k] -= scale
                loss = math.log(s) + m - zi[k]
                total += loss
            if losses.shape[0]:
                losses[i] = loss
        sums[b] = total


_REDUCTIONS = ("mean", "sum", "none")


def supported(logits, target, weight=None, label_smoothing=0.0) -> bool:
    """Whether :func:`cross_entropy` runs the kernel (otherwise it is ``F.cross_entropy``)."""
    return (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)
            and logits.device.type == "cpu" and target.device.type == "cpu"
            and logits.dtype in (torch.float32, torch.float64) and logits.dim() == 2
            and logits.shape[1] > 0 and target.dim() == 1 and target.shape[0] == logits.shape[0]
            and target.dtype in (torch.int64, torch.int32) and weight is None
            and not label_smoothing)


def _run(z: torch.Tensor, t: torch.Tensor, ignore: int, scale: float, per_row: bool,
         want_grad: bool):
    """(per-row losses or None, summed loss as a float, gradient or None) of contiguous z."""
    n, c = z.shape
    zn, tn = z.numpy(), t.numpy()
    losses = torch.empty(n if per_row else 0, dtype=z.dtype)
    sums = np.empty((n + _ROWS - 1) // _ROWS)
    g = _CACHE.empty((n, c), z.dtype) if want_grad else None
    gn = g.numpy() if want_grad else np.empty((0, c), dtype=zn.dtype)
    _ce_kernel(zn, tn, ignore, _scalar(scale, z.dtype), losses.numpy(), sums, gn, want_grad)
    total = float(sums.sum())
    return (losses if per_row else None), total, g


def _scale(reduction: str, count: int) -> float:
    return 1.0 / count if reduction == "mean" and count else 1.0


def _result(losses, total, reduction, count, dtype):
    if reduction == "none":
        return losses
    if reduction == "mean":  # torch's mean over no rows is nan (0 / 0)
        return torch.tensor(total / count if count else math.nan, dtype=dtype)
    return torch.tensor(total, dtype=dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, t, ignore, reduction, count):
        scale = _scale(reduction, count)
        losses, total, g = _run(z, t, ignore, scale, reduction == "none", True)
        ctx.ignore, ctx.reduction, ctx.scale = ignore, reduction, scale
        ctx.g = g
        ctx.save_for_backward(z, t)
        return _result(losses, total, reduction, count, z.dtype)

    @staticmethod
    def backward(ctx, go):
        z, t = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a gradient that itself has a graph
            keep = (t != ctx.ignore).unsqueeze(1)
            onehot = F.one_hot(torch.where(keep.squeeze(1), t, 0).long(), z.shape[1])
            g = (torch.softmax(z, 1) - onehot.to(z.dtype)) * keep * ctx.scale
        else:
            g, ctx.g = ctx.g, None
            if g is None:  # a second backward (retain_graph): the kept one was handed on
                g = _run(z, t, ctx.ignore, ctx.scale, False, True)[2]
        go = go.to(z.dtype)
        if ctx.reduction == "none":
            g = g * go.unsqueeze(1) if torch.is_grad_enabled() else g.mul_(go.unsqueeze(1))
        elif torch.is_grad_enabled():
            g = g * go
        elif float(go) != 1.0:
            g.mul_(go)
        return g, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight=None, *,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ...)``, in one pass over ``[N, C]`` float32 / float64
    CPU logits with ``[N]`` int64 / int32 class targets (see the module docstring); any other
    input is handed to ``F.cross_entropy`` unchanged."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {', '.join(_REDUCTIONS)}")
    if not supported(logits, target, weight, label_smoothing) or logits.shape[0] == 0:
        return F.cross_entropy(logits, target, weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
    c = logits.shape[1]
    t = target.contiguous()
    count, bad = _check_targets(t.numpy(), c, ignore_index)
    if bad:
        keep = t != ignore_index
        wrong = t[keep & ((t < 0) | (t >= c))]
        raise IndexError(f"target holds class {int(wrong[0])} ({bad} rows out of range): "
                         f"classes must be in [0, {c}) for logits of {c} columns, or "
                         f"ignore_index ({ignore_index}) for rows left out of the loss")
    z, ignore, count = logits.contiguous(), int(ignore_index), int(count)
    if not (torch.is_grad_enabled() and z.requires_grad):  # the loss alone
        losses, total, _ = _run(z, t, ignore, 1.0, reduction == "none", False)
        return _result(losses, total, reduction, count, z.dtype)
    return _CrossEntropy.apply(z, t, ignore, reduction, count)
