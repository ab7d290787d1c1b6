#!/usr/bin/env bash
# sanitize-gpu.sh -- run the CUDA build of ds4 under NVIDIA compute-sanitizer (memcheck,
# racecheck, synccheck) on the tiny, small, "other", small-q2 and small-q4 models (the last two:
# the published files' IQ2_XXS/Q2_K and Q4_K expert layouts), and the backend op test
# (build/cuda-$CUDA_ARCH/test_backend_ops) once under memcheck.  Any finding fails: a non-zero
# "ERROR SUMMARY", any racecheck hazard (error or warning), any "Error:"/"Warning:" line from
# the tool, a non-zero exit of the program, or a run that did not finish.
#
# It is not a correctness test of the numbers (tests/test_gpu.py and test_backend_ops are) and
# not a benchmark; it needs a GPU and compute-sanitizer, and says so and exits 2 without them.
#
#   scripts/sanitize-gpu.sh [--bin PATH] [--out DIR] [--tools "memcheck racecheck synccheck"]
#                           [--models "tiny small other small-q2 small-q4 tiny-mtp small-mtp"]
#                           [--timeout S] [--ops-timeout S]
#                           [--jobs N] [--no-ops]
#
# Environment equivalents: SANITIZE_BIN (default ./ds4), SANITIZE_OUT (build/sanitize-out),
# SANITIZE_TOOLS, SANITIZE_MODELS, SANITIZE_TIMEOUT (300 s a run), SANITIZE_OPS_TIMEOUT (300 s),
# SANITIZE_JOBS (8 runs at once), SANITIZE_RUNS ("136:4 120:12 24:12", prompt:decode pairs),
# SANITIZE_LEAK_CHECK=1 (memcheck --leak-check full), COMPUTE_SANITIZER (the tool's path),
# CUDA_ARCH (sm_90: which build/cuda-*/test_backend_ops).  (No DS4_* names: ds4 rejects unknown
# DS4_* variables.)
#
# Each model gets three runs under each tool, so every path runs under every tool while the
# slowest tool (racecheck: ~20 ms a kernel) stays near two minutes a run:
#   p136+n4    136-token prefill (positions 0..135: window wrap, 34 ratio-4 rows, the ratio-128
#              row at 127, indexer top-k, all inside one batch; the batch kernels), then decode
#              on a full window with top-k active
#   p120+n12   prefill to 119, then decode across position 127: the one-token compressor kernel
#              emits ratio-4 rows and the first ratio-128 row, with more than top_k compressed
#              rows (top_k: tiny 8, small 16, other 6)
#   p24+n12    decode across the sliding window's wrap (window: tiny 32, other 24)
# tiny-mtp and small-mtp (not in the default list) are those models written with an MTP block
# (ds4 synth --mtp), run with speculative decoding: each run first makes its plain greedy ids
# without the sanitizer, then runs `--mtp-draft 3` under it with DS4_MTP_FORCE=0.5 on those
# ids, so checks of every width 1..4 occur and are rolled back; the second and third runs with
# DS4_CUDA_GRAPHS=1 (the check widths' graphs).
# Each run is `compute-sanitizer --tool T --error-exitcode 1 [--racecheck-report all]
# --log-file OUT/NAME.log ds4 -m MODEL --backend cuda --tokens IDS -n N`; the tool's report goes
# to NAME.log, the program's output to NAME.out.  One line per run on stdout, then
# "sanitizer: N runs, M failed" (N counts the runs made; skipped ones are listed and counted
# apart).  Exit 0 when clean, 1 on any finding or timeout, 2 when the environment cannot run it
# (no compute-sanitizer, no GPU, no CUDA build).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

BIN=${SANITIZE_BIN:-./ds4}
OUTDIR=${SANITIZE_OUT:-build/sanitize-out}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
MODELS=${SANITIZE_MODELS:-tiny small other small-q2 small-q4}
RUNS=${SANITIZE_RUNS:-136:4 120:12 24:12}
TMO=${SANITIZE_TIMEOUT:-300}
OPS_TMO=${SANITIZE_OPS_TIMEOUT:-300}
JOBS=${SANITIZE_JOBS:-8}
ARCH=${CUDA_ARCH:-sm_90}
DO_OPS=1

die_env() { echo "sanitize-gpu.sh: error: $*" >&2; echo "sanitizer: 0 runs, not run ($*)"; exit 2; }
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    --tools) TOOLS=$2; shift ;;
    --models) MODELS=$2; shift ;;
    --timeout) TMO=$2; shift ;;
    --ops-timeout) OPS_TMO=$2; shift ;;
    --jobs) JOBS=$2; shift ;;
    --no-ops) DO_OPS=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "sanitize-gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for t in $TOOLS; do
  case "$t" in memcheck|racecheck|synccheck|initcheck) ;; *) die_env "unknown tool '$t'" ;; esac
done
for m in $MODELS; do
  case "$m" in tiny|small|other|small-q2|small-q4|tiny-mtp|small-mtp) ;;
    *) die_env "unknown model '$m' (tiny, small, other, small-q2, small-q4, tiny-mtp, small-mtp)" ;; esac
done
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die_env "--jobs must be a positive integer"
[[ "$TMO" =~ ^[1-9][0-9]*$ && "$OPS_TMO" =~ ^[1-9][0-9]*$ ]] || die_env "timeouts must be positive integers (seconds)"

# ---- preflight: the environment, not the code under test -------------------------------
SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
  for c in /usr/local/cuda/bin/compute-sanitizer "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
           "$(command -v compute-sanitizer 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then SAN=$c; break; fi
  done
fi
{ [ -n "$SAN" ] && [ -x "$SAN" ]; } || die_env "compute-sanitizer not found (looked in /usr/local/cuda/bin, \$CUDA_HOME/bin and PATH; set COMPUTE_SANITIZER=/path/to/compute-sanitizer)"
SAN_VERSION=$("$SAN" --version 2>&1 | grep -iE 'version|release' | tail -1)
[ -x "$BIN" ] || die_env "ds4 binary '$BIN' not found or not executable (make cuda CUDA_ARCH=$ARCH, or --bin PATH)"
case "$BIN" in /*) ;; *) BIN=$PWD/${BIN#./} ;; esac
command -v nvidia-smi > /dev/null 2>&1 || die_env "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi -L > /dev/null 2>&1 || die_env "no GPU visible (nvidia-smi -L failed: $(nvidia-smi -L 2>&1 | head -1))"

# --racecheck-report all (hazards and the analysis) exists since compute-sanitizer 2020.x; ask
# the tool rather than assume, so an older or newer one still runs racecheck.
RACE_OPTS=()
SAN_HELP=$("$SAN" --help 2>&1)     # read whole: grep -q on a pipe could SIGPIPE the tool (pipefail)
if grep -q -- '--racecheck-report' <<< "$SAN_HELP"; then RACE_OPTS=(--racecheck-report all)
else echo "sanitize-gpu: this compute-sanitizer has no --racecheck-report; racecheck runs with its default report"; fi
MEM_OPTS=()
[ "${SANITIZE_LEAK_CHECK:-0}" = 1 ] && MEM_OPTS=(--leak-check full)

mkdir -p "$OUTDIR" build/test-out
rm -f "$OUTDIR"/*.result "$OUTDIR"/*.ref
echo "sanitize-gpu: $SAN ($SAN_VERSION)"
echo "sanitize-gpu: binary $BIN, tools: $TOOLS, models: $MODELS, runs: $RUNS, timeout ${TMO}s, $JOBS at once, logs in $OUTDIR"

# models: tiny and small from ds4 synth (as tests/conftest.py writes them); other is carried.
# tiny is always written: the preflight run uses it.
declare -A MODEL_PATH
# shellcheck disable=SC2086  # MODELS is a word list
for m in $(printf '%s\n' tiny $MODELS | awk '!seen[$0]++'); do
  p=build/test-out/$m.gguf
  case "$m" in
    tiny|small)
      timeout 120 "$BIN" synth --config "$m" --seed 1 --type f32 -o "$p" > "$OUTDIR/synth-$m.log" 2>&1 \
        || die_env "ds4 synth --config $m failed: $(tail -1 "$OUTDIR/synth-$m.log")" ;;
    tiny-mtp|small-mtp)
      timeout 120 "$BIN" synth --config "${m%-mtp}" --seed 1 --type f32 --mtp -o "$p" > "$OUTDIR/synth-$m.log" 2>&1 \
        || die_env "ds4 synth --config ${m%-mtp} --mtp failed: $(tail -1 "$OUTDIR/synth-$m.log")" ;;
    small-q2|small-q4)
      timeout 120 "$BIN" synth --config "$m" --seed 1 -o "$p" > "$OUTDIR/synth-$m.log" 2>&1 \
        || die_env "ds4 synth --config $m failed: $(tail -1 "$OUTDIR/synth-$m.log")" ;;
    other)
      [ -f "$p" ] || cp -f build/carry/other.gguf "$p" 2>/dev/null ;;
  esac
  [ -f "$p" ] && MODEL_PATH[$m]=$PWD/$p
done

# one plain CUDA run first: a failure here is the machine or the build, not a sanitizer finding
if ! timeout 120 "$BIN" -m "build/test-out/tiny.gguf" --backend cuda --tokens 1,2,3,4 -n 2 \
      > "$OUTDIR/preflight.log" 2>&1; then
  [ -f build/test-out/tiny.gguf ] || die_env "no build/test-out/tiny.gguf for the preflight run"
  tail -5 "$OUTDIR/preflight.log" >&2
  die_env "'$BIN --backend cuda' does not run here (log above, $OUTDIR/preflight.log): not a CUDA build, or no usable GPU"
fi

# ---- runs --------------------------------------------------------------------------------
# ids N SEED: N comma-separated token ids in [0, 256) (every model's vocabulary has >= 384)
ids() {
  local n=$1 x=$2 out="" i
  for ((i = 0; i < n; i++)); do
    x=$(( (x * 1103515245 + 12345) & 0x7fffffff ))
    out+="$(( (x >> 16) & 255 )),"
  done
  echo "${out%,}"
}

# sum_field REGEX LOG: the last number of each match of REGEX in LOG, summed over the matches
# ("" when nothing matches)
sum_field() {
  grep -oE "$1" "$2" | sed -E 's/^(.*[^0-9])?([0-9]+)[^0-9]*$/\2/' | awk '{s += $1; n++} END {if (n) print s}'
}

# judge TOOL SANLOG APPOUT RC SECONDS DONE_PATTERN -> "PASS (...)" / "FAIL (...)" / "TIMEOUT (...)"
judge() {
  local tool=$1 log=$2 out=$3 rc=$4 secs=$5 done_re=$6 why=() e h he hw other joined bad=0 counts
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "TIMEOUT (killed after ${secs} s) logs: $log $out"; return
  fi
  # racecheck ends with its own RACECHECK SUMMARY line instead of ERROR SUMMARY (CUDA 13.0's
  # compute-sanitizer 2025.3.1, seen on the H200)
  e=$(sum_field 'ERROR SUMMARY: [0-9]+ errors?' "$log")
  counts="errors ${e:-?}"
  if [ -z "$e" ]; then
    [ "$tool" = racecheck ] || why+=("no ERROR SUMMARY line")
  elif [ "$e" -ne 0 ]; then bad=1; fi
  if [ "$tool" = racecheck ]; then
    h=$(sum_field 'RACECHECK SUMMARY: [0-9]+ hazards? displayed' "$log")
    he=$(sum_field 'RACECHECK SUMMARY: .*\([0-9]+ errors?' "$log")
    hw=$(sum_field 'RACECHECK SUMMARY: .*[0-9]+ warnings?\)' "$log")
    counts+=", hazards ${h:-?} (${he:-?} errors, ${hw:-?} warnings)"
    if [ -z "$h" ]; then why+=("no RACECHECK SUMMARY line")
    elif [ "$h" -ne 0 ] || [ "${he:-0}" -ne 0 ] || [ "${hw:-0}" -ne 0 ]; then bad=1; fi
  fi
  other=$(grep -cE '^(=+ +)?(Error|Warning)' "$log")
  [ "$other" -ne 0 ] && why+=("$other Error/Warning lines")
  [ "$rc" -ne 0 ] && why+=("exit $rc")
  grep -qE "$done_re" "$out" || why+=("did not finish")
  if [ "$bad" -eq 0 ] && [ ${#why[@]} -eq 0 ]; then
    echo "PASS ($counts; ${secs} s)"
  else
    joined=""
    [ ${#why[@]} -ne 0 ] && printf -v joined '; %s' "${why[@]}"
    echo "FAIL ($counts$joined; ${secs} s) logs: $log $out"
  fi
}

# run_one NAME TOOL WHAT LABEL TIMEOUT DONE_PATTERN CMD... : one sanitizer run; the tool's report
# goes to NAME.log (--log-file), the program's own output to NAME.out, the verdict to NAME.result
run_one() {
  local name=$1 tool=$2 what=$3 label=$4 tmo=$5 done_re=$6 opts=()
  shift 6
  local log=$OUTDIR/$name.log out=$OUTDIR/$name.out t0=$SECONDS rc line
  [ "$tool" = racecheck ] && opts=("${RACE_OPTS[@]}")
  [ "$tool" = memcheck ] && opts=("${MEM_OPTS[@]}")
  rm -f "$log"
  {
    echo "# $(date -u +%FT%TZ) $SAN --tool $tool --error-exitcode 1 ${opts[*]} --log-file $log $*"
    timeout -k 30 "$tmo" "$SAN" --tool "$tool" --error-exitcode 1 "${opts[@]}" --log-file "$log" "$@"
  } > "$out" 2>&1
  rc=$?
  [ -f "$log" ] || echo "(compute-sanitizer wrote no log; its own messages, if any, are in $out)" > "$log"
  line=$(printf '%-9s %-6s %-16s %s' "$tool" "$what" "$label" \
               "$(judge "$tool" "$log" "$out" "$rc" $((SECONDS - t0)) "$done_re")")
  echo "$line" > "$OUTDIR/$name.result"
  echo "$line"
}

# throttle: wait for a free slot (at most $JOBS sanitizer runs at once)
throttle() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; }

SKIPPED=()
ORDER=()
# the op test first: the longest single run
if [ "$DO_OPS" = 1 ]; then
  OPS_BIN=build/cuda-$ARCH/test_backend_ops
  if [ -x "$OPS_BIN" ]; then
    ORDER+=(memcheck-ops)
    throttle
    run_one memcheck-ops memcheck ops test_backend_ops "$OPS_TMO" '^[0-9]+ passed, 0 failed$' "$PWD/$OPS_BIN" &
  else
    SKIPPED+=("ops: $OPS_BIN not built (make $OPS_BIN CUDA_ARCH=$ARCH)")
  fi
fi
for m in $MODELS; do
  if [ -z "${MODEL_PATH[$m]:-}" ]; then
    SKIPPED+=("$m: build/test-out/$m.gguf absent (gpu-check copies it from build/carry/other.gguf; tests/oracle/write_gguf_ggufpy.py writes it)")
    continue
  fi
  for tool in $TOOLS; do
    seed=1
    for r in $RUNS; do
      P=${r%%:*} N=${r##*:}
      name=$tool-$m-p${P}n$N
      ORDER+=("$name")
      throttle
      # -v: the CLI prints the generated ids (the line that says the run finished) only then; the
      # streamed text before it has no newline, so the pattern is not anchored
      case "$m" in
        *-mtp)
          ref=$OUTDIR/$m-p${P}n$N.ref      # one plain run per model and run, whatever the tools
          [ -s "$ref" ] || "$BIN" -m "${MODEL_PATH[$m]}" --backend cuda --tokens "$(ids "$P" "$seed")" -n "$N" -v \
            2>&1 > /dev/null | sed -n 's/^generated ids: //p' > "$ref"
          graphs=0; [ "$seed" -gt 1 ] && graphs=1
          ( export DS4_MTP_FORCE="0.5:$ref" DS4_CUDA_GRAPHS=$graphs
            run_one "$name" "$tool" "$m" "p$P+n$N D3 g$graphs" "$TMO" 'generated ids:' \
              "$BIN" -m "${MODEL_PATH[$m]}" --backend cuda --tokens "$(ids "$P" "$seed")" -n "$N" -v \
              --mtp-draft 3 --stats ) & ;;
        *)
          run_one "$name" "$tool" "$m" "p$P+n$N" "$TMO" 'generated ids:' \
            "$BIN" -m "${MODEL_PATH[$m]}" --backend cuda --tokens "$(ids "$P" "$seed")" -n "$N" -v & ;;
      esac
      seed=$((seed + 1))
    done
  done
done
wait

# ---- summary -----------------------------------------------------------------------------
n=0 failed=0 timedout=0
: > "$OUTDIR/summary.txt"
for name in "${ORDER[@]}"; do
  n=$((n + 1))
  if [ -f "$OUTDIR/$name.result" ]; then line=$(cat "$OUTDIR/$name.result")
  else line="$name: no result (the run did not report)"; fi
  echo "$line" >> "$OUTDIR/summary.txt"
  case "$line" in
    *" PASS ("*) ;;
    *" TIMEOUT ("*) failed=$((failed + 1)); timedout=$((timedout + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
done
for s in "${SKIPPED[@]}"; do echo "SKIP $s" | tee -a "$OUTDIR/summary.txt"; done
final="sanitizer: $n runs, $failed failed"
[ "$timedout" -ne 0 ] && final+=" ($timedout timed out)"
[ ${#SKIPPED[@]} -ne 0 ] && final+=" (${#SKIPPED[@]} skipped)"
echo "$final" | tee -a "$OUTDIR/summary.txt"
[ "$failed" -eq 0 ] && [ "$n" -gt 0 ]
