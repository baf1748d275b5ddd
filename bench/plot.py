#!/usr/bin/env python3
"""GFLOP/s against sequence length for mha and PyTorch, from `mha_bench --sweep --json`.

usage: plot.py results.json out.png
"""
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    data = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for suite, style in (("sweep", "-"), ("sweep-causal", "--")):
        rows = [r for r in data["rows"] if r["suite"] == suite]
        if not rows:
            continue
        t = [int(re.findall(r"\d+", r["shape"])[2]) for r in rows]
        label = "causal" if "causal" in suite else "non-causal"
        ax.plot(t, [r["mha_gflops"] for r in rows], "o" + style, color="C0", label=f"mha, {label}")
        if all("peer_gflops" in r for r in rows):
            ax.plot(t, [r["peer_gflops"] for r in rows], "s" + style, color="C1",
                    label=f"{data['peer']} SDPA, {label}")
    ax.axhline(data["peak_gflops"], color="gray", lw=0.8, ls=":", label="measured fp32 FMA peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T  (B=1, H=8, D=64)")
    ax.set_ylabel("GFLOP/s (unmasked part only)")
    ax.set_title(f"attention forward, fp32, {data['threads']} threads")
    ax.set_ylim(0, data["peak_gflops"] * 1.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
