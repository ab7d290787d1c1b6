#!/usr/bin/env bash
# gpu-hooks-trees.sh -- one GPU run: what hooks `attn` cost a flash16 decode step with graphs in
# this tree and in other trees beside it (e.g. `git archive REV` unpacked under build/carry/),
# with this tree's hooks checks first.  Logs under $OUT.
#   1. this tree and every DIR built side by side (make cuda, ds4_bench; test_backend_ops here);
#   2. `test_backend_ops hc` (hc_pre against the CPU) and tests/test_gpu.py -k "hooks and not
#      other" (the hooks' bytes against the CPU's, logits unchanged, lossless, exact drops);
#   3. ds4_bench --model flash16 --reps 3 --decode 64 --prefill 64, DS4_CUDA_GRAPHS=1: hooks
#      off in this tree, then DS4_HOOKS=attn (to /dev/null) in this tree and in each DIR, then
#      this tree off and attn again (the first and last bracket the others).
#   scripts/gpu-hooks-trees.sh [DIR...]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-build/gpu-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-sm_90}
for d in "$@"; do [ -d "$d" ] || { echo "gpu-hooks-trees: $d is not a directory"; exit 2; }; done
bt() {   # DIR NAME: make cuda and ds4_bench there
  (cd "$1" && make cuda CUDA_ARCH="$ARCH" > "$OUT/b-$2.log" 2>&1 && make --no-print-directory \
    build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" >> "$OUT/b-$2.log" 2>&1; echo "$2 build rc $?")
}
for d in "$@"; do bt "$d" "$(basename "$d")" & done
make cuda CUDA_ARCH="$ARCH" > "$OUT/build.log" 2>&1 && make --no-print-directory build/cuda-"$ARCH"/ds4_bench \
  build/cuda-"$ARCH"/test_backend_ops CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1; echo "build rc $?"
wait
timeout 60 build/cuda-"$ARCH"/test_backend_ops hc 2>&1 | tail -2
TEST_DS4_CUDA_BIN=build/cuda-"$ARCH"/ds4 timeout 80 python3 -m pytest -q tests/test_gpu.py -k "hooks and not other" 2>&1 | tail -2
run() {  # NAME BENCH HOOKS
  local L="$OUT/h-$1-$3.log"
  if [ "$3" = none ]; then DS4_CUDA_GRAPHS=1 timeout 60 "$2" --model flash16 --backend cuda --reps 3 --decode 64 \
      --prefill 64 > "$L" 2>&1
  else DS4_HOOKS=attn DS4_HOOKS_OUT=/dev/null DS4_CUDA_GRAPHS=1 timeout 60 "$2" --model flash16 --backend cuda \
      --reps 3 --decode 64 --prefill 64 > "$L" 2>&1; fi
  echo "$1 hooks=$3: $(grep -E '^decode: median' "$L")"
}
B=build/cuda-"$ARCH"/ds4_bench
run this "$B" none
run this "$B" attn
for d in "$@"; do run "$(basename "$d")" "$d/build/cuda-$ARCH/ds4_bench" attn; done
run this "$B" none
run this "$B" attn
