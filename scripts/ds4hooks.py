#!/usr/bin/env python3
"""ds4hooks.py -- read the hook record streams ds4 writes (DS4_HOOKS, ds4_hooks.h), with numpy alone.

  ds4hooks.py info FILE                      the header, and records / rows / bytes per (hook, layer)
  ds4hooks.py export FILE OUT.npz|OUT.safetensors
                                             one array per (hook, layer): rows in position order,
                                             named HOOK.LAYER (logits: "logits"), plus POS arrays
  ds4hooks.py compare A B [--tol T]          the same records in both (hook, layer, position,
                                             shape), and max |a - b| per (hook, layer) within T
                                             (integer hooks: equal); exit 1 when not
  ds4hooks.py plot FILE -o OUT.png           attention-output norm per layer x position, and the
                                             experts chosen per layer (needs matplotlib:
                                             Debian python3-matplotlib; says so and exits 0 without)

As a module: read(path) -> Stream with .header (dict), .records (list of Record) and
.arrays() -> {(hook, layer): (positions, array)}.  A truncated file is read up to its last
whole record (Stream.truncated says so); a record that is not well-formed is an error.
The format is in ds4_hooks.h and README.md.
"""
import argparse
import json
import os
import struct
import sys

try:
    import numpy as np
except ImportError:                     # another python3 of the same version: Debian's numpy
    sys.path.append("/usr/lib/python3/dist-packages")
    import numpy as np

MAGIC = b"DS4HOOKS"
RECORD_MAGIC = 0x52483444
REC = struct.Struct("<IIQiIIBBH4IQQ")    # ds4h_record, 64 bytes
assert REC.size == 64
DTYPES = {0: np.float32, 1: np.int32}
FLAG_GAP = 1
# hooks whose records hold one token each, of a size that varies with the position
RAGGED = {"attn_probs"}


class FormatError(ValueError):
    pass


class Record:
    __slots__ = ("hook", "name", "seq", "layer", "pos", "step", "dtype", "shape", "gap", "data")

    def __init__(self, hook, name, seq, layer, pos, step, dtype, shape, gap, data):
        self.hook, self.name, self.seq, self.layer, self.pos = hook, name, seq, layer, pos
        self.step, self.dtype, self.shape, self.gap, self.data = step, dtype, shape, gap, data


class Stream:
    def __init__(self, header, records, truncated):
        self.header, self.records, self.truncated = header, records, truncated

    def arrays(self):
        """{(name, layer): (positions [rows], values [rows, ...])}, rows in position order.
        Ragged hooks (attn_probs): (positions [records], [one array per record])."""
        groups = {}
        for r in self.records:
            if r.gap:
                continue
            groups.setdefault((r.name, r.layer), []).append(r)
        out = {}
        for key, recs in groups.items():
            recs.sort(key=lambda r: (r.pos, r.seq))
            if key[0] in RAGGED:
                out[key] = (np.array([r.pos for r in recs], dtype=np.int64), [r.data for r in recs])
                continue
            pos = np.concatenate([np.arange(r.pos, r.pos + r.shape[0], dtype=np.int64) for r in recs])
            val = np.concatenate([r.data for r in recs])
            out[key] = (pos, val)
        return out

    def dropped(self):
        return sum(r.shape[0] for r in self.records if r.gap)


def read(path):
    with open(path, "rb") as f:
        buf = f.read()
    if buf[:min(len(buf), 8)] != MAGIC[:min(len(buf), 8)] or not buf:
        raise FormatError(f"{path}: not a ds4 hook stream (no DS4HOOKS magic)")
    if len(buf) < 16:
        raise FormatError(f"{path}: truncated: {len(buf)} bytes, shorter than the 16-byte file header")
    version, n = struct.unpack_from("<II", buf, 8)
    if version != 1:
        raise FormatError(f"{path}: format version {version}, this reader knows 1")
    if 16 + n > len(buf) or n % 8:
        raise FormatError(f"{path}: header of {n} bytes does not fit the file ({len(buf)} bytes)")
    try:
        header = json.loads(buf[16:16 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: the header is not JSON ({e})")
    names = {c["id"]: c["name"] for c in header.get("catalog", [])}
    off, records, truncated, seq = 16 + n, [], False, 0
    while off < len(buf):
        if off + REC.size > len(buf):
            truncated = True
            break
        (magic, hook, rseq, layer, pos, step, dt, ndim, flags, s0, s1, s2, s3, nbytes, _) = REC.unpack_from(buf, off)
        if magic != RECORD_MAGIC:
            raise FormatError(f"{path}: no record magic at byte {off}")
        if hook not in names or dt not in DTYPES or not 1 <= ndim <= 4:
            raise FormatError(f"{path}: record {rseq} at byte {off}: hook {hook}, dtype {dt}, ndim {ndim}")
        if rseq != seq:
            raise FormatError(f"{path}: record at byte {off} has sequence number {rseq}, expected {seq}")
        shape = (s0, s1, s2, s3)[:ndim]
        gap = bool(flags & FLAG_GAP)
        want = 0 if gap else int(np.prod(shape, dtype=np.int64)) * 4
        if nbytes != want:
            raise FormatError(f"{path}: record {rseq}: {nbytes} payload bytes for shape {shape}")
        body = off + REC.size
        end = body + nbytes + (-nbytes) % 8
        if end > len(buf):
            truncated = True
            break
        data = None if gap else np.frombuffer(buf, dtype=DTYPES[dt], count=nbytes // 4, offset=body).reshape(shape)
        records.append(Record(hook, names[hook], rseq, layer, pos, step, dt, shape, gap, data))
        # every record produced took a sequence number, dropped ones too: a gap record holds
        # the first dropped record's and stands for shape[0] of them
        seq += shape[0] if gap else 1
        off = end
    return Stream(header, records, truncated)


def key_name(name, layer):
    return name if layer < 0 else f"{name}.{layer}"


def cmd_info(a):
    s = read(a.file)
    h = s.header
    print(f"{a.file}: ds4h v{h.get('version')}, backend {h.get('backend')}, policy {h.get('policy')}, "
          f"model {json.dumps(h.get('model'))}")
    print(f"selection: {json.dumps(h.get('selection'))}")
    print(f"{len(s.records)} records{' (truncated: read up to the last whole record)' if s.truncated else ''}, "
          f"{s.dropped()} records dropped")
    for (name, layer), (pos, val) in sorted(s.arrays().items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if name in RAGGED:
            print(f"  {key_name(name, layer):12s} rows {len(pos):6d}  positions {pos.min()}..{pos.max()}  "
                  f"one record per token, {val[0].shape} .. {val[-1].shape}  {val[0].dtype}")
            continue
        print(f"  {key_name(name, layer):12s} rows {len(pos):6d}  positions {pos.min()}..{pos.max()}  "
              f"shape {tuple(val.shape)}  {val.dtype}")
    return 0


def cmd_export(a):
    arrays = read(a.file).arrays()
    flat = {}
    for (name, layer), (pos, val) in arrays.items():
        k = key_name(name, layer)
        if name in RAGGED:      # one array per token: NAME.LAYER.pPOS
            for p, v in zip(pos.tolist(), val):
                flat[f"{k}.p{p}"] = np.ascontiguousarray(v)
            continue
        flat[k] = np.ascontiguousarray(val)
        flat[k + ".pos"] = pos
    if a.out.endswith(".npz"):
        np.savez(a.out, **flat)
    elif a.out.endswith(".safetensors"):
        write_safetensors(a.out, flat)
    else:
        print("ds4hooks: export writes .npz or .safetensors", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {len(arrays)} arrays")
    return 0


def write_safetensors(path, arrays):
    """The safetensors layout: u64 header length, a JSON header (dtype, shape, data offsets), the data."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
    meta, blobs, off = {}, [], 0
    for k in sorted(arrays):
        v = np.ascontiguousarray(arrays[k])
        b = v.astype(v.dtype.newbyteorder("<"), copy=False).tobytes()
        meta[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hdr = json.dumps(meta, separators=(",", ":")).encode()
    hdr += b" " * ((-len(hdr)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for b in blobs:
            f.write(b)


def cmd_compare(a):
    sa, sb = read(a.a), read(a.b)
    aa, ab = sa.arrays(), sb.arrays()
    bad = 0                    # arrays of both streams that differ
    missing = sorted(set(aa) ^ set(ab))
    if missing:
        print(f"ds4hooks: different (hook, layer) sets: only in A {sorted(set(aa) - set(ab))}, "
              f"only in B {sorted(set(ab) - set(aa))}")
    for key in sorted(set(aa) & set(ab)):
        (pa, va), (pb, vb) = aa[key], ab[key]
        name = key_name(*key)
        if key[0] in RAGGED:
            same = np.array_equal(pa, pb) and all(x.shape == y.shape for x, y in zip(va, vb))
            if not same:
                print(f"  {name:12s} DIFFERENT positions or shapes")
                bad += 1
                continue
            d = max((float(np.abs(x.astype(np.float64) - y).max()) for x, y in zip(va, vb)), default=0.0)
            ok = d <= a.tol
            print(f"  {name:12s} max|d| {d:.3g}  {'ok' if ok else 'ABOVE ' + str(a.tol)}")
            bad += not ok
            continue
        if not np.array_equal(pa, pb) or va.shape != vb.shape:
            print(f"  {name:12s} DIFFERENT positions or shapes ({va.shape} vs {vb.shape})")
            bad += 1
            continue
        if va.dtype.kind == "i":
            ok = np.array_equal(va, vb)
            print(f"  {name:12s} {'equal' if ok else 'DIFFERENT'} ({va.size} ids)")
            bad += not ok
            continue
        d = float(np.abs(va.astype(np.float64) - vb.astype(np.float64)).max()) if va.size else 0.0
        ok = d <= a.tol
        print(f"  {name:12s} max|d| {d:.3g}  {'ok' if ok else 'ABOVE ' + str(a.tol)}")
        bad += not ok
    print(f"compare: {len(set(aa) & set(ab))} arrays in both, {bad} differ"
          + (f"; {len(missing)} in only one" if missing else ""))
    return 1 if bad or missing else 0


def cmd_plot(a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ds4hooks: plot needs matplotlib (Debian: apt-get install -y python3-matplotlib); skipped")
        return 0
    s = read(a.file)
    arrays = s.arrays()
    attn = sorted((k, v) for k, v in arrays.items() if k[0] == "attn")
    sel = sorted((k, v) for k, v in arrays.items() if k[0] == "moe_sel")
    if not attn and not sel:
        print("ds4hooks: nothing to plot: the stream has neither attn nor moe records", file=sys.stderr)
        return 1
    panels = (1 if attn else 0) + (1 if sel else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(10, 3.5 * panels), squeeze=False)
    i = 0
    if attn:
        layers = [k[1] for k, _ in attn]
        pmax = max(int(v[0].max()) for _, v in attn) + 1
        img = np.full((len(layers), pmax), np.nan)
        for row, (_, (pos, val)) in enumerate(attn):
            img[row, pos] = np.linalg.norm(val.reshape(len(pos), -1).astype(np.float64), axis=1)
        ax = axes[i][0]
        im = ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest",
                       extent=(-0.5, pmax - 0.5, -0.5, len(layers) - 0.5))
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers)
        ax.set_xlabel("position")
        ax.set_ylabel("layer")
        ax.set_title("attention output norm |attn| per layer and position")
        fig.colorbar(im, ax=ax)
        i += 1
    if sel:
        n_exp = max(int(v[1].max()) for _, v in sel) + 1
        img = np.zeros((len(sel), n_exp))
        for row, (_, (pos, val)) in enumerate(sel):
            ids = val.reshape(-1)
            ids = ids[ids >= 0]
            img[row] = np.bincount(ids, minlength=n_exp)[:n_exp]
        ax = axes[i][0]
        im = ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest")
        ax.set_yticks(range(len(sel)))
        ax.set_yticklabels([k[1] for k, _ in sel])
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title("experts chosen per layer (count over the stream's tokens)")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("info")
    q.add_argument("file")
    q = sub.add_parser("export")
    q.add_argument("file")
    q.add_argument("out")
    q = sub.add_parser("compare")
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--tol", type=float, default=0.0)
    q = sub.add_parser("plot")
    q.add_argument("file")
    q.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    try:
        rc = {"info": cmd_info, "export": cmd_export, "compare": cmd_compare, "plot": cmd_plot}[a.cmd](a)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # the reader left (ds4hooks.py info F | head): not an error of ours; stop quietly, and
        # keep Python from reporting the pipe again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (FormatError, OSError) as e:
        print(f"ds4hooks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
