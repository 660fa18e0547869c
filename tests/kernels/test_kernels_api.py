"""Public surface: CSR record, backend selection, and the errors bad input gets."""

import pytest
import torch

import kernels
from kernels import CSR


def small():
    return CSR.from_coo(torch.tensor([0, 1, 2, 0]), torch.tensor([1, 2, 1, 1]), 3)


def test_public_names():
    assert set(kernels.__all__) == {"CSR", "gspmm", "gspmm_norm", "gsddmm", "edge_softmax", "use_backend",
                                    "set_default_backend", "set_output_cache_limit",
                                    "output_cache_limit", "output_cache_stats",
                                    "empty_output_cache", "no_output_cache"}


def test_csr_fields_and_repr():
    csr = small()
    assert csr.indptr.tolist() == [0, 0, 3, 4]
    assert csr.indices.tolist() == [0, 2, 0, 1]
    assert csr.eids.tolist() == [0, 2, 3, 1]
    assert csr.in_degrees().tolist() == [0, 3, 1]
    src, dst = csr.coo()
    assert src.tolist() == [0, 1, 2, 0] and dst.tolist() == [1, 2, 1, 1]
    assert repr(csr) == ("CSR(num_src=3, num_dst=3, num_edges=4, index_dtype=torch.int64, "
                         "device=cpu)")
    t = csr.transpose()
    assert (t.num_src, t.num_dst) == (3, 3) and t.transpose() is csr
    assert t.indptr.tolist() == [0, 2, 3, 4] and t.eids.tolist() == [0, 3, 1, 2]


def test_csr_bipartite_and_empty():
    csr = CSR.from_coo(torch.tensor([4, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                       (5, 2))
    assert (csr.num_src, csr.num_dst, csr.index_dtype) == (5, 2, torch.int32)
    out = kernels.gspmm(csr, "copy_u", "sum", u=torch.arange(5.0).unsqueeze(1))
    assert out.tolist() == [[0.0], [4.0]]
    empty = CSR.from_coo(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), (3, 2))
    for reduce in ("sum", "mean", "max", "min"):
        out = kernels.gspmm(empty, "copy_u", reduce, u=torch.ones(3, 4))
        assert out.shape == (2, 4) and not out.any()
    assert kernels.gsddmm(empty, "u_dot_v", u=torch.ones(3, 4), v=torch.ones(2, 4)).shape == (0, 1)
    assert kernels.edge_softmax(empty, torch.ones(0, 2)).shape == (0, 2)


def test_hand_computed_values():
    csr = small()  # edges 0->1, 1->2, 2->1, 0->1
    u = torch.tensor([[1.0], [10.0], [100.0]])
    e = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert kernels.gspmm(csr, "u_mul_e", "sum", u=u, e=e).tolist() == [[0.0], [305.0], [20.0]]
    assert kernels.gspmm(csr, "u_mul_e", "max", u=u, e=e).tolist() == [[0.0], [300.0], [20.0]]
    mean = kernels.gspmm(csr, "copy_e", "mean", e=e.unsqueeze(1))
    torch.testing.assert_close(mean, torch.tensor([[0.0], [8 / 3], [2.0]]))
    assert kernels.gsddmm(csr, "u_sub_v", u=u, v=u).squeeze(1).tolist() == [-9.0, -90.0, 90.0, -9.0]
    y = kernels.edge_softmax(csr, torch.log(torch.tensor([1.0, 5.0, 2.0, 1.0])))
    torch.testing.assert_close(y, torch.tensor([0.25, 1.0, 0.5, 0.25]))


def test_max_gradient_goes_to_one_edge_on_ties():
    csr = small()
    u = torch.tensor([[1.0], [1.0], [1.0]], requires_grad=True)
    e = torch.ones(4, requires_grad=True)
    kernels.gspmm(csr, "u_mul_e", "max", u=u, e=e).sum().backward()
    # destination 1 ties across edges 0, 2, 3: the smallest edge id (0) takes the gradient.
    assert e.grad.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert u.grad.squeeze(1).tolist() == [1.0, 1.0, 0.0]


def test_backend_selection():
    from kernels import _backend

    assert _backend.current_choice() == "auto"
    with kernels.use_backend("torch"):
        assert _backend.resolve("auto", torch.device("cpu")).NAME == "torch"
        with kernels.use_backend("auto"):
            assert _backend.current_choice() == "auto"
        assert _backend.current_choice() == "torch"
    assert _backend.current_choice() == "auto"
    try:
        kernels.set_default_backend("torch")
        assert _backend.resolve("auto", torch.device("cpu")).NAME == "torch"
    finally:
        kernels.set_default_backend("auto")
    # An explicit backend argument wins over the default.
    assert _backend.resolve("torch", torch.device("cpu")).NAME == "torch"


@pytest.mark.parametrize("call,exc,msg", [
    (lambda c: kernels.gspmm(c, "u_pow_e", "sum", u=torch.ones(3, 2), e=torch.ones(4)),
     ValueError, "unknown gspmm op 'u_pow_e'; valid names are 'copy_u'"),
    (lambda c: kernels.gspmm(c, "copy_u", "prod", u=torch.ones(3, 2)), ValueError,
     "unknown reducer 'prod'; valid names are 'sum', 'mean', 'max', 'min'"),
    (lambda c: kernels.gspmm(c, "copy_u", "sum", u=torch.ones(3, 2), backend="cuda"), ValueError,
     "unknown backend 'cuda'; valid names are 'auto', 'numba', 'numba_cuda', 'torch'"),
    (lambda c: kernels.gsddmm(c, "u_dot_w", u=torch.ones(3, 2)), ValueError, "unknown gsddmm op"),
    (lambda c: kernels.gspmm(c, "copy_u", "sum", u=torch.ones(4, 2)), ValueError,
     r"u must have shape \[3, ...\] with one row per source vertex \(got shape \(4, 2\)\)"),
    (lambda c: kernels.gspmm(c, "u_mul_e", "sum", u=torch.ones(3, 2), e=torch.ones(3)), ValueError,
     r"e must have shape \[4, ...\] with one row per edge \(got shape \(3,\)\)"),
    (lambda c: kernels.gspmm(c, "u_mul_e", "sum", u=torch.ones(3, 2), e=torch.ones(4, 3)),
     ValueError, r"operand feature shapes \(2,\) and \(3,\) do not broadcast"),
    (lambda c: kernels.gsddmm(c, "u_dot_v", u=torch.ones(3, 2), v=torch.ones(3, 3)), ValueError,
     "dot needs both operands to end in the same feature dim"),
    (lambda c: kernels.gspmm(c, "u_mul_e", "sum", u=torch.ones(3, 2), e=torch.ones(4, dtype=torch.float64)),
     TypeError, "operands must share one dtype"),
    (lambda c: kernels.gspmm(c, "copy_u", "sum", u=torch.ones(3, 2, dtype=torch.int64)), TypeError,
     "u must be a floating tensor"),
    (lambda c: kernels.gspmm(c, "copy_u", "sum"), ValueError, "op 'copy_u' needs operand 'u'"),
    (lambda c: kernels.gspmm(c, "copy_u", "sum", u=torch.ones(3, 2), e=torch.ones(4)), ValueError,
     "op 'copy_u' does not use operand 'e'"),
    (lambda c: kernels.edge_softmax(c, torch.ones(5)), ValueError, "scores must have shape"),
    (lambda c: kernels.gspmm("graph", "copy_u", "sum", u=torch.ones(3, 2)), TypeError,
     "expected a kernels.CSR"),
])
def test_bad_input_errors(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call(small())


def test_bad_backend_names_in_selectors():
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        kernels.set_default_backend("fast")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        with kernels.use_backend("fast"):
            pass


def test_backward_reuses_the_live_csr_under_saved_tensor_hooks(monkeypatch):
    """Saved-tensor hooks may hand back another Python object for the same index tensor (torch
    2.2 does): backward must still find the live CSR and its cached transpose, not rebuild one
    (a rebuilt transpose per call cost memory and time in every streamed backward)."""
    csr = small()
    csr.transpose()  # cached on csr
    u = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("backward rebuilt a CSR although the forward's CSR is alive")

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.view_as(t)):
        out = kernels.gspmm(csr, "copy_u", "sum", u=u)
    monkeypatch.setattr(CSR, "from_coo", staticmethod(no_rebuild))
    out.pow(2).sum().backward()
    dense = torch.zeros(3, 3, dtype=torch.float64)
    for s, d in zip(*[t.tolist() for t in csr.coo()]):
        dense[d, s] += 1
    expect = dense.T @ (2 * (dense @ u.detach()))
    torch.testing.assert_close(u.grad, expect)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("op", ["u_add_e", "u_sub_e"])
def test_add_gradient_wrt_an_edge_weight_sums_per_destination_first(monkeypatch, backend, op):
    """d/de of u_add_e / u_sub_e with one weight per edge (or head) is each edge's destination
    row of g summed over the features e is broadcast along: the kernel gathers the per-destination
    sums ([N, H, 1]), never an [E, H, F] copy of g (8.6 GB on R-MAT scale 21 at F = 64)."""
    from kernels import _backend

    mod = _backend._load(backend)
    seen = []
    real = mod.sddmm
    monkeypatch.setattr(mod, "sddmm", lambda csr, op_, lhs, *a: seen.append(
        (op_, tuple(lhs.shape))) or real(csr, op_, lhs, *a))
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 30, (200,), generator=gen)
    dst = torch.randint(0, 30, (200,), generator=gen)
    csr = CSR.from_coo(src, dst, 30)
    u = torch.randn(30, 2, 5, dtype=torch.float64, generator=gen)
    e = torch.randn(200, 2, 1, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(30, 2, 5, dtype=torch.float64, generator=gen)
    (got,) = torch.autograd.grad(kernels.gspmm(csr, op, "sum", u=u, e=e, backend=backend), e, g)
    assert seen == [("copy_lhs", (30, 2, 1))]
    msg = u[src] + e if op == "u_add_e" else u[src] - e
    ref = torch.zeros(30, 2, 5, dtype=torch.float64).index_add(0, dst, msg)
    (want,) = torch.autograd.grad(ref, e, g)
    torch.testing.assert_close(got, want)


_I64 = torch.int64


@pytest.mark.parametrize("build,exc,msg", [
    # The crash: a numba kernel given this CSR read far outside its arrays (SIGSEGV).
    (lambda: CSR.from_coo(torch.tensor([0, 10**9]), torch.tensor([0, 1]), 2), ValueError,
     r"src\[1\] = 1000000000 is out of range for num_src = 2; ids must lie in \[0, 2\)"),
    (lambda: CSR.from_coo(torch.tensor([0, -1]), torch.tensor([0, 1]), 2), ValueError,
     r"src\[1\] = -1 is out of range"),
    (lambda: CSR.from_coo(torch.tensor([0, 1]), torch.tensor([0, 5]), (2, 3)), ValueError,
     r"dst\[1\] = 5 is out of range for num_dst = 3"),
    (lambda: CSR.from_coo(torch.tensor([0.0]), torch.tensor([0]), 2), TypeError,
     r"src must be an integer tensor \(got torch.float32\)"),
    (lambda: CSR.from_coo(torch.tensor([0]), torch.tensor([0]), -1), ValueError,
     r"num_nodes must be >= 0 \(got -1\)"),
    (lambda: CSR.from_coo(torch.tensor([0]), torch.tensor([0]), 2.5), TypeError,
     r"num_nodes must be an integer \(got 2.5"),
    (lambda: CSR.from_coo(torch.tensor([0]), torch.tensor([0]), (1, 2, 3)), ValueError,
     r"num_nodes must be an int or a pair"),
    (lambda: CSR.from_coo(torch.tensor([0]), torch.tensor([0]), 2**31, index_dtype=torch.int32),
     ValueError, "index_dtype torch.int32 cannot hold 2147483648"),
    (lambda: CSR(torch.tensor([0, 1, 2]), torch.tensor([0, 7]), torch.tensor([0, 1]), 2, 2),
     ValueError, r"indices\[1\] = 7 is out of range for num_src = 2"),
    (lambda: CSR(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([0, 2]), 2, 2),
     ValueError, r"eids\[1\] = 2 is out of range for the number of edges = 2"),
    (lambda: CSR(torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1]), 2, 3),
     ValueError, r"indptr must be non-decreasing \(got indptr\[1\] = 2 > indptr\[2\] = 1\)"),
    (lambda: CSR(torch.tensor([0, 1, 5]), torch.tensor([0, 1]), torch.tensor([0, 1]), 2, 2),
     ValueError, r"indptr\[-1\] = 5"),
    (lambda: CSR(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([0, 1]), 2, 2),
     ValueError, r"indptr must have num_dst \+ 1 = 3 entries \(got 2\)"),
    (lambda: CSR(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1]),
                 torch.tensor([0, 1]), 2, 2), TypeError, "indptr must be torch.int64"),
    (lambda: CSR(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1],
                 dtype=torch.int32), 2, 2), TypeError, "indices and eids must both be"),
    (lambda: CSR(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([0]), 2, 2),
     ValueError, r"eids must have one entry per edge: 2 like indices \(got 1\)"),
    (lambda: CSR(torch.tensor([[0, 1, 2]]), torch.tensor([0, 1]), torch.tensor([0, 1]), 2, 2),
     ValueError, r"indptr must be 1-D \(got shape \(1, 3\)\)"),
])
def test_every_csr_constructor_checks_its_ids(build, exc, msg):
    with pytest.raises(exc, match=msg):
        build()


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_out_of_range_ids_never_reach_a_kernel(backend):
    """The issue's reproduction, in a child process so that a segfault is a failure, not a dead
    test run: the CSR is refused before the kernel runs, on every backend."""
    import subprocess
    import sys
    code = (
        "import torch, kernels\n"
        "try:\n"
        "    csr = kernels.CSR.from_coo(torch.tensor([0, 10**9]), torch.tensor([0, 1]), 2)\n"
        f"    kernels.gspmm(csr, 'copy_u', 'sum', torch.randn(2, 4), backend='{backend}')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: src[1] = 1000000000 is out of range" in out.stdout


def test_checked_csr_is_unchanged_and_derived_csrs_skip_the_check(monkeypatch):
    csr = CSR(torch.tensor([0, 0, 3, 4]), torch.tensor([0, 2, 0, 1]), torch.tensor([0, 2, 3, 1]),
              3, 3)
    assert csr.indptr.tolist() == [0, 0, 3, 4] and (csr.num_src, csr.num_dst) == (3, 3)
    assert CSR(torch.zeros(1, dtype=_I64), torch.zeros(0, dtype=_I64), torch.zeros(0, dtype=_I64),
               5, 0).num_edges == 0
    # transpose() and to() build from already checked arrays: no second O(E) pass.
    import kernels.csr as csr_module

    def fail(*a, **k):
        raise AssertionError("checked twice")

    monkeypatch.setattr(csr_module, "_check_csr", fail)
    monkeypatch.setattr(csr_module, "_check_ids", fail)
    t = csr.transpose()
    assert t.indptr.tolist() == [0, 2, 3, 4]
    assert csr.to("cpu") is csr


def _reference_transpose(csr):
    """Rows = sources, each row's edges in edge-id order (the definition, edge by edge)."""
    src, dst = csr.coo()
    rows = [[] for _ in range(csr.num_src)]
    for k in range(csr.num_edges):
        rows[int(src[k])].append((int(dst[k]), k))
    indptr = [0]
    for r in rows:
        indptr.append(indptr[-1] + len(r))
    return indptr, [d for r in rows for d, _ in r], [k for r in rows for _, k in r]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sizes", [(40, 40), (7, 30), (30, 7)])
def test_transpose_matches_its_definition(index_dtype, sizes):
    gen = torch.Generator().manual_seed(3)
    e = 500  # parallel edges and self loops included
    src = torch.randint(0, sizes[0], (e,), generator=gen)
    dst = torch.randint(0, sizes[1], (e,), generator=gen)
    csr = CSR.from_coo(src, dst, sizes, index_dtype=index_dtype)
    t = csr.transpose()
    indptr, indices, eids = _reference_transpose(csr)
    assert (t.num_src, t.num_dst) == (sizes[1], sizes[0])  # rows are csr's sources
    assert t.indptr.tolist() == indptr and t.indices.tolist() == indices
    assert t.eids.tolist() == eids
    assert t.index_dtype == index_dtype and t.indptr.dtype == torch.int64


def test_transpose_keeps_no_int64_copy_of_the_edges():
    """Building the transpose caches nothing of the edges' size on the CSR (dst_ids() is not
    filled) and its live temporaries stay within a few index arrays: int64 copies of the edges
    made it the peak of a training run's first backward (R-MAT 1M / 16M)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    import weakref

    class Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key not in self.live and st.nbytes():
                        self.live[key] = st.nbytes()
                        weakref.finalize(st, self.live.pop, key, None)
                        self.peak = max(self.peak, sum(self.live.values()))
            return out

    e, n = 200_000, 5000
    gen = torch.Generator().manual_seed(0)
    csr = CSR.from_coo(torch.randint(0, n, (e,), generator=gen, dtype=torch.int32),
                       torch.randint(0, n, (e,), generator=gen, dtype=torch.int32), n)
    with Peak() as p:
        t = csr.transpose()
    assert csr._dst_ids is None
    # per edge: sources and destinations by edge id (4 + 4), the sort's keys and order (4 + 8),
    # the result's indices and ids (4 + 4); the int64 copies took 56 bytes
    assert p.peak <= 30 * e, p.peak / e
    assert t.transpose() is csr


@pytest.mark.parametrize("op,reduce,grads,kept", [
    ("copy_u", "sum", "u", set()),          # a sum of copies reads neither operand back
    ("copy_u", "mean", "u", set()),
    ("u_add_e", "sum", "ue", set()),
    ("u_mul_e", "sum", "u", {"e"}),         # d/du of u * e reads e
    ("u_mul_e", "sum", "e", {"u"}),         # d/de reads u
    ("u_mul_e", "sum", "ue", {"u", "e"}),
    ("u_div_e", "sum", "e", {"u", "e"}),    # d/de of u / e = -u / e^2
    ("u_mul_e", "max", "u", {"u", "e"}),    # max / min: unchanged, both kept
])
def test_gspmm_keeps_only_the_operands_backward_reads(op, reduce, grads, kept):
    """An operand backward does not read is not saved: GCN's copy_u kept its whole [N, 64]
    source features alive from forward to backward (256 MiB on the e2e graph)."""
    import gc
    import weakref

    csr = small()
    leaf_u = torch.randn(3, 4, dtype=torch.float64, requires_grad="u" in grads)
    leaf_e = torch.rand(4, 1, dtype=torch.float64, requires_grad="e" in grads)
    u, e = leaf_u * 1.0 + 0.5, leaf_e * 1.0 + 0.5  # non-leaves: only the kernel may hold them
    refs = {"u": weakref.ref(u), "e": weakref.ref(e)}
    out = kernels.gspmm(csr, op, reduce, u=u, e=None if op == "copy_u" else e)
    del u, e
    gc.collect()
    assert {k for k, r in refs.items() if r() is not None} == kept
    out.sum().backward()  # and backward still has what it needs
    assert all(getattr(leaf, "grad") is not None for leaf, k in ((leaf_u, "u"), (leaf_e, "e"))
               if k in grads and not (op == "copy_u" and k == "e"))


@pytest.mark.parametrize("op,kept", [("u_add_v", set()), ("u_mul_v", {"u", "v"}),
                                     ("u_dot_v", {"u", "v"})])
def test_gsddmm_keeps_only_the_operands_backward_reads(op, kept):
    import gc
    import weakref

    csr = small()
    leaf_u, leaf_v = (torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True) for _ in "uv")
    u, v = leaf_u * 1.0, leaf_v * 1.0
    refs = {"u": weakref.ref(u), "v": weakref.ref(v)}
    out = kernels.gsddmm(csr, op, u=u, v=v)
    del u, v
    gc.collect()
    assert {k for k, r in refs.items() if r() is not None} == kept
    out.sum().backward()
    assert leaf_u.grad is not None and leaf_v.grad is not None


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("op,reduce", [("u_mul_e", "sum"), ("copy_u", "mean"), ("u_add_e", "max")])
def test_gspmm_takes_a_reshape_view_s_tensor(backend, op, reduce):
    """u given as a reshape of z (GAT's z.view(-1, H, C)): z goes into the kernel's autograd
    node directly (no view node), so the gradient z gets from it is a plain tensor, which
    autograd accumulates other gradients of z into in place (a view node's output it adds to
    out of place, in a fresh tensor); values and gradients as with the view."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(0)
    n, e, heads, c = 300, 3000, 4, 8
    csr = CSR.from_coo(torch.randint(0, n, (e,), generator=gen),
                       torch.randint(0, n, (e,), generator=gen), n)
    x = torch.randn(n, heads * c, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(heads * c, 2, generator=gen, dtype=torch.float64)
    a = torch.rand(e, heads, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    go = torch.randn(n, heads, c, generator=gen, dtype=torch.float64)

    def run(view):
        z = x * 1.0
        u = z.view(n, heads, c) if view else z.detach().view(n, heads, c).requires_grad_()
        out = kernels.gspmm(csr, op, reduce, u=u, e=None if op == "copy_u" else a,
                            backend=backend)
        if view:  # z's only other consumer comes first: its gradient arrives last
            assert out.grad_fn.next_functions[0][0] is z.grad_fn
            return out, z.mm(w)
        return out, u

    out, score = run(True)
    with profile() as prof:
        torch.autograd.backward([score, out], [torch.ones_like(score), go])
    adds = {ev.key: ev.count for ev in prof.key_averages() if ev.key in ("aten::add", "aten::add_")}
    assert adds.get("aten::add_", 0) >= 1 and "aten::add" not in adds, adds
    got = x.grad.clone()
    ref_out, u = run(False)
    (gu,) = torch.autograd.grad(ref_out, u, go)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(got, gu.reshape(n, -1) + torch.ones(n, 2, dtype=x.dtype) @ w.t())


def test_auto_warns_once_when_it_falls_back_to_torch(monkeypatch):
    """"auto" takes the torch reference where the device's backend cannot load (numba missing,
    or numba.cuda unable to load its numpy support); it says so once, with the reason, instead of
    running torch's slower ops unannounced."""
    import warnings

    from kernels import _backend

    monkeypatch.delitem(_backend._modules, "numba", raising=False)
    monkeypatch.setitem(_backend._unusable, "numba", "ImportError: no numba (test)")
    monkeypatch.setattr(_backend, "_warned", set())
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match=r"torch reference instead of 'numba': ImportError: no"):
        assert _backend.resolve("auto", cpu).NAME == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve("auto", cpu).NAME == "torch"  # once
        # a dtype the backend does not compute in is no fallback worth a warning
        monkeypatch.delitem(_backend._unusable, "numba")
        assert _backend.resolve("auto", cpu, torch.float16).NAME == "torch"
    with pytest.raises(ValueError, match="backend 'numba_cuda' is not usable here"):
        monkeypatch.setitem(_backend._unusable, "numba_cuda", "no GPU (test)")
        monkeypatch.delitem(_backend._modules, "numba_cuda", raising=False)
        _backend.resolve("numba_cuda", cpu)
