"""Hugging Face transformers end to end: attn_implementation "mha" against "sdpa" and "eager",
same model, same weights, same inputs, one process, 2 threads (torch's and mha's).

- A Llama-style decoder of ~105 M parameters (hidden 768, 12 layers, 12 query / 4 key-value
  heads, MLP 2048, vocabulary 32000 tied): prefill of 512, 2048 and 8192 tokens (tokens/s of one
  forward without a cache), and 256 greedy tokens decoded after a 512-token prompt with
  transformers' cache (tokens/s of the decoding alone: generate(256) minus generate(1)).
- A BERT-base encoder (hidden 768, 12 layers, 12 heads, MLP 3072): sequences/s at 128 and 512
  tokens, batch 8.
- A T5-small encoder (d_model 512, 6 layers, 8 heads of 64, MLP 2048): a relative position bias
  added to every layer's scores; sequences/s at 128 and 512 tokens, batch 8.
With --train, instead: training steps of BERT-base and the T5-small encoder (forward and backward
of a batch of 8 x 256, every other sequence padded after 192 tokens, no optimizer step), where
T5's learned position bias takes its gradient through mha's backward.
In float32 and bfloat16 (the model cast with .to(dtype)). Random weights, no downloads. Each cell
is the fastest of --repeats runs, the implementations taking turns within each repeat (neighbours
on a shared machine only ever add time); "eager" skips 8192 tokens (its T x T weights per layer
take minutes there).

With --bound, the prefill cases also run "free": an attention function that computes nothing
(it returns zeros of the output's shape), so sdpa's time over free's is the most any attention
implementation could gain end to end in that case (the rest of the model is the same work).

And the fixed cost of one call (measured first): mha.scaled_dot_product_attention on tiny inputs (numpy and torch)
against torch's SDPA, µs per call.

  python bench/transformers_e2e.py [--repeats 2] [--dtypes float32 bfloat16] [--json out.json] [--calls-only]
                                   [--bound] [--models llama bert t5] [--train]
"""
import argparse
import json
import time

import torch
from transformers import (AttentionInterface, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, T5Config,
                          T5EncoderModel)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import mha.integrations.transformers  # noqa: F401  (registers "mha")

THREADS = 2
IMPLS = ("mha", "sdpa", "eager")


def free_attention(module, query, key, value, attention_mask, **kwargs):
    """No attention at all: zeros of the (B, T, H, Dv) output transformers expects, no weights."""
    B, H, T, _ = query.shape
    return query.new_zeros((B, T, H, value.shape[-1])), None


AttentionInterface.register("free", free_attention)
AttentionMaskInterface.register("free", sdpa_mask)


def llama(dtype):
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192 + 512,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(dtype)


def bert(dtype):
    config = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    return BertModel(config).eval().to(dtype)


def t5(dtype):
    config = T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, dropout_rate=0.0)
    torch.manual_seed(0)
    return T5EncoderModel(config).eval().to(dtype)


def interleaved(model, impls, fn, repeats):
    """{impl: the fastest of `repeats` timings of fn()}, the implementations taking turns within
    each repeat (drift on a shared machine hits them alike rather than whichever ran last)."""
    times = {impl: float("inf") for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            model.set_attn_implementation(impl)
            start = time.perf_counter()
            fn()
            times[impl] = min(times[impl], time.perf_counter() - start)
    return times


def run(dtypes, repeats, bound=False, models=("llama", "bert", "t5"), train=False):
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        if train:
            for family in ("bert", "t5"):
                if family in models:
                    rows += run_training(family, dtype, dtype_name, repeats, g)
            continue
        if "llama" in models:
            rows += run_llama(dtype, dtype_name, repeats, bound, g)
        for family in ("bert", "t5"):
            if family in models:
                rows += run_encoder(family, dtype, dtype_name, repeats, g)
    return rows


def run_llama(dtype, dtype_name, repeats, bound, g):
    """tokens/s of prefill (512, 2048, 8192 tokens) and of 256 greedy tokens after a 512-token prompt."""
    rows = []
    model = llama(dtype)
    name = f"llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M"
    for T in (512, 2048, 8192):
        ids = torch.randint(3, 32000, (1, T), generator=g)
        impls = [i for i in IMPLS if i != "eager" or T <= 2048] + (["free"] if bound else [])
        with torch.no_grad():
            for impl in impls:  # warm-up
                model.set_attn_implementation(impl)
                model(input_ids=ids[:, :64], use_cache=False)
            times = interleaved(model, impls, lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1),
                                repeats)
        for impl in impls:
            rows.append(dict(model=name, dtype=dtype_name, case=f"prefill {T}", impl=impl, seconds=times[impl],
                             rate=T / times[impl], unit="tokens/s"))
            print(rows[-1], flush=True)
    prompt = torch.randint(3, 32000, (1, 512), generator=g)

    def generate(n):
        with torch.no_grad():
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    for impl in IMPLS:
        model.set_attn_implementation(impl)
        generate(2)  # warm-up
    long = interleaved(model, IMPLS, lambda: generate(256), repeats)
    short = interleaved(model, IMPLS, lambda: generate(1), repeats)
    for impl in IMPLS:
        s = long[impl] - short[impl]
        rows.append(dict(model=name, dtype=dtype_name, case="decode 256 after 512", impl=impl, seconds=s,
                         rate=255 / s, unit="tokens/s"))
        print(rows[-1], flush=True)
    return rows


def run_encoder(family, dtype, dtype_name, repeats, g):
    """sequences/s of batches of 8 through BERT-base or the T5-small encoder."""
    rows = []
    model = bert(dtype) if family == "bert" else t5(dtype)
    for T in (128, 512):
        ids = torch.randint(1000, 30000, (8, T), generator=g)
        with torch.no_grad():
            for impl in IMPLS:
                model.set_attn_implementation(impl)
                model(input_ids=ids[:1])
            times = interleaved(model, IMPLS, lambda: model(input_ids=ids), repeats)
        for impl in IMPLS:
            rows.append(dict(model="bert-base" if family == "bert" else "t5-small encoder", dtype=dtype_name,
                             case=f"batch 8 x {T}", impl=impl, seconds=times[impl], rate=8 / times[impl],
                             unit="sequences/s"))
            print(rows[-1], flush=True)
    return rows


def run_training(family, dtype, dtype_name, repeats, g):
    """sequences/s of training steps (forward and backward of the output's mean square) on a batch
    of 8 x 256, every other sequence padded after 192 tokens. A fallback warning is an error: the
    step must run on the implementation named."""
    import warnings

    model = (bert if family == "bert" else t5)(dtype).train()
    ids = torch.randint(1000, 30000, (8, 256), generator=g)
    mask = torch.ones(8, 256, dtype=torch.long)
    mask[1::2, 192:] = 0

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask).last_hidden_state.float().square().mean().backward()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="mha:")
        for impl in IMPLS:  # warm-up
            model.set_attn_implementation(impl)
            step()
        times = interleaved(model, IMPLS, step, repeats)
    rows = []
    for impl in IMPLS:
        rows.append(dict(model="bert-base" if family == "bert" else "t5-small encoder", dtype=dtype_name,
                         case="train step 8 x 256", impl=impl, seconds=times[impl], rate=8 / times[impl],
                         unit="sequences/s"))
        print(rows[-1], flush=True)
    return rows


def call_overhead():
    """µs per mha.scaled_dot_product_attention call on tiny inputs (the fixed cost decoding pays
    once per layer and token), numpy and torch, against torch's SDPA: the best of 5 runs of 5000."""
    import numpy as np

    import mha

    def per_call(fn, n=5000):
        for _ in range(500):
            fn()
        best_s = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best_s = min(best_s, (time.perf_counter() - start) / n)
        return best_s * 1e6

    rows = []
    for heads, keys, dim in ((1, 4, 8), (32, 16, 64)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, 1, dim, generator=g)
        k = torch.randn(1, heads, keys, dim, generator=g)
        v = torch.randn(1, heads, keys, dim, generator=g)
        qn, kn, vn = (x.numpy() for x in (q, k, v))
        cells = {"mha numpy": per_call(lambda: mha.scaled_dot_product_attention(qn, kn, vn)),
                 "mha torch": per_call(lambda: mha.scaled_dot_product_attention(q, k, v)),
                 "torch sdpa": per_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))}
        rows.append((f"(1, {heads}, 1, {dim}) over {keys} keys", cells))
        print(rows[-1], flush=True)
    return rows


def table(rows):
    bound = any(r["impl"] == "free" for r in rows)
    lines = ["| model | dtype | case | mha | sdpa | eager | mha / sdpa |" + (" bound: free / sdpa |" if bound else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if bound else "")]
    keys = []
    for r in rows:
        k = (r["model"], r["dtype"], r["case"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cell = {r["impl"]: r for r in rows if (r["model"], r["dtype"], r["case"]) == k}
        fmt = lambda i: f"{cell[i]['rate']:.2f} {cell[i]['unit']}" if i in cell else "—"  # noqa: E731
        ratio = cell["mha"]["rate"] / cell["sdpa"]["rate"]
        line = f"| {k[0]} | {k[1]} | {k[2]} | {fmt('mha')} | {fmt('sdpa')} | {fmt('eager')} | {ratio:.2f}× |"
        if bound:
            line += f" {cell['free']['rate'] / cell['sdpa']['rate']:.2f}× |" if "free" in cell else " — |"
        lines.append(line)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json")
    ap.add_argument("--calls-only", action="store_true", help="only the per-call overhead table")
    ap.add_argument("--bound", action="store_true", help="prefill also without attention (the most it can gain)")
    ap.add_argument("--models", nargs="+", choices=("llama", "bert", "t5"), default=["llama", "bert", "t5"])
    ap.add_argument("--train", action="store_true", help="training steps of the encoders instead (bert, t5)")
    a = ap.parse_args()
    torch.set_num_threads(THREADS)
    calls = call_overhead()
    rows = run(a.dtypes, a.repeats, a.bound, a.models, a.train) if not a.calls_only else []
    print("| call | mha numpy | mha torch | torch sdpa |\n|---|---|---|---|")
    for name, c in calls:
        print(f"| {name} | {c['mha numpy']:.1f} µs | {c['mha torch']:.1f} µs | {c['torch sdpa']:.1f} µs |")
    if rows:
        print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
