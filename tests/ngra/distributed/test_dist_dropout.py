"""Dropout does not depend on the partition: with the same seed, K workers drop exactly the
elements one process drops (vertex features by global row, GAT's attention by global edge id,
self loops included), so every zoo model trained with dropout on has the single-process outputs,
loss and gradients, in memory and streamed, with the halo and the ring exchange."""

from __future__ import annotations

import contextlib

import pytest
import torch

import distutil
from test_dist_graph import CLASSES, F_IN, HIDDEN, MODELS, RELATIONS, _check, _kwargs, _problem

P_DROP = 0.4


def _model(name):
    from ngra.nn.models import build_model

    torch.manual_seed(1)
    return build_model(name, F_IN, HIDDEN, CLASSES, dropout=P_DROP, heads=2,
                       num_relations=RELATIONS if name == "rgcn" else None)


def _step(model, g, x, y, train, kwargs, n_train, engine=None):
    import ngra

    torch.manual_seed(7)  # the dropout draws: the same on every worker and in the reference
    with ngra.Engine(**engine) if engine else contextlib.nullcontext():
        out = model(g, x, **kwargs)
    loss = torch.nn.functional.cross_entropy(out[train], y[train], reduction="sum") / n_train
    loss.backward()
    return out.detach(), loss.detach()


def _worker(rank, world, exchange, engine):
    import torch.distributed as dist

    from ngra.distributed import DistGraph, Transport, partition, sync_gradients

    g, x, y, train, extra = _problem()
    dg = DistGraph.from_global(g, partition(g, world, method="random"), Transport(timeout=60),
                               exchange=exchange)
    ids = dg.global_ids
    results = {}
    for name in MODELS:
        model = _model(name)
        out, loss = _step(model, dg, x[ids], y[ids], train[ids], _kwargs(name, extra, dg.edge_ids),
                          int(train.sum()), engine)
        sync_gradients(model)
        dist.all_reduce(loss)
        results[name] = (out, float(loss), {k: p.grad.clone() for k, p in model.named_parameters()})
    return ids, results


@pytest.mark.slow
@pytest.mark.parametrize("world,exchange,engine", [
    (2, "halo", None), (3, "ring", None), (3, "halo", {"num_chunks": 2})])
def test_dropout_masks_do_not_depend_on_the_partition(world, exchange, engine):
    g, x, y, train, extra = _problem()
    want = {}
    for name in MODELS:
        model = _model(name)
        out, loss = _step(model, g, x, y, train, _kwargs(name, extra), int(train.sum()))
        want[name] = (out, float(loss), {k: p.grad.clone() for k, p in model.named_parameters()})
    # Dropout really is on: another seed gives another loss for every model.
    for name in MODELS:
        model = _model(name)
        torch.manual_seed(8)
        other = model(g, x, **_kwargs(name, extra))
        assert not torch.allclose(other, want[name][0]), name
    out = distutil.run(_worker, world, exchange, engine, timeout=300)
    _check([(ids, None, results) for ids, results in out], reference=want.get)
