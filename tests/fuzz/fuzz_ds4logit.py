#!/usr/bin/env python3
"""fuzz_ds4logit.py -- a mutation loop over the DS4LOGIT reader (tests/oracle/ds4logit.py).

usage: fuzz_ds4logit.py [--quick] [--n N] [--seed S] [SEED_FILE]

Starts from a valid dump (default tests/fuzz/corpus/ds4logit/tiny-n4.ds4logit, written by
`./ds4 -n 4 -p Hi --dump-logits F`) and feeds N mutations of it to ds4logit.read() (and, when
read accepts one, to check() and is_greedy()). Mutations: bit flips, byte sets, header int32
fields set to edge values (0, -1, 1, INT32_MIN/MAX, the right value +-1, huge row counts),
truncation, extension, splices. Invariant: read either returns a Dump whose arrays have the
header's shapes, or raises ds4logit.FormatError or ValueError; any other exception (IndexError,
struct.error, MemoryError, numpy errors, ...) is a bug: the input is written to
build/fuzz/artifacts/ds4logit/ and the script exits 1. --quick: 3000 mutations (make test).
"""
import os, random, struct, sys, tempfile, time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))
import ds4logit  # noqa: E402

EDGE = [0, 1, -1, 2, 7, 512, 0x7FFFFFFF, -0x80000000, 0x10000, 0x40000000]


def mutate(rng, seed):
    b = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        k = rng.randrange(7)
        if k == 0 and b:                                   # bit flip
            i = rng.randrange(len(b)); b[i] ^= 1 << rng.randrange(8)
        elif k == 1 and b:                                 # random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif k == 2 and len(b) >= 32:                      # header field
            f = rng.randrange(6)
            old = struct.unpack_from("<i", b, 8 + 4 * f)[0]
            v = rng.choice(EDGE + [old + 1, old - 1, old * 2])
            struct.pack_into("<i", b, 8 + 4 * f, max(-0x80000000, min(0x7FFFFFFF, v)))
        elif k == 3:                                       # truncate
            del b[rng.randrange(len(b) + 1):]
        elif k == 4:                                       # extend
            b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 28, 2048])))
        elif k == 5 and len(b) >= 8:                       # magic
            b[rng.randrange(8)] = rng.randrange(256)
        elif k == 6 and len(b) >= 32:                      # consistent header, wrong body
            n_vocab, P, G = rng.choice(EDGE), rng.randrange(-2, 20), rng.randrange(-2, 20)
            struct.pack_into("<iiiii", b, 12, n_vocab, P, G, P + G, 0)
    return bytes(b)


def main():
    args = sys.argv[1:]
    n = 20000
    seed_rng = 1
    path = os.path.join(ROOT, "tests", "fuzz", "corpus", "ds4logit", "tiny-n4.ds4logit")
    while args:
        a = args.pop(0)
        if a == "--quick": n = 3000
        elif a == "--n": n = int(args.pop(0))
        elif a == "--seed": seed_rng = int(args.pop(0))
        else: path = a
    seed = open(path, "rb").read()
    d = ds4logit.read(path)                 # the seed itself must be valid
    assert not ds4logit.check(d, path), ds4logit.check(d, path)
    rng = random.Random(seed_rng)
    t0 = time.time()
    counts = {"accepted": 0, "FormatError": 0, "ValueError": 0}
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "m.ds4logit")
        for i in range(n):
            m = mutate(rng, seed)
            with open(f, "wb") as fh:
                fh.write(m)
            try:
                d = ds4logit.read(f)
                assert d.tokens.shape == (d.n_rows,) and d.argmax.shape == (d.n_rows,)
                assert d.logits.shape == (d.n_rows, d.n_vocab)
                ds4logit.check(d, f)
                ds4logit.is_greedy(d)
                counts["accepted"] += 1
            except ds4logit.FormatError:
                counts["FormatError"] += 1
            except ValueError:
                counts["ValueError"] += 1
            except BaseException as e:  # noqa: BLE001 -- anything else is the bug we look for
                if isinstance(e, KeyboardInterrupt): raise
                out = os.path.join(ROOT, "build", "fuzz", "artifacts", "ds4logit")
                os.makedirs(out, exist_ok=True)
                bad = os.path.join(out, f"crash-{i}")
                open(bad, "wb").write(m)
                print(f"fuzz_ds4logit: mutation {i}: {type(e).__name__}: {e}; input saved to {bad}")
                return 1
    print(f"fuzz-replay: fuzz_ds4logit: {n} mutations in {time.time() - t0:.1f} s, ok "
          f"({counts['accepted']} accepted, {counts['FormatError']} FormatError, {counts['ValueError']} ValueError)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
