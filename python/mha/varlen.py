"""mha.varlen_attention: packed sequences of different lengths without padding, with
FlashAttention's flash_attn_varlen_func arguments.

    out = mha.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=True)

q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); cu_seqlens_q/k (S + 1,) int32 or
int64 offsets starting at 0. Sequence s attends only within itself, exactly as attention on it
alone; causal=True aligns bottom-right per sequence, as FlashAttention does (the last query sees
the last key). window_size=(left, 0) with causal=True keeps the left keys before each query and
itself. Differentiable for torch tensors that require grad (gradients of q, k and v).
return_attn_probs=True returns (out, softmax_lse (Hq, total_q) float32, None): mha never forms
the probabilities. softcap (> 0: Gemma 2's tanh cap) and alibi_slopes ((Hq,) or (S, Hq) float32;
no gradient) as FlashAttention takes them (docs/semantics.md, "Score variants").
"""
import numpy as np

from . import _arrays as A
from . import _mha

Error = A.Error
_NAME = "varlen_attention"


def _offsets(cu, name, kind):
    """cu_seqlens as a contiguous int64 array of the caller's kind (a copy for int32)."""
    A.check_array(cu, f"{_NAME}: {name}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise Error(f"{_NAME}: {name} must be (S + 1,) offsets; got shape {tuple(cu.shape)}")
    if A.is_torch(cu):
        torch = A.torch_module()
        if cu.dtype not in (torch.int32, torch.int64):
            raise Error(f"{_NAME}: {name} must be int32 or int64; got {cu.dtype}")
        return cu.detach().to(torch.int64).contiguous()
    if cu.dtype not in (np.int32, np.int64):
        raise Error(f"{_NAME}: {name} must be int32 or int64; got {cu.dtype}")
    return np.ascontiguousarray(cu, dtype=np.int64)


def _window(window_size, causal):
    """FlashAttention's (left, right) as mha's window (0: none)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise Error(f"{_NAME}: window_size must be a pair (left, right); got {window_size!r}")
    left, right = (A.check_int(w, f"{_NAME}: window_size", -1, 2**63 - 2) for w in window_size)
    if (left, right) == (-1, -1):
        return 0
    if not causal or right not in (-1, 0) or left < 0:
        raise Error(f"{_NAME}: mha supports window_size=(left, 0) with causal=True (left >= 0); got "
                    f"{window_size} with causal={causal}")
    return left + 1


class _VarlenFunction:
    """Built on first use (torch is imported only by callers that have it)."""
    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            torch = A.torch_module()

            class VarlenFunction(torch.autograd.Function):
                @staticmethod
                def forward(ctx, q, k, v, cu_q, cu_k, params):
                    scale, causal, window, dropout_p, seed, num_threads, softcap, alibi = params
                    out = torch.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
                    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)
                    _mha.varlen_attention(q.detach(), k.detach(), v.detach(), cu_q, cu_k, out, lse, scale=scale,
                                          causal=causal, window=window, dropout_p=dropout_p, dropout_seed=seed,
                                          num_threads=num_threads, softcap=softcap, alibi_slopes=A.native(alibi))
                    ctx.save_for_backward(q, k, v, out, lse)
                    ctx.cu, ctx.params = (cu_q, cu_k), params
                    ctx.mark_non_differentiable(lse)
                    return out, lse

                @staticmethod
                def backward(ctx, grad_out, _):
                    if torch.is_grad_enabled():
                        raise Error(f"mha.{_NAME}: second-order gradients (create_graph=True) are not supported")
                    q, k, v, out, lse = ctx.saved_tensors
                    scale, causal, window, dropout_p, seed, num_threads, softcap, alibi = ctx.params
                    dq, dk, dv = (torch.empty(x.shape, dtype=q.dtype) for x in (q, k, v))
                    if grad_out is None:
                        grad_out = torch.zeros_like(out)
                    _mha.varlen_attention_backward(q.detach(), k.detach(), v.detach(), ctx.cu[0], ctx.cu[1], out, lse,
                                                   grad_out.to(q.dtype).contiguous(), dq, dk, dv, scale=scale,
                                                   causal=causal, window=window, dropout_p=dropout_p,
                                                   dropout_seed=seed, num_threads=num_threads, softcap=softcap,
                                                   alibi_slopes=A.native(alibi))
                    return dq, dk, dv, None, None, None

            cls.cls = VarlenFunction
        return cls.cls


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_attn_probs=False, *, dropout_seed=None, num_threads=0):
    """See the module docstring. deterministic is accepted for compatibility: mha's results are
    always the same bits for the same inputs and seed, whatever the thread count."""
    kind = A.kind_of(q, k, v, cu_seqlens_q, cu_seqlens_k)
    dtypes = [A.check_attention_dtype(x, f"{_NAME}: {n}") for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if len(set(dtypes)) > 1:
        raise Error(f"{_NAME}: q, k and v must have one dtype; got {dtypes[0]}, {dtypes[1]} and {dtypes[2]}")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim != 3:
            raise Error(f"{_NAME}: {n} must be (total, heads, head_dim); got shape {tuple(x.shape)}")
    softcap = A.check_number(softcap, f"{_NAME}: softcap", 0.0)
    if alibi_slopes is not None:
        A.check_array(alibi_slopes, f"{_NAME}: alibi_slopes")
        if A.is_torch(alibi_slopes) != (kind == "torch"):
            raise Error(f"{_NAME}: alibi_slopes must be the same kind (torch/numpy) as q")
        if A.is_torch(alibi_slopes) and alibi_slopes.requires_grad and A.torch_module().is_grad_enabled():
            raise Error(f"{_NAME}: mha does not compute gradients with respect to alibi_slopes; pass "
                        "alibi_slopes.detach()")
        alibi_slopes = A.to_float32(alibi_slopes)  # A.native at each call: a DLPack capsule is used once
    dropout_p = A.check_number(dropout_p, f"{_NAME}: dropout_p", 0.0, 1.0)
    num_threads = A.check_int(num_threads, f"{_NAME}: num_threads", 0, _mha.MAX_THREADS)
    scale = None if softmax_scale is None else A.check_number(softmax_scale, f"{_NAME}: softmax_scale")
    causal = A.check_bool(causal, f"{_NAME}: causal")
    A.check_bool(deterministic, f"{_NAME}: deterministic")
    return_attn_probs = A.check_bool(return_attn_probs, f"{_NAME}: return_attn_probs")
    window = _window(window_size, causal)
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q", kind)
    cu_k = _offsets(cu_seqlens_k, "cu_seqlens_k", kind)
    for cu, m, name in ((cu_q, max_seqlen_q, "max_seqlen_q"), (cu_k, max_seqlen_k, "max_seqlen_k")):
        m = A.check_int(m, f"{_NAME}: {name}", 0, 2**63 - 1)
        longest = int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0
        if longest > m:
            rows = "row" if longest == 1 else "rows"
            raise Error(f"{_NAME}: {name} = {m} but a sequence has {longest} {rows}")
    if dropout_seed is not None:
        seed = A.check_int(dropout_seed, f"{_NAME}: dropout_seed", 0, 2**64 - 1)
    else:
        seed = A.random_seed(kind) if dropout_p > 0 else 0
    causal_code = 2 if causal else 0  # bottom-right per sequence
    params = (scale, causal_code, window, float(dropout_p), seed, num_threads, softcap, alibi_slopes)

    torch = A.torch_module() if kind == "torch" else None
    if torch is not None and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _VarlenFunction.get().apply(q, k, v, cu_q, cu_k, params)
    else:
        out = A.empty(kind, (q.shape[0], q.shape[1], v.shape[2]), dtypes[0])
        lse = A.empty(kind, (q.shape[1], q.shape[0]))
        _mha.varlen_attention(A.native(q), A.native(k), A.native(v), cu_q, cu_k, out, lse, scale=scale,
                              causal=causal_code, window=window, dropout_p=float(dropout_p), dropout_seed=seed,
                              num_threads=num_threads, softcap=softcap, alibi_slopes=A.native(alibi_slopes))
    return (out, lse, None) if return_attn_probs else out
