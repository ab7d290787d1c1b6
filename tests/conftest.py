"""Shared fixtures for ds4's pytest harness.

Models are regenerated, never committed: `ds4 synth` writes tiny and small,
llama.cpp's gguf-py writes the "other" model (an independent writer).  Oracle
dumps from llama.cpp are produced live in every run (build/oracle holds the
npm-fetched libllama), so perturbing the engine fails these tests.
"""
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "oracle"))
import ds4logit  # noqa: E402

BUILD = os.path.join(REPO, "build")
OUT = os.path.join(BUILD, "test-out")
ORACLE_DIR = os.path.join(BUILD, "oracle")
ORACLE_BIN = os.path.join(ORACLE_DIR, "bin", "llama_oracle")
DS4 = os.environ.get("TEST_DS4_BIN", os.path.join(REPO, "ds4"))
CUDA_BIN = os.environ.get("TEST_DS4_CUDA_BIN", "")

# The prompt every oracle comparison uses: 32 byte-level ids.
PROMPT_TEXT = "Once upon a time, in a land far a"[:32]
PROMPT = [b for b in PROMPT_TEXT.encode()]
N_GEN = 300


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and TEST_DS4_CUDA_BIN")
    os.makedirs(OUT, exist_ok=True)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def ds4_run(args, binary=None, env=None, check=True):
    r = run([binary or DS4] + args, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"ds4 {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def model_path(name):
    return os.path.join(OUT, f"{name}.gguf")


@contextlib.contextmanager
def one_writer(path):
    """The caller alone makes PATH: pytest's workers (tests/run_pytest.sh, TEST_WORKERS) share
    build/test-out.  What it makes is written beside it and renamed over it, whole."""
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def make_model(name):
    """tiny/small from ds4 synth (seed 1, f32), small-q2/small-q4 from ds4 synth (seed 1, the
    published files' types); other from llama.cpp's gguf-py writer (seed 1).  Any other name
    must already exist in OUT (e.g. qo-q2-ggml, written by test_quant_oracle)."""
    p = model_path(name)
    with one_writer(p):
        return _make_model(name, p)


def _make_model(name, p):
    if os.path.exists(p):
        return p
    if name in ("tiny", "small"):
        ds4_run(["synth", "--config", name, "--seed", "1", "--type", "f32", "-o", p])
    elif name in ("tiny-1m", "small-1m"):   # the same weights, context_length 1,048,576 (long runs)
        ds4_run(["synth", "--config", name[:-3], "--ctx", "1048576", "--seed", "1", "--type", "f32", "-o", p])
    elif name in ("small-q2", "small-q4"):   # the published files' type layouts, small shape
        ds4_run(["synth", "--config", name, "--seed", "1", "-o", p])
    elif name == "other":
        r = run([sys.executable, os.path.join(REPO, "tests", "oracle", "write_gguf_ggufpy.py"),
                 "--gguf-py", os.path.join(ORACLE_DIR, "gguf-py"), "--config", "other",
                 "--seed", "1", "-o", p + ".part"])
        assert r.returncode == 0, r.stderr
        os.replace(p + ".part", p)            # whole or not at all, as ds4 synth writes
    else:
        raise ValueError(name)
    return p


def llama_dump(name, prompt=PROMPT, n_gen=N_GEN):
    out = os.path.join(OUT, f"{name}.llama.ds4logit")
    model = make_model(name)
    with one_writer(out):
        if os.path.exists(out):
            return out
        assert os.path.exists(ORACLE_BIN), "llama oracle not built (tests/run_pytest.sh builds it)"
        r = run([ORACLE_BIN, "-m", model, "--tokens", ",".join(map(str, prompt)),
                 "-n", str(n_gen), "-o", out + ".part", "--threads", "2"])
        assert r.returncode == 0, f"llama.cpp failed on {name}: {r.stderr}"
        os.replace(out + ".part", out)
        return out


def logit_diff(a, b):
    """Two DS4LOGIT dumps fed the same tokens, all logits finite: (da, db, |dlogit| in f64, its
    max, the row of the max)."""
    import numpy as np
    da, db = ds4logit.read(a), ds4logit.read(b)
    assert da.n_vocab == db.n_vocab and da.n_rows == db.n_rows
    assert np.array_equal(da.tokens, db.tokens), \
        f"fed tokens differ first at row {int(np.argmax(da.tokens != db.tokens))}"
    assert np.all(np.isfinite(da.logits)) and np.all(np.isfinite(db.logits))
    diff = np.abs(da.logits.astype(np.float64) - db.logits.astype(np.float64))
    return da, db, diff, float(diff.max()), int(np.unravel_index(np.argmax(diff), diff.shape)[0])


def ds4_dump(name, tag="cpu", binary=None, extra=(), prompt=PROMPT, n_gen=N_GEN):
    out = os.path.join(OUT, f"{name}.ds4-{tag}.ds4logit")
    ds4_run(["-m", make_model(name), "--tokens", ",".join(map(str, prompt)), "-n", str(n_gen),
             "--dump-logits", out] + list(extra), binary=binary)
    return out


@pytest.fixture(scope="session")
def ds4_bin():
    assert os.path.exists(DS4), f"{DS4} missing: run make"
    return DS4
