#!/usr/bin/env bash
# gpu-hooks-hang.sh -- does a prompt through a small hook ring ever stop?  Builds this tree and
# each tree of TREES (space-separated directories, e.g. `git archive REV` unpacked) side by side,
# with bench/spin_wait.cu, and runs spin_wait's three modes (copy, nocopy, room: whether a kernel
# spinning for another thread's copy stops a process whose main thread issues launches behind it,
# without the engine).  Then HANG_RUNS (4) rounds, the trees in turn: small, a 512-token prompt + 4 steps, every hook,
# DS4_HOOKS_RING_MB=HANG_RING (2), eager, under HANG_LIMIT (15) s.  Each run: its rc (124:
# stopped by the limit), seconds and the hooks' stats line.  A stopped run's threads are shown
# first (gdb's backtraces where gdb is installed, else each thread's wchan and kernel stack).
# Logs under $OUT.
#   [TREES="DIR ..."] bash scripts/gpu-hooks-hang.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-build/gpu-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-sm_90}
T=${TMPDIR:-/tmp}/gpu-hang; mkdir -p "$T"
DIRS=". ${TREES:-}"
echo "=== build: $DIRS ($(date -u +%H:%M:%S))"
pids=""
for d in $DIRS; do
  (cd "$d" && make cuda CUDA_ARCH="$ARCH") > "$OUT/build-$(basename "$(cd "$d" && pwd)").log" 2>&1 & pids="$pids $!"
done
make --no-print-directory build/cuda-"$ARCH"/spin_wait CUDA_ARCH="$ARCH" > "$OUT/build-spin.log" 2>&1 & pids="$pids $!"
for p in $pids; do wait "$p" || { echo "a build failed:"; tail -20 "$OUT"/build-*.log; exit 1; }; done
echo "=== spin_wait ($(date -u +%H:%M:%S))"
for m in copy nocopy room; do
  build/cuda-"$ARCH"/spin_wait $m 20 4000 16 20 2 2>&1 | tail -1
  echo "spin_wait $m: rc ${PIPESTATUS[0]}"
done
./ds4 synth --config small --seed 1 --type f32 -o "$T/small.gguf" > /dev/null 2>&1 || { echo "synth failed"; exit 1; }
P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(512)))")
echo "=== runs ($(date -u +%H:%M:%S)); gdb: $(command -v gdb || echo none)"
for r in $(seq 1 "${HANG_RUNS:-4}"); do
  for d in $DIRS; do
    name=$(basename "$(cd "$d" && pwd)")
    log="$OUT/run-$name-$r.log"; t0=$(date +%s.%N)
    env $(env | grep -o '^DS4_[A-Z_]*' | sed 's/^/-u /') DS4_HOOKS=attn,resid,moe,logits,attn_probs \
      DS4_HOOKS_OUT="$T/h.ds4h" DS4_HOOKS_RING_MB="${HANG_RING:-2}" \
      "$d/ds4" -m "$T/small.gguf" --backend cuda --tokens "$P" -n 4 --stats > "$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 $(( ${HANG_LIMIT:-15} * 5 ))); do kill -0 $pid 2> /dev/null || break; sleep 0.2; done
    if kill -0 $pid 2> /dev/null; then
      { echo "--- $name run $r stopped: threads"
        if command -v gdb > /dev/null; then timeout 30 gdb -batch -p $pid -ex "thread apply all bt" 2>&1 | grep -E '^#|^Thread' | head -80
        else for t in /proc/$pid/task/*; do echo "$t $(cat $t/comm) $(cat $t/wchan)"; cat $t/stack 2> /dev/null | head -6; done; fi
      } > "$OUT/stuck-$name-$r.log" 2>&1
      kill -9 $pid 2> /dev/null; wait $pid 2> /dev/null; rc=124
    else wait $pid; rc=$?; fi
    echo "$name run $r: rc $rc, $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }") s, $(grep -h 'stats: hooks:' "$log" | head -1)"
    [ -f "$OUT/stuck-$name-$r.log" ] && head -40 "$OUT/stuck-$name-$r.log"
  done
done
rm -rf "$T"
