"""Summarise Nsight Compute's SASS source page: where each kernel's warps stall.

Usage:
  ncu --clock-control none --profile-from-start off -k "regex:_gemm1_swiglu_kernel|_gemm2_kernel" \
      --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      python scripts/ncu_kernels.py moe64 > stalls.csv
  python scripts/ncu_stalls.py stalls.csv [--top 25]
For each kernel in the file: total stall samples, the instructions holding the most samples (with
their share and the stall reasons ncu names in their columns), and the share by opcode.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import Counter


def _sections(text: str):
    """(kernel name, rows as dicts) for each kernel's table in ncu's CSV output: a '"Kernel Name",
    "<name>",' line, then a header line starting with "Address", then one line per instruction."""
    title, lines = "", []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            if lines:
                yield title, list(csv.DictReader(io.StringIO("\n".join(lines))))
            title, lines = next(csv.reader([line]))[1], []
        elif line.startswith('"Address"') or (lines and line.startswith('"')):
            lines.append(line)
    if lines:
        yield title, list(csv.DictReader(io.StringIO("\n".join(lines))))


def _number(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def summarise(rows: list[dict], top: int) -> list[str]:
    if not rows:
        return ["  (no rows)"]
    columns = list(rows[0])
    stall = next((c for c in columns if "Stall Sampling (All" in c), None)
    if stall is None:
        return [f"  no stall-sampling column; columns: {columns[:12]}"]
    reasons = [c for c in columns if c.startswith("stall_") and "(Not Issued)" not in c]
    total = sum(_number(r[stall]) for r in rows) or 1.0
    out = [f"  stall samples: {total:.0f} (column {stall!r})"]
    for r in sorted(rows, key=lambda r: -_number(r[stall]))[:top]:
        share = _number(r[stall]) / total
        why = sorted(((c, _number(r[c])) for c in reasons), key=lambda cv: -cv[1])[:2]
        why_text = ", ".join(f"{c}={v:.0f}" for c, v in why if v)
        out.append(f"  {share:6.1%}  {r.get('Address', ''):>6}  {r.get('Source', '')[:70]:70}  {why_text}")
    by_op = Counter()
    for r in rows:
        op = re.sub(r"^@!?U?P\w+\s+", "", r.get("Source", "").strip()).split(" ")[0].split(".")[0]
        by_op[op] += _number(r[stall])
    out.append("  by opcode: " + ", ".join(f"{op} {v / total:.1%}" for op, v in by_op.most_common(12)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_file")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.csv_file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for title, rows in _sections(text):
        print(title or "(kernel)")
        print("\n".join(summarise(rows, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
