"""Numba CPU backend specifics: bitwise determinism, thread count, backend selection."""

import pytest
import torch

import kernels
from kernels import CSR


def _power_law_graph(n=3000, e=60000, seed=0):
    """Skewed in-degrees (low ids are hubs), so row parts differ a lot in size."""
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen) ** 3 * n).long()
    src = torch.randint(0, n, (e,), generator=gen)
    return CSR.from_coo(src, dst, n)


def _run_all(csr, threads):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(csr.num_src, 2, 16, generator=gen).requires_grad_()
    w = torch.randn(csr.num_edges, 2, 1, generator=gen).requires_grad_()
    outs = []
    for reduce in ("sum", "mean", "max"):
        out = kernels.gspmm(csr, "u_mul_e", reduce, u=u, e=w, backend="numba")
        gu, gw = torch.autograd.grad(out, (u, w), torch.ones_like(out))
        outs += [out, gu, gw]
    s = kernels.gsddmm(csr, "u_dot_v", u=u, v=u, backend="numba")
    a = kernels.edge_softmax(csr, s, backend="numba")
    gu, = torch.autograd.grad(a, (u,), torch.randn(a.shape, generator=gen))
    # one score per edge (the numba softmax's other path); max over 32-feature rows
    flat = u.reshape(csr.num_src, 32)
    s1 = kernels.gsddmm(csr, "u_dot_v", u=flat, v=flat, backend="numba").squeeze(1)
    a1 = kernels.edge_softmax(csr, s1, backend="numba")
    m1 = kernels.gspmm(csr, "copy_u", "max", u=flat, backend="numba")
    gu1, = torch.autograd.grad((a1.sum(), m1.sum()), (u,))
    return outs + [s, a, gu, s1, a1, m1, gu1]


def test_numba_backend_is_bitwise_deterministic():
    csr = _power_law_graph()
    before = torch.get_num_threads()
    try:
        first = _run_all(csr, before)
        again = _run_all(csr, before)
        one_thread = _run_all(csr, 1)
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(first, again, one_thread):
        assert torch.equal(a, b)
        assert torch.equal(a, c)  # independent of the thread count, too


def test_numba_threads_follow_torch():
    import numba

    from kernels import _numba_cpu

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _numba_cpu._threads() == 1 and numba.get_num_threads() == 1
        torch.set_num_threads(before)
        assert _numba_cpu._threads() == min(before, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)


def test_auto_picks_numba_on_cpu_and_rejects_half():
    from kernels import _backend

    assert _backend.backend_name("auto", torch.device("cpu")) == "numba"
    csr = _power_law_graph(50, 200)
    with pytest.raises(TypeError, match="backend 'numba' supports float32 and float64"):
        kernels.gspmm(csr, "copy_u", "sum", u=torch.ones(50, 2, dtype=torch.float16), backend="numba")
    # half precision on CPU goes to the torch reference under "auto"
    out = kernels.gspmm(csr, "copy_u", "sum", u=torch.ones(50, 2, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), kernels.gspmm(csr, "copy_u", "sum", u=torch.ones(50, 2)))


def test_numba_rejects_cuda_device_request():
    from kernels import _numba_cpu

    with pytest.raises(ValueError, match="backend 'numba' runs on CPU tensors"):
        _numba_cpu.check_device(torch.device("cuda", 0))


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("op", ["copy_u", "copy_e", "u_add_e", "u_mul_e", "u_div_e"])
def test_maxmin_without_grad_skips_arg_but_not_values(backend, op, reduce):
    """Inference (no input needs grad) takes the kernel path that does not track the arg edge;
    it must give the same values as the path that does."""
    csr = _power_law_graph(200, 3000)
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(200, 2, 8, generator=gen) if op != "copy_e" else None
    shape = (3000, 2, 8) if op in ("copy_e", "u_add_e") else (3000, 2, 1)
    e = torch.rand(shape, generator=gen) + 0.5 if op != "copy_u" else None
    plain = kernels.gspmm(csr, op, reduce, u=u, e=e, backend=backend)
    tracked = kernels.gspmm(csr, op, reduce, u=u.requires_grad_() if u is not None else None,
                            e=e.requires_grad_() if e is not None else None, backend=backend)
    assert torch.equal(plain, tracked.detach())
