#!/usr/bin/env python3
"""Write the F32 "twin" of a GGUF model: same metadata, every tensor dequantised by libggml.

    dequant_twin.py IN.gguf OUT.gguf [--oracle-dir build/oracle] [-q]

The twin is the oracle model for quantised files (tests/test_quant_oracle.py): llama.cpp's
CPU path multiplies quantised weights against 8-bit-quantised (or F16) activations, so on the
quantised file itself it is not a tight reference.  On the twin every matrix is F32 and
llama.cpp computes f32 activations times exactly the weights ds4 uses (ds4 dequantises
bit-for-bit like libggml, tests/oracle/quant_oracle.c).

- The file is parsed with llama.cpp's own gguf-py (DIR/gguf-py: GGUFReader).
- Every tensor that is not F32 or I32 is converted with libggml's own to_float:
  ggml_get_type_traits(type)->to_float from DIR/lib/libggml-base.so, called through ctypes
  (struct ggml_type_traits as declared in DIR/include/ggml.h of llama.cpp v0.4.0; its
  blck_size and type_size are checked against gguf-py's GGML_QUANT_SIZES before use).
  F32 and I32 tensors are copied as they are.
- The header, the key/value section (bytes copied verbatim, so every key and its type are
  unchanged, general.alignment included), the tensor order, names and shapes are kept; only
  the tensor types (-> F32) and data offsets change.

Module use (tests/oracle/requant.py shares the loaders and the writer):
    gguf = import_gguf(dir); lib = GGML(dir); lib.to_float(type, raw_bytes, n) -> np.float32
    write_gguf(path, reader, [(name, ggml_type, dims, bytes_like), ...])
"""
from __future__ import annotations

import argparse
import ctypes
import os
import struct
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ds4logit import np  # noqa: E402  (numpy, with ds4logit's fallback to Debian's python3-numpy)

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "build", "oracle")

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26


def die(msg: str) -> None:
    sys.exit(f"{os.path.basename(sys.argv[0]) or 'dequant_twin.py'}: error: {msg}")


def import_gguf(oracle_dir: str):
    gguf_py = os.path.join(oracle_dir, "gguf-py")
    if not os.path.isfile(os.path.join(gguf_py, "gguf", "__init__.py")):
        die(f"{gguf_py} is not a gguf-py checkout (run tests/oracle/fetch_llama.sh)")
    try:
        import yaml  # noqa: F401  (gguf.metadata imports it; unused here)
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    if os.path.abspath(gguf_py) not in sys.path:
        sys.path.insert(0, os.path.abspath(gguf_py))
    import gguf
    return gguf


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits, ggml.h (llama.cpp v0.4.0)
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class GGML:
    """The few libggml-base entry points the oracle tools use, through ctypes."""

    def __init__(self, oracle_dir: str = DEFAULT_DIR):
        path = os.path.join(oracle_dir, "lib", "libggml-base.so")
        if not os.path.exists(path):
            die(f"no {path} (run tests/oracle/fetch_llama.sh)")
        self.lib = ctypes.CDLL(path)
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p]
        self.lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        self.lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_init.restype = None
        self.lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        self.lib.ggml_quantize_free.restype = None
        self.lib.ggml_quantize_free.argtypes = []
        self._fn = {}

    def traits(self, ggml_type: int) -> _TypeTraits:
        return self.lib.ggml_get_type_traits(int(ggml_type)).contents

    def check_sizes(self, ggml_type: int, block: int, type_size: int) -> _TypeTraits:
        """Guard against a misread struct: libggml's block geometry must equal gguf-py's."""
        tr = self.traits(ggml_type)
        if tr.blck_size != block or tr.type_size != type_size:
            die(f"libggml type {ggml_type} ({tr.type_name!r}) is {tr.blck_size} elements / "
                f"{tr.type_size} bytes, gguf-py says {block} / {type_size}: struct layout mismatch?")
        return tr

    def to_float(self, ggml_type: int, raw, n: int) -> np.ndarray:
        """n floats from the raw blocks `raw` (bytes-like / uint8 array) by libggml's to_float."""
        fn = self._fn.get(ggml_type)
        if fn is None:
            tr = self.traits(ggml_type)
            if not tr.to_float:
                die(f"libggml has no to_float for type {ggml_type} ({tr.type_name!r})")
            fn = self._fn[ggml_type] = _TO_FLOAT(tr.to_float)
        src = np.ascontiguousarray(np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8))
        tr = self.traits(ggml_type)
        if n % tr.blck_size or src.nbytes != n // tr.blck_size * tr.type_size:
            die(f"to_float({tr.type_name.decode()}): {src.nbytes} bytes do not hold {n} elements")
        out = np.empty(n, dtype=np.float32)
        out[:] = np.float32(np.nan)   # poison: an unwritten element cannot pass
        fn(src.ctypes.data, out.ctypes.data, n)
        return out

    def quantize(self, ggml_type: int, x: np.ndarray, imatrix=None) -> bytes:
        """ggml_quantize_chunk over the rows of the 2-D float32 array x (one imatrix for all)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        nrows, n_per_row = x.shape
        tr = self.traits(ggml_type)
        row_bytes = n_per_row // tr.blck_size * tr.type_size
        dst = np.zeros(nrows * row_bytes, dtype=np.uint8)
        im = None
        if imatrix is not None:
            im = np.ascontiguousarray(imatrix, dtype=np.float32)
            assert im.shape == (n_per_row,)
        elif self.lib.ggml_quantize_requires_imatrix(int(ggml_type)):
            die(f"{tr.type_name.decode()} needs an importance matrix")
        self.lib.ggml_quantize_init(int(ggml_type))
        got = self.lib.ggml_quantize_chunk(int(ggml_type), x.ctypes.data, dst.ctypes.data, 0, nrows,
                                           n_per_row, None if im is None else im.ctypes.data)
        if got != dst.nbytes:
            die(f"ggml_quantize_chunk({tr.type_name.decode()}) wrote {got} bytes, expected {dst.nbytes}")
        return dst.tobytes()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def write_gguf(path: str, reader, tensors) -> None:
    """Write a GGUF v3 file with reader's header and key/value bytes and the given tensors.

    tensors: list of (name, ggml_type, dims (ne0 first, as in the file), data bytes-like), in
    the order to write.  Data offsets are laid out with the reader's alignment."""
    gguf = sys.modules["gguf"]
    raw = reader.data
    version = int(reader.fields["GGUF.version"].parts[0][0])
    kv_count = int(reader.fields["GGUF.kv_count"].parts[0][0])
    if reader.byte_order != "I" or version != 3:
        die("only little-endian GGUF v3 input is supported")
    # the key/value section: from the end of the 24-byte header to the first tensor info
    kv_start = 24
    kv_end = min(t.field.offset for t in reader.tensors) if reader.tensors else reader.data_offset
    align = int(reader.alignment)

    infos = bytearray()
    offsets = []
    off = 0
    for name, ggml_type, dims, data in tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        n = 1
        for d in dims:
            n *= int(d)
        nbytes = n // block * type_size
        if memoryview(data).nbytes != nbytes:
            die(f"{name}: {memoryview(data).nbytes} bytes of data, its type and shape need {nbytes}")
        nb = name.encode()
        infos += struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims))
        infos += struct.pack(f"<{len(dims)}Q", *[int(d) for d in dims])
        infos += struct.pack("<IQ", int(ggml_type), off)
        offsets.append(off)
        off = _align(off + nbytes, align)

    with open(path, "wb") as f:
        f.write(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(tensors), kv_count))
        f.write(bytes(raw[kv_start:kv_end]))
        f.write(infos)
        pos = f.tell()
        f.write(b"\0" * (_align(pos, align) - pos))
        base = f.tell()
        for (name, _, _, data), o in zip(tensors, offsets):
            pos = f.tell() - base
            f.write(b"\0" * (o - pos))
            f.write(memoryview(data).cast("B"))
        pos = f.tell() - base
        f.write(b"\0" * (_align(pos, align) - pos))


def twin(src: str, dst: str, oracle_dir: str = DEFAULT_DIR, quiet: bool = False) -> dict:
    gguf = import_gguf(oracle_dir)
    lib = GGML(oracle_dir)
    reader = gguf.GGUFReader(src)
    out = []
    counts: dict = {}
    for t in reader.tensors:
        ty = int(t.tensor_type)
        dims = [int(d) for d in t.shape.tolist()]
        name_ty = gguf.GGMLQuantizationType(ty).name
        counts[name_ty] = counts.get(name_ty, 0) + 1
        if ty in (GGML_TYPE_F32, GGML_TYPE_I32):
            out.append((t.name, ty, dims, np.ascontiguousarray(t.data)))
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ty)]
        lib.check_sizes(ty, block, type_size)
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        y = lib.to_float(ty, raw, t.n_elements)
        if not np.all(np.isfinite(y)):
            die(f"{t.name}: non-finite values after to_float")
        out.append((t.name, GGML_TYPE_F32, dims, y))
    write_gguf(dst, reader, out)
    if not quiet:
        conv = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"dequant_twin.py: wrote {dst}: {len(out)} tensors, all F32/I32 (from {conv})")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description="write the libggml-dequantised F32 twin of a GGUF model")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--oracle-dir", default=DEFAULT_DIR, help="build/oracle (lib/, gguf-py/)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args()
    twin(a.src, a.dst, a.oracle_dir, a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
