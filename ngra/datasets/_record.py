"""The dataset record returned by every loader and generator, and helpers shared by them."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ngra.graph import Graph

__all__ = ["Dataset", "DatasetError", "ChecksumError", "default_root", "row_normalize"]


class DatasetError(ValueError):
    """A dataset file is malformed, corrupt, or describes sizes this machine cannot hold.

    Every loader raises it (never a bare numpy/scipy/pickle/zipfile error) with a message that
    names the file and the offending value. It is a ``ValueError``, so ``except ValueError``
    callers keep working.
    """


class ChecksumError(DatasetError):
    """A file does not have the expected SHA-256 (downloaded, or loaded with a pinned checksum)."""


# SHA-256 of the upstream files whose checksums are known: Cora in tkipf/gcn @ 39a4089f (the copy
# this project's tests read). Keys are paths relative to a datasets root. Other datasets have no
# pinned checksum (the npz copies in the shared test data are repacks, not the upstream files),
# so their loaders rely on validating every array instead.
PINNED_SHA256 = {
    "planetoid/cora/ind.cora.allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
    "planetoid/cora/ind.cora.ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
    "planetoid/cora/ind.cora.graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
    "planetoid/cora/ind.cora.test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
    "planetoid/cora/ind.cora.tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
    "planetoid/cora/ind.cora.ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
    "planetoid/cora/ind.cora.x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
    "planetoid/cora/ind.cora.y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
    # karpathy/char-rnn @ 6f9487a6, data/tinyshakespeare/input.txt
    "text/tinyshakespeare.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_pinned(path: Path, key: str) -> None:
    """Raise :class:`ChecksumError` unless ``path`` has the pinned SHA-256 of ``key`` (if any)."""
    expected = PINNED_SHA256.get(key)
    if expected is None:
        return
    got = sha256_file(path)
    if got != expected:
        raise ChecksumError(
            f"{path}: SHA-256 {got} does not match the expected {expected} of the published {key}; "
            "the file is corrupt or was modified. Download it again (ngra.datasets.download(..., "
            "force=True)), or, for a copy you changed on purpose, pass verify_checksums=False "
            "(every array is then validated instead)"
        )


def available_memory() -> int:
    """Bytes this process can still allocate: the kernel's MemAvailable (or free physical pages),
    lowered to what an address-space limit (RLIMIT_AS) leaves."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            avail = 1 << 40
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            used = 0
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        used = int(line.split()[1]) * 1024
                        break
            avail = min(avail, max(soft - used, 0))
    except (ImportError, OSError, ValueError):
        pass
    return avail


def format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # unreachable


def check_allocation(nbytes: int, path, what: str) -> None:
    """Refuse, before allocating, what would need more than the memory available.

    ``what`` names the value that asks for the memory, e.g. "test vertex 10000000000 (N = ...)".
    """
    avail = available_memory()
    if nbytes > avail:
        raise DatasetError(
            f"{path}: {what} needs {format_bytes(nbytes)} of memory, more than the "
            f"{format_bytes(avail)} available; the file is corrupt, or the dataset is too large for "
            "this machine"
        )


def check_num_classes(max_label: int, num_nodes: int, path, where: str) -> None:
    """Refuse a class id >= N for a graph of N vertices: it means more classes than vertices,
    most of them empty, which only a corrupt file has (and per-class arrays such as logits
    [N, C] could not even be allocated for an id like 10**9)."""
    if max_label >= max(num_nodes, 1):
        raise DatasetError(
            f"{path}: {where} {max_label} is not a plausible class id for a graph of {num_nodes} "
            f"vertices; class ids must lie in [0, {max(num_nodes, 1)}) (more classes than vertices "
            "means the file is corrupt)"
        )


@dataclass(eq=False, repr=False)
class Dataset:
    """A graph with vertex features, labels and a train/validation/test split.

    With ``N = graph.num_nodes`` and ``F`` features:

    - ``name`` (str): the name ``ngra.datasets.load`` knows it by.
    - ``graph`` (:class:`ngra.graph.Graph`): the edges; each loader documents whether it is
      symmetrized.
    - ``x`` [N, F] float32: vertex features as stored by the source (no normalization unless
      asked for); ``None`` for a graph-only dataset (edge lists, R-MAT).
    - ``y`` [N] int64: class of each vertex in ``[0, num_classes)``, or -1 for a vertex without
      a label (such vertices are in no split); ``None`` for a graph-only dataset.
    - ``train_mask``, ``val_mask``, ``test_mask`` [N] bool: disjoint splits, or ``None`` where
      the source has none. ``mask.nonzero()`` gives indices.
    - ``num_classes`` (int): 0 when there are no labels.
    """

    name: str
    graph: Graph
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    train_mask: torch.Tensor | None = None
    val_mask: torch.Tensor | None = None
    test_mask: torch.Tensor | None = None
    num_classes: int = 0

    def __post_init__(self):
        if not isinstance(self.graph, Graph):
            raise TypeError(f"Dataset.graph must be an ngra.graph.Graph (got {type(self.graph).__name__})")
        n = self.graph.num_nodes
        if self.x is not None:
            if not isinstance(self.x, torch.Tensor) or not self.x.is_floating_point() or self.x.dim() != 2:
                raise ValueError(f"Dataset.x must be a 2-D floating-point tensor [N, F] (got {_describe(self.x)})")
            if self.x.shape[0] != n:
                raise ValueError(f"Dataset.x has {self.x.shape[0]} rows but the graph has {n} nodes")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, (int, np.integer)) \
                or self.num_classes < 0:
            raise ValueError(f"Dataset.num_classes must be an int >= 0 (got {self.num_classes!r})")
        self.num_classes = int(self.num_classes)
        if self.y is not None:
            if not isinstance(self.y, torch.Tensor) or self.y.dtype != torch.int64 or self.y.dim() != 1:
                raise ValueError(f"Dataset.y must be a 1-D int64 tensor [N] (got {_describe(self.y)})")
            if self.y.shape[0] != n:
                raise ValueError(f"Dataset.y has {self.y.shape[0]} entries but the graph has {n} nodes")
            if n and (int(self.y.min()) < -1 or int(self.y.max()) >= self.num_classes):
                raise ValueError(
                    f"Dataset.y holds labels in [{int(self.y.min())}, {int(self.y.max())}]; labels must lie "
                    f"in [0, {self.num_classes}) (num_classes={self.num_classes}), or be -1 for unlabelled"
                )
        masks = {}
        for field in ("train_mask", "val_mask", "test_mask"):
            m = getattr(self, field)
            if m is None:
                continue
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.shape != (n,):
                raise ValueError(f"Dataset.{field} must be a bool tensor of shape [{n}] (got {_describe(m)})")
            if self.y is not None and bool((self.y[m] < 0).any()):
                raise ValueError(f"Dataset.{field} selects vertices without a label (y == -1)")
            masks[field] = m
        names = list(masks)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if bool((masks[a] & masks[b]).any()):
                    raise ValueError(f"Dataset.{a} and Dataset.{b} overlap; splits must be disjoint")

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes

    @property
    def num_features(self) -> int:
        """F, or 0 when there are no features."""
        return 0 if self.x is None else int(self.x.shape[1])

    def stats(self) -> dict:
        """Summary numbers (plain Python values), e.g. for ``ngra info --dataset NAME``."""
        g = self.graph
        indeg, outdeg = g.in_degrees(), g.out_degrees()
        out = {
            "name": self.name,
            "num_nodes": g.num_nodes,
            "num_edges": g.num_edges,
            "avg_in_degree": g.num_edges / g.num_nodes if g.num_nodes else 0.0,
            "max_in_degree": int(indeg.max()) if g.num_nodes else 0,
            "max_out_degree": int(outdeg.max()) if g.num_nodes else 0,
            "isolated_nodes": int(((indeg == 0) & (outdeg == 0)).sum()),
            "self_loops": int((g.src == g.dst).sum()),
            "num_features": self.num_features,
            "num_classes": self.num_classes,
        }
        if self.y is not None:
            out["unlabelled_nodes"] = int((self.y < 0).sum())
            out["class_counts"] = torch.bincount(self.y[self.y >= 0], minlength=self.num_classes).tolist()
        for field in ("train", "val", "test"):
            m = getattr(self, f"{field}_mask")
            if m is not None:
                out[f"num_{field}"] = int(m.sum())
        return out

    def __repr__(self) -> str:
        parts = [f"name={self.name!r}", f"num_nodes={self.num_nodes}", f"num_edges={self.graph.num_edges}"]
        if self.x is not None:
            parts.append(f"num_features={self.num_features}")
        if self.y is not None:
            parts.append(f"num_classes={self.num_classes}")
        masks = (self.train_mask, self.val_mask, self.test_mask)
        if any(m is not None for m in masks):
            parts.append("split=" + "/".join("-" if m is None else str(int(m.sum())) for m in masks))
        return f"Dataset({', '.join(parts)})"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def out_of_range(ids: np.ndarray, n: int) -> int | None:
    """The first offending value if some id lies outside ``[0, n)`` (the minimum if negative), else None."""
    if ids.size == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return lo if lo < 0 else hi if hi >= n else None


def default_root() -> Path:
    """Where datasets live when no ``root`` is given: ``$NGRA_DATASETS`` or ``~/.cache/ngra/datasets``."""
    return Path(os.environ.get("NGRA_DATASETS", "~/.cache/ngra/datasets")).expanduser()


def row_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x[i] / sum_j |x[i, j]|`` (L1 row normalization); all-zero rows stay zero. Returns a new tensor.

    For non-negative bag-of-words features this is the row normalization GCN and GAT apply
    to the citation datasets (Kipf & Welling 2017, ``preprocess_features``).
    """
    norm = x.abs().sum(dim=1, keepdim=True)
    return x / torch.where(norm > 0, norm, torch.ones_like(norm))


def per_class_split(y: np.ndarray, num_classes: int, train_per_class: int, val_per_class: int,
                    seed: int, source: str):
    """Random split: ``train_per_class`` and ``val_per_class`` labelled vertices of each class,
    every other labelled vertex in test (Shchur et al. 2018). Returns three [N] bool tensors.

    Deterministic for a given ``seed``. Raises if a class has fewer than
    ``train_per_class + val_per_class`` labelled vertices.
    """
    for arg, v in (("train_per_class", train_per_class), ("val_per_class", val_per_class)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{arg} must be an int >= 0 (got {v!r})")
    need = train_per_class + val_per_class
    counts = np.bincount(y[y >= 0], minlength=num_classes)
    if num_classes and counts.min() < need:
        c = int(counts.argmin())
        raise DatasetError(
            f"{source}: class {c} has only {counts[c]} labelled nodes, fewer than "
            f"train_per_class + val_per_class = {train_per_class} + {val_per_class}; lower them"
        )
    rng = np.random.default_rng(seed)
    labelled = np.flatnonzero(y >= 0)
    perm = rng.permutation(labelled)
    # Group the shuffled vertices by class; the rank inside its class decides the split.
    grouped = perm[np.argsort(y[perm], kind="stable")]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(grouped.size) - starts[y[grouped]]
    masks = []
    for lo, hi in ((0, train_per_class), (train_per_class, need), (need, None)):
        m = np.zeros(y.shape[0], dtype=bool)
        m[grouped[(rank >= lo) & ((rank < hi) if hi is not None else True)]] = True
        masks.append(torch.from_numpy(m))
    return tuple(masks)
