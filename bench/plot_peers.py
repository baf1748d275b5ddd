#!/usr/bin/env python3
"""GFLOP/s per shape for mha (fp32, bf16, fp16) and the peers, from `peers.py --json`: grouped
bars, one group per shape, with the measured fp32 FMA (and bf16) peak as lines.

usage: plot_peers.py peers.json out.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    data = json.load(open(sys.argv[1]))
    rows = data["rows"]
    columns = list(rows[0]["gflops"].keys())
    for r in rows[1:]:
        columns += [c for c in r["gflops"] if c not in columns]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(columns)
    for i, col in enumerate(columns):
        xs = [g + (i - (len(columns) - 1) / 2) * width for g in range(len(rows))]
        ys = [r["gflops"].get(col, 0.0) for r in rows]
        hatch = "" if col.startswith("mha") else "//"
        ax.bar(xs, ys, width, label=col, color=f"C{i}", hatch=hatch, edgecolor="white", linewidth=0.3)
    ax.axhline(data["peak"], color="gray", lw=0.8, ls=":", label="fp32 FMA peak (measured)")
    if data.get("bf16_peak"):
        ax.axhline(data["bf16_peak"], color="gray", lw=0.8, ls="--",
                   label="bf16 peak (measured: AMX tiles, else vdpbf16ps)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["shape"] for r in rows])
    ax.set_xlabel("shape (B, H, T, D)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"Attention forward, {data['threads']} threads, one process (torch {data['torch']})")
    ax.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.14))
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
