"""Array kinds: mha takes numpy arrays or torch tensors and returns the kind it was given.

Nothing here copies q, k or v: torch tensors go to the extension through DLPack (detached, so
that autograd's bookkeeping stays in Python), numpy arrays through the buffer protocol. torch
is never imported by mha itself; a tensor can only exist if the caller imported it.
"""
import sys

import numpy as np

from . import _mha

Error = _mha.Error


def torch_module():
    return sys.modules.get("torch")


def is_torch(x):
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def kind_of(*arrays):
    """'torch' or 'numpy' for the non-None arrays; mixing the two is an error."""
    kinds = {"torch" if is_torch(a) else "numpy" for a in arrays if a is not None}
    if len(kinds) > 1:
        raise Error("mha: pass either torch tensors or numpy arrays, not both")
    return kinds.pop() if kinds else "numpy"


def check_array(x, name):
    """x must be a numpy array or a torch tensor (lists and scalars are not converted silently)."""
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        raise Error(f"{name}: expected a numpy array or a torch tensor; got {type(x).__name__}")
    return x


def check_number(x, name, lo=None, hi=None):
    """A finite real number (not a bool or a string) in [lo, hi], as float."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise Error(f"{name} must be a number; got {type(x).__name__} {x!r}")
    x = float(x)
    if not np.isfinite(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
        bounds = (f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None
                  else f" <= {hi}" if hi is not None else "")
        raise Error(f"{name} must be a finite number{bounds}; got {x}")
    return x


def check_int(x, name, lo, hi):
    """An integer (not a bool, a float or a string) in [lo, hi], as int."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise Error(f"{name} must be an integer; got {type(x).__name__} {x!r}")
    x = int(x)
    if not lo <= x <= hi:
        raise Error(f"{name} must be in [{lo}, {hi}]; got {x}")
    return x


def check_bool(x, name):
    """A flag: True or False (numpy's too, or the integer 0 or 1), as bool. A string, None or a
    tensor is an error, not its truth value ("False" is truthy)."""
    if x is True or x is False:
        return x
    if isinstance(x, (np.bool_, int, np.integer)) and x in (0, 1):
        return bool(x)
    raise Error(f"{name} must be True or False; got {type(x).__name__} {x!r}")


BACKENDS = ("auto", "reference", "fast")


def check_backend(x, name):
    """Which kernels run: "auto" (the fast ones where they apply), "reference" or "fast"."""
    if type(x) is not str or x not in BACKENDS:
        raise Error(f"{name}: backend must be 'auto', 'reference' or 'fast'; got {x!r}")
    return x


def check_int_list(x, name, lo, hi):
    """A sequence of integers in [lo, hi] (a list, a tuple, any iterable but a string, or a 1-d
    numpy array or torch tensor), as a list of int."""
    if isinstance(x, np.ndarray) or is_torch(x):
        if x.ndim != 1:
            raise Error(f"{name} must be a sequence of integers; got an array of shape {tuple(x.shape)}")
        x = x.tolist()
    elif isinstance(x, (str, bytes, dict)) or not hasattr(x, "__iter__"):
        raise Error(f"{name} must be a sequence of integers; got {type(x).__name__} {x!r}")
    return [check_int(v, name, lo, hi) for v in x]


def check_attention_dtype(x, name):
    """float32, bfloat16 (torch) or float16 on the CPU: the element types attention computes with
    (float32 arithmetic, results rounded once to the input's type). Returns the dtype's name."""
    if is_torch(x):
        torch = torch_module()
        if x.device.type != "cpu":
            raise Error(f"{name}: mha runs on the CPU; got a tensor on {x.device}")
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if x.dtype not in names:
            raise Error(f"{name}: mha takes float32, bfloat16 or float16; got {x.dtype} {tuple(x.shape)}")
        return names[x.dtype]
    if not isinstance(x, np.ndarray):
        raise Error(f"{name}: expected a numpy array or a torch tensor; got {type(x).__name__}")
    if x.dtype not in (np.float32, np.float16):
        raise Error(f"{name}: mha takes float32 or float16 numpy arrays (bfloat16 through torch); got {x.dtype} "
                    f"{x.shape}")
    return str(x.dtype)


def check_broadcasts_to(x, scores, name):
    """x (a mask or bias) broadcasts to the scores' shape: no more dimensions, and each of its
    dimensions, aligned from the last, equal to the scores' or 1. Else an Error naming x, its
    shape as given and the first dimension that does not fit."""
    shape = tuple(x.shape)
    if len(shape) > len(scores):
        raise Error(f"{name} {shape} has more dimensions than the scores {scores}")
    for i, have in enumerate(shape):
        want = scores[len(scores) - len(shape) + i]
        if have != want and have != 1:
            raise Error(f"{name} {shape} does not broadcast to the scores {scores}: dimension {i} is {have}, "
                        f"expected {want if want == 1 else f'{want} or 1'}")


def to_float32(x):
    """A float32 copy of a 16-bit floating array (attention biases are float32 for every dtype)."""
    if is_torch(x):
        return x.float()
    return x.astype(np.float32)


_dlpack = None


def to_dlpack_of(torch):
    """torch.utils.dlpack.to_dlpack: a tensor as a DLPack capsule, made in C."""
    global _dlpack
    if _dlpack is None:
        import torch.utils.dlpack  # noqa: F401  (torch is imported already: a tensor exists)
        _dlpack = torch.utils.dlpack.to_dlpack
    return _dlpack


def native(x):
    """What the extension receives, for one call: a DLPack capsule of the detached tensor (a capsule
    is consumed by the call it is passed to) or a numpy array with non-negative strides."""
    if x is None:
        return None
    if is_torch(x):
        if x.requires_grad:
            x = x.detach()
        torch = torch_module()
        # A DLPack capsule made in C: Tensor.__dlpack__ is Python code (~3.4 µs a tensor on the
        # project machine, against 0.3 µs), a quarter of a small call's cost. The capsule owns a
        # reference to the tensor until the extension is done with it.
        to_dlpack = to_dlpack_of(torch)
        if x.dtype == torch.bool:
            try:
                return to_dlpack(x)
            except (RuntimeError, TypeError, BufferError):
                # Older torch cannot export bool: a byte copy (full size for a broadcast mask).
                x = x.to(torch.uint8)
        return to_dlpack(x)
    if x.flags.c_contiguous and x.dtype.isnative:  # the common case, without looking at strides
        return x
    if any(s < 0 or s % x.itemsize for s in x.strides) or not x.dtype.isnative:
        # Negative strides, or byte strides that are not whole elements (views into packed bytes):
        # the extension counts strides in elements, so such an array travels as a copy.
        return np.ascontiguousarray(x)
    return x


def empty(kind, shape, dtype="float32"):
    """An uninitialised array of the caller's kind; dtype "float32", "bfloat16" (torch) or "float16"."""
    if kind == "torch":
        torch = torch_module()
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype))
    return np.empty(tuple(shape), dtype=np.dtype(dtype))


def from_numpy(kind, a):
    """A result of the extension (numpy) in the caller's kind, without a copy."""
    if a is None or kind == "numpy":
        return a
    return torch_module().from_numpy(a)


def is_bool(x):
    if is_torch(x):
        return x.dtype == torch_module().bool
    return x.dtype == np.bool_


def is_floating(x):
    if is_torch(x):
        return x.dtype.is_floating_point
    return np.issubdtype(x.dtype, np.floating)


def expand(x, shape):
    """Broadcast x to shape without copying (stride 0)."""
    if is_torch(x):
        return x.expand(*shape)
    return np.broadcast_to(x, tuple(shape))


def keys_dense(x):
    """x, or a copy of it whose last (key) dimension is dense, for a mask whose keys are spaced
    apart (a transposed mask, or T5's position bias, a permuted embedding with keys H apart). The
    kernels read a mask row key by key, so spaced keys cost a cache line each, re-read once per
    head. Broadcast (stride-0) dimensions stay broadcast: only the distinct elements are copied."""
    if is_torch(x):
        strides, unit = x.stride(), 1
    else:
        strides, unit = x.strides, x.itemsize
    if x.ndim == 0 or x.shape[-1] <= 1 or strides[-1] == 0 or strides[-1] == unit:
        return x
    distinct = x[tuple(slice(0, 1) if s == 0 else slice(None) for s in strides)]
    if is_torch(x):
        return distinct.contiguous().expand(*x.shape)
    return np.broadcast_to(np.ascontiguousarray(distinct), x.shape)


def reshape(x, shape):
    return x.reshape(tuple(shape))


def logical_not(x):
    if is_torch(x):
        return ~x
    return np.logical_not(x)


def random_seed(kind):
    """A dropout seed from the caller's global generator (torch.manual_seed / np.random.seed)."""
    if kind == "torch":
        torch = torch_module()
        return int(torch.randint(0, 2**62, (1,)).item())
    return int(np.random.randint(0, 2**62, dtype=np.int64))
