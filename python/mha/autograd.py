"""torch.autograd integration: mha's attention inside a torch model, trained by torch.

mha.scaled_dot_product_attention routes here when a torch input requires grad. The forward
keeps the output and its log-sum-exp (O(T) memory, no T x T matrix); the backward runs mha's
FlashAttention-2-style kernel, regenerating dropout from the saved seed. Broadcast key/value
(a batch or head dimension of 1) is expanded *outside* the Function, so torch sums the
gradient over the broadcast copies itself. A float attn_mask gets its gradient (float32, the
kernel sums it over the mask's size-1 dimensions; torch then over what was expanded), sinks get
theirs (summed over batch and rows, float32); a bool attn_mask, key_lengths and alibi_slopes
are constants.
"""
import torch

from . import _arrays as A
from . import _mha


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, keep, bias, lengths, alibi, params):
        (scale, causal, window, dropout_p, seed, num_threads, backend, want_weights, average_weights, S,
         softcap, sink_tokens) = params
        N, Hq, L, _ = q.shape
        out = torch.empty((N, Hq, L, v.shape[-1]), dtype=q.dtype)
        lse = torch.empty((N, Hq, L), dtype=torch.float32)
        weights = None
        if want_weights:
            weights = torch.empty((N, L, S) if average_weights else (N, Hq, L, S), dtype=q.dtype)
        n = A.native
        _mha.attention(n(q), n(k), n(v), n(out), keep_mask=n(keep), attn_bias=n(bias),
                       key_lengths=lengths, lse=n(lse), weights=n(weights), scale=scale, causal=causal, window=window,
                       dropout_p=dropout_p, dropout_seed=seed, num_threads=num_threads, backend=backend,
                       softcap=softcap, alibi_slopes=n(alibi), sinks=n(sinks), sink_tokens=sink_tokens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.keep, ctx.bias, ctx.lengths, ctx.params = keep, bias, lengths, params
        ctx.alibi, ctx.sinks = alibi, sinks
        ctx.mark_non_differentiable(lse)
        if weights is None:
            return out, lse
        ctx.mark_non_differentiable(weights)
        return out, lse, weights

    @staticmethod
    def backward(ctx, grad_out, *unused):
        # Grad mode is on in a backward exactly when the caller asked for create_graph=True: a
        # double backward (e.g. a gradient penalty), which this kernel does not provide. Refuse
        # it rather than return a first gradient without a graph (a silently wrong second one).
        if torch.is_grad_enabled():
            raise A.Error("mha.scaled_dot_product_attention: second-order gradients (create_graph=True) are not "
                          "supported; compute that term with torch.nn.functional.scaled_dot_product_attention")
        q, k, v, out, lse = ctx.saved_tensors
        (scale, causal, window, dropout_p, seed, num_threads, backend, _, _, _, softcap, sink_tokens) = ctx.params
        # Gradients in the inputs' dtype: for bfloat16/float16 accumulated in float32, rounded once.
        dq = torch.empty(q.shape, dtype=q.dtype)
        dk = torch.empty(k.shape, dtype=q.dtype)
        dv = torch.empty(v.shape, dtype=q.dtype)
        dsinks = None if ctx.sinks is None else torch.empty(ctx.sinks.shape, dtype=torch.float32)
        dbias = torch.empty(ctx.bias.shape, dtype=torch.float32) if ctx.needs_input_grad[5] else None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        n = A.native
        _mha.attention_backward(n(q), n(k), n(v), n(out), n(lse), n(grad_out.to(q.dtype).contiguous()),
                                n(dq), n(dk), n(dv),
                                keep_mask=n(ctx.keep), attn_bias=n(ctx.bias), key_lengths=ctx.lengths,
                                scale=scale, causal=causal, window=window, dropout_p=dropout_p, dropout_seed=seed,
                                num_threads=num_threads, backend=backend, softcap=softcap,
                                alibi_slopes=n(ctx.alibi), sinks=n(ctx.sinks), grad_sinks=n(dsinks),
                                sink_tokens=sink_tokens, grad_attn_bias=n(dbias))
        return dq, dk, dv, dsinks, None, dbias, None, None, None


def attention(p, dropout_p, seed, num_threads, backend, want_weights, average_weights):
    """(out, lse, weights) of the prepared arguments p (see functional._prepare), differentiable."""
    params = (p.scale, p.causal, p.window, float(dropout_p), seed, num_threads, backend, want_weights,
              average_weights, p.S, p.softcap, p.sink_tokens)
    results = AttentionFunction.apply(p.q, p.k, p.v, p.sinks, p.keep, p.bias, p.lengths, p.alibi, params)
    out, lse = results[0], results[1]
    weights = results[2] if want_weights else None
    return out, lse, weights
