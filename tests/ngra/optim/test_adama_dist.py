"""AdamA on several real gloo processes: data parallel (each micro-batch gradient summed before
it is folded) and ZeRO-sharded states equal one process running the same global micro-batches,
parameters and moments (with uneven shards: parameters of 15, 3, 12, 4 and 4 elements)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import distutil  # noqa: E402

STEPS, N, ROWS = 3, 3, 4  # ROWS per rank and micro-batch


def _model():
    import torch

    torch.manual_seed(0)
    # Parameter sizes 15, 3, 12, 4, 4: uneven shards for 2 and 3 ranks.
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 1, bias=False)).double()


def _batches(world):
    import torch

    gen = torch.Generator().manual_seed(11)
    return [[(torch.randn(world * ROWS, 5, generator=gen, dtype=torch.float64),
              torch.randn(world * ROWS, 1, generator=gen, dtype=torch.float64))
             for _ in range(N)] for _ in range(STEPS)]


def _train(model, opt, batches, rows, scale, manual=False):
    for step in batches:
        with opt.micro_batches(N):
            for x, y in step:
                # Sum of squared errors over this process's rows / (global rows * N): the sum
                # over processes is the global micro-batch's mean loss / N.
                loss = ((model(x[rows]) - y[rows]) ** 2).sum() / (scale * N)
                loss.backward()
                if manual:
                    opt.accumulate()
        opt.step()


def _worker(rank, world, shard, manual):
    import torch
    import torch.distributed as dist

    from ngra.optim import AdamA

    batches = _batches(world)
    ref = _model()
    ref_opt = AdamA(ref.parameters(), lr=0.05, weight_decay=0.1, amsgrad=True)
    _train(ref, ref_opt, batches, slice(None), world * ROWS)

    model = _model()
    opt = AdamA(model.parameters(), lr=0.05, weight_decay=0.1, amsgrad=True,
                process_group=dist.group.WORLD, shard=shard, hooks=not manual)
    _train(model, opt, batches, slice(rank * ROWS, (rank + 1) * ROWS), world * ROWS, manual)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                          _model().parameters()))
    names = [n for n, p in model.named_parameters() if p in opt.state]
    # The moments a rank holds equal one process's (its shard of them, with shard=True).
    for p, q in zip(model.parameters(), ref.parameters()):
        if p in opt.state:
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                diff = max(diff, (opt.state[p][k] - ref_opt.state[q][k]).abs().max().item())
            assert float(opt.state[p]["step"]) == STEPS
    return diff, moved, names


@pytest.mark.parametrize("world,shard,manual", [
    (2, False, False), (2, True, False),
    pytest.param(3, True, True, marks=pytest.mark.slow), pytest.param(4, False, True,
                                                                      marks=pytest.mark.slow)])
def test_data_parallel_equals_one_process(world, shard, manual):
    results = distutil.run(_worker, world, shard, manual, timeout=120)
    for diff, moved, _ in results:
        assert diff < 1e-12 and moved > 1e-2
    held = [names for _, _, names in results]
    all_names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight"]
    if not shard:
        assert held == [all_names] * world
    else:
        # Each parameter's moments live on exactly one rank.
        assert sorted(n for names in held for n in names) == sorted(all_names)
        assert all(names for names in held)
