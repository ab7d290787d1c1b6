#!/usr/bin/env bash
# scripts/long_oracle.sh [N] [THREADS] -- the CPU backend against llama.cpp over a long prompt.
#
# tiny declared with a 1M context (ds4 synth --ctx 1048576), N random prompt tokens (default
# 16384, random.Random(11)), one prefill each (ds4 in DS4_UBATCH chunks, llama.cpp in its own
# batches), every row compared (tests/oracle/ds4logit.py).  Twice: with tiny's indexer top-k
# of 8 (the indexer far past its top-k: a pick among up to N/4 compressed rows), and with the
# file's top_k rewritten to N/4, so that every candidate row is kept and no pick is made.
# Needs the llama.cpp oracle that tests/run_pytest.sh builds (build/oracle) and numpy.  About
# 4 + 5 minutes of llama.cpp on 2 cores for N = 16384 (bench/RESULTS.md has the numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-16384}
T=${2:-2}
PY=${PY:-/usr/bin/python3}   # the python3 with numpy (tests/run_pytest.sh looks in the same place first)
OUT=${OUT:-build/long-oracle}
mkdir -p "$OUT"
ORACLE=build/oracle/bin/llama_oracle
[ -x "$ORACLE" ] || { echo "long_oracle: $ORACLE missing (run make test-py once: tests/run_pytest.sh builds it)"; exit 2; }
[ -x ./ds4 ] || make cpu > /dev/null
./ds4 synth --config tiny --ctx 1048576 --seed 1 --type f32 -o "$OUT/tiny-1m.gguf" > /dev/null 2>&1
$PY - "$OUT/tiny-1m.gguf" "$OUT/tiny-1m-keepall.gguf" "$((N / 4))" <<'EOF'
import struct, sys
d = bytearray(open(sys.argv[1], "rb").read())
key = b"deepseek4.attention.indexer.top_k"
i = d.find(struct.pack("<Q", len(key)) + key)
assert i > 0, "no indexer top_k key"
j = i + 8 + len(key)
assert struct.unpack_from("<I", d, j)[0] == 4, "top_k is not a u32"
struct.pack_into("<I", d, j + 4, int(sys.argv[3]))
open(sys.argv[2], "wb").write(d)
EOF
TOK=$($PY -c "import random; r=random.Random(11); print(','.join(str(r.randrange(512)) for _ in range($N)))")
for m in tiny-1m tiny-1m-keepall; do
  "$ORACLE" -m "$OUT/$m.gguf" --tokens "$TOK" -n 0 -o "$OUT/$m.llama.ds4logit" --threads "$T" 2>&1 | tail -1
  DS4_THREADS=$T ./ds4 -m "$OUT/$m.gguf" --backend cpu --tokens "$TOK" -n 0 --dump-logits "$OUT/$m.ds4.ds4logit" \
      > /dev/null 2> "$OUT/$m.ds4.log"
  grep '^speed' "$OUT/$m.ds4.log"
  $PY - "$OUT/$m.ds4.ds4logit" "$OUT/$m.llama.ds4logit" "$m" <<'EOF'
import sys
import numpy as np
sys.path.insert(0, "tests/oracle")
import ds4logit
a, b = ds4logit.read(sys.argv[1]), ds4logit.read(sys.argv[2])
m = np.abs(a.logits.astype(np.float64) - b.logits).max(axis=1)
n = len(m)
for lo in range(0, n, 4096):
    hi = min(n, lo + 4096)
    print(f"{sys.argv[3]}: rows {lo}..{hi - 1}: max |dlogit| {m[lo:hi].max():.3g}, mean {m[lo:hi].mean():.3g}")
bad = np.nonzero(m > 1e-3)[0]
print(f"{sys.argv[3]}: {len(bad)} rows above 1e-3 (first {bad[:6].tolist()}), "
      f"{int((a.logits.argmax(1) != b.logits.argmax(1)).sum())} argmax differ of {n}")
EOF
done
