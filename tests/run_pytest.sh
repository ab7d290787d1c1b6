#!/usr/bin/env bash
# Run the pytest harness with an interpreter that has pytest and numpy.
# Fetches and builds the llama.cpp oracle first (npm registry; cached in build/oracle).
# Extra arguments go to pytest.  pytest's exit 5 ("no tests collected") counts as failure
# here unless a marker selection was asked for, where it means "nothing to run".
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
"$PY" -m pytest -v -rs tests "$@"
rc=$?
if [ $rc -eq 5 ]; then
  case " $* " in
    *" -m "*) echo "run_pytest: no tests selected by the marker"; exit 0 ;;
    *) echo "run_pytest: pytest collected no tests" >&2; exit 1 ;;
  esac
fi
exit $rc
