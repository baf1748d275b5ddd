"""Hostile inputs from Python, one class of defect per test (docs/reliability.md): index widths,
accessor bounds, thread counts, degenerate and overflowing sizes, argument types, second-order
gradients. Each must give a correct result or an mha.Error naming the argument — never a crash,
a hang, a nanobind signature dump or a silently wrong answer."""
import numpy as np
import pytest
import torch

import mha
import mha.distributed
import mha.integrations.transformers


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


@pytest.mark.parametrize("batch, capacity", [(2**40, 0), (2**40, 2**40), (1, 2**40)])
def test_kv_caches_too_large_to_allocate_are_errors(batch, capacity):
    # A batch of 2**40 once raised MemoryError (std::bad_alloc from its per-sequence lengths)
    # before the storage's own check.
    m = mha.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(mha.Error, match="cannot allocate|too large"):
        m.make_cache(batch, capacity=capacity)


@pytest.mark.parametrize("threads", [-1, mha._mha.MAX_THREADS + 1, 5000, 100000, 2**40, 1.5])
def test_thread_counts_outside_the_range_are_errors(threads):
    x = np.ones((1, 2, 5, 4), dtype=np.float32)
    with pytest.raises(mha.Error, match="num_threads"):
        mha.scaled_dot_product_attention(x, x, x, num_threads=threads)
    with pytest.raises(mha.Error, match="num_threads"):
        mha.MultiheadAttention(8, 2, batch_first=True, num_threads=threads)
    m = mha.MultiheadAttention(8, 2, batch_first=True).eval()
    m.num_threads = threads  # an attribute, set freely as torch's are: checked at each call
    y = np.ones((1, 3, 8), dtype=np.float32)
    with pytest.raises(mha.Error, match="num_threads"):
        m(y, y, y)
    with pytest.raises(mha.Error, match="num_threads"):
        m.step(y, m.make_cache(1))


@pytest.mark.parametrize("attribute, value", [("training", "yes"), ("training", None), ("backend", 3),
                                              ("backend", "bogus"), ("num_threads", None)])
def test_attributes_set_freely_are_checked_at_each_call(attribute, value):
    m = mha.MultiheadAttention(8, 2, batch_first=True)
    setattr(m, attribute, value)
    x = torch.randn(1, 3, 8)
    with pytest.raises(mha.Error, match=attribute):
        m(x, x, x)


def test_train_takes_only_a_flag():
    m = mha.MultiheadAttention(8, 2)
    with pytest.raises(mha.Error, match="mode"):
        m.train("no")  # a string's truth value is True
    assert m.training is True and m.train(0).training is False  # 0 and 1 are flags everywhere in mha


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


# --- every argument of the public API, one hostile value at a time ----------------------------

# Values no argument takes as they are: each must be an mha.Error naming the argument (not
# nanobind's TypeError with its signature dump, not Python's own error from deep inside, not a
# string or an array taken for its truth value).
REFUSED_EVERYWHERE = [object(), "3", float("nan"), float("inf"), (1, 2, 3), np.array([0.0, 1.0])]
# Refused too, but by the arguments that are plain real numbers (softcap, scale...).
REFUSED_BUT_BY_REALS = [1.5, 2**70, -(2**70)]
REALS = {"softcap", "qk_norm_eps", "scale", "softmax_scale", "timeout", "scaling"}
# Tried as well: each either works or is an mha.Error.
ALSO_TRIED = [None, True, -1, 0, 2**64 - 1, [1], np.int64(2), np.float32(0.5), torch.tensor(2),
              np.zeros(3, dtype=np.int64), torch.ones(2, 2, dtype=torch.bool), np.zeros((1, 2, 0, 8), np.float32)]


def public_calls():
    """(name, function, positional arguments, keyword arguments) of calls that work as given."""
    q = torch.randn(1, 2, 5, 8)
    packed = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    m = mha.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    yield ("MultiheadAttention", mha.MultiheadAttention, (8, 2),
           dict(dropout=0.0, bias=True, kdim=None, vdim=None, batch_first=True, dtype=None, num_kv_heads=None,
                out_dropout=0.0, seed=0, num_threads=0, softcap=0.0, alibi=False, sinks=False, rotary=None,
                qk_norm=False, qk_norm_eps=1e-6, window=0, sink_tokens=0))
    yield ("from_state_dict", mha.MultiheadAttention.from_state_dict, (m.state_dict(), 2),
           dict(causal=False, max_seq_len=0, batch_first=True, dropout=0.0, out_dropout=0.0, prefix="",
                num_threads=0, dtype=None, softcap=0.0, alibi=False, rotary=None, qk_norm_eps=1e-6, window=0,
                sink_tokens=0))
    yield ("forward", m.forward, (x, x, x),
           dict(key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
                is_causal=False, keep_mask=None, dropout_seed=None, training=None))
    yield "load_state_dict", m.load_state_dict, (m.state_dict(),), dict(strict=True, prefix="")
    yield "from_torch", mha.MultiheadAttention.from_torch, (torch.nn.MultiheadAttention(8, 2),), dict(num_heads=None)
    yield "make_cache", m.make_cache, (1,), dict(capacity=0, dtype=None)
    yield "step", m.step, (x, m.make_cache(1)), dict(new_tokens=[3])
    kv = m.make_cache(2)
    yield "KvCache.length", kv.length, (0,), {}
    yield "KvCache.stored", kv.stored, (0,), {}
    yield ("scaled_dot_product_attention", mha.scaled_dot_product_attention, (q, q, q),
           dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                causal_alignment="top-left", key_lengths=None, window=0, return_lse=False, return_weights=False,
                average_weights=False, dropout_seed=None, num_threads=0, backend="auto", softcap=0.0,
                alibi_slopes=None, sinks=None, sink_tokens=0))
    out, lse = mha.scaled_dot_product_attention(q, q, q, return_lse=True)
    yield "merge_attention", mha.merge_attention, (out.clone(), lse.clone(), out, lse), dict(num_threads=0)
    yield ("varlen_attention", mha.varlen_attention, (packed, packed, packed, cu, cu, 5, 5),
           dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False, dropout_seed=None, num_threads=0))
    yield ("PagedKvCache", mha.PagedKvCache, (1, 8),
           dict(head_dim_v=None, page_size=16, pages=2, max_pages=0, window=0, dtype="float32"))
    cache = mha.PagedKvCache(kv_heads=2, head_dim=8, page_size=16, pages=2, max_pages=6)
    s = cache.add_sequence()
    cache.append(s, torch.randn(2, 20, 8), torch.randn(2, 20, 8))
    for name in ("fork", "length", "first_position", "block_table", "keys_as_float", "values_as_float",
                 "references"):
        yield f"PagedKvCache.{name}", getattr(cache, name), (s,), {}
    yield "PagedKvCache.append", cache.append, (s, torch.randn(2, 1, 8), torch.randn(2, 1, 8)), {}
    yield "PagedKvCache.attend", cache.attend, (torch.randn(1, 4, 1, 8), [s]), dict(num_threads=0)
    yield "PagedKvCache.free_sequence", cache.free_sequence, (cache.fork(s),), {}
    full = torch.randn(2, 3, 8, 4)
    yield "shard_sequence", mha.distributed.shard_sequence, (full, 1, 2), dict(layout="zigzag", dim=-2)
    yield ("unshard_sequence", mha.distributed.unshard_sequence, ([full[:, :, :4], full[:, :, 4:]],),
           dict(layout="zigzag", dim=-2))


class _Attention(torch.nn.Module):
    """What transformers passes as `module` to an attention function (its flag is all mha reads)."""
    is_causal = True


def transformers_calls():
    """mha's attention function for Hugging Face transformers, called as a model calls it."""
    q = torch.randn(1, 2, 5, 8)
    yield ("attention_forward", mha.integrations.transformers.attention_forward, (_Attention(), q, q, q, None),
           dict(dropout=0.0, scaling=None, is_causal=None, position_bias=None, head_mask=None, softcap=None,
                s_aux=None, output_attentions=False))


def paged_state(cache):
    """Everything a PagedKvCache shows: a failed call must leave all of it as it was."""
    seqs = cache.sequences
    return (cache.pages, cache.free_pages, seqs, [cache.references(p) for p in range(cache.pages)],
            [(cache.length(s), cache.first_position(s), cache.block_table(s), cache.keys_as_float(s).tobytes(),
              cache.values_as_float(s).tobytes()) for s in seqs])


def sweep(calls):
    """Calls each of `calls` as given, then with each argument replaced by each hostile value;
    returns how many were refused (with an mha.Error, the only exception allowed)."""
    refusals = 0
    for name, fn, args, kwargs in calls:
        fn(*args, **kwargs)  # the call as given works
        cache = getattr(fn, "__self__", None)
        slots = [(i, f"argument {i}") for i in range(len(args))] + [(k, k) for k in kwargs]
        for slot, label in slots:
            must_refuse = REFUSED_EVERYWHERE + ([] if label in REALS else REFUSED_BUT_BY_REALS)
            for bad in must_refuse + ALSO_TRIED:
                a, kw = list(args), dict(kwargs)
                if isinstance(slot, int):
                    a[slot] = bad
                else:
                    kw[slot] = bad
                before = paged_state(cache) if isinstance(cache, mha.PagedKvCache) else None
                try:
                    fn(*a, **kw)
                except mha.Error:
                    refusals += 1
                    if before is not None:
                        assert paged_state(cache) == before, f"{name}({label}={bad!r}) failed but changed the pool"
                    continue
                except Exception as e:  # noqa: BLE001 — the defect this test looks for
                    pytest.fail(f"{name}({label}={bad!r}) raised {type(e).__name__}, not mha.Error: {e}")
                assert not any(bad is r for r in must_refuse), f"{name} accepted {label}={bad!r}"
    return refusals


def test_every_argument_refuses_hostile_values():
    refusals = sweep(public_calls())
    refusals += sweep(transformers_calls())
    assert refusals > 2500  # the sweep ran: 146 arguments × 21 values, 2,813 refusals when written


def test_kv_cache_is_made_by_its_module():
    with pytest.raises(mha.Error, match="make_cache"):
        mha.KvCache()
    with pytest.raises(mha.Error, match="make_cache"):
        mha.KvCache(2, capacity=16)
    assert isinstance(mha.MultiheadAttention(8, 2).make_cache(2), mha.KvCache)


def test_distributed_calls_refuse_hostile_values(tmp_path):
    """ring_attention and gather_sequence in a process group of one rank (gloo), initialised here
    and destroyed after: the same sweep. `group` took any object to torch (a ValueError), and
    is_causal any object's truth value ("False" was causal)."""
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q = torch.randn(1, 2, 4, 8)
        refusals = sweep([
            ("ring_attention", mha.distributed.ring_attention, (q, q, q),
             dict(group=None, is_causal=False, scale=None, layout="zigzag", num_threads=0, timeout=None)),
            ("gather_sequence", mha.distributed.gather_sequence, (q,), dict(group=None, layout="zigzag", dim=-2)),
        ])
    finally:
        dist.destroy_process_group()
    assert refusals > 150  # 11 arguments × 21 values
