"""The numba backend's cache of freed outputs (kernels/_outcache.py): reuse, never while in use,
the limit, results and gradients on reused (poisoned) blocks, threads, bad limits."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from kernels import CSR
from kernels._outcache import CACHE, MIN_BYTES, OutputCache, size_class

# outputs [N, F] float32 of 1 MiB, edge values [E, F] of 5 MiB: both large enough for the cache
N, E, F = 8192, 40_000, 32


@pytest.fixture(scope="module")
def csr():
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, N, (E,), generator=gen, dtype=torch.int32)
    dst = torch.randint(0, N, (E,), generator=gen, dtype=torch.int32)
    return CSR.from_coo(src, dst, N)


@pytest.fixture
def cache():
    """The process's cache, emptied, with its default limit restored afterwards."""
    limit = kernels.output_cache_limit()
    kernels.set_output_cache_limit(256 << 20)
    kernels.empty_output_cache()
    yield CACHE
    kernels.set_output_cache_limit(limit)
    kernels.empty_output_cache()


def x_of(seed, rows=N, f=F):
    return torch.randn(rows, f, generator=torch.Generator().manual_seed(seed))


def poison(cache):
    """Fill every cached block with NaN bytes, so a kernel that reads an output before writing
    it, or expects zeros, shows."""
    views = cache._free_views()
    for block in views:
        block.fill(0xFF)
    return len(views)


def test_size_classes_round_up_by_at_most_an_eighth():
    for n in (MIN_BYTES, MIN_BYTES + 1, 3 << 20, (5 << 20) - 7, 100_000_000, 1 << 33):
        c = size_class(n)
        assert n <= c <= n * 1.125 + 1 and c % 4096 == 0
    assert size_class(1 << 20) == 1 << 20


def test_a_freed_output_is_reused(csr, cache):
    x = x_of(0)
    y = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
    ptr, before = y.data_ptr(), cache.stats()
    assert before["cached_blocks"] == 0
    del y
    assert cache.stats()["cached_bytes"] == size_class(N * F * 4)
    y = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
    after = cache.stats()
    assert y.data_ptr() == ptr and after["hits"] == before["hits"] + 1
    assert after["cached_bytes"] == 0
    torch.testing.assert_close(y, kernels.gspmm(csr, "copy_u", "sum", u=x, backend="torch"))


def test_memory_in_use_is_never_handed_out(csr, cache):
    """A view, a numpy array over the output, or the output itself keeps its block."""
    x = x_of(1)
    y = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
    view, arr = y[5:], y.numpy()[:7]
    keep_view, keep_arr = view.clone(), arr.copy()
    del y
    assert cache.stats()["cached_blocks"] == 0
    others = [kernels.gspmm(csr, "copy_u", "max", u=x_of(s), backend="numba") for s in (2, 3)]
    lo, hi = view.untyped_storage().data_ptr(), view.untyped_storage().data_ptr() + N * F * 4
    assert all(not lo <= o.data_ptr() < hi for o in others)
    assert torch.equal(view, keep_view) and np.array_equal(arr, keep_arr)
    del view
    assert cache.stats()["cached_blocks"] == 0  # the numpy array still holds it
    del arr
    assert cache.stats()["cached_blocks"] == 1


def test_limit_evicts_the_oldest_and_zero_turns_it_off(csr, cache):
    one = size_class(N * F * 4)
    kernels.set_output_cache_limit(2 * one)
    ys = [kernels.gspmm(csr, "copy_u", "sum", u=x_of(s), backend="numba") for s in range(3)]
    spans = [(y.data_ptr(), y.data_ptr() + one) for y in ys]
    while ys:  # freed in order 0, 1, 2
        ys.pop(0)
    s = cache.stats()
    assert s["cached_bytes"] == 2 * one  # the limit
    # what is kept is the last two freed (merged where they lie side by side)
    kept = sorted((v.ctypes.data, v.ctypes.data + len(v)) for v in cache._free_views())
    assert sum(b - a for a, b in kept) == 2 * one
    assert all(any(a <= lo and hi <= b for a, b in kept) for lo, hi in spans[1:])
    y = kernels.gspmm(csr, "copy_u", "sum", u=x_of(0), backend="numba")
    assert any(a <= y.data_ptr() < b for a, b in kept) and cache.stats()["cached_bytes"] == one
    del y
    kernels.set_output_cache_limit(0)
    assert cache.stats()["cached_bytes"] == 0
    hits = cache.stats()["hits"] + cache.stats()["misses"]
    y = kernels.gspmm(csr, "copy_u", "sum", u=x_of(0), backend="numba")
    del y
    s = cache.stats()
    assert s["hits"] + s["misses"] == hits and s["cached_blocks"] == 0


def test_small_and_bypassed_requests_do_not_use_it(cache):
    before = cache.stats()
    small = cache.empty((MIN_BYTES // 8,), torch.float32)
    del small
    with kernels.no_output_cache():
        big = cache.empty((MIN_BYTES,), torch.float32)
        big_np = cache.empty_numpy((MIN_BYTES,), np.float32)
    del big, big_np
    assert cache.stats() == before
    big = cache.empty((MIN_BYTES,), torch.float32)  # outside the block: from the cache again
    del big
    assert cache.stats()["misses"] == before["misses"] + 1
    assert cache.stats()["cached_blocks"] == 1


def test_zeros_on_a_reused_block_are_zeros(cache):
    t = cache.empty((MIN_BYTES // 4,), torch.float32).fill_(7.0)
    ptr = t.data_ptr()
    del t
    poison(cache)
    z = cache.zeros((MIN_BYTES // 4,), torch.float32)
    assert z.data_ptr() == ptr and not z.any()


CASES = {
    "copy_u/sum": lambda g, x, w, s: kernels.gspmm(g, "copy_u", "sum", u=x),
    "u_mul_e/sum": lambda g, x, w, s: kernels.gspmm(g, "u_mul_e", "sum", u=x, e=w[:, :1]),
    "u_mul_e/max": lambda g, x, w, s: kernels.gspmm(g, "u_mul_e", "max", u=x, e=w),
    "u_add_e/min": lambda g, x, w, s: kernels.gspmm(g, "u_add_e", "min", u=x, e=w),
    "u_dot_v": lambda g, x, w, s: kernels.gsddmm(g, "u_dot_v", u=x, v=x * 2),
    "u_mul_e (sddmm)": lambda g, x, w, s: kernels.gsddmm(g, "u_mul_e", u=x, e=w),
    "edge_softmax": lambda g, x, w, s: kernels.edge_softmax(g, s),
}


@pytest.mark.parametrize("case", list(CASES))
def test_results_and_gradients_on_poisoned_reused_blocks(csr, cache, case):
    """Forward and backward twice; before the second, every cached block is filled with NaN
    bytes. Both runs match the torch backend, so no kernel reads its output before writing it
    or takes a reused block for zeros."""
    fn = CASES[case]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, F, generator=gen, dtype=torch.float32)
    w = torch.rand(E, F, generator=gen, dtype=torch.float32) + 0.5
    s = torch.randn(E, 8, generator=gen, dtype=torch.float32)

    def run(backend):
        leaves = [t.detach().requires_grad_() for t in (x, w, s)]
        with kernels.use_backend(backend):
            out = fn(csr, *leaves)
            gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            grads = torch.autograd.grad(out, leaves, gout, allow_unused=True)
        return out.detach(), [g for g in grads if g is not None]

    def check():  # returns holding no tensor of the run, so that all its blocks are freed
        out, grads = run("numba")
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)

    ref_out, ref_grads = run("torch")
    check()
    blocks = poison(cache)
    assert blocks > 0
    before = cache.stats()
    check()
    after = cache.stats()
    # the second run allocated nothing new: the blocks the first one freed served it, poisoned
    assert after["hits"] - before["hits"] >= blocks and after["misses"] == before["misses"]


def test_blocks_freed_by_other_threads(cache):
    """Finalizers run in whichever thread frees the last reference."""
    shape = (MIN_BYTES // 4,)
    ts = [cache.empty(shape, torch.float32) for _ in range(16)]
    errors = []

    def free(chunk):
        try:
            for _ in range(len(chunk)):
                chunk.pop()
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=free, args=(ts[i::4],)) for i in range(4)]
    del ts
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert not errors and s["cached_bytes"] == 16 * MIN_BYTES
    again = [cache.empty(shape, torch.float32) for _ in range(16)]
    assert len({t.data_ptr() for t in again}) == 16 and cache.stats()["cached_bytes"] == 0
    assert cache.stats()["misses"] == s["misses"]


@pytest.mark.parametrize("bad", [-1, "1GiB", 1.5, True, None])
def test_bad_limits_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="byte count >= 0") as err:
        kernels.set_output_cache_limit(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.slow
def test_the_environment_sets_the_limit_and_a_bad_value_says_how():
    root = Path(__file__).resolve().parents[2]
    code = "import kernels; print(kernels.output_cache_limit())"
    env = {**os.environ, "PYTHONPATH": str(root)}
    ok = subprocess.run([sys.executable, "-c", code], env={**env, "NGRA_KERNEL_OUTPUT_CACHE": "0"},
                        capture_output=True, text=True, cwd=root)
    assert ok.returncode == 0 and ok.stdout.strip() == "0", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code],
                         env={**env, "NGRA_KERNEL_OUTPUT_CACHE": "2GiB"}, capture_output=True,
                         text=True, cwd=root)
    assert bad.returncode != 0
    assert "NGRA_KERNEL_OUTPUT_CACHE='2GiB'" in bad.stderr and "byte count" in bad.stderr


MIB = MIN_BYTES // 4  # float32 elements per MiB


@pytest.fixture
def own():
    """A cache of its own (its own arena), so that pieces lie where these tests put them."""
    return OutputCache(256 << 20)


def test_a_larger_piece_is_split_and_merged_back_when_freed(own):
    """A request no warm piece of its size serves takes the smallest larger piece's start (a
    hit: no new pages), the rest staying cached; freed pieces merge with warm neighbours, so
    that the whole serves a request of its size again."""
    big = own.empty((8 * MIB,), torch.float32)
    base = big.data_ptr()
    del big
    before = own.stats()
    a = own.empty((2 * MIB,), torch.float32)
    assert a.data_ptr() == base and own.stats()["cached_bytes"] == 6 * MIN_BYTES
    b = own.empty((6 * MIB,), torch.float32)  # the rest, exactly
    assert b.data_ptr() == base + 2 * MIN_BYTES and own.stats()["cached_bytes"] == 0
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == 2 * MIB  # the pieces do not overlap
    del a
    assert own.stats()["cached_blocks"] == 1
    del b  # merged with its freed neighbour: one 8 MiB piece
    s = own.stats()
    assert s["cached_blocks"] == 1 and s["cached_bytes"] == 8 * MIN_BYTES
    again = own.empty((8 * MIB,), torch.float32)
    assert again.data_ptr() == base
    s = own.stats()
    assert s["misses"] == before["misses"] and s["hits"] == before["hits"] + 3


def test_a_miss_takes_the_stretch_with_the_most_warm_bytes(own):
    """No warm piece is large enough: the request takes warm and emptied ranges side by side,
    the most warm bytes it can (here the 4 MiB freed after the piece in use, and 1 MiB of new
    pages past it, rather than the 4 MiB before it)."""
    a, b, c = (own.empty((n * MIB,), torch.float32) for n in (4, 1, 4))
    assert b.data_ptr() == a.data_ptr() + 4 * MIN_BYTES == c.data_ptr() - MIN_BYTES
    c_ptr = c.data_ptr()
    del a, c
    before = own.stats()
    d = own.empty((5 * MIB,), torch.float32)
    s = own.stats()
    assert d.data_ptr() == c_ptr and s["misses"] == before["misses"] + 1
    # 6 MiB in use and 4 cached: within the most ever in use (9 MiB) and an eighth, so the
    # 4 MiB piece stays cached
    assert s["cached_bytes"] == 4 * MIN_BYTES
    d.fill_(1.0)
    assert float(d.sum()) == 5 * MIB and float(b.fill_(2.0).sum()) == 2 * MIB


def test_a_miss_past_the_most_in_use_empties_the_oldest(own):
    """Growing past the most ever in use, a miss empties cached pieces, oldest first, as far as
    in use + cached would pass that plus an eighth (so they do not sit on top of the growth)."""
    olds = [own.empty((n * MIB,), torch.float32) for n in (8, 1, 8, 1)]
    keep = olds[1], olds[3]
    del olds
    assert own.stats()["cached_bytes"] == 16 * MIN_BYTES and own.in_use_peak == 18 * MIN_BYTES
    before = own.stats()
    big = own.empty((24 * MIB,), torch.float32)  # in use 26 MiB: a new most
    s = own.stats()
    assert s["misses"] == before["misses"] + 1 and own.in_use_peak == 26 * MIN_BYTES
    # budget: 26 + 26 / 8 = 29.25 MiB, in use 26 MiB: at most 3.25 MiB cached, so both 8 MiB
    # pieces (the only cached ones) are emptied
    assert s["cached_bytes"] == 0
    del big
    assert own.stats()["cached_bytes"] == 24 * MIN_BYTES
    small = own.empty((2 * MIB,), torch.float32)  # a hit: nothing emptied
    assert own.stats()["cached_bytes"] == 22 * MIN_BYTES
    del small, keep


def test_pieces_of_a_block_trimmed_away_leave_the_rest_usable(own):
    """Trimming the cache to a limit empties the oldest pieces, also next to a piece in use,
    without touching that piece; the emptied range serves later requests (as new pages)."""
    big = own.empty((8 * MIB,), torch.float32)
    base = big.data_ptr()
    del big
    kept = own.empty((3 * MIB,), torch.float32).fill_(5.0)
    assert own.stats()["cached_bytes"] == 5 * MIN_BYTES
    own.set_limit(0)
    assert own.stats()["cached_bytes"] == 0
    assert float(kept.sum()) == 5.0 * 3 * MIB
    own.set_limit(256 << 20)
    again = own.empty((5 * MIB,), torch.float32).fill_(1.0)  # the emptied range, zero-filled anew
    assert again.data_ptr() == base + 3 * MIN_BYTES and float(again.sum()) == 5 * MIB
    del kept  # returned; its neighbour is in use
    assert own.stats()["cached_bytes"] == 3 * MIN_BYTES
    del again  # merged: the whole 8 MiB again
    assert own.stats()["cached_blocks"] == 1 and own.stats()["cached_bytes"] == 8 * MIN_BYTES


def test_a_piece_larger_than_the_limit_keeps_only_the_limit(own):
    own.set_limit(3 * MIN_BYTES)
    t = own.empty((5 * MIB,), torch.float32)
    ptr = t.data_ptr()
    del t
    views = own._free_views()
    assert own.stats()["cached_bytes"] == 3 * MIN_BYTES and len(views) == 1
    assert views[0].ctypes.data == ptr + 2 * MIN_BYTES  # the start was emptied


@pytest.mark.parametrize("preset", [None, "0"])
def test_import_turns_on_torch_huge_pages_unless_the_user_chose(preset):
    """``import kernels`` sets torch's THP_MEM_ALLOC_ENABLE (large CPU tensors on transparent huge
    pages) only where the user has not set it; the output cache follows the same choice."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if preset is not None:
        env["THP_MEM_ALLOC_ENABLE"] = preset
    code = ("import os, torch, kernels, kernels._outcache as o; "
            "print(os.environ['THP_MEM_ALLOC_ENABLE'], o._HUGE_PAGES)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == (["1", "True"] if preset is None else ["0", "False"])
