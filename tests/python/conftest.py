"""Shared helpers for the differential tests against PyTorch.

Bound (docs/numerics.md): the error of mha's float32 result against torch in float64, norm-wise
(max |got - want| / max |want|), must be at most twice the error of torch's own float32 result
plus 1e-5:  err(mha) <= 2 * err(torch float32) + 1e-5.  The 1e-5 is the C++ parity bound; the
2x term covers results that cancel (a gradient summing many terms of both signs is small next
to its terms, so any float32 order is far from it in relative terms, torch's too).
Rows that torch makes NaN because every key is masked are checked separately: mha gives zeros.
"""
import math

import numpy as np
import pytest
import torch

import mha

BOUND = 1e-5

# Largest errors seen, reported at the end of the session (the closing figures).
STATS = {}


def record(name, err):
    count, worst = STATS.get(name, (0, 0.0))
    STATS[name] = (count + 1, max(worst, err))


def pytest_terminal_summary(terminalreporter):
    if STATS:
        terminalreporter.write_line("mha differential tests against torch (cases, largest error):")
        for name, (count, worst) in sorted(STATS.items()):
            terminalreporter.write_line(f"  {name:<34} {count:>6} cases  max {worst:.2e}")


def within_bound(got, want64, want32, name):
    """Checks err(got) <= 2 err(want32) + BOUND against want64 and records err(got)."""
    err = rel_error(got, want64)
    ref = rel_error(want32, want64)
    record(name, err)
    assert err <= 2 * ref + BOUND, f"{name}: mha error {err:.3e}, torch float32 error {ref:.3e}"


def rel_error(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = max(np.max(np.abs(want)) if want.size else 0.0, 1e-30)
    return float(np.max(np.abs(got - want)) / scale) if want.size else 0.0


def torch_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, dtype=torch.float64):
    """torch's scaled_dot_product_attention in `dtype`: F.scaled_dot_product_attention when this
    torch has it (2.x), else torch's documented reference implementation in torch ops."""
    q, k, v = (torch.as_tensor(x).to(dtype) for x in (q, k, v))
    mask = None if attn_mask is None else torch.as_tensor(attn_mask)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    F = torch.nn.functional
    if hasattr(F, "scaled_dot_product_attention") and not (is_causal and mask is not None):
        kw = {"scale": scale}
        if enable_gqa:
            kw["enable_gqa"] = True
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kw)
        except TypeError:  # torch 2.0-2.4: no enable_gqa or scale
            pass
    return _reference(q, k, v, mask, is_causal, scale, enable_gqa)


def _reference(q, k, v, mask, is_causal, scale, enable_gqa):
    L, S = q.size(-2), k.size(-2)
    scale_factor = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    bias = torch.zeros(L, S, dtype=q.dtype)
    if is_causal:
        bias = bias.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(diagonal=0), float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            bias = bias.masked_fill(~mask, float("-inf"))
        else:
            bias = bias + mask
    if enable_gqa and q.dim() >= 3 and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    w = q @ k.transpose(-2, -1) * scale_factor + bias
    return torch.softmax(w, dim=-1) @ v


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)
