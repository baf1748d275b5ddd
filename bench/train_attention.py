"""Attention in training through torch autograd: mha.scaled_dot_product_attention against
torch.nn.functional.scaled_dot_product_attention, same inputs, one process, 2 threads.

Each case times the forward alone (no grad) and a forward + backward of sum(out * r), the best
of --repeats calls, with a padding mask (every other sequence's last quarter of keys masked) as
a bool mask or as a float one (0 / -inf), with and without dropout, and with the float mask
itself needing its gradient (a learned bias, as T5's). Milliseconds, and mha's time over torch's.

  python bench/train_attention.py [--repeats 7] [--shape 8 12 256 64]
"""
import argparse
import time

import torch

import mha


def best_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 12, 256, 64], metavar=("B", "H", "T", "D"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    B, H, T, D = a.shape
    g = torch.Generator().manual_seed(0)
    q, k, v, r = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    keep = torch.ones(B, 1, T, T, dtype=torch.bool)
    keep[1::2, :, :, 3 * T // 4:] = False
    bias = torch.zeros(B, 1, T, T).masked_fill(~keep, float("-inf"))
    learned = torch.randn(H, T, T, generator=g)
    impls = {"mha": mha.scaled_dot_product_attention, "torch": torch.nn.functional.scaled_dot_product_attention}
    cases = [("bool mask", keep, 0.0, False), ("float mask", bias, 0.0, False), ("bool mask, dropout 0.1", keep, 0.1,
             False), ("float mask, dropout 0.1", bias, 0.1, False), ("learned bias (H, T, T), its gradient", learned,
                                                                     0.0, True)]
    print(f"(B, H, T, D) = {tuple(a.shape)}, best of {a.repeats}, 2 threads, torch {torch.__version__}")
    print("| case | forward mha | forward torch | mha / torch | fwd + bwd mha | fwd + bwd torch | mha / torch |")
    print("|---|---|---|---|---|---|---|")
    for name, mask, p, mask_grad in cases:
        fwd, step = {}, {}
        for impl, sdpa in impls.items():
            def forward():
                with torch.no_grad():
                    sdpa(q, k, v, attn_mask=mask, dropout_p=p)

            def train():
                xs = [x.clone().requires_grad_() for x in (q, k, v)]
                m = mask.clone().requires_grad_() if mask_grad else mask
                sdpa(*xs, attn_mask=m, dropout_p=p).mul(r).sum().backward()

            fwd[impl], step[impl] = best_ms(forward, a.repeats), best_ms(train, a.repeats)
        print(f"| {name} | {fwd['mha']:.1f} ms | {fwd['torch']:.1f} ms | {fwd['mha'] / fwd['torch']:.2f}× "
              f"| {step['mha']:.1f} ms | {step['torch']:.1f} ms | {step['mha'] / step['torch']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
