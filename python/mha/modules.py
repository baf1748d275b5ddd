"""mha.MultiheadAttention: torch.nn.MultiheadAttention's constructor, forward and state_dict
names, on mha's C++ module (one packed QKV GEMM for self-attention, the fast kernel).

forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
        average_attn_weights=True, is_causal=False) -> (attn_output, attn_weights or None)
with torch's conventions: (L, N, E) unless batch_first, unbatched (L, E) inputs; bool
attn_mask True = *not* allowed to attend, float attn_mask added; attn_mask (L, S) or
(N * num_heads, L, S); key_padding_mask (N, S), bool True = padding or float added; dropout on
the weights in training mode (a new module is in training mode, as torch's; call .eval()).
Differences (docs/semantics.md): a query with every key masked gets zeros before the output
projection (torch: NaN); is_causal without attn_mask applies the analytic causal mask (top-left;
no L x S mask is built; torch raises);
add_bias_kv and add_zero_attn are not supported (an error says so).
dtype= float32 (default), bfloat16 or float16: the weights are stored in it and inputs must have
it; the module computes in float32 inside and rounds its outputs once (bfloat16 modules need
torch tensors: numpy has no bfloat16). 16-bit modules run forward and step; train in float32.
Extras: num_kv_heads (GQA), keep_mask= (nonzero = attend, BERT-style polarity), dropout_seed=,
training= (this call's mode instead of the module's), key/value optional (self-attention), step()
with a KvCache for decoding, from_torch().
Threads: every setting of a call travels with it into C++; calls from many threads may share one
module (pass training= per call rather than switching train()/eval() between threads).
"""
import numpy as np

from . import _arrays as A
from . import _mha

Error = _mha.Error
KvCache = _mha.KvCache

_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads", "h")
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype_name(dtype):
    """None (float32), a torch dtype, a numpy dtype or a name -> "float32" / "bfloat16" / "float16"."""
    if dtype is None:
        return "float32"
    name = str(dtype).replace("torch.", "")
    if name in _DTYPE_NAMES:
        return name
    if not isinstance(dtype, (np.generic, np.ndarray)) and not A.is_torch(dtype):  # a value is not a type
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError):
            pass
        if name in _DTYPE_NAMES:
            return name
    raise Error(f"MultiheadAttention: dtype must be float32, bfloat16 or float16; got {type(dtype).__name__} "
                f"{dtype!r}")


def _rotary(rotary, where):
    """rotary= as the extension takes it: None or a dict (its keys and values are checked in C++)."""
    if rotary is not None and not isinstance(rotary, dict):
        raise Error(f"{where}: rotary must be None or a dict (dims, theta, ...); got {type(rotary).__name__} "
                    f"{rotary!r}")
    return rotary


def _prefix(prefix, where):
    if not isinstance(prefix, str):
        raise Error(f"{where}: prefix must be a string; got {type(prefix).__name__} {prefix!r}")
    return prefix


def _out(kind, a):
    """A result array of the extension in the caller's kind; bfloat16 travels as uint16 bits."""
    if a is None:
        return None
    if a.dtype == np.uint16:
        return A.torch_module().from_numpy(a).view(A.torch_module().bfloat16)
    return A.from_numpy(kind, a)


def _numpy_state_dict(state_dict):
    if not hasattr(state_dict, "items"):
        raise Error(f"MultiheadAttention: state_dict must map names to tensors or arrays; got "
                    f"{type(state_dict).__name__}")
    out = {}
    for name, t in state_dict.items():
        if not isinstance(name, str):
            raise Error(f"MultiheadAttention: state_dict's names must be strings; got {type(name).__name__} {name!r}")
        if A.is_torch(t):
            t = t.detach().cpu()
            t = t.float() if t.is_floating_point() else t
            t = t.numpy()
        t = np.asarray(t)
        if not np.issubdtype(t.dtype, np.floating):
            last = name.rsplit(".", 1)[-1]
            if last.endswith("weight") or last.endswith("bias"):  # a weight's name, not a buffer's
                raise Error(f"MultiheadAttention: '{name}' has dtype {t.dtype}; weights must be floating point")
            continue  # buffers such as a causal-mask buffer of bools or ints: not weights
        out[name] = np.ascontiguousarray(t, dtype=np.float32)
    return out


def _shared_arguments(name, dropout, out_dropout, dtype, softcap, qk_norm_eps, rotary):
    """The constructor's and from_state_dict's common arguments, checked, as the extension's keywords."""
    return dict(attn_dropout=A.check_number(dropout, f"{name}: dropout", 0.0, 1.0),
                out_dropout=A.check_number(out_dropout, f"{name}: out_dropout", 0.0, 1.0),
                dtype=_dtype_name(dtype), softcap=A.check_number(softcap, f"{name}: softcap", 0.0),
                qk_norm_eps=A.check_number(qk_norm_eps, f"{name}: qk_norm_eps", 0.0), rotary=_rotary(rotary, name))


class MultiheadAttention:
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, num_kv_heads=None,
                 out_dropout=0.0, seed=0, num_threads=0, softcap=0.0, alibi=False, sinks=False, rotary=None,
                 qk_norm=False, qk_norm_eps=1e-6, window=0, sink_tokens=0):
        if add_bias_kv or add_zero_attn:
            raise Error("MultiheadAttention: add_bias_kv and add_zero_attn are not supported by mha")
        if device is not None and str(device) != "cpu":
            raise Error(f"MultiheadAttention: mha runs on the CPU; got device={device}")
        # dtype: the weights', inputs' and outputs' type (float32, bfloat16 or float16); 16-bit
        # modules compute in float32 inside and run forward and step (no autograd through them).
        # Score variants and positions (docs/semantics.md): softcap (Gemma 2), alibi (BLOOM's
        # slopes), sinks (a learnable logit per head, weight "sinks"), rotary (a dict: dims, theta,
        # interleaved, scaling "none"/"linear"/"ntk"/"yarn", factor, original_max_positions,
        # beta_fast, beta_slow), qk_norm (RMSNorm per head, weights "q_norm.weight", "k_norm.weight"),
        # window (a sliding window: causal calls only) with sink_tokens (StreamingLLM's first positions).
        # Every argument is checked here, so that a wrong type is an mha.Error naming it (never
        # nanobind's TypeError, never a string or a float taken for a number); C++ checks the values.
        n = "MultiheadAttention"
        dims = {k: A.check_int(x, f"{n}: {k}", -2**63, 2**63 - 1)
                for k, x in (("embed_dim", embed_dim), ("num_heads", num_heads), ("window", window),
                             ("sink_tokens", sink_tokens))}
        dims.update({k: 0 if x is None else A.check_int(x, f"{n}: {k}", -2**63, 2**63 - 1)  # None or 0: the default
                     for k, x in (("num_kv_heads", num_kv_heads), ("kdim", kdim), ("vdim", vdim))})
        flags = {k: A.check_bool(x, f"{n}: {k}") for k, x in (("bias", bias), ("batch_first", batch_first),
                                                                ("alibi", alibi), ("sinks", sinks),
                                                                ("qk_norm", qk_norm))}
        self._m = _mha.Module(**dims, **flags, **_shared_arguments(n, dropout, out_dropout, dtype, softcap,
                                                                   qk_norm_eps, rotary),
                              seed=A.check_int(seed, f"{n}: seed", 0, 2**64 - 1), causal=1 if dims["window"] else 0)
        self._set_call_settings(n, num_threads)

    # --- construction from PyTorch -----------------------------------------------------------

    @classmethod
    def from_state_dict(cls, state_dict, num_heads, *, causal=False, max_seq_len=0, batch_first=True, dropout=0.0,
                        out_dropout=0.0, prefix="", num_threads=0, dtype=None, softcap=0.0, alibi=False, rotary=None,
                        qk_norm_eps=1e-6, window=0, sink_tokens=0):
        """A module whose layout (widths, kv heads, bias, output projection) is read from the
        weights' names and shapes: nn.MultiheadAttention's or separate q/k/v/out Linear layers
        (the seed modules). `state_dict` maps names to torch tensors or numpy arrays; dtype is the
        module's (default float32), the weights are converted to it. Sinks and QK-norm are on when
        the weights hold "sinks" / "q_norm.weight" and "k_norm.weight"; softcap, alibi and rotary
        as in the constructor."""
        self = cls.__new__(cls)
        n = "MultiheadAttention.from_state_dict"
        ints = {k: A.check_int(x, f"{n}: {k}", -2**63, 2**63 - 1)
                for k, x in (("num_heads", num_heads), ("max_seq_len", max_seq_len), ("window", window),
                             ("sink_tokens", sink_tokens))}
        self._m = _mha.Module.from_state_dict(_numpy_state_dict(state_dict), **ints,
                                              **_shared_arguments(n, dropout, out_dropout, dtype, softcap,
                                                                  qk_norm_eps, rotary),
                                              causal=1 if A.check_bool(causal, f"{n}: causal") else 0,
                                              batch_first=A.check_bool(batch_first, f"{n}: batch_first"),
                                              prefix=_prefix(prefix, n), alibi=A.check_bool(alibi, f"{n}: alibi"))
        self._set_call_settings(n, num_threads)
        return self

    def _set_call_settings(self, name, num_threads):
        """The attributes forward and step read at each call (torch's training, and mha's threads
        and kernels), checked there as well: they may be set freely."""
        self.training = True
        self.num_threads = A.check_int(num_threads, f"{name}: num_threads", 0, _mha.MAX_THREADS)
        self.backend = "auto"

    @classmethod
    def from_torch(cls, module, num_heads=None, **kwargs):
        """The same module in mha, weights copied. nn.MultiheadAttention keeps its settings
        (batch_first, dropout, kdim/vdim, training mode); another module (such as the seeds')
        is read through from_state_dict: pass num_heads unless the module has an attribute
        for it, and causal/max_seq_len/batch_first as it behaves. The dtype follows the module's
        parameters (bfloat16 and float16 stay, anything else becomes float32) unless dtype= is given."""
        torch = A.torch_module()
        if torch is None or not isinstance(module, torch.nn.Module):
            raise Error(f"MultiheadAttention.from_torch: module must be a torch.nn.Module; got {type(module).__name__}")
        if num_heads is not None:
            num_heads = A.check_int(num_heads, "MultiheadAttention.from_torch: num_heads", 1, 2**63 - 1)
        if "dtype" not in kwargs:
            # A bfloat16/float16 module stays 16-bit; float64 weights convert to float32, as before.
            params = list(module.parameters())
            dtype = params[0].dtype if params else None
            kwargs["dtype"] = dtype if dtype in (torch.bfloat16, torch.float16) else None
        if isinstance(module, torch.nn.MultiheadAttention):
            if num_heads not in (None, module.num_heads):
                raise Error(f"MultiheadAttention.from_torch: num_heads={num_heads} but the module has "
                            f"{module.num_heads}")
            if module.bias_k is not None or module.add_zero_attn:
                raise Error("MultiheadAttention.from_torch: add_bias_kv and add_zero_attn are not supported by mha")
            self = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                       bias=module.in_proj_bias is not None, kdim=module.kdim, vdim=module.vdim,
                       batch_first=module.batch_first, **kwargs)
            self.load_state_dict(module.state_dict())
        else:
            if num_heads is None:
                for name in _HEAD_ATTRIBUTES:
                    if isinstance(getattr(module, name, None), int):
                        num_heads = getattr(module, name)
                        break
                else:
                    raise Error(f"MultiheadAttention.from_torch: cannot tell the number of heads of "
                                f"{type(module).__name__}; pass num_heads=")
            self = cls.from_state_dict(module.state_dict(), num_heads, **kwargs)
        self.training = module.training
        return self

    def load_state_dict(self, state_dict, strict=True, prefix=""):
        """Copies weights in by torch's names. strict: names that are not weights of this module
        are an error (as torch's strict loading)."""
        strict = A.check_bool(strict, "MultiheadAttention.load_state_dict: strict")
        layout, used, ignored = self._m.load_state_dict(_numpy_state_dict(state_dict),
                                                        prefix=_prefix(prefix, "MultiheadAttention.load_state_dict"))
        if strict and ignored:
            raise Error(f"MultiheadAttention.load_state_dict: unexpected keys {ignored} ({layout})")
        return layout

    def state_dict(self):
        """Weights by nn.MultiheadAttention's names (separate q/k/v/out names when those cannot
        express this module), as numpy arrays: torch.from_numpy or load_state_dict takes them."""
        return self._m.state_dict()

    # --- settings ----------------------------------------------------------------------------

    @property
    def config(self):
        return self._m.config

    embed_dim = property(lambda self: self._m.config["embed_dim"])
    num_heads = property(lambda self: self._m.config["num_heads"])
    num_kv_heads = property(lambda self: self._m.config["num_kv_heads"])
    kdim = property(lambda self: self._m.config["kdim"])
    vdim = property(lambda self: self._m.config["vdim"])
    batch_first = property(lambda self: self._m.config["batch_first"])
    dropout = property(lambda self: self._m.config["attn_dropout"])
    head_dim = property(lambda self: self._m.config["qk_proj_dim"] // self._m.config["num_heads"])
    dtype = property(lambda self: self._m.config["dtype"])

    def _check_input(self, x, name):
        got = A.check_attention_dtype(x, f"MultiheadAttention: {name}")
        if got != self.dtype:
            raise Error(f"MultiheadAttention: {name} is {got} but the module's dtype is {self.dtype} (convert the "
                        f"input, or build the module with dtype={got})")

    def _float_mask(self, m, name):
        """A float mask: float32 or the module's dtype, handed over as float32 (added to the scores)."""
        got = A.check_attention_dtype(m, f"MultiheadAttention: {name}")
        if got not in ("float32", self.dtype):
            raise Error(f"MultiheadAttention: a float {name} must be float32 or the module's dtype ({self.dtype}); "
                        f"got {got}")
        return m if got == "float32" else A.to_float32(m)

    def train(self, mode=True):
        self.training = A.check_bool(mode, "MultiheadAttention.train: mode")  # torch refuses non-bools too
        return self

    def eval(self):
        return self.train(False)

    # --- forward -----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, keep_mask=None, dropout_seed=None, training=None):
        for x, n in ((key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask"), (keep_mask, "keep_mask")):
            if x is not None:
                A.check_array(x, f"MultiheadAttention: {n}")
        kind = A.kind_of(query, key, value, key_padding_mask, attn_mask, keep_mask)
        self_attention = key is None or (key is query and value is query)
        if (key is None) != (value is None):
            raise Error("MultiheadAttention: give both key and value, or neither (self-attention)")
        self._check_input(query, "query")
        if not self_attention:
            self._check_input(key, "key")
            self._check_input(value, "value")
        if query.ndim not in (2, 3):
            raise Error(f"MultiheadAttention: query must be (L, E) unbatched, or (N, L, E) / (L, N, E) batched; got "
                        f"{tuple(query.shape)}")
        batched = query.ndim == 3
        bf = self.batch_first

        def batch(x):  # unbatched (T, E) -> the module's batched layout with N = 1
            if x is None or batched:
                return x
            return x[None] if bf else x[:, None]

        q, k, v = batch(query), batch(key), batch(value)
        N = q.shape[0 if bf else 1]
        L = q.shape[1 if bf else 0]
        S = L if self_attention else k.shape[1 if bf else 0]
        H = self.num_heads

        keep = None
        if keep_mask is not None:
            keep = keep_mask if A.is_bool(keep_mask) else keep_mask != 0
        bias = None
        kpm = None
        if attn_mask is not None:
            mask_shape = tuple(attn_mask.shape)
            if attn_mask.ndim == 3:
                if attn_mask.shape[0] != N * H:
                    raise Error(f"MultiheadAttention: a 3-D attn_mask must be (N * num_heads, L, S) = ({N * H}, {L}, "
                                f"{S}); got {mask_shape}")
                attn_mask = A.reshape(attn_mask, (N, H) + tuple(attn_mask.shape[1:]))
            elif attn_mask.ndim != 2:
                raise Error(f"MultiheadAttention: attn_mask must be (L, S) or (N * num_heads, L, S); got "
                            f"{mask_shape}")
            if mask_shape[-2:] != (L, S):
                raise Error(f"MultiheadAttention: attn_mask must be (L, S) = ({L}, {S}) or (N * num_heads, L, S) = "
                            f"({N * H}, {L}, {S}); got {mask_shape}")
            if A.is_bool(attn_mask):
                blocked_free = A.logical_not(attn_mask)  # torch: True = not allowed
                keep = blocked_free if keep is None else _and(keep, blocked_free)
            else:
                bias = self._float_mask(attn_mask, "attn_mask")
        # is_causal without attn_mask: the analytic causal mask (top-left, as torch's), with block
        # skipping and O(T) memory; with attn_mask, torch takes is_causal as a hint and so does mha.
        causal = 1 if A.check_bool(is_causal, "MultiheadAttention: is_causal") and attn_mask is None else None
        if key_padding_mask is not None:
            kp = key_padding_mask if batched else key_padding_mask[None]
            if tuple(kp.shape) != (N, S):
                raise Error(f"MultiheadAttention: key_padding_mask must be (N, S) = ({N}, {S}); got "
                            f"{tuple(key_padding_mask.shape)}")
            if A.is_bool(kp):
                kpm = kp
            else:
                kp4 = A.reshape(self._float_mask(kp, "key_padding_mask"), (N, 1, 1, S))
                bias = kp4 if bias is None else bias + kp4
        # Settings travel with the call (the C++ module holds none): threads may share a module.
        # The attributes are set freely, as torch's are: checked here, at each call.
        training = A.check_bool(self.training if training is None else training, "MultiheadAttention: training")
        backend = A.check_backend(self.backend, "MultiheadAttention")
        seed = None if dropout_seed is None else A.check_int(dropout_seed, "MultiheadAttention: dropout_seed", 0,
                                                             2**64 - 1)
        if seed is None and training and self.dropout > 0:
            seed = A.random_seed(kind)
        out, weights = self._m.forward(A.native(q), None if self_attention else A.native(k),
                                       None if self_attention else A.native(v), keep_mask=A.native(keep),
                                       attn_bias=A.native(bias), key_padding_mask=A.native(kpm),
                                       need_weights=A.check_bool(need_weights, "MultiheadAttention: need_weights"),
                                       average_weights=A.check_bool(average_attn_weights,
                                                                    "MultiheadAttention: average_attn_weights"),
                                       training=training, causal=causal, dropout_seed=seed,
                                       num_threads=self._num_threads(),
                                       backend=backend)
        if not batched:
            out = out[0] if bf else out[:, 0]
            if weights is not None:
                weights = weights[0]
        return _out(kind, out), _out(kind, weights)

    def _num_threads(self):
        """The num_threads attribute, checked (it is set freely, as torch's attributes are)."""
        return A.check_int(self.num_threads, "MultiheadAttention: num_threads", 0, _mha.MAX_THREADS)

    # --- decoding ----------------------------------------------------------------------------

    def make_cache(self, batch, capacity=0, dtype=None):
        """A KV cache for step(): this module's kv heads and head dims. dtype: how keys and values
        are stored — float32 (default), bfloat16 or float16 (torch/numpy dtypes or names): half
        the bytes, rounded once when appended, the queries rounded to it for attention; "int8" or
        "int4" (or torch.int8): quantized per group of 32 values with a scale and minimum each,
        up to 4 outlier key channels kept exactly (about 1.3 and 0.7 bytes per value at head dim
        128; docs/numerics.md has the error), float32 queries."""
        name = "float32" if dtype is None else str(dtype).replace("torch.", "")
        if name not in ("int8", "int4"):
            try:
                name = _dtype_name(dtype)
            except Error:
                raise Error("MultiheadAttention.make_cache: dtype must be float32, bfloat16, float16, int8 or "
                            f"int4; got {dtype}") from None
        return self._m.make_cache(A.check_int(batch, "MultiheadAttention.make_cache: batch", 0, 2**63 - 1),
                                  A.check_int(capacity, "MultiheadAttention.make_cache: capacity", 0, 2**63 - 1),
                                  dtype=name)

    def step(self, x, cache, new_tokens=None):
        """Incremental self-attention: x holds the newest positions (N, n, E) (or (n, N, E) when
        not batch_first); their keys and values are appended to `cache` and each attends to its
        sequence's earlier positions and itself, as a causal forward over the whole sequence
        would. new_tokens[b]: how many of the n rows of sequence b are real (default all)."""
        kind = A.kind_of(x)
        self._check_input(x, "x")
        if not isinstance(cache, KvCache):
            raise Error(f"MultiheadAttention.step: cache must be a KvCache from make_cache(); got "
                        f"{type(cache).__name__}")
        counts = ([] if new_tokens is None else
                  A.check_int_list(new_tokens, "MultiheadAttention.step: new_tokens", 0, 2**63 - 1))
        out = self._m.step(A.native(x), cache, counts, num_threads=self._num_threads())
        return _out(kind, out)


def _and(a, b):
    if A.is_torch(a) or A.is_torch(b):
        return a.bool() & b.bool()
    return np.logical_and(a, b)
