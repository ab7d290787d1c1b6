#!/usr/bin/env python3
"""scripts/patch_sizes.py -- restate each patch's size in patches/README.md's table.

The size column is `git apply --numstat` over the patch: lines added, lines removed, files
(tests/test_series.py checks it).  Run after a regen or refresh changed a patch's size.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def size(patch):
    out = subprocess.run(["git", "apply", "--numstat", patch], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    add = dele = 0
    for line in out.splitlines():
        a, d, _ = line.split("\t", 2)
        add += int(a) if a != "-" else 0
        dele += int(d) if d != "-" else 0
    return f"+{add:,}/\u2212{dele:,}, {len(out.splitlines())} files"


def main():
    readme = os.path.join(ROOT, "patches", "README.md")
    text = open(readme, encoding="utf-8").read()
    names = [l.strip() for l in open(os.path.join(ROOT, "patches", "series")) if l.strip()]
    for name in names:
        row = re.compile(r"^(\| `" + re.escape(name) + r"` \| [^|]+ \| )[^|]+( \|)", re.M)
        if not row.search(text):
            sys.exit(f"patch_sizes: patches/README.md has no row for {name}")
        text = row.sub(lambda m: m.group(1) + size(os.path.join("patches", name)) + m.group(2), text)
    open(readme, "w", encoding="utf-8").write(text)


if __name__ == "__main__":
    main()
