#!/usr/bin/env bash
# scripts/fuzz.sh -- coverage-guided fuzzing of ds4's input parsers (libFuzzer, Debian's clang).
#
#   scripts/fuzz.sh build              build every target into build/fuzz/ (only what is stale;
#                                      each source compiled once, FUZZ_BUILD_JOBS at a time)
#   scripts/fuzz.sh run [SECONDS]      fuzz every target for SECONDS each (default 60), one after
#                                      the other; new inputs go to build/fuzz/work/<target>/, the
#                                      seeds in tests/fuzz/corpus/<target>/ are read, not written;
#                                      a crash/timeout/OOM writes build/fuzz/artifacts/<target>/ and
#                                      exits non-zero
#   scripts/fuzz.sh replay             run each target once over tests/fuzz/corpus/<target>/ and
#                                      tests/fuzz/crashers/<target>/ (-runs=0: no fuzzing), plus the
#                                      DS4LOGIT mutation loop; quick, the regression test of make test
#   scripts/fuzz.sh ci [SECONDS]       the short budget of make test: `run SECONDS` (default 10, so
#                                      5 targets x 10 s, under 2 minutes in all) where clang links
#                                      -fsanitize=fuzzer; elsewhere one "skipped:" line and exit 0
#   scripts/fuzz.sh planted [SECONDS]  build fuzz_gguf against a copy of ds4.c with one bounds check
#                                      removed and fuzz it until the planted bug is found
#
# Targets (tests/fuzz/): fuzz_gguf (GGUF reader + validator from memory), fuzz_gguf_pad (the
# same, input zero-padded to 4 MiB so fuzzed metadata reaches the validator), fuzz_tok
# (tokenizer, needs models/ds4-tiny.gguf from `make`), fuzz_env (the DS4_* environment reader),
# fuzz_cli (ds4_cli.c's command-line parsers: run and synth options). Seeds: corpus/<target>/, gguf_pad
# shares corpus/gguf/. Limits: -timeout=1 (1 s per input),
# -rss_limit_mb=2048 -malloc_limit_mb=2048. Environment: CLANG (default clang), FUZZ_JOBS
# (targets fuzzed at once by run and ci; default 1, make fuzz-ci: 2), FUZZ_BUILD_JOBS (compilers
# at once; default nproc), FUZZ_OUT (default build/fuzz).
set -eu
cd "$(dirname "$0")/.."

CLANG=${CLANG:-clang}
FLAGS="-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I."
LIBS="-pthread -lm"
OUT=${FUZZ_OUT:-build/fuzz}
TARGETS="gguf gguf_pad tok env cli"
LIMITS="-timeout=1 -rss_limit_mb=2048 -malloc_limit_mb=2048"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}   # a leak per input is a failure too
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

need_clang() {
  if ! command -v "$CLANG" >/dev/null 2>&1; then
    echo "fuzz: $CLANG not found (Debian: apt-get install clang libclang-rt-14-dev; scripts/test-deps.sh installs them)" >&2
    exit 2
  fi
}

# The targets are linked from objects compiled once each (every source with the same sanitizer
# and coverage flags; the harnesses that #include ds4.c or ds4_cli.c are their own objects), up to
# FUZZ_BUILD_JOBS compilers at once.  An object is remade when its source or any header of the
# tree (or, for a harness, the .c it includes) is newer; a target when any of its objects is.
LIB_OBJS="ds4_synth ds4_hooks ds4_quant ds4_tok ds4_msg"
# target_objs TARGET: its objects (harness first), as names under $OUT/obj/
target_objs() {
  case $1 in
    gguf) echo "h_gguf $LIB_OBJS" ;;
    gguf_pad) echo "h_gguf_pad $LIB_OBJS" ;;
    env) echo "h_env $LIB_OBJS" ;;
    tok) echo "h_tok ds4 $LIB_OBJS" ;;
    cli) echo "h_cli ds4 $LIB_OBJS ds4_collect" ;;
    planted) echo "h_planted $LIB_OBJS" ;;
  esac
}
# obj_src NAME: "SOURCE [EXTRA FLAGS]" of an object; obj_deps NAME: the files it is built from
obj_src() {
  case $1 in
    h_gguf) echo "tests/fuzz/fuzz_gguf.c" ;;
    h_gguf_pad) echo "tests/fuzz/fuzz_gguf.c -DDS4_FUZZ_PAD" ;;
    h_planted) echo "tests/fuzz/fuzz_gguf.c -DDS4_FUZZ_PAD '-DDS4_FUZZ_SRC=\"$OUT/planted/ds4.c\"'" ;;
    h_*) echo "tests/fuzz/fuzz_${1#h_}.c" ;;
    *) echo "$1.c" ;;
  esac
}
obj_deps() {
  local src
  src=$(obj_src "$1"); src=${src%% *}
  case $1 in
    h_gguf|h_gguf_pad|h_env) echo "$src ds4.c" ;;
    h_planted) echo "$src $OUT/planted/ds4.c" ;;
    h_cli) echo "$src ds4_cli.c" ;;
    *) echo "$src" ;;
  esac
  ls *.h
}
stale() {   # stale OUTPUT INPUT...: OUTPUT missing or older than an input
  local out=$1 f; shift
  [ -e "$out" ] || return 0
  for f in "$@"; do [ "$f" -nt "$out" ] && return 0; done
  return 1
}
# build_targets TARGET...: their stale objects (in parallel), then their stale links
build_targets() {
  local jobs=${FUZZ_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)} t o todo="" pids=() fail=0 p
  for t in "$@"; do
    for o in $(target_objs "$t"); do
      case " $todo " in *" $o "*) ;; *) stale "$OUT/obj/$o.o" $(obj_deps "$o") && todo="$todo $o" ;; esac
    done
  done
  if [ -n "$todo" ]; then need_clang; fi
  mkdir -p "$OUT/obj"
  for o in $todo; do
    eval "$CLANG $FLAGS -c $(obj_src "$o") -o $OUT/obj/$o.o" & pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  [ $fail -eq 0 ] || { echo "fuzz: a compile failed" >&2; exit 1; }
  for t in "$@"; do
    local bin=$OUT/fuzz_$t objs=()
    [ "$t" = planted ] && bin=$OUT/fuzz_gguf_planted
    for o in $(target_objs "$t"); do objs+=("$OUT/obj/$o.o"); done
    stale "$bin" "${objs[@]}" || continue
    need_clang
    $CLANG $FLAGS "${objs[@]}" -o "$bin" $LIBS
  done
}

build() { build_targets $TARGETS; }

need_model() {
  if [ ! -f models/ds4-tiny.gguf ]; then echo "fuzz: models/ds4-tiny.gguf missing (run make)" >&2; exit 2; fi
}

seeds() { echo tests/fuzz/corpus/${1%_pad}; }

run_one() {   # run_one TARGET SECONDS
  local t=$1 s=$2
  mkdir -p $OUT/work/$t $OUT/artifacts/$t
  $OUT/fuzz_$t $LIMITS -max_total_time="$s" -print_final_stats=1 \
      -artifact_prefix=$OUT/artifacts/$t/ $OUT/work/$t $(seeds $t) \
      >$OUT/$t.log 2>&1 && rc=0 || rc=$?
  grep -E "^#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb" $OUT/$t.log \
      | sed "s/^/fuzz_$t: /"
  if [ $rc -ne 0 ]; then
    echo "fuzz_$t: FAILED (exit $rc); log $OUT/$t.log, input in $OUT/artifacts/$t/:" >&2
    grep -E "ERROR|SUMMARY|runtime error|fuzz_[a-z_]+:" $OUT/$t.log | head -5 >&2
    echo "  save it under tests/fuzz/crashers/$t/ so make test replays it" >&2
    return 1
  fi
}

run_all() {   # run_all SECONDS: every target, FUZZ_JOBS at once; exits 1 if any failed
  local secs=$1 jobs=${FUZZ_JOBS:-1} fail=0 pids=() t p
  build; need_model
  for t in $TARGETS; do
    run_one $t "$secs" & pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  exit $fail
}

cmd=${1:-replay}
case $cmd in
  build) build ;;
  run) run_all "${2:-60}" ;;
  replay)
    build; need_model
    fail=0
    for t in $TARGETS; do
      dirs=$(seeds $t)
      [ -d tests/fuzz/crashers/$t ] && [ -n "$(ls -A tests/fuzz/crashers/$t)" ] && dirs="$dirs tests/fuzz/crashers/$t"
      n=$(find $dirs -type f | wc -l)
      mkdir -p $OUT/artifacts/$t
      if $OUT/fuzz_$t $LIMITS -runs=0 -artifact_prefix=$OUT/artifacts/$t/ $dirs >$OUT/$t.replay.log 2>&1; then
        echo "fuzz-replay: fuzz_$t: $n inputs, ok"
      else
        echo "fuzz-replay: fuzz_$t: FAILED; log $OUT/$t.replay.log" >&2
        grep -E "runtime error|^fuzz_[a-z_]+:|^Running:" $OUT/$t.replay.log | tail -4 >&2
        fail=1
      fi
    done
    if [ -f tests/fuzz/fuzz_ds4logit.py ]; then
      ${PYTHON:-python3} tests/fuzz/fuzz_ds4logit.py --quick || fail=1
    fi
    exit $fail ;;
  planted)
    secs=${2:-300}
    src=$OUT/planted/ds4.c
    mkdir -p $OUT/planted
    # The planted bug: the reader's check that a tensor's data lies inside the file
    # (ds4_gguf_parse: "t->offset > room || t->nbytes > room - t->offset") loses its first half,
    # so an offset past the end makes "room - t->offset" wrap around and the tensor is accepted.
    # Fuzzed through fuzz_gguf_pad (the zero-padded image), seeds tests/fuzz/corpus/gguf/.
    sed 's/if (t->offset > room || t->nbytes > room - t->offset) {/if (t->nbytes > room - t->offset) {/' ds4.c >$src
    if cmp -s ds4.c $src; then echo "fuzz planted: the check to remove was not found in ds4.c" >&2; exit 2; fi
    sed -i 's|#include "\([a-z0-9_]*\.h\)"|#include "../../../\1"|' $src
    build_targets planted
    # Seeds: corpus/gguf without the *-mut-offset files, which already hold an offset past the
    # end and find it at once (with them: 0 s); the question is whether fuzzing finds it.
    mkdir -p $OUT/artifacts/planted $OUT/work/planted $OUT/planted/seeds
    rm -rf $OUT/work/planted/* $OUT/planted/seeds/*
    cp tests/fuzz/corpus/gguf/* $OUT/planted/seeds/ && rm -f $OUT/planted/seeds/*-mut-offset
    start=$(date +%s)
    if $OUT/fuzz_gguf_planted $LIMITS -max_total_time="$secs" -print_final_stats=1 \
         -artifact_prefix=$OUT/artifacts/planted/ $OUT/work/planted $OUT/planted/seeds >$OUT/planted.log 2>&1; then
      echo "fuzz planted: NOT found in $secs s (log $OUT/planted.log)"; exit 1
    fi
    echo "fuzz planted: found after $(( $(date +%s) - start )) s:"
    grep -E "^#[0-9]+|ERROR|SUMMARY|fuzz_gguf:" $OUT/planted.log | tail -4 ;;
  ci)
    # What test-deps checks: clang, and a link of -fsanitize=fuzzer (libclang-rt-14-dev).
    if ! command -v "$CLANG" >/dev/null 2>&1 ||
       ! echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }' |
         "$CLANG" -fsanitize=fuzzer -x c - -o /dev/null >/dev/null 2>&1; then
      echo "skipped: fuzzing budget (no $CLANG that links -fsanitize=fuzzer; Debian: clang libclang-rt-14-dev)"
      exit 0
    fi
    echo "fuzz-ci: every target for ${2:-10} s (${TARGETS// /, })"
    run_all "${2:-10}" ;;
  *) sed -n 2,25p "$0"; exit 2 ;;
esac
