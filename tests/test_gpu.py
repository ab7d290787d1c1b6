"""CUDA backend against the CPU path (the specification), on the same token sequences.

Runs only where a GPU exists and TEST_DS4_CUDA_BIN names a CUDA build of ds4 (make test-gpu,
scripts/gpu-check.sh); elsewhere every test here is skipped with a visible reason.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import CUDA_BIN, OUT, PROMPT, REPO, ds4_dump, ds4_run, ds4logit, make_model

sys.path.insert(0, os.path.join(REPO, "scripts"))
import ds4hooks  # noqa: E402  (scripts/ds4hooks.py: the hook stream reader)

pytestmark = pytest.mark.gpu

# Bound on max |dlogit| between the CUDA and CPU backends on f32-weight models.  Both compute
# in f32; the GPU sums dot products in a different (tree) order and uses cuBLAS Sgemm (no TF32)
# for prefill, so each op differs by ~1e-7..1e-6 relative (tests/test_backend_ops.c).
# Measured on an H200 (2026-11-29, prompt + 300 teacher-forced steps): tiny 3.3e-6, small
# 4.4e-6, other 4.5e-6 -- the same size as the CPU-vs-llama.cpp agreement, so the same bound
# (5e-5, ~10x margin) applies; real bugs move logits by 1e-2 or more.
GPU_TOL = 5e-5


def have_gpu():
    if not CUDA_BIN or not os.path.exists(CUDA_BIN):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


skip_no_gpu = pytest.mark.skipif(not have_gpu(), reason="skipped: no GPU (or TEST_DS4_CUDA_BIN unset)")


def compare(a, b, tol):
    da, db = ds4logit.read(a), ds4logit.read(b)
    assert np.array_equal(da.tokens, db.tokens)
    worst = float(np.abs(da.logits.astype(np.float64) - db.logits).max())
    assert worst <= tol, f"max |dlogit| {worst:.3g} > {tol:g}"
    bad = np.nonzero(da.argmax != db.argmax)[0]
    assert bad.size == 0, f"argmax differs first at row {int(bad[0])}"
    return worst


def cuda_vs_cpu(name):
    """Teacher-forced on the CPU's greedy tokens: prefill + 300 decode steps."""
    cpu = ds4_dump(name, tag="cpu-ref", extra=["--backend", "cpu"])
    d = ds4logit.read(cpu)
    cont = ",".join(map(str, d.tokens[len(PROMPT):].tolist()))
    gpu = ds4_dump(name, tag="cuda", binary=CUDA_BIN, extra=["--backend", "cuda", "--force", cont])
    worst = compare(gpu, cpu, GPU_TOL)
    print(f"{name}: max |dlogit| cuda vs cpu = {worst:.3g}")


@skip_no_gpu
@pytest.mark.parametrize("name", ["tiny", "small", "other"])
def test_cuda_matches_cpu(name):
    cuda_vs_cpu(name)


# The quantised layouts (IQ2_XXS/Q2_K or Q4_K experts, ds4_cuda_matvec_q.cuh): the same bound.  Their
# kernels' products are exact and their sums f32 (tensor-core accumulation), so the per-op error
# is DOT-sized like every other matvec's (test_backend_ops).  qo-*-ggml hold expert blocks
# written by libggml's own quantiser (test_quant_oracle makes them with the llama.cpp library;
# the GPU machine has no network, so scripts/gpu-check.sh carries them from build/carry/).
@skip_no_gpu
@pytest.mark.parametrize("name", ["small-q2", "small-q4", "qo-q2-ggml", "qo-q4-ggml"])
def test_cuda_matches_cpu_quant(name):
    if name.startswith("qo-") and not os.path.exists(os.path.join(OUT, name + ".gguf")):
        pytest.skip(f"skipped: {name}.gguf not in {OUT} (made by test_quant_oracle, carried by scripts/gpu-check.sh)")
    cuda_vs_cpu(name)


@skip_no_gpu
def test_cuda_greedy_same_tokens():
    cpu = ds4logit.read(ds4_dump("small", tag="cpu-g", extra=["--backend", "cpu"]))
    gpu = ds4logit.read(ds4_dump("small", tag="cuda-g", binary=CUDA_BIN, extra=["--backend", "cuda"]))
    assert np.array_equal(cpu.tokens, gpu.tokens)


@skip_no_gpu
def test_cuda_deterministic():
    a = ds4_dump("small", tag="cuda-a", binary=CUDA_BIN, extra=["--backend", "cuda"])
    b = ds4_dump("small", tag="cuda-b", binary=CUDA_BIN, extra=["--backend", "cuda"])
    assert open(a, "rb").read() == open(b, "rb").read()


@skip_no_gpu
@pytest.mark.parametrize("name", ["small", "small-q2"])
def test_cuda_graphs_flag_bit_identical(name):
    """DS4_CUDA_GRAPHS=1 against the flag unset, on the GPU: byte-identical dumps (prompt + 300
    steps).  Stage 0 only read the flag; from stage 2 on it captures and replays graphs, and
    this is the check that replay computes exactly what eager launches do."""
    dumps = []
    for v in (None, "1"):
        env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        if v:
            env["DS4_CUDA_GRAPHS"] = v
        out = os.path.join(OUT, f"{name}.cuda-graphs-{v or 'unset'}.ds4logit")
        ds4_run(["-m", make_model(name), "--backend", "cuda", "--tokens", ",".join(map(str, PROMPT)),
                 "-n", "300", "--dump-logits", out], binary=CUDA_BIN, env=env)
        dumps.append(open(out, "rb").read())
    assert dumps[0] == dumps[1]


@skip_no_gpu
@pytest.mark.parametrize("model", ["small", "small-q2"])
def test_eager_pdl_bit_identical(model):
    """DS4_CUDA_EAGER_PDL=1 (the default: kernels outside a recording, here every one, launched
    as programmatic dependents on sm_90+) against 0 (plain launches): byte-identical dumps of a
    300-token prompt in chunks of 128 (DS4_UBATCH) and 64 steps.  The same kernels in the same
    order, so any difference is a kernel that touches memory before its grid wait."""
    prompt = [(i * 7919) % 500 + 1 for i in range(300)]
    dumps = []
    for v in ("0", "1"):
        env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        env["DS4_CUDA_EAGER_PDL"] = v
        env["DS4_UBATCH"] = "128"
        out = os.path.join(OUT, f"{model}.eager-pdl-{v}.ds4logit")
        ds4_run(["-m", make_model(model), "--backend", "cuda", "--tokens", ",".join(map(str, prompt)),
                 "-n", "64", "--dump-logits", out], binary=CUDA_BIN, env=env)
        dumps.append(open(out, "rb").read())
    assert dumps[0] == dumps[1]


@skip_no_gpu
@pytest.mark.parametrize("graphs", [None, "1"])
def test_side_streams_bit_identical(graphs):
    """DS4_CUDA_SHARED_STREAM=1 (the default: at decode the MoE's shared expert on a side stream,
    and a ratio layer's compressors and indexer on another, beside the queries) against 0 (all
    in order on one stream): byte-identical dumps of small (ratio-4 and ratio-128 layers),
    prompt + 300 steps, eager and with graphs.  The same kernels on the same inputs, so any
    difference is a missing dependency between the streams."""
    dumps = []
    for v in ("0", "1"):
        env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        env["DS4_CUDA_SHARED_STREAM"] = v
        if graphs:
            env["DS4_CUDA_GRAPHS"] = graphs
        out = os.path.join(OUT, f"small.side-{v}-graphs-{graphs or 'unset'}.ds4logit")
        ds4_run(["-m", make_model("small"), "--backend", "cuda", "--tokens", ",".join(map(str, PROMPT)),
                 "-n", "300", "--dump-logits", out], binary=CUDA_BIN, env=env)
        dumps.append(open(out, "rb").read())
    assert dumps[0] == dumps[1]


def trace_steps(path):
    """A DS4_LAUNCH_TRACE file split into forward calls: the lines from a call's first upload
    (its step block) to its wait.  Returns [(uploads, launch lines)] in call order."""
    steps, cur = [], None
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("upload ") and (cur is None or cur[1]):
            cur = ([], [])          # a new call: its uploads come before any launch
            steps.append(cur)
        if cur is None:
            continue
        if line.startswith("upload "):
            cur[0].append(line)
        elif line.startswith("launch "):
            cur[1].append(line)
    return steps


@skip_no_gpu
@pytest.mark.parametrize("name,n", [("tiny", 200), ("small", 150)])
def test_decode_launches_replayable(name, n):
    """Stage 1 (patches/0003 and 0004, the trace and the step block): the launch trace (DS4_LAUNCH_TRACE) of every decode step -- each
    launch's kernel, grid, block, shared memory and argument bytes -- is byte-identical at every
    position, across the window wrap (tiny 32, small 64), the indexer's top-k threshold and the
    compressors' emit steps (every 4th and 128th).  So one captured step replays at any
    position.  The prompt's batch is a different shape, and its trace must differ."""
    trace = os.path.join(OUT, f"{name}.launch-trace.txt")
    env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    env["DS4_LAUNCH_TRACE"] = trace
    ds4_run(["-m", make_model(name), "--backend", "cuda", "--tokens", ",".join(map(str, PROMPT)),
             "-n", str(n)], binary=CUDA_BIN, env=env)
    steps = trace_steps(trace)
    assert len(steps) == 1 + n, f"{len(steps)} forward calls traced, expected 1 prompt + {n} steps"
    prefill, decode = steps[0], steps[1:]
    ref = decode[0][1]
    assert len(ref) > 20, f"a decode step traced only {len(ref)} launches"
    for i, (ups, launches) in enumerate(decode):
        assert ups == decode[0][0], f"decode step {i}: uploads {ups} != {decode[0][0]}"
        if launches != ref:
            diff = next(j for j in range(min(len(ref), len(launches))) if launches[j] != ref[j]) \
                if len(launches) == len(ref) else "count"
            raise AssertionError(f"decode step {i} (position {len(PROMPT) + i}): launches differ from step 0 "
                                 f"({len(launches)} vs {len(ref)} launches; first difference: {diff})")
    assert prefill[1] != ref


@skip_no_gpu
def test_decode_allocates_nothing_and_waits_once():
    """Stage 1: between the prompt and the end of decode the backend makes no device allocation or
    free and no device sync, and exactly one stream sync per step (the one that reads the
    logits), as its counters (ds4 --stats) report them."""
    n = 64
    r = ds4_run(["-m", make_model("small"), "--backend", "cuda", "--tokens", ",".join(map(str, PROMPT)),
                 "-n", str(n), "--stats"], binary=CUDA_BIN)
    line = next(l for l in r.stderr.splitlines() if l.startswith("stats:"))
    assert f"decode {n} steps on cuda" in line, line
    assert ", 0 device allocations, 0 frees, 0 device syncs, " in line, line
    assert line.endswith(f", {n} stream syncs"), line


def graph_run(name, n, graphs=None, layers=None, fail=None, stats=False, tag="", pdl=None):
    """ds4 on the GPU, prompt + n decode steps, its dump's bytes and its stdout/stderr."""
    env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    if graphs:
        env["DS4_CUDA_GRAPHS"] = "1"
    if pdl is not None:
        env["DS4_CUDA_GRAPH_PDL"] = str(pdl)
    if layers is not None:
        env["DS4_CUDA_GRAPH_LAYERS"] = str(layers)
    if fail is not None:
        env["DS4_CUDA_GRAPH_FAIL"] = str(fail)
    out = os.path.join(OUT, f"{name}.graphs-{tag or 'x'}.ds4logit")
    args = ["-m", make_model(name), "--backend", "cuda", "--tokens", ",".join(map(str, PROMPT)),
            "-n", str(n), "--dump-logits", out] + (["--stats"] if stats else [])
    r = ds4_run(args, binary=CUDA_BIN, env=env)
    data = open(out, "rb").read()
    os.remove(out)
    return data, r


def graph_stats(stderr):
    line = next(l for l in stderr.splitlines() if l.startswith("stats: graphs:"))
    nums = [int(x) for x in __import__("re").findall(r"(\d+) (?:captures|replays|eager fallbacks|held)", line)]
    return dict(zip(["captures", "replays", "fallbacks", "held"], nums)), line


@skip_no_gpu
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_graphs_replay_bit_identical_4096(name):
    """Stage 2: 4096 decode steps (every window wrap, compression boundary and the indexer's
    threshold many times over) with graphs -- one per step, and clusters of 1 and of 4 layers --
    give the eager run's dump byte for byte, with zero re-captures in steady decode: one capture
    per region, every later step replayed, no fallback."""
    n = 4096                 # past tiny's context_length 4096: its -1m twin (the same weights)
    eager, _ = graph_run(name + "-1m", n, tag="eager")
    layers = {"tiny": 6, "small": 8}[name]
    for lay in (None, 1, 4):
        data, r = graph_run(name + "-1m", n, graphs=True, layers=lay, stats=True, tag=f"g{lay}")
        assert data == eager, f"DS4_CUDA_GRAPH_LAYERS={lay}: the dump differs from eager"
        st, line = graph_stats(r.stderr)
        regions = 1 if not lay else -(-layers // lay)
        assert st["captures"] == regions, line
        assert st["replays"] == regions * (n - 1), line
        assert st["fallbacks"] == 0, line


@skip_no_gpu
def test_graphs_pdl_identical():
    """DS4_CUDA_GRAPH_PDL: recorded kernels launched as programmatic dependents (the default on
    sm_90+) or plainly give the eager dump byte for byte; --stats says which was used."""
    eager, _ = graph_run("small", 300, tag="eager-p")
    cc = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                        capture_output=True, text=True).stdout.split()
    on = bool(cc) and float(cc[0]) >= 9.0
    for pdl in (0, 1):
        data, r = graph_run("small", 300, graphs=True, stats=True, tag=f"pdl{pdl}", pdl=pdl)
        assert data == eager, f"DS4_CUDA_GRAPH_PDL={pdl}: the dump differs from eager"
        st, line = graph_stats(r.stderr)
        assert st["fallbacks"] == 0 and st["captures"] == 1, line
        assert line.endswith("programmatic dependent launch " + ("on" if pdl and on else "off")), line


@skip_no_gpu
def test_graphs_fail_closed():
    """DS4_CUDA_GRAPH_FAIL=1 makes the first capture fail: the region runs eagerly from then on,
    one line says so, the fallbacks are counted, and not a logit changes."""
    eager, _ = graph_run("small", 64, tag="eager-f")
    data, r = graph_run("small", 64, graphs=True, layers=4, fail=1, stats=True, tag="fail")
    assert data == eager
    assert r.stderr.count("CUDA graph recording of region") == 1, r.stderr
    assert "injected by DS4_CUDA_GRAPH_FAIL=1" in r.stderr
    st, line = graph_stats(r.stderr)
    assert st["fallbacks"] == 64 and st["captures"] == 1, line   # region 0 eager every step, region 1 recorded


# ---- hooks (stage 3): the CUDA emitter (ds4_hooks.cu) ----

HOOKS_ALL = "attn,resid,moe,logits,attn_probs"
# Bound on a hooked activation, CUDA against the CPU, relative to the array's largest
# magnitude: the activations are what the logits are made of, computed with the same op
# orders, so they carry the same ~1e-7..1e-6 relative differences per op (test_backend_ops);
# the logits agree to ~5e-6 of their ~1-10 scale.  1e-4 keeps ~10x margin over what the
# H200 measured (printed below); a wrong hook (another layer, another position, a stale
# buffer) differs by order 1.
HOOK_REL_TOL = 1e-4


def hooks_run(name, n, hooks, graphs=False, tag="", extra_env=None, backend="cuda", stats=True, check=True):
    """ds4 with DS4_HOOKS on: (dump bytes, hook stream path, result)."""
    env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    if graphs:
        env["DS4_CUDA_GRAPHS"] = "1"
    if hooks:
        env["DS4_HOOKS"] = hooks
    hp = os.path.join(OUT, f"{name}.hooks-{tag}.ds4h")
    env["DS4_HOOKS_OUT"] = hp
    env.update(extra_env or {})
    out = os.path.join(OUT, f"{name}.hooks-{tag}.ds4logit")
    args = ["-m", make_model(name), "--backend", backend, "--tokens", ",".join(map(str, PROMPT)),
            "-n", str(n), "--dump-logits", out] + (["--stats"] if stats else [])
    r = ds4_run(args, binary=CUDA_BIN, env=env, check=check)
    data = open(out, "rb").read() if os.path.exists(out) else b""
    if os.path.exists(out):
        os.remove(out)
    return data, hp, r


def hooks_stats(stderr):
    import re
    line = next(l for l in stderr.splitlines() if l.startswith("stats: hooks:"))
    m = re.search(r"(\d+) records produced, (\d+) written .* (\d+) dropped in (\d+) gaps, (\d+) producer waits", line)
    return dict(zip(["produced", "written", "dropped", "gaps", "waits"], map(int, m.groups()))), line


@skip_no_gpu
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_hooks_cuda_leave_logits_and_stream_identical(name):
    """Stage 3: hooks on leave the logits byte-identical to hooks off, eager and with graphs;
    the hook stream is byte-identical between eager and graph replay; 300 steps cross the
    window and a ratio-128 boundary (attn_probs changes size on the way)."""
    n = 300
    off, _, _ = hooks_run(name, n, None, tag="off")
    off_g, _, _ = hooks_run(name, n, None, graphs=True, tag="off-g")
    on, he, re_ = hooks_run(name, n, HOOKS_ALL, tag="eager")
    on_g, hg, rg = hooks_run(name, n, HOOKS_ALL, graphs=True, tag="graphs")
    assert off == off_g == on == on_g, "hooks or graphs changed the logits"
    assert open(he, "rb").read() == open(hg, "rb").read(), "the hook stream differs between eager and graphs"
    for r in (re_, rg):
        st, line = hooks_stats(r.stderr)
        assert st["produced"] == st["written"] and st["dropped"] == 0, line
    s = ds4hooks.read(he)
    assert not s.truncated and s.dropped() == 0
    print(f"{name}: {len(s.records)} records, eager and graph streams identical ({os.path.getsize(he)} bytes)")
    os.remove(hg)


@skip_no_gpu
@pytest.mark.parametrize("name", ["tiny", "other"])
def test_hooks_cuda_match_cpu(name):
    """CUDA hook values against the CPU writer's (the specification), teacher-forced on the
    same tokens: every (hook, layer) array within HOOK_REL_TOL of its largest magnitude,
    the chosen experts identical."""
    n = 160
    _, hc, _ = hooks_run(name, n, HOOKS_ALL, backend="cpu", tag="cpu", stats=False)
    _, hg, _ = hooks_run(name, n, HOOKS_ALL, graphs=True, tag="cuda", stats=False)
    a, b = ds4hooks.read(hc).arrays(), ds4hooks.read(hg).arrays()
    assert set(a) == set(b)
    worst = 0.0
    for key in sorted(a):
        (pa, va), (pb, vb) = a[key], b[key]
        assert np.array_equal(pa, pb), key
        if key[0] in ds4hooks.RAGGED:
            for x, y in zip(va, vb):
                assert x.shape == y.shape, key
                d = float(np.abs(x.astype(np.float64) - y).max())
                worst = max(worst, d)       # probabilities: already relative to 1
                assert d <= HOOK_REL_TOL, (key, d)
            continue
        if va.dtype.kind == "i":
            assert np.array_equal(va, vb), f"{key}: chosen experts differ"
            continue
        scale = max(float(np.abs(va).max()), 1e-30)
        d = float(np.abs(va.astype(np.float64) - vb).max()) / scale
        worst = max(worst, d)
        assert d <= HOOK_REL_TOL, (key, d)
    print(f"{name}: {len(a)} arrays, max relative |d| cuda vs cpu = {worst:.3g}")


@skip_no_gpu
def test_hooks_lossless_throttled_consumer():
    """Lossless by default: with a 1 MiB ring and a drain that pauses 25 ms after each batch,
    the producers wait (counted) and not one of >= 10^6 records is lost: sequence numbers run
    0..N-1 without a gap record, and produced == written."""
    n = 32300            # tiny: 31 records per step (5 hooks x 6 layers, logits) + the prompt call;
    env = {"DS4_HOOKS_RING_MB": "1", "DS4_HOOKS_THROTTLE_US": "25000"}   # past 4096: tiny-1m
    _, hp, r = hooks_run("tiny-1m", n, "attn,resid,moe,logits", graphs=True, tag="lossless", extra_env=env)
    st, line = hooks_stats(r.stderr)
    print(line)
    assert st["produced"] >= 1_000_000, line
    assert st["written"] == st["produced"] and st["dropped"] == 0 and st["gaps"] == 0, line
    assert st["waits"] > 0, f"the throttled drain never made a producer wait: {line}"
    s = ds4hooks.read(hp)          # raises on any sequence break
    assert len(s.records) == st["produced"] and s.dropped() == 0 and not s.truncated
    os.remove(hp)


def assert_same_arrays(a, b, what):
    """Two runs' (hook, layer) arrays (ds4hooks.arrays()) bit for bit the same: the same keys,
    positions and values; `what` names what differs between the runs."""
    assert set(a) == set(b), f"the (hook, layer) arrays depend on {what}"
    for key in sorted(a):
        (pa, va), (pb, vb) = a[key], b[key]
        assert np.array_equal(pa, pb), f"{key}: positions depend on {what}"
        if key[0] in ds4hooks.RAGGED:
            assert all(x.tobytes() == y.tobytes() for x, y in zip(va, vb)), f"{key}: values depend on {what}"
        else:
            assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), f"{key}: values depend on {what}"


@skip_no_gpu
def test_hooks_prompt_through_small_ring():
    """A prompt whose records are many times the payload ring, in one eager call: the call
    publishes as it goes (an eighth of the ring at a time), the host holds a record back while
    the ring has no room for it (the device never waits), and the prompt ends, lossless; three
    times, since a wait cycle between producers and drain would stop a run only now and then.
    Every (hook, layer) array, positions and values, is bit for bit the one a ring that holds
    the whole call gives.  (The bytes of the streams differ: a record above a quarter of the
    ring goes as several records of fewer rows.)"""
    toks = ",".join(str((i * 7919) % 1000 + 1) for i in range(512))

    def run(ring_mb, tag):
        hp = os.path.join(OUT, f"small.hooks-ring{tag}.ds4h")
        env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        env.update({"DS4_HOOKS": HOOKS_ALL, "DS4_HOOKS_OUT": hp, "DS4_HOOKS_RING_MB": str(ring_mb)})
        try:        # a prompt whose producers and drain wait on each other would never end
            r = subprocess.run([CUDA_BIN, "-m", make_model("small"), "--backend", "cuda", "--tokens", toks, "-n", "4",
                                "--stats"], capture_output=True, text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a 512-token prompt through a {ring_mb} MiB ring did not end in 120 s")
        assert r.returncode == 0, r.stderr
        st, line = hooks_stats(r.stderr)
        assert st["produced"] == st["written"] and st["dropped"] == 0 and st["gaps"] == 0, line
        return hp, st, line

    big, st_big, _ = run(1024, "big")
    sb = ds4hooks.read(big)            # raises on any sequence break
    assert len(sb.records) == st_big["written"] and not sb.truncated and sb.dropped() == 0
    a = sb.arrays()
    for i in range(3):
        small, st_small, line = run(2, "small")
        print(line)
        ss = ds4hooks.read(small)
        assert len(ss.records) == st_small["written"] and not ss.truncated and ss.dropped() == 0
        assert os.path.getsize(small) > 8 * 2 * 2**20, f"the prompt's records ({os.path.getsize(small)} bytes) fit the ring"
        assert_same_arrays(a, ss.arrays(), "the ring's size")
        os.remove(small)
    os.remove(big)


@skip_no_gpu
def test_hooks_turn_after_replayed_steps():
    """A conversation (--chat -i) with graphs on: each turn's prompt is an eager call after
    replayed decode steps, whose producers reserve ring space the host did not count, so the
    host's bounds of the ring's use must be found again before the turn's first record.  The
    second turn's records are more than eight 2 MiB rings.  Through that ring with graphs the
    run ends, lossless, and every (hook, layer) array, positions and values, is bit for bit the
    same turns' eager through a 1 GiB ring."""
    m = os.path.join(OUT, "small-vocab.gguf")
    if not os.path.exists(m):
        ds4_run(["synth", "--config", "small", "--seed", "1", "--type", "f32", "--vocab", "-o", m])
    turns = "hello there\n" + " ".join(f"word{i}" for i in range(400)) + "\nand again\n"

    def run(graphs, ring_mb, tag):
        hp = os.path.join(OUT, f"small.hooks-turns-{tag}.ds4h")
        env = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
        env.update({"DS4_HOOKS": HOOKS_ALL, "DS4_HOOKS_OUT": hp, "DS4_HOOKS_RING_MB": str(ring_mb),
                    "DS4_CUDA_GRAPHS": "1" if graphs else "0"})
        try:
            r = subprocess.run([CUDA_BIN, "-m", m, "--backend", "cuda", "--chat", "-i", "-n", "8", "--stats"],
                               input=turns, capture_output=True, text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"three turns through a {ring_mb} MiB ring (graphs {graphs}) did not end in 120 s")
        assert r.returncode == 0, r.stderr
        st, line = hooks_stats(r.stderr)
        assert st["produced"] == st["written"] and st["dropped"] == 0 and st["gaps"] == 0, line
        s = ds4hooks.read(hp)
        assert len(s.records) == st["written"] and not s.truncated and s.dropped() == 0
        return hp, r, s.arrays()

    big, r0, a = run(False, 1024, "eager")
    small, r1, b = run(True, 2, "graphs")
    assert r1.stdout == r0.stdout, "graphs changed the answers"
    replays = re.search(r"(\d+) replays", r1.stderr)
    assert replays and int(replays.group(1)) > 0, "no step was replayed"
    assert os.path.getsize(small) > 8 * 2 * 2**20, "the turns' records fit the ring"
    assert_same_arrays(a, b, "graphs or the ring")
    os.remove(big)
    os.remove(small)


@skip_no_gpu
def test_hooks_drop_counts_exactly():
    """DS4_HOOKS_POLICY=drop never waits: produced == written + dropped, the gap records in
    the stream account for every dropped record, one line says how many, and the logits do
    not change."""
    n = 3000
    env = {"DS4_HOOKS_RING_MB": "1", "DS4_HOOKS_THROTTLE_US": "50000", "DS4_HOOKS_POLICY": "drop"}
    ref, _, _ = hooks_run("tiny", n, None, graphs=True, tag="drop-ref")
    data, hp, r = hooks_run("tiny", n, "attn,resid,moe,logits", graphs=True, tag="drop", extra_env=env)
    assert data == ref
    st, line = hooks_stats(r.stderr)
    print(line)
    assert st["dropped"] > 0, f"nothing was dropped: {line}"
    assert st["produced"] == st["written"] + st["dropped"] and st["waits"] == 0, line
    s = ds4hooks.read(hp)
    assert sum(1 for x in s.records if not x.gap) == st["written"]
    assert s.dropped() == st["dropped"]
    assert r.stderr.count("records dropped") == 1, r.stderr
    os.remove(hp)


@skip_no_gpu
def test_collect_cuda(tmp_path):
    """ds4 collect --backend cuda: the drain thread hands each record to the dataset writer.
    The shards hold the run's .ds4h stream byte for byte; each column is within HOOK_REL_TOL of
    the CPU's dataset (chosen experts identical); a run stopped after one shard and resumed
    gives the same files; where pyarrow is installed it reads the Arrow shards (the schema,
    datasets' Array2D metadata, values equal to the safetensors run's), and where `datasets`
    is, load_from_disk opens the directory with the features written."""
    import json
    import test_collect as tc
    model = str(tmp_path / "tiny-vocab.gguf")
    r = subprocess.run([CUDA_BIN, "synth", "--config", "tiny", "--seed", "1", "--vocab", "-o", model],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    corpus = str(tmp_path / "corpus.txt")
    tc.write_text_corpus(corpus, tc.corpus_docs())
    hooks = "attn:0-1,resid:2,moe:3,moe_sel:3"

    def collect(d, *extra, backend="cuda"):
        r = subprocess.run([CUDA_BIN, "collect", "-m", model, "-i", corpus, "-o", str(tmp_path / d), "--hooks", hooks,
                            "--ctx", str(tc.CTX), "--shard-rows", "3", "--backend", backend] + list(extra),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return str(tmp_path / d)

    def columns(d):
        meta = json.load(open(os.path.join(d, "ds4_collect.json")))
        out = {}
        for i in range(meta["shards"]):
            t, _ = tc.read_safetensors(os.path.join(d, f"data-{i:05d}-of-{meta['shards']:05d}.safetensors"))
            for c in meta["columns"] + [{"name": "token_ids"}]:
                out[c["name"]] = out.get(c["name"], b"") + t[c["name"]][2]
        return meta, out

    g = collect("cuda", "--format", "safetensors", "--ds4h", str(tmp_path / "cuda.ds4h"))
    meta, cg = columns(g)
    assert meta["shards"] > 2
    _, recs = tc.read_ds4h(str(tmp_path / "cuda.ds4h"))
    for c in meta["columns"]:
        assert cg[c["name"]] == b"".join(x for _, x in recs[(c["ds4_hook"], c["layer"])]), c["name"]

    _, cc = columns(collect("cpu", "--format", "safetensors", backend="cpu"))
    assert cc["token_ids"] == cg["token_ids"]
    worst = 0.0
    for c in meta["columns"]:
        if c["dtype"] == "int32":
            assert cc[c["name"]] == cg[c["name"]], f"{c['name']}: chosen experts differ"
            continue
        va, vb = np.frombuffer(cc[c["name"]], "<f4"), np.frombuffer(cg[c["name"]], "<f4")
        d = float(np.abs(va.astype(np.float64) - vb).max()) / max(float(np.abs(va).max()), 1e-30)
        worst = max(worst, d)
        assert d <= HOOK_REL_TOL, (c["name"], d)
    print(f"collect: {len(meta['columns'])} columns, {meta['windows']} windows, max relative |d| cuda vs cpu = {worst:.3g}")

    part = collect("part", "--format", "safetensors", "--stop-after-shards", "1")
    assert len([f for f in os.listdir(part) if f.endswith(".safetensors")]) == 1
    collect("part", "--format", "safetensors")
    for f in os.listdir(g):
        assert open(os.path.join(part, f), "rb").read() == open(os.path.join(g, f), "rb").read(), f

    try:
        import pyarrow.ipc
    except ImportError:
        print("collect: pyarrow not installed; the Arrow read-back is tests/test_collect.py's (npm apache-arrow)")
        return
    a = collect("arrow")
    am = json.load(open(os.path.join(a, "ds4_collect.json")))
    info = json.load(open(os.path.join(a, "dataset_info.json")))
    state = json.load(open(os.path.join(a, "state.json")))
    names = [c["name"] for c in am["columns"]] + ["token_ids"]
    assert list(info["features"]) == names
    assert [f["filename"] for f in state["_data_files"]] == \
        [f"data-{i:05d}-of-{am['shards']:05d}.arrow" for i in range(am["shards"])]
    got = {n: [] for n in names}
    rows = 0
    for f in state["_data_files"]:
        t = pyarrow.ipc.open_stream(os.path.join(a, f["filename"])).read_all()
        assert t.schema.names == names
        hf = json.loads(t.schema.metadata[b"huggingface"])
        assert hf["info"]["features"] == info["features"]
        rows += t.num_rows
        for n in names:
            got[n].append(np.asarray(t.column(n).combine_chunks().flatten().flatten() if n != "token_ids"
                                     else t.column(n).combine_chunks().flatten()))
    assert rows == am["windows"] == meta["windows"]
    for c in am["columns"] + [{"name": "token_ids", "dtype": "int32"}]:
        v = np.concatenate(got[c["name"]]).astype("<i4" if c["dtype"] == "int32" else "<f4")
        assert v.tobytes() == cg[c["name"]], c["name"]
    print(f"collect: pyarrow {pyarrow.__version__} read {am['shards']} shards, {rows} rows, equal to the safetensors run")
    try:
        import datasets
    except ImportError:
        print("collect: datasets not installed; load_from_disk not tried")
        return
    ds = datasets.load_from_disk(a)
    assert ds.num_rows == rows and list(ds.features) == names
    assert ds.features[names[0]].shape == (tc.CTX, am["columns"][0]["width"])
    print(f"collect: datasets {datasets.__version__} load_from_disk: {ds.num_rows} rows, features {list(ds.features)}")
