"""Hugging Face transformers: `attn_implementation="mha"`.

    import mha.integrations.transformers            # registers the name "mha"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="mha")
    model.set_attn_implementation("mha")            # or switch a loaded model

Importing this module registers an attention function in transformers' `AttentionInterface`
and, with it, a mask function in `AttentionMaskInterface` (transformers builds no mask at all
for a name it does not find there: padding would be ignored silently). `register(name)` does the
same under another name.

What the attention function does with what transformers passes (per layer and call):
  query (B, Hq, Tq, D), key and value (B, Hkv, Tk, D/Dv): grouped-query heads go to mha's kernels
    as they are (no repeat_kv); the output returns as (B, Tq, Hq, Dv), as every implementation.
  attention_mask: transformers' boolean mask (B, 1, Tq, Tk) (True = attend; it carries causality,
    padding, sliding windows and cache offsets) or a float mask added to the scores; None when
    the pattern is plain causal or bidirectional without padding; then `is_causal` applies with
    top-left alignment, exactly as transformers' "sdpa" does (with a cache, transformers builds a
    mask whenever the query is shorter than the keys and longer than one token).
  scaling, dropout (the model passes 0 in eval mode), softcap (Gemma 2), s_aux (gpt-oss sinks,
    trained with their gradient), sliding_window (in the mask already), output_attentions
    (the weights are computed only when asked for).
  float32, bfloat16 and float16 tensors; gradients for training through mha's backward kernel.
What it cannot do falls back to transformers' "sdpa" (or "eager" where sdpa cannot either) with
one warning per reason: float64 tensors, `position_bias` (T5-style relative bias), a
`head_mask`, tensors not on the CPU. Other keyword arguments (the model's flags, flash
attention's packed-sequence offsets, which the mask already expresses) are ignored, as "sdpa"
ignores them.
A fully masked query row (a left-padding position) gives zeros where sdpa gives NaN or a uniform
average; transformers ignores those rows' outputs either way.
"""

import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .._mha import Error
from ..functional import scaled_dot_product_attention

__all__ = ["attention_forward", "register"]

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_warned = set()


def _additive_mask(mask, query, key, is_causal):
    """The boolean (or absent) mask of "sdpa" as the float mask "eager" adds to the scores."""
    Tq, Tk = query.shape[2], key.shape[2]
    if mask is None:
        if not is_causal or Tq == 1:
            return None
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)


def _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"mha: {reason}; this call runs transformers' own attention instead", stacklevel=3)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        # sdpa refuses both: the model's own eager formula, which wants an additive mask always.
        import importlib
        eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
        if eager is None:  # sdpa would ignore s_aux silently or refuse softcap: say why instead
            raise ValueError(f"mha: {reason}, and {type(module).__module__} has no eager_attention_forward to run "
                             "softcap or sinks instead")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return eager(module, query, key, value, _additive_mask(attention_mask, query, key, causal),
                     dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention-function signature on mha's kernels (see the module docstring).
    Returns (attn_output (B, Tq, Hq, Dv), attn_weights (B, Hq, Tq, Tk) or None)."""
    reason = None
    if position_bias is not None:
        kwargs["position_bias"] = position_bias
        reason = "position_bias (a relative position bias) is not supported"
    elif query.dtype not in _SUPPORTED:
        reason = f"dtype {query.dtype} is not supported (float32, bfloat16, float16)"
    elif query.device.type != "cpu":
        reason = f"tensors on {query.device} are not supported (CPU only)"
    elif kwargs.get("head_mask") is not None:
        reason = "head_mask is not supported"
    if reason:
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

    Tq, Tk = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is not None:
        if mask.shape[-1] > Tk:  # a static cache's mask may be wider than the keys used
            mask = mask[..., :Tk]
        if mask.dtype != torch.bool and mask.dtype != torch.float32 and mask.dtype != query.dtype:
            mask = mask.to(torch.float32)
    # transformers' sdpa convention: is_causal only without a mask and for more than one query.
    causal = bool(is_causal) and mask is None and Tq > 1
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    want_weights = bool(kwargs.get("output_attentions", False))
    result = scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=float(dropout or 0.0), is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], softcap=float(softcap) if softcap else 0.0, sinks=sinks,
        return_weights=want_weights)
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def register(name="mha"):
    """Registers mha's attention and transformers' boolean (sdpa-style) mask under `name`, so
    that `attn_implementation=name` selects them. Idempotent."""
    if not isinstance(name, str) or not name:
        raise Error(f"mha.integrations.transformers.register: name must be a non-empty string; got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()
