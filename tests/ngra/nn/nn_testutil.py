"""Helpers for the ngra.nn tests: edge-case graphs, weight copying, parity checks.

Imported as ``from nn_testutil import ...`` (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import torch

import ngra

# name -> (src, dst, num_nodes)
EDGE_CASES = {
    "empty": ([], [], 4),
    "isolated": ([0, 1, 2], [1, 2, 0], 5),  # vertices 3 and 4 have no edges at all
    "self_loops": ([0, 1, 1, 2, 2, 3], [0, 1, 2, 2, 0, 1], 4),  # 3 has no loop
    "double_loop": ([0, 0, 1, 1], [0, 0, 0, 1], 3),  # two parallel loops at 0; 2 is isolated
    "multi_edges": ([0, 0, 0, 1, 2, 2], [1, 1, 1, 0, 1, 1], 3),
    "star_in": ([1, 2, 3, 4, 5], [0, 0, 0, 0, 0], 6),
    "star_out": ([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 6),
}
GRAPHS = [*EDGE_CASES, "random"]
# (graph, dtype) pairs for parity tests: every graph in float32, the two richest in float64 too.
PARITY_CASES = [(g, torch.float32) for g in GRAPHS] + \
    [(g, torch.float64) for g in ("self_loops", "random")]
# Fewer cases for a layer's secondary variants (options), to keep the suite fast.
SECONDARY_CASES = [("self_loops", torch.float32), ("multi_edges", torch.float32),
                   ("random", torch.float64)]
# Graphs for the fused-vs-unfused checks.
FUSE_GRAPHS = ["empty", "isolated", "self_loops", "multi_edges", "random"]


def variant_cases(variants):
    """``(variant, graph, dtype)``: the first variant on every parity case, the others on
    :data:`SECONDARY_CASES`."""
    first, *rest = variants
    return [(first, g, d) for g, d in PARITY_CASES] + \
        [(v, g, d) for v in rest for g, d in SECONDARY_CASES]


def make_graph(name: str, seed: int = 0) -> ngra.Graph:
    if name == "random":
        gen = torch.Generator().manual_seed(seed)
        n, e = 17, 60
        return ngra.Graph(torch.randint(0, n, (e,), generator=gen),
                          torch.randint(0, n, (e,), generator=gen), n)
    src, dst, n = EDGE_CASES[name]
    return ngra.Graph(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), n)


def copy_weights(ours: torch.nn.Module, theirs: torch.nn.Module, mapping: dict) -> None:
    """Copy ``theirs``' tensors into ``ours``: ``mapping`` is our name -> their name (dotted).
    Every parameter of ours must be mapped, so no weight escapes the comparison."""
    names = {n for n, _ in ours.named_parameters()}
    missing = names - set(mapping)
    if missing:
        raise AssertionError(f"parameters without a PyG counterpart in the mapping: {sorted(missing)}")
    for ours_name, theirs_name in mapping.items():
        dst = ours.get_parameter(ours_name) if ours_name in names else ours.get_buffer(ours_name)
        src = _get(theirs, theirs_name)
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))


def _get(module, name):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def tolerances(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def assert_parity(ours, theirs, run_ours, run_theirs, inputs: dict, mapping: dict, dtype,
                  seed: int = 0):
    """Same outputs and gradients (w.r.t. every input in ``inputs`` and every mapped weight).

    ``run_ours(**inputs)`` / ``run_theirs(**inputs)`` get fresh leaf copies of ``inputs``; the
    loss is ``(out * probe).sum()`` with a fixed random ``probe``. ``mapping`` is our parameter
    name -> their parameter name (as for :func:`copy_weights`).
    """
    tol = tolerances(dtype)
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    a_in = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    b_in = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    out_a = run_ours(**a_in)
    their_tensors = {ours_name: _get(theirs, theirs_name) for ours_name, theirs_name in mapping.items()}
    out_b = run_theirs(**b_in)
    torch.testing.assert_close(out_a, out_b, **tol, msg=lambda m: f"forward differs:\n{m}")
    probe = torch.randn(out_a.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    (out_a * probe).sum().backward()
    (out_b * probe).sum().backward()
    for k in inputs:
        if a_in[k].is_floating_point():
            ga, gb = a_in[k].grad, b_in[k].grad
            ga = torch.zeros_like(a_in[k]) if ga is None else ga
            gb = torch.zeros_like(b_in[k]) if gb is None else gb
            torch.testing.assert_close(ga, gb, **tol, msg=lambda m, k=k: f"grad of input {k!r}:\n{m}")
    for name, p in ours.named_parameters():
        q = their_tensors.get(name)
        if q is None:
            continue
        ga = torch.zeros_like(p) if p.grad is None else p.grad
        gb = torch.zeros_like(q) if q.grad is None else q.grad
        torch.testing.assert_close(ga, gb.reshape(ga.shape), **tol,
                                   msg=lambda m, name=name: f"grad of weight {name!r}:\n{m}")
    return out_a


def assert_fused_matches_unfused(layer, g, vdata, edata, dtype=torch.float32, seed=0):
    """The optimized and the raw IR give the same outputs and gradients (the RNG is reseeded
    before each run, so random ops such as dropout draw the same numbers)."""
    prog = ngra.compile(layer, g, vdata, edata)
    assert not prog.eager, prog.reason
    tol = tolerances(dtype)
    results = []
    for fused in (True, False):
        vd = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in vdata.items()}
        ed = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in edata.items()}
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        out = prog.run(g, vd, ed, fused=fused)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * probe).sum().backward()
        grads = {f"v.{k}": t.grad for k, t in vd.items() if t.requires_grad}
        grads.update({f"e.{k}": t.grad for k, t in ed.items() if t.requires_grad})
        grads.update({n: p.grad for n, p in layer.named_parameters()})
        results.append((out.detach(), grads))
    (out_f, grads_f), (out_u, grads_u) = results
    torch.testing.assert_close(out_f, out_u, **tol)
    for k in grads_f:
        gf, gu = grads_f[k], grads_u[k]
        if gf is None and gu is None:
            continue
        gf = torch.zeros_like(gu) if gf is None else gf
        gu = torch.zeros_like(gf) if gu is None else gu
        torch.testing.assert_close(gf, gu, **tol, msg=lambda m, k=k: f"grad of {k}:\n{m}")
    return prog
