# Context-parallel causal attention over a long sequence: every rank holds a zigzag shard.
#   torchrun --nproc-per-node 4 examples/ring_attention.py [--tokens 16384]
import argparse

import torch
import torch.distributed as dist

import mha
from mha import distributed as md

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=16384)
tokens = parser.parse_args().tokens
torch.set_num_threads(1)
dist.init_process_group("gloo")  # torchrun's environment: rank, world size, 127.0.0.1
rank, world = dist.get_rank(), dist.get_world_size()

# The same full sequence on every rank (a fixed seed); each keeps only its shard.
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, tokens, 64, generator=g) for _ in range(3))  # (B, H, T, D)
q_l, k_l, v_l = (md.shard_sequence(x, rank, world).requires_grad_() for x in (q, k, v))

out_l = md.ring_attention(q_l, k_l, v_l, is_causal=True, num_threads=1)
out_l.sum().backward()  # gradients of the shards, through the ring

out = md.gather_sequence(out_l.detach())  # the full output, on every rank
if rank == 0:
    want = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(f"{world} ranks, {tokens} tokens, {tokens // world} per rank")
    print(f"max |ring - single process|: {(out - want).abs().max().item():.1e}")
    print(f"dq shard: {tuple(q_l.grad.shape)}")
dist.destroy_process_group()
