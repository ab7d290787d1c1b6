"""scripts/kernel_table.py, the table behind scripts/kernel_report.sh (and issue 26's per-kernel time and
DRAM GB/s): its self-test parses ncu CSV samples (raw page in every time unit, details page, the DRAM byte
counters) and checks the rows, the families, the before/after table, the bytes and the footer; a CSV it
cannot read is refused in one line, as the --before CSV; two CSVs give the table by family side by side.
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


def _samples():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import kernel_table
    before, after = os.path.join(OUT, "kt-before.csv"), os.path.join(OUT, "kt-after.csv")
    with open(before, "w") as f:
        f.write(kernel_table._raw_sample("nsecond", 1.0))
    with open(after, "w") as f:
        f.write(kernel_table._raw_sample("usecond", 0.5e-3))      # every kernel twice as fast
    return before, after


def test_before_and_after_by_family():
    before, after = _samples()
    r = run(after, "--before", before)
    assert r.returncode == 0, r.stderr
    rows = [l for l in r.stdout.splitlines() if l.startswith("| dense products (decode) | 147.6 | 73.8 | 0.50x |")]
    assert len(rows) == 1, r.stdout


def test_unreadable_before_is_refused():
    _, after = _samples()
    bad = os.path.join(OUT, "kt-not-ncu.csv")
    with open(bad, "w") as f:
        f.write("program output only\n")
    r = run(after, "--before", bad)
    assert r.returncode == 1 and "no ncu CSV header" in r.stderr and len(r.stderr.strip().splitlines()) == 1
