"""Hook for the streaming engine: ``current_engine()`` is the engine of the innermost active
``with ngra.Engine(...)`` block, or None (run in memory)."""

from __future__ import annotations

import contextvars

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_engine", default=None)


def current_engine():
    return _ACTIVE.get()
