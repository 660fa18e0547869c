"""`ngra train --workers K`: K real workers started by torch's elastic launcher train exactly as
one process (losses and accuracies of every epoch, dropout off), also when each streams its
piece; a worker's error is one line; checkpoints resume bit for bit, also after the launcher
restarts failed workers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Every test here runs `ngra train` / `ngra partition` in fresh processes (14-65 s each on a
# 2-core machine): all slow, so the torch-2.2 floor session leaves them to the main one.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
BASE = ["-m", "ngra", "train", "--dataset", "sbm", "--dataset-option", "num_nodes=600",
        "--epochs", "4", "--dropout", "0", "--no-progress", "--seed", "1"]


def _train(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    res = subprocess.run([sys.executable, *BASE, *extra, "--metrics-json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


@pytest.mark.parametrize("model,workers,partition,extra", [
    ("gcn", 2, "metis", ()), ("sage", 3, "random", ()),
    ("gat", 2, "contiguous", ("--num-chunks", "3")), ("gat", 3, "metis", ("--exchange", "ring"))])
def test_workers_train_like_one_process(tmp_path, model, workers, partition, extra):
    """``--num-chunks``: each worker streams its piece through the engine (the one process does
    not); ``--exchange ring``: NGra's ring chunk sharing instead of the halo exchange."""
    one, _ = _train(tmp_path, "one", "--model", model, "--save-model", str(tmp_path / "one.pt"))
    many, stdout = _train(tmp_path, "many", "--model", model, "--workers", str(workers),
                          "--partition", partition, "--save-model", str(tmp_path / "many.pt"),
                          *extra)
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


def test_workers_train_like_one_process_with_dropout_on(tmp_path):
    """Dropout masks follow global vertex and edge ids, so K workers drop what one process
    drops: GAT (feature and attention dropout) on 3 workers has the one-process losses."""
    one, _ = _train(tmp_path, "one", "--model", "gat", "--dropout", "0.5")
    many, _ = _train(tmp_path, "many", "--model", "gat", "--dropout", "0.5", "--workers", "3",
                     "--partition", "random")
    losses = [h["loss"] for h in one["history"]]
    assert len(set(losses)) == len(losses)  # dropout on: every epoch differs
    for a, b in zip(one["history"], many["history"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["val_acc"] == pytest.approx(a["val_acc"], abs=1e-6)


def test_unsupported_combinations_are_one_line(tmp_path):
    res = subprocess.run([sys.executable, *BASE, "--model", "gcn", "--workers", "2",
                          "--memory-budget", "1B"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 2
    assert "the streaming engine cannot run gcn on sbm with --memory-budget 1B: memory_budget " \
           "1 B cannot be met" in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    # Which worker failed and how, not the launcher's banner of '=' characters.
    assert re.match(r"ngra train: error: a worker failed \(worker \d: exit code 2(; worker \d: "
                    r"exit code 2|; the others were stopped)?\); see its error above$", last), last
    res = subprocess.run([sys.executable, *BASE, "--model", "gcn", "--workers", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--workers must be between 1 and 64 (got 0)" in res.stderr


def _weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def test_checkpoint_and_resume_on_workers_is_bit_for_bit(tmp_path):
    """Dropout on (each worker draws from its own RNG stream): stopping after 3 epochs and
    resuming gives exactly the weights and history of an uninterrupted 6-epoch run."""
    common = ["--model", "gcn", "--workers", "2", "--dropout", "0.5", "--partition", "random"]
    whole, _ = _train(tmp_path, "whole", *common, "--epochs", "6", "--save-model",
                      str(tmp_path / "whole.pt"))
    ck = str(tmp_path / "ck")
    _train(tmp_path, "first", *common, "--epochs", "3", "--checkpoint", ck)
    resumed, _ = _train(tmp_path, "rest", *common, "--epochs", "6", "--checkpoint", ck, "--resume",
                        "--save-model", str(tmp_path / "resumed.pt"))
    assert resumed["resumed_from"] == 3

    def curve(m):
        return [(h["loss"], h["train_acc"], h["val_acc"], h["val_loss"]) for h in m["history"]]

    assert curve(resumed) == curve(whole)  # exactly: the first 3 epochs from the checkpoint
    a, b = _weights(tmp_path / "whole.pt"), _weights(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # On another number of workers the checkpoint is refused, naming the difference.
    res = subprocess.run([sys.executable, *BASE, *common[:2], "--workers", "3", "--epochs", "6",
                          "--checkpoint", ck, "--resume"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 2 and "workers: checkpoint 2, now 3" in res.stderr, res.stderr[-2000:]


def _workers_of(marker: str) -> list[int]:
    """pids of the worker processes of the `ngra train` launcher whose command line has marker."""
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if marker.encode() in cmd:
                procs[int(d.name)] = ppid
    return [pid for pid, ppid in procs.items() if ppid in procs]


def test_killed_worker_restarts_and_resumes_bit_for_bit(tmp_path):
    """torchrun-style elastic restart: a worker is killed (SIGKILL) after a checkpoint was written;
    the launcher restarts the group, which resumes from the checkpoint and ends with exactly the
    weights of an uninterrupted run."""
    import os
    import signal
    import time

    args = [sys.executable, "-m", "ngra", "train", "--dataset", "sbm", "--dataset-option",
            "num_nodes=6000", "--model", "gcn", "--epochs", "40", "--no-progress", "--seed", "1",
            "--workers", "2", "--partition", "contiguous"]
    ref = tmp_path / "ref.pt"
    subprocess.run([*args, "--save-model", str(ref)], check=True, capture_output=True,
                   timeout=600, cwd=ROOT)
    ck = tmp_path / "ck"
    out = tmp_path / "killed.pt"
    proc = subprocess.Popen([*args, "--checkpoint", str(ck), "--max-restarts", "1",
                             "--save-model", str(out), "--metrics-json", str(tmp_path / "m.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (ck / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        victims = _workers_of(str(ck))
        assert victims, "no worker found to kill"
        os.kill(victims[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-12000:]
    assert "restart 1 by the launcher: resuming from" in stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["resumed_from"] is not None and 1 <= m["resumed_from"] < 40
    a, b = _weights(ref), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stored_dataset_trains_like_the_dataset_on_one_process_and_on_workers(tmp_path):
    """`ngra partition` writes sbm as a chunk store; `ngra train --dataset FOLDER` on one
    process (which reads it whole) and on 3 workers streaming their pieces (each reads only its
    own) give the same run as training on sbm itself."""
    folder = tmp_path / "sbm-store"
    res = subprocess.run([sys.executable, "-m", "ngra", "partition", "--dataset", "sbm",
                          "--dataset-option", "num_nodes=600", "--seed", "1", "--out",
                          str(folder), "--intervals", "5", "--no-progress"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"wrote {folder}: 600 vertices" in res.stdout and "5 intervals (metis order" \
        in res.stdout, res.stdout
    one, _ = _train(tmp_path, "one", "--model", "gat")
    stored = subprocess.run([sys.executable, *BASE[:4], str(folder), *BASE[7:], "--model", "gat",
                             "--metrics-json", str(tmp_path / "stored.json")],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert stored.returncode == 0, stored.stderr[-3000:]
    many = subprocess.run([sys.executable, *BASE[:4], str(folder), *BASE[7:], "--model", "gat",
                           "--workers", "3", "--num-chunks", "2",
                           "--metrics-json", str(tmp_path / "many.json")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert many.returncode == 0, many.stderr[-3000:]
    for other in (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("stored", "many")):
        assert len(other["history"]) == len(one["history"]) == 4
        for a, b in zip(one["history"], other["history"]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            for k in ("train_acc", "val_acc"):
                assert b[k] == pytest.approx(a[k], abs=1e-6)
        for k in ("train_acc", "val_acc", "test_acc"):
            assert other[k] == pytest.approx(one[k], abs=1e-6)


def test_stored_dataset_errors_are_one_line(tmp_path):
    folder = tmp_path / "s"
    part = [sys.executable, "-m", "ngra", "partition", "--dataset", "sbm", "--dataset-option",
            "num_nodes=600", "--out", str(folder), "--intervals", "2", "--no-progress"]
    assert subprocess.run(part, capture_output=True, text=True, timeout=300,
                          cwd=ROOT).returncode == 0
    cases = [
        (part, "already holds a stored dataset; pass overwrite=True (--overwrite)"),
        ([sys.executable, "-m", "ngra", "partition", "--dataset", str(folder), "--out",
          str(tmp_path / "t"), "--intervals", "2"], "is already a stored dataset"),
        ([sys.executable, "-m", "ngra", "partition", "--dataset", "sbm", "--out",
          str(tmp_path / "u"), "--intervals", "0"], "--intervals must be >= 1 (got 0)"),
        ([sys.executable, *BASE[:4], str(folder), *BASE[7:], "--model", "gcn", "--workers",
          "2", "--partition", "random"], "--partition random does not apply to the stored "
                                         "dataset"),
        ([sys.executable, *BASE[:4], str(folder), *BASE[7:], "--model", "gcn", "--workers",
          "3"], "has 2 intervals, fewer than the 3 workers"),
    ]
    for argv, message in cases:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 2 and message in res.stderr, (argv, res.stderr[-2000:])
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "keep.txt").write_text("mine")
    plain = [str(tmp_path / "plain") if a == str(folder) else a for a in part]
    res = subprocess.run(plain, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "is a folder that is not a stored dataset" in res.stderr
    assert (tmp_path / "plain" / "keep.txt").read_text() == "mine"  # nothing there replaced


def test_stored_dataset_settings_that_cannot_apply_are_refused(tmp_path):
    folder = tmp_path / "n"
    assert subprocess.run([sys.executable, "-m", "ngra", "partition", "--dataset", "sbm",
                           "--dataset-option", "num_nodes=600", "--normalize-features", "--out",
                           str(folder), "--intervals", "2", "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT).returncode == 0
    for extra, message in ((["--raw-features"], "--raw-features cannot apply"),
                           (["--dataset-option", "num_nodes=10"],
                            "dataset options (num_nodes) do not apply to the stored dataset")):
        for workers in ([], ["--workers", "2"]):
            res = subprocess.run([sys.executable, *BASE[:4], str(folder), *BASE[7:], "--model",
                                  "gcn", *extra, *workers], capture_output=True, text=True,
                                 timeout=300, cwd=ROOT)
            assert res.returncode == 2 and message in res.stderr, (extra, workers,
                                                                   res.stderr[-2000:])
