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


# -- issue 20: reliability ----------------------------------------------------------------------

def one_line_error(capsys, command="train") -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ngra {command}: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args, message", [
    (["--lr", "1e308", "--epochs", "5"], "the training loss became nan at epoch 2; lower the learning rate "
                                         "(lr=1e+308) or check the features for inf/nan"),
    (["--hidden", "100000000000"], "gcn with hidden=100000000000 and num_layers=2 on dataset 'sbm' (150 vertices, "
                                   "8 features) needs at least "),
    (["--num-layers", "100000"], "num_layers must be at most 1024 (got 100000)"),
    (["--num-chunks", "1000000000"], "num_chunks must be at most 256 (got 1000000000)"),
    (["--num-chunks", "151"], "num_chunks 151 is more than the 150 vertices of dataset 'sbm'"),
])
def test_out_of_range_numbers_are_one_line_errors(args, message, capsys):
    # Each was a traceback (or a hang, or an OOM kill) before.
    assert train(*args) == 2
    assert message in one_line_error(capsys)


def test_metrics_json_is_checked_before_training(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert train("--epochs", "2", "--checkpoint", str(ck), "--metrics-json", str(tmp_path)) == 2
    assert f"--metrics-json {str(tmp_path)!r} is a folder; give a file name such as" in one_line_error(capsys)
    assert not ck.exists()  # refused before anything ran
    # Not a regular file (like /dev/null, which os.replace would replace: never test with the real
    # one, as root a regression would delete it): a FIFO of our own.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert train("--epochs", "2", "--metrics-json", str(fifo)) == 2
    assert f"--metrics-json {str(fifo)!r} exists and is not a regular file" in one_line_error(capsys)
    assert fifo.exists() and not fifo.is_file()
    if Path("/proc/self").is_dir():  # a folder nobody, root included, can create files in
        assert train("--epochs", "2", "--metrics-json", "/proc/m.json") == 2
        assert "--metrics-json: cannot write to folder '/proc' (" in one_line_error(capsys)
    assert not list(tmp_path.glob(".*tmp"))


def test_metrics_json_write_failure_after_training_keeps_the_result_line(tmp_path, capsys, monkeypatch):
    import ngra.cli

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ngra.cli.os, "replace", full)
    assert train("--epochs", "2", "--metrics-json", str(tmp_path / "m.json")) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("gcn on sbm: train_acc ")
    assert captured.err.count("\n") == 1 and "No space left on device" in captured.err
    assert "the run finished and its result is the line above" in captured.err
    assert not list(tmp_path.iterdir())


def test_info_on_a_graph_too_large_for_memory_is_one_line(capsys):
    # 2**40 vertices: per-vertex statistics need terabytes (a traceback from torch's allocator
    # before); the dataset loader may also refuse the scale itself. Either way: one line.
    assert main(["info", "--dataset", "rmat", "--dataset-option", "scale=40", "--dataset-option",
                 "num_edges=100"]) == 2
    one_line_error(capsys, "info")


def test_damaged_or_edited_checkpoint_is_one_line(tmp_path, capsys):
    from ngra.train import CHECKPOINT_NAME, _save_checkpoint, load_checkpoint

    ck = tmp_path / "ck"
    assert train("--epochs", "2", "--checkpoint", str(ck)) == 0
    path = ck / CHECKPOINT_NAME
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert train("--epochs", "3", "--checkpoint", str(ck), "--resume") == 2
    assert f"{path} is damaged: the SHA-256 of its content is" in one_line_error(capsys)
    path.write_bytes(good)
    state = load_checkpoint(path)
    state["epoch"] = -5
    _save_checkpoint(path, state)
    assert train("--epochs", "3", "--checkpoint", str(ck), "--resume") == 2
    assert f"{path} holds epoch -5 (expected an integer >= 1" in one_line_error(capsys)


_INTERRUPTIBLE = ("import sys; from ngra.cli import main; print('started', flush=True); "
                  "sys.exit(main(sys.argv[1:]))")


def _interrupt(tmp_path, args, *, after: str, delay: float = 0.0):
    """Run the CLI in a child, send SIGINT ``delay`` s after ``after`` appears on its stdout;
    returns (exit status, stderr)."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    # A test run started in the background of a non-interactive shell ignores SIGINT, and a
    # child inherits that (Python then installs no KeyboardInterrupt handler): give the child
    # the default disposition, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if after in line:
                break
            assert time.monotonic() < deadline, "the CLI printed nothing expected"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_sigint_during_setup_exits_130_without_a_traceback_or_a_resume_hint(tmp_path):
    # Issue 20: Ctrl-C in the first second printed a KeyboardInterrupt traceback (exit -2), and
    # the line mentioned --resume before any checkpoint existed. Here SIGINT arrives as soon as
    # main() starts: while the (larger) graph is generated and the model compiled.
    ck = tmp_path / "ck"
    code, err = _interrupt(tmp_path, ["train", "--model", "gat", "--dataset", "sbm", "--dataset-option",
                                      "num_nodes=20000", "--epochs", "50", "--no-progress", "--checkpoint",
                                      str(ck)], after="started", delay=0.3)
    assert code == 130, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    if (ck / "last.pt").exists():  # the signal came late on a slow machine: then resuming is right
        assert "run the same command with --resume" in err, err
    else:
        assert "--resume" not in err, err
        assert err in ("ngra train: interrupted before the first checkpoint was written; nothing to resume\n",
                       "ngra train: interrupted\n"), err  # the latter: still parsing the arguments


def test_sigint_after_a_checkpoint_says_how_to_resume(tmp_path):
    ck = tmp_path / "ck"
    code, err = _interrupt(tmp_path, ["train", "--model", "gcn", "--dataset", "sbm", *SMALL_SBM, "--epochs",
                                      "100000", "--no-progress", "--log-every", "1", "--checkpoint", str(ck)],
                           after="epoch     1")
    assert code == 130, err
    assert err == (f"ngra train: interrupted; to continue from the last checkpoint, run the same command with "
                   f"--resume (it is in {ck})\n")
    from ngra.train import load_checkpoint

    assert load_checkpoint(ck / "last.pt")["epoch"] >= 1


def test_a_closed_pipe_is_not_a_traceback():
    """`ngra info ... | head -1`: the reader goes away; exit 141 (SIGPIPE's status), no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "ngra", "info", "--dataset", "karate", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
