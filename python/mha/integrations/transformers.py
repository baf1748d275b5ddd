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
    trained with their gradient), position_bias (T5's relative bias, added to the scores as
    transformers' "sdpa" adds it: masked positions of a boolean mask stay out, a float mask adds
    to it; learned in training, its gradient comes from mha's backward), sliding_window (in the
    mask already), output_attentions (the weights are computed only when asked for).
  float32, bfloat16 and float16 tensors; gradients for training through mha's backward kernel.
What it cannot do falls back to transformers' "sdpa" (or "eager" where sdpa cannot either) with
one warning per reason: float64 tensors, a `head_mask`, tensors not on the CPU. Other keyword
arguments (the model's flags, flash attention's packed-sequence offsets, which the mask already
expresses) are ignored, as "sdpa" ignores them.
Arguments of the wrong kind (a string for a number, a flag that is not True or False, a
non-tensor) are an `mha.Error` naming the argument.
A fully masked query row (a left-padding position) gives zeros where sdpa gives NaN or a uniform
average; transformers ignores those rows' outputs either way.
"""

import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _arrays as A
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
            raise Error(f"mha: {reason}, and {type(module).__module__} has no eager_attention_forward to run "
                        "softcap or sinks instead")
        return eager(module, query, key, value, _additive_mask(attention_mask, query, key, is_causal),
                     dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


_NAME = "mha.integrations.transformers.attention_forward"


def _check_arguments(module, tensors, dropout, scaling, is_causal, kwargs):
    """What transformers passes, checked before any of it is used: an `mha.Error` naming the
    argument for a value no model passes (a module that is not one, a tensor that is not one, a
    string for a number, a flag that is not True or False), never an AttributeError from inside
    or a string's truth value ("False" is truthy). Returns (dropout, is_causal, want_weights) as a
    float and two bools, each None replaced by its default (is_causal: the module's attribute)."""
    if not isinstance(module, torch.nn.Module):
        raise Error(f"{_NAME}: module must be a torch.nn.Module; got {type(module).__name__}")
    for name, x, optional in tensors:
        if not (isinstance(x, torch.Tensor) or (optional and x is None)):
            raise Error(f"{_NAME}: {name} must be a torch tensor{' or None' if optional else ''}; "
                        f"got {type(x).__name__}")
    for name, x, _ in tensors[:3]:
        if x.dim() != 4:
            raise Error(f"{_NAME}: {name} must be (B, H, T, D); got shape {tuple(x.shape)}")
    for name, x, _ in tensors[3:5]:  # attention_mask, position_bias
        if x is not None and not 2 <= x.dim() <= 4:
            raise Error(f"{_NAME}: {name} must be (..., Tq, Tk) with at most 4 dimensions; got shape "
                        f"{tuple(x.shape)}")
    dropout = 0.0 if dropout is None else A.check_number(dropout, f"{_NAME}: dropout", 0.0, 1.0)
    if scaling is not None:
        A.check_number(scaling, f"{_NAME}: scaling")
    if is_causal is None:
        is_causal = A.check_bool(getattr(module, "is_causal", True), f"{_NAME}: module.is_causal")
    else:
        is_causal = A.check_bool(is_causal, f"{_NAME}: is_causal")
    if kwargs.get("softcap") is not None:
        A.check_number(kwargs["softcap"], f"{_NAME}: softcap", 0.0)
    want_weights = kwargs.get("output_attentions")
    want_weights = False if want_weights is None else A.check_bool(want_weights, f"{_NAME}: output_attentions")
    return dropout, is_causal, want_weights


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention-function signature on mha's kernels (see the module docstring).
    Returns (attn_output (B, Tq, Hq, Dv), attn_weights (B, Hq, Tq, Tk) or None)."""
    tensors = [("query", query, False), ("key", key, False), ("value", value, False),
               ("attention_mask", attention_mask, True), ("position_bias", position_bias, True),
               ("head_mask", kwargs.get("head_mask"), True), ("s_aux", kwargs.get("s_aux"), True)]
    dropout, is_causal, want_weights = _check_arguments(module, tensors, dropout, scaling, is_causal, kwargs)
    reason = None
    if query.dtype not in _SUPPORTED:
        reason = f"dtype {query.dtype} is not supported (float32, bfloat16, float16)"
    elif query.device.type != "cpu":
        reason = f"tensors on {query.device} are not supported (CPU only)"
    elif kwargs.get("head_mask") is not None:
        reason = "head_mask is not supported"
    if reason:
        if position_bias is not None:
            kwargs["position_bias"] = position_bias
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

    Tq, Tk = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None:
        if mask.shape[-1] > Tk:  # a static cache's mask may be wider than the keys used
            mask = mask[..., :Tk]
        if mask.dtype != torch.bool and mask.dtype != torch.float32 and mask.dtype != query.dtype:
            mask = mask.to(torch.float32)
    if position_bias is not None:  # added to the scores, as transformers' sdpa does (T5)
        if position_bias.dtype not in (torch.float32, query.dtype):
            raise Error(f"{_NAME}: position_bias must be float32 or the query's dtype ({query.dtype}); got "
                        f"{position_bias.dtype}")
        scores = (query.shape[0], query.shape[1], Tq, Tk)
        for name, x in (("attention_mask", mask), ("position_bias", position_bias)):
            if x is not None:
                A.check_broadcasts_to(x, scores, f"{_NAME}: {name}")
        # T5's bias is a permuted embedding, keys H apart: scaled_dot_product_attention copies
        # such a mask once to dense key rows (A.keys_dense).
        if mask is None:
            mask = position_bias  # with is_causal, the kernels mask the future (top-left) as sdpa does
        elif mask.dtype == torch.bool:
            mask = torch.where(mask, position_bias, float("-inf"))
        else:
            mask = position_bias + mask
    # transformers' sdpa convention: is_causal only without a mask and for more than one query
    # (a position bias alone keeps it: sdpa then masks the bias's future positions).
    causal = is_causal and attention_mask is None and Tq > 1
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    result = scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], softcap=0.0 if softcap is None else softcap, sinks=sinks,
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
