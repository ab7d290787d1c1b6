#!/usr/bin/env python3
"""kernel_table.py -- the per-kernel GPU time of one profiled decode step, as a markdown table.

What it is.  It reads the CSV that Nsight Compute writes for the one decode step
`ds4_bench --profile-step` brackets with cudaProfilerStart/Stop (run by
scripts/kernel_report.sh as `ncu --profile-from-start off --metrics
gpu__time_duration.sum --csv --page raw ...`), groups the launches by kernel name
and prints, largest first: kernel, launches, mean us per launch, total us, the
share of all kernel time and of the wall-clock step.  A footer follows, as the
last block of the output: kernels per step, the sum of kernel time, the wall-clock
step from ds4_bench's host-timed steps (a run without the profiler: ncu serialises
and slows everything), and their ratio, i.e. how busy the GPU is during a step.

Kernel names are demangled (ncu's demangled names, or c++filt for a mangled one),
then shortened: no return type, no parameter list, no spaces, and template
arguments nested deeper than one level written as <...>, so k_matvec<8,1,0> and
k_matvec<0,1,0> stay two rows while a cuBLAS name stays readable.  Two different
kernels that shorten to the same text get #2, #3 appended.

Where the CSV also holds dram__bytes_read.sum and dram__bytes_write.sum (kernel_report.sh
with KR_BYTES=1), each row gains the kernel's DRAM traffic per launch and its achieved
DRAM GB/s (bytes over the kernel's own time), the figure a memory-bound decode is judged by.

A second table sums the kernels by family (FAMILIES: the dense products, the experts'
gate|up and down, the router, attention, mHC, ...; the decode matvecs by their MODE template
argument), with the same time, share and DRAM columns: issue 26's "per family, us and GB/s".
With --before OLD.csv (the same step profiled on the tree before a change) a third table
sets the two side by side per family: us before and after, their ratio, launches, and the
DRAM GB/s of each where both CSVs hold the counters -- the "before and after" of issue 26.

What it is not.  Not a profiler and not an ncu report reader: only the duration (and the
DRAM byte counters) of each launch are used.  It does not run ncu; see
scripts/kernel_report.sh.

ncu CSV pitfalls it handles: ncu's own ==PROF== lines and the program's output
mixed in, the units row of `--page raw` (nsecond, usecond, msecond, second; ns,
us, ms, s), thousands separators in values ("1,234.5"), and the long
`--page details` layout (Metric Name / Metric Unit / Metric Value columns).

    scripts/kernel_table.py NCU.csv [--bench-log PLAIN.log] [--ncu-bench-log NCU_RUN.log]
                            [--wall-ms MS] [--launches N] [--title TEXT] [--out FILE.md]
                            [--before OLD_NCU.csv]
    scripts/kernel_table.py --self-test
"""
import argparse
import csv
import re
import shutil
import subprocess
import sys

METRIC = "gpu__time_duration.sum"
BYTES = ("dram__bytes_read.sum", "dram__bytes_write.sum")
# bytes per unit (ncu prints SI prefixes; the binary ones are accepted too)
BYTE_UNITS = {
    "byte": 1.0, "b": 1.0, "bytes": 1.0,
    "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12,
    "kib": 1024.0, "mib": 1024.0 ** 2, "gib": 1024.0 ** 3,
}
# microseconds per unit
UNITS = {
    "nsecond": 1e-3, "ns": 1e-3, "nanosecond": 1e-3,
    "usecond": 1.0, "us": 1.0, "\u00b5s": 1.0, "microsecond": 1.0,
    "msecond": 1e3, "ms": 1e3, "millisecond": 1e3,
    "second": 1e6, "s": 1e6, "sec": 1e6,
}


class ParseError(Exception):
    pass


def parse_number(text):
    """A number as ncu prints it: "1,234.5" (thousands separators), "12.5", "1.2e-05"."""
    t = text.strip().replace("\u00a0", "").replace(" ", "")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?([eE][+-]?\d+)?", t):
        t = t.replace(",", "")
    elif re.fullmatch(r"[+-]?\d+,\d+", t):          # a decimal comma (non-C locale)
        t = t.replace(",", ".")
    return float(t)


def to_us(value, unit, where):
    u = (unit or "").strip()
    if u not in UNITS:
        if u:
            raise ParseError(f"{where}: unknown time unit '{u}' (expected one of {', '.join(sorted(UNITS))})")
        print(f"kernel_table: {where}: no unit given, assuming nanoseconds", file=sys.stderr)
        u = "nsecond"
    return parse_number(value) * UNITS[u]


def to_bytes(value, unit, where):
    u = (unit or "byte").strip().lower()
    if u not in BYTE_UNITS:
        raise ParseError(f"{where}: unknown byte unit '{unit}' (expected one of {', '.join(sorted(BYTE_UNITS))})")
    return parse_number(value) * BYTE_UNITS[u]


def csv_fields(line):
    try:
        return next(csv.reader([line]))
    except (csv.Error, StopIteration):
        return None


def read_launches(text):
    """[(kernel name, microseconds, DRAM bytes or None)] in launch order, from ncu --csv output (raw or
    details page); the bytes are read + written where the CSV has both counters."""
    lines = [l.rstrip("\r\n") for l in text.splitlines()]
    header, hi = None, -1
    for i, line in enumerate(lines):
        if line.startswith("==") or '"' not in line:
            continue
        f = csv_fields(line)
        if f and "Kernel Name" in f and "ID" in f:
            header, hi = f, i
            break
    if header is None:
        raise ParseError("no ncu CSV header (a line with \"ID\" and \"Kernel Name\") found")
    col = {name: j for j, name in enumerate(header)}
    k_id, k_name = col["ID"], col["Kernel Name"]
    rows = []
    for line in lines[hi + 1:]:
        if line.startswith("==") or not line.startswith('"'):
            continue
        f = csv_fields(line)
        if f is None or len(f) != len(header):
            continue
        rows.append(f)

    out = []
    if METRIC in col:                                   # --page raw: one column per metric, then a units row
        m = col[METRIC]
        bc = [col[b] for b in BYTES] if all(b in col for b in BYTES) else None
        unit, bunits = None, [None, None]
        for f in rows:
            if f[k_id].strip() == "":
                unit = f[m]
                if bc:
                    bunits = [f[c] for c in bc]
                continue
            if f[m].strip() in ("", "n/a"):
                raise ParseError(f"launch {f[k_id]}: no value for {METRIC}")
            nbytes = None
            if bc:
                nbytes = sum(to_bytes(f[c], u, f"launch {f[k_id]}") for c, u in zip(bc, bunits))
            out.append((f[k_name], to_us(f[m], unit, f"launch {f[k_id]}"), nbytes))
    elif "Metric Name" in col and "Metric Value" in col:   # --page details: one row per metric
        mn, mv, mu = col["Metric Name"], col["Metric Value"], col.get("Metric Unit")
        order, per = [], {}
        for f in rows:
            if f[mn] != METRIC and f[mn] not in BYTES:
                continue
            if f[k_id] not in per:
                order.append(f[k_id])
                per[f[k_id]] = {"name": f[k_name]}
            unit = f[mu] if mu is not None else None
            where = f"launch {f[k_id]}"
            per[f[k_id]].setdefault(f[mn], to_us(f[mv], unit, where) if f[mn] == METRIC else to_bytes(f[mv], unit, where))
        for i in order:
            d = per[i]
            if METRIC not in d:
                continue
            nbytes = sum(d[b] for b in BYTES) if all(b in d for b in BYTES) else None
            out.append((d["name"], d[METRIC], nbytes))
    else:
        raise ParseError(f"the CSV has no {METRIC} column and no Metric Name/Value columns")
    if not out:
        raise ParseError("the CSV holds no kernel launches (was the step bracketed? ncu --profile-from-start off)")
    return out


# ---- names ----

def demangle(name):
    if not name.startswith("_Z"):
        return name
    tool = shutil.which("c++filt")
    if not tool:
        return name
    try:
        r = subprocess.run([tool, name], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or name
    except (OSError, subprocess.SubprocessError):
        return name


def strip_params(s):
    """Drop a trailing parameter list "(...)" (and a trailing " const")."""
    s = s.strip()
    if s.endswith(" const"):
        s = s[:-6].rstrip()
    if not s.endswith(")"):
        return s
    depth = 0
    for i in range(len(s) - 1, -1, -1):
        c = s[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                head = s[:i].rstrip()
                # "(anonymous namespace)" alone is not a parameter list
                return head if head else s
    return s


def drop_return_type(s):
    """The last space-separated token at template depth 0: "void ns::k<a, b>" -> "ns::k<a, b>"."""
    depth, cut = 0, 0
    for i, c in enumerate(s):
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth -= 1
        elif c == " " and depth == 0:
            cut = i + 1
    return s[cut:]


def collapse_templates(s, keep_depth=1, max_len=72):
    """Remove spaces; template arguments deeper than keep_depth become "..."; cap the length."""
    s = s.replace("(anonymous namespace)::", "")
    s = re.sub(r"\s+", " ", s)
    s = re.sub(r"\s*,\s*", ",", s)
    s = re.sub(r"\s*([<>])\s*", r"\1", s)
    out, depth, skipping = [], 0, False
    for c in s:
        if c == "<":
            depth += 1
            if depth > keep_depth:
                if depth == keep_depth + 1:
                    out.append("<...")
                skipping = True
                continue
        elif c == ">":
            if depth > keep_depth:
                depth -= 1
                if depth == keep_depth:
                    out.append(">")
                    skipping = False
                continue
            depth -= 1
        if not skipping:
            out.append(c)
    r = "".join(out)
    if len(r) > max_len and "<" in r:
        base, _, args = r.partition("<")
        parts, acc = [], ""
        for a in args[:-1].split(","):
            if len(base) + len(acc) + len(a) + 6 > max_len:
                parts.append("...")
                break
            parts.append(a)
            acc += a + ","
        r = base + "<" + ",".join(parts) + ">"
    return r


def short_name(full):
    return collapse_templates(drop_return_type(strip_params(demangle(full.strip()))))


# ---- the table ----

def summarize(launches):
    """Rows (short name, launches, mean us, total us, DRAM bytes or None), largest total first; names made
    unique."""
    groups = {}          # key: the full name without parameters
    for name, us, nbytes in launches:
        key = strip_params(demangle(name.strip()))
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += us
        g[2] = None if nbytes is None or g[2] is None else g[2] + nbytes
    rows, used = [], {}
    for key, (n, tot, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        s = collapse_templates(drop_return_type(key))
        if s in used:
            used[s] += 1
            s = f"{s} #{used[s]}"
        else:
            used[s] = 1
        rows.append((s, n, tot / n, tot, nbytes))
    return rows


# Kernel families, by the short name (first match wins; the rest is "other").  The decode
# matvecs are k_matvec<TYPE,NT,MODE> and k_matvec_q<TYPE,MODE,NT>, MODE 0 dense, 1 gate|up, 2 down.
FAMILIES = [
    ("dense products (decode)", r"^k_matvec<\d+,\d+,0>|^k_matvec_q<\d+,0,\d+>|^k_matvec_generic"),
    ("experts gate|up (decode)", r"^k_matvec<\d+,\d+,1>|^k_matvec_q<\d+,1,\d+>"),
    ("experts down (decode)", r"^k_matvec<\d+,\d+,2>|^k_matvec_q<\d+,2,\d+>"),
    ("products (prefill: tensor cores, split, cuBLAS)", r"^k_tc_|^k_dequant|gemm|gemv|^cutlass|xmma|^sm\d+_"),
    ("router", r"^k_moe_gate|^k_moe_route"),
    ("MoE gather, combine, swiglu", r"^k_moe_|^k_swiglu"),
    ("attention", r"^k_att|^k_ring_store"),
    ("indexer", r"^k_indexer"),
    ("compressor", r"^k_compress"),
    ("mHC (hc_pre, hc_post, hc_mix)", r"^k_hc"),
    ("norms and RoPE", r"^k_rmsnorm|^k_head_norm_rope|^k_norm_rope|^k_rope"),
    ("hooks", r"^k_hook_"),
]


def family_of(short):
    for name, rx in FAMILIES:
        if re.search(rx, short):
            return name
    return "other"


def families(rows):
    """Rows (family, launches, total us, DRAM bytes or None) from summarize's rows, largest first."""
    fam = {}
    for name, n, _, tot, nbytes in rows:
        f = fam.setdefault(family_of(name.split(" #")[0]), [0, 0.0, 0.0])
        f[0] += n
        f[1] += tot
        f[2] = None if nbytes is None or f[2] is None else f[2] + nbytes
    return [(k, n, tot, b) for k, (n, tot, b) in sorted(fam.items(), key=lambda kv: -kv[1][1])]


def compare(before, after):
    """Markdown lines: the families of two profiled steps side by side (launch lists as
    read_launches gives them), largest after first, then the families only before."""
    fb = {f[0]: f for f in families(summarize(before))}
    fa = families(summarize(after))
    with_bytes = all(f[3] is not None for f in fa) and all(f[3] is not None for f in fb.values())
    out = ["| family | us before | us after | after / before | launches before | launches after |" +
           (" GB/s before | GB/s after |" if with_bytes else ""),
           "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if with_bytes else "")]
    rows = [(f[0], fb.get(f[0]), f) for f in fa] + [(k, b, None) for k, b in fb.items() if k not in {f[0] for f in fa}]
    for name, b, a in rows:
        bu, au = (b[2] if b else 0.0), (a[2] if a else 0.0)
        ratio = f"{au / bu:.2f}x" if bu > 0 and a else "-"
        line = (f"| {name} | {bu:.1f} | {au:.1f} | {ratio} | {b[1] if b else 0} | {a[1] if a else 0} |")
        if with_bytes:
            line += f" {gbps(b[3], bu) if b else 0:.0f} | {gbps(a[3], au) if a else 0:.0f} |"
        out.append(line)
    tb, ta = sum(l[1] for l in before), sum(l[1] for l in after)
    line = f"| **all kernels** | {tb:.1f} | {ta:.1f} | {ta / tb:.2f}x | {len(before)} | {len(after)} |"
    if with_bytes:
        line += f" {gbps(sum(l[2] for l in before), tb):.0f} | {gbps(sum(l[2] for l in after), ta):.0f} |"
    out.append(line)
    return out


def gbps(nbytes, us):
    return nbytes / (us * 1e3) if us > 0 else 0.0     # bytes / (us * 1e-6) / 1e9


def read_results(path):
    """{metric: (value, {key: value})} from the RESULT lines of a ds4_bench log."""
    res = {}
    if not path:
        return res
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if not line.startswith("RESULT "):
                    continue
                kv = dict(t.split("=", 1) for t in line.split()[1:] if "=" in t)
                if "metric" in kv and "value" in kv:
                    try:
                        res[kv["metric"]] = (float(kv["value"]), kv)
                    except ValueError:
                        pass
    except OSError as e:
        print(f"kernel_table: cannot read {path}: {e}", file=sys.stderr)
    return res


def render(launches, wall_ms=None, wall_note="", launches_counted=None, title=None, ncu_wall_ms=None):
    rows = summarize(launches)
    total_us = sum(r[3] for r in rows)
    n = len(launches)
    with_bytes = all(r[4] is not None for r in rows)
    out = []
    if title:
        out += [f"## {title}", ""]
    hdr = "| kernel | launches | us/launch (mean) | us total | % of kernel time |"
    sep = "|---|---:|---:|---:|---:|"
    if wall_ms:
        hdr += " % of wall step |"
        sep += "---:|"
    if with_bytes:
        hdr += " DRAM MB/launch | DRAM GB/s |"
        sep += "---:|---:|"
    out += [hdr, sep]
    for name, cnt, mean, tot, nbytes in rows:
        line = f"| `{name}` | {cnt} | {mean:.2f} | {tot:.1f} | {100.0 * tot / total_us:.1f}% |"
        if wall_ms:
            line += f" {100.0 * tot / (wall_ms * 1e3):.1f}% |"
        if with_bytes:
            line += f" {nbytes / cnt / 1e6:.2f} | {gbps(nbytes, tot):.0f} |"
        out.append(line)
    line = f"| **all kernels** | {n} | {total_us / n:.2f} | {total_us:.1f} | 100.0% |"
    if wall_ms:
        line += f" {100.0 * total_us / (wall_ms * 1e3):.1f}% |"
    if with_bytes:
        all_bytes = sum(r[4] for r in rows)
        line += f" {all_bytes / n / 1e6:.2f} | {gbps(all_bytes, total_us):.0f} |"
    out.append(line)
    out += ["", "| family | launches | us total | % of kernel time |" + (" DRAM MB | DRAM GB/s |" if with_bytes else ""),
            "|---|---:|---:|---:|" + ("---:|---:|" if with_bytes else "")]
    for fam, cnt, tot, nbytes in families(rows):
        line = f"| {fam} | {cnt} | {tot:.1f} | {100.0 * tot / total_us:.1f}% |"
        if with_bytes:
            line += f" {nbytes / 1e6:.1f} | {gbps(nbytes, tot):.0f} |"
        out.append(line)

    foot = [""]
    counted = f" (ds4_cuda_stats counted {launches_counted} launches in that step)" if launches_counted is not None else ""
    foot.append(f"kernels per step: {n} launches of {len(rows)} kernels{counted}")
    foot.append(f"sum of kernel time: {total_us / 1e3:.3f} ms")
    if wall_ms:
        extra = f"; under ncu, outside the profiled step: {ncu_wall_ms:.3f} ms" if ncu_wall_ms else ""
        foot.append(f"wall-clock step: {wall_ms:.3f} ms{wall_note}{extra}")
        ratio = total_us / (wall_ms * 1e3)
        foot.append(f"kernel time / wall-clock step: {ratio:.3f} (the GPU runs kernels {100.0 * ratio:.1f}% "
                    f"of the step; the rest is launch gaps, host work and copies)")
    else:
        foot.append("wall-clock step: unknown (no step_wall_ms; pass --bench-log or --wall-ms)")
    return out, foot, total_us, rows


def load(path):
    """The launches of the ncu CSV at path, or None after one line on stderr."""
    try:
        with open(path, errors="replace") as f:
            return read_launches(f.read())
    except (OSError, ParseError, ValueError) as e:
        print(f"kernel_table: {path}: {e}", file=sys.stderr)
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description="Per-kernel time table of one ncu-profiled decode step.")
    ap.add_argument("csv", nargs="?", help="ncu --csv output (--page raw or --page details)")
    ap.add_argument("--bench-log", help="ds4_bench --profile-step log of a run WITHOUT the profiler (wall-clock)")
    ap.add_argument("--ncu-bench-log", help="ds4_bench's own output from the profiled run (launch count)")
    ap.add_argument("--wall-ms", type=float, help="wall-clock decode step in ms (overrides the logs)")
    ap.add_argument("--launches", type=int, help="launches counted by ds4_cuda_stats (overrides the logs)")
    ap.add_argument("--title", help="a heading for the markdown")
    ap.add_argument("--out", help="also write the table and footer to this markdown file")
    ap.add_argument("--before", help="the same step's ncu CSV from the tree before a change: a table by family, "
                    "before and after")
    ap.add_argument("--self-test", action="store_true", help="check the parser and the table on embedded samples")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if not a.csv:
        ap.error("the ncu CSV file is required (or --self-test)")
    launches = load(a.csv)
    if launches is None:
        return 1

    plain, under = read_results(a.bench_log), read_results(a.ncu_bench_log)
    wall_ms, note, ncu_wall = a.wall_ms, "", None
    if "step_wall_ms" in under:
        ncu_wall = under["step_wall_ms"][0]
    if wall_ms is None and "step_wall_ms" in plain:
        wall_ms, kv = plain["step_wall_ms"][0], plain["step_wall_ms"][1]
        note = f" (median of {kv.get('steps', '?')} host-timed steps, no profiler attached)"
    elif wall_ms is None and ncu_wall is not None:
        wall_ms, ncu_wall = ncu_wall, None
        note = " (host-timed under ncu, outside the profiled step: an upper bound)"
    elif wall_ms is not None:
        note = " (given)"
    launches_counted = a.launches
    for res in (under, plain):
        if launches_counted is None and "profiled_step_launches" in res:
            launches_counted = int(res["profiled_step_launches"][0])

    table, foot, total_us, rows = render(launches, wall_ms, note, launches_counted, a.title, ncu_wall)
    if a.before:
        before = load(a.before)
        if before is None:
            return 1
        table += ["", f"By family, before ({a.before}) and after ({a.csv}):", ""] + compare(before, launches)
    print(f"RESULT bench=kernel_report metric=kernel_sum_ms value={total_us / 1e3:.4f} launches={len(launches)} "
          f"kernels={len(rows)}")
    if wall_ms:
        print(f"RESULT bench=kernel_report metric=kernel_over_wall value={total_us / (wall_ms * 1e3):.4f} "
              f"step_wall_ms={wall_ms:.4f}")
    if a.out:
        try:
            with open(a.out, "w") as f:
                f.write("\n".join(table + foot) + "\n")
            print(f"wrote {a.out}")
        except OSError as e:
            print(f"kernel_table: cannot write {a.out}: {e}", file=sys.stderr)
            return 1
    print()
    print("\n".join(table + foot))
    return 0


# ---- self-test: samples in ncu's own layouts ----

_RAW_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
             '"Grid Size","Device","CC","gpu__time_duration.sum"')
_KERNELS = [   # (ncu demangled name, nanoseconds)
    ("void k_hc_pre_part(const float *, const float *, const float *, const float *, float *, const float *, "
     "long, int, int, int, double *, float *)", 3200.0),
    ("void k_matvec<8, 1, 0>(mv_args)", 5100.0),
    ("void k_matvec<0, 1, 0>(mv_args)", 2500.0),
    ("void k_matvec<8, 1, 0>(mv_args)", 139000.0),
    ("void k_rmsnorm<1024, true>(const float *, const float *, float *, long, float)", 1234.5),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, "
     "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<const float>, "
     "cublasGemvTensorStridedBatched<const float>, cublasGemvTensorStridedBatched<float>, float>>"
     "(T13, T6, T6)", 7000.0),
    ("void (anonymous namespace)::k_matvec<8, 1, 0>(mv_args)", 1000.0),
]


def _raw_sample(unit, scale):
    lines = ["==PROF== Connected to process 4242 (/work/build/cuda-sm_90/ds4_bench)",
             "model flash16: 26.24 GB of weights, built in 13.4 s, uploaded to cuda in 4.3 s",
             _RAW_HEAD,
             '"","","","","","","","","","","","%s"' % unit]
    for i, (name, ns) in enumerate(_KERNELS):
        v = ns * scale
        vs = f"{v:,.4f}" if v >= 1000 else f"{v:.6g}"
        lines.append(f'"{i}","4242","ds4_bench","127.0.0.1","{name}","1","7","(256, 1, 1)","(132, 1, 1)",'
                     f'"0","9.0","{vs}"')
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def _raw_bytes_sample():
    """The raw page with the DRAM byte counters too (KR_BYTES=1), in Mbyte and Kbyte."""
    lines = [_RAW_HEAD + ',"dram__bytes_read.sum","dram__bytes_write.sum"',
             '"","","","","","","","","","","","nsecond","Mbyte","Kbyte"']
    for i, (name, ns) in enumerate(_KERNELS):
        lines.append(f'"{i}","4242","ds4_bench","h","{name}","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0",'
                     f'"{ns:.3f}","{2.0 * (i + 1):.4f}","{(i + 1):.4f}"')
    return "\n".join(lines) + "\n"


def _details_sample():
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    lines = [head]
    for i, (name, ns) in enumerate(_KERNELS):
        pre = f'"{i}","4242","ds4_bench","h","{name}","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0",'
        lines.append(pre + '"Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"')
        lines.append(pre + '"Command line profiler metrics","dram__bytes_write.sum","byte","1,024"')
        lines.append(pre + f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,.3f}"')
    return "\n".join(lines) + "\n"


def self_test():
    fails = []

    def check(cond, what):
        if not cond:
            fails.append(what)

    want_total_us = sum(ns for _, ns in _KERNELS) / 1e3
    for unit, scale in (("nsecond", 1.0), ("usecond", 1e-3), ("msecond", 1e-6), ("second", 1e-9), ("ns", 1.0)):
        got = read_launches(_raw_sample(unit, scale))
        check(len(got) == len(_KERNELS), f"raw/{unit}: {len(got)} launches")
        tot = sum(l[1] for l in got)
        check(abs(tot - want_total_us) < 1e-6 * want_total_us, f"raw/{unit}: total {tot} us, want {want_total_us}")
    got = read_launches(_details_sample())
    check(len(got) == len(_KERNELS), f"details: {len(got)} launches")
    check(abs(sum(l[1] for l in got) - want_total_us) < 1e-6 * want_total_us, "details: total")

    check(all(l[2] == 1048576 + 1024 for l in got), "details: read + written bytes per launch")
    check(all(l[2] is None for l in read_launches(_raw_sample("nsecond", 1.0))), "raw without counters: no bytes")
    gotb = read_launches(_raw_bytes_sample())
    check([l[2] for l in gotb] == [2e6 * (i + 1) + 1e3 * (i + 1) for i in range(len(_KERNELS))],
          f"raw bytes in Mbyte + Kbyte: {[l[2] for l in gotb]}")
    tb, _, _, rb = render(gotb)
    check(tb[0].endswith("| DRAM MB/launch | DRAM GB/s |"), f"bytes columns: {tb[0]}")
    rbn = {r[0]: r for r in rb}
    mv = rbn.get("k_matvec<8,1,0>")        # launches 1 and 3: 4.002 + 8.004 MB in 5.1 + 139 us
    check(mv is not None and abs(mv[4] - 12.006e6) < 1e-3, f"k_matvec<8,1,0> bytes: {mv}")
    check(any(l.startswith("| `k_matvec<8,1,0>` | 2 |") and l.endswith(" | 6.00 | 83 |") for l in tb),
          f"k_matvec<8,1,0> MB/launch and GB/s: {[l for l in tb if 'k_matvec<8,1,0>`' in l]}")
    try:
        to_bytes("1", "furlong", "x")
        fails.append("unknown byte unit accepted")
    except ParseError:
        pass
    check(parse_number("1,234.5") == 1234.5, "parse 1,234.5")
    check(parse_number("12,5") == 12.5, "parse 12,5")
    check(parse_number("4.0e-05") == 4e-5, "parse 4.0e-05")
    try:
        to_us("1", "furlong", "x")
        fails.append("unknown unit accepted")
    except ParseError:
        pass
    try:
        read_launches("just program output\nno csv here\n")
        fails.append("missing header accepted")
    except ParseError:
        pass

    rows = {r[0]: r for r in summarize(read_launches(_raw_sample("nsecond", 1.0)))}
    check("k_matvec<8,1,0>" in rows and "k_matvec<0,1,0>" in rows, f"template args kept apart: {sorted(rows)}")
    check(rows.get("k_matvec<8,1,0>", (0, 0))[1] == 2, "k_matvec<8,1,0> has 2 launches")
    check(abs(rows.get("k_matvec<8,1,0>", (0, 0, 0, 0))[3] - 144.1) < 1e-9, "k_matvec<8,1,0> total 144.1 us")
    check(abs(rows.get("k_matvec<8,1,0>", (0, 0, 0, 0))[2] - 72.05) < 1e-9, "k_matvec<8,1,0> mean 72.05 us")
    check("k_matvec<8,1,0> #2" in rows, "the anonymous-namespace k_matvec<8,1,0> is a row of its own")
    check("k_hc_pre_part" in rows, "non-template kernel name")
    check("k_rmsnorm<1024,true>" in rows, "k_rmsnorm<1024,true>")
    gemv = [n for n in rows if n.startswith("gemv2T_kernel_val<")]
    check(len(gemv) == 1 and "..." in gemv[0] and len(gemv[0]) <= 72, f"cuBLAS name shortened: {gemv}")
    check(list(rows)[0] == "k_matvec<8,1,0>", "largest total first")
    check(strip_params("(anonymous namespace)::k") == "(anonymous namespace)::k", "no params to strip")
    check(drop_return_type("void ns::k<a, b c>") == "ns::k<a, b c>", "return type dropped")

    table, foot, total_us, _ = render(read_launches(_raw_sample("usecond", 1e-3)), wall_ms=1.0,
                                      wall_note=" (test)", launches_counted=7)
    check(abs(total_us - want_total_us) < 1e-6, "render total")
    check(any(l.startswith("| **all kernels** | 7 |") for l in table), "all-kernels row")
    check(foot[1].startswith("kernels per step: 7 launches of 6 kernels"), f"footer: {foot[1]}")
    check("kernel time / wall-clock step: 0.159" in foot[-1], f"footer ratio: {foot[-1]}")
    check(len(foot) <= 12, "footer fits gpu-check's 12-line summary")

    fam = {f[0]: f for f in families(summarize(read_launches(_raw_sample("nsecond", 1.0))))}
    dense = fam.get("dense products (decode)")
    check(dense is not None and dense[1] == 4 and abs(dense[2] - 147.6) < 1e-9,
          f"dense family: k_matvec<8,1,0> x 3 and <0,1,0>, 147.6 us: {dense}")
    check(fam.get("mHC (hc_pre, hc_post, hc_mix)", (0, 0))[1] == 1 and "norms and RoPE" in fam and
          fam.get("products (prefill: tensor cores, split, cuBLAS)", (0, 0))[1] == 1, f"families: {sorted(fam)}")
    check(family_of("k_matvec<8,1,1>") == "experts gate|up (decode)" and family_of("k_matvec_q<16,2,1>") ==
          "experts down (decode)" and family_of("k_matvec_q<12,0,2>") == "dense products (decode)" and
          family_of("k_tc_wgmma<8,true>") == "products (prefill: tensor cores, split, cuBLAS)" and
          family_of("k_hook_put") == "hooks" and family_of("k_embed") == "other", "family_of's patterns")
    fb = {f[0]: f for f in families(rb)}
    check(abs(fb["dense products (decode)"][3] - (4.002e6 + 6.003e6 + 8.004e6 + 14.007e6)) < 1e-3,
          f"dense family bytes: {fb.get('dense products (decode)')}")
    check(any(l.startswith("| dense products (decode) | 4 | 147.6 | ") for l in tb), "family table row")

    # before and after: the dense family twice as fast, the mHC kernel gone
    after = [(n, us / 2 if "k_matvec<" in n else us, b) for n, us, b in gotb if "k_hc_pre" not in n]
    cmp_lines = compare(gotb, after)
    dl = [l for l in cmp_lines if l.startswith("| dense products (decode) |")]
    check(len(dl) == 1 and "| 147.6 | 73.8 | 0.50x | 4 | 4 |" in dl[0], f"before/after dense row: {dl}")
    hl = [l for l in cmp_lines if l.startswith("| mHC")]
    check(len(hl) == 1 and "| 3.2 | 0.0 | - | 1 | 0 |" in hl[0], f"a family only before: {hl}")
    check(cmp_lines[0].endswith("| GB/s before | GB/s after |") and cmp_lines[-1].startswith("| **all kernels** |"),
          f"before/after header and total: {cmp_lines[0]} {cmp_lines[-1]}")

    if fails:
        for f in fails:
            print(f"self-test FAIL: {f}")
        return 1
    print("kernel_table self-test: ok (raw page in ns/us/ms/s, details page, DRAM bytes, names, table, families, "
          "before and after, footer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
