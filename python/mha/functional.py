"""mha.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's
signature and semantics, on mha's kernels, for numpy arrays and torch tensors.

Semantics (as torch's):
  query (..., L, E), key (..., S, E), value (..., S, Ev) -> (..., L, Ev); batch dimensions
  broadcast. With enable_gqa, dimension -3 holds the heads and key/value may have fewer heads
  that divide the query's (query head h reads key head h // (Hq // Hk)).
  attn_mask: bool -> True means the key takes part; float -> added to the scaled scores.
  is_causal: query i sees keys j <= i (top-left, torch's alignment, also when L != S).
  scale: default 1/sqrt(E). dropout_p: applied to the probabilities (functional: always).
Differences, all documented in docs/semantics.md:
  a query row with no visible key returns zeros (torch returns NaN);
  is_causal and attn_mask together are allowed (both apply; torch raises);
  inputs are float32, bfloat16 (torch tensors) or float16 on the CPU, one dtype for query, key
  and value (torch also takes float64); out and weights come back in that dtype, lse in float32.
  Half types compute in float32 and round the results once; a float attn_mask is float32 or
  the query's dtype.
Extras (keyword-only): causal_alignment="bottom-right" (the last query sees the last key),
key_lengths (N,) for padded keys, window (sliding window, with is_causal), return_lse,
return_weights / average_weights, dropout_seed (reproducible dropout), num_threads, backend.
Score variants (keyword-only, FlashAttention's names; docs/semantics.md "Score variants"):
  softcap: > 0 turns scaled scores s into softcap·tanh(s / softcap) (Gemma 2); 0 is off.
  alibi_slopes: (Hq,) or batch dims + (Hq,): adds -slope·|query position - key position| (BLOOM);
    a query's position follows causal_alignment (bottom-right unless is_causal with top-left).
  sinks: (Hq,): a logit per head in every row's softmax denominator with no value (gpt-oss);
    differentiable (torch) like query, key and value.
  sink_tokens: with window, the first sink_tokens keys stay visible too (StreamingLLM).

With torch tensors that require grad (and grad mode on) the call is differentiable in query,
key and value through mha's backward kernel (mha.autograd).
"""

import math

import numpy as np

from . import _arrays as A
from . import _mha

Error = _mha.Error

_ALIGN = {"top-left": 1, "bottom-right": 2}


def _prod(shape):
    return int(np.prod(shape)) if len(shape) else 1


def _broadcast_shapes(*shapes, what):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise Error(f"scaled_dot_product_attention: batch dimensions of {what} do not broadcast: "
                    + ", ".join(str(tuple(s)) for s in shapes)) from None


def _to4(x, lead, tail):
    """x broadcast to lead + tail, then as (N,) + tail: no copy when len(lead) <= 1."""
    x = A.expand(x, tuple(lead) + tuple(tail))
    if len(lead) == 1:
        return x
    return A.reshape(x, (_prod(lead),) + tuple(tail))


class _Prepared:
    """Arguments in the extension's 4-D convention, and how to shape results back."""


def _prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, key_lengths):
    dtypes = []
    for x, n in ((query, "query"), (key, "key"), (value, "value")):
        dtypes.append(A.check_attention_dtype(x, f"scaled_dot_product_attention: {n}"))
        if x.ndim < 2:
            raise Error(f"scaled_dot_product_attention: {n} needs at least 2 dimensions (..., T, E); got shape "
                        f"{tuple(x.shape)}")
    if len(set(dtypes)) > 1:
        raise Error(f"scaled_dot_product_attention: query, key and value must have one dtype; got {dtypes[0]}, "
                    f"{dtypes[1]} and {dtypes[2]}")
    L, E = query.shape[-2:]
    S, Ek = key.shape[-2:]
    Sv, Ev = value.shape[-2:]
    if Ek != E or Sv != S:
        raise Error(f"scaled_dot_product_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                    f"{tuple(value.shape)} disagree (query and key need one E, key and value one S)")
    qb, kb, vb = tuple(query.shape[:-2]), tuple(key.shape[:-2]), tuple(value.shape[:-2])
    Hq = qb[-1] if qb else 1
    Hk = kb[-1] if kb else 1
    Hv = vb[-1] if vb else 1
    if Hq < 1 or Hk < 1:
        raise Error(f"scaled_dot_product_attention: query {tuple(query.shape)} and key {tuple(key.shape)} need at "
                    f"least one head each")
    if Hk != Hv:
        raise Error(f"scaled_dot_product_attention: key {tuple(key.shape)} and value {tuple(value.shape)} have "
                    f"different head counts")
    if enable_gqa:
        if Hq % Hk:
            raise Error(f"scaled_dot_product_attention: enable_gqa needs the query's heads ({Hq}) to be a multiple "
                        f"of the key's ({Hk}); query {tuple(query.shape)}, key {tuple(key.shape)}")
    elif Hk not in (1, Hq):
        raise Error(f"scaled_dot_product_attention: query {tuple(query.shape)} and key {tuple(key.shape)} have "
                    f"different head counts; pass enable_gqa=True for grouped-query attention")
    lead = _broadcast_shapes(qb[:-1], kb[:-1], vb[:-1], what="query, key and value")
    p = _Prepared()
    p.lead, p.Hq, p.L, p.S, p.Ev = lead, Hq, L, S, Ev
    p.dtype = dtypes[0]
    p.N = _prod(lead)
    p.query_ndim = query.ndim
    one = () if lead else (1,)  # rank-2 inputs (no batch dims) run as N = 1
    p.q = _to4(query, lead or one, (Hq, L, E))
    p.k = _to4(key, lead or one, (Hk, S, E))
    p.v = _to4(value, lead or one, (Hk, S, Ev))
    p.keep = p.bias = None
    if attn_mask is not None:
        A.check_array(attn_mask, "scaled_dot_product_attention: attn_mask")
        if A.is_torch(attn_mask) != A.is_torch(query):
            raise Error("scaled_dot_product_attention: attn_mask must be the same kind (torch/numpy) as query")
        score_rank = len(lead) + 3
        A.check_broadcasts_to(attn_mask, tuple(lead) + (Hq, L, S), "scaled_dot_product_attention: attn_mask")
        m = A.reshape(attn_mask, (1,) * (score_rank - attn_mask.ndim) + tuple(attn_mask.shape))
        if len(lead) > 1:
            m = A.reshape(A.expand(m, tuple(lead) + tuple(m.shape[len(lead):])), (p.N,) + tuple(m.shape[len(lead):]))
        elif not lead:
            m = A.reshape(m, (1,) + tuple(m.shape))
        m = A.keys_dense(m)
        if A.is_bool(m):
            p.keep = m
        elif A.is_floating(m):
            mask_dtype = A.check_attention_dtype(attn_mask, "scaled_dot_product_attention: attn_mask")
            if mask_dtype not in ("float32", p.dtype):
                raise Error(f"scaled_dot_product_attention: a float attn_mask must be float32 or the query's dtype "
                            f"({p.dtype}); got {mask_dtype}")
            # The kernels add a float32 bias: a 16-bit mask is widened (exactly) before broadcasting.
            p.bias = m if mask_dtype == "float32" else A.to_float32(m)
        else:
            raise Error(f"scaled_dot_product_attention: attn_mask must be bool (True = takes part) or float32 "
                        f"(added to the scores); got {attn_mask.dtype}")
    if not isinstance(causal_alignment, str) or causal_alignment not in _ALIGN:
        raise Error(f"scaled_dot_product_attention: causal_alignment must be 'top-left' or 'bottom-right'; got "
                    f"{causal_alignment!r}")
    p.causal = _ALIGN[causal_alignment] if is_causal else 0
    p.lengths = None
    if key_lengths is not None:
        if isinstance(key_lengths, (list, tuple)):
            key_lengths = np.array(key_lengths, dtype=object if any(
                not isinstance(x, (int, np.integer)) or isinstance(x, bool) for x in key_lengths) else None)
        lengths = np.asarray(key_lengths.cpu() if A.is_torch(key_lengths) else key_lengths)
        if lengths.shape != (p.N,):
            raise Error(f"scaled_dot_product_attention: key_lengths must have shape ({p.N},) (one per batch "
                        f"element); got {lengths.shape}")
        if not np.issubdtype(lengths.dtype, np.integer):
            raise Error(f"scaled_dot_product_attention: key_lengths must be integers; got {lengths.dtype}")
        # int64 throughout (never a narrowing cast: a wrapped length would run silently); the
        # range [0, S] is checked in C++. Unsigned values past int64 cannot be a length.
        if lengths.dtype.kind == "u" and lengths.size and lengths.max() > np.iinfo(np.int64).max:
            raise Error(f"scaled_dot_product_attention: key_lengths[{int(lengths.argmax())}] = {int(lengths.max())} "
                        f"is outside [0, S]")
        p.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    p.scale = None if scale is None else A.check_number(scale, "scaled_dot_product_attention: scale")
    return p


def _score_inputs(p, kind, softcap, alibi_slopes, sinks):
    """softcap, alibi_slopes (as (N, Hq) or (Hq,)) and sinks (Hq,) for the extension, float32."""
    name = "scaled_dot_product_attention"
    p.softcap = A.check_number(softcap, f"{name}: softcap", 0.0)
    p.alibi = p.sinks = None
    for x, n in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if x is None:
            continue
        A.check_array(x, f"{name}: {n}")
        if A.is_torch(x) != (kind == "torch"):
            raise Error(f"{name}: {n} must be the same kind (torch/numpy) as query")
        if not A.is_floating(x):
            raise Error(f"{name}: {n} must be floating point; got {x.dtype}")
    if alibi_slopes is not None:
        shape = tuple(alibi_slopes.shape)
        if shape == (p.Hq,):
            p.alibi = A.to_float32(alibi_slopes)
        elif shape == tuple(p.lead) + (p.Hq,) and p.lead:
            p.alibi = A.to_float32(A.reshape(alibi_slopes, (p.N, p.Hq)))
        else:
            raise Error(f"{name}: alibi_slopes must have shape ({p.Hq},) or batch dims + heads "
                        f"{tuple(p.lead) + (p.Hq,)}; got {shape}")
    if sinks is not None:
        if tuple(sinks.shape) != (p.Hq,):
            raise Error(f"{name}: sinks must have shape ({p.Hq},) (one per query head); got {tuple(sinks.shape)}")
        p.sinks = sinks if str(sinks.dtype).endswith("float32") else A.to_float32(sinks)
    return p


def _shape_back(p, x, tail):
    """A (N, ...) result as lead + tail (rank-2 queries: just tail)."""
    if p.query_ndim == 2:
        return A.reshape(x, tail)
    return A.reshape(x, tuple(p.lead) + tuple(tail))


def _run_forward(p, kind, dropout_p, seed, num_threads, backend, want_lse, want_weights, average_weights):
    out = A.empty(kind, (p.N, p.Hq, p.L, p.Ev), p.dtype)
    lse = A.empty(kind, (p.N, p.Hq, p.L)) if want_lse else None
    weights = None
    if want_weights:
        weights = A.empty(kind, (p.N, p.L, p.S) if average_weights else (p.N, p.Hq, p.L, p.S), p.dtype)
    _mha.attention(A.native(p.q), A.native(p.k), A.native(p.v), A.native(out), keep_mask=A.native(p.keep),
                   attn_bias=A.native(p.bias), key_lengths=p.lengths, lse=A.native(lse),
                   weights=A.native(weights), scale=p.scale,
                   causal=p.causal, window=p.window, dropout_p=float(dropout_p), dropout_seed=seed,
                   num_threads=num_threads, backend=backend, softcap=p.softcap, alibi_slopes=A.native(p.alibi),
                   sinks=A.native(p.sinks), sink_tokens=p.sink_tokens)
    return out, lse, weights


_FAST_NUMPY = ("f", "e")  # dtype.char of float32, float16 (a string test: dtype == dtype is slow)
# Once torch is seen: (torch.Tensor, its float dtypes, mask dtypes, torch.bool, is_grad_enabled, to_dlpack).
_fast_torch = None


def _fast_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, align, num_threads, backend):
    """The common call with only the checks the C++ side does not make itself: rank-4 (B, H, T, E)
    query, key and value of one kind (exactly numpy.ndarray or torch.Tensor, C-contiguous numpy),
    dtype and batch size, an optional rank-4 mask that broadcasts by size-1 dimensions (bool, or
    float32), no extras, no gradient. Decoding makes one call per layer and token, and the general
    path's Python was most of a small call's time. Returns None for any other call: the general
    path then decides, errors included."""
    global _fast_torch
    kind = type(query)
    if kind is np.ndarray:
        if (type(key) is not np.ndarray or type(value) is not np.ndarray or query.dtype.char not in _FAST_NUMPY
                or not query.dtype.isnative):  # a byte-swapped float32 is the general path's error
            return None
        # Arrays the extension reads as they are (A.native copies negative or fractional strides).
        if not (query.flags.c_contiguous and key.flags.c_contiguous and value.flags.c_contiguous):
            return None
        if attn_mask is not None and not (type(attn_mask) is np.ndarray and
                                          (attn_mask.dtype == np.bool_ or attn_mask.dtype == np.float32)):
            return None
        is_bool = attn_mask is not None and attn_mask.dtype == np.bool_
    else:
        if _fast_torch is None:
            torch = A.torch_module()
            if torch is None:
                return None
            _fast_torch = (torch.Tensor, {torch.float32, torch.bfloat16, torch.float16}, {torch.bool, torch.float32},
                           torch.bool, torch.is_grad_enabled, A.to_dlpack_of(torch))
        tensor, floats, masks, bool_, grad_enabled, _ = _fast_torch
        if kind is not tensor or type(key) is not tensor or type(value) is not tensor:
            return None  # subclasses (Parameter, tensor-likes) take the general path
        if query.dtype not in floats or not (query.is_cpu and key.is_cpu and value.is_cpu):
            return None
        if attn_mask is not None and not (type(attn_mask) is tensor and attn_mask.is_cpu and
                                          attn_mask.dtype in masks):
            return None
        if (query.requires_grad or key.requires_grad or value.requires_grad or
                (attn_mask is not None and attn_mask.requires_grad)) and grad_enabled():
            return None
        is_bool = attn_mask is not None and attn_mask.dtype is bool_
    dtype = query.dtype
    qshape, kshape, vshape = query.shape, key.shape, value.shape  # each access makes a new tuple
    if len(qshape) != 4 or len(kshape) != 4 or len(vshape) != 4 or (key.dtype is not dtype and key.dtype != dtype) or (
            value.dtype is not dtype and value.dtype != dtype):
        return None
    B, Hq, L, E = qshape
    Bk, Hk, S, Ek = kshape
    Bv, Hv, Sv, Ev = vshape
    if Bk != B or Bv != B or Hv != Hk or Sv != S or Ek != E:
        return None
    if Hk != Hq and Hk != 1 and not (enable_gqa and Hk > 0 and Hq % Hk == 0):
        return None
    if attn_mask is not None:
        if attn_mask.ndim != 4 or any(m != 1 and m != t for m, t in zip(attn_mask.shape, (B, Hq, L, S))):
            return None
        attn_mask = A.native(A.expand(A.keys_dense(attn_mask), (B, Hq, L, S)))
    if scale is not None and not (type(scale) is float and math.isfinite(scale)):
        return None
    if align is None or type(is_causal) is not bool or type(enable_gqa) is not bool or type(backend) is not str:
        return None
    if backend not in A.BACKENDS:
        return None
    if type(num_threads) is not int or not 0 <= num_threads <= _mha.MAX_THREADS:
        return None
    # Arguments by position (keyword matching costs the extension call ~0.3 µs); q, k, v and out
    # as numpy arrays, or as DLPack capsules made in C (no gradient is needed here, so no detach;
    # new_empty is ~1 µs cheaper than torch.empty).
    if kind is np.ndarray:
        out = np.empty((B, Hq, L, Ev), dtype=dtype)
        q, k, v, o = query, key, value, out
    else:
        out = query.new_empty((B, Hq, L, Ev))
        pack = _fast_torch[5]
        q, k, v, o = pack(query), pack(key), pack(value), pack(out)
    _mha.attention(q, k, v, o, attn_mask if is_bool else None, None if is_bool else attn_mask, None, None, None, scale,
                   align if is_causal else 0, 0, 0.0, 0, num_threads, backend)
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top-left", key_lengths=None, window=0,
                                 return_lse=False, return_weights=False, average_weights=False, dropout_seed=None,
                                 num_threads=0, backend="auto", softcap=0.0, alibi_slopes=None, sinks=None,
                                 sink_tokens=0):
    """See the module docstring. Returns out, or a tuple (out, [lse], [weights]) with the extras
    asked for: lse (..., Hq, L), weights (..., Hq, L, S) or averaged over heads (..., L, S)."""
    # Types before values: an array's == is an array, and its truth an error.
    if (type(dropout_p) is float and dropout_p == 0.0 and type(window) is int and window == 0
            and type(softcap) is float and softcap == 0.0 and type(sink_tokens) is int and sink_tokens == 0
            and key_lengths is None and alibi_slopes is None and sinks is None and dropout_seed is None
            and return_lse is False and return_weights is False and average_weights is False
            and type(causal_alignment) is str):
        out = _fast_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, _ALIGN.get(causal_alignment),
                         num_threads, backend)
        if out is not None:
            return out
    kind = A.kind_of(query, key, value, attn_mask)
    name = "scaled_dot_product_attention"
    dropout_p = A.check_number(dropout_p, f"{name}: dropout_p", 0.0, 1.0)
    num_threads = A.check_int(num_threads, f"{name}: num_threads", 0, _mha.MAX_THREADS)
    flags = [A.check_bool(x, f"{name}: {n}") for x, n in ((is_causal, "is_causal"), (enable_gqa, "enable_gqa"),
                                                           (return_lse, "return_lse"),
                                                           (return_weights, "return_weights"),
                                                           (average_weights, "average_weights"))]
    is_causal, enable_gqa, return_lse, return_weights, average_weights = flags
    backend = A.check_backend(backend, name)
    p = _prepare(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, key_lengths)
    p.window = A.check_int(window, f"{name}: window", 0, 2**63 - 1)
    p.sink_tokens = A.check_int(sink_tokens, f"{name}: sink_tokens", 0, 2**63 - 1)
    _score_inputs(p, kind, softcap, alibi_slopes, sinks)
    if dropout_seed is not None:
        seed = A.check_int(dropout_seed, f"{name}: dropout_seed", 0, 2**64 - 1)
    else:
        seed = A.random_seed(kind) if dropout_p > 0 else 0

    needs_grad = False
    if kind == "torch":
        torch = A.torch_module()
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (query, key, value, p.sinks, p.bias))
        if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise Error(f"{name}: mha does not compute gradients with respect to alibi_slopes; pass "
                        "alibi_slopes.detach()")
    if needs_grad:
        from . import autograd  # imports torch, which the caller already has
        out, lse, weights = autograd.attention(p, dropout_p, seed, num_threads, backend, return_weights,
                                               average_weights)
    else:
        out, lse, weights = _run_forward(p, kind, dropout_p, seed, num_threads, backend, return_lse,
                                         return_weights, average_weights)
    results = [_shape_back(p, out, (p.Hq, p.L, p.Ev))]
    if p.query_ndim == 2:
        results[0] = A.reshape(out, (p.L, p.Ev))
    if return_lse:
        results.append(A.reshape(lse, (p.L,)) if p.query_ndim == 2 else _shape_back(p, lse, (p.Hq, p.L)))
    if return_weights:
        if average_weights:
            w = A.reshape(weights, (p.L, p.S)) if p.query_ndim == 2 else _shape_back(p, weights, (p.L, p.S))
        else:
            w = A.reshape(weights, (p.L, p.S)) if p.query_ndim == 2 else _shape_back(p, weights, (p.Hq, p.L, p.S))
        results.append(w)
    return results[0] if len(results) == 1 else tuple(results)


def merge_attention(out, lse, part_out, part_lse, *, num_threads=0):
    """Merges attention over two disjoint sets of keys for the same queries into attention over
    their union, in place in (out, lse), and returns (out, lse): with l = log(e^lse + e^part_lse),
    out <- out e^(lse - l) + part_out e^(part_lse - l), lse <- l (C++ mha::merge_attention).
    out, part_out (B, H, T, Dv) and lse, part_lse (B, H, T) float32, numpy or torch, as returned by
    scaled_dot_product_attention(..., return_lse=True). A part whose row saw no key (lse -inf,
    zeros) leaves the other unchanged. No gradient: the parts are taken as constants."""
    num_threads = A.check_int(num_threads, "merge_attention: num_threads", 0, _mha.MAX_THREADS)
    for x, name in ((out, "out"), (lse, "lse"), (part_out, "part_out"), (part_lse, "part_lse")):
        A.check_array(x, f"merge_attention: {name}")
    n = A.native
    _mha.merge_attention(n(out), n(lse), n(part_out), n(part_lse), num_threads)
    return out, lse
