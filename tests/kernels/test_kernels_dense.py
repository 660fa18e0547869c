"""kernels._dense (Linear, ReLU, addcmul, +, * with outputs and gradients in the output cache)
against torch's own ops: the same values and gradients, bit for bit (a Linear's weight gradient
up to rounding: the same sums in another order), on results large enough to take the cached
path (checked through the cache's counters); torch's op where it does not apply (small
results, other dtypes, hooks, autocast, in-place forms); second derivatives; and ngra's
interpreter giving a GIN / GraphSAGE / GCN layer the same values and gradients with the cache on
and off."""

from __future__ import annotations

import operator
import weakref

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _dense

N = 4096  # [4096, 64] float32 = 1 MiB: the smallest result the cache serves


def _requests():
    s = kernels.output_cache_stats()
    return s["hits"] + s["misses"]


def _grads(fn, inputs, seed=0):
    """``fn(*inputs)`` and the gradients of a random weighting of it w.r.t. every input that
    requires grad."""
    out = fn(*inputs)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out.detach(), torch.autograd.grad(out, needs, g)


def _close(got, want):
    """Equal up to rounding (a Linear's weight gradient: torch's sums in another order)."""
    eps = 1e-5 if want.dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got, want, rtol=0, atol=eps * float(want.abs().max()))


def _leaves(gen, dtype, *shapes, grad=True):
    return [torch.randn(*s, dtype=dtype, generator=gen).requires_grad_(grad) for s in shapes]


CASES = {
    # name: (cached form, torch's form, operand shapes)
    "linear": (_dense.linear, F.linear, [(N, 32), (64, 32), (64,)]),
    "linear, no bias": (_dense.linear, F.linear, [(N, 32), (64, 32)]),
    # GAT's per-head scores: the weight gradient is torch's g^T x (bit for bit), the other
    # orientation being several times slower for a narrow g
    "linear, narrow output": (_dense.linear, F.linear, [(16 * N, 64), (4, 64)]),
    "linear, narrow input": (_dense.linear, F.linear, [(N, 4), (64, 4), (64,)]),
    "relu": (_dense.relu, torch.relu, [(N, 64)]),
    "leaky_relu": (lambda x: _dense.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2), [(N, 64)]),
    "leaky_relu, edge scores": (_dense.leaky_relu, F.leaky_relu, [(16 * N, 4)]),
    "addcmul, scalar weight": (_dense.addcmul, torch.addcmul, [(N, 64), (1,), (N, 64)]),
    "addcmul, column weight": (_dense.addcmul, torch.addcmul, [(N, 64), (N, 1), (N, 64)]),
    "addcmul, broadcast bias": (_dense.addcmul, torch.addcmul, [(64,), (N, 64), (N, 1)]),
    "add, same shape": (_dense.add, operator.add, [(N, 64), (N, 64)]),
    "add, bias": (_dense.add, operator.add, [(N, 64), (64,)]),
    "mul, column": (_dense.mul, operator.mul, [(N, 64), (N, 1)]),
    "mul, same shape": (_dense.mul, operator.mul, [(N, 64), (N, 64)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_op_equals_torch_op_and_its_gradients(case, dtype):
    fast, slow, shapes = CASES[case]
    gen = torch.Generator().manual_seed(3)
    inputs = _leaves(gen, dtype, *shapes)
    before = _requests()
    out, grads = _grads(fast, inputs)
    assert _requests() > before  # the cached path ran (forward and backward take blocks)
    ref_out, ref_grads = _grads(slow, inputs)
    assert out.dtype == dtype and torch.equal(out, ref_out)
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.shape == want.shape
        if case.startswith("linear") and i == 1 and case != "linear, narrow output":
            _close(got, want)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("needs", [(True, False), (False, True), (True, True)])
def test_only_the_gradients_asked_for(needs):
    gen = torch.Generator().manual_seed(4)
    x, w = _leaves(gen, torch.float32, (N, 32), (64, 32), grad=False)
    x.requires_grad_(needs[0])
    w.requires_grad_(needs[1])
    out, grads = _grads(_dense.linear, [x, w])
    ref_out, ref_grads = _grads(F.linear, [x, w])
    assert torch.equal(out, ref_out) and len(grads) == sum(needs)
    if needs[0]:
        assert torch.equal(grads[0], ref_grads[0])
    if needs[1]:
        _close(grads[-1], ref_grads[-1])


def test_second_derivatives_match_torch():
    gen = torch.Generator().manual_seed(5)
    x, w, b = _leaves(gen, torch.float64, (N, 16), (32, 16), (32,))
    y = _leaves(gen, torch.float64, (N, 32))[0]

    def loss(lin, act, times):
        h = act(lin(x, w, b))
        return (times(h, y) ** 2).sum()

    results = []
    before = _requests()
    for forms in ((_dense.linear, _dense.relu, _dense.mul), (F.linear, torch.relu, operator.mul)):
        gx, gw = torch.autograd.grad(loss(*forms), (x, w), create_graph=True)
        results.append(torch.autograd.grad((gx ** 2).sum() + gw.sum(), (x, w, b, y)))
        if len(results) == 1:
            assert _requests() > before  # [N, 32] float64 results: 1 MiB, the cached path
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_torch_op_where_the_cached_path_does_not_apply():
    gen = torch.Generator().manual_seed(6)
    small = torch.randn(100, 64, generator=gen)
    big = torch.randn(N, 64, generator=gen)
    before = _requests()
    assert torch.equal(_dense.relu(small), torch.relu(small))  # 25 KiB: glibc's heap
    ints = torch.randint(-5, 5, (N, 64), generator=gen)
    assert torch.equal(_dense.relu(ints), torch.relu(ints))  # not a float dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = torch.randn(64, 64, generator=gen)
        assert _dense.linear(big, w).dtype == torch.bfloat16  # autocast's own linear
    assert torch.equal(_dense.add(big, 2.0), big + 2.0)  # a scalar operand
    assert _requests() == before


def test_module_hooks_keep_the_module_call():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(N, 64)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert _dense.call("module", lin, (x,), {}) is NotImplemented
    assert _dense.call("module", torch.nn.ReLU(inplace=True), (x,), {}) is NotImplemented
    assert _dense.call("function", F.relu, (x,), {"inplace": True}) is NotImplemented
    assert _dense.call("method", "relu_", (x,), {}) is NotImplemented
    out = _dense.call("module", torch.nn.Linear(64, 64), (x,), {})  # no hook: cached
    assert out is not NotImplemented and out.shape == (N, 64) and not seen


def test_call_takes_torch_s_argument_forms():
    """Keywords and defaults as torch's functions take them; forms the cached op does not have
    (in place, alpha, more operands) are left to torch."""
    gen = torch.Generator().manual_seed(7)
    x, w, b, y = (torch.randn(*s, generator=gen) for s in ((N, 64), (64, 64), (64,), (N, 64)))
    taken = [
        (("function", F.leaky_relu, (x,), {"negative_slope": 0.3}), F.leaky_relu(x, 0.3)),
        (("function", F.leaky_relu, (x,), {}), F.leaky_relu(x)),
        (("function", F.leaky_relu, (x, 0.1), {"inplace": False}), F.leaky_relu(x, 0.1)),
        (("module", torch.nn.LeakyReLU(0.25), (x,), {}), F.leaky_relu(x, 0.25)),
        (("function", F.linear, (x, w), {"bias": b}), F.linear(x, w, b)),
        (("function", F.linear, (x,), {"weight": w}), F.linear(x, w)),
        (("function", torch.addcmul, (b, x, y), {}), torch.addcmul(b, x, y)),
        (("method", "add", (x, y), {}), x.add(y)),
        (("method", "mul", (x, y), {}), x.mul(y)),
    ]
    for args, want in taken:
        got = _dense.call(*args)
        assert got is not NotImplemented and torch.equal(got, want), args[:2]
    left = [("function", F.leaky_relu, (x, 0.2), {"inplace": True}),
            ("function", F.leaky_relu, (x, 0.2, False), {}),
            ("module", torch.nn.LeakyReLU(inplace=True), (x,), {}),
            ("function", torch.add, (x, y), {"alpha": 2}),
            ("method", "add", (x, y), {"alpha": 2}),
            ("function", torch.addcmul, (b, x, y), {"value": 2}),
            ("function", F.linear, (x,), {"bias": b}),  # no weight
            ("function", torch.sub, (x, y), {})]
    for args in left:
        assert _dense.call(*args) is NotImplemented, args[:2]


def test_cache_off_gives_torch_ops():
    x = torch.randn(N, 64)
    limit = kernels.output_cache_limit()
    kernels.set_output_cache_limit(0)
    try:
        assert _dense.call("function", torch.relu, (x,), {}) is NotImplemented
    finally:
        kernels.set_output_cache_limit(limit)


def _layer_run(layer, g, x):
    torch.manual_seed(0)
    out = layer(g, x)
    gx, *gp = torch.autograd.grad(out, [x, *layer.parameters()],
                                  torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out.detach(), gx, gp


@pytest.mark.parametrize("name", ["gin", "sage", "gcn", "gat"])
def test_layers_same_with_and_without_the_cached_ops(name, monkeypatch):
    """A whole layer through ngra's interpreter (GIN's MLP, GraphSAGE's two linears and sum,
    GCN's W x, GAT's LeakyReLU of the edge scores): the cache on (the dense ops take the cached
    path) and off (torch's ops)."""
    from ngra import Graph
    from ngra.nn import GATConv, GCNConv, GINConv, SAGEConv
    gen = torch.Generator().manual_seed(2)
    n, f = N, 96
    src, dst = torch.randint(0, n, (8 * n,), generator=gen), torch.randint(0, n, (8 * n,), generator=gen)
    keep = src != dst
    g = Graph(src[keep], dst[keep], n)
    torch.manual_seed(0)
    layer = {"gin": lambda: GINConv(torch.nn.Sequential(torch.nn.Linear(f, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 64))),
             "sage": lambda: SAGEConv(f, 64), "gcn": lambda: GCNConv(f, 64),
             # 8 heads: its [E, 8] edge scores (about 37K edges) pass 1 MiB for LeakyReLU
             "gat": lambda: GATConv(f, 8, heads=8)}[name]()
    x = torch.randn(n, f, generator=gen, requires_grad=True)
    taken = []
    call = _dense.call

    def counted(kind, target, args, kwargs):
        out = call(kind, target, args, kwargs)
        taken.append(out is not NotImplemented)
        return out
    monkeypatch.setattr(_dense, "call", counted)
    grouped = []
    group = _dense._LinearGroup.apply
    monkeypatch.setattr(_dense._LinearGroup, "apply", lambda *a: grouped.append(1) or group(*a))
    blocks = []
    blocked_mlp = _dense._BlockedMlp.apply
    monkeypatch.setattr(_dense._BlockedMlp, "apply",
                        lambda *a: blocks.append(1) or blocked_mlp(*a))
    fast = _layer_run(layer, g, x)
    # GIN: its MLP's ReLU and Linear after the one-kernel sum as one relu_linear (the projection
    # before it calls _dense.linear itself); GraphSAGE: the sum (its two Linears on x: a group);
    # GCN: W x; GAT: its Linear, LeakyReLU, + bias (its two score projections, [N, 8] each,
    # are a group too small for the cached path: torch's Linears)
    assert sum(taken) >= {"gin": 0, "sage": 1, "gcn": 1, "gat": 3}[name]
    assert len(grouped) == (name == "sage")
    assert len(blocks) == (name == "gin")
    limit = kernels.output_cache_limit()
    kernels.set_output_cache_limit(0)
    try:
        slow = _layer_run(layer, g, x)
    finally:
        kernels.set_output_cache_limit(limit)
    if blocks:  # GEMMs of blocks of rows: equal up to rounding where MKL groups sums otherwise
        _close(fast[0], slow[0])
    else:
        assert torch.equal(fast[0], slow[0])
    if grouped or blocks:  # grouped Linears: x's gradient as one GEMM instead of a sum of two
        _close(fast[1], slow[1])
    else:
        assert torch.equal(fast[1], slow[1])
    for a, b in zip(fast[2], slow[2]):  # the weights' gradients up to rounding
        _close(a, b)


# -- a Linear on a dropout's output keeps the dropout's input instead ----------------------------
def _dropped(dtype, grad_x=False, rows=N + 37):
    from kernels import _dropout
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 48, dtype=dtype, generator=gen).requires_grad_(grad_x)
    w, b = _leaves(gen, dtype, (64, 48), (64,))
    return _dropout, x, w, b


def _global_rows(n, seed=8):
    """A distributed-graph worker's rows: n distinct global row ids out of 3n, shuffled."""
    return torch.randperm(3 * n, generator=torch.Generator().manual_seed(seed))[:n]


def _spy_remade(_dropout, monkeypatch, kernel):
    """Count the passes that make a dropout again for a weight gradient: ``(chunks, kernel)``
    lists, one item per pass through ``_dropout.chunks`` (torch's GEMMs) and per call of the
    one-kernel ``_dropout.weight_grads`` that took it. ``kernel`` False: the kernel never
    applies (its width limit 0)."""
    chunked, fused = [], []
    orig_chunks, orig_kernel = _dropout.chunks, _dropout.weight_grads
    monkeypatch.setattr(_dropout, "chunks", lambda *a: chunked.append(1) or orig_chunks(*a))

    def spy(*a):
        got = orig_kernel(*a)
        if got is not None:
            fused.append(1)
        return got
    monkeypatch.setattr(_dropout, "weight_grads", spy)
    if not kernel:
        monkeypatch.setattr(_dropout, "WG_MAX_WIDTH", 0)
    return chunked, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_features", [64, 4])  # both orientations of the weight gradient
@pytest.mark.parametrize("piece", [False, True])  # a worker's rows, masked by their global ids
@pytest.mark.parametrize("kernel", [False, True])  # chunks and torch's GEMMs, or one kernel
def test_linear_of_a_dropout_makes_it_again(dtype, out_features, piece, kernel, monkeypatch):
    """The dropout's output is not kept for the weight gradient (it is freed with its last
    reference): backward makes it again a few rows at a time, in chunks for torch's GEMMs
    (forced to many here, the last one short) or, for float32 gradients at least 16 wide of the
    whole tensor's dropout, in one kernel (kernels._dropout.weight_grads); the gradients equal
    torch's Linear on the same dropout output."""
    # a result of at least 1 MiB, which the cached Linear takes
    _dropout, x, w, b = _dropped(dtype, rows=(N + 37) * 64 // out_features)
    w = w[:out_features].detach().requires_grad_()
    b = b[:out_features].detach().requires_grad_()
    monkeypatch.setattr(_dropout, "CHUNK_BYTES", x.shape[0] // 5 * 48 * x.element_size())
    made, fused = _spy_remade(_dropout, monkeypatch, kernel)
    in_kernel = kernel and dtype == torch.float32 and out_features >= 16 and not piece
    h = _dropout.dropout(x, 0.5, 1234, _global_rows(x.shape[0]) if piece else None)
    ref = h.detach().clone()
    gone = weakref.ref(h)
    out = _dense.linear(h, w, b)
    del h
    assert gone() is None  # nothing kept it
    g = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
    gw, gb = torch.autograd.grad(out, (w, b), g)
    assert (made, fused) == (([], [1]) if in_kernel else ([1], []))
    want_out, (want_gw, want_gb) = _grads(F.linear, [ref, w, b], seed=5)
    assert torch.equal(out.detach(), want_out)
    _close(gw, want_gw)
    assert torch.equal(gb, want_gb)


@pytest.mark.parametrize("piece", [False, True])
def test_dropout_chunks_are_the_dropout_bit_for_bit(piece, monkeypatch):
    _dropout, x, _, _ = _dropped(torch.float32)
    monkeypatch.setattr(_dropout, "CHUNK_BYTES", 777 * 48 * 4)
    ids = _global_rows(x.shape[0]) if piece else None
    whole = _dropout.dropout(x, 0.3, 99, ids).detach()
    if piece:  # each row's mask is its global row's: as the whole tensor's rows `ids`
        big = torch.zeros(3 * x.shape[0], 48).index_copy_(0, ids, x.detach())
        assert torch.equal(whole, _dropout.dropout(big, 0.3, 99, torch.arange(big.shape[0]))[ids])
    parts, ends = [], []
    for r0, r1, rows in _dropout.chunks(x, 0.3, 99, ids):
        parts.append(rows.clone())
        ends.append((r0, r1))
    assert ends[0][0] == 0 and ends[-1][1] == x.shape[0] and len(ends) > 2
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert torch.equal(torch.cat(parts), whole)


def test_linear_keeps_a_dropout_output_changed_in_place(monkeypatch):
    """An in-place change of the dropout's output (or of its input) after the dropout: the
    recipe no longer holds, the Linear keeps its input as usual, the gradients follow it."""
    _dropout, x, w, b = _dropped(torch.float32)
    made, fused = _spy_remade(_dropout, monkeypatch, True)
    for change in ("output", "input"):
        h = _dropout.dropout(x, 0.5, 7)
        if change == "output":
            h.mul_(3)
        else:
            with torch.no_grad():
                x.add_(1)
        assert _dropout.recipe(h) is None
        ref = h.detach().clone()
        got = _grads(_dense.linear, [h, w, b], seed=2)
        want = _grads(F.linear, [ref, w, b], seed=2)
        _close(got[1][0], want[1][0])
    assert made == [] and fused == []


def test_linear_of_a_dropout_second_derivatives():
    """create_graph: the dropout is made again through its differentiable op."""
    _dropout, x, w, b = _dropped(torch.float64, grad_x=True)
    h = _dropout.dropout(x, 0.5, 11)
    ref = _dropout.dropout(x, 0.5, 11)  # the same values, through torch's Linear
    outs = [_dense.linear(h, w, b), F.linear(ref, w, b)]
    hvps = []
    for out in outs:
        gw, = torch.autograd.grad(out.pow(2).sum(), w, create_graph=True)
        hvps.append(torch.autograd.grad(gw.sum(), (x, w)))
    for got, want in zip(*hvps):
        _close(got, want)


# -- Linears sharing their input (ngra.passes.group_linears) --------------------------------------
def _separate(x, *wb):
    return tuple(F.linear(x, w, b) for w, b in zip(wb[0::2], wb[1::2]))


def _grouped(x, *wb):
    return _dense.linear_group(x, *zip(wb[0::2], wb[1::2]))


def _group_grads(fn, inputs, used, seed=0):
    """``fn(*inputs)`` (a tuple) and the gradients of a random weighting of its outputs ``used``
    w.r.t. every input that requires grad (None where nothing reaches it)."""
    outs = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=gen)).sum()
               for k, o in enumerate(outs) if k in used)
    needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, needs, allow_unused=True)


GROUPS = {
    # name: operand shapes (x, then weight and bias per Linear; None: no bias)
    "SAGE layer 1 (W_l no bias, W_r with)": [(N, 32), (64, 32), None, (64, 32), (64,)],
    # GAT's two score projections: narrow outputs, torch's g^T x orientation
    "GAT scores": [(16 * N, 64), (4, 64), None, (4, 64), None],
    "gated GCN (four, mixed widths)": [(N, 16), (64, 16), (64,), (32, 16), (32,), (8, 16), None,
                                      (64, 16), (64,)],
}


@pytest.mark.parametrize("used", [(0, 1), (1,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(GROUPS))
def test_linear_group_equals_separate_linears(case, dtype, used):
    gen = torch.Generator().manual_seed(8)
    inputs = [None if s is None else _leaves(gen, dtype, s)[0] for s in GROUPS[case]]
    before = _requests()
    outs, grads = _group_grads(_grouped, inputs, used)
    assert _requests() > before  # the grouped Function ran (its blocks come from the cache)
    ref_outs, ref_grads = _group_grads(_separate, inputs, used)
    assert all(o.dtype == dtype and torch.equal(o, r) for o, r in zip(outs, ref_outs))
    for got, want in zip(grads, ref_grads):  # x: one GEMM of the gradients side by side
        assert (got is None) == (want is None)  # an unused output's weight gets no gradient
        if want is not None:
            assert got.shape == want.shape
            _close(got, want)


def test_linear_group_second_derivatives_match_torch():
    gen = torch.Generator().manual_seed(9)
    x, w1, w2, b2 = _leaves(gen, torch.float64, (N, 16), (32, 16), (48, 16), (48,))
    results = []
    for fn in (_grouped, _separate):
        a, b = fn(x, w1, None, w2, b2)
        loss = (torch.tanh(a) ** 2).sum() + (b ** 3).sum()
        gx, gw1, gw2 = torch.autograd.grad(loss, (x, w1, w2), create_graph=True)
        results.append(torch.autograd.grad((gx ** 2).sum() + gw1.sum() + (gw2 ** 2).sum(),
                                           (x, w1, w2, b2)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("out_features", [64, 4])
@pytest.mark.parametrize("kernel", [False, True])
def test_linear_group_of_a_dropout_makes_it_again_once(out_features, kernel, monkeypatch):
    _dropout, x, w, b = _dropped(torch.float32, rows=(N + 37) * 64 // out_features)
    w1 = w[:out_features].detach().requires_grad_()
    w2 = (w[:out_features] * 2).detach().requires_grad_()
    b2 = b[:out_features].detach().requires_grad_()
    monkeypatch.setattr(_dropout, "CHUNK_BYTES", x.shape[0] // 5 * 48 * x.element_size())
    made, fused = _spy_remade(_dropout, monkeypatch, kernel)
    h = _dropout.dropout(x, 0.5, 1234)
    ref = h.detach().clone()
    outs, grads = _group_grads(_grouped, [h, w1, None, w2, b2], (0, 1))
    # one pass over the dropout made again, for both weight gradients
    assert (made, fused) == (([], [1]) if kernel and out_features >= 16 else ([1], []))
    want_outs, want_grads = _group_grads(_separate, [ref, w1, None, w2, b2], (0, 1))
    assert all(torch.equal(o, r) for o, r in zip(outs, want_outs))
    for got, want in zip(grads, want_grads):
        _close(got, want)


def test_linear_group_calls_hooked_modules_and_checks_its_operands():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(N, 32, generator=gen)
    a, b = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64, bias=False)
    seen = []
    b.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    before = _requests()
    outs = _dense.linear_group(x, a, b)
    assert seen == [(N, 64)] and _requests() == before  # each Linear on its own, hooks ran
    assert torch.equal(outs[0], a(x)) and torch.equal(outs[1], x @ b.weight.t())
    both = _dense.linear_group(x, (a.weight, a.bias), (b.weight, None))  # pairs: no hooks
    assert torch.equal(both[0], outs[0]) and torch.equal(both[1], outs[1])
    assert _requests() > before
    with pytest.raises(TypeError, match=r"Linear 1 must be a torch.nn.Linear or a \(weight, bias\) pair"):
        _dense.linear_group(x, a, b.weight)
    with pytest.raises(ValueError, match="at least one Linear"):
        _dense.linear_group(x)


# -- ReLU then Linear, a block of rows at a time ----------------------------------------------------

def _relu_then_linear(z, w, b=None):
    return F.linear(torch.relu(z), w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", [[(N + 37, 64), (64, 64), (64,)],  # rows not a block multiple
                                    [(N, 64), (16, 64)],  # no bias, narrow output (g^T a)
                                    [(N, 8), (64, 8), (64,)]])  # widening
def test_relu_linear_equals_relu_then_linear(dtype, shapes, monkeypatch):
    """Forward and the gradients of z, weight and bias up to rounding, over several blocks of
    rows (the last one short); z's zeros and negatives pass no gradient, as the ReLU's."""
    monkeypatch.setattr(_dense, "RELU_LINEAR_BYTES", 1000 * shapes[0][1] * (dtype.itemsize))
    gen = torch.Generator().manual_seed(4)
    leaves = _leaves(gen, dtype, *shapes)
    with torch.no_grad():
        leaves[0][::7] = 0.0
    before = _requests()
    got = _grads(_dense.relu_linear, leaves)
    assert _requests() > before  # the blocked path ran (it takes its blocks from the cache)
    want = _grads(_relu_then_linear, leaves)
    _close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        _close(a, b)


def test_relu_linear_only_the_gradients_asked_for():
    gen = torch.Generator().manual_seed(5)
    z, w, b = _leaves(gen, torch.float32, (N, 64), (32, 64), (32,))
    for needs in ((True, False, False), (False, True, False), (False, False, True)):
        for t, need in zip((z, w, b), needs):
            t.requires_grad_(need)
        out = _dense.relu_linear(z, w, b)
        (grad,) = torch.autograd.grad(out.sum(), [t for t, need in zip((z, w, b), needs)
                                                  if need])
        want_out = _relu_then_linear(z, w, b)
        (want,) = torch.autograd.grad(want_out.sum(), [t for t, need in zip((z, w, b), needs)
                                                       if need])
        _close(grad, want)


def test_relu_linear_second_derivatives_match_torch():
    gen = torch.Generator().manual_seed(6)
    z, w, b = _leaves(gen, torch.float64, (N, 16), (24, 16), (24,))
    results = []
    for fn in (_dense.relu_linear, _relu_then_linear):
        out = fn(z, w, b)
        gz, gw = torch.autograd.grad((torch.tanh(out) ** 2).sum(), (z, w), create_graph=True)
        results.append(torch.autograd.grad((gz ** 2).sum() + (gw ** 2).sum(), (z, w, b)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_relu_linear_falls_back_where_blocks_do_not_apply():
    """Small results, another dtype, a 3-D z: torch's ReLU and Linear."""
    gen = torch.Generator().manual_seed(7)
    for shapes, dtype in (([(8, 4), (3, 4), (3,)], torch.float32),
                          ([(N, 64), (64, 64), (64,)], torch.bfloat16),
                          ([(2, N, 32), (64, 32), (64,)], torch.float32)):
        leaves = [t.to(dtype).detach().requires_grad_() for t in _leaves(gen, torch.float32,
                                                                         *shapes)]
        got, want = _grads(_dense.relu_linear, leaves), _grads(_relu_then_linear, leaves)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b)


# -- a Linear on relu_dropout's output takes its backward ------------------------------------------
def _relu_dropped(dtype, rows=N + 37, width=64, seed=21):
    """``(_dropout, z)``: z [rows, width] with zeros (which pass no gradient) and negatives."""
    from kernels import _dropout
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, width, dtype=dtype, generator=gen)
    z[::7] = 0.0
    return _dropout, z.requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_features,bias", [(64, True), (16, False), (4, True)])
def test_linear_of_a_fusable_relu_dropout_takes_its_backward(dtype, out_features, bias,
                                                             monkeypatch):
    """``linear(relu_dropout(z, fusable=True), w, b)``: the Linear's autograd input is z itself
    (relu_dropout's backward does not run), its backward makes ``g W`` and the mask a block of
    rows at a time (several here, the last one short); value and the gradients of z, w and b
    equal the separate ops' (relu_dropout's own backward, then torch's Linear on its output),
    z's to the bit; the offer is consumed (z no longer held by the output)."""
    _dropout, z = _relu_dropped(dtype, rows=(N + 37) * 64 // out_features)  # results >= 1 MiB
    monkeypatch.setattr(_dense, "RELU_LINEAR_BYTES", 1000 * 64 * dtype.itemsize)
    gen = torch.Generator().manual_seed(22)
    w, b = _leaves(gen, dtype, (out_features, 64), (out_features,))
    wb = [w, b] if bias else [w]
    h = _dropout.relu_dropout(z, 0.4, 77, fusable=True)
    assert _dropout.relu_dropout_of(h)[0] is z
    out = _dense.linear(h, *wb)
    assert _dropout.relu_dropout_of(h) is None  # taken: h no longer holds z
    assert out.grad_fn.next_functions[0][0].variable is z  # z's accumulator, not relu_dropout's
    g = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(23))
    got = torch.autograd.grad(out, [z, *wb], g)
    h2 = _dropout.relu_dropout(z, 0.4, 77)  # the same mask, not offered
    assert _dropout.relu_dropout_of(h2) is None
    want_out = F.linear(h2, *wb)
    want = torch.autograd.grad(want_out, [z, *wb], g)
    assert torch.equal(out.detach(), want_out.detach())
    assert torch.equal(got[0], want[0])
    assert float(got[0].abs().sum()) > 0 and torch.equal(got[0][::7], torch.zeros_like(got[0][::7]))
    for a, c in zip(got[1:], want[1:]):
        _close(a, c)


@pytest.mark.parametrize("out_features,bias,linears,used", [
    (64, True, 1, (0,)), (16, False, 1, (0,)), (16, True, 2, (0, 1)), (16, True, 2, (1,))])
def test_relu_dropout_linear_backward_in_one_pass(out_features, bias, linears, used,
                                                  monkeypatch):
    """Where ``kernels._gemm`` takes the rows (its row floor lowered here), z's gradient and the
    weight and bias gradients of the Linears on ``relu_dropout(z)`` come from one pass
    (``_gemm.mlp_backward``), equal to the separate ops' (z's to the bit for one Linear; for two
    side by side, and the parameters' gradients, up to rounding), with an output left unused,
    a bias or none."""
    from kernels import _gemm
    _dropout, z = _relu_dropped(torch.float32, rows=3 * _gemm.ROWS + 17)
    monkeypatch.setattr(_dense, "usable", lambda *a: True)
    monkeypatch.setattr(_gemm, "MIN_ROWS", 64)
    calls = []
    real = _gemm.mlp_backward
    monkeypatch.setattr(_gemm, "mlp_backward", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(28)
    w0, b0, w1, b1 = _leaves(gen, torch.float32, (out_features, 64), (out_features,),
                             (16, 64), (16,))
    pairs = [(w0, b0 if bias else None), (w1, b1)][:linears]
    gens = [torch.randn(z.shape[0], w.shape[0], generator=gen) for w, _ in pairs]
    results = []
    for fusable in (True, False):
        h = _dropout.relu_dropout(z, 0.4, 77, fusable=fusable)
        outs = (_dense.linear_group(h, *pairs) if fusable
                else [F.linear(h, w, b) for w, b in pairs])
        leaves = [z] + [t for i in used for t in pairs[i] if t is not None]
        results.append(torch.autograd.grad([outs[i] for i in used], leaves,
                                           [gens[i] for i in used]))
    assert calls == [1]
    got, want = results
    if linears == 1:  # the same tiles as the separate input-gradient product
        assert torch.equal(got[0], want[0])
    else:  # one product over both gradients side by side against two summed
        _close(got[0], want[0])
    assert float(got[0].abs().sum()) > 0 and len(got) == len(want) > 1
    for a, c in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5 * float(c.abs().max()))


def test_fused_relu_dropout_linear_with_other_consumers_and_changes():
    """The output read by a Linear and by another op: z's gradient is the sum of both paths
    (relu_dropout's backward runs for the other one). An output changed in place before the
    Linear, or an input with NaNs, is not offered, and the Linear keeps its usual backward."""
    _dropout, z = _relu_dropped(torch.float32)
    gen = torch.Generator().manual_seed(24)
    w, b = _leaves(gen, torch.float32, (64, 64), (64,))

    def both(h):
        return (_dense.linear(h, w, b).square().sum() + (h * torch.arange(64.0)).sum())
    got = torch.autograd.grad(both(_dropout.relu_dropout(z, 0.5, 5, fusable=True)), (z, w, b))
    want = torch.autograd.grad(both(_dropout.relu_dropout(z, 0.5, 5)), (z, w, b))
    for a, c in zip(got, want):
        _close(a, c)
    h = _dropout.relu_dropout(z, 0.5, 5, fusable=True)
    with torch.no_grad():
        h[0] += 1
    assert _dropout.relu_dropout_of(h) is None
    with torch.no_grad():
        zn = z.detach().clone()
        zn[3, 3] = float("nan")
    assert _dropout.relu_dropout_of(_dropout.relu_dropout(zn.requires_grad_(), 0.5, 5,
                                                          fusable=True)) is None


def test_fused_relu_dropout_linear_second_derivatives():
    """create_graph: the fused backward through torch's differentiable ops, against torch's
    ReLU, the same mask as a constant, and Linear."""
    _dropout, z = _relu_dropped(torch.float64, rows=N)
    gen = torch.Generator().manual_seed(25)
    w, b = _leaves(gen, torch.float64, (32, 64), (32,))
    mask = _dropout.dropout(torch.ones(z.shape, dtype=torch.float64), 0.5, 9)  # 0 or 2
    results = []
    for fused in (True, False):
        h = _dropout.relu_dropout(z, 0.5, 9, fusable=True) if fused else torch.relu(z) * mask
        out = _dense.linear(h, w, b) if fused else F.linear(h, w, b)
        gz, gw = torch.autograd.grad((torch.tanh(out) ** 2).sum(), (z, w), create_graph=True)
        results.append(torch.autograd.grad((gz ** 2).sum() + (gw ** 2).sum(), (w, b)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("used", [(0, 1), (1,)])
def test_linear_group_of_a_fusable_relu_dropout_takes_its_backward(used, monkeypatch):
    """``linear_group(relu_dropout(z, fusable=True), ...)`` (GraphSAGE's two Linears on layer 2's
    input): one Function differentiable in z; the outputs and the gradients of z and every
    parameter of the Linears used equal the separate ops on relu_dropout's output (z's up to
    the rounding of the stacked GEMM), with an output left unused. Linears wider than
    RELU_LINEAR_MAX_WIDTH in all decline the offer (and end it: z is not held on)."""
    _dropout, z = _relu_dropped(torch.float32, rows=2 * (N + 37))  # results >= 1 MiB
    monkeypatch.setattr(_dense, "RELU_LINEAR_BYTES", 1000 * 64 * 4)
    gen = torch.Generator().manual_seed(27)
    w0, b0, w1 = _leaves(gen, torch.float32, (32, 64), (32,), (16, 64))
    wide = _leaves(gen, torch.float32, (64, 64))[0]
    h = _dropout.relu_dropout(z, 0.5, 31, fusable=True)
    declined = _dense.linear_group(h, (w0, b0), (wide, None))  # 96 wide: declined, offer ended
    assert _dropout.relu_dropout_of(h) is None
    assert declined[1].grad_fn.next_functions[0][0] is h.grad_fn  # through relu_dropout's node
    h = _dropout.relu_dropout(z, 0.5, 31, fusable=True)
    outs = _dense.linear_group(h, (w0, b0), (w1, None))
    assert _dropout.relu_dropout_of(h) is None and len(outs) == 2
    h2 = _dropout.relu_dropout(z, 0.5, 31)
    refs = (F.linear(h2, w0, b0), F.linear(h2, w1))
    for o, r in zip(outs, refs):
        assert torch.equal(o.detach(), r.detach())
    leaves = [z, w0, b0, w1] if 0 in used else [z, w1]
    gens = [torch.randn(refs[i].shape, generator=torch.Generator().manual_seed(40 + i))
            for i in used]
    got = torch.autograd.grad([outs[i] for i in used], leaves, gens)
    want = torch.autograd.grad([refs[i] for i in used], leaves, gens)
    for a, c in zip(got, want):
        _close(a, c)


def test_gcn_layer_two_takes_the_relu_dropout_backward(monkeypatch):
    """A 2-layer GCN (ngra.nn.GNN): layer 2's Linear takes relu_dropout's backward; output and
    parameter gradients equal those with the offer declined (same seeds)."""
    import ngra
    from kernels_testutil import offered_and_declined
    from ngra.nn import build_model
    n = 4096
    gen = torch.Generator().manual_seed(26)
    g = ngra.Graph(torch.randint(0, n, (8 * n,), generator=gen),
                   torch.randint(0, n, (8 * n,), generator=gen), n).remove_self_loops()
    x = torch.randn(n, 32, generator=gen)
    torch.manual_seed(0)
    model = build_model("gcn", 32, 64, 64)  # layer 2's result [4096, 64]: 1 MiB, cached
    calls = []
    real = _dense._ReluDropoutLinear.apply
    monkeypatch.setattr(_dense._ReluDropoutLinear, "apply",
                        lambda *a: calls.append(1) or real(*a))
    (out, grads), (out2, grads2) = offered_and_declined(monkeypatch, model, g, x)
    assert calls == [1]
    assert torch.equal(out, out2)
    for a, c in zip(grads, grads2):
        _close(a, c)


def _linear_relu_linear(x, w1, b1, w2, b2=None):
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", [[(N + 37, 32), (64, 32), (64,), (48, 64), (48,)],
                                    [(N, 64), (64, 64), (64,), (16, 64)],  # narrow output
                                    [(N, 8), (64, 8), (64,), (64, 64), (64,)]])  # narrow input
def test_linear_relu_linear_equals_the_three_ops(dtype, shapes, monkeypatch):
    """An MLP Linear -> ReLU -> Linear over several blocks of rows (the last one short): its
    value and the gradients of x and all four parameters, up to rounding."""
    monkeypatch.setattr(_dense, "RELU_LINEAR_BYTES", 1000 * shapes[1][0] * dtype.itemsize)
    gen = torch.Generator().manual_seed(8)
    leaves = _leaves(gen, dtype, *shapes)
    if len(leaves) == 4:
        leaves.append(None)
    calls = []
    apply = _dense._BlockedMlp.apply
    monkeypatch.setattr(_dense._BlockedMlp, "apply", lambda *a: calls.append(1) or apply(*a))
    got = _grads(_dense.linear_relu_linear, leaves)
    assert calls == [1]
    want = _grads(_linear_relu_linear, leaves)
    _close(got[0], want[0])
    assert len(got[1]) == len(want[1]) == len(shapes)
    for a, b in zip(got[1], want[1]):
        _close(a, b)


def test_linear_relu_linear_only_the_gradients_asked_for():
    gen = torch.Generator().manual_seed(9)
    leaves = _leaves(gen, torch.float32, (N, 16), (64, 16), (64,), (32, 64), (32,))
    for k in range(len(leaves)):
        for j, t in enumerate(leaves):
            t.requires_grad_(j == k)
        (got,) = torch.autograd.grad(_dense.linear_relu_linear(*leaves).sum(), [leaves[k]])
        (want,) = torch.autograd.grad(_linear_relu_linear(*leaves).sum(), [leaves[k]])
        _close(got, want)


def test_linear_relu_linear_second_derivatives_match_torch():
    gen = torch.Generator().manual_seed(10)
    x, w1, b1, w2, b2 = _leaves(gen, torch.float64, (N, 8), (16, 8), (16,), (24, 16), (24,))
    results = []
    for fn in (_dense.linear_relu_linear, _linear_relu_linear):
        out = fn(x, w1, b1, w2, b2)
        gx, gw1, gw2 = torch.autograd.grad((torch.tanh(out) ** 2).sum(), (x, w1, w2),
                                           create_graph=True)
        results.append(torch.autograd.grad((gx ** 2).sum() + (gw1 ** 2).sum() + gw2.sum(),
                                           (x, w1, b1, w2)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_linear_relu_linear_falls_back_where_blocks_do_not_apply():
    gen = torch.Generator().manual_seed(11)
    for shapes in ([(8, 4), (3, 4), (3,), (2, 3), (2,)],  # small
                   [(N, 4), (6, 4), (6,), (2, 5), (2,)]):  # widths that do not chain
        leaves = _leaves(gen, torch.float32, *shapes)
        if shapes[3][1] != shapes[1][0]:
            with pytest.raises(RuntimeError):
                _dense.linear_relu_linear(*leaves)
            continue
        got, want = _grads(_dense.linear_relu_linear, leaves), _grads(_linear_relu_linear, leaves)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b)
