"""ngra: GNN training on large graphs with SAGA-NN vertex programs."""

__version__ = "0.1.0"
