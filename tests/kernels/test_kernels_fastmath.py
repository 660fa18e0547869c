"""The numba CPU kernels' exp (kernels._cpu.fastmath._vexp) against the exact exp."""

import decimal
import math

import numba
import numpy as np
import pytest

from kernels._cpu.fastmath import _vexp


def _exact_exp_ulps(x: np.ndarray, got: np.ndarray) -> np.ndarray:
    """|got - exp(x)| in units in the last place of ``got``'s dtype at exp(x), with exp(x) from
    ``decimal`` at 60 significant digits (exact to far below an ulp, and the same on every CPU and
    numpy version, unlike np.exp or libm, whose own results may be 1 ulp off). Subnormal results
    use the subnormal spacing, as np.spacing does."""
    ctx = decimal.Context(prec=60, Emin=-10**6, Emax=10**6)
    tiny = decimal.Decimal(float(np.finfo(got.dtype).smallest_subnormal))
    nmant = np.finfo(got.dtype).nmant
    out = np.empty(x.size)
    for k, (xk, gk) in enumerate(zip(x.astype(np.float64).tolist(), got.astype(np.float64).tolist())):
        exact = ctx.exp(decimal.Decimal(xk))
        # The ulp of exact's binade: 2**(floor(log2 exact) - nmant), never below the subnormal step.
        e2 = math.frexp(float(exact))[1] - 1 if float(exact) > 0 else -10**6
        ulp = max(ctx.power(2, e2 - nmant), tiny)
        out[k] = float(abs(ctx.subtract(decimal.Decimal(gk), exact)) / ulp)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vectorizable_exp_matches_libm(dtype):
    """_vexp (the edge softmax's exp in plain arithmetic): within 1 ulp of the exact exp (float64
    within 1 ulp as a faithful libm is) over the whole finite range, subnormal results included,
    and exactly libm's IEEE results at the edges: -inf -> 0, +inf and overflow -> inf, NaN -> NaN,
    0 -> 1, underflow -> 0. The reference is exact (``decimal``), so the test does not depend on
    the CPU's instruction set or the numpy version (np.exp of numpy 1.26 with AVX-512 is itself
    up to 1 ulp from libm)."""
    @numba.njit
    def vexp(x, out):
        for i in range(x.size):
            out[i] = _vexp(x[i])

    lo, hi = {np.float32: (-110.0, 90.0), np.float64: (-750.0, 712.0)}[dtype]
    info = np.finfo(dtype)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(lo, hi, 40_000), rng.uniform(-2, 2, 10_000)]).astype(dtype)
    got = np.empty_like(x)
    vexp(x, got)
    # The exact result's range, from the dtype's limits (no exp of the platform involved).
    overflow = x.astype(np.float64) > math.log(float(info.max))
    underflow = x.astype(np.float64) < math.log(float(info.smallest_subnormal)) - 1.0
    # Just above log(max) the exact result may still round to max: checked apart, below.
    near_max = np.abs(x.astype(np.float64) - math.log(float(info.max))) < 1e-3
    assert (np.isinf(got) == overflow)[~near_max].all()
    assert (got[underflow] == 0).all()
    inner = ~overflow & ~underflow & ~near_max
    ulps = _exact_exp_ulps(x[inner], got[inner])
    assert ulps.max() <= 1.0, (ulps.max(), x[inner][ulps.argmax()])
    normal = x.astype(np.float64) > math.log(float(info.tiny)) + 1.0
    assert (got[inner & (x.astype(np.float64) > math.log(float(info.smallest_subnormal)) + 1)]
            > 0).all()  # no subnormal flushed to 0
    assert (inner & ~normal).sum() > 20  # the subnormal range was sampled

    edges = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, lo, hi, info.max, -info.max],
                     dtype=dtype)
    got = np.empty_like(edges)
    vexp(edges, got)
    np.testing.assert_array_equal(got, np.array([0, np.inf, np.nan, 1, 1, 0, np.inf, np.inf, 0],
                                                dtype=dtype))
    # The largest finite result: exp(log(max)) stays finite and within 1 ulp of exact.
    top = np.array([np.log(info.max)], dtype=dtype)
    while math.log(float(info.max)) < float(top[0]):  # rounding up would overflow exactly
        top = np.nextafter(top, dtype(0))
    got = np.empty_like(top)
    vexp(top, got)
    assert np.isfinite(got).all() and _exact_exp_ulps(top, got).max() <= 1.0
