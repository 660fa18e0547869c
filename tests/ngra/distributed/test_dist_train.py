"""`ngra train --workers K`: K real workers started by torch's elastic launcher train exactly as
one process (losses and accuracies of every epoch, dropout off), and what is not supported yet
is one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
BASE = ["-m", "ngra", "train", "--dataset", "sbm", "--dataset-option", "num_nodes=600",
        "--epochs", "4", "--dropout", "0", "--no-progress", "--seed", "1"]


def _train(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    res = subprocess.run([sys.executable, *BASE, *extra, "--metrics-json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


@pytest.mark.parametrize("model,workers,partition", [("gcn", 2, "metis"), ("sage", 3, "random")])
def test_workers_train_like_one_process(tmp_path, model, workers, partition):
    one, _ = _train(tmp_path, "one", "--model", model, "--save-model", str(tmp_path / "one.pt"))
    many, stdout = _train(tmp_path, "many", "--model", model, "--workers", str(workers),
                          "--partition", partition, "--save-model", str(tmp_path / "many.pt"))
    assert stdout.count(f"{model} on sbm:") == 1  # only rank 0 reports
    assert len(one["history"]) == len(many["history"]) == 4
    for a, b in zip(one["history"], many["history"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        for k in ("train_acc", "val_acc"):
            assert b[k] == pytest.approx(a[k], abs=1e-6)  # float32 mean vs exact count ratio
    for k in ("train_acc", "val_acc", "test_acc"):
        assert many[k] == pytest.approx(one[k], abs=1e-6)
    # rank 0 saves the selected weights, which are the same on every worker
    w1, wk = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("one", "many"))
    assert w1["build"] == wk["build"] and w1["state_dict"].keys() == wk["state_dict"].keys()
    for k, v in w1["state_dict"].items():
        torch.testing.assert_close(wk["state_dict"][k], v, rtol=1e-4, atol=1e-6)


def test_unsupported_combinations_are_one_line(tmp_path):
    res = subprocess.run([sys.executable, *BASE, "--model", "gcn", "--workers", "2",
                          "--checkpoint", str(tmp_path / "ck")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 2
    assert "--checkpoint with several workers is not supported yet" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    # Which worker failed and how, not the launcher's banner of '=' characters.
    assert re.match(r"ngra train: error: a worker failed \(worker \d: exit code 2(; worker \d: "
                    r"exit code 2|; the others were stopped)?\); see its error above$", last), last
    res = subprocess.run([sys.executable, *BASE, "--model", "gcn", "--workers", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--workers must be between 1 and 64 (got 0)" in res.stderr
