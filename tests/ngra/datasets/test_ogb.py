"""OGB node-property raw layout and plain edge lists, on small files written in the real formats."""

import pytest
import torch

from ngra.datasets import DatasetError, load, read_edge_list
from ngra.datasets.ogb import read_ogb_node
from tests.ngra.datasets.dataset_files import gz, write_ogb


def test_ogbn_arxiv_layout(tmp_path):
    feat = write_ogb(tmp_path / "ogb" / "ogbn_arxiv")
    ds = load("ogbn-arxiv", root=tmp_path)
    assert repr(ds) == ("Dataset(name='ogbn-arxiv', num_nodes=12, num_edges=6, num_features=3, "
                        "num_classes=4, split=6/3/3)")
    # Directed, in file order, nothing dropped (as OGB ships arxiv).
    assert ds.graph.edge_index.tolist() == [[0, 1, 2, 3, 4, 0], [1, 2, 0, 4, 4, 1]]
    assert torch.equal(ds.x, torch.from_numpy(feat))
    assert ds.y.tolist() == [i % 4 for i in range(12)]
    assert torch.nonzero(ds.val_mask).flatten().tolist() == [6, 7, 8]


def test_ogbn_products_adds_inverse_edges(tmp_path):
    write_ogb(tmp_path / "ogb" / "ogbn_products", edges=((0, 1), (2, 3)), split="sales_ranking")
    ds = load("ogbn-products", root=tmp_path)
    assert ds.graph.edge_index.tolist() == [[0, 2, 1, 3], [1, 3, 0, 2]]


def test_nan_labels_and_split_choice(tmp_path):
    labels = ["nan" if i in (10, 11) else str(i % 2) for i in range(12)]
    write_ogb(tmp_path, labels=labels, splits={"train": [0, 1], "valid": [2], "test": [3, 4]})
    write_ogb(tmp_path, labels=labels, split="other", splits={"train": [5], "valid": [6], "test": [7]})
    with pytest.raises(ValueError, match=r"split: expected exactly one split scheme directory, found "
                                         r"\['other', 'time'\]; pass split=<name>"):
        read_ogb_node(tmp_path)
    ds = read_ogb_node(tmp_path, split="other")
    assert ds.y[10] == -1 and ds.y[11] == -1 and ds.num_classes == 2
    assert torch.nonzero(ds.train_mask).flatten().tolist() == [5]


def test_no_features_file(tmp_path):
    write_ogb(tmp_path)
    (tmp_path / "raw" / "node-feat.csv.gz").unlink()
    ds = read_ogb_node(tmp_path)
    assert ds.x is None and ds.num_features == 0


@pytest.mark.parametrize("corrupt, match", [
    (lambda d: gz(d / "raw" / "edge.csv.gz", ["0,1", "1,99"]),
     r"edge\.csv\.gz: has 2 edges but num-edge-list\.csv\.gz says 6"),
    (lambda d: (gz(d / "raw" / "edge.csv.gz", ["0,1", "1,99"]), gz(d / "raw" / "num-edge-list.csv.gz", ["2"])),
     r"edge\.csv\.gz: edge index 99 out of range for a graph with 12 nodes; indices must lie in \[0, 12\)"),
    (lambda d: gz(d / "raw" / "edge.csv.gz", ["0,1,5"] * 6), r"edge\.csv\.gz: expected 2 column\(s\) per line, found 3"),
    (lambda d: gz(d / "raw" / "edge.csv.gz", ["0,1"] * 5 + ["a,b"]), r"edge\.csv\.gz: cannot parse lines 1-6"),
    (lambda d: gz(d / "raw" / "node-feat.csv.gz", ["1.0,2.0,3.0"] * 11), r"node-feat\.csv\.gz: has 11 rows for 12 vertices"),
    (lambda d: gz(d / "raw" / "node-feat.csv.gz", ["1.0,2.0,3.0"] * 11 + ["1.0,2.0"]),
     r"node-feat\.csv\.gz: cannot parse lines 1-12"),
    (lambda d: gz(d / "raw" / "node-label.csv.gz", ["1"] * 11), r"node-label\.csv\.gz: expected 12 lines of one label each"),
    (lambda d: gz(d / "raw" / "node-label.csv.gz", ["1.5"] + ["1"] * 11), r"node-label\.csv\.gz: label 1\.5 is not a class id"),
    (lambda d: gz(d / "raw" / "node-label.csv.gz", ["-2"] + ["1"] * 11), r"node-label\.csv\.gz: label -2\.0 is not a class id"),
    (lambda d: gz(d / "raw" / "num-node-list.csv.gz", ["12", "13"]), r"num-node-list\.csv\.gz: expected a single count >= 0"),
    (lambda d: gz(d / "split" / "time" / "test.csv.gz", ["9", "12"]),
     r"test\.csv\.gz: vertex 12 out of range for a graph with 12 nodes; ids must lie in \[0, 12\)"),
    (lambda d: (d / "split" / "time" / "valid.csv.gz").unlink(), r"valid\.csv\.gz not found"),
    (lambda d: (d / "raw" / "node-feat.csv.gz").write_bytes(
        (d / "raw" / "node-feat.csv.gz").read_bytes()[:40]), r"node-feat\.csv\.gz: cannot read \(truncated or corrupt\?\)"),
])
def test_malformed(tmp_path, corrupt, match):
    write_ogb(tmp_path)
    corrupt(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        read_ogb_node(tmp_path)


def test_missing_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ogbn_arxiv/raw/edge\.csv\.gz not found; expected OGB's raw layout"):
        load("ogbn-arxiv", root=tmp_path)


# -- plain edge lists -----------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True])
def test_edge_list(tmp_path, compressed):
    lines = ["# Directed graph: toy", "# FromNodeId\tToNodeId", "0\t1", "1\t2", "", "2\t0", "2\t0", "5\t5"]
    path = tmp_path / ("e.txt.gz" if compressed else "e.txt")
    if compressed:
        gz(path, lines)
    else:
        path.write_text("\n".join(lines) + "\n")
    g = read_edge_list(path)
    assert g.edge_index.tolist() == [[0, 1, 2, 2, 5], [1, 2, 0, 0, 5]]  # file order, duplicates kept
    assert g.num_nodes == 6
    assert read_edge_list(path, num_nodes=10).num_nodes == 10


def test_edge_list_csv_and_empty(tmp_path):
    p = tmp_path / "e.csv"
    p.write_text("3,4\n4,3\n")
    assert read_edge_list(p, delimiter=",").edge_index.tolist() == [[3, 4], [4, 3]]
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    assert read_edge_list(empty).num_edges == 0


@pytest.mark.parametrize("text, kwargs, exc, match", [
    ("0 1 7\n", {}, ValueError, r"e\.txt: expected 2 column\(s\) per line, found 3"),
    ("0 1\n1 -4\n", {}, ValueError, r"e\.txt: edge index -4 is negative \(found at dst\[1\]\)"),
    ("0 1\n1 9\n", {"num_nodes": 5}, ValueError, r"e\.txt: edge index 9 out of range for a graph with 5 nodes"),
    ("0 1\n1 2.5\n", {}, ValueError, r"e\.txt: cannot parse lines 1-2"),
])
def test_edge_list_errors(tmp_path, text, kwargs, exc, match):
    p = tmp_path / "e.txt"
    p.write_text(text)
    with pytest.raises(exc, match=match):
        read_edge_list(p, **kwargs)
    with pytest.raises(FileNotFoundError, match=r"nope\.txt not found"):
        read_edge_list(tmp_path / "nope.txt")


# -- hardening: implausible sizes and ids are refused, naming the value, before allocation ----

@pytest.mark.parametrize("splits, match", [
    # the Dataset record refused these with a ValueError that named no file
    ({"train": [0, 10], "valid": [6], "test": [9]}, r"split/time/train\.csv\.gz: vertex 10 has no label \(nan in "
                                                    r"node-label\.csv\.gz\); a split may only hold labelled vertices"),
    ({"train": [0, 1], "valid": [6], "test": [1]}, r"split/time/test\.csv\.gz: vertex 1 is also in train\.csv\.gz; "
                                                   r"splits must be disjoint"),
])
def test_ogb_split_files_checked_against_labels(tmp_path, splits, match):
    write_ogb(tmp_path, labels=["nan" if i in (10, 11) else "1" for i in range(12)], splits=splits)
    with pytest.raises(DatasetError, match=match):
        read_ogb_node(tmp_path)


def test_ogb_vertex_count_too_large(tmp_path):
    write_ogb(tmp_path)
    gz(tmp_path / "raw" / "num-node-list.csv.gz", [str(10**15)])
    with pytest.raises(DatasetError, match=r"num-node-list\.csv\.gz: vertex count 1000000000000000 \(N = "
                                           r"1000000000000000 vertices, ~32 bytes each\) needs 32\.0 PB of memory"):
        read_ogb_node(tmp_path)


@pytest.mark.parametrize("label", ["1000000000", "1000000000000", "inf"])
def test_ogb_absurd_label(tmp_path, label):
    # accepted before: num_classes = 10**12 + 1 (and inf became a garbage int64)
    write_ogb(tmp_path, labels=[label] + [str(i % 4) for i in range(1, 12)])
    with pytest.raises(DatasetError, match=r"node-label\.csv\.gz: label \d+ is not a plausible class id for a "
                                           r"graph of 12 vertices; class ids must lie in \[0, 12\)"):
        read_ogb_node(tmp_path)


def test_gzip_without_newlines_is_refused_early(tmp_path, monkeypatch):
    import ngra.datasets.text as text

    monkeypatch.setattr(text, "_MAX_LINE_CHARS", 10_000)
    monkeypatch.setattr(text, "_BLOCK_CHARS", 4096)
    write_ogb(tmp_path)
    gz(tmp_path / "raw" / "node-feat.csv.gz", ["1" * 100_000])  # one line, no newline until the end
    with pytest.raises(DatasetError, match=r"node-feat\.csv\.gz: line 1 is longer than 10000 characters"):
        read_ogb_node(tmp_path)


def test_table_larger_than_memory_is_refused_while_reading(tmp_path, monkeypatch):
    import ngra.datasets._record as record
    import ngra.datasets.text as text

    monkeypatch.setattr(text, "_BLOCK_CHARS", 4096)
    monkeypatch.setattr(record, "available_memory", lambda: 100_000)
    path = tmp_path / "big.txt"
    path.write_text("".join(f"{i} {i + 1}\n" for i in range(20_000)))
    with pytest.raises(DatasetError, match=r"big\.txt: the table up to line \d+ needs [\d.]+ KB of memory, more "
                                           r"than the 100\.0 KB available"):
        read_edge_list(path)


def test_edge_list_huge_vertex_id(tmp_path):
    # accepted before: a Graph of 2**40 + 1 vertices, whose CSR alone needs 8.8 TB
    p = tmp_path / "e.txt"
    p.write_text(f"0 1\n1 {2**40}\n")
    with pytest.raises(DatasetError, match=r"e\.txt: vertex id 1099511627776 \(edge 1 of the file\) \(N = "
                                           r"1099511627777 vertices, ~32 bytes each\) needs 35\.2 TB of memory"):
        read_edge_list(p)


@pytest.mark.parametrize("text", [f"0 {2**63}\n", "0 1\n\x00\x00\n", "0 1\n\xff\n"])
def test_edge_list_unparseable(tmp_path, text):
    p = tmp_path / "e.txt"
    p.write_bytes(text.encode("latin1"))
    with pytest.raises(DatasetError, match=r"e\.txt: cannot (parse lines|read)"):
        read_edge_list(p)
