"""A small GPT-style decoder for the dense and mixture-of-experts experiments.

``GPT(vocab_size, block_size, d_model, n_layer, n_head)`` maps token ids ``idx`` [B, T] to logits
[B, T, vocab_size]: token + learned position embeddings, ``n_layer`` pre-norm blocks
``x + attn(ln1(x))``, ``x + ffn(ln2(x))`` with causal multi-head self-attention, a final
LayerNorm and a linear head. The feed-forward network of each block is pluggable: ``ffn(d_model,
layer)`` returns any module mapping [B, T, d_model] to [B, T, d_model] (default
:class:`FeedForward`, ``Linear(d, 4d) -> GELU -> Linear(4d, d)``), so an MoE layer drops in.
``blocks`` is an ``nn.ModuleList``, so the model can be cut into pipeline stages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "FeedForward", "perplexity"]


class FeedForward(nn.Module):
    """``Linear(d, hidden) -> GELU -> Linear(hidden, d) -> Dropout``; hidden defaults to 4d."""

    def __init__(self, d_model: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = 4 * d_model if hidden is None else hidden
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t attends to positions <= t."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} must be divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, ffn: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d_model: int = 128, n_layer: int = 4,
                 n_head: int = 4, *, dropout: float = 0.0, ffn=None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("d_model", d_model), ("n_layer", n_layer), ("n_head", n_head)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int (got {value!r})")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        make = ffn if ffn is not None else (lambda d, layer: FeedForward(d, dropout=dropout))
        self.blocks = nn.ModuleList(Block(d_model, n_head, make(d_model, i), dropout)
                                    for i in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits [B, T, vocab]; with ``targets`` [B, T], ``(logits, mean cross-entropy)``."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, time] token ids (got shape {tuple(idx.shape)})")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean cross-entropy in nats."""
    return math.exp(loss)
