"""Worker launch helpers: the launcher's environment, torch's elastic launcher starting real
workers, and a worker's rows of a dataset record."""

from __future__ import annotations

import subprocess
import sys

import distutil
import pytest
import torch

from ngra.distributed.launch import WorkerInfo, launch, local_record, worker_info


def test_worker_info_from_the_environment(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert worker_info() == WorkerInfo(0, 1, 0, 0) and not worker_info().distributed
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert worker_info() == WorkerInfo(2, 3, 0, 1) and worker_info().distributed
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK=3 and WORLD_SIZE=3 from the environment are "
                                         "inconsistent"):
        worker_info()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match="RANK='two' must be an integer"):
        worker_info()


def test_launch_starts_workers_through_the_elastic_launcher(tmp_path):
    # A tiny module run as `python -m`, in a child process so the launcher's signal handlers
    # and workers stay out of pytest.
    pkg = tmp_path / "hello_workers.py"
    pkg.write_text("import os, sys\n"
                   "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(\n"
                   "    os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_PORT'])\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from ngra.distributed.launch import launch;"
            "launch([sys.argv[1]], 3, module='hello_workers')")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ,
                                                      "PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-2000:]
    seen = [(tmp_path / f"rank{r}").read_text().split() for r in range(3)]
    assert {w for w, _ in seen} == {"3"} and len({p for _, p in seen}) == 1
    with pytest.raises(ValueError, match="nproc must be an int >= 1"):
        launch([], 0)


def test_local_record_takes_the_workers_rows():
    class Piece:
        global_ids = torch.tensor([1, 3])

    class Data:
        name = "toy"
        x = torch.arange(8.0).reshape(4, 2)
        y = torch.tensor([0, 1, 2, 3])
        train_mask = torch.tensor([True, False, True, True])
        val_mask = None
        test_mask = torch.tensor([False, True, False, False])

    rec = local_record(Data(), Piece())
    assert rec.x.tolist() == [[2.0, 3.0], [6.0, 7.0]] and rec.y.tolist() == [1, 3]
    assert rec.train_mask.tolist() == [False, True] and rec.val_mask is None
    assert rec.test_mask.tolist() == [True, False] and rec.name == "toy"


def _finish(rank, world):
    import time

    from ngra.distributed.launch import wait_for_peers

    time.sleep(0.5 * rank)  # the last worker comes 1 s after the first
    t0 = time.monotonic()
    wait_for_peers(timeout=30)
    return time.monotonic() - t0


def _one_missing(rank, world):
    from ngra.distributed.launch import wait_for_peers

    if rank == 1:
        return "absent"
    wait_for_peers(timeout=2)


@pytest.mark.slow
def test_wait_for_peers_waits_for_the_last_worker_and_names_a_missing_one():
    waited = distutil.run(_finish, 3)
    assert waited[0] >= 0.9 and waited[2] < 0.5
    out = distutil.run(_one_missing, 2, expect_errors=True)
    assert out[1] == "absent"
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in out[0], out[0]


@pytest.fixture
def start_method():
    """Set spawn's start method in a test; the suite's own (tests/conftest.py) comes back after."""
    from ngra.distributed import launch as mod

    saved = dict(mod._START)
    yield lambda method: mod.set_spawn_start_method(method, saved["preload"])
    mod._START.update(saved)


def _env_and_output(rank, world):
    import os

    print(f"hello from {rank}")
    if rank == 1 and os.environ.get("NGRA_TEST_WORKER_FAILS") == "yes":
        raise ValueError("worker 1 was told to fail")
    return os.environ.get("NGRA_TEST_WORKER_VALUE")


@pytest.mark.parametrize("method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_spawn_workers_see_the_callers_environment_and_their_output_is_kept(
        method, start_method, monkeypatch, capfd):
    # The forkserver starts at its first use and keeps that environment: a variable set after
    # it started must still reach the workers, and what a forked worker prints (which would go
    # to the server's stdout) must reach the caller's output.
    start_method(method)
    monkeypatch.setenv("NGRA_TEST_WORKER_VALUE", "one")
    assert distutil.run(_env_and_output, 2) == ["one", "one"]
    monkeypatch.setenv("NGRA_TEST_WORKER_VALUE", "two")
    assert distutil.run(_env_and_output, 2) == ["two", "two"]
    out, err = capfd.readouterr()
    assert (out + err).count("hello from 0") == 2 and (out + err).count("hello from 1") == 2
    monkeypatch.setenv("NGRA_TEST_WORKER_FAILS", "yes")
    with pytest.raises(distutil.WorkerError, match=r"(?s)worker 1 raised:.*worker 1 was told"):
        distutil.run(_env_and_output, 2)


def _hangs(rank, world):
    import time

    if rank == 0:
        time.sleep(600)


@pytest.mark.slow  # waits out its 10 s limit
def test_spawn_kills_a_hung_worker_and_names_it(start_method, capfd):
    start_method("forkserver")
    with pytest.raises(distutil.WorkerError, match=r"worker\(s\) \[0\] of 2 did not finish "
                                                   r"within 10 s \(killed\)"):
        distutil.run(_hangs, 2, timeout=10)
    # faulthandler's dump, 5 s before the limit, says where the worker was stuck.
    out, err = capfd.readouterr()
    assert "output of worker 0 of 2" in err and "in _hangs" in err, err[-2000:]


def test_spawn_start_method_must_be_known():
    from ngra.distributed.launch import set_spawn_start_method

    with pytest.raises(ValueError, match="start method must be 'spawn' or 'forkserver' "
                                         "\\(got 'fork'\\)"):
        set_spawn_start_method("fork")
    with pytest.raises(TypeError, match=r"preload must be a list of module names \(got the "
                                        r"string 'torch'; write \['torch'\]\)"):
        set_spawn_start_method("forkserver", "torch")
