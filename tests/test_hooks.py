"""Activation hooks on the CPU backend (DS4_HOOKS, ds4_hooks.h; stage 3 of patches/series, its CPU half).

The CPU backend writes every selected record as the forward pass makes it (a plain, synchronous
writer); scripts/ds4hooks.py reads, exports and compares the streams.  These tests run without a
GPU: hooks leave the logits byte-identical, the logits hook equals --dump-logits bit for bit,
every (hook, layer) has one row per position, the selection and its errors, determinism across
thread counts, truncated files, the exporters, and the plot.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import DS4, OUT, PROMPT, REPO, ds4_run, ds4logit, make_model
from test_cli import expect_error

sys.path.insert(0, os.path.join(REPO, "scripts"))
import ds4hooks  # noqa: E402

TOOL = os.path.join(REPO, "scripts", "ds4hooks.py")
N = 40
TOK = ",".join(map(str, PROMPT))


def clean_env(**kv):
    e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    e.update(kv)
    return e


def hooked(name, spec, tag, extra=(), threads=None, n=N):
    """ds4 on the CPU with DS4_HOOKS=spec: (the stream's path, the dump's path)."""
    out = os.path.join(OUT, f"{name}.hooks-{tag}.ds4h")
    dump = os.path.join(OUT, f"{name}.hooks-{tag}.ds4logit")
    env = clean_env(DS4_HOOKS=spec, DS4_HOOKS_OUT=out)
    args = ["-m", make_model(name), "--backend", "cpu", "--tokens", TOK, "-n", str(n), "--dump-logits", dump]
    if threads:
        args += ["--threads", str(threads)]
    ds4_run(args + list(extra), env=env)
    return out, dump


@pytest.fixture(scope="module")
def tiny_all():
    return hooked("tiny", "attn,resid,moe,logits", "all")


def test_hooks_leave_logits_unchanged(tiny_all):
    _, dump = tiny_all
    plain = os.path.join(OUT, "tiny.hooks-none.ds4logit")
    ds4_run(["-m", make_model("tiny"), "--backend", "cpu", "--tokens", TOK, "-n", str(N), "--dump-logits", plain],
            env=clean_env())
    assert open(dump, "rb").read() == open(plain, "rb").read()


def test_logits_hook_is_the_dump(tiny_all):
    """The logits records hold exactly the rows --dump-logits writes (prefill rows, then each step's)."""
    out, dump = tiny_all
    pos, val = ds4hooks.read(out).arrays()[("logits", -1)]
    d = ds4logit.read(dump)
    assert np.array_equal(pos, np.arange(len(PROMPT) + N))
    assert val.shape == d.logits.shape
    assert np.array_equal(val.view(np.uint32), d.logits.astype(np.float32).view(np.uint32))


def test_every_layer_every_position(tiny_all):
    out, _ = tiny_all
    s = ds4hooks.read(out)
    m = s.header["model"]
    L, D, hc, k = m["n_layer"], m["n_embd"], m["n_hc"], m["n_expert_used"]
    arrays = s.arrays()
    rows = len(PROMPT) + N
    for layer in range(L):
        for name, shape in (("attn", (D,)), ("resid", (hc, D)), ("moe", (D,)), ("moe_w", (k,)), ("moe_sel", (k,))):
            pos, val = arrays[(name, layer)]
            assert np.array_equal(pos, np.arange(rows)), (name, layer)
            assert val.shape == (rows,) + shape, (name, layer, val.shape)
            if name == "moe_sel":
                assert val.min() >= 0 and val.max() < 8            # tiny: 8 experts
                assert all(len(set(r)) == k for r in val.tolist())  # k distinct experts per token
            else:
                assert np.isfinite(val).all()
    # identity is the writer's: sequence numbers are 0.., the prefill is step 0, decode steps 1..N
    assert [r.seq for r in s.records] == list(range(len(s.records)))
    steps = sorted({r.step for r in s.records})
    assert steps == list(range(N + 1))
    assert not s.truncated and s.dropped() == 0


def test_selection_layers(tmp_path):
    out, _ = hooked("tiny", "attn:1-2,resid:5,moe_sel:0", "sel")
    s = ds4hooks.read(out)
    assert sorted(s.arrays()) == [("attn", 1), ("attn", 2), ("moe_sel", 0), ("resid", 5)]
    assert s.header["selection"] == {"attn": [1, 2], "resid": [5], "moe_sel": [0]}


def test_same_stream_for_any_thread_count():
    a, _ = hooked("small", "attn,resid:0-3,moe", "t1", threads=1, n=12)
    b, _ = hooked("small", "attn,resid:0-3,moe", "t3", threads=3, n=12)
    assert open(a, "rb").read() == open(b, "rb").read()
    r = subprocess.run([sys.executable, TOOL, "compare", a, b], capture_output=True, text=True)
    assert r.returncode == 0 and "0 differ" in r.stdout, r.stdout


def test_compare_finds_a_difference(tiny_all, tmp_path):
    out, _ = tiny_all
    buf = bytearray(open(out, "rb").read())
    s = ds4hooks.read(out)
    first = next(r for r in s.records if r.name == "attn")
    # flip one payload float of the first attn record: find it by its bytes
    raw = first.data.tobytes()
    at = bytes(buf).find(raw)
    assert at > 0
    struct.pack_into("<f", buf, at, struct.unpack_from("<f", buf, at)[0] + 1.0)
    bad = tmp_path / "bad.ds4h"
    bad.write_bytes(bytes(buf))
    r = subprocess.run([sys.executable, TOOL, "compare", out, str(bad), "--tol", "1e-3"], capture_output=True, text=True)
    assert r.returncode == 1 and "attn.0" in r.stdout and "ABOVE" in r.stdout, r.stdout


def test_truncated_file_reads_whole_records(tiny_all, tmp_path):
    out, _ = tiny_all
    full = ds4hooks.read(out)
    buf = open(out, "rb").read()
    cut = tmp_path / "cut.ds4h"
    cut.write_bytes(buf[: len(buf) - 1000])
    s = ds4hooks.read(str(cut))
    assert s.truncated and 0 < len(s.records) < len(full.records)
    assert all(np.array_equal(a.data, b.data) for a, b in zip(s.records, full.records))
    r = subprocess.run([sys.executable, TOOL, "info", str(cut)], capture_output=True, text=True)
    assert r.returncode == 0 and "truncated" in r.stdout


def test_not_a_stream(tmp_path):
    p = tmp_path / "x.ds4h"
    p.write_bytes(b"GGUF" + b"\0" * 60)
    r = subprocess.run([sys.executable, TOOL, "info", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "not a ds4 hook stream" in r.stderr


def test_short_and_piped(tiny_all, tmp_path):
    """A file cut inside its 16-byte header says 'truncated', not 'not a stream'; info into a
    pipe that closes early stops quietly; compare counts the arrays it compared."""
    out, _ = tiny_all
    p = tmp_path / "short.ds4h"
    p.write_bytes(open(out, "rb").read()[:12])
    r = subprocess.run([sys.executable, TOOL, "info", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "truncated: 12 bytes" in r.stderr, r.stderr
    r = subprocess.run(f"{sys.executable} {TOOL} info {out} | head -1", shell=True, capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "" and len(r.stdout.splitlines()) == 1, r.stderr
    r = subprocess.run([sys.executable, TOOL, "compare", out, out], capture_output=True, text=True)
    n = len(ds4hooks.read(out).arrays())
    assert r.returncode == 0 and f"compare: {n} arrays in both, 0 differ" in r.stdout, r.stdout


def test_failed_runs_leave_the_capture_alone(tmp_path):
    """A run that fails before it starts (a context too small, a layer past the model, a token
    past the vocabulary, a damaged model) leaves the previous stream byte for byte, and no
    temporary file beside it; the run that works says where the records went."""
    out = str(tmp_path / "keep.ds4h")
    env = clean_env(DS4_HOOKS="attn", DS4_HOOKS_OUT=out)
    r = ds4_run(["-m", make_model("tiny"), "--backend", "cpu", "-n", "4"], env=env)
    before = open(out, "rb").read()
    assert f"ds4: hooks: {len(ds4hooks.read(out).records)} records" in r.stderr and out in r.stderr, r.stderr
    for args, e in ((["-c", "5"], env), (["--tokens", "99999"], env),
                    (["-n", "1"], clean_env(DS4_HOOKS="attn:9", DS4_HOOKS_OUT=out)),
                    (["-m", "/nonexistent.gguf"], env)):
        r = subprocess.run([DS4] + (["-m", make_model("tiny")] if "-m" not in args else []) + args,
                           env=e, capture_output=True, text=True)
        assert r.returncode != 0, args
        assert open(out, "rb").read() == before, args
    assert os.listdir(tmp_path) == ["keep.ds4h"]


def test_ctrl_c_closes_the_stream_whole(tmp_path):
    """Ctrl-C in the middle of a long run: the stream holds whole records, every one numbered,
    and reads without a truncation."""
    import pty
    import select
    import time
    out = str(tmp_path / "int.ds4h")
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(DS4_HOOKS="attn,moe", DS4_HOOKS_OUT=out)
        os.execv(DS4, [DS4, "-m", make_model("tiny-1m"), "--backend", "cpu", "-n", "100000"])
    buf, end = b"", time.time() + 60
    while time.time() < end and buf.count(b"\n") < 1 or len(buf) < 300:
        if select.select([fd], [], [], 0.1)[0]:
            buf += os.read(fd, 4096)
    os.write(fd, b"\x03")
    try:
        while select.select([fd], [], [], 30)[0] and os.read(fd, 4096):
            pass
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WEXITSTATUS(status) == 130, status
    s = ds4hooks.read(out)
    assert not s.truncated and len(s.records) > 0
    assert [r.seq for r in s.records] == list(range(len(s.records)))


def test_export_npz_and_safetensors(tiny_all, tmp_path):
    out, _ = tiny_all
    arrays = ds4hooks.read(out).arrays()
    npz = tmp_path / "h.npz"
    st = tmp_path / "h.safetensors"
    for p in (npz, st):
        r = subprocess.run([sys.executable, TOOL, "export", out, str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    z = np.load(npz)
    assert np.array_equal(z["attn.3"], arrays[("attn", 3)][1])
    assert np.array_equal(z["moe_sel.0.pos"], arrays[("moe_sel", 0)][0])
    # safetensors: u64 header length, JSON, data
    b = st.read_bytes()
    (n,) = struct.unpack_from("<Q", b, 0)
    meta = json.loads(b[8:8 + n])
    e = meta["resid.2"]
    lo, hi = e["data_offsets"]
    got = np.frombuffer(b[8 + n + lo:8 + n + hi], dtype=np.float32).reshape(e["shape"])
    assert e["dtype"] == "F32" and np.array_equal(got, arrays[("resid", 2)][1])
    assert meta["moe_sel.1"]["dtype"] == "I32"


def test_plot(tiny_all, tmp_path):
    out, _ = tiny_all
    png = tmp_path / "attn.png"
    r = subprocess.run([sys.executable, TOOL, "plot", out, "-o", str(png)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "needs matplotlib" in r.stdout
        pytest.skip("skipped: no matplotlib (Debian python3-matplotlib): the plot said so and exited 0")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


HOOK_ERRORS = [
    ({"DS4_HOOKS": "atn"}, "unknown hook 'atn'"),
    ({"DS4_HOOKS": "attn:3-1"}, "bad layer range '3-1' for attn"),
    ({"DS4_HOOKS": "attn:x"}, "bad layer range 'x'"),
    ({"DS4_HOOKS": "resid:,moe"}, "bad layer range '' for resid"),    # found by fuzz_env
    ({"DS4_HOOKS": "attn,,resid"}, "an empty hook name"),
    ({"DS4_HOOKS": ""}, "DS4_HOOKS='': empty"),
    ({"DS4_HOOKS": "logits:0"}, "logits has no layers"),
    ({"DS4_HOOKS": "resid:6"}, "layer 6 is past the model's 6 layers (0..5)"),
    ({"DS4_HOOKS": "attn", "DS4_HOOKS_OUT": ""}, "DS4_HOOKS_OUT is empty"),
    ({"DS4_HOOKS": "attn", "DS4_HOOKS_POLICY": "sometimes"}, "DS4_HOOKS_POLICY='sometimes' is not wait or drop"),
    ({"DS4_HOOKS": "attn", "DS4_HOOKS_OUT": "/nonexistent-dir/x.ds4h"}, "DS4_HOOKS_OUT: cannot write /nonexistent-dir/x.ds4h"),
    ({"DS4_HOOKS": "attn", "DS4_HOOKS_RING_MB": "x"}, "DS4_HOOKS_RING_MB='x' is not an integer in [0, 65536]"),
    ({"DS4_HOOKS_RING_MB": "65537"}, "DS4_HOOKS_RING_MB='65537' is not an integer in [0, 65536]"),
    ({"DS4_HOOKS_THROTTLE_US": "-5"}, "DS4_HOOKS_THROTTLE_US='-5' is not an integer in [0, 1000000]"),
]


def test_cpu_says_it_has_no_rings():
    """The CUDA emitter's settings do nothing on the CPU writer: one line says so, the run goes on."""
    r = ds4_run(["-m", make_model("tiny"), "--backend", "cpu", "-n", "1"],
                env=clean_env(DS4_HOOKS="attn", DS4_HOOKS_OUT=os.path.join(OUT, "norings.ds4h"),
                              DS4_HOOKS_RING_MB="8"))
    assert r.stderr.count("the cpu backend writes each record as its op returns") == 1, r.stderr


@pytest.mark.parametrize("env,needle", HOOK_ERRORS, ids=[e[1][:28] for e in HOOK_ERRORS])
def test_bad_hook_settings(env, needle):
    expect_error(["-m", make_model("tiny"), "--backend", "cpu", "-n", "1"], needle, env=env)


# ---- what a hook means: llama.cpp's own intermediate tensors -------------------------------------
# tests/oracle/llama_oracle.c --tensors copies the named graph tensors of llama.cpp's deepseek4
# (src/models/deepseek4.cpp) through its eval callback.  The correspondence:
#   attn  <-> attn_out-<il>   the attention block's output (after wo_b), before hc_post adds it back
#   resid <-> l_last-<il>     the streams after the layer's FFN hc_post (the next layer's input)
#   moe   <-> ffn_out-<il>    moe_out + ffn_shexp, the FFN block's output
# Both engines compute in f32 with different summation orders; on the logits they agree to
# ~4e-6 (test_oracle.py).  Measured here (2026-12-01, tiny, 32 + 8 steps): max|d| / max|ref|
# 7.1e-7 (attn), 6.2e-7 (resid), 7.4e-7 (moe).  The bound, 1e-5 of the tensor's largest
# magnitude, leaves a decade of margin; a wrong tensor (another layer, a missing residual, the
# routed output without the shared expert) is off by O(1).
from conftest import ORACLE_BIN, run  # noqa: E402

LL_PAIRS = (("attn", "attn_out"), ("resid", "l_last"), ("moe", "ffn_out"))
LL_REL_TOL = 1e-5


def read_lltensor(path):
    b = open(path, "rb").read()
    assert b[:8] == b"LLTENSOR" and struct.unpack_from("<I", b, 8)[0] == 1
    off, out = 12, {}
    while off < len(b):
        (nl,) = struct.unpack_from("<I", b, off)
        off += 4
        name = b[off:off + nl].decode()
        off += nl
        (il,) = struct.unpack_from("<i", b, off)
        ne = struct.unpack_from("<4q", b, off + 4)
        (nb,) = struct.unpack_from("<Q", b, off + 36)
        off += 44
        a = np.frombuffer(b, dtype=np.float32, count=nb // 4, offset=off).reshape(ne[::-1])
        off += nb
        out.setdefault((name.rsplit("-", 1)[0], il), []).append(a)
    return out


@pytest.mark.parametrize("name", ["tiny", "other"])
def test_hooks_match_llama_cpp(name):
    assert os.path.exists(ORACLE_BIN), "llama oracle not built (tests/run_pytest.sh builds it)"
    n = 8
    ll_out = os.path.join(OUT, f"{name}.ll-tensors")
    ll_dump = os.path.join(OUT, f"{name}.ll-tensors.ds4logit")
    r = run([ORACLE_BIN, "-m", make_model(name), "--tokens", TOK, "-n", str(n), "-o", ll_dump, "--threads", "2",
             "--tensors", ",".join(t for _, t in LL_PAIRS), "--tensors-out", ll_out])
    assert r.returncode == 0, r.stderr
    ll = read_lltensor(ll_out)
    forced = ",".join(map(str, ds4logit.read(ll_dump).tokens[len(PROMPT):].tolist()))
    ours = os.path.join(OUT, f"{name}.ll-hooks.ds4h")
    ds4_run(["-m", make_model(name), "--backend", "cpu", "--tokens", TOK, "--force", forced, "-n", str(n)],
            env=clean_env(DS4_HOOKS="attn,resid,moe", DS4_HOOKS_OUT=ours))
    s = ds4hooks.read(ours)
    arrays = s.arrays()
    L = s.header["model"]["n_layer"]
    for hook, tensor in LL_PAIRS:
        for il in range(L):
            pos, a = arrays[(hook, il)]
            parts = ll[(tensor, il)]
            assert len(parts) == n + 1, f"{tensor}-{il}: {len(parts)} evaluations, expected {n + 1}"
            ref = np.concatenate([p.reshape((-1,) + a.shape[1:]) for p in parts]).astype(np.float64)
            assert ref.shape == a.shape, (hook, il, ref.shape, a.shape)
            rel = float(np.abs(a - ref).max() / np.abs(ref).max())
            assert rel <= LL_REL_TOL, f"{hook} layer {il} vs llama.cpp {tensor}-{il}: {rel:.3g} > {LL_REL_TOL:g}"


def test_attn_probs():
    """attn_probs: one record per token and layer, [H][n+1] with n = the rows the query attended
    (window, then ratio-128 rows or ratio-4 pick slots) and the sink last; every head's weights
    are >= 0 and sum to 1 (f32 weights of a softmax whose denominator was summed in double:
    within 1e-5); the logits are unchanged with the hook on."""
    out, dump = hooked("tiny", "attn_probs", "probs")
    s = ds4hooks.read(out)
    m = s.header["model"]
    H, W, topk = 8, 32, 8                  # tiny: 8 heads, window 32, top-k 8 (ds4 synth --config tiny)
    ratios = [0, 0, 4, 128, 4, 128]        # tiny's compress_ratios
    arrays = s.arrays()
    rows = len(PROMPT) + N
    for layer in range(m["n_layer"]):
        pos, vals = arrays[("attn_probs", layer)]
        assert np.array_equal(pos, np.arange(rows))
        r = ratios[layer]
        for p, v in zip(pos.tolist(), vals):
            n = min(W, p + 1) + ((p + 1) // 128 if r == 128 else topk if r == 4 else 0)
            assert v.shape == (H, n + 1), (layer, p, v.shape)
            assert (v >= 0).all()
            assert np.abs(v.astype(np.float64).sum(axis=1) - 1.0).max() < 1e-5, (layer, p)
    plain = os.path.join(OUT, "tiny.hooks-none.ds4logit")
    if not os.path.exists(plain):
        ds4_run(["-m", make_model("tiny"), "--backend", "cpu", "--tokens", TOK, "-n", str(N), "--dump-logits", plain],
                env=clean_env())
    assert open(dump, "rb").read() == open(plain, "rb").read()
    npz = os.path.join(OUT, "tiny.probs.npz")
    r = subprocess.run([sys.executable, TOOL, "export", out, npz], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    z = np.load(npz)
    assert np.array_equal(z["attn_probs.3.p40"], arrays[("attn_probs", 3)][1][40])
