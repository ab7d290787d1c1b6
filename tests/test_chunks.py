"""Chunked prefill (DS4_UBATCH, stage 4: the chunked-prefill patch): a prompt runs in chunks of at most DS4_UBATCH
tokens, every state carried across, and on the CPU -- the specification -- the logits do not
depend on the chunk size at all: byte-identical dumps for chunks of 1, 7, 512 and the whole
prompt.  Also the context's limits: context_length, synth --ctx, ds4 info --ctx."""
import os
import random
import subprocess
import sys

import pytest

from conftest import OUT, REPO, ds4_run, make_model, run, DS4

sys.path.insert(0, os.path.join(REPO, "scripts"))
import ds4hooks  # noqa: E402


def clean_env(**kv):
    e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    e.update({k: str(v) for k, v in kv.items()})
    return e


def prompt(n, vocab, seed=3):
    rnd = random.Random(seed)
    return ",".join(str(rnd.randrange(vocab)) for _ in range(n))


# tiny: window 32, ratio-128 rows every 128 positions, the indexer keeps 8 of the ratio-4 rows
# (past its top-k from position 32 on); small: window 64, top-k 16.  600 prompt positions cross
# every boundary several times; the decode steps after them continue from the chunked state.
@pytest.mark.parametrize("name,vocab", [("tiny", 512), ("small", 1024)])
def test_logits_do_not_depend_on_the_chunk_size(name, vocab):
    toks = prompt(600, vocab)
    dumps = {}
    for ub in (1, 7, 512, 65535):
        d = os.path.join(OUT, f"{name}.chunks-{ub}.ds4logit")
        ds4_run(["-m", make_model(name), "--backend", "cpu", "--tokens", toks, "-n", "40", "--dump-logits", d],
                env=clean_env(DS4_UBATCH=ub))
        dumps[ub] = open(d, "rb").read()
    whole = dumps[65535]
    for ub in (1, 7, 512):
        assert dumps[ub] == whole, f"DS4_UBATCH={ub}: the dump differs from the whole prompt's"


def test_hooks_across_chunks():
    """Every hook, attn_probs too: the records of a chunked prompt, joined by position, are the
    whole prompt's, and the positions run on without a gap."""
    toks = prompt(300, 512)
    streams = {}
    for ub in (7, 65535):
        out = os.path.join(OUT, f"tiny.chunks-hooks-{ub}.ds4h")
        ds4_run(["-m", make_model("tiny"), "--backend", "cpu", "--tokens", toks, "-n", "8",
                 "--dump-logits", out + ".ds4logit"],                   # the logits hook: every row
                env=clean_env(DS4_UBATCH=ub, DS4_HOOKS="attn,resid,moe,logits,attn_probs", DS4_HOOKS_OUT=out))
        streams[ub] = out
    a, b = ds4hooks.read(streams[7]).arrays(), ds4hooks.read(streams[65535]).arrays()
    assert set(a) == set(b)
    for key in a:
        (pa, va), (pb, vb) = a[key], b[key]
        assert list(pa) == list(pb) == list(range(len(pa))), key
        if key[0] == "attn_probs":
            assert all((x == y).all() for x, y in zip(va, vb)), key
        else:
            assert (va == vb).all(), key
    r = run([sys.executable, os.path.join(REPO, "scripts", "ds4hooks.py"), "compare", streams[7], streams[65535]])
    assert r.returncode == 0 and " 0 differ" in r.stdout, r.stdout


def test_ubatch_bounds():
    for bad in ("0", "65536", "x", "-1"):
        r = run([DS4, "-m", make_model("tiny"), "-n", "1"], env=clean_env(DS4_UBATCH=bad))
        assert r.returncode == 2 and f"DS4_UBATCH='{bad}' is not an integer in [1, 65535]" in r.stderr, r.stderr
    r = run([DS4, "-m", make_model("tiny"), "-n", "1", "-v"], env=clean_env(DS4_UBATCH=5))
    assert r.returncode == 0 and "batches of 5" in r.stderr, r.stderr


def test_context_length():
    """A context past the model's context_length is refused by name, -c or prompt + n alike;
    ds4 synth --ctx writes any context_length; ds4 info --ctx prints the plan."""
    tiny = make_model("tiny")                                   # context_length 4096
    r = run([DS4, "-m", tiny, "-c", "5000"])
    assert r.returncode == 2 and "-c 5000 is past the model's context_length 4096" in r.stderr, r.stderr
    r = run([DS4, "-m", tiny, "--tokens", "1,2,3", "-n", "4094"])
    assert r.returncode == 2 and "3 prompt + 4094 generated tokens are past the model's context_length 4096" in r.stderr
    big = make_model("tiny-1m")
    r = run([DS4, "info", big, "--ctx", "1048576"])
    assert r.returncode == 0, r.stderr
    assert "context of 1048576 positions (model context_length 1048576), prefill chunks of 4096 tokens" in r.stdout
    gb = float(r.stdout.split("activations): ")[1].split(" GB")[0])
    assert 0.3 < gb < 0.5, r.stdout                             # tiny's rows at 1M positions: ~0.38 GB
    r = run([DS4, "info", tiny, "--ctx", "5000"])
    assert r.returncode == 0 and "PAST IT" in r.stdout
    for args, needle in ((["info", tiny, "--ctx", "0"], "--ctx expects"), (["info", "--ctx", "5"], "usage: ds4 info"),
                         (["synth", "--config", "tiny", "--ctx", "0", "-o", "/tmp/x.gguf"], "--ctx expects"),
                         (["synth", "--config", "tiny/9", "--ctx", "5", "-o", "/tmp/x.gguf"], "context length once")):
        r = run([DS4] + args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
    # the same weights whatever the declared length: the logits of a short run are identical
    d1, d2 = os.path.join(OUT, "ctx-a.ds4logit"), os.path.join(OUT, "ctx-b.ds4logit")
    ds4_run(["-m", tiny, "--tokens", "1,2,3", "-n", "8", "--dump-logits", d1])
    ds4_run(["-m", big, "--tokens", "1,2,3", "-n", "8", "--dump-logits", d2])
    assert open(d1, "rb").read() == open(d2, "rb").read()


def test_a_context_that_does_not_fit_is_refused():
    """The plan is checked before anything is allocated: under a 1 GiB address-space limit, a
    65535-token prompt in one 65535-token chunk on a 1M-position context (about 1.7 GB on tiny)
    is refused in one line naming the bytes needed and the bytes available, before any compute;
    a 3-token prompt on the same context (batch 3, 0.38 GB) runs."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = clean_env(DS4_UBATCH=65535, DS4_THREADS=1)
    base = [DS4, "-m", make_model("tiny-1m"), "-c", "1048576", "-n", "1"]
    text = "".join(chr(33 + i % 90) for i in range(65535))     # tiny-1m has no vocabulary: one id per byte
    r = subprocess.run(base + ["-p", text], env=env, preexec_fn=limit, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    lines = [l for l in r.stderr.splitlines()
             if l.startswith("ds4: ") and not l.startswith(("ds4: model", "ds4: context of"))]
    assert len(lines) == 1, lines
    assert "a context of 1048576 positions (batches of 65535) needs" in lines[0] and "GB are available" in lines[0], lines
    r = subprocess.run(base + ["--tokens", "1,2,3"], env=env, preexec_fn=limit, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_prompt_meter_and_ctrl_c_between_chunks():
    """Under a pty: a prompt that takes more than 2 s shows its meter on stderr (tokens done,
    tok/s), and Ctrl-C stops it between two chunks: status 130, the dump not written (its
    prompt rows are not all there), no temporary file left."""
    import pty
    import select
    import time
    dump = os.path.join(OUT, "meter.ds4logit")
    if os.path.exists(dump):
        os.unlink(dump)
    text = os.path.join(OUT, "meter-prompt.txt")
    with open(text, "w") as f:
        f.write("".join(chr(33 + i % 90) for i in range(60000)))   # tiny-1m has no vocabulary: 60,000 ids
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["DS4_UBATCH"] = "16"
        os.execv(DS4, [DS4, "-m", make_model("tiny-1m"), "-f", text, "-n", "4", "--dump-logits", dump])
    buf, end = b"", time.time() + 60
    while time.time() < end and b"ds4: prompt " not in buf:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    assert b"ds4: prompt " in buf and b"/60000 tokens" in buf, buf[-500:]
    os.write(fd, b"\x03")
    try:
        while select.select([fd], [], [], 30)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, (status, buf[-500:])
    assert b"interrupted (Ctrl-C)" in buf
    assert not os.path.exists(dump) and not [f for f in os.listdir(OUT) if f.startswith("meter.ds4logit.tmp")]
