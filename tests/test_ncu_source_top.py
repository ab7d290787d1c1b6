"""scripts/ncu_source_top.py, the reader of an ncu SASS source page (gpu-prefill.sh pcstall): the samples per
opcode and the instructions sampled most, from a page written here; a file without the samples column, or with
no samples, is refused in one line with exit 2.
"""
import os
import subprocess
import sys

from conftest import OUT, REPO

TOP = os.path.join(REPO, "scripts", "ncu_source_top.py")

PAGE = '''"Kernel Name","k_tc_wgmma"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x10","@!P0 BAR.SYNC.DEFER_BLOCKING 0x0","1,200","1,100","0","1100"
"0x20","WGMMA.64x64x16.F32.F16 gdesc[UR4], R24, R88","300","100","0","0"
"0x30","LDS.U.128 R4, [R2]","500","450","400","0"
"0x40","LDS.U.32 R5, [R2+0x4]","100","90","80","0"
"0x50","FFMA R1, R2, R3, R1","0","0","0","0"
'''


def run(text, *args):
    path = os.path.join(OUT, "ncu-page.csv")
    with open(path, "w") as f:
        f.write(text)
    return subprocess.run([sys.executable, TOP, path, *args], capture_output=True, text=True)


def test_opcodes_and_top_instructions():
    r = run(PAGE, "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "5 instructions, 2100 samples, 1740 of them not issued (82.9%)" in out
    # the opcode table: modifiers and the predicate guard dropped, the two LDS lines summed
    assert "| BAR | 1200 | 57.1% |" in out
    assert "| LDS | 600 | 28.6% |" in out
    assert "| WGMMA | 300 | 14.3% |" in out
    assert "FFMA" not in out.split("| address |")[0]
    # the two instructions sampled most, largest first, with their stall columns
    rows = [l for l in out.split("| address |")[1].splitlines() if l.startswith("| 0x")]
    assert len(rows) == 2
    assert rows[0].startswith("| 0x10 |") and "stall_barrier 1100" in rows[0]
    assert rows[1].startswith("| 0x30 |") and "stall_long_sb 400" in rows[1]


def test_a_page_without_samples_is_refused():
    r = run('"# Address","Source"\n"0x10","NOP"\n')
    assert r.returncode == 2
    assert "no 'Warp Stall Sampling (All Samples)' column" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run(PAGE.replace('"1,200","1,100"', '"0","0"').replace('"300"', '"0"').replace('"500"', '"0"')
            .replace('"100","90"', '"0","90"'))
    assert r.returncode == 2
    assert "no samples" in r.stderr
