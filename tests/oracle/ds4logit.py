#!/usr/bin/env python3
"""Read, write, inspect and compare DS4LOGIT logit dumps (numpy only).

Format (little-endian):
    char    magic[8] = b"DS4LOGIT"
    int32   version = 1, n_vocab, n_prompt (P), n_gen (G), n_rows = P + G, reserved = 0
    int32   token[n_rows]              token fed at each row
    int32   argmax[n_rows]             argmax of each logit row
    float32 logits[n_rows][n_vocab]
Row i < P is prompt position i; row P + j is decode step j, whose token is the one fed at
that step (in greedy mode: argmax of row P + j - 1).

CLI:
    ds4logit.py info FILE
    ds4logit.py compare A B [--tol 1e-4] [--rtol 0]
        prints max |dlogit| (overall, prompt rows, decode rows), the row where it occurs and
        the first row whose argmax differs; exits 1 if max |dlogit| > tol + rtol*max|logit|,
        if any argmax differs, if a logit is not finite, or if n_vocab, n_rows or the token
        sequences disagree (the same rows split differently into prompt and decode are fine:
        rows are compared one to one, "prompt"/"decode" in the report follow the smaller P);
        exits 2 on unreadable input.

Library:
    d = read(path)            -> Dump(n_vocab, n_prompt, n_gen, tokens, argmax, logits)
    write(path, n_prompt, tokens, logits, argmax=None)
"""
from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass

try:
    import numpy as np
except ImportError:  # Debian's python3-numpy under another python3 of the same version
    sys.path.append("/usr/lib/python3/dist-packages")
    try:
        import numpy as np
    except ImportError:
        sys.exit("ds4logit.py: error: numpy not found (apt-get install -y python3-numpy)")

MAGIC = b"DS4LOGIT"
VERSION = 1
HEADER = struct.Struct("<8s6i")


@dataclass
class Dump:
    n_vocab: int
    n_prompt: int
    n_gen: int
    tokens: np.ndarray   # int32 [n_rows]
    argmax: np.ndarray   # int32 [n_rows]
    logits: np.ndarray   # float32 [n_rows, n_vocab]

    @property
    def n_rows(self) -> int:
        return self.n_prompt + self.n_gen


class FormatError(Exception):
    pass


def read(path: str) -> Dump:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        raise FormatError(f"{path}: too short for a DS4LOGIT header")
    magic, version, n_vocab, n_prompt, n_gen, n_rows, reserved = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise FormatError(f"{path}: bad magic {magic!r}")
    if version != VERSION:
        raise FormatError(f"{path}: unsupported version {version}")
    if n_vocab <= 0 or n_prompt < 0 or n_gen < 0 or n_rows != n_prompt + n_gen or reserved != 0:
        raise FormatError(f"{path}: inconsistent header (vocab {n_vocab}, P {n_prompt}, G {n_gen}, "
                          f"rows {n_rows}, reserved {reserved})")
    want = HEADER.size + 8 * n_rows + 4 * n_rows * n_vocab
    if len(data) != want:
        raise FormatError(f"{path}: size {len(data)} != expected {want}")
    off = HEADER.size
    tokens = np.frombuffer(data, dtype="<i4", count=n_rows, offset=off).astype(np.int32)
    off += 4 * n_rows
    argmax = np.frombuffer(data, dtype="<i4", count=n_rows, offset=off).astype(np.int32)
    off += 4 * n_rows
    logits = np.frombuffer(data, dtype="<f4", count=n_rows * n_vocab, offset=off)
    logits = logits.astype(np.float32).reshape(n_rows, n_vocab)
    return Dump(n_vocab, n_prompt, n_gen, tokens, argmax, logits)


def write(path: str, n_prompt: int, tokens, logits, argmax=None) -> None:
    logits = np.ascontiguousarray(np.asarray(logits, dtype="<f4"))
    if logits.ndim != 2:
        raise ValueError("logits must be [n_rows, n_vocab]")
    n_rows, n_vocab = logits.shape
    tokens = np.asarray(tokens, dtype="<i4")
    if tokens.shape != (n_rows,) or not 0 <= n_prompt <= n_rows:
        raise ValueError("tokens must be [n_rows] and 0 <= n_prompt <= n_rows")
    if argmax is None:
        argmax = np.argmax(logits, axis=1) if n_rows else np.zeros(0)
    argmax = np.asarray(argmax, dtype="<i4")
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, n_vocab, n_prompt, n_rows - n_prompt, n_rows, 0))
        f.write(tokens.tobytes())
        f.write(argmax.tobytes())
        f.write(logits.tobytes())


def check(d: Dump, path: str = "") -> list[str]:
    """Internal consistency problems of one dump (empty list when well-formed)."""
    bad = []
    if d.n_rows and not np.all(np.isfinite(d.logits)):
        bad.append(f"{path}: {int((~np.isfinite(d.logits)).sum())} non-finite logits")
    if np.any(d.tokens < 0) or np.any(d.tokens >= d.n_vocab):
        bad.append(f"{path}: token id out of range")
    if d.n_rows and np.any(np.argmax(d.logits, axis=1) != d.argmax):
        rows = np.nonzero(np.argmax(d.logits, axis=1) != d.argmax)[0]
        bad.append(f"{path}: stored argmax disagrees with logits at rows {rows[:8].tolist()}")
    return bad


def is_greedy(d: Dump) -> bool:
    """True when every decode token is the argmax of the row before it."""
    P = d.n_prompt
    return d.n_gen > 0 and P > 0 and bool(np.all(d.tokens[P:] == d.argmax[P - 1:-1]))


def cmd_info(args) -> int:
    d = read(args.file)
    L = d.logits
    print(f"{args.file}: vocab {d.n_vocab}, prompt {d.n_prompt}, gen {d.n_gen}, "
          f"{'greedy' if is_greedy(d) else 'forced/other'}")
    if d.n_rows:
        fin = L[np.isfinite(L)]
        print(f"  logits mean {fin.mean():.4f} std {fin.std():.4f} min {fin.min():.3f} max {fin.max():.3f}; "
              f"per-row std {L.std(axis=1).min():.3f}..{L.std(axis=1).max():.3f}")
        print(f"  distinct argmax {len(np.unique(d.argmax))} of {d.n_rows} rows; "
              f"first tokens {d.tokens[:min(24, d.n_rows)].tolist()}")
    for p in check(d, args.file):
        print("  PROBLEM:", p)
    return 1 if check(d, args.file) else 0


def cmd_compare(args) -> int:
    a, b = read(args.a), read(args.b)
    problems = []
    if (a.n_vocab, a.n_prompt, a.n_gen) != (b.n_vocab, b.n_prompt, b.n_gen):
        print(f"header differs: A vocab/P/G = {a.n_vocab}/{a.n_prompt}/{a.n_gen}, "
              f"B = {b.n_vocab}/{b.n_prompt}/{b.n_gen}")
        if a.n_vocab != b.n_vocab:
            print("FAIL (n_vocab)")
            return 1
        if a.n_rows != b.n_rows:
            problems.append("n_rows")
        # Same rows split differently between prefill and decode: comparable row by row.
    n = min(a.n_rows, b.n_rows)
    P = min(a.n_prompt, b.n_prompt)
    tok_diff = np.nonzero(a.tokens[:n] != b.tokens[:n])[0]
    if tok_diff.size:
        r = int(tok_diff[0])
        print(f"token sequences differ first at row {r} (A {a.tokens[r]}, B {b.tokens[r]}); "
              f"logits after that row are not comparable")
        problems.append("tokens")
    d = np.abs(a.logits[:n].astype(np.float64) - b.logits[:n].astype(np.float64))
    scale = float(np.max(np.abs(b.logits[:n]))) if n else 0.0
    if n:
        r, c = np.unravel_index(int(np.argmax(d)), d.shape)
        maxd = float(d[r, c])
        print(f"max |dlogit| {maxd:.3e} at row {r} ({'prompt' if r < P else 'decode'}) vocab {c}; "
              f"max |logit| {scale:.3f}; rel {maxd / scale if scale else 0:.3e}")
        if P:
            print(f"  prompt rows 0..{P - 1}: max {float(d[:P].max()):.3e}, mean {float(d[:P].mean()):.3e}")
        if n > P:
            print(f"  decode rows {P}..{n - 1}: max {float(d[P:].max()):.3e}, mean {float(d[P:].mean()):.3e}")
    else:
        maxd = 0.0
        print("no rows")
    am = np.nonzero(a.argmax[:n] != b.argmax[:n])[0]
    if am.size:
        r = int(am[0])
        print(f"first differing argmax at row {r}: A {a.argmax[r]} B {b.argmax[r]} "
              f"({am.size} rows differ)")
        problems.append("argmax")
    else:
        print(f"argmax identical over {n} rows")
    tol = args.tol + args.rtol * scale
    if not np.isfinite(maxd) or maxd > tol:
        problems.append("tol")
    if not np.all(np.isfinite(a.logits)) or not np.all(np.isfinite(b.logits)):
        problems.append("non-finite")
    print(("FAIL (" + ", ".join(problems) + f"; tol {tol:.3e})") if problems else f"OK (tol {tol:.3e})")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description="DS4LOGIT dump tool")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="summarise one dump and check it is well-formed")
    p.add_argument("file")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("compare", help="compare two dumps")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tol", type=float, default=1e-4, help="absolute tolerance on max |dlogit|")
    p.add_argument("--rtol", type=float, default=0.0, help="extra tolerance, times max |logit| of B")
    p.set_defaults(fn=cmd_compare)
    args = ap.parse_args()
    try:
        return args.fn(args)
    except (FormatError, OSError) as e:
        print(f"ds4logit.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
