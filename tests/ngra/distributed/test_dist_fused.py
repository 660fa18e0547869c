"""FusedAdam (reduce-scatter, Adam on a shard, all-gather in a DDP comm hook) trains exactly as
DDP + torch.optim.Adam: on 2, 3 and 4 real gloo processes, after several steps every parameter
equals the unfused run (float32 with 2 ranks: bit for bit; float64: to 1e-12), with parameter
sizes not divisible by the number of ranks, a parameter no rank uses, one only some ranks use, a
frozen parameter, one bucket per parameter, DDP's bucket rebuild after the first iteration,
weight decay (L2 and AdamW), amsgrad, the three reduce-scatter implementations and both buffer
modes (DDP's bucket buffer, or buffers of its own, also under gradient_as_bucket_view=True);
bfloat16 parameters are updated through a float32 master copy. .grad keeps the local gradient.
The optimizer state is about 1/K per rank, with DDP's buckets FusedAdam's transient buffers and
a step's memory are the model's size smaller than with its own, its state dicts round-trip (also
to and from torch.optim.Adam), and misuse fails with a message that says what to do.

Each world size is one spawn of K workers running several scenarios (starting K interpreters and
DDP's first import cost seconds each on this 2-core machine)."""

from __future__ import annotations

import copy

import pytest
import torch

import distutil

STEPS = 4


class _Net(torch.nn.Module):
    """Sizes prime to 2, 3 and 4 (35, 5, 15, 3, 9, 6, 2 elements), a frozen parameter, and with
    ``partial``: a branch some ranks use (``some``) and one no rank uses (``never``)."""

    def __init__(self, dtype, partial=True):
        super().__init__()
        torch.manual_seed(0)
        self.partial = partial
        self.frozen = torch.nn.Parameter(torch.randn(3, dtype=dtype), requires_grad=False)
        self.a = torch.nn.Linear(7, 5).to(dtype)
        self.b = torch.nn.Linear(5, 3).to(dtype)
        self.some = torch.nn.Linear(3, 3).to(dtype)
        self.never = torch.nn.Linear(3, 2).to(dtype)

    def forward(self, x, use_some):
        h = self.b(torch.tanh(self.a(x))) * self.frozen
        if not self.partial:  # everything used: DDP rebuilds its buckets after iteration 1
            return self.some(h) + self.never(h).sum(1, keepdim=True)
        return self.some(h) if use_some else h


def _data(rank, step, dtype):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(6, 7, generator=gen, dtype=dtype),
            torch.randn(6, 3, generator=gen, dtype=dtype))


def _setup(fused, dtype, opt_kw, ddp_kw, partial=True, mode="auto", gather="native",
           buffers="auto"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ngra.distributed.fused import FusedAdam

    if "bucket_cap_mb" in ddp_kw:
        # torch 2.2 sizes the first bucket after the rebuild by this global (1 MiB), not by
        # bucket_cap_mb as torch 2.13 does: set it so that both make one bucket per parameter.
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = int(ddp_kw["bucket_cap_mb"] * 2 ** 20)
    model = DDP(_Net(dtype, partial), find_unused_parameters=partial, **ddp_kw)
    if fused:
        return model, FusedAdam(model, reduce_scatter=mode, all_gather=gather, buffers=buffers,
                                profile=True, **opt_kw)
    kw = dict(opt_kw)
    cls = torch.optim.AdamW if kw.pop("decoupled_weight_decay", False) else torch.optim.Adam
    return model, cls(model.parameters(), **kw)


def _run(rank, model, opt, steps, start=0, dtype=torch.float64):
    for step in range(start, start + steps):
        x, y = _data(rank, step, dtype)
        # `some` is used by rank 1 only on odd steps, and by every rank on step 2.
        use = (rank == 1 and step % 2 == 1) or step == 2
        ((model(x, use) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _equivalence(rank, dtype, opt_kw, ddp_kw, partial=True, mode="auto", gather="native",
                 buffers="auto"):
    ref = _run(rank, *_setup(False, dtype, opt_kw, ddp_kw, partial), STEPS, dtype=dtype)
    model, opt = _setup(True, dtype, opt_kw, ddp_kw, partial, mode, gather, buffers)
    got = _run(rank, model, opt, STEPS, dtype=dtype)
    names = [n for n, _ in model.module.named_parameters()]
    return {"ref": ref, "got": got, "mode": (opt.reduce_scatter_mode, opt.all_gather_mode),
            "buffers": opt.buffer_mode,
            "bytes": opt.state_bytes(),
            "steps": dict(zip(names, opt._steps)), "layouts": len(opt._layouts),
            "buckets": [len(s["hooks"]) for s in opt.stats]}


def _state_dicts(rank, world):
    """Round trips after 2 of 4 steps: this rank's shard into a new FusedAdam; the gathered
    full state dict against torch.optim.Adam's; Adam's state dict into FusedAdam and back."""
    f64, kw = torch.float64, {"lr": 0.05, "weight_decay": 0.01}
    out = {}
    model, adam = _setup(False, f64, kw, {})
    _run(rank, model, adam, 2)
    # Copies: state_dict() returns the live tensors, which the next steps change in place.
    adam_sd, adam_params = copy.deepcopy(adam.state_dict()), _copy(model.module.state_dict())
    out["ref"] = _run(rank, model, adam, 2, start=2)
    model, opt = _setup(True, f64, kw, {})
    _run(rank, model, opt, 2)
    full = opt.full_state_dict()
    out["full"] = {n: copy.deepcopy(full["state"].get(i)) for i, (n, _) in
                   enumerate(model.module.named_parameters())}
    out["adam"] = {n: adam_sd["state"].get(i) for i, (n, _) in
                   enumerate(model.module.named_parameters())}
    shard, params = opt.state_dict(), _copy(model.module.state_dict())
    out["continued"] = _run(rank, model, opt, 2, start=2)
    # The shard into a fresh FusedAdam on a fresh model with the parameters after 2 steps.
    model, opt = _setup(True, f64, kw, {})
    model.module.load_state_dict(params)
    opt.load_state_dict(shard)
    out["from_shard"] = _run(rank, model, opt, 2, start=2)
    # torch.optim.Adam's state dict into FusedAdam.
    model, opt = _setup(True, f64, kw, {})
    model.module.load_state_dict(adam_params)
    opt.load_state_dict(adam_sd)
    out["from_adam"] = _run(rank, model, opt, 2, start=2)
    # FusedAdam's full state dict into torch.optim.Adam.
    model, adam = _setup(False, f64, kw, {})
    model.module.load_state_dict(params)
    adam.load_state_dict(full)
    out["to_adam"] = _run(rank, model, adam, 2, start=2)
    for key, bad in (("wrong_rank", dict(shard, rank=(rank + 1) % world)),
                     ("old_format", dict(shard, format="ngra.FusedAdam/sharded"))):
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            out[key] = str(e)
    return out


def _copy(sd):
    return {k: v.clone() for k, v in sd.items()}


def _misuse(rank, world):
    """Errors, in the order a user meets them; the last one breaks DDP's reducer (documented),
    so it comes last."""
    from ngra.distributed.fused import FusedAdam

    errors = {}
    model, opt = _setup(True, torch.float64, {"lr": 0.1}, {})
    for name, fn in (("step_first", opt.step),
                     ("second_hook", lambda: FusedAdam(model)),
                     ("add_group", lambda: opt.add_param_group({"params": []}))):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            errors[name] = str(e)
    from torch.nn.parallel import DistributedDataParallel as DDP
    try:  # refused before any collective, on every rank alike
        FusedAdam(DDP(_Net(torch.float64), gradient_as_bucket_view=True), buffers="bucket")
    except ValueError as e:
        errors["bucket_as_view"] = str(e)
    x, y = _data(rank, 0, torch.float64)
    ((model(x, False) - y) ** 2).mean().backward()
    try:
        opt.full_state_dict()
    except RuntimeError as e:
        errors["state_in_flight"] = str(e)
    try:
        ((model(x, False) - y) ** 2).mean().backward()
    except RuntimeError as e:
        errors["two_backwards"] = str(e)
    return errors


def _low_precision(rank, world):
    """bfloat16 parameters: one step updates a float32 master copy of the rank's parts. Adam's
    first step is ``p - lr * m / (sqrt(v) + eps)`` with ``m / sqrt(v) = sign(g)`` after bias
    correction, insensitive to the bfloat16 rounding of the mean gradient, so the master equals
    torch.optim.Adam on a float32 copy fed the float32 mean of the local gradients."""
    import torch.distributed as dist

    model, opt = _setup(True, torch.bfloat16, {"lr": 0.05}, {}, partial=False)
    params = list(model.module.named_parameters())
    ref = [p.detach().float().clone().requires_grad_(p.requires_grad) for _, p in params]
    x, y = _data(rank, 0, torch.bfloat16)
    ((model(x, True) - y) ** 2).mean().backward()
    for r, (_, p) in zip(ref, params):
        if p.requires_grad:  # .grad holds the local gradient (documented): average it here
            g = p.grad.float()
            dist.all_reduce(g)
            r.grad = g / world
    opt.step()
    adam = torch.optim.Adam([r for r in ref if r.requires_grad], lr=0.05)
    adam.step()
    out = {}
    for i, ((name, p), r) in enumerate(zip(params, ref)):
        st = opt._shard.get(i)
        q, flat = p.numel() // world, r.detach().reshape(-1)
        want = torch.cat([flat[rank * q:(rank + 1) * q], flat[world * q:]])
        out[name] = (p.detach().clone(), r.detach().clone(),
                     None if st is None else st["master"].clone(), want)
    return out


def _local_grads(rank, world):
    """.grad after backward is this rank's own gradient in both buffer modes (DDP copies nothing
    back in "bucket" mode, and its bucket then holds the gathered parameters)."""
    out = {}
    for buffers in ("bucket", "own"):
        model, opt = _setup(True, torch.float64, {"lr": 0.05}, {}, partial=False,
                            buffers=buffers)
        plain = copy.deepcopy(model.module)
        x, y = _data(rank, 0, torch.float64)
        ((model(x, True) - y) ** 2).mean().backward()
        ((plain(x, True) - y) ** 2).mean().backward()
        out[buffers] = all(torch.equal(p.grad, q.grad) for p, q in
                           zip(model.module.parameters(), plain.parameters()) if p.requires_grad)
        opt.step()
    return out


class _Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def _memory(rank, world):
    """Peak bytes of FusedAdam's own buffers (its accounting) and of every tensor a training
    step creates (ngra.engine.TensorMemory), per buffer mode and for DDP + Adam."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ngra.distributed.fused import FusedAdam
    from ngra.engine import TensorMemory

    out = {}
    for name in ("ddp+adam", "bucket", "own"):
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 16_640  # one bucket per Linear
        model = DDP(_Wide(), bucket_cap_mb=16_640 / 2 ** 20)
        opt = (torch.optim.Adam(model.parameters()) if name == "ddp+adam"
               else FusedAdam(model, buffers=name, profile=True))
        for step in range(3):  # DDP rebuilds its buckets after the first
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * rank))
            with TensorMemory() as tm:
                model(x).square().mean().backward()
                opt.step()
            opt.zero_grad()
        state = (sum(t.numel() * t.element_size() for st in opt.state.values()
                     for t in st.values() if t.dim()) if name == "ddp+adam"
                 else opt.state_bytes())
        out[name] = {"step_peak": tm.peak, "state": state,
                     "buffers": 0 if name == "ddp+adam" else opt.stats[-1]["peak_buffer_bytes"],
                     "buckets": 0 if name == "ddp+adam" else len(opt.stats[-1]["hooks"]),
                     "mode": None if name == "ddp+adam" else opt.reduce_scatter_mode,
                     "params": [p.detach().clone() for p in model.parameters()]}
    return out


def _world2(rank, world):
    out = {"f32": _equivalence(rank, torch.float32, {"lr": 0.05}, {})}
    out["f32_own"] = _equivalence(rank, torch.float32, {"lr": 0.05}, {}, buffers="own")
    out["f32_as_view"] = _equivalence(rank, torch.float32, {"lr": 0.05},
                                      {"gradient_as_bucket_view": True})
    out["local_grads"] = _local_grads(rank, world)
    out["memory"] = _memory(rank, world)
    out["bf16"] = _low_precision(rank, world)
    out["f64_buckets"] = _equivalence(rank, torch.float64, {"lr": 0.05, "weight_decay": 0.1},
                                      {"bucket_cap_mb": 1e-4}, partial=False)
    out["misuse"] = _misuse(rank, world)
    return out


def _world3(rank, world):
    out = {"wd_buckets": _equivalence(rank, torch.float64, {"lr": 0.05, "weight_decay": 0.1},
                                      {"bucket_cap_mb": 1e-4}),
           "adamw_all_reduce": _equivalence(
               rank, torch.float64, {"lr": 0.05, "weight_decay": 0.1,
                                     "decoupled_weight_decay": True}, {}, mode="all_reduce",
               gather="all_reduce")}
    out["state_dicts"] = _state_dicts(rank, world)
    return out


def _world4(rank, world):
    return {"amsgrad_all_to_all": _equivalence(
                rank, torch.float64, {"lr": 0.05, "betas": (0.8, 0.9), "amsgrad": True},
                {"bucket_cap_mb": 1e-4}, mode="all_to_all"),
            "rebuild": _equivalence(rank, torch.float64, {"lr": 0.05}, {"bucket_cap_mb": 1e-4},
                                    partial=False)}


def _assert_same(ref, got, exact, tol=1e-12):
    assert ref.keys() == got.keys()
    for name in ref:
        r, g = ref[name], got[name]
        if exact:
            assert torch.equal(r, g), f"{name}: max diff {(r - g).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def _check_equivalence(results, key, world, dtype, exact, partial=True, moments=2):
    for r in results:
        res = r[key]
        _assert_same(res["ref"], res["got"], exact)
        _assert_same(results[0][key]["got"], res["got"], exact=True)  # same on every rank
        init = dict(_Net(dtype).named_parameters())
        assert torch.equal(res["got"]["frozen"], init["frozen"].detach())
        assert res["steps"]["frozen"] == 0 and res["steps"]["a.weight"] == STEPS
        if partial:  # never: no update, no step; some: a step where any rank used it
            for name in ("never.weight", "never.bias"):
                assert torch.equal(res["got"][name], init[name].detach()), name
                assert res["steps"][name] == 0
            assert res["steps"]["some.weight"] == 3
    # Optimizer state about 1/K: moments of this rank's part of n // K elements and of the
    # n % K elements of the tail, which every rank updates.
    trained = [35, 5, 15, 3, 9, 3] + ([] if partial else [6, 2])
    own = sum(n // world + n % world for n in trained)
    assert [r[key]["bytes"] for r in results] == [moments * own * dtype.itemsize] * world


@pytest.mark.slow
def test_two_ranks_bitwise_buckets_rebuild_and_misuse():
    results = distutil.run(_world2, 2, timeout=120)
    # K = 2: the two-term sum is the same in any order, so float32 matches bit for bit.
    _check_equivalence(results, "f32", 2, torch.float32, exact=True)
    _check_equivalence(results, "f32_own", 2, torch.float32, exact=True)
    _check_equivalence(results, "f32_as_view", 2, torch.float32, exact=True)
    assert [results[0][k]["buffers"] for k in ("f32", "f32_own", "f32_as_view")] == \
        ["bucket", "own", "own"]
    assert all(r["local_grads"] == {"bucket": True, "own": True} for r in results)
    _check_equivalence(results, "f64_buckets", 2, torch.float64, exact=True, partial=False)
    for r in results:
        for name, (param, ref, master, want) in r["bf16"].items():
            if name == "frozen":
                assert master is None and torch.equal(param.float(), ref)
                continue
            assert master is not None and master.dtype == torch.float32, name
            torch.testing.assert_close(master, want, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(param, ref.bfloat16())  # bfloat16 tolerance
    model_bytes = 4 * (64 * 64 + 64) * 4
    for r in results:
        mem = r["memory"]
        for name in ("bucket", "own"):  # the same training as DDP + Adam...
            assert all(torch.equal(a, b) for a, b in zip(mem[name]["params"],
                                                         mem["ddp+adam"]["params"]))
            assert mem[name]["buckets"] == 4 and mem[name]["state"] == model_bytes
        assert mem["ddp+adam"]["state"] == 2 * model_bytes
        # ... "own" keeps a [K, W] buffer per bucket until step(), the model's size; "bucket"
        # only the receive buffers of the buckets in flight (1/K of a bucket each, the whole
        # bucket with torch 2.2's all_to_all; here all four at the last hook, this backward is
        # too short for any to complete) and tails.
        assert mem["own"]["buffers"] >= model_bytes
        recv = model_bytes / (2 if mem["bucket"]["mode"] == "native" else 1)
        assert mem["bucket"]["buffers"] <= recv + 1024, mem["bucket"]["buffers"]
        # The whole step, every tensor it creates: "bucket" needs the model's size less.
        assert mem["own"]["step_peak"] - mem["bucket"]["step_peak"] >= 0.9 * model_bytes, mem
    res = results[0]["f64_buckets"]
    # Several buckets, and DDP rebuilt them after the first iteration: more layouts than buckets.
    assert res["buckets"][-1] > 1 and res["layouts"] > res["buckets"][-1], res
    for r in results:
        e = r["misuse"]
        assert "expected loss.backward() through the DDP model before step()" in e["step_first"]
        assert "a DDP model takes one comm hook" in e["second_hook"]
        assert "expected exactly one parameter group" in e["add_group"]
        assert "buffers='bucket' needs DDP(gradient_as_bucket_view=False)" in \
            e["bucket_as_view"]
        assert "expected no update in flight" in e["state_in_flight"]
        assert "a second backward pass through the DDP model ran before step()" in \
            e["two_backwards"] and "no_sync()" in e["two_backwards"]


@pytest.mark.slow
def test_three_ranks_uneven_parts_unused_parameters_and_state_dicts():
    results = distutil.run(_world3, 3, timeout=120)
    _check_equivalence(results, "wd_buckets", 3, torch.float64, exact=False)
    _check_equivalence(results, "adamw_all_reduce", 3, torch.float64, exact=False)
    assert results[0]["adamw_all_reduce"]["mode"] == ("all_reduce", "all_reduce")
    assert results[0]["wd_buckets"]["buckets"][-1] > 1
    for r in results:
        sd = r["state_dicts"]
        for name, st in sd["adam"].items():  # gathered moments = torch.optim.Adam's
            if st is None:
                assert sd["full"][name] is None, name
                continue
            # 2 steps, 1 for `some` (rank 1 used it at step 1 only)
            assert float(sd["full"][name]["step"]) == float(st["step"]) == (
                1.0 if name.startswith("some") else 2.0)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sd["full"][name][key], st[key], rtol=1e-12,
                                           atol=1e-15)
        _assert_same(sd["continued"], sd["from_shard"], exact=True)
        for key in ("continued", "from_adam", "to_adam"):
            _assert_same(sd["ref"], sd[key], exact=False)
        assert "expected rank" in sd["wrong_rank"] and "full_state_dict()" in sd["wrong_rank"]
        assert "written by an earlier FusedAdam" in sd["old_format"]


@pytest.mark.slow
def test_four_ranks_amsgrad_all_to_all_and_rebuilt_buckets():
    results = distutil.run(_world4, 4, timeout=180)
    _check_equivalence(results, "amsgrad_all_to_all", 4, torch.float64, exact=False, moments=3)
    _check_equivalence(results, "rebuild", 4, torch.float64, exact=False, partial=False)
    assert results[0]["amsgrad_all_to_all"]["mode"] == ("all_to_all", "native")


def test_argument_errors_need_no_process_group():
    from ngra.distributed.fused import FusedAdam

    with pytest.raises(TypeError, match="expected a torch.nn.parallel.DistributedDataParallel "
                                        r"model \(got Linear\)"):
        FusedAdam(torch.nn.Linear(2, 2))
    for kw, msg in (({"lr": -1.0}, r"expected lr >= 0 \(got -1.0\)"),
                    ({"betas": (0.9, 1.0)}, r"expected betas = \(beta1, beta2\) in \[0, 1\)"),
                    ({"eps": -1e-8}, "expected eps >= 0"),
                    ({"weight_decay": -0.1}, "expected weight_decay >= 0"),
                    ({"reduce_scatter": "ring"}, "reduce_scatter must be one of"),
                    ({"buffers": "ring"}, "buffers must be one of"),
                    ({"all_gather": "ring"}, "all_gather must be one of")):
        with pytest.raises(ValueError, match=msg):
            FusedAdam(torch.nn.Linear(2, 2), **kw)


def test_parts_cover_every_element_once():
    from ngra.distributed.fused import _mine, _split

    for n in (1, 2, 5, 12, 13):
        for k in (1, 2, 3, 4, 7):
            part, tail = _split(n, k)
            assert k * part + tail == n and 0 <= tail < k
            flat = torch.arange(n)
            mine = [_mine(flat, r * part, part, k).tolist() for r in range(k)]
            # The parts are disjoint and in order; the tail is the same on every rank.
            assert sum((m[:part] for m in mine), []) + mine[0][part:] == list(range(n))
            assert all(m[part:] == list(range(k * part, n)) for m in mine)
