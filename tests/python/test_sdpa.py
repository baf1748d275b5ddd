"""mha.scaled_dot_product_attention against torch on random configurations (hypothesis):
shapes and batch broadcasting, heads and GQA, bool and float masks of every broadcastable
shape, causal, scale, numpy and torch inputs; plus the extras and the errors."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import mha
from conftest import BOUND, normal, record, rel_error, torch_sdpa, within_bound


@st.composite
def sdpa_case(draw):
    rank = draw(st.integers(2, 5))
    lead = [draw(st.integers(1, 3)) for _ in range(max(rank - 3, 0))]
    enable_gqa = draw(st.booleans())
    hq = draw(st.integers(1, 6)) if rank >= 3 else 1
    if rank >= 3 and enable_gqa:
        hk = draw(st.sampled_from([d for d in range(1, hq + 1) if hq % d == 0]))
    elif rank >= 3:
        hk = draw(st.sampled_from([1, hq]))
    else:
        hk = 1
    L, S = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    E, Ev = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    # key/value may broadcast over the leading batch dims
    klead = [d if draw(st.booleans()) else 1 for d in lead]
    qshape = lead + ([hq] if rank >= 3 else []) + [L, E]
    kshape = klead + ([hk] if rank >= 3 else []) + [S, E]
    vshape = klead + ([hk] if rank >= 3 else []) + [S, Ev]
    score = lead + ([hq] if rank >= 3 else []) + [L, S]
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mshape = None
    if mask_kind != "none":
        mrank = draw(st.integers(1, len(score)))
        mshape = [d if draw(st.booleans()) else 1 for d in score[len(score) - mrank:]]
    return dict(qshape=qshape, kshape=kshape, vshape=vshape, mask_kind=mask_kind, mshape=mshape,
                is_causal=draw(st.booleans()), scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
                enable_gqa=enable_gqa, as_torch=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


def make_inputs(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = normal(rng, c["qshape"]), normal(rng, c["kshape"]), normal(rng, c["vshape"])
    mask = None
    if c["mask_kind"] == "bool":
        mask = rng.random(c["mshape"]) < 0.75
    elif c["mask_kind"] == "float":
        mask = normal(rng, c["mshape"])
    return q, k, v, mask


def check_against(got, want, want32, name, scale=None):
    """want (float64) may have NaN rows (every key masked): mha must give zeros there. scale:
    see conftest.within_bound."""
    got = np.asarray(got, dtype=np.float64)
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape)
    want32 = np.broadcast_to(np.asarray(want32, dtype=np.float64), got.shape)
    nan_rows = np.isnan(want).any(axis=-1)
    assert np.all(got[nan_rows] == 0), f"{name}: a fully masked row is not zeros"
    within_bound(got[~nan_rows], want[~nan_rows], want32[~nan_rows], name, scale)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(sdpa_case())
def test_matches_torch(c):
    q, k, v, mask = make_inputs(c)
    want = torch_sdpa(q, k, v, mask, c["is_causal"], c["scale"], c["enable_gqa"]).numpy()
    want32 = torch_sdpa(q, k, v, mask, c["is_causal"], c["scale"], c["enable_gqa"], dtype=torch.float32).numpy()
    if c["as_torch"]:
        args = [torch.from_numpy(x) for x in (q, k, v)]
        m = None if mask is None else torch.from_numpy(mask)
    else:
        args, m = [q, k, v], mask
    got = mha.scaled_dot_product_attention(*args, attn_mask=m, is_causal=c["is_causal"], scale=c["scale"],
                                           enable_gqa=c["enable_gqa"])
    assert type(got) is type(args[0]), "mha returns the kind it was given"
    assert tuple(got.shape) == want.shape
    check_against(got, want, want32, "sdpa output", scale=float(np.abs(v).max()) if v.size else None)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(sdpa_case())
def test_lse_and_weights_match_torch(c):
    q, k, v, mask = make_inputs(c)
    out, lse, w = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c["is_causal"],
                                                   scale=c["scale"], enable_gqa=c["enable_gqa"], return_lse=True,
                                                   return_weights=True)
    # The weights applied to V reproduce the output; their rows are torch's softmax.
    E = q.shape[-1]
    scale = c["scale"] if c["scale"] is not None else 1 / np.sqrt(E)
    def scores(dtype):
        qt, kt = torch.from_numpy(q).to(dtype), torch.from_numpy(k).to(dtype)
        if c["enable_gqa"] and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
            kt = kt.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        s = qt @ kt.transpose(-2, -1) * scale
        Lq, S = q.shape[-2], k.shape[-2]
        if c["is_causal"]:
            s = s.masked_fill(~torch.ones(Lq, S, dtype=torch.bool).tril(), float("-inf"))
        if mask is not None:
            m = torch.from_numpy(mask)
            s = s.masked_fill(~m, float("-inf")) if mask.dtype == bool else s + m.to(dtype)
        return s

    s = scores(torch.float64)
    want_w = torch.softmax(s, -1).numpy()
    want_lse = torch.logsumexp(s, -1).numpy()
    check_against(w, want_w, torch.softmax(scores(torch.float32), -1).numpy(), "sdpa weights")
    finite = np.isfinite(np.broadcast_to(want_lse, lse.shape))
    assert np.all(np.isneginf(lse[~finite])), "a fully masked row has lse = -inf"
    err = float(np.max(np.abs(lse[finite] - np.broadcast_to(want_lse, lse.shape)[finite]), initial=0.0))
    record("sdpa lse (absolute)", err)
    assert err <= 1e-4


def test_numpy_in_numpy_out_without_copying_inputs(rng):
    q = normal(rng, (2, 3, 5, 8))
    k = normal(rng, (2, 3, 7, 8))
    v = normal(rng, (2, 3, 7, 4))
    out = mha.scaled_dot_product_attention(q[:, :, ::1], k.transpose(0, 1, 2, 3), v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (2, 3, 5, 4)
    # Strided views (every other head, transposed layouts) give the same result as copies.
    x = normal(rng, (2, 5, 6, 8))  # (B, T, H, D)
    qs = x.transpose(0, 2, 1, 3)[:, ::2]  # (B, 3, T, D) view, not contiguous
    a = mha.scaled_dot_product_attention(qs, qs, qs)
    b = mha.scaled_dot_product_attention(np.ascontiguousarray(qs), np.ascontiguousarray(qs), np.ascontiguousarray(qs))
    np.testing.assert_array_equal(a, b)


def test_bottom_right_causal_and_key_lengths(rng):
    q = normal(rng, (2, 2, 3, 8))
    k = normal(rng, (2, 2, 6, 8))
    v = normal(rng, (2, 2, 6, 8))
    got = mha.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom-right")
    keep = np.tril(np.ones((3, 6), dtype=bool), k=3)  # query i sees j <= i + 3
    want = torch_sdpa(q, k, v, keep).numpy()
    assert rel_error(got, want) <= BOUND
    lengths = np.array([6, 4], dtype=np.int32)
    got = mha.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
    keep = np.ones((2, 1, 1, 6), dtype=bool)
    keep[1, ..., 4:] = False
    assert rel_error(got, torch_sdpa(q, k, v, keep).numpy()) <= BOUND


def test_fully_masked_rows_are_zeros_not_nan(rng):
    q, k, v = normal(rng, (1, 1, 4, 8)), normal(rng, (1, 1, 5, 8)), normal(rng, (1, 1, 5, 8))
    mask = np.ones((4, 5), dtype=bool)
    mask[2] = False
    out, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[0, 0, 2] == 0) and np.isneginf(lse[0, 0, 2])
    # torch 2.x's CPU SDPA agrees (zeros); its nn.MultiheadAttention still gives NaN there.
    assert np.array_equal(torch_sdpa(q, k, v, mask).numpy()[0, 0, 2], out[0, 0, 2])


def test_dropout_is_reproducible_and_matches_its_weights(rng):
    q, k, v = normal(rng, (2, 2, 16, 8)), normal(rng, (2, 2, 16, 8)), normal(rng, (2, 2, 16, 8))
    a, w = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=7, return_weights=True)
    b = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=7)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, w @ v, rtol=1e-5, atol=1e-5)  # the weights returned are the ones applied
    dropped = (w == 0).mean()
    assert 0.2 < dropped < 0.4
    assert np.all(mha.scaled_dot_product_attention(q, k, v, dropout_p=1.0) == 0)
    torch.manual_seed(3)
    c = mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.3)
    torch.manual_seed(3)
    d = mha.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), dropout_p=0.3)
    assert torch.equal(c, d), "without a seed, dropout follows torch.manual_seed"


@pytest.mark.parametrize("bad, message", [
    (dict(q=(2, 3, 4)), "disagree"),
    (dict(dtype=np.float64), "float32"),
    (dict(k=(2, 3, 5, 8), v=(2, 3, 5, 8)), "enable_gqa"),
    (dict(mask=(3, 5)), "does not broadcast"),
    (dict(mask_dtype=np.int32), "bool"),
    (dict(dropout_p=1.5), "dropout_p"),
    (dict(align="middle"), "causal_alignment"),
])
def test_errors_name_the_argument(rng, bad, message):
    q = normal(rng, bad.get("q", (2, 4, 5, 8))).astype(bad.get("dtype", np.float32))
    k = normal(rng, bad.get("k", (2, 4, 5, 8)))
    v = normal(rng, bad.get("v", (2, 4, 5, 8)))
    mask = None
    if "mask" in bad:
        mask = np.ones(bad["mask"], dtype=bool)
    if "mask_dtype" in bad:
        mask = np.ones((5, 5), dtype=bad["mask_dtype"])
    with pytest.raises(mha.Error, match=message):
        mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=bad.get("dropout_p", 0.0),
                                         is_causal=True, causal_alignment=bad.get("align", "top-left"))
    assert issubclass(mha.Error, ValueError)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_mask_that_does_not_broadcast_is_named_as_passed(rng, kind):
    q, k = normal(rng, (1, 2, 4, 8)), normal(rng, (1, 2, 1, 8))
    if kind == "torch":
        q, k = torch.from_numpy(q), torch.from_numpy(k)
    mask = np.zeros((4, 2), np.float32), np.zeros((3, 1), bool)
    if kind == "torch":
        mask = tuple(torch.from_numpy(m) for m in mask)
    # The caller's name and shape (not the kernel's 4-D attn_bias / keep_mask); against a single
    # key the mask's last dimension may only be 1.
    with pytest.raises(mha.Error, match=r"^scaled_dot_product_attention: attn_mask \(4, 2\) does not broadcast to the "
                                        r"scores \(1, 2, 4, 1\): dimension 1 is 2, expected 1$"):
        mha.scaled_dot_product_attention(q, k, k, attn_mask=mask[0])
    with pytest.raises(mha.Error, match=r"attn_mask \(3, 1\) .*: dimension 0 is 3, expected 4 or 1$"):
        mha.scaled_dot_product_attention(q, k, k, attn_mask=mask[1])


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_the_small_call_path_agrees_with_the_general_one(rng, monkeypatch, kind, mask):
    """Rank-4 calls without extras skip the Python argument handling (functional._fast_call):
    the same bits as the general path (forced here by return_lse), and really taken."""
    from mha import functional
    q, k, v = normal(rng, (2, 6, 9, 8)), normal(rng, (2, 3, 11, 8)), normal(rng, (2, 3, 11, 5))
    m = None
    if mask == "bool":
        m = rng.random((2, 1, 9, 11)) < 0.7
    elif mask == "float":
        m = normal(rng, (1, 6, 1, 11))
    args = [q, k, v, m]
    if kind == "torch":
        args = [None if a is None else torch.from_numpy(a) for a in args]
    general = mha.scaled_dot_product_attention(*args[:3], attn_mask=args[3], is_causal=True, enable_gqa=True,
                                               scale=0.4, return_lse=True)[0]

    def refuse(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(functional, "_prepare", refuse)
    fast = mha.scaled_dot_product_attention(*args[:3], attn_mask=args[3], is_causal=True, enable_gqa=True,
                                            scale=0.4)
    assert type(fast) is type(general)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(general))
    with pytest.raises(AssertionError, match="general path"):  # grouped heads without enable_gqa: its error
        mha.scaled_dot_product_attention(*args[:3])


@pytest.mark.parametrize("view", ["transposed", "reversed", "parameter"])
def test_the_small_call_path_hands_on_what_it_does_not_take(rng, monkeypatch, view):
    """Views the small call path does not read as they are (non-contiguous numpy arrays, negative
    strides) and torch.Tensor subclasses go to the general path, which gives the result of the
    same values in a contiguous array."""
    from mha import functional
    q, k, v = normal(rng, (2, 9, 4, 8)), normal(rng, (2, 11, 4, 8)), normal(rng, (2, 11, 4, 8))
    if view == "transposed":  # (B, T, H, D) memory read as (B, H, T, D), as models hold it
        args = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    elif view == "reversed":
        args = [np.ascontiguousarray(x.transpose(0, 2, 1, 3))[:, :, ::-1] for x in (q, k, v)]
    else:
        args = [torch.nn.Parameter(torch.from_numpy(x.transpose(0, 2, 1, 3).copy()), requires_grad=False)
                for x in (q, k, v)]
    want = mha.scaled_dot_product_attention(*[np.ascontiguousarray(np.asarray(a.detach() if view == "parameter"
                                                                                else a)) for a in args],
                                            is_causal=True)
    prepared = []
    general = functional._prepare

    def counted(*a, **kw):
        prepared.append(1)
        return general(*a, **kw)

    monkeypatch.setattr(functional, "_prepare", counted)
    got = mha.scaled_dot_product_attention(*args, is_causal=True)
    assert prepared, "the small call path took a view it reads wrongly"
    np.testing.assert_array_equal(np.asarray(got.detach() if view == "parameter" else got), want)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("path", ["small call", "general"])
def test_a_mask_with_spaced_keys_is_copied_once_keeping_its_broadcast(rng, monkeypatch, kind, mask_dtype, path):
    """A mask whose keys are spaced apart (T5's position bias is a permuted embedding, keys H
    apart) is copied to dense key rows before the kernels read it key by key; its broadcast
    (stride-0) dimensions stay broadcast, so no (B, H, Tq, Tk) array is made. Same bits as the
    same mask made contiguous, on both paths."""
    from mha import _arrays, functional
    B, H, L, S = 3, 4, 5, 7
    q, k, v = normal(rng, (B, H, L, 8)), normal(rng, (B, H, S, 8)), normal(rng, (B, H, S, 8))
    table = normal(rng, (L, S, H)) if mask_dtype == "float" else (rng.random((L, S, H)) < 0.7)
    table[:, 0] = 1  # every row keeps a key
    spaced = table.transpose(2, 0, 1)[None]  # (1, H, L, S), keys H apart
    if kind == "torch":
        q, k, v, spaced = (torch.from_numpy(np.asarray(x)) for x in (q, k, v, spaced))
        spaced = spaced.expand(B, H, L, S)  # and a broadcast batch dimension (stride 0)
    else:
        spaced = np.broadcast_to(spaced, (B, H, L, S))
    dense = np.ascontiguousarray(np.asarray(spaced))
    extra = {} if path == "small call" else {"dropout_p": 0.0, "key_lengths": [S] * B}
    copies = []
    real = _arrays.keys_dense

    def spy(x):
        y = real(x)
        if y is not x:
            copies.append(y)
        return y

    monkeypatch.setattr(_arrays, "keys_dense", spy)
    got = mha.scaled_dot_product_attention(q, k, v, attn_mask=spaced, **extra)
    assert len(copies) == 1
    strides = copies[0].stride() if kind == "torch" else tuple(s // copies[0].itemsize for s in copies[0].strides)
    assert strides[0] == 0 and strides[-1] == 1, strides
    monkeypatch.setattr(_arrays, "keys_dense", real)
    want = mha.scaled_dot_product_attention(*(np.asarray(x) for x in (q, k, v)), attn_mask=dense, **extra)
    np.testing.assert_array_equal(np.asarray(got), want)
