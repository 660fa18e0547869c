"""A character-level text corpus for language-model experiments (the dense and MoE parts).

:func:`load_corpus` reads ``text/tinyshakespeare.txt`` under a datasets root (its published
SHA-256 is checked) or any UTF-8 file, and returns a :class:`Corpus`: the text as token ids over
its sorted distinct characters, cut once into a fixed train / validation split (the last
``val_fraction`` of the text, so no sequence straddles the cut), and batches of
``(inputs [B, T], targets [B, T])`` drawn with a caller-seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ._record import DatasetError, default_root, verify_pinned

__all__ = ["Corpus", "load_corpus", "SHAKESPEARE"]

SHAKESPEARE = "text/tinyshakespeare.txt"


@dataclass(frozen=True)
class Corpus:
    """``train`` [N_train] and ``val`` [N_val] int64 token ids; ``vocab`` the characters, in id
    order (``vocab[i]`` is token ``i``)."""

    train: torch.Tensor
    val: torch.Tensor
    vocab: str
    name: str = "corpus"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.vocab)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.int64)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(self, split: str, batch_size: int, block: int, generator: torch.Generator):
        """``(x, y)``, each [batch_size, block]: ``batch_size`` windows at random offsets of
        ``split`` ("train" or "val"); ``y`` is ``x`` shifted by one token."""
        data = {"train": self.train, "val": self.val}.get(split)
        if data is None:
            raise ValueError(f"split must be 'train' or 'val' (got {split!r})")
        if batch_size < 1 or block < 1:
            raise ValueError(f"batch_size and block must be >= 1 (got {batch_size}, {block})")
        if data.numel() <= block:
            raise ValueError(f"the {split} split has {data.numel()} tokens, too few for block "
                             f"{block}; use a shorter block")
        start = torch.randint(0, data.numel() - block, (batch_size,), generator=generator)
        idx = start[:, None] + torch.arange(block + 1)
        window = data[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (f"Corpus({self.name!r}, train={self.train.numel()}, val={self.val.numel()}, "
                f"vocab_size={self.vocab_size})")


def load_corpus(path=None, *, root=None, val_fraction: float = 0.1) -> Corpus:
    """Tiny Shakespeare from ``root`` (default: the datasets root), or the UTF-8 file ``path``.

    The split is fixed: the first ``1 - val_fraction`` of the characters train, the rest
    validate."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1) (got {val_fraction!r})")
    if path is None:
        base = Path(root).expanduser() if root is not None else default_root()
        path = base / SHAKESPEARE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; pass root= the folder that holds "
                                    f"{SHAKESPEARE} (e.g. ../shared/datasets)")
        verify_pinned(path, SHAKESPEARE)
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from e
    if len(text) < 2:
        raise DatasetError(f"{path}: {len(text)} characters; a corpus needs at least 2")
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    codes = np.unique(points)  # sorted code points: token i is character codes[i]
    vocab = "".join(map(chr, codes.tolist()))
    ids = torch.from_numpy(np.searchsorted(codes, points).astype(np.int64))
    cut = max(1, min(len(text) - 1, round(len(text) * (1.0 - val_fraction))))
    return Corpus(ids[:cut].clone(), ids[cut:].clone(), vocab, name=path.stem)
