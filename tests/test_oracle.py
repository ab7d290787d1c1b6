"""ds4's CPU path against llama.cpp's deepseek4 (CPU, F32 KV cache, no flash attention).

Every comparison: the same 32-token prompt in one prefill, then 300 greedy decode steps on
both engines.  300 + 32 positions cross the sliding window (32 tiny / 64 small / 24 other)
many times, two ratio-128 emissions (positions 127 and 255) and the indexer's top-k
threshold (tiny keeps 8 of up to 83 ratio-4 rows, small 16, other 6).
"""
import os

import numpy as np
import pytest

from conftest import (N_GEN, OUT, PROMPT, REPO, ds4_dump, ds4_run, ds4logit, llama_dump,
                      logit_diff, make_model)

# Bound on max |dlogit| between ds4's CPU path and llama.cpp, for f32-weight models.
# The two reference implementations agree with each other to ~1e-5 on logits of std ~1
# (shared architecture doc: llama.cpp vs transformers); both engines compute in f32 with
# different summation orders.  Measured (2026-11-29, seed 1, prompt + 300 steps): tiny
# 3.2e-6, small 3.5e-6, other 7.4e-6.  5e-5 leaves a ~7x margin over the worst of those and
# is still ~3 orders of magnitude below what a real bug does (a flipped sign, a wrong RoPE
# pair or an off-by-one window moves logits by 1e-2..1).
LLAMA_TOL = 5e-5

MODELS = ["tiny", "small", "other"]


def compare(a, b, tol):
    da, db, _, worst, row = logit_diff(a, b)
    assert worst <= tol, f"max |dlogit| {worst:.3g} at row {row} exceeds {tol:g}"
    bad = np.nonzero(da.argmax != db.argmax)[0]
    assert bad.size == 0, f"argmax differs first at row {int(bad[0])}"
    return worst


@pytest.mark.parametrize("name", MODELS)
def test_llama_cpp_agrees(name):
    """Identical greedy tokens and logits within LLAMA_TOL over prefill + 300 decode steps."""
    ref = llama_dump(name)
    got = ds4_dump(name, extra=["--backend", "cpu"])
    worst = compare(got, ref, LLAMA_TOL)
    d = ds4logit.read(ref)
    # the comparison is only meaningful if the model is not degenerate
    assert 0.3 < float(d.logits.std()) < 5.0
    assert len(set(d.argmax.tolist())) > 20
    print(f"{name}: max |dlogit| vs llama.cpp = {worst:.3g}")


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_committed_vectors(name):
    """The committed llama.cpp vectors (tests/vectors) still match: guards the synth generator too."""
    path = os.path.join(REPO, "tests", "vectors", f"{name}.llama.ds4logit")
    if not os.path.exists(path):
        pytest.skip(f"no committed vector {path}")
    got = ds4_dump(name, tag="vec", extra=["--backend", "cpu"])
    compare(got, path, LLAMA_TOL)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_transformers_vectors(name):
    """Committed vectors from HF transformers' DeepseekV4ForCausalLM (made on the GPU machine)."""
    path = os.path.join(REPO, "tests", "vectors", f"{name}.hf.ds4logit")
    if not os.path.exists(path):
        pytest.skip(f"no committed transformers vector {path}")
    ref = ds4logit.read(path)
    tokens = ref.tokens.tolist()
    got = os.path.join(OUT, f"{name}.ds4-hf.ds4logit")
    ds4_run(["-m", make_model(name), "--tokens", ",".join(map(str, tokens[:ref.n_prompt])),
             "--force", ",".join(map(str, tokens[ref.n_prompt:])), "--backend", "cpu",
             "--dump-logits", got])
    compare(got, path, LLAMA_TOL)


def test_dump_is_deterministic():
    """Same inputs and flags give a byte-identical dump, whatever the thread count."""
    a = ds4_dump("tiny", tag="det1", extra=["--threads", "2"], n_gen=40)
    b = ds4_dump("tiny", tag="det2", extra=["--threads", "1"], n_gen=40)
    c = ds4_dump("tiny", tag="det3", extra=["--threads", "2"], n_gen=40)
    assert open(a, "rb").read() == open(c, "rb").read()
    assert open(a, "rb").read() == open(b, "rb").read()


def test_dump_format():
    p = ds4_dump("tiny", tag="fmt", n_gen=7)
    raw = open(p, "rb").read()
    assert raw[:8] == b"DS4LOGIT"
    hdr = np.frombuffer(raw[8:32], dtype="<i4")
    assert hdr.tolist() == [1, 512, len(PROMPT), 7, len(PROMPT) + 7, 0]
    d = ds4logit.read(p)
    assert d.tokens[:len(PROMPT)].tolist() == PROMPT
    assert np.array_equal(d.argmax, d.logits.argmax(axis=1))
    # greedy: decode step j feeds the argmax of the previous row
    assert d.tokens[len(PROMPT):].tolist() == d.argmax[len(PROMPT) - 1:-1].tolist()


def test_force_matches_greedy():
    """Teacher forcing with the greedy continuation reproduces the greedy dump exactly."""
    g = ds4logit.read(ds4_dump("tiny", tag="g", n_gen=20))
    cont = g.tokens[len(PROMPT):].tolist()
    f = ds4_dump("tiny", tag="f", extra=["--force", ",".join(map(str, cont))], n_gen=20)
    assert open(f, "rb").read() == open(os.path.join(OUT, "tiny.ds4-g.ds4logit"), "rb").read()


def test_prefill_equals_decode():
    """Prefilling 32 tokens or feeding them one by one gives the same logits (f32 reorderings only)."""
    whole = ds4logit.read(ds4_dump("tiny", tag="pre", n_gen=0))
    seq = os.path.join(OUT, "tiny.seq.ds4logit")
    ds4_run(["-m", make_model("tiny"), "--tokens", str(PROMPT[0]),
             "--force", ",".join(map(str, PROMPT[1:])), "--dump-logits", seq])
    one = ds4logit.read(seq)
    # identical math, different matmul batching: f32 rounding only (< 1e-5 on logits of std ~1)
    assert float(np.abs(whole.logits - one.logits).max()) < 1e-4
