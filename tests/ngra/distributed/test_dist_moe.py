"""Expert parallelism on 1-4 real gloo workers: every worker's outputs, input gradients, its
experts' gradients and the (summed) gate gradient equal the single-process MoE with the same
weights run on each worker's tokens; uneven loads, an expert that receives no token, capacity
overflow, workers with no tokens; E not divisible by the number of workers (refused)."""

import distutil
import pytest
import torch

from ngra.nn import MoE
from ngra.nn.moe import TopKGate

D, H = 5, 7


def _layer(num_experts, gate, cf):
    torch.manual_seed(0)
    g = TopKGate(D, num_experts, k=1 if gate == "switch" else 2, capacity_factor=cf)
    moe = MoE(D, num_experts, hidden=H, gate=g).double()
    with torch.no_grad():
        # Tokens are positive (rand), so a negative row means no token ever picks the last
        # expert; a boosted row 0 makes expert 0 overloaded.
        moe.gate.wg.weight.copy_(torch.rand(num_experts, D, dtype=torch.float64))
        moe.gate.wg.weight[0] += 0.5
        moe.gate.wg.weight[-1] = -1.0
    return moe


def _data(world, sizes):
    gen = torch.Generator().manual_seed(1)
    xs = [torch.rand(n, D, dtype=torch.float64, generator=gen) for n in sizes[:world]]
    cs = [torch.randn(n, D, dtype=torch.float64, generator=gen) for n in sizes[:world]]
    return xs, cs


def _ep_worker(rank, world, num_experts, gate, cf, sizes):
    from ngra.distributed.moe import ExpertParallelMoE, sync_replicated_gradients

    moe = _layer(num_experts, gate, cf)
    ep = ExpertParallelMoE.from_moe(moe)
    xs, cs = _data(world, sizes)
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    ((y * cs[rank]).sum() + 0.1 * ep.aux_loss).backward()
    sync_replicated_gradients(ep)
    experts = {i: [None if p.grad is None else p.grad for p in e.parameters()]
               for i, e in zip(ep.local_experts, ep.experts)}
    refused = None
    try:  # E not divisible by the number of workers (1 divides everything)
        ExpertParallelMoE(D, 3)
    except ValueError as e:
        refused = str(e)
    return {"y": y.detach(), "dx": x.grad, "gate": ep.gate.wg.weight.grad, "experts": experts,
            "stats": ep.last_stats, "comm": ep.last_comm, "refused": refused}


def _reference(num_experts, gate, cf, world, sizes):
    moe = _layer(num_experts, gate, cf)
    xs, cs = _data(world, sizes)
    ys, dxs, loads, dropped = [], [], 0, 0
    for x, c in zip(xs, cs):
        x = x.clone().requires_grad_(True)
        y = moe(x)
        ((y * c).sum() + 0.1 * moe.aux_loss).backward()
        ys.append(y.detach())
        dxs.append(x.grad)
        loads = loads + moe.last_stats["load"]
        dropped += moe.last_stats["dropped"]
    experts = {i: [None if p.grad is None else p.grad for p in e.parameters()]
               for i, e in enumerate(moe.experts)}
    return ys, dxs, moe.gate.wg.weight.grad, experts, loads, dropped


def _check(world, num_experts, gate, cf, sizes):
    got = distutil.run(_ep_worker, world, num_experts, gate, cf, sizes, timeout=120)
    ys, dxs, dgate, experts, loads, dropped = _reference(num_experts, gate, cf, world, sizes)
    for r, out in enumerate(got):
        torch.testing.assert_close(out["y"], ys[r], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out["dx"], dxs[r], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out["gate"], dgate, rtol=1e-10, atol=1e-12)
        for i, grads in out["experts"].items():
            for a, b in zip(grads, experts[i]):
                assert (a is None) == (b is None), i
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    covered = sorted(i for out in got for i in out["experts"])
    assert covered == list(range(num_experts))
    return got, loads, dropped


@pytest.mark.slow
@pytest.mark.parametrize("world,num_experts,gate,cf,sizes", [
    (1, 4, "switch", 1.0, [20]),            # one worker: capacity overflow too
    (2, 4, "gshard", 0.75, [23, 9]),          # capacity overflow, uneven token counts
    (4, 8, "switch", None, [15, 0, 31, 6]),  # a worker without tokens, no capacity limit
])
def test_expert_parallel_equals_single_process(world, num_experts, gate, cf, sizes):
    got, loads, dropped = _check(world, num_experts, gate, cf, sizes)
    assert int(loads[-1]) == 0  # an expert that receives no token: no gradient on its owner
    assert all(g is None for g in got[-1]["experts"][num_experts - 1])
    assert int(loads.max()) > 2 * int(loads[:-1].min())  # uneven loads
    if cf is not None:
        assert dropped > 0  # capacity overflow happened
    if world > 1:
        assert sum(out["comm"]["rows_out"] for out in got) == \
            sum(out["comm"]["rows_in"] for out in got) > 0
        assert all(out["comm"]["bytes_out"] == out["comm"]["rows_out"] * D * 8 for out in got)
    for out in got:
        if world == 1:
            assert out["refused"] is None
        else:
            assert f"num_experts must be divisible by the number of workers: expected a multiple " \
                   f"of {world} (got num_experts=3); use {'2 or 4' if world == 2 else '4'} " \
                   "experts" in out["refused"], out["refused"]


def test_needs_an_initialized_process_group():
    from ngra.distributed.moe import ExpertParallelMoE
    with pytest.raises(RuntimeError, match="call dist.init_process_group"):
        ExpertParallelMoE(D, 4)
