"""The MTP block of a deepseek4 file (issue 27, first step): read in llama.cpp's convention,
written by `ds4 synth --mtp`, shown by `ds4 info`, refused by name when broken, and its head
(ds4_mtp_eval, the CPU specification) against llama.cpp's MTP graph.

The block is blk.<n_layer>: a whole layer and the nextn tensors (eh_proj, enorm, hnorm, and
optionally embed_tokens, shared_head_head, shared_head_norm).  ds4 decodes without it, so a
model's logits are the same bytes with and without it; llama.cpp reads the same file and
counts the block as its MTP layer.

The head is compared on the same inputs: tests/mtp_dump runs the prompt through ds4's trunk,
writes its final hidden streams, and the MTP head's logits of every row (row k: token k with
the streams of position k - 1, zeros at k = 0, as llama.cpp's MTP driver pairs them);
llama_oracle --mtp feeds those streams to llama.cpp's graph_mtp.  The trunks are compared
elsewhere (test_oracle).  The hidden states llama.cpp itself outputs for the MTP driver
(h_nextn, unmasked) are not used: in this release they changed with the context's size for
the same prompt (rows 0..19 of a 20-token prompt against the same rows of 100 tokens), while
ds4's and llama.cpp's logits agreed.
"""
import os

import pytest

from conftest import BUILD, OUT, ORACLE_BIN, ds4_run, logit_diff, run

import ds4logit

PROMPT = "1,2,3,4,5,6,7,8"


def synth(name, *extra):
    p = os.path.join(OUT, f"{name}.gguf")
    if not os.path.exists(p):
        ds4_run(["synth", "--config", "tiny", "--seed", "1", "-o", p] + list(extra))
    return p


def test_info_shows_the_block():
    r = ds4_run(["info", synth("tiny-mtp", "--mtp")])
    assert "an MTP block (blk.6, ratio 0, f32)" in r.stdout, r.stdout
    r = ds4_run(["info", synth("tiny-plain")])
    assert "MTP" not in r.stdout


def test_trunk_ignores_the_block():
    dumps = []
    for name, extra in (("tiny-plain", ()), ("tiny-mtp", ("--mtp",))):
        out = os.path.join(OUT, f"{name}.mtp-test.ds4logit")
        ds4_run(["-m", synth(name, *extra), "--tokens", PROMPT, "-n", "16", "--dump-logits", out])
        dumps.append(out)
    a, b = ds4logit.read(dumps[0]), ds4logit.read(dumps[1])
    assert (a.logits == b.logits).all() and (a.tokens == b.tokens).all()


def test_flag_given_twice_or_with_the_suffix():
    p = os.path.join(OUT, "never.gguf")
    for args in (["--mtp", "--mtp"], ["--mtp", "--config", "tiny+mtp"]):
        cmd = ["synth", "-o", p] + args + ([] if "--config" in args else ["--config", "tiny"])
        r = ds4_run(cmd, check=False)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "--mtp" in r.stderr
    assert not os.path.exists(p)


def test_broken_block_refused_by_name():
    """The block's hnorm cut out of the file (its directory entry renamed): refused, naming it."""
    src = synth("tiny-mtp", "--mtp")
    data = bytearray(open(src, "rb").read())
    old, new = b"blk.6.nextn.hnorm.weight", b"blk.6.nextn.hnorX.weight"
    i = data.find(old)
    assert i > 0 and data.find(old, i + 1) < 0
    data[i:i + len(old)] = new
    bad = os.path.join(OUT, "tiny-mtp-broken.gguf")
    open(bad, "wb").write(data)
    r = ds4_run(["info", bad], check=False)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "missing tensor 'blk.6.nextn.hnorm.weight'" in r.stderr, r.stderr


MTP_DUMP = os.path.join(BUILD, "tests", "mtp_dump")


@pytest.mark.parametrize("config", [("small", "1", None), ("small", "2", "64")], ids=["small", "small@64-seed2"])
def test_mtp_head_matches_llama_cpp(config):
    """100 rows (past small's window of 64): the head's logits within the f32 bound of the
    trunk's oracle comparison (test_oracle, 5e-5), argmax identical on every row."""
    assert os.path.exists(ORACLE_BIN), "llama oracle not built (tests/run_pytest.sh builds it)"
    assert os.path.exists(MTP_DUMP), f"{MTP_DUMP} missing: make test-py builds it"
    name, seed, experts = config
    tag = f"{name}-s{seed}" + (f"-e{experts}" if experts else "") + "-mtp"
    model = os.path.join(OUT, f"{tag}.gguf")
    if not os.path.exists(model):
        ds4_run(["synth", "--config", name, "--seed", seed, "--mtp", "-o", model] +
                (["--experts", experts] if experts else []))
    prompt = ",".join(str((i * 37) % 1000 + 1) for i in range(100))
    mine, streams, ref = (os.path.join(OUT, f"{tag}.{x}") for x in ("ds4-mtp.ds4logit", "streams.f32", "llama-mtp.ds4logit"))
    r = run([MTP_DUMP, model, prompt, mine, streams])
    assert r.returncode == 0, r.stderr
    r = run([ORACLE_BIN, "-m", model, "--tokens", prompt, "-n", "0", "-o", ref, "--threads", "2", "--mtp", streams])
    assert r.returncode == 0, r.stderr
    a, b, diff, mx, row = logit_diff(ref, mine)
    assert mx < 5e-5, f"max |dlogit| {mx} at row {row}"
    assert (a.logits.argmax(axis=1) == b.logits.argmax(axis=1)).all()


def test_mtp_eval_without_a_block():
    """A model without the block: mtp_dump says so in one line, exit 1."""
    assert os.path.exists(MTP_DUMP), f"{MTP_DUMP} missing: make test-py builds it"
    r = run([MTP_DUMP, synth("tiny-plain"), "1,2,3", os.path.join(OUT, "never.ds4logit"), os.path.join(OUT, "never.f32")])
    assert r.returncode == 1 and "the model has no MTP block" in r.stderr, r.stderr


def test_llama_cpp_reads_the_block():
    """llama.cpp counts blk.6 as its MTP layer (n_layer 6 of 7) and its logits match ours."""
    assert os.path.exists(ORACLE_BIN), "llama oracle not built (tests/run_pytest.sh builds it)"
    m = synth("tiny-mtp", "--mtp")
    out = os.path.join(OUT, "tiny-mtp.llama.ds4logit")
    r = run([ORACLE_BIN, "-m", m, "--tokens", PROMPT, "-n", "16", "-o", out, "--threads", "2", "-v"])
    assert r.returncode == 0, r.stderr
    log = r.stdout + r.stderr
    assert "n_layer_all           = 7" in log and "n_layer               = 6" in log, log[-2000:]
    mine = os.path.join(OUT, "tiny-mtp.mtp-test.ds4logit")
    ds4_run(["-m", m, "--tokens", PROMPT, "-n", "16", "--dump-logits", mine])
    _, _, _, mx, _ = logit_diff(out, mine)
    assert mx < 5e-5, mx


# ---- an MTP block from a file of its own (ds4 --mtp FILE, ds4 synth --mtp-file) ----

def mtp_file(config="tiny", *extra):
    """The block alone: the keys of config with its block, the block's tensors only."""
    p = os.path.join(OUT, f"{config}{''.join(extra)}.mtpfile.gguf")
    if not os.path.exists(p):
        ds4_run(["synth", "--config", config, "--seed", "1", "--mtp-file", "-o", p] + list(extra))
    return p


def test_mtp_file_is_the_block():
    """The trunk's file plus the block's file is the model with the block: ds4 info's line, the
    head's logits and the trunk's streams (mtp_dump) byte for byte, on small (past its window)."""
    assert os.path.exists(MTP_DUMP), f"{MTP_DUMP} missing: make test-py builds it"
    plain, whole = (os.path.join(OUT, f"small-{t}.mtpfile-test.gguf") for t in ("plain", "whole"))
    for p, extra in ((plain, []), (whole, ["--mtp"])):
        if not os.path.exists(p):
            ds4_run(["synth", "--config", "small", "--seed", "1", "-o", p] + extra)
    block = mtp_file("small")
    assert os.path.getsize(block) < os.path.getsize(whole) - os.path.getsize(plain) + (1 << 20)
    line = lambda r: [l for l in (r.stdout + r.stderr).splitlines() if "MTP block" in l]
    assert line(ds4_run(["info", plain, "--mtp", block])) == line(ds4_run(["info", whole])) != []
    prompt = ",".join(str((i * 37) % 1000 + 1) for i in range(100))
    outs = []
    for tag, args in (("whole", [whole]), ("file", [plain, "--mtp", block])):
        d, s = os.path.join(OUT, f"mtpfile-{tag}.ds4logit"), os.path.join(OUT, f"mtpfile-{tag}.f32")
        r = run([MTP_DUMP, args[0], prompt, d, s] + args[1:])
        assert r.returncode == 0, r.stderr
        outs.append((open(d, "rb").read(), open(s, "rb").read()))
    assert outs[0] == outs[1], "the head from the MTP file differs from the model's own block"


def test_mtp_file_speculates_as_the_block():
    """--mtp-draft 2 with the block from its file: the dump and the drafts' counts are the whole
    model's, with the head's own drafts and with DS4_MTP_FORCE."""
    whole, plain = synth("tiny-mtp", "--mtp"), synth("tiny-plain")
    prompt = ",".join(str((i * 7) % 500) for i in range(40))
    ref = os.path.join(OUT, "mtpfile-ref.ids")
    r = ds4_run(["-m", plain, "--tokens", prompt, "-n", "200", "-v"])
    ids = [l for l in r.stderr.splitlines() if l.startswith("generated ids:")][0].split(":")[1]
    open(ref, "w").write(ids.strip() + "\n")
    for force in (None, "0.5"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DS4_")}
        if force:
            env["DS4_MTP_FORCE"] = f"{force}:{ref}"
        got = []
        for args in ([whole], [plain, "--mtp", mtp_file("tiny")]):
            d = os.path.join(OUT, f"mtpfile-spec-{len(got)}.ds4logit")
            r = ds4_run(["-m", args[0], "--tokens", prompt, "-n", "200", "--mtp-draft", "2", "--stats",
                         "--dump-logits", d] + args[1:], env=env)
            st = [l for l in r.stderr.splitlines() if l.startswith("stats: mtp:")]
            assert len(st) == 1, r.stderr
            got.append((r.stdout, open(d, "rb").read(), st[0].split(";")[0]))
        assert got[0] == got[1], (force, got[0][2], got[1][2])


def test_mtp_file_refused_by_name():
    """Bad MTP files: one line naming the problem, exit 1, for the run and for ds4 info."""
    plain, whole = synth("tiny-plain"), synth("tiny-mtp", "--mtp")
    good = mtp_file("tiny")
    nan = os.path.join(OUT, "tiny.mtpfile-nan.gguf")
    d = bytearray(open(good, "rb").read())
    d[-64:] = b"\xff" * 64                       # the last tensor's tail: shared_head_norm, F32
    open(nan, "wb").write(d)
    cut = os.path.join(OUT, "tiny.mtpfile-cut.gguf")
    open(cut, "wb").write(open(good, "rb").read()[: os.path.getsize(good) // 2])
    cases = [
        ([whole, "--mtp", good], "the model has an MTP block already (blk.6)"),
        ([plain, "--mtp", mtp_file("small")], "key 'deepseek4.block_count' is not the model's"),
        ([plain, "--mtp", mtp_file("tiny", "--ctx", "1000")], "key 'deepseek4.context_length' is not the model's"),
        ([plain, "--mtp", plain], "it holds no MTP block"),
        ([plain, "--mtp", nan], "tensor nextn.shared_head_norm.weight holds a NaN or Inf"),
        ([plain, "--mtp", cut], "extends past end of file"),
        ([plain, "--mtp", os.path.join(OUT, "no-such.gguf")], "cannot open MTP file"),
    ]
    for (m, _, f), msg in cases:
        for cmd in (["-m", m, "--mtp", f, "--tokens", "1,2,3", "-n", "2"], ["info", m, "--mtp", f]):
            r = ds4_run(cmd, check=False)
            assert r.returncode == 1, (cmd, r.returncode, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (cmd, r.stderr)


def test_mtp_file_synth_flags():
    """--mtp-file excludes --mtp and a config's +mtp: a usage error, nothing written."""
    p = os.path.join(OUT, "never.gguf")
    for args in (["--config", "tiny", "--mtp", "--mtp-file"], ["--config", "tiny+mtp", "--mtp-file"],
                 ["--config", "tiny+mtpfile", "--mtp"]):
        r = ds4_run(["synth", "-o", p] + args, check=False)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(p)
