#!/usr/bin/env python3
"""Re-quantise a model's routed experts with libggml's own quantiser (ggml_quantize_chunk).

    requant.py IN.gguf OUT.gguf [--seed N] [--std S] [--threads T] [--oracle-dir build/oracle] [-q]

OUT is IN byte for byte except the data of every ffn_gate_exps / ffn_up_exps / ffn_down_exps
tensor, which keeps its type (IQ2_XXS, Q2_K or Q4_K in the small-q2 / small-q4 layouts) but
now holds the blocks that libggml-base (build/oracle/lib, llama.cpp v0.4.0) writes for fresh
random float values.  So the quantised blocks come from llama.cpp's quantiser instead of
ds4_quant_random_block, with real (fitted) scales, mins and grid choices.

Values: for each expert, rows of N(0, (S * r)^2) with a per-row factor r in [0.5, 1.5]
(default S = 0.04, about the scale of ds4 synth's expert matrices), one value in 512
multiplied by 8 (outliers), drawn from numpy Generator(PCG64(seed)) in file order.
Importance matrix: one random positive vector per expert (0.01 + u1*u2, as in
tests/oracle/quant_oracle.c).  IQ2_XXS cannot be quantised without one, so every IQ2_XXS expert
passes one; for Q2_K and Q4_K the even experts pass one and the odd experts none, so both of
libggml's quantiser paths (weighted and unweighted) are used.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dequant_twin import DEFAULT_DIR, GGML, die, import_gguf, np  # noqa: E402

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def requant(src: str, dst: str, seed: int = 1, std: float = 0.04,
            oracle_dir: str = DEFAULT_DIR, quiet: bool = False, threads: int = 2) -> dict:
    gguf = import_gguf(oracle_dir)
    lib = GGML(oracle_dir)
    rng = np.random.Generator(np.random.PCG64(seed))
    reader = gguf.GGUFReader(src)
    edits = []
    stats: dict = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(threads, os.cpu_count() or 1)))
    for t in reader.tensors:
        if not t.name.endswith(EXPERT_SUFFIXES):
            continue
        ty = int(t.tensor_type)
        qt = gguf.GGMLQuantizationType(ty)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        if block == 1:
            die(f"{t.name} is {qt.name}, not a quantised type")
        lib.check_sizes(ty, block, type_size)
        dims = [int(d) for d in t.shape.tolist()]          # ne0 (row length), ne1 (rows), ne2 (experts)
        if len(dims) != 3 or dims[0] % block:
            die(f"{t.name}: unexpected shape {dims}")
        n_per_row, n_rows, n_exp = dims
        need_imat = bool(lib.lib.ggml_quantize_requires_imatrix(ty))
        jobs = []
        for e in range(n_exp):
            r = rng.uniform(0.5, 1.5, size=(n_rows, 1))
            x = rng.standard_normal((n_rows, n_per_row)) * (std * r)
            x[rng.integers(0, 512, size=x.shape) == 0] *= 8.0
            x = x.astype(np.float32)
            imat = None
            if need_imat or e % 2 == 0:
                imat = (0.01 + rng.uniform(size=n_per_row) * rng.uniform(size=n_per_row)).astype(np.float32)
            jobs.append((x, imat))
        lib.lib.ggml_quantize_init(ty)   # once, before the threads (it is thread-safe anyway)
        # ctypes drops the GIL during the call: the experts are quantised in parallel
        parts = list(pool.map(lambda j: lib.quantize(ty, j[0], j[1]), jobs))
        err2 = x2 = 0.0
        for (x, _), q in zip(jobs, parts):
            y = lib.to_float(ty, q, x.size)
            err2 += float(np.sum((y.astype(np.float64) - x.ravel()) ** 2))
            x2 += float(np.sum(x.astype(np.float64) ** 2))
        data = b"".join(parts)
        if len(data) != t.n_bytes:
            die(f"{t.name}: quantised {len(data)} bytes, the tensor holds {t.n_bytes}")
        edits.append((t.data_offset, data))
        s = stats.setdefault(qt.name, [0, 0.0, 0.0])
        s[0] += 1
        s[1] += err2
        s[2] += x2
    pool.shutdown()
    if not edits:
        die(f"{src} has no routed expert tensors")
    del reader
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        for off, data in edits:
            f.seek(off)
            f.write(data)
    lib.lib.ggml_quantize_free()
    out = {k: (v[0], (v[1] / v[2]) ** 0.5) for k, v in stats.items()}
    if not quiet:
        desc = ", ".join(f"{k} x{n} (relative RMS error {e:.3f})" for k, (n, e) in sorted(out.items()))
        print(f"requant.py: wrote {dst}: routed experts re-quantised by ggml_quantize_chunk: {desc}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description="re-quantise routed experts with libggml's quantiser")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--std", type=float, default=0.04)
    ap.add_argument("--oracle-dir", default=DEFAULT_DIR, help="build/oracle (lib/, gguf-py/)")
    ap.add_argument("--threads", type=int, default=2, help="quantiser threads (capped at the cores)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args()
    if os.path.abspath(a.src) == os.path.abspath(a.dst):
        die("OUT must differ from IN")
    requant(a.src, a.dst, a.seed, a.std, a.oracle_dir, a.quiet, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
