#!/usr/bin/env bash
# One command for the GPU machine: build with its nvcc, run every GPU test and the
# benchmarks, write logs under $OUT (default build/gpu-out), print a short table last.
#
#   scripts/gpu-check.sh [all|test|bench|hf]     (default all)
#
# Expects (carried from the development machine, because the GPU machine has no network):
#   build/carry/other.gguf                 the gguf-py-written model (tests/oracle/write_gguf_ggufpy.py)
#   build/carry/{tiny,small}.llama.ds4logit llama.cpp dumps whose tokens the HF oracle replays
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs go to $OUT/gpu-check/ and are packed into $OUT/gpu-check.tar.gz at exit (the device
# tool returns at most 8 files); without $OUT they stay in build/gpu-out/.
if [ -n "${OUT:-}" ]; then
  FINAL=$OUT; OUT=$OUT/gpu-check
  trap 'tar czf "$FINAL/gpu-check.tar.gz" -C "$OUT" . && rm -rf "$OUT"' EXIT
else
  OUT=build/gpu-out
fi
mkdir -p "$OUT" build/test-out
WHAT=${1:-all}
ARCH=${CUDA_ARCH:-sm_90}
PY=python3
declare -a TABLE
row() { TABLE+=("$1"); }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
# bench_model MODEL LIMIT_S: one ds4_bench run, its RESULT lines appended to the table
bench_model() {
  step "bench $1"
  timeout "$2" build/cuda-$ARCH/ds4_bench --model "$1" --backend cuda --reps 5 --decode 32 --prefill 512,4096 \
     --copy-bw "${BW:-0}" 2>&1 | tee "$OUT/bench-$1.log"
  grep RESULT "$OUT/bench-$1.log" | sed 's/^RESULT /bench: /' >> "$OUT/table.txt"
}

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
nvcc --version | tail -2

step "build (make cuda CUDA_ARCH=$ARCH)"
if ! make cuda CUDA_ARCH="$ARCH" > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
make --no-print-directory build/cuda-$ARCH/test_backend_ops build/cuda-$ARCH/ds4_bench build/cuda-$ARCH/bandwidth \
    CUDA_ARCH=$ARCH >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build ok"
cp -f build/carry/other.gguf build/test-out/other.gguf 2>/dev/null || true

if [ "$WHAT" = all ] || [ "$WHAT" = test ]; then
  step "backend ops: CUDA vs CPU"
  build/cuda-$ARCH/test_backend_ops 2>&1 | tee "$OUT/ops.log" | tail -60
  row "ops:     $(tail -1 "$OUT/ops.log")"

  step "embedded default on CUDA"
  ./ds4 --backend cuda -p "Once upon a time" -n 64 2>&1 | tee "$OUT/run.log"

fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  step "copy bandwidth"
  build/cuda-$ARCH/bandwidth | tee "$OUT/bandwidth.log"
  BW=$(awk '/copy_bw_GBps/ {print $2}' "$OUT/bandwidth.log")
  row "copy bandwidth: $BW GB/s (read+write)"
  bench_model flash16 200      # first: the model the goals are about
fi

if [ "$WHAT" = all ] || [ "$WHAT" = test ]; then
  step "GPU pytest (CUDA vs CPU logits, determinism)"
  TEST_DS4_CUDA_BIN=$PWD/ds4 PYTHONUNBUFFERED=1 timeout 150 $PY -m pytest -q -rs -s tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
  row "pytest:  $(tail -1 "$OUT/pytest-gpu.log")"
  grep -E "max \|dlogit\|" "$OUT/pytest-gpu.log" | sed 's/^/gpu-vs-cpu: /' >> "$OUT/table.txt"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = hf ]; then
  step "transformers oracle (float64) on the llama.cpp token sequences"
  for m in tiny small; do
    [ -f build/carry/$m.llama.ds4logit ] || continue
    ./ds4 synth --config $m --seed 1 --type f32 -o build/test-out/$m.gguf > /dev/null 2>&1
    PYTHONUNBUFFERED=1 timeout 100 $PY tests/oracle/hf_oracle.py -m build/test-out/$m.gguf \
       --tokens-from build/carry/$m.llama.ds4logit -o "$OUT/$m.hf.ds4logit" 2>&1 | tail -4 | tee "$OUT/hf-$m.log"
    row "hf $m:  $(grep -F 'max |dlogit|' "$OUT/hf-$m.log" | tail -1)"
  done
fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  bench_model tiny 60
  bench_model small 60
fi

echo
echo "================ summary ($(git rev-parse --short HEAD 2>/dev/null || echo nogit), $(date -u +%F))"
for r in "${TABLE[@]}"; do echo "$r"; done
[ -f "$OUT/table.txt" ] && cat "$OUT/table.txt"
