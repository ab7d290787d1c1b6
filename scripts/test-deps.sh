#!/usr/bin/env bash
# scripts/test-deps.sh -- the packages `make test` needs beyond gcc and make.
#
# The pytest harness (tests/run_pytest.sh) needs a python3 with pytest and numpy (and Debian's
# python3-matplotlib, for the hook plot: without it that test skips, saying so, and
# python3-pytest-xdist, for make test-py's two workers: without it one runs, saying so), and the
# llama.cpp oracle fetch (tests/oracle/fetch_llama.sh) needs npm and git, and the fuzz targets
# (scripts/fuzz.sh, make fuzz / fuzz-replay) need clang with libFuzzer (Debian 12: clang, and
# libclang-rt-14-dev for libclang_rt.fuzzer-x86_64.a), and ds4 collect's Arrow check
# (tests/test_collect.py) flatc and the flatbuffers headers (flatbuffers-compiler,
# libflatbuffers-dev). This script is the
# one list of them: `make test` runs it first (also `make test-deps`), and CI (.ci/run) gets
# them through `make test` too.
#
# Nothing missing: it prints nothing. Something missing, running as root with apt-get: it
# installs the Debian packages (apt-get update, apt-get install) and says so in one line.
# Not root: it prints the exact command to run and exits non-zero. No apt-get (not Debian):
# it names the Debian packages and exits non-zero.
#
# What it is not: a general installer. It never installs the compiler or make (make is
# already running it; .ci/run installs those), CUDA (cuda-check skips without nvcc), or
# anything with pip; the python3 it installs into is Debian's /usr/bin/python3. A python3 on
# PATH with pytest and numpy is accepted too, since run_pytest.sh would use it. It does not
# check that the npm registry is reachable; fetch_llama.sh says so when it is not.
set -u

# Sets need=(the Debian packages still missing).
check() {
  need=()
  local cand have_py=0 py=/usr/bin/python3
  for cand in /usr/bin/python3 python3; do   # the same search as tests/run_pytest.sh
    if "$cand" -c "import pytest, numpy" >/dev/null 2>&1; then have_py=1; py=$cand; break; fi
  done
  if [ $have_py -eq 0 ]; then
    /usr/bin/python3 -c "import pytest" >/dev/null 2>&1 || need+=(python3-pytest)
    /usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || need+=(python3-numpy)
  fi
  # pytest's workers (make test-py); into Debian's python3 only (another runs one worker)
  if [ "$py" = /usr/bin/python3 ] && ! /usr/bin/python3 -c "import xdist" >/dev/null 2>&1; then
    need+=(python3-pytest-xdist)
  fi
  # the hook streams' plot (scripts/ds4hooks.py plot; tests/test_hooks.py draws one)
  /usr/bin/python3 -c "import matplotlib" >/dev/null 2>&1 || need+=(python3-matplotlib)
  command -v npm >/dev/null 2>&1 || need+=(npm)
  # the Arrow IPC verifier of tests/test_collect.py: flatc and the flatbuffers headers
  command -v flatc >/dev/null 2>&1 || need+=(flatbuffers-compiler)
  [ -f /usr/include/flatbuffers/flatbuffers.h ] || need+=(libflatbuffers-dev)
  command -v git >/dev/null 2>&1 || need+=(git)
  # libFuzzer: clang, and a link of -fsanitize=fuzzer that works (libclang_rt.fuzzer is in
  # libclang-rt-14-dev on Debian 12, not in the clang package)
  if ! command -v clang >/dev/null 2>&1; then
    need+=(clang libclang-rt-14-dev)
  elif ! echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }' |
         clang -fsanitize=fuzzer -x c - -o /dev/null >/dev/null 2>&1; then
    need+=(libclang-rt-14-dev)
  fi
}

check
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: error: make test needs ${need[*]} (Debian names); no apt-get here, so install them with this system's package manager" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "test-deps: error: make test needs ${need[*]}, and only root installs them; run:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi

echo "test-deps: installing ${need[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -qq; then
  echo "test-deps: error: apt-get update failed; could not install ${need[*]}" >&2
  exit 1
fi
if ! apt-get install -y -qq "${need[@]}" >/dev/null; then
  echo "test-deps: error: apt-get install -y ${need[*]} failed" >&2
  exit 1
fi

# Check again: apt-get said yes, but are the modules and commands there now?
wanted="${need[*]}"
check
if [ ${#need[@]} -gt 0 ]; then
  echo "test-deps: error: apt-get installed $wanted, but ${need[*]} still not usable (pytest and numpy are checked with /usr/bin/python3)" >&2
  exit 1
fi
