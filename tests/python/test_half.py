"""bfloat16 and float16 through the Python API, against torch 2.x in the same dtype.

Truth: torch's SDPA in float64 on the same 16-bit values (widened exactly). Bound
(docs/numerics.md, "16-bit types"): mha's error is at most twice torch's own error in that dtype
plus a small absolute term, err(mha) <= 2 err(torch 16-bit) + ABS16, with ABS16 = one rounding
of the result (2^-8 for bfloat16, 2^-11 for float16, relative to max |result|): where torch's
16-bit result happens to round exactly, ours may round the other way on a tie-close value.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import mha
from conftest import record, rel_error, torch_sdpa

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def within(got, want64, torch16, dtype, name):
    err = rel_error(got.double().numpy(), want64.numpy())
    ref = rel_error(torch16.double().numpy(), want64.numpy())
    record(f"{name} {NAME[dtype]}", err)
    assert err <= 2 * ref + UNIT[dtype], f"{name}: mha {err:.3e}, torch {NAME[dtype]} {ref:.3e}"


@st.composite
def half_case(draw):
    hq = draw(st.integers(1, 6))
    hk = draw(st.sampled_from([d for d in range(1, hq + 1) if hq % d == 0]))
    return dict(B=draw(st.integers(1, 2)), hq=hq, hk=hk, L=draw(st.integers(1, 70)), S=draw(st.integers(1, 70)),
                E=draw(st.integers(1, 72)), Ev=draw(st.integers(1, 72)), causal=draw(st.booleans()),
                mask=draw(st.sampled_from(["none", "bool", "float"])), dtype=draw(st.sampled_from(list(UNIT))),
                seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(half_case())
def test_forward_matches_torch_in_its_dtype(c):
    g = torch.Generator().manual_seed(c["seed"])
    dt = c["dtype"]
    q = torch.randn(c["B"], c["hq"], c["L"], c["E"], generator=g).to(dt)
    k = torch.randn(c["B"], c["hk"], c["S"], c["E"], generator=g).to(dt)
    v = torch.randn(c["B"], c["hk"], c["S"], c["Ev"], generator=g).to(dt)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(c["L"], c["S"], generator=g) < 0.8
        mask[:, 0] = True  # torch gives NaN for rows with no key; tested elsewhere
    elif c["mask"] == "float":
        mask = torch.randn(c["L"], c["S"], generator=g).to(dt)
    causal = c["causal"] and c["L"] <= c["S"]  # top-left causal with L > S leaves rows empty
    gqa = c["hq"] != c["hk"]
    got = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    assert got.dtype == dt
    want = torch_sdpa(q, k, v, mask, causal, enable_gqa=gqa)
    t16 = torch_sdpa(q, k, v, mask, causal, enable_gqa=gqa, dtype=dt)
    within(got, want, t16, dt, "sdpa out")


@pytest.mark.parametrize("dt", list(UNIT))
def test_weights_and_lse(dt):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 40, 32, generator=g).to(dt) for _ in range(3))
    out, lse, w = mha.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, return_weights=True)
    assert out.dtype == dt and w.dtype == dt and lse.dtype == torch.float32
    q64, k64 = q.double(), k.double()
    s = (q64 @ k64.transpose(-1, -2)) / np.sqrt(32)
    s = s.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want_w = torch.softmax(s, -1)
    assert rel_error(lse.double().numpy(), want_lse.numpy()) < 1e-5
    # Weights: float32 probabilities rounded once to dt.
    assert rel_error(w.double().numpy(), want_w.numpy()) <= UNIT[dt] + 1e-6


# Head dims (D, Dv): (40, 24) on the float32 tiles; (64, 64) on AMX tiles for bfloat16 where the
# CPU has them (P and dS rounded to bfloat16, docs/numerics.md), as torch's own kernel rounds.
@pytest.mark.parametrize("dims", [(40, 24), (64, 64)])
@pytest.mark.parametrize("dt", list(UNIT))
def test_autograd_matches_torch_in_its_dtype(dt, dims):
    g = torch.Generator().manual_seed(7)
    D, Dv = dims
    shapes = [(2, 4, 50, D), (2, 2, 60, D), (2, 2, 60, Dv)]
    base = [torch.randn(s, generator=g).to(dt) for s in shapes]
    dout = torch.randn(2, 4, 50, Dv, generator=g).to(dt)

    def grads(fn, dtype):
        xs = [b.to(dtype).detach().requires_grad_() for b in base]
        out = fn(*xs)
        out.backward(dout.to(dtype))
        return [x.grad for x in xs]

    def torch_fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    mine = grads(lambda q, k, v: mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), dt)
    want = grads(torch_fn, torch.float64)
    t16 = grads(torch_fn, dt)
    for name, a, w, t in zip(("dq", "dk", "dv"), mine, want, t16):
        assert a.dtype == dt
        within(a, w, t, dt, f"autograd {name} (D, Dv) = {dims}")


def test_numpy_float16_in_and_out():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 20, 16)).astype(np.float16)
    out = mha.scaled_dot_product_attention(q, q, q)
    assert out.dtype == np.float16
    want = torch_sdpa(q, q, q)
    t16 = torch_sdpa(q, q, q, dtype=torch.float16)
    within(torch.from_numpy(out), want, t16, torch.float16, "numpy out")


def test_dtype_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(mha.Error, match="one dtype"):
        mha.scaled_dot_product_attention(q.bfloat16(), q, q)
    with pytest.raises(mha.Error, match="float32, bfloat16 or float16"):
        mha.scaled_dot_product_attention(q.double(), q.double(), q.double())
    with pytest.raises(mha.Error, match="attn_mask"):
        mha.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), attn_mask=torch.zeros(4, 4).half())
    with pytest.raises(mha.Error, match="float32 or float16"):
        a = np.zeros((1, 2, 4, 8))
        mha.scaled_dot_product_attention(a, a, a)


@pytest.mark.parametrize("dt", list(UNIT))
def test_fully_masked_rows_are_zero(dt):
    q = torch.randn(1, 2, 3, 8).to(dt)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    out = mha.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert out.dtype == dt
    assert torch.all(out[:, :, 1] == 0)
    assert torch.isfinite(out).all()


def torch_module_pair(dt, seed, **kwargs):
    torch.manual_seed(seed)
    t16 = torch.nn.MultiheadAttention(48, 6, batch_first=True, **kwargs).to(dt).eval()
    t64 = torch.nn.MultiheadAttention(48, 6, batch_first=True, **kwargs).double().eval()
    t64.load_state_dict({k: v.double() for k, v in t16.state_dict().items()})
    return t16, t64


@pytest.mark.parametrize("dt", list(UNIT))
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("layout", [{}, {"bias": False}, {"kdim": 20, "vdim": 36}])
def test_module_from_torch_in_its_dtype(dt, padding, layout):
    t16, t64 = torch_module_pair(dt, 11, **layout)
    m = mha.MultiheadAttention.from_torch(t16)
    assert m.dtype == NAME[dt]
    g = torch.Generator().manual_seed(12)
    q = torch.randn(3, 17, 48, generator=g).to(dt)
    k = torch.randn(3, 23, layout.get("kdim", 48), generator=g).to(dt)
    v = torch.randn(3, 23, layout.get("vdim", 48), generator=g).to(dt)
    kpm = None
    if padding:
        kpm = torch.zeros(3, 23, dtype=torch.bool)
        kpm[0, 20:] = True
        kpm[2, 5:] = True
    y, w = m(q, k, v, key_padding_mask=kpm)
    assert y.dtype == dt and w.dtype == dt
    with torch.no_grad():
        y64, w64 = t64(q.double(), k.double(), v.double(), key_padding_mask=kpm)
        y16, w16 = t16(q, k, v, key_padding_mask=kpm)
    within(y, y64, y16, dt, "module out")
    within(w, w64, w16, dt, "module weights")


@pytest.mark.parametrize("dt", list(UNIT))
def test_module_step_matches_forward(dt):
    m = mha.MultiheadAttention(48, 6, batch_first=True, dtype=dt, num_kv_heads=2).eval()
    x = torch.randn(2, 12, 48).to(dt)
    full, _ = m(x, is_causal=True, need_weights=False)
    cache = m.make_cache(2)
    parts = [m.step(x[:, :7], cache)] + [m.step(x[:, t:t + 1], cache) for t in range(7, 12)]
    steps = torch.cat(parts, dim=1)
    assert steps.dtype == dt
    assert rel_error(steps.double().numpy(), full.double().numpy()) <= 2 * UNIT[dt]


def test_module_dtype_errors():
    m = mha.MultiheadAttention(16, 2, batch_first=True, dtype=torch.bfloat16)
    with pytest.raises(mha.Error, match="module's dtype is bfloat16"):
        m(torch.randn(1, 3, 16))
    with pytest.raises(mha.Error, match="float32 or float16"):  # numpy has no bfloat16
        a = np.zeros((1, 3, 16), dtype=np.float64)
        m(a)
    with pytest.raises(mha.Error, match="dtype must be"):
        mha.MultiheadAttention(16, 2, dtype=torch.float64)


@pytest.mark.parametrize("dt", list(UNIT))
def test_sixteen_bit_kv_cache(dt):
    m = mha.MultiheadAttention(48, 6, batch_first=True, num_kv_heads=2).eval()
    x = torch.randn(2, 10, 48)
    c32, c16 = m.make_cache(2), m.make_cache(2, dtype=dt)
    assert c16.dtype == NAME[dt] and c32.dtype == "float32"
    a = torch.cat([m.step(x[:, :6], c32)] + [m.step(x[:, t:t + 1], c32) for t in range(6, 10)], dim=1)
    b = torch.cat([m.step(x[:, :6], c16)] + [m.step(x[:, t:t + 1], c16) for t in range(6, 10)], dim=1)
    assert c16.nbytes * 2 == c32.nbytes
    # q, k, v and the attention output rounded once each: within 8 u16 (docs/numerics.md)
    err = rel_error(b.numpy(), a.numpy())
    record(f"kv cache {NAME[dt]} vs float32 cache", err)
    assert 0 < err <= 8 * UNIT[dt]
    with pytest.raises(mha.Error, match="dtype must be float32, bfloat16, float16, int8 or int4"):
        m.make_cache(1, dtype="int3")


@pytest.mark.parametrize("dt", ["int8", "int4", torch.int8])
def test_quantized_kv_cache(dt):
    """step() from an int8/int4 cache against a float32 cache: the sizes the format promises
    (codes + a float32 (int8) or bfloat16 (int4) scale and minimum per 32 values, 4 float32
    outlier channels per key row) and a bounded error (the C++ suite measures it per decoded
    row: docs/numerics.md)."""
    torch.manual_seed(3)
    m = mha.MultiheadAttention(128, 4, batch_first=True, num_kv_heads=2)  # head dim 32: one group
    x = torch.randn(2, 12, 128)
    cq, c32 = m.make_cache(2, dtype=dt), m.make_cache(2)
    name = "int8" if dt in ("int8", torch.int8) else "int4"
    assert cq.dtype == name
    a = torch.cat([m.step(x[:, :6], c32), m.step(x[:, 6:7], c32), m.step(x[:, 7:], c32)], dim=1)
    b = torch.cat([m.step(x[:, :6], cq), m.step(x[:, 6:7], cq), m.step(x[:, 7:], cq)], dim=1)
    bits = 8 if name == "int8" else 4
    rows = c32.nbytes // (32 * 4)  # rows of 32 values, half of them keys
    group = 8 if bits == 8 else 4  # float32 or bfloat16 scale and minimum
    assert cq.nbytes == rows * (32 * bits // 8 + group) + rows // 2 * 4 * 4  # + 4 outlier key channels
    err = rel_error(b.numpy(), a.numpy())
    record(f"kv cache {name} vs float32 cache", err)
    assert 0 < err <= (2e-2 if bits == 8 else 0.3)


def test_from_torch_keeps_sixteen_bit_and_widens_float64():
    t = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    assert mha.MultiheadAttention.from_torch(t.double()).dtype == "float32"
    assert mha.MultiheadAttention.from_torch(t.bfloat16()).dtype == "bfloat16"
    assert mha.MultiheadAttention.from_torch(t.half()).dtype == "float16"
    assert mha.MultiheadAttention.from_torch(t.half(), dtype=torch.float32).dtype == "float32"
