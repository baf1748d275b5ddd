"""mha.distributed.ring_attention across processes: 2 and 4 ranks on 127.0.0.1 (gloo over a
file store), outputs and gradients against single-process attention, and the failures: uneven
shards, ranks that disagree on the settings, bad layouts, a rank that dies. Each run spawns its
ranks once and goes through all of its cases there (starting a process costs a torch import).

Bound (docs/numerics.md, "Ring attention"): against torch's float64 attention over the whole
sequence, the ring's error is at most twice that of mha's own single-process float32 attention
on the same inputs, plus the usual 1e-5 (conftest.BOUND).
"""
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mha
from mha import distributed as md

from conftest import BOUND, record

# (causal, layout, Hq, Hkv, T): GQA and MHA, both layouts, lengths that split into 2·world chunks.
CASES = [(False, "zigzag", 4, 2, 48), (True, "zigzag", 4, 2, 48), (True, "zigzag", 2, 2, 16),
         (True, "contiguous", 3, 1, 24), (False, "contiguous", 2, 2, 8)]


def _init(rank, world, store):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1, whatever the host name resolves to
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _rel(got, want):
    return float((got.double() - want).abs().max() / max(want.abs().max().item(), 1e-30))


def _equivalence_worker(rank, world, store, result):
    _init(rank, world, store)
    errors = []
    for case, (causal, layout, hq, hkv, T) in enumerate(CASES):
        g = torch.Generator().manual_seed(1000 + case)  # the same inputs on every rank
        B, D, Dv = 2, 16, 12
        q = torch.randn(B, hq, T, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, hkv, T, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, hkv, T, Dv, generator=g, dtype=torch.float64)
        dout = torch.randn(B, hq, T, Dv, generator=g, dtype=torch.float64)
        # The truth: torch's float64 attention over the whole sequence, and its gradients.
        q64, k64, v64 = (x.clone().requires_grad_() for x in (q, k, v))
        rep = hq // hkv
        want = torch.nn.functional.scaled_dot_product_attention(
            q64, k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1), is_causal=causal)
        want.backward(dout)
        # mha on one process, float32: the error the ring may double.
        q1, k1, v1 = (x.float().requires_grad_() for x in (q, k, v))
        one = mha.scaled_dot_product_attention(q1, k1, v1, is_causal=causal, enable_gqa=True)
        one.backward(dout.float())
        # The ring: this rank's shards.
        shard = lambda x: md.shard_sequence(x.float(), rank, world, layout)  # noqa: E731
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        out = md.ring_attention(ql, kl, vl, is_causal=causal, layout=layout, num_threads=1)
        out.backward(shard(dout))
        # Inference (no grad) takes the same ring and gives the same bits.
        with torch.no_grad():
            again = md.ring_attention(ql, kl, vl, is_causal=causal, layout=layout, num_threads=1)
        assert torch.equal(again, out.detach())
        gathered = [md.gather_sequence(x, layout=layout) for x in (out.detach(), ql.grad, kl.grad, vl.grad)]
        for name, got, single, truth in zip(("out", "dq", "dk", "dv"), gathered, (one, q1.grad, k1.grad, v1.grad),
                                            (want, q64.grad, k64.grad, v64.grad)):
            errors.append([f"{world} ranks, causal={causal}, {layout}, Hq={hq}, Hkv={hkv}: {name}",
                           _rel(got, truth), _rel(single.detach(), truth)])
    if rank == 0:
        with open(result, "w") as f:
            json.dump(errors, f)
    dist.destroy_process_group()


def _failures_worker(rank, world, store, result):
    _init(rank, world, store)
    q = torch.randn(1, 2, 8, 4)
    # Uneven shards: every rank refuses, naming the shapes (none waits for the others).
    uneven = torch.randn(1, 2, 8 + 2 * rank, 4)
    with pytest.raises(mha.Error, match=r"uneven shards.*rank 0: q \(1, 2, 8, 4\).*rank 1: q \(1, 2, 10, 4\)"):
        md.ring_attention(uneven, uneven, uneven)
    with pytest.raises(mha.Error, match=r"same is_causal, layout and scale.*rank 0: is_causal=False.*rank 1: "
                                        r"is_causal=True"):
        md.ring_attention(q, q, q, is_causal=rank == 1)
    with pytest.raises(mha.Error, match=r"same is_causal, layout and scale.*scale=0\.5.*scale=1\.0"):
        md.ring_attention(q, q, q, scale=0.5 + rank / 2)
    odd = torch.randn(1, 2, 5, 4)
    with pytest.raises(mha.Error, match="zigzag shard .* even; got 5"):
        md.ring_attention(odd, odd, odd, is_causal=True)
    with pytest.raises(mha.Error, match="layout must be"):
        md.ring_attention(q, q, q, layout="striped")
    with pytest.raises(mha.Error, match="float32"):
        md.ring_attention(q.double(), q.double(), q.double())
    with pytest.raises(mha.Error, match="multiple of the key/value heads"):
        md.ring_attention(torch.randn(1, 3, 8, 4), q, q)
    dist.barrier()
    # A rank that dies once the ring has started: the other fails with an error naming the
    # step and the peer, well before the timeout.
    if rank == 1:
        md._forward = lambda *args: os._exit(0)  # noqa: E731 (dies where its first send would be)
    start = time.monotonic()
    with pytest.raises(mha.Error, match=r"rank 0 of 2: passing K/V on at ring step 0 .*receiving from rank 1.*failed"):
        md.ring_attention(q, q, q, timeout=30)
    with open(result, "w") as f:
        json.dump({"seconds": time.monotonic() - start}, f)


def _run(worker, world, tmp_path, timeout=180):
    """Starts `world` ranks of worker(rank, world, store, result) and waits for them (at most
    `timeout` seconds: a hang fails the test instead of hanging it). Returns the result file."""
    store, result = str(tmp_path / "store"), str(tmp_path / "result.json")
    ctx = mp.start_processes(worker, args=(world, store, result), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks still running after {timeout} s")
    with open(result) as f:
        return json.load(f)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_equals_single_process_attention(world, tmp_path):
    errors = _run(_equivalence_worker, world, tmp_path)
    assert len(errors) == 4 * len(CASES)
    for name, err, single in errors:
        record(f"ring {name.split(': ')[1]}", err)
        assert err <= 2 * single + BOUND, f"{name}: ring error {err:.3e}, single-process mha {single:.3e}"


def test_ring_failures_are_errors(tmp_path):
    result = _run(_failures_worker, 2, tmp_path)
    assert result["seconds"] < 25, result  # the dead peer was noticed, not waited out


def test_shard_helpers_round_trip():
    x = torch.arange(2 * 24, dtype=torch.float32).reshape(2, 24, 1).transpose(0, 1).contiguous()  # (24, 2, 1)
    for layout in md.LAYOUTS:
        for world in (1, 2, 3):
            shards = [md.shard_sequence(x, r, world, layout, dim=0) for r in range(world)]
            assert torch.equal(md.unshard_sequence(shards, layout, dim=0), x)
    # zigzag over 2 ranks: chunks (0, 3) and (1, 2) of 4.
    assert md.shard_sequence(torch.arange(8), 0, 2, dim=0).tolist() == [0, 1, 6, 7]
    assert md.shard_sequence(torch.arange(8), 1, 2, dim=0).tolist() == [2, 3, 4, 5]
    with pytest.raises(mha.Error, match="does not split into 4 equal chunks"):
        md.shard_sequence(torch.arange(10), 0, 2, dim=0)
    with pytest.raises(mha.Error, match="rank"):
        md.shard_sequence(torch.arange(8), 2, 2, dim=0)
    with pytest.raises(mha.Error, match="not initialised"):
        md.ring_attention(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))


def test_merge_attention_from_python():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 3)
    out, lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    a, la = mha.scaled_dot_product_attention(q, k[:, :, :7], v[:, :, :7], return_lse=True)
    b, lb = mha.scaled_dot_product_attention(q, k[:, :, 7:], v[:, :, 7:], return_lse=True)
    merged, merged_lse = mha.merge_attention(a, la, b, lb)
    assert merged is a and merged_lse is la  # in place in the first part
    torch.testing.assert_close(merged, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-6)
    with pytest.raises(mha.Error, match="part_out must have out's shape"):
        mha.merge_attention(a, la, b[:, :, :4], lb)
