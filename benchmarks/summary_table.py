"""Compact table (one row per direction/dtype/headdim/causal, one column per seqlen) of a
`bench --json` result, as used in README.md and the issue notes.

    python benchmarks/summary_table.py benchmarks/results/2026-11-29-h200.json
"""

import json
import sys


def main(path):
    data = json.load(open(path))
    rows = data["rows"]
    seqlens = sorted({r["seqlen"] for r in rows})
    label = {512: "512", 1024: "1k", 2048: "2k", 4096: "4k", 8192: "8k", 16384: "16k"}
    print("| dir | dtype | d | causal | " + " | ".join(f"s={label.get(s, s)}" for s in seqlens) + " |")
    print("|---|---|---|---|" + "---|" * len(seqlens))
    keys = sorted({(r["direction"], r["dtype"], r["headdim"], r["causal"]) for r in rows},
                  key=lambda k: (k[0] != "fwd", k[1] != "fp16", k[2], k[3]))
    for key in keys:
        cells = []
        for s in seqlens:
            (r,) = [r for r in rows if (r["direction"], r["dtype"], r["headdim"], r["causal"]) == key
                    and r["seqlen"] == s]
            cells.append(f"{r['tflops']:.0f} / {r['torch_tflops']:.0f} ({r['ratio']:.2f}x)")
        d, dt, h, c = key
        print(f"| {d} | {dt} | {h} | {'yes' if c else 'no'} | " + " | ".join(cells) + " |")
    for s in data.get("summary", []):
        print(s)


if __name__ == "__main__":
    main(sys.argv[1])
