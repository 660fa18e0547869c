"""Fault injection into training checkpoints (``DIR/last.pt``, what ``ngra train --resume`` reads).

Each fault (a seeded byte flip, overwrite, truncation or extension; see fuzzutil) is loaded in a
child process through the code path of ``--resume``: ``setup()`` builds the run's model as the
command line does, then ``_resume`` verifies the file (header, SHA-256, torch.load with
``weights_only``, structure and value ranges), checks it fits the model and restores the model,
the optimizer, the early stopper and the global RNGs. A fault must be refused with a
CheckpointError naming the file, or restore exactly the clean state: never a signal, never
another exception, never a silent change.

- ``Checkpoint``: the file as written. Returns the whole restored state (weights, optimizer
  state, stopper, epoch, history, the torch/numpy/``random`` RNG states).
- ``Resealed``: the adversary that recomputes the checksum after the damage (an edit written
  back with a valid header), so only the checks after it and torch's own reader stand between
  the damage and training. A sealed edit of a weight cannot be told from a real one, so this
  target returns what resuming promises rather than the values: the restored state fits the
  model (names, shapes, dtypes), the epoch and history agree, every RNG can draw, and one
  training step runs.

Run alone: ``.venv/bin/python -m pytest tests/fuzz/test_fuzz_checkpoint.py -q -s`` (prints the figures).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fuzzutil

from ngra import train
from ngra.train import CHECKPOINT_NAME, CheckpointError, TrainConfig

THIS = Path(__file__).resolve()
SMALL_SBM = {"num_nodes": 120, "num_classes": 3, "num_features": 6, "avg_degree": 5.0,
             "train_per_class": 8, "val_per_class": 8}
# gat: dropout on features and attention, so the RNG state matters; patience: a live stopper.
CONFIG = dict(model="gat", dataset="sbm", dataset_options=SMALL_SBM, hidden=4, heads=2, epochs=2,
              patience=5, progress=False)
REL = f"ck/{CHECKPOINT_NAME}"


def _write(directory: Path) -> None:
    train.run(TrainConfig(**CONFIG, checkpoint=directory / "ck"))


def _resume(folder: Path):
    """What ``ngra train ... --checkpoint FOLDER --resume`` does before its first epoch."""
    config = TrainConfig(**CONFIG, checkpoint=folder, resume=True)
    model, data, fit_kwargs, _ = train.setup(config)
    optimizer, stopper, fingerprint = train._training_objects(
        model, **{k: fit_kwargs[k] for k in ("lr", "weight_decay", "weight_decay_on", "patience", "selection",
                                             "run_info")})
    history, epoch, stopped = train._resume(folder / CHECKPOINT_NAME, model, optimizer, stopper, fingerprint)
    return model, data, fit_kwargs, optimizer, stopper, history, epoch, stopped


class Checkpoint:
    errors = (CheckpointError,)

    def make(self, directory: Path) -> list[str]:
        _write(directory)
        return [REL]

    def load(self, directory: Path):
        model, _, _, optimizer, stopper, history, epoch, stopped = _resume(directory / "ck")
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "stopper": stopper.state_dict(), "history": history, "epoch": epoch, "stopped": stopped,
                "rng": train._get_rng_state()}


class Resealed:
    errors = (CheckpointError,)

    def make(self, directory: Path) -> list[str]:
        _write(directory)
        path = directory / REL
        raw = path.read_bytes()
        path.write_bytes(raw[raw.index(b"\n") + 1:])  # the bare torch.save payload is what is damaged
        return [REL]

    def load(self, directory: Path):
        payload = (directory / REL).read_bytes()
        sealed = directory / "sealed"  # beside it: the clean copy must stay bare for the next fault
        sealed.mkdir(exist_ok=True)
        (sealed / CHECKPOINT_NAME).write_bytes(train._header(payload) + payload)  # passes the checksum now
        model, data, fit_kwargs, optimizer, stopper, history, epoch, stopped = _resume(sealed)
        state = model.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fits = all(s["exp_avg"].shape == p.shape and s["exp_avg"].dtype == p.dtype
                   for p, s in optimizer.state.items()) and all(any(p is q for q in params)
                                                                for p in optimizer.state)
        best = stopper.best_state
        draws = (torch.rand(3).shape, random.random() < 1.0, np.random.random(3).shape)
        # One training step, as the first resumed epoch takes it.
        d = train._prepare_data(data, torch.device("cpu"))
        model.train()
        optimizer.zero_grad(set_to_none=True)
        out = model(d.graph, d.x, **fit_kwargs["forward_kwargs"])
        F.cross_entropy(out[d.idx["train"]], d.y[d.idx["train"]]).backward()
        optimizer.step()
        return {"names": sorted(state), "shapes": [list(v.shape) for v in state.values()],
                "optimizer_fits": fits, "epoch_ok": 1 <= epoch == len(history),
                "best_ok": best is None or {k: v.shape for k, v in best.items()} == {k: v.shape for k, v in
                                                                                       state.items()},
                "stopper_ok": 0 <= stopper.best_epoch <= epoch, "stopped": isinstance(stopped, bool),
                "draws": repr(draws), "logits": list(out.shape)}


# (target, faults, seed)
RUNS = [("Checkpoint", 250, 201), ("Resealed", 250, 202)]


@pytest.mark.slow
@pytest.mark.parametrize("target, count, seed", RUNS, ids=[r[0] for r in RUNS])
def test_checkpoint_faults_are_refused_or_harmless(target, count, seed):
    report = fuzzutil.check(f"{THIS}::{target}", count=count, seed=seed)
    assert report.counts["refused"] > 0
    if target == "Checkpoint":  # every byte is covered by the checksum: nothing loads changed or not
        assert report.counts["refused"] == count, report
