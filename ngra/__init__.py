"""ngra: GNN training on large graphs with SAGA-NN vertex programs.

Public surface: :class:`Graph`, :class:`VertexProgram`, :func:`compile`, the built-in message and
reducer descriptors in :mod:`ngra.fn`, the streaming :class:`Engine`, and :mod:`ngra.datasets`.
Everything else is importable but not advertised.
"""

import kernels as _kernels  # noqa: F401  (first: it picks OpenMP's wait policy before torch loads)

from . import datasets
from . import function as fn
from . import nn
from . import profile
from .engine import Engine
from .graph import Graph
from .ir import IR, IRError
from .program import NgraWarning, Program, VertexProgram, compile, eager

__version__ = "0.1.0"

__all__ = ["Graph", "VertexProgram", "Program", "compile", "eager", "fn", "Engine", "datasets", "nn", "profile", "IR",
           "IRError", "NgraWarning"]
