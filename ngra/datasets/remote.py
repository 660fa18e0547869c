"""Download dataset files into a root folder, verifying SHA-256 checksums.

Files land where ``ngra.datasets.load`` looks for them (``<root>/planetoid/<name>/...``,
``<root>/npz/<file>.npz``, ``<root>/ogb/<dir>/...``). A pinned checksum that does not match
refuses the file (nothing is written). Files without a pinned checksum are accepted on first
download with a warning, and their checksum is recorded in ``<root>/SHA256SUMS``; later
downloads of the same file must match that record.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, BinaryIO

from tqdm.auto import tqdm

from ._record import PINNED_SHA256, ChecksumError, default_root, sha256_file
from .npz import NPZ_FILES
from .ogb import OGB_NODE
from .planetoid import PLANETOID_NAMES, planetoid_files

__all__ = ["download", "ChecksumError"]


@dataclass(frozen=True)
class Remote:
    url: str
    path: str  # where it lands, relative to root (also the path under a mirror)
    sha256: str | None  # None: not pinned (trust on first download, then recorded)
    unzip_to: str | None = None  # for archives: extract here (relative to root), drop one top folder


_PLANETOID_URL = "https://github.com/tkipf/gcn/raw/master/gcn/data/"
_NPZ_URL = "https://github.com/shchur/gnn-benchmark/raw/master/data/npz/"
_OGB_URL = "http://snap.stanford.edu/ogb/data/nodeproppred/"

# Pinned checksums: see _record.PINNED_SHA256 (the loaders check the same ones).
_PINNED = PINNED_SHA256


def remotes(name: str) -> tuple[Remote, ...]:
    """The files that make up dataset ``name``."""
    if name in PLANETOID_NAMES:
        return tuple(Remote(_PLANETOID_URL + f, f"planetoid/{name}/{f}", _PINNED.get(f"planetoid/{name}/{f}"))
                     for f in planetoid_files(name))
    if name in NPZ_FILES:
        f = NPZ_FILES[name]
        return (Remote(_NPZ_URL + f, f"npz/{f}", _PINNED.get(f"npz/{f}")),)
    if name in OGB_NODE:
        folder = OGB_NODE[name][0]
        short = name.split("-", 1)[1]
        return (Remote(f"{_OGB_URL}{short}.zip", f"ogb/{short}.zip", None, unzip_to=f"ogb/{folder}"),)
    known = sorted((*PLANETOID_NAMES, *NPZ_FILES, *OGB_NODE))
    raise ValueError(f"no download source for dataset {name!r}; downloadable: {', '.join(known)}")


def download(name: str, root=None, *, mirror: str | None = None,
             fetch: Callable[[str, BinaryIO], None] | None = None, force: bool = False) -> Path:
    """Fetch the files of dataset ``name`` into ``root`` (default: ``default_root()``); returns root.

    - ``mirror``: a base URL that replaces the upstream location; file ``p`` (a path like
      ``planetoid/cora/ind.cora.x``) is fetched from ``mirror/p``. ``file://`` URLs work, e.g.
      a local copy laid out like the root folder.
    - ``fetch(url, out)``: writes the bytes at ``url`` to the binary file ``out``; the default
      uses ``urllib`` with a progress bar. Inject another to use a proxy or a test double.
    - Files already present are checked, not fetched again; one whose checksum does not match
      raises :class:`ChecksumError` unless ``force=True``, which fetches it again. An unpacked
      OGB folder that exists is taken as it is (its zip is not kept to check against).
    """
    root = Path(root) if root is not None else default_root()
    fetch = fetch or _urllib_fetch
    records = _read_records(root)
    for remote in remotes(name):
        dest = root / remote.path
        done = root / remote.unzip_to if remote.unzip_to else dest
        expected = remote.sha256 or records.get(remote.path)
        if done.exists() and not force:
            got = sha256_file(dest) if remote.unzip_to is None and expected is not None else expected
            if got != expected:
                raise ChecksumError(
                    f"{dest}: SHA-256 {got} does not match the expected {expected}; the file is "
                    "corrupt or was changed. Delete it or call download(..., force=True)"
                )
            continue
        url = f"{mirror.rstrip('/')}/{remote.path}" if mirror else remote.url
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    fetch(url, out)
                except OSError as e:
                    raise OSError(f"could not fetch {url}: {e}") from e
            got = sha256_file(Path(tmp))
            if expected is not None and got != expected:
                raise ChecksumError(
                    f"{url}: SHA-256 {got} does not match the expected {expected}; the download is corrupt "
                    f"or the upstream file changed. Nothing was written to {dest}"
                )
            if remote.unzip_to:
                _unzip(Path(tmp), done, url)
            else:
                os.replace(tmp, dest)
            if expected is None:  # recorded only once the file was usable
                warnings.warn(f"{url} has no pinned checksum; accepted it and recorded SHA-256 {got} in "
                              f"{root / 'SHA256SUMS'}", stacklevel=2)
                records[remote.path] = got
                _write_records(root, records)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return root


def _urllib_fetch(url: str, out: BinaryIO) -> None:
    with urllib.request.urlopen(url, timeout=60) as response:
        total = response.headers.get("Content-Length")
        with tqdm(total=int(total) if total else None, unit="B", unit_scale=True,
                  desc=url.rsplit("/", 1)[-1], disable=None, leave=False) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))


def _read_records(root: Path) -> dict[str, str]:
    path = root / "SHA256SUMS"
    if not path.is_file():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        digest, _, rel = line.strip().partition("  ")
        if rel:
            records[rel] = digest
    return records


def _write_records(root: Path, records: dict[str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "SHA256SUMS").write_text("".join(f"{d}  {p}\n" for p, d in sorted(records.items())))


def _unzip(archive: Path, target: Path, url: str) -> None:
    """Extract ``archive`` into ``target``, dropping the single top-level folder OGB zips have."""
    try:
        with zipfile.ZipFile(archive) as z:
            names = [m for m in z.namelist() if not m.endswith("/")]
            tops = {m.split("/", 1)[0] for m in names}
            if len(tops) != 1 or any("/" not in m for m in names):
                raise ValueError(f"{url}: expected one top-level folder in the archive (got {sorted(tops)[:5]})")
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".unzip"))
            try:
                for m in names:
                    rel = Path(m.split("/", 1)[1])
                    if rel.is_absolute() or ".." in rel.parts:
                        raise ValueError(f"{url}: archive member {m!r} would land outside {target}")
                    (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                    with z.open(m) as src, open(staging / rel, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(staging, target)
            finally:
                if staging.exists():
                    shutil.rmtree(staging)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{url}: not a zip archive: {e}") from e
