"""The streaming plan: the IR of a vertex program cut into its pre / edge / post parts
(:class:`StreamPlan`), and what those parts allow (which edge parts stream, replay or go chunk by
chunk). See :mod:`ngra.engine` for how the parts run."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import GRAPH_OPS, IR, Node
from ..ops import module_replayable, writes_in_place
from ..passes import is_pure, mixing_reason


_EDGE_OPS = tuple(GRAPH_OPS)  # every graph op runs in the edge part
_REDUCTIONS = tuple(name for name, op in GRAPH_OPS.items() if op.reduction)  # the Gathers


# -- splitting the IR --------------------------------------------------------------------------------
@dataclass
class StreamPlan:
    """The IR cut into pre / edge / post parts (see :mod:`ngra.engine`).

    ``needs``: ids of pre nodes the edge part reads; ``post_reads``: ids of pre nodes the post
    part reads (both stay alive until their part has run; other pre values are dropped after
    their last reader, as the in-memory executor does).
    """

    pre: list[Node]
    edge: list[Node]
    post: list[Node]
    reductions: list[Node]
    needs: set = field(default_factory=set)
    post_reads: set = field(default_factory=set)

    @classmethod
    def of(cls, ir: IR) -> "StreamPlan":
        edge_ids: set[int] = set()
        post_ids: set[int] = set()
        after_gather = False
        for n in ir.nodes:
            ins = n.inputs()
            if n.op == "output":
                continue
            # A global value read from edge values (a reduction over dim 0) is computed in the
            # edge part too; Engine.run refuses it when there is more than one column.
            if n.op in _EDGE_OPS or n.domain == "edge" or (
                    n.domain == "global" and any(id(a) in edge_ids and a.op not in _REDUCTIONS
                                                 for a in ins)):
                if n.op in _REDUCTIONS or any(id(a) in post_ids for a in ins):
                    # Reductions' outputs are vertex values; a node reading them is post.
                    (edge_ids if n.op in _REDUCTIONS else post_ids).add(id(n))
                    after_gather = after_gather or n.op in _REDUCTIONS
                else:
                    edge_ids.add(id(n))
            elif any(id(a) in post_ids or (id(a) in edge_ids and a.op in _REDUCTIONS) for a in ins):
                post_ids.add(id(n))
                after_gather = True
            elif after_gather and not is_pure(n):
                # A random vertex op written after the Gather (dropout in ApplyVertex) draws after
                # the edge part in memory: so it does here, or the two would draw other numbers.
                post_ids.add(id(n))
        pre = [n for n in ir.nodes if id(n) not in edge_ids and id(n) not in post_ids
               and n.op != "output"]
        edge = [n for n in ir.nodes if id(n) in edge_ids]
        post = [n for n in ir.nodes if id(n) in post_ids]
        pre_ids = {id(n) for n in pre}
        for n in edge:
            for a in n.inputs():
                if id(a) not in pre_ids and id(a) not in edge_ids:
                    raise ValueError(f"cannot stream: %{n.name} reads %{a.name}, which depends on "
                                     f"a Gather\nIR:\n{ir}")
        needs = {id(a) for n in edge for a in n.inputs() if id(a) in pre_ids}
        post_reads = {id(a) for n in [*post, ir.output] for a in n.inputs() if id(a) in pre_ids}
        return cls(pre, edge, post, [n for n in edge if n.op in _REDUCTIONS], needs, post_reads)


def _source_operands(plan: StreamPlan) -> list[int]:
    """Ids of the vertex values the edge part reads on the source side (``u`` of a g-SDDMM or
    g-SpMM, a scatter to ``src``), in plan order."""
    out: list[int] = []
    for n in plan.edge:
        if n.op in GRAPH_OPS:
            for side, a in zip(GRAPH_OPS[n.op].sides(n), n.args):
                if side == "src" and isinstance(a, Node) and id(a) not in out:
                    out.append(id(a))
    return out


def _check_rowwise(program, plan: StreamPlan, p: int) -> None:
    """Refuse an edge part that mixes rows across edges: the engine runs it on one column of
    edges at a time, where such an op (batch norm in training, softmax / norm / cumsum / flip over
    dim 0, a dim-0 mean, ...) would see only that column's rows and silently compute something
    else than in memory. (The edge softmax and the Gather are per destination, complete within a
    column.)"""
    for n in plan.edge:
        reason = mixing_reason(n, "edge")
        if reason is None:
            continue
        where = f" at {n.source}" if n.source else ""
        raise ValueError(
            f"ngra.Engine cannot stream {type(program.layer).__name__}: %{n.name} = "
            f"{n.format().split(' = ', 1)[1]}{where} mixes rows across edges ({reason}). The "
            f"engine runs the edge part on one column of edges at a time (P = {p}), where this "
            "op would see only that column's edges and give another result than in memory. "
            "Compute it in apply_vertex on vertex values (every vertex is present at once there), "
            "make it act per edge (a non-zero dim), or call the layer outside the Engine block "
            f"(in memory, where it is correct).\nIR:\n{program.ir}")


def _reducer(n: Node) -> str:
    return GRAPH_OPS[n.op].reducer(n)


def _chunkable_ops(plan: StreamPlan) -> bool:
    """Whether every graph op of the edge part combines exactly across a column's chunks."""
    return all(GRAPH_OPS[n.op].chunkable for n in plan.edge if n.op in GRAPH_OPS)


def _replayable(n: Node) -> bool:
    """Whether node ``n`` can be re-run on its own to rebuild a value autograd saved: anything
    but in-place ops (and modules that may be in place), which would change saved values (the
    facts: :mod:`ngra.ops`)."""
    if n.op in ("call_function", "call_method"):
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        return not writes_in_place(name, n.kwargs)
    if n.op == "call_module":
        return module_replayable(n.value)
    return True
