"""Shared helpers for the differential tests against PyTorch.

Bound (docs/numerics.md): the error of mha's float32 result against torch in float64, norm-wise
(max |got - want| / max |want|), must be at most twice the error of torch's own float32 result
plus 1e-5:  err(mha) <= 2 * err(torch float32) + 1e-5.  The 1e-5 is the C++ parity bound; the
2x term covers results that cancel (a gradient summing many terms of both signs is small next
to its terms, so any float32 order is far from it in relative terms, torch's too).
Rows that torch makes NaN because every key is masked are checked separately: mha gives zeros.
Attention outputs are measured on the scale of the values (max |v|, or max |out| if larger): an
output row is a convex combination of value rows, so its rounding error scales with them, and a
row whose terms cancel (one query, one value column) is tiny next to them — measured on its own
size, any float32 order is far from it, and mha's (exp2 polynomial, other summation order) can
exceed twice torch's there (seen: 3.6e-5 of |out| = 1.1e-3, i.e. 1.6e-8 of |v|).
"""
import numpy as np
import pytest
import torch

import mha

# The truth is torch 2.x (scripts/py-env.sh installs it): its own SDPA, autograd and
# nn.MultiheadAttention paths, not re-implementations.
assert int(torch.__version__.split(".")[0]) >= 2, f"the differential tests need torch 2.x; got {torch.__version__}"

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


def within_bound(got, want64, want32, name, scale=None):
    """Checks err(got) <= 2 err(want32) + BOUND against want64 and records err(got); errors
    relative to max |want64|, or to `scale` where that is larger (see above)."""
    err = rel_error(got, want64, scale)
    ref = rel_error(want32, want64, scale)
    record(name, err)
    assert err <= 2 * ref + BOUND, f"{name}: mha error {err:.3e}, torch float32 error {ref:.3e}"


def rel_error(got, want, scale=None):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = max(np.max(np.abs(want)) if want.size else 0.0, scale or 0.0, 1e-30)
    return float(np.max(np.abs(got - want)) / scale) if want.size else 0.0


def torch_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, dtype=torch.float64):
    """torch 2.x's own F.scaled_dot_product_attention in `dtype`. torch refuses is_causal together
    with attn_mask; that combination is given to it as one mask: the causal mask (top-left) AND a
    bool mask, or the causal mask filled with -inf plus a float mask."""
    q, k, v = (torch.as_tensor(x).to(dtype) for x in (q, k, v))
    mask = None if attn_mask is None else torch.as_tensor(attn_mask)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    if is_causal and mask is not None:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        if mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    # torch 2.15 fails (IndexError) on masks of lower rank than its (..., L, S) scores, which the
    # SDPA contract allows: give it the same mask broadcast to full rank. enable_gqa needs a head
    # dimension in torch (it indexes dim -3); without one it is moot.
    if mask is not None:
        mask = mask.expand(q.shape[:-1] + (k.size(-2),))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                            scale=scale, enable_gqa=enable_gqa and q.dim() >= 3)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)
