"""Speculative decoding with the MTP head (`ds4 --mtp-draft D`, issue 27): D drafts from the
model's MTP block, checked by the model in one call of D + 1 rows, the positions of the drafts
not taken rolled back (ds4_ctx_checkpoint / ds4_ctx_rollback).

What must hold, and is checked here on the CPU backend:
  - the tokens, the text and the logits rows of the emitted sequence (--dump-logits) are plain
    greedy decoding's, byte for byte, for D = 1, 2, 3, with the head's own drafts and with
    DS4_MTP_FORCE's forced acceptance at P = 0, 0.5 and 1;
  - the head follows the model: each step's first draft is the head's choice at that position
    with the whole history fed in one batch (tests/mtp_dump), so its rows of rejected chained
    drafts are rolled back too;
  - without the rollback's restore (DS4_ROLLBACK_RESTORE, a debug knob) these fail: the model's
    logits change, or the head's drafts do;
  - with --temp > 0 (speculative sampling), each token's distribution is plain sampling's
    (below, a chi-square test over many seeds);
  - bad input: one line, non-zero exit.

Random weights: the head's own drafts are almost never right, so most runs force acceptance
with the reference ids of a plain run (DS4_MTP_FORCE=P:FILE).  The prompts cross every ring:
tiny has a window of 32, ratio-4 compressors with 8 state slots and ratio-128 ones with 128;
40 prompt positions and 1000 steps wrap the window ring about 30 times and close a ratio-128
block 8 times, and with D = 3 the rolled-back positions land on every slot phase.  small
(window 64) runs 300 steps after 140 prompt positions, past three ratio-128 blocks: its steps
cost about 10 times tiny's, and the CPU machine running the suite has 2 cores.  DS4_THREADS=1:
on that machine one thread is faster than two sharing it; one run checks 2 threads."""
import os
import random
import re
import sys

import numpy as np
import pytest

from conftest import BUILD, OUT, REPO, ds4_run, run, DS4

import ds4logit

MTP_DUMP = os.path.join(BUILD, "tests", "mtp_dump")


def model(name, *extra):
    p = os.path.join(OUT, f"{name}{''.join(extra)}-mtp-spec.gguf")
    if not os.path.exists(p):
        ds4_run(["synth", "--config", name, "--seed", "1", "--mtp", "-o", p] + list(extra))
    return p


def env(**kv):
    e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    e["DS4_THREADS"] = "1"
    e.update({k: str(v) for k, v in kv.items()})
    return e


def prompt(n, vocab=512, seed=3):
    rnd = random.Random(seed)
    return ",".join(str(rnd.randrange(vocab)) for _ in range(n))


def gen(m, toks, n, tag, *extra, **envkv):
    """A run: (its stdout, stderr, the dump's bytes, the stats' drafted and accepted or None)."""
    dump = os.path.join(OUT, f"mtp-spec.{tag}.ds4logit")
    r = ds4_run(["-m", m, "--tokens", toks, "-n", str(n), "--dump-logits", dump, "-v", "--stats"] + list(extra),
                env=env(**envkv))
    st = re.search(r"stats: mtp: .*?: (\d+) steps, (\d+) drafted, (\d+) accepted", r.stderr)
    return r.stdout, r.stderr, open(dump, "rb").read(), (tuple(int(x) for x in st.groups()) if st else None)


def ids_line(stderr, what):
    line = [l for l in stderr.splitlines() if l.startswith(what + ":")]
    assert len(line) == 1, stderr[-2000:]
    return [int(x) for x in line[0].split(":")[1].split()]


CASES = {"tiny": (40, 1000), "small": (140, 300)}
_plain = {}


def plain(name):
    """The plain greedy run of a model, and the file of its generated ids (DS4_MTP_FORCE's FILE,
    the -v line as it is: blanks between the ids)."""
    if name not in _plain:
        P, n = CASES[name]
        out, err, dump, st = gen(model(name), prompt(P), n, f"{name}-plain")
        assert st is None
        ref = os.path.join(OUT, f"mtp-spec.{name}.ref")
        gen_ids = ids_line(err, "generated ids")
        assert len(gen_ids) == n
        open(ref, "w").write(" ".join(map(str, gen_ids)) + "\n")
        _plain[name] = (out, dump, ref)
    return _plain[name]


def check_stats(st, force, D, n):
    steps, drafted, accepted = st
    assert steps + accepted == n, st                  # every step emits its token and the drafts taken
    assert drafted <= D * steps
    if force == "1":
        assert accepted == drafted > 0, st
    elif force == "0":
        assert accepted == 0 and drafted > 0, st
    elif force == "0.5":
        assert 0 < accepted < drafted, st


TINY = [(D, f) for D in (1, 2, 3) for f in (None, "0", "0.5", "1")]


@pytest.mark.parametrize("D,force", TINY, ids=[f"D{D}-{f or 'head'}" for D, f in TINY])
def test_tiny_greedy_identical(D, force):
    out0, dump0, ref = plain("tiny")
    P, n = CASES["tiny"]
    kv = {"DS4_MTP_FORCE": f"{force}:{ref}"} if force else {}
    out, err, dump, st = gen(model("tiny"), prompt(P), n, f"tiny-D{D}-{force}", "--mtp-draft", str(D), **kv)
    assert out == out0
    assert dump == dump0, "the dump (tokens and logits) differs from plain greedy decoding's"
    check_stats(st, force, D, n)


SMALL = [(2, "0.5"), (3, "0.5"), (3, "1")]


@pytest.mark.parametrize("D,force", SMALL, ids=[f"D{D}-{f}" for D, f in SMALL])
def test_small_greedy_identical(D, force):
    out0, dump0, ref = plain("small")
    P, n = CASES["small"]
    out, err, dump, st = gen(model("small"), prompt(P), n, f"small-D{D}-{force}", "--mtp-draft", str(D),
                             DS4_MTP_FORCE=f"{force}:{ref}")
    assert out == out0 and dump == dump0
    check_stats(st, force, D, n)


def test_two_threads_and_chunked_prompt():
    """The same bytes with 2 threads, and with the prompt (the model's and the head's rows) in
    chunks of 7."""
    out0, dump0, ref = plain("tiny")
    P, n = CASES["tiny"]
    for kv in ({"DS4_THREADS": 2}, {"DS4_UBATCH": 7}):
        out, err, dump, st = gen(model("tiny"), prompt(P), n, "tiny-kv", "--mtp-draft", "3",
                                 DS4_MTP_FORCE=f"0.5:{ref}", **kv)
        assert out == out0 and dump == dump0, kv


def head_mismatches(stderr, toks):
    """The steps' first drafts (the head's own choice, -v) against tests/mtp_dump's head over the
    whole sequence in one batch (row k predicts token k + 1): (drafts compared, mismatches)."""
    assert os.path.exists(MTP_DUMP), f"{MTP_DUMP} missing: make test-py builds it"
    gen_ids, first = ids_line(stderr, "generated ids"), ids_line(stderr, "mtp first drafts")
    P = len(toks.split(","))
    seq = toks + "," + ",".join(map(str, gen_ids))
    out = os.path.join(OUT, "mtp-spec.head.ds4logit")
    r = run([MTP_DUMP, model("tiny"), seq, out, out + ".f32"], env=env())
    assert r.returncode == 0, r.stderr
    am = ds4logit.read(out).logits.argmax(axis=1)
    pairs = [(f, int(am[P + j - 1])) for j, f in enumerate(first) if f >= 0]
    return len(pairs), sum(a != b for a, b in pairs)


@pytest.mark.parametrize("D,ub", [(1, None), (2, None), (3, None), (3, 7)])
def test_head_follows_the_model(D, ub):
    """Accepted and rejected drafts mixed (P = 0.5): every first draft is the head's choice with
    the canonical history, so the chained rows were rolled back and the accepted drafts' rows
    fed with the model's streams (also with the prompt's head rows in chunks of 7)."""
    _, _, ref = plain("tiny")
    P, n = CASES["tiny"]
    kv = {"DS4_MTP_FORCE": f"0.5:{ref}"}
    if ub:
        kv["DS4_UBATCH"] = ub
    _, err, _, _ = gen(model("tiny"), prompt(P), n, f"tiny-head-D{D}", "--mtp-draft", str(D), **kv)
    compared, bad = head_mismatches(err, prompt(P))
    assert compared > n // 3 and bad == 0, (compared, bad)


def test_rollback_is_needed():
    """DS4_ROLLBACK_RESTORE (bit 0 the model's layers, bit 1 the head's): without the model's
    restore, the logits leave plain decoding's; without the head's, the model's stay (the drafts
    decide nothing) but the head's first drafts leave the canonical ones."""
    out0, dump0, ref = plain("tiny")
    P, n = CASES["tiny"]
    for restore in ("0", "2"):
        _, _, dump, _ = gen(model("tiny"), prompt(P), n, f"tiny-norestore-{restore}", "--mtp-draft", "3",
                            DS4_MTP_FORCE=f"0:{ref}", DS4_ROLLBACK_RESTORE=restore)
        assert dump != dump0, f"DS4_ROLLBACK_RESTORE={restore}: the model's rollback made no difference"
    _, err, dump, _ = gen(model("tiny"), prompt(P), n, "tiny-norestore-1", "--mtp-draft", "3",
                          DS4_MTP_FORCE=f"0:{ref}", DS4_ROLLBACK_RESTORE="1")
    assert dump == dump0
    compared, bad = head_mismatches(err, prompt(P))
    assert bad > 0, "without the head's restore its drafts stayed canonical: the test sees nothing"


def test_interactive():
    """-i: the turns' prompts and the EOS that closes each answer go through the head too; the
    answers are plain decoding's, with every draft accepted (P = 1, the reference being the
    plain run's answers one after the other)."""
    m = model("tiny", "--vocab")
    turns = "hello there\nhow are you\n"
    base = [DS4, "-m", m, "--chat", "-i", "-n", "40", "-v"]
    r0 = run(base, input=turns, env=env())
    assert r0.returncode == 0, r0.stderr
    ref = os.path.join(OUT, "mtp-spec.interactive.ref")
    answers = [l.split(":")[1] for l in r0.stderr.splitlines() if l.startswith("generated ids:")]
    assert len(answers) == 2
    open(ref, "w").write(" ".join(answers))
    r = run(base + ["--mtp-draft", "3", "--stats"], input=turns, env=env(DS4_MTP_FORCE=f"1:{ref}"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == r0.stdout
    st = re.search(r"(\d+) drafted, (\d+) accepted", r.stderr)
    assert st and st.group(1) == st.group(2) != "0", r.stderr


HOOKS = "attn,resid,moe,logits,attn_probs"


def hook_arrays(path):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import ds4hooks
    st = ds4hooks.read(path)
    assert not st.truncated and st.dropped() == 0
    assert [r.seq for r in st.records] == list(range(len(st.records))), path   # numbered as written
    return st, st.arrays()


def hooks_same_rows(plain_path, spec_path):
    """Two hook streams of one sequence, plain decoding's and a speculative run's: joined by
    (hook, layer, position), every hook's rows the same, byte for byte -- the same positions,
    once each, none of a rejected draft -- and the speculative stream in fewer records (a
    check call's rows share one)."""
    (s0, a0), (s1, a1) = hook_arrays(plain_path), hook_arrays(spec_path)
    assert a0.keys() == a1.keys() and len(a0) > 4 * 8
    for key in a0:
        (p0, v0), (p1, v1) = a0[key], a1[key]
        assert np.array_equal(p0, p1), key           # every position once, none past the sequence
        if isinstance(v0, list):
            assert len(v0) == len(v1) and all(np.array_equal(x, y) for x, y in zip(v0, v1)), key
        else:
            assert v0.dtype == v1.dtype and np.array_equal(v0, v1), key
    assert len(s1.records) < len(s0.records)


def hook_stats(stderr):
    """The run's --stats hook lines: (produced, written, rejected)."""
    m = re.search(r"stats: hooks: (\d+) records produced, (\d+) written", stderr)
    assert m, stderr[-2000:]
    rj = re.search(r"stats: hooks: (\d+) records of rejected drafts alone not written", stderr)
    return int(m.group(1)), int(m.group(2)), int(rj.group(1)) if rj else 0


@pytest.mark.parametrize("D", [1, 3])
def test_hooks_hold_only_the_sequences_rows(D):
    """DS4_HOOKS with --mtp-draft: a check call's records are held until the drafts taken are
    known, then written cut to the rows kept (ds4_ctx_hooks_hold / commit).  Joined by (hook,
    layer, position), every hook's rows equal plain greedy decoding's, byte for byte, with no
    row of a rejected draft: the same positions, once each, the same values."""
    _, _, ref = plain("tiny")
    P, n = 40, 200
    paths = {}
    for tag, extra, kv in (("plain", [], {}), (f"D{D}", ["--mtp-draft", str(D)], {"DS4_MTP_FORCE": f"0.5:{ref}"})):
        path = paths[tag] = os.path.join(OUT, f"mtp-spec.hooks-{tag}.ds4h")
        _, err, _, st = gen(model("tiny"), prompt(P), n, f"tiny-hooks-{tag}", *extra, DS4_HOOKS=HOOKS,
                            DS4_HOOKS_OUT=path, **kv)
        produced, written, rejected = hook_stats(err)
        # the counters against the file: every record counted as written is in it, numbered
        assert produced == written == len(hook_arrays(path)[0].records), err[-2000:]
        if extra:
            assert 0 < st[2] < st[1], st             # drafts taken and drafts refused
            assert rejected > 0, err[-2000:]         # records of refused drafts' rows alone
        else:
            assert rejected == 0, err[-2000:]
    hooks_same_rows(paths["plain"], paths[f"D{D}"])


def one_line_error(args, needle, status, **envkv):
    r = run([DS4] + args, env=env(**envkv))
    assert r.returncode == status, (args, r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ds4: ") and needle in lines[0], r.stderr


def test_bad_input():
    m = model("tiny")
    plain_model = os.path.join(OUT, "mtp-spec-plain.gguf")
    if not os.path.exists(plain_model):
        ds4_run(["synth", "--config", "tiny", "--seed", "1", "-o", plain_model])
    ref = os.path.join(OUT, "mtp-spec.bad.ref")
    open(ref, "w").write("1 2 x\n")
    big = os.path.join(OUT, "mtp-spec.big.ref")
    open(big, "w").write("1,2,99999\n")
    base = ["-m", m, "--tokens", "1,2,3", "-n", "4"]
    for v in ("0", "4", "x", "-1", ""):
        one_line_error(base + ["--mtp-draft", v], "--mtp-draft expects an integer in [1, 3]", 2)
    one_line_error(base + ["--mtp-draft", "1", "--mtp-draft", "2"], "--mtp-draft is given twice", 2)
    one_line_error(base + ["--mtp-draft", "2", "--temp", "0.7"], "DS4_MTP_FORCE goes with greedy decoding", 2,
                   DS4_MTP_FORCE=f"1:{ref}")
    one_line_error(["-m", plain_model, "--tokens", "1,2", "--mtp-draft", "1"], "needs a model with an MTP block", 2)
    one_line_error(base, "DS4_MTP_FORCE goes with --mtp-draft", 2, DS4_MTP_FORCE=f"1:{ref}")
    for v in ("", "x", "0.5", "0.5:", "2:f", "-0.1:f", "nan:f", ":f", " 1:f"):
        one_line_error(base + ["--mtp-draft", "1"], "is not P:FILE", 2, DS4_MTP_FORCE=v)
    one_line_error(base + ["--mtp-draft", "1"], "cannot read", 1, DS4_MTP_FORCE="1:/nonexistent/ref")
    one_line_error(base + ["--mtp-draft", "1"], "holds 'x', not token ids", 2, DS4_MTP_FORCE=f"1:{ref}")
    one_line_error(base + ["--mtp-draft", "1"], "an id past the vocabulary", 2, DS4_MTP_FORCE=f"1:{big}")
    one_line_error(base + ["--mtp-draft", "2"], "DS4_UBATCH=2 is too small", 2, DS4_UBATCH=2)
    for v in ("4", "-1", "x"):
        one_line_error(base, "DS4_ROLLBACK_RESTORE", 2, DS4_ROLLBACK_RESTORE=v)


# ---- speculative sampling (--temp > 0) ----
#
# The tokens differ from plain sampling's with the same seed (the generator is drawn more often);
# what must hold is each token's distribution.  Over many seeds, each emitted token t_k (k = 1..3:
# the ones a step of 3 drafts decides, by a draft taken or a draw from the residue) must be
# distributed as plain sampling's distribution after t_0..t_{k-1}: softmax(logits / T) of the
# run's own dump row (the model's logits after those tokens, which the greedy tests hold to plain
# decoding's bytes).  The probability integral transform of each token, the vocabulary in
# descending probability and a uniform draw inside the token's mass, is uniform on [0, 1) exactly
# when the tokens have that distribution; a sampler that leans towards the head's drafts (taking
# them too often, or drawing a refused one's replacement from p instead of the residue) moves
# mass to tokens the model finds unlikely, into the upper bins.  Chi-square over 10 bins, 9
# degrees of freedom, bound 33.7 (p = 1e-4), over fixed seeds: the result is the same every run,
# and a correct sampler lands far from the bound (the README gives the statistics measured; the
# biased variants tried gave hundreds).  T = 1.5: tiny's head then has about half its drafts
# taken, so both paths are exercised.
SAMPLING_T = 1.5
SAMPLING_RUNS = 1000
CHI2_BOUND = 33.7


def pit_chi2(extra, tag):
    import numpy as np
    rng = np.random.default_rng(7)
    m = model("tiny")
    counts = np.zeros(10)
    drafted = accepted = 0
    dump = os.path.join(OUT, f"mtp-spec.sampling-{tag}.ds4logit")
    for seed in range(1, SAMPLING_RUNS + 1):
        r = run([DS4, "-m", m, "--tokens", "1,2,3,4,5", "-n", "4", "--temp", str(SAMPLING_T), "--seed", str(seed),
                 "--dump-logits", dump, "--stats"] + extra, env=env())
        assert r.returncode == 0, r.stderr
        st = re.search(r"(\d+) drafted, (\d+) accepted", r.stderr)
        if st:
            drafted += int(st.group(1))
            accepted += int(st.group(2))
        d = ds4logit.read(dump)
        P = d.n_prompt
        assert d.n_gen == 4
        for k in (1, 2, 3):
            l = d.logits[P + k - 1].astype(np.float64) / SAMPLING_T
            p = np.exp(l - l.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            rank = np.empty(len(p), dtype=np.int64)
            rank[order] = np.arange(len(p))
            cum = np.cumsum(p[order])
            x = int(d.tokens[P + k])
            u = cum[rank[x]] - p[x] + rng.random() * p[x]
            counts[min(int(u * 10), 9)] += 1
    expect = counts.sum() / 10
    return float(((counts - expect) ** 2 / expect).sum()), drafted, accepted


def test_sampling_distribution():
    chi2, drafted, accepted = pit_chi2(["--mtp-draft", "3"], "spec")
    assert drafted > 0 and 0.25 < accepted / drafted < 0.9, (drafted, accepted)
    assert chi2 < CHI2_BOUND, f"speculative sampling's tokens are not plain sampling's distribution: chi2 {chi2:.1f}"


def test_sampling_distribution_plain_control():
    """The same statistic on plain sampling: the test's own model of the distribution is right."""
    chi2, drafted, _ = pit_chi2([], "plain")
    assert drafted == 0 and chi2 < CHI2_BOUND, chi2
