#!/usr/bin/env python3
"""check_streams.py -- every GPU operation of the CUDA backend goes to ds4_current_stream().

The invariants of stages 0 and 1 (patches/series, ds4_stream.h), checked on the source text so
that they hold for every later change:

  launch    every `<<<grid, block, smem, stream>>>` passes ds4_current_stream() as its
            stream (the backend has one, in ds4_launch_kernel; DS4_LAUNCH calls it);
  memset    no synchronous cudaMemset/2D/3D (cudaMemsetAsync on the current stream instead);
  stream    every call that takes a stream (async copies and memsets, event records, host
            functions, kernel and graph launches, stream waits, async allocations) passes
            ds4_current_stream(); the one exception is the hook drain thread's work on its own
            stream (ds4_hooks.cu, stage 3): a call naming E->drain with a NOTE(hook drain)
            comment on its line or the 3 above;
  cublas    every cuBLAS call that does GPU work is the statement of DS4_CUBLAS(...), whose
            definition sets the handle's stream to ds4_current_stream() first (handle set-up
            and status strings are exempt);
  sync      (engine files only) every synchronous copy and synchronisation (a stream's poll,
            cudaStreamQuery, included) carries a `NOTE(load time)`, `NOTE(step result)`,
            `NOTE(prefill)` or `NOTE(hook room)` comment on its line or the 3 lines above: the
            first never runs in a step, the second is the one wait of a step (the results), the
            third a prompt's expert grouping (never in a decode step), the fourth the hook
            emitter's wait for ring room before an eager call's record (ds4_hooks.cu, hooks on);
            a synchronisation of E->drain may carry NOTE(hook drain) instead (the drain thread
            waits for its own copies, never for the compute stream);
  count     (engine files only) every device or pinned allocation, free and synchronisation
            (cudaMalloc, cudaFree, cudaHostAlloc, cudaMallocHost, cudaFreeHost,
            cudaDeviceSynchronize, cudaStreamSynchronize) sits in a function whose body also
            bumps one of the backend's counters (g_n_...), so ds4_backend_stats sees it.
  pdl       (engine files only) every kernel (__global__ function) begins with ds4_grid_dep(),
            before it touches memory: in a recorded region with DS4_CUDA_GRAPH_PDL (stage 2) a
            kernel may be scheduled before the one it depends on has finished, and that call is
            its wait.  The one exception is a reviewed prologue that reads only what no kernel
            writes (weights): a NOTE(pdl prologue) comment right after the kernel's brace, and
            the marker on or above each ds4_grid_dep() of the body;

Comments and string literals are ignored (their text is blanked, line numbers kept).

  scripts/check_streams.py [--engine FILE ...] [--other FILE ...]

Without arguments it checks the repository's files: engine = ds4_cuda*.cu, ds4_hooks.cu and
every *.cuh and ds4_stream.h at the top level; other (all rules but sync) = the benchmark programs that drive
the backend (bench/ds4_bench.c, bench/matvec_table.c).  bench/bandwidth.cu is not checked: it
is a standalone copy-bandwidth probe with its own kernels, not the engine.  One line per
violation (FILE:LINE: rule: what), then a summary line; exit 0 when clean, 1 on a violation, 2
on a usage or I/O error.  tests/test_stream_check.py plants violations and expects each to fail.
"""
import glob
import os
import re
import sys

STREAM = "ds4_current_stream()"
STREAM_CALLS = [
    "cudaMemsetAsync", "cudaMemset2DAsync", "cudaMemset3DAsync", "cudaMemcpyAsync", "cudaMemcpy2DAsync",
    "cudaMemcpy3DAsync", "cudaMemcpyPeerAsync", "cudaMemcpyToSymbolAsync", "cudaMemcpyFromSymbolAsync",
    "cudaMemPrefetchAsync", "cudaLaunchHostFunc", "cudaEventRecord", "cudaEventRecordWithFlags",
    "cudaStreamWaitEvent", "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaMallocAsync", "cudaFreeAsync", "cudaGraphLaunch", "cudaStreamAddCallback", "cudaStreamBeginCapture",
    "cudaStreamEndCapture",
]
SYNC_MEMSET = ["cudaMemset", "cudaMemset2D", "cudaMemset3D"]
SYNC_OPS = ["cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyPeer", "cudaMemcpyToSymbol",
            "cudaMemcpyFromSymbol", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
            "cudaStreamQuery"]
CUBLAS_EXEMPT = {"cublasCreate", "cublasCreate_v2", "cublasDestroy", "cublasDestroy_v2", "cublasSetStream",
                 "cublasSetStream_v2", "cublasSetMathMode", "cublasSetAtomicsMode", "cublasSetPointerMode",
                 "cublasSetPointerMode_v2", "cublasGetStatusName", "cublasGetStatusString", "cublasSetWorkspace",
                 "cublasSetWorkspace_v2", "cublasGetVersion", "cublasGetVersion_v2"}
MARKERS = ("NOTE(load time)", "NOTE(step result)", "NOTE(prefill)", "NOTE(hook room)")
DRAIN, DRAIN_MARK = "E->drain", "NOTE(hook drain)"   # the hook drain thread's own stream
COUNTED = ["cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaDeviceSynchronize",
           "cudaStreamSynchronize"]


def blank(text):
    """Comments and string/char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def call_args(code, open_paren):
    """The text between the parenthesis at open_paren and its match (None if unbalanced)."""
    depth = 0
    for j in range(open_paren, len(code)):
        if code[j] == "(":
            depth += 1
        elif code[j] == ")":
            depth -= 1
            if depth == 0:
                return code[open_paren + 1:j]
    return None


def split_top(s):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def norm(s):
    return re.sub(r"\s+", "", s)


def calls(code, names):
    """(name, offset of '(') for every call of one of names (whole identifiers)."""
    pat = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\s*\(")
    for m in pat.finditer(code):
        yield m.group(1), m.end() - 1


def check_file(path, engine):
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        print(f"check_streams: cannot read {path}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    code = blank(text)
    lines = text.split("\n")
    found = []

    def line_of(off):
        return code.count("\n", 0, off) + 1

    def bad(off, rule, what):
        found.append((line_of(off), rule, what))

    # launch: <<<...>>> with the current stream as the 4th configuration argument
    for m in re.finditer(r"<<<", code):
        end = code.find(">>>", m.end())
        cfg = split_top(code[m.end():end]) if end >= 0 else []
        if len(cfg) != 4 or norm(cfg[3]) != norm(STREAM):
            bad(m.start(), "launch", f"kernel launch without {STREAM} as its stream "
                                     "(launch through DS4_LAUNCH(kernel, grid, block, smem, args...))")
    # memset: no synchronous memsets
    for name, p in calls(code, SYNC_MEMSET):
        bad(p, "memset", f"synchronous {name} (use {name}Async(..., {STREAM}))")
    # stream: calls taking a stream pass the current one
    def drain_marked(p, args):
        ln = line_of(p)
        return args is not None and norm(DRAIN) in norm(args) and any(
            DRAIN_MARK in l for l in lines[max(0, ln - 4):ln])

    for name, p in calls(code, STREAM_CALLS):
        args = call_args(code, p)
        if (args is None or norm(STREAM) not in norm(args)) and not drain_marked(p, args):
            bad(p, "stream", f"{name} without {STREAM}")
    # cublas: GPU work only inside DS4_CUBLAS(...), whose definition sets the stream
    for m in re.finditer(r"\bcublas[A-Z]\w*(?=\s*\()", code):
        name = m.group(0)
        if name in CUBLAS_EXEMPT:
            continue
        before = code[:m.start()].rstrip()
        if not before.endswith("DS4_CUBLAS("):
            bad(m.start(), "cublas", f"{name} outside DS4_CUBLAS(...) (which sets the handle's stream to {STREAM})")
    for m in re.finditer(r"#\s*define\s+DS4_CUBLAS\s*\(", code):
        j = m.end()
        while True:                               # the macro body: continued lines
            k = code.find("\n", j)
            if k < 0 or not code[:k].rstrip().endswith("\\"):
                break
            j = k + 1
        body = code[m.end():k if k >= 0 else len(code)]
        if not re.search(r"cublasSetStream\s*\([^;]*" + re.escape(STREAM), body):
            bad(m.start(), "cublas", f"DS4_CUBLAS does not call cublasSetStream(..., {STREAM})")
    # sync: synchronous copies and synchronisations are marked (engine files)
    if engine:
        for name, p in calls(code, SYNC_OPS):
            ln = line_of(p)
            window = lines[max(0, ln - 4):ln]
            if not any(mk in l for l in window for mk in MARKERS) and not drain_marked(p, call_args(code, p)):
                bad(p, "sync", f"{name} without a NOTE(load time) / NOTE(step result) / NOTE(prefill) / "
                               "NOTE(hook room) comment on its line or the 3 above")
        # pdl: the first statement of every kernel is ds4_grid_dep();
        for m in re.finditer(r"\b__global__\b", code):
            par, rest = code.find("(", m.end()), ""
            while par >= 0:                       # past __launch_bounds__(...): the parameter list
                args = call_args(code, par)
                if args is None:
                    break
                rest = code[par + len(args) + 2:].lstrip()
                if rest[:1] in ("{", ";"):
                    break
                par = code.find("(", par + len(args) + 2)
            if not rest.startswith("{"):
                continue                          # a declaration
            if re.match(r"\{\s*ds4_grid_dep\s*\(\s*\)\s*;", rest):
                continue
            # or a reviewed prologue: a NOTE(pdl prologue) comment right after the brace, and
            # the body waits (each of its waits carries the marker too)
            brace = len(code) - len(rest)
            depth, end = 0, len(code)
            for j in range(brace, len(code)):
                depth += {"{": 1, "}": -1}.get(code[j], 0)
                if depth == 0:
                    end = j
                    break
            first_code = len(rest[1:]) - len(rest[1:].lstrip())
            waits = [w.start() + brace for w in re.finditer(r"\bds4_grid_dep\s*\(", code[brace:end])]
            marked = "NOTE(pdl prologue)" in text[brace + 1:brace + 1 + first_code] and waits and all(
                any("NOTE(pdl prologue)" in l for l in lines[max(0, line_of(w) - 4):line_of(w)]) for w in waits)
            if not marked:
                bad(m.start(), "pdl", "a kernel whose first statement is not ds4_grid_dep(); (a programmatic "
                                      "dependent launch would let it run before its inputs are written; a "
                                      "reviewed prologue says NOTE(pdl prologue) at the top and at each wait)")
        # count: the enclosing function (from the last line starting at column 0 with an
        # identifier and a parenthesis, to the next line that is a lone "}") bumps a counter
        for name, p in calls(code, COUNTED):
            start = code.rfind("\n", 0, p) + 1
            fn = None
            for m in re.finditer(r"^[A-Za-z_][^\n;]*\(", code[:start], re.M):
                fn = m.start()
            end = code.find("\n}", p)
            body = code[fn if fn is not None else 0:end if end >= 0 else len(code)]
            if not re.search(r"\bg_n_\w+\s*(\+\+|\+=)", body):
                bad(p, "count", f"{name} in a function that does not bump a g_n_ counter "
                                "(ds4_backend_stats would not see it)")
    return found


def main(argv):
    engine, other, mode = [], [], None
    for a in argv:
        if a in ("--engine", "--other"):
            mode = a
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        elif mode == "--engine":
            engine.append(a)
        elif mode == "--other":
            other.append(a)
        else:
            print(f"check_streams: unexpected argument '{a}' (see --help)", file=sys.stderr)
            return 2
    if not engine and not other:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        engine = sorted(glob.glob(os.path.join(root, "ds4_cuda*.cu"))) + [os.path.join(root, "ds4_hooks.cu"),
                                                                         os.path.join(root, "ds4_stream.h")]
        engine += sorted(glob.glob(os.path.join(root, "*.cuh")))
        other = [os.path.join(root, "bench", "ds4_bench.c"), os.path.join(root, "bench", "matvec_table.c")]
    n = 0
    for path, is_engine in [(p, True) for p in engine] + [(p, False) for p in other]:
        for ln, rule, what in check_file(path, is_engine):
            print(f"{os.path.relpath(path)}:{ln}: {rule}: {what}")
            n += 1
    print(f"stream-check: {len(engine) + len(other)} files, {n} violation{'s' if n != 1 else ''}")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
