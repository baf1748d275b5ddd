"""mha.MultiheadAttention against torch.nn.MultiheadAttention (eval mode, same weights through
from_torch) on random configurations: widths, heads, kdim/vdim, bias, batch_first, unbatched
inputs, self and cross attention, bool/float attn_mask in 2-D and 3-D, bool/float
key_padding_mask, need_weights with and without averaging, causal. And the seed modules."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import mha
import copy

from conftest import BOUND, normal, record, rel_error, within_bound

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "parity"))
import seeds  # noqa: E402  the three articles' modules, as written


@st.composite
def mha_case(draw):
    heads = draw(st.integers(1, 4))
    E = heads * draw(st.integers(1, 8))
    cross = draw(st.booleans())
    return dict(
        E=E, heads=heads, cross=cross,
        kdim=draw(st.sampled_from([None, 5, 12])) if cross else None,
        vdim=draw(st.sampled_from([None, 7, 16])) if cross else None,
        bias=draw(st.booleans()), batch_first=draw(st.booleans()), batched=draw(st.booleans()),
        N=draw(st.integers(1, 3)), L=draw(st.integers(1, 12)), S=draw(st.integers(1, 12)),
        attn_mask=draw(st.sampled_from(["none", "bool2", "bool3", "float2", "float3", "causal"])),
        kpm=draw(st.sampled_from(["none", "bool", "float"])),
        need_weights=draw(st.booleans()), average=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)),
        torch_grad=draw(st.booleans()))


def build(c):
    torch.manual_seed(c["seed"] % 10000)
    m = torch.nn.MultiheadAttention(c["E"], c["heads"], bias=c["bias"], kdim=c["kdim"], vdim=c["vdim"],
                                    batch_first=c["batch_first"]).eval()
    with torch.no_grad():  # non-zero biases
        if m.in_proj_bias is not None:
            m.in_proj_bias.uniform_(-0.5, 0.5)
            m.out_proj.bias.uniform_(-0.5, 0.5)
    return m


def inputs(c):
    rng = np.random.default_rng(c["seed"])
    N, L, S, E = c["N"], c["L"], c["S"] if c["cross"] else c["L"], c["E"]

    def seq(T, width):
        if not c["batched"]:
            return torch.from_numpy(normal(rng, (T, width)))
        return torch.from_numpy(normal(rng, (N, T, width) if c["batch_first"] else (T, N, width)))

    q = seq(L, E)
    if c["cross"]:
        k, v = seq(S, c["kdim"] or E), seq(S, c["vdim"] or E)
    else:
        k = v = q
    n = N if c["batched"] else 1
    H = c["heads"]
    am, causal = None, False
    kind = c["attn_mask"]
    if kind == "bool2":
        am = torch.from_numpy(rng.random((L, S)) < 0.3)
    elif kind == "bool3":
        am = torch.from_numpy(rng.random((n * H, L, S)) < 0.3)
    elif kind == "float2":
        am = torch.from_numpy(normal(rng, (L, S)))
    elif kind == "float3":
        am = torch.from_numpy(normal(rng, (n * H, L, S)))
    elif kind == "causal":
        causal = True
    kpm = None
    if c["kpm"] == "bool":
        kpm = torch.from_numpy(rng.random((n, S)) < 0.3)
    elif c["kpm"] == "float":
        kpm = torch.from_numpy(normal(rng, (n, S)))
    if kpm is not None and not c["batched"]:
        kpm = kpm[0]
    return q, k, v, am, kpm, causal


def blocked_rows(c, am, kpm, causal):
    """(n, L) bool: rows whose every key is masked (torch gives NaN; mha gives zeros before out_proj)."""
    n = c["N"] if c["batched"] else 1
    L, S, H = c["L"], c["S"] if c["cross"] else c["L"], c["heads"]
    allowed = np.ones((n, H, L, S), dtype=bool)
    if am is not None and am.dtype == torch.bool:
        a = am.numpy()
        allowed &= ~(a.reshape(n, H, L, S) if a.ndim == 3 else a)
    if causal:
        allowed &= np.tril(np.ones((L, S), dtype=bool))
    if kpm is not None and kpm.dtype == torch.bool:
        allowed &= ~kpm.numpy().reshape(n, 1, 1, S)
    return ~allowed.any(-1)  # (n, H, L)


def output_terms(tm64, value):
    """The scale of an output's terms: out = W_o·a + b_o with each a a convex combination of the
    projected value rows v' (conftest.py: attention outputs on the scale of the values), so
    max_i Σ_j |W_o[i, j]|·max|v'[:, j]| + |b_o[i]|. An output whose terms cancel is tiny next to
    them (hypothesis found E = 1 and one key: 1.6e-4 from terms of 4.3e-2 and -4.3e-2), and any
    float32 order is then far from it on its own scale (mha 2.3e-5, torch 7e-8: one ulp of the
    terms apart)."""
    with torch.no_grad():
        E = tm64.embed_dim
        w_v = tm64.in_proj_weight[2 * E:] if tm64.in_proj_weight is not None else tm64.v_proj_weight
        b_v = tm64.in_proj_bias[2 * E:] if tm64.in_proj_bias is not None else 0
        top = (value @ w_v.T + b_v).abs().reshape(-1, E).amax(0)  # max |v'| per column
        terms = tm64.out_proj.weight.abs() @ top
        if tm64.out_proj.bias is not None:
            terms = terms + tm64.out_proj.bias.abs()
        return float(terms.max())


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(mha_case())
def test_matches_torch_multihead_attention(c):
    tm = build(c)
    m = mha.MultiheadAttention.from_torch(tm)
    q, k, v, am, kpm, causal = inputs(c)
    L, S, H = c["L"], (c["S"] if c["cross"] else c["L"]), c["heads"]
    n = c["N"] if c["batched"] else 1
    torch_mask, torch_kpm = am, kpm
    if causal:  # torch's is_causal is a hint that needs the mask itself
        torch_mask = ~torch.ones(L, S, dtype=torch.bool).tril()
    if kpm is not None and kpm.dtype != torch.bool:
        # A float key_padding_mask is added to the scores: give torch the sum as one float
        # attn_mask of (n * H, L, S) (torch deprecates mixing mask kinds).
        base = torch.zeros(n, H, L, S)
        if torch_mask is not None:
            tm_ = torch_mask.reshape(n, H, L, S) if torch_mask.dim() == 3 else torch_mask
            base = base.masked_fill(tm_, float("-inf")) if tm_.dtype == torch.bool else base + tm_
        base = base + kpm.reshape(n, 1, 1, S)
        torch_mask, torch_kpm = base.reshape(n * H, L, S), None
    # With grad enabled torch takes F.multi_head_attention_forward (its SDPA or math path); under
    # no_grad an eligible call (batched self-attention, batch_first, no weights, ...) takes the
    # fused inference fast path. Both are drawn.
    with torch.set_grad_enabled(c["torch_grad"]):
        want, want_w = tm(q, k, v, key_padding_mask=torch_kpm, need_weights=c["need_weights"],
                          attn_mask=torch_mask, average_attn_weights=c["average"], is_causal=causal)
    want = want.detach()
    want_w = None if want_w is None else want_w.detach()
    tm64 = copy.deepcopy(tm).double()  # the float64 truth the bound is measured from
    d = lambda t: None if t is None else (t.double() if t.dtype != torch.bool else t)  # noqa: E731
    want64, want64_w = tm64(d(q), d(k) if c["cross"] else d(q), d(v) if c["cross"] else d(q),
                            key_padding_mask=d(torch_kpm), need_weights=c["need_weights"],
                            attn_mask=d(torch_mask), average_attn_weights=c["average"])
    want64 = want64.detach()
    got, got_w = m(q, k, v, key_padding_mask=kpm, need_weights=c["need_weights"], attn_mask=am,
                   average_attn_weights=c["average"], is_causal=causal)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape
    blocked = blocked_rows(c, am, kpm, causal)  # (n, H, L)
    row_blocked = blocked.any(1)  # a row fully masked in any head differs from torch (NaN there)
    # Output rows as (n, L, E).
    def rows(x):
        x = x.numpy()
        if not c["batched"]:
            return x[None]
        return x if c["batch_first"] else x.transpose(1, 0, 2)
    g, w, w64 = rows(got), rows(want), rows(want64)
    if row_blocked.any():
        assert not np.isnan(g).any(), "mha never returns NaN for masked rows"
    within_bound(g[~row_blocked], w64[~row_blocked], w[~row_blocked], "MultiheadAttention output",
                 scale=output_terms(tm64, d(v) if c["cross"] else d(q)))
    if c["need_weights"]:
        gw, ww, ww64 = got_w.numpy(), want_w.numpy(), want64_w.detach().numpy()
        if not c["batched"]:
            gw, ww, ww64 = gw[None], ww[None], ww64[None]
        keep = ~row_blocked if c["average"] else ~blocked
        if not c["average"]:
            assert np.all(gw[blocked] == 0)
        within_bound(gw[keep], ww64[keep], ww[keep], "MultiheadAttention weights")
    else:
        assert got_w is None


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", ["none", "key_padding_mask", "causal"])
def test_matches_torch_fused_inference_fast_path(rng, need_weights, mask):
    """torch's nn.MultiheadAttention fast path (torch._native_multi_head_attention): eval, no_grad,
    batch_first, self-attention, biases (torch takes it only with them). The test checks that
    torch takes it."""
    E, H, N, L = 32, 4, 3, 11
    torch.manual_seed(7)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    m = mha.MultiheadAttention.from_torch(tm)
    x = torch.from_numpy(normal(rng, (N, L, E)))
    kw = dict(need_weights=need_weights, average_attn_weights=False)
    if mask == "key_padding_mask":
        kpm = torch.zeros(N, L, dtype=torch.bool)
        kpm[1, 7:] = True
        kw["key_padding_mask"] = kpm
    elif mask == "causal":
        kw["attn_mask"] = ~torch.ones(L, L, dtype=torch.bool).tril()
        kw["is_causal"] = True
    calls = []
    real = torch._native_multi_head_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch._native_multi_head_attention = spy
    try:
        with torch.no_grad():
            want, want_w = tm(x, x, x, **kw)
    finally:
        torch._native_multi_head_attention = real
    assert calls, "torch did not take its fast path for this call"
    with torch.no_grad():
        x64 = x.double()
        want64, want64_w = copy.deepcopy(tm).double()(x64, x64, x64, **kw)
    got, got_w = m(x, x, x, **kw)
    within_bound(got.numpy(), want64.numpy(), want.numpy(), "MultiheadAttention fast path")
    if need_weights:
        within_bound(got_w.numpy(), want64_w.numpy(), want_w.numpy(), "MultiheadAttention fast path weights")


def test_numpy_inputs_and_state_dict_round_trip(rng):
    tm = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    m = mha.MultiheadAttention.from_torch(tm)
    x = normal(rng, (2, 5, 16))
    out, w = m(x, x, x)
    assert isinstance(out, np.ndarray) and w.shape == (2, 5, 5)
    sd = m.state_dict()
    assert set(sd) == set(tm.state_dict())
    tm2 = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    tm2.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    want, _ = tm2(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x))
    assert rel_error(out, want.detach().numpy()) <= BOUND


def test_training_mode_applies_dropout_like_torch():
    m = mha.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    assert m.training  # a new module trains, as torch's
    x = torch.randn(2, 8, 16)
    a, _ = m(x, x, x, dropout_seed=1)
    b, _ = m(x, x, x, dropout_seed=1)
    c, _ = m(x, x, x, dropout_seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    m.eval()
    d, _ = m(x, x, x)
    e, _ = m(x, x, x)
    assert torch.equal(d, e)


def test_seed_modules_load_and_match():
    torch.manual_seed(0)
    x = torch.rand(2, 9, 48)
    gpt = seeds.GptMultiHeadAttention(n_embd=48, n_heads=4, block_size=9).eval()
    m = mha.MultiheadAttention.from_torch(gpt, num_heads=4, causal=True, max_seq_len=9)
    got, _ = m(x, need_weights=False)
    assert rel_error(got.numpy(), gpt(x).detach().numpy()) <= BOUND

    bert = seeds.BertMultiHeadAttention(embed_dim=32, num_heads=4).eval()
    x = torch.randn(2, 10, 32)
    mask = (torch.rand(2, 1, 10, 10) > 0.3).int()
    mask[:, :, torch.arange(10), torch.arange(10)] = 1
    want, want_w = bert(x, mask)
    m = mha.MultiheadAttention.from_torch(bert)  # num_heads read from the module
    got, got_w = m(x, keep_mask=mask, average_attn_weights=False)  # the seed's polarity: mask == 0 is blocked
    assert rel_error(got.numpy(), want.detach().numpy()) <= BOUND
    assert rel_error(got_w.numpy(), want_w.detach().numpy()) <= BOUND

    single = seeds.SelfAttention(dim_in=24, dim_k=16, dim_v=20).eval()
    x = torch.randn(3, 7, 24)
    m = mha.MultiheadAttention.from_torch(single, num_heads=1)
    got, _ = m(x, need_weights=False)
    assert rel_error(got.numpy(), single(x).detach().numpy()) <= BOUND

    multi = seeds.MultiHeadSelfAttention(dim_in=32, dim_k=48, dim_v=64, num_heads=8).eval()
    x = torch.randn(2, 9, 32)
    m = mha.MultiheadAttention.from_torch(multi)
    got, _ = m(x, need_weights=False)
    assert rel_error(got.numpy(), multi(x).detach().numpy()) <= BOUND


def test_kv_cache_steps_equal_a_causal_forward(rng):
    m = mha.MultiheadAttention(32, 4, batch_first=True, num_kv_heads=2).eval()
    x = normal(rng, (1, 7, 32))
    cache = m.make_cache(1)
    first = m.step(x[:, :4], cache)
    rest = [m.step(x[:, t:t + 1], cache) for t in range(4, 7)]
    steps = np.concatenate([first] + rest, axis=1)
    full, _ = m(x, is_causal=True, need_weights=False)
    assert cache.length(0) == 7
    np.testing.assert_allclose(steps, full, rtol=0, atol=1e-5)


def test_unsupported_options_and_bad_inputs_are_errors():
    with pytest.raises(mha.Error, match="add_bias_kv"):
        mha.MultiheadAttention(16, 2, add_bias_kv=True)
    with pytest.raises(mha.Error, match="not divisible"):
        mha.MultiheadAttention(10, 3)
    m = mha.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(mha.Error, match="float32"):
        m(x.double(), x.double(), x.double())
    with pytest.raises(mha.Error, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(mha.Error, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool))
    # A mask whose (L, S) is not the call's, bool or float, 2-D or 3-D: named as the caller's
    # attn_mask with the shapes it must have (not as the attention layer's keep mask or bias).
    k4 = torch.randn(2, 4, 16)
    for mask in (torch.zeros(5, 5, dtype=torch.bool), torch.zeros(5, 3), torch.zeros(4, 4, 4)):
        with pytest.raises(mha.Error, match=r"attn_mask must be \(L, S\) = \(5, 4\) or \(N \* num_heads, L, S\) = "
                                            r"\(4, 5, 4\); got \(" + ", ".join(map(str, mask.shape)) + r"\)"):
            m(x, k4, k4, attn_mask=mask)


@pytest.mark.parametrize("order", ["torch first", "mha first"])
def test_importing_torch_and_mha_in_either_order(order):
    """libtorch bundles its own oneDNN; mha's GEMMs must work whichever library loads first."""
    imports = "import torch, mha" if order == "torch first" else "import mha, torch"
    code = (f"{imports}\n"
            "m = mha.MultiheadAttention(64, 4, batch_first=True).eval()\n"
            "x = torch.randn(2, 33, 64)\n"
            "t = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()\n"
            "m.load_state_dict(t.state_dict())\n"
            "a, _ = m(x, x, x); b, _ = t(x, x, x)\n"
            "assert float((a - b).abs().max()) < 1e-4, float((a - b).abs().max())\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eight_threads_share_one_module_with_mixed_settings(rng):
    """Per-call settings: 8 Python threads calling one module at once, with training and
    evaluation, weights or not, causal or not, give exactly the serial results."""
    import threading

    m = mha.MultiheadAttention(48, 6, dropout=0.25, batch_first=True, num_kv_heads=3)
    xs = [torch.from_numpy(normal(rng, (2, 20 + 3 * t, 48))) for t in range(8)]

    def call(t, k):
        return m(xs[t], xs[t], xs[t], need_weights=k % 2 == 0, average_attn_weights=k % 4 == 0,
                 is_causal=k % 3 == 0, training=(t + k) % 2 == 0, dropout_seed=1000 * t + k)

    calls = 12
    serial = [[call(t, k) for k in range(calls)] for t in range(8)]
    results = [[None] * calls for _ in range(8)]
    errors = []

    def worker(t):
        try:
            for k in range(calls):
                results[t][k] = call(t, k)
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(8):
        for k in range(calls):
            (a, aw), (b, bw) = serial[t][k], results[t][k]
            assert torch.equal(a, b), (t, k)
            assert (aw is None) == (bw is None) and (aw is None or torch.equal(aw, bw)), (t, k)
    # The settings took effect: call (0, 0) trains (dropout), the same call in evaluation differs.
    evaluation, _ = m(xs[0], xs[0], xs[0], is_causal=True, training=False)
    assert not torch.equal(serial[0][0][0], evaluation)


def test_is_causal_uses_the_analytic_mask_and_matches_an_explicit_one(rng):
    m = mha.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.from_numpy(normal(rng, (2, 37, 32)))
    got, _ = m(x, x, x, is_causal=True, need_weights=False)
    explicit, _ = m(x, x, x, attn_mask=~torch.ones(37, 37, dtype=torch.bool).tril(), need_weights=False)
    assert rel_error(got.numpy(), explicit.numpy()) <= 1e-6
