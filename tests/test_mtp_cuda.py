"""Speculative decoding on the CUDA backend (`ds4 --mtp-draft D --backend cuda`, issue 27).

Runs only where a GPU exists and TEST_DS4_CUDA_BIN names a CUDA build of ds4 (make test-gpu,
scripts/gpu-check.sh mtp); elsewhere every test here is skipped with a visible reason.  What
must hold:
  - the MTP head on CUDA against the CPU's, on the same rows (tests/mtp_dump: a prompt through
    the trunk, then every row through the head, on each backend): max |dlogit| within GPU_TOL,
    argmax identical;
  - greedy decoding with --mtp-draft 1, 2, 3 emits plain CUDA greedy decoding's tokens and
    logits rows (--dump-logits), byte for byte, over 4096 steps (TEST_MTP_CUDA_STEPS) on tiny and
    small, with DS4_MTP_FORCE at 0, 0.5 and 1, with graphs off and on.  A check call of D + 1
    rows runs the batch paths of the matvecs (D + 1 tokens a launch), attention and the
    compressors; each gives a row the one-token call's bytes.  These models' 8 and 16 heads
    cannot show attention's part of it (its row chunks hit the same cap for one query and for
    four): test_backend_ops `rows` checks it at Flash's 64 heads, and scripts/gpu-check.sh mtp
    compares whole runs' dumps at the full shape;
  - with DS4_CUDA_GRAPHS=1 the dump is byte-identical to the eager run's, the check calls and
    the head's calls are replayed graphs (one recording per width of each, DS4_GRAPH_MAX_ROWS in
    ds4.c), no region falls back to eager launches and nothing is recorded twice: the steady
    state makes no re-captures;
  - DS4_HOOKS with --mtp-draft: the CUDA emitter's stream holds the sequence's rows and no
    others, byte for byte plain decoding's, numbered as written (as the CPU writer's).

The models are tiny and small (ds4 synth --mtp, seed 1) declared with a 65,536-token context,
so that 4096 steps fit, and small with Q8_0 matrices and in the published layouts (all drafts
forced right, so every check call is D + 1 rows); the prompts are the CPU test's
(tests/test_mtp_spec.py)."""
import os
import re

import numpy as np
import pytest

from conftest import BUILD, CUDA_BIN, OUT, ds4_run, run
from test_gpu import GPU_TOL, skip_no_gpu
from test_mtp_spec import HOOKS, check_stats, hook_stats, hooks_same_rows, ids_line, prompt

import ds4logit

pytestmark = pytest.mark.gpu

STEPS = int(os.environ.get("TEST_MTP_CUDA_STEPS", "4096"))
PROMPTS = {"tiny": 40, "small": 140, "small-q8": 140, "small-q2": 140, "small-q4": 140}
# the CUDA build of tests/mtp_dump: beside TEST_DS4_CUDA_BIN (make test-gpu), else build/cuda-$CUDA_ARCH
MTP_DUMP_CUDA = os.path.join(os.path.dirname(CUDA_BIN), "mtp_dump") if CUDA_BIN else ""
if not os.path.exists(MTP_DUMP_CUDA):
    MTP_DUMP_CUDA = os.path.join(BUILD, f"cuda-{os.environ.get('CUDA_ARCH', 'sm_90')}", "mtp_dump")


def model(name):
    """tiny, small (f32), small-q8 (small with Q8_0 matrices: the head's eh_proj of a prompt's
    rows, one per token and stream, goes to the tensor-core engine, whose scratch the session
    sizes for them), small-q2 or small-q4 (the published layouts' types), each with an MTP block
    and a 65,536-token context."""
    p = os.path.join(OUT, f"{name}-mtp-cuda.gguf")
    if not os.path.exists(p):
        typ = ["--type", "q8_0"] if name.endswith("-q8") else []
        ds4_run(["synth", "--config", name.removesuffix("-q8"), "--seed", "1", "--mtp", "--ctx", "65536", "-o", p]
                + typ)
    return p


def env(**kv):
    e = {k: x for k, x in os.environ.items() if not k.startswith("DS4_")}
    e.update({k: str(v) for k, v in kv.items()})
    return e


def gen(name, tag, *extra, **envkv):
    """A CUDA run of STEPS greedy steps: (stdout, stderr, the dump's path)."""
    dump = os.path.join(OUT, f"mtp-cuda.{name}.{tag}.ds4logit")
    r = ds4_run(["-m", model(name), "--backend", "cuda", "--tokens", prompt(PROMPTS[name]), "-n", str(STEPS),
                 "--dump-logits", dump, "-v", "--stats"] + list(extra), binary=CUDA_BIN, env=env(**envkv))
    return r.stdout, r.stderr, dump


_plain = {}


def plain(name):
    """Plain CUDA greedy decoding (eager), and the file of its generated ids (DS4_MTP_FORCE's FILE)."""
    if name not in _plain:
        out, err, dump = gen(name, "plain")
        ref = os.path.join(OUT, f"mtp-cuda.{name}.ref")
        ids = ids_line(err, "generated ids")
        assert len(ids) == STEPS
        open(ref, "w").write(" ".join(map(str, ids)) + "\n")
        _plain[name] = (out, dump, ref)
    return _plain[name]


def spec_stats(err):
    st = re.search(r"stats: mtp: .*?: (\d+) steps, (\d+) drafted, (\d+) accepted", err)
    assert st, err[-2000:]
    return tuple(int(x) for x in st.groups())


def graph_stats(err):
    g = re.search(r"stats: graphs: (\d+) captures .*?, (\d+) replays, (\d+) eager fallbacks", err)
    assert g, err[-2000:]
    return tuple(int(x) for x in g.groups())


_eager = {}


def spec_case(name, D, force, graphs):
    out0, dump0, ref = plain(name)
    key = (name, D, force)
    out, err, dump = gen(name, f"D{D}-{force}-g{graphs}", "--mtp-draft", str(D),
                         DS4_MTP_FORCE=f"{force}:{ref}", DS4_CUDA_GRAPHS=graphs)
    a, b = ds4logit.read(dump), ds4logit.read(dump0)
    n = min(len(a.logits), len(b.logits))
    rows = np.nonzero(np.any(a.logits[:n] != b.logits[:n], axis=1))[0]
    if rows.size:
        r = int(rows[0])
        print(f"{name} D={D} P={force} graphs={graphs}: {rows.size} rows differ from plain decoding's, the first "
              f"at row {r} (max |dlogit| {float(np.abs(a.logits[r].astype(np.float64) - b.logits[r]).max()):.3g}, "
              f"argmax {int(a.argmax[r])} / {int(b.argmax[r])})")
    assert out == out0, "the text differs from plain greedy decoding's"
    assert np.array_equal(a.tokens, b.tokens), "the tokens differ from plain greedy decoding's"
    assert np.array_equal(a.argmax, b.argmax)
    worst = float(np.abs(a.logits.astype(np.float64) - b.logits).max())
    assert open(dump, "rb").read() == open(dump0, "rb").read(), f"logits differ from plain decoding's: {worst:.3g}"
    check_stats(spec_stats(err), force, D, STEPS)
    if graphs:
        captures, replays, fallbacks = graph_stats(err)
        # every check call is D + 1 rows but the last steps' (fewer drafts near the end of -n), and
        # the head's calls of 1 .. D + 1 queued rows: one recording per width of each at most (D
        # check widths, D + 1 head widths), and none made twice
        assert fallbacks == 0 and 0 < captures <= 2 * D + 1 and replays >= STEPS // (D + 1) // 2, (captures, replays,
                                                                                                    fallbacks)
        if key in _eager:
            assert open(dump, "rb").read() == open(_eager[key], "rb").read(), "graphs changed the logits"
    else:
        _eager[key] = dump
    print(f"{name} D={D} P={force} graphs={graphs}: tokens and logits byte-identical to plain decoding's "
          f"over {STEPS} steps")


CASES = [(D, f, g) for D in (1, 2, 3) for f in ("0", "0.5", "1") for g in (0, 1)]


@skip_no_gpu
@pytest.mark.parametrize("D,force,graphs", CASES, ids=[f"D{D}-{f}-g{g}" for D, f, g in CASES])
def test_tiny_greedy_identical(D, force, graphs):
    spec_case("tiny", D, force, graphs)


@skip_no_gpu
@pytest.mark.parametrize("D,force,graphs", CASES, ids=[f"D{D}-{f}-g{g}" for D, f, g in CASES])
def test_small_greedy_identical(D, force, graphs):
    spec_case("small", D, force, graphs)


QUANT = [(m, D) for m in ("small-q8", "small-q2", "small-q4") for D in (1, 3)]


@skip_no_gpu
@pytest.mark.parametrize("name,D", QUANT, ids=[f"{m}-D{D}" for m, D in QUANT])
def test_quant_greedy_identical(name, D):
    """The matrices' other types: Q8_0 (small-q8), and the published layouts' (F16 projections,
    IQ2_XXS/Q2_K or Q4_K experts)."""
    spec_case(name, D, "1", 1)


@skip_no_gpu
@pytest.mark.parametrize("name", ["tiny", "small", "small-q8"])
def test_head_matches_cpu(name):
    """The head's logits on CUDA against the CPU's on the same rows: a 200-token sequence through
    the trunk, then all its rows through the head in one call, on each backend."""
    assert os.path.exists(MTP_DUMP_CUDA), f"{MTP_DUMP_CUDA} missing: make it (make cuda-check builds it)"
    cpu_bin = os.path.join(BUILD, "tests", "mtp_dump")
    assert os.path.exists(cpu_bin), f"{cpu_bin} missing: make test-py builds it"
    seq = prompt(200)
    dumps = []
    for tag, cmd in (("cpu", [cpu_bin]), ("cuda", [MTP_DUMP_CUDA])):
        d = os.path.join(OUT, f"mtp-cuda.head.{name}.{tag}.ds4logit")
        r = run(cmd + [model(name), seq, d, d + ".f32"] + (["cuda"] if tag == "cuda" else []), env=env())
        assert r.returncode == 0, r.stderr
        dumps.append(ds4logit.read(d))
    a, b = dumps
    worst = float(np.abs(a.logits.astype(np.float64) - b.logits).max())
    assert worst <= GPU_TOL, f"max |dlogit| of the head, cuda vs cpu {worst:.3g} > {GPU_TOL:g}"
    assert np.array_equal(a.argmax, b.argmax)
    print(f"{name}: the MTP head, cuda vs cpu, 200 rows: max |dlogit| {worst:.3g}, argmax identical")


HOOK_STEPS = 400


@skip_no_gpu
@pytest.mark.parametrize("D,graphs", [(1, 0), (3, 0), (1, 1), (3, 1)])
def test_hooks_hold_only_the_sequences_rows(D, graphs):
    """DS4_HOOKS with --mtp-draft on the CUDA emitter: the drain keeps a check call's records
    back until the drafts taken are known (hooks_hold / hooks_commit), then writes them cut to
    the rows kept.  As on the CPU (tests/test_mtp_spec.py): joined by (hook, layer, position),
    every hook's rows are plain CUDA greedy decoding's, byte for byte, with no row of a
    rejected draft, and the records are numbered as written; eager and with graphs."""
    _, _, ref = plain("tiny")
    paths = {}
    for tag, extra, kv in (("plain", [], {}), (f"D{D}", ["--mtp-draft", str(D)], {"DS4_MTP_FORCE": f"0.5:{ref}"})):
        path = paths[tag] = os.path.join(OUT, f"mtp-cuda.hooks-{tag}-g{graphs}.ds4h")
        r = ds4_run(["-m", model("tiny"), "--backend", "cuda", "--tokens", prompt(PROMPTS["tiny"]),
                     "-n", str(HOOK_STEPS), "-v", "--stats"] + extra, binary=CUDA_BIN,
                    env=env(DS4_HOOKS=HOOKS, DS4_HOOKS_OUT=path, DS4_CUDA_GRAPHS=graphs, **kv))
        produced, written, rejected = hook_stats(r.stderr)
        assert produced == written, r.stderr[-2000:]
        if extra:
            steps, drafted, accepted = spec_stats(r.stderr)
            assert 0 < accepted < drafted, (steps, drafted, accepted)
            assert rejected > 0, r.stderr[-2000:]
            if graphs:                  # the check calls, hooks and all, and the head's: one recording a width
                caps, reps, fb = graph_stats(r.stderr)
                assert fb == 0 and 1 <= caps <= 2 * D + 1 and reps > 0, (caps, reps, fb)
        else:
            assert rejected == 0, r.stderr[-2000:]
    hooks_same_rows(paths["plain"], paths[f"D{D}"])


@skip_no_gpu
def test_mtp_file_on_cuda():
    """The block from its own file (`--mtp MTPFILE`) on CUDA: tiny without its block plus the
    block's file (ds4 synth --mtp-file) decodes with --mtp-draft 2 and graphs exactly as tiny
    with its block: the dump, the text and the drafts' counts."""
    plain_m, block = (os.path.join(OUT, f"tiny-mtp-cuda.{t}.gguf") for t in ("plain", "block"))
    for p, flag in ((plain_m, []), (block, ["--mtp-file"])):
        if not os.path.exists(p):
            ds4_run(["synth", "--config", "tiny", "--seed", "1", "--ctx", "65536", "-o", p] + flag)
    _, _, ref = plain("tiny")
    got = []
    for tag, m, extra in (("whole", model("tiny"), []), ("file", plain_m, ["--mtp", block])):
        dump = os.path.join(OUT, f"mtp-cuda.mtpfile.{tag}.ds4logit")
        r = ds4_run(["-m", m, "--backend", "cuda", "--tokens", prompt(PROMPTS["tiny"]), "-n", "512",
                     "--dump-logits", dump, "--stats", "--mtp-draft", "2"] + extra, binary=CUDA_BIN,
                    env=env(DS4_MTP_FORCE=f"0.5:{ref}", DS4_CUDA_GRAPHS=1))
        got.append((r.stdout, open(dump, "rb").read(), spec_stats(r.stderr)))
    assert got[0] == got[1], "the block from its file decodes differently from the model's own"
