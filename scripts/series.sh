#!/usr/bin/env bash
# series.sh -- the patch series of patches/ (patches/README.md): the eager baseline engine and one
# patch per stage on top of it.  No baseline tree is stored: it is HEAD's tracked files (outside
# patches/) with every patch of patches/series reverse-applied.  Invariant: baseline + every patch
# == HEAD, byte for byte.  The project's documents (README.md, bench/RESULTS.md, bench/pending/:
# changes waiting for a GPU run, tests/fuzz/RESULTS.md) and the tooling that drives the series and
# the GPU machine (this script, scripts/gpu-check.sh, tests/test_series.py) are in no patch: every
# stage carries HEAD's, so editing them never regenerates a patch.
#
#   scripts/series.sh base DIR          the baseline tree into DIR (created; must not exist)
#   scripts/series.sh tree N DIR        the baseline with the first N patches applied, into DIR
#                                       (N = 0: the baseline; 1: with 0001, the stream seam; N = -1:
#                                       all but the newest patch, which the GPU series check
#                                       compares HEAD with)
#   scripts/series.sh export DIR        DIR/base (the baseline) and DIR/patches (the numbered
#                                       patches and series): for a reviewer to `git apply` one at
#                                       a time
#   scripts/series.sh check             make series-check: the baseline and each stage, each in a
#                                       tree of its own, built (CPU engine, CUDA compile and link
#                                       when nvcc is there, its CUDA units as one translation unit:
#                                       SERIES_UNITY) and tested (the C tests, and a CPU logit
#                                       dump of the tiny model that must be byte-identical across
#                                       stages); the last stage must equal HEAD.  The stages' jobs
#                                       run SERIES_JOBS at a time, reported in stage order; what an
#                                       earlier stage made from identical inputs (a compiler run,
#                                       the C tests' result, the dump) is reused, in a line saying so
#   scripts/series.sh add NAME REV      append patch NNNN-NAME.patch: HEAD's tracked files against
#                                       commit REV's (the last commit of the previous stage),
#                                       outside patches/, with a header to fill in
#   scripts/series.sh regen REV         after more commits of the newest stage: its patch := HEAD's
#                                       files against the stage before it as commit REV held it
#                                       (REV: a commit where the series was consistent, e.g. the
#                                       one before the new work), its header kept
#   scripts/series.sh edit N DIR        a git repository in DIR at stage N (0 = the baseline), one
#                                       commit per stage (tags stage-0 .. stage-N): change it there
#   scripts/series.sh refresh N DIR     patch N := DIR's stage N-1 .. DIR's working tree (N = 0:
#                                       the baseline itself changed); each later patch re-applied on
#                                       top (3-way) and regenerated; then this checkout's files
#                                       outside patches/ are set to the new top of the series.
#                                       Review with git diff, then commit.  A later patch K that
#                                       conflicts stops it: resolve in DIR, then refresh K DIR.
#
# Patches are `git format-patch`-style files: the header (everything before the first
# "diff --git") is the pull request's description and is kept when a patch is regenerated.
# Environment: SERIES_JOBS (check: the jobs run at once, and make -j inside each; default 2),
# CHECK_ARCH (the architecture check compiles each stage's CUDA engine for, compute_90: PTX),
# CHECK_NVCCFLAGS (its nvcc flags, "-std=c++17 -Xcicc -O0"), CHECK_CFLAGS (a stage's CPU build,
# "-O1 -ftree-vectorize"), CHECK_CUDA_CFLAGS (the C objects of its CUDA check, -O0), SERIES_UNITY
# (check: 1, the default, compiles a stage's CUDA units as one translation unit where its
# Makefile allows and CHECK_ARCH is a compute_ one; 0: one nvcc run a unit), KEEP=1 (check keeps
# its work directory and says where).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SELF=$ROOT/scripts/$(basename "$0")
PATCHES=$ROOT/patches
JOBS=${SERIES_JOBS:-2}
ARCH=${CHECK_ARCH:-compute_90}
# a stage's CUDA units compiled as one translation unit (job_cuda), where the check builds PTX
UNITY=${SERIES_UNITY:-1}
[[ "$ARCH" == compute_* ]] || UNITY=0
# A stage's CUDA build is a compile-and-link check: PTX for compute_90 with the device
# optimiser off takes a third of an sm_90 -O3 build; HEAD's own full build (make cuda-check,
# sm_90, -O3) is the one that meets ptxas
NVFLAGS=${CHECK_NVCCFLAGS:--std=c++17 -Xcicc -O0}
# The C side of a stage: its CPU build, whose C tests and dump run, at -O1 with the loop
# vectorizer (-O1's compile time; the C tests, whose CPU forward passes dominate, as fast as at
# -O2); the C objects of its CUDA check, which only link, at -O0.  Every stage takes the same
# flags, so the dumps compare as before (CHECK_CFLAGS, CHECK_CUDA_CFLAGS).
CPU_CFLAGS=${CHECK_CFLAGS:--O1 -ftree-vectorize}
CUDA_CFLAGS_CHECK=${CHECK_CUDA_CFLAGS:--O0}

die() { echo "series.sh: $*" >&2; exit 2; }

# What a patch never holds: the series itself, the project's documents and results, and the tooling
# that drives the series and the GPU machine (HEAD's at every stage: it works on HEAD's tree).
NOT_STAGED=(':(exclude)patches' ':(exclude)README.md' ':(exclude)bench/RESULTS.md' ':(exclude)bench/pending' ':(exclude)tests/fuzz/RESULTS.md'
            ':(exclude)scripts/series.sh' ':(exclude)scripts/gpu-check.sh' ':(exclude)tests/test_series.py')

# git apply in directory $1, as a plain patch tool there: a repository that merely encloses $1
# (a tree exported under a checkout's build/) must not make git apply skip "outside" paths;
# $1's own repository (an edit worktree) still counts.
gapply() {
  local d
  d=$(cd "$1" && pwd -P); shift
  (cd "$d" && GIT_CEILING_DIRECTORIES=$(dirname "$d") git apply "$@")
}
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# the patch files, in order
series() {
  [ -f "$PATCHES/series" ] || die "no $PATCHES/series"
  local p
  while IFS= read -r p; do
    p=${p%%#*}; p=$(echo "$p" | tr -d '[:space:]')
    [ -n "$p" ] || continue
    [ -f "$PATCHES/$p" ] || die "patches/series names $p, which is not in patches/"
    echo "$p"
  done < "$PATCHES/series"
}

# HEAD's tracked files outside patches/ into DIR
head_tree() {
  mkdir -p "$1"
  git -C "$ROOT" archive HEAD | tar -x -C "$1"
  rm -rf "$1/patches"
}

# reverse-apply the whole series in DIR (a copy of HEAD's tree): the baseline
unapply_all() {
  local d=$1 p
  local -a ps
  mapfile -t ps < <(series)
  for ((i = ${#ps[@]} - 1; i >= 0; i--)); do
    p=${ps[$i]}
    gapply "$d" -R --binary --whitespace=nowarn "$PATCHES/$p" \
      || die "patch $p does not reverse-apply to HEAD's tree (HEAD != baseline + series: run refresh)"
  done
}

# a patch file's header (up to the first diff), then the diff given on stdin
write_patch() {
  local file=$1 header=$2
  { printf '%s' "$header"; cat; } > "$file.tmp"
  mv "$file.tmp" "$file"
}
header_of() { awk '/^diff --git /{exit} {print}' "$1"; }

cmd_base() {
  local dir=${1:-}; [ -n "$dir" ] || die "usage: series.sh base DIR"
  [ ! -e "$dir" ] || die "$dir exists"
  head_tree "$dir"
  unapply_all "$dir"
  echo "series.sh: baseline in $dir ($(series | wc -l) patches reverse-applied)"
}

cmd_tree() {
  local n=${1:-} dir=${2:-}
  [ -n "$n" ] && [ -n "$dir" ] || die "usage: series.sh tree N DIR"
  local -a ps
  mapfile -t ps < <(series)
  [ "$n" = "-1" ] && n=$(( ${#ps[@]} - 1 ))
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -le ${#ps[@]} ] || die "tree $n: the series has 0..${#ps[@]} patches"
  cmd_base "$dir" > /dev/null
  local i
  for ((i = 0; i < n; i++)); do
    gapply "$dir" --binary --whitespace=nowarn "$PATCHES/${ps[$i]}" || die "patch ${ps[$i]} does not apply"
  done
  echo "series.sh: the baseline and $n patches in $dir"
}

cmd_export() {
  local dir=${1:-}; [ -n "$dir" ] || die "usage: series.sh export DIR"
  [ ! -e "$dir" ] || die "$dir exists"
  mkdir -p "$dir/patches"
  cmd_base "$dir/base" > /dev/null
  local p
  for p in $(series); do cp "$PATCHES/$p" "$dir/patches/"; done
  cp "$PATCHES/series" "$dir/patches/"
  echo "series.sh: $dir/base (the baseline) and $dir/patches ($(series | wc -l) patches):"
  echo "  cd $dir/base && git apply ../patches/0001-*.patch   # then the next, one at a time"
}

# ---- check ----
# Every stage is built and tested in a tree of its own ($WORK/stage-K, and a copy for the CUDA
# build), as two jobs: cpu (make cpu, the C tests, the tiny model's CPU dump) and cuda (the engine
# and test_backend_ops compiled and linked for CHECK_ARCH).  The jobs of all stages are scheduled
# SERIES_JOBS at a time, so one stage's nvcc runs beside another's; a stage is reported, in
# order, when both its jobs are done.
#
# What an earlier stage already made from the same inputs is reused, never weaker than making
# it again: every compiler run (cc and nvcc, compile or link) goes through a cache keyed by the
# compiler (its path and --version), the exact arguments and the bytes of every input (a source
# with every file it includes by #include "...", transitively; an object or a library given by
# path); a run whose key an earlier stage ran gets that stage's output, byte for byte.  The C
# tests' result is keyed by their programs' bytes and test-c's recipe (the tests read no file
# of the tree: they build what they read), the dump by ./ds4's bytes and the dump's command.
# Each reuse is said in the stage's lines.  Equal inputs, equal result: the invariant proven is
# the same (every stage builds, its tests pass, its dump is byte-identical to the baseline's).

# the cache's compiler wrapper and key helper (python), written into $WORK/bin at check time
write_cache_tools() {
  mkdir -p "$WORK/bin" "$WORK/cache" "$WORK/wait"
  cat > "$WORK/bin/cache.py" <<'PYEOF'
import fcntl, hashlib, os, re, shutil, subprocess, sys

INC = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^">]+)[">]', re.M)
SRC = (".c", ".h", ".cu", ".cuh", ".cc", ".cpp", ".hpp", ".inc")

def hash_inputs(h, paths, incdirs):
    """content of each path; for a source, of every file it includes by "..." (its directory,
    then the -I directories) or <...> (the -I directories), transitively"""
    seen, todo = set(), list(paths)
    while todo:
        f = os.path.normpath(todo.pop(0))
        if f in seen or not os.path.isfile(f):
            continue
        seen.add(f)
        data = open(f, "rb").read()
        h.update(b"file\0" + f.encode() + b"\0" + hashlib.sha256(data).digest())
        if f.endswith(SRC):
            for kind, name in INC.findall(data):
                name = name.decode(errors="replace")
                dirs = ([os.path.dirname(f)] if kind == b'"' else []) + incdirs
                for d in dirs:
                    c = os.path.join(d, name)
                    if os.path.isfile(c):
                        todo.append(c)
                        break

def compiler(real, args):
    out = args[args.index("-o") + 1] if "-o" in args[:-1] else None
    cache, log = os.environ["SERIES_CACHE"], os.environ.get("SERIES_LOG")
    if not out or not cache:
        os.execvp(real, [real] + args)
    incdirs, i = [], 0
    while i < len(args):
        if args[i] == "-I" and i + 1 < len(args):
            incdirs.append(args[i + 1]); i += 1
        elif args[i].startswith("-I"):
            incdirs.append(args[i][2:])
        i += 1
    h = hashlib.sha256()
    h.update(os.environ.get("SERIES_TOOLS", "").encode() + b"\0" + real.encode() + b"\0")
    for i, a in enumerate(args):
        h.update(b"arg\0" + a.encode() + b"\0")
    hash_inputs(h, [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-o")
                    and os.path.isfile(a)], incdirs)
    entry = os.path.join(cache, h.hexdigest())
    lock = open(entry + ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:                      # the same run is under way in another stage: wait for it
        waiting = os.path.join(os.environ["SERIES_WAIT"], str(os.getpid()))
        open(waiting, "w").close()
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.unlink(waiting)
    if os.path.isfile(entry + ".out"):
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        shutil.copyfile(entry + ".out", out + ".tmp")
        shutil.copymode(entry + ".out", out + ".tmp")
        os.replace(out + ".tmp", out)
        who = open(entry + ".who").read().strip()
        if log:
            open(log, "a").write(f"reused {out} {who}\n")
        return 0
    rc = subprocess.call([real] + args)
    if rc == 0 and os.path.isfile(out):
        shutil.copy2(out, entry + ".tmp")
        open(entry + ".who", "w").write(os.environ.get("SERIES_STAGE", "?") + "\n")
        os.replace(entry + ".tmp", entry + ".out")
    if log:
        open(log, "a").write(f"ran {out}\n")
    return rc

def key(kind):
    """stdin's text and the bytes of every word of it that names a file"""
    text = sys.stdin.buffer.read()
    h = hashlib.sha256(kind.encode() + b"\0" + os.environ.get("SERIES_TOOLS", "").encode() + b"\0" + text)
    hash_inputs(h, [w for w in text.decode(errors="replace").split() if os.path.isfile(w)], [])
    return h.hexdigest()

def units(arch, dirs, unity):
    """per stage tree, the keys of its CUDA units (the unit, what it includes, NVCCFLAGS): which
    stage's cuda job to wait for instead of compiling a unit twice at once; where the units are
    compiled as one translation unit (unity: job_cuda's), one key for all of them"""
    for d in dirs:
        mk = open(os.path.join(d, "Makefile"), "rb").read()
        flags = b"".join(l for l in mk.splitlines(True) if l.startswith(b"NVCCFLAGS"))
        one = unity == "1" and b"\ndefine CUDA_UNIT" in mk
        cus = [u for u in sorted(os.listdir(d)) if u.endswith(".cu")]
        ks = []
        for grp in ([cus] if one else [[u] for u in cus]):
            h = hashlib.sha256(flags + arch.encode())
            cwd = os.getcwd(); os.chdir(d)
            hash_inputs(h, grp, ["."])
            os.chdir(cwd)
            ks.append(h.hexdigest()[:16])
        print(" ".join(ks) if ks else "-")

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "cc":
        sys.exit(compiler(sys.argv[2], sys.argv[3:]))
    elif mode == "key":
        print(key(sys.argv[2]))
    elif mode == "units":
        units(sys.argv[2], sys.argv[4:], sys.argv[3])
PYEOF
  local cc nvcc py
  # the interpreter itself, not a version manager's shim, without the site module (-S: the
  # wrapper, run once per compiler run, needs only the standard library)
  py=$(python3 -c 'import sys; print(sys.executable)')
  cc=$(command -v "${CC:-cc}") || die "no C compiler (${CC:-cc})"
  printf '#!/bin/sh\nexec %q -S %q "$@"\n' "$py" "$WORK/bin/cache.py" > "$WORK/bin/cachepy"
  chmod +x "$WORK/bin/cachepy"
  printf '#!/bin/sh\nexec %q -S %q cc %q "$@"\n' "$py" "$WORK/bin/cache.py" "$cc" > "$WORK/bin/cc"
  chmod +x "$WORK/bin/cc"
  SERIES_TOOLS="$("$cc" --version 2>&1 | head -1); $(g++ --version 2>&1 | head -1)"
  if nvcc=$(command -v "${NVCC:-nvcc}"); then
    printf '#!/bin/sh\nexec %q -S %q cc %q "$@"\n' "$py" "$WORK/bin/cache.py" "$nvcc" > "$WORK/bin/nvcc"
    chmod +x "$WORK/bin/nvcc"
    SERIES_TOOLS="$SERIES_TOOLS; $("$nvcc" --version 2>&1 | tail -1)"
  fi
  export SERIES_TOOLS SERIES_CACHE=$WORK/cache SERIES_WAIT=$WORK/wait
  # job_cuda's question to a stage's Makefile: its CUDA units
  printf 'series-units:\n\t@echo $(CUDA_UNITS)\n' > "$WORK/bin/units.mk"
}

# "N of M compiler runs as STAGES made them" from a job's cache log
cache_summary() {
  local log=$1 n m who
  m=$(wc -l < "$log"); n=$(grep -c '^reused ' "$log" || true)
  who=$(awk '$1 == "reused" { $1 = $2 = ""; sub(/^  /, ""); print }' "$log" | sort -u | paste -sd, - | sed 's/,/, /g')
  if [ "$m" = 0 ]; then echo "nothing to run"
  elif [ "$n" = 0 ]; then echo "$m compiler runs"
  else echo "$m compiler runs, $n of them as ${who} made them"; fi
}

# a result (test-c's log, a dump) keyed by the text on stdin and the files it names: run CMD...
# (which writes FILE) unless an earlier stage had the key, whose FILE is then copied; says which
cached_result() {
  local kind=$1 file=$2; shift 2
  local k fd
  k=$("$WORK/bin/cachepy" key "$kind")
  exec {fd}> "$WORK/cache/$k.lock"
  flock "$fd"
  if [ -f "$WORK/cache/$k.out" ]; then
    cp "$WORK/cache/$k.out" "$file"
    REUSED_FROM=$(cat "$WORK/cache/$k.who")
  else
    REUSED_FROM=
    "$@" || { exec {fd}>&-; return 1; }
    cp "$file" "$WORK/cache/$k.tmp"
    echo "$SERIES_STAGE" > "$WORK/cache/$k.who"
    mv "$WORK/cache/$k.tmp" "$WORK/cache/$k.out"
  fi
  exec {fd}>&-
}

# series.sh __job cpu|cuda K DIR LABEL: one job of check, in DIR (its stage's tree)
job_cpu() {
  local k=$1 label=$2 t
  export SERIES_LOG=$PWD/cache-cpu.log SERIES_STAGE=$label
  : > "$SERIES_LOG"
  export CFLAGS=$CPU_CFLAGS
  make --no-print-directory -j"$JOBS" cpu CC="$WORK/bin/cc" > build.log 2>&1 || { tail -30 build.log; return 1; }
  echo "cpu: built ($(cache_summary "$SERIES_LOG"))"
  # the C tests: their programs, then test-c's recipe unless it and the programs are an earlier stage's
  : > "$SERIES_LOG"
  t=$(make -pq test-c 2>/dev/null | sed -n 's/^test-c: *//p' | head -1)
  make --no-print-directory -j"$JOBS" $t CC="$WORK/bin/cc" > test-build.log 2>&1 || { tail -30 test-build.log; return 1; }
  run_tests() { make --no-print-directory test-c CC="$WORK/bin/cc" > test-c.log 2>&1 || { tail -30 test-c.log; return 1; }; }
  make --no-print-directory -n test-c CC="$WORK/bin/cc" > test-c.recipe 2>&1
  cached_result test-c test-c.log run_tests < test-c.recipe || return 1
  if [ -n "$REUSED_FROM" ]; then
    echo "test-c: its programs and recipe are ${REUSED_FROM}'s, the result reused: $(tail -1 test-c.log)"
  else
    echo "test-c: $(tail -1 test-c.log) (programs: $(cache_summary "$SERIES_LOG"))"
  fi
  local dump=$WORK/dump-$k.ds4logit
  local cmd="./ds4 synth --config tiny --seed 1 --type f32 -o tiny.gguf && ./ds4 -m tiny.gguf --backend cpu --tokens 1,5,9,14,2,7,3,30,11,4,8,6 -n 64 --dump-logits $dump"
  run_dump() { sh -c "$cmd" > dump.log 2>&1 || { tail -5 dump.log; return 1; }; }
  printf '%s\n' "${cmd% --dump-logits*}" > dump.recipe
  cached_result dump "$dump" run_dump < dump.recipe || return 1
  [ -z "$REUSED_FROM" ] || echo "dump: ./ds4 is ${REUSED_FROM}'s binary, its dump reused"
}

job_cuda() {
  local k=$1 label=$2 units="" how=""
  local -a one=()
  export SERIES_LOG=$PWD/cache-cuda.log SERIES_STAGE=$label CFLAGS=$CUDA_CFLAGS_CHECK
  : > "$SERIES_LOG"
  # UNITY: a stage whose Makefile makes its CUDA units from CUDA_UNITS through the CUDA_UNIT
  # template compiles them as one translation unit (ds4_series_unity.cu, which includes each),
  # so that a change to a header every unit includes costs one nvcc run, not one a unit (an nvcc
  # run's fixed cost and the shared headers' parse are paid once); HEAD's own units are compiled
  # one by one by make cuda-check.  What this cannot see: a unit that compiles only after
  # another's includes.
  if [ "$UNITY" = 1 ] && grep -q '^define CUDA_UNIT' Makefile; then
    units=$(make --no-print-directory -s -f Makefile -f "$WORK/bin/units.mk" series-units 2>/dev/null || true)
  fi
  if [ -n "$units" ]; then
    printf '#include "%s.cu"\n' $units > ds4_series_unity.cu
    one=(CUDA_UNITS=ds4_series_unity)
    how=" (its $(echo $units | wc -w) CUDA units as one translation unit)"
  fi
  # the engine and the backend-ops test (the bench and tool programs are HEAD's make cuda-check's)
  make --no-print-directory -j"$JOBS" "build/cuda-$ARCH/ds4" "build/cuda-$ARCH/test_backend_ops" "${one[@]}" \
      CUDA_ARCH="$ARCH" NVCCFLAGS="$NVFLAGS" CC="$WORK/bin/cc" NVCC="$WORK/bin/nvcc" > cuda-check.log 2>&1 \
    || { tail -30 cuda-check.log; return 1; }
  echo "cuda: ds4 and test_backend_ops compiled$how and linked for $ARCH ($(cache_summary "$SERIES_LOG"))"
}

cmd_job() {
  local kind=$1 k=$2 dir=$3 label=$4 t0=$SECONDS rc=0
  cd "$dir"
  "job_$kind" "$k" "$label" > "$WORK/out/$kind-$k" 2>&1 || rc=$?
  echo "$kind job: $((SECONDS - t0)) s" >> "$WORK/out/$kind-$k"
  echo "$rc" > "$WORK/out/$kind-$k.rc"
}

stage_name() { if [ "$1" = 0 ]; then echo "the baseline"; else echo "stage $1 ($(series | sed -n "$1p"))"; fi; }

cmd_check() {
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/ds4-series-XXXX")
  export WORK JOBS ARCH UNITY
  [ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
  local -a ps
  mapfile -t ps < <(series)
  local n=${#ps[@]} k t0=$SECONDS
  echo "series-check: ${#ps[@]} patches, work in $WORK"
  # the trees: the baseline (HEAD with the series reverse-applied), then each patch on the one before
  head_tree "$WORK/head"
  cp -a "$WORK/head" "$WORK/stage-0"
  unapply_all "$WORK/stage-0"
  for ((k = 1; k <= n; k++)); do
    cp -a "$WORK/stage-$((k - 1))" "$WORK/stage-$k"
    gapply "$WORK/stage-$k" --binary --whitespace=nowarn "$PATCHES/${ps[$((k - 1))]}" \
      || die "${ps[$((k - 1))]} does not apply on stage $((k - 1))"
  done
  diff -r "$WORK/stage-$n" "$WORK/head" > "$WORK/final.diff" 2>&1 \
    || { head -40 "$WORK/final.diff"; die "baseline + series != HEAD (above)"; }
  echo "the trees: the baseline (reverse-applied from HEAD's) and $n stages; the last == HEAD"
  write_cache_tools
  mkdir -p "$WORK/out"
  local -a labels queue
  labels[0]="the baseline"
  for ((k = 1; k <= n; k++)); do labels[$k]="stage $k"; done
  # the jobs, in stage order; a cuda job whose unit an earlier stage compiles waits for that stage's
  declare -A dep=()
  local nv=0
  if [ -x "$WORK/bin/nvcc" ]; then
    nv=1
    local -a ukeys
    mapfile -t ukeys < <(python3 "$WORK/bin/cache.py" units "$ARCH" "$UNITY" $(for ((k = 0; k <= n; k++)); do echo "$WORK/stage-$k"; done))
    declare -A first=()
    local u
    for ((k = 0; k <= n; k++)); do
      for u in ${ukeys[$k]}; do
        [ "$u" = - ] && continue
        if [ -z "${first[$u]:-}" ]; then first[$u]=$k
        elif [ "${first[$u]}" != "$k" ]; then dep[cuda-$k]="${dep[cuda-$k]:-} cuda-${first[$u]}"; fi
      done
    done
  fi
  for ((k = 0; k <= n; k++)); do
    [ "$nv" = 1 ] && queue+=("cuda-$k")
    queue+=("cpu-$k")
    [ "$nv" = 1 ] && cp -a "$WORK/stage-$k" "$WORK/stage-$k-cuda"
  done
  # the scheduler: SERIES_JOBS jobs at once, not counting one that waits for another's compiler run
  set -m
  declare -A state=() pid=()
  local running=0 next_print=0 j d ok failed=
  while :; do
    for j in "${!pid[@]}"; do
      [ -f "$WORK/out/$j.rc" ] || continue
      wait "${pid[$j]}" 2>/dev/null || true
      unset "pid[$j]"; running=$((running - 1))
      if [ "$(cat "$WORK/out/$j.rc")" != 0 ]; then state[$j]=failed; failed=$j; else state[$j]=done; fi
    done
    if [ -n "$failed" ]; then
      for j in "${!pid[@]}"; do kill -TERM -- "-${pid[$j]}" 2>/dev/null || true; done
      wait 2>/dev/null || true
      k=${failed#*-}
      echo "== $(stage_name "$k"): the ${failed%-*} job failed"
      cat "$WORK/out/$failed"
      die "$(stage_name "$k") failed (its tree: $WORK/stage-$k$( [ "${failed%-*}" = cpu ] || echo -cuda); KEEP=1 keeps it)"
    fi
    # report the stages whose jobs are done, in order
    while [ "$next_print" -le "$n" ] && [ "${state[cpu-$next_print]:-}" = done ] \
          && { [ "$nv" = 0 ] || [ "${state[cuda-$next_print]:-}" = done ]; }; do
      k=$next_print
      echo "== $(stage_name "$k")"
      cat "$WORK/out/cpu-$k"
      if [ "$nv" = 1 ]; then cat "$WORK/out/cuda-$k"; else echo "cuda-check: skipped (nvcc not found)"; fi
      if [ "$k" -gt 0 ]; then
        cmp -s "$WORK/dump-0.ds4logit" "$WORK/dump-$k.ds4logit" \
          || die "stage $k: the tiny model's CPU logits differ from the baseline's"
        echo "logits: byte-identical to the baseline's ($(wc -c < "$WORK/dump-$k.ds4logit") bytes)"
      fi
      [ "${KEEP:-0}" = 1 ] || rm -rf "$WORK/stage-$k" "$WORK/stage-$k-cuda"
      next_print=$((k + 1))
    done
    [ "$next_print" -gt "$n" ] && break
    # start what is ready
    local waiting
    waiting=$(find "$WORK/wait" -type f | wc -l)
    for j in "${queue[@]}"; do
      [ $((running - waiting)) -lt "$JOBS" ] || break
      [ -z "${state[$j]:-}" ] || continue
      ok=1
      for d in ${dep[$j]:-}; do [ "${state[$d]:-}" = done ] || ok=0; done
      [ "$ok" = 1 ] || continue
      k=${j#*-}
      d=$WORK/stage-$k; [ "${j%-*}" = cuda ] && d=$d-cuda
      bash "$SELF" __job "${j%-*}" "$k" "$d" "${labels[$k]}" &
      pid[$j]=$!; state[$j]=running; running=$((running + 1))
    done
    sleep 0.2
  done
  set +m
  echo "series-check: baseline + $n patches == HEAD, every stage built and tested ($((SECONDS - t0)) s)"
  [ "${KEEP:-0}" = 1 ] && echo "series-check: kept $WORK" || true
}

cmd_add() {
  local name=${1:-} rev=${2:-}
  [ -n "$name" ] && [ -n "$rev" ] || die "usage: series.sh add NAME REV"
  [[ "$name" =~ ^[a-z0-9][a-z0-9-]*$ ]] || die "NAME: lower-case letters, digits and dashes"
  git -C "$ROOT" rev-parse --verify -q "$rev^{commit}" > /dev/null || die "$rev is not a commit"
  local n file
  n=$(( $(series 2>/dev/null | wc -l) + 1 ))
  file=$(printf '%04d-%s.patch' "$n" "$name")
  local header
  header=$(printf 'From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: ds4 <ds4@localhost>\nSubject: [PATCH %d] %s\n\nWhat changes:\nWhy behaviour cannot change (or what does):\nVerification:\n---\n\n' "$n" "$name")
  git -C "$ROOT" diff --binary --full-index "$rev" HEAD -- . "${NOT_STAGED[@]}" | write_patch "$PATCHES/$file" "$header"$'\n\n'
  echo "$file" >> "$PATCHES/series"
  echo "series.sh: wrote patches/$file ($(grep -c '^diff --git ' "$PATCHES/$file") files); fill in its header, then commit"
}

cmd_regen() {
  local rev=${1:-}
  [ -n "$rev" ] || die "usage: series.sh regen REV"
  git -C "$ROOT" rev-parse --verify -q "$rev^{commit}" > /dev/null || die "$rev is not a commit"
  local p t
  p=$(series | tail -1)
  [ -n "$p" ] || die "the series is empty"
  t=$(mktemp -d)
  # the stage before the newest, as REV held it: REV's files without REV's newest patch
  git -C "$ROOT" archive "$rev" | tar -x -C "$t"
  git -C "$ROOT" show "$rev:patches/$p" > "$t.patch" 2> /dev/null || die "$rev has no patches/$p"
  rm -rf "$t/patches"
  gapply "$t" -R --binary --whitespace=nowarn "$t.patch" 2> /dev/null \
    || die "at $rev the series is not consistent (its $p does not reverse-apply to its files)"
  git -C "$t" init -q
  git -C "$t" add -A
  git -C "$t" -c user.name=series -c user.email=series@localhost commit -qm "stage before $p"
  # the newest patch: that stage against HEAD's files
  find "$t" -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {} +
  git -C "$ROOT" archive HEAD | tar -x -C "$t"
  rm -rf "$t/patches"
  git -C "$t" add -A
  git -C "$t" diff --cached --binary --full-index -- . "${NOT_STAGED[@]}" | write_patch "$PATCHES/$p" "$(header_of "$PATCHES/$p")"$'\n'
  rm -rf "$t" "$t.patch"
  echo "series.sh: regenerated patches/$p: the stage before it as at $rev, against HEAD ($(grep -c '^diff --git ' "$PATCHES/$p") files)"
}

cmd_edit() {
  local n=${1:-} dir=${2:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ -n "$dir" ] || die "usage: series.sh edit N DIR"
  local -a ps
  mapfile -t ps < <(series)
  [ "$n" -le "${#ps[@]}" ] || die "there are ${#ps[@]} patches"
  [ ! -e "$dir" ] || die "$dir exists"
  cmd_base "$dir" > /dev/null
  git -C "$dir" init -q
  git -C "$dir" add -A
  git -C "$dir" -c user.name=series -c user.email=series@localhost commit -qm "stage 0: baseline"
  git -C "$dir" tag stage-0
  local k
  for ((k = 1; k <= n; k++)); do
    gapply "$dir" --binary --whitespace=nowarn "$PATCHES/${ps[$((k - 1))]}"
    git -C "$dir" add -A
    git -C "$dir" -c user.name=series -c user.email=series@localhost commit -qm "stage $k: ${ps[$((k - 1))]}"
    git -C "$dir" tag "stage-$k"
  done
  echo "series.sh: $dir is at stage $n; change it (commits or not), then: scripts/series.sh refresh $n $dir"
}

cmd_refresh() {
  local n=${1:-} dir=${2:-}
  [[ "$n" =~ ^[0-9]+$ ]] && [ -n "$dir" ] || die "usage: series.sh refresh N DIR"
  # stage-N: an edit worktree at stage N; stage-(N-1) alone: one whose patch N stopped on a
  # conflict during an earlier refresh and was resolved there
  git -C "$dir" rev-parse -q --verify "stage-$n" > /dev/null \
    || { [ "$n" -ge 1 ] && git -C "$dir" rev-parse -q --verify "stage-$((n - 1))" > /dev/null; } \
    || die "$dir is not an edit worktree at stage $n"
  local -a ps
  mapfile -t ps < <(series)
  local g=(git -C "$dir" -c user.name=series -c user.email=series@localhost)
  "${g[@]}" add -A
  "${g[@]}" commit -qm "stage $n: edited" --allow-empty
  "${g[@]}" tag -f "stage-$n" HEAD > /dev/null
  local prev k p
  if [ "$n" -ge 1 ]; then
    p=${ps[$((n - 1))]}
    "${g[@]}" diff --binary --full-index "stage-$((n - 1))" HEAD -- . "${NOT_STAGED[@]}" | write_patch "$PATCHES/$p" "$(header_of "$PATCHES/$p")"$'\n'
    echo "series.sh: regenerated $p"
  fi
  for ((k = n + 1; k <= ${#ps[@]}; k++)); do
    p=${ps[$((k - 1))]}
    prev=$("${g[@]}" rev-parse HEAD)
    "${g[@]}" tag -f "stage-$((k - 1))" HEAD > /dev/null
    gapply "$dir" --3way --binary --whitespace=nowarn "$PATCHES/$p" 2> "$dir/.git/series-apply.log" \
      || { cat "$dir/.git/series-apply.log" >&2
           die "$p does not apply on the changed stage $((k - 1)): resolve in $dir, commit, then refresh $k $dir"; }
    "${g[@]}" add -A
    "${g[@]}" commit -qm "stage $k: $p" --allow-empty
    "${g[@]}" tag -f "stage-$k" HEAD > /dev/null
    "${g[@]}" diff --binary --full-index "$prev" HEAD -- . "${NOT_STAGED[@]}" | write_patch "$PATCHES/$p" "$(header_of "$PATCHES/$p")"$'\n'
    echo "series.sh: re-applied and regenerated $p"
  done
  # this checkout := the new top of the series (outside patches/)
  local top
  top=$(mktemp -d)
  git -C "$dir" archive HEAD | tar -x -C "$top"
  rm -rf "$top/patches"
  (cd "$ROOT" && git ls-files -z -- . ':(exclude)patches') | while IFS= read -r -d '' f; do
    [ -e "$top/$f" ] || rm -f "$ROOT/$f"
  done
  cp -a "$top/." "$ROOT/"
  rm -rf "$top"
  echo "series.sh: the checkout now holds baseline + series; review (git status, git diff), then commit"
}

verb=${1:-}; shift || true
case "$verb" in
  base) cmd_base "$@" ;;
  tree) cmd_tree "$@" ;;
  export) cmd_export "$@" ;;
  check) cmd_check "$@" ;;
  __job) cmd_job "$@" ;;
  add) cmd_add "$@" ;;
  regen) cmd_regen "$@" ;;
  edit) cmd_edit "$@" ;;
  refresh) cmd_refresh "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac; exit $?   # on the esac line: refresh rewrites this file, and bash reads on after a command
