#!/usr/bin/env python3
"""make_corpus.py -- write the GGUF seed corpus (tests/fuzz/corpus/gguf/) from synthetic models.

usage: make_corpus.py OUTDIR MODEL.gguf...

For each model: the file cut at every section boundary (after the 24-byte header, after the
kv section, after the tensor infos, after the alignment padding) and, so that the seeds stay
small, cut again a little into the tensor data (the reader rejects the cut files, but the
header/kv/tensor-info code is what the seeds are for), plus a few deterministic mutations of
the cut-in-data file (the counts, a kv type, a tensor type, a dimension, an offset).
"""
import os, random, struct, sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

def sections(b):
    """Offsets: end of header, end of kv, end of tensor infos, start of data; and tensor-info field offsets."""
    assert b[:4] == b"GGUF"
    n_t, n_kv = struct.unpack_from("<QQ", b, 8)
    p = 24
    kv_type_offs = []
    align = 32
    def rstr(p):
        (n,) = struct.unpack_from("<Q", b, p)
        return p + 8 + n, b[p + 8:p + 8 + n]
    def rval(p, t):
        if t == 8:
            return rstr(p)[0]
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, p)
            p += 12
            for _ in range(n):
                p = rval(p, et)
            return p
        return p + SIZES[t]
    for _ in range(n_kv):
        p, key = rstr(p)
        (t,) = struct.unpack_from("<I", b, p)
        kv_type_offs.append(p)
        if key == b"general.alignment":
            (align,) = struct.unpack_from("<I", b, p + 4)
        p = rval(p + 4, t)
    end_kv = p
    tinfo = []
    for _ in range(n_t):
        p, _name = rstr(p)
        (nd,) = struct.unpack_from("<I", b, p)
        dims_off = p + 4
        type_off = dims_off + 8 * nd
        tinfo.append((dims_off, type_off, type_off + 4))
        p = type_off + 4 + 8
    end_ti = p
    data = (p + align - 1) // align * align
    return end_kv, end_ti, data, kv_type_offs, tinfo

def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(1)
    for path in sys.argv[2:]:
        b = open(path, "rb").read()
        name = os.path.basename(path).replace(".gguf", "")
        end_kv, end_ti, data, kvt, ti = sections(b)
        cuts = {"hdr": 24, "kv": end_kv, "ti": end_ti, "pad": data, "data": min(len(b), data + 4096)}
        for tag, n in cuts.items():
            open(os.path.join(out, f"{name}-{tag}"), "wb").write(b[:n])
        base = bytearray(b[:cuts["data"]])
        def mut(tag, off, val, fmt):
            m = bytearray(base)
            struct.pack_into(fmt, m, off, val)
            open(os.path.join(out, f"{name}-mut-{tag}"), "wb").write(m)
        mut("ntensors", 8, struct.unpack_from("<Q", base, 8)[0] + 1, "<Q")
        mut("nkv", 16, 0xFFFFFFFF, "<Q")
        mut("kvtype", rng.choice(kvt), 13, "<I")
        d, t, o = rng.choice(ti)
        mut("ttype", t, 8, "<I")
        mut("dim", d, 1 << 40, "<Q")
        mut("offset", o, 1 << 62, "<Q")
        mut("version", 4, 2, "<I")

main()
