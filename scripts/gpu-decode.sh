#!/usr/bin/env bash
# gpu-decode.sh -- one GPU run for the decode work (issue 26): build, then the steps named, logs
# under $OUT (small files only: the device tool brings back at most 16 MiB a file).
#   same:  CUDA logits with DS4_CUDA_SHARED_STREAM=1 against 0 (the shared expert beside the
#          routed experts and the compressors and indexer beside the queries, or all in order),
#          byte for byte: SAME_MODELS (config/type) with a 300-token prompt + 64 greedy steps,
#          graphs off and on; then tiny and small written with an MTP block, --mtp-draft 3 with
#          DS4_MTP_FORCE=0.5 (checks of 1..4 rows), graphs on.
#   speed: ds4_bench --decode 64 --reps 3 (--prefill 64) on SPEED_MODELS (flash16 flash-q2@64),
#          DS4_CUDA_SHARED_STREAM 0 and 1 alternating, SPEED_ROUNDS (2) rounds, graphs on
#          (SPEED_GRAPHS="1 0": eager too).
#   hooks: ds4_bench as speed on flash16 with graphs, DS4_HOOKS=attn (to /dev/null) against none,
#          for each DS4_CUDA_SHARED_STREAM value of HOOKS_S ("1"), HOOKS_ROUNDS (1) rounds alternating.
#   vs:    PREV=DIR, another tree (e.g. `git archive REV` unpacked), built beside this one: CUDA
#          logits of both on small Q8_0 (300-token prompt + 64 steps, graphs on) byte for byte,
#          then ds4_bench as speed on VS_MODELS (flash16), PREV and this tree alternating,
#          VS_ROUNDS (2) rounds, graphs on.
#   san:   compute-sanitizer's SAN_TOOLS ("memcheck synccheck"; racecheck too) on a small prefill
#          + 24 steps, graphs on, DS4_CUDA_SHARED_STREAM=1.
#   mtp:   tests/test_mtp_cuda.py -k MTP_K (small_greedy) at TEST_MTP_CUDA_STEPS (1024), under
#          MTP_LIMIT (150) seconds.
#   whatif: this tree built again with -DDS4_WHATIF (in $TMPDIR), then ds4_bench --decode 64 --reps 3
#          (--prefill 512) on WHATIF_MODEL (flash16), graphs on, once for each entry of WHATIF_SETS
#          (space-separated WHATIF_SKIP lists of kernels, matvec modes and parts of k_hc_pre, see
#          DS4_LAUNCH in ds4_cuda_common.cuh; "-": none), with the full step ("-") first and last:
#          a step's time without each family of kernels, i.e. what that family costs on its
#          critical path.
#          For timing only: the dropped kernels' outputs are missing.  Then a table: each entry's
#          launches dropped, its step time, its cost to the step and that cost per launch.
#          WHATIF_ENV: VAR=VALUE words for every run (e.g. "DS4_HOOKS=attn DS4_HOOKS_OUT=/dev/null"
#          with the set k_hook_put: what the hooks' producers cost, apart from their forks and
#          joins).
#   probe: the what-if build's ds4_bench (--reps 1 --decode 64 --prefill 512, graphs on) once for
#          each WHATIF_SKIP list of PROBE_SKIP (space-separated; default hcp_probe: k_hc_pre's
#          timeline, printed by its finishing block), and the first PROBE_LINES (6) lines each
#          printed.
#   The trees a run needs (this one; PREV for vs; a -DDS4_WHATIF copy for whatif and probe) are
#   built side by side before any step.
#   scripts/gpu-decode.sh [same] [speed] [hooks] [vs] [san] [mtp] [whatif] [probe]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-build/gpu-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-sm_90}
WHAT=" ${*:-same speed} "
want() { [[ "$WHAT" == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
T=${TMPDIR:-/tmp}/gpu-decode; mkdir -p "$T"
# The trees a run needs (this one, PREV for vs, a -DDS4_WHATIF copy for whatif and probe) build
# side by side: device time is short, and each build is mostly one nvcc process at a time.
build_tree() {   # DIR LOG [MAKE ARGS...]
  local dir=$1 log=$2; shift 2
  (cd "$dir" && make cuda CUDA_ARCH="$ARCH" "$@" && make --no-print-directory build/cuda-"$ARCH"/ds4_bench \
    CUDA_ARCH="$ARCH" "$@") > "$log" 2>&1
}
built() {        # PID LOG: that build's result; on a failure its log's end, the other builds stopped
  wait "$1" && return 0
  tail -30 "$2"; kill $(jobs -p) 2> /dev/null; exit 1
}
W="$T/whatif"
if want vs && [ ! -d "${PREV:-}" ]; then echo "vs: PREV=DIR (a tree to compare with) is not a directory"; exit 2; fi
step "build$(want vs && echo ", PREV (${PREV:-})")$( (want whatif || want probe) && echo ", the what-if copy ($W)")"
if want whatif || want probe; then
  rm -rf "$W"; mkdir -p "$W"
  tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$W"
  build_tree "$W" "$OUT/build-whatif.log" "NVCCFLAGS=-O3 -std=c++17 -lineinfo -DDS4_WHATIF" & B_W=$!
fi
if want vs; then build_tree "$PREV" "$OUT/build-prev.log" & B_PREV=$!; fi
build_tree . "$OUT/build.log" & B_THIS=$!
built $B_THIS "$OUT/build.log"
if want vs; then built $B_PREV "$OUT/build-prev.log"; fi
if want whatif || want probe; then built $B_W "$OUT/build-whatif.log"; fi
if want same; then
  step "CUDA logits, DS4_CUDA_SHARED_STREAM=1 against 0"
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(300)))")
  for m in ${SAME_MODELS:-small/q8_0 small-q2/}; do
    cfg=${m%%/*}; ty=${m#*/}
    ./ds4 synth --config "$cfg" --seed 1 ${ty:+--type $ty} -o "$T/m.gguf" > /dev/null 2>&1
    for g in 0 1; do
      for s in 0 1; do
        DS4_CUDA_GRAPHS=$g DS4_CUDA_SHARED_STREAM=$s timeout 120 ./ds4 -m "$T/m.gguf" --backend cuda --tokens "$P" -n 64 \
          --dump-logits "$T/s$s.ds4logit" > "$OUT/same-$cfg-g$g-s$s.log" 2>&1 || echo "$m graphs=$g S=$s: rc $?"
      done
      if cmp -s "$T/s0.ds4logit" "$T/s1.ds4logit"; then
        echo "$m graphs=$g: logits with DS4_CUDA_SHARED_STREAM=1 byte-identical to 0 ($(stat -c %s "$T/s1.ds4logit") bytes)"
      else echo "$m graphs=$g: LOGITS DIFFER: $(python3 tests/oracle/ds4logit.py compare "$T/s0.ds4logit" "$T/s1.ds4logit" \
          --tol 5e-5 2>&1 | tr '\n' ' ')"; fi
    done
  done
  Q=$(python3 -c "import random; r=random.Random(5); print(','.join(str(r.randrange(500) + 1) for _ in range(64)))")
  for cfg in tiny small; do
    ./ds4 synth --config $cfg --seed 1 --mtp -o "$T/mtp.gguf" > /dev/null 2>&1
    timeout 120 ./ds4 -m "$T/mtp.gguf" --backend cuda --tokens "$Q" -n 256 -v > /dev/null 2> "$OUT/mtp-$cfg-plain.log"
    sed -n 's/^.*generated ids: //p' "$OUT/mtp-$cfg-plain.log" > "$T/ref.txt"
    for s in 0 1; do
      DS4_CUDA_GRAPHS=1 DS4_CUDA_SHARED_STREAM=$s DS4_MTP_FORCE="0.5:$T/ref.txt" timeout 120 ./ds4 -m "$T/mtp.gguf" \
        --backend cuda --tokens "$Q" -n 256 --mtp-draft 3 --stats -v --dump-logits "$T/m$s.ds4logit" > /dev/null \
        2> "$OUT/mtp-$cfg-s$s.log" || echo "$cfg mtp S=$s: rc $?"
    done
    ids0=$(sed -n 's/^.*generated ids: //p' "$OUT/mtp-$cfg-s0.log"); ids1=$(sed -n 's/^.*generated ids: //p' "$OUT/mtp-$cfg-s1.log")
    echo "$cfg --mtp-draft 3 (P = 0.5, graphs): ids $([ -n "$ids1" ] && [ "$ids1" = "$(cat "$T/ref.txt")" ] && echo "equal to plain greedy" || echo "DIFFER from plain greedy")," \
      "S=1 vs S=0 ids $([ "$ids0" = "$ids1" ] && echo same || echo DIFFER), dumps $(cmp -s "$T/m0.ds4logit" "$T/m1.ds4logit" && echo byte-identical || echo DIFFER);" \
      "$(grep -o 'stats: mtp: .*' "$OUT/mtp-$cfg-s1.log" | head -1); $(grep -o '[0-9]* captures.*fallbacks' "$OUT/mtp-$cfg-s1.log" | head -1)"
  done
  rm -f "$T"/*.gguf "$T"/*.ds4logit
fi
if want speed; then
  step "decode speed, DS4_CUDA_SHARED_STREAM 0 and 1 alternating, ${SPEED_ROUNDS:-2} rounds"
  for m in ${SPEED_MODELS:-flash16 flash-q2@64}; do
    for g in ${SPEED_GRAPHS:-1}; do
      for r in $(seq 1 "${SPEED_ROUNDS:-2}"); do
        for s in 0 1; do
          L="$OUT/speed-$m-g$g-s$s-$r.log"
          DS4_CUDA_GRAPHS=$g DS4_CUDA_SHARED_STREAM=$s timeout 200 build/cuda-"$ARCH"/ds4_bench --model "$m" --backend cuda \
            --reps 3 --decode 64 --prefill 64 > "$L" 2>&1 || echo "$m g=$g s=$s: rc $?"
          echo "$m graphs=$g S=$s round $r: $(grep -E '^decode: median' "$L")"
        done
      done
    done
  done
fi
if want vs; then
  step "PREV against this tree: small Q8_0 logits, then decode speed (${VS_ROUNDS:-2} rounds alternating)"
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(300)))")
  ./ds4 synth --config small --seed 1 --type q8_0 -o "$T/vs.gguf" > /dev/null 2>&1
  for tree in prev this; do
    bin=./ds4; [ $tree = prev ] && bin=$PREV/ds4
    DS4_CUDA_GRAPHS=1 timeout 120 "$bin" -m "$T/vs.gguf" --backend cuda --tokens "$P" -n 64 \
      --dump-logits "$T/vs-$tree.ds4logit" > "$OUT/vs-$tree.log" 2>&1 || echo "vs $tree: rc $?"
  done
  if cmp -s "$T/vs-prev.ds4logit" "$T/vs-this.ds4logit"; then
    echo "small/q8_0 graphs: logits byte-identical to PREV's ($(stat -c %s "$T/vs-this.ds4logit") bytes)"
  else echo "small/q8_0 graphs: LOGITS DIFFER from PREV's"; fi
  rm -f "$T/vs.gguf" "$T"/vs-*.ds4logit
  for m in ${VS_MODELS:-flash16}; do
    for r in $(seq 1 "${VS_ROUNDS:-2}"); do
      for tree in prev this; do
        bin=build/cuda-"$ARCH"/ds4_bench; [ $tree = prev ] && bin=$PREV/build/cuda-"$ARCH"/ds4_bench
        L="$OUT/vs-$m-$tree-$r.log"
        DS4_CUDA_GRAPHS=1 timeout 200 "$bin" --model "$m" --backend cuda --reps 3 --decode 64 --prefill 64 > "$L" 2>&1 \
          || echo "$m $tree: rc $?"
        echo "$m graphs $tree round $r: $(grep -E '^decode: median' "$L")"
      done
    done
  done
fi
if want hooks; then
  step "flash16 decode with graphs, DS4_HOOKS=attn against none, S in ${HOOKS_S:-1}, ${HOOKS_ROUNDS:-1} rounds alternating"
  for r in $(seq 1 "${HOOKS_ROUNDS:-1}"); do
    for s in ${HOOKS_S:-1}; do
      for h in none attn; do
        L="$OUT/hooks-s$s-$h-$r.log"
        if [ $h = none ]; then DS4_CUDA_SHARED_STREAM=$s DS4_CUDA_GRAPHS=1 timeout 200 build/cuda-"$ARCH"/ds4_bench \
            --model flash16 --backend cuda --reps 3 --decode 64 --prefill 64 > "$L" 2>&1
        else DS4_CUDA_SHARED_STREAM=$s DS4_HOOKS=attn DS4_HOOKS_OUT=/dev/null DS4_CUDA_GRAPHS=1 timeout 200 \
            build/cuda-"$ARCH"/ds4_bench --model flash16 --backend cuda --reps 3 --decode 64 --prefill 64 > "$L" 2>&1; fi
        echo "flash16 graphs S=$s hooks=$h round $r: $(grep -E '^decode: median' "$L")"
      done
    done
  done
fi
if want whatif; then
  WM=${WHATIF_MODEL:-flash16}
  step "what-if: $WM decode steps with graphs, kernel families dropped (a -DDS4_WHATIF build; timing only)"
  SMALL=k_hc_pre,k_attention,k_attention_combine,k_head_norm_rope,k_moe_combine,k_compressor_step,k_indexer_scores,k_indexer_select
  SETS=${WHATIF_SETS:-"- mv_dense mv_gateup mv_down k_hc_pre k_attention k_attention_combine k_head_norm_rope k_moe_combine k_compressor_step k_indexer_scores,k_indexer_select $SMALL -"}
  i=0; rm -f "$OUT/whatif-runs.txt"
  for set in $SETS; do
    i=$((i + 1)); L="$OUT/whatif-$i.log"
    skip=$set; [ "$set" = - ] && skip=""
    env ${WHATIF_ENV:-} WHATIF_SKIP="$skip" DS4_CUDA_GRAPHS=1 timeout 200 "$W"/build/cuda-"$ARCH"/ds4_bench --model "$WM" --backend cuda \
      --reps 3 --decode 64 --prefill 512 > "$L" 2>&1 || echo "$set: rc $?"
    echo "dropped ${set}: $(grep -E '^decode: median' "$L" | sed 's/, 3 reps.*/)/') $(grep -o '[0-9]* nodes' "$L" | head -1)"
    echo "$set $(grep -oE '\(([0-9.]+) ms/token' "$L" | head -1 | tr -d '(') $(grep -oE '[0-9]+ nodes' "$L" | head -1)" \
      >> "$OUT/whatif-runs.txt"
  done
  # each family's cost to the step: the full step's time (the mean of its runs) less the step's without it
  python3 - "$OUT/whatif-runs.txt" <<'PY'
import sys
runs = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 5:
        runs.append((f[0], float(f[1]), int(f[3])))
full = [r for r in runs if r[0] == "-"]
if not full:
    sys.exit("whatif: no run of the full step")
ms0 = sum(r[1] for r in full) / len(full)
n0 = full[0][2]
print(f"| dropped | launches | ms a token | cost to the step (full: {ms0:.3f} ms, {n0} nodes) | a launch |")
print("|---|---:|---:|---:|---:|")
for name, ms, n in runs:
    if name == "-":
        continue
    k = n0 - n
    per = f"{(ms0 - ms) * 1e3 / k:.1f} us" if k > 0 else "-"
    print(f"| `{name}` | {k} | {ms:.3f} | {ms0 - ms:.2f} ms | {per} |")
PY
fi
if want probe; then
  n=0
  for ps in ${PROBE_SKIP:-hcp_probe}; do
    n=$((n + 1))
    step "what-if probe: WHATIF_SKIP=$ps, one ${WHATIF_MODEL:-flash16} decode run with graphs (the probe's lines)"
    WHATIF_SKIP="$ps" DS4_CUDA_GRAPHS=1 timeout 200 "$W"/build/cuda-"$ARCH"/ds4_bench \
      --model "${WHATIF_MODEL:-flash16}" --backend cuda --reps 1 --decode 64 --prefill 512 > "$OUT/probe-$n.log" 2>&1 \
      || echo "probe: rc $?"
    grep -E '_probe [0-9]+:' "$OUT/probe-$n.log" | head -"${PROBE_LINES:-6}"
  done
fi
if want whatif || want probe; then rm -rf "$W"; fi
if want san; then
  step "compute-sanitizer, small, graphs on, DS4_CUDA_SHARED_STREAM=1"
  ./ds4 synth --config small --seed 1 -o "$T/san.gguf" > /dev/null 2>&1
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(136)))")
  for tool in ${SAN_TOOLS:-memcheck synccheck}; do
    DS4_CUDA_GRAPHS=1 timeout "${SAN_LIMIT:-150}" compute-sanitizer --tool $tool --error-exitcode 9 ./ds4 -m "$T/san.gguf" --backend cuda \
      --tokens "$P" -n 24 > "$OUT/san-$tool.log" 2>&1
    echo "$tool: rc $? $(grep -h 'ERROR SUMMARY' "$OUT/san-$tool.log" | tail -1)"
  done
  rm -f "$T/san.gguf"
fi
if want mtp; then
  step "tests/test_mtp_cuda.py -k '${MTP_K:-small_greedy}' at ${TEST_MTP_CUDA_STEPS:-1024} steps"
  make --no-print-directory build/cuda-"$ARCH"/mtp_dump build/tests/mtp_dump CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1
  TEST_MTP_CUDA_STEPS=${TEST_MTP_CUDA_STEPS:-1024} TEST_DS4_CUDA_BIN=$PWD/ds4 CUDA_ARCH="$ARCH" PYTHONUNBUFFERED=1 \
    timeout "${MTP_LIMIT:-150}" python3 -m pytest -q -rs tests/test_mtp_cuda.py -k "${MTP_K:-small_greedy}" > "$OUT/mtp-pytest.log" 2>&1
  echo "rc $?"; tail -5 "$OUT/mtp-pytest.log"
fi
