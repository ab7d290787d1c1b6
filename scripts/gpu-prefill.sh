#!/usr/bin/env bash
# gpu-prefill.sh -- one GPU run for the prefill work (patches "prefill on tensor cores" and
# "prefill attention"): build, the backend-op tests, then flash16 (and flash-q2@64) prefill with
# DS4_CUDA_PREFILL_TC=0 (dequantise + cuBLAS) and 1 side by side (bench, q2), or with
# the DS4_CUDA_PREFILL_ATTN values of ATTN_MODES ("1 2": the f32 tiles and the tensor-core tiles;
# 0 is the per-token kernel) side by side (attn: ATTN_ROUNDS rounds, alternating), logs under $OUT.
# test runs test_backend_ops with OPS_ARGS (e.g. "att", "ix"; empty: every case).
# prof: ncu (clocks as found) on two k_attention_tiles launches (layers 2 and 3: ratio 4 and 128)
# and PROF_GEMMS k_tc_gemm launches of a flash16 prefill of PROF_N (4096) tokens; PROF_KERNELS
# ("NAME:SKIP:COUNT ...") names others.
# stall: ncu metrics of STALL_COUNT (2) launches of STALL_KERNEL (a regex on the demangled name,
# k_tc_gemm) after STALL_SKIP (40) in a STALL_MODEL (flash16) prefill: instructions per MMA,
# tensor pipe, shared-memory bank conflicts, L2 bytes and the sampled stall reasons.
# peak: bench/mma_peak (mma.sync f16 and s8 on every SM; wgmma f16 on an sm_90 card, also in
# k_tc_wgmma's pattern of exact sums with its folds: the products' ceiling); bench,
# attn, q2 and tcw then print each prefill's TFLOP/s as a share of the f16 peak of the
# instruction the run uses (ds4_bench --tc-peak: wgmma's for DS4_CUDA_PREFILL_TC=2 to 4).
# tcw: TCW_MODELS (flash16) prefill with the DS4_CUDA_PREFILL_TC values of TCW_PAIR ("1 2":
# k_tc_gemm, mma.sync, and k_tc_wgmma), TCW_ROUNDS (2) rounds alternating.
# vs, same: PREV=DIR, another tree (e.g. `git archive REV` unpacked), built beside this one; vs:
# VS_MODELS (flash16) prefill, PREV and this tree alternating VS_ROUNDS (2) rounds; same:
# CUDA logits of a 300-token prompt + 32 greedy steps on SAME_MODELS (config/type, default
# "small/q8_0 small/f16"; "small-q4/ flash-q2@16" for the super-block types: small-q2's Q2_K
# experts do not take the engine, flash-q2@16's do; its file goes to $TMPDIR) from both trees,
# compared byte for byte (for a change that keeps every sum).
# hooks: flash16 prefill with DS4_HOOKS=attn (to /dev/null) against none, HOOKS_ROUNDS (2) rounds; with
#   HOOKS_TREES="DIR ..." (other trees, e.g. `git archive REV` unpacked) their attn runs beside; with
#   HOOKS_RINGS="MiB ..." attn runs with those DS4_HOOKS_RING_MB beside.
# dprof: ncu sections (as prof) on the first launch of each kernel of DPROF_KERNELS (a regex list,
# default the decode step's non-matvec kernels) in one flash16 decode step (ds4_bench
# --profile-step, position 536 after a 512-token prefill).
# l2hot: bench/matvec_table (decode shapes) with weights from DRAM (the default rotation) and
# with --copies 1 (the same weights each call: from L2 where they fit), side by side.
# report: scripts/kernel_report.sh on a REPORT_MODEL (flash16) prefill of REPORT_N (4096) tokens, kernel
# by kernel, for each DS4_CUDA_PREFILL_TC value of REPORT_TC (4: the defaults; _ATTN the same, 2 at most), under REPORT_LIMIT
# (400) s.
# dreport: scripts/kernel_report.sh flash16 (one decode step, kernel by kernel) with PREV's
# ds4_bench and with this tree's, one after the other, then the two by kernel family side by
# side (kernel_table.py --before).
# exact: CUDA against the CPU on EXACT_MODELS (config/type, e.g. "small/q8_0 small-q4/"), the tree's
# prefill paths switched off and on.  tcsame: CUDA logits with DS4_CUDA_PREFILL_TC=1 against 0 on
# TCSAME_MODEL (flash-q2@16: the published layout's experts at Flash's shapes, where the CPU would
# take hours), written to $TMPDIR.  san: compute-sanitizer on prefills of SAN_MODELS and on
# test_backend_ops (SAN_OPS: 1 every case; tc, tc2, tc3, tc4 or pl2, as test_backend_ops takes them; 0 none).
# l2read: bench/l2_read (the SMs' read bandwidth from L2, ld.global.cg and cp.async).
# envsame: CUDA logits with the defaults and with each setting of ENVSAME (words VAR=VALUE, default
# "DS4_CUDA_PREFILL_TC=3") on ENVSAME_MODELS (config/type), a 300-token prompt + 32 greedy steps,
# byte for byte (for a switch that keeps every sum).
# planes: PLANES_MODELS (flash16) prefill with DS4_CUDA_PREFILL_PLANES 3 and 2, PLANES_ROUNDS (2)
# rounds alternating.  peer: llama.cpp and ds4 on the same file (see the step).
# pcstall: ncu's source counters on one launch of PCSTALL_KERNEL (a regex on the demangled name,
# k_tc_wgmma) after PCSTALL_SKIP (40) in a PCSTALL_MODEL (flash16) prefill of PROF_N (4096)
# tokens, then scripts/ncu_source_top.py on its SASS page: the warp samples per opcode and the
# PCSTALL_TOP (40) instructions sampled most, with their stall reasons.
# pwhatif: this tree built again with -DDS4_WHATIF (in $TMPDIR), then PWHATIF_MODEL (flash16)
# prefills of PWHATIF_N (512,4096) tokens (ds4_bench --reps 3, medians) once for each entry of
# PWHATIF_SETS (space-separated WHATIF_SKIP lists of kernels, see DS4_LAUNCH; "-": none; "ALL":
# every kernel of this tree's DS4_LAUNCH sites, which leaves the prefill's time outside them:
# cuBLAS, copies, fills, the host; "REST": all but k_tc_wgmma, k_attention_mma and the routing
# whose tables the products read: k_moe_gate, k_moe_route, k_moe_group, k_pair_rows), the full
# prefill ("-") first and last: what each family costs a prefill's wall clock.  For timing only:
# the dropped kernels' outputs are missing, and where those steer later work the cost mixes in
# the change: the indexer's (stale picks: its sets and REST read negative) and any kernel on
# the way to the router's input (hc_pre's: the tokens route alike, the experts' tiles fill).
#   scripts/gpu-prefill.sh [peak] [l2read] [test] [bench] [attn] [planes] [tcw] [q2] [hooks] [vs] [same] [envsame] [report] [prof] [dprof] [dreport] [l2hot] [stall] [pcstall] [exact] [tcsame] [san] [peer] [pwhatif]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-build/gpu-out}; mkdir -p "$OUT"
ARCH=${CUDA_ARCH:-sm_90}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)   # the ncu steps: prof, dprof, stall, pcstall
WHAT=" ${*:-test bench} "
want() { [[ "$WHAT" == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
step build
make cuda CUDA_ARCH="$ARCH" > "$OUT/build.log" 2>&1 &&
  make --no-print-directory build/cuda-"$ARCH"/test_backend_ops build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" \
    >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
if want vs || want same || want dreport; then
  [ -d "${PREV:-}" ] || { echo "vs/same: PREV=DIR (a tree to compare with) is not a directory"; exit 2; }
  step "build PREV ($PREV)"
  (cd "$PREV" && make cuda CUDA_ARCH="$ARCH" && make --no-print-directory build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH") \
    > "$OUT/build-prev.log" 2>&1 || { tail -30 "$OUT/build-prev.log"; exit 1; }
fi
PEAK=0
if want peak; then
  step "tensor-core peak (bench/mma_peak)"
  make --no-print-directory build/cuda-"$ARCH"/mma_peak CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 &&
    build/cuda-"$ARCH"/mma_peak | tee "$OUT/mma-peak.log"
  PEAK=$(awk '/^mma_f16_tflops/ {print $2}' "$OUT/mma-peak.log" 2>/dev/null); PEAK=${PEAK:-0}
  WPEAK=$(awk '/^wgmma_f16_tflops/ {print $2}' "$OUT/mma-peak.log" 2>/dev/null)
fi
if want test; then
  step "test_backend_ops ${OPS_ARGS:-}"
  timeout "${OPS_LIMIT:-240}" build/cuda-"$ARCH"/test_backend_ops ${OPS_ARGS:-} > "$OUT/ops.log" 2>&1
  echo "rc $?"; grep -E 'FAIL' "$OUT/ops.log" | head -20
  grep -E 'tensor|K=4096 N=1000|0/1-token|wide range' "$OUT/ops.log" | head -40
  grep -E '^attention.* (nt=(200|256|512|4096)|H=64 d=512)' "$OUT/ops.log" | head -40; tail -1 "$OUT/ops.log"
fi
bench() {   # MODEL TC PREFILLS REPS [ATTN [TAG]]
  local log="$OUT/bench-$1-tc$2${6:+-$6}.log" pk=$PEAK
  [ "$2" -ge 2 ] && [ -n "${WPEAK:-}" ] && pk=$WPEAK
  DS4_CUDA_PREFILL_TC=$2 DS4_CUDA_PREFILL_ATTN=${5:-2} timeout 300 build/cuda-"$ARCH"/ds4_bench --model "$1" \
     --backend cuda --reps "$4" --decode 8 --prefill "$3" --tc-peak "$pk" > "$log" 2>&1
  echo "$1 TC=$2 ATTN=${5:-2}: $(grep -E '^model|^prefill' "$log" | tr '\n' ' ')"
}
if want bench; then
  step "flash16 prefill, TC 0 vs 1"
  bench flash16 0 512,4096 3
  bench flash16 1 512,4096 3
fi
if want attn; then
  step "flash16 prefill, ATTN ${ATTN_MODES:-1 2} (TC 1)"
  for r in $(seq 1 "${ATTN_ROUNDS:-2}"); do
    for am in ${ATTN_MODES:-1 2}; do bench flash16 1 "${ATTN_PREFILLS:-512,4096}" 3 "$am" "attn$am-$r"; done
  done
fi
if want l2read; then
  step "L2 read bandwidth (bench/l2_read)"
  make --no-print-directory build/cuda-"$ARCH"/l2_read CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1 &&
    timeout 120 build/cuda-"$ARCH"/l2_read | tee "$OUT/l2read.log"
fi
if want planes; then
  step "prefill, DS4_CUDA_PREFILL_PLANES 3 and 2 (TC=4, ATTN=2), ${PLANES_ROUNDS:-2} rounds alternating"
  for m in ${PLANES_MODELS:-flash16}; do
    for r in $(seq 1 "${PLANES_ROUNDS:-2}"); do
      for pl in 3 2; do
        echo "planes $pl: $(DS4_CUDA_PREFILL_PLANES=$pl bench "$m" 4 "${PLANES_PREFILLS:-512,4096}" 3 2 "pl$pl-$r")"
      done
    done
  done
fi
if want tcw; then
  step "prefill, DS4_CUDA_PREFILL_TC ${TCW_PAIR:-1 2} (1 k_tc_gemm, 2 k_tc_wgmma), ${TCW_ROUNDS:-2} rounds alternating"
  for m in ${TCW_MODELS:-flash16}; do
    for r in $(seq 1 "${TCW_ROUNDS:-2}"); do
      for tc in ${TCW_PAIR:-1 2}; do bench "$m" $tc "${TCW_PREFILLS:-512,4096}" 3 2 "tcw-$r"; done
    done
  done
fi
if want q2; then
  step "flash-q2@64 prefill, TC 0 vs 1"
  bench flash-q2@64 0 512,4096 3
  bench flash-q2@64 1 512,4096 3
fi
if want hooks; then
  for d in ${HOOKS_TREES:-}; do   # other trees' attn runs beside this one's (their ds4_bench built side by side)
    (cd "$d" && make --no-print-directory build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH") > "$OUT/build-$(basename "$d").log" 2>&1 &
  done
  wait || true
  step "flash16 prefill with DS4_HOOKS=attn (DS4_HOOKS_OUT=/dev/null) and without, ${HOOKS_ROUNDS:-2} rounds alternating${HOOKS_TREES:+; attn also with $HOOKS_TREES}"
  for r in $(seq 1 "${HOOKS_ROUNDS:-2}"); do
    for h in off attn $(for m in ${HOOKS_RINGS:-}; do echo "ring$m"; done) ${HOOKS_TREES:-}; do
      bin=build/cuda-"$ARCH"/ds4_bench env=; [ $h = off ] || env="DS4_HOOKS=attn DS4_HOOKS_OUT=/dev/null"
      case $h in off|attn) ;; ring*) env="$env DS4_HOOKS_RING_MB=${h#ring}" ;; *) bin=$h/build/cuda-"$ARCH"/ds4_bench ;; esac
      log="$OUT/hooks-$(basename "$h")-$r.log"
      env $env timeout 300 "$bin" --model flash16 --backend cuda --reps 3 --decode 8 --prefill 512,4096 > "$log" 2>&1
      echo "hooks $h round $r: $(grep -E '^prefill' "$log" | sed 's/ (.*//' | tr '\n' ' ') $(grep -E '^hooks:' "$log" | head -1)"
    done
  done
fi
if want vs; then
  step "prefill, PREV against this tree, ${VS_ROUNDS:-2} rounds alternating"
  for m in ${VS_MODELS:-flash16}; do
    for r in $(seq 1 "${VS_ROUNDS:-2}"); do
      for tree in prev head; do
        bin=build/cuda-"$ARCH"/ds4_bench; [ $tree = prev ] && bin="$PREV/$bin"
        log="$OUT/vs-$m-$tree-$r.log"
        timeout 300 "$bin" --model "$m" --backend cuda --reps 3 --decode 8 --prefill 512,4096 --tc-peak "$PEAK" > "$log" 2>&1
        echo "$m $tree round $r: $(grep -E '^prefill|^decode: median' "$log" | sed 's/ (.*//' | tr '\n' ' ')"
      done
    done
  done
fi
if want same; then
  step "CUDA logits, PREV against this tree: ${SAME_MODELS:-small/q8_0 small/f16}, a 300-token prompt + 32 greedy steps"
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(300)))")
  for m in ${SAME_MODELS:-small/q8_0 small/f16}; do
    cfg=${m%%/*}; ty=${m#*/}; [ "$ty" = "$m" ] && ty=""
    G=${TMPDIR:-/tmp}/same.gguf      # not under $OUT: a Flash-shaped file is tens of GB
    ./ds4 synth --config "$cfg" --seed 1 ${ty:+--type $ty} -o "$G" > /dev/null 2>&1
    for tree in prev head; do
      bin=./ds4; [ $tree = prev ] && bin="$PREV/ds4"
      "$bin" -m "$G" --backend cuda --tokens "$P" -n 32 --dump-logits "$OUT/same-$tree.ds4logit" \
        > /dev/null 2>&1 || echo "$tree $m: rc $?"
    done
    if cmp -s "$OUT/same-prev.ds4logit" "$OUT/same-head.ds4logit"; then
      echo "$cfg ${ty:-default}: CUDA logits byte-identical ($(stat -c %s "$OUT/same-head.ds4logit") bytes)"
    else echo "$cfg ${ty:-default}: CUDA LOGITS DIFFER: $(python3 tests/oracle/ds4logit.py compare "$OUT/same-prev.ds4logit" \
        "$OUT/same-head.ds4logit" --tol 5e-5 2>&1 | tr '\n' ' ')"; fi
    rm -f "$G" "$OUT"/same-*.ds4logit
  done
fi
if want envsame; then
  step "CUDA logits, the defaults against ${ENVSAME:-DS4_CUDA_PREFILL_TC=3} (the same sums): ENVSAME_MODELS, a 300-token prompt + 32 greedy steps"
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(300)))")
  for m in ${ENVSAME_MODELS:-small/q8_0 small/f16 small-q4/ small-q2/}; do
    cfg=${m%%/*}; ty=${m#*/}; [ "$ty" = "$m" ] && ty=""
    ./ds4 synth --config "$cfg" --seed 1 ${ty:+--type $ty} -o "$OUT/es.gguf" > /dev/null 2>&1
    i=0
    for e in default ${ENVSAME:-DS4_CUDA_PREFILL_TC=3}; do
      if [ "$e" = default ]; then set --; else set -- "$e"; fi
      env "$@" timeout 120 ./ds4 -m "$OUT/es.gguf" --backend cuda --tokens "$P" -n 32 \
        --dump-logits "$OUT/es-$i.ds4logit" > "$OUT/es-$i.log" 2>&1 || echo "$m $e: rc $? $(tail -1 "$OUT/es-$i.log")"
      if [ $i -gt 0 ]; then
        if cmp -s "$OUT/es-0.ds4logit" "$OUT/es-$i.ds4logit"; then
          echo "$m: CUDA logits with $e byte-identical to the defaults' ($(stat -c %s "$OUT/es-$i.ds4logit") bytes)"
        else echo "$m: $e LOGITS DIFFER: $(python3 tests/oracle/ds4logit.py compare "$OUT/es-0.ds4logit" \
            "$OUT/es-$i.ds4logit" --tol 5e-5 2>&1 | tr '\n' ' ')"; fi
      fi
      i=$((i + 1))
    done
    rm -f "$OUT/es.gguf" "$OUT"/es-*.ds4logit
  done
fi
if want report; then
  RM=${REPORT_MODEL:-flash16}
  step "kernel report: $RM prefill ${REPORT_N:-4096} (REPORT_TC: 3 = the default paths; 2 = wgmma with cp.async copies; 1 = mma.sync and the f32 attention tiles; 0 = cuBLAS and the per-token attention)"
  for tc in ${REPORT_TC:-4}; do
    DS4_CUDA_PREFILL_TC=$tc DS4_CUDA_PREFILL_ATTN=$((tc > 2 ? 2 : tc)) PLAIN=0 timeout "${REPORT_LIMIT:-400}" bash scripts/kernel_report.sh "$RM" "$OUT/kr-tc$tc" -- \
      --prefill "${REPORT_N:-4096}" --profile-prefill --profile-timed 2 > "$OUT/kr-tc$tc.log" 2>&1
    tail -14 "$OUT/kr-tc$tc/kernels-$RM.md"
  done
fi
if want prof; then
  step "ncu: ${PROF_KERNELS:-k_attention_tiles and k_tc_gemm}, flash16 prefill of ${PROF_N:-4096} tokens"
  SECS=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats
        --section InstructionStats)
  for k in ${PROF_KERNELS:-k_attention_tiles:2:2 k_tc_gemm:40:${PROF_GEMMS:-6}}; do
    set -- ${k//:/ }
    timeout 300 "$NCU" --clock-control none -k "regex:$1" --launch-skip "$2" --launch-count "$3" "${SECS[@]}" \
      build/cuda-"$ARCH"/ds4_bench --model flash16 --backend cuda --reps 1 --decode 2 --prefill "${PROF_N:-4096}" \
      --no-warmup > "$OUT/prof-$1.log" 2>&1
    echo "$1: rc $? $(grep -cE '^  [a-z_]+.*\(' "$OUT/prof-$1.log") launches profiled"
    grep -E '^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Executed Ipc A' "$OUT/prof-$1.log" | head -60
  done
fi
if want dprof; then
  step "ncu: one launch of each of DPROF_KERNELS in a flash16 decode step"
  for k in ${DPROF_KERNELS:-k_hc_pre k_moe_gate k_indexer_scores k_indexer_select k_attention< k_attention_combine k_head_norm_rope k_moe_combine}; do
    f="$OUT/dprof-$(echo "$k" | tr -cd 'a-z_').log"
    timeout 200 "$NCU" --clock-control none --profile-from-start off --kernel-name-base demangled -k "regex:$k" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
      build/cuda-"$ARCH"/ds4_bench --model flash16 --backend cuda --reps 0 --prefill 512 --profile-step > "$f" 2>&1
    echo "$k: rc $?"
    grep -E 'Duration|Registers Per|Block Size|Grid Size|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall' "$f" | head -14
  done
fi
if want dreport; then
  step "kernel report: one flash16 decode step, PREV's ds4_bench then this tree's"
  for tree in prev head; do
    b=build/cuda-"$ARCH"/ds4_bench; [ $tree = prev ] && b="$PREV/$b"
    BENCH=$b timeout 240 bash scripts/kernel_report.sh flash16 "$OUT/dkr-$tree" > "$OUT/dkr-$tree.log" 2>&1
    echo "$tree: rc $?"; tail -30 "$OUT/dkr-$tree/kernels-flash16.md"
  done
  python3 scripts/kernel_table.py "$OUT/dkr-head/ncu-flash16.csv" --before "$OUT/dkr-prev/ncu-flash16.csv" \
    > "$OUT/dkr-families.md" 2>&1 && sed -n '/^By family, before/,$p' "$OUT/dkr-families.md" | head -24
fi
if want l2hot; then
  step "matvec_table: weights from DRAM, then from L2 (--copies 1)"
  make --no-print-directory build/cuda-"$ARCH"/matvec_table CUDA_ARCH="$ARCH" >> "$OUT/build.log" 2>&1
  for c in 0 1; do
    timeout 150 build/cuda-"$ARCH"/matvec_table --reps 5 --calls 32 --copies $c > "$OUT/l2hot-$c.log" 2>&1
    echo "copies $c: rc $?"; grep -E '^\| [a-z]' "$OUT/l2hot-$c.log" | cut -d'|' -f2,5,6,8,9,12 | head -20
  done
fi
if want stall; then
  SM=${STALL_MODEL:-flash16}; SK=${STALL_KERNEL:-k_tc_gemm}; SS=${STALL_SKIP:-40}; SC=${STALL_COUNT:-2}
  step "ncu metrics: $SC launches of $SK after $SS in a $SM prefill of ${PROF_N:-4096} tokens (issue, tensor pipe, banks, stalls)"
  M=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  M=$M,sm__inst_executed_pipe_tensor_op_hmma.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
  M=$M,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
  M=$M,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active
  for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall \
           lg_throttle no_instructions; do M=$M,smsp__pcsamp_warps_issue_stalled_$r; done
  timeout 240 "$NCU" --clock-control none --kernel-name-base demangled -k "regex:$SK" --launch-skip "$SS" \
    --launch-count "$SC" --metrics "$M" \
    build/cuda-"$ARCH"/ds4_bench --model "$SM" --backend cuda --reps 1 --decode 2 --prefill "${PROF_N:-4096}" \
    --no-warmup > "$OUT/stall.log" 2>&1
  echo "rc $?"; grep -E '^  [a-zA-Z_].*\(|gpu__time|hmma|inst_executed.sum|issue_active|bank|wavefronts|lts__t_bytes|stalled' "$OUT/stall.log"
fi
if want pcstall; then
  PM=${PCSTALL_MODEL:-flash16}; PK=${PCSTALL_KERNEL:-k_tc_wgmma}; PS=${PCSTALL_SKIP:-40}
  step "ncu source counters: one launch of $PK after $PS in a $PM prefill of ${PROF_N:-4096} tokens, instruction by instruction"
  rm -f "$OUT/pcstall.ncu-rep"
  timeout 240 "$NCU" --clock-control none --kernel-name-base demangled -k "regex:$PK" --launch-skip "$PS" \
    --launch-count 1 --section SourceCounters --section WarpStateStats -o "$OUT/pcstall" \
    build/cuda-"$ARCH"/ds4_bench --model "$PM" --backend cuda --reps 1 --decode 2 --prefill "${PROF_N:-4096}" \
    --no-warmup > "$OUT/pcstall.log" 2>&1
  echo "rc $?"; grep -E '^  [a-zA-Z_].*\(' "$OUT/pcstall.log" | head -2
  "$NCU" --import "$OUT/pcstall.ncu-rep" --page source --print-source sass --csv > "$OUT/pcstall-sass.csv" 2> "$OUT/pcstall-page.err"
  echo "source page: rc $? $(head -c 300 "$OUT/pcstall-page.err")"
  python3 scripts/ncu_source_top.py "$OUT/pcstall-sass.csv" --top "${PCSTALL_TOP:-40}" | tee "$OUT/pcstall.md"
fi
if want exact; then
  step "CUDA against the CPU (EXACT_MODELS: config/type): a 300-token prompt (prefill) + 32 greedy steps"
  # token ids below 512: tiny's vocabulary (small's is 1024)
  P=$(python3 -c "print(','.join(str((i * 7919) % 500 + 1) for i in range(300)))")
  for m in ${EXACT_MODELS:-small/q8_0 small/f16 small/f32}; do
    cfg=${m%%/*}; ty=${m#*/}; [ "$ty" = "$m" ] && ty=""; tag=$cfg${ty:+-$ty}
    ./ds4 synth --config "$cfg" --seed 1 ${ty:+--type $ty} -o "$OUT/$tag.gguf" > /dev/null 2>&1
    ./ds4 -m "$OUT/$tag.gguf" --backend cpu --tokens "$P" -n 32 --dump-logits "$OUT/cpu-$tag.ds4logit" > /dev/null 2>&1
    for v in ${EXACT_PATHS:-00 10 11 12}; do   # TC ATTN
      set -- "${v:0:1}" "${v:1:1}"
      DS4_CUDA_PREFILL_TC=$1 DS4_CUDA_PREFILL_ATTN=$2 ./ds4 -m "$OUT/$tag.gguf" --backend cuda --tokens "$P" -n 32 \
        --dump-logits "$OUT/cuda-$tag-$1$2.ds4logit" > /dev/null 2>&1
      echo "$tag TC=$1 ATTN=$2 vs CPU: $(python3 tests/oracle/ds4logit.py compare "$OUT/cpu-$tag.ds4logit" \
        "$OUT/cuda-$tag-$1$2.ds4logit" --tol 5e-5 2>&1 | tr '\n' ' ') rc ${PIPESTATUS[0]}"
    done
    rm -f "$OUT"/*.gguf "$OUT"/*.ds4logit
  done
fi
if want tcsame; then
  step "CUDA logits, the engine (TC=1) against dequantise + cuBLAS (TC=0): ${TCSAME_MODEL:-flash-q2@16}, a 200-token prompt + 8 greedy steps"
  P=$(python3 -c "print(','.join(str((i * 7919) % 1000 + 1) for i in range(200)))")
  G=${TMPDIR:-/tmp}/tcsame.gguf
  ./ds4 synth --config "${TCSAME_MODEL:-flash-q2@16}" --seed 1 -o "$G" > "$OUT/tcsame-synth.log" 2>&1 || tail -3 "$OUT/tcsame-synth.log"
  for tc in 0 1; do
    DS4_CUDA_PREFILL_TC=$tc ./ds4 -m "$G" --backend cuda --tokens "$P" -n 8 --dump-logits "${G%.gguf}-$tc.ds4logit" \
      > "$OUT/tcsame-$tc.log" 2>&1 || { echo "TC=$tc: rc $?"; tail -3 "$OUT/tcsame-$tc.log"; }
  done
  echo "TC=1 vs TC=0: $(python3 tests/oracle/ds4logit.py compare "${G%.gguf}-0.ds4logit" "${G%.gguf}-1.ds4logit" --tol 5e-5 \
    2>&1 | tr '\n' ' ') rc ${PIPESTATUS[0]}"
  rm -f "$G" "${G%.gguf}"-*.ds4logit
fi
if want san; then
  step "compute-sanitizer on the tensor-core engine: prefills of 200 tokens (SAN_MODELS: config/type); test_backend_ops"
  for m in ${SAN_MODELS:-small/q8_0}; do
    cfg=${m%%/*}; ty=${m#*/}; [ "$ty" = "$m" ] && ty=""
    for tool in memcheck racecheck; do
      timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 build/cuda-"$ARCH"/ds4_bench --model "$cfg" \
        ${ty:+--type $ty} --backend cuda --reps 1 --decode 2 --prefill 200 --no-warmup > "$OUT/san-$tool.log" 2>&1
      echo "$tool $m prefill 200: rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san-$tool.log" | tail -1) $(grep -c '^prefill' "$OUT/san-$tool.log") prefill line"
    done
  done
  if [ "${SAN_OPS:-1}" != 0 ]; then   # 1: every case; tc: the tensor-core engine's cases only
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 build/cuda-"$ARCH"/test_backend_ops \
      $(case "${SAN_OPS:-1}" in tc|tc2|tc3|tc4|pl2) echo "$SAN_OPS";; esac) > "$OUT/san-ops.log" 2>&1
    echo "memcheck test_backend_ops ${SAN_OPS:-1}: rc $? $(grep -E 'ERROR SUMMARY' "$OUT/san-ops.log" | tail -1) $(grep -E 'passed, ' "$OUT/san-ops.log" | tail -1)"
  fi
fi
if want peer; then
  # llama.cpp v0.4.0 CUDA (.peer: cp -r ../shared/peer .peer, carried) and ds4 on the same file,
  # side by side: ds4 synth writes PEER_MODELS (flash16) to $TMPDIR; run.sh prefills PEER_PROMPTS
  # (512 4096) random ids + 16 greedy steps, 3 reps, its graphs on and off; ds4_bench reads the
  # same file (medians of 3), once for each word VAR=VALUE of PEER_ENVS (default: the environment as given).
  [ -f .peer/run.sh ] || { echo "peer: .peer/run.sh missing (cp -r ../shared/peer .peer and carry it)"; exit 2; }
  for m in ${PEER_MODELS:-flash16}; do
    G=${TMPDIR:-/tmp}/peer-${m//[@\/]/_}.gguf
    step "llama.cpp and ds4 on $m (ds4 synth --config $m --seed 1), prompts ${PEER_PROMPTS:-512 4096}"
    ./ds4 synth --config "$m" --seed 1 -o "$G" > "$OUT/peer-synth.log" 2>&1 || { tail -3 "$OUT/peer-synth.log"; continue; }
    ls -l "$G" | awk '{print "file bytes", $5}'
    for p in ${PEER_PROMPTS:-512 4096}; do
      echo "llama.cpp prompt $p: $(timeout "${PEER_LIMIT:-240}" bash .peer/run.sh "$G" "$p" 16 3 2>&1 | tr '\n' ' ')"
    done
    i=0
    for e in ${PEER_ENVS:-default}; do   # words VAR=VALUE: one ds4 run each
      if [ "$e" = default ]; then set --; else set -- "$e"; fi
      env "$@" timeout 300 build/cuda-"$ARCH"/ds4_bench --model "$G" --backend cuda --reps 3 --decode 8 \
        --prefill "$(echo ${PEER_PROMPTS:-512 4096} | tr ' ' ',')" > "$OUT/peer-ds4-$m-$i.log" 2>&1
      echo "ds4 $m ($e): $(grep -E '^model|^prefill' "$OUT/peer-ds4-$m-$i.log" | sed 's/ (.*//' | tr '\n' ' ')"
      i=$((i + 1))
    done
    rm -f "$G"
  done
fi
if want pwhatif; then
  W=${TMPDIR:-/tmp}/gpu-prefill-whatif
  step "what-if: ${PWHATIF_MODEL:-flash16} prefills, kernel families dropped (a -DDS4_WHATIF build in $W; timing only)"
  rm -rf "$W"; mkdir -p "$W"
  tar --exclude=./build --exclude=./.git --exclude=./.peer -cf - . | tar -xf - -C "$W"
  (cd "$W" && make cuda CUDA_ARCH="$ARCH" NVCCFLAGS="-O3 -std=c++17 -lineinfo -DDS4_WHATIF" &&
    make --no-print-directory build/cuda-"$ARCH"/ds4_bench CUDA_ARCH="$ARCH" NVCCFLAGS="-O3 -std=c++17 -lineinfo -DDS4_WHATIF") \
    > "$OUT/build-pwhatif.log" 2>&1 || { tail -30 "$OUT/build-pwhatif.log"; exit 1; }
  # every kernel name of a DS4_LAUNCH site (ALL)
  ALLK=$(grep -ho 'DS4_LAUNCH(([a-z_0-9]*\|DS4_LAUNCH([a-z_0-9]*' ds4_cuda*.cu ds4_hooks.cu | sed 's/.*(//' | sort -u | tr '\n' ',' | sed 's/,$//')
  PN=${PWHATIF_N:-512,4096}
  SETS=${PWHATIF_SETS:-"- k_tc_wgmma k_attention_mma k_tc_split k_hcb_dots k_hcb_finish k_head_norm_rope k_att_rows_split k_moe_combine,k_moe_gather ALL -"}
  i=0; rm -f "$OUT/pwhatif-runs.txt"
  for set in $SETS; do
    i=$((i + 1)); L="$OUT/pwhatif-$i.log"
    skip=$set; [ "$set" = - ] && skip=""; [ "$set" = ALL ] && skip=$ALLK
    [ "$set" = REST ] && skip=$(echo "$ALLK" | tr ',' '\n' | grep -vx 'k_tc_wgmma\|k_attention_mma\|k_moe_gate\|k_moe_route\|k_moe_group\|k_pair_rows' | tr '\n' ',' | sed 's/,$//')
    WHATIF_SKIP="$skip" timeout 240 "$W"/build/cuda-"$ARCH"/ds4_bench --model "${PWHATIF_MODEL:-flash16}" --backend cuda \
      --reps 3 --decode 1 --decode-after 64 --prefill "$PN" > "$L" 2>&1 || echo "$set: rc $?"
    echo "$set $(grep -E '^prefill' "$L" | awk '{printf "%s %s ", $2, $5}')" | tee -a "$OUT/pwhatif-runs.txt"
  done
  # each family's cost: the full prefill's time (the mean of its runs) less the prefill's without it
  python3 - "$OUT/pwhatif-runs.txt" <<'PY'
import sys
runs = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 3 and len(f) % 2 == 1:
        runs.append((f[0], {int(f[j]): float(f[j + 1]) for j in range(1, len(f), 2)}))
full = [r for n, r in runs if n == "-"]
if not full:
    sys.exit("pwhatif: no run of the full prefill")
ns = sorted(full[0])
base = {n: sum(r[n] for r in full if n in r) / len(full) for n in ns}
print("| dropped | " + " | ".join(f"{n} tokens: s (cost, share)" for n in ns) + " |")
print("|---|" + "---:|" * len(ns))
print("| nothing | " + " | ".join(f"{base[n]:.4f}" for n in ns) + " |")
for name, r in runs:
    if name == "-":
        continue
    cells = [f"{r[n]:.4f} ({(base[n] - r[n]) * 1e3:.1f} ms, {100 * (base[n] - r[n]) / base[n]:.1f}%)" if n in r else "-"
             for n in ns]
    print(f"| `{name[:60]}` | " + " | ".join(cells) + " |")
PY
  rm -rf "$W"
fi
