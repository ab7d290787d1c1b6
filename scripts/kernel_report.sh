#!/usr/bin/env bash
# kernel_report.sh -- where the GPU time of ONE decode step goes, kernel by kernel.
#
# What it is.  Two runs of `ds4_bench --profile-step` on MODEL (tiny, small,
# flash16 or a .gguf): first without a profiler, for the wall-clock decode step
# (median of host-timed steps, RESULT metric=step_wall_ms); then under Nsight
# Compute with profiling off until the program's cudaProfilerStart(), which
# ds4_bench calls around exactly one decode step after its warm-up steps, so
# one-time work (cudaFuncSetAttribute, scratch growth, module loading) stays
# out.  ncu records gpu__time_duration.sum of every kernel in that step, with
# clocks and caches left as they are (--clock-control none --cache-control
# none), and scripts/kernel_table.py turns the CSV into a markdown table:
# kernel, launches, mean us, total us, share of the step; then a footer with
# kernels per step, the sum of kernel time, the wall-clock step and their
# ratio (how busy the GPU is during a step).  The footer is the last block of
# the output (scripts/gpu-check.sh copies it into its summary).
#
# What it is not.  Not a timing of the step under the profiler (ncu serialises
# kernels and adds its own cost between them: only per-kernel durations are
# taken from it), and not an nsys timeline: gaps between kernels are visible
# only as wall-clock minus kernel time.
#
#   scripts/kernel_report.sh MODEL [OUTDIR] [-- EXTRA_DS4_BENCH_ARGS...]
#
#   OUTDIR defaults to build/kernel-report.  Written there, TAG = the model's name:
#     kernels-TAG.md         the table and footer
#     ncu-TAG.csv            ncu's raw CSV (one row per kernel launch)
#     bench-TAG-plain.log    ds4_bench without the profiler
#     bench-TAG-ncu.log      ds4_bench's own output under ncu
#   ds4_bench gets: --model MODEL --backend cuda --reps 0 --prefill 512 --profile-step,
#   then EXTRA (later flags win: e.g. -- --prefill 4096 --profile-warmup 16).  With
#   -- --prefill N --profile-prefill the profiled unit is a prefill of N tokens instead of a
#   decode step (set OUTDIR or TAG apart from a decode report of the same model).
#   Environment: CUDA_ARCH (sm_90), NCU (ncu on PATH, else /usr/local/cuda/bin/ncu),
#   BENCH (a ds4_bench binary; default build/cuda-$CUDA_ARCH/ds4_bench, built by make),
#   PLAIN=0 skips the run without the profiler (the wall clock then comes from the ncu run).
#   KR_BYTES=1 also records each kernel's DRAM bytes (dram__bytes_read.sum, dram__bytes_write.sum):
#   the table then gives MB per launch and achieved DRAM GB/s.  Where ncu needs a second pass
#   (kernel replay) for them, that pass may find in L2 what the first brought, so the bytes
#   can read low; the durations are the first pass's.
#   Without a GPU it prints "skipped: no GPU" and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { awk '/^#   scripts\/kernel_report.sh MODEL/ {on = 1} /^set -uo/ {on = 0} on' "$0" | sed 's/^# \{0,1\}//'; }
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then usage; [ $# -ge 1 ] && exit 0; exit 2; fi
MODEL=$1; shift
OUTDIR=build/kernel-report
if [ $# -gt 0 ] && [ "$1" != "--" ]; then OUTDIR=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
EXTRA=("$@")
ARCH=${CUDA_ARCH:-sm_90}
PY=${PYTHON:-python3}
TAG=$(basename "$MODEL"); TAG=${TAG%.gguf}
mkdir -p "$OUTDIR" || exit 2
CSV=$OUTDIR/ncu-$TAG.csv
PLAIN_LOG=$OUTDIR/bench-$TAG-plain.log
NCU_LOG=$OUTDIR/bench-$TAG-ncu.log
MD=$OUTDIR/kernels-$TAG.md

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no GPU (kernel_report)"; exit 0
fi
NCU=${NCU:-$(command -v ncu 2>/dev/null || true)}
[ -z "$NCU" ] && [ -x /usr/local/cuda/bin/ncu ] && NCU=/usr/local/cuda/bin/ncu
if [ -z "$NCU" ] || [ ! -x "$NCU" ]; then
  echo "kernel_report: ncu (Nsight Compute) not found: install it or set NCU=/path/to/ncu"; exit 2
fi
if [ -z "${BENCH:-}" ]; then
  BENCH=build/cuda-$ARCH/ds4_bench
  if ! make --no-print-directory "$BENCH" CUDA_ARCH="$ARCH" > "$OUTDIR/build-$TAG.log" 2>&1; then
    tail -30 "$OUTDIR/build-$TAG.log"; echo "kernel_report: building $BENCH failed"; exit 1
  fi
fi
[ -x "$BENCH" ] || { echo "kernel_report: $BENCH is not an executable"; exit 2; }
BARGS=(--model "$MODEL" --backend cuda --reps 0 --prefill 512 --profile-step ${EXTRA[@]+"${EXTRA[@]}"})
UNIT="one decode step"
if [[ " ${EXTRA[*]-} " == *" --profile-prefill "* ]]; then
  # the profiled unit is a prefill of the last --prefill given (ds4_bench takes the first of its list)
  PL=512; for ((i = 0; i < ${#BARGS[@]} - 1; i++)); do [ "${BARGS[$i]}" = --prefill ] && PL=${BARGS[$((i + 1))]%%,*}; done
  UNIT="one prefill of $PL tokens"
fi

echo "kernel_report: $MODEL, $UNIT; $("$NCU" --version 2>/dev/null | tail -1)"
echo "kernel_report: ds4_bench ${BARGS[*]}"
if [ "${PLAIN:-1}" != 0 ]; then
  echo "kernel_report: run 1/2, no profiler (wall-clock step) -> $PLAIN_LOG"
  if ! "$BENCH" "${BARGS[@]}" > "$PLAIN_LOG" 2>&1; then
    tail -20 "$PLAIN_LOG"; echo "kernel_report: ds4_bench failed without the profiler"; exit 1
  fi
  grep -E '^(profile|RESULT)' "$PLAIN_LOG"
else
  : > "$PLAIN_LOG"
fi

# Options that only newer ncu versions know are added when its --help lists them.
NCU_HELP=$("$NCU" --help 2>&1)
has_opt() { grep -q -- "$1" <<< "$NCU_HELP"; }
METRICS=gpu__time_duration.sum
[ "${KR_BYTES:-0}" = 1 ] && METRICS=$METRICS,dram__bytes_read.sum,dram__bytes_write.sum
NOPTS=(--profile-from-start off --metrics "$METRICS" --clock-control none --cache-control none
       --csv --page raw --log-file "$CSV")
has_opt --print-kernel-base && NOPTS+=(--print-kernel-base demangled)   # full template arguments
has_opt --print-units && NOPTS+=(--print-units base)                      # always nsecond
rm -f "$CSV"
echo "kernel_report: run 2/2, under ncu -> $CSV"
# LC_ALL=C: '.' as the decimal point and ',' as the thousands separator in the CSV
LC_ALL=C "$NCU" "${NOPTS[@]}" "$BENCH" "${BARGS[@]}" > "$NCU_LOG" 2>&1
rc=$?
if [ $rc -ne 0 ] || ! grep -q '"Kernel Name"' "$CSV" 2>/dev/null; then
  # some ncu versions print the CSV to stdout despite --log-file: take it from there
  if grep -q '"Kernel Name"' "$NCU_LOG" 2>/dev/null; then
    cp "$NCU_LOG" "$CSV"
  else
    echo "kernel_report: ncu failed (rc $rc) or profiled nothing; the end of its output:"
    tail -15 "$CSV" 2>/dev/null; tail -15 "$NCU_LOG"
    grep -q ERR_NVGPUCTRPERM "$CSV" "$NCU_LOG" 2>/dev/null &&
      echo "kernel_report: no permission for GPU counters: run as root or allow profiling (NVreg_RestrictProfilingToAdminUsers=0)"
    exit 1
  fi
fi
grep -E '^(profile|RESULT)' "$NCU_LOG"

"$PY" scripts/kernel_table.py "$CSV" --bench-log "$PLAIN_LOG" --ncu-bench-log "$NCU_LOG" \
    --title "Kernel time of $UNIT: $TAG ($(date -u +%F), $(git rev-parse --short HEAD 2>/dev/null || echo nogit))" \
    --out "$MD"
