#!/usr/bin/env bash
# scripts/long_picks.sh [N] [THREADS] -- the lightning indexer's picks, position by position, behind
# the rows where ds4's CPU logits leave llama.cpp's on tiny-1m (scripts/long_oracle.sh).
#
# The same model and prompt as long_oracle.sh (tiny declared with a 1M context, N random tokens
# from random.Random(11), default 16384).  llama.cpp (llama_oracle --tensors) exports, for the two
# indexer layers (2 and 4), its indexer scores (lid_score_masked), its picks (lid_top_k, i32), the
# indexer's inputs (lid_q_rot, lid_weights, lid_k), the attention query (q), window rows (kv) and
# compressed rows (csa_comp_k), and every layer's attn_out; ds4 streams attn (every layer) and
# attn_probs (layers 2 and 4).  ds4's picks are read back from its attention weights:
# log p_slot - log p_sink = q.k_row/sqrt(d) - sink_h, the sinks from the window rows, each slot
# matched against every visible compressed row (llama.cpp keeps those Hadamard-rotated, so its q
# is rotated the same way).  Per position and layer: the relative gap (s8 - s9)/|s8| between
# llama.cpp's 8th and 9th scores, an f64 rescoring from llama.cpp's indexer inputs where that gap
# is < 1e-3, both engines' picks (as llama.cpp's ranks), and each run of logit rows that differ by
# more than 1e-3 traced to the latest differing pick.  Layer 2's inputs agree everywhere (layers
# 0-1 have no indexer); layer 4's only before the first layer-2 difference.
# Reuses the dumps under $OUT (FORCE=1 reruns both engines).  Needs the llama.cpp oracle (make
# test-py builds it) and numpy in $PY.  At N = 16384 on 2 cores: about 4 minutes of llama.cpp,
# 1 of ds4 and 1-2 of analysis; 1.3 GB under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-16384}
T=${2:-2}
PY=${PY:-/usr/bin/python3}
OUT=${OUT:-build/long-picks}
mkdir -p "$OUT"
ORACLE=build/oracle/bin/llama_oracle
[ -x "$ORACLE" ] || { echo "long_picks: $ORACLE missing (run make test-py once)"; exit 2; }
[ -x ./ds4 ] || make cpu > /dev/null
M=$OUT/tiny-1m.gguf
[ -f "$M" ] || ./ds4 synth --config tiny --ctx 1048576 --seed 1 --type f32 -o "$M" > /dev/null 2>&1
TOK=$($PY -c "import random; r=random.Random(11); print(','.join(str(r.randrange(512)) for _ in range($N)))")
if [ ! -f "$OUT/n$N.llama.llt" ] || [ "${FORCE:-0}" = 1 ]; then
  "$ORACLE" -m "$M" --tokens "$TOK" -n 0 -o "$OUT/n$N.llama.ds4logit" --threads "$T" \
      --tensors lid_score_masked,lid_top_k,lid_q_rot,lid_weights,lid_k,attn_out,q,kv,csa_comp_k --tensors-out "$OUT/n$N.llama.llt" 2>&1 | tail -1
fi
if [ ! -f "$OUT/n$N.ds4.ds4h" ] || [ "${FORCE:-0}" = 1 ]; then
  DS4_THREADS=$T DS4_HOOKS=attn,attn_probs:2,attn_probs:4 DS4_HOOKS_OUT="$OUT/n$N.ds4.ds4h" ./ds4 -m "$M" --backend cpu --tokens "$TOK" -n 0 \
      --dump-logits "$OUT/n$N.ds4.ds4logit" > /dev/null 2> "$OUT/n$N.ds4.log"
  grep '^speed' "$OUT/n$N.ds4.log"
fi
$PY - "$OUT/n$N" <<'EOF'
import struct, sys
import numpy as np
sys.path.insert(0, "tests/oracle"); sys.path.insert(0, "scripts")
import ds4logit, ds4hooks
pre = sys.argv[1]
K, THR = 8, 1e-4


def read_llt(path):
    """{name: array in numpy order (ne reversed)}; i32 for lid_top_k, f32 otherwise"""
    out = {}
    with open(path, "rb") as f:
        assert f.read(8) == b"LLTENSOR" and struct.unpack("<I", f.read(4))[0] == 1
        while True:
            h = f.read(4)
            if not h:
                break
            name = f.read(struct.unpack("<I", h)[0]).decode()
            f.read(4)
            ne = struct.unpack("<4q", f.read(32))
            nb = struct.unpack("<Q", f.read(8))[0]
            dt = np.int32 if name.startswith("lid_top_k") else np.float32
            a = np.frombuffer(f.read(nb), dtype=dt).reshape(ne[::-1])
            assert name not in out, f"{name} twice (more than one ubatch?)"
            out[name] = a
    return out


L = read_llt(pre + ".llama.llt")
H = ds4hooks.read(pre + ".ds4.ds4h").arrays()
a, b = ds4logit.read(pre + ".ds4.ds4logit"), ds4logit.read(pre + ".llama.ds4logit")
dl = np.abs(a.logits.astype(np.float64) - b.logits).max(axis=1)
n = len(dl)
dattn = {}
for il in range(6):
    pos, v = H[("attn", il)]
    assert (pos == np.arange(n)).all()
    dattn[il] = np.abs(v.astype(np.float64) - L[f"attn_out-{il}"].reshape(n, -1)).max(axis=1)
print("max |ds4 attn - llama.cpp attn_out| per layer: " +
      ", ".join(f"L{il} {dattn[il].max():.2g}" for il in range(6)))
bad = dl > 1e-3
runs = []
for t in np.nonzero(bad)[0]:
    if runs and t <= runs[-1][1] + 1:
        runs[-1][1] = t
    else:
        runs.append([t, t])
print(f"logits: {int(bad.sum())} of {n} rows differ by more than 1e-3, in {len(runs)} runs "
      f"(max |dlogit| elsewhere {dl[~bad].max():.2g})")

res = {}
for il in (2, 4):
    S = L[f"lid_score_masked-{il}"].reshape(n, -1)           # [n, n_kv], -inf where not visible
    top = L[f"lid_top_k-{il}"].reshape(n, K)
    qi, wi, ki = (L[f"lid_q_rot-{il}"].reshape(n, -1, L[f"lid_q_rot-{il}"].shape[-1]),
                  L[f"lid_weights-{il}"].reshape(n, -1), L[f"lid_k-{il}"].reshape(-1, L[f"lid_k-{il}"].shape[-1]))
    q = L[f"q-{il}"].reshape(n, -1, L[f"q-{il}"].shape[-1])    # [n, H, d] attention queries
    ck = L[f"csa_comp_k-{il}"].reshape(-1, q.shape[-1])         # [n_comp, d] compressed rows
    nvis = np.isfinite(S).sum(axis=1)
    picks = nvis > K
    order = np.argsort(-S, axis=1, kind="stable")[:, :K + 1]     # llama.cpp's ranking, ties to the lower row
    s8 = np.take_along_axis(S, order[:, K - 1:K], 1)[:, 0].astype(np.float64)
    s9 = np.take_along_axis(S, order[:, K:K + 1], 1)[:, 0].astype(np.float64)
    with np.errstate(invalid="ignore"):
        gap = np.where(picks, (s8 - s9) / np.maximum(np.abs(s8), 1e-30), np.inf)
    own_ok = (np.sort(order[:, :K], 1) == np.sort(top, 1)).all(1) | ~picks
    # ds4's picks, read back from its attention weights (attn_probs: the window rows, the 8 pick
    # slots, the sink): log p_row - log p_sink = q_h.k_row / sqrt(d) - sink_h.  The window rows
    # (llama.cpp's kv) give sink_h; llama.cpp keeps the compressed rows Hadamard-rotated
    # (csa_state_compress_rot), so its query is rotated the same way for them.
    kv = L[f"kv-{il}"].reshape(n, -1)
    dh = q.shape[-1]
    had = np.array([[1.0]])
    while had.shape[0] < dh:
        had = np.block([[had, had], [had, -had]])
    had /= np.sqrt(dh)
    ppos, plist = H[("attn_probs", il)]
    assert (ppos == np.arange(n)).all()
    scale = 1.0 / np.sqrt(dh)
    W = 32
    cand = np.nonzero(picks)[0]          # every position that picks 8 of more rows
    ds4p, margin, resid, rpos = {}, [], [], []
    for t in cand:
        p = plist[t].astype(np.float64)
        nw = p.shape[1] - K - 1
        with np.errstate(divide="ignore"):
            z = np.log(p[:, :-1]) - np.log(p[:, -1:])                                   # [H, nw + K]
        qt = q[t].astype(np.float64)
        sink = (scale * (qt @ kv[t - nw + 1:t + 1].T.astype(np.float64)) - z[:, :nw]).mean(1)
        u = scale * ((qt @ had) @ ck[:nvis[t]].T.astype(np.float64))                  # [H, nvis]
        zz = (z[:, nw:] + sink[:, None]).T                                             # [K, H]
        d2 = np.maximum((zz ** 2).sum(1)[:, None] + (u ** 2).sum(0)[None] - 2 * zz @ u, 0)  # [K, nvis]
        srt = np.sort(d2, 1)
        ds4p[t] = np.argmin(d2, 1)
        margin.append(np.sqrt(srt[:, 1]).min()); resid.append(np.sqrt(srt[:, 0]).max())
        rpos.append(t)
    print(f"layer {il}: {int(picks.sum())} positions pick 8 of more rows; lid_top_k = the top 8 of lid_score_masked at "
          f"{int(own_ok.sum())}/{n}; 8th/9th relative gap < 1e-5 at {int((gap < 1e-5).sum())}, < 1e-4 at "
          f"{int((gap < 1e-4).sum())}, < 1e-3 at {int((gap < 1e-3).sum())}")
    print(f"  ds4's picks read back from its attention weights at {len(ds4p)} positions (match residual <= "
          f"{max(resid):.2g}, next row >= {min(margin):.2g} away)")
    resid, rpos = np.array(resid), np.array(rpos)
    print("  that residual (ds4's attention logits q.k/sqrt(d) against llama.cpp's, 8 heads), median by position: " +
          ", ".join(f"{lo}..{min(n, lo + 4096) - 1} {np.median(resid[(rpos >= lo) & (rpos < lo + 4096)]):.2g}"
                    for lo in range(0, n, 4096)))
    # the same scores in f64 from llama.cpp's own indexer inputs, where the 8th/9th gap is small
    f64, err = {}, []
    for t in np.nonzero(gap < 1e-3)[0]:
        qk = qi[t].astype(np.float64) @ ki[:nvis[t]].T.astype(np.float64)                # [Hi, nvis]
        s64 = (np.maximum(qk, 0) * wi[t].astype(np.float64)[:, None]).sum(0)
        f64[t] = set(np.argsort(-s64, kind="stable")[:K].tolist())
        r89 = order[t, K - 1:K + 1]
        err.extend(np.abs(S[t, r89] - s64[r89]) / np.abs(s64[r89]))
    print(f"  llama.cpp's f32 scores of the 8th and 9th rows there against f64: relative error median "
          f"{np.median(err):.2g}, max {np.max(err):.2g}")
    print(f"  f64 rescoring from llama.cpp's indexer inputs at the {len(f64)} positions with gap < 1e-3: the same "
          f"8 rows as lid_top_k at {sum(f64[t] == set(top[t].tolist()) for t in f64)}, as ds4 at "
          f"{sum(f64[t] == set(ds4p[t].tolist()) for t in f64)}")
    diff = []
    for t in cand:
        dd, ll = set(ds4p[t].tolist()), set(top[t].tolist())
        if dd != ll:
            rank = {int(r): i + 1 for i, r in enumerate(np.argsort(-S[t], kind="stable")[:nvis[t]])}
            diff.append((int(t), sorted(rank[r] for r in ll - dd), sorted(rank[r] for r in dd - ll)))
    res[il] = dict(gap=gap, diff=diff, picks=picks)

# where the inputs of a layer still agree: layer 2 always (layers 0-1 have no indexer); layer 4 before
# the first position whose layer-2 pick differs (it changes that position's stream from layer 2 on)
first2 = min([t for t, _, _ in res[2]["diff"]], default=n)
for il in (2, 4):
    gap, diff, picks = res[il]["gap"], res[il]["diff"], res[il]["picks"]
    clean = np.arange(n) < (n if il == 2 else first2)
    dset = {t for t, _, _ in diff}
    cd = [x for x in diff if clean[x[0]]]
    agree = picks & clean & ~np.isin(np.arange(n), list(dset))
    print(f"layer {il}, positions {'0' if True else ''}..{(n if il == 2 else first2) - 1} (inputs agree): "
          f"{len(cd)} picks differ:")
    for t, lr, dr in cd:
        print(f"  pos {t}: llama.cpp's rank {lr} row -> ds4's rank-{dr} row (by llama.cpp's scores), gap {gap[t]:.2g}, "
              f"|dlogit| {dl[t]:.2g}")
    print(f"  largest gap where the picks differ: {max([gap[t] for t, _, _ in cd], default=float('nan')):.2g}; "
          f"smallest gap where they agree: {gap[agree].min():.2g}; "
          f"agreeing positions with gap below the largest differing one: "
          f"{int((gap[agree] <= max([gap[t] for t, _, _ in cd], default=0)).sum())}")
    od = [x for x in diff if not clean[x[0]]]
    if od:
        print(f"  after position {first2} (layer-4 inputs perturbed by that layer-2 difference): {len(od)} picks differ: " +
              "; ".join(f"{t} (ranks {lr}->{dr}, gap {gap[t]:.2g})" for t, lr, dr in od[:30]))
flips = sorted([(t, il) for il in (2, 4) for t, _, _ in res[il]["diff"]])
print("runs of differing logit rows: start..end (max |dlogit|) <- the latest differing pick at or before the start")
for s, e in runs:
    prev = [t for t, il in flips if t <= s]
    src = (f"{'+'.join(f'L{il}' for t, il in flips if t == prev[-1])} pick at {prev[-1]} ({s - prev[-1]} rows before)"
           if prev else "none")
    print(f"  {s}..{e} ({dl[s:e + 1].max():.2g}) <- {src}")
first = min([t for t, _ in flips], default=n)
print(f"first differing pick: {first}; rows before it: max |dlogit| {dl[:first].max():.2g}")
EOF
