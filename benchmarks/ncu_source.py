"""Where a kernel's warps stall, instruction by instruction: reads the CSV of ncu's source page (`ncu -i REPORT
--page source --csv --print-source sass`) and prints the instructions with the most warp-stall samples, each with
its share of all samples and its largest stall reasons. `scripts/gpu-check ncu` makes the reports.

    python benchmarks/ncu_source.py FILE.csv [--top 30]
"""
from __future__ import annotations

import argparse
import csv


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if any("Stall Sampling" in c for c in r)), None)
    if header is None:
        print(f"{args.csv}: no stall-sampling column; first lines: {rows[:3]}")
        return
    names, body = rows[header], rows[header + 1:]
    samples = next(i for i, c in enumerate(names) if "Stall Sampling (All" in c)
    text = next((i for i, c in enumerate(names) if c in ("Source", "# Source")), 1)
    reasons = [i for i, c in enumerate(names) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[samples]) or 0 for r in body if len(r) > samples)
    print(f"{args.csv}: {len(body)} lines, {total:.0f} stall samples (line: index in the listing)")
    ranked = sorted((i for i, r in enumerate(body) if len(r) > samples), key=lambda i: -(number(body[i][samples]) or 0))
    for i in ranked[:args.top]:
        r = body[i]
        top = sorted(((number(r[k]) or 0, names[k]) for k in reasons if k < len(r)), reverse=True)[:3]
        why = ", ".join(f"{n} {v:.0f}" for v, n in top if v > 0)
        print(f"{100 * (number(r[samples]) or 0) / max(total, 1):5.1f} %  {i:5}  {r[text][:80]:80} {why}")


if __name__ == "__main__":
    main()
