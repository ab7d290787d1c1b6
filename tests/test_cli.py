"""Bad input to the ds4 program: every case exits non-zero with ONE line naming the problem,
never a crash (no signal, no sanitizer report).  `make sanitize` runs this file against an
ASan+UBSan build (TEST_DS4_BIN)."""
import os
import shutil
import subprocess

import pytest

from conftest import OUT, REPO, ds4_run, make_model, run, DS4


def expect_error(args, needle, env=None, binary=None):
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("DS4_"):
            del e[k]
    if env:
        e.update(env)
    r = run([binary or DS4] + args, env=e)
    assert 0 < r.returncode < 128, f"exit {r.returncode} for {args}: {r.stderr}"
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one error line for {args}, got: {r.stderr!r}"
    assert lines[0].startswith("ds4: "), lines[0]
    assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert "AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr


FLAG_CASES = [
    (["--bogus"], "unknown option '--bogus'"),
    (["-n"], "needs a value"),
    (["-n", "abc"], "-n expects"),
    (["-n", "-3"], "-n expects"),
    (["--temp", "x"], "--temp expects"),
    (["--temp", "-1"], "--temp expects"),
    (["--top-p", "0"], "--top-p expects"),
    (["--top-p", "1.5"], "--top-p expects"),
    (["--seed", "-1"], "--seed expects"),
    (["--backend", "tpu"], "unknown --backend 'tpu'"),
    (["--tokens", "1,,2"], "--tokens expects"),
    (["--tokens", "1,2,"], "trailing comma"),
    (["--tokens", "-5"], "--tokens expects"),
    (["--tokens", "999999"], "out of range"),
    (["--tokens", "1,2", "-p", "x"], "give one of -p, -f or --tokens"),
    (["-f", "/nonexistent.txt"], "cannot read the prompt file"),
    (["-p", ""], "prompt is empty"),
    (["-c", "4", "-p", "Once upon a time"], "exceed --ctx 4"),
    (["-c", "0"], "-c expects"),
    (["--threads", "0"], "--threads expects"),
    (["--force", "1,2", "-n", "5"], "--force gives 2 ids but -n asks for 5"),
    (["--force", "1,2,3", "-n", "2"], "--force gives 3 ids but -n asks for 2"),
    (["-p", "a", "-p", "b"], "-p is given twice"),
    (["-c", "9", "--ctx", "9"], "-c is given twice"),
    (["-v", "--verbose"], "-v is given twice"),
    (["-i", "-p", "x"], "-i goes with --chat"),
    (["--dump-logits", "/nonexistent-dir/x.bin", "-n", "1"], "cannot write"),
    (["synth"], "synth needs --config"),
    (["synth", "--config", "huge", "-o", "/tmp/x.gguf"], "unknown synthetic config 'huge'"),
    (["synth", "--config", "tiny", "--type", "q4_0", "-o", "/tmp/x.gguf"], "unknown --type 'q4_0'"),
    (["synth", "--config", "tiny"], "synth needs -o"),
    (["synth", "--config", "tiny", "--seed", "x", "-o", "/tmp/x.gguf"], "--seed expects"),
    # found by tests/fuzz/fuzz_cli (tests/fuzz/crashers/cli/): a newline in an argument made the
    # error two lines; " -1" passed the '-' check and strtoull made it 2^64-1; --vocab/--experts
    # cut a long config at 96 bytes, so a bad one became good
    (["--bo\ngus"], "unknown option '--bo\\x0agus'"),
    (["--backend", "c\npu"], "unknown --backend 'c\\x0apu'"),
    (["--seed", " -1"], "--seed expects a non-negative integer, got ' -1'"),
    (["synth", "--config", "tiny", "--seed", "\t-2", "-o", "/tmp/x.gguf"], "got '\\x09-2'"),
    (["synth", "--config", "tiny@" + "0" * 82 + "16junk", "--vocab", "-o", os.path.join(OUT, "cut.gguf")],
     "unknown name or an expert count"),
    (["synth", "--config", "tiny", "--config", "small", "-o", "/tmp/x.gguf"], "--config is given twice"),
    (["--mtp-draft", "0"], "--mtp-draft expects an integer in [1, 3]"),
    (["--mtp-draft", "4"], "--mtp-draft expects an integer in [1, 3]"),
    (["--mtp-draft", "x"], "--mtp-draft expects an integer in [1, 3]"),
    (["--mtp-draft", "1"], "--mtp-draft needs a model with an MTP block"),   # tiny has none
]


@pytest.mark.parametrize("args,needle", FLAG_CASES, ids=[" ".join(a) or "-" for a, _ in FLAG_CASES])
def test_bad_flags(args, needle):
    if not any(a in ("-m", "synth") for a in args):
        args = ["-m", make_model("tiny")] + args
    expect_error(args, needle)


# Exit status: 2 for a usage error (a bad flag, value or combination), 1 when a file, the model
# or the run fails (README, "Running").
STATUS_CASES = [
    (["-n", "abc"], 2), (["-p", "a", "-p", "b"], 2), (["--tokens", "999999"], 2), (["-c", "4"], 2),
    (["synth", "--config", "nope", "-o", "/tmp/x.gguf"], 2), (["synth", "--config", "tiny"], 2),
    (["synth", "--config", "small-q2", "--experts", "2", "-o", "/tmp/x.gguf"], 2),
    (["synth", "--config", "tiny", "-o", "/nonexistent-dir/x.gguf"], 1),
    (["info"], 2), (["-m", "/nonexistent/model.gguf"], 1), (["info", "/nonexistent/model.gguf"], 1),
    (["--dump-logits", "/nonexistent-dir/x.bin", "-n", "1"], 1),
    (["--mtp-draft", "0"], 2), (["--mtp-draft", "1"], 2),
]


@pytest.mark.parametrize("args,status", STATUS_CASES, ids=[" ".join(a) for a, _ in STATUS_CASES])
def test_exit_status(args, status):
    if not any(a in ("-m", "synth", "info") for a in args):
        args = ["-m", make_model("tiny")] + args
    r = run([DS4] + args)
    assert r.returncode == status, f"{args}: exit {r.returncode}, expected {status}: {r.stderr}"


ENV_CASES = [
    ({"DS4_THREADS": "abc"}, "DS4_THREADS='abc'"),
    ({"DS4_THREADS": "-1"}, "DS4_THREADS='-1'"),
    ({"DS4_THREADS": "100000"}, "DS4_THREADS='100000'"),
    ({"DS4_NOPE": "1"}, "unknown environment variable DS4_NOPE"),
    ({"DS4_CUDA_GRAPHS": "2"}, "DS4_CUDA_GRAPHS='2' is not 0 or 1"),
    ({"DS4_CUDA_GRAPHS": "yes"}, "DS4_CUDA_GRAPHS='yes'"),
    ({"DS4_CUDA_GRAPHS": ""}, "DS4_CUDA_GRAPHS=''"),
    ({"DS4_LAUNCH_TRACE": ""}, "DS4_LAUNCH_TRACE is empty"),
    ({"DS4_CUDA_GRAPH_LAYERS": "-1"}, "DS4_CUDA_GRAPH_LAYERS='-1' is not an integer in [0, 1024]"),
    ({"DS4_CUDA_GRAPH_LAYERS": "4x"}, "DS4_CUDA_GRAPH_LAYERS='4x'"),
    ({"DS4_CUDA_GRAPH_CACHE": "0"}, "DS4_CUDA_GRAPH_CACHE='0' is not an integer in [1, 4096]"),
    ({"DS4_CUDA_GRAPH_CACHE": " 8"}, "DS4_CUDA_GRAPH_CACHE=' 8'"),
    ({"DS4_CUDA_GRAPH_FAIL": "+1"}, "DS4_CUDA_GRAPH_FAIL='+1'"),
    ({"DS4_CUDA_GRAPH_FAIL": ""}, "DS4_CUDA_GRAPH_FAIL=''"),
    ({"DS4_CUDA_GRAPH_PDL": "2"}, "DS4_CUDA_GRAPH_PDL='2' is not an integer in [0, 1]"),
    ({"DS4_CUDA_GRAPH_PDL": "on"}, "DS4_CUDA_GRAPH_PDL='on'"),
    ({"DS4_CUDA_EAGER_PDL": "2"}, "DS4_CUDA_EAGER_PDL='2' is not an integer in [0, 1]"),
    ({"DS4_CUDA_PREFILL_TC": "5"}, "DS4_CUDA_PREFILL_TC='5' is not an integer in [0, 4]"),
    ({"DS4_CUDA_PREFILL_ATTN": "3"}, "DS4_CUDA_PREFILL_ATTN='3' is not an integer in [0, 2]"),
    ({"DS4_CUDA_PREFILL_PLANES": "1"}, "DS4_CUDA_PREFILL_PLANES='1' is not an integer in [2, 3]"),
    ({"DS4_CUDA_DECODE_GROUP": "2"}, "DS4_CUDA_DECODE_GROUP='2' is not an integer in [0, 1]"),
    ({"DS4_CUDA_SHARED_STREAM": "on"}, "DS4_CUDA_SHARED_STREAM='on' is not an integer in [0, 1]"),
    ({"DS4_ROLLBACK_RESTORE": "4"}, "DS4_ROLLBACK_RESTORE='4' is not an integer in [0, 3]"),
    ({"DS4_MTP_FORCE": "0.5"}, "DS4_MTP_FORCE='0.5' is not P:FILE"),
    ({"DS4_MTP_FORCE": "1.5:ref.txt"}, "DS4_MTP_FORCE='1.5:ref.txt' is not P:FILE"),
    ({"DS4_MTP_FORCE": "1:ref.txt"}, "DS4_MTP_FORCE goes with --mtp-draft"),
    # found by tests/fuzz/fuzz_env: a newline in a value made the error two lines
    ({"DS4_THREADS": "1\n2"}, "DS4_THREADS='1\\x0a2'"),
]


@pytest.mark.parametrize("env,needle", ENV_CASES, ids=[list(e)[0] + "=" + list(e.values())[0] for e, _ in ENV_CASES])
def test_bad_env(env, needle):
    expect_error(["-m", make_model("tiny"), "-n", "1"], needle, env=env)


def test_env_variables_documented():
    """Every DS4_* variable the engine reads (ds4.c's list) is the one the unknown-variable
    error names, and has a row in the README's table with its default."""
    import re
    src = open(os.path.join(REPO, "ds4.c")).read()
    m = re.search(r"static const char \*known\[\] = \{(.*?)\};", src, re.S)
    known = re.findall(r'"(DS4_[A-Z0-9_]+)"', m.group(1))
    assert len(known) >= 10
    e = {k: v for k, v in os.environ.items() if not k.startswith("DS4_")}
    e["DS4_NOPE"] = "1"
    r = run([DS4, "-m", make_model("tiny"), "-n", "1"], env=e)
    named = re.search(r"ds4 reads: (.*?); see README", r.stderr).group(1).split(", ")
    assert sorted(named) == sorted(known), (named, known)
    readme = open(os.path.join(REPO, "README.md")).read()
    missing = [k for k in known if not re.search(r"^\| `" + k + r"` \|.*\| [^|]+ \|$", readme, re.M)]
    assert not missing, f"no README row (name, meaning, default) for {missing}"


def test_cuda_graphs_flag_on_cpu():
    """DS4_CUDA_GRAPHS=0/1 are read and validated at start-up; the CPU backend records nothing and
    says so once, and splitting the step into regions (DS4_CUDA_GRAPH_LAYERS) changes no logit:
    the dumps are byte-identical."""
    dumps = []
    for v in (None, "0", "1", "1:2"):
        e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        if v is not None:
            e["DS4_CUDA_GRAPHS"] = v[0]
        if v == "1:2":
            e["DS4_CUDA_GRAPH_LAYERS"] = "2"
        p = os.path.join(OUT, f"graphs-{v}.ds4logit")
        r = ds4_run(["-m", make_model("tiny"), "--tokens", "1,2,3,4", "-n", "8", "--backend", "cpu",
                     "--dump-logits", p], env=e)
        assert ("records no graphs" in r.stderr) == (v is not None and v[0] == "1"), r.stderr
        dumps.append(open(p, "rb").read())
    assert dumps[0] == dumps[1] == dumps[2] == dumps[3]


def bad_model(name, data):
    p = os.path.join(OUT, f"bad-{name}.gguf")
    with open(p, "wb") as f:
        f.write(data)
    return p


def test_bad_model_files():
    good = open(make_model("tiny"), "rb").read()
    cases = {
        "empty": (b"", "empty"),
        "magic": (b"GGUX" + good[4:], "magic"),
        "version": (good[:4] + (2).to_bytes(4, "little") + good[8:], "version"),
        "trunc-header": (good[:10], ""),
        "trunc-kv": (good[:200], ""),
        "trunc-data": (good[:len(good) // 2], ""),
        "trunc-last-byte": (good[:-1], ""),
        "garbage": (bytes(range(256)) * 64, ""),
    }
    for name, (data, needle) in cases.items():
        expect_error(["-m", bad_model(name, data), "-n", "1"], needle)
    expect_error(["-m", "/nonexistent/model.gguf"], "cannot open model")
    expect_error(["-m", OUT], "not a regular file")
    # a path or config with control bytes is quoted escaped: still one line
    expect_error(["-m", "/no\nexist.gguf"], "cannot open model '/no\\x0aexist.gguf'")
    expect_error(["synth", "--config", "ti\nny", "-o", os.path.join(OUT, "x.gguf")],
                 "unknown synthetic config 'ti\\x0any'")


def test_help_and_default_model():
    r = run([DS4, "--help"])
    assert r.returncode == 0 and "usage: ds4" in r.stdout
    assert "DS4_" in r.stdout and "README" in r.stdout          # the environment, and where it is documented
    default = os.path.join(os.path.dirname(DS4), "models", "ds4-tiny.gguf")
    if not os.path.exists(default):
        pytest.skip("no embedded default model beside this binary")
    r = subprocess.run([DS4, "-p", "Once upon a time", "-n", "8", "--backend", "cpu", "-v"], capture_output=True)
    err = r.stderr.decode("utf-8")
    assert r.returncode == 0, err
    # stdout is the generated text alone; the ids, the prompt and the speed are on stderr
    assert r.stdout.decode("utf-8").endswith("\n") and b"ids:" not in r.stdout and b"tok/s" not in r.stdout
    assert "generated ids:" in err and "tok/s" in err
    # the default model has a vocabulary (ds4 synth --vocab): the prompt is tokenized, BOS first
    prompt_ids = [int(x) for x in err.split("prompt ids:")[1].split("\n")[0].split()]
    assert prompt_ids[0] == 0 and len(prompt_ids) < 1 + len("Once upon a time")
    assert "prompt: <｜begin▁of▁sentence｜>Once upon a time\n" in err
    assert "byte-level ids" not in err
    # without -v: no ids
    r = run([DS4, "-n", "2"])
    assert r.returncode == 0 and "ids:" not in r.stderr and "speed:" in r.stderr


def test_info():
    """`ds4 info FILE`: types, parameters, memory and decode bytes; errors as one line."""
    r = run([DS4, "info", make_model("tiny")])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "F32" in out and "I32" in out and "total" in out
    assert "device memory for the weights:" in out and "weights read per decoded token:" in out
    total = [l for l in out.splitlines() if l.startswith("total")][0].split()
    params = sum(int(l.split()[2]) for l in out.splitlines() if l[:3] in ("F32", "I32"))
    assert int(total[2]) == params
    expect_error(["info", "/nonexistent/model.gguf"], "cannot open model")
    expect_error(["info"], "usage: ds4 info FILE")
    good = open(make_model("tiny"), "rb").read()
    expect_error(["info", bad_model("info-trunc", good[:len(good) // 2])], "")


def test_stats_flag():
    """--stats prints the backend's counters over the decode steps (the CPU backend has none)."""
    r = ds4_run(["-m", make_model("tiny"), "--tokens", "1,2,3", "-n", "5", "--backend", "cpu", "--stats"])
    assert "stats: decode 5 steps on cpu: 0.0 launches per step" in r.stderr, r.stderr


def test_launch_trace_on_cpu_says_so():
    e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    e["DS4_LAUNCH_TRACE"] = os.path.join(OUT, "cpu-trace.txt")
    r = ds4_run(["-m", make_model("tiny"), "--tokens", "1,2", "-n", "1", "--backend", "cpu"], env=e)
    assert "DS4_LAUNCH_TRACE: the cpu backend launches no kernels; nothing is traced" in r.stderr
