#!/usr/bin/env python3
"""Writes the PyTorch parity vectors under tests/data/parity/.

For every case: <case>/weights.safetensors (the module's state_dict exactly as PyTorch names it),
<case>/inputs.safetensors (in the `mha forward` input convention) and
<case>/expected.safetensors (PyTorch's outputs), plus one manifest.json describing the cases.
All modules run in eval mode (dropout off), in float32, from a fixed seed.

<case>/grads.safetensors holds torch autograd's gradients of loss = sum(output * grad_output)
for a random grad_output (stored too): "input.<name>" for each float input (every input is its
own leaf, so a key that is the value gets two gradients) and "param.<state_dict name>" for each
parameter. Cases whose output torch makes NaN have none.

Run with scripts/parity/make_parity_vectors.sh, which provides torch and safetensors.
"""
import json
import os
import sys

import torch
import torch.nn as nn
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import seeds  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "parity")


def save_grads(d, module, inputs, fwd):
    """Writes d/grads.safetensors: autograd of sum(fwd(leaves) * R) by the float inputs and parameters."""
    leaves = {k: v.detach().clone().requires_grad_(True) if k in ("x", "query", "key", "value") else v
              for k, v in inputs.items()}
    module.zero_grad()
    out = fwd(leaves)
    gen = torch.Generator().manual_seed(len(d))  # its own stream: the other vectors keep their draws
    r = torch.randn(out.shape, generator=gen)
    (out * r).sum().backward()
    grads = {"grad_output": r}
    for k, v in leaves.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            grads["input." + k] = v.grad.detach().contiguous()
    for k, p in module.named_parameters():
        grads["param." + k] = p.grad.detach().contiguous()
    save_file(grads, os.path.join(d, "grads.safetensors"))


def save_case(name, module, inputs, expected, fwd=None, **info):
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, os.path.join(d, "weights.safetensors"))
    save_file({k: v.detach().clone().contiguous() for k, v in inputs.items()}, os.path.join(d, "inputs.safetensors"))
    save_file({k: v.detach().contiguous() for k, v in expected.items()}, os.path.join(d, "expected.safetensors"))
    if fwd is not None:
        save_grads(d, module, inputs, fwd)
    entry = {"name": name, "grads": fwd is not None}
    entry.update(info)
    return entry


def seed_cases():
    cases = []
    torch.manual_seed(1000)
    m = seeds.GptMultiHeadAttention(n_embd=64, n_heads=8, block_size=16).eval()
    x = torch.rand(3, 12, 64)
    cases.append(save_case("seed000_gpt", m, {"x": x}, {"output": m(x)}, heads=8, causal="top-left", fwd=lambda i: m(i["x"]),
                           max_seq_len=16, description="seed 000: GPT masked self-attention, bias, block_size 16"))

    m = seeds.GptMultiHeadAttention(n_embd=48, n_heads=4, block_size=9, bias=False).eval()
    x = torch.rand(2, 9, 48)
    cases.append(save_case("seed000_gpt_nobias", m, {"x": x}, {"output": m(x)}, heads=4, causal="top-left", fwd=lambda i: m(i["x"]),
                           max_seq_len=9, description="seed 000 with bias=False, T = block_size"))

    m = seeds.BertMultiHeadAttention(embed_dim=32, num_heads=4).eval()
    x = torch.randn(2, 10, 32)
    out, attn = m(x)
    cases.append(save_case("seed002_bert", m, {"x": x}, {"output": out, "attn_weights": attn}, heads=4,
                           fwd=lambda i: m(i["x"])[0],
                           need_weights=True, description="seed 002: BERT attention returning per-head weights"))

    m = seeds.BertMultiHeadAttention(embed_dim=32, num_heads=4).eval()
    x = torch.randn(2, 10, 32)
    mask = (torch.rand(2, 1, 10, 10) > 0.3).int()
    mask[:, :, torch.arange(10), torch.arange(10)] = 1  # no fully masked row: seed 002 gives those a uniform row
    out, attn = m(x, mask)
    cases.append(save_case("seed002_bert_mask", m, {"x": x, "keep_mask": mask.bool()},
                           {"output": out, "attn_weights": attn}, heads=4, need_weights=True,
                           fwd=lambda i: m(i["x"], mask)[0],
                           description="seed 002 with a (B, 1, T, T) mask, mask == 0 filled with -1e9"))

    m = seeds.SelfAttention(dim_in=24, dim_k=16, dim_v=20).eval()
    x = torch.randn(3, 7, 24)
    cases.append(save_case("seed003_single", m, {"x": x}, {"output": m(x)}, heads=1, fwd=lambda i: m(i["x"]),
                           description="seed 003: single-head, dim_in 24, dim_k 16, dim_v 20, no bias"))

    m = seeds.MultiHeadSelfAttention(dim_in=32, dim_k=48, dim_v=64, num_heads=8).eval()
    x = torch.randn(2, 9, 32)
    cases.append(save_case("seed003_multi", m, {"x": x}, {"output": m(x)}, heads=8, fwd=lambda i: m(i["x"]),
                           description="seed 003: 8 heads, dim_k 48 != dim_v 64, no bias, no output projection"))
    return cases


def torch_mha_cases():
    cases = []
    torch.manual_seed(2000)
    E, H = 32, 4

    def mha(**kw):
        m = nn.MultiheadAttention(E, H, **kw).eval()
        with torch.no_grad():  # non-zero biases, so that bias handling is tested
            if m.in_proj_bias is not None:
                m.in_proj_bias.uniform_(-0.5, 0.5)
            if m.out_proj.bias is not None:
                m.out_proj.bias.uniform_(-0.5, 0.5)
        return m

    m = mha(batch_first=True)
    x = torch.randn(3, 11, E)
    out, w = m(x, x, x)
    cases.append(save_case("torch_mha_self", m, {"x": x}, {"output": out, "attn_weights": w}, heads=H,
                           fwd=lambda i: m(i["x"], i["x"], i["x"])[0],
                           need_weights=True, average_weights=True,
                           description="nn.MultiheadAttention self-attention, weights averaged over heads"))

    m = mha(batch_first=False)
    x = torch.randn(8, 2, E)  # (T, B, E)
    out, w = m(x, x, x, average_attn_weights=False)
    cases.append(save_case("torch_mha_seq_first", m, {"x": x}, {"output": out, "attn_weights": w}, heads=H,
                           fwd=lambda i: m(i["x"], i["x"], i["x"])[0],
                           need_weights=True, seq_first=True,
                           description="nn.MultiheadAttention batch_first=False, per-head weights"))

    m = mha(batch_first=True, kdim=24, vdim=40)
    q, k, v = torch.randn(2, 5, E), torch.randn(2, 7, 24), torch.randn(2, 7, 40)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    kpm[1, 2] = True
    out, w = m(q, k, v, key_padding_mask=kpm, average_attn_weights=False)
    cases.append(save_case("torch_mha_cross_kdim_vdim", m,
                           {"query": q, "key": k, "value": v, "key_padding_mask": kpm},
                           {"output": out, "attn_weights": w}, heads=H, need_weights=True,
                           fwd=lambda i: m(i["query"], i["key"], i["value"], key_padding_mask=kpm)[0],
                           description="cross-attention, kdim 24, vdim 40, key_padding_mask"))

    m = mha(batch_first=True)
    q, kv = torch.randn(2, 6, E), torch.randn(2, 9, E)
    out, _ = m(q, kv, kv, need_weights=False)
    cases.append(save_case("torch_mha_cross", m, {"query": q, "key": kv, "value": kv}, {"output": out}, heads=H,
                           fwd=lambda i: m(i["query"], i["key"], i["value"])[0],
                           description="cross-attention, same widths, key is value"))

    m = mha(batch_first=True)
    x = torch.randn(2, 10, E)
    blocked = torch.rand(10, 10) > 0.6
    blocked[torch.arange(10), torch.arange(10)] = False
    out, w = m(x, x, x, attn_mask=blocked, average_attn_weights=False)
    cases.append(save_case("torch_mha_bool_mask", m, {"x": x, "keep_mask": ~blocked},
                           {"output": out, "attn_weights": w}, heads=H, need_weights=True,
                           fwd=lambda i: m(i["x"], i["x"], i["x"], attn_mask=blocked)[0],
                           description="bool attn_mask (T, S), True = blocked in torch, stored as keep_mask = ~mask"))

    m = mha(batch_first=True)
    x = torch.randn(2, 10, E)
    fmask = torch.randn(10, 10)
    out, w = m(x, x, x, attn_mask=fmask)
    cases.append(save_case("torch_mha_float_mask", m, {"x": x, "attn_bias": fmask},
                           {"output": out, "attn_weights": w}, heads=H, need_weights=True, average_weights=True,
                           fwd=lambda i: m(i["x"], i["x"], i["x"], attn_mask=fmask)[0],
                           description="float attn_mask (T, S), added to the scores; weights averaged"))

    m = mha(batch_first=True)
    x = torch.randn(2, 8, E)
    blocked3 = torch.rand(2 * H, 8, 8) > 0.5
    blocked3[:, torch.arange(8), torch.arange(8)] = False
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1, 6:] = True
    kpm[1, 0] = False
    out, w = m(x, x, x, attn_mask=blocked3, key_padding_mask=kpm, average_attn_weights=False)
    cases.append(save_case("torch_mha_3d_mask", m,
                           {"x": x, "keep_mask": (~blocked3).view(2, H, 8, 8), "key_padding_mask": kpm},
                           {"output": out, "attn_weights": w}, heads=H, need_weights=True,
                           fwd=lambda i: m(i["x"], i["x"], i["x"], attn_mask=blocked3, key_padding_mask=kpm)[0],
                           description="3-D bool attn_mask (B*H, T, S) as (B, H, T, S) keep_mask, plus key_padding_mask"))

    m = mha(batch_first=True, bias=False)
    x = torch.randn(2, 7, E)
    out, w = m(x, x, x)
    cases.append(save_case("torch_mha_no_bias", m, {"x": x}, {"output": out, "attn_weights": w}, heads=H,
                           fwd=lambda i: m(i["x"], i["x"], i["x"])[0],
                           need_weights=True, average_weights=True, description="nn.MultiheadAttention bias=False"))

    m = mha(batch_first=True)
    x = torch.randn(2, 6, E)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, :] = True  # every key of batch 1 is padding: torch returns NaN there, mha returns out_proj.bias
    out, _ = m(x, x, x, key_padding_mask=kpm, need_weights=False)
    cases.append(save_case("torch_mha_fully_masked", m, {"x": x, "key_padding_mask": kpm}, {"output": out},
                           heads=H, fully_masked_batches=[1],
                           description="all keys of batch 1 padded: torch gives NaN rows, mha gives zeros "
                                       "before out_proj (so the output is out_proj.bias)"))
    return cases


def main():
    torch.set_num_threads(1)
    cases = seed_cases() + torch_mha_cases()
    with open(os.path.join(ROOT, "manifest.json"), "w") as f:
        json.dump({"generator": "scripts/parity/make_parity_vectors.py", "torch": torch.__version__,
                   "cases": cases}, f, indent=1)
    print(f"wrote {len(cases)} cases to {os.path.normpath(ROOT)} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
