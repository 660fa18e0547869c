r"""Mixture-of-experts layers: Switch (top-1), GShard (top-2) and Dense-To-Sparse (DTS) gates.

A :class:`MoE` layer holds E expert feed-forward networks (each the transformer's
:class:`~ngra.nn.transformer.FeedForward`, ``Linear(d, h) -> GELU -> Linear(h, d)``) and a gate.
For tokens ``x`` [N, d] (any leading shape is flattened) the gate returns, per token n and
expert e, a dispatch mask ``D[n, e]`` and a combine weight ``C[n, e]`` (zero where ``D`` is
False), and the layer computes::

    y_n = sum_{e : D[n, e]} C[n, e] * expert_e(x_n)                     (y: [N, d])

Each expert runs once on the rows dispatched to it (sparse compute: a token costs as many
expert FFNs as it has dispatched experts). ``moe.aux_loss`` (a scalar tensor) holds the gate's
load-balancing loss of the last forward; add ``weight * ngra.nn.moe.aux_loss(model)`` to the
training loss. ``moe.last_stats`` holds detached statistics of the last forward (active experts
per token, tokens per expert, assignments dropped by capacity).

Gates (``p = softmax(x W_g)`` [N, E] are the router probabilities; ``W_g`` [d, E], no bias):

- :class:`TopKGate` with ``k=1`` (Switch Transformer, ``gate="switch"``): token n goes to
  ``e1 = argmax_e p[n, e]`` with weight ``p[n, e1]``.
- :class:`TopKGate` with ``k=2`` (GShard, ``gate="gshard"``): the two largest ``e1, e2``, with
  weights renormalized over the pair, ``p[n, ej] / (p[n, e1] + p[n, e2])``. (GShard's random
  dispatch of the second expert is not implemented: the second expert is always used.)
- Capacity: with a capacity factor ``cf``, each expert takes at most
  ``C = ceil(cf * k * N / E)`` assignments; positions are given in token order, all first
  choices before any second choice (as GShard), and an assignment at position >= C is dropped
  (its token gets nothing from that expert; in a transformer the residual carries it).
  ``capacity_factor=None``: no limit (then the layer acts row by row).
- Load-balancing loss (Switch, eq. 4; GShard's is the same with the first choice):
  ``aux = E * sum_e f_e * P_e``, ``f_e`` the fraction of tokens whose first choice is e (before
  dropping), ``P_e`` the mean of ``p[:, e]``; it is 1 for a perfectly uniform router.
- :class:`DTSGate` (``gate="dts"``, "Dense-To-Sparse Gate for Mixture-of-Experts", Nie et al.,
  the EvoMoE code): in training, Gumbel-softmax weights at temperature tau,
  ``w = softmax((log p + g) / tau)`` with ``g`` i.i.d. Gumbel(0, 1) [N, E]; every expert with
  ``w > threshold`` is dispatched with weight ``w`` (no renormalization), the others dropped.
  At a high temperature ``w`` is near uniform, so every token goes to every expert (dense); as
  tau is annealed (:func:`dts_temperature`, set with :func:`set_temperature`) ``w`` sharpens
  and the experts under the threshold fall away (sparse). In evaluation: top-1 (Switch routing
  without capacity limit). No capacity limit in training either (EvoMoE sets the capacity to
  the number of tokens). The balance loss above is reported with ``f_e`` from ``argmax w``.

  Where this follows what: the Gumbel-softmax over ``log softmax(logits)``, the fixed
  threshold (EvoMoE's ``GUMBEL_THRESHOLD = 0.02``, our default), dropping without
  renormalization, no capacity and top-1 evaluation follow the EvoMoE code
  (``fairseq/modules/moe/topkgate.py``); the annealed temperature is the paper's idea, and
  the EvoMoE code anneals it with a "heat" scheduler (cosine by default). Our defaults, 2.0
  -> 0.3 over training with a cosine schedule, are our choice, not a value checked against the
  paper. Not implemented: EvoMoE's first stage (training one expert and copying it with
  noise into E experts, "expert diversify"): our experts start independently initialized.

Expert parallelism (each of K workers hosting E/K experts, tokens moved by all-to-all) is
:class:`ngra.distributed.moe.ExpertParallelMoE`, a subclass of :class:`MoE`.

As a GNN's ApplyVertex network, see :class:`MoEConv`.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._utils import Conv, check_bool, check_int, check_prob
from .transformer import FeedForward

__all__ = ["MoE", "MoEConv", "Gate", "TopKGate", "DTSGate", "GateOutput", "GATES", "aux_loss",
           "set_temperature", "dts_temperature", "moe_layers"]

GATES = ("switch", "gshard", "dts")
_AUTO = "auto"  # capacity_factor default: 1.25 for top-k gates, none for DTS


class GateOutput(NamedTuple):
    """What a gate returns for N tokens and E experts."""

    dispatch: torch.Tensor  # [N, E] bool: token n is computed by expert e
    combine: torch.Tensor   # [N, E] float: weight of expert e's output in token n (0 off dispatch)
    aux_loss: torch.Tensor  # [] load-balancing loss (1 for a uniform router)
    dropped: int            # token-expert assignments dropped for capacity


def _check_capacity_factor(where: str, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{where}: capacity_factor must be a finite number > 0, or None for no "
                         f"capacity limit (got {value!r}); 1.0-2.0 is usual (1.25 by default)")
    return float(value)


def balance_loss(probs: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` for router probabilities ``probs`` [N, E] and first choices
    ``first`` [N] (``f_e`` = fraction of tokens with ``first == e``, ``P_e`` = mean prob). Zero
    for N = 0. Only ``P_e`` carries a gradient (``f_e`` counts)."""
    n, e = probs.shape
    if n == 0:
        return probs.sum() * 0.0
    frac = torch.bincount(first, minlength=e).to(probs.dtype) / n
    return e * (frac * probs.mean(0)).sum()


class Gate(nn.Module):
    """Base of the gates: the router ``W_g`` (``Linear(d_model, num_experts, bias=False)``) and
    the finite-logits check. Subclasses implement ``forward(x [N, d]) -> GateOutput``."""

    k: int = 1

    def __init__(self, d_model: int, num_experts: int, *, check_finite: bool = True):
        super().__init__()
        where = type(self).__name__
        self.d_model = check_int(where, "d_model", d_model)
        self.num_experts = check_int(where, "num_experts", num_experts)
        self.check_finite = check_bool(where, "check_finite", check_finite)
        self.wg = nn.Linear(self.d_model, self.num_experts, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``x W_g`` [N, E]; NaN or inf raises (they would route silently to
        expert 0 through argmax, or poison every expert's output through softmax)."""
        z = self.wg(x)
        if self.check_finite and z.numel() and not bool(torch.isfinite(z).all()):
            bad = int((~torch.isfinite(z)).any(1).sum())
            if not bool(torch.isfinite(x).all()):
                cause = "the layer's input x already holds NaN/inf"
            elif not bool(torch.isfinite(self.wg.weight).all()):
                cause = "the router weight W_g holds NaN/inf"
            else:
                cause = "x W_g overflowed"
            raise FloatingPointError(
                f"{type(self).__name__}: router logits must be finite: expected no NaN/inf (got "
                f"{bad} of {z.shape[0]} tokens with NaN/inf logits; {cause}). Training has "
                "probably diverged: lower the learning rate, clip gradients, or check the data "
                "(check_finite=False skips this check)")
        return z

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}"


class TopKGate(Gate):
    """Top-k routing with capacity and token dropping: ``k=1`` is Switch, ``k=2`` GShard (see
    the module docstring for the math). ``forward(x [N, d_model]) -> GateOutput``."""

    def __init__(self, d_model: int, num_experts: int, *, k: int = 1,
                 capacity_factor: float | None = 1.25, check_finite: bool = True):
        super().__init__(d_model, num_experts, check_finite=check_finite)
        where = type(self).__name__
        self.k = check_int(where, "k", k)
        if self.k > self.num_experts:
            raise ValueError(f"{where}: top-k must be <= num_experts: expected k <= "
                             f"{self.num_experts} (got k={self.k}); use fewer experts per token "
                             "or more experts")
        self.capacity_factor = _check_capacity_factor(where, capacity_factor)

    def capacity(self, num_tokens: int) -> int | None:
        """``ceil(capacity_factor * k * N / E)`` assignments per expert (None: unlimited)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.k * num_tokens / self.num_experts)

    def forward(self, x: torch.Tensor) -> GateOutput:
        n, e = x.shape[0], self.num_experts
        probs = F.softmax(self.logits(x), dim=-1)
        top_p, top_i = probs.topk(self.k, dim=-1)  # [N, k], largest first
        weight = top_p / top_p.sum(-1, keepdim=True) if self.k > 1 else top_p
        cap = self.capacity(n)
        if cap is None:
            keep = torch.ones_like(top_i, dtype=torch.bool)
        else:
            # Position of each assignment in its expert's buffer: choice j of token n comes after
            # every choice < j of all tokens and after choice j of tokens < n (GShard's order).
            keep = torch.empty_like(top_i, dtype=torch.bool)
            taken = torch.zeros(e, dtype=torch.int64, device=x.device)
            for j in range(self.k):
                onehot = F.one_hot(top_i[:, j], e)
                pos = (onehot.cumsum(0) - 1 + taken).gather(1, top_i[:, j:j + 1]).squeeze(1)
                keep[:, j] = pos < cap
                taken = taken + onehot.sum(0)
        combine = probs.new_zeros(n, e).scatter(1, top_i, weight * keep)
        dispatch = torch.zeros(n, e, dtype=torch.bool, device=x.device).scatter(1, top_i, keep)
        return GateOutput(dispatch, combine, balance_loss(probs, top_i[:, 0]),
                          int(keep.numel() - keep.sum()))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, capacity_factor={self.capacity_factor}"


class DTSGate(Gate):
    """Dense-To-Sparse gate (see the module docstring): Gumbel-softmax weights at
    ``temperature`` in training, experts with weight ``<= threshold`` dropped; top-1 in eval.

    ``threshold`` must lie in [0, 1/E) so that a token always keeps its largest weight
    (``max_e w >= 1/E``). ``generator``: an optional ``torch.Generator`` for the Gumbel noise
    (default: torch's global generator)."""

    def __init__(self, d_model: int, num_experts: int, *, temperature: float = 2.0,
                 threshold: float = 0.02, generator: torch.Generator | None = None,
                 check_finite: bool = True):
        super().__init__(d_model, num_experts, check_finite=check_finite)
        where = type(self).__name__
        threshold = float(check_prob(where, "threshold", threshold))
        if threshold >= 1.0 / self.num_experts:
            raise ValueError(f"{where}: threshold must be < 1/num_experts = "
                             f"{1.0 / self.num_experts:.4g} so every token keeps an expert "
                             f"(got {threshold}); 0.02 is EvoMoE's value")
        self.threshold = threshold
        self.temperature = temperature  # checked by the property
        self.generator = generator
        self.k = self.num_experts  # at most every expert per token

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                not math.isfinite(value) or value <= 0:
            raise ValueError(f"{type(self).__name__}: temperature must be a finite number > 0 "
                             f"(got {value!r}); anneal it with ngra.nn.moe.dts_temperature")
        self._temperature = float(value)

    def gumbel(self, shape, like: torch.Tensor) -> torch.Tensor:
        """``-log(-log u)``, ``u ~ U(0, 1)`` [shape]; ``u`` is clamped away from 0 (log 0)."""
        u = torch.rand(shape, dtype=like.dtype, device=like.device, generator=self.generator)
        return -torch.log(-torch.log(u.clamp_min(torch.finfo(like.dtype).tiny)))

    def forward(self, x: torch.Tensor) -> GateOutput:
        n, e = x.shape[0], self.num_experts
        z = self.logits(x)
        probs = F.softmax(z, dim=-1)
        if not self.training:
            first = probs.argmax(-1)
            onehot = F.one_hot(first, e).bool()
            return GateOutput(onehot, probs * onehot, balance_loss(probs, first), 0)
        w = F.softmax((F.log_softmax(z, dim=-1) + self.gumbel(z.shape, z)) / self.temperature,
                      dim=-1)
        keep = w > self.threshold
        return GateOutput(keep, w * keep, balance_loss(probs, w.argmax(-1)), 0)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, temperature={self.temperature:.4g}, "
                f"threshold={self.threshold}")


def _make_gate(where, gate, d_model, num_experts, capacity_factor, temperature, threshold,
               check_finite) -> Gate:
    if isinstance(gate, Gate):
        if gate.d_model != d_model or gate.num_experts != num_experts:
            raise ValueError(f"{where}: the gate must route d_model={d_model} to num_experts="
                             f"{num_experts} (got {gate.d_model} -> {gate.num_experts})")
        return gate
    if gate not in GATES:
        raise ValueError(f"{where}: gate must be one of {list(GATES)} or a Gate instance (got "
                         f"{gate!r})")
    if gate == "dts":
        if capacity_factor not in (_AUTO, None):
            raise ValueError(f"{where}: the DTS gate has no capacity limit (as in EvoMoE); "
                             f"expected capacity_factor=None (got {capacity_factor!r})")
        return DTSGate(d_model, num_experts, temperature=temperature, threshold=threshold,
                       check_finite=check_finite)
    cf = 1.25 if capacity_factor == _AUTO else capacity_factor
    return TopKGate(d_model, num_experts, k=1 if gate == "switch" else 2, capacity_factor=cf,
                    check_finite=check_finite)


class MoE(nn.Module):
    r"""A mixture-of-experts feed-forward layer: [..., d_model] -> [..., d_model].

    ``y_n = sum_{e : D[n, e]} C[n, e] * expert_e(x_n)`` (module docstring), each expert a
    ``FeedForward(d_model, hidden)`` (hidden defaults to 4 d_model), run once on its rows.

    Options (keyword-only): ``gate`` ("switch", "gshard", "dts" or a :class:`Gate`);
    ``capacity_factor`` (top-k gates; default 1.25; None: no limit; the DTS gate has none);
    ``temperature`` and ``threshold`` (DTS); ``hidden``; ``dropout`` (inside the experts);
    ``check_finite`` (refuse NaN/inf router logits, a host sync per call).

    As a transformer FFN: ``GPT(..., ffn=lambda d, layer: MoE(d, 8, gate="dts"))``.
    After each forward: ``aux_loss`` (scalar tensor, differentiable) and ``last_stats``
    (``active``: mean experts per token; ``load`` [E]: assignments per expert after dropping;
    ``dropped``: assignments dropped for capacity; ``tokens``: N).
    """

    def __init__(self, d_model: int, num_experts: int, *, hidden: int | None = None,
                 gate="switch", capacity_factor=_AUTO, temperature: float = 2.0,
                 threshold: float = 0.02, dropout: float = 0.0, check_finite: bool = True):
        super().__init__()
        where = type(self).__name__
        self.d_model = check_int(where, "d_model", d_model)
        self.num_experts = check_int(where, "num_experts", num_experts)
        self.hidden = 4 * self.d_model if hidden is None else check_int(where, "hidden", hidden)
        check_prob(where, "dropout", dropout)
        if capacity_factor != _AUTO:
            _check_capacity_factor(where, capacity_factor)
        self.gate = _make_gate(where, gate, self.d_model, self.num_experts, capacity_factor,
                               temperature, threshold, check_bool(where, "check_finite",
                                                                  check_finite))
        self.experts = nn.ModuleList(FeedForward(self.d_model, self.hidden, dropout)
                                     for _ in range(self.num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: dict = {}

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this module holds (all of them; a subset when expert
        parallel)."""
        return range(self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__}: expected input [..., {self.d_model}] (got "
                             f"shape {tuple(x.shape)})")
        tokens = x.reshape(-1, self.d_model)
        route = self.gate(tokens)
        y = self._mix(tokens, route.dispatch, route.combine)
        self.aux_loss = route.aux_loss
        with torch.no_grad():
            load = route.dispatch.sum(0)
            self.last_stats = {
                "tokens": tokens.shape[0], "load": load.cpu(), "dropped": route.dropped,
                "active": float(load.sum()) / max(1, tokens.shape[0])}
        return y.reshape(x.shape)

    @staticmethod
    def _slots(dispatch: torch.Tensor):
        """``(token [S], expert [S], counts [E])``: the dispatched (token, expert) pairs sorted
        by expert, then token (so each expert's rows are one contiguous block)."""
        tok, exp = dispatch.t().nonzero(as_tuple=True)[::-1]  # expert-major order
        return tok, exp, torch.bincount(exp, minlength=dispatch.shape[1])

    def _run_experts(self, rows: torch.Tensor, counts: list, experts) -> torch.Tensor:
        """Expert ``experts[i]`` on the ``counts[i]`` rows of its block of ``rows``; an expert
        with no rows is not called (so it gets no gradient, as in a per-token loop)."""
        outs = [expert(chunk) if chunk.shape[0] else chunk
                for expert, chunk in zip(experts, rows.split(counts))]
        return torch.cat(outs) if outs else rows

    def _mix(self, tokens, dispatch, combine):
        tok, exp, counts = self._slots(dispatch)
        out = self._run_experts(tokens[tok], counts.tolist(), self.experts)
        weight = combine[tok, exp].unsqueeze(1)
        return tokens.new_zeros(tokens.shape).index_add(0, tok, out * weight)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, hidden={self.hidden}"


def moe_layers(model: nn.Module) -> list:
    """Every :class:`MoE` inside ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of ``aux_loss`` over the MoE layers of ``model`` from their last forward (0.0 if
    none ran)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0


def set_temperature(model: nn.Module, temperature: float) -> int:
    """Set the temperature of every :class:`DTSGate` in ``model``; returns how many."""
    gates = [m for m in model.modules() if isinstance(m, DTSGate)]
    for g in gates:
        g.temperature = temperature
    return len(gates)


def dts_temperature(step: int, total_steps: int, *, start: float = 2.0, end: float = 0.3,
                    schedule: str = "cosine") -> float:
    r"""The DTS temperature at ``step`` of ``total_steps`` (clamped to the end after it):
    ``cosine``: ``end + (start - end) (1 + cos(pi s / S)) / 2`` (EvoMoE's heat scheduler shape);
    ``linear``: ``start + (end - start) s / S``; ``exponential``: ``start (end / start)^(s/S)``.
    """
    if total_steps < 1 or step < 0:
        raise ValueError(f"dts_temperature: expected step >= 0 and total_steps >= 1 (got step="
                         f"{step}, total_steps={total_steps})")
    if not (start > 0 and end > 0):
        raise ValueError(f"dts_temperature: temperatures must be > 0 (got start={start}, "
                         f"end={end})")
    s = min(step, total_steps) / total_steps
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * s))
    if schedule == "linear":
        return start + (end - start) * s
    if schedule == "exponential":
        return start * (end / start) ** s
    raise ValueError(f"dts_temperature: schedule must be 'cosine', 'linear' or 'exponential' "
                     f"(got {schedule!r})")


class MoEConv(Conv):
    r"""A GraphSAGE-mean layer whose ApplyVertex network is a mixture of experts::

        z_i  = W_l mean_{j -> i} x_j + b + W_r x_i          (the vertex program)
        x_i' = z_i + MoE(z_i)                                (ApplyVertex's MoE, per vertex)

    Shapes: ``x`` [N, in_channels] -> [N, out_channels]; the MoE maps out_channels to
    out_channels. ``moe`` options (keyword-only) are passed to :class:`MoE`;
    ``capacity_factor`` defaults to None here (no capacity limit), so the layer is row-wise.
    With ``num_experts=1`` it is the dense model ``z_i + FFN(z_i)`` (the gate's weight is 1).

    Why the MoE runs right after :meth:`propagate` instead of inside the traced
    ``apply_vertex``: ngra compiles ``apply_vertex`` by tracing it with torch.fx, and MoE
    routing is data dependent (which rows go to which expert, how many), so a traced MoE fails
    and the whole layer would fall back to eager execution (losing the fused g-SpMM). A
    capacity limit also makes a vertex's output depend on other vertices' routing (who came
    first in an expert's buffer), which ngra's row-wise checks rightly refuse on a DistGraph.
    ApplyVertex runs once on all N vertices both in memory and under the streaming Engine, so
    ``MoE(apply_vertex(v, acc))`` after propagate computes exactly the ApplyVertex network
    ``v, acc -> MoE(W_l acc + W_r h)``. On a DistGraph each worker routes its own vertices:
    with ``capacity_factor=None`` (the default here) routing is per row, so the result equals
    one process; with a capacity factor the capacity counts the worker's own vertices.
    """

    gather = "mean"

    def __init__(self, in_channels: int, out_channels: int, *, num_experts: int, gate="switch",
                 capacity_factor=None, **moe_options):
        super().__init__()
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.lin_l = nn.Linear(self.in_channels, self.out_channels)
        self.lin_r = nn.Linear(self.in_channels, self.out_channels, bias=False)
        self.moe = MoE(self.out_channels, num_experts, gate=gate,
                       capacity_factor=capacity_factor, **moe_options)

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels),
                f"num_experts={self.moe.num_experts}", f"gate={type(self.moe.gate).__name__}"]

    def apply_edge(self, e):
        return e.src["h"]

    def apply_vertex(self, v, acc):
        return self.lin_l(acc) + self.lin_r(v.data["h"])

    def forward(self, g, x: torch.Tensor) -> torch.Tensor:
        z = self.propagate(*self.prepare(g, x))
        return z + self.moe(z)
