#!/usr/bin/env bash
# gpu-collect.sh -- one GPU run for `ds4 collect` (issue 25): build, the GPU collect test, then
# flash16 with a vocabulary written to disk, plain prefill at --ctx against collect --backend
# cuda with hooks resid at one layer (tokens/s and GB/s written), and a SIGTERM mid-run,
# resumed, against an uninterrupted run of the same budget.  Logs under $OUT.
#   scripts/gpu-collect.sh [test] [speed] [resume]            (default: all three)
# Environment: COLLECT_CTX (1024), COLLECT_TOKENS (speed's budget, 409600), COLLECT_FORMAT
# (speed's --format, arrow), COLLECT_HOOKS
# (resid:20), RESUME_TOKENS (65536), KILL_SHARDS (the interrupted run gets SIGTERM once it has
# reported this many whole shards, 2).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-build/gpu-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-sm_90}
WHAT=" ${*:-test speed resume} "
want() { [[ "$WHAT" == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
CTX=${COLLECT_CTX:-1024}; HOOKS=${COLLECT_HOOKS:-resid:20}
step build
make cuda CUDA_ARCH="$ARCH" > "$OUT/build.log" 2>&1 &&
  make --no-print-directory build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
if want test; then
  step "tests/test_gpu.py -k collect"
  TEST_DS4_CUDA_BIN=$PWD/ds4 timeout 200 python3 -m pytest -q -rs -s tests/test_gpu.py -k collect 2>&1 | tail -6
fi
W=build/collect-work; mkdir -p "$W"
# a corpus of generated text: sentences of numbered words, one document a line, no downloads
corpus() {
  [ -s "$W/corpus.txt" ] || python3 -c "
import random
r = random.Random(1)
words = 'the of and a to in is was for on that with as by it at from his an were are which this be or has had'.split()
with open('$W/corpus.txt', 'w') as f:
    for d in range(40000):
        f.write(' '.join(r.choice(words) + (str(r.randrange(1000)) if r.random() < 0.2 else '') for _ in range(r.randrange(20, 400))) + '\n')
"
  [ -s "$W/flash16.gguf" ] || { step "ds4 synth --config flash16 --vocab (26 GB)"; timeout 400 ./ds4 synth --config flash16 --seed 1 --vocab -o "$W/flash16.gguf" > "$OUT/synth.log" 2>&1 || { tail -3 "$OUT/synth.log"; return 1; }; }
}
if want speed; then
  corpus || exit 1
  step "flash16: plain prefill of $CTX tokens, then collect --ctx $CTX --hooks $HOOKS --backend cuda"
  timeout 200 build/cuda-"$ARCH"/ds4_bench --model "$W/flash16.gguf" --backend cuda --reps 3 --decode 2 --prefill "$CTX" \
    > "$OUT/bench-prefill.log" 2>&1
  grep -E '^prefill' "$OUT/bench-prefill.log"
  rm -rf "$W/ds-speed"
  timeout 500 ./ds4 collect -m "$W/flash16.gguf" -i "$W/corpus.txt" -o "$W/ds-speed" --hooks "$HOOKS" --ctx "$CTX" \
    --tokens "${COLLECT_TOKENS:-409600}" --backend cuda --format "${COLLECT_FORMAT:-arrow}" > "$OUT/collect-speed.log" 2>&1
  echo "collect rc $?"; grep -E 'collect: shard' "$OUT/collect-speed.log" | tail -1; tail -1 "$OUT/collect-speed.log"
  du -sb "$W/ds-speed" | awk '{printf "dataset: %.3f GB on disk\n", $1 / 1e9}'; ls "$W/ds-speed" | head -3
  rm -rf "$W/ds-speed"
fi
if want resume; then
  corpus || exit 1
  step "flash16: collect of ${RESUME_TOKENS:-65536} tokens, uninterrupted against SIGTERM after ${KILL_SHARDS:-2} shards and resumed"
  rm -rf "$W/ds-a" "$W/ds-b"
  args=(-m "$W/flash16.gguf" -i "$W/corpus.txt" --hooks "$HOOKS" --ctx "$CTX" --tokens "${RESUME_TOKENS:-65536}"
        --shard-rows 8 --backend cuda)
  timeout 300 ./ds4 collect "${args[@]}" -o "$W/ds-a" > "$OUT/resume-a.log" 2>&1; echo "uninterrupted rc $?"
  timeout 300 ./ds4 collect "${args[@]}" -o "$W/ds-b" > "$OUT/resume-b1.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ "$(grep -c 'collect: shard' "$OUT/resume-b1.log")" -lt "${KILL_SHARDS:-2}" ]; do sleep 0.2; done
  kill -TERM "$pid" 2>/dev/null; wait "$pid"; echo "killed run rc $? ($(tail -1 "$OUT/resume-b1.log"))"
  timeout 300 ./ds4 collect "${args[@]}" -o "$W/ds-b" > "$OUT/resume-b2.log" 2>&1; echo "resumed rc $? ($(grep -c . "$OUT/resume-b2.log") lines)"
  if diff -r "$W/ds-a" "$W/ds-b" > /dev/null; then echo "resume: the resumed dataset equals the uninterrupted one ($(ls "$W/ds-a" | wc -l) files)";
  else echo "resume: DATASETS DIFFER"; diff -rq "$W/ds-a" "$W/ds-b" | head -5; fi
  rm -rf "$W/ds-a" "$W/ds-b"
fi
