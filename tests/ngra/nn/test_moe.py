"""ngra.nn.MoE against a slow per-token loop (routing, capacity, outputs, aux loss, gradients;
float64), the DTS gate's dense-to-sparse behaviour, the GPT and GNN uses, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

import ngra
from ngra.nn import MoE, MoEConv, SAGEConv
from ngra.nn.moe import DTSGate, TopKGate, aux_loss, dts_temperature, set_temperature
from ngra.nn.transformer import GPT

D, H, E = 6, 10, 4


def reference(moe, x, noise=None):
    """``(y [N, D], aux)`` routed token by token with Python lists: each token's choices by
    sorting its probabilities, capacity positions counted in GShard's order (all first choices,
    then all second choices), each expert called on one token at a time."""
    gate, n, e = moe.gate, x.shape[0], moe.num_experts
    logits = x @ gate.wg.weight.t()
    probs = [torch.softmax(logits[i], 0) for i in range(n)]
    experts = {}  # token -> [(expert, weight)]
    if isinstance(gate, TopKGate):
        k = gate.k
        order = [sorted(range(e), key=lambda j, p=p: -float(p[j].detach()))[:k] for p in probs]
        cap = math.inf if gate.capacity_factor is None else \
            math.ceil(gate.capacity_factor * k * n / e)
        count = [0] * e
        for c in range(k):
            for i in range(n):
                ex = order[i][c]
                if count[ex] < cap:
                    denom = sum(probs[i][j] for j in order[i]) if k > 1 else 1.0
                    experts.setdefault(i, []).append((ex, probs[i][ex] / denom))
                count[ex] += 1
        first = [o[0] for o in order]
    elif gate.training:
        first = []
        for i in range(n):
            w = torch.softmax((torch.log_softmax(logits[i], 0) + noise[i]) / gate.temperature, 0)
            experts[i] = [(j, w[j]) for j in range(e) if float(w[j].detach()) > gate.threshold]
            first.append(max(range(e), key=lambda j, w=w: float(w[j].detach())))
    else:
        first = [max(range(e), key=lambda j, p=p: float(p[j].detach())) for p in probs]
        experts = {i: [(first[i], probs[i][first[i]])] for i in range(n)}
    rows = []
    for i in range(n):
        y = x.new_zeros(x.shape[1])
        for ex, w in experts.get(i, []):
            y = y + w * moe.experts[ex](x[i:i + 1])[0]
        rows.append(y)
    frac = [sum(1 for f in first if f == j) / n for j in range(e)]
    aux = e * sum(frac[j] * sum(p[j] for p in probs) / n for j in range(e))
    return torch.stack(rows), aux


def _grads(moe, x):
    return [x.grad.clone()] + [None if p.grad is None else p.grad.clone()
                               for p in moe.parameters()]


def _compare(moe, x, noise=None):
    coeff = torch.randn(x.shape, dtype=x.dtype)
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = moe(x)
    ((y * coeff).sum() + 0.3 * moe.aux_loss).backward()
    fast = _grads(moe, x)
    stats = moe.last_stats
    moe.zero_grad(set_to_none=True)
    x.grad = None
    y_ref, aux_ref = reference(moe, x, noise)
    ((y_ref * coeff).sum() + 0.3 * aux_ref).backward()
    slow = _grads(moe, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(moe.aux_loss, aux_ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(fast, slow):
        assert (a is None) == (b is None)  # an expert without tokens gets no gradient in both
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    return stats


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("cf", [None, 1.0, 0.5])
def test_topk_gate_matches_per_token_loop(k, cf):
    torch.manual_seed(10 * k + (0 if cf is None else int(4 * cf)))
    moe = MoE(D, E, hidden=H, gate=TopKGate(D, E, k=k, capacity_factor=cf)).double()
    # Skewed router: uneven loads, so capacity 0.5 and 1.0 overflow.
    with torch.no_grad():
        moe.gate.wg.weight[0] += 0.8
    x = torch.rand(23, D, dtype=torch.float64)
    stats = _compare(moe, x)
    if cf is None:
        assert stats["dropped"] == 0 and stats["active"] == k
    else:
        assert stats["dropped"] > 0 and int(stats["load"].max()) <= math.ceil(cf * k * 23 / E)
    assert stats["load"].sum() == 23 * k - stats["dropped"]


def test_switch_and_gshard_names_and_default_capacity():
    assert MoE(D, E, gate="switch").gate.k == 1 and MoE(D, E, gate="gshard").gate.k == 2
    assert MoE(D, E).gate.capacity_factor == 1.25
    assert MoE(D, E, capacity_factor=None).gate.capacity(100) is None
    assert isinstance(MoE(D, E, gate="dts").gate, DTSGate)


def test_dts_gate_matches_per_token_loop_dense_then_sparse():
    torch.manual_seed(3)
    moe = MoE(D, E, hidden=H, gate="dts", threshold=0.05).double()
    with torch.no_grad():
        moe.gate.wg.weight.mul_(8.0)  # a confident router: sparse at a low temperature
    x = torch.randn(40, D, dtype=torch.float64)
    active = {}
    for tau in (20.0, 0.3):
        moe.gate.temperature = tau
        moe.gate.generator = torch.Generator().manual_seed(7)
        noise = torch.Generator().manual_seed(7)
        u = torch.rand(x.shape[0], E, dtype=torch.float64, generator=noise)
        stats = _compare(moe, x, noise=-torch.log(-torch.log(u)))
        active[tau] = stats["active"]
    assert active[20.0] == E  # dense: every token to every expert
    assert 1.0 <= active[0.3] < 2.0  # sparse
    moe.eval()  # top-1, no capacity
    stats = _compare(moe, x)
    assert stats["active"] == 1.0 and stats["dropped"] == 0


def test_dts_temperature_schedules_and_setter():
    assert dts_temperature(0, 100) == 2.0 and dts_temperature(100, 100) == pytest.approx(0.3)
    assert dts_temperature(50, 100) == pytest.approx(1.15)
    assert dts_temperature(500, 100) == pytest.approx(0.3)
    assert dts_temperature(50, 100, schedule="linear") == pytest.approx(1.15)
    assert dts_temperature(50, 100, schedule="exponential") == pytest.approx(math.sqrt(0.6))
    model = torch.nn.Sequential(MoE(D, E, gate="dts"), MoE(D, E, gate="switch"),
                                MoE(D, E, gate="dts"))
    assert set_temperature(model, 0.7) == 2 and model[2].gate.temperature == 0.7
    with pytest.raises(ValueError, match="schedule must be"):
        dts_temperature(1, 10, schedule="step")


def test_empty_input_and_shapes():
    moe = MoE(D, E, hidden=H)
    assert moe(torch.zeros(0, D)).shape == (0, D) and float(moe.aux_loss.detach()) == 0.0
    assert moe(torch.randn(2, 3, D)).shape == (2, 3, D)
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 6\] \(got shape \(3, 5\)\)"):
        moe(torch.randn(3, 5))


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"top-k must be <= num_experts: expected k <= 4 "
                                         r"\(got k=5\)"):
        TopKGate(D, E, k=5)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"capacity_factor must be a finite number > 0.*"
                                             rf"\(got {bad!r}\)"):
            MoE(D, E, capacity_factor=bad)
    with pytest.raises(ValueError, match="DTS gate has no capacity limit"):
        MoE(D, E, gate="dts", capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"threshold must be < 1/num_experts = 0.25"):
        DTSGate(D, E, threshold=0.3)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0 \(got 0\)"):
        DTSGate(D, E, temperature=0)
    with pytest.raises(ValueError, match="gate must be one of"):
        MoE(D, E, gate="hash")


def test_nan_router_logits_are_refused():
    moe = MoE(D, E, hidden=H)
    x = torch.randn(5, D)
    x[2, 1] = float("nan")
    with pytest.raises(FloatingPointError, match=r"router logits must be finite: expected no "
                                                 r"NaN/inf \(got 1 of 5 tokens.*input x"):
        moe(x)
    with torch.no_grad():
        moe.gate.wg.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="router weight W_g holds NaN/inf"):
        moe(torch.randn(5, D))
    moe.gate.check_finite = False
    moe(torch.randn(5, D))  # the check can be turned off


def test_gpt_with_moe_ffn_trains():
    torch.manual_seed(0)
    model = GPT(11, 8, d_model=16, n_layer=2, n_head=2,
                ffn=lambda d, layer: MoE(d, 4, hidden=32, gate="dts" if layer else "switch"))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 11, (4, 8))
    losses = []
    for _ in range(30):
        _, loss = model(idx, idx)
        total = loss + 0.01 * aux_loss(model)
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]  # memorizes the one batch
    assert all(m.ffn.aux_loss is not None for m in model.blocks)
    assert model.blocks[1].ffn.gate.wg.weight.grad is not None


def _graph():
    torch.manual_seed(5)
    src = torch.randint(0, 30, (90,))
    dst = torch.randint(0, 30, (90,))
    return ngra.Graph(src, dst, num_nodes=30), torch.randn(30, 5, dtype=torch.float64)


@pytest.mark.slow  # the first g-SpMM call compiles numba kernels (seconds)
def test_moeconv_is_sage_then_moe_and_compiles():
    g, x = _graph()
    layer = MoEConv(5, D, num_experts=E, gate="gshard", hidden=H).double()
    sage = SAGEConv(5, D).double()
    with torch.no_grad():
        sage.lin_l.load_state_dict(layer.lin_l.state_dict())
        sage.lin_r.load_state_dict(layer.lin_r.state_dict())
    z = sage(g, x)
    torch.testing.assert_close(layer(g, x), z + layer.moe(z))
    assert not ngra.compile(layer, *layer.prepare(g, x)).eager  # the fused g-SpMM stays
    with ngra.Engine(num_chunks=3):  # streamed: same values
        torch.testing.assert_close(layer(g, x), z + layer.moe(z))
    dense = MoEConv(5, D, num_experts=1, hidden=H).double()  # E = 1: z + FFN(z)
    zd = dense.propagate(*dense.prepare(g, x))
    torch.testing.assert_close(dense(g, x), zd + dense.moe.experts[0](zd))
