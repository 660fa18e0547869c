"""numba_cuda specifics: rows split into segments (hub rows of power-law graphs), bitwise
determinism, torch's current stream, dtypes it refuses. Runs in the CUDA simulator on tiny graphs
(CI) and on CUDA tensors with realistic sizes on a GPU (NUMBA_ENABLE_CUDASIM=0)."""

import numpy as np
import pytest
import torch
from kernels_testutil import CUDA_DEVICE, CUDA_SIM

import kernels
from kernels import CSR, _numba_cuda

needs_gpu = pytest.mark.skipif(CUDA_SIM, reason="needs a GPU (the CUDA simulator is on)")


def _power_law(n, e, seed, device):
    """Destinations drawn from x**4 (vertex 0 gets the most in-edges) and sources likewise, so
    that both the CSR and its transpose have hub rows."""
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen) ** 4 * n).long()
    src = (torch.rand(e, generator=gen) ** 4 * n).long().flip(0)
    return CSR.from_coo(src, dst, n).to(device)


@pytest.fixture
def seg_edges(monkeypatch):
    """Under the simulator, split every row longer than 3 positions (tiny graphs then exercise the
    split path); on a GPU keep the real segment length and use graphs with long rows."""
    if CUDA_SIM:
        monkeypatch.setattr(_numba_cuda, "_SEG_EDGES", 3)
    return _numba_cuda._SEG_EDGES


def _graph(seg):
    n, e = (12, 60) if CUDA_SIM else (2000, 200_000)
    csr = _power_law(n, e, 0, CUDA_DEVICE)
    # both orientations must have rows of several segments, or the test checks nothing new
    assert int(csr.in_degrees().max()) > 2 * seg
    assert int(csr.transpose().in_degrees().max()) > 2 * seg
    return csr


def _run(backend, fn, inputs, g):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(backend, *leaves)
    grads = torch.autograd.grad(out, leaves, g)
    return [out.detach()] + list(grads)


def _close(got, want, dtype):
    """Within tol of the largest magnitude (float64; float32 goes through _match_torch)."""
    tol = {torch.float32: 2e-5, torch.float64: 1e-11}[dtype]
    for a, b in zip(got, want):
        finite = b[torch.isfinite(b)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, scale), equal_nan=True)


def _match_torch(fn, inputs, g):
    """numba_cuda's outputs and gradients against the torch backend's. In float32 the hub rows of
    a GPU graph sum ~30K terms in another order than torch's atomics, and each float32 result
    carries the rounding of its large partial sums (on an H200, 0.5 apart at magnitude 2e3, beyond
    any fixed tolerance that would still catch a lost segment). So in float32 both are held
    against float64 arithmetic on the same inputs, and numba_cuda may be off by no more than four
    times torch's own float32 error (or 2e-5 of the largest magnitude): a dropped or doubled
    segment of a hub row is off by a whole segment's sum, hundreds of times that."""
    dtype = inputs[0].dtype
    got, want = _run("numba_cuda", fn, inputs, g), _run("torch", fn, inputs, g)
    if dtype == torch.float64:
        return _close(got, want, dtype)
    exact = _run("torch", fn, [x.double() for x in inputs], g.double())
    names = ["output"] + [f"grad {i}" for i in range(len(inputs))]
    for name, a, b, x in zip(names, got, want, exact):
        fin = torch.isfinite(x)
        torch.testing.assert_close(a[~fin], b[~fin], equal_nan=True)  # inf / nan as torch's
        scale = float(x[fin].abs().max()) if fin.any() else 1.0
        err = float((a.double() - x)[fin].abs().max()) if fin.any() else 0.0
        err_torch = float((b.double() - x)[fin].abs().max()) if fin.any() else 0.0
        assert err <= max(2e-5 * max(1.0, scale), 4 * err_torch), (
            f"{name}: numba_cuda is off float64 by {err:.3g}, torch's float32 by {err_torch:.3g} "
            f"(largest magnitude {scale:.3g})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op,reduce", [("copy_u", "sum"), ("u_mul_e", "mean"),
                                       ("u_mul_e", "max"), ("u_sub_e", "min"),
                                       ("copy_e", "max")])
def test_split_rows_gspmm_match_torch(seg_edges, op, reduce, dtype):
    csr = _graph(seg_edges)
    gen = torch.Generator().manual_seed(1)
    f = 5 if CUDA_SIM else 40
    u = torch.randn(csr.num_src, f, generator=gen, dtype=torch.float64).to(dtype).to(csr.device)
    e = (torch.rand(csr.num_edges, 1, generator=gen, dtype=torch.float64) + 0.5)
    if op == "copy_e":
        e = torch.randn(csr.num_edges, f, generator=gen, dtype=torch.float64)
    e = e.to(dtype).to(csr.device)
    g = torch.randn(csr.num_dst, f, generator=gen, dtype=torch.float64).to(dtype).to(csr.device)
    ins = [x for x, used in ((u, op != "copy_e"), (e, op != "copy_u")) if used]

    def fn(backend, *xs):
        uu = xs[0] if op != "copy_e" else None
        ee = xs[-1] if op != "copy_u" else None
        return kernels.gspmm(csr, op, reduce, u=uu, e=ee, backend=backend)

    _match_torch(fn, ins, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# heads: one lane per segment, a few, and more features than a lane group (the simulator's 8
# lanes, a GPU's 32) with the last stride part-filled
@pytest.mark.parametrize("heads", [(), (3,), (10,), (40,)])
def test_split_rows_edge_softmax_match_torch(seg_edges, heads, dtype):
    csr = _graph(seg_edges)
    gen = torch.Generator().manual_seed(2)
    s = torch.randn((csr.num_edges,) + heads, generator=gen, dtype=torch.float64) * 4
    # masked scores: a whole segment of -inf inside a hub row must add nothing to its sum
    order = csr.eids.long().cpu()
    s[order[: 2 * seg_edges]] = float("-inf")
    s = s.to(dtype).to(csr.device)
    g = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(dtype).to(csr.device)
    fn = lambda backend, x: kernels.edge_softmax(csr, x, backend=backend)  # noqa: E731
    assert torch.isfinite(fn("numba_cuda", s)).all()
    _match_torch(fn, [s], g)


@pytest.mark.parametrize("red", [1, 3, 32, 70])
def test_dot_reduction_widths(red):
    """u_dot_v with dot lengths below, at and above a lane group (a butterfly of warp shuffles;
    the simulator runs it through shared memory), several heads, forward and gradients."""
    csr = _power_law(9, 30, 3, CUDA_DEVICE) if CUDA_SIM else _power_law(500, 20_000, 3, "cuda")
    gen = torch.Generator().manual_seed(4)
    u = torch.randn(csr.num_src, 2, red, generator=gen, dtype=torch.float64).to(csr.device)
    v = torch.randn(csr.num_dst, 2, red, generator=gen, dtype=torch.float64).to(csr.device)
    g = torch.randn(csr.num_edges, 2, 1, generator=gen, dtype=torch.float64).to(csr.device)
    fn = lambda backend, a, b: kernels.gsddmm(csr, "u_dot_v", u=a, v=b, backend=backend)  # noqa
    _close(_run("numba_cuda", fn, [u, v], g), _run("torch", fn, [u, v], g), torch.float64)


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test: the sums that would go to cuSPARSE
    (not bitwise reproducible on long rows) take numba_cuda's own kernel."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_cusparse_sums_only_outside_deterministic_mode(monkeypatch):
    monkeypatch.setattr(_numba_cuda, "cusparse_sums", True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert _numba_cuda._use_cusparse()
        torch.use_deterministic_algorithms(True)
        assert not _numba_cuda._use_cusparse()
    finally:
        torch.use_deterministic_algorithms(before)
    monkeypatch.setattr(_numba_cuda, "cusparse_sums", False)
    assert not _numba_cuda._use_cusparse()


@pytest.mark.slow
def test_bitwise_deterministic(seg_edges, deterministic):
    csr = _graph(seg_edges)
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(csr.num_src, 7, generator=gen).to(csr.device)
    w = torch.rand(csr.num_edges, 1, generator=gen).to(csr.device)
    g = torch.randn(csr.num_dst, 7, generator=gen).to(csr.device)
    fn = lambda backend, a, b: kernels.gspmm(csr, "u_mul_e", "sum", u=a, e=b,  # noqa: E731
                                             backend=backend)
    first = _run("numba_cuda", fn, [u, w], g)
    for _ in range(2):
        for a, b in zip(_run("numba_cuda", fn, [u, w], g), first):
            assert torch.equal(a, b)


def test_refuses_half_precision_and_auto_falls_back():
    csr = _power_law(6, 12, 6, CUDA_DEVICE)
    u = torch.randn(6, 4, device=CUDA_DEVICE).half()
    with pytest.raises(TypeError, match="supports float32 and float64 \\(got torch.float16\\)"):
        kernels.gspmm(csr, "copy_u", "sum", u=u, backend="numba_cuda")
    if not CUDA_SIM:  # on a GPU "auto" picks numba_cuda, and the torch reference for half
        out = kernels.gspmm(csr, "copy_u", "sum", u=u)
        ref = kernels.gspmm(csr, "copy_u", "sum", u=u.float(), backend="torch")
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@needs_gpu
@pytest.mark.parametrize("cusparse", [False, True])
def test_runs_on_the_gpu_on_torchs_current_stream(cusparse, monkeypatch):
    """The kernels are compiled for the device (not simulated) and queue on torch's current
    stream: work on a side stream, followed by a wait, gives the default stream's result (to
    the bit from numba_cuda's own kernel; to rounding through cuSPARSE, which is not bitwise
    reproducible on this graph's hub rows)."""
    assert not _numba_cuda.simulated()
    monkeypatch.setattr(_numba_cuda, "cusparse_sums", cusparse)
    csr = _power_law(3000, 300_000, 7, "cuda")
    u = torch.randn(csr.num_src, 64, device="cuda")
    ref = kernels.gspmm(csr, "copy_u", "sum", u=u, backend="numba_cuda")
    assert ref.is_cuda and (cusparse or len(_numba_cuda._spmm_sum.overloads) > 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy a while before u2 is written
        u2 = u * 1.0  # queued on the side stream: the kernel must run after it
        out = kernels.gspmm(csr, "copy_u", "sum", u=u2, backend="numba_cuda")
    torch.cuda.current_stream().wait_stream(side)
    if cusparse:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)  # a lost wait: garbage
    else:
        assert torch.equal(out, ref)
    fn = lambda backend, x: kernels.gspmm(csr, "copy_u", "sum", u=x, backend=backend)  # noqa: E731
    _match_torch(fn, [u], torch.randn_like(ref))


def test_direct_launch_arguments_are_numbas_layout():
    """A direct launch hands each array as numba-cuda's kernels take it (meminfo, parent, size,
    itemsize, data pointer, shape, strides in bytes) and scalars as numba types them."""
    t = torch.zeros(2, 3, dtype=torch.float64)
    out = []
    _numba_cuda._array_arg(t, out)
    assert out == [0, 0, 6, 8, t.data_ptr(), 2, 3, 24, 8]
    out = []
    _numba_cuda._SCALARS["float32"](0.5, out)
    _numba_cuda._SCALARS["int64"](3, out)
    _numba_cuda._SCALARS["bool"](True, out)
    assert [type(v).__name__ for v in out] == ["c_float", "c_long", "bool"]
    assert [getattr(v, "value", v) for v in out] == [0.5, 3, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cusparse_sums_match_the_dense_reference(dtype):
    """The sums that go through cuSPARSE on a GPU (copy_u and u_mul_e with one weight per edge,
    sum and mean): the same construction on CPU tensors (torch.sparse.mm runs there too) against
    the torch backend, including rows without edges, int32 and int64 indices and heads."""
    for index_dtype in (torch.int32, torch.int64):
        gen = torch.Generator().manual_seed(3)
        src = torch.randint(0, 40, (300,), generator=gen)
        dst = torch.randint(0, 30, (300,), generator=gen) % 29  # destination 29 gets no edges
        csr = CSR.from_coo(src, dst, (40, 30), index_dtype=index_dtype)
        assert int(csr.in_degrees()[29]) == 0 and csr.indices.dtype == index_dtype
        gr = _numba_cuda._Graph(csr)
        u = torch.randn(40, 3, 5, generator=gen, dtype=dtype)
        w = torch.rand(300, 1, 1, generator=gen, dtype=dtype)
        for op, e in (("copy_u", None), ("u_mul_e", w)):
            for mean in (False, True):
                got = _numba_cuda._cusparse_sum(csr, gr, u.reshape(40, 15),
                                                None if e is None else e.reshape(300, 1), mean)
                want = kernels.gspmm(csr, op, "mean" if mean else "sum", u=u, e=e,
                                     backend="torch")
                torch.testing.assert_close(got.reshape(want.shape), want)


@needs_gpu
def test_direct_launches_match_numbas_own(monkeypatch):
    """After a kernel's first launch through numba, later launches of the same argument types
    go straight to cuda.core (see _numba_cuda._direct); every op gives bitwise the result of
    numba's own launch path, forward and backward."""
    csr = _power_law(3000, 300_000, 8, "cuda")
    gen = torch.Generator().manual_seed(8)
    u = torch.randn(csr.num_src, 4, 6, generator=gen, dtype=torch.float64).to("cuda")
    w = torch.rand(csr.num_edges, 4, 1, generator=gen, dtype=torch.float64).to("cuda")
    v = torch.randn(csr.num_dst, 4, 6, generator=gen, dtype=torch.float64).to("cuda")
    s = torch.randn(csr.num_edges, 4, generator=gen).to("cuda")
    cases = {
        "gspmm u_mul_e sum": lambda a: kernels.gspmm(csr, "u_mul_e", "sum", u=a[0], e=a[1]),
        "gspmm u_mul_e mean": lambda a: kernels.gspmm(csr, "u_mul_e", "mean", u=a[0], e=a[1]),
        "gspmm copy_u max": lambda a: kernels.gspmm(csr, "copy_u", "max", u=a[0]),
        "gsddmm u_dot_v": lambda a: kernels.gsddmm(csr, "u_dot_v", u=a[0], v=a[2]),
        "gsddmm u_sub_v": lambda a: kernels.gsddmm(csr, "u_sub_v", u=a[0], v=a[2]),
        "edge_softmax": lambda a: kernels.edge_softmax(csr, a[3]),
    }
    direct = [0]
    launch = _numba_cuda._direct

    def counted(*args):
        done = launch(*args)
        direct[0] += done
        return done

    monkeypatch.setattr(_numba_cuda, "_direct", counted)
    for name, fn in cases.items():
        runs = []
        for on in (False, True, True):
            monkeypatch.setattr(_numba_cuda, "direct_launch", on)
            before = direct[0]
            args = [x.detach().requires_grad_() for x in (u, w, v, s)]
            with kernels.use_backend("numba_cuda"):
                out = fn(args)
                grads = torch.autograd.grad(out, args, torch.ones_like(out), allow_unused=True)
            torch.cuda.synchronize()
            assert (direct[0] > before) == on, name
            runs.append([out] + [g for g in grads if g is not None])
        for got in runs[1:]:
            assert len(got) == len(runs[0]) and len(got) > 1, name
            for a, b in zip(got, runs[0]):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_split_rows_nan_propagates_like_torch(seg_edges, reduce):
    """A NaN in a later segment of a hub row wins over the earlier segments' values, as in
    torch's amax/amin (forward; a NaN has no defined winner edge to route gradients to)."""
    csr = _graph(seg_edges)
    hub = int(csr.in_degrees().argmax())
    beg, end = int(csr.indptr[hub]), int(csr.indptr[hub + 1])
    u = torch.randn(csr.num_src, 3, generator=torch.Generator().manual_seed(9)).to(csr.device)
    u[csr.indices[beg + seg_edges + 1].long(), 1] = float("nan")  # in the hub's 2nd segment
    assert end > beg + seg_edges + 1
    got = kernels.gspmm(csr, "copy_u", reduce, u=u, backend="numba_cuda")
    want = kernels.gspmm(csr, "copy_u", reduce, u=u, backend="torch")
    assert torch.isnan(got[hub, 1])
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_refuses_cpu_tensors_outside_the_simulator(monkeypatch):
    monkeypatch.setattr(_numba_cuda, "simulated", lambda: False)  # as on a GPU machine
    csr = _power_law(6, 12, 6, "cpu")
    with pytest.raises(ValueError, match="backend 'numba_cuda' runs on CUDA tensors \\(got "
                                         "device cpu\\)"):
        kernels.gspmm(csr, "copy_u", "sum", u=torch.ones(6, 2), backend="numba_cuda")


def test_scalar_helpers_are_shared_with_the_cpu_backend():
    """The op codes and the scalar helpers come from kernels/_scalar.py: each helper is one Python
    function, compiled by both backends (not a twin per backend)."""
    from kernels import _numba_cpu, _scalar
    from kernels._cpu import codes

    for compiled, f in ((codes._bop, _scalar.bop), (codes._row, _scalar.row),
                        (_numba_cuda._bop, _scalar.bop), (_numba_cuda._row, _scalar.row)):
        assert compiled.py_func is f
    for backend in (_numba_cpu, _numba_cuda):
        assert backend._CODE is _scalar._CODE and backend._TARGET is _scalar._TARGET
    # the plain functions agree with the op names (the kernels' results are checked elsewhere)
    ops = {"copy_lhs": 2.0, "copy_rhs": 8.0, "add": 10.0, "sub": -6.0, "mul": 16.0, "div": 0.25}
    for name, want in ops.items():
        assert _scalar.bop(_scalar._CODE[name], 2.0, 8.0) == want
    assert [_scalar.row(_scalar._TARGET[t], 5, 6, 7) for t in "uve"] == [5, 6, 7]


def test_numpy_support_that_cannot_load_is_named(monkeypatch):
    """numba.cuda loads its numpy support at a kernel's first compile, where a numpy it does not
    know fails deep inside numba (numba-cuda 0.30.4 with numpy 2.5). unusable_reason loads it first
    and names numpy and the fix, so that "auto" takes the torch backend and an explicit
    "numba_cuda" says why."""
    import sys

    monkeypatch.setattr(_numba_cuda, "simulated", lambda: False)
    monkeypatch.setattr(_numba_cuda.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "numba.cuda.cudaimpl", None)  # its import now fails
    reason = _numba_cuda.unusable_reason()
    assert reason is not None
    assert f"numpy {np.__version__}" in reason and "numba-cuda" in reason, reason
