"""mha: multi-head attention in C++ with PyTorch's API.

    import mha
    out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)   # numpy or torch
    layer = mha.MultiheadAttention.from_torch(torch_layer)             # same weights, same call
    out = mha.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # packed sequences

Inputs are float32 numpy arrays or CPU torch tensors, taken without copying; results come back
as the kind given. See the docstrings of mha.functional and mha.modules, and docs/semantics.md
for masks, causal alignment, dropout and fully masked rows.
"""
from ._mha import Error, KvCache
from .functional import merge_attention, scaled_dot_product_attention
from .modules import MultiheadAttention
from .paged import PagedKvCache
from .varlen import varlen_attention

__version__ = "0.1.0"
__all__ = ["Error", "KvCache", "MultiheadAttention", "PagedKvCache", "merge_attention", "scaled_dot_product_attention",
           "varlen_attention", "__version__"]
