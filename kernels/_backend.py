"""Backend selection: one place that turns ``backend="auto"`` (or an override) into a module.

A backend module provides the primitives the autograd Functions are written against:

- ``spmm(csr, binop, reduce, lhs, rhs, need_arg=True) -> (out, arg)``: ``out`` [num_dst, *fo];
  ``reduce`` in sum/mean/max/min; for max/min with ``need_arg``, ``arg`` records which edge won
  each output element (the smallest edge id among ties) in a backend-specific form (the torch
  and CUDA backends: [num_dst, *fo] int64 edge ids, -1 where a destination has no in-edge; numba:
  a bit mask per CSR position), else ``None``.
- ``spmm_arg_backward(csr, binop, arg, g, lhs, rhs, need_lhs, need_rhs) -> (grad_lhs,
  grad_rhs)``: max/min gradients routed through ``arg``, in the operands' own shapes.
- ``sddmm(csr, binop, lhs, lhs_target, rhs, rhs_target) -> out`` [E, *fo] in original edge order.
- ``edge_softmax(csr, scores) -> y`` and ``edge_softmax_backward(csr, y, grad_y) -> grad_scores``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings

from ._ops import check_choice

BACKENDS = ("auto", "numba", "numba_cuda", "torch")

_lock = threading.Lock()
_default = "auto"
_override: list[str] = []  # stack of use_backend() contexts, innermost last
_modules: dict = {}
_unusable: dict = {}  # backend name -> reason it cannot be imported/used


def set_default_backend(name: str) -> None:
    """Set the process-wide backend that ``backend="auto"`` resolves to (``"auto"`` restores
    selection by device)."""
    global _default
    check_choice("backend", name, BACKENDS)
    _default = name


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, ``backend="auto"`` calls resolve to ``name`` (process-wide)."""
    check_choice("backend", name, BACKENDS)
    with _lock:
        _override.append(name)
    try:
        yield
    finally:
        with _lock:
            _override.pop()


def _load(name: str):
    if name in _modules:
        return _modules[name]
    if name in _unusable:
        return None
    modname = {"torch": "._torch_backend", "numba": "._numba_cpu", "numba_cuda": "._numba_cuda"}[name]
    try:
        mod = importlib.import_module(modname, __package__)
        reason = mod.unusable_reason() if hasattr(mod, "unusable_reason") else None
    except ImportError as err:  # numba missing or broken: fall back to the torch reference
        mod, reason = None, f"{type(err).__name__}: {err}"
    if reason is not None:
        _unusable[name] = reason
        return None
    _modules[name] = mod
    return mod


_warned: set = set()


def _warn_fallback(name: str) -> None:
    """Once per backend: "auto" runs the torch reference where ``name`` was wanted, and why (a
    GPU user would otherwise train on torch's slower ops without knowing)."""
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(f"backend='auto' uses the torch reference instead of {name!r}: "
                  f"{_unusable[name]}", RuntimeWarning, stacklevel=3)


def current_choice() -> str:
    """The name ``"auto"`` currently stands for (an override, the default, or ``"auto"``)."""
    if _override:
        return _override[-1]
    return _default


def resolve(backend: str, device, dtype=None):
    """Backend module for an explicit name or ``"auto"``, for ``dtype`` tensors on ``device``.

    ``"auto"`` takes numba on CPU and numba_cuda on CUDA, and the torch reference where that
    backend cannot be loaded or does not compute in ``dtype`` (e.g. float16 on CPU).
    """
    check_choice("backend", backend, BACKENDS)
    name = backend if backend != "auto" else current_choice()
    if name == "auto":
        name = "numba_cuda" if device.type == "cuda" else "numba"
        mod = _load(name)
        if mod is None:
            _warn_fallback(name)
            return _load("torch")
        if dtype is not None and dtype not in mod.DTYPES:
            return _load("torch")
        return mod
    mod = _load(name)
    if mod is None:
        raise ValueError(f"backend {name!r} is not usable here: {_unusable[name]}")
    if hasattr(mod, "check_device"):
        mod.check_device(device)
    return mod


def backend_name(backend: str, device, dtype=None) -> str:
    """Name of the module :func:`resolve` picks (for logs and benchmarks)."""
    return resolve(backend, device, dtype).NAME
