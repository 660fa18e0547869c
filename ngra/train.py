"""Full-graph node classification: a training loop with early stopping, checkpoints and resume.

Two levels, use either:

- :func:`fit` trains a model you built on a dataset record you loaded (any object with
  ``graph``, ``x``, ``y``, ``train_mask``, ``val_mask``, ``test_mask``); it seeds nothing and
  builds nothing, so it stays out of the way of your own setup.
- :func:`run` does the whole job from a :class:`TrainConfig` (model and dataset by name, the
  paper defaults of :data:`MODEL_DEFAULTS`, seeding, device, streaming engine); it is what
  ``ngra train`` calls.

Both return a :class:`TrainResult` whose accuracies are those of the model with the best
validation score (see :func:`fit`), and leave that model in ``result.model``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import numbers
import os
import random
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from kernels._loss import cross_entropy as _cross_entropy

__all__ = ["HParams", "MODEL_DEFAULTS", "TrainConfig", "TrainResult", "EpochStats", "ConfigError",
           "CheckpointError", "fit", "run", "evaluate", "compile_model", "load_checkpoint",
           "peak_memory_bytes", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "last.pt"
_FORMAT = "ngra-checkpoint"
# 2: a header line with the SHA-256 of the torch.save payload that follows it (1: the bare payload).
_VERSION = 2


class ConfigError(ValueError):
    """A setting the user gave cannot work (bad number, unknown name, missing folder, ...).

    The message names the setting, the value and the fix; ``ngra train`` prints it on one line
    and exits with status 2.
    """


class CheckpointError(ConfigError):
    """A checkpoint file cannot be resumed from: damaged (its checksum does not match), cut
    short, not an ngra checkpoint, or holding values that cannot be this run's state. The
    message names the file."""


# -- defaults ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class HParams:
    """Training hyperparameters of one model (the values ``ngra train`` uses unless overridden).

    - ``hidden``: width of the hidden layers (for gat: features *per head*).
    - ``heads``: attention heads of gat's hidden layers (other models ignore it).
    - ``num_layers``: graph layers (ggnn: propagation steps).
    - ``dropout``: dropout probability on every layer's input (gat: also on the attention).
    - ``lr``, ``weight_decay``: Adam's learning rate and L2 penalty (``weight_decay * w`` added
      to the gradient, the same as Kipf's ``weight_decay * l2_loss(w)`` term in the loss).
    - ``weight_decay_on``: ``"first"`` puts the penalty on the weight matrices of the first layer
      only, not on its bias (Kipf & Welling's and Shchur et al.'s code), ``"all"`` on every
      parameter, biases included (GAT's code).
    - ``epochs``: maximum number of epochs.
    - ``patience``: stop after this many epochs without improvement; ``None``: never stop early.
    - ``selection``: what counts as improvement, and which weights are kept. ``"gat"`` (GAT's
      code): an epoch improves if validation accuracy >= its best or validation loss <= its
      lowest; the weights kept are those of the last epoch where both held. ``"loss"`` (Shchur
      et al.'s gnn-benchmark): an epoch improves if validation loss < its lowest; the weights
      kept are those of the lowest validation loss.
    """

    hidden: int
    dropout: float
    lr: float
    weight_decay: float
    epochs: int
    patience: int | None
    weight_decay_on: str = "all"
    selection: str = "gat"
    heads: int = 8
    num_layers: int = 2


# The deepest published GNNs have about 1,000 layers (RevGNN-Deep, Li et al. 2021: 1,001); every
# layer compiles its own programs (about 15 ms each here), so 10^5 layers would only look hung.
MAX_LAYERS = 1024

_GENERIC = HParams(hidden=64, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None)

#: Per-model defaults. gcn: Kipf & Welling (ICLR 2017): 16 hidden, dropout 0.5, lr 0.01, weight
#: decay 5e-4 on the first layer, 200 epochs. gat: Velickovic et al. (ICLR 2018), Cora setup: 8
#: heads x 8 hidden, dropout 0.6, lr 0.005, weight decay 5e-4, patience 100 (their epoch cap is
#: 100,000; 1,000 is ample for the Planetoid graphs, where GAT stops after a few hundred). The
#: other models have no paper setting for these benchmarks and share generic values: 64 hidden,
#: dropout 0.5, lr 0.01, weight decay 5e-4, 200 epochs, no early stopping.
MODEL_DEFAULTS: dict[str, HParams] = {
    "gcn": HParams(hidden=16, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, patience=None,
                   weight_decay_on="first"),
    "gat": HParams(hidden=8, heads=8, dropout=0.6, lr=0.005, weight_decay=5e-4, epochs=1000,
                   patience=100),
    **{name: _GENERIC for name in ("sage", "sage-pool", "gin", "ggcn", "ggnn", "rgcn", "commnet")},
}

# "auto" row-normalizes the features of the citation graphs, as Kipf & Welling and GAT do; the
# Amazon and Coauthor features are used raw, as in Shchur et al.'s benchmark (their
# normalize_features is off), and so are generated and OGB features.
_ROW_NORMALIZED = ("cora", "citeseer", "pubmed")
# Generators of graphs without features or labels: name -> why training refuses them.
_GRAPH_ONLY = {"rmat": "R-MAT generates edges only, without vertex features, labels or a split"}


# -- config -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything :func:`run` needs. ``None`` means "the model's default" (:data:`MODEL_DEFAULTS`).

    - ``model``: a name of ``ngra.nn.MODELS``; ``dataset``: a name of ``ngra.datasets.available()``.
    - ``data_dir``: folder with ``planetoid/``, ``npz/``, ``ogb/`` (file-based datasets only;
      default: ``ngra.datasets.default_root()``).
    - ``seed``: seeds torch, numpy and ``random`` before the model is built, and is the split
      seed of datasets with a random split (Amazon, Coauthor). Generated datasets (sbm, ...)
      keep their own fixed default seed, so every run sees the same graph.
    - ``normalize_features``: ``None`` ("auto"): row-normalize the Planetoid citation datasets
      (as Kipf & Welling and GAT do), leave the others as they are (as Shchur et al. do for
      Amazon and Coauthor).
    - ``patience``: ``0`` turns early stopping off.
    - ``checkpoint``: folder for ``last.pt``, written every ``checkpoint_every`` epochs and at the
      end; ``resume=True`` continues from it.
    - ``memory_budget`` (bytes or a string such as ``"2GiB"``) / ``num_chunks``: run every graph
      layer inside ``ngra.Engine(...)``, streaming the graph chunk by chunk.
    - ``progress``: tqdm bar; ``log_every``: also print a line every that many epochs (0: never).
    - ``dataset_options``: keyword arguments for the loader or generator, e.g.
      ``{"num_nodes": 10**6}`` for sbm (see ``ngra.datasets.load``); they override ``seed`` as
      the split seed.
    - ``partition``: how the vertices are split when several workers run (``torchrun`` or
      ``ngra train --workers K``): ``"metis"``, ``"contiguous"`` or ``"random"``.
    - ``exchange``: how the workers exchange the vertex values their layers read across the
      cut: ``"halo"`` (the rows each needs) or ``"ring"`` (NGra's chunk sharing: every worker's
      rows circulate around a ring while each worker computes on the block it holds; see
      :mod:`ngra.distributed.ring`).
    - ``save_model``: a file to write the selected weights to at the end, with what rebuilding
      the model needs (see :mod:`ngra.modelfile`; ``ngra evaluate`` / ``ngra predict`` read it).
    """

    model: str
    dataset: str
    data_dir: str | os.PathLike | None = None
    dataset_options: dict | None = None
    epochs: int | None = None
    hidden: int | None = None
    heads: int | None = None
    num_layers: int | None = None
    dropout: float | None = None
    lr: float | None = None
    weight_decay: float | None = None
    weight_decay_on: str | None = None
    selection: str | None = None
    patience: int | None = None
    seed: int = 0
    device: str = "cpu"
    normalize_features: bool | None = None
    checkpoint: str | os.PathLike | None = None
    resume: bool = False
    checkpoint_every: int = 1
    memory_budget: int | str | None = None
    num_chunks: int | None = None
    progress: bool = True
    log_every: int = 0
    partition: str = "metis"
    exchange: str = "halo"
    save_model: str | os.PathLike | None = None

    def hparams(self) -> HParams:
        """The model's defaults with this config's overrides applied, validated."""
        from .nn import MODELS

        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        base = MODEL_DEFAULTS[self.model]
        over = {f.name: getattr(self, f.name) for f in dataclasses.fields(HParams)
                if getattr(self, f.name) is not None}
        if over.get("patience") == 0:
            over["patience"] = None
        hp = dataclasses.replace(base, **over)
        _check_int("epochs", hp.epochs, 1, "give the number of epochs to train, e.g. --epochs 200")
        _check_int("hidden", hp.hidden, 1, "give a layer width such as --hidden 16")
        _check_int("heads", hp.heads, 1, "give a number of attention heads such as --heads 8")
        _check_int("num_layers", hp.num_layers, 1, "give a number of graph layers such as --num-layers 2")
        if hp.num_layers > MAX_LAYERS:
            raise ConfigError(f"num_layers must be at most {MAX_LAYERS} (got {hp.num_layers}); every layer "
                              f"compiles its own programs (1,000 GCN layers take about 15 s before the first "
                              f"epoch on a 34-vertex graph), and the deepest published GNNs have about 1,000; "
                              f"give a number such as --num-layers 2")
        if hp.patience is not None:
            _check_int("patience", hp.patience, 0, "give a number of epochs, or 0 to turn early stopping off")
        _check_real("lr", hp.lr, "give a positive learning rate such as --lr 0.01", low=0.0, low_open=True)
        _check_real("weight_decay", hp.weight_decay, "give 0 for none or a small value such as 5e-4", low=0.0)
        _check_real("dropout", hp.dropout, "a dropout probability lies in [0, 1), e.g. --dropout 0.5",
                    low=0.0, high=1.0)
        if hp.weight_decay_on not in ("first", "all"):
            raise ConfigError(f"weight_decay_on must be 'first' or 'all' (got {hp.weight_decay_on!r})")
        if hp.selection not in _SELECTIONS:
            raise ConfigError(f"selection must be one of {', '.join(map(repr, _SELECTIONS))} (got "
                              f"{hp.selection!r})")
        return hp

    def validate(self, *, with_data: bool = False) -> HParams:
        """Check every setting that needs no files; returns :meth:`hparams`.

        ``with_data=True``: the dataset record is given (``run(config, data=...)``), so
        ``dataset`` only names it and may be any string."""
        from .datasets import available
        from .datasets.stored import is_stored

        hp = self.hparams()
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ConfigError(f"dataset must be a name (got {self.dataset!r}); choose one of "
                              f"{', '.join(available())}")
        if not with_data and self.dataset.lower() not in available() and not is_stored(self.dataset):
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(available())}, "
                              "or a folder written by `ngra partition`")
        _check_int("seed", self.seed, 0, "give a non-negative integer seed such as --seed 0")
        _check_int("checkpoint_every", self.checkpoint_every, 1, "checkpoint every N >= 1 epochs")
        _check_int("log_every", self.log_every, 0, "give 0 (never) or a number of epochs")
        if self.dataset_options is not None and not isinstance(self.dataset_options, dict):
            raise ConfigError(f"dataset_options must be a dict of loader arguments (got "
                              f"{type(self.dataset_options).__name__})")
        if self.resume and self.checkpoint is None:
            raise ConfigError("resume needs a checkpoint folder: pass --checkpoint DIR (the folder "
                              "the interrupted run wrote its checkpoints to) together with --resume")
        if self.num_chunks is not None and self.memory_budget is not None:
            raise ConfigError(f"give one of memory_budget ({self.memory_budget!r}) and num_chunks "
                              f"({self.num_chunks!r}), not both: the budget chooses the number of chunks")
        if self.num_chunks is not None:
            from .engine import MAX_INTERVALS

            _check_int("num_chunks", self.num_chunks, 1, "give a number of chunks such as --num-chunks 4")
            if self.num_chunks > MAX_INTERVALS:
                raise ConfigError(f"num_chunks must be at most {MAX_INTERVALS} (got {self.num_chunks}): each "
                                  f"of the P x P chunks costs Python work and buffers per layer, so the "
                                  f"engine never chooses more than {MAX_INTERVALS} intervals itself; give "
                                  f"--num-chunks {MAX_INTERVALS} or less, or --memory-budget SIZE to let it choose")
        if self.memory_budget is not None:
            from partition import parse_bytes

            try:
                parse_bytes(self.memory_budget)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"memory_budget {self.memory_budget!r} is not a memory size: {e}") from e
        _device(self.device)
        return hp


def _check_int(name, value, minimum, fix):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum} (got {value!r}); {fix}")


def _check_real(name, value, fix, *, low, high=None, low_open=False):
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        rng = f"> {low}" if low_open else (f">= {low}" if high is None else f"in [{low}, {high})")
        raise ConfigError(f"{name} must be a number {rng} (got {value!r}); {fix}")


def _device(spec) -> torch.device:
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {spec!r} is not a torch device; use 'cpu' or 'cuda' / 'cuda:0'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} was asked for but torch sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu")
    return dev


# -- results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class EpochStats:
    """One epoch: ``loss`` is the training loss of the training step (dropout on); the
    accuracies and ``val_loss`` come from the evaluation pass after it (dropout off)."""

    epoch: int
    loss: float
    train_acc: float | None
    val_acc: float | None
    val_loss: float | None
    time_s: float


@dataclass(eq=False)
class TrainResult:
    """Outcome of :func:`fit` / :func:`run`.

    - ``train_acc``, ``val_acc``, ``test_acc``: accuracies (fractions in [0, 1]) of the selected
      model (best validation, see :func:`fit`) on each split; ``None`` for an empty split.
    - ``best_epoch``: the epoch (1-based) whose weights were selected; ``epochs_run``: epochs
      completed in total (resumed runs included); ``stopped_early``: patience ran out.
    - ``epoch_time_s``: median wall-clock seconds of one training step (forward, loss, backward,
      optimizer step) over the epochs run in *this* call; evaluation and checkpoint writing are
      not included. The median, not the mean: the first step also compiles the kernels where
      numba's disk cache is cold (GAT on Coauthor CS on an H200, 50 epochs: a mean of 42.7 ms on
      a fresh machine against 21.1 ms run again). Each step's time is in ``history``. ``None``
      if this call ran no epoch (a finished run resumed).
    - ``peak_memory_bytes``: see :func:`peak_memory_bytes` (process-wide peak resident memory,
      taken when training ended). ``peak_device_memory_bytes``: on CUDA, the peak of
      ``torch.cuda.max_memory_allocated`` during this call, else ``None``.
    - ``history``: one :class:`EpochStats` per epoch (resumed runs included).
    - ``resumed_from``: the epoch the run continued from, or ``None``.
    - ``model``: the trained model, holding the selected weights.
    """

    train_acc: float | None
    val_acc: float | None
    test_acc: float | None
    best_epoch: int
    epochs_run: int
    stopped_early: bool
    epoch_time_s: float | None
    peak_memory_bytes: int | None
    peak_device_memory_bytes: int | None
    history: list[EpochStats]
    resumed_from: int | None
    model: torch.nn.Module | None = None
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain-JSON summary (the ``--metrics-json`` file): the required keys first, then
        ``best_epoch``, ``epochs_run``, ``stopped_early``, ``resumed_from``, ``info`` (the run's
        settings) and ``history``."""
        return {
            "train_acc": self.train_acc, "val_acc": self.val_acc, "test_acc": self.test_acc,
            "epoch_time_s": self.epoch_time_s, "peak_memory_bytes": self.peak_memory_bytes,
            "peak_device_memory_bytes": self.peak_device_memory_bytes,
            "best_epoch": self.best_epoch, "epochs_run": self.epochs_run,
            "stopped_early": self.stopped_early, "resumed_from": self.resumed_from,
            "info": self.info, "history": [dataclasses.asdict(h) for h in self.history],
        }

    def summary(self) -> str:
        """One line: the three accuracies, where the model came from, time and memory."""
        def pct(a):
            return "n/a" if a is None else f"{100 * a:.2f}%"
        t = "n/a" if self.epoch_time_s is None else f"{self.epoch_time_s * 1e3:.1f} ms/epoch"
        mem = "n/a" if self.peak_memory_bytes is None else f"{self.peak_memory_bytes / 2**20:.0f} MiB"
        if self.peak_device_memory_bytes is not None:  # on CUDA, the memory that bounds a graph
            mem += f"; peak GPU memory {self.peak_device_memory_bytes / 2**20:.0f} MiB"
        stop = ", stopped early" if self.stopped_early else ""
        return (f"train_acc {pct(self.train_acc)}  val_acc {pct(self.val_acc)}  test_acc "
                f"{pct(self.test_acc)}  (best epoch {self.best_epoch} of {self.epochs_run}{stop}; "
                f"{t}; peak RSS {mem})")

    def __repr__(self) -> str:
        return f"TrainResult({self.summary()})"


def peak_memory_bytes() -> int | None:
    """Peak resident set size of this process so far, in bytes, as the OS counts it.

    This is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, bytes on macOS),
    converted to bytes: the largest amount of physical memory the process has held at any time
    since it started, so it includes the Python interpreter, torch, the dataset and earlier work
    in the same process, not only training; it never decreases. It does not count GPU memory.
    ``None`` where ``resource`` has no ``ru_maxrss`` (Windows).
    """
    try:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (AttributeError, OSError):  # pragma: no cover - platforms without getrusage
        return None
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


# -- the loop ---------------------------------------------------------------------------------

@dataclass
class _Data:
    graph: Any
    x: torch.Tensor
    y: torch.Tensor
    idx: dict  # split name -> LongTensor of vertex ids


def _prepare_data(data, device: torch.device) -> _Data:
    name = getattr(data, "name", type(data).__name__)
    for attr in ("graph", "x", "y", "train_mask"):
        if getattr(data, attr, None) is None:
            raise ConfigError(f"dataset {name!r} has no {attr}; training needs a graph, features x, "
                              "labels y and a train_mask (graph-only datasets such as 'rmat' cannot "
                              "be trained on)")
    idx = {}
    for split in ("train", "val", "test"):
        mask = getattr(data, f"{split}_mask", None)
        idx[split] = (torch.zeros(0, dtype=torch.int64) if mask is None
                      else mask.nonzero().squeeze(1)).to(device)
    if idx["train"].numel() == 0 and _workers(data.graph) is None:  # a piece may have none
        raise ConfigError(f"dataset {name!r} has an empty training split; nothing to train on")
    return _Data(data.graph.to(device), data.x.to(device), data.y.to(device), idx)


def evaluate(model: torch.nn.Module, data, *, forward_kwargs: dict | None = None) -> dict:
    """Accuracy and loss of ``model`` (in eval mode, no gradients) on each split of ``data``.

    Returns ``{"train_acc", "val_acc", "test_acc", "train_loss", "val_loss", "test_loss"}``;
    a split with no vertices gets ``None``. ``data`` is a dataset record (see :func:`fit`).
    """
    device = _model_device(model)
    d = data if isinstance(data, _Data) else _prepare_data(data, device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(d.graph, d.x, **(forward_kwargs or {}))
    finally:
        model.train(was_training)
    if not isinstance(data, _Data):  # fit() checked its data once, before the first epoch
        _check_labels(d, tuple(out.shape), getattr(data, "name", type(data).__name__))
    workers = _workers(d.graph)
    if workers is not None:
        # A worker's piece: correct counts, loss sums and sizes summed over the workers.
        sums = torch.zeros(len(d.idx), 3, dtype=torch.float64)
        for k, ids in enumerate(d.idx.values()):
            if ids.numel():
                logits = out[ids]
                sums[k, 0] = float((logits.argmax(1) == d.y[ids]).sum())
                sums[k, 1] = float(_cross_entropy(logits, d.y[ids], reduction="sum"))
                sums[k, 2] = ids.numel()
        workers.allreduce_sum(sums)
        res = {}
        for k, split in enumerate(d.idx):
            n = float(sums[k, 2])
            res[f"{split}_acc"] = None if n == 0 else float(sums[k, 0]) / n
            res[f"{split}_loss"] = None if n == 0 else float(sums[k, 1]) / n
        return res
    res = {}
    for split, ids in d.idx.items():
        if ids.numel() == 0:
            res[f"{split}_acc"] = res[f"{split}_loss"] = None
            continue
        logits = out[ids]
        res[f"{split}_acc"] = float((logits.argmax(1) == d.y[ids]).float().mean())
        res[f"{split}_loss"] = float(_cross_entropy(logits, d.y[ids]))
    return res


def _workers(graph):
    """The transport of a worker's piece of a distributed graph (a DistGraph), else None."""
    return getattr(graph, "transport", None)


def _model_device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


_SELECTIONS = ("gat", "loss")


class _Stopper:
    """Model selection and early stopping on validation.

    ``selection="gat"`` (GAT's reference code): an epoch *improves* if its validation accuracy
    is >= the best so far or its validation loss is <= the lowest so far; the weights are
    *selected* (snapshotted) at epochs where both hold at once. ``selection="loss"`` (Shchur et
    al.'s gnn-benchmark): an epoch improves, and is selected, if its validation loss is below
    the lowest so far. ``patience`` epochs in a row without improving stop training. Without
    validation vertices the last epoch is selected and patience must be off.
    """

    def __init__(self, patience: int | None, selection: str = "gat"):
        self.patience = patience
        self.selection = selection
        self.best_acc = -math.inf
        self.best_loss = math.inf
        self.bad_epochs = 0
        self.best_epoch = 0
        self.best_state: dict | None = None

    def update(self, epoch: int, val_acc, val_loss, model) -> bool:
        """Record ``epoch``; returns True when training should stop."""
        if val_acc is None:
            self.best_epoch, self.best_state = epoch, _copy_state(model)
            return False
        if self.selection == "loss":
            acc_ok = loss_ok = val_loss < self.best_loss
        else:
            acc_ok, loss_ok = val_acc >= self.best_acc, val_loss <= self.best_loss
        if acc_ok and loss_ok:
            self.best_epoch, self.best_state = epoch, _copy_state(model)
        if acc_ok or loss_ok:
            self.best_acc = max(self.best_acc, val_acc)
            self.best_loss = min(self.best_loss, val_loss)
            self.bad_epochs = 0
            return False
        self.bad_epochs += 1
        return self.patience is not None and self.bad_epochs >= self.patience

    def state_dict(self) -> dict:
        return {"best_acc": self.best_acc, "best_loss": self.best_loss, "bad_epochs": self.bad_epochs,
                "best_epoch": self.best_epoch, "best_state": self.best_state}

    def load_state_dict(self, s: dict) -> None:
        self.best_acc, self.best_loss = float(s["best_acc"]), float(s["best_loss"])
        self.bad_epochs, self.best_epoch = int(s["bad_epochs"]), int(s["best_epoch"])
        self.best_state = s["best_state"]


def _copy_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _param_groups(model, weight_decay: float, weight_decay_on: str):
    if weight_decay_on == "all" or weight_decay == 0:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    first = getattr(model, "encoder", None) or (getattr(model, "layers", None) or [None])[0]
    if not isinstance(first, torch.nn.Module):
        raise ConfigError(f"weight_decay_on='first' needs a model with a first layer (an ngra.nn.GNN "
                          f"from build_model); {type(model).__name__} has neither .encoder nor "
                          "non-empty .layers; use weight_decay_on='all'")
    # Matrices only: the reference code (Kipf's, Shchur et al.'s) regularizes weights, not biases.
    decayed = {id(p) for p in first.parameters() if p.dim() >= 2}
    return [{"params": [p for p in model.parameters() if id(p) in decayed], "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if id(p) not in decayed], "weight_decay": 0.0}]


def fit(model: torch.nn.Module, data, *, epochs: int, lr: float, weight_decay: float = 0.0,
        weight_decay_on: str = "all", patience: int | None = None, selection: str = "gat",
        forward_kwargs: dict | None = None, checkpoint: str | os.PathLike | None = None,
        resume: bool = False, checkpoint_every: int = 1, progress: bool = True, log_every: int = 0,
        on_epoch: Callable[[EpochStats], None] | None = None, run_info: dict | None = None,
        desc: str = "train") -> TrainResult:
    """Train ``model`` for node classification on ``data`` with Adam and cross-entropy.

    ``data`` has ``graph`` (ngra.Graph), ``x`` [N, F], ``y`` [N] int64 and bool masks [N]
    ``train_mask`` / ``val_mask`` / ``test_mask`` (an :class:`ngra.datasets.Dataset`); it is
    moved to the model's device. ``model(graph, x, **forward_kwargs)`` must return logits
    [N, C]. Per epoch: one training step on the full graph (loss = mean cross-entropy over the
    training vertices), then one evaluation pass (see :func:`evaluate`).

    Model selection and early stopping (see :class:`HParams` ``selection``): with ``"gat"``
    (GAT's code), the weights of the last epoch at which validation accuracy and loss were both
    at their best so far are restored at the end, and ``patience`` (None: off) stops after that
    many epochs without either improving; with ``"loss"``, both go by validation loss alone.
    ``weight_decay_on="first"`` applies ``weight_decay`` to the first layer only.

    Checkpoints: with ``checkpoint=DIR``, ``DIR/last.pt`` is written every ``checkpoint_every``
    epochs and at the end, atomically (a temporary file, fsync, then ``os.replace``). It holds
    the model, the optimizer, the epoch, the torch/CUDA/numpy/``random`` RNG states, the
    early-stopping state (with the selected weights) and the history. ``resume=True`` continues
    from it; on the CPU a run killed and resumed ends with exactly the weights of an
    uninterrupted run with the same seed. The file carries a SHA-256 of its content, verified
    on resume with its structure (see :func:`load_checkpoint`): a damaged or edited checkpoint
    raises :class:`CheckpointError` before anything is restored. A checkpoint is also refused if
    it was written for other settings (``lr``, ``weight_decay``, ``patience``, ``selection``,
    parameter shapes and ``run_info``); ``epochs`` may differ, to train a finished run further.
    Without ``resume`` a folder that already holds a checkpoint is refused rather than
    overwritten.

    Labels: every vertex of a split needs a label in ``[0, C)`` for the model's ``C`` outputs,
    else :class:`ConfigError` (checked once, before the first epoch).

    ``on_epoch(stats)`` is called after each epoch (after its checkpoint is written); an
    exception raised there ends training, e.g. to stop from outside.

    Seeds are not set here; seed torch (and numpy, ``random``) before building the model.
    """
    _check_int("epochs", epochs, 1, "give the number of epochs to train")
    _check_real("lr", lr, "give a positive learning rate", low=0.0, low_open=True)
    _check_real("weight_decay", weight_decay, "give 0 for none", low=0.0)
    if patience is not None:
        _check_int("patience", patience, 1, "or None for no early stopping")
    if selection not in _SELECTIONS:
        raise ConfigError(f"selection must be one of {', '.join(map(repr, _SELECTIONS))} (got {selection!r})")
    _check_int("checkpoint_every", checkpoint_every, 1, "checkpoint every N >= 1 epochs")
    if resume and checkpoint is None:
        raise ConfigError("resume=True needs checkpoint=DIR, the folder of the interrupted run")
    device = _model_device(model)
    d = _prepare_data(data, device)
    kwargs = dict(forward_kwargs or {})
    workers = _workers(d.graph)  # a worker's piece of a distributed graph: global loss and metrics
    if workers is not None:
        from .distributed import sync_gradients

        n_train = int(workers.allreduce_sum(torch.tensor([float(d.idx["train"].numel())]))[0])
        if n_train == 0:
            raise ConfigError(f"dataset {getattr(data, 'name', '?')!r} has an empty training "
                              "split; nothing to train on")
    optimizer, stopper, fingerprint = _training_objects(
        model, lr=lr, weight_decay=weight_decay, weight_decay_on=weight_decay_on, patience=patience,
        selection=selection, run_info=run_info)
    if workers is not None:
        # A checkpoint resumes only on as many workers: each has its own piece and RNG stream.
        fingerprint["workers"] = workers.world_size
    ckpt_path = None if checkpoint is None else check_checkpoint_dir(checkpoint, resume=resume)

    # Compile every layer's program up front (train and eval mode), so that compilation is
    # neither in the first epoch's time nor anywhere in the random-number stream.
    out_shape = _compile(model, d, kwargs)
    _check_labels(d, out_shape, getattr(data, "name", type(data).__name__))

    history: list[EpochStats] = []
    start, finished, resumed_from = 0, False, None
    if ckpt_path is not None and resume:
        history, start, finished = _resume(ckpt_path, model, optimizer, stopper, fingerprint,
                                           rank=None if workers is None else workers.rank)
        resumed_from = start

    def save(epoch, stopped):
        if ckpt_path is None:
            return
        rng = _get_rng_state()
        extra = {}
        if workers is not None:
            # The model, optimizer and stopper are the same on every worker (gradients are
            # summed before each step); the RNG streams are not (each draws for its own piece).
            extra["worker_rng"] = workers.gather_objects(rng)
            if workers.rank != 0:
                return
        _save_checkpoint(ckpt_path, {
            "format": _FORMAT, "version": _VERSION, "epoch": epoch, "stopped_early": stopped,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "stopper": stopper.state_dict(), "rng": rng,
            "history": [dataclasses.asdict(h) for h in history], "fingerprint": fingerprint,
            **extra})

    step_times = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    stopped = finished
    epoch = start
    bar = tqdm(total=epochs, initial=min(start, epochs), desc=desc, unit="epoch", leave=False,
               disable=None if progress else True, dynamic_ncols=True)
    try:
        for epoch in range(start + 1, epochs + 1):
            if stopped:
                break
            t0 = time.perf_counter()
            model.train()
            optimizer.zero_grad(set_to_none=True)
            out = model(d.graph, d.x, **kwargs)
            if workers is None:
                loss = _cross_entropy(out[d.idx["train"]], d.y[d.idx["train"]])
                loss.backward()
            else:
                # Each worker's share of the mean over all training vertices; the summed
                # gradients are then the single-process ones.
                loss = _cross_entropy(out[d.idx["train"]], d.y[d.idx["train"]],
                                       reduction="sum") / n_train
                loss.backward()
                sync_gradients(model)
                loss = workers.allreduce_sum(loss.detach().reshape(1).double())[0]
            optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"the training loss became {loss_value} at epoch {epoch}; lower the "
                                         f"learning rate (lr={lr:g}) or check the features for inf/nan")
            ev = evaluate(model, d, forward_kwargs=kwargs)
            stats = EpochStats(epoch, loss_value, ev["train_acc"], ev["val_acc"], ev["val_loss"], dt)
            history.append(stats)
            stopped = stopper.update(epoch, ev["val_acc"], ev["val_loss"], model)
            if epoch % checkpoint_every == 0 or stopped or epoch == epochs:
                save(epoch, stopped)
            bar.update(1)
            bar.set_postfix_str(_fmt_stats(stats), refresh=False)
            if log_every and (epoch % log_every == 0 or stopped or epoch == epochs):
                bar.write(f"epoch {epoch:5d}  {_fmt_stats(stats)}")
            if on_epoch is not None:
                on_epoch(stats)
    finally:
        bar.close()

    if stopper.best_state is not None:
        model.load_state_dict(stopper.best_state)
    final = evaluate(model, d, forward_kwargs=kwargs)
    return TrainResult(
        train_acc=final["train_acc"], val_acc=final["val_acc"], test_acc=final["test_acc"],
        best_epoch=stopper.best_epoch, epochs_run=len(history), stopped_early=stopped,
        epoch_time_s=statistics.median(step_times) if step_times else None,
        peak_memory_bytes=peak_memory_bytes(),
        peak_device_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        history=history, resumed_from=resumed_from, model=model,
        info={**(run_info or {}), "epochs": epochs, "lr": lr, "weight_decay": weight_decay,
              "weight_decay_on": weight_decay_on, "patience": patience, "selection": selection})


def compile_model(model: torch.nn.Module, data, *, forward_kwargs: dict | None = None) -> None:
    """Run ``model`` once in train and once in eval mode, without gradients, so every layer
    compiles its programs (they are cached per mode). The torch RNG state is restored
    afterwards: the passes draw dropout masks that must not shift training's random stream."""
    _compile(model, data, forward_kwargs)


def _compile(model, data, forward_kwargs) -> tuple:
    """compile_model(); returns the shape of the eval-mode output."""
    d = data if isinstance(data, _Data) else _prepare_data(data, _model_device(model))
    was_training = model.training
    devices = [d.x.device] if d.x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for mode in (True, False):
                model.train(mode)
                out = model(d.graph, d.x, **(forward_kwargs or {}))
    finally:
        model.train(was_training)
    return tuple(getattr(out, "shape", ()))


def _check_labels(d: _Data, out_shape: tuple, name: str) -> None:
    """Raise ConfigError unless the model's output is logits [N, C] and every vertex of a split
    has a label in [0, C) (cross_entropy would fail with a bare IndexError, or skip -100)."""
    n = d.x.shape[0]
    if len(out_shape) != 2 or out_shape[0] != n:
        raise ConfigError(f"the model must return logits [N, C] = [{n}, num_classes] for the {n} vertices "
                          f"of dataset {name!r} (got shape {list(out_shape)})")
    c = out_shape[1]
    y = d.y
    if y.dim() != 1 or y.shape[0] != n or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ConfigError(f"dataset {name!r}: labels y must be an integer tensor [N] = [{n}] of class ids "
                          f"(got {y.dtype} of shape {list(y.shape)})")
    for split, ids in d.idx.items():
        if ids.numel() == 0:
            continue
        labels = y[ids]
        bad = ((labels < 0) | (labels >= c)).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            top = int(labels.max())
            raise ConfigError(
                f"dataset {name!r}: vertex {int(ids[k])} of the {split} split has label {int(labels[k])}, "
                f"but the model outputs {c} classes (logits [N, {c}]), so labels must lie in [0, {c}); "
                f"build the model with {max(top + 1, c)} outputs (the dataset's num_classes), or fix y")


def _fmt_stats(s: EpochStats) -> str:
    def f(v):
        return "  n/a " if v is None else f"{v:.4f}"
    return f"loss {s.loss:.4f}  train {f(s.train_acc)}  val {f(s.val_acc)}"


# -- checkpoints ------------------------------------------------------------------------------

def check_writable(path, flag: str) -> None:
    """Refuse an output file ``path`` (given as ``flag``) that cannot be written, before
    training: by creating (and removing) the temporary file it will be written through."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a folder; give a file name such as "
                          f"{str(path / 'out')!r}")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} exists and is not a regular file; give the name "
                          "of a file to (over)write")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag}: folder {str(path.parent)!r} does not exist; create it or "
                          "write the file elsewhere")
    probe = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(probe, "x"):
            pass
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write to folder {str(path.parent)!r} "
                          f"({e.strerror or e}); choose a writable location") from e


def check_checkpoint_dir(directory, *, resume: bool) -> Path:
    """Path of the checkpoint file in ``directory``, after checking the folder suits the run.

    Creates the folder if needed. Raises :class:`ConfigError` if it is a file, if ``resume``
    is asked but there is no checkpoint, or if there is one and ``resume`` is not asked.
    """
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"checkpoint folder {d} is a file; give a folder (it is created if missing)")
    path = d / CHECKPOINT_NAME
    if resume and not path.is_file():
        raise ConfigError(f"resume asked but {path} does not exist; check the --checkpoint folder, "
                          "or drop --resume to start a new run there")
    if not resume and path.exists():
        raise ConfigError(f"{path} already holds a checkpoint; pass --resume to continue that run, "
                          "or choose another --checkpoint folder (or delete it) to start afresh")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create checkpoint folder {d}: {e}") from e
    return path


# A checkpoint file is one header line, then the torch.save payload it describes:
#   NGRA-CHECKPOINT 2 sha256=<64 hex digits of the payload's SHA-256> bytes=<payload length>\n
# The payload is verified before torch.load sees it, so a damaged file is refused instead of
# resuming with other weights (torch.load itself checks no checksum of tensor data).
_HEADER = re.compile(rb"NGRA-CHECKPOINT (\d{1,6}) sha256=([0-9a-f]{64}) bytes=(\d{1,20})\n")
_MAX_HEADER = 128
_STATE_KEYS = ("format", "version", "epoch", "stopped_early", "model", "optimizer", "stopper", "rng",
               "history", "fingerprint")
_FIX = "delete it (or restore a good copy) to start afresh, or choose another --checkpoint folder"


def _header(payload) -> bytes:
    """The header line that seals ``payload`` (the bytes of a torch.save archive)."""
    return (f"NGRA-CHECKPOINT {_VERSION} sha256={hashlib.sha256(payload).hexdigest()} "
            f"bytes={len(payload)}\n").encode()


def _save_checkpoint(path: Path, state: dict) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    header = _header(payload)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    # The rename itself is durable only once the folder's entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The training state in the checkpoint file ``path`` (``DIR/last.pt``, written by :func:`fit`),
    after verifying it.

    The file's SHA-256 checksum is checked before its content is unpickled (with torch's
    ``weights_only=True``: a checkpoint is data, loading one runs no code from it), then its
    structure: the keys ``epoch`` (int >= 1), ``stopped_early``, ``model`` (a state dict),
    ``optimizer``, ``stopper``, ``rng``, ``history`` (one record per epoch) and ``fingerprint``
    (the run's settings; ``workers``: K for a run on several workers, whose checkpoint also has
    ``worker_rng``, each worker's RNG states in rank order). Raises :class:`CheckpointError`,
    naming the file, for anything else:
    a flipped bit, a file cut short, another file, a state edited into values no run writes.
    Whether the state fits a given model is checked when :func:`fit` resumes from it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    payload = _verified_payload(path, data)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a bad payload
        raise CheckpointError(f"{path} passed its checksum but torch.load cannot read it "
                              f"({type(e).__name__}: {_clip(str(e), 200)}); {_FIX}") from e
    _check_state(state, path)
    return state


def _verified_payload(path: Path, data: bytes) -> memoryview:
    if data[:4] == b"PK\x03\x04":
        raise CheckpointError(f"{path} is a checkpoint without a checksum (format 1, written by an "
                              f"older ngra, or a plain torch.save file); this ngra resumes only from "
                              f"format {_VERSION}, which it can verify; {_FIX}")
    end = data.find(b"\n", 0, _MAX_HEADER)
    m = _HEADER.fullmatch(data[:end + 1]) if end >= 0 else None
    if m is None:
        raise CheckpointError(f"{path} is not an ngra checkpoint, or is damaged: expected its first "
                              f"line to be 'NGRA-CHECKPOINT {_VERSION} sha256=<hex> bytes=<n>' (got "
                              f"{_short(bytes(data[:min(len(data), 80)]), 100)}); {_FIX}")
    version, recorded, size = int(m[1]), m[2].decode(), int(m[3])
    if version != _VERSION:
        raise CheckpointError(f"{path} has checkpoint format {version}; this ngra reads format "
                              f"{_VERSION}; {_FIX}")
    payload = memoryview(data)[end + 1:]
    if len(payload) != size:
        how = "cut short" if len(payload) < size else "longer than written"
        raise CheckpointError(f"{path} is {how}: expected {size} bytes after its header (got "
                              f"{len(payload)}); {_FIX}")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != recorded:
        raise CheckpointError(f"{path} is damaged: the SHA-256 of its content is {actual[:16]}..., "
                              f"expected {recorded[:16]}... as recorded when it was written; {_FIX}")
    return payload


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _tensor_dict(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items())


def _check_state(state, path: Path) -> None:
    """Raise CheckpointError unless ``state`` has the structure and value ranges fit() writes."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path} holds {what}, which no ngra run writes (the file was edited "
                               f"or damaged); {_FIX}")

    if not isinstance(state, dict):
        raise bad(f"a {type(state).__name__} (expected a dict of training state)")
    if state.get("format") != _FORMAT or state.get("version") != _VERSION:
        raise bad(f"format {_short(state.get('format'))} version {_short(state.get('version'))} (expected "
                  f"{_FORMAT!r} version {_VERSION})")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise bad(f"no {', '.join(map(repr, missing))} (expected the keys {', '.join(_STATE_KEYS)})")
    epoch = state["epoch"]
    if not _is_int(epoch) or epoch < 1:
        raise bad(f"epoch {_short(epoch)} (expected an integer >= 1: a checkpoint is written after an epoch)")
    if not isinstance(state["stopped_early"], bool):
        raise bad(f"stopped_early {_short(state['stopped_early'])} (expected True or False)")
    if not _tensor_dict(state["model"]):
        raise bad("a 'model' that is not a state dict of tensors")
    opt = state["optimizer"]
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict)
            and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) for g in opt["param_groups"])):
        raise bad("an 'optimizer' that is not an optimizer state dict (state, param_groups)")
    st = state["stopper"]
    if not (isinstance(st, dict) and _is_real(st.get("best_acc")) and _is_real(st.get("best_loss"))
            and _is_int(st.get("bad_epochs")) and _is_int(st.get("best_epoch"))
            and (st.get("best_state") is None or _tensor_dict(st.get("best_state")))):
        raise bad("a 'stopper' without best_acc, best_loss, bad_epochs, best_epoch, best_state")
    if not (0 <= st["best_epoch"] <= epoch and 0 <= st["bad_epochs"] <= epoch):
        raise bad(f"best_epoch {st['best_epoch']} and bad_epochs {st['bad_epochs']} (expected each in "
                  f"[0, {epoch}], the checkpoint's epoch)")
    hist = state["history"]
    fields = [f.name for f in dataclasses.fields(EpochStats)]
    if not isinstance(hist, list) or len(hist) != epoch:
        n = len(hist) if isinstance(hist, list) else type(hist).__name__
        raise bad(f"a history of {n} epochs at epoch {epoch} (expected one record per epoch)")
    for i, h in enumerate(hist, 1):
        if not (isinstance(h, dict) and sorted(h) == sorted(fields) and h["epoch"] == i
                and _is_real(h["loss"]) and _is_real(h["time_s"])
                and all(h[k] is None or _is_real(h[k]) for k in ("train_acc", "val_acc", "val_loss"))):
            raise bad(f"history record {i} {_short(h)} (expected {', '.join(fields)} with epoch {i})")
    if not isinstance(state["fingerprint"], dict):
        raise bad("a 'fingerprint' that is not a dict of the run's settings")
    _check_rng_state(state["rng"], bad)
    every = state.get("worker_rng")
    if every is not None:
        workers = state["fingerprint"].get("workers")
        if not isinstance(every, list) or len(every) != workers:
            n = len(every) if isinstance(every, list) else type(every).__name__
            raise bad(f"RNG states of {n} workers for a run on {_short(workers)} (expected one each)")
        for r in every:
            _check_rng_state(r, bad)


def _check_rng_state(rng, bad) -> None:
    """Check every generator state by loading it into a scratch generator (the global ones are
    set only once the whole checkpoint has passed)."""
    if not isinstance(rng, dict) or not {"torch", "python", "numpy"} <= set(rng):
        raise bad("an 'rng' without the torch, python and numpy generator states")
    t = rng["torch"]
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == torch.get_rng_state().shape):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise bad(f"a torch RNG state of shape {shape} (expected a uint8 tensor of shape "
                  f"{tuple(torch.get_rng_state().shape)})")
    try:
        torch.Generator().set_state(t)
        random.Random().setstate(_as_tuple(rng["python"]))
        n = rng["numpy"]
        keys = n["keys"]
        if not (isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.shape == (624,)
                and int(keys.min()) >= 0 and int(keys.max()) < 2**32):
            raise ValueError("numpy's keys must be 624 integers in [0, 2**32)")
        # numpy takes any pos and then reads past its 624 keys (a segfault): check it here.
        if not (n["name"] == "MT19937" and _is_int(n["pos"]) and 0 <= n["pos"] <= 624
                and n["has_gauss"] in (0, 1) and _is_real(n["cached_gaussian"])):
            raise ValueError(f"numpy's state must be MT19937 with pos in [0, 624] and has_gauss 0 or 1 (got "
                             f"{_short(n['name'])}, pos {_short(n['pos'])}, has_gauss {_short(n['has_gauss'])})")
        np.random.RandomState().set_state((n["name"], keys.numpy().astype(np.uint32), n["pos"],
                                           n["has_gauss"], n["cached_gaussian"]))
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, RuntimeError) as e:
        raise bad(f"an RNG state that cannot be restored ({type(e).__name__}: {_clip(str(e), 120)})") from e
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda)):
        raise bad("a CUDA RNG state that is not a list of uint8 tensors")


def _training_objects(model, *, lr, weight_decay, weight_decay_on, patience, selection, run_info):
    """The optimizer, the early stopper and the settings fingerprint fit() trains (and resumes) with."""
    optimizer = torch.optim.Adam(_param_groups(model, weight_decay, weight_decay_on), lr=lr)
    stopper = _Stopper(patience, selection)
    fingerprint = {"lr": float(lr), "weight_decay": float(weight_decay), "weight_decay_on": weight_decay_on,
                   "patience": patience, "selection": selection,
                   "params": {k: list(v.shape) for k, v in model.state_dict().items()},
                   # build_model's arguments repeat the settings above plus the data's sizes;
                   # left out so that checkpoints written before they were recorded still resume
                   **{k: v for k, v in (run_info or {}).items() if k != "build"}}
    return optimizer, stopper, fingerprint


def _resume(path: Path, model, optimizer, stopper, fingerprint, *,
            rank: int | None = None) -> tuple[list[EpochStats], int, bool]:
    """Load and verify the checkpoint ``path``, check it fits this run, and restore the model,
    optimizer, stopper and the global RNGs from it (worker ``rank``'s, for a run on several
    workers). Returns ``(history, epoch, stopped_early)``. Nothing is restored unless every check
    passed."""
    state = load_checkpoint(path)
    _check_fingerprint(state["fingerprint"], fingerprint, path)
    rng = state["rng"]
    if rank is not None:
        every = state.get("worker_rng")
        if every is None or len(every) != fingerprint.get("workers"):
            raise CheckpointError(f"{path} has no RNG state for each of the "
                                  f"{fingerprint.get('workers')} workers; {_FIX}")
        rng = every[rank]
    saved_opt, epoch = state["optimizer"], state["epoch"]
    now_groups = optimizer.state_dict()["param_groups"]
    if len(saved_opt["param_groups"]) != len(now_groups):
        raise CheckpointError(f"{path} has {len(saved_opt['param_groups'])} optimizer parameter groups, "
                              f"this run {len(now_groups)}; {_FIX}")
    for saved, now in zip(saved_opt["param_groups"], now_groups):
        if not isinstance(saved.get("params"), list) or len(saved["params"]) != len(now["params"]):
            raise CheckpointError(f"{path} has an optimizer parameter group with parameters "
                                  f"{_short(saved.get('params'))} where this run has {len(now['params'])}; {_FIX}")
        for key in ("lr", "weight_decay", "betas", "eps", "amsgrad"):
            if _as_tuple(saved.get(key)) != _as_tuple(now.get(key)):
                raise CheckpointError(f"{path} has optimizer {key} {_short(saved.get(key))}, but the run's "
                                      f"settings give {_short(now.get(key))} (the file was edited); {_FIX}")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    best = state["stopper"]["best_state"]
    for name, sd in (("model", state["model"]), ("selected weights", best)):
        if sd is not None and {k: v.shape for k, v in sd.items()} != shapes:
            raise CheckpointError(f"{path}: its {name} do not match this model's parameters (names or "
                                  f"shapes differ); {_FIX}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # Adam's per-parameter state (torch.optim.Adam: step and the two moments, with amsgrad the max).
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if optimizer.defaults.get("amsgrad") else set())
    for i, s in saved_opt["state"].items():
        ok = _is_int(i) and 0 <= i < len(params) and isinstance(s, dict) and set(s) == keys
        for k, v in (s.items() if ok else ()):
            if k == "step":
                ok = ok and (v.numel() == 1 and v.is_floating_point() if isinstance(v, torch.Tensor)
                             else _is_real(v)) and 0 <= float(v) <= epoch
            else:
                ok = ok and isinstance(v, torch.Tensor) and v.shape == params[i].shape \
                    and v.dtype == params[i].dtype
        if not ok:
            raise CheckpointError(f"{path} holds optimizer state {_short(i)} that does not fit parameter "
                                  f"{_short(i)} of this model at epoch {epoch} (other keys than Adam's "
                                  f"{', '.join(sorted(keys))}, wrong shape or dtype, or more steps than "
                                  f"epochs); {_FIX}")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(saved_opt)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{path} does not fit this model ({type(e).__name__}: "
                              f"{_clip(' '.join(str(e).split()), 200)}); {_FIX}") from e
    stopper.load_state_dict(state["stopper"])
    _set_rng_state(rng)
    return [EpochStats(**h) for h in state["history"]], int(epoch), bool(state["stopped_early"])


def _check_fingerprint(saved: dict, now: dict, path: Path) -> None:
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        parts = "; ".join(f"{k}: checkpoint {_short(saved.get(k))}, now {_short(now.get(k))}" for k in diff)
        raise CheckpointError(f"{path} was written by a run with other settings ({parts}); resume with "
                              "the same settings, or use another --checkpoint folder")


def _short(v, limit: int = 80) -> str:
    return _clip(repr(v), limit)


def _clip(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _get_rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(v):
    return tuple(_as_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v


# -- the whole job ----------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator and ``random``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_dataset(name: str, data_dir=None, *, seed: int = 0, normalize_features: bool | None = None,
                 options: dict | None = None):
    """``ngra.datasets.load(name, data_dir, **options)`` with the trainer's conventions: ``seed``
    is the split seed of random-split datasets (npz) unless ``options`` has one,
    ``normalize_features=None`` row-normalizes the Planetoid datasets. Missing files or folders
    raise :class:`ConfigError`."""
    from . import datasets
    from .datasets.npz import NPZ_FILES
    from .datasets.stored import is_stored

    if not isinstance(name, str):
        raise ConfigError(f"dataset must be a name (got {name!r}); see ngra.datasets.available()")
    if is_stored(name):  # a folder written by `ngra partition`
        stored = open_stored(name, normalize_features, options)
        data = stored.load()
        if normalize_features and not stored.normalized:
            data.x = datasets.row_normalize(data.x)
        return data
    name = name.lower()
    if data_dir is not None and name not in ("sbm", "karate", "rmat"):
        root = Path(data_dir)
        if not root.is_dir():
            raise ConfigError(f"data directory {str(root)!r} does not exist or is not a folder; pass "
                              "--data-dir the folder that holds planetoid/, npz/ or ogb/ (for "
                              "example ../shared/datasets)")
    normalize = name in _ROW_NORMALIZED if normalize_features is None else normalize_features
    options = {**({"seed": seed} if name in NPZ_FILES else {}), **(options or {})}
    try:
        return datasets.load(name, data_dir, normalize_features=normalize, **options)
    except FileNotFoundError as e:
        raise ConfigError(f"{e}; or pass --data-dir the folder that holds it") from e


def build(config: TrainConfig, data, hp: HParams | None = None):
    """``(model, forward_kwargs)`` for ``config`` on ``data``, built after seeding."""
    from .nn import build_model

    hp = hp or config.hparams()
    seed_everything(config.seed)
    model = build_model(config.model, **build_arguments(config, data, hp))
    return model, model_inputs(config.model, data.graph)


def build_arguments(config: TrainConfig, data, hp: HParams | None = None) -> dict:
    """The keyword arguments of ``build_model(config.model, ...)`` for ``data``."""
    hp = hp or config.hparams()
    out = dict(in_dim=data.num_features, hidden=hp.hidden, out_dim=data.num_classes,
               num_layers=hp.num_layers, dropout=hp.dropout, heads=hp.heads)
    if config.model == "rgcn":
        # Loaded datasets carry no edge types: every edge gets relation 0 (one relation),
        # which makes R-GCN a mean-aggregating layer with a root weight.
        out["num_relations"] = 1
    return out


def model_inputs(model: str, graph) -> dict:
    """The per-edge inputs a model of ``build_arguments`` takes besides ``(g, x)``."""
    if model == "rgcn":
        return {"edge_type": torch.zeros(graph.num_edges, dtype=torch.int64)}
    return {}


def _check_model_size(config: TrainConfig, data, hp: HParams, device: torch.device) -> None:
    """Refuse a model that cannot fit in memory, before allocating it: the model is built on
    torch's meta device (shapes only) to count its parameters exactly. The estimate is a lower
    bound: parameters, gradients and Adam's two moments (4 x the parameter bytes) plus one
    [N, width] float32 output per layer kept for the backward pass."""
    from .nn import build_model

    extra = {"num_relations": 1} if config.model == "rgcn" else {}
    try:
        with torch.device("meta"):
            meta = build_model(config.model, data.num_features, hp.hidden, data.num_classes,
                               num_layers=hp.num_layers, dropout=hp.dropout, heads=hp.heads, **extra)
        param_bytes = sum(t.numel() * t.element_size() for t in meta.state_dict().values())
    except RuntimeError:  # "Storage size calculation overflowed": more than 2**63 bytes
        param_bytes = math.inf
    width = hp.hidden * (hp.heads if config.model == "gat" else 1)
    need = 4 * param_bytes + hp.num_layers * data.graph.num_nodes * width * 4
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"GPU {device}"
    else:
        have, where = _memory_limit(), "this machine"
        if have is None:  # pragma: no cover - no sysconf
            return
    if need > have:
        from partition import format_bytes

        size = "more than 2**63 bytes" if math.isinf(need) else f"at least {format_bytes(int(need))}"
        raise ConfigError(
            f"{config.model} with hidden={hp.hidden}"
            f"{f' x heads={hp.heads}' if config.model == 'gat' else ''} and num_layers={hp.num_layers} on "
            f"dataset {config.dataset!r} ({data.graph.num_nodes} vertices, {data.num_features} features) "
            f"needs {size} (parameters, gradients and Adam's moments, and one output per layer), but "
            f"{where} has {format_bytes(int(have))}; give a smaller --hidden or --num-layers")


def _memory_limit() -> int | None:
    """Physical memory in bytes, or the container's cgroup limit (v2 ``memory.max``) if lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
        return None
    with contextlib.suppress(OSError, ValueError):
        total = min(total, int(Path("/sys/fs/cgroup/memory.max").read_text().strip()))  # "max": no limit
    return total


def _engine_context(config: TrainConfig):
    if config.memory_budget is None and config.num_chunks is None:
        return contextlib.nullcontext()
    from .engine import Engine
    from partition import parse_bytes

    if config.num_chunks is not None:
        return Engine(num_chunks=config.num_chunks)
    return Engine(memory_budget=parse_bytes(config.memory_budget))


def open_stored(path: str, normalize_features: bool | None, options: dict | None):
    """The stored dataset at ``path`` (written by ``ngra partition``), opened without reading it,
    after checking that the settings can apply: the dataset options were used when it was
    written, and its features cannot be un-normalized."""
    from .datasets.stored import StoredDataset

    if options:
        raise ConfigError(f"dataset options ({', '.join(options)}) do not apply to the stored "
                          f"dataset {path!r}: they were used when it was written; write it again "
                          "with `ngra partition ... --dataset-option ...`")
    try:
        stored = StoredDataset.open(path)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from e
    if normalize_features is False and stored.normalized:
        raise ConfigError(f"the stored dataset {path!r} was written with row-normalized features, "
                          "so --raw-features cannot apply; write it again with `ngra partition "
                          "... --raw-features`")
    return stored


def _has_array(data, attr: str) -> bool:
    """Whether the dataset record (or a stored dataset, not read yet) has vertex array ``attr``."""
    from .datasets.stored import StoredDataset

    if isinstance(data, StoredDataset):
        return attr in data.meta["arrays"]
    return getattr(data, attr, None) is not None


def _split_size(data, mask: str) -> int:
    from .datasets.stored import StoredDataset

    if isinstance(data, StoredDataset):
        return int(data.split.get(mask, 0))
    m = getattr(data, mask, None)
    return 0 if m is None else int(m.sum())


def _distribute(config: TrainConfig, data, kwargs: dict, device):
    """Under a launcher with several workers (``torchrun``, ``ngra train --workers K``): join the
    group, cut the graph (``config.partition``) and keep this worker's piece, its rows of the
    data and of the per-edge model inputs (with ``--num-chunks`` / ``--memory-budget`` each
    worker then streams its own piece). Alone: everything as it is."""
    from .distributed.launch import worker_info

    info = worker_info()
    if not info.distributed:
        return data, kwargs
    from .datasets import row_normalize
    from .datasets.stored import StoredDataset
    from .distributed import PARTITION_METHODS, DistGraph, Transport, partition
    from .distributed.launch import init_from_env, local_record
    from .distributed.ring import EXCHANGE_MODES

    if config.partition not in PARTITION_METHODS:
        raise ConfigError(f"partition must be one of {list(PARTITION_METHODS)} "
                          f"(got {config.partition!r})")
    if config.exchange not in EXCHANGE_MODES:
        raise ConfigError(f"exchange must be one of {list(EXCHANGE_MODES)} "
                          f"(got {config.exchange!r})")
    stored = isinstance(data, StoredDataset)
    if stored and config.partition != "metis":
        raise ConfigError(f"--partition {config.partition} does not apply to the stored dataset "
                          f"{config.dataset!r}: its workers take runs of its intervals (ordered "
                          f"by {data.meta.get('ordering', '?')} when it was written); leave "
                          "--partition out")
    if stored and data.store.num_intervals < info.world_size:
        raise ConfigError(f"the stored dataset {config.dataset!r} has {data.store.num_intervals} "
                          f"intervals, fewer than the {info.world_size} workers; write it again "
                          f"with `ngra partition ... --intervals {info.world_size}` or more")
    init_from_env(device)
    if stored:  # only this worker's chunk columns and rows are read
        local = data.piece(Transport(device=device))
        if config.normalize_features and not data.normalized:
            local.x = row_normalize(local.x)
    else:
        parts = partition(data.graph, info.world_size, method=config.partition, seed=config.seed)
        local = local_record(data, DistGraph.from_global(data.graph, parts,
                                                         Transport(device=device)))
    local.graph = local.graph.with_exchange(config.exchange)
    dg, num_edges = local.graph, data.graph.num_edges
    edge_rows = {k: v[dg.edge_ids.to(v.device)] if v.dim() and v.shape[0] == num_edges else v
                 for k, v in kwargs.items()}
    return local, edge_rows


def setup(config: TrainConfig, *, data=None):
    """Everything before the first epoch: validate, check the checkpoint folder, load the data
    (unless ``data``, a dataset record, is given: then ``config.dataset`` only names it), build
    the model. Returns ``(model, data, fit_kwargs, engine_context)``. Every user error raises
    :class:`ConfigError`."""
    hp = config.validate(with_data=data is not None)
    if data is None and config.dataset.lower() in _GRAPH_ONLY:
        # Refused before loading: generating the graph would only end in the refusal below.
        raise ConfigError(f"dataset {config.dataset!r} cannot be trained on: "
                          f"{_GRAPH_ONLY[config.dataset.lower()]}. Train on a labelled dataset such "
                          "as sbm (a generated graph with learnable labels, any size); use R-MAT for "
                          "benchmarks and `ngra info`")
    if config.checkpoint is not None:
        check_checkpoint_dir(config.checkpoint, resume=config.resume)
    if config.save_model is not None:
        check_writable(config.save_model, "save_model")
    engine_ctx = _engine_context(config)
    normalized = config.normalize_features
    if data is None:
        from .datasets.stored import is_stored
        from .distributed.launch import worker_info

        if is_stored(config.dataset):
            stored = open_stored(config.dataset, normalized, config.dataset_options)
            normalized = stored.normalized or bool(normalized)
            if worker_info().distributed:
                data = stored  # each worker reads its piece (_distribute), never the whole
        elif normalized is None:
            normalized = config.dataset.lower() in _ROW_NORMALIZED
        if data is None:
            data = load_dataset(config.dataset, config.data_dir, seed=config.seed,
                                normalize_features=config.normalize_features,
                                options=config.dataset_options)
    missing = [what for attr, what in (("x", "vertex features (x)"), ("y", "labels (y)"),
                                       ("train_mask", "training split (train_mask)"))
               if not _has_array(data, attr)]
    if missing:
        raise ConfigError(
            f"dataset {config.dataset!r} has no {' and no '.join(missing)}; training needs features "
            "x [N, F], labels y [N] and a train_mask. Choose a dataset that has them (see `ngra info "
            "--dataset NAME`), or build an ngra.datasets.Dataset with them and pass it as "
            "run(config, data=...)")
    if hp.patience is not None and not _split_size(data, "val_mask"):
        raise ConfigError(f"dataset {config.dataset!r} has no validation vertices, so early stopping "
                          f"(patience={hp.patience}) cannot work; pass --patience 0")
    device = _device(config.device)
    if config.num_chunks is not None and config.num_chunks > data.graph.num_nodes:
        raise ConfigError(f"num_chunks {config.num_chunks} is more than the {data.graph.num_nodes} vertices "
                          f"of dataset {config.dataset!r}: every interval needs a vertex; give at most "
                          f"{data.graph.num_nodes}, e.g. --num-chunks {max(1, min(data.graph.num_nodes, 4))}")
    _check_model_size(config, data, hp, device)
    model, kwargs = build(config, data, hp)
    full = data  # before a worker keeps its piece
    model = model.to(device)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    data, kwargs = _distribute(config, data, kwargs, device)
    if not isinstance(engine_ctx, contextlib.nullcontext):
        # The engine plans its chunks on the first call; a budget that no chunking can meet is
        # the user's setting to fix, so find out now rather than inside the first epoch.
        flag = (f"--num-chunks {config.num_chunks}" if config.num_chunks is not None
                else f"--memory-budget {config.memory_budget}")
        # Data errors (an empty training split, ...) are raised here, not blamed on the engine.
        prepared = _prepare_data(data, device)
        try:
            with engine_ctx:
                compile_model(model, prepared, forward_kwargs=kwargs)
        except ValueError as e:
            raise ConfigError(f"the streaming engine cannot run {config.model} on {config.dataset} "
                              f"with {flag}: {e}") from e
    run_info = {"model": config.model, "dataset": config.dataset.lower(), "seed": config.seed,
                "hidden": hp.hidden, "num_layers": hp.num_layers, "dropout": hp.dropout,
                "normalize_features": normalized, "build": build_arguments(config, full, hp)}
    if config.model == "gat":
        run_info["heads"] = hp.heads
    if _workers(data.graph) is not None:
        from .datasets.stored import StoredDataset

        run_info["partition"] = f"stored intervals ({full.meta.get('ordering', '?')} order)" \
            if isinstance(full, StoredDataset) else config.partition
    if config.dataset_options:
        run_info["dataset_options"] = {k: config.dataset_options[k] for k in sorted(config.dataset_options)}
    fit_kwargs = dict(epochs=hp.epochs, lr=hp.lr, weight_decay=hp.weight_decay,
                      weight_decay_on=hp.weight_decay_on, patience=hp.patience, selection=hp.selection,
                      forward_kwargs=kwargs,
                      checkpoint=config.checkpoint, resume=config.resume,
                      checkpoint_every=config.checkpoint_every, progress=config.progress,
                      log_every=config.log_every, run_info=run_info,
                      desc=f"{config.model} on {config.dataset}")
    return model, data, fit_kwargs, engine_ctx


def run(config: TrainConfig, *, data=None,
        on_epoch: Callable[[EpochStats], None] | None = None) -> TrainResult:
    """Load ``config.dataset`` (or take ``data``, see :func:`setup`), build ``config.model`` with
    the model's defaults (:data:`MODEL_DEFAULTS`) overridden by the config, seed, and
    :func:`fit` it (inside ``ngra.Engine`` when ``memory_budget`` / ``num_chunks`` are set)."""
    model, data, fit_kwargs, engine_ctx = setup(config, data=data)
    with engine_ctx:
        result = fit(model, data, on_epoch=on_epoch, **fit_kwargs)
    record_run(result, config, engine_ctx)
    from .distributed.launch import worker_info

    if config.save_model is not None and worker_info().rank == 0:
        save_selected(result, config)
    return result


def save_selected(result: TrainResult, config: TrainConfig) -> Path:
    """Write ``result.model`` (the weights selected on validation) to ``config.save_model``
    (see :mod:`ngra.modelfile`), with how the data was read and the run's accuracies."""
    from .modelfile import save_model

    info = result.info
    data = {k: info.get(k) for k in ("dataset", "normalize_features", "seed")}
    data["dataset_options"] = info.get("dataset_options")
    metrics = {"train_acc": result.train_acc, "val_acc": result.val_acc,
               "test_acc": result.test_acc, "best_epoch": result.best_epoch}
    return save_model(config.save_model, result.model, name=info["model"], build=info["build"],
                      data=data, metrics=metrics)


def record_run(result: TrainResult, config: TrainConfig, engine_ctx) -> None:
    """Add the run's device and streaming settings to ``result.info``; for a streamed run also
    ``info["streamed"]``: what the engine really did in its last streamed call, a copy of
    ``ngra.Engine.last_run`` (``num_intervals`` P, chosen by ``memory_budget`` if given, the
    vertex ``ordering``, ...)."""
    result.info.update(device=config.device, memory_budget=config.memory_budget,
                       num_chunks=config.num_chunks)
    last_run = getattr(engine_ctx, "last_run", None)
    if last_run:
        # numpy scalars -> Python numbers: info goes into the --metrics-json file.
        result.info["streamed"] = {k: v.item() if isinstance(v, np.generic) else v for k, v in last_run.items()}
