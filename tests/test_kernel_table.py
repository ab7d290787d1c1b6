"""scripts/kernel_table.py, the table behind scripts/kernel_report.sh (and issue 26's per-kernel time and
DRAM GB/s): its self-test parses ncu CSV samples (raw page in every time unit, details page, the DRAM byte
counters) and checks the rows, the bytes and the footer; a CSV it cannot read is refused in one line.
"""
import os
import subprocess
import sys

from conftest import OUT, REPO

TABLE = os.path.join(REPO, "scripts", "kernel_table.py")


def run(*args):
    return subprocess.run([sys.executable, TABLE, *args], capture_output=True, text=True)


def test_self_test():
    r = run("--self-test")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-test: ok" in r.stdout


def test_unreadable_csv_is_refused():
    path = os.path.join(OUT, "not-ncu.csv")
    with open(path, "w") as f:
        f.write("program output only\n")
    r = run(path)
    assert r.returncode == 1
    assert "no ncu CSV header" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
