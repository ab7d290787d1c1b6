"""`ds4 collect` on the CPU: activation datasets in the layout of Hugging Face `datasets`'
save_to_disk, read back by an independent Arrow implementation (the npm apache-arrow package,
installed by this file into build/npm; the Arrow tests skip, saying so, when npm cannot reach
the registry).

What is checked: the shards' values equal the .ds4h hook stream of the same run byte for byte;
token_ids follow the packing rule (BOS first, a BOS between documents, a tail dropped) computed
here from the tokenizer's own ids (`ds4 -v`); the corpus made here holds documents that cross
windows, one longer than a window, an empty one, invalid UTF-8, an oversized one and, as JSONL,
malformed lines, each counted; the schema carries datasets' Array2D extension type and the
huggingface metadata; dataset_info.json and state.json as save_to_disk writes them; resume after
--stop-after-shards and after SIGTERM gives the same bytes as an uninterrupted run and leaves
whole shards untouched; a write error stops with one line and the whole shards intact; usage
errors exit 2 with one line; --format safetensors holds the same values, one file per shard.
"""
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import time

import pytest

from conftest import DS4, OUT, REPO, run

NPM_DIR = os.path.join(REPO, "build", "npm")
ARROW_VERSION = "17.0.0"
CTX = 32


@pytest.fixture(scope="module")
def model():
    p = os.path.join(OUT, "tiny-vocab.gguf")
    if not os.path.exists(p):
        r = run([DS4, "synth", "--config", "tiny", "--seed", "1", "--vocab", "-o", p])
        assert r.returncode == 0, r.stderr
    return p


@pytest.fixture(scope="module")
def arrow():
    """The npm apache-arrow package in build/npm (git-ignored), installed once."""
    mod = os.path.join(NPM_DIR, "node_modules", "apache-arrow", "package.json")
    if os.path.exists(mod) and json.load(open(mod))["version"] == ARROW_VERSION:
        return NPM_DIR
    if not shutil.which("npm") or not shutil.which("node"):
        pytest.skip("skipped: npm/node not installed (Debian: npm); the Arrow read-back needs apache-arrow")
    os.makedirs(NPM_DIR, exist_ok=True)
    r = run(["npm", "install", "--prefix", NPM_DIR, "--no-audit", "--no-fund", f"apache-arrow@{ARROW_VERSION}"],
            timeout=600)
    if r.returncode != 0:
        pytest.skip(f"skipped: npm could not install apache-arrow@{ARROW_VERSION} (registry unreachable?): "
                    f"{r.stderr.strip().splitlines()[-1:] }")
    return NPM_DIR


@pytest.fixture(scope="module")
def verifier():
    """tests/arrow_verify.cc over flatc's code for tests/arrow_ipc.fbs: the flatbuffers verifier
    Arrow C++ runs on every IPC message (Debian: flatbuffers-compiler, libflatbuffers-dev)."""
    flatc = shutil.which("flatc")
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not flatc or not cxx or not os.path.exists("/usr/include/flatbuffers/flatbuffers.h"):
        pytest.skip("skipped: the flatbuffers verifier needs flatc, its headers and a C++ compiler "
                    "(Debian: flatbuffers-compiler libflatbuffers-dev g++)")
    d = os.path.join(REPO, "build", "arrow-verify")
    os.makedirs(d, exist_ok=True)
    r = run([flatc, "--cpp", "-o", d, os.path.join(REPO, "tests", "arrow_ipc.fbs")])
    assert r.returncode == 0, r.stderr
    exe = os.path.join(d, "arrow_verify")
    r = run([cxx, "-std=c++17", "-O1", "-I", d, os.path.join(REPO, "tests", "arrow_verify.cc"), "-o", exe])
    assert r.returncode == 0, r.stderr
    return exe


def read_arrow(arrow, d, tmp):
    out = os.path.join(tmp, "arrow-out")
    os.makedirs(out, exist_ok=True)
    r = run(["node", os.path.join(REPO, "tests", "arrow_read.mjs"), arrow, d, out])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    cols = {f[:-4]: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    return rep, cols


def read_ds4h(path):
    """(header, {(hook name, layer): [payload bytes per record, in order]})"""
    b = open(path, "rb").read()
    assert b[:8] == b"DS4HOOKS"
    n = struct.unpack_from("<I", b, 12)[0]
    hdr = json.loads(b[16:16 + n])
    names = {c["id"]: c["name"] for c in hdr["catalog"]}
    recs, o = {}, 16 + n
    while o + 64 <= len(b):
        magic, hook, seq, layer, pos, step, dt, nd, fl = struct.unpack_from("<IIQiIIBBH", b, o)
        nbytes = struct.unpack_from("<Q", b, o + 48)[0]
        assert magic == 0x52483444 and fl == 0
        recs.setdefault((names[hook], layer), []).append((pos, b[o + 64:o + 64 + nbytes]))
        o += 64 + (nbytes + 7) // 8 * 8
    return hdr, recs


TL = {"attn": "hook_attn_out", "resid": "hook_resid_post", "moe": "hook_mlp_out",
      "moe_w": "mlp.hook_expert_weights", "moe_sel": "mlp.hook_expert_indices"}


def corpus_docs():
    """Documents that exercise the packing: short ones that share windows, one of ~8 windows, an
    empty line, invalid UTF-8, non-ASCII text."""
    long_doc = " ".join(f"word{i} and some more text" for i in range(60))
    return [
        "Once upon a time there was a tiny model.",
        "It had six layers of random weights and a small vocabulary.",
        "",
        long_doc,
        "bad \xff\xfe bytes",          # written as latin-1 below: invalid UTF-8
        "short",
        "Ünïcödé text, 日本語 and emoji 🙂 here.",
        "The end of the corpus, with a tail that does not fill a window " * 3,
    ]


def write_text_corpus(path, docs, extra_lines=()):
    with open(path, "wb") as f:
        for d in docs:
            f.write((d.encode("latin-1") if "\xff" in d else d.encode()) + b"\n")
        for x in extra_lines:
            f.write(x + b"\n")


def token_ids(model, text):
    r = run([DS4, "-m", model, "-p", text, "-n", "0", "-v"])
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("prompt ids:")][0]
    return [int(v) for v in line.split(":")[1].split()]


def expected_windows(model, docs, ctx):
    """The packing rule of README's "ds4 collect", here in Python over the tokenizer's ids."""
    stream = []
    bos = None
    for d in docs:
        ids = token_ids(model, d)
        bos = ids[0]
        if stream:
            stream.append(bos)
        stream += ids[1:]
    wins, i = [], 0
    while True:
        lead = 1 if i < len(stream) and stream[i] == bos else 0
        if len(stream) - i < ctx - 1 + lead:
            break
        wins.append([bos] + stream[i + lead:i + lead + ctx - 1])
        i += ctx - 1 + lead
    return wins, len(stream) - i


def assert_same_files(a, b):
    """Directories a and b hold the same files with the same bytes."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for f in os.listdir(a):
        assert open(os.path.join(a, f), "rb").read() == open(os.path.join(b, f), "rb").read(), f


def collect(model, corpus, d, *extra, hooks="attn:0-1,resid:2,moe:3", env=None, **kw):
    return run([DS4, "collect", "-m", model, "-i", corpus, "-o", d, "--hooks", hooks, "--ctx", str(CTX)] + list(extra),
               env=env, **kw)


def test_collect_arrow_equals_ds4h_stream(model, arrow, tmp_path):
    docs = corpus_docs()
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, docs, [b"x" * 5000])          # oversized with --max-doc-bytes 4096
    d = str(tmp_path / "ds")
    r = collect(model, corpus, d, "--shard-rows", "4", "--max-doc-bytes", "4096", "--ds4h", str(tmp_path / "run.ds4h"))
    assert r.returncode == 0, r.stderr
    meta = json.load(open(os.path.join(d, "ds4_collect.json")))
    assert meta["documents"] == {"used": 6, "empty": 1, "invalid_utf8": 1, "oversized": 1, "bad_json": 0}
    used = [x for x in docs if x and "\xff" not in x]
    wins, tail = expected_windows(model, used, CTX)
    assert meta["windows"] == len(wins) >= 8 and meta["tail_tokens_dropped"] == tail > 0
    assert meta["shards"] == (len(wins) + 3) // 4

    rep, cols = read_arrow(arrow, d, str(tmp_path))
    assert [s["rows"] for s in rep["shards"]] == [4] * (len(wins) // 4) + ([len(wins) % 4] if len(wins) % 4 else [])
    got = struct.unpack(f"<{len(wins) * CTX}i", cols["token_ids"])
    assert [list(got[i * CTX:(i + 1) * CTX]) for i in range(len(wins))] == wins
    # a document boundary inside a window, and the long document across several
    assert any(w[1:].count(wins[0][0]) for w in wins)

    hdr, recs = read_ds4h(str(tmp_path / "run.ds4h"))
    names = [f["name"] for f in rep["schema"]["fields"]]
    assert names == ["blocks.0.hook_attn_out", "blocks.1.hook_attn_out", "blocks.2.hook_resid_post",
                     "blocks.3.hook_mlp_out", "blocks.3.mlp.hook_expert_weights", "blocks.3.mlp.hook_expert_indices",
                     "token_ids"]
    for col in meta["columns"]:
        rs = recs[(col["ds4_hook"], col["layer"])]
        assert len(rs) == len(wins) and all(p == 0 for p, _ in rs)      # one record per window, from position 0
        assert cols[col["name"]] == b"".join(x for _, x in rs), col["name"]
        assert len(cols[col["name"]]) == len(wins) * CTX * col["width"] * 4


def test_collect_format(model, arrow, tmp_path):
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    d = str(tmp_path / "ds")
    r = collect(model, corpus, d, hooks="resid:1,moe_sel:0")
    assert r.returncode == 0, r.stderr
    rep, _ = read_arrow(arrow, d, str(tmp_path))
    sch = rep["schema"]
    sel, resid, tok = sch["fields"]            # by layer, then hook
    assert resid["name"] == "blocks.1.hook_resid_post" and resid["type"] == "List<List<Float32>>" and resid["nullable"]
    assert resid["metadata"] == {"ARROW:extension:name": "datasets.features.features.Array2DExtensionType",
                                 "ARROW:extension:metadata": f'[[{CTX}, 512], "float32"]'}
    assert resid["child"] == [{"name": "item", "type": "List<Float32>", "nullable": True}]
    assert sel["type"] == "List<List<Int32>>" and sel["metadata"]["ARROW:extension:metadata"] == f'[[{CTX}, 2], "int32"]'
    assert tok["name"] == "token_ids" and tok["type"] == f"FixedSizeList[{CTX}]<Int32>" and tok["metadata"] == {}
    features = {"blocks.0.mlp.hook_expert_indices": {"shape": [CTX, 2], "dtype": "int32", "_type": "Array2D"},
                "blocks.1.hook_resid_post": {"shape": [CTX, 512], "dtype": "float32", "_type": "Array2D"},
                "token_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "length": CTX, "_type": "Sequence"}}
    hf = json.loads(sch["metadata"]["huggingface"])
    assert hf == {"info": {"features": features}}
    assert list(hf["info"]["features"]) == ["blocks.0.mlp.hook_expert_indices", "blocks.1.hook_resid_post", "token_ids"]
    info = json.load(open(os.path.join(d, "dataset_info.json")))
    assert info["features"] == features and list(info["features"]) == list(features)
    assert json.loads(info["description"])["tool"] == "ds4 collect"
    desc = json.loads(info["description"])
    assert desc["context_size"] == CTX and desc["hooks"] == "resid:1,moe_sel:0"
    assert desc["tokenizer"]["bos"] == 0 and len(desc["tokenizer"]["pieces_fnv1a64"]) == 16
    state = json.load(open(os.path.join(d, "state.json")))
    assert sorted(state) == ["_data_files", "_fingerprint", "_format_columns", "_format_kwargs", "_format_type",
                             "_output_all_columns", "_split"]
    n = desc["shards"]
    assert state["_data_files"] == [{"filename": f"data-{i:05d}-of-{n:05d}.arrow"} for i in range(n)]
    assert sorted(os.listdir(d)) == sorted([f["filename"] for f in state["_data_files"]] +
                                           ["dataset_info.json", "state.json", "ds4_collect.json"])


def test_collect_flatbuffers_verify(model, verifier, tmp_path):
    """Every message of every shard passes the verifier pyarrow runs (nesting, bounds, alignment),
    each body inside its file, the end-of-stream marker last; a damaged shard does not."""
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    d = str(tmp_path / "ds")
    r = collect(model, corpus, d, "--shard-rows", "5", hooks="attn:0,resid:5,moe:1-2")
    assert r.returncode == 0, r.stderr
    shards = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".arrow"))
    r = run([verifier] + shards)
    assert r.returncode == 0 and r.stdout.count("verified") == len(shards) > 1, r.stdout
    bad = bytearray(open(shards[0], "rb").read())
    bad[8:12] = b"\x00\xff\xff\x7f"             # the schema's root offset, far past its flatbuffer
    (tmp_path / "bad.arrow").write_bytes(bytes(bad))
    r = run([verifier, str(tmp_path / "bad.arrow")])
    assert r.returncode == 1 and "does not verify" in r.stdout, r.stdout


def test_collect_jsonl(model, tmp_path):
    lines = ['{"text": "a lone surrogate \\ud800 here"}',
             '{"text": ""}',
             '{"title": "no text field"}',
             '{"text": 42}',
             'not json at all',
             '{"text": "trailing garbage"} x',
             '',
             json.dumps({"id": 1, "text": "Once upon a time there was a tiny model. " * 3, "meta": {"a": [1, 2]}}),
             json.dumps({"text": "escapes: \u00e9 \n \t \"quoted\" \ud83d\ude42"}),
             json.dumps({"text": "the last document " * 40}),
             json.dumps({"text": "past the budget: not counted"}), '{"text": 1}']
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    d = str(tmp_path / "ds")
    r = collect(model, str(corpus), d, "--jsonl", "--tokens", str(3 * CTX))
    assert r.returncode == 0, r.stderr
    meta = json.load(open(os.path.join(d, "ds4_collect.json")))
    assert meta["windows"] == 3 and meta["corpus"]["format"] == "jsonl" and meta["corpus"]["text_field"] == "text"
    assert meta["documents"]["bad_json"] == 4 and meta["documents"]["invalid_utf8"] == 1
    # counted up to the budget: the last two lines (one of them bad) are not
    assert meta["documents"]["empty"] == 2 and 1 <= meta["documents"]["used"] <= 3
    assert meta["token_budget"] == 3 * CTX and meta["tokens"] == 3 * CTX
    assert "bad JSON" in r.stderr.splitlines()[-1]


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} and the metadata, the offsets checked contiguous."""
    b = open(path, "rb").read()
    n = struct.unpack_from("<Q", b, 0)[0]
    hdr = json.loads(b[8:8 + n])
    meta = hdr.pop("__metadata__")
    data, end, out = b[8 + n:], 0, {}
    for name, t in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        lo, hi = t["data_offsets"]
        assert lo == end, (name, lo, end)
        out[name] = (t["dtype"], t["shape"], data[lo:hi])
        end = hi
    assert end == len(data)
    return out, meta


def test_collect_safetensors(model, tmp_path):
    """--format safetensors: one file per shard, a tensor per column and token_ids, the values the
    .ds4h stream's; resume gives the same bytes."""
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    d, part = str(tmp_path / "st"), str(tmp_path / "part")
    r = collect(model, corpus, d, "--format", "safetensors", "--shard-rows", "3", "--ds4h", str(tmp_path / "run.ds4h"),
                hooks="attn:0,resid:2,moe_sel:1")
    assert r.returncode == 0, r.stderr
    meta = json.load(open(os.path.join(d, "ds4_collect.json")))
    S, W = meta["shards"], meta["windows"]
    assert meta["format"] == "safetensors" and S > 2
    assert sorted(os.listdir(d)) == sorted([f"data-{i:05d}-of-{S:05d}.safetensors" for i in range(S)] + ["ds4_collect.json"])
    _, recs = read_ds4h(str(tmp_path / "run.ds4h"))
    cols, rows = {}, 0
    for i in range(S):
        t, m = read_safetensors(os.path.join(d, f"data-{i:05d}-of-{S:05d}.safetensors"))
        assert json.loads(m["ds4_collect"]) == meta and m["format"] == "pt"
        assert list(t) == [c["name"] for c in meta["columns"]] + ["token_ids"]
        n = t["token_ids"][1][0]
        rows += n
        for c in meta["columns"]:
            dt, shape, data = t[c["name"]]
            assert dt == ("I32" if c["dtype"] == "int32" else "F32") and shape == [n, CTX, c["width"]]
            cols[c["name"]] = cols.get(c["name"], b"") + data
        assert t["token_ids"][0] == "I32" and t["token_ids"][1] == [n, CTX]
    assert rows == W
    for c in meta["columns"]:
        assert cols[c["name"]] == b"".join(x for _, x in recs[(c["ds4_hook"], c["layer"])]), c["name"]
    r = collect(model, corpus, part, "--format", "safetensors", "--shard-rows", "3", "--stop-after-shards", "1",
                hooks="attn:0,resid:2,moe_sel:1")
    assert r.returncode == 0, r.stderr
    r = collect(model, corpus, part, "--format", "safetensors", "--shard-rows", "3", hooks="attn:0,resid:2,moe_sel:1")
    assert r.returncode == 0, r.stderr
    for f in os.listdir(d):
        assert open(os.path.join(part, f), "rb").read() == open(os.path.join(d, f), "rb").read(), f
    r = collect(model, corpus, part, "--shard-rows", "3", hooks="attn:0,resid:2,moe_sel:1")   # arrow into it: refused
    assert r.returncode == 2 and "other settings" in r.stderr


def test_collect_resume_after_stop(model, arrow, tmp_path):
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert collect(model, corpus, whole, "--shard-rows", "2").returncode == 0
    r = collect(model, corpus, part, "--shard-rows", "2", "--stop-after-shards", "2")
    assert r.returncode == 0 and "--stop-after-shards" in r.stderr.splitlines()[-1], r.stderr
    shards = sorted(f for f in os.listdir(part) if f.endswith(".arrow"))
    assert len(shards) == 2 and not os.path.exists(os.path.join(part, "state.json"))
    before = {f: os.stat(os.path.join(part, f)).st_mtime_ns for f in shards}
    n = json.load(open(os.path.join(part, "ds4_collect.json")))["shards"]
    with open(os.path.join(part, f"data-00002-of-{n:05d}.arrow.partial"), "wb") as f:   # what a crash leaves
        f.write(b"\xff\xff\xff\xffjunk")
    r = collect(model, corpus, part, "--shard-rows", "2")
    assert r.returncode == 0, r.stderr
    assert "2 of" in r.stderr and "stay as they are" in r.stderr
    assert {f: os.stat(os.path.join(part, f)).st_mtime_ns for f in shards} == before   # never rewritten
    assert_same_files(whole, part)
    # a run with other settings into the same directory is refused
    r = collect(model, corpus, part, "--shard-rows", "3")
    assert r.returncode == 2 and "other settings" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_collect_chunked_prefill_same_bytes(model, tmp_path):
    """A window prefilled in chunks (DS4_UBATCH=7: its hook records come in pieces, each at its
    position) gives the same shards as one chunk."""
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    one, chunked = str(tmp_path / "one"), str(tmp_path / "chunked")
    assert collect(model, corpus, one, "--shard-rows", "8").returncode == 0
    r = collect(model, corpus, chunked, "--shard-rows", "8", env=dict(os.environ, DS4_UBATCH="7"))
    assert r.returncode == 0, r.stderr
    assert_same_files(one, chunked)


def test_collect_resume_after_sigterm(model, tmp_path):
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs() * 4)
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert collect(model, corpus, whole, "--shard-rows", "1").returncode == 0
    p = subprocess.Popen([DS4, "collect", "-m", model, "-i", corpus, "-o", part, "--hooks", "attn:0-1,resid:2,moe:3",
                          "--ctx", str(CTX), "--shard-rows", "1", "--threads", "1"],
                         stderr=subprocess.PIPE, text=True)
    n = json.load(open(os.path.join(whole, "ds4_collect.json")))["shards"]
    first = os.path.join(part, f"data-00000-of-{n:05d}.arrow")
    t0 = time.time()
    while not os.path.exists(first) and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("the run ended before SIGTERM arrived (machine too fast for this corpus)")
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err.strip().splitlines()[-1]
    assert not [f for f in os.listdir(part) if f.endswith(".partial")]
    r = collect(model, corpus, part, "--shard-rows", "1")
    assert r.returncode == 0, r.stderr
    assert_same_files(whole, part)


def test_collect_write_error(model, tmp_path):
    corpus = str(tmp_path / "corpus.txt")
    write_text_corpus(corpus, corpus_docs())
    ref = str(tmp_path / "ref")
    assert collect(model, corpus, ref, "--shard-rows", "2").returncode == 0
    n = json.load(open(os.path.join(ref, "ds4_collect.json")))["shards"]
    size = os.path.getsize(os.path.join(ref, f"data-00000-of-{n:05d}.arrow"))
    d = str(tmp_path / "ds")
    assert collect(model, corpus, d, "--shard-rows", "2", "--stop-after-shards", "2").returncode == 0

    def limit():                     # every file this run writes stops short of a shard
        resource.setrlimit(resource.RLIMIT_FSIZE, (size - 100, size - 100))
    r = collect(model, corpus, d, "--shard-rows", "2", preexec_fn=limit)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "failed" in last and "the 2 whole shards stay" in last, last
    files = sorted(os.listdir(d))
    assert not [f for f in files if f.endswith(".partial")] and "state.json" not in files
    arrows = [f for f in files if f.endswith(".arrow")]
    assert len(arrows) == 2, files
    for f in arrows:
        assert open(os.path.join(d, f), "rb").read() == open(os.path.join(ref, f), "rb").read()
    r = collect(model, corpus, d, "--shard-rows", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(d)) == sorted(os.listdir(ref))


@pytest.mark.parametrize("args,env,msg", [
    (["--hooks", "attn"], None, "collect needs -i"),
    (["-i", "c.txt", "-o", "d", "--hooks", "logits"], None, "logits and attn_probs"),
    (["-i", "c.txt", "-o", "d", "--hooks", "bogus"], None, "unknown hook"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn:99"], None, "past the model"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--ctx", "32", "--tokens", "10"], None, "less than one window"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--text-field", "t"], None, "--text-field goes with --jsonl"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--ctx", "8", "--ctx", "9"], None, "given twice"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--backend", "tpu"], None, "unknown --backend 'tpu'"),
    # make test's ./ds4 is the CPU build (the CUDA run is tests/test_gpu.py's test_collect_cuda)
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--backend", "cuda"], None, "built without CUDA"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn", "--format", "parquet"], None, "arrow or safetensors"),
    (["-i", "c.txt", "-o", "d", "--hooks", "attn"], {"DS4_HOOKS": "attn"}, "unset DS4_HOOKS"),
])
def test_collect_usage_errors(model, tmp_path, args, env, msg):
    (tmp_path / "c.txt").write_text("hello\n")
    e = dict(os.environ, **(env or {}))
    r = run([DS4, "collect", "-m", model] + args, cwd=str(tmp_path), env=e)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()
