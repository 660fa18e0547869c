"""Tests of ngra.train: the loop, model selection, checkpoints and resume, config errors."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import resource
import signal
import statistics
import struct
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import pytest
import torch

from ngra import datasets
from ngra.nn import MODELS, build_model
from ngra.train import (CHECKPOINT_NAME, MODEL_DEFAULTS, CheckpointError, ConfigError, TrainConfig, _Stopper,
                        _save_checkpoint, evaluate, fit, load_checkpoint, peak_memory_bytes, run)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "datasets"

# A small planted-partition graph: trains in milliseconds per epoch, still learnable.
SMALL_SBM = {"num_nodes": 240, "num_classes": 3, "num_features": 8, "avg_degree": 6.0,
             "train_per_class": 10, "val_per_class": 10}


def small_config(**kw) -> TrainConfig:
    base = dict(model="gcn", dataset="sbm", dataset_options=SMALL_SBM, epochs=12, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def _forward_kwargs(name, graph):
    return {"edge_type": torch.zeros(graph.num_edges, dtype=torch.int64)} if name == "rgcn" else {}


# -- every model on every generated dataset -----------------------------------------------------

@pytest.mark.parametrize("dataset", ["sbm", "karate"])
@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_and_loss_decreases(model, dataset):
    options = SMALL_SBM if dataset == "sbm" else None
    # Dropout off so that the loss of consecutive steps is comparable: the check is that the
    # optimizer moves the model downhill, not that dropout noise happens to be small.
    res = run(TrainConfig(model=model, dataset=dataset, dataset_options=options, epochs=15, dropout=0.0,
                          patience=0, progress=False))
    losses = [h.loss for h in res.history]
    assert len(losses) == 15 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0], losses
    for acc in (res.train_acc, res.test_acc):
        assert 0.0 <= acc <= 1.0


TINY_SBM = {**SMALL_SBM, "num_nodes": 90, "train_per_class": 5, "val_per_class": 5}


@pytest.mark.parametrize("dataset", ["sbm", "karate"])
@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_streamed(model, dataset):
    common = dict(model=model, dataset=dataset, dataset_options=TINY_SBM if dataset == "sbm" else None,
                  epochs=8, dropout=0.0, patience=0, progress=False)
    mem = run(TrainConfig(**common))
    streamed = run(TrainConfig(**common, num_chunks=3))
    got = [h.loss for h in streamed.history]
    want = [h.loss for h in mem.history]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert got[-1] < 0.9 * got[0], got


def test_gcn_learns_the_default_sbm():
    # What `make train` runs (100 epochs there; 60 here to stay quick): far above chance (1/7).
    res = run(TrainConfig(model="gcn", dataset="sbm", epochs=60, progress=False))
    assert res.test_acc > 0.7, res.summary()


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_on_cora(model):
    if not (SHARED / "planetoid" / "cora").is_dir():
        pytest.skip(f"{SHARED}/planetoid/cora not found")
    res = run(TrainConfig(model=model, dataset="cora", data_dir=SHARED, epochs=6, dropout=0.0, patience=0,
                          progress=False))
    losses = [h.loss for h in res.history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_gcn_on_cora_one_seed():
    if not (SHARED / "planetoid" / "cora").is_dir():
        pytest.skip(f"{SHARED}/planetoid/cora not found")
    res = run(TrainConfig(model="gcn", dataset="cora", data_dir=SHARED, epochs=100, progress=False))
    assert res.test_acc > 0.75, res.summary()


# -- result record ------------------------------------------------------------------------------

def test_result_fields_and_json():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = run(small_config())
    d = res.to_dict()
    for key in ("train_acc", "val_acc", "test_acc"):
        assert 0.0 <= d[key] <= 1.0
    assert d["epoch_time_s"] > 0
    # the median step (the first one also compiles kernels where numba's cache is cold)
    assert res.epoch_time_s == statistics.median(h.time_s for h in res.history)
    # ru_maxrss is in KiB on Linux and never decreases.
    assert before * 1024 <= d["peak_memory_bytes"] <= peak_memory_bytes()
    assert d["epochs_run"] == 12 and len(d["history"]) == 12 and d["resumed_from"] is None
    assert d["info"]["model"] == "gcn" and d["info"]["lr"] == MODEL_DEFAULTS["gcn"].lr
    json.dumps(d)  # plain JSON
    assert "test_acc" in res.summary() and "best epoch" in repr(res)
    assert d["peak_device_memory_bytes"] is None and "GPU" not in res.summary()  # on the CPU
    on_gpu = dataclasses.replace(res, peak_device_memory_bytes=3 * 2**20)
    assert on_gpu.summary().endswith("peak RSS " + f"{d['peak_memory_bytes'] / 2**20:.0f} MiB"
                                     "; peak GPU memory 3 MiB)")


def test_reported_accuracies_are_those_of_the_selected_model():
    res = run(small_config(epochs=20))
    again = evaluate(res.model, datasets.load("sbm", **SMALL_SBM))
    assert again["test_acc"] == res.test_acc and again["val_acc"] == res.val_acc
    best = res.history[res.best_epoch - 1]
    assert best.val_acc == res.val_acc and best.train_acc == res.train_acc


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = run(small_config()), run(small_config()), run(small_config(seed=1))
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not all(torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))


def test_karate_without_validation_selects_last_epoch():
    res = run(TrainConfig(model="gcn", dataset="karate", epochs=5, progress=False))
    assert res.val_acc is None and res.best_epoch == 5 and res.history[-1].val_acc is None


def test_weight_decay_on_first_layer_only(monkeypatch):
    groups = []
    real = torch.optim.Adam

    def spy(params, **kw):
        groups.extend(params)
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "Adam", spy)
    res = run(small_config(epochs=1))
    first = res.model.layers[0]
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    assert [id(p) for p in groups[0]["params"]] == [id(first.lin.weight)]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in res.model.parameters()} - {id(first.lin.weight)}


# -- early stopping -----------------------------------------------------------------------------

def _feed(stopper, seq):
    model = torch.nn.Linear(1, 1)
    out = []
    for epoch, (acc, loss) in enumerate(seq, 1):
        with torch.no_grad():
            model.weight.fill_(epoch)
        out.append(stopper.update(epoch, acc, loss, model))
    return out


def test_stopper_follows_gat_rule():
    s = _Stopper(patience=2)
    stops = _feed(s, [(0.5, 1.0), (0.6, 0.9), (0.6, 0.95), (0.55, 0.8), (0.5, 0.85), (0.5, 0.9)])
    # epoch 3 improves (acc ties the best), epoch 4 improves (loss), 5 and 6 do not -> stop at 6.
    assert stops == [False, False, False, False, False, True]
    # Selected: the last epoch where acc >= best and loss <= best held together: epoch 2.
    assert s.best_epoch == 2 and float(s.best_state["weight"]) == 2.0
    assert (s.best_acc, s.best_loss, s.bad_epochs) == (0.6, 0.8, 2)


def test_stopper_on_validation_loss_only():
    s = _Stopper(patience=2, selection="loss")
    stops = _feed(s, [(0.5, 1.0), (0.9, 0.9), (0.95, 0.9), (0.99, 0.95), (0.2, 0.85), (0.9, 0.86), (0.9, 0.85)])
    # Equal or higher loss is no improvement, whatever the accuracy: epochs 3-4 then 6-7.
    assert stops == [False, False, False, True, False, False, True]
    assert s.best_epoch == 5 and float(s.best_state["weight"]) == 5.0


def test_selection_is_checked():
    with pytest.raises(ConfigError, match=r"selection must be one of 'gat', 'loss' \(got 'acc'\)"):
        run(small_config(selection="acc"))


def test_stopper_without_patience_never_stops():
    s = _Stopper(patience=None)
    assert not any(_feed(s, [(0.5, 1.0)] + [(0.1, 9.0)] * 50))
    assert s.best_epoch == 1


def test_early_stopping_ends_the_run():
    res = run(small_config(epochs=400, patience=5))
    assert res.stopped_early and res.epochs_run < 400
    assert res.best_epoch <= res.epochs_run - 5


# -- checkpoints and resume ---------------------------------------------------------------------

class _Kill(Exception):
    pass


def _kill_at(k):
    def hook(stats):
        if stats.epoch == k:
            raise _Kill
    return hook


def _checkpoint(path):
    return load_checkpoint(Path(path) / CHECKPOINT_NAME)


def _assert_same_run(a: dict, b: dict):
    assert a["epoch"] == b["epoch"]
    for part in ("model",):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    for k in a["stopper"]["best_state"]:
        assert torch.equal(a["stopper"]["best_state"][k], b["stopper"]["best_state"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    strip = [{k: v for k, v in h.items() if k != "time_s"} for h in a["history"]]
    assert strip == [{k: v for k, v in h.items() if k != "time_s"} for h in b["history"]]


@pytest.mark.parametrize("model", ["gcn", "gat"])
def test_resume_after_interruption_gives_the_uninterrupted_model(tmp_path, model):
    # gat draws dropout masks on features and attention: the RNG state must be restored.
    cfg = dict(model=model, epochs=14, patience=30)
    full = run(small_config(**cfg, checkpoint=tmp_path / "a"))
    with pytest.raises(_Kill):
        run(small_config(**cfg, checkpoint=tmp_path / "b"), on_epoch=_kill_at(6))
    assert _checkpoint(tmp_path / "b")["epoch"] == 6
    resumed = run(small_config(**cfg, checkpoint=tmp_path / "b", resume=True))
    assert resumed.resumed_from == 6 and resumed.epochs_run == 14
    for (k, va), vb in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(va, vb), k
    assert (resumed.test_acc, resumed.best_epoch) == (full.test_acc, full.best_epoch)
    _assert_same_run(_checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b"))


def test_resume_a_finished_run_trains_further(tmp_path):
    full = run(small_config(epochs=10, checkpoint=tmp_path / "a"))
    run(small_config(epochs=6, checkpoint=tmp_path / "b"))
    more = run(small_config(epochs=10, checkpoint=tmp_path / "b", resume=True))
    assert more.resumed_from == 6 and more.epochs_run == 10
    _assert_same_run(_checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b"))
    again = run(small_config(epochs=10, checkpoint=tmp_path / "b", resume=True))
    assert again.epochs_run == 10 and again.epoch_time_s is None
    assert again.test_acc == full.test_acc


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from ngra.train import TrainConfig, run
    opts = {options!r}
    def hook(stats):
        if stats.epoch == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # after epoch 5's checkpoint is on disk
    run(TrainConfig(model="gat", dataset="sbm", dataset_options=opts, epochs=12, patience=30,
                    checkpoint=sys.argv[1], progress=False), on_epoch=hook)
""")


@pytest.mark.slow
def test_resume_after_sigkill_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", _KILLED_RUN.format(options=SMALL_SBM), str(tmp_path / "b")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _checkpoint(tmp_path / "b")["epoch"] == 5
    opts = [a for k, v in SMALL_SBM.items() for a in ("--dataset-option", f"{k}={v}")]
    resumed = subprocess.run(
        [sys.executable, "-m", "ngra", "train", "--model", "gat", "--dataset", "sbm", *opts, "--epochs", "12",
         "--patience", "30", "--checkpoint", str(tmp_path / "b"), "--resume", "--no-progress",
         "--metrics-json", str(tmp_path / "m.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    full = run(small_config(model="gat", epochs=12, patience=30, checkpoint=tmp_path / "a"))
    _assert_same_run(_checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b"))
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["resumed_from"] == 5 and metrics["test_acc"] == full.test_acc


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    run(small_config(epochs=3, checkpoint=tmp_path))
    good = (tmp_path / CHECKPOINT_NAME).read_bytes()
    real_save = torch.save

    def torn_save(obj, f):
        real_save({"half": torch.zeros(10)}, f)  # part of a file, then the "crash"
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        run(small_config(epochs=5, checkpoint=tmp_path, resume=True))
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


def test_resume_ignores_a_stale_temporary_file(tmp_path):
    run(small_config(epochs=3, checkpoint=tmp_path))
    (tmp_path / f".{CHECKPOINT_NAME}.99999.tmp").write_bytes(b"torn")
    assert run(small_config(epochs=4, checkpoint=tmp_path, resume=True)).epochs_run == 4


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"epochs": -5}, r"epochs must be an integer >= 1 \(got -5\)"),
    ({"epochs": 0}, r"epochs must be an integer >= 1 \(got 0\)"),
    ({"epochs": 2.5}, r"epochs must be an integer"),
    ({"lr": 0.0}, r"lr must be a number > 0.0 \(got 0.0\)"),
    ({"lr": -1e-3}, r"lr must be a number > 0.0"),
    ({"lr": float("nan")}, r"lr must be a number"),
    ({"dropout": 1.0}, r"dropout must be a number in \[0.0, 1.0\) \(got 1.0\)"),
    ({"dropout": -0.1}, r"dropout must be a number in \[0.0, 1.0\)"),
    ({"weight_decay": -1.0}, r"weight_decay must be a number >= 0.0"),
    ({"hidden": 0}, r"hidden must be an integer >= 1"),
    ({"patience": -1}, r"patience must be an integer >= 0"),
    ({"seed": -1}, r"seed must be an integer >= 0"),
    ({"model": "gcnn"}, r"unknown model 'gcnn'; choose one of gcn, sage"),
    ({"dataset": "corra"}, r"unknown dataset 'corra'; choose one of cora"),
    ({"resume": True}, r"resume needs a checkpoint folder: pass --checkpoint DIR"),
    ({"num_chunks": 0}, r"num_chunks must be an integer >= 1"),
    ({"memory_budget": "12M"}, r"memory_budget '12M' is not a memory size"),
    ({"device": "gpu7"}, r"device 'gpu7' is not a torch device"),
    ({"weight_decay_on": "last"}, r"weight_decay_on must be 'first' or 'all'"),
])
def test_bad_settings_raise_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        run(small_config(**kw))


def test_missing_data_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"data directory .*nope.* does not exist.*--data-dir"):
        run(TrainConfig(model="gcn", dataset="cora", data_dir=tmp_path / "nope", progress=False))
    with pytest.raises(ConfigError, match=r"not found.*or pass --data-dir"):
        run(TrainConfig(model="gcn", dataset="amazon-computers", data_dir=tmp_path, progress=False))


def test_unlabelled_dataset_is_refused():
    # R-MAT and edge lists: tests/ngra/test_train_loaders.py.
    karate = datasets.load("karate")
    unlabelled = dataclasses.replace(karate, y=None, train_mask=None, val_mask=None, test_mask=None)
    with pytest.raises(ConfigError, match=r"dataset 'karate' has no labels \(y\) and no training split "
                                          r"\(train_mask\); training needs features x \[N, F\], labels y"):
        run(TrainConfig(model="gcn", dataset="karate", progress=False), data=unlabelled)


@pytest.mark.parametrize("num_chunks", [None, 2])
def test_empty_training_split_is_a_data_error(num_chunks):
    # Streamed, the data is checked before the engine's first call: the error must not blame it.
    data = datasets.load("sbm", **SMALL_SBM)
    data = dataclasses.replace(data, train_mask=torch.zeros_like(data.train_mask))
    with pytest.raises(ConfigError, match=r"^dataset 'sbm' has an empty training split; nothing to train on$"):
        run(small_config(num_chunks=num_chunks), data=data)


def test_run_takes_a_dataset_record_under_any_name():
    data = datasets.load("sbm", **SMALL_SBM)
    res = run(TrainConfig(model="gcn", dataset="my-graph", epochs=3, progress=False), data=data)
    assert res.epochs_run == 3 and res.info["dataset"] == "my-graph"
    with pytest.raises(ConfigError, match=r"unknown dataset 'my-graph'; choose one of cora"):
        run(TrainConfig(model="gcn", dataset="my-graph", epochs=3, progress=False))
    with pytest.raises(ConfigError, match=r"dataset must be a name \(got ''\)"):
        run(TrainConfig(model="gcn", dataset="", epochs=3, progress=False), data=data)


def test_streamed_run_reports_what_the_engine_did():
    assert "streamed" not in run(small_config(epochs=2)).info
    res = run(small_config(epochs=2, num_chunks=3))
    # The engine's own record (ngra.Engine.last_run); its other fields belong to the engine's tests.
    assert res.info["streamed"]["num_intervals"] == 3 and res.info["streamed"]["ordering"] == "identity"
    json.dumps(res.to_dict())
    # A budget chooses P; the record says which (smaller budgets, more intervals).
    p = [run(small_config(epochs=1, memory_budget=b)).info["streamed"]["num_intervals"] for b in ("16KiB", "4KiB")]
    assert 1 < p[0] < p[1], p


def test_patience_without_validation_is_refused():
    with pytest.raises(ConfigError, match=r"no validation vertices.*--patience 0"):
        run(TrainConfig(model="gat", dataset="karate", progress=False))


def test_checkpoint_folder_rules(tmp_path):
    with pytest.raises(ConfigError, match=r"resume asked but .*last.pt does not exist"):
        run(small_config(checkpoint=tmp_path / "empty", resume=True))
    run(small_config(epochs=2, checkpoint=tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"already holds a checkpoint; pass --resume"):
        run(small_config(epochs=2, checkpoint=tmp_path / "c"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"is a file"):
        run(small_config(checkpoint=tmp_path / "file"))


def test_resume_with_other_settings_is_refused(tmp_path):
    run(small_config(epochs=2, checkpoint=tmp_path))
    with pytest.raises(ConfigError, match=r"other settings \(lr: checkpoint 0.01, now 0.02\)"):
        run(small_config(epochs=4, lr=0.02, checkpoint=tmp_path, resume=True))
    with pytest.raises(ConfigError, match=r"hidden: checkpoint 16, now 32"):
        run(small_config(epochs=4, hidden=32, checkpoint=tmp_path, resume=True))


def test_corrupt_checkpoint_is_refused(tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"last.pt is not an ngra checkpoint, or is damaged: expected its "
                                              r"first line to be 'NGRA-CHECKPOINT 2 sha256=<hex> bytes=<n>' "
                                              r"\(got b'not a checkpoint'\)"):
        run(small_config(checkpoint=tmp_path, resume=True))


def _tensor_data_offsets(path: Path) -> list[int]:
    """File offsets of the first byte of every tensor's data in a checkpoint (its zip records
    named .../data/<key>, after the header line)."""
    raw = path.read_bytes()
    start = raw.index(b"\n") + 1
    offsets = []
    with zipfile.ZipFile(io.BytesIO(raw[start:])) as z:
        for info in z.infolist():
            if "/data/" in info.filename and info.file_size:
                local = start + info.header_offset
                name_len, extra_len = struct.unpack("<HH", raw[local + 26:local + 30])
                offsets.append(local + 30 + name_len + extra_len)
    return offsets


def test_a_flipped_bit_in_tensor_data_is_refused(tmp_path):
    # Issue 20: torch.load checks no checksum of tensor data, so most such flips resumed silently
    # with other weights; the checksum now refuses every one before anything is restored.
    run(small_config(epochs=2, checkpoint=tmp_path))
    path = tmp_path / CHECKPOINT_NAME
    good = path.read_bytes()
    offsets = _tensor_data_offsets(path)
    assert len(offsets) >= 9
    silently_changed = 0
    for k, off in enumerate(offsets[:9]):
        bad = bytearray(good)
        bad[off + 1] ^= 1 << (k % 8)
        path.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=r"last.pt is damaged: the SHA-256 of its content is [0-9a-f]{16}"
                                                  r"\.\.\., expected [0-9a-f]{16}\.\.\. as recorded"):
            run(small_config(epochs=3, checkpoint=tmp_path, resume=True))
        # What the bare torch.load of the payload (the old format) made of it: often loaded, changed.
        try:
            flipped, clean = load_checkpoint_unchecked(bytes(bad)), load_checkpoint_unchecked(good)
        except Exception:  # noqa: BLE001 - torch refused this one itself
            continue
        silently_changed += any(not torch.equal(flipped[part][k], clean[part][k])
                                for part in ("model",) for k in clean[part])
        silently_changed += any(not torch.equal(flipped["optimizer"]["state"][i][k], v)
                                for i, s in clean["optimizer"]["state"].items() for k, v in s.items())
    assert silently_changed >= 1
    path.write_bytes(good)
    assert run(small_config(epochs=3, checkpoint=tmp_path, resume=True)).resumed_from == 2


def load_checkpoint_unchecked(raw: bytes) -> dict:
    return torch.load(io.BytesIO(raw[raw.index(b"\n") + 1:]), weights_only=True)


@pytest.mark.parametrize("how, match", [
    ("truncate", r"last.pt is cut short: expected \d+ bytes after its header \(got \d+\)"),
    ("extend", r"last.pt is longer than written: expected \d+ bytes after its header"),
    ("header", r"last.pt is not an ngra checkpoint, or is damaged: expected its first line"),
    ("version", r"last.pt has checkpoint format 3; this ngra reads format 2"),
    ("format-1", r"last.pt is a checkpoint without a checksum \(format 1, written by an older ngra, or a plain "
                 r"torch.save file\)"),
    ("empty", r"last.pt is not an ngra checkpoint"),
])
def test_damaged_checkpoint_files_are_refused(tmp_path, how, match):
    run(small_config(epochs=2, checkpoint=tmp_path))
    path = tmp_path / CHECKPOINT_NAME
    raw = path.read_bytes()
    body = raw[raw.index(b"\n") + 1:]
    edited = {"truncate": raw[:-100], "extend": raw + b"\0", "header": b"X" + raw[1:],
              "version": raw.replace(b"NGRA-CHECKPOINT 2", b"NGRA-CHECKPOINT 3", 1), "format-1": body,
              "empty": b""}[how]
    path.write_bytes(edited)
    with pytest.raises(CheckpointError, match=match):
        run(small_config(epochs=3, checkpoint=tmp_path, resume=True))


def _set(path, value):
    def edit(state):
        *keys, last = path
        for k in keys:
            state = state[k]
        if value is _DELETE:
            del state[last]
        else:
            state[last] = value(state[last]) if callable(value) else value
    return edit


_DELETE = object()


@pytest.mark.parametrize("edit, match", [
    (_set(["model"], _DELETE), r"holds no 'model' \(expected the keys format, version, epoch"),
    (_set(["epoch"], -5), r"holds epoch -5 \(expected an integer >= 1"),
    (_set(["epoch"], 7), r"holds a history of 2 epochs at epoch 7 \(expected one record per epoch\)"),
    (_set(["epoch"], "2"), r"holds epoch '2' \(expected an integer >= 1"),
    (_set(["stopped_early"], "no"), r"holds stopped_early 'no' \(expected True or False\)"),
    (_set(["rng", "torch"], lambda t: t[:100]), r"holds a torch RNG state of shape \(100,\) \(expected a uint8 "
                                                r"tensor of shape \(\d+,\)\)"),
    (_set(["rng", "python"], lambda s: (s[0], s[1][:10], s[2])), r"holds an RNG state that cannot be restored"),
    # numpy itself accepts pos 10**6 and then segfaults on the next draw.
    (_set(["rng", "numpy", "pos"], 10**6), r"holds an RNG state that cannot be restored \(ValueError: numpy's "
                                          r"state must be MT19937 with pos in \[0, 624\]"),
    (_set(["rng", "numpy", "has_gauss"], 7), r"pos in \[0, 624\] and has_gauss 0 or 1"),
    (_set(["rng", "torch"], lambda t: torch.zeros_like(t)), r"holds an RNG state that cannot be restored "
                                                           r"\(RuntimeError: Invalid mt19937 state\)"),
    (_set(["rng", "numpy", "keys"], lambda k: k[:5]), r"numpy's keys must be 624 integers"),
    (_set(["rng"], _DELETE), r"holds no 'rng'"),
    (_set(["history"], lambda h: h[:1]), r"a history of 1 epochs at epoch 2"),
    (_set(["history", 0, "epoch"], 9), r"holds history record 1 \{"),
    (_set(["stopper", "best_epoch"], 5), r"best_epoch 5 and bad_epochs 0 \(expected each in \[0, 2\]"),
    (_set(["stopper", "best_loss"], "low"), r"holds a 'stopper' without best_acc"),
    (_set(["model", "layers.0.lin.weight"], lambda w: w[:3]), r"its model do not match this model's parameters"),
    (_set(["model", "layers.0.lin.weight"], _DELETE), r"its model do not match this model's parameters"),
    (_set(["optimizer", "state", 0, "exp_avg"], lambda t: t[:1]), r"holds optimizer state 0 that does not fit "
                                                                  r"parameter 0 of this model at epoch 2 \(other keys than "
                                                                  r"Adam's exp_avg, exp_avg_sq, step, wrong shape"),
    (_set(["optimizer", "state", 0, "step"], lambda t: t + 100), r"optimizer state 0 .* more steps than epochs"),
    (_set(["optimizer", "state", 1, "exp_avg_sq"], lambda t: t.double()), r"holds optimizer state 1 .* wrong shape "
                                                                         r"or dtype"),
    # A flipped bit in a key's name (found by tests/fuzz): Adam's step failed with a KeyError.
    (_set(["optimizer", "state", 2], lambda s: {("exp_avg_sp" if k == "exp_avg_sq" else k): v for k, v in s.items()}),
     r"holds optimizer state 2 that does not fit parameter 2 of this model at epoch 2 \(other keys"),
    (_set(["optimizer", "param_groups", 0, "lr"], 10.0), r"has optimizer lr 10.0, but the run's settings give 0.01"),
    (_set(["optimizer", "param_groups"], lambda g: g[:1]), r"has 1 optimizer parameter groups, this run 2"),
    (_set(["optimizer", "param_groups", 1, "params"], lambda ids: ids[:1]), r"has an optimizer parameter group with "
                                                                            r"parameters \[1\] where this run has 3"),
    (_set(["fingerprint", "seed"], 3), r"was written by a run with other settings \(seed: checkpoint 3, now 0\)"),
    (_set(["format"], "other"), r"holds format 'other' version 2 \(expected 'ngra-checkpoint' version 2\)"),
])
def test_edited_but_loadable_checkpoints_are_refused(tmp_path, edit, match):
    # Edited through torch and written back with a valid checksum: the content itself is checked.
    run(small_config(epochs=2, checkpoint=tmp_path))
    path = tmp_path / CHECKPOINT_NAME
    state = load_checkpoint(path)
    edit(state)
    _save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=match) as info:
        run(small_config(epochs=3, checkpoint=tmp_path, resume=True))
    assert str(path) in str(info.value)


def test_a_plain_torch_file_is_still_readable_as_the_payload(tmp_path):
    # The payload after the header line is an ordinary torch.save archive.
    run(small_config(epochs=2, checkpoint=tmp_path))
    raw = (tmp_path / CHECKPOINT_NAME).read_bytes()
    header, _, payload = raw.partition(b"\n")
    assert header.startswith(b"NGRA-CHECKPOINT 2 sha256=") and header.endswith(b"bytes=%d" % len(payload))
    state = torch.load(io.BytesIO(payload), weights_only=True)
    assert state["epoch"] == 2 and state["version"] == 2
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["epoch"] == 2


def test_streaming_flags_are_checked():
    with pytest.raises(ConfigError, match=r"give one of memory_budget \('1GiB'\) and num_chunks \(2\), not both"):
        run(small_config(num_chunks=2, memory_budget="1GiB"))
    with pytest.raises(ConfigError, match=r"streaming engine cannot run gcn on sbm with --memory-budget 1B"):
        run(small_config(memory_budget="1B"))


def test_fit_checks_its_arguments():
    data = datasets.load("sbm", **SMALL_SBM)
    model = build_model("gcn", data.num_features, 8, data.num_classes)
    with pytest.raises(ConfigError, match=r"epochs must be an integer >= 1 \(got 0\)"):
        fit(model, data, epochs=0, lr=0.01)
    with pytest.raises(ConfigError, match=r"resume=True needs checkpoint=DIR"):
        fit(model, data, epochs=1, lr=0.01, resume=True)
    with pytest.raises(ConfigError, match=r"weight_decay_on='first' needs a model with a first layer"):
        fit(torch.nn.Linear(8, 3), data, epochs=1, lr=0.01, weight_decay=1e-3, weight_decay_on="first")


def test_fit_with_a_plain_model_and_forward_kwargs():
    data = datasets.load("sbm", **SMALL_SBM)
    torch.manual_seed(0)
    model = build_model("rgcn", data.num_features, 8, data.num_classes, num_relations=1)
    res = fit(model, data, epochs=5, lr=0.01, forward_kwargs=_forward_kwargs("rgcn", data.graph),
              progress=False)
    assert res.epochs_run == 5 and res.model is model


def test_labels_beyond_the_output_width_are_named():
    # Issue 20: torch's bare "IndexError: Target 2 is out of bounds" before.
    data = datasets.load("sbm", **SMALL_SBM)
    torch.manual_seed(0)
    narrow = build_model("gcn", data.num_features, 8, 2)  # 3 classes in the data
    first = int(data.train_mask.nonzero()[(data.y[data.train_mask] == 2).nonzero()[0, 0], 0])
    with pytest.raises(ConfigError, match=rf"^dataset 'sbm': vertex {first} of the train split has label 2, but the "
                                          r"model outputs 2 classes \(logits \[N, 2\]\), so labels must lie in "
                                          r"\[0, 2\); build the model with 3 outputs"):
        fit(narrow, data, epochs=1, lr=0.01, progress=False)
    with pytest.raises(ConfigError, match=r"has label 2, but the model outputs 2 classes"):
        evaluate(narrow, data)
    # Plain records (fit takes any object with these fields): ngra.datasets.Dataset checks y itself.
    def record(y, test_mask=data.test_mask):
        return types.SimpleNamespace(name="sbm", graph=data.graph, x=data.x, y=y, train_mask=data.train_mask,
                                     val_mask=data.val_mask, test_mask=test_mask)

    negative = record(torch.where(data.val_mask, -100, data.y))  # cross_entropy would skip -100
    with pytest.raises(ConfigError, match=r"of the val split has label -100, but the model outputs 3 classes"):
        fit(build_model("gcn", data.num_features, 8, 3), negative, epochs=1, lr=0.01, progress=False)
    # Vertices in no split may carry any label (OGB marks unlabelled ones), as before.
    test = data.test_mask & (torch.arange(240) % 2 == 0)
    unlabelled = ~(data.train_mask | data.val_mask | test)
    free = record(torch.where(unlabelled, -7, data.y), test)
    assert fit(build_model("gcn", data.num_features, 8, 3), free, epochs=1, lr=0.01, progress=False).epochs_run == 1
    floats = record(data.y.float())
    with pytest.raises(ConfigError, match=r"labels y must be an integer tensor \[N\] = \[240\] of class ids \(got "
                                          r"torch.float32 of shape \[240\]\)"):
        fit(build_model("gcn", data.num_features, 8, 3), floats, epochs=1, lr=0.01, progress=False)


@pytest.mark.parametrize("kw, match", [
    ({"num_layers": 100_000}, r"^num_layers must be at most 1024 \(got 100000\); every layer compiles"),
    ({"num_chunks": 10**9}, r"^num_chunks must be at most 256 \(got 1000000000\)"),
    ({"num_chunks": 241}, r"^num_chunks 241 is more than the 240 vertices of dataset 'sbm': every interval needs a "
                          r"vertex; give at most 240, e.g. --num-chunks 4$"),
    ({"hidden": 10**11}, r"^gcn with hidden=100000000000 and num_layers=2 on dataset 'sbm' \(240 vertices, 8 "
                         r"features\) needs at least \d+(\.\d+)? TiB \(parameters, gradients and Adam's moments, and "
                         r"one output per layer\), but this machine has .*; give a smaller --hidden or --num-layers$"),
    ({"model": "gin", "hidden": 10**11}, r"needs more than 2\*\*63 bytes"),
    ({"model": "gat", "hidden": 10**5, "heads": 10**4}, r"^gat with hidden=100000 x heads=10000 and num_layers=2"),
])
def test_sizes_beyond_the_machine_are_refused_before_allocating(kw, match):
    # Issue 20: --hidden 1e11 died in torch's allocator with a traceback, --num-layers 1e5 hung,
    # --num-chunks 1e9 grew to 24 GB and was OOM-killed.
    with pytest.raises(ConfigError, match=match):
        run(small_config(epochs=1, **kw))


def test_the_largest_accepted_num_chunks_still_runs():
    assert run(small_config(epochs=1, num_chunks=240)).info["streamed"]["num_intervals"] == 240
