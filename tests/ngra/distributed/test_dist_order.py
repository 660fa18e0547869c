"""The order of a streamed call on a worker's piece (``Engine(column_order=...)``): the halo
exchange started without waiting, the columns in a searched order, each waiting only for the
peers it reads. On 2 and 3 real gloo workers, every order gives the same outputs, loss and
gradients bit for bit as the fixed order (one blocking exchange, columns 0..P-1), and those
equal the single-process run (float32, 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

import distutil
from test_dist_graph import _step as _loss_step

N, F_IN, HIDDEN, CLASSES = 72, 5, 6, 3
ORDERS = ("fixed", "overlap", "searched")
MODELS = ("gcn", "gat", "ggcn", "sage")


def _problem():
    """A graph with locality (most edges join nearby ids, some jump far), so that with a
    contiguous partition some columns of a piece read only its own rows and others read a
    peer's: the searched order differs from 0..P-1."""
    import ngra

    gen = torch.Generator().manual_seed(0)
    dst = torch.randint(0, N, (300,), generator=gen)
    src = (dst + torch.randint(-3, 4, (300,), generator=gen)).clamp(0, N - 1)
    far = torch.randint(0, N, (4,), generator=gen)
    src = torch.cat([src, far])
    dst = torch.cat([dst, torch.randint(0, N, (4,), generator=gen)])
    g = ngra.Graph(src, dst, N)
    x = torch.randn(N, F_IN, generator=gen)
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    train = torch.rand(N, generator=gen) < 0.6
    w = torch.rand(g.num_edges, generator=gen) + 0.5
    return g, x, y, train, w


def _model(name):
    from ngra.nn.models import build_model

    torch.manual_seed(1)
    return build_model(name, F_IN, HIDDEN, CLASSES, dropout=0.0, heads=2)


def _step(model, name, g, x, y, train, w, n_train):
    return _loss_step(model, g, x, y, train, {"edge_weight": w} if name == "gcn" else {},
                      n_train)


def _reference(name):
    g, x, y, train, w = _problem()
    model = _model(name)
    out, loss = _step(model, name, g, x, y, train, w, int(train.sum()))
    return out.detach(), float(loss.detach()), {k: p.grad.clone()
                                                for k, p in model.named_parameters()}


def _order_worker(rank, world, shared_memory, num_chunks, method):
    import torch.distributed as dist

    import ngra
    from ngra.distributed import DistGraph, Transport, partition, sync_gradients

    g, x, y, train, w = _problem()
    t = Transport(timeout=60, shared_memory=shared_memory)
    parts = partition(g, world, method=method) if isinstance(method, str) else method
    dg = DistGraph.from_global(g, parts, t)
    ids = dg.global_ids
    results = {}
    for name in MODELS:
        for order in ORDERS:
            model = _model(name)
            with ngra.Engine(num_chunks=num_chunks, column_order=order) as eng:
                out, loss = _step(model, name, dg, x[ids], y[ids], train[ids], w[dg.edge_ids],
                                  int(train.sum()))
            run = eng.last_run
            sync_gradients(model)
            total = loss.detach().clone()
            dist.all_reduce(total)
            results[(name, order)] = (out.detach(), float(total),
                                      {k: p.grad.clone() for k, p in model.named_parameters()},
                                      run.get("column_order"), run.get("order"))
    return ids, results


def _halves():
    """Worker 0: vertices 0..35, worker 1: 36..71, worker 2: nothing at all."""
    parts = torch.zeros(N, dtype=torch.long)
    parts[36:] = 1
    return parts


@pytest.mark.slow
@pytest.mark.parametrize("world,shared_memory,num_chunks,method", [
    (2, False, 4, "contiguous"), (3, False, 3, "contiguous"), (3, None, 4, "random"),
    (3, False, 3, _halves())], ids=["2-gloo", "3-gloo", "3-shm-random", "3-gloo-empty-worker"])
def test_every_column_order_gives_the_fixed_order_bit_for_bit(world, shared_memory, num_chunks,
                                                               method):
    results = distutil.run(_order_worker, world, shared_memory, num_chunks, method, timeout=300)
    reordered = 0
    for name in MODELS:
        want_out, want_loss, want_grads = _reference(name)
        for rank, (ids, res) in enumerate(results):
            fixed = res[(name, "fixed")]
            assert fixed[3] == "fixed" and fixed[4] == list(range(num_chunks)), fixed[3:]
            for order in ORDERS[1:]:
                got = res[(name, order)]
                assert got[3] == order, (name, order, got[3])
                assert sorted(got[4]) == list(range(num_chunks)), got[4]
                reordered += got[4] != list(range(num_chunks))
                assert torch.equal(got[0], fixed[0]), (name, order, rank, "outputs")
                assert got[1] == fixed[1], (name, order, rank, "loss")
                for k in fixed[2]:
                    assert torch.equal(got[2][k], fixed[2][k]), (name, order, rank, k)
            # ... and the fixed order equals one process.
            torch.testing.assert_close(fixed[0], want_out[ids], rtol=1e-5, atol=1e-6)
            assert fixed[1] == pytest.approx(want_loss, rel=1e-5)
            for k, gw in want_grads.items():
                torch.testing.assert_close(fixed[2][k], gw, rtol=1e-5, atol=1e-6)
    if isinstance(method, str) and method == "contiguous":
        assert reordered > 0  # the search did move columns: the equality is not vacuous
    if not isinstance(method, str):
        assert results[2][0].numel() == 0  # the worker without vertices took part


# -- the asynchronous pull under it ---------------------------------------------------------------
def _value(rank: int, rows: int) -> torch.Tensor:
    return (rank * 1000 + torch.arange(rows).unsqueeze(1) * 10 + torch.arange(3)).float()


def _need(rank: int, world: int) -> dict:
    """Seeded: a few rows (duplicates included) of every peer but one, and of itself."""
    gen = torch.Generator().manual_seed(rank)
    return {p: torch.randint(0, 6, (int(torch.randint(1, 5, (1,), generator=gen)),),
                             generator=gen)
            for p in range(world) if world < 3 or p != (rank + 1) % world}


def _async_worker(rank, world, shared_memory):
    from ngra.distributed import Transport, TransportError

    t = Transport(timeout=30, shared_memory=shared_memory)
    region = t.register("x", _value(rank, 6))
    plan = t.plan(region, _need(rank, world))
    want = plan.pull().clone()
    # Two pulls of one plan in flight at once (different values, own receive buffers), posted
    # in reverse rank order, waited for peer by peer.
    out1 = torch.empty_like(want)
    first = plan.pull_async(out1, peers=list(reversed(range(world))))
    region.set(_value(rank, 6) + 0.5)
    out2 = torch.empty_like(want)
    second = plan.pull_async(out2)
    for p in range(world):
        first.wait(p)
        assert first.arrived(p)
    first.finish()
    second.finish()
    errors = []
    try:
        plan.pull_async(torch.empty(1, 3))
    except TransportError as e:
        errors.append(str(e))
    try:
        plan.pull_async(peers=[0, 0])
    except TransportError as e:
        errors.append(str(e))
    return want, out1.clone(), out2.clone(), first.done and second.done, errors


@pytest.mark.parametrize("world,shared_memory", [(2, False), (3, False), (3, True)])
def test_pull_async_brings_the_rows_of_a_synchronous_pull(world, shared_memory):
    for rank, (want, out1, out2, done, errors) in enumerate(
            distutil.run(_async_worker, world, shared_memory, timeout=120)):
        torch.testing.assert_close(out1, want, rtol=0, atol=0)
        torch.testing.assert_close(out2, want + 0.5, rtol=0, atol=0)
        assert done
        assert "out must have shape" in errors[0] and "got (1, 3)" in errors[0], errors[0]
        assert "peers must be distinct ranks" in errors[1], errors[1]


def _hung_peer_worker(rank, world):
    from ngra.distributed import Transport, TransportError

    t = Transport(timeout=2, shared_memory=False)
    region = t.register("h", _value(rank, 4))
    plan = t.plan(region, {1 - rank: torch.tensor([0, 1])})
    plan.pull()
    if rank == 1:
        import time

        time.sleep(6)  # hung: never joins the next exchange
        return "slept"
    pending = plan.pull_async()
    try:
        pending.wait(1)
    except TransportError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_waiting_for_a_hung_peer_is_an_error_naming_it():
    text = distutil.run(_hung_peer_worker, 2, timeout=120, may_die=(1,))[0]
    assert "receiving the rows of peer 1 (region 'h')" in text, text
    assert "timeout of 2 s" in text, text


def _param_edge_worker(rank, world):
    """A layer whose edge part reads a parameter directly (a Linear on edge features, which
    cannot be lifted to the vertices): its gradient would be summed in run order, so the engine
    runs it in the fixed order whatever it is asked, and says why."""
    import ngra
    from ngra.distributed import DistGraph, Transport, partition, sync_gradients

    class EdgeGated(ngra.VertexProgram):
        def __init__(self):
            super().__init__("sum")
            self.gate = torch.nn.Linear(1, F_IN)

        def apply_edge(self, e):
            return torch.sigmoid(self.gate(e.data["w"])) * e.src["h"]

    g, x, _, _, w = _problem()
    dg = DistGraph.from_global(g, partition(g, world, method="contiguous"),
                               Transport(timeout=60, shared_memory=False))
    out = {}
    for order in ("fixed", "searched"):
        torch.manual_seed(3)
        layer = EdgeGated()
        with ngra.Engine(num_chunks=3, column_order=order) as eng:
            y = layer(dg, x[dg.global_ids], {"w": w[dg.edge_ids].unsqueeze(1)})
        y.square().sum().backward()
        sync_gradients(layer)
        out[order] = (y.detach(), layer.gate.weight.grad.clone(), eng.last_run["column_order"],
                      eng.last_run.get("column_order_reason"))
    return out


def test_an_edge_part_that_reads_a_parameter_runs_in_the_fixed_order():
    for out in distutil.run(_param_edge_worker, 2, timeout=300):
        y, grad, ran, why = out["searched"]
        assert ran == "fixed" and "reads parameters directly" in why, (ran, why)
        assert torch.equal(y, out["fixed"][0]) and torch.equal(grad, out["fixed"][1])
