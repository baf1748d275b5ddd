# mha from Python: torch's API, numpy or torch in, the same kind out. Run by the Python tests.
import numpy as np
import torch

import mha

# scaled_dot_product_attention, exactly torch's arguments (bool mask: True = takes part).
q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
want = torch.softmax((q @ k.transpose(-2, -1) / 8).masked_fill(
    ~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf")), -1) @ v
print("sdpa vs torch ops:", float((out - want).abs().max()))

# Extras torch lacks: bottom-right causal alignment, the log-sum-exp, reproducible dropout.
out, lse = mha.scaled_dot_product_attention(q[:, :, -4:], k, v, is_causal=True,
                                            causal_alignment="bottom-right", return_lse=True)

# nn.MultiheadAttention's weights and call, on mha's kernels.
layer = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
fast = mha.MultiheadAttention.from_torch(layer)
x = torch.randn(4, 100, 256)
y, w = fast(x, x, x, key_padding_mask=torch.zeros(4, 100, dtype=torch.bool))
print("MultiheadAttention vs torch:", float((y - layer(x, x, x)[0]).abs().max()))

# numpy works the same (float32).
a = np.random.default_rng(0).standard_normal((2, 16, 32), dtype=np.float32)
print(type(mha.scaled_dot_product_attention(a, a, a)).__name__)

# Training: with tensors that require grad, gradients flow through mha's backward kernel.
q.requires_grad_(True)
mha.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
print("grad:", tuple(q.grad.shape))

# bfloat16 and float16: the same calls; computed in float32, results rounded once to the dtype.
qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
print(mha.scaled_dot_product_attention(qb, kb, vb, is_causal=True).dtype)   # torch.bfloat16
half = mha.MultiheadAttention.from_torch(layer.bfloat16())                  # bf16 weights
print(half(x.bfloat16(), x.bfloat16(), x.bfloat16())[0].dtype)
