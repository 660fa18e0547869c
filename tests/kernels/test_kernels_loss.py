"""kernels._loss.cross_entropy (ngra.nn.cross_entropy) against torch's F.cross_entropy: loss and
gradient, every reduction, ignored rows, repeated and double backward, the fallbacks and the
errors."""

from __future__ import annotations

import math
import re

import numba
import pytest
import torch
import torch.nn.functional as F

from kernels import _loss
from kernels._loss import cross_entropy


def _pair(n=3000, c=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(n, c, generator=g)).to(dtype)
    t = torch.randint(0, c, (n,), generator=g)
    return z, t


def _both(z, t, **kw):
    """(loss, grad) of ngra's and of torch's, each on its own leaf copy of z; the gradient of
    the loss's sum (reduction none) or of the loss."""
    out = []
    for fn in (cross_entropy, F.cross_entropy):
        zz = z.clone().requires_grad_(True)
        loss = fn(zz, t, **kw)
        loss.sum().backward() if loss.dim() else loss.backward()
        out.append((loss.detach(), zz.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("c", [1, 2, 7, 16, 47])
def test_matches_torch(dtype, reduction, c):
    z, t = _pair(c=c, dtype=dtype)
    (l1, g1), (l2, g2) = _both(z, t, reduction=reduction)
    assert l1.dtype == l2.dtype and l1.shape == l2.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(l1, l2, **tol)
    torch.testing.assert_close(g1, g2, **tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_rows_count_for_nothing(reduction):
    z, t = _pair()
    t[::3] = -100
    t[5] = 7
    (l1, g1), (l2, g2) = _both(z, t, reduction=reduction)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    assert (g1[::3] == 0).all()
    # another ignore_index, and a class index as the ignored one
    t2 = t.clone()
    t2[t2 == -100] = 3
    (l1, g1), (l2, g2) = _both(z, t2, reduction=reduction, ignore_index=3)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_every_row_ignored_gives_torchs_nan_mean_and_zero_gradient():
    z, t = _pair(n=50)
    t[:] = -100
    (l1, g1), (l2, g2) = _both(z, t)
    assert math.isnan(float(l1)) and math.isnan(float(l2))
    assert (g1 == 0).all() and (g2 == 0).all()


def test_int32_targets_non_contiguous_logits_and_a_scaled_loss():
    z, t = _pair(c=20)
    zt = z.t().contiguous().t()  # column-major: not contiguous
    assert not zt.is_contiguous()
    a = zt.clone().requires_grad_(True)
    (3.5 * cross_entropy(a, t.int())).backward()
    b = z.clone().requires_grad_(True)
    (3.5 * F.cross_entropy(b, t)).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    # a weighted per-row loss: the incoming gradient is a vector
    w = torch.rand(z.shape[0])
    a.grad = b.grad = None
    (cross_entropy(a, t, reduction="none") * w).sum().backward()
    (F.cross_entropy(b, t, reduction="none") * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_a_second_backward_recomputes_the_gradient():
    z, t = _pair()
    a = z.clone().requires_grad_(True)
    loss = cross_entropy(a, t)
    loss.backward(retain_graph=True)
    first = a.grad.clone()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(a.grad, 2 * first)
    loss.backward(torch.tensor(0.5))
    torch.testing.assert_close(a.grad, 2.5 * first)


def test_gradcheck_and_double_backward():
    z, t = _pair(n=40, c=5, dtype=torch.float64)
    t[3] = -100
    zz = z.clone().requires_grad_(True)
    for reduction in ("mean", "sum", "none"):
        assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, reduction=reduction), (zz,))
        assert torch.autograd.gradgradcheck(lambda a: cross_entropy(a, t, reduction=reduction),
                                            (zz,))


def test_the_loss_alone_without_grad_and_through_a_graph():
    z, t = _pair()
    with torch.no_grad():
        torch.testing.assert_close(cross_entropy(z.requires_grad_(True), t), F.cross_entropy(z, t))
    # logits computed by a layer: the gradient reaches its weights as torch's does
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(z.shape[0], 16)
    grads = []
    for fn in (cross_entropy, F.cross_entropy):
        lin.zero_grad()
        fn(lin(x), t).backward()
        grads.append(lin.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_nan_and_inf_rows_as_torch():
    z, t = _pair(n=20, c=4)
    z[2, 1] = float("nan")
    z[5, :] = float("-inf")
    z[7, 0] = float("inf")
    z[9, 3] = float("-inf")
    (l1, g1), (l2, g2) = _both(z, t, reduction="none")
    torch.testing.assert_close(l1, l2, equal_nan=True)
    torch.testing.assert_close(g1, g2, equal_nan=True)


def test_the_loss_does_not_depend_on_the_number_of_threads():
    z, t = _pair(n=5000)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = cross_entropy(z, t)
        numba.set_num_threads(threads)
        assert torch.equal(cross_entropy(z, t), one)
    finally:
        numba.set_num_threads(threads)


def test_other_inputs_are_torchs_own():
    z, t = _pair(n=30, c=5)
    w = torch.rand(5)
    assert not _loss.supported(z, t, w)
    torch.testing.assert_close(cross_entropy(z, t, w), F.cross_entropy(z, t, w))
    torch.testing.assert_close(cross_entropy(z, t, label_smoothing=0.1),
                               F.cross_entropy(z, t, label_smoothing=0.1))
    probs = torch.softmax(torch.randn(30, 5), 1)
    torch.testing.assert_close(cross_entropy(z, probs), F.cross_entropy(z, probs))
    z3, t3 = torch.randn(4, 5, 6), torch.randint(0, 5, (4, 6))
    torch.testing.assert_close(cross_entropy(z3, t3), F.cross_entropy(z3, t3))
    zh = z.half()
    assert not _loss.supported(zh, t)
    try:
        want = F.cross_entropy(zh, t)
    except RuntimeError as e:  # torch 2.2 has no half nll_loss on the CPU: the same error
        with pytest.raises(RuntimeError, match=re.escape(str(e))):
            cross_entropy(zh, t)
    else:
        torch.testing.assert_close(cross_entropy(zh, t), want)
    empty = torch.zeros(0, 5, requires_grad=True)
    assert math.isnan(float(cross_entropy(empty.detach(), torch.zeros(0, dtype=torch.long))))


def test_bad_targets_and_reductions_are_clear_errors():
    z, t = _pair(n=30, c=5)
    t[4] = 5
    t[9] = -2
    with pytest.raises(IndexError, match=r"target holds class 5 \(2 rows out of range\).*"
                                         r"\[0, 5\).*ignore_index \(-100\)"):
        cross_entropy(z, t)
    with pytest.raises(ValueError, match="reduction='avg': expected one of mean, sum, none"):
        cross_entropy(z, t.clamp(0, 4), reduction="avg")
