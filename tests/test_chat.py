"""-p through the tokenizer and --chat, end to end on a model with a vocabulary: the `small`
synthetic model given a byte-level BPE vocabulary by tests/oracle/add_vocab.py (gguf-py writes
it; the tokenizer's agreement with llama.cpp is tests/test_tokenizer.py's)."""
import os
import subprocess

import pytest

from conftest import OUT, ORACLE_DIR, REPO, make_model, run, DS4
from test_cli import expect_error

GGUF_PY = os.path.join(ORACLE_DIR, "gguf-py")


def vocab_model():
    p = os.path.join(OUT, "small-vocab.gguf")
    if os.path.exists(p):
        return p
    if not os.path.isdir(GGUF_PY):
        pytest.skip("skipped: build/oracle/gguf-py missing (tests/run_pytest.sh fetches it)")
    r = run(["/usr/bin/python3", os.path.join(REPO, "tests", "oracle", "add_vocab.py"), "--gguf-py", GGUF_PY,
             make_model("small"), p])
    assert r.returncode == 0, r.stderr
    return p


def ds4(args):
    """Run ds4 with -v: the generated text (stdout, UTF-8 always) and stderr, which has the
    prompt as text and the prompt and generated ids."""
    r = subprocess.run([DS4, "-v"] + args, capture_output=True)
    out, err = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")
    assert r.returncode == 0, f"ds4 {' '.join(args)} failed ({r.returncode}): {err}"
    return out, err


def ids_of(out, label):
    line = [l for l in out.splitlines() if l.startswith(label)][0]
    return [int(x) for x in line.split(":", 1)[1].split()]


def special(name):
    # add_vocab.py's layout: BOS 0, EOS 1, 256 bytes, then User, Assistant, <think>, </think>
    return {"bos": 0, "eos": 1, "user": 258, "assistant": 259, "think": 260, "/think": 261}[name]


def test_prompt_round_trip():
    m = vocab_model()
    text = "Once upon a time, 3 émigrés saw 東京 🙂"
    out, err = ds4(["-m", m, "--backend", "cpu", "-p", text, "-n", "4"])
    ids = ids_of(err, "prompt ids")
    assert ids[0] == special("bos") and len(ids) < len(text.encode()) + 1   # merges were used
    assert "prompt: <｜begin▁of▁sentence｜>" + text + "\n" in err           # the ids back to the text
    assert "byte-level ids" not in err


def test_chat_layout():
    m = vocab_model()
    _, out = ds4(["-m", m, "--backend", "cpu", "-p", "Hi", "--chat", "-n", "2"])
    ids = ids_of(out, "prompt ids")
    assert ids[:2] == [special("bos"), special("user")]
    assert ids[-2:] == [special("assistant"), special("/think")]
    _, out2 = ds4(["-m", m, "--backend", "cpu", "-p", "Hi", "--chat", "--think", "-n", "2"])
    assert ids_of(out2, "prompt ids")[-1] == special("think")
    assert ids_of(out2, "prompt ids")[:-1] == ids[:-1]
    # in the prompt, control-token text stays text; user-defined tokens (<think>) are matched,
    # as llama_tokenize(parse_special = false) does
    _, out3 = ds4(["-m", m, "--backend", "cpu", "-p", "<｜User｜><think>", "--chat", "-n", "1"])
    inner = ids_of(out3, "prompt ids")[2:-2]
    assert special("user") not in inner and inner[-1] == special("think")


def test_chat_stops_at_eos():
    m = vocab_model()
    text, out = ds4(["-m", m, "--backend", "cpu", "-p", "Hi", "--chat", "-n", "4", "--force", "5,6,1,7"])
    assert ids_of(out, "generated ids") == [5, 6]
    assert text == "\u2403\u2404\n"     # ids 5 and 6 are the bytes 3 and 4 (control pictures); EOS is not printed
    d = os.path.join(OUT, "chat-eos.ds4logit")
    ds4(["-m", m, "--backend", "cpu", "-p", "Hi", "--chat", "-n", "4", "--force", "5,6,1,7", "--dump-logits", d])
    import ds4logit
    assert ds4logit.read(d).n_gen == 2
    # without --chat, EOS is a token like any other
    _, out = ds4(["-m", m, "--backend", "cpu", "-p", "Hi", "-n", "4", "--force", "5,6,1,7"])
    assert ids_of(out, "generated ids") == [5, 6, 1, 7]


def test_chat_errors():
    m = vocab_model()
    expect_error(["-m", m, "-p", "Hi", "--think"], "--think goes with --chat")
    expect_error(["-m", m, "--tokens", "1,2", "--chat"], "--chat wraps -p TEXT")
    expect_error(["-m", make_model("tiny"), "-p", "Hi", "--chat"], "--chat needs a model with a vocabulary")
