"""mha attention inside torch autograd: gradients of mha.scaled_dot_product_attention against
torch autograd of torch's SDPA (float64) on random configurations, dropout regenerated in
the backward, and a small torch model that trains with mha's attention."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import mha
from conftest import BOUND, normal, record, rel_error, torch_sdpa, within_bound


@st.composite
def grad_case(draw):
    gqa = draw(st.booleans())
    hq = draw(st.integers(1, 4))
    hk = draw(st.sampled_from([d for d in range(1, hq + 1) if hq % d == 0])) if gqa else draw(st.sampled_from([1, hq]))
    return dict(B=draw(st.integers(1, 2)), kB=None, hq=hq, hk=hk, gqa=gqa, L=draw(st.integers(1, 24)),
                S=draw(st.integers(1, 24)), E=draw(st.integers(1, 24)), Ev=draw(st.integers(1, 24)),
                mask=draw(st.sampled_from(["none", "bool", "float"])), causal=draw(st.booleans()),
                scale=draw(st.one_of(st.none(), st.floats(0.1, 1.5))), seed=draw(st.integers(0, 2**32 - 1)))


def grads(fn, q, k, v, r):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out * r).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(grad_case())
def test_gradients_match_torch_autograd(c):
    rng = np.random.default_rng(c["seed"])
    q = torch.from_numpy(normal(rng, (c["B"], c["hq"], c["L"], c["E"])))
    k = torch.from_numpy(normal(rng, (c["B"], c["hk"], c["S"], c["E"])))
    v = torch.from_numpy(normal(rng, (c["B"], c["hk"], c["S"], c["Ev"])))
    r = torch.from_numpy(normal(rng, (c["B"], c["hq"], c["L"], c["Ev"])))
    mask = None
    if c["mask"] == "bool":
        mask = torch.from_numpy(rng.random((c["L"], c["S"])) < 0.7)
        mask[:, 0] = True  # every row sees key 0 (also under causal): no NaN rows in torch's gradients
    elif c["mask"] == "float":
        mask = torch.from_numpy(normal(rng, (c["hq"], c["L"], c["S"])))
    kw = dict(attn_mask=mask, is_causal=c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
    got = grads(lambda a, b, d: mha.scaled_dot_product_attention(a, b, d, **kw), q, k, v, r)
    want = grads(lambda a, b, d: torch_sdpa(a, b, d, mask, c["causal"], c["scale"], c["gqa"]),
                 q.double(), k.double(), v.double(), r.double())
    want32 = grads(lambda a, b, d: torch_sdpa(a, b, d, mask, c["causal"], c["scale"], c["gqa"], dtype=torch.float32),
                   q, k, v, r)
    # dq and dk are exactly 0 with one visible key: errors on the scale of all three gradients;
    # the output on the scale of the values (conftest.py).
    scale = max(float(w.abs().max()) for w in want[1:])
    for name, g, w, w32 in zip(("out", "dq", "dk", "dv"), got, want, want32):
        s = scale if name != "out" else max(float(w.abs().max()), float(v.abs().max()) if v.numel() else 0.0, 1e-30)
        err = float((g.double() - w).abs().max()) / s
        ref = float((w32.double() - w).abs().max()) / s
        record(f"autograd {name}", err)
        assert err <= 2 * ref + BOUND, f"{name}: mha error {err:.3e}, torch float32 error {ref:.3e}"


def test_broadcast_key_value_gradients_are_summed():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 5, 8, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, requires_grad=True)  # broadcast over batch and heads
    v = torch.randn(1, 1, 6, 4, requires_grad=True)
    mha.scaled_dot_product_attention(q, k, v).square().sum().backward()
    gk, gv = k.grad.clone(), v.grad.clone()
    k.grad = v.grad = None
    torch_sdpa(q, k, v).float().square().sum().backward()
    assert rel_error(gk.numpy(), k.grad.numpy()) <= BOUND and rel_error(gv.numpy(), v.grad.numpy()) <= BOUND


def test_dropout_is_regenerated_in_the_backward():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 12, 8, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 2, 12, 8)
    out, w = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.4, dropout_seed=5, return_weights=True)
    out.backward(dout)
    # dV = (dropped, rescaled P)ᵀ dO with the very mask the forward applied (returned in w).
    want_dv = w.transpose(-2, -1) @ dout
    assert rel_error(v.grad.numpy(), want_dv.numpy()) <= BOUND


def test_attn_mask_requiring_grad_is_an_error():
    q = torch.randn(1, 1, 3, 4, requires_grad=True)
    bias = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(mha.Error, match="attn_mask"):
        mha.scaled_dot_product_attention(q, q, q, attn_mask=bias)


class TinyAttentionModel(torch.nn.Module):
    """Projections in torch, attention in mha (or torch, to compare)."""

    def __init__(self, E, H, use_mha):
        super().__init__()
        self.qkv, self.out, self.H, self.use_mha = torch.nn.Linear(E, 3 * E), torch.nn.Linear(E, E), H, use_mha

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, E // self.H).permute(2, 0, 3, 1, 4)
        if self.use_mha:
            a = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = torch_sdpa(q, k, v, is_causal=True).float()
        return self.out(a.transpose(1, 2).reshape(B, T, E))


def test_a_torch_model_trains_with_mha_attention_as_with_torchs():
    torch.manual_seed(0)
    x, y = torch.randn(8, 10, 32), torch.randn(8, 10, 32)
    losses = {}
    for use_mha in (True, False):
        torch.manual_seed(1)
        model = TinyAttentionModel(32, 4, use_mha)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        trace = []
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            trace.append(loss.item())
        losses[use_mha] = trace
    assert losses[True][-1] < 0.7 * losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3)
