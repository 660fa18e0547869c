"""Datasets: loaders for standard benchmark formats and generators that need no files.

``load(name, root)`` returns a :class:`Dataset` (graph, features, labels, split, classes);
``available()`` lists the names. Generators: ``sbm`` (planted partition), ``rmat_edges`` /
``rmat`` (R-MAT, streamable in blocks), ``karate``. ``read_edge_list`` reads a plain edge
list into a Graph. ``download`` fetches files with checksum verification.

A malformed, corrupt or implausibly large file raises :class:`DatasetError` (a ``ValueError``)
naming the file and the offending value; a checksum mismatch raises its subclass
:class:`ChecksumError`. Loaders check pinned SHA-256s where they are known (Cora) and validate
every array of every file before numpy or scipy index with it.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

from ._record import ChecksumError, Dataset, DatasetError, default_root, row_normalize
from .remote import download
from .generators import karate, rmat, rmat_edges, sbm
from .npz import NPZ_FILES, read_npz
from .ogb import OGB_NODE, read_ogb_node
from .planetoid import PLANETOID_NAMES, read_planetoid
from .stored import StoredDataset, read_stored, write_stored
from .text import read_edge_list

__all__ = ["Dataset", "DatasetError", "ChecksumError", "load", "available", "download", "sbm", "rmat_edges", "rmat",
           "karate", "read_edge_list", "row_normalize", "default_root", "write_stored", "read_stored",
           "StoredDataset"]


def _planetoid(name, root, *, verify_checksums=True):
    return read_planetoid(root / "planetoid" / name, name, verify_checksums=verify_checksums)


def _npz(name, root, *, train_per_class: int = 20, val_per_class: int = 30, seed: int = 0):
    path = root / "npz" / NPZ_FILES[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; download it with ngra.datasets.download({name!r}, root=...)")
    return read_npz(path, name=name, train_per_class=train_per_class, val_per_class=val_per_class, seed=seed)


def _ogb(name, root, *, split: str | None = None):
    folder, add_inverse_edge = OGB_NODE[name]
    return read_ogb_node(root / "ogb" / folder, name=name, add_inverse_edge=add_inverse_edge, split=split)


def _keywords(fn, *, required: bool = False) -> list[str]:
    """Option names ``fn`` accepts (``required=True``: those without a default)."""
    return [p for p, v in inspect.signature(fn).parameters.items()
            if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD) and p not in ("name", "root")
            and (not required or v.default is inspect.Parameter.empty)]


# name -> (loader(name, root, **options), the function whose keywords are the options)
_LOADERS = {
    # verify_checksums is load()'s own keyword, so Planetoid datasets take no options
    **{n: (_planetoid, lambda name, root: None) for n in PLANETOID_NAMES},
    **{n: (_npz, _npz) for n in NPZ_FILES},
    **{n: (_ogb, _ogb) for n in OGB_NODE},
    "sbm": (lambda name, root, **kw: sbm(**kw), sbm),
    "karate": (lambda name, root, **kw: karate(**kw), karate),
    "rmat": (lambda name, root, **kw: Dataset("rmat", rmat(**kw)), rmat),
}
_FILE_BASED = {*PLANETOID_NAMES, *NPZ_FILES, *OGB_NODE}
_download = download  # load() has a parameter of the same name


def available() -> list[str]:
    """Names ``load`` accepts: file-based datasets, then generators (``sbm``, ``karate``, ``rmat``)."""
    return [*PLANETOID_NAMES, *NPZ_FILES, *OGB_NODE, "sbm", "karate", "rmat"]


def load(name: str, root=None, *, download: bool = False, normalize_features: bool = False,
         verify_checksums: bool = True, **options) -> Dataset:
    """Load dataset ``name`` (see ``available()``) as a :class:`Dataset`.

    - ``root``: folder holding ``planetoid/<name>/``, ``npz/`` and ``ogb/`` (default
      ``$NGRA_DATASETS`` or ``~/.cache/ngra/datasets``); unused by generators.
    - ``download=True`` fetches missing files first (see :func:`download`).
    - ``normalize_features=True`` divides each feature row by its L1 norm
      (:func:`row_normalize`). It is off by default because it is a modelling choice: GCN and
      GAT row-normalize the bag-of-words features of the citation datasets, while many later
      papers feed them raw.
    - ``verify_checksums=False`` skips the check of files that have a pinned SHA-256 (Cora's),
      for a copy you changed on purpose; their contents are still validated.
    - ``options`` go to the loader: npz datasets take ``train_per_class``, ``val_per_class``,
      ``seed`` (their split is random); OGB takes ``split``; generators take their own
      arguments (``load("sbm", num_nodes=10**6)``, ``load("karate", features="degree")``,
      ``load("rmat", scale=16, num_edges=10**6)``).

    Graphs of the citation and npz datasets are symmetrized, deduplicated and free of
    self-loops (each loader's docstring gives the details). A malformed or corrupt file raises
    :class:`DatasetError` (a ``ValueError``) naming the file; a checksum mismatch raises its
    subclass :class:`ChecksumError`.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(available())}")
    loader, signature = _LOADERS[key]
    accepted = _keywords(signature)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"load({name!r}) got unknown option(s) {unknown}; it accepts {accepted or 'none'}")
    needed = [k for k in _keywords(signature, required=True) if k not in options]
    if needed:
        example = ", ".join(f"{k}=..." for k in needed)
        raise TypeError(f"load({name!r}) needs the option(s) {needed}, e.g. load({name!r}, {example}) "
                        f"(on the command line: {' '.join(f'--dataset-option {k}=...' for k in needed)})")
    root = Path(root) if root is not None else default_root()
    if download and key in _FILE_BASED:
        _download(key, root)
    if key in PLANETOID_NAMES:  # the only loader with pinned checksums
        options = {**options, "verify_checksums": verify_checksums}
    dataset = loader(key, root, **options)
    if normalize_features:
        if dataset.x is None:
            raise ValueError(f"normalize_features=True but dataset {name!r} has no features")
        dataset = replace(dataset, x=row_normalize(dataset.x))
    return dataset
