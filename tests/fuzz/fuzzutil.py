"""Fault injection for every file format ngra reads: seeded byte flips, overwrites and
truncations, each loaded in a child process so that a crash (a signal) is a test failure.

A *target* is a class in a test module with:

- ``errors``: the project's own exception types a refusal may raise (e.g. ``(StoreError,)``);
- ``make(directory) -> list[str]``: write the clean files into ``directory`` and return the
  relative paths of the files to corrupt;
- ``load(directory)``: read them back with the public API and return their content (tensors,
  arrays, numbers, strings, nested in dicts / lists / tuples / dataclasses);
- optionally ``reference(directory)``: for formats that carry no checksum, where a changed byte
  can be a different but valid file (a digit in a text edge list), an independent, slow reading
  of the same files by the format's specification, returning what ``load`` should return, or
  raising any exception for bytes that are not a valid file.

Each fault is one mutation of one of those files. The child loads the mutated copy and classifies
it:

- ``refused``: one of ``errors`` was raised and its message names the corrupted file (its base
  name, or for a file inside a folder, the folder's name);
- ``identical``: loaded with exactly the clean content (e.g. a flipped bit in padding);
- ``valid-change`` (only for targets with ``reference``): loaded content that differs from the
  clean file's but equals what the reference reads from the mutated bytes -- the format cannot
  tell this file from a genuine one, and the loader read it exactly as specified;
- ``changed``: loaded but the content differs (and, with a ``reference``, differs from the
  reference's reading, or the reference refuses those bytes) -- a silent change, a failure;
- ``wrong-error``: another exception type, or a message that does not name the file -- a failure;
- ``crashed`` (seen by the parent): the child died by a signal or ran past its time limit while
  loading that fault -- a failure.

The children write one JSON line per fault, and a ``start`` line before each, so a crash is
attributed to the fault that caused it. An address-space limit (``NGRA_FUZZ_MEMORY_GIB``,
default 6) turns an allocation that a size check missed into a failure instead of an OOM kill.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent

KINDS = ("bitflip", "byte", "bytes", "truncate", "zero-tail", "extend")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One mutation: ``kind`` of the file ``rel`` at byte ``offset`` (``value``: see mutate)."""

    index: int
    rel: str
    kind: str
    offset: int
    value: int

    def describe(self) -> str:
        return f"fault {self.index}: {self.kind} of {self.rel} at byte {self.offset} (value {self.value})"


def plan(sizes: dict[str, int], count: int, seed: int) -> list[Fault]:
    """``count`` seeded faults spread over the files (``sizes``: relative path -> bytes)."""
    rng = np.random.default_rng(seed)
    rels = sorted(sizes)
    faults = []
    for k in range(count):
        rel = rels[k % len(rels)]
        size = max(sizes[rel], 1)
        kind = KINDS[int(rng.integers(len(KINDS)))]
        # Half the faults land in the first 512 bytes, where headers and sizes live.
        head = min(size, 512)
        offset = int(rng.integers(head)) if rng.random() < 0.5 else int(rng.integers(size))
        value = int(rng.integers(1 << 30))
        faults.append(Fault(k, rel, kind, offset, value))
    return faults


def mutate(data: bytes, fault: Fault) -> bytes:
    """The bytes of the file after ``fault``; always different from ``data`` when it is not empty."""
    buf = bytearray(data)
    n = len(buf)
    off = min(fault.offset, max(n - 1, 0))
    if fault.kind == "bitflip" and n:
        buf[off] ^= 1 << (fault.value % 8)
    elif fault.kind == "byte" and n:
        buf[off] = (buf[off] + 1 + fault.value % 255) % 256
    elif fault.kind == "bytes" and n:
        rng = np.random.default_rng(fault.value)
        span = min(n - off, 1 + fault.value % 16)
        new = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
        if new == bytes(buf[off:off + span]):
            new = bytes((b + 1) % 256 for b in new)
        buf[off:off + span] = new
    elif fault.kind == "truncate" and n:
        del buf[off:]
    elif fault.kind == "zero-tail" and n:
        buf[off:] = bytes(n - off) if any(buf[off:]) else b"\xff" * (n - off)
    else:  # extend (or any kind on an empty file)
        buf += np.random.default_rng(fault.value).integers(0, 256, 1 + fault.value % 64,
                                                           dtype=np.uint8).tobytes()
    return bytes(buf)


def digest(obj) -> str:
    """A stable hash of loaded content: exact values, dtypes and shapes; NaNs compare equal."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        if obj.is_sparse:
            obj = obj.coalesce()
            _feed(h, ("sparse", obj.indices(), obj.values(), tuple(obj.shape)))
            return
        obj = obj.contiguous().numpy() if obj.dtype != torch.bfloat16 else obj.float().numpy()
    if isinstance(obj, np.ndarray):
        h.update(f"nd{obj.dtype.str}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, np.generic)):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        raise TypeError(f"fuzz target returned a {type(obj).__name__}; return tensors, arrays, "
                        "numbers, strings or containers of them")


def names_file(message: str, rel: str) -> bool:
    """Whether an error message names the corrupted file ``rel`` (or a folder holding it)."""
    parts = Path(rel).parts
    return any(p in message for p in parts)


# --------------------------------------------------------------------------------------------
# Child side.

def _load_target(spec: str):
    path, _, name = spec.partition("::")
    module_spec = importlib.util.spec_from_file_location(f"_fuzz_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(Path(path).parent))
    module_spec.loader.exec_module(module)
    return getattr(module, name)()


def _limit_memory() -> None:
    gib = float(os.environ.get("NGRA_FUZZ_MEMORY_GIB", "6"))
    if gib > 0:
        import resource

        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _child(spec: str, workdir: str, faults_json: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    target = _load_target(spec)
    work = Path(workdir)
    clean = work / "clean"
    clean_digest = digest(target.load(clean))
    faults = [Fault(**f) for f in json.loads(Path(faults_json).read_text())]
    _limit_memory()
    with open(out, "a", buffering=1) as log:
        for fault in faults:
            case = work / f"case{fault.index}"
            shutil.copytree(clean, case)
            target_file = case / fault.rel
            target_file.write_bytes(mutate(target_file.read_bytes(), fault))
            log.write(json.dumps({"start": fault.index}) + "\n")
            log.flush()
            try:
                got = digest(target.load(case))
            except target.errors as e:
                msg = str(e)
                outcome = "refused" if names_file(msg, fault.rel) else "wrong-error"
                detail = f"{type(e).__name__}: {msg}"
            except BaseException as e:  # noqa: BLE001 - classifying every escape is the point
                outcome, detail = "wrong-error", f"{type(e).__name__}: {e}"
            else:
                outcome, detail = ("identical", "") if got == clean_digest else _changed(target, case, got)
            log.write(json.dumps({"index": fault.index, "outcome": outcome,
                                  "detail": detail[:400]}) + "\n")
            log.flush()
            shutil.rmtree(case, ignore_errors=True)


def _changed(target, case: Path, got: str) -> tuple[str, str]:
    """Classify a load whose content differs from the clean one (see the module docstring)."""
    if not hasattr(target, "reference"):
        return "changed", ""
    try:
        expected = digest(target.reference(case))
    except Exception as e:  # noqa: BLE001 - any refusal by the reference
        return "changed", f"loaded, but the reference refuses these bytes: {type(e).__name__}: {e}"
    if expected != got:
        return "changed", "loaded content differs from the reference's reading of the same bytes"
    return "valid-change", ""


# --------------------------------------------------------------------------------------------
# Parent side.

OK_OUTCOMES = ("refused", "identical", "valid-change")

@dataclasses.dataclass
class Report:
    target: str
    counts: Counter
    failures: list[str]
    has_reference: bool = False

    def __str__(self) -> str:
        c = self.counts
        valid = (f"{c['valid-change']} loaded a different valid file exactly as the reference reads "
                 "it, " if self.has_reference or c["valid-change"] else "")
        return (f"{self.target}: {sum(c.values())} faults injected, {c['refused']} refused, "
                f"{c['identical']} loaded identical, {valid}{c['crashed']} crashed, "
                f"{c['changed']} accepted wrongly (changed), {c['wrong-error']} wrong errors")


def run(spec: str, *, count: int, seed: int = 0, timeout: float = 240.0,
        per_fault_timeout: float = 30.0) -> Report:
    """Inject ``count`` faults into the files of the target ``spec`` ("path/to/test.py::Class")
    and load each in a child process; after a crash the next child goes on with the next fault.
    """
    target = _load_target(spec)
    with tempfile.TemporaryDirectory(prefix="ngra-fuzz-") as tmp:
        work = Path(tmp)
        clean = work / "clean"
        clean.mkdir()
        rels = target.make(clean)
        sizes = {rel: (clean / rel).stat().st_size for rel in rels}
        faults = plan(sizes, count, seed)
        counts: Counter = Counter()
        failures: list[str] = []
        pending = list(faults)
        deadline = _now() + timeout
        while pending:
            if _now() > deadline:
                failures.append(f"time limit of {timeout:.0f} s reached with {len(pending)} of "
                                f"{count} faults not run")
                break
            faults_json = work / "faults.json"
            faults_json.write_text(json.dumps([dataclasses.asdict(f) for f in pending]))
            out = work / "out.jsonl"
            out.write_text("")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
            budget = min(deadline - _now(), 20.0 + per_fault_timeout * len(pending))
            proc = subprocess.Popen(
                [sys.executable, "-c",
                 "import sys; sys.path.insert(0, sys.argv[1]); import fuzzutil; "
                 "fuzzutil._child(*sys.argv[2:])",
                 str(HERE), spec, str(work), str(faults_json), str(out)],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=max(budget, 1.0))
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                timed_out = True
            done, started = {}, None
            for line in out.read_text().splitlines():
                rec = json.loads(line)
                if "start" in rec:
                    started = rec["start"]
                else:
                    done[rec["index"]] = rec
                    started = None
            by_index = {f.index: f for f in pending}
            for idx, rec in done.items():
                counts[rec["outcome"]] += 1
                if rec["outcome"] not in OK_OUTCOMES:
                    failures.append(f"{by_index[idx].describe()}: {rec['outcome']} {rec['detail']}")
            if started is None and proc.returncode != 0:
                tail = output.decode(errors="replace")[-2000:]
                raise RuntimeError(f"fuzz child for {spec} failed before any fault "
                                   f"(exit {proc.returncode}):\n{tail}")
            if started is not None:
                counts["crashed"] += 1
                how = (f"hung past {budget:.0f} s" if timed_out
                       else f"died with exit status {proc.returncode}")
                failures.append(f"{by_index[started].describe()}: crashed ({how}): "
                                + output.decode(errors="replace")[-500:])
            pending = [f for f in pending if f.index not in done and f.index != started]
        return Report(spec.rpartition("::")[2], counts, failures, hasattr(target, "reference"))


def _now() -> float:
    import time

    return time.monotonic()


def check(spec: str, *, count: int, seed: int = 0, timeout: float = 240.0) -> Report:
    """Run the faults and fail (naming each bad fault) unless every one was refused with the
    project's error naming the file, or loaded identical (or, for a target with a ``reference``,
    loaded exactly as the reference reads the changed bytes)."""
    report = run(spec, count=count, seed=seed, timeout=timeout)
    print(report)
    if report.failures:
        shown = "\n".join(report.failures[:20])
        more = len(report.failures) - 20
        raise AssertionError(f"{report}\n{shown}" + (f"\n... and {more} more" if more > 0 else ""))
    assert sum(report.counts.values()) == count, report
    return report
