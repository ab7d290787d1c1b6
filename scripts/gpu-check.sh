#!/usr/bin/env bash
# One command for the GPU machine: build with its nvcc, run every GPU test and the
# benchmarks, write logs under $OUT (default build/gpu-out), print a short table last.
#
#   scripts/gpu-check.sh [WHAT ...]      (default all; several WHATs run in the order below)
#
#   test      backend ops (CUDA vs CPU), the embedded default on CUDA, GPU pytest
#   hf        transformers float64 oracle on the carried llama.cpp token sequences
#   sanitize  compute-sanitizer memcheck/racecheck/synccheck (scripts/sanitize-gpu.sh)
#   spot      flash16 CUDA vs CPU logits, Q8_0 at the full Flash shape (tests/spot_check.c)
#   bench     copy bandwidth, ds4_bench on flash16, flash-q2@256 and flash-q4@128 (the published
#             files' layouts at the largest expert counts an H200 holds), then tiny and small; tiny
#             eager against DS4_CUDA_GRAPHS=1 (2 rounds) and bench/launch_floor (per-kernel floors)
#   kernels   scripts/kernel_report.sh flash16 and flash-q2@64, build/cuda-$ARCH/matvec_table
#   series    the patch series (patches/): the stage before the newest (scripts/series.sh tree -1)
#             built for CUDA beside HEAD; CUDA logits (32 prompt tokens + 1000 decode steps on tiny
#             and small, 300 on other) under it, HEAD and HEAD with DS4_CUDA_GRAPHS=1 must be
#             byte-identical (and with DS4_CUDA_GRAPH_LAYERS=1 and 4), and so must the flash16 spot
#             check's CUDA logits (a few minutes: the CPU reference runs in each build); HEAD's
#             decode waits and graph counters (ds4 --stats); flash16 decode tok/s of both (and of
#             HEAD with graphs), side by side (SERIES_SPOT=0: no spot check, =cuda: its CUDA side only; SERIES_BENCH=N rounds, 0: none)
#   hooks     the CUDA hook emitter (stage 3): GPU pytest -k hooks (logits and streams eager vs graphs,
#             CUDA vs CPU values, >= 10^6 records lossless under a throttled drain, exact drops),
#             memcheck with every hook on (eager, graphs), the pinned copy bandwidth, flash16 decode
#             with graphs and hooks off / attn / all but attn_probs side by side (2 rounds), and the
#             drain on a 4096-token prefill with resid against the same prefill without hooks
#             (HOOKS_BENCH=0: the pytest and the memcheck runs only)
#   cli       the program on a GPU: the CUDA dump equals the CPU's greedy tokens path with hooks and
#             graphs on, a failed CUDA run leaves an earlier hook stream and dump byte for byte, ds4
#             info's backends column, and the load-time NaN/Inf scan's cost on flash16 (ds4 info,
#             which parses and scans, against a CUDA run's load, weights uploaded)
#   mtp       the MTP block (patch 0025) on CUDA: small with and without it (ds4 synth --mtp), a
#             300-token prompt + 32 greedy steps: the CUDA logits byte-identical (the block goes up
#             with the model and is not run), ds4 info's line; then speculative decoding on CUDA:
#             test_rollback cuda (eager and with graphs: the rollback, the head fed from its queue),
#             tests/test_mtp_cuda.py (MTP_PYTEST=0: skip; MTP_PYTEST_K: its -k; TEST_MTP_CUDA_STEPS),
#             and the speed on MTP_MODELS (default "flash16 flash-q2@64"; empty: none), each written
#             with an MTP block: plain greedy decoding with graphs, then --mtp-draft D = 1, 2, 3 (MTP_DS)
#             with DS4_MTP_FORCE at P = 0, 0.5, 0.8, 1 (MTP_PS), each with DS4_CUDA_DECODE_GROUP = 1
#             (MTP_GROUPS="1 0": both, side by side) (MTP_N steps, default 256; graphs on)
#   long      chunked prefill (patch 0007): flash16 declared with a 262144-token context, prefill of
#             512..65536 tokens (LONG_PREFILL) in DS4_UBATCH chunks and 64 decode steps with graphs at
#             that depth, device memory; the prefill of 16384 tokens in chunks of 1024..8192
#             (LONG_UBATCH, empty: none); llama.cpp at LONG_PEER_LEN (LONG_PEER=1, .peer carried);
#             slim with a 1M context (LONG_1M=0: skip): 1,000,000 prompt positions on CUDA in chunks
#             then 64 decode steps with graphs, finite logits, its last 1000 prompt rows against the
#             CPU backend's; every launch's grid against the device limits at 1M positions in
#             chunks of 65535 (LONG_BOUNDS=0: skip); compute-sanitizer memcheck and racecheck on
#             chunks of 7 (LONG_SAN=0: skip)
#   all       all of these: build, test, hf, sanitize, spot, bench flash16, kernels, bench tiny+small
#
# Rough times on one H200: build ~1 min, test ~2 min, sanitize a few minutes (19 runs, 3 at
# once, each limited to 300 s), spot 1-3 min (builds flash16 twice in host memory, 52 GB),
# bench ~2 min.  `all` can run past a 10-minute command limit: run the WHATs separately there.
#
# Expects (carried from the development machine, because the GPU machine has no network):
#   build/carry/other.gguf                 the gguf-py-written model (tests/oracle/write_gguf_ggufpy.py)
#   build/carry/qo-{q2,q4}-ggml.gguf       small-q2/q4 with libggml-quantised experts (test_quant_oracle)
#   build/carry/{tiny,small}.llama.ds4logit llama.cpp dumps whose tokens the HF oracle replays
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# Logs go to $OUT/gpu-check/ and are packed into $OUT/gpu-check.tar.gz at exit (the device
# tool returns at most 8 files); without $OUT they stay in build/gpu-out/.
if [ -n "${OUT:-}" ]; then
  FINAL=$OUT; OUT=$OUT/gpu-check
  # files over 15 MiB are left out, each named on stdout: the device tool brings back at most
  # 16 MiB a file, and an oversized pack would lose every log of the run
  trap 'find "$OUT" -type f -size +15M -printf "gpu-check: left out of the pack (over 15 MiB): %p\n" -delete;
        tar czf "$FINAL/gpu-check.tar.gz" -C "$OUT" . && rm -rf "$OUT"' EXIT
else
  OUT=build/gpu-out
fi
mkdir -p "$OUT" build/test-out
rm -f "$OUT/table.txt"      # this run's rows only (build/gpu-out persists between runs)
WHAT=" ${*:-all} "
for w in $WHAT; do
  case "$w" in all|test|hf|sanitize|spot|bench|kernels|series|hooks|cli|long|mtp) ;;
    *) echo "gpu-check: unknown WHAT '$w' (all, test, hf, sanitize, spot, bench, kernels, series, hooks, cli, long, mtp)"; exit 2 ;; esac
done
want() { [[ "$WHAT" == *" all "* || "$WHAT" == *" $1 "* ]]; }
ARCH=${CUDA_ARCH:-sm_90}
PY=python3
declare -a TABLE
row() { TABLE+=("$1"); }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
# last_or PATTERN FILE FALLBACK: the last line of FILE matching PATTERN, else FALLBACK
last_or() { local l; l=$(grep -E "$1" "$2" 2>/dev/null | tail -1); echo "${l:-$3}"; }
# measure_bw: the device's copy bandwidth into $BW (once per run)
measure_bw() {
  [ -n "${BW:-}" ] && return
  step "copy bandwidth"
  build/cuda-"$ARCH"/bandwidth | tee "$OUT/bandwidth.log"
  BW=$(awk '/copy_bw_GBps/ {print $2}' "$OUT/bandwidth.log")
  row "copy bandwidth: ${BW:-?} GB/s (read+write)"
}
# bench_model MODEL LIMIT_S [PREFILLS]: one ds4_bench run, its RESULT lines appended to the table
bench_model() {
  step "bench $1"
  timeout "$2" build/cuda-"$ARCH"/ds4_bench --model "$1" --backend cuda --reps 5 --decode 32 --prefill "${3:-512,4096}" \
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
make --no-print-directory build/cuda-"$ARCH"/test_backend_ops build/cuda-"$ARCH"/ds4_bench build/cuda-"$ARCH"/bandwidth \
    build/cuda-"$ARCH"/launch_floor CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build ok"
cp -f build/carry/*.gguf build/test-out/ 2>/dev/null || true

if want test; then
  step "backend ops: CUDA vs CPU"
  build/cuda-"$ARCH"/test_backend_ops 2>&1 | tee "$OUT/ops.log" | tail -60
  row "ops:     $(tail -1 "$OUT/ops.log")"

  step "embedded default on CUDA"
  ./ds4 --backend cuda -p "Once upon a time" -n 64 2>&1 | tee "$OUT/run.log"

  step "GPU pytest (CUDA vs CPU logits, determinism)"
  TEST_DS4_CUDA_BIN=$PWD/ds4 PYTHONUNBUFFERED=1 timeout 150 $PY -m pytest -q -rs -s tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
  row "pytest:  $(tail -1 "$OUT/pytest-gpu.log")"
  grep -E "max \|dlogit\|" "$OUT/pytest-gpu.log" | sed 's/^/gpu-vs-cpu: /' >> "$OUT/table.txt"
fi

if want hf; then
  step "transformers oracle (float64) on the llama.cpp token sequences"
  for m in tiny small; do
    [ -f build/carry/$m.llama.ds4logit ] || continue
    ./ds4 synth --config $m --seed 1 --type f32 -o build/test-out/$m.gguf > /dev/null 2>&1
    PYTHONUNBUFFERED=1 timeout 100 $PY tests/oracle/hf_oracle.py -m build/test-out/$m.gguf \
       --tokens-from build/carry/$m.llama.ds4logit -o "$OUT/$m.hf.ds4logit" 2>&1 | tail -4 | tee "$OUT/hf-$m.log"
    row "hf $m:  $(grep -F 'max |dlogit|' "$OUT/hf-$m.log" | tail -1)"
  done
fi

if want sanitize; then
  step "compute-sanitizer: memcheck, racecheck, synccheck on tiny/small/other/small-q2/small-q4; test_backend_ops under memcheck"
  SANITIZE_BIN=$PWD/ds4 CUDA_ARCH="$ARCH" timeout "${SANITIZE_LIMIT:-1800}" bash scripts/sanitize-gpu.sh \
      --out "$OUT/sanitize" 2>&1 | tee "$OUT/sanitize.log"
  src=${PIPESTATUS[0]}
  row "$(last_or '^sanitizer:' "$OUT/sanitize.log" "sanitizer: no result (rc $src; see sanitize.log)")"
  while IFS= read -r l; do row "  $l"; done < <(grep -E ' (FAIL|TIMEOUT) \(|^SKIP ' "$OUT/sanitize.log" | sed 's/ logs: .*//')
fi

if want spot; then
  step "flash16 spot check: CUDA vs CPU logits (Q8_0, 8 prompt + 8 teacher-forced steps, in memory)"
  make --no-print-directory build/cuda-"$ARCH"/spot_check CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1
  timeout "${SPOT_LIMIT:-600}" build/cuda-"$ARCH"/spot_check --model flash16 --type q8_0 2>&1 | tee "$OUT/spot.log"
  src=${PIPESTATUS[0]}
  row "flash16 $(last_or '^spot: (PASS|FAIL)' "$OUT/spot.log" "spot: no result (rc $src; see spot.log)")"
fi

if want bench; then
  measure_bw
  bench_model flash16 200      # first: the model the goals are about
  bench_model flash-q2@256 240 512
  bench_model flash-q4@128 240 512
fi

if want kernels; then
  step "kernel report (flash16) and matvec table"
  measure_bw
  if [ -f scripts/kernel_report.sh ]; then
    timeout 300 bash scripts/kernel_report.sh flash16 "$OUT" 2>&1 | tee "$OUT/kernel-report.log"
    PLAIN=0 timeout 200 bash scripts/kernel_report.sh flash-q2@64 "$OUT" 2>&1 | tee "$OUT/kernel-report-q2.log" | tail -25
    krc=${PIPESTATUS[0]}
    # its footer: the last block of non-empty lines it printed (at most 12)
    awk 'NF == 0 {n = 0; next} {buf[n++] = $0} END {for (i = (n > 12 ? n - 12 : 0); i < n; i++) print buf[i]}' \
        "$OUT/kernel-report.log" | sed 's/^/kernels: /' >> "$OUT/table.txt"
    [ "$krc" -eq 0 ] || row "kernels: kernel_report.sh rc $krc$([ "$krc" -eq 124 ] && echo ' (timed out after 300 s)')"
  else
    row "kernels: scripts/kernel_report.sh absent, skipped"
  fi
  make --no-print-directory build/cuda-"$ARCH"/matvec_table CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 || true
  if [ -x build/cuda-"$ARCH"/matvec_table ]; then
    timeout 300 build/cuda-"$ARCH"/matvec_table --copy-bw "${BW:-0}" 2>&1 | tee "$OUT/matvec_table.log"
    mrc=${PIPESTATUS[0]}
    row "matvec_table: rc $mrc$([ "$mrc" -eq 124 ] && echo ' (timed out after 300 s)'), output in matvec_table.log"
  else
    row "matvec_table: build/cuda-$ARCH/matvec_table not built, skipped"
  fi
fi

if want series; then
  # HEAD against the stage before it: the baseline with every patch but the newest
  # (scripts/series.sh tree -1); each earlier stage was checked the same way against its own
  # predecessor when it was the newest (bench/RESULTS.md)
  step "series: the previous stage vs HEAD (DS4_CUDA_GRAPHS off / on), CUDA logits byte for byte"
  # SERIES_PREV=DIR: that tree, prepared elsewhere (scripts/series.sh tree -1 DIR), e.g. where
  # this checkout's git metadata is not its working tree's (a copied tree on the GPU machine)
  SB=build/series-prev
  # SERIES_HEAD_ENV="VAR=V ...": set for HEAD's runs only (a knob the previous tree does not know,
  # e.g. DS4_CUDA_PREFILL_TC=0 against a tree from before the prefill engine)
  HEADENV="${SERIES_HEAD_ENV:-}"
  rm -rf "$SB"
  if { if [ -n "${SERIES_PREV:-}" ]; then cp -a "$SERIES_PREV" "$SB" && rm -rf "$SB/build" && echo "series: $SERIES_PREV"; \
       else bash scripts/series.sh tree -1 "$SB"; fi; } > "$OUT/series.log" 2>&1 \
     && (cd "$SB" && make cuda CUDA_ARCH="$ARCH" -j16 && make build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" -j16) >> "$OUT/series.log" 2>&1; then
    TOK=1,5,9,14,2,7,3,30,11,4,8,6,12,19,25,17,21,13,10,16,27,22,15,18,24,20,23,26,28,29,31,33
    # 32 prompt tokens + N decode steps: 1000 on tiny and small cross the window (32, 64), the
    # indexer's top-k threshold (8, 16 visible rows) and 8 ratio-128 emissions; 300 on other
    for m in tiny small other small-q2; do
      p=build/test-out/$m.gguf; n=1000
      case "$m" in tiny|small) ./ds4 synth --config "$m" --seed 1 --type f32 -o "$p" > /dev/null 2>&1 ;; other) n=300 ;;
        small-q2) ./ds4 synth --config "$m" --seed 1 -o "$p" > /dev/null 2>&1; n=300 ;; esac
      [ -f "$p" ] || { row "series $m: model missing ($p), skipped"; continue; }
      "$SB"/ds4 -m "$p" --backend cuda --tokens "$TOK" -n $n --dump-logits "$OUT/series-$m-prev.ds4logit" > /dev/null 2>&1
      env $HEADENV ./ds4 -m "$p" --backend cuda --tokens "$TOK" -n $n --dump-logits "$OUT/series-$m-head.ds4logit" > /dev/null 2>&1
      DS4_CUDA_GRAPHS=1 env $HEADENV ./ds4 -m "$p" --backend cuda --tokens "$TOK" -n $n --dump-logits "$OUT/series-$m-on.ds4logit" > /dev/null 2>&1
      DS4_CUDA_GRAPHS=1 DS4_CUDA_GRAPH_LAYERS=1 env $HEADENV ./ds4 -m "$p" --backend cuda --tokens "$TOK" -n $n --dump-logits "$OUT/series-$m-l1.ds4logit" > /dev/null 2>&1
      DS4_CUDA_GRAPHS=1 DS4_CUDA_GRAPH_LAYERS=4 env $HEADENV ./ds4 -m "$p" --backend cuda --tokens "$TOK" -n $n --dump-logits "$OUT/series-$m-l4.ds4logit" > /dev/null 2>&1
      same=1
      for v in head on l1 l4; do cmp -s "$OUT/series-$m-prev.ds4logit" "$OUT/series-$m-$v.ds4logit" || same=0; done
      if [ -s "$OUT/series-$m-prev.ds4logit" ] && [ $same = 1 ]; then
        row "series $m ($n steps): previous stage, HEAD, HEAD with DS4_CUDA_GRAPHS=1 (whole step, LAYERS=1, LAYERS=4) byte-identical ($(wc -c < "$OUT/series-$m-prev.ds4logit") bytes)"
      else
        row "series $m ($n steps): DUMPS DIFFER or missing (series-$m-{prev,head,on,l1,l4}.ds4logit)"
      fi
      rm -f "$OUT"/series-$m-*.ds4logit
      # the hook streams (every point but attn_probs), eager and with graphs, byte for byte
      same=1
      for g in 0 1; do
        for b in prev head; do
          bin="env $HEADENV ./ds4"; [ $b = prev ] && bin=$SB/ds4
          DS4_CUDA_GRAPHS=$g DS4_HOOKS=attn,resid,moe,logits DS4_HOOKS_OUT="$OUT/series-$m-$b-$g.ds4h" \
            $bin -m "$p" --backend cuda --tokens "$TOK" -n 200 > /dev/null 2>&1
        done
        [ -s "$OUT/series-$m-prev-$g.ds4h" ] && cmp -s "$OUT/series-$m-prev-$g.ds4h" "$OUT/series-$m-head-$g.ds4h" || same=0
      done
      cmp -s "$OUT/series-$m-head-0.ds4h" "$OUT/series-$m-head-1.ds4h" || same=0
      if [ $same = 1 ]; then
        row "series $m hooks (200 steps): previous stage and HEAD, eager and graphs, byte-identical streams ($(wc -c < "$OUT/series-$m-head-0.ds4h") bytes)"
      else
        row "series $m hooks (200 steps): STREAMS DIFFER or missing (series-$m-*.ds4h)"
      fi
      rm -f "$OUT"/series-$m-*.ds4h
    done
    # decode waits and allocations, counted by the backend (ds4 --stats)
    ./ds4 -m build/test-out/small.gguf --backend cuda --tokens "$TOK" -n 256 --stats 2>&1 >/dev/null | grep '^stats:' > "$OUT/series-stats.log"
    row "series waits (small, 256 steps): $(cat "$OUT/series-stats.log")"
    DS4_CUDA_GRAPHS=1 ./ds4 -m build/test-out/small.gguf --backend cuda --tokens "$TOK" -n 4096 --stats 2>&1 >/dev/null | grep '^stats:' > "$OUT/series-stats-graphs.log"
    row "series graphs (small, 4096 steps): $(tr '\n' ' ' < "$OUT/series-stats-graphs.log")"
    # the flash16 spot check (Q8_0, built in host memory): CUDA logits byte for byte
    # (SERIES_SPOT=0: skip it; SERIES_SPOT=cuda: --cuda-only, the CUDA side alone, greedy on
    # its own tokens, without the CPU reference's minutes in each build)
    if [ "${SERIES_SPOT:-1}" != 0 ]; then
    SPOTARGS=""; [ "${SERIES_SPOT:-1}" = cuda ] && SPOTARGS=--cuda-only
    make --no-print-directory build/cuda-"$ARCH"/spot_check CUDA_ARCH="$ARCH" -j16 >> "$OUT/series.log" 2>&1
    (cd "$SB" && make --no-print-directory build/cuda-"$ARCH"/spot_check CUDA_ARCH="$ARCH" -j16) >> "$OUT/series.log" 2>&1
    timeout "${SPOT_LIMIT:-600}" "$SB"/build/cuda-"$ARCH"/spot_check $SPOTARGS --dump-cuda "$OUT/series-spot-prev.f32" > "$OUT/series-spot-prev.log" 2>&1
    timeout "${SPOT_LIMIT:-600}" env $HEADENV build/cuda-"$ARCH"/spot_check $SPOTARGS --dump-cuda "$OUT/series-spot-head.f32" > "$OUT/series-spot-head.log" 2>&1
    DS4_CUDA_GRAPHS=1 timeout "${SPOT_LIMIT:-600}" env $HEADENV build/cuda-"$ARCH"/spot_check $SPOTARGS --dump-cuda "$OUT/series-spot-on.f32" > "$OUT/series-spot-on.log" 2>&1
    if [ -s "$OUT/series-spot-prev.f32" ] && cmp -s "$OUT/series-spot-prev.f32" "$OUT/series-spot-head.f32" \
       && cmp -s "$OUT/series-spot-prev.f32" "$OUT/series-spot-on.f32"; then
      row "series flash16 spot: previous stage, HEAD, HEAD+DS4_CUDA_GRAPHS=1 byte-identical ($(wc -c < "$OUT/series-spot-prev.f32") bytes)"
    else
      row "series flash16 spot: DUMPS DIFFER or missing (series-spot-*.log)"
    fi
    rm -f "$OUT"/series-spot-*.f32     # 16 x 129280 floats each: the verdict and logs stay
    fi
    for r in $(seq 1 "${SERIES_BENCH:-2}"); do   # side by side, alternating (medians of 3 reps each); head also with graphs
      for b in prev head graphs; do
        bin=build/cuda-"$ARCH"/ds4_bench; [ "$b" = prev ] && bin=$SB/$bin
        g=0; [ "$b" = graphs ] && g=1
        DS4_CUDA_GRAPHS=$g timeout 150 "$bin" --model flash16 --backend cuda --reps 3 --decode 32 --prefill 512 > "$OUT/series-bench-$b-$r.log" 2>&1
        row "series bench $b run $r: $(grep -o 'metric=decode_tok_s value=[0-9.]*' "$OUT/series-bench-$b-$r.log" || echo 'no result') $(grep -o 'metric=decode_waits.*' "$OUT/series-bench-$b-$r.log")"
      done
    done
  else
    tail -20 "$OUT/series.log"; row "series: the previous stage did not build (series.log)"
  fi
fi

if want hooks; then
  step "hooks: the CUDA emitter (DS4_HOOKS)"
  TEST_DS4_CUDA_BIN=$PWD/ds4 PYTHONUNBUFFERED=1 timeout 300 $PY -m pytest -q -rs -s tests/test_gpu.py -k hooks 2>&1 \
      | tee "$OUT/pytest-hooks.log" | tail -12
  row "hooks pytest: $(tail -1 "$OUT/pytest-hooks.log")"
  ./ds4 synth --config tiny --seed 1 --type f32 -o build/test-out/tiny.gguf > /dev/null 2>&1
  for g in 0 1; do
    DS4_CUDA_GRAPHS=$g DS4_HOOKS=attn,resid,moe,logits,attn_probs DS4_HOOKS_OUT="$OUT/san-hooks-$g.ds4h" timeout 300 \
      compute-sanitizer --tool memcheck --error-exitcode 1 ./ds4 -m build/test-out/tiny.gguf --backend cuda \
      --tokens 1,2,3,4,5,6,7,8 -n 130 > "$OUT/san-hooks-$g.log" 2>&1
    row "hooks memcheck (graphs=$g): rc $? $(grep -h 'ERROR SUMMARY' "$OUT/san-hooks-$g.log" | tail -1)"
    rm -f "$OUT/san-hooks-$g.ds4h"
  done
  if [ "${HOOKS_BENCH:-1}" != 0 ]; then
  measure_bw
  build/cuda-"$ARCH"/bandwidth 512 2>/dev/null | grep d2h_pinned | sed 's/^/hooks: /' >> "$OUT/table.txt"
  for r in 1 2; do
    for h in off attn most; do
      case $h in off) hk="" ;; attn) hk=attn ;; most) hk=attn,resid,moe,logits ;; esac
      env DS4_CUDA_GRAPHS=1 DS4_HOOKS_OUT=/dev/null ${hk:+DS4_HOOKS=$hk} timeout 120 build/cuda-"$ARCH"/ds4_bench \
          --model flash16 --backend cuda --reps 3 --decode 32 --prefill 512 > "$OUT/hooks-bench-$h-$r.log" 2>&1
      row "hooks bench $h run $r: $(grep -o 'metric=decode_tok_s value=[0-9.]*' "$OUT/hooks-bench-$h-$r.log" || echo 'no result') $(grep -o 'waits=.*' "$OUT/hooks-bench-$h-$r.log")"
    done
  done
  for h in off resid; do      # the drain when payload-bound, against the same prefill without hooks
    hk=""; [ $h = resid ] && hk=DS4_HOOKS=resid
    env DS4_HOOKS_OUT=/dev/null $hk timeout 200 \
        build/cuda-"$ARCH"/ds4_bench --model flash16 --backend cuda --reps 1 --decode 4 --prefill 4096 \
        > "$OUT/hooks-prefill-$h.log" 2>&1
    row "hooks prefill 4096 $h: $(grep -E '^prefill' "$OUT/hooks-prefill-$h.log" | tail -1) | $(grep -E '^hooks:' "$OUT/hooks-prefill-$h.log")"
  done
  fi
fi

if want bench; then
  bench_model tiny 60
  bench_model small 60
  # stage 2 on the smallest model: eager against DS4_CUDA_GRAPHS=1, side by side, and the
  # per-kernel floors that bound it (bench/launch_floor.cu)
  step "tiny: eager and graphs, and the launch floors"
  build/cuda-"$ARCH"/launch_floor 141 | tee "$OUT/launch-floor.log"
  grep _us_ "$OUT/launch-floor.log" | sed 's/^/launch floor (141 kernels): /' >> "$OUT/table.txt"
  for r in 1 2; do
    for g in 0 1; do
      DS4_CUDA_GRAPHS=$g timeout 60 build/cuda-"$ARCH"/ds4_bench --model tiny --backend cuda --reps 5 --decode 256 \
          --prefill 64 > "$OUT/bench-tiny-graphs$g-$r.log" 2>&1
      row "tiny DS4_CUDA_GRAPHS=$g run $r: $(grep -o 'metric=decode_tok_s value=[0-9.]*' "$OUT/bench-tiny-graphs$g-$r.log" || echo 'no result')"
    done
  done
fi

if want cli; then
  step "cli: the program on the GPU"
  C="$OUT/cli"; mkdir -p "$C"
  ./ds4 synth --config small --seed 1 --type f32 -o "$C/small.gguf" > /dev/null 2>&1
  DS4_CUDA_GRAPHS=1 DS4_HOOKS=attn,moe DS4_HOOKS_OUT="$C/keep.ds4h" ./ds4 -m "$C/small.gguf" --backend cuda \
      --tokens 1,2,3,4,5,6,7,8 -n 64 --stats --dump-logits "$C/keep.ds4logit" > "$C/text.txt" 2> "$C/run.log"
  row "cli cuda run: rc $? $(grep -c . "$C/text.txt") text line(s); $(grep '^ds4: hooks:' "$C/run.log" | sed 's/ written to .*//')"
  before=$(md5sum < "$C/keep.ds4h")$(md5sum < "$C/keep.ds4logit")
  # each a run that fails before it starts: too small a context, a token past the vocabulary,
  # a layer past the model, a device ring too small for attn_probs
  fails=("DS4_HOOKS=attn|-c 5" "DS4_HOOKS=attn|--tokens 99999" "DS4_HOOKS=attn:99|-n 2"
         "DS4_HOOKS=attn_probs DS4_HOOKS_RING_MB=1|-n 2 -c 2000000")
  for f in "${fails[@]}"; do
    env ${f%%|*} DS4_HOOKS_OUT="$C/keep.ds4h" ./ds4 -m "$C/small.gguf" --backend cuda ${f#*|} \
        --dump-logits "$C/keep.ds4logit" > /dev/null 2>> "$C/fail.log"
    rc=$?
    after=$(md5sum < "$C/keep.ds4h")$(md5sum < "$C/keep.ds4logit")
    row "cli failed run (${f%%|*} ${f#*|}): rc $rc, capture and dump $([ "$before" = "$after" ] && echo intact || echo CHANGED)"
  done
  ./ds4 -m "$C/small.gguf" --backend cpu --tokens 1,2,3,4,5,6,7,8 -n 64 -v > /dev/null 2> "$C/cpu.log"
  ./ds4 -m "$C/small.gguf" --backend cuda --tokens 1,2,3,4,5,6,7,8 -n 64 -v > /dev/null 2> "$C/cuda.log"
  row "cli greedy ids cpu vs cuda: $(cmp -s <(grep '^generated ids' "$C/cpu.log") <(grep '^generated ids' "$C/cuda.log") && echo identical || echo DIFFERENT)"
  ./ds4 info "$C/small.gguf" | grep -E '^(F32|I32) ' | sed 's/^/cli info: /' >> "$OUT/table.txt"
  ./ds4 synth --config small-q2 --seed 1 -o "$C/small-q2.gguf" > /dev/null 2>&1
  ./ds4 info "$C/small-q2.gguf" | grep -E '^(Q2_K|IQ2_XXS|Q8_0|F16) ' | sed 's/^/cli info: /' >> "$OUT/table.txt"
  # the load-time scan on flash16 (25 GB, Q8_0): ds4 info parses and scans; the run also uploads
  F=build/test-out/flash16.gguf
  [ -f "$F" ] || timeout 300 ./ds4 synth --config flash16 --seed 1 -o "$F" > "$C/synth.log" 2>&1
  for r in 1 2 3; do
    s0=$(date +%s%N); ./ds4 info "$F" > /dev/null; s1=$(date +%s%N)
    row "cli flash16 ds4 info (parse + scan) run $r: $(( (s1 - s0) / 1000000 )) ms"
  done
  ./ds4 -m "$F" --backend cuda --tokens 1,2,3 -n 1 2>&1 >/dev/null | grep '^speed' | sed 's/^/cli flash16 /' >> "$OUT/table.txt"
  rm -f "$F"
fi

if want long; then
  step "long: chunked prefill"
  make --no-print-directory build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1
  LP=${LONG_PREFILL:-512,4096,16384,65536}
  LD=${LP##*,}
  [ "${LONG_FLASH:-1}" = 0 ] || DS4_CUDA_GRAPHS=1 timeout "${LONG_LIMIT:-420}" build/cuda-"$ARCH"/ds4_bench --model flash16/262144 --backend cuda \
      --reps 1 --no-warmup --decode 64 --decode-after "$LD" --prefill "$LP" --ubatch "${LONG_UBATCH-1024,2048,4096,8192}" --ubatch-prompt 16384 \
      2>&1 | tee "$OUT/long-flash16.log"
  grep RESULT "$OUT/long-flash16.log" | sed 's/^RESULT /long: /' >> "$OUT/table.txt"
  # llama.cpp side by side at the lengths of LONG_PEER_LEN (default: the longest of LONG_PREFILL),
  # on the same weights written to a file (LONG_PEER=1; the peer folder carried as .peer:
  # cp -r ../shared/peer .peer).  run.sh times its prompt with llama.cpp's graphs on, then off.
  if [ "${LONG_PEER:-0}" = 1 ] && [ -f .peer/run.sh ]; then
    ./ds4 synth --config flash16 --ctx 262144 --seed 1 -o build/test-out/flash16-256k.gguf > /dev/null 2>&1
    for pl in $(echo "${LONG_PEER_LEN:-$LD}" | tr , ' '); do
      timeout "${LONG_PEER_LIMIT:-600}" bash .peer/run.sh build/test-out/flash16-256k.gguf "$pl" 64 1 2>&1 | tee "$OUT/long-peer-$pl.log"
      grep RESULT "$OUT/long-peer-$pl.log" | sed "s/^RESULT /long peer (llama.cpp, prompt $pl): /" >> "$OUT/table.txt"
    done
    rm -f build/test-out/flash16-256k.gguf
  fi
  if [ -n "${LONG_1M:-1}" ] && [ "${LONG_1M:-1}" != 0 ]; then
    # slim (tiny narrowed: 4 layers, 2 heads, one indexer head) declared with a 1M context, so that
    # the CPU half fits a call: its indexer and ratio-128 attention are quadratic in the position
    # (about 4 minutes of the 16 cores for 1M positions; tiny's 32 indexer heads would take hours).
    # LONG_1M_POS prompt positions (default 1,000,000), then 64 decode steps with graphs on CUDA;
    # the CPU backend prefills the same positions and the last 1000 prompt rows are compared.
    M1=${LONG_1M_MODEL:-slim}
    ./ds4 synth --config "$M1" --ctx 1048576 --seed 1 -o build/test-out/long-1m.gguf > /dev/null 2>&1
    $PY -c "import random; r=random.Random(5); open('build/test-out/p1m.txt','w').write(''.join(chr(32+r.randrange(95)) for _ in range(${LONG_1M_POS:-1000000})))"
    s0=$(date +%s)
    DS4_CUDA_GRAPHS=1 ./ds4 -m build/test-out/long-1m.gguf --backend cuda -f build/test-out/p1m.txt -n 64 \
        --dump-logits "$OUT/long-1m-cuda.ds4logit" --stats > /dev/null 2> "$OUT/long-1m-cuda.log"
    row "long $M1 1M cuda: rc $? in $(( $(date +%s) - s0 )) s; $(grep '^speed' "$OUT/long-1m-cuda.log")"
    s0=$(date +%s)
    timeout "${LONG_CPU_LIMIT:-420}" ./ds4 -m build/test-out/long-1m.gguf --backend cpu -f build/test-out/p1m.txt -n 0 \
        --dump-logits "$OUT/long-1m-cpu.ds4logit" > /dev/null 2> "$OUT/long-1m-cpu.log"
    row "long $M1 1M cpu: rc $? in $(( $(date +%s) - s0 )) s; $(grep '^speed' "$OUT/long-1m-cpu.log")"
    $PY - "$OUT/long-1m-cuda.ds4logit" "$OUT/long-1m-cpu.ds4logit" "$M1" <<'PYEOF' | tee -a "$OUT/table.txt"
import sys, numpy as np
def rows(p):
    h = np.fromfile(p, dtype=np.int32, count=8, offset=8)
    V, P, G, R = int(h[1]), int(h[2]), int(h[3]), int(h[4])
    off = 32 + 8 * R
    return P, G, np.memmap(p, dtype=np.float32, mode="r", offset=off, shape=(R, V))
Pa, Ga, a = rows(sys.argv[1])
fin = bool(np.isfinite(a).all())
print(f"long: {sys.argv[3]} 1M prompt {Pa} + {Ga} decode rows (cuda, graphs) all finite: {fin}")
try:
    Pb, Gb, b = rows(sys.argv[2])
except Exception as e:
    sys.exit(f"long: no cpu dump to compare ({e})")
x, y = a[Pa - 1000:Pa].astype(np.float64), b[Pb - 1000:Pb].astype(np.float64)
m = np.abs(x - y).max(axis=1)
print(f"long: {sys.argv[3]} last 1000 prompt rows (positions {Pa - 1000}..{Pa - 1}) cuda vs cpu: max|d| {m.max():.3g}, "
      f"median row max {np.median(m):.3g}, rows above the 5e-5 bound {int((m > 5e-5).sum())}, "
      f"argmax differ {int((x.argmax(1) != y.argmax(1)).sum())} ({'ok' if m.max() <= 5e-5 else 'ABOVE'})")
PYEOF
    rm -f "$OUT"/long-1m-*.ds4logit
  fi
  # Launch bounds at the largest shapes (LONG_BOUNDS=0: skip): slim's 1M context in chunks of
  # DS4_UBATCH_MAX (65535) tokens, then decode steps with graphs, every launch written by
  # DS4_LAUNCH_TRACE; each grid must be within the device's limits (x < 2^31, y and z <= 65535,
  # 1024 threads a block), and the largest grid.y/z seen must be the chunk's 65535 (planted).
  if [ "${LONG_BOUNDS:-1}" != 0 ]; then
    ./ds4 synth --config slim --ctx 1048576 --seed 1 -o build/test-out/long-1m.gguf > /dev/null 2>&1
    [ -f build/test-out/p1m.txt ] || $PY -c "import random; r=random.Random(5); open('build/test-out/p1m.txt','w').write(''.join(chr(32+r.randrange(95)) for _ in range(1000000)))"
    s0=$(date +%s)
    DS4_UBATCH=65535 DS4_CUDA_GRAPHS=1 DS4_LAUNCH_TRACE="$OUT/long-bounds.trace" ./ds4 -m build/test-out/long-1m.gguf \
        --backend cuda -f build/test-out/p1m.txt -n 8 > /dev/null 2> "$OUT/long-bounds.log"
    row "long launch bounds (slim, 1M positions in chunks of 65535, 8 steps with graphs): rc $? in $(( $(date +%s) - s0 )) s"
    $PY - "$OUT/long-bounds.trace" <<'PYEOF' | tee -a "$OUT/table.txt"
import re, sys
n, bad, my, mx = 0, [], 0, 0
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"launch L(\d+) \S+ grid=(\d+),(\d+),(\d+) block=(\d+),(\d+),(\d+) smem=(\d+)", line)
    if not m:
        continue
    L, gx, gy, gz, bx, by, bz, smem = map(int, m.groups())
    n += 1
    my, mx = max(my, gy, gz), max(mx, gx)
    if not (1 <= gx < 2**31 and 1 <= gy <= 65535 and 1 <= gz <= 65535 and bx * by * bz <= 1024 and smem <= 232448):
        bad.append(line.strip()[:120])
ok = n > 0 and not bad and my == 65535
print(f"long: launch bounds: {n} launches traced, largest grid.x {mx}, largest grid.y/z {my} (the chunk: 65535), "
      f"{len(bad)} out of bounds {'ok' if ok else 'FAIL'}")
for b in bad[:5]:
    print("  out of bounds:", b)
PYEOF
    rm -f "$OUT/long-bounds.trace"
  fi
  # compute-sanitizer on a chunked prefill in chunks of 7 across the window (32), a ratio-128
  # boundary and the indexer's top-k (8 of the ratio-4 rows), then decode steps with graphs
  # (LONG_SAN=0: skip).  racecheck is the slow one: a shorter prompt that still crosses them.
  if [ "${LONG_SAN:-1}" != 0 ]; then
    ./ds4 synth --config tiny --seed 1 --type f32 -o build/test-out/tiny.gguf > /dev/null 2>&1
    for tool in memcheck racecheck; do
      n=300; g=40; [ $tool = racecheck ] && n=140 && g=4
      TOKS=$($PY -c "import random; r=random.Random(3); print(','.join(str(r.randrange(512)) for _ in range($n)))")
      DS4_UBATCH=7 DS4_CUDA_GRAPHS=1 timeout "${LONG_SAN_LIMIT:-300}" compute-sanitizer --tool $tool --error-exitcode 9 ./ds4 \
          -m build/test-out/tiny.gguf --backend cuda --tokens "$TOKS" -n $g > "$OUT/long-san-$tool.log" 2>&1
      row "long sanitize $tool (tiny, $n prompt tokens in chunks of 7, $g steps with graphs): rc $? $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/long-san-$tool.log" | tail -1)"
    done
  fi
fi

if want mtp; then
  step "the MTP block on CUDA: small with and without it"
  ./ds4 synth --config small --seed 1 -o build/test-out/mtp-plain.gguf > /dev/null 2>&1
  ./ds4 synth --config small --seed 1 --mtp -o build/test-out/mtp-block.gguf > /dev/null 2>&1
  TOKS=$($PY -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(300)))")
  for m in plain block; do
    timeout 120 ./ds4 -m build/test-out/mtp-$m.gguf --backend cuda --tokens "$TOKS" -n 32 \
      --dump-logits "$OUT/mtp-$m.ds4logit" > "$OUT/mtp-$m.log" 2>&1 || echo "mtp $m: rc $?"
  done
  grep 'MTP' "$OUT/mtp-block.log"
  if cmp -s "$OUT/mtp-plain.ds4logit" "$OUT/mtp-block.ds4logit"; then
    row "mtp: small's CUDA logits with and without the MTP block byte-identical ($(stat -c %s "$OUT/mtp-block.ds4logit") bytes)"
  else row "mtp: CUDA LOGITS DIFFER with the MTP block"; fi
  if [ "${MTP_PYTEST:-1}" != 0 ]; then
    step "speculative decoding on CUDA: tests/test_mtp_cuda.py"
    make --no-print-directory build/cuda-"$ARCH"/mtp_dump build/tests/mtp_dump build/cuda-"$ARCH"/test_rollback \
      CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 || echo "mtp: building mtp_dump or test_rollback failed"
    # the rollback and the head's queue on the GPU, eager and with graphs (the queued head's
    # calls of up to 4 rows then replay recordings, the host-fed ones run eagerly)
    for g in 0 1; do
      DS4_CUDA_GRAPHS=$g timeout 300 build/cuda-"$ARCH"/test_rollback cuda > "$OUT/mtp-rollback-g$g.log" 2>&1
      row "mtp: test_rollback cuda, graphs $g: rc $? $(tail -1 "$OUT/mtp-rollback-g$g.log")"
      grep FAIL "$OUT/mtp-rollback-g$g.log"
    done
    TEST_DS4_CUDA_BIN=$PWD/ds4 CUDA_ARCH="$ARCH" PYTHONUNBUFFERED=1 timeout "${MTP_PYTEST_LIMIT:-600}" \
      $PY -m pytest -q -rs -s tests/test_mtp_cuda.py ${MTP_PYTEST_K:+-k "$MTP_PYTEST_K"} > "$OUT/mtp-pytest.log" 2>&1
    tail -25 "$OUT/mtp-pytest.log"
    row "mtp pytest: $(tail -1 "$OUT/mtp-pytest.log")"
    grep -E "byte-identical to plain|the MTP head, cuda" "$OUT/mtp-pytest.log" | sed 's/^/mtp: /' >> "$OUT/table.txt"
  fi
  MTP_TOKS=$($PY -c "import random; r=random.Random(5); print(','.join(str(r.randrange(1000) + 1) for _ in range(64)))")
  for M in ${MTP_MODELS-flash16 flash-q2@64}; do
    T=${M//@/-}
    F=build/test-out/mtp-speed-$T.gguf
    step "speculative decoding speed: $M with an MTP block (graphs on, ${MTP_N:-256} steps)"
    [ -f "$F" ] || timeout 400 ./ds4 synth --config "$M" --seed 1 --mtp -o "$F" > "$OUT/mtp-synth-$T.log" 2>&1 \
      || { tail -3 "$OUT/mtp-synth-$T.log"; continue; }
    DS4_CUDA_GRAPHS=1 timeout 300 ./ds4 -m "$F" --backend cuda --tokens "$MTP_TOKS" -n "${MTP_N:-256}" -v --stats \
      > /dev/null 2> "$OUT/mtp-speed-$T-plain.log" || { tail -3 "$OUT/mtp-speed-$T-plain.log"; continue; }
    sed -n 's/^generated ids: //p' "$OUT/mtp-speed-$T-plain.log" > "$OUT/mtp-speed-$T.ref"
    PLAIN=$(sed -n 's/.*decode [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' "$OUT/mtp-speed-$T-plain.log")
    row "mtp speed $M: plain greedy with graphs $PLAIN tok/s"
    for D in ${MTP_DS:-1 2 3}; do
      for P in ${MTP_PS:-0 0.5 0.8 1}; do
        for G in ${MTP_GROUPS:-1}; do
          L="$OUT/mtp-speed-$T-D$D-P$P-G$G.log"
          DS4_CUDA_DECODE_GROUP=$G DS4_CUDA_GRAPHS=1 DS4_MTP_FORCE="$P:$OUT/mtp-speed-$T.ref" timeout 300 ./ds4 -m "$F" \
            --backend cuda --tokens "$MTP_TOKS" -n "${MTP_N:-256}" --mtp-draft "$D" --stats > /dev/null 2> "$L" \
            || echo "mtp $M D=$D P=$P G=$G: rc $?"
          S=$(sed -n 's/.*decode [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p' "$L")
          row "mtp speed $M D=$D P=$P DS4_CUDA_DECODE_GROUP=$G: ${S:-?} tok/s ($(awk -v s="${S:-0}" -v p="${PLAIN:-0}" 'BEGIN { printf "%.2f", p > 0 ? s / p : 0 }')x plain); $(grep -o 'stats: mtp: .*' "$L" | sed 's/^stats: mtp: //'); $(grep -o '[0-9]* captures.*fallbacks' "$L")"
        done
      done
    done
    # byte identity at the full shape: plain against --mtp-draft 3 with every draft forced right
    # (every check 4 rows); the first row that differs, when one does (MTP_DUMPS=0: skip)
    if [ "${MTP_DUMPS:-1}" != 0 ]; then
      DS4_CUDA_GRAPHS=1 timeout 300 ./ds4 -m "$F" --backend cuda --tokens "$MTP_TOKS" -n "${MTP_N:-256}" \
        --dump-logits "$OUT/mtp-dump-$T-plain.ds4logit" > /dev/null 2> "$OUT/mtp-dump-$T-plain.log"
      DS4_CUDA_GRAPHS=1 DS4_MTP_FORCE="1:$OUT/mtp-speed-$T.ref" timeout 300 ./ds4 -m "$F" --backend cuda \
        --tokens "$MTP_TOKS" -n "${MTP_N:-256}" --mtp-draft 3 --dump-logits "$OUT/mtp-dump-$T-D3.ds4logit" \
        > /dev/null 2> "$OUT/mtp-dump-$T-D3.log"
      row "mtp dump $M, plain against --mtp-draft 3 (P = 1): $($PY - "$OUT/mtp-dump-$T-plain.ds4logit" \
        "$OUT/mtp-dump-$T-D3.ds4logit" <<'PYEOF'
import sys
sys.path.insert(0, "tests/oracle")
import numpy as np, ds4logit
a, b = ds4logit.read(sys.argv[1]), ds4logit.read(sys.argv[2])
n = min(len(a.logits), len(b.logits))
d = np.nonzero(np.any(a.logits[:n] != b.logits[:n], axis=1))[0]
if not d.size:
    print(f"byte-identical over {n} rows")
else:
    r = int(d[0])
    print(f"{d.size} of {n} rows differ, the first at row {r} (max |dlogit| "
          f"{float(np.abs(a.logits[r].astype(np.float64) - b.logits[r]).max()):.3g}, argmax {int(a.argmax[r])} / {int(b.argmax[r])})")
PYEOF
)"
      rm -f "$OUT"/mtp-dump-"$T"-*.ds4logit   # ~165 MB each at Flash's vocabulary: not packed
    fi
    rm -f "$F"
  done
  rm -f "$OUT"/mtp-plain.ds4logit "$OUT"/mtp-block.ds4logit
fi

echo
echo "================ summary ($(git rev-parse --short HEAD 2>/dev/null || echo nogit), $(date -u +%F))"
for r in "${TABLE[@]}"; do echo "$r"; done
if [ -f "$OUT/table.txt" ]; then cat "$OUT/table.txt"; fi
