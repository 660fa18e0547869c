"""Helpers for the chunk store's integrity tests (shared with tests/fuzz/test_fuzz_store.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from partition.store import MANIFEST, _manifest_digest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resign(path) -> None:
    """Make every checksum of the store at ``path`` match its files again, as an adversary (or a
    faulty writer) would: each chunk's sha256 (from the chunk slots of ``offsets.npy`` as they
    now are), each file's size and sha256, and the manifest's own checksum. Files that no
    longer parse are left for the store's header checks to refuse."""
    path = Path(path)
    mpath = path / MANIFEST
    m = json.loads(mpath.read_text())
    try:
        offsets = np.load(path / "offsets.npy", allow_pickle=False)
        edges = [np.load(path / f"{name}.npy", allow_pickle=False)
                 for name in ("src", "dst", "eids")]
        shas = np.load(path / "chunk_sha256.npy", allow_pickle=False)
        if offsets.ndim == 1 and shas.shape == (offsets.shape[0] - 1, 32):
            for k in range(shas.shape[0]):
                lo, hi = int(offsets[k]), int(offsets[k + 1])
                h = hashlib.sha256()
                for a in edges:
                    h.update(np.ascontiguousarray(a[max(lo, 0):max(hi, 0)]).tobytes())
                shas[k] = np.frombuffer(h.digest(), dtype=np.uint8)
            np.save(path / "chunk_sha256.npy", shas)
    except Exception:  # noqa: BLE001 - a file that does not parse stays as it is
        pass
    for rel, info in m["files"].items():
        if (path / rel).is_file():
            info["bytes"] = (path / rel).stat().st_size
            info["sha256"] = _sha256(path / rel)
    m["manifest_sha256"] = _manifest_digest(m)
    mpath.write_text(json.dumps(m, indent=1))
