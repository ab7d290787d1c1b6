#!/usr/bin/env bash
# Run the pytest harness with an interpreter that has pytest and numpy.
# Fetches and builds the llama.cpp oracle first (npm registry; cached in build/oracle).
# Extra arguments go to pytest.  pytest's exit 5 ("no tests collected") counts as failure
# here unless a marker selection was asked for, where it means "nothing to run".
# TEST_WORKERS (default 1; `make test-py` sets 2): pytest processes (pytest-xdist), each test
# file whole in one (--dist loadfile: a file's tests keep their order and what they share);
# where the interpreter has no pytest-xdist, one process, after a line saying so.
set -u
cd "$(dirname "$0")/.."
PY=""
for cand in /usr/bin/python3 python3; do
  if "$cand" -c "import pytest, numpy" >/dev/null 2>&1; then PY="$cand"; break; fi
done
if [ -z "$PY" ]; then
  echo "run_pytest: no python3 with pytest and numpy (run scripts/test-deps.sh: it installs them as root, else prints the command)" >&2
  exit 2
fi
# TEST_QUICK=1 (make test-quick): the files that need no llama.cpp oracle, without fetching it
if [ -n "${TEST_QUICK:-}" ]; then
  "$PY" -m pytest -v -rs tests/test_cli.py tests/test_run.py tests/test_chat.py tests/test_layouts.py \
    tests/test_stream_check.py tests/test_kernel_table.py tests/test_hooks.py tests/test_collect.py tests/test_mtp.py tests/test_mtp_spec.py -k "not llama_cpp" "$@"
  rc=$?
  [ $rc -eq 5 ] && { echo "run_pytest: pytest collected no tests" >&2; exit 1; }
  exit $rc
fi
if ! tests/oracle/fetch_llama.sh build/oracle; then
  echo "run_pytest: could not fetch the llama.cpp oracle (npm)" >&2
  exit 2
fi
make --no-print-directory -f tests/oracle/Makefile.inc oracle ORACLE_PYTHON="$PY" >/dev/null || exit 2
W=${TEST_WORKERS:-1}
[[ "$W" =~ ^[1-9][0-9]?$ ]] || { echo "run_pytest: TEST_WORKERS='$W' is not a worker count (1..99)" >&2; exit 2; }
XD=()
if [ "$W" -gt 1 ]; then
  if "$PY" -c "import xdist" >/dev/null 2>&1; then
    XD=(-n "$W" --dist loadfile)
  else
    echo "run_pytest: $PY has no pytest-xdist (scripts/test-deps.sh installs python3-pytest-xdist): one worker, not $W"
  fi
fi
"$PY" -m pytest -v -rs "${XD[@]}" tests "$@"
rc=$?
if [ $rc -eq 5 ]; then
  case " $* " in
    *" -m "*) echo "run_pytest: no tests selected by the marker"; exit 0 ;;
    *) echo "run_pytest: pytest collected no tests" >&2; exit 1 ;;
  esac
fi
exit $rc
