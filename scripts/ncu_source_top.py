#!/usr/bin/env python3
"""ncu_source_top.py -- where one profiled kernel's warps were sampled, instruction by instruction.

Reads the SASS source page of an Nsight Compute report as CSV
(`ncu --import R.ncu-rep --page source --print-source sass --csv`, one kernel launch) and prints:
  - the total of the warp-state samples;
  - the samples per opcode (the SASS mnemonic without its modifiers: WGMMA, LDS, SYNCS, BAR ...),
    largest first, as a share of the total;
  - the TOP instructions by samples, each with its share and, where the page has them, its
    largest stall-reason columns.
The sampled count is ncu's "Warp Stall Sampling (All Samples)" column; a page without it is an
error (exit 2), never an empty table.

    python3 scripts/ncu_source_top.py PAGE.csv [--top 40]
"""
import argparse
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"


def number(s):
    s = (s or "").replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def read_page(path):
    """The header row (the first that names the samples column) and the rows after it."""
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    for i, r in enumerate(rows):
        if ALL in r:
            return r, [x for x in rows[i + 1:] if len(x) == len(r)]
    return None, []


def opcode(sass):
    """The mnemonic of a SASS line: predicate guard and modifiers dropped (`@!P0 BAR.SYNC.DEFER_BLOCKING 0x0`
    -> BAR)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("page")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    head, rows = read_page(a.page)
    if head is None:
        print(f"ncu_source_top: {a.page}: no '{ALL}' column (not a source page of SASS?)", file=sys.stderr)
        return 2
    src = next((c for c in ("Source", "# Source", "SASS") if c in head), None)
    if src is None:
        print(f"ncu_source_top: {a.page}: no Source column", file=sys.stderr)
        return 2
    addr = next((c for c in ("Address", "# Address") if c in head), None)
    ia, isrc = head.index(ALL), head.index(src)
    ini = head.index(NOT_ISSUED) if NOT_ISSUED in head else None
    reasons = [j for j, c in enumerate(head) if "stall" in c.lower() and c not in (ALL, NOT_ISSUED)]
    total = sum(number(r[ia]) for r in rows)
    if total <= 0:
        print(f"ncu_source_top: {a.page}: {len(rows)} instructions, no samples", file=sys.stderr)
        return 2
    ni = sum(number(r[ini]) for r in rows) if ini is not None else None
    print(f"{len(rows)} instructions, {total:.0f} samples" +
          (f", {ni:.0f} of them not issued ({100 * ni / total:.1f}%)" if ni is not None else ""))

    by_op = {}
    for r in rows:
        op = opcode(r[isrc])
        by_op[op] = by_op.get(op, 0.0) + number(r[ia])
    print("\n| opcode | samples | share |\n|---|---:|---:|")
    for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]):
        if v / total < 0.005:
            break
        print(f"| {op} | {v:.0f} | {100 * v / total:.1f}% |")

    print(f"\n| address | instruction | samples | share | largest stall columns |\n|---|---|---:|---:|---|")
    for r in sorted(rows, key=lambda r: -number(r[ia]))[:a.top]:
        v = number(r[ia])
        if v <= 0:
            break
        top = sorted(((number(r[j]), head[j]) for j in reasons), reverse=True)[:3]
        why = ", ".join(f"{n} {x:.0f}" for x, n in top if x > 0)
        where = r[head.index(addr)] if addr else ""
        print(f"| {where} | `{r[isrc].strip()}` | {v:.0f} | {100 * v / total:.1f}% | {why} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
