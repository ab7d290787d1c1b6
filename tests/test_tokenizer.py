"""ds4_tok (ds4_tok.c) against llama.cpp v0.4.0's tokenizer, on vocabularies written with
llama.cpp's gguf-py (tests/oracle/write_vocab_gguf.py) and loaded by libllama with
vocab_only = true (tests/oracle/tok_oracle.c).  ds4's side runs through tests/tok_driver.c.

The corpus (several thousand cases: mixed scripts, digits of other scripts, emoji and ZWJ
sequences, CJK and kana, code, whitespace runs, punctuation, special tokens, invalid UTF-8,
random bytes) is generated deterministically by write_vocab_gguf.gen_cases(seed, n) and
written with the escapes both drivers decode (see tests/tok_driver.c).  Ids must be
identical, pieces must be identical, and for valid UTF-8 the pieces must join back into the
input.
"""
import os
import subprocess
import sys

import pytest

from conftest import OUT, REPO, ORACLE_DIR, run

sys.path.insert(0, os.path.join(REPO, "tests", "oracle"))
import write_vocab_gguf as wv  # noqa: E402

TOK_DIR = os.path.join(OUT, "tok")
GGUF_PY = os.path.join(ORACLE_DIR, "gguf-py")
TOK_ORACLE = os.path.join(ORACLE_DIR, "bin", "tok_oracle")
TOK_DRIVER = os.path.join(REPO, "build", "tok_driver")
N_CASES = int(os.environ.get("DS4_TOK_CASES", "4000"))   # e.g. 50000 for a longer run
SEED = 1


@pytest.fixture(scope="module")
def bins():
    if not os.path.exists(os.path.join(ORACLE_DIR, "include", "llama.h")):
        pytest.skip("llama.cpp oracle not fetched (tests/oracle/fetch_llama.sh)")
    r = run(["make", "--no-print-directory", "-C", REPO, "-f", "tests/oracle/Makefile.inc", "tok-oracle"])
    assert r.returncode == 0, r.stdout + r.stderr
    os.makedirs(TOK_DIR, exist_ok=True)
    return TOK_ORACLE, TOK_DRIVER


_written = {}


def write_vocab(name, *extra):
    """Write (once per test session) a vocabulary GGUF with write_vocab_gguf.py."""
    path = os.path.join(TOK_DIR, name + ".gguf")
    if _written.get(path) == extra:
        return path
    r = run([sys.executable, os.path.join(REPO, "tests", "oracle", "write_vocab_gguf.py"),
             "--gguf-py", GGUF_PY, "-o", path] + list(extra))
    assert r.returncode == 0, r.stderr
    _written[path] = extra
    return path


@pytest.fixture(scope="module")
def corpus(bins):
    cases = wv.gen_cases(SEED, N_CASES)
    # long inputs: runs of one class, and a long mixed line
    cases += [b" " * 20000 + b"x", b"a" * 20000, b"7" * 20001, ("\u00e9" * 5000 + "\u0301" * 500).encode(),
              ("\u4e2d" * 20000).encode(), b"\n" * 5000 + b" " * 5000, ("\u00a0" * 3000 + "y").encode(),
              b"<think>" * 2000, b" ".join(wv.gen_case(__import__("random").Random(3)) for _ in range(3000))]
    path = os.path.join(TOK_DIR, "corpus.txt")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for c in cases:
            f.write(wv.escape_case(c) + "\n")
    return cases, path


def ids_of(binary, vocab, corpus_path, tag, special=True):
    out = os.path.join(TOK_DIR, f"{os.path.basename(vocab)}.{tag}.{'sp' if special else 'nosp'}.ids")
    cmd = [binary, vocab, "encode", corpus_path, out] + ([] if special else ["--no-special"])
    r = run(cmd)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr[-2000:]}"
    with open(out) as f:
        return [[int(x) for x in line.split()] for line in f.read().split("\n")[:-1]]


def pieces_of(binary, vocab, tag):
    out = os.path.join(TOK_DIR, f"{os.path.basename(vocab)}.{tag}.pieces")
    r = run([binary, vocab, "pieces", out])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(out) as f:
        return [bytes.fromhex(line) for line in f.read().split("\n")[:-1]]


def compare_ids(cases, a, b, what):
    assert len(a) == len(b) == len(cases), (len(a), len(b), len(cases))
    bad = [i for i in range(len(cases)) if a[i] != b[i]]
    print(f"\n{what}: {len(cases)} strings, {sum(map(len, a))} llama.cpp ids, {len(bad)} mismatches")
    if bad:
        i = bad[0]
        raise AssertionError(f"{what}: {len(bad)} mismatches; first case {i} {cases[i]!r}:\n"
                             f"  llama.cpp {a[i]}\n  ds4       {b[i]}")


@pytest.mark.parametrize("pre", ["deepseek-v3", "joyai-llm"])
def test_ids_match_llama(bins, corpus, pre):
    oracle, driver = bins
    cases, cpath = corpus
    vocab = write_vocab("small-" + pre, "--pre", pre, "--seed", str(SEED))
    for special in (True, False):
        want = ids_of(oracle, vocab, cpath, "llama", special)
        got = ids_of(driver, vocab, cpath, "ds4", special)
        compare_ids(cases, want, got, f"{pre} parse_special={special}")
    pieces_l, pieces_d = pieces_of(oracle, vocab, "llama"), pieces_of(driver, vocab, "ds4")
    assert pieces_l == pieces_d, \
        f"pieces differ first at id {next(i for i in range(len(pieces_l)) if pieces_l[i] != pieces_d[i])}"
    # round trip: for valid UTF-8 the pieces of ds4's ids join back into the input
    got = ids_of(driver, vocab, cpath, "ds4", True)
    n_valid = 0
    for c, ids in zip(cases, got):
        try:
            c.decode("utf-8")
        except UnicodeDecodeError:
            continue
        n_valid += 1
        assert b"".join(pieces_d[i] for i in ids) == c, f"round trip fails for {c!r}"
    print(f"{pre}: {len(pieces_l)} pieces identical; round trip ok for {n_valid} valid UTF-8 strings")


def test_synth_vocab_in_llama(bins, corpus):
    """The vocabulary `ds4 synth --vocab` writes (the embedded default model's) reads and
    tokenizes identically in llama.cpp: an independent reader of ds4's tokenizer keys."""
    oracle, driver = bins
    cases, cpath = corpus
    vocab = os.path.join(TOK_DIR, "tiny-vocab.gguf")
    r = run([os.path.join(REPO, "ds4"), "synth", "--config", "tiny", "--vocab", "--seed", "1", "-o", vocab])
    assert r.returncode == 0, r.stderr
    for special in (True, False):
        compare_ids(cases, ids_of(oracle, vocab, cpath, "llama", special), ids_of(driver, vocab, cpath, "ds4", special),
                    f"ds4 synth vocabulary, parse_special={special}")
    assert pieces_of(oracle, vocab, "llama") == pieces_of(driver, vocab, "ds4")


def test_pre_names_agree(bins, corpus):
    """joyai-llm tokenizes exactly like deepseek-v3 (same vocabulary, llama.cpp's ids)."""
    oracle, _ = bins
    _, cpath = corpus
    a = ids_of(oracle, write_vocab("small-deepseek-v3", "--pre", "deepseek-v3", "--seed", str(SEED)), cpath, "llama")
    b = ids_of(oracle, write_vocab("small-joyai-llm", "--pre", "joyai-llm", "--seed", str(SEED)), cpath, "llama")
    assert a == b


def test_large_vocab(bins, corpus):
    """A synthetic vocabulary of DeepSeek V4's size: 129280 tokens, 127741 merges."""
    oracle, driver = bins
    cases, cpath = corpus
    vocab = write_vocab("large", "--large")
    r = run([driver, vocab, "bench", "3"])
    assert r.returncode == 0, r.stderr
    print("\n" + r.stdout.strip())
    ms = float(r.stdout.split("build_ms")[1])
    assert ms < 500, f"tokenizer build took {ms} ms"
    compare_ids(cases, ids_of(oracle, vocab, cpath, "llama"), ids_of(driver, vocab, cpath, "ds4"),
                "large vocab")
    assert pieces_of(oracle, vocab, "llama") == pieces_of(driver, vocab, "ds4")


@pytest.mark.parametrize("args,needle", [
    (["--pre", "llama3"], "'llama3'"),
    (["--pre", "deepseek-llm"], "'deepseek-llm'"),
    (["--bad-merge", "nospace"], "merge 51 'ab' is not two parts"),
    (["--bad-merge", "twospaces"], "merge 51 'a b c' is not two parts"),
    (["--bad-merge", "unknown"], "right part is not a token"),
])
def test_rejects(bins, args, needle):
    """Unknown pre-tokenizers and malformed merges: exit 2, one line naming the problem."""
    _, driver = bins
    vocab = write_vocab("bad-" + "-".join(args).strip("-"), "--merges", "50", *args)
    r = run([driver, vocab, "bench", "1"])
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_api_edges(bins):
    _, driver = bins
    r = run([driver, write_vocab("small-deepseek-v3", "--pre", "deepseek-v3", "--seed", str(SEED)), "selftest"])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_overlong_code_points_do_not_crash(bins):
    """4-byte forms above U+10FFFF make llama.cpp abort (uncaught 'invalid codepoint');
    ds4 turns each such byte into U+FFFD (three bytes EF BF BD of the byte alphabet)."""
    _, driver = bins
    vocab = write_vocab("small-deepseek-v3", "--pre", "deepseek-v3", "--seed", str(SEED))
    path = os.path.join(TOK_DIR, "overflow.txt")
    with open(path, "w") as f:
        f.write("ok\\xf5\\x80\\x80\\x80z\n\\xf4\\x90\\x80\\x80\n\\xf7\\xbf\\xbf\\xbf\n")
    ids = ids_of(driver, vocab, path, "ds4")
    pieces = pieces_of(driver, vocab, "ds4")
    assert b"".join(pieces[i] for i in ids[0]) == b"ok" + "\ufffd".encode() * 4 + b"z"
    assert b"".join(pieces[i] for i in ids[1]) == "\ufffd".encode() * 4
