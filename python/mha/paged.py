"""mha.PagedKvCache: keys and values of many sequences in one pool of pages (vLLM's layout),
for serving: sequences are added, appended to, forked (sharing their pages, copy on write) and
freed; attend() decodes a batch of sequences of different lengths in one call. The C++ class
(include/mha/paged_kv_cache.h) documents the semantics.

    cache = mha.PagedKvCache(kv_heads=8, head_dim=128, dtype="int8")
    s = cache.add_sequence()
    cache.append(s, k, v)                  # (Hkv, n, D) float32, numpy or torch
    out = cache.attend(q, [s, t])          # q (S, Hq, n, D) -> (S, Hq, n, Dv)
"""
import numpy as np

from . import _arrays as A
from . import _mha

Error = A.Error


def _float32(x, name):
    A.check_array(x, f"PagedKvCache: {name}")
    got = A.check_attention_dtype(x, f"PagedKvCache: {name}")
    if got != "float32":
        raise Error(f"PagedKvCache: {name} must be float32 (the cache stores its own type); got {got}")
    return A.native(x)


def _id(seq, what):
    """A sequence id: an integer (the C++ side says whether it is live)."""
    return A.check_int(seq, f"PagedKvCache.{what}: seq", -2**63, 2**63 - 1)


class PagedKvCache:
    def __init__(self, kv_heads, head_dim, head_dim_v=None, *, page_size=64, pages=16, max_pages=0, window=0,
                 dtype="float32"):
        """dtype: "float32", "bfloat16", "float16", "int8" or "int4" (or torch.int8 / torch dtypes)."""
        name = "float32" if dtype is None else str(dtype).replace("torch.", "")
        dims = [A.check_int(x, f"PagedKvCache: {n}", 1, 2**31) for x, n in
                ((kv_heads, "kv_heads"), (head_dim, "head_dim"),
                 (head_dim if head_dim_v is None else head_dim_v, "head_dim_v"))]
        self._c = _mha.PagedKvCache(*dims, A.check_int(page_size, "PagedKvCache: page_size", 1, 2**31),
                                    A.check_int(pages, "PagedKvCache: pages", 1, 2**40),
                                    A.check_int(max_pages, "PagedKvCache: max_pages", 0, 2**40),
                                    A.check_int(window, "PagedKvCache: window", 0, 2**62), name)

    def add_sequence(self):
        return self._c.add_sequence()

    def fork(self, seq):
        return self._c.fork(_id(seq, "fork"))

    def free_sequence(self, seq):
        self._c.free_sequence(_id(seq, "free_sequence"))

    def append(self, seq, k, v):
        """Appends k (Hkv, n, Dk) and v (Hkv, n, Dv), float32, as the next n positions of seq."""
        self._c.append(_id(seq, "append"), _float32(k, "k"), _float32(v, "v"))

    def length(self, seq):
        return self._c.length(_id(seq, "length"))

    def first_position(self, seq):
        """0 unless a sliding window released seq's leading pages: block_table(seq) holds the
        positions first_position(seq) .. length(seq)."""
        return self._c.first_position(_id(seq, "first_position"))

    def block_table(self, seq):
        return list(self._c.block_table(_id(seq, "block_table")))

    def attend(self, q, seqs, num_threads=0):
        """One decoding step: q (S, Hq, n, Dk) float32 for the sequences seqs -> (S, Hq, n, Dv)."""
        kind = A.kind_of(q)
        qn = _float32(q, "q")
        seqs = A.check_int_list(seqs, "PagedKvCache.attend: seqs", -2**63, 2**63 - 1)
        if q.ndim != 4:
            raise Error(f"PagedKvCache.attend: q must be (S, Hq, n, Dk); got shape {tuple(q.shape)}")
        out = A.empty(kind, (q.shape[0], q.shape[1], q.shape[2], self._c.head_dim_v))
        self._c.attend(qn, seqs, out, A.check_int(num_threads, "PagedKvCache.attend: num_threads", 0,
                                                  _mha.MAX_THREADS))
        return out

    def keys_as_float(self, seq):
        """seq's stored keys (Hkv, positions kept, Dk) as a float32 numpy copy (dequantized)."""
        return self._c.keys_as_float(_id(seq, "keys_as_float"))

    def values_as_float(self, seq):
        return self._c.values_as_float(_id(seq, "values_as_float"))

    pages = property(lambda self: self._c.pages)
    free_pages = property(lambda self: self._c.free_pages)
    nbytes = property(lambda self: self._c.nbytes)
    dtype = property(lambda self: self._c.dtype)
    sequences = property(lambda self: list(self._c.sequences()))

    def references(self, page):
        """How many sequences' block tables hold page (0: a free page)."""
        return self._c.references(A.check_int(page, "PagedKvCache.references: page", -2**63, 2**63 - 1))
