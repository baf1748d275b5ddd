"""mha.PagedKvCache from Python: batched decoding over sequences of different lengths against
torch's SDPA over each sequence's stored keys and values, fork and free, errors."""
import numpy as np
import pytest
import torch

import mha
from conftest import record


def sdpa_alone(q, k, v):
    """q (Hq, n, D) over k, v (Hkv, L, D), bottom-right causal, GQA expanded."""
    G = q.shape[0] // k.shape[0]
    n, L = q.shape[1], k.shape[1]
    mask = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(G, 0), v.repeat_interleave(G, 0), attn_mask=mask)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", torch.int8, "int4"])
def test_batched_decode_matches_torch_on_the_stored_values(dtype):
    torch.manual_seed(5)
    cache = mha.PagedKvCache(kv_heads=2, head_dim=32, page_size=16, pages=4, dtype=dtype)
    ids, lengths = [], [5, 40, 17, 64]
    for L in lengths:
        s = cache.add_sequence()
        cache.append(s, torch.randn(2, L, 32), torch.randn(2, L, 32))
        ids.append(s)
    q = torch.randn(len(ids), 8, 1, 32)
    out = cache.attend(q, ids)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 8, 1, 32)
    for i, s in enumerate(ids):
        k = torch.from_numpy(cache.keys_as_float(s)).double()
        v = torch.from_numpy(cache.values_as_float(s)).double()
        qs = q[i].double()
        if cache.dtype == "bfloat16":  # the queries are rounded to the pool's type
            qs = q[i].bfloat16().double()
        want = sdpa_alone(qs, k, v)
        err = float((out[i].double() - want).abs().max() / want.abs().max())
        record(f"paged decode {cache.dtype}", err)
        # bfloat16: the queries' rounding; int8/int4: the decode kernel may round the query to
        # 16 bits (int8 keys) or 8 bits (int4 keys) for integer dot products, and int4 values and
        # weights to bfloat16 for bfloat16 dot products (AVX-512 BF16), or the weights to bytes
        # (AVX2; AVX-512 VNNI and VBMI), and int8 weights to 16-bit words (AVX-512 VNNI: 2^-9)
        # (docs/numerics.md, "The kernel over the codes").
        bound = {"bfloat16": 1 / 128, "int8": 2**-9, "int4": 2**-4}.get(cache.dtype, 1e-5)
        assert err < bound


def test_fork_free_and_errors():
    cache = mha.PagedKvCache(kv_heads=1, head_dim=16, page_size=16, pages=2, max_pages=4)
    a = cache.add_sequence()
    cache.append(a, np.random.randn(1, 20, 16).astype(np.float32), np.random.randn(1, 20, 16).astype(np.float32))
    b = cache.fork(a)
    assert cache.block_table(a) == cache.block_table(b)
    assert [cache.references(p) for p in cache.block_table(a)] == [2, 2]
    cache.append(b, np.ones((1, 1, 16), np.float32), np.ones((1, 1, 16), np.float32))
    assert cache.block_table(a)[-1] != cache.block_table(b)[-1]
    cache.free_sequence(a)
    with pytest.raises(mha.Error, match="sequence 0 is not live"):
        cache.length(a)
    with pytest.raises(mha.Error, match="pool is full"):
        cache.append(b, np.zeros((1, 60, 16), np.float32), np.zeros((1, 60, 16), np.float32))
    assert cache.length(b) == 21
    with pytest.raises(mha.Error, match="must be float32"):
        cache.append(b, np.zeros((1, 1, 16), np.float16), np.zeros((1, 1, 16), np.float16))
    with pytest.raises(mha.Error, match="page_size must be a power of two"):
        mha.PagedKvCache(kv_heads=1, head_dim=16, page_size=24)
    with pytest.raises(mha.Error, match="PagedKvCache: dtype must be .*'int8' or 'int4'; got 'int2'"):
        mha.PagedKvCache(kv_heads=1, head_dim=16, dtype="int2")
    # Every accessor's argument is checked: an mha.Error naming it, never nanobind's TypeError.
    for page in (1.5, None, "0", True, 2**64):
        with pytest.raises(mha.Error, match="references: page"):
            cache.references(page)
    for page in (-1, cache.pages, 2**63 - 1):
        with pytest.raises(mha.Error, match="references: page .* outside"):
            cache.references(page)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(dtype):
    """Two queries (positions 38 and 39) with a window of 3: a NaN value at position 36 is seen by
    the first and not by the second, though both read it in one block (for int8/int4 keys the
    block starts at 32). The second row must be what it is with that value finite."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 40, 32)).astype(np.float32)
    v = rng.standard_normal((1, 40, 32)).astype(np.float32)
    q = rng.standard_normal((1, 2, 2, 32)).astype(np.float32)
    outs = []
    for bad in (np.nan, np.inf, 0.5):
        cache = mha.PagedKvCache(1, 32, page_size=16, pages=4, window=3, dtype=dtype)
        seq = cache.add_sequence()
        v[0, 36, 5] = bad
        cache.append(seq, k, v)
        outs.append(cache.attend(q, [seq]))
    # The second row is redone by the float path (VisibleOutput); int4's fast value pass rounds P
    # and the values to bfloat16, each product within 2^-7 (docs/numerics.md); int8's, where the
    # CPU has AVX-512 VNNI, rounds P·scale to 16-bit words (norm-wise within 2^-9); bfloat16's,
    # where the CPU has AMX-BF16, rounds P to bfloat16 (within 2^-8 of Σ P|v|, and the bfloat16
    # outputs one rounding each).
    tol = 2**-7 if dtype in ("int4", "bfloat16") else 2**-9 if dtype == "int8" else 1e-5
    for out in outs[:2]:
        assert not np.isfinite(out[0, :, 0, 5]).any()  # Inf, or NaN (a quantized group)
        np.testing.assert_allclose(out[0, :, 1], outs[2][0, :, 1], rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_pool_consistent(seed):
    """Hostile-input fuzz: random add / fork / free / append / attend calls, some with bad
    arguments (freed or unknown ids, wrong shapes, non-integers, a full pool). Each call either
    works or raises mha.Error and leaves everything as it was; after each, every page is either
    free or in the tables, as many times as references() says, and lengths are what the appends
    made them."""
    rng = np.random.default_rng(seed)
    dtype = ["float32", "bfloat16", "float16", "int8", "int4", "int8"][seed]
    H, D = 2, int(rng.choice([8, 33]))
    cache = mha.PagedKvCache(H, D, page_size=int(rng.choice([16, 32])), pages=4, max_pages=16,
                             dtype=dtype)
    length, freed = {}, []
    for step in range(200):
        op = rng.choice(["add", "fork", "free", "append", "attend"], p=[0.15, 0.15, 0.15, 0.35, 0.2])
        bad_id, bad_shape = rng.random() < 0.15, rng.random() < 0.1
        live = list(length)
        held = [s for s in live if length[s] > 0] if op == "attend" else live  # attend: a key per query
        if bad_id or not held:
            unknown = [*freed, -1, 10**6, 2**63 - 1, 1.5]
            seq = unknown[rng.integers(len(unknown))]
        else:
            seq = rng.choice(held)
        before = {s: cache.length(s) for s in live}, cache.free_pages
        try:
            if op == "add":
                length[cache.add_sequence()] = 0
            elif op == "fork":
                child = cache.fork(seq)
                length[child] = length[seq]
            elif op == "free":
                cache.free_sequence(seq)
                length.pop(seq)
                freed.append(seq)
            elif op == "append":
                n = int(rng.integers(0, 50))
                k = rng.standard_normal((H, n, D + bad_shape)).astype(np.float32)
                cache.append(seq, k, rng.standard_normal((H, n, D)).astype(np.float32))
                length[seq] += n
            else:
                seqs = [seq] + [s for s in held if rng.random() < 0.5]
                out = cache.attend(rng.standard_normal((len(seqs), 2 * H, 1, D)).astype(np.float32), seqs)
                assert out.shape == (len(seqs), 2 * H, 1, D) and np.isfinite(out).all()
        except mha.Error:
            assert ({s: cache.length(s) for s in live}, cache.free_pages) == before, f"step {step}: {op} changed state"
        tables = [cache.block_table(s) for s in cache.sequences]
        assert sorted(cache.sequences) == sorted(length)
        assert all(cache.length(s) == n for s, n in length.items())
        used = [p for t in tables for p in t]
        for p in range(cache.pages):
            assert cache.references(p) == used.count(p), f"step {step}: page {p}"
        assert cache.free_pages == cache.pages - len(set(used))
