"""The character corpus: the real Tiny Shakespeare (pinned SHA-256), a fixed split, batches."""

from __future__ import annotations

import pytest
import torch

from ngra.datasets._record import ChecksumError
from ngra.datasets.corpus import load_corpus


def test_tiny_shakespeare(shared_datasets):
    c = load_corpus(root=shared_datasets)
    assert c.vocab_size == 65 and c.train.numel() + c.val.numel() == 1_115_394
    assert c.val.numel() == pytest.approx(111_539, abs=1)
    text = (shared_datasets / "text" / "tinyshakespeare.txt").read_text()
    assert c.decode(c.train[:14]) == text[:14] == "First Citizen:"
    assert c.decode(c.val[-10:]) == text[-10:]
    x, y = c.batch("val", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_own_file_split_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcabcabcd")
    c = load_corpus(f, val_fraction=0.2)
    assert c.vocab == "abcd" and c.decode(c.train) == "abcabcab" and c.decode(c.val) == "cd"
    assert torch.equal(c.encode("dab"), torch.tensor([3, 0, 1]))
    assert repr(c) == "Corpus('t', train=8, val=2, vocab_size=4)"
    with pytest.raises(ValueError, match="the val split has 2 tokens, too few for block 2"):
        c.batch("val", 1, 2, torch.Generator())
    with pytest.raises(ValueError, match="split must be 'train' or 'val' \\(got 'test'\\)"):
        c.batch("test", 1, 2, torch.Generator())
    with pytest.raises(ValueError, match="val_fraction must lie in \\(0, 1\\) \\(got 1.0\\)"):
        load_corpus(f, val_fraction=1.0)
    with pytest.raises(ValueError, match="character 'z' is not in the corpus vocabulary"):
        c.encode("z")


def test_a_modified_shakespeare_is_refused(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "tinyshakespeare.txt").write_text("First Citizen:\n")
    with pytest.raises(ChecksumError, match="does not match the expected"):
        load_corpus(root=tmp_path)
    with pytest.raises(FileNotFoundError, match="pass root= the folder"):
        load_corpus(root=tmp_path / "nowhere")
