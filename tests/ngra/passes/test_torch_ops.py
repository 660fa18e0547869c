"""The table of torch-call facts (ngra.ops) that the passes and the engine read: its entries are
consistent, every rule has an implementation, and the flags agree with what torch does (views
share storage, row-wise ops keep rows, pure modules draw nothing)."""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
import torch.nn.functional as F

from ngra import ops, passes

E = 9
SUBSET = torch.tensor([6, 1, 8, 3])


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _callables(name):
    """Every torch callable of that name: Tensor method, torch / F / operator function."""
    found = [getattr(mod, name) for mod in (torch.Tensor, torch, F, operator)
             if callable(getattr(mod, name, None))]
    return list(dict.fromkeys(found))


def _same_rows(whole, part, idx) -> bool:
    """``part`` (computed on rows ``idx``) equals rows ``idx`` of ``whole``, item by item."""
    if isinstance(whole, (tuple, list)):
        return len(whole) == len(part) and all(_same_rows(w, p, idx) for w, p in zip(whole, part))
    return part.shape == whole[idx].shape and torch.allclose(part.double(), whole[idx].double(),
                                                           equal_nan=True)


# --- consistency ----------------------------------------------------------------------------------
def test_every_entry_is_consistent_and_every_rule_is_implemented():
    implemented = set(passes._ROW_RULES) | set(passes._ROW_RULES_ON_ROWS)
    assert implemented == set(ops.ROW_RULES)
    assert not set(passes._ROW_RULES) & set(passes._ROW_RULES_ON_ROWS)
    for name, op in ops.TORCH_OPS.items():
        assert op.name == name
        assert op.rows is None or op.rows in ops.ROW_RULES, op
        assert (op.rows is None) == op.random, op  # only random draws have no rule
        assert (op.dim is not None) == (op.rows == "dim"), op
        assert not (op.reorders or op.binary_form) or op.rows == "dim", op
        assert not name.startswith("_") and name == name.strip()
        assert _callables(name) or name in ("getattr", "linear_group"), \
            f"{name} is no torch function or method"  # linear_group: ngra.passes.group_linears
    for cls, m in ops.TORCH_MODULES.items():
        assert m.cls is cls and issubclass(cls, torch.nn.Module)
        assert m.rows in (None, "rowwise", "dim", "stats"), m
        assert (m.dim_attr is not None) == (m.rows == "dim"), m
        if m.dim_attr:
            assert m.dim_attr in inspect.signature(cls.__init__).parameters, m
        assert not m.pure or m.rows in ("rowwise", "dim"), m  # pure ones are all analysed
        assert not m.vector_rows or m.rows == "rowwise", m


def test_in_place_forms_and_in_place_arguments():
    assert ops.torch_op("clamp_") is ops.TORCH_OPS["clamp"]  # element-wise: as out of place
    assert ops.torch_op("uniform_").random
    assert ops.torch_op("unsqueeze_") is None  # not element-wise: not known
    assert ops.torch_op("_foo_") is None
    for name, kwargs in [("mul_", {}), ("add", {"out": None}), ("relu", {"inplace": True})]:
        assert ops.writes_in_place(name, kwargs)
    assert not ops.writes_in_place("relu", {"inplace": False})
    assert ops.module_replayable(torch.nn.ReLU()) and not ops.module_replayable(
        torch.nn.ReLU(inplace=True))
    assert ops.module_pure(torch.nn.Linear(2, 2)) and not ops.module_pure(torch.nn.Dropout())
    assert ops.module_rows(torch.nn.BatchNorm2d(2)).rows == "stats"
    assert ops.module_rows(torch.nn.Conv1d(2, 2, 1)) is None


# --- views ----------------------------------------------------------------------------------------
VIEW_CALLS = {  # name -> the call on x [E, 4, 3]
    "detach": lambda x: x.detach(), "view": lambda x: x.view(-1, 12),
    "view_as": lambda x: x.view_as(x), "expand_as": lambda x: x[:, :1].expand_as(x),
    "unsqueeze": lambda x: x.unsqueeze(1), "squeeze": lambda x: x[:, :1].squeeze(1),
    "transpose": lambda x: x.transpose(1, 2), "swapaxes": lambda x: x.swapaxes(1, 2),
    "swapdims": lambda x: x.swapdims(1, 2), "movedim": lambda x: x.movedim(1, 2),
    "moveaxis": lambda x: x.moveaxis(1, 2), "permute": lambda x: x.permute(0, 2, 1),
    "expand": lambda x: x[:, :1].expand(-1, 5, -1), "narrow": lambda x: x.narrow(1, 1, 2),
    "select": lambda x: x.select(1, 2), "unflatten": lambda x: x.unflatten(1, (2, 2)),
    "unbind": lambda x: x.unbind(1), "split": lambda x: x.split(2, 1),
    "chunk": lambda x: x.chunk(2, 1),
}
COPY_CALLS = {
    "clone": lambda x: x.clone(), "repeat": lambda x: x.repeat(1, 2, 1),
    "tile": lambda x: x.tile(2), "index_select": lambda x: x.index_select(1, torch.tensor([0])),
    "cumsum": lambda x: x.cumsum(1), "cat": lambda x: torch.cat([x, x], 1),
}


def _storages(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return {o.untyped_storage().data_ptr() for o in outs}


def test_view_ops_share_storage_and_others_copy():
    assert set(VIEW_CALLS) == {n for n, op in ops.TORCH_OPS.items() if op.view}
    x = torch.randn(E, 4, 3, generator=_gen())
    for name, call in VIEW_CALLS.items():
        assert _storages(call(x)) == _storages(x), name
    for name, call in COPY_CALLS.items():
        assert not ops.TORCH_OPS[name].view
        assert not _storages(call(x)) & _storages(x), name


# --- row-wise ops keep rows -------------------------------------------------------------------------
def test_element_wise_ops_keep_rows():
    """Every element-wise entry, as torch runs it on one or two row-aligned tensors, gives on a
    subset of the rows those rows of its result."""
    x = torch.rand(E, 4, generator=_gen(1)) * 0.8 + 0.1  # inside every op's domain
    y = torch.rand(E, 4, generator=_gen(2)) * 0.8 + 0.1
    checked = set()
    for name, op in ops.TORCH_OPS.items():
        if op.rows != "elementwise":
            continue
        for fn in _callables(name):
            for args in ((x,), (x, y), (x > 0.5, x, y), (x, y, x)):
                try:
                    whole = fn(*args)
                except (TypeError, RuntimeError):
                    continue
                if not isinstance(whole, torch.Tensor) or whole.shape[:1] != (E,):
                    continue
                part = fn(*(a[SUBSET] for a in args))
                assert _same_rows(whole, part, SUBSET), (name, fn)
                checked.add(name)
                break
    missing = {n for n, op in ops.TORCH_OPS.items() if op.rows == "elementwise"} - checked
    # ones that need other operands (ints, dtypes, masks with a value, ...)
    assert missing <= {"to", "type", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
                       "invert", "and_", "or_", "xor", "masked_fill", "lerp", "clamp_min",
                       "clamp_max", "threshold", "where"}, missing
    assert len(checked) > 90


DIM_EXTRA = {  # positional arguments around the dim (inserted at its position)
    "norm": (2,), "normalize": (2,), "topk": (1,), "kthvalue": (1,), "diff": (1,),
    "roll": (1,), "chunk": (2,), "split": (2,), "narrow": (0, 2), "select": (1,),
    "index_select": (torch.tensor([2, 0]),), "unflatten": ((2, 2),),
}


@pytest.mark.parametrize("name", sorted(n for n, op in ops.TORCH_OPS.items() if op.rows == "dim"))
def test_ops_along_a_dim_keep_rows_along_dim_1(name):
    """Along a non-zero dim (what row_mixing accepts) the op keeps rows; over dim 0 (what it
    refuses) the combining ones do not."""
    op = ops.TORCH_OPS[name]
    pos = op.dim[0]
    x = torch.rand(E, 4, 3, generator=_gen(3))

    def call(t, dim):
        extra = list(DIM_EXTRA.get(name, ()))
        args = (*extra[:pos], dim, *extra[pos:])
        if hasattr(t, name):
            return getattr(t, name)(*args)
        return (getattr(torch, name, None) or getattr(F, name))(t, *args)

    whole = call(x, 1)
    assert _same_rows(whole, call(x[SUBSET], 1), SUBSET)
    if not op.reorders and name not in ("max", "min", "all", "any", "count_nonzero"):
        try:
            whole0, part0 = call(x, 0), call(x[SUBSET], 0)
        except RuntimeError:  # glu: dim 0 of odd size
            return
        first = whole0[0] if isinstance(whole0, tuple) else whole0
        assert first.shape[:1] != (E,) or not _same_rows(whole0, part0, SUBSET)


ROWWISE_MODULES = {  # class name -> (module, input on E rows)
    "Linear": lambda: torch.nn.Linear(4, 3), "Bilinear": lambda: torch.nn.Bilinear(4, 4, 2),
    "LayerNorm": lambda: torch.nn.LayerNorm(4), "GroupNorm": lambda: torch.nn.GroupNorm(2, 4),
    "RMSNorm": lambda: torch.nn.RMSNorm(4), "Embedding": lambda: torch.nn.Embedding(5, 3),
    "RNNCell": lambda: torch.nn.RNNCell(4, 3), "GRUCell": lambda: torch.nn.GRUCell(4, 3),
    "LSTMCell": lambda: torch.nn.LSTMCell(4, 3), "Threshold": lambda: torch.nn.Threshold(0.3, 0.0),
    "Dropout": lambda: torch.nn.Dropout().eval(),
}


def test_row_wise_modules_keep_rows_and_pure_ones_draw_nothing():
    torch.manual_seed(0)
    x = torch.randn(E, 4, generator=_gen(4))
    ids = torch.randint(0, 5, (E,), generator=_gen(5))
    seen = set()
    for cls, spec in ops.TORCH_MODULES.items():
        if spec.rows != "rowwise":
            continue
        m = ROWWISE_MODULES.get(cls.__name__, cls)()
        args = (ids,) if cls is torch.nn.Embedding else (x, x) if cls is torch.nn.Bilinear else (x,)
        state = torch.get_rng_state()
        whole = m(*args)
        if spec.pure:
            assert torch.equal(torch.get_rng_state(), state), cls
            torch.testing.assert_close(m(*args), whole)
        assert _same_rows(whole, m(*(a[SUBSET] for a in args)), SUBSET), cls
        seen.add(cls)
    assert len(seen) >= 32


def test_random_ops_draw():
    x = torch.rand(E, 4)
    for call in (lambda: F.dropout(x, 0.5), lambda: torch.rand_like(x),
                 lambda: x.clone().uniform_(), lambda: torch.bernoulli(x),
                 lambda: F.gumbel_softmax(x)):
        state = torch.get_rng_state()
        call()
        assert not torch.equal(torch.get_rng_state(), state)
    assert all(ops.TORCH_OPS[n].random for n in ("dropout", "rand_like", "uniform_", "bernoulli",
                                                 "gumbel_softmax"))
