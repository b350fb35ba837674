"""Compact table (one row per direction/dtype/headdim/causal, one column per seqlen) of a
`bench --json` result, as used in README.md and the issue notes. Each cell: cuflash2 /
SDPA-flash TFLOP/s (ratio), then cuDNN's TFLOP/s (cuflash2's ratio to it) where the run has it.

    python benchmarks/summary_table.py benchmarks/results/2026-11-29-h200.json
"""

import json
import sys


def _num(value, spec):
    return "–" if value is None else format(value, spec)


def _cell(r):
    """cuflash2 / SDPA-flash TFLOP/s (ratio); with cuDNN in the file (newer runs), its TFLOP/s
    and ratio too, "n/a" where cuDNN refused the row."""
    text = f"{_num(r['tflops'], '.0f')} / {_num(r['torch_tflops'], '.0f')} ({_num(r['ratio'], '.2f')}x)"
    if "cudnn_tflops" in r:
        if r.get("cudnn_error"):
            text += ", cuDNN n/a"
        else:
            text += f", cuDNN {_num(r['cudnn_tflops'], '.0f')} ({_num(r['ratio_vs_cudnn'], '.2f')}x)"
    return text


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
            found = [r for r in rows if (r["direction"], r["dtype"], r["headdim"], r["causal"]) == key
                     and r["seqlen"] == s]
            cells.append(_cell(found[0]) if found else "–")  # d=256 only from s=4k by default
        d, dt, h, c = key
        print(f"| {d} | {dt} | {h} | {'yes' if c else 'no'} | " + " | ".join(cells) + " |")
    if data.get("summary"):
        print()
    for direction, s in data.get("summary", {}).items():
        for label, prefix in (("SDPA-flash", ""), ("cuDNN", "cudnn_")):
            if s.get(prefix + "configs"):
                print(f"{direction}: cuflash2 / {label} geometric mean "
                      f"{s[prefix + 'geomean_ratio']:.3f}x, min {s[prefix + 'min_ratio']:.3f}x "
                      f"({s[prefix + 'min_config']}; {s[prefix + 'configs']} rows)")


if __name__ == "__main__":
    main(sys.argv[1])
