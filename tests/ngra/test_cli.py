"""Tests of the command line (ngra.cli): train, info, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngra.cli import main

REPO = Path(__file__).resolve().parents[2]
SMALL_SBM = ["--dataset-option", "num_nodes=150", "--dataset-option", "num_classes=3",
             "--dataset-option", "num_features=8", "--dataset-option", "train_per_class=10",
             "--dataset-option", "val_per_class=10"]


def train(*args):
    return main(["train", "--model", "gcn", "--dataset", "sbm", *SMALL_SBM, "--no-progress", *args])


def test_train_writes_metrics_json_and_prints_a_final_line(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert train("--epochs", "6", "--seed", "3", "--metrics-json", str(out)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gcn on sbm: train_acc ") and "test_acc" in lines[0]
    m = json.loads(out.read_text())
    for key in ("train_acc", "val_acc", "test_acc"):
        assert 0.0 <= m[key] <= 1.0
    assert m["epoch_time_s"] > 0 and m["peak_memory_bytes"] > 2**20
    assert m["epochs_run"] == 6 and len(m["history"]) == 6
    assert m["info"]["seed"] == 3 and m["info"]["dataset_options"]["num_nodes"] == 150
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, then renamed


def test_flags_override_model_defaults(tmp_path):
    out = tmp_path / "m.json"
    assert train("--epochs", "2", "--hidden", "5", "--lr", "0.02", "--weight-decay", "0",
                 "--dropout", "0.1", "--weight-decay-on", "all", "--metrics-json", str(out)) == 0
    info = json.loads(out.read_text())["info"]
    assert (info["hidden"], info["lr"], info["weight_decay"], info["dropout"], info["weight_decay_on"]) == \
        (5, 0.02, 0.0, 0.1, "all")


def test_log_every_prints_epoch_lines(capsys):
    assert train("--epochs", "4", "--log-every", "2") == 0
    out = capsys.readouterr().out
    assert "epoch     2  loss " in out and "epoch     4  loss " in out and "epoch     3" not in out


def test_checkpoint_and_resume(tmp_path):
    ck = tmp_path / "ck"
    assert train("--epochs", "3", "--checkpoint", str(ck)) == 0
    out = tmp_path / "m.json"
    assert train("--epochs", "5", "--checkpoint", str(ck), "--resume", "--metrics-json", str(out)) == 0
    m = json.loads(out.read_text())
    assert m["resumed_from"] == 3 and m["epochs_run"] == 5


@pytest.mark.parametrize("args, message", [
    (["--epochs", "-5"], "epochs must be an integer >= 1 (got -5)"),
    (["--lr", "0"], "lr must be a number > 0.0 (got 0.0)"),
    (["--lr", "-0.1"], "lr must be a number > 0.0 (got -0.1)"),
    (["--dropout", "1"], "dropout must be a number in [0.0, 1.0) (got 1.0)"),
    (["--dropout", "-0.5"], "dropout must be a number in [0.0, 1.0) (got -0.5)"),
    (["--hidden", "0"], "hidden must be an integer >= 1 (got 0)"),
    (["--epochs", "ten"], "argument --epochs: invalid int value: 'ten'"),
    (["--resume"], "resume needs a checkpoint folder: pass --checkpoint DIR"),
    (["--num-chunks", "2", "--memory-budget", "1GiB"], "give one of memory_budget ('1GiB') and num_chunks (2)"),
    (["--memory-budget", "lots"], "memory_budget 'lots' is not a memory size"),
    (["--dataset-option", "oops"], "--dataset-option expects KEY=VALUE (got 'oops')"),
    (["--dataset-option", "colour=red"], "got unknown option(s) ['colour']"),
    (["--device", "cuda:0" if not __import__("torch").cuda.is_available() else "tpu"], "device"),
    (["--metrics-json", "/nonexistent-dir/m.json"], "--metrics-json: folder '/nonexistent-dir' does not exist"),
])
def test_bad_train_input_exits_2_with_one_line(args, message, capsys):
    assert train(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ngra train: error: "), err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["train", "--model", "gcnn", "--dataset", "sbm"], "unknown model 'gcnn'; choose one of gcn,"),
    (["train", "--model", "gcn", "--dataset", "corra"], "unknown dataset 'corra'; choose one of cora,"),
    (["train", "--model", "gcn", "--dataset", "cora", "--data-dir", "/nonexistent/data"],
     "data directory '/nonexistent/data' does not exist or is not a folder; pass --data-dir"),
    (["train", "--dataset", "sbm"], "the following arguments are required: --model"),
    (["info", "--dataset", "corra"], "unknown dataset 'corra'"),
    (["info", "--dataset", "cora", "--data-dir", "/nonexistent/data"], "data directory '/nonexistent/data'"),
    (["train", "--model", "gcn", "--dataset", "rmat"],
     "ngra train: error: dataset 'rmat' cannot be trained on: R-MAT generates edges only, without vertex "
     "features, labels or a split. Train on a labelled dataset such as sbm"),
    (["info", "--dataset", "rmat"], "ngra info: error: load('rmat') needs the option(s) ['num_edges'], e.g. "
                                    "load('rmat', num_edges=...) (on the command line: --dataset-option num_edges=...)"),
    (["info", "--dataset", "karate", "--dataset-option", "oops"], "ngra info: error: --dataset-option expects KEY=VALUE"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_names_and_folders_exit_2_with_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ngra"), err
    assert message in err and "Traceback" not in err


def test_checkpoint_written_for_other_settings_is_a_user_error(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert train("--epochs", "2", "--checkpoint", str(ck)) == 0
    assert train("--epochs", "4", "--lr", "0.5", "--checkpoint", str(ck), "--resume") == 2
    err = capsys.readouterr().err
    assert "other settings (lr: checkpoint 0.01, now 0.5)" in err and err.count("\n") == 1


def test_streaming_flags(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert train("--epochs", "2", "--num-chunks", "2", "--metrics-json", str(out)) == 0
    info = json.loads(out.read_text())["info"]
    assert info["num_chunks"] == 2 and info["streamed"]["num_intervals"] == 2
    assert train("--epochs", "2", "--memory-budget", "1B") == 2
    err = capsys.readouterr().err
    assert "streaming engine cannot run gcn on sbm with --memory-budget 1B" in err and err.count("\n") == 1


def test_info_prints_statistics(capsys):
    assert main(["info", "--dataset", "karate"]) == 0
    out = capsys.readouterr().out
    assert "num_nodes" in out and " 34\n" in out and "num_edges" in out
    assert main(["info", "--dataset", "karate", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_nodes"] == 34 and stats["num_edges"] == 156 and stats["num_classes"] == 2


def test_info_takes_dataset_options(capsys):
    assert main(["info", "--dataset", "rmat", "--dataset-option", "scale=5", "--dataset-option", "num_edges=100",
                 "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["name"], stats["num_nodes"], stats["num_edges"], stats["num_classes"]) == ("rmat", 32, 100, 0)


def test_python_dash_m_runs_the_same_command_line():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "ngra", "info", "--dataset", "karate", "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["num_nodes"] == 34
    bad = subprocess.run([sys.executable, "-m", "ngra", "train", "--model", "gcn", "--dataset", "sbm",
                          "--epochs", "-1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "ngra train: error: epochs must be an integer >= 1 (got -1); give the " \
                                 "number of epochs to train, e.g. --epochs 200"
