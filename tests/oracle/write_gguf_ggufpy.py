#!/usr/bin/env python3
"""Write a random-weight DeepSeek V4 (`deepseek4`) GGUF with llama.cpp's own gguf-py.

This is the *independent* writer: key names, tensor names and the file layout come from
llama.cpp's gguf-py package (fetched by fetch_llama.sh into DIR/gguf-py), not from ds4.
Only numpy is needed besides that.

    python3 write_gguf_ggufpy.py --gguf-py build/oracle/gguf-py --seed 1 -o /tmp/other.gguf \
        [--config tiny|other]

All weights are F32 (ffn_gate_tid2eid is I32); tokenizer.ggml.model = "no_vocab" (raw ids).
The same (config, seed) always gives the same bytes: tensors are drawn from
numpy Generator(PCG64(seed)) in the order they are listed in `tensor_plan()`.
"""
from __future__ import annotations

import argparse
import os
import sys
import types


def import_numpy():
    try:
        import numpy  # noqa: F401
    except ImportError:
        # Debian's python3-numpy, when running under a different python3 of the same version.
        sys.path.append("/usr/lib/python3/dist-packages")
        try:
            import numpy  # noqa: F401
        except ImportError:
            sys.exit("write_gguf_ggufpy.py: error: numpy not found (apt-get install -y python3-numpy)")
    import numpy as np
    return np


def import_gguf(gguf_py: str):
    if not os.path.isfile(os.path.join(gguf_py, "gguf", "__init__.py")):
        sys.exit(f"write_gguf_ggufpy.py: error: {gguf_py} is not a gguf-py checkout (run fetch_llama.sh)")
    try:
        import yaml  # noqa: F401  (gguf.metadata imports it; we never use it)
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    sys.path.insert(0, os.path.abspath(gguf_py))
    import gguf
    return gguf


# ----------------------------------------------------------------------------------------------
# Configurations. "other" is the fixed acceptance model; do not change it.
CONFIGS = {
    "other": dict(
        vocab=384, n_embd=96, n_layer=5, compress_ratios=[0, 4, 128, 4, 0], hash_layers=1,
        n_head=4, head_dim=64, n_rot=16, q_lora=48, o_groups=2, o_lora=24, window=24,
        idx_heads=32, idx_dim=64, idx_topk=6,
        n_expert=6, n_expert_used=2, n_expert_shared=1, expert_ff=48,
        expert_weights_scale=1.5, expert_weights_norm=True, gating_func=4,
        swiglu_clamp_exp=10.0, swiglu_clamp_shexp=10.0,
        hc=4, hc_sinkhorn=20, hc_eps=1e-6, rms_eps=1e-6,
        rope_base=10000.0, compress_rope_base=160000.0,
        yarn_factor=4.0, yarn_orig_ctx=256, ctx_len=4096,
    ),
    "tiny": dict(
        vocab=256, n_embd=64, n_layer=4, compress_ratios=[0, 4, 128, 4], hash_layers=1,
        n_head=2, head_dim=64, n_rot=16, q_lora=32, o_groups=2, o_lora=16, window=16,
        idx_heads=32, idx_dim=64, idx_topk=4,
        n_expert=4, n_expert_used=2, n_expert_shared=1, expert_ff=32,
        expert_weights_scale=1.5, expert_weights_norm=True, gating_func=4,
        swiglu_clamp_exp=10.0, swiglu_clamp_shexp=10.0,
        hc=4, hc_sinkhorn=20, hc_eps=1e-6, rms_eps=1e-6,
        rope_base=10000.0, compress_rope_base=160000.0,
        yarn_factor=4.0, yarn_orig_ctx=256, ctx_len=4096,
    ),
}


def check_config(c: dict) -> None:
    def need(cond, msg):
        if not cond:
            sys.exit(f"write_gguf_ggufpy.py: error: bad config: {msg}")
    need(len(c["compress_ratios"]) >= c["n_layer"], "compress_ratios shorter than block_count")
    need(all(r in (0, 4, 128) for r in c["compress_ratios"]), "ratios must be 0, 4 or 128")
    need(4 in c["compress_ratios"][: c["n_layer"]], "llama.cpp needs at least one ratio-4 layer")
    need(c["idx_dim"] % 64 == 0, "indexer key_length must be a multiple of 64")
    need(c["hc"] == 4, "hyper_connection.count must be 4")
    need(c["idx_heads"] >= 32, "use >= 32 indexer heads (ties in the top-k otherwise)")
    need(c["n_head"] * c["head_dim"] % c["o_groups"] == 0, "n_head*head_dim must divide by output groups")
    need(c["n_rot"] <= c["head_dim"] and c["n_rot"] <= c["idx_dim"] and c["n_rot"] % 2 == 0, "bad rope dims")
    need(c["gating_func"] == 4, "llama.cpp only supports sqrt-softplus gating (4)")
    need(c["hash_layers"] <= c["n_layer"], "hash_layer_count > block_count")


def tensor_plan(c: dict):
    """Yield (name, ggml_ne, kind, param) in a fixed order.

    ggml_ne is ggml's shape (ne0 first); numpy gets the reverse. kind says how to draw it:
      mat   N(0, (param/sqrt(fan_in))^2) with fan_in = ne0
      norm  1 + 0.1 N
      gauss N(0, param^2)
      tid2eid  random distinct expert ids per token (I32)
    """
    D, V, H, d = c["n_embd"], c["vocab"], c["n_head"], c["head_dim"]
    q, g, r = c["q_lora"], c["o_groups"], c["o_lora"]
    E, k, f = c["n_expert"], c["n_expert_used"], c["expert_ff"] * c["n_expert_shared"]
    fe = c["expert_ff"]
    Hi, di, hc = c["idx_heads"], c["idx_dim"], c["hc"]
    mix = (2 + hc) * hc

    yield "token_embd.weight", (D, V), "gauss", 1.0
    yield "output_norm.weight", (D,), "norm", None
    yield "output.weight", (D, V), "mat", 1.0
    yield "output_hc_fn.weight", (hc * D, hc), "mat", 0.5
    yield "output_hc_base.weight", (hc,), "gauss", 0.5
    yield "output_hc_scale.weight", (1,), "scale", None
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        ratio = c["compress_ratios"][i]
        yield b + "attn_norm.weight", (D,), "norm", None
        yield b + "ffn_norm.weight", (D,), "norm", None
        yield b + "attn_sinks.weight", (H,), "gauss", 1.0
        yield b + "attn_q_a.weight", (D, q), "mat", 1.0
        yield b + "attn_q_a_norm.weight", (q,), "norm", None
        yield b + "attn_q_b.weight", (q, H * d), "mat", 1.0
        yield b + "attn_kv.weight", (D, d), "mat", 1.0
        yield b + "attn_kv_a_norm.weight", (d,), "norm", None
        yield b + "attn_output_a.weight", (H * d // g, g * r), "mat", 1.0
        yield b + "attn_output_b.weight", (g * r, D), "mat", 1.0
        for site in ("attn", "ffn"):
            yield b + f"hc_{site}_fn.weight", (hc * D, mix), "mat", 0.5
            yield b + f"hc_{site}_base.weight", (mix,), "gauss", 0.5
            yield b + f"hc_{site}_scale.weight", (3,), "scale", None
        if ratio:
            cf = 2 if ratio == 4 else 1
            yield b + "attn_compressor_kv.weight", (D, cf * d), "mat", 1.0
            yield b + "attn_compressor_gate.weight", (D, cf * d), "mat", 1.0
            yield b + "attn_compressor_ape.weight", (cf * d, ratio), "gauss", 0.5
            yield b + "attn_compressor_norm.weight", (d,), "norm", None
            if ratio == 4:
                yield b + "indexer.proj.weight", (D, Hi), "mat", 1.0
                yield b + "indexer.attn_q_b.weight", (q, Hi * di), "mat", 1.0
                yield b + "indexer_compressor_kv.weight", (D, 2 * di), "mat", 1.0
                yield b + "indexer_compressor_gate.weight", (D, 2 * di), "mat", 1.0
                yield b + "indexer_compressor_ape.weight", (2 * di, 4), "gauss", 0.5
                yield b + "indexer_compressor_norm.weight", (di,), "norm", None
        yield b + "ffn_gate_inp.weight", (D, E), "mat", 1.0
        if i < c["hash_layers"]:
            yield b + "ffn_gate_tid2eid.weight", (k, V), "tid2eid", None
        else:
            yield b + "exp_probs_b.bias", (E,), "gauss", 0.1
        # Expert gate/up pre-activations have std ~3 so the SwiGLU clamp (10) is sometimes
        # hit; down is scaled back so the MoE output stays O(1).
        yield b + "ffn_gate_exps.weight", (D, fe, E), "mat", 3.0
        yield b + "ffn_up_exps.weight", (D, fe, E), "mat", 3.0
        yield b + "ffn_down_exps.weight", (fe, D, E), "mat", 0.35
        yield b + "ffn_gate_shexp.weight", (D, f), "mat", 3.0
        yield b + "ffn_up_shexp.weight", (D, f), "mat", 3.0
        yield b + "ffn_down_shexp.weight", (f, D), "mat", 0.35


def draw(np, rng, ne, kind, param, c):
    shape = tuple(reversed(ne))  # numpy shape = reverse of ggml ne
    if kind == "mat":
        return (rng.standard_normal(shape) * (param / np.sqrt(ne[0]))).astype(np.float32)
    if kind == "gauss":
        return (rng.standard_normal(shape) * param).astype(np.float32)
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "scale":
        return (0.5 + rng.random(shape)).astype(np.float32)  # U(0.5, 1.5)
    if kind == "tid2eid":
        k, V = ne
        ids = np.stack([rng.permutation(c["n_expert"])[:k] for _ in range(V)])
        return ids.astype(np.int32)  # numpy (V, k)
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-py", required=True, help="llama.cpp gguf-py directory (fetch_llama.sh DIR/gguf-py)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    args = ap.parse_args()

    np = import_numpy()
    gguf = import_gguf(args.gguf_py)
    c = CONFIGS[args.config]
    check_config(c)

    arch_name = "deepseek4"
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    known = set()
    for t in gguf.MODEL_TENSORS[arch]:
        tmpl = gguf.TENSOR_NAMES[t]
        known.add(tmpl.replace("{bid}", "N") if "{bid}" in tmpl else tmpl)

    K = gguf.Keys
    A = arch_name

    def key(tmpl: str) -> str:
        return tmpl.format(arch=A)

    w = gguf.GGUFWriter(args.out, A)  # adds general.architecture
    w.add_custom_alignment(32)        # general.alignment (u32)
    w.add_string(K.General.NAME, f"ds4-oracle-{args.config}-seed{args.seed}")
    w.add_uint32(K.General.FILE_TYPE, 0)  # all F32
    w.add_string(K.Tokenizer.MODEL, "no_vocab")

    u32, f32 = w.add_uint32, w.add_float32
    u32(key(K.LLM.CONTEXT_LENGTH), c["ctx_len"])
    u32(key(K.LLM.EMBEDDING_LENGTH), c["n_embd"])
    u32(key(K.LLM.BLOCK_COUNT), c["n_layer"])
    u32(key(K.LLM.VOCAB_SIZE), c["vocab"])
    u32(key(K.Attention.HEAD_COUNT), c["n_head"])
    u32(key(K.Attention.HEAD_COUNT_KV), 1)
    u32(key(K.Attention.KEY_LENGTH), c["head_dim"])
    u32(key(K.Attention.VALUE_LENGTH), c["head_dim"])
    f32(key(K.Attention.LAYERNORM_RMS_EPS), c["rms_eps"])
    u32(key(K.Attention.Q_LORA_RANK), c["q_lora"])
    u32(key(K.Attention.SLIDING_WINDOW), c["window"])
    u32(key(K.Attention.OUTPUT_GROUP_COUNT), c["o_groups"])
    u32(key(K.Attention.OUTPUT_LORA_RANK), c["o_lora"])
    f32(key(K.Attention.COMPRESS_ROPE_FREQ_BASE), c["compress_rope_base"])
    w.add_key_value(key(K.Attention.COMPRESS_RATIOS), [int(x) for x in c["compress_ratios"]],
                    gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    u32(key(K.Attention.Indexer.HEAD_COUNT), c["idx_heads"])
    u32(key(K.Attention.Indexer.KEY_LENGTH), c["idx_dim"])
    u32(key(K.Attention.Indexer.TOP_K), c["idx_topk"])
    u32(key(K.Rope.DIMENSION_COUNT), c["n_rot"])
    f32(key(K.Rope.FREQ_BASE), c["rope_base"])
    w.add_string(key(K.Rope.SCALING_TYPE), gguf.RopeScalingType.YARN.value)
    f32(key(K.Rope.SCALING_FACTOR), c["yarn_factor"])
    u32(key(K.Rope.SCALING_ORIG_CTX_LEN), c["yarn_orig_ctx"])
    u32(key(K.LLM.EXPERT_COUNT), c["n_expert"])
    u32(key(K.LLM.EXPERT_USED_COUNT), c["n_expert_used"])
    u32(key(K.LLM.EXPERT_SHARED_COUNT), c["n_expert_shared"])
    u32(key(K.LLM.EXPERT_FEED_FORWARD_LENGTH), c["expert_ff"])
    f32(key(K.LLM.EXPERT_WEIGHTS_SCALE), c["expert_weights_scale"])
    w.add_bool(key(K.LLM.EXPERT_WEIGHTS_NORM), c["expert_weights_norm"])
    u32(key(K.LLM.EXPERT_GATING_FUNC), c["gating_func"])
    f32(key(K.LLM.SWIGLU_CLAMP_EXP), c["swiglu_clamp_exp"])
    f32(key(K.LLM.SWIGLU_CLAMP_SHEXP), c["swiglu_clamp_shexp"])
    u32(key(K.HyperConnection.COUNT), c["hc"])
    u32(key(K.HyperConnection.SINKHORN_ITERATIONS), c["hc_sinkhorn"])
    f32(key(K.HyperConnection.EPSILON), c["hc_eps"])
    u32(key(K.LLM.HASH_LAYER_COUNT), c["hash_layers"])

    rng = np.random.Generator(np.random.PCG64(args.seed))
    n_params = 0
    for name, ne, kind, param in tensor_plan(c):
        parts = name.split(".")
        generic = ".".join(["blk", "N"] + parts[2:-1]) if parts[0] == "blk" else ".".join(parts[:-1])
        if generic not in known:
            sys.exit(f"write_gguf_ggufpy.py: error: {name} is not a deepseek4 tensor in gguf-py")
        arr = draw(np, rng, ne, kind, param, c)
        assert tuple(reversed(arr.shape)) == tuple(ne), (name, arr.shape, ne)
        w.add_tensor(name, arr)
        n_params += arr.size

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"write_gguf_ggufpy.py: wrote {args.out} (config {args.config}, seed {args.seed}, "
          f"{n_params} params)")


if __name__ == "__main__":
    main()
