"""Hostile inputs from Python, one class of defect per test (docs/reliability.md): index widths,
accessor bounds, thread counts, degenerate and overflowing sizes, argument types, second-order
gradients. Each must give a correct result or an mha.Error naming the argument — never a crash,
a hang, a nanobind signature dump or a silently wrong answer."""
import numpy as np
import pytest
import torch

import mha


def test_more_than_2_to_31_keys_through_expand():
    # The tiled path, bottom-right causal with a window past key index 2^31: each row sees 4 keys.
    q = torch.ones(1, 1, 32, 4)
    n = 2**31 + 5
    k = torch.zeros(1, 1, 1, 4).expand(1, 1, n, 4)
    v = torch.ones(1, 1, 1, 4).expand(1, 1, n, 4)
    out, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom-right", window=4,
                                                return_lse=True)
    assert torch.equal(out, torch.ones_like(out))
    assert torch.allclose(lse, torch.full_like(lse, float(np.log(4))))


def test_long_rows_sum_accurately():
    # 2^25 + 3 visible keys (a float running sum of 1.0s stops at 2^24): the answer is 1.
    n = 2**25 + 3
    q = torch.ones(1, 1, 1, 4)
    k = torch.zeros(1, 1, 1, 4).expand(1, 1, n, 4)
    v = torch.ones(1, 1, 1, 4).expand(1, 1, n, 4)
    out = mha.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, torch.ones_like(out), atol=1e-5)


@pytest.mark.parametrize("lengths", [[2**32 + 3], [2**31], [-1], [6], np.array([2**64 - 1], dtype=np.uint64)])
def test_key_lengths_outside_the_keys_are_errors_not_wrapped(lengths):
    x = np.ones((1, 1, 5, 4), dtype=np.float32)
    with pytest.raises(mha.Error, match="key_lengths"):
        mha.scaled_dot_product_attention(x, x, x, key_lengths=lengths)


def test_key_lengths_of_the_wrong_type():
    x = np.ones((1, 1, 5, 4), dtype=np.float32)
    for bad in ([2.5], ["3"], [True]):
        with pytest.raises(mha.Error, match="key_lengths"):
            mha.scaled_dot_product_attention(x, x, x, key_lengths=bad)


@pytest.mark.parametrize("b", [-1, 1, 5, 10**12, -(2**63), 2**70, "0", 0.0, None])
def test_kv_cache_accessors_check_the_sequence(b):
    m = mha.MultiheadAttention(8, 2, batch_first=True)
    cache = m.make_cache(1)
    assert cache.length(0) == 0 and cache.stored(0) == 0
    with pytest.raises(mha.Error, match="outside|integer"):
        cache.length(b)
    with pytest.raises(mha.Error, match="outside|integer"):
        cache.stored(b)


@pytest.mark.parametrize("threads", [-1, mha._mha.MAX_THREADS + 1, 5000, 100000, 2**40, 1.5])
def test_thread_counts_outside_the_range_are_errors(threads):
    x = np.ones((1, 2, 5, 4), dtype=np.float32)
    with pytest.raises(mha.Error, match="num_threads"):
        mha.scaled_dot_product_attention(x, x, x, num_threads=threads)
    m = mha.MultiheadAttention(8, 2, batch_first=True, num_threads=threads).eval()
    y = np.ones((1, 3, 8), dtype=np.float32)
    with pytest.raises(mha.Error, match="num_threads"):
        m(y, y, y)
    with pytest.raises(mha.Error, match="num_threads"):
        m.step(y, m.make_cache(1))


def test_nothing_to_compute_returns_at_once():
    # 2^40 batches, Dv = 0: no output element. This looped over every batch entry for minutes.
    q = torch.zeros(1, 1, 3, 4).expand(2**40, 1, 3, 4)
    v = torch.zeros(1, 1, 5, 0).expand(2**40, 1, 5, 0)
    k = torch.zeros(1, 1, 5, 4).expand(2**40, 1, 5, 4)
    out = mha.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2**40, 1, 3, 0)


def test_module_sizes_that_overflow_are_errors():
    with pytest.raises(mha.Error, match="overflows 64 bits"):
        mha.MultiheadAttention(2**31, 1)
    with pytest.raises(mha.Error, match="cannot allocate"):
        mha.MultiheadAttention(2**20, 1)


def test_argument_types_are_named():
    x = np.ones((1, 2, 5, 4), dtype=np.float32)
    t = torch.ones(1, 2, 5, 4)
    with pytest.raises(mha.Error, match="scale"):
        mha.scaled_dot_product_attention(x, x, x, scale="0.5")
    with pytest.raises(mha.Error, match="scale"):
        mha.scaled_dot_product_attention(x, x, x, scale=float("nan"))
    with pytest.raises(mha.Error, match="dropout_p"):
        mha.scaled_dot_product_attention(x, x, x, dropout_p="0.1")
    with pytest.raises(mha.Error, match="dropout_seed"):
        mha.scaled_dot_product_attention(x, x, x, dropout_p=0.1, dropout_seed=-1)
    with pytest.raises(mha.Error, match="dropout_seed"):
        mha.scaled_dot_product_attention(x, x, x, dropout_p=0.1, dropout_seed=2**64)
    with pytest.raises(mha.Error, match="backend"):
        mha.scaled_dot_product_attention(x, x, x, backend=3)
    with pytest.raises(mha.Error, match="window"):
        mha.scaled_dot_product_attention(x, x, x, is_causal=True, window=2.5)
    with pytest.raises(mha.Error, match="attn_mask"):
        mha.scaled_dot_product_attention(x, x, x, attn_mask=[[True] * 5] * 5)
    with pytest.raises(mha.Error, match="query"):
        mha.scaled_dot_product_attention([[1.0]], x, x)
    with pytest.raises(mha.Error, match="head"):
        mha.scaled_dot_product_attention(t, t[:, :0], t[:, :0], enable_gqa=True)
    m = mha.MultiheadAttention(8, 2, batch_first=True)
    y = torch.ones(1, 3, 8)
    with pytest.raises(mha.Error, match="dropout_seed"):
        m(y, y, y, dropout_seed=-1)
    with pytest.raises(mha.Error, match="key_padding_mask"):
        m(y, y, y, key_padding_mask=[[False] * 3])


def test_numpy_strides_that_are_not_whole_elements():
    # A float32 view into packed bytes at an odd offset: byte strides of 4·k + 2.
    raw = np.zeros(2 + 4 * 1 * 2 * 5 * 4 * 2, dtype=np.uint8)
    x = np.ndarray((1, 2, 5, 4), dtype=np.float32, buffer=raw, offset=2, strides=(160, 80, 16, 4))
    x[...] = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    c = np.ascontiguousarray(x)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(x, x, x), mha.scaled_dot_product_attention(c, c, c))
    # Rows 18 bytes apart: not a whole number of float32 elements.
    odd = np.ndarray((1, 1, 3, 4), dtype=np.float32, buffer=np.zeros(200, np.uint8), strides=(48, 48, 18, 4))
    c = np.ascontiguousarray(odd)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(odd, odd, odd),
                                  mha.scaled_dot_product_attention(c, c, c))


def test_byte_swapped_floats_are_refused():
    """Big-endian float32 (from a file, say) is an error on the rank-4 small-call path too: never
    read as little-endian."""
    be = np.ones((1, 2, 3, 4), dtype=">f4")
    with pytest.raises(mha.Error, match=">f4"):
        mha.scaled_dot_product_attention(be, be, be)
    ok = np.ones((1, 2, 3, 4), dtype=np.float32)
    with pytest.raises(mha.Error, match=">f4"):
        mha.scaled_dot_product_attention(ok, be, be)


def test_integer_weights_are_refused_not_dropped():
    tm = torch.nn.MultiheadAttention(8, 2)
    sd = {k: v.clone() for k, v in tm.state_dict().items()}
    sd["in_proj_weight"] = sd["in_proj_weight"].long()
    m = mha.MultiheadAttention(8, 2)
    with pytest.raises(mha.Error, match="in_proj_weight.*int64"):
        m.load_state_dict(sd)


def test_second_order_gradients_raise_instead_of_being_wrong():
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = mha.scaled_dot_product_attention(q, k, v)
    with pytest.raises(mha.Error, match="second-order"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (g,) = torch.autograd.grad(mha.scaled_dot_product_attention(q, k, v).square().sum(), q)  # first order: fine
    assert g.shape == q.shape


def test_varlen_and_paged_cache_refuse_hostile_arguments():
    q = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(mha.Error, match=r"cu_seqlens_q must be \(S \+ 1,\)"):
        mha.varlen_attention(q, q, q, cu.reshape(1, 2), cu, 5, 5)
    with pytest.raises(mha.Error, match="max_seqlen_q must be an integer"):
        mha.varlen_attention(q, q, q, cu, cu, 5.0, 5)
    with pytest.raises(mha.Error, match="window_size must be a pair"):
        mha.varlen_attention(q, q, q, cu, cu, 5, 5, causal=True, window_size=3)
    with pytest.raises(mha.Error, match="second-order"):
        qg = q.clone().requires_grad_()
        out = mha.varlen_attention(qg, q, q, cu, cu, 5, 5)
        torch.autograd.grad(out.square().sum(), qg, create_graph=True)
    cache = mha.PagedKvCache(kv_heads=1, head_dim=8, page_size=16)
    with pytest.raises(mha.Error, match="seq must be an integer"):
        cache.length(True)
    with pytest.raises(mha.Error, match="sequence 3 is not live"):
        cache.attend(torch.zeros(1, 1, 1, 8), [3])
    with pytest.raises(mha.Error, match="expected a numpy array or a torch tensor"):
        cache.append(cache.add_sequence(), [[[0.0] * 8]], [[[0.0] * 8]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_non_finite_token_reaches_only_the_later_rows_of_a_step(dtype):
    # 12 new tokens in one step (the decode kernel takes up to 16 rows), the last one NaN: rows
    # 0-10 do not see it, though the kernel reads its key and value in their block (0 x NaN must
    # not reach them). Their outputs are those of a step of the first 11 tokens alone (the key channel scales of a
    # quantized cache come from the finite keys in both). int4: the redone rows take the float
    # value pass, the step alone the bfloat16 one where the CPU has it (2^-7, docs/numerics.md);
    # int8: the one on 16-bit weights where the CPU has AVX-512 VNNI (norm-wise within 2^-9).
    m = mha.MultiheadAttention(64, 4, batch_first=True)
    x = np.random.default_rng(0).standard_normal((1, 12, 64)).astype(np.float32)
    alone = m.step(x[:, :11], m.make_cache(1, dtype=dtype))
    x[0, 11, :] = np.nan
    y = m.step(x, m.make_cache(1, dtype=dtype))
    assert not np.isfinite(y[0, 11]).any()
    tol = 2**-7 if dtype == "int4" else 2**-9 if dtype == "int8" else 1e-5
    np.testing.assert_allclose(y[0, :11], alone[0], rtol=tol, atol=tol)
