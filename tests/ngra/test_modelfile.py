"""Saved models: ``ngra train --save-model`` writes the *selected* weights, which
``torch.load(weights_only=True)`` + ``build_model`` and ``ngra evaluate`` / ``ngra predict`` read
back; damaged or foreign files are one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ngra.cli import main
from ngra.modelfile import ModelFileError, load_model, save_model
from ngra.nn import build_model
from ngra.train import TrainConfig, evaluate, load_dataset, run

SBM = {"num_nodes": 150, "num_classes": 3, "num_features": 8, "train_per_class": 10,
       "val_per_class": 10}
SBM_ARGS = [a for k, v in SBM.items() for a in ("--dataset-option", f"{k}={v}")]


def _config(tmp_path, **kw):
    # lr 0.3 overfits: validation loss is lowest at epoch 7 of 40.
    return TrainConfig(model="gcn", dataset="sbm", dataset_options=SBM, epochs=40, lr=0.3,
                       selection="loss", progress=False, save_model=tmp_path / "m.pt", **kw)


def test_saved_weights_are_the_selected_epochs_and_reload_plainly(tmp_path):
    res = run(_config(tmp_path, checkpoint=tmp_path / "ck"))
    f = torch.load(tmp_path / "m.pt", weights_only=True)
    assert f["format"] == "ngra-model" and f["model"] == "gcn"
    assert f["build"] == {"in_dim": 8, "hidden": 16, "out_dim": 3, "num_layers": 2,
                          "dropout": 0.5, "heads": 8}
    assert f["metrics"]["best_epoch"] == res.best_epoch and f["metrics"]["test_acc"] == res.test_acc
    model = build_model(f["model"], **f["build"])
    model.load_state_dict(f["state_dict"])
    for k, v in res.model.state_dict().items():
        assert torch.equal(f["state_dict"][k], v)
    data = load_dataset("sbm", options=SBM)
    assert evaluate(model, data)["test_acc"] == res.test_acc
    # The checkpoint holds the last epoch's weights; the saved model the selected epoch's.
    assert res.best_epoch < res.epochs_run, "the run must select an earlier epoch to show this"
    from ngra.train import load_checkpoint

    last = load_checkpoint(tmp_path / "ck" / "last.pt")["model"]
    assert any(not torch.equal(last[k], f["state_dict"][k]) for k in last)


def test_evaluate_and_predict_commands(tmp_path, capsys):
    assert main(["train", "--model", "sage", "--dataset", "sbm", *SBM_ARGS, "--epochs", "8",
                 "--no-progress", "--seed", "2", "--save-model", str(tmp_path / "s.pt"),
                 "--metrics-json", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    capsys.readouterr()
    assert main(["evaluate", "--model-file", str(tmp_path / "s.pt"), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    for k in ("train_acc", "val_acc", "test_acc"):
        assert ev[k] == metrics[k]
    model, info = load_model(tmp_path / "s.pt")
    data = load_dataset("sbm", seed=2, options=SBM)
    with torch.no_grad():
        prob = model(data.graph, data.x).softmax(-1)
    for suffix in (".npy", ".csv", ".pt"):
        out = tmp_path / f"p{suffix}"
        assert main(["predict", "--model-file", str(tmp_path / "s.pt"), "--output", str(out)]) == 0
        assert f"predicted 150 vertices -> {out}" in capsys.readouterr().out
        if suffix == ".npy":
            assert np.array_equal(np.load(out), prob.argmax(-1).numpy())
        elif suffix == ".pt":
            torch.testing.assert_close(torch.load(out, weights_only=True), prob)
        else:
            rows = out.read_text().splitlines()
            assert rows[0] == "vertex,class,probability" and len(rows) == 151
            v, c, p = rows[7].split(",")
            assert (int(v), int(c)) == (6, int(prob[6].argmax())) and float(p) == \
                pytest.approx(float(prob[6].max()), abs=1e-6)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_model_files_are_one_line_errors(tmp_path, capsys):
    model = build_model("gcn", 8, 4, 3)
    good = save_model(tmp_path / "g.pt", model, name="gcn",
                      build=dict(in_dim=8, hidden=4, out_dim=3), data={"dataset": "sbm"})
    raw = good.read_bytes()
    cases = {
        "missing.pt": (None, "model file '{p}' not found"),
        "cut.pt": (raw[: len(raw) // 2], "{p}: not a readable model file"),
        "other.pt": ({"weights": 1}, "{p}: not an ngra model file; write one with"),
        "ck.pt": ({"optimizer": {}, "model": {}}, "not an ngra model file (a checkpoint?"),
        "v9.pt": ({"format": "ngra-model", "version": 9}, "model file version 9; this ngra reads "
                                                         "version 1"),
        "shape.pt": ({"format": "ngra-model", "version": 1, "model": "gcn",
                      "build": dict(in_dim=8, hidden=5, out_dim=3),
                      "state_dict": model.state_dict()}, "the saved weights do not fit model 'gcn'"),
    }
    for name, (content, message) in cases.items():
        p = tmp_path / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif content is not None:
            torch.save(content, p)
        with pytest.raises(ModelFileError, match=None) as e:
            load_model(p)
        assert message.format(p=p) in str(e.value)
        err = _error(capsys, ["evaluate", "--model-file", str(p)])
        assert err.startswith("ngra evaluate: error: ") and message.format(p=p) in err
    # Data that does not fit the model, and a bad output path.
    err = _error(capsys, ["evaluate", "--model-file", str(good), "--dataset-option",
                          "num_features=5"])
    assert "has 5 features per vertex but the model was built for 8" in err
    err = _error(capsys, ["predict", "--model-file", str(good), "--output", str(tmp_path / "p.txt")])
    assert "--output" in err and "must end in one of .npy, .csv, .pt" in err
    err = _error(capsys, ["train", "--model", "gcn", "--dataset", "sbm", "--save-model",
                          str(tmp_path / "no" / "m.pt")])
    assert "--save-model: folder" in err and "does not exist" in err
