#!/usr/bin/env bash
# series.sh -- the patch series of patches/ (patches/README.md): the eager baseline engine and one
# patch per stage on top of it.  No baseline tree is stored: it is HEAD's tracked files (outside
# patches/) with every patch of patches/series reverse-applied.  Invariant: baseline + every patch
# == HEAD, byte for byte.  The project's documents (README.md, bench/RESULTS.md, tests/fuzz/RESULTS.md)
# and the tooling that drives the series and the GPU machine (this script, scripts/gpu-check.sh,
# tests/test_series.py) are in no patch: every stage carries HEAD's, so editing them never
# regenerates a patch.
#
#   scripts/series.sh base DIR          the baseline tree into DIR (created; must not exist)
#   scripts/series.sh tree N DIR        the baseline with the first N patches applied, into DIR
#                                       (N = 0: the baseline; 1: with 0001, the stream seam; N = -1:
#                                       all but the newest patch, which the GPU series check
#                                       compares HEAD with)
#   scripts/series.sh export DIR        DIR/base (the baseline) and DIR/patches (the numbered
#                                       patches and series): for a reviewer to `git apply` one at
#                                       a time
#   scripts/series.sh check             make series-check: the baseline, then each stage in turn,
#                                       built (CPU engine, CUDA compile and link when nvcc is
#                                       there) and tested (the C tests, and a CPU logit dump of the
#                                       tiny model that must be byte-identical across stages); the
#                                       last stage must equal HEAD
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
# Environment: SERIES_JOBS (make -j for check, default 2), CHECK_ARCH (the architecture check
# compiles each stage's CUDA engine for, sm_90), KEEP=1 (check keeps its work directory and says where).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCHES=$ROOT/patches
JOBS=${SERIES_JOBS:-2}
ARCH=${CHECK_ARCH:-sm_90}

die() { echo "series.sh: $*" >&2; exit 2; }

# What a patch never holds: the series itself, the project's documents and results, and the tooling
# that drives the series and the GPU machine (HEAD's at every stage: it works on HEAD's tree).
NOT_STAGED=(':(exclude)patches' ':(exclude)README.md' ':(exclude)bench/RESULTS.md' ':(exclude)tests/fuzz/RESULTS.md'
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

# build and test one stage in a copy of its tree; the tiny model's CPU dump goes to $3
# obj_cache get|put, in a stage's build directory: the CUDA objects (build/cuda-ARCH/ds4_cuda.o,
# build/cuda-ARCH/cu/X.o) keyed by the bytes that make them: the unit X.cu, every top-level file
# it includes (transitively, by #include "..."), the Makefile's NVCCFLAGS line and ARCH.  get
# copies each cached object whose key matches into place (newer than its sources, so make keeps
# it) and prints how many; put stores this stage's.  Equal inputs, equal object.
obj_cache() {
  local mode=$1 cache=$WORK/objcache
  mkdir -p "$cache"
  python3 - "$mode" "$cache" "$ARCH" <<'PYEOF'
import hashlib, os, re, shutil, sys
mode, cache, arch = sys.argv[1:4]
flags = [l for l in open("Makefile", errors="replace") if l.startswith("NVCCFLAGS")]
def key(unit):
    h, seen, todo = hashlib.sha256(), set(), [unit]
    h.update(("".join(flags) + arch).encode())
    while todo:
        f = todo.pop()
        if f in seen or not os.path.isfile(f):
            continue
        seen.add(f)
        data = open(f, "rb").read()
        h.update(f.encode() + b"\0" + data)
        todo += [m.decode() for m in re.findall(rb'^\s*#\s*include\s+"([^"/]+)"', data, re.M)]
    return h.hexdigest()
objs = {f"build/cuda-{arch}/ds4_cuda.o": "ds4_cuda.cu"}
objs.update({f"build/cuda-{arch}/cu/{u[:-3]}.o": u for u in os.listdir(".") if u.endswith(".cu")})
hits = 0
for obj, unit in objs.items():
    if not os.path.isfile(unit):
        continue
    c = os.path.join(cache, key(unit) + "-" + obj.replace("/", "_"))
    if mode == "get" and os.path.isfile(c):
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        shutil.copyfile(c, obj)
        hits += 1
    elif mode == "put" and os.path.isfile(obj) and not os.path.isfile(c):
        shutil.copyfile(obj, c)
if mode == "get" and hits:
    print(hits)
PYEOF
}

check_stage() {
  local tree=$1 label=$2 dump=$3 w
  w=$(mktemp -d "$WORK/build-XXXX")
  cp -a "$tree/." "$w/"
  echo "== $label: build and test ($w)"
  (
    cd "$w"
    make --no-print-directory -j"$JOBS" cpu > build.log 2>&1 || { tail -30 build.log; exit 1; }
    make --no-print-directory test-c > test-c.log 2>&1 || { tail -30 test-c.log; exit 1; }
    tail -1 test-c.log
    if command -v "${NVCC:-nvcc}" > /dev/null 2>&1; then
      # the engine and the backend-ops test, compiled and linked for CHECK_ARCH (the bench and
      # tool programs are HEAD's make cuda-check's); a CUDA unit whose inputs an earlier stage
      # compiled already is taken from that stage (obj_cache), and the link runs regardless
      local hits
      hits=$(obj_cache get)
      make --no-print-directory -j"$JOBS" "build/cuda-$ARCH/ds4" "build/cuda-$ARCH/test_backend_ops" \
          CUDA_ARCH="$ARCH" > cuda-check.log 2>&1 || { tail -30 cuda-check.log; exit 1; }
      obj_cache put
      echo "cuda: ds4 and test_backend_ops compiled and linked ($ARCH${hits:+; $hits unit(s) as compiled by an earlier stage})"
    else
      echo "cuda-check: skipped (nvcc not found)"
    fi
    { ./ds4 synth --config tiny --seed 1 --type f32 -o tiny.gguf \
        && ./ds4 -m tiny.gguf --backend cpu --tokens 1,5,9,14,2,7,3,30,11,4,8,6 -n 64 --dump-logits "$dump"; } \
        > dump.log 2>&1 || { tail -5 dump.log; exit 1; }
  ) || die "$label failed (its logs: $w)"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$w"
}

cmd_check() {
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/ds4-series-XXXX")
  [ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
  local -a ps
  mapfile -t ps < <(series)
  echo "series-check: ${#ps[@]} patches, work in $WORK"
  head_tree "$WORK/head"
  cp -a "$WORK/head" "$WORK/src"
  unapply_all "$WORK/src"
  echo "== baseline: reconstructed by reverse-applying the series to HEAD's tree"
  check_stage "$WORK/src" "baseline" "$WORK/dump-0.ds4logit"
  local k=0 p
  for p in "${ps[@]}"; do
    k=$((k + 1))
    gapply "$WORK/src" --binary --whitespace=nowarn "$PATCHES/$p" || die "$p does not apply on stage $((k - 1))"
    check_stage "$WORK/src" "stage $k ($p)" "$WORK/dump-$k.ds4logit"
    cmp -s "$WORK/dump-0.ds4logit" "$WORK/dump-$k.ds4logit" \
      || die "stage $k: the tiny model's CPU logits differ from the baseline's"
    echo "logits: byte-identical to the baseline's ($(wc -c < "$WORK/dump-$k.ds4logit") bytes)"
  done
  diff -r "$WORK/src" "$WORK/head" > "$WORK/final.diff" 2>&1 \
    || { head -40 "$WORK/final.diff"; die "baseline + series != HEAD (above)"; }
  echo "series-check: baseline + ${#ps[@]} patches == HEAD, every stage built and tested"
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
  add) cmd_add "$@" ;;
  regen) cmd_regen "$@" ;;
  edit) cmd_edit "$@" ;;
  refresh) cmd_refresh "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac; exit $?   # on the esac line: refresh rewrites this file, and bash reads on after a command
