"""What ngra knows of the torch calls in a traced program: one table that the passes and the
streaming engine read (the graph ops' table is :data:`ngra.ir.GRAPH_OPS`).

- :data:`TORCH_OPS`: per function / Tensor method, by its short name (``torch.relu``,
  ``F.relu`` and ``x.relu()`` are all ``"relu"``): a :class:`TorchOp`;
- :data:`TORCH_MODULES`: per module class (a subclass has its base's facts): a
  :class:`TorchModule`;
- :data:`TENSOR_META`: tensor attributes that describe it (``x.shape``, ``x.dtype``), no rows.

The readers: :func:`ngra.passes.is_pure` (dce, cse), :func:`ngra.passes.row_mixing` (lift, the
engine's and a worker's row checks) and ``ngra.engine.plan._replayable`` (autograd replay).

*Row-wise* means: row k of the output depends only on row k of the per-edge (per-vertex)
operands, so the op gives the same rows on any subset of the rows (one column of a streamed
graph, one worker's piece) and can be computed once per vertex instead of once per edge (lift).
Whether a call is row-wise may depend on its arguments (``x.sum(1)`` is, ``x.sum(0)`` is not);
``TorchOp.rows`` names the rule that decides it, implemented in :mod:`ngra.passes`. A call not
in the table counts as mixing rows: always correct in memory, never lifted or streamed. (Purity
needs no entry: any torch or ``operator`` function or Tensor method is pure unless it draws
random numbers or writes in place; a module is pure only if its entry says so.)

In place: by torch's convention a name ending in ``_`` (``x.mul_(2)``), or an ``out=`` or
``inplace=True`` argument, writes into an existing tensor (:func:`writes_in_place`). The in-place
form of an element-wise op (``x.clamp_(0)``) is row-wise as its out-of-place form
(:func:`torch_op`), but never pure or replayable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TorchOp", "TorchModule", "TORCH_OPS", "TORCH_MODULES", "TENSOR_META", "ROW_RULES",
           "torch_op", "writes_in_place", "module_pure", "module_replayable", "module_rows"]

# The rules of TorchOp.rows; each is implemented in ngra.passes (_ROW_RULES).
ROW_RULES = {
    "always": "row-wise whatever its arguments (x.dim(), x.type_as(y))",
    "getattr": "an attribute of TENSOR_META (x.shape, x.dtype); any other keeps no known rows",
    "getitem": "x[idx]: row-wise when idx keeps dim 0 whole (x[:, 1], x[..., :3])",
    "size": "x.size(d): row-wise unless it reads the number of rows (x.size(0), x.size())",
    "elementwise": "element by element: row-wise when broadcasting keeps the operands' rows "
                   "aligned (per-row operands of one rank, others without a dim 0 of their own)",
    "like": "shaped like its second operand (x.view_as(y)): row-wise when that has rows",
    "matmul": "x @ w: row-wise for a per-row x and a parameter w (or batched over the rows)",
    "embedding": "a parameter table indexed by per-row ids",
    "cat": "cat / stack of per-row values: row-wise along a non-zero dim",
    "reshape": "x.view(-1, *feature_shape): row-wise when dim 0 stays the rows (-1 first)",
    "unsqueeze": "row-wise for a new dim other than 0",
    "swap": "transpose(d0, d1): row-wise when neither is dim 0",
    "move": "movedim(source, destination): row-wise when neither is dim 0",
    "permute": "permute(dims): row-wise when dims[0] is 0",
    "expand": "expand / repeat / tile: row-wise when dim 0 is kept (-1 for expand, 1 for repeat)",
    "dim": "acts along the dim argument (TorchOp.dim): row-wise when no dim is 0",
}


@dataclass(frozen=True)
class TorchOp:
    """What one torch function / Tensor method does, as the passes and the engine need it.

    - ``rows``: the rule (a key of :data:`ROW_RULES`) deciding whether a call is row-wise; None:
      never known to be (random draws: see ``random``);
    - ``dim``: for ``rows="dim"``, ``(position, keyword, default)`` of its dim argument
      (position counted after the tensor; default None: all dims, i.e. including dim 0);
    - ``random``: draws random numbers, so it is impure (never dropped or merged) and its rows
      depend on the order of the draws; dropout with a per-edge mask is the exception (see
      :func:`ngra.executor.dropout_spec`);
    - ``view``: always returns a view of its first operand (shares its storage);
    - ``reorders``: over dim 0 it moves, selects or merges rows (flip, sort, narrow), rather
      than combining their values (sum, softmax); only the wording of an error depends on it;
    - ``binary_form``: with a tensor as second operand it is the element-wise form
      (``torch.max(a, b)``), otherwise a reduction along ``dim``.
    """

    name: str
    rows: str | None
    dim: tuple[int, str, Any] | None = None
    random: bool = False
    view: bool = False
    reorders: bool = False
    binary_form: bool = False


def _group(rows: str | None, names: str, **facts) -> list[TorchOp]:
    return [TorchOp(name, rows, **facts) for name in names.split()]


def _dim(names: str, pos: int = 0, kw: str = "dim", default=None, **facts) -> list[TorchOp]:
    return _group("dim", names, dim=(pos, kw, default), **facts)


TORCH_OPS: dict[str, TorchOp] = {op.name: op for op in (
    # random draws (the trailing-underscore ones fill a tensor in place)
    *_group(None, "dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d rand "
            "randn randint rand_like randn_like randint_like bernoulli multinomial normal "
            "poisson randperm rrelu gumbel_softmax uniform_ normal_ exponential_ geometric_ "
            "cauchy_ log_normal_", random=True),
    # element-wise, one operand
    *_group("elementwise", "relu sigmoid tanh exp log abs neg sqrt rsqrt square sin cos erf "
            "leaky_relu elu gelu silu selu celu softplus mish hardtanh relu6 clamp clip float "
            "double half bfloat16 to contiguous reciprocal sign log1p expm1 logsigmoid softsign "
            "tanhshrink hardsigmoid hardswish tan asin acos atan sinh cosh asinh acosh atanh exp2 "
            "log2 log10 floor ceil round trunc frac erfc erfinv logit sgn positive isnan isinf "
            "isfinite logical_not bitwise_not invert nan_to_num clone long int bool type "
            "clamp_min clamp_max threshold hardshrink softshrink"),
    *_group("elementwise", "detach", view=True),
    # element-wise, two or more operands (broadcast)
    *_group("elementwise", "add sub mul div truediv pow maximum minimum floordiv remainder fmod "
            "mod atan2 hypot eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and "
            "bitwise_or bitwise_xor and_ or_ xor where masked_fill lerp addcmul addcdiv rsub "
            "true_divide floor_divide multiply subtract divide fmax fmin copysign xlogy"),
    # reductions, scans and normalizations along a dim
    *_dim("sum mean nansum nanmean amax amin prod logsumexp var std all any argmax argmin "
          "median count_nonzero softmax log_softmax softmin cumsum cumprod cummax cummin "
          "logcumsumexp"),
    *_dim("max min", binary_form=True),
    *_dim("norm", 1),
    *_dim("normalize", 1, default=1),
    *_dim("glu", default=-1),
    # reordering, selecting, splitting and merging along a dim
    *_dim("sort argsort", default=-1, reorders=True),
    *_dim("topk kthvalue", 1, default=-1),
    *_dim("diff", 1, default=-1),
    *_dim("flip", kw="dims", reorders=True),
    *_dim("roll", 1, kw="dims", reorders=True),
    *_dim("squeeze unflatten narrow select", reorders=True, view=True),
    *_dim("unbind", default=0, reorders=True, view=True),
    *_dim("flatten", kw="start_dim", default=0, reorders=True),
    *_dim("chunk split", 1, default=0, reorders=True, view=True),
    *_dim("index_select", reorders=True),
    # shapes and layouts
    *_group("reshape", "reshape"),
    *_group("reshape", "view", view=True),
    *_group("unsqueeze", "unsqueeze", view=True),
    *_group("swap", "transpose swapaxes swapdims", view=True),
    *_group("move", "movedim moveaxis", view=True),
    *_group("permute", "permute", view=True),
    *_group("expand", "expand", view=True),
    *_group("expand", "repeat tile"),
    *_group("like", "reshape_as"),
    *_group("like", "view_as expand_as", view=True),
    *_group("always", "type_as dim ndimension"),
    *_group("cat", "cat concat stack"),
    *_group("matmul", "matmul mm bmm linear linear_group"),  # linear_group: ngra.passes
    *_group("embedding", "embedding"),
    *_group("getattr", "getattr"),
    *_group("getitem", "getitem"),
    *_group("size", "size"),
)}

TENSOR_META = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad",
                         "is_sparse"})


def torch_op(name: str) -> TorchOp | None:
    """The table's entry for ``name``; the in-place form of an element-wise op (``clamp_``) has
    its out-of-place form's entry."""
    op = TORCH_OPS.get(name)
    if op is None and name.endswith("_") and not name.startswith("_"):
        base = TORCH_OPS.get(name[:-1])
        if base is not None and base.rows == "elementwise":
            return base
    return op


def writes_in_place(name: str, kwargs: dict) -> bool:
    """Whether a call of ``name`` with ``kwargs`` writes into an existing tensor (torch's
    trailing-underscore convention, ``out=``, ``inplace=True``)."""
    return name.endswith("_") or "out" in kwargs or bool(kwargs.get("inplace"))


@dataclass(frozen=True)
class TorchModule:
    """What calling a module of class ``cls`` (or of a subclass) does.

    - ``pure``: deterministic and without side effects (dce may drop it, cse merge it, lift move
      it to the vertices); dropout draws, batch norm updates its running statistics;
    - ``rows``: ``"rowwise"`` (each row on its own), ``"dim"`` (along the dim named by the
      attribute ``dim_attr``: row-wise when it is not 0) or ``"stats"`` (row-wise only in eval
      mode with running statistics: batch norm); None: mixes rows or is not known not to;
    - ``vector_rows``: a 1-d input is one value per row (Embedding's ids), not one sample;
    - ``replayable``: can be re-run on its own to rebuild a value autograd saved (unless built
      with ``inplace=True``).
    """

    cls: type
    pure: bool = False
    rows: str | None = None
    dim_attr: str | None = None
    vector_rows: bool = False
    replayable: bool = False


def _modules(names: str, **facts) -> list[TorchModule]:
    return [TorchModule(getattr(torch.nn, name), **facts) for name in names.split()
            if hasattr(torch.nn, name)]  # RMSNorm: torch >= 2.4


TORCH_MODULES: dict[type, TorchModule] = {m.cls: m for m in (
    *_modules("Linear ReLU LeakyReLU ELU GELU Sigmoid Tanh Softplus SiLU", pure=True,
              rows="rowwise", replayable=True),
    *_modules("Identity", pure=True, rows="rowwise", vector_rows=True, replayable=True),
    *_modules("SELU CELU Softsign Hardtanh ReLU6 Mish LayerNorm PReLU", pure=True,
              rows="rowwise"),
    *_modules("Bilinear Hardsigmoid Hardswish LogSigmoid Tanhshrink Softshrink Hardshrink "
              "Threshold GroupNorm RNNCell GRUCell LSTMCell RMSNorm", rows="rowwise"),
    *_modules("Embedding", rows="rowwise", vector_rows=True),
    *_modules("Dropout", rows="rowwise", replayable=True),
    TorchModule(torch.nn.modules.dropout._DropoutNd, replayable=True),
    *_modules("Softmax LogSoftmax", pure=True, rows="dim", dim_attr="dim"),
    *_modules("Softmin GLU", rows="dim", dim_attr="dim"),
    *_modules("Flatten", pure=True, rows="dim", dim_attr="start_dim"),
    *_modules("Unflatten", rows="dim", dim_attr="dim"),
    TorchModule(torch.nn.modules.batchnorm._BatchNorm, rows="stats"),
)}


def _classes(**facts) -> tuple[type, ...]:
    return tuple(m.cls for m in TORCH_MODULES.values()
                 if all(getattr(m, k) == v for k, v in facts.items()))


def module_pure(m: torch.nn.Module) -> bool:
    """Whether calling ``m`` is pure (:attr:`TorchModule.pure`)."""
    return isinstance(m, _classes(pure=True))


def module_replayable(m: torch.nn.Module) -> bool:
    """Whether a call of ``m`` can be re-run to rebuild a saved value (not in place)."""
    return isinstance(m, _classes(replayable=True)) and not getattr(m, "inplace", False)


def module_rows(m: torch.nn.Module) -> TorchModule | None:
    """The entry deciding whether ``m`` acts row by row: batch norm's, else a dim module's, else
    a row-wise module's (a subclass of several has the first); None: not known to."""
    for rows in ("stats", "dim", "rowwise"):
        for cls in _classes(rows=rows):
            if isinstance(m, cls):
                return TORCH_MODULES[cls]
    return None
