"""ds4_quant.c's dequantisation against ggml's, bit for bit (tests/oracle/quant_oracle.c).

Q2_K, Q4_K, IQ2_XXS and the control Q8_0: ds4_quant_dequant and ggml's to_float (libggml-base
of the npm llama.cpp release in build/oracle) must give identical float bytes on random valid
blocks, on random bytes with finite scales, and on ggml's own quantiser's output; plus all
65536 f16 scale values.  The oracle is rebuilt on every run, so editing ds4_quant.c (a grid
constant, the order of a multiply) fails this test.
"""
import os
import re
import shutil
import subprocess

import pytest

from conftest import ORACLE_DIR, REPO

BIN = os.path.join(ORACLE_DIR, "bin", "quant_oracle")
LIB = os.path.join(ORACLE_DIR, "lib")
TYPES = ["Q2_K", "Q4_K", "IQ2_XXS", "Q8_0"]
MIN_BLOCKS = 10000


def build_oracle(extra=(), out=BIN):
    if not os.path.exists(os.path.join(LIB, "libggml-base.so")) or \
            not os.path.exists(os.path.join(ORACLE_DIR, "include", "ggml.h")):
        pytest.skip(f"no libggml-base.so / ggml.h in {ORACLE_DIR} "
                    "(tests/oracle/fetch_llama.sh build/oracle fetches them; tests/run_pytest.sh does)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", *extra,
           "-I" + os.path.join(ORACLE_DIR, "include"),
           os.path.join(REPO, "tests", "oracle", "quant_oracle.c"), os.path.join(REPO, "ds4_quant.c"),
           "-o", out, "-L" + LIB, "-lggml-base", "-lm",
           "-Wl,-rpath,$ORIGIN/../lib", "-Wl,-rpath," + os.path.abspath(LIB)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"building quant_oracle failed:\n{' '.join(cmd)}\n{r.stderr}"
    return out


def test_dequant_bit_exact_vs_ggml():
    binary = build_oracle()
    r = subprocess.run([binary], capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, f"quant_oracle exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
    for t in TYPES:
        m = re.search(rf"^{t}\s.*blocks compared (\d+) .*mismatches (\d+)$", r.stdout, re.M)
        assert m, f"no result line for {t}:\n{r.stdout}"
        assert int(m.group(1)) >= MIN_BLOCKS, f"{t}: only {m.group(1)} blocks compared"
        assert int(m.group(2)) == 0
    m = re.search(r"^F16\s.*blocks compared (\d+), mismatches (\d+)$", r.stdout, re.M)
    assert m and int(m.group(1)) == 65536 and int(m.group(2)) == 0
    assert re.search(r"^API\s+checks failed: 0$", r.stdout, re.M)
    assert r.stdout.rstrip().endswith("OK: bit-exact")


def test_dequant_other_seed():
    """A second, independent draw of every block source (catches seed-lucky passes)."""
    binary = build_oracle()
    r = subprocess.run([binary, "--seed", "7", "--blocks", "12000", "--quant-rows", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"quant_oracle --seed 7 exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert "mismatches 0" in r.stdout and "OK: bit-exact" in r.stdout


def test_dequant_fma_build():
    """Built with FMA and fp-contract=fast the bits do not move: every product is exact in float."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        flags = ""
    if not re.search(r"^flags\s*:.*\bfma\b", flags, re.M):
        pytest.skip("CPU without FMA (or no /proc/cpuinfo)")
    binary = build_oracle(extra=["-O3", "-mfma", "-ffp-contract=fast"], out=BIN + "-fma")
    r = subprocess.run([binary, "--blocks", "12000", "--quant-rows", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"FMA-built quant_oracle exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
    assert "OK: bit-exact" in r.stdout
