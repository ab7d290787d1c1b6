"""The ds4 program as a person runs it: text streamed to stdout token by token and valid UTF-8,
Ctrl-C keeping what was made, write errors and non-finite numbers stopping the run with one
line, output files never destroyed by a failed run, the interactive chat (README, "Running")."""
import os
import pty
import select
import signal
import subprocess
import time

import pytest

import ds4logit
from conftest import OUT, REPO, make_model, run, DS4

sys_gguf = os.path.join(REPO, "tests", "oracle")


def vocab_tiny():
    """tiny with ds4 synth's byte-level BPE vocabulary (the embedded default model's config)."""
    p = os.path.join(OUT, "tiny-vocab.gguf")
    if not os.path.exists(p):
        r = run([DS4, "synth", "--config", "tiny", "--vocab", "--seed", "1", "-o", p])
        assert r.returncode == 0, r.stderr
    return p


def patched(name, tensor, fill):
    """A copy of tiny with every byte (fill: bytes) or every f32 (fill: float) of one tensor replaced."""
    import struct
    import sys
    sys.path.insert(0, sys_gguf)
    import gguf_np
    src = make_model("tiny")
    t = gguf_np.GGUFFile(src).tensors[tensor]
    data = bytearray(open(src, "rb").read())
    if isinstance(fill, float):
        data[t.offset:t.offset + t.nbytes] = struct.pack("<f", fill) * (t.nbytes // 4)
    else:
        n = min(len(fill), t.nbytes)
        data[t.offset:t.offset + n] = fill[:n]
    p = os.path.join(OUT, f"tiny-{name}.gguf")
    with open(p, "wb") as f:
        f.write(data)
    return p


def one_line(stderr, needle):
    lines = [l for l in stderr.splitlines() if l.startswith("ds4: ") and "model:" not in l and "has no vocabulary" not in l]
    assert len(lines) == 1 and needle in lines[0], stderr


# ---- the text on stdout ----

def test_utf8_writer():
    """A model without a vocabulary prints byte-level ids as bytes: --force picks them, so every
    rule of the writer is checked on exact bytes (README, "Running")."""
    cases = [
        ([0xE6, 0x9D, 0xB1], "東"),                                  # a character split over 3 tokens
        ([0xFF, 0x41], "\ufffdA"),                                   # a byte that never starts one
        ([0xE6, 0x41], "\ufffdA"),                                   # a sequence cut short
        ([0xE0, 0x80, 0x41], "\ufffd\ufffdA"),                       # overlong: E0 wants A0..BF next
        ([0xED, 0xA0, 0x80], "\ufffd\ufffd\ufffd"),                  # a surrogate
        ([0x1B, 0x5B, 0x7F, 0x09, 0x0A], "\u241b[\u2421\t\n"),       # controls as their pictures
        ([0xF0, 0x9F, 0x99, 0x82], "🙂"),
        ([0xF0, 0x9F], "\ufffd"),                                    # incomplete at the end
        ([300, 0x41], "<300>A"),                                     # no byte for an id past 255
    ]
    for ids, text in cases:
        r = subprocess.run([DS4, "-m", make_model("tiny"), "--tokens", "1,2", "--force", ",".join(map(str, ids))],
                           capture_output=True)
        assert r.returncode == 0, r.stderr
        out = r.stdout.decode("utf-8")                               # strict: valid UTF-8 or this raises
        assert out == text + ("" if text.endswith("\n") else "\n"), (ids, out)


def test_stdout_is_text_only_and_utf8():
    r = subprocess.run([DS4, "-m", vocab_tiny(), "-n", "300", "--temp", "1", "--seed", "7"], capture_output=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode("utf-8")
    assert not any(ord(ch) < 32 and ch not in "\n\t" for ch in out)
    assert "speed:" in r.stderr.decode() and b"speed:" not in r.stdout


def read_until(fd, pred, timeout):
    buf = b""
    end = time.time() + timeout
    while time.time() < end and not pred(buf):
        rl, _, _ = select.select([fd], [], [], 0.1)
        if rl:
            try:
                chunk = os.read(fd, 4096)
            except OSError:            # EIO: the child closed the terminal
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_streams_on_a_terminal_and_ctrl_c_keeps_the_files():
    """Under a pty: text arrives while the run goes on; Ctrl-C stops it with status 130, and the
    dump holds exactly the rows made (a whole DS4LOGIT file)."""
    dump = os.path.join(OUT, "ctrl-c.ds4logit")
    if os.path.exists(dump):
        os.unlink(dump)
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(DS4, [DS4, "-m", make_model("tiny-1m"), "--tokens", "1,2,3", "-n", "200000", "--dump-logits", dump])
    try:
        early = read_until(fd, lambda b: b.count(b"\n") >= 1 and len(b.split(b"\n", 1)[1]) >= 16, 60)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the run ended before any text was read"
        assert len(early.split(b"\n", 1)[1]) >= 16, early              # the model line, then text
        os.write(fd, b"\x03")                                           # Ctrl-C, through the line discipline
        rest = read_until(fd, lambda b: False, 60)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, status
    tail = (early + rest).decode("utf-8", "replace")
    assert "ds4: interrupted (Ctrl-C):" in tail and "speed:" in tail, tail
    d = ds4logit.read(dump)
    assert d.n_prompt == 3 and 0 < d.n_gen < 200000
    assert os.path.getsize(dump) == 32 + 8 * (3 + d.n_gen) + 4 * (3 + d.n_gen) * 512
    assert not [f for f in os.listdir(OUT) if f.startswith("ctrl-c.ds4logit.tmp")]


def test_sigterm_stops_cleanly():
    """kill and timeout send SIGTERM: the same clean stop as Ctrl-C, status 143, a whole dump."""
    dump = os.path.join(OUT, "sigterm.ds4logit")
    p = subprocess.Popen([DS4, "-m", make_model("tiny-1m"), "--tokens", "1,2", "-n", "200000", "--dump-logits", dump],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(64)                       # the run is generating
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert first and p.returncode == 143, err
    assert b"ds4: interrupted (SIGTERM)" in err
    d = ds4logit.read(dump)
    assert d.n_prompt == 2 and 0 < d.n_gen < 200000


def test_write_errors_are_errors():
    with open("/dev/full", "w") as full:
        r = subprocess.run([DS4, "-m", make_model("tiny"), "-n", "4"], stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 1
    one_line(r.stderr, "writing the text to stdout failed")
    r = run([DS4, "-m", make_model("tiny"), "-n", "2", "--dump-logits", "/dev/full"])
    assert r.returncode == 1
    one_line(r.stderr, "'/dev/full'")
    r = run([DS4, "info", make_model("tiny")])
    with open("/dev/full", "w") as full:
        r = subprocess.run([DS4, "info", make_model("tiny")], stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 1 and "writing to stdout failed" in r.stderr


# ---- bad numbers ----

def test_damaged_weights_are_refused_at_load():
    """The issue's case: 100 KB of output.weight overwritten with 0xFF (NaN as f32)."""
    bad = patched("ff", "output.weight", b"\xff" * 100000)
    for args in (["-m", bad, "-n", "4"], ["-m", bad, "-n", "4", "--temp", "1"], ["info", bad]):
        r = run([DS4] + args)
        assert r.returncode == 1, r.stderr
        one_line(r.stderr, "tensor output.weight holds a NaN or Inf value (element 0")


def test_nonfinite_logits_stop_the_run():
    """Finite weights whose products overflow: the logits are Inf/NaN from the first row."""
    big = patched("big", "output.weight", 3.0e38)
    r = run([DS4, "-m", big, "-n", "4"])
    assert r.returncode == 1
    one_line(r.stderr, "non-finite logits in the prompt: row 0 (position 15)")   # the last of 16 rows
    dump = os.path.join(OUT, "nonfinite.ds4logit")
    r = run([DS4, "-m", big, "-n", "4", "--dump-logits", dump])
    assert r.returncode == 1
    one_line(r.stderr, "non-finite logits in the prompt: row 0 (position 0)")    # every row is known
    assert ds4logit.read(dump).n_gen == 0                                     # the rows made are kept
    r = run([DS4, "-m", big, "-n", "4", "--allow-nonfinite"])
    assert r.returncode == 0, r.stderr


# ---- output files survive a failed run ----

def test_failed_runs_leave_the_dump_alone():
    dump = os.path.join(OUT, "keep.ds4logit")
    r = run([DS4, "-m", make_model("tiny"), "-n", "3", "--dump-logits", dump])
    assert r.returncode == 0, r.stderr
    before = open(dump, "rb").read()
    fails = [
        ["-m", make_model("tiny"), "-c", "5"],                                     # usage, after the model
        ["-m", make_model("tiny"), "--tokens", "99999"],
        ["-m", patched("ff", "output.weight", b"\xff" * 100000)],                  # fails at load
        ["-m", patched("big", "output.weight", 3.0e38), "-n", "3"],                # fails in the prompt
    ]
    for args in fails:
        r = run([DS4] + args + ["--dump-logits", dump])
        assert r.returncode != 0, args
        if "big" in args[1]:
            continue                      # this one got its prompt rows through: a new, whole dump
        assert open(dump, "rb").read() == before, args
    assert not [f for f in os.listdir(OUT) if f.startswith("keep.ds4logit.tmp")]


def cuda_binary():
    for d in sorted(os.listdir(os.path.join(REPO, "build"))) if os.path.isdir(os.path.join(REPO, "build")) else []:
        p = os.path.join(REPO, "build", d, "ds4")
        if d.startswith("cuda-") and os.access(p, os.X_OK):
            return p
    return None


def test_cuda_build_without_a_gpu():
    """A CUDA build on a machine without a GPU (CI's): one line saying so; the dump untouched."""
    b = cuda_binary()
    if not b:
        pytest.skip("skipped: no CUDA build (make cuda-check builds one where nvcc exists)")
    if subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("skipped: this machine has a GPU")
    dump, hooks = os.path.join(OUT, "keep-cuda.ds4logit"), os.path.join(OUT, "keep-cuda.ds4h")
    for p in (dump, hooks):
        with open(p, "wb") as f:
            f.write(b"earlier capture")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS4_")}
    env.update(DS4_HOOKS="attn", DS4_HOOKS_OUT=hooks)
    r = run([b, "-m", make_model("tiny"), "-n", "2", "--dump-logits", dump], env=env)
    assert r.returncode == 1
    one_line(r.stderr, "no CUDA GPU found")
    assert open(dump, "rb").read() == b"earlier capture" and open(hooks, "rb").read() == b"earlier capture"
    assert not [f for f in os.listdir(OUT) if ".tmp-" in f and f.startswith("keep-cuda")]
    r = run([b, "info", make_model("small-q2")])
    assert r.returncode == 0 and [l for l in r.stdout.splitlines() if l.startswith("Q2_K")][0].endswith("cpu, cuda")


# ---- chat ----

def test_interactive_chat():
    """-i: each line of stdin is a turn; the first turn starts with BOS, later ones continue the
    history (no BOS); each answer ends with a newline on stdout."""
    m = vocab_tiny()
    r = subprocess.run([DS4, "-m", m, "--chat", "-i", "-n", "5", "-v"], input=b"Hello\n\nHow are you\n",
                       capture_output=True)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    prompts = [l for l in err.splitlines() if l.startswith("prompt ids:")]
    assert len(prompts) == 2, err                                   # the empty line is no turn
    first, second = ([int(x) for x in l.split(":")[1].split()] for l in prompts)
    assert first[0] == 0 and second[0] != 0                         # BOS once
    assert "prompt: <｜User｜>How are you<｜Assistant｜></think>" in err
    assert r.stdout.decode("utf-8").count("\n") >= 2
    # a context too small for the next turn: one line, exit 1, the answers so far kept
    r = subprocess.run([DS4, "-m", m, "--chat", "-i", "-n", "5", "-c", "24"], input=b"Hello\nHello again\n",
                       capture_output=True)
    assert r.returncode == 1 and b"the context is full" in r.stderr, r.stderr


def test_context_plan_is_printed():
    r = run([DS4, "-m", make_model("tiny"), "-n", "2", "-c", "100", "-v"])
    assert r.returncode == 0 and "ds4: context of 100 positions" in r.stderr, r.stderr
