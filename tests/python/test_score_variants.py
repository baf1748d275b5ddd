"""Softcap, ALiBi and sinks against the formulas the models define, taken from the transformers
package itself (Gemma 2's softcapped eager attention, gpt-oss's eager attention with sinks,
BLOOM's ALiBi tensor and slopes), run in float64; gradients (sinks included) against torch
autograd through those formulas. Bound: conftest.within_bound (2x torch float32's error + 1e-5).
"""
import math

import numpy as np
import pytest
import torch

import mha
from conftest import within_bound

# scripts/py-env.sh installs transformers: a missing one fails here, never skips.
from transformers.models.bloom import modeling_bloom as bloom  # noqa: E402
from transformers.models.gemma2 import modeling_gemma2 as gemma2  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss  # noqa: E402


class _Module(torch.nn.Module):
    """What the eager functions read from their attention module."""

    def __init__(self, hq, hkv, head_dim, sinks=None):
        super().__init__()
        self.num_key_value_groups = hq // hkv
        self.head_dim = head_dim
        self.training = False
        if sinks is not None:
            self.sinks = sinks


def _mask(tq, tk, causal, window, dtype):
    """Additive mask (0 / -inf) for bottom-right causal alignment and an optional window."""
    i = torch.arange(tq)[:, None] + (tk - tq)
    j = torch.arange(tk)[None, :]
    keep = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        keep &= j <= i
        if window:
            keep &= j > i - window
    return torch.zeros(tq, tk, dtype=dtype).masked_fill(~keep, float("-inf"))


def _case(rng, b, hq, hkv, tq, tk, d, dtype=torch.float32):
    q = torch.tensor(rng.standard_normal((b, hq, tq, d)), dtype=dtype)
    k = torch.tensor(rng.standard_normal((b, hkv, tk, d)), dtype=dtype)
    v = torch.tensor(rng.standard_normal((b, hkv, tk, d)), dtype=dtype)
    return q, k, v


SHAPES = [  # (B, Hq, Hkv, Tq, Tk, D): GQA, MQA, decode rows, tile edges 47/48/49 and 63/64/65
    (1, 4, 2, 1, 300, 32),
    (2, 4, 4, 47, 47, 16),
    (1, 8, 2, 48, 65, 64),
    (2, 6, 1, 49, 64, 24),
    (1, 2, 2, 130, 130, 40),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 33])
def test_softcap_matches_gemma2(shape, window):
    rng = np.random.default_rng(sum(shape) + window)
    b, hq, hkv, tq, tk, d = shape
    q, k, v = _case(rng, b, hq, hkv, tq, tk, d)
    cap = 1.5  # of the order of the scores: tanh bends them
    module = _Module(hq, hkv, d)

    def eager(dtype):
        mask = _mask(tq, tk, True, window, dtype)
        out, _ = gemma2.eager_attention_forward(module, q.to(dtype), k.to(dtype), v.to(dtype), mask, scaling=d**-0.5,
                                                softcap=cap)
        return out.transpose(1, 2)

    got = mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, softcap=cap,
                                           causal_alignment="bottom-right", window=window)
    within_bound(got, eager(torch.float64), eager(torch.float32), "softcap vs Gemma 2", scale=v.abs().max().item())


@pytest.mark.parametrize("shape", SHAPES)
def test_sinks_match_gpt_oss_with_gradients(shape):
    rng = np.random.default_rng(7 + sum(shape))
    b, hq, hkv, tq, tk, d = shape
    q, k, v = _case(rng, b, hq, hkv, tq, tk, d)
    sinks = torch.tensor(rng.uniform(-2, 2, hq), dtype=torch.float32)
    dout = torch.tensor(rng.standard_normal((b, hq, tq, d)), dtype=torch.float32)

    def eager(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, sinks)]
        module = _Module(hq, hkv, d, sinks=leaves[3])
        mask = _mask(tq, tk, True, 0, dtype)[None, None]
        out, _ = gpt_oss.eager_attention_forward(module, *leaves[:3], mask, scaling=d**-0.5)
        out = out.transpose(1, 2)
        (out * dout.to(dtype)).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = mha.scaled_dot_product_attention(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3],
                                           causal_alignment="bottom-right")
    (out * dout).sum().backward()
    got = [out.detach()] + [x.grad for x in leaves]
    want64, want32 = eager(torch.float64), eager(torch.float32)
    for name, g, w64, w32 in zip(["out", "dq", "dk", "dv", "dsinks"], got, want64, want32):
        scale = v.abs().max().item() if name == "out" else None
        within_bound(g, w64, w32, f"sinks vs gpt-oss: {name}", scale=scale)


@pytest.mark.parametrize("shape", SHAPES)
def test_alibi_matches_bloom(shape):
    """BLOOM adds slope·j (the key's position) to causally masked scores: softmax-equal to mha's
    -slope·(i - j), since each row's shift slope·i cancels. Outputs and gradients must agree."""
    rng = np.random.default_rng(11 + sum(shape))
    b, hq, hkv, tq, tk, d = shape
    q, k, v = _case(rng, b, hq, hkv, tq, tk, d)
    dout = torch.tensor(rng.standard_normal((b, hq, tq, d)), dtype=torch.float32)
    slopes = bloom._get_alibi_slopes(hq, torch.device("cpu")).float()

    def eager(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        alibi = bloom.build_alibi_tensor(torch.ones(b, tk), hq, dtype).reshape(b, hq, 1, tk)
        mask = _mask(tq, tk, True, 0, dtype) + alibi
        out, _ = gemma2.eager_attention_forward(_Module(hq, hkv, d), *leaves, mask, scaling=d**-0.5)
        out = out.transpose(1, 2)
        (out * dout.to(dtype)).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = mha.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True, alibi_slopes=slopes,
                                           causal_alignment="bottom-right")
    (out * dout).sum().backward()
    got = [out.detach()] + [x.grad for x in leaves]
    want64, want32 = eager(torch.float64), eager(torch.float32)
    for name, g, w64, w32 in zip(["out", "dq", "dk", "dv"], got, want64, want32):
        scale = v.abs().max().item() if name == "out" else None
        within_bound(g, w64, w32, f"alibi vs BLOOM: {name}", scale=scale)


def test_all_three_with_softcap_gradients():
    """Softcap, ALiBi (per batch and head) and sinks together, gradients through tanh: against
    torch autograd through the same formulas written out in float64."""
    rng = np.random.default_rng(3)
    b, hq, hkv, tq, tk, d = 2, 4, 2, 20, 37, 16
    q, k, v = _case(rng, b, hq, hkv, tq, tk, d)
    sinks = torch.tensor(rng.uniform(-1, 1, hq), dtype=torch.float32)
    slopes = torch.tensor(rng.uniform(0, 0.3, (b, hq)), dtype=torch.float32)
    dout = torch.tensor(rng.standard_normal((b, hq, tq, d)), dtype=torch.float32)
    cap = 2.0

    def formula(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, sinks)]
        qq, kk, vv, ss = leaves
        kk, vv = kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1)
        s = qq @ kk.transpose(-1, -2) / math.sqrt(d)
        s = cap * torch.tanh(s / cap)
        pos = torch.arange(tq)[:, None] + (tk - tq)
        s = s - slopes.to(dtype)[:, :, None, None] * (pos - torch.arange(tk)[None, :]).abs().to(dtype)
        s = s + _mask(tq, tk, True, 0, dtype)
        logits = torch.cat([s, ss.reshape(1, hq, 1, 1).expand(b, hq, tq, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
        out = p @ vv
        (out * dout.to(dtype)).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = mha.scaled_dot_product_attention(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3],
                                           alibi_slopes=slopes, softcap=cap, causal_alignment="bottom-right")
    (out * dout).sum().backward()
    got = [out.detach()] + [x.grad for x in leaves]
    for name, g, w64, w32 in zip(["out", "dq", "dk", "dv", "dsinks"], got, formula(torch.float64),
                                 formula(torch.float32)):
        within_bound(g, w64, w32, f"all three: {name}", scale=v.abs().max().item() if name == "out" else None)


def test_numpy_inputs_and_bad_arguments():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 4, 8)).astype(np.float32) for _ in range(3))
    out = mha.scaled_dot_product_attention(q, k, v, softcap=5.0, alibi_slopes=np.full(3, 0.1, np.float32),
                                           sinks=np.zeros(3, np.float32))
    assert out.shape == (2, 3, 4, 8) and np.isfinite(out).all()
    with pytest.raises(mha.Error, match="softcap"):
        mha.scaled_dot_product_attention(q, k, v, softcap=-1.0)
    with pytest.raises(mha.Error, match=r"alibi_slopes must have shape \(3,\)"):
        mha.scaled_dot_product_attention(q, k, v, alibi_slopes=np.ones(4, np.float32))
    with pytest.raises(mha.Error, match=r"sinks must have shape \(3,\)"):
        mha.scaled_dot_product_attention(q, k, v, sinks=np.ones((2, 3), np.float32))
    with pytest.raises(mha.Error, match="not finite"):
        mha.scaled_dot_product_attention(q, k, v, sinks=np.array([0, np.inf, 0], np.float32))
    with pytest.raises(mha.Error, match="same kind"):
        mha.scaled_dot_product_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(mha.Error, match="alibi_slopes.detach"):
        mha.scaled_dot_product_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v),
                                         alibi_slopes=torch.zeros(3, requires_grad=True))
    # A fully masked row with a sink: zeros, not NaN.
    out = mha.scaled_dot_product_attention(q, k, v, key_lengths=[0, 4], is_causal=True,
                                           causal_alignment="bottom-right", sinks=np.ones(3, np.float32))
    assert (out[0] == 0).all() and np.isfinite(out).all()


# --- Inside the module: rotary embeddings, QK-norm, and the score variants ----------------------

from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gptj import modeling_gptj as gptj  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402


def _hf_rope(head_dim, dims, theta, scaling, factor=1.0, original=0):
    """transformers' inverse frequencies and attention factor for a rope_parameters dict."""
    params = {"rope_type": "default" if scaling == "none" else scaling, "rope_theta": theta}
    if scaling != "none":
        params["factor"] = factor
    if scaling == "yarn":
        params["original_max_position_embeddings"] = original
    # head_dim = the rotated dims: transformers' rope functions then rotate exactly those.
    cfg = LlamaConfig(hidden_size=dims * 2, num_attention_heads=2, head_dim=dims,
                      max_position_embeddings=4 * max(original, 16), rope_parameters=params)
    init = (llama.LlamaRotaryEmbedding.compute_default_rope_parameters if scaling == "none"
            else ROPE_INIT_FUNCTIONS[params["rope_type"]])
    inv, factor = init(cfg) if scaling == "none" else init(cfg, "cpu")
    return inv.double(), factor


def _module_reference(m, x, causal, rope, interleaved, qk_norm, dtype):
    """The module's forward written out with transformers' pieces: projections, Qwen3RMSNorm per
    head, Llama's (rotate_half) or GPT-J's (rotate_every_two) rotary embedding on the first dims,
    softcap/ALiBi/sinks as in the eager formulas above, output projection."""
    sd = {k: torch.tensor(v, dtype=dtype) for k, v in m.state_dict().items()}
    cfg = m.config
    B, T, E = x.shape
    H, Hkv, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["qk_proj_dim"] // cfg["num_heads"]
    x = x.to(dtype)
    q = (x @ sd["q_proj.weight"].T).view(B, T, H, D).transpose(1, 2)
    k = (x @ sd["k_proj.weight"].T).view(B, T, Hkv, D).transpose(1, 2)
    v = (x @ sd["v_proj.weight"].T).view(B, T, Hkv, D).transpose(1, 2)
    if qk_norm:
        for t, name in ((q, "q_norm.weight"), (k, "k_norm.weight")):
            norm = qwen3.Qwen3RMSNorm(D, eps=cfg["qk_norm_eps"]).to(dtype)
            norm.weight.data = sd[name]
            t.copy_(norm(t))
    if rope is not None:
        inv, att = rope
        dims = 2 * inv.numel()
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
        if interleaved:
            sincos = torch.cat((ang.sin(), ang.cos()), dim=1).to(dtype) * att
            sin, cos = sincos[None, :, : dims // 2], sincos[None, :, dims // 2:]
            rot = lambda t: torch.cat((gptj.apply_rotary_pos_emb(t[..., :dims].transpose(1, 2), sin, cos).transpose(1, 2),
                                       t[..., dims:]), dim=-1)  # noqa: E731
        else:
            emb = torch.cat((ang, ang), dim=-1)
            cos, sin = (emb.cos() * att).to(dtype)[None], (emb.sin() * att).to(dtype)[None]
            rot = lambda t: torch.cat((llama.apply_rotary_pos_emb(t[..., :dims], t[..., :dims], cos, sin)[0],  # noqa: E731
                                       t[..., dims:]), dim=-1)
        q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if cfg["softcap"]:
        s = cfg["softcap"] * torch.tanh(s / cfg["softcap"])
    if cfg["alibi"]:
        # BLOOM's slopes with ALiBi's own bias -slope·(i - j): BLOOM's slope·j equals it only up
        # to a shift per row, which a sink logit would see.
        slopes = bloom._get_alibi_slopes(H, torch.device("cpu")).to(dtype)
        dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs().to(dtype)
        s = s - slopes[None, :, None, None] * dist
    if causal:
        s = s + _mask(T, T, True, 0, dtype)
    if cfg["sinks"]:
        s = torch.cat([s, sd["sinks"].reshape(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :T]
    a = (p @ v).transpose(1, 2).reshape(B, T, H * D)
    return a @ sd["out_proj.weight"].T


@pytest.mark.parametrize("case", [
    dict(rotary={"dims": 16}, interleaved=False, scaling="none"),
    dict(rotary={"dims": 8, "interleaved": True}, interleaved=True, scaling="none"),
    dict(rotary={"dims": 16, "theta": 500.0, "scaling": "linear", "factor": 2.0}, interleaved=False, scaling="linear"),
    dict(rotary={"dims": 12, "scaling": "yarn", "factor": 4.0, "original_max_positions": 8}, interleaved=False,
         scaling="yarn"),
    dict(rotary=None, interleaved=False, scaling=None, qk_norm=True, softcap=3.0, alibi=True, sinks=True),
    dict(rotary={"dims": 16}, interleaved=False, scaling="none", qk_norm=True, sinks=True, softcap=5.0),
])
def test_module_matches_transformers_pieces(case):
    """Rotary (Llama half-split and GPT-J interleaved, partial dims, linear and YaRN scaling as
    transformers computes them), Qwen3's QK-norm and the score variants inside the module, causal,
    GQA 4/2, against the module written out with transformers' own functions in float64."""
    rng = np.random.default_rng(17)
    E, H, Hkv, B, T = 64, 4, 2, 2, 37
    kw = {k: case[k] for k in ("qk_norm", "softcap", "alibi", "sinks") if k in case}
    m = mha.MultiheadAttention(E, H, bias=False, batch_first=True, num_kv_heads=Hkv, rotary=case["rotary"], **kw)
    m.eval()
    sd = m.state_dict()
    if kw.get("qk_norm"):
        sd["q_norm.weight"] = rng.uniform(0.5, 1.5, 16).astype(np.float32)
        sd["k_norm.weight"] = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    if kw.get("sinks"):
        sd["sinks"] = rng.uniform(-1, 1, H).astype(np.float32)
    m.load_state_dict(sd)
    x = torch.tensor(rng.standard_normal((B, T, E)), dtype=torch.float32)
    got, _ = m(x, x, x, is_causal=True, need_weights=False, attn_mask=None)
    rope = None
    if case["rotary"]:
        r = case["rotary"]
        rope = _hf_rope(16, r["dims"], r.get("theta", 10000.0), case["scaling"], r.get("factor", 1.0),
                        r.get("original_max_positions", 0))
    want64 = _module_reference(m, x, True, rope, case["interleaved"], kw.get("qk_norm"), torch.float64)
    want32 = _module_reference(m, x, True, rope, case["interleaved"], kw.get("qk_norm"), torch.float32)
    within_bound(got.detach(), want64.detach(), want32.detach(), "module variants vs transformers")


def test_module_step_equals_forward_and_weights_round_trip():
    """Decoding token by token with rotary, QK-norm, ALiBi, sinks and softcap gives the forward's
    output (the cache holds rotated keys); the weights save and load by the models' names."""
    rng = np.random.default_rng(23)
    E, H, T = 32, 4, 11
    kw = dict(num_kv_heads=2, softcap=4.0, alibi=True, sinks=True, qk_norm=True,
              rotary={"dims": 8, "scaling": "yarn", "factor": 2.0, "original_max_positions": 4})
    m = mha.MultiheadAttention(E, H, batch_first=True, **kw)
    m.eval()
    sd = m.state_dict()
    assert {"sinks", "q_norm.weight", "k_norm.weight"} <= set(sd)
    sd["sinks"] = rng.uniform(-1, 1, H).astype(np.float32)
    sd["q_norm.weight"] = rng.uniform(0.5, 1.5, E // H).astype(np.float32)
    m.load_state_dict(sd)
    x = rng.standard_normal((2, T, E)).astype(np.float32)
    full, _ = m(x, x, x, is_causal=True, need_weights=False)
    cache = m.make_cache(2)
    rows = [m.step(x[:, :4], cache)]
    rows += [m.step(x[:, t:t + 1], cache) for t in range(4, T)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=0, atol=2e-5 * np.abs(full).max())
    m2 = mha.MultiheadAttention.from_state_dict(sd, H, batch_first=True, softcap=4.0, alibi=True,
                                                rotary=kw["rotary"])
    assert m2.config["sinks"] and m2.config["qk_norm"] and m2.config["rotary"]["scaling"] == "yarn"
    np.testing.assert_array_equal(m2(x, x, x, is_causal=True, need_weights=False)[0], full)
    with pytest.raises(mha.Error, match="rotary has no setting 'base'"):
        mha.MultiheadAttention(E, H, rotary={"base": 10})
    with pytest.raises(mha.Error, match="rotary.dims must be even"):
        mha.MultiheadAttention(E, H, rotary={"dims": 7})
    with pytest.raises(mha.Error, match="original_max_positions"):
        mha.MultiheadAttention(E, H, rotary={"dims": 8, "scaling": "yarn", "factor": 2.0})
    del sd["sinks"]
    with pytest.raises(mha.Error, match="'sinks' is missing"):
        m.load_state_dict(sd)


def test_streaming_llm_sink_tokens():
    """A window with StreamingLLM's sink tokens equals the keep mask of that visible set, in the
    functional call (forward and gradients) and in a module decoding token by token (its cache
    keeps the sinks apart from the window's ring)."""
    rng = np.random.default_rng(29)
    B, H, T, D, W, S = 2, 2, 40, 8, 6, 3
    q, k, v = (torch.tensor(rng.standard_normal((B, H, T, D)), dtype=torch.float32, requires_grad=True)
               for _ in range(3))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = (j <= i) & ((j > i - W) | (j < S))
    got = mha.scaled_dot_product_attention(q, k, v, is_causal=True, window=W, sink_tokens=S)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
    dout = torch.tensor(rng.standard_normal(got.shape), dtype=torch.float32)
    grads = torch.autograd.grad((got * dout).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * dout.double()).sum(), (q, k, v))
    assert (got - want).abs().max() < 1e-5
    for g, w in zip(grads, want_grads):
        assert (g - w).abs().max() < 1e-4 * max(1.0, w.abs().max().item())
    m = mha.MultiheadAttention(16, 2, batch_first=True, window=W, sink_tokens=S, rotary={"dims": 8})
    m.eval()
    assert m.config["sink_tokens"] == S and m.config["window"] == W
    x = rng.standard_normal((2, 25, 16)).astype(np.float32)
    full, _ = m(x, x, x, need_weights=False)
    cache = m.make_cache(2)
    rows = [m.step(x[:, :9], cache)] + [m.step(x[:, t:t + 1], cache) for t in range(9, 25)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=0, atol=2e-5 * np.abs(full).max())
    with pytest.raises(mha.Error, match="sink_tokens = 2"):
        mha.scaled_dot_product_attention(q, k, v, sink_tokens=2)
