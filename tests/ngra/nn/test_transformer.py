"""The small GPT: attention against a dense masked-softmax reference, causality, pluggable FFN."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ngra.nn.transformer import GPT, CausalSelfAttention


def test_attention_matches_a_dense_reference():
    torch.manual_seed(0)
    att = CausalSelfAttention(16, 4)
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    att = att.double()
    q, k, v = att.qkv(x).split(16, dim=2)
    heads = [z.view(2, 7, 4, 4).transpose(1, 2) for z in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    ref = att.proj((scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(2, 7, 16))
    out = att(x)
    torch.testing.assert_close(out, ref)
    g_out, = torch.autograd.grad(out.sum(), x)
    g_ref, = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g_out, g_ref)


def test_gpt_is_causal_and_takes_any_ffn():
    torch.manual_seed(0)
    seen = []

    def ffn(d, layer):
        seen.append(layer)
        return nn.Sequential(nn.Linear(d, d), nn.Tanh())

    m = GPT(11, 8, 16, 3, 2, ffn=ffn).eval()
    assert seen == [0, 1, 2]
    idx = torch.randint(0, 11, (2, 8))
    other = idx.clone()
    other[:, 5:] = (other[:, 5:] + 1) % 11
    torch.testing.assert_close(m(idx)[:, :5], m(other)[:, :5])
    assert not torch.allclose(m(idx)[:, 5:], m(other)[:, 5:])
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 8, 11) and loss.item() == pytest.approx(math.log(11), rel=0.2)


def test_bad_sizes_are_clear():
    with pytest.raises(ValueError, match="d_model 10 must be divisible by n_head 4"):
        GPT(5, 4, 10, 1, 4)
    with pytest.raises(ValueError, match="block_size must be a positive int \\(got 0\\)"):
        GPT(5, 0)
    with pytest.raises(ValueError, match="sequence length 5 exceeds block_size 4"):
        GPT(5, 4, 8, 1, 2)(torch.zeros(1, 5, dtype=torch.long))
