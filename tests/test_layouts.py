"""The published Flash files' tensor-type layouts (`ds4 synth --config small-q2|small-q4`):
they load, `ds4 info` reports the per-type layout, and the CPU backend runs them
deterministically.  Their numerical agreement with llama.cpp is tests/test_quant_oracle.py's."""
import os

import pytest

from conftest import OUT, ds4_run, run, DS4

EXPECT = {
    "small-q2": {"F32", "F16", "Q8_0", "Q2_K", "IQ2_XXS", "I32"},
    "small-q4": {"F32", "F16", "Q8_0", "Q4_K", "I32"},
}


def layout_model(name):
    p = os.path.join(OUT, f"{name}.gguf")
    if not os.path.exists(p):
        ds4_run(["synth", "--config", name, "--seed", "1", "-o", p])
    return p


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_layout_info(name):
    r = run([DS4, "info", layout_model(name)])
    assert r.returncode == 0, r.stderr
    types = {l.split()[0] for l in r.stdout.splitlines()[2:] if l and not l.startswith(("total", "device", "weights", "tokenizer", "this build"))}
    assert types == EXPECT[name], r.stdout
    # the backends column asks each backend of the build which types it takes: the CPU takes all
    for l in r.stdout.splitlines()[2:]:
        if l.split() and l.split()[0] in EXPECT[name]:
            assert l.split("  ")[-1].strip().startswith("cpu"), l


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_layout_runs_deterministic(name):
    m = layout_model(name)
    outs = []
    for tag in ("a", "b"):
        d = os.path.join(OUT, f"{name}-{tag}.ds4logit")
        ds4_run(["-m", m, "--backend", "cpu", "--tokens", "3,1,4,1,5,9,2,6", "-n", "24", "--dump-logits", d])
        outs.append(open(d, "rb").read())
    assert outs[0] == outs[1]


def test_expert_count():
    p = os.path.join(OUT, "small-q2-e64.gguf")
    ds4_run(["synth", "--config", "small-q2", "--experts", "64", "--seed", "1", "-o", p])
    r = run([DS4, "info", p])
    assert r.returncode == 0 and "64 experts top-4" in r.stderr + r.stdout
    ds4_run(["-m", p, "--backend", "cpu", "--tokens", "1,2,3", "-n", "4"])
    from test_cli import expect_error
    expect_error(["synth", "--config", "small-q2", "--experts", "2", "-o", os.path.join(OUT, "x.gguf")],
                 "expert count outside [top-k, 1024]")
    expect_error(["synth", "--config", "small-q2@8", "--experts", "16", "-o", os.path.join(OUT, "x.gguf")],
                 "give the expert count once")
