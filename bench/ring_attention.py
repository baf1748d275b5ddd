"""Context-parallel ring attention (mha.distributed) on one machine: R ranks on 127.0.0.1 (gloo),
one thread each, against the compute the ring contains, and the numbers docs/scale-out.md models.

Per configuration (non-causal, causal zigzag, causal contiguous), forward and forward + backward:
- ring: the wall time of ring_attention on every rank (the slowest rank counts);
- compute: the same ranks computing the same blocks in the same order with the transfers replaced
  by local copies (a ring that does not communicate): what the ring would take if communication
  were free and hidden;
- ring / compute (target ≤ 1.10: communication hidden), and causal / (non-causal / 2) (target
  ≤ 1.10 for zigzag: ranks balanced), each the median over the repeats of the ratio of two runs
  made one right after the other.
And the transfer alone: one K/V shard sent round the ring with nothing to overlap (ms, GB/s).
Times are the fastest of --repeats runs.

  python bench/ring_attention.py [--ranks 2] [--tokens 8192] [--heads 8] [--dim 128] [--repeats 3] [--json out.json]
"""
import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mha import distributed as md


class _LocalRing(md._Ring):
    """The ring's schedule and block computations without communication: each 'transfer' copies
    the shard into the receive buffer (what this rank would hold if its neighbour's shard were
    its own: the same shapes, the same work)."""

    def start(self, send, recv, tag):
        recv.copy_(send)
        return ()

    def wait(self, works, what, step):
        pass


def _time(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
    return float(elapsed)


def _worker(rank, world, store, args, result):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    T, H, D = args.tokens, args.heads, args.dim
    g = torch.Generator().manual_seed(rank)
    Tl = T // world
    q, k, v, dout = (torch.randn(1, H, Tl, D, generator=g) for _ in range(4))
    ring = md._Ring(None, None)
    local = _LocalRing(None, None)
    scale = D ** -0.5
    configs = [("non-causal", False, "zigzag"), ("causal zigzag", True, "zigzag"),
               ("causal contiguous", True, "contiguous")]
    best, ratios = {}, {}

    def keep(key, seconds):
        best[key] = min(best.get(key, float("inf")), seconds)

    def run(r, causal, layout, part):
        if part == "forward":
            return _time(lambda: md._forward(r, q, k, v, scale, causal, layout, 1))
        out, lse = md._forward(r, q, k, v, scale, causal, layout, 1)

        def step():
            md._forward(r, q, k, v, scale, causal, layout, 1)
            md._backward(r, q, k, v, out, lse, dout, scale, causal, layout, 1)
        return _time(step)

    # Neighbours on a shared machine add time in bursts: ratios are taken between runs made one
    # right after the other (the order reversed every repeat) and reported as medians.
    for repeat in range(args.repeats):
        for part in ("forward", "forward + backward"):
            runs = [(c, kind) for c in configs for kind in ("ring", "compute")]
            t = {}
            for (name, causal, layout), kind in (runs if repeat % 2 == 0 else reversed(runs)):
                t[name, kind] = run(ring if kind == "ring" else local, causal, layout, part)
                keep((name, kind, part), t[name, kind])
            for name, _, _ in configs:
                ratios.setdefault((name, part, "ring/compute"), []).append(t[name, "ring"] / t[name, "compute"])
                ratios.setdefault((name, part, "half"), []).append(t[name, "ring"] / (t["non-causal", "ring"] / 2))
        # The transfer alone: one K/V shard once round the ring.
        kv = md._pack(k, v)
        buf = torch.empty_like(kv)

        def transfer():
            for step in range(world - 1):
                ring.wait(ring.start(kv, buf, 7), "transfer", step)
        keep(("transfer", "ring", "kv"), _time(transfer))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    if rank == 0:
        flops = 4.0 * T * T * H * D  # non-causal forward, whole sequence
        rows = []
        for name, causal, layout in configs:
            for part, mult in (("forward", 1.0), ("forward + backward", 3.5)):
                ring_s, comp_s = best[(name, "ring", part)], best[(name, "compute", part)]
                work = flops * mult * (0.5 if causal else 1.0)
                rows.append({"config": name, "part": part, "ring_s": ring_s, "compute_s": comp_s,
                             "ring_over_compute": median(ratios[name, part, "ring/compute"]),
                             "ring_over_compute_all": ratios[name, part, "ring/compute"],
                             "ring_gflops": work / ring_s / 1e9,
                             "over_half_noncausal": median(ratios[name, part, "half"]) if causal else None})
        steps = max(world - 1, 1)
        transfer_s = best[("transfer", "ring", "kv")] / steps
        out = {"ranks": world, "tokens": T, "heads": H, "dim": D, "shard_tokens": Tl, "rows": rows,
               "kv_shard_bytes": kv.numel() * 4, "transfer_step_s": transfer_s,
               "transfer_gbs": kv.numel() * 4 / transfer_s / 1e9 if world > 1 else None}
        with open(result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args.ranks, store, args, result), nprocs=args.ranks, start_method="spawn")
        with open(result) as f:
            r = json.load(f)
    print(f"ring attention: {r['ranks']} ranks x 1 thread on 127.0.0.1 (gloo); (B, H, T, D) = "
          f"(1, {r['heads']}, {r['tokens']}, {r['dim']}), {r['shard_tokens']} tokens per rank")
    print(f"{'':<39} {'ring s':>8} {'compute s':>10} {'ring/compute*':>13} {'GFLOP/s':>8} "
          f"{'/(non-causal/2)*':>17}")
    for row in r["rows"]:
        half = "" if row["over_half_noncausal"] is None else f"{row['over_half_noncausal']:.3f}"
        print(f"{row['config']:<19} {row['part']:<19} {row['ring_s']:>8.3f} {row['compute_s']:>10.3f} "
              f"{row['ring_over_compute']:>13.3f} {row['ring_gflops']:>8.1f} {half:>17}")
    print("* medians of the ratios of adjacent runs (best times shown)")
    if r["transfer_gbs"]:
        print(f"transfer alone: one K/V shard ({r['kv_shard_bytes'] / 2**20:.1f} MiB) per ring step: "
              f"{r['transfer_step_s'] * 1e3:.1f} ms, {r['transfer_gbs']:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
