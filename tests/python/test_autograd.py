"""mha attention inside torch autograd: gradients of mha.scaled_dot_product_attention against
torch autograd of torch's SDPA (float64) on random configurations (a float attn_mask's
included), dropout regenerated in the backward, and a small torch model that trains with mha's
attention."""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, HealthCheck
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


def grads(fn, q, k, v, r, mask=None):
    """(out, dq, dk, dv) of sum(fn(q, k, v, mask) * r), and d mask for a float mask."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    float_mask = mask is not None and mask.is_floating_point()
    if float_mask:
        mask = mask.clone().requires_grad_(True)
    out = fn(q, k, v, mask)
    (out * r).sum().backward()
    return (out.detach(), q.grad, k.grad, v.grad) + ((mask.grad,) if float_mask else ())


def mask_grad_scale(q, k, v, dout, out, mask, is_causal, scale, gqa):
    """The largest element of the float mask's gradient P (dP - D) taken term by term in
    absolute value, P_ij (sum_d |dO_id V_jd| + sum_d |dO_id O_id|), summed over the dimensions
    the mask broadcasts along: the scale of float32's rounding of it (docs/numerics.md). Its two
    sums cancel where a row sees one key (dP = D exactly), so max(|dmask|, |D|) is no scale."""
    q, k, v, dout, out = (x.double() for x in (q, k, v, dout, out))
    S = k.size(-2)
    one_hot = torch.eye(S, dtype=torch.float64).expand(k.shape[:-1] + (S,))
    p = torch_sdpa(q, k, one_hot, mask, is_causal, scale, gqa)  # attention to one-hot values: P
    if gqa:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    terms = p * (dout.abs() @ v.abs().transpose(-1, -2) + (dout * out).abs().sum(-1, keepdim=True))
    return float(terms.sum_to_size(mask.shape).max())


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(grad_case())
# One key: dmask = dP - D = 0 from two sums of 12 terms that cancel 15,000-fold (fresh-machine
# run of 224fd42; the old scale max(|dmask|, |D|) failed it at 2.3e-4).
@example(dict(B=1, kB=None, hq=1, hk=1, gqa=False, L=1, S=1, E=12, Ev=12, mask="float", causal=False, scale=None,
              seed=15172592))
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
    kw = dict(is_causal=c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
    got = grads(lambda a, b, d, m: mha.scaled_dot_product_attention(a, b, d, attn_mask=m, **kw), q, k, v, r, mask)
    want = grads(lambda a, b, d, m: torch_sdpa(a, b, d, m, c["causal"], c["scale"], c["gqa"]),
                 q.double(), k.double(), v.double(), r.double(), None if mask is None else
                 mask if mask.dtype == torch.bool else mask.double())
    want32 = grads(lambda a, b, d, m: torch_sdpa(a, b, d, m, c["causal"], c["scale"], c["gqa"], dtype=torch.float32),
                   q, k, v, r, mask)
    # dq and dk are exactly 0 with one visible key: errors on the scale of all three gradients;
    # the output on the scale of the values (conftest.py); the mask's on that of its terms.
    scale = max(float(w.abs().max()) for w in want[1:4])
    for name, g, w, w32 in zip(("out", "dq", "dk", "dv", "dmask"), got, want, want32):
        s = scale if name != "out" else max(float(w.abs().max()), float(v.abs().max()) if v.numel() else 0.0, 1e-30)
        if name == "dmask":
            s = max(float(w.abs().max()), mask_grad_scale(q, k, v, r, want[0], mask, c["causal"], c["scale"], c["gqa"]),
                    1e-30)
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


@pytest.mark.parametrize("shape", ["full", "heads", "rows", "keys", "spaced", "lead", "only-mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_float_attn_mask_gradient_matches_torch(shape, dtype, backend):
    """A float attn_mask that requires grad gets torch's gradient, summed over the dimensions it
    broadcasts along: full (B, H, L, S), per head (H, L, S), (L, 1), (1, S), a permuted one with
    keys spaced apart (T5's), batch dimensions before the heads, and the mask as the only input
    needing grad. GQA and causal with L > S; a 16-bit mask in the 16-bit case. Against torch
    float64 autograd: within 2x torch's own error in the dtype plus BOUND (float32) or the
    dtype's unit roundoff (bfloat16, as test_half.py)."""
    g = torch.Generator().manual_seed(3)
    B, H, Hk, L, S, E = 2, 4, 2, 9, 7, 8
    lead = (3,) if shape == "lead" else ()
    q = torch.randn(lead + (B, H, L, E), generator=g)
    k, v = (torch.randn(lead + (B, Hk, S, E), generator=g) for _ in range(2))
    r = torch.randn(lead + (B, H, L, E), generator=g)
    mask = {"full": lambda: torch.randn(B, H, L, S, generator=g), "heads": lambda: torch.randn(H, L, S, generator=g),
            "rows": lambda: torch.randn(L, 1, generator=g), "keys": lambda: torch.randn(1, S, generator=g),
            "spaced": lambda: torch.randn(L, S, H, generator=g).permute(2, 0, 1),
            "lead": lambda: torch.randn(3, 1, H, 1, S, generator=g),
            "only-mask": lambda: torch.randn(H, L, S, generator=g)}[shape]()
    fixed = shape == "only-mask"  # q, k, v constants: the mask alone puts the call in autograd

    def run(fn, dt, m):
        xs = [x.detach().to(dt).requires_grad_(not fixed) for x in (q, k, v)]
        m = m.detach().to(dt if dt != torch.bfloat16 else dtype).requires_grad_(True)
        out = fn(*xs, m)
        (out.to(dt) * r.to(dt)).sum().backward()
        return [x.grad for x in xs] + [m.grad, out.detach()]

    got = run(lambda a, b, d, m: mha.scaled_dot_product_attention(a, b, d, attn_mask=m, is_causal=True, enable_gqa=True,
                                                                  backend=backend), dtype, mask)
    want = run(lambda a, b, d, m: torch_sdpa(a, b, d, m, True, None, True), torch.float64, mask)
    ref = run(lambda a, b, d, m: torch_sdpa(a, b, d, m, True, None, True, dtype=dtype), dtype, mask)
    assert got[3].shape == mask.shape and got[3].dtype == dtype
    # The mask's gradient on the scale of its terms: a per-row bias (L, 1) has none (softmax
    # ignores a row's shift), only rounding.
    dmask_scale = mask_grad_scale(q, k, v, r, want[4], mask, True, None, True)
    for name, gt, w, w32 in zip(("dq", "dk", "dv", "dmask"), got, want, ref):
        if fixed and name != "dmask":
            assert gt is None
            continue
        s = max(float(w.abs().max()), dmask_scale if name == "dmask" else 0.0, 1e-30)
        err = float((gt.double() - w).abs().max()) / s
        tol = float((w32.double() - w).abs().max()) / s
        record(f"autograd {name} of a float mask ({dtype})", err)
        floor = BOUND if dtype == torch.float32 else 2.0**-8
        assert err <= 2 * tol + floor, f"{name}: mha error {err:.3e}, torch {dtype} error {tol:.3e}"
    assert got[3].abs().sum() > 0


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
