"""Hugging Face transformers end to end: attn_implementation "mha" against "sdpa" and "eager",
same model, same weights, same inputs, one process, 2 threads (torch's and mha's).

- A Llama-style decoder of ~105 M parameters (hidden 768, 12 layers, 12 query / 4 key-value
  heads, MLP 2048, vocabulary 32000 tied): prefill of 512, 2048 and 8192 tokens (tokens/s of one
  forward without a cache), and 256 greedy tokens decoded after a 512-token prompt with
  transformers' cache (tokens/s of the decoding alone: generate(256) minus generate(1)).
- A BERT-base encoder (hidden 768, 12 layers, 12 heads, MLP 3072): sequences/s at 128 and 512
  tokens, batch 8.
In float32 and bfloat16 (the model cast with .to(dtype)). Random weights, no downloads. Each cell
is the fastest of --repeats runs (neighbours on a shared machine only ever add time); "eager"
skips 8192 tokens (its T x T weights per layer take minutes there).

  python bench/transformers_e2e.py [--repeats 2] [--dtypes float32 bfloat16] [--json out.json]
"""
import argparse
import json
import time

import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

import mha.integrations.transformers  # noqa: F401  (registers "mha")

THREADS = 2
IMPLS = ("mha", "sdpa", "eager")


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


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(dtypes, repeats):
    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        model = llama(dtype)
        params = sum(p.numel() for p in model.parameters())
        for T in (512, 2048, 8192):
            ids = torch.randint(3, 32000, (1, T), generator=g)
            for impl in IMPLS:
                if impl == "eager" and T > 2048:
                    continue
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    model(input_ids=ids[:, :64], use_cache=False)  # warm-up
                    s = best(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), repeats)
                rows.append(dict(model=f"llama {params / 1e6:.0f}M", dtype=dtype_name, case=f"prefill {T}", impl=impl,
                                 seconds=s, rate=T / s, unit="tokens/s"))
                print(rows[-1], flush=True)
        prompt = torch.randint(3, 32000, (1, 512), generator=g)
        for impl in IMPLS:
            model.set_attn_implementation(impl)

            def generate(n):
                with torch.no_grad():
                    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)

            generate(2)  # warm-up
            s = best(lambda: generate(256), repeats) - best(lambda: generate(1), repeats)
            rows.append(dict(model=f"llama {params / 1e6:.0f}M", dtype=dtype_name, case="decode 256 after 512",
                             impl=impl, seconds=s, rate=255 / s, unit="tokens/s"))
            print(rows[-1], flush=True)
        del model
        model = bert(dtype)
        for T in (128, 512):
            ids = torch.randint(1000, 30000, (8, T), generator=g)
            for impl in IMPLS:
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    model(input_ids=ids[:1])
                    s = best(lambda: model(input_ids=ids), repeats)
                rows.append(dict(model="bert-base", dtype=dtype_name, case=f"batch 8 x {T}", impl=impl, seconds=s,
                                 rate=8 / s, unit="sequences/s"))
                print(rows[-1], flush=True)
        del model
    return rows


def table(rows):
    lines = ["| model | dtype | case | mha | sdpa | eager | mha / sdpa |", "|---|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        k = (r["model"], r["dtype"], r["case"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cell = {r["impl"]: r for r in rows if (r["model"], r["dtype"], r["case"]) == k}
        fmt = lambda i: f"{cell[i]['rate']:.2f} {cell[i]['unit']}" if i in cell else "—"  # noqa: E731
        ratio = cell["mha"]["rate"] / cell["sdpa"]["rate"]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {fmt('mha')} | {fmt('sdpa')} | {fmt('eager')} | {ratio:.2f}× |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(THREADS)
    rows = run(a.dtypes, a.repeats)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
