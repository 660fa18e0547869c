"""kernels._nbcache: numba's disk caches are dropped when code that kernels of other modules
compile in changed (numba itself checks each kernel against its own file only), and kept
otherwise."""

from pathlib import Path

import kernels
from kernels import _nbcache


def _package(root: Path) -> Path:
    pkg = root / "kernels"
    for name in _nbcache.SHARED:
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(f"# {name}\n")
    return pkg


def _caches(pkg: Path) -> list:
    made = []
    for folder, stem in ((pkg / "__pycache__", "spmm._spmm_sum-82.py311"),
                         (pkg / "_cpu" / "__pycache__", "_dropout._dropout_kernel-44.py311")):
        folder.mkdir(parents=True, exist_ok=True)
        for suffix in (".nbi", ".1.nbc"):
            f = folder / (stem + suffix)
            f.write_bytes(b"cached")
            made.append(f)
    (pkg / "__pycache__" / "tiles.cpython-311.pyc").write_bytes(b"bytecode")  # not numba's
    return made


def test_caches_dropped_when_shared_code_changes_and_kept_otherwise(tmp_path):
    pkg = _package(tmp_path)
    made = _caches(pkg)
    assert _nbcache.drop_stale(pkg)  # no digest recorded yet: dropped
    assert not any(f.exists() for f in made)
    assert (pkg / "__pycache__" / "tiles.cpython-311.pyc").exists()
    made = _caches(pkg)
    assert not _nbcache.drop_stale(pkg)  # unchanged: kept
    assert all(f.exists() for f in made)
    (pkg / "_cpu" / "tiles.py").write_text("# tiles.py, edited\n")
    assert _nbcache.drop_stale(pkg)
    assert not any(f.exists() for f in made)
    assert not _nbcache.drop_stale(pkg)


def test_import_records_the_packages_digest():
    pkg = Path(kernels.__file__).resolve().parent
    stamp = pkg / "__pycache__" / _nbcache.STAMP
    assert stamp.read_text().strip() == _nbcache.digest(pkg)


def test_unwritable_or_missing_files_do_nothing(tmp_path):
    assert not _nbcache.drop_stale(tmp_path / "nowhere")
