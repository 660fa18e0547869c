"""download(): file:// mirrors of the shared copies, injected fetchers, checksum refusal, OGB zips."""

import hashlib
import io
import shutil
import zipfile

import pytest

from ngra.datasets import ChecksumError, download, load
from ngra.datasets.remote import remotes


MIRROR = "https://mirror.example/data"


def copy_fetch(source_root):
    """Serves MIRROR/<path> from a local folder laid out like the root; records the URLs asked for."""
    asked = []

    def fetch(url, out):
        asked.append(url)
        out.write((source_root / url.removeprefix(MIRROR + "/")).read_bytes())
    fetch.asked = asked
    return fetch


def test_cora_from_file_mirror_verifies_pinned_checksums(shared_datasets, tmp_path, recwarn):
    root = download("cora", tmp_path / "data", mirror=shared_datasets.as_uri())
    assert not [w for w in recwarn if "no pinned checksum" in str(w.message)]  # all eight are pinned
    assert load("cora", root=root).num_nodes == 2708
    # A second call checks the files and fetches nothing.
    fetch = copy_fetch(shared_datasets)
    download("cora", root, fetch=fetch, mirror=MIRROR)
    assert fetch.asked == []


def test_corrupted_copy_is_refused(shared_datasets, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_datasets / "planetoid" / "cora", mirror / "planetoid" / "cora")
    x = mirror / "planetoid" / "cora" / "ind.cora.x"
    data = bytearray(x.read_bytes())
    data[100] ^= 0xFF
    x.write_bytes(bytes(data))
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match=r"ind\.cora\.x: SHA-256 [0-9a-f]{64} does not match the expected "
                                            r"23cfa55d.*Nothing was written to"):
        download("cora", root, mirror=mirror.as_uri())
    assert not (root / "planetoid" / "cora" / "ind.cora.x").exists()
    assert not list((root / "planetoid" / "cora").glob("*.part"))  # no temporary files left behind


def test_existing_corrupted_file_needs_force(shared_datasets, tmp_path):
    root = download("cora", tmp_path, mirror=shared_datasets.as_uri())
    target = root / "planetoid" / "cora" / "ind.cora.y"
    target.write_bytes(b"garbage")
    with pytest.raises(ChecksumError, match=r"ind\.cora\.y: SHA-256 .* does not match .*force=True"):
        download("cora", root, mirror=shared_datasets.as_uri())
    download("cora", root, mirror=shared_datasets.as_uri(), force=True)
    assert load("cora", root=root).num_nodes == 2708


def test_unpinned_file_is_recorded_then_enforced(shared_datasets, tmp_path):
    fetch = copy_fetch(shared_datasets)
    with pytest.warns(UserWarning, match=r"has no pinned checksum; accepted it and recorded SHA-256"):
        root = download("amazon-computers", tmp_path, fetch=fetch, mirror=MIRROR)
    assert fetch.asked == [MIRROR + "/npz/amazon_electronics_computers.npz"]
    digest = hashlib.sha256((shared_datasets / "npz" / "amazon_electronics_computers.npz").read_bytes()).hexdigest()
    assert (root / "SHA256SUMS").read_text() == f"{digest}  npz/amazon_electronics_computers.npz\n"
    assert load("amazon-computers", root=root).num_nodes == 13752
    # The recorded checksum now guards later downloads.
    bad = lambda url, out: out.write(b"not the same file")  # noqa: E731
    with pytest.raises(ChecksumError, match=r"does not match the expected " + digest):
        download("amazon-computers", root, fetch=bad, force=True)
    saved = root / "npz" / "amazon_electronics_computers.npz"
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == digest  # the good copy is untouched


def test_load_download_flag(shared_datasets, tmp_path, monkeypatch):
    import ngra.datasets.remote as remote

    monkeypatch.setattr(remote, "_PLANETOID_URL", shared_datasets.as_uri() + "/planetoid/cora/")
    assert load("cora", root=tmp_path, download=True).num_nodes == 2708


def test_fetch_errors_name_the_url(tmp_path):
    def broken(url, out):
        raise ConnectionError("network unreachable")
    with pytest.raises(OSError, match=r"could not fetch https://.*ind\.cora\.x: network unreachable"):
        download("cora", tmp_path, fetch=broken)
    with pytest.raises(OSError, match=r"could not fetch file:///nonexistent/planetoid/cora/ind\.cora\.x"):
        download("cora", tmp_path, mirror="file:///nonexistent")


def ogb_zip(top="arxiv", members=None):
    members = members or {"raw/edge.csv.gz": b"", "split/time/train.csv.gz": b""}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(f"{top}/{name}" if top else name, data)
    return buf.getvalue()


def test_ogb_zip_is_unpacked_into_place(tmp_path):
    payload = ogb_zip()
    with pytest.warns(UserWarning, match="no pinned checksum"):
        download("ogbn-arxiv", tmp_path, fetch=lambda url, out: out.write(payload))
    assert (tmp_path / "ogb" / "ogbn_arxiv" / "raw" / "edge.csv.gz").is_file()
    assert (tmp_path / "ogb" / "ogbn_arxiv" / "split" / "time" / "train.csv.gz").is_file()
    assert not (tmp_path / "ogb" / "arxiv.zip").exists()
    assert remotes("ogbn-arxiv")[0].url == "http://snap.stanford.edu/ogb/data/nodeproppred/arxiv.zip"


@pytest.mark.parametrize("payload, match", [
    (ogb_zip(members={"../evil.txt": b"x", "raw/a": b""}, top="arxiv"), r"would land outside"),
    (ogb_zip(top=None), r"expected one top-level folder in the archive"),
    (b"not a zip", r"not a zip archive"),
])
def test_bad_ogb_zips(tmp_path, payload, match):
    with pytest.raises(ValueError, match=match):
        download("ogbn-arxiv", tmp_path, fetch=lambda url, out: out.write(payload))
    assert not (tmp_path / "ogb" / "ogbn_arxiv").exists()
    assert not (tmp_path / "SHA256SUMS").exists()  # a rejected archive is not trusted later
    assert not list((tmp_path / "ogb").iterdir())  # no temporary files or staging folders left
    assert not (tmp_path.parent / "evil.txt").exists()


def test_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match=r"no download source for dataset 'sbm'; downloadable: amazon-computers"):
        download("sbm", tmp_path)
