#!/usr/bin/env python3
"""Pure-numpy GGUF (v2/v3) reader: metadata of every type, the tensor directory, tensor data.

    from gguf_np import GGUFFile
    g = GGUFFile("model.gguf")           # memory-maps the file
    g.kv["deepseek4.block_count"]        # python int / float / bool / str; arrays -> numpy or list
    g.get("deepseek4.rope.freq_base", 10000.0)
    g.tensors["blk.0.attn_q_a.weight"]   # TensorInfo(name, shape, ggml_type, offset, nbytes)
    g.tensor("blk.0.attn_q_a.weight")    # numpy array, numpy shape = reversed ggml ne

Tensor types decoded: F32, F16, BF16 (returned as float32), F64, I8, I16, I32, I64, Q8_0
(dequantised to float32, y = d * q exactly as ggml does). Other quantised types can be listed
and read raw (`g.raw(name)`), but not decoded.

CLI: python3 gguf_np.py FILE [--tensors]   prints the metadata (and the tensor directory).

Only numpy is needed. Errors are raised as GGUFError with a one-line message.
"""
from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass

try:
    import numpy as np
except ImportError:  # Debian's python3-numpy under another python3 of the same version
    sys.path.append("/usr/lib/python3/dist-packages")
    import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# gguf metadata value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)

KV_TYPE_NAMES = {
    T_UINT8: "u8", T_INT8: "i8", T_UINT16: "u16", T_INT16: "i16", T_UINT32: "u32", T_INT32: "i32",
    T_FLOAT32: "f32", T_BOOL: "bool", T_STRING: "str", T_ARRAY: "arr", T_UINT64: "u64",
    T_INT64: "i64", T_FLOAT64: "f64",
}

# fixed-size scalar metadata types: struct code, numpy dtype
_SCALAR = {
    T_UINT8: ("<B", "<u1"), T_INT8: ("<b", "<i1"), T_UINT16: ("<H", "<u2"), T_INT16: ("<h", "<i2"),
    T_UINT32: ("<I", "<u4"), T_INT32: ("<i", "<i4"), T_FLOAT32: ("<f", "<f4"), T_BOOL: ("<B", "<u1"),
    T_UINT64: ("<Q", "<u8"), T_INT64: ("<q", "<i8"), T_FLOAT64: ("<d", "<f8"),
}

# ggml tensor types we know the size of: id -> (name, block elements, block bytes)
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1 = 0, 1, 2, 3
GGML_Q8_0 = 8
GGML_I8, GGML_I16, GGML_I32, GGML_I64, GGML_F64 = 24, 25, 26, 27, 28
GGML_BF16 = 30
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}
_PLAIN_DTYPES = {
    GGML_F32: "<f4", GGML_F16: "<f2", GGML_F64: "<f8", GGML_I8: "<i1", GGML_I16: "<i2",
    GGML_I32: "<i4", GGML_I64: "<i8",
}


class GGUFError(Exception):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: tuple          # numpy order (ggml ne reversed)
    ggml_type: int
    offset: int           # absolute byte offset in the file
    nbytes: int | None    # None when the type's size is unknown here

    @property
    def ne(self) -> tuple:
        return tuple(reversed(self.shape))

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}",))[0]

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def ggml_nbytes(ggml_type: int, shape) -> int | None:
    if ggml_type not in GGML_TYPES:
        return None
    _, blk, bsz = GGML_TYPES[ggml_type]
    ne0 = shape[-1] if len(shape) else 1
    if ne0 % blk:
        raise GGUFError(f"row length {ne0} is not a multiple of the {GGML_TYPES[ggml_type][0]} block ({blk})")
    n = 1
    for s in shape:
        n *= s
    return n // blk * bsz


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def dequant_q8_0(raw: np.ndarray, shape) -> np.ndarray:
    """raw: uint8 bytes of Q8_0 blocks (34 bytes: f16 d, 32 x int8 q) -> float32 array of shape."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)          # [nb, 1]
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)         # [nb, 32]
    return (q * d).reshape(shape)


class _Cursor:
    def __init__(self, buf, pos=0):
        self.buf = buf
        self.pos = pos
        self.size = len(buf)

    def need(self, n):
        if self.pos + n > self.size:
            raise GGUFError(f"truncated file: need {n} bytes at offset {self.pos}, size {self.size}")

    def unpack(self, code):
        n = struct.calcsize(code)
        self.need(n)
        v = struct.unpack_from(code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self):
        n = self.unpack("<Q")
        self.need(n)
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b.decode("utf-8", errors="surrogateescape")

    def array(self, dtype, count):
        dt = np.dtype(dtype)
        n = dt.itemsize * count
        self.need(n)
        a = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += n
        return a


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self._fh = open(path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open {path}: {e.strerror}") from None
        try:
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{path}: empty file") from None
        self.kv: dict = {}
        self.kv_types: dict = {}   # key -> type id, or (T_ARRAY, element type id)
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def close(self):
        try:
            self._mm.close()
        except BufferError:  # numpy views of the mapping are still alive; the GC unmaps later
            pass
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- parsing -----------------------------------------------------------------------------
    def _value(self, c: _Cursor, t: int, depth=0):
        if t in _SCALAR:
            v = c.unpack(_SCALAR[t][0])
            return bool(v) if t == T_BOOL else v
        if t == T_STRING:
            return c.string()
        if t == T_ARRAY:
            if depth > 4:
                raise GGUFError("metadata arrays nested too deeply")
            et = c.unpack("<I")
            n = c.unpack("<Q")
            if et in _SCALAR:
                a = c.array(_SCALAR[et][1], n)
                return a.astype(bool) if et == T_BOOL else a
            if et == T_STRING:
                return [c.string() for _ in range(n)]
            if et == T_ARRAY:
                return [self._value(c, T_ARRAY, depth + 1) for _ in range(n)]
            raise GGUFError(f"unknown metadata array element type {et}")
        raise GGUFError(f"unknown metadata value type {t}")

    def _parse(self):
        c = _Cursor(self._mm)
        c.need(4)
        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r})")
        c.pos = 4
        self.version = c.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} (need 2 or 3)")
        n_tensors = c.unpack("<Q")
        n_kv = c.unpack("<Q")
        if n_tensors > 10_000_000 or n_kv > 10_000_000:
            raise GGUFError(f"{self.path}: implausible counts ({n_tensors} tensors, {n_kv} keys)")
        for _ in range(n_kv):
            key = c.string()
            t = c.unpack("<I")
            if key in self.kv:
                raise GGUFError(f"duplicate metadata key {key}")
            if t == T_ARRAY:
                save = c.pos
                et = c.unpack("<I")
                c.pos = save
                self.kv_types[key] = (T_ARRAY, et)
            else:
                self.kv_types[key] = t
            self.kv[key] = self._value(c, t)
        infos, names = [], set()
        for _ in range(n_tensors):
            name = c.string()
            nd = c.unpack("<I")
            if nd > 8:
                raise GGUFError(f"tensor {name}: {nd} dimensions")
            ne = [c.unpack("<Q") for _ in range(nd)]
            gt = c.unpack("<I")
            off = c.unpack("<Q")
            if name in names:
                raise GGUFError(f"duplicate tensor {name}")
            names.add(name)
            infos.append((name, tuple(reversed(ne)), gt, off))
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"bad general.alignment {align!r}")
        self.alignment = align
        self.data_offset = (c.pos + align - 1) // align * align
        for name, shape, gt, off in infos:
            if off % align:
                raise GGUFError(f"tensor {name}: offset {off} not aligned to {align}")
            nbytes = ggml_nbytes(gt, shape)
            absoff = self.data_offset + off
            if nbytes is not None and absoff + nbytes > len(self._mm):
                raise GGUFError(f"tensor {name}: data [{absoff}, {absoff + nbytes}) past end of file ({len(self._mm)})")
            self.tensors[name] = TensorInfo(name, shape, gt, absoff, nbytes)

    # --- access ------------------------------------------------------------------------------
    def get(self, key, default=KeyError):
        if key in self.kv:
            return self.kv[key]
        if default is KeyError:
            raise GGUFError(f"missing metadata key {key}")
        return default

    def raw(self, name: str) -> np.ndarray:
        """Read-only uint8 view of a tensor's bytes (no copy)."""
        ti = self._info(name)
        if ti.nbytes is None:
            raise GGUFError(f"tensor {name}: unknown ggml type {ti.ggml_type}")
        return np.frombuffer(self._mm, dtype=np.uint8, count=ti.nbytes, offset=ti.offset)

    def _info(self, name):
        if name not in self.tensors:
            raise GGUFError(f"missing tensor {name}")
        return self.tensors[name]

    def tensor(self, name: str) -> np.ndarray:
        """Decoded tensor in numpy order. F32/F16/F64/ints keep their dtype (read-only view);
        BF16 and Q8_0 come back as new float32 arrays."""
        ti = self._info(name)
        t = ti.ggml_type
        if t in _PLAIN_DTYPES:
            a = np.frombuffer(self._mm, dtype=np.dtype(_PLAIN_DTYPES[t]), count=ti.n_elements, offset=ti.offset)
            return a.reshape(ti.shape)
        if t == GGML_BF16:
            a = np.frombuffer(self._mm, dtype="<u2", count=ti.n_elements, offset=ti.offset)
            return bf16_to_f32(a).reshape(ti.shape)
        if t == GGML_Q8_0:
            return dequant_q8_0(self.raw(name), ti.shape)
        raise GGUFError(f"tensor {name}: type {ti.type_name} is not decoded by gguf_np")

    def tensor_f(self, name: str, dtype=np.float32) -> np.ndarray:
        """Tensor as a new float array of dtype (exact widening for F16/BF16/Q8_0 -> f32/f64)."""
        return np.array(self.tensor(name), dtype=dtype, copy=True)


def _fmt_value(v, limit=8):
    if isinstance(v, np.ndarray):
        body = ", ".join(str(x) for x in v[:limit].tolist())
        return f"[{body}{', ...' if v.size > limit else ''}] ({v.size})"
    if isinstance(v, list):
        body = ", ".join(repr(x) for x in v[:limit])
        return f"[{body}{', ...' if len(v) > limit else ''}] ({len(v)})"
    return repr(v)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Print a GGUF file's metadata and tensor directory.")
    ap.add_argument("file")
    ap.add_argument("--tensors", action="store_true", help="also list the tensors")
    a = ap.parse_args(argv)
    try:
        g = GGUFFile(a.file)
    except GGUFError as e:
        print(f"gguf_np.py: error: {e}", file=sys.stderr)
        return 1
    print(f"GGUF v{g.version}, {len(g.kv)} keys, {len(g.tensors)} tensors, alignment {g.alignment}, "
          f"data at {g.data_offset}")
    for k, v in g.kv.items():
        t = g.kv_types[k]
        tn = f"arr[{KV_TYPE_NAMES.get(t[1], t[1])}]" if isinstance(t, tuple) else KV_TYPE_NAMES.get(t, t)
        print(f"  {k} ({tn}) = {_fmt_value(v)}")
    if a.tensors:
        for ti in g.tensors.values():
            print(f"  {ti.name:48s} {ti.type_name:5s} ne={list(ti.ne)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
