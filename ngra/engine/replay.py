"""Backward of a streamed column without keeping its edge values: saved-tensor hooks that
rebuild them by re-running the column's edge part when backward first needs them
(:class:`_Replay`; see :mod:`ngra.engine`, "Memory and backward")."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .run import _Run


class _Token:
    """What autograd keeps for one tensor it saved in a column (see :class:`_Replay`)."""

    __slots__ = ("kind", "tensor", "node", "ordinal", "ptr", "dtype", "device", "size", "stride",
                 "offset", "attr", "used")

    def __init__(self, kind, t, node, ordinal):
        self.kind, self.node, self.ordinal, self.used = kind, node, ordinal, False
        self.tensor = t if kind == "keep" else None
        self.attr = None
        self.ptr = t.untyped_storage().data_ptr() if t.layout == torch.strided else 0
        self.dtype, self.device = t.dtype, t.device
        self.size, self.stride = tuple(t.shape), t.stride() if t.layout == torch.strided else ()
        self.offset = t.storage_offset() if t.layout == torch.strided else 0


class _Capture:
    """Watches a column's re-run for :class:`_Replay`: keeps the outputs of the nodes in
    ``values`` and, as a saved-tensor pack hook, the tensors saved at ``saves`` positions
    ``(node, ordinal)``. (A module-level class: one defined inside a method would live in a
    reference cycle, and keep the replay and its tensors alive until the garbage collector.)"""

    def __init__(self, values: set, saves: set, into_values: dict, into_saves: dict):
        self.node = -1
        self.ordinal: dict[int, int] = {}
        self._values, self._saves = values, saves
        self._into_values, self._into_saves = into_values, into_saves

    def done(self, k: int, value) -> None:
        if k in self._values:
            # Detached: the re-run's own autograd graph (which holds this capture through its
            # hooks) must not be kept alive by what it produced.
            self._into_values[k] = value.detach()

    def pack(self, t):
        k = self.node
        o = self.ordinal[k] = self.ordinal.get(k, -1) + 1
        if (k, o) in self._saves:
            self._into_saves[(k, o)] = t.detach()
        # The re-run's graph is never backpropagated: it keeps nothing. (Returning ``t`` would
        # tie an op's output to the node that saved it, a cycle through C++ that no collector
        # sees.)
        return None


def _never_unpacked(_):
    raise RuntimeError("internal: a column's re-run graph was backpropagated")


class _Replay:
    """Saved-tensor hooks of one column: its edge-level values are not kept for backward but
    rebuilt when backward first needs them, by re-running the edge part up to the last node
    whose value (or saved tensor) is needed: never the reductions themselves, whose backward
    needs only their inputs. (``torch.utils.checkpoint`` would re-run the whole column,
    reductions included: a custom autograd Function packs its saved tensors only after its
    forward ran, so checkpointing cannot stop before the kernel.)

    At pack time each saved tensor becomes a :class:`_Token`:

    - ``keep``: tensors that are not the column's own (vertex operands, parameters, edge
      inputs, the index arrays of cached columns): kept as they are;
    - ``value``: a view of the output of edge node ``k``: rebuilt as that view of the re-run
      node's output;
    - ``index``: an index array of a store's column: read again with the column;
    - ``saved``: anything else a node saved (a max/min reduction's arg-max): re-run through
      that node under autograd, capturing its saved tensors by position;
    - ``empty``: a tensor with no elements (an empty column's), made anew.

    A token never holds an op's output: the output's node holds the token, so that would be a
    reference cycle through autograd's C++ objects, which no garbage collector sees.

    Random ops replay with the random state the column started with. When every token has been
    unpacked, the rebuilt values are dropped.
    """

    def __init__(self, run: _Run, j: int, vert: dict):
        self.run, self.j, self.vert = run, j, vert
        self.node = -1
        self.ordinal: dict[int, int] = {}
        self.tokens: list[_Token] = []
        self.outputs: dict[int, tuple] = {}  # live storage -> (node, dtype, weakref)
        self.col = None
        self.values = self.saves = None
        self.pending = 0
        dev = run.device
        self.rng = (torch.get_rng_state(),
                    torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        own = [t for t in [*vert.values(), *run.src_vert.values()] if isinstance(t, torch.Tensor)]
        own += [*run.edata.values(), *run.layer.parameters(), *run.layer.buffers()]
        self.keep = {t.untyped_storage().data_ptr() for t in own}

    def forward(self):
        run = self.run
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            self.col = run.loader.get(self.j, self.j + 1)
            env = run._edge_part(self.col, self.vert, watch=self)
        self.col = None  # a store's column is read again if backward needs its index arrays
        self.node = -1
        # Only packing reads it, and its weakref callbacks refer back to self: a cycle that
        # would keep the call's tensors alive until the garbage collector ran.
        self.outputs = None
        return tuple(env[id(r)] for r in run.plan.reductions)

    def done(self, k: int, value) -> None:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and value.numel():
            st = value.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.outputs:  # a view keeps its base's node
                # Forgotten when the storage is freed: its address may then be reused.
                outputs = self.outputs
                self.outputs[ptr] = (k, value.dtype, weakref.ref(st, lambda _, p=ptr:
                                                                  outputs.pop(p, None)))
            for tok in self.tokens:  # what node k saved of its own output is a value too
                if tok.kind == "saved" and tok.node == k and tok.ptr == ptr \
                        and tok.dtype == value.dtype:
                    tok.kind = "value"
        for tok in self.tokens:
            if tok.node == k:
                tok.tensor = None  # held through node k only, so that addresses stay unique

    def _index_attr(self, ptr: int):
        col = self.col
        for attr, t in (("indptr", col.csr.indptr), ("indices", col.csr.indices),
                        ("eids", col.csr.eids), ("col_eids", col.eids)):
            if t.numel() and t.untyped_storage().data_ptr() == ptr:
                return attr
        return None

    def pack(self, t):
        k = self.node
        ordinal = self.ordinal[k] = self.ordinal.get(k, -1) + 1
        if t.layout != torch.strided:
            return _Token("keep", t, k, ordinal)
        if t.numel() == 0:  # made anew (holding it could tie an output to its own node)
            return _Token("empty", t, k, ordinal)
        ptr = t.untyped_storage().data_ptr()
        hit = self.outputs.get(ptr)
        if hit is not None and hit[1] == t.dtype:
            tok = _Token("value", t, hit[0], ordinal)
            tok.tensor = None
        elif ptr in self.keep:
            tok = _Token("keep", t, k, ordinal)
        elif (attr := self._index_attr(ptr)) is not None:
            tok = _Token("keep" if self.run.layout.cached else "index", t, k, ordinal)
            tok.attr = attr
        else:
            tok = _Token("saved", t, k, ordinal)
            tok.tensor = t  # until node k is done (see done())
        if tok.kind not in ("keep", "empty"):
            self.tokens.append(tok)
            self.pending += 1
        return tok

    def unpack(self, tok):
        if tok.kind == "keep":
            return tok.tensor
        if tok.kind == "empty":
            return torch.empty_strided(tok.size, tok.stride, dtype=tok.dtype, device=tok.device)
        if self.values is None:
            self._rebuild()
        if tok.kind == "index":
            t = self.col.eids if tok.attr == "col_eids" else getattr(self.col.csr, tok.attr)
        elif tok.kind == "value":
            t = self.values[tok.node].as_strided(tok.size, tok.stride, tok.offset)
        else:
            t = self.saves[(tok.node, tok.ordinal)]
        if not tok.used:
            tok.used = True
            self.pending -= 1
            if self.pending == 0:  # the column's backward has everything: let it all go
                self.values = self.saves = self.col = None
        return t

    def _rebuild(self) -> None:
        """Re-run the column's edge part up to the last node a token needs."""
        run = self.run
        self.col = run.loader.get(self.j, self.j - 1)
        for tok in self.tokens:  # a second backward (retain_graph) frees the values again
            tok.used = False
        self.pending = len(self.tokens)
        values = {tok.node for tok in self.tokens if tok.kind == "value"}
        saves = {(tok.node, tok.ordinal) for tok in self.tokens if tok.kind == "saved"}
        upto = max((tok.node for tok in self.tokens if tok.kind in ("value", "saved")), default=-1)
        self.values, self.saves = {}, {}
        if upto < 0:
            return
        cap = _Capture(values, saves, self.values, self.saves)
        cpu, cuda = self.rng
        devices = [run.device.index or 0] if cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, run.device)
            if saves:  # saved tensors only exist where autograd records
                with torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(cap.pack, _never_unpacked):
                    run._edge_part(self.col, self.vert, upto=upto, watch=cap)
            else:
                with torch.no_grad():
                    run._edge_part(self.col, self.vert, upto=upto, watch=cap)
