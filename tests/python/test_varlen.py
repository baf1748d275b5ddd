"""mha.varlen_attention against torch's SDPA run on each sequence alone (float64 truth and
float32 for the bound of conftest.py), forward and gradients, with FlashAttention's arguments."""
import numpy as np
import pytest
import torch

import mha
from conftest import record, within_bound


def packed(lengths_q, lengths_k, Hq, Hkv, D, Dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(tk, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(tk, Hkv, Dv, generator=g, dtype=dtype)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def torch_alone(q, k, v, causal, left):
    """One sequence (T, H, D) through torch SDPA, bottom-right causal and an optional window."""
    Tq, Tk = q.shape[0], k.shape[0]
    G = q.shape[1] // k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1), v.repeat_interleave(G, 1).transpose(0, 1)
    mask = None
    if causal:
        i = torch.arange(Tq)[:, None] + (Tk - Tq)
        j = torch.arange(Tk)[None, :]
        mask = j <= i
        if left >= 0:
            mask &= j >= i - left
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("causal,left", [(False, -1), (True, -1), (True, 5)])
def test_forward_and_gradients_equal_each_sequence_alone(causal, left):
    lengths_q, lengths_k = [7, 1, 33, 12], [7, 40, 33, 20]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, Hq=4, Hkv=2, D=24, Dv=16)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                               window_size=(left, 0) if left >= 0 else (-1, -1))
    gout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), gout)
    q0 = k0 = 0
    for nq, nk in zip(lengths_q, lengths_k):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        results = {}
        for dt in (torch.float64, torch.float32):
            qs, ks, vs = (x.detach()[s].to(dt).requires_grad_(True) for x, s in ((q, sq), (k, sk), (v, sk)))
            o = torch_alone(qs, ks, vs, causal, left)
            grads = torch.autograd.grad(o, (qs, ks, vs), gout[sq].to(dt))
            results[dt] = (o, *grads)
        for name, got, i in (("varlen out", out[sq], 0), ("varlen dq", dq[sq], 1), ("varlen dk", dk[sk], 2),
                             ("varlen dv", dv[sk], 3)):
            within_bound(got.detach().numpy(), results[torch.float64][i].detach().numpy(),
                         results[torch.float32][i].detach().numpy(), name)
        q0, k0 = q0 + nq, k0 + nk


def test_numpy_bfloat16_lse_and_arguments():
    q, k, v, cu_q, cu_k = packed([5, 9], [5, 9], Hq=2, Hkv=2, D=8, Dv=8)
    out, lse, probs = mha.varlen_attention(q.numpy(), k.numpy(), v.numpy(), cu_q.numpy(), cu_k.numpy(), 9, 9,
                                           softmax_scale=0.3, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and lse.shape == (2, 14) and probs is None
    want = torch.nn.functional.scaled_dot_product_attention(q[5:].transpose(0, 1), k[5:].transpose(0, 1),
                                                            v[5:].transpose(0, 1), scale=0.3).transpose(0, 1)
    record("varlen numpy out", float(np.abs(out[5:] - want.numpy()).max()))
    assert np.abs(out[5:] - want.numpy()).max() < 1e-5
    ob = mha.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 9, 9)
    of = mha.varlen_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), cu_q, cu_k, 9, 9)
    assert ob.dtype == torch.bfloat16
    assert torch.equal(ob, of.bfloat16())  # float32 on the widened inputs, rounded once
    # Dropout: seeded, so the same seed gives the same bits.
    a = mha.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, dropout_p=0.3, dropout_seed=7)
    b = mha.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, dropout_p=0.3, dropout_seed=7)
    assert torch.equal(a, b)


def test_bad_arguments_are_errors():
    q, k, v, cu_q, cu_k = packed([3, 2], [4, 4], Hq=2, Hkv=1, D=8, Dv=8)
    with pytest.raises(mha.Error, match="must not decrease"):
        mha.varlen_attention(q, k, v, torch.tensor([0, 4, 3, 5]), torch.tensor([0, 4, 4, 8]), 9, 9)
    with pytest.raises(mha.Error, match=r"cu_seqlens_k\[S\] = 7"):
        mha.varlen_attention(q, k, v, cu_q, torch.tensor([0, 4, 7]), 9, 9)
    with pytest.raises(mha.Error, match="max_seqlen_q = 2 but a sequence has 3 rows"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 2, 4)
    q1, k1, v1, cu_q1, cu_k1 = packed([1], [1], Hq=2, Hkv=1, D=8, Dv=8)
    with pytest.raises(mha.Error, match="max_seqlen_k = 0 but a sequence has 1 row$"):
        mha.varlen_attention(q1, k1, v1, cu_q1, cu_k1, 1, 0)
    with pytest.raises(mha.Error, match="int32 or int64"):
        mha.varlen_attention(q, k, v, cu_q.float(), cu_k, 3, 4)
    with pytest.raises(mha.Error, match=r"window_size=\(left, 0\) with causal=True"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 3, 4, window_size=(2, 2))
    with pytest.raises(mha.Error, match="softcap must be a finite number >= 0.0; got -1.0"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 3, 4, softcap=-1.0)
    with pytest.raises(mha.Error, match=r"alibi_slopes must be \(Hq,\)"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 3, 4, alibi_slopes=torch.ones(5))
    with pytest.raises(mha.Error, match=r"q must be \(total, heads, head_dim\)"):
        mha.varlen_attention(q[0], k, v, cu_q, cu_k, 3, 4)


def test_softcap_and_alibi_per_sequence_equal_sdpa_on_each():
    """softcap and per-sequence ALiBi slopes (S, Hq): each sequence's output and gradients are
    those of scaled_dot_product_attention on it alone with its row of slopes (bit for bit: the
    same kernels on the same rows)."""
    rng = np.random.default_rng(9)
    lens_q, lens_k, hq, hkv, d = [3, 1, 6], [5, 4, 6], 4, 2, 8
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]))
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]))
    q = torch.tensor(rng.standard_normal((sum(lens_q), hq, d)), dtype=torch.float32, requires_grad=True)
    k = torch.tensor(rng.standard_normal((sum(lens_k), hkv, d)), dtype=torch.float32, requires_grad=True)
    v = torch.tensor(rng.standard_normal((sum(lens_k), hkv, d)), dtype=torch.float32, requires_grad=True)
    slopes = torch.tensor(rng.uniform(0, 0.5, (3, hq)), dtype=torch.float32)
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, 6, 6, causal=True, softcap=2.0, alibi_slopes=slopes)
    dout = torch.tensor(rng.standard_normal(out.shape), dtype=torch.float32)
    (out * dout).sum().backward()
    for s in range(3):
        qs, ks, vs = (x.detach()[c[s]:c[s + 1]].transpose(0, 1).clone().requires_grad_()
                      for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        o = mha.scaled_dot_product_attention(qs, ks, vs, is_causal=True, causal_alignment="bottom-right",
                                             enable_gqa=True, softcap=2.0, alibi_slopes=slopes[s])
        (o * dout[cu_q[s]:cu_q[s + 1]].transpose(0, 1)).sum().backward()
        assert torch.equal(o.detach().transpose(0, 1), out.detach()[cu_q[s]:cu_q[s + 1]])
        for x, xs, c in ((q, qs, cu_q), (k, ks, cu_k), (v, vs, cu_k)):
            assert torch.equal(xs.grad.transpose(0, 1), x.grad[c[s]:c[s + 1]])
