#!/usr/bin/env python3
"""HF transformers oracle for ds4: DeepSeek V4 logits from a `deepseek4` GGUF, teacher-forced.

    python3 tests/oracle/hf_oracle.py -m MODEL.gguf --tokens-from REF.ds4logit -o OUT.ds4logit \
        [--device cuda|cpu] [--dtype float64|float32] [--mode incremental|full|both]
    python3 tests/oracle/hf_oracle.py --self-test                 (numpy only)
    python3 tests/oracle/hf_oracle.py --check-mapping MODEL.gguf  (numpy only)
    python3 tests/oracle/hf_oracle.py --print-mapping             (numpy only)

What it does
  1. Reads the GGUF with gguf_np.py (pure numpy, next to this file).
  2. Builds a transformers DeepseekV4Config from the deepseek4.* keys (only fields the installed
     config class accepts; dropped ones are printed) and a DeepseekV4ForCausalLM, then copies
     every GGUF tensor into it with the inverse of llama.cpp's converter mapping (see
     `print_mapping`). Every HF state-dict key must be filled with the right shape and every GGUF
     tensor of the main layers must be used, or it stops with a listing.
  3. Takes the token sequence (n_rows = P + G tokens) from the DS4LOGIT file REF and computes the
     logits of every row, teacher-forced on those tokens:
       --mode incremental (default): one forward over the P prompt tokens, then one forward per
           later token through the model's own cache (DeepseekV4 HCA/CSA cache layers, which carry
           the compressor/indexer buffers, overlap state and compressed rows) - prefill + decode,
           like the engine;
       --mode full: one causal forward over all n_rows tokens, no cache;
       --mode both: both; writes the incremental logits and prints max |full - incremental|.
  4. --dtype float64 (default) keeps the *whole* computation in float64. `model.double()` alone is
     not enough: the module casts to float32 internally (RMSNorm, unweighted RMSNorm, RoPE tables
     and rotation, mHC and the output head, compressor/indexer softmax, indexer scores, RoPE
     inv_freq at init). A torch function mode (F64Mode below) is active while the model is built
     and during every forward; it rewrites
        Tensor.float() / .half() / .bfloat16()        -> .to(float64)
        Tensor.to(float32|float16|bfloat16) / .type() -> float64
        any dtype=float32|float16|bfloat16 keyword    -> float64   (softmax, arange, zeros, ...)
     with torch's default dtype float64, and checks that no torch call in the forward returns a
     float32/16/bf16 tensor (any such leak is an error). The counts of rewrites are printed.
     Attention runs with attn_implementation="eager" and the MoE experts with the "eager" experts
     implementation (no SDPA/flash/grouped_mm kernels); TF32 matmuls are disabled.
  5. Writes OUT in the DS4LOGIT format (same tokens as REF) and prints max |dlogit| vs REF and the
     number of argmax disagreements.

Needs: python3, numpy, torch, transformers with models.deepseek_v4 (5.17 was the target). No
network, no gguf package. Errors: one line on stderr (after any listing), exit status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds4logit  # noqa: E402
import gguf_np  # noqa: E402
from ds4logit import np  # noqa: E402  (numpy, with ds4logit's fallback to Debian's python3-numpy)

PROG = "hf_oracle.py"


class OracleError(Exception):
    pass


def note(msg: str = "") -> None:
    print(f"{PROG}: {msg}" if msg else "", flush=True)


def fail_listing(title: str, lines: list[str], limit: int = 60) -> None:
    """Print a listing (several lines) before the one-line error that follows it."""
    print(f"{PROG}: {title}:", file=sys.stderr)
    for s in lines[:limit]:
        print(f"{PROG}:   {s}", file=sys.stderr)
    if len(lines) > limit:
        print(f"{PROG}:   ... and {len(lines) - limit} more", file=sys.stderr)


# =================================================================================================
# DS4LOGIT files (ds4logit.py), their failures as OracleError
# =================================================================================================
def read_ds4logit(path: str) -> ds4logit.Dump:
    try:
        return ds4logit.read(path)
    except OSError as e:
        raise OracleError(f"cannot read {path}: {e.strerror}") from None
    except ds4logit.FormatError as e:
        raise OracleError(str(e)) from None


def write_ds4logit(path: str, n_prompt: int, tokens, logits32: np.ndarray) -> np.ndarray:
    """Write logits (float32 [n_rows, n_vocab]) by way of PATH.tmp; returns the argmax written (of
    the f32 values)."""
    logits32 = np.ascontiguousarray(logits32, dtype="<f4")
    argmax = np.argmax(logits32, axis=1).astype("<i4") if logits32.shape[0] else np.zeros(0, "<i4")
    tmp = path + ".tmp"
    try:
        ds4logit.write(tmp, n_prompt, tokens, logits32, argmax)
    except ValueError:
        raise OracleError("write_ds4logit: tokens/rows/prompt length mismatch") from None
    os.replace(tmp, path)
    return argmax


# =================================================================================================
# GGUF deepseek4 keys -> hyper-parameters
# =================================================================================================
ARCH = "deepseek4"
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}


def _per_layer(v, n_all: int, what: str) -> list:
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, list):
        if len(v) < n_all:
            raise OracleError(f"{what}: array of {len(v)} < block_count {n_all}")
        return v[:n_all]
    return [v] * n_all


def read_hparams(g: gguf_np.GGUFFile) -> dict:
    arch = g.get("general.architecture", None)
    if arch != ARCH:
        raise OracleError(f"general.architecture is {arch!r}, expected {ARCH!r}")
    missing = []

    def k(name, default=KeyError):
        key = f"{ARCH}.{name}"
        if key in g.kv:
            return g.kv[key]
        if default is KeyError:
            missing.append(key)
            return None
        return default

    hp: dict = {}
    n_all = k("block_count")
    if n_all is None:
        raise OracleError(f"missing metadata key {ARCH}.block_count")
    n_all = int(n_all)
    nextn = int(k("nextn_predict_layers", 0))
    n_layer = n_all
    # like llama.cpp: MTP blocks count only when their eh_proj is really there
    if nextn > 0 and f"blk.{n_all - nextn}.nextn.eh_proj.weight" in g.tensors:
        n_layer = n_all - nextn
    hp["n_layer_all"], hp["n_layer"] = n_all, n_layer

    emb = g.tensors.get("token_embd.weight")
    vocab = k("vocab_size", None)
    if vocab is None:
        if emb is None:
            raise OracleError("no vocab_size key and no token_embd.weight")
        vocab = emb.shape[0]
    hp["n_vocab"] = int(vocab)
    if emb is not None and emb.shape[0] != hp["n_vocab"]:
        raise OracleError(f"vocab_size {hp['n_vocab']} != token_embd rows {emb.shape[0]}")

    hp["n_ctx_train"] = int(k("context_length", 0) or 0)
    hp["n_embd"] = k("embedding_length")
    hp["n_head"] = k("attention.head_count")
    hp["n_head_kv"] = k("attention.head_count_kv", 1)
    hp["head_dim"] = k("attention.key_length")
    hp["head_dim_v"] = k("attention.value_length", hp["head_dim"])
    hp["rms_eps"] = k("attention.layer_norm_rms_epsilon")
    hp["q_lora"] = k("attention.q_lora_rank")
    hp["window"] = k("attention.sliding_window")
    hp["o_groups"] = k("attention.output_group_count")
    hp["o_lora"] = k("attention.output_lora_rank")
    hp["compress_rope_base"] = k("attention.compress_rope_freq_base")
    ratios = k("attention.compress_ratios")
    hp["idx_heads"] = k("attention.indexer.head_count")
    hp["idx_dim"] = k("attention.indexer.key_length")
    hp["idx_topk"] = k("attention.indexer.top_k")
    hp["n_rot"] = k("rope.dimension_count")
    hp["rope_base"] = k("rope.freq_base", 10000.0)
    hp["n_expert"] = k("expert_count")
    hp["n_expert_used"] = k("expert_used_count")
    hp["n_expert_shared"] = k("expert_shared_count", 1)
    ff = k("expert_feed_forward_length")
    hp["expert_weights_scale"] = k("expert_weights_scale", 1.0)
    hp["expert_weights_norm"] = bool(k("expert_weights_norm", True))
    gating = k("expert_gating_func", None)
    clamp_exp = k("swiglu_clamp_exp", None)
    clamp_shexp = k("swiglu_clamp_shexp", None)
    hp["hc"] = k("hyper_connection.count")
    hp["hc_iters"] = k("hyper_connection.sinkhorn_iterations")
    hp["hc_eps"] = k("hyper_connection.epsilon")
    hp["hash_layers"] = int(k("hash_layer_count", 0))
    if missing:
        raise OracleError("missing GGUF keys: " + ", ".join(missing))

    for name in ("n_embd", "n_head", "n_head_kv", "head_dim", "head_dim_v", "q_lora", "window", "o_groups",
                 "o_lora", "idx_heads", "idx_dim", "idx_topk", "n_rot", "n_expert", "n_expert_used",
                 "n_expert_shared", "hc", "hc_iters"):
        hp[name] = int(hp[name])
    for name in ("rms_eps", "compress_rope_base", "rope_base", "expert_weights_scale", "hc_eps"):
        hp[name] = float(hp[name])

    hp["compress_ratios"] = [int(r) for r in _per_layer(ratios, n_all, "compress_ratios")][:n_layer]
    ffl = sorted(set(int(x) for x in _per_layer(ff, n_all, "expert_feed_forward_length")[:n_layer]))
    if len(ffl) != 1:
        raise OracleError(f"per-layer expert_feed_forward_length {ffl}: HF has one moe_intermediate_size")
    hp["expert_ff"] = ffl[0]
    hp["gating_func"] = int(gating) if gating is not None else 4
    if clamp_exp is None:
        clamp_exp = 0.0
    hp["clamp_exp"] = [float(x) for x in _per_layer(clamp_exp, n_all, "swiglu_clamp_exp")[:n_layer]]
    if clamp_shexp is None:
        hp["clamp_shexp"] = list(hp["clamp_exp"])
    else:
        hp["clamp_shexp"] = [float(x) for x in _per_layer(clamp_shexp, n_all, "swiglu_clamp_shexp")[:n_layer]]

    st = k("rope.scaling.type", "none")
    st = str(st).lower() if st is not None else "none"
    rs = {"type": st}
    if st == "yarn":
        factor = k("rope.scaling.factor")
        orig = k("rope.scaling.original_context_length")
        if missing:
            raise OracleError("missing GGUF keys: " + ", ".join(missing))
        rs["factor"] = float(factor)
        rs["orig_ctx"] = int(orig)
        rs["beta_fast"] = float(k("rope.scaling.yarn_beta_fast", 32.0))
        rs["beta_slow"] = float(k("rope.scaling.yarn_beta_slow", 1.0))
        rs["ext_factor"] = k("rope.scaling.yarn_ext_factor", None)
        rs["attn_factor"] = k("rope.scaling.yarn_attn_factor", None)
    elif st not in ("none", ""):
        raise OracleError(f"rope.scaling.type {st!r} is not supported (HF V4 knows default and yarn)")
    hp["rope_scaling"] = rs
    hp["tokenizer_model"] = g.kv.get("tokenizer.ggml.model")
    return hp


def check_hparams_for_hf(hp: dict) -> list[str]:
    """Raise for what HF's DeepSeek V4 module cannot express; return warnings."""
    warn = []
    errs = []
    if hp["n_head_kv"] != 1:
        errs.append(f"head_count_kv {hp['n_head_kv']} (HF V4 is single-KV-head MQA)")
    if hp["head_dim_v"] != hp["head_dim"]:
        errs.append(f"value_length {hp['head_dim_v']} != key_length {hp['head_dim']}")
    if hp["n_expert_shared"] != 1:
        errs.append(f"expert_shared_count {hp['n_expert_shared']} (HF V4 has exactly one shared expert)")
    if hp["gating_func"] not in GATING_FUNCS:
        errs.append(f"expert_gating_func {hp['gating_func']} unknown")
    if not hp["expert_weights_norm"]:
        errs.append("expert_weights_norm false (HF V4 always normalises the routed weights)")
    cl = sorted(set(hp["clamp_exp"]) | set(hp["clamp_shexp"]))
    if len(cl) != 1:
        errs.append(f"swiglu clamps {cl}: HF V4 has one swiglu_limit for routed and shared experts")
    elif cl[0] <= 0:
        errs.append(f"swiglu clamp {cl[0]} (HF V4 always clamps)")
    bad = sorted(set(r for r in hp["compress_ratios"] if r not in (0, 4)))
    if len(bad) > 1:
        errs.append(f"several non-4 compress ratios {bad}: HF V4 has one HCA rate")
    if hp["hash_layers"] > hp["n_layer"]:
        errs.append(f"hash_layer_count {hp['hash_layers']} > block_count {hp['n_layer']}")
    if hp["n_rot"] % 2 or hp["n_rot"] > hp["head_dim"] or hp["n_rot"] > hp["idx_dim"]:
        errs.append(f"rope.dimension_count {hp['n_rot']} vs head_dim {hp['head_dim']} / indexer {hp['idx_dim']}")
    prf = hp["n_rot"] / hp["head_dim"]
    if int(hp["head_dim"] * prf) != hp["n_rot"]:
        errs.append(f"partial_rotary_factor {prf!r} does not give back {hp['n_rot']} rope dims in HF's int()")
    if (hp["n_head"] * hp["head_dim"]) % hp["o_groups"]:
        errs.append("n_head*head_dim not divisible by output_group_count")
    if errs:
        raise OracleError("GGUF model not expressible in HF DeepseekV4: " + "; ".join(errs))
    rs = hp["rope_scaling"]
    if rs["type"] == "yarn":
        if rs.get("ext_factor") is not None and float(rs["ext_factor"]) != 1.0:
            warn.append(f"rope.scaling.yarn_ext_factor {rs['ext_factor']} ignored (HF YaRN has no ext_factor; "
                        "llama.cpp uses it as the ramp weight)")
        if rs.get("attn_factor") is not None:
            warn.append(f"rope.scaling.yarn_attn_factor {rs['attn_factor']} ignored (HF V4 forces "
                        "attention_factor=1.0; llama.cpp deepseek4 cancels the YaRN magnitude scale)")
        if hp["n_ctx_train"] and hp["n_ctx_train"] != round(rs["factor"] * rs["orig_ctx"]):
            warn.append(f"context_length {hp['n_ctx_train']} != factor*original_context_length "
                        f"{round(rs['factor'] * rs['orig_ctx'])}; HF gets max_position_embeddings = the latter "
                        "(some HF versions derive the YaRN factor from that ratio)")
    if hp["tokenizer_model"] not in (None, "no_vocab"):
        warn.append(f"tokenizer.ggml.model is {hp['tokenizer_model']!r}; token ids are used as-is")
    return warn


# =================================================================================================
# hyper-parameters -> DeepseekV4Config keyword arguments
# =================================================================================================
LT_SLIDING, LT_CSA, LT_HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def layer_type_of(ratio: int) -> str:
    return LT_SLIDING if ratio == 0 else (LT_CSA if ratio == 4 else LT_HCA)


def rope_parameters_for(hp: dict) -> dict:
    prf = hp["n_rot"] / hp["head_dim"]
    main = {"rope_type": "default", "rope_theta": hp["rope_base"], "partial_rotary_factor": prf}
    rs = hp["rope_scaling"]
    if rs["type"] == "yarn":
        comp = {"rope_type": "yarn", "rope_theta": hp["compress_rope_base"], "partial_rotary_factor": prf,
                "factor": rs["factor"], "original_max_position_embeddings": rs["orig_ctx"],
                "beta_fast": rs["beta_fast"], "beta_slow": rs["beta_slow"], "attention_factor": 1.0}
    else:
        comp = {"rope_type": "default", "rope_theta": hp["compress_rope_base"], "partial_rotary_factor": prf}
    return {"main": main, "compress": comp}


def hf_config_kwargs(hp: dict) -> dict:
    ratios = hp["compress_ratios"]
    hca = sorted(set(r for r in ratios if r not in (0, 4)))
    rs = hp["rope_scaling"]
    max_pos = round(rs["factor"] * rs["orig_ctx"]) if rs["type"] == "yarn" else (hp["n_ctx_train"] or 4096)
    n = hp["n_layer"]
    return dict(
        vocab_size=hp["n_vocab"],
        hidden_size=hp["n_embd"],
        moe_intermediate_size=hp["expert_ff"],
        num_hidden_layers=n,
        num_attention_heads=hp["n_head"],
        num_key_value_heads=1,
        head_dim=hp["head_dim"],
        q_lora_rank=hp["q_lora"],
        num_experts_per_tok=hp["n_expert_used"],
        n_routed_experts=hp["n_expert"],
        n_shared_experts=hp["n_expert_shared"],
        scoring_func=GATING_FUNCS[hp["gating_func"]],
        norm_topk_prob=True,
        routed_scaling_factor=hp["expert_weights_scale"],
        max_position_embeddings=int(max_pos),
        rope_theta=hp["rope_base"],
        layer_types=[layer_type_of(r) for r in ratios],
        compress_rates={LT_CSA: 4, LT_HCA: hca[0] if hca else 128},
        compress_rope_theta=hp["compress_rope_base"],
        hc_mult=hp["hc"],
        hc_sinkhorn_iters=hp["hc_iters"],
        hc_eps=hp["hc_eps"],
        mlp_layer_types=["hash_moe"] * hp["hash_layers"] + ["moe"] * (n - hp["hash_layers"]),
        swiglu_limit=hp["clamp_exp"][0],
        sliding_window=hp["window"],
        o_groups=hp["o_groups"],
        o_lora_rank=hp["o_lora"],
        index_n_heads=hp["idx_heads"],
        index_head_dim=hp["idx_dim"],
        index_topk=hp["idx_topk"],
        num_nextn_predict_layers=0,
        hidden_act="silu",
        rms_norm_eps=hp["rms_eps"],
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters=rope_parameters_for(hp),
        partial_rotary_factor=hp["n_rot"] / hp["head_dim"],
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=None,
    )


def legacy_alternatives(want: dict, hp: dict) -> dict:
    """Older DeepseekV4Config spellings of some fields: field -> {legacy name: value}."""
    return {
        "layer_types": {"compress_ratios": list(hp["compress_ratios"])},
        "mlp_layer_types": {"num_hash_layers": hp["hash_layers"]},
        "compress_rates": {"compress_rate_csa": 4, "compress_rate_hca": want["compress_rates"][LT_HCA]},
        "partial_rotary_factor": {"qk_rope_head_dim": hp["n_rot"]},
        "n_routed_experts": {"num_local_experts": hp["n_expert"]},
        "moe_intermediate_size": {"intermediate_size": hp["expert_ff"]},
    }


def filter_config_kwargs(cfg_cls, want: dict, hp: dict):
    """Keep the keyword arguments the installed config class accepts. Returns (kwargs, notes)."""
    import dataclasses
    import inspect
    accepted = set()
    if dataclasses.is_dataclass(cfg_cls):
        accepted |= {f.name for f in dataclasses.fields(cfg_cls) if f.init}
    has_var_kw = False
    try:
        sig = inspect.signature(cfg_cls.__init__)
        for name, p in sig.parameters.items():
            if name == "self":
                continue
            if p.kind == p.VAR_KEYWORD:
                has_var_kw = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                accepted.add(name)
    except (TypeError, ValueError):
        has_var_kw = True
    out, notes = {}, []
    alts = legacy_alternatives(want, hp)
    for key, val in want.items():
        if key in accepted:
            out[key] = val
            continue
        alt = alts.get(key, {})
        if alt and (has_var_kw or all(a in accepted for a in alt)):
            out.update(alt)
            notes.append(f"dropped {key} (not a field of {cfg_cls.__name__}); passed legacy "
                         + ", ".join(f"{a}={v!r}" for a, v in alt.items()))
        else:
            notes.append(f"dropped {key}={val!r} (not a field of {cfg_cls.__name__})")
    return out, notes


def verify_config(cfg, want: dict, hp: dict, notes: list) -> list[str]:
    """Compare what the config object ended up with against what the GGUF says. Attributes the
    config does not have at all go to notes (the state-dict and RoPE checks still apply)."""
    bad = []

    def same(a, b):
        if isinstance(b, float) or isinstance(a, float):
            try:
                return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
            except (TypeError, ValueError):
                return False
        return a == b

    def check(attr, expect, *alts):
        for name in (attr,) + alts:
            if hasattr(cfg, name):
                got = getattr(cfg, name)
                if isinstance(got, tuple):
                    got = list(got)
                if not same(got, expect):
                    bad.append(f"config.{name} = {got!r}, GGUF says {expect!r}")
                return
        notes.append(f"config has no attribute {attr} (GGUF value {expect!r} not checked)")

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "num_experts_per_tok", "routed_scaling_factor", "rope_theta",
                "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit",
                "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                "rms_norm_eps", "scoring_func", "layer_types", "mlp_layer_types"):
        check(key, want[key])
    check("n_routed_experts", hp["n_expert"], "num_local_experts")
    check("moe_intermediate_size", hp["expert_ff"], "intermediate_size")
    if getattr(cfg, "tie_word_embeddings", False):
        bad.append("config.tie_word_embeddings is true")
    if hasattr(cfg, "qk_rope_head_dim") and cfg.qk_rope_head_dim != hp["n_rot"]:
        bad.append(f"config.qk_rope_head_dim = {cfg.qk_rope_head_dim}, GGUF rope.dimension_count {hp['n_rot']}")
    rates = getattr(cfg, "compress_rates", None)
    if isinstance(rates, dict):
        for lt in set(want["layer_types"]) - {LT_SLIDING}:
            if rates.get(lt) != want["compress_rates"][lt]:
                bad.append(f"config.compress_rates[{lt}] = {rates.get(lt)}, want {want['compress_rates'][lt]}")
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        exp = want["rope_parameters"]
        for lt in ("main", "compress"):
            for key, val in exp[lt].items():
                got = rp.get(lt, {}).get(key)
                if not same(got, val):
                    bad.append(f"config.rope_parameters[{lt}][{key}] = {got!r}, want {val!r}")
    else:
        bad.append(f"config.rope_parameters has no main/compress sub-dicts: {rp!r}")
    return bad


# =================================================================================================
# GGUF <-> HF tensor mapping (inverse of llama.cpp conversion/deepseek.py DeepseekV4Model)
# =================================================================================================
# llama.cpp's converter renames the original DeepSeek checkpoint tensors to GGUF names without any
# transpose or permutation (numpy shape of a GGUF tensor == torch shape of the checkpoint tensor),
# stacks the routed experts (w1 -> ffn_gate_exps, w3 -> ffn_up_exps, w2 -> ffn_down_exps, each
# [E, out, in]), writes tid2eid as I32 [V, k], and drops exp_probs_b of hash layers. The HF module
# uses the checkpoint shapes too, and fuses gate+up of the routed experts into gate_up_proj
# [E, 2f, D] (gate first: _apply_gate does gate, up = chunk(2, dim=-1)).
# Each rule: HF state-dict key regex -> (GGUF tensor names, transform, original checkpoint name).
_L = r"model\.layers\.(\d+)\."


def _blk(m, name):
    return f"blk.{m.group(1)}.{name}"


MAP_RULES = [
    (r"model\.embed_tokens\.weight", lambda m: ["token_embd.weight"], "copy", "embed.weight"),
    (r"lm_head\.weight", lambda m: ["output.weight"], "copy", "head.weight"),
    (r"model\.norm\.weight", lambda m: ["output_norm.weight"], "copy", "norm.weight"),
    (r"model\.hc_head\.(?:hc_)?(fn|base|scale)", lambda m: [f"output_hc_{m.group(1)}.weight"], "copy",
     "hc_head_{fn,base,scale}"),
    (_L + r"input_layernorm\.weight", lambda m: [_blk(m, "attn_norm.weight")], "copy", "attn_norm.weight"),
    (_L + r"post_attention_layernorm\.weight", lambda m: [_blk(m, "ffn_norm.weight")], "copy", "ffn_norm.weight"),
    (_L + r"(attn|ffn)_hc\.(fn|base|scale)", lambda m: [f"blk.{m.group(1)}.hc_{m.group(2)}_{m.group(3)}.weight"],
     "copy", "hc_{attn,ffn}_{fn,base,scale}"),
    (_L + r"self_attn\.q_a_proj\.weight", lambda m: [_blk(m, "attn_q_a.weight")], "copy", "attn.wq_a.weight"),
    (_L + r"self_attn\.q_a_norm\.weight", lambda m: [_blk(m, "attn_q_a_norm.weight")], "copy", "attn.q_norm.weight"),
    (_L + r"self_attn\.q_b_proj\.weight", lambda m: [_blk(m, "attn_q_b.weight")], "copy", "attn.wq_b.weight"),
    (_L + r"self_attn\.kv_proj\.weight", lambda m: [_blk(m, "attn_kv.weight")], "copy", "attn.wkv.weight"),
    (_L + r"self_attn\.kv_norm\.weight", lambda m: [_blk(m, "attn_kv_a_norm.weight")], "copy", "attn.kv_norm.weight"),
    (_L + r"self_attn\.o_a_proj\.weight", lambda m: [_blk(m, "attn_output_a.weight")], "copy", "attn.wo_a.weight"),
    (_L + r"self_attn\.o_b_proj\.weight", lambda m: [_blk(m, "attn_output_b.weight")], "copy", "attn.wo_b.weight"),
    (_L + r"self_attn\.sinks", lambda m: [_blk(m, "attn_sinks.weight")], "copy", "attn.attn_sink"),
    (_L + r"self_attn\.compressor\.indexer\.kv_proj\.weight", lambda m: [_blk(m, "indexer_compressor_kv.weight")],
     "copy", "attn.indexer.compressor.wkv.weight"),
    (_L + r"self_attn\.compressor\.indexer\.gate_proj\.weight",
     lambda m: [_blk(m, "indexer_compressor_gate.weight")], "copy", "attn.indexer.compressor.wgate.weight"),
    (_L + r"self_attn\.compressor\.indexer\.position_bias", lambda m: [_blk(m, "indexer_compressor_ape.weight")],
     "copy", "attn.indexer.compressor.ape"),
    (_L + r"self_attn\.compressor\.indexer\.kv_norm\.weight",
     lambda m: [_blk(m, "indexer_compressor_norm.weight")], "copy", "attn.indexer.compressor.norm.weight"),
    (_L + r"self_attn\.compressor\.indexer\.q_b_proj\.weight", lambda m: [_blk(m, "indexer.attn_q_b.weight")],
     "copy", "attn.indexer.wq_b.weight"),
    (_L + r"self_attn\.compressor\.indexer\.(?:scorer\.)?weights_proj\.weight",
     lambda m: [_blk(m, "indexer.proj.weight")], "copy", "attn.indexer.weights_proj.weight"),
    (_L + r"self_attn\.compressor\.kv_proj\.weight", lambda m: [_blk(m, "attn_compressor_kv.weight")], "copy",
     "attn.compressor.wkv.weight"),
    (_L + r"self_attn\.compressor\.gate_proj\.weight", lambda m: [_blk(m, "attn_compressor_gate.weight")], "copy",
     "attn.compressor.wgate.weight"),
    (_L + r"self_attn\.compressor\.position_bias", lambda m: [_blk(m, "attn_compressor_ape.weight")], "copy",
     "attn.compressor.ape"),
    (_L + r"self_attn\.compressor\.kv_norm\.weight", lambda m: [_blk(m, "attn_compressor_norm.weight")], "copy",
     "attn.compressor.norm.weight"),
    (_L + r"mlp\.gate\.weight", lambda m: [_blk(m, "ffn_gate_inp.weight")], "copy", "ffn.gate.weight"),
    (_L + r"mlp\.gate\.e_score_correction_bias", lambda m: [_blk(m, "exp_probs_b.bias")], "copy", "ffn.gate.bias"),
    (_L + r"mlp\.gate\.tid2eid", lambda m: [_blk(m, "ffn_gate_tid2eid.weight")], "int64", "ffn.gate.tid2eid"),
    (_L + r"mlp\.experts\.gate_up_proj", lambda m: [_blk(m, "ffn_gate_exps.weight"), _blk(m, "ffn_up_exps.weight")],
     "cat_gate_up", "ffn.experts.*.w1 / w3 (stacked)"),
    (_L + r"mlp\.experts\.gate_proj", lambda m: [_blk(m, "ffn_gate_exps.weight")], "copy",
     "ffn.experts.*.w1 (stacked)"),
    (_L + r"mlp\.experts\.up_proj", lambda m: [_blk(m, "ffn_up_exps.weight")], "copy", "ffn.experts.*.w3 (stacked)"),
    (_L + r"mlp\.experts\.down_proj", lambda m: [_blk(m, "ffn_down_exps.weight")], "copy",
     "ffn.experts.*.w2 (stacked)"),
    (_L + r"mlp\.shared_experts\.gate_proj\.weight", lambda m: [_blk(m, "ffn_gate_shexp.weight")], "copy",
     "ffn.shared_experts.w1.weight"),
    (_L + r"mlp\.shared_experts\.up_proj\.weight", lambda m: [_blk(m, "ffn_up_shexp.weight")], "copy",
     "ffn.shared_experts.w3.weight"),
    (_L + r"mlp\.shared_experts\.down_proj\.weight", lambda m: [_blk(m, "ffn_down_shexp.weight")], "copy",
     "ffn.shared_experts.w2.weight"),
]
_COMPILED_RULES = [(re.compile(rx), fn, tr, orig) for rx, fn, tr, orig in MAP_RULES]

TRANSFORM_DOC = {
    "copy": "same array (numpy shape of the GGUF tensor == HF shape), cast to the model dtype",
    "int64": "I32 -> int64 (HF keeps tid2eid as a long buffer)",
    "cat_gate_up": "concatenate(gate_exps [E,f,D], up_exps [E,f,D], axis=1) -> [E,2f,D], gate rows first",
}


def map_hf_key(key: str):
    for rx, fn, tr, orig in _COMPILED_RULES:
        m = rx.fullmatch(key)
        if m:
            return fn(m), tr
    return None, None


def transform_shape(tr: str, shapes: list):
    if tr in ("copy", "int64"):
        return tuple(shapes[0])
    if tr == "cat_gate_up":
        a, b = shapes
        if tuple(a) != tuple(b) or len(a) != 3:
            return None
        return (a[0], 2 * a[1], a[2])
    raise OracleError(f"unknown transform {tr}")


def expected_hf_params(hp: dict) -> dict:
    """The state dict (key -> (shape, is_int)) the HF DeepseekV4ForCausalLM should have for this GGUF,
    as read from modeling_deepseek_v4.py. Used by --self-test / --check-mapping without torch, and
    for a diagnostic diff against the real model."""
    D, V, H, d = hp["n_embd"], hp["n_vocab"], hp["n_head"], hp["head_dim"]
    q, g, r, hc = hp["q_lora"], hp["o_groups"], hp["o_lora"], hp["hc"]
    E, k, f = hp["n_expert"], hp["n_expert_used"], hp["expert_ff"]
    Hi, di = hp["idx_heads"], hp["idx_dim"]
    mix = (2 + hc) * hc
    out = {
        "model.embed_tokens.weight": ((V, D), False),
        "model.norm.weight": ((D,), False),
        "model.hc_head.hc_fn": ((hc, hc * D), False),
        "model.hc_head.hc_base": ((hc,), False),
        "model.hc_head.hc_scale": ((1,), False),
        "lm_head.weight": ((V, D), False),
    }
    for i in range(hp["n_layer"]):
        p = f"model.layers.{i}."
        ratio = hp["compress_ratios"][i]
        out[p + "input_layernorm.weight"] = ((D,), False)
        out[p + "post_attention_layernorm.weight"] = ((D,), False)
        for site in ("attn_hc", "ffn_hc"):
            out[p + site + ".fn"] = ((mix, hc * D), False)
            out[p + site + ".base"] = ((mix,), False)
            out[p + site + ".scale"] = ((3,), False)
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = ((q, D), False)
        out[a + "q_a_norm.weight"] = ((q,), False)
        out[a + "q_b_proj.weight"] = ((H * d, q), False)
        out[a + "kv_proj.weight"] = ((d, D), False)
        out[a + "kv_norm.weight"] = ((d,), False)
        out[a + "o_a_proj.weight"] = ((g * r, H * d // g), False)
        out[a + "o_b_proj.weight"] = ((D, g * r), False)
        out[a + "sinks"] = ((H,), False)
        if ratio:
            c = 2 if ratio == 4 else 1
            out[a + "compressor.kv_proj.weight"] = ((c * d, D), False)
            out[a + "compressor.gate_proj.weight"] = ((c * d, D), False)
            out[a + "compressor.position_bias"] = ((ratio, c * d), False)
            out[a + "compressor.kv_norm.weight"] = ((d,), False)
            if ratio == 4:
                x = a + "compressor.indexer."
                out[x + "kv_proj.weight"] = ((2 * di, D), False)
                out[x + "gate_proj.weight"] = ((2 * di, D), False)
                out[x + "position_bias"] = ((4, 2 * di), False)
                out[x + "kv_norm.weight"] = ((di,), False)
                out[x + "q_b_proj.weight"] = ((Hi * di, q), False)
                out[x + "scorer.weights_proj.weight"] = ((Hi, D), False)
        m = p + "mlp."
        out[m + "gate.weight"] = ((E, D), False)
        if i < hp["hash_layers"]:
            out[m + "gate.tid2eid"] = ((V, k), True)
        else:
            out[m + "gate.e_score_correction_bias"] = ((E,), False)
        out[m + "experts.gate_up_proj"] = ((E, 2 * f, D), False)
        out[m + "experts.down_proj"] = ((E, D, f), False)
        out[m + "shared_experts.gate_proj.weight"] = ((f, D), False)
        out[m + "shared_experts.up_proj.weight"] = ((f, D), False)
        out[m + "shared_experts.down_proj.weight"] = ((D, f), False)
    return out


_BLK = re.compile(r"blk\.(\d+)\.(.+)$")


def ignorable_gguf_tensor(name: str, hp: dict):
    """Why a GGUF tensor has no HF counterpart, or None when it must be used."""
    m = _BLK.match(name)
    if not m:
        return None
    il, rest = int(m.group(1)), m.group(2)
    if il >= hp["n_layer"]:
        return "MTP block (HF does not instantiate the MTP layers)"
    if rest == "exp_probs_b_vl.bias":
        return "vision-token routing bias (text-only oracle)"
    if rest == "exp_probs_b.bias" and il < hp["hash_layers"]:
        return "selection bias of a hash-routed layer (unused by HF and llama.cpp)"
    return None


def build_plan(hf_shapes: dict, gguf_shapes: dict, hp: dict):
    """hf_shapes: HF key -> shape. gguf_shapes: GGUF name -> numpy shape.
    Returns (plan, ignored) or raises OracleError after printing the listing."""
    plan, ignored = [], []
    unmapped, missing, badshape = [], [], []
    used = set()
    for key, shape in hf_shapes.items():
        srcs, tr = map_hf_key(key)
        if srcs is None:
            unmapped.append(f"{key} {list(shape)}")
            continue
        miss = [s for s in srcs if s not in gguf_shapes]
        if miss:
            missing.append(f"{key} <- {', '.join(miss)}")
            continue
        got = transform_shape(tr, [gguf_shapes[s] for s in srcs])
        if got != tuple(shape):
            badshape.append(f"{key}: HF {list(shape)}, from GGUF {', '.join(s + str(list(gguf_shapes[s])) for s in srcs)}"
                            f" via {tr} -> {list(got) if got else 'incompatible'}")
            continue
        used.update(srcs)
        plan.append((key, srcs, tr))
    unused = []
    for name in gguf_shapes:
        if name in used:
            continue
        why = ignorable_gguf_tensor(name, hp)
        if why:
            ignored.append((name, why))
        else:
            unused.append(f"{name} {list(gguf_shapes[name])}")
    problems = []
    if unmapped:
        fail_listing("HF keys with no GGUF mapping rule (unexpected keys)", unmapped)
        problems.append(f"{len(unmapped)} HF keys unmapped")
    if missing:
        fail_listing("HF keys whose GGUF tensors are missing", missing)
        problems.append(f"{len(missing)} HF keys without GGUF data")
    if badshape:
        fail_listing("shape mismatches", badshape)
        problems.append(f"{len(badshape)} shape mismatches")
    if unused:
        fail_listing("GGUF tensors that no HF key uses", unused)
        problems.append(f"{len(unused)} GGUF tensors unused")
    if problems:
        raise OracleError("strict GGUF -> HF mapping check failed: " + ", ".join(problems))
    return plan, ignored


def load_plan_array(g: gguf_np.GGUFFile, srcs: list, tr: str, np_dtype) -> np.ndarray:
    if tr == "int64":
        a = g.tensor(srcs[0])
        if a.dtype.kind not in "iu":
            raise OracleError(f"{srcs[0]} is {g.tensors[srcs[0]].type_name}, expected an integer tensor")
        return np.array(a, dtype=np.int64)
    arrs = []
    for s in srcs:
        a = g.tensor(s)
        if a.dtype.kind not in "f":
            raise OracleError(f"{s} is {g.tensors[s].type_name}, expected a float tensor")
        arrs.append(np.array(a, dtype=np_dtype))
    if tr == "copy":
        return arrs[0]
    if tr == "cat_gate_up":
        return np.concatenate(arrs, axis=1)
    raise OracleError(f"unknown transform {tr}")


def print_mapping() -> None:
    print("GGUF tensor (llama.cpp deepseek4)        -> HF DeepseekV4ForCausalLM key   [transform]   "
          "(original DeepSeek checkpoint name)")
    examples = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.hc_head.hc_fn",
        "model.hc_head.hc_base", "model.hc_head.hc_scale",
    ]
    layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight", "attn_hc.fn", "attn_hc.base",
        "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale", "self_attn.q_a_proj.weight",
        "self_attn.q_a_norm.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
        "self_attn.kv_norm.weight", "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "self_attn.sinks",
        "self_attn.compressor.kv_proj.weight", "self_attn.compressor.gate_proj.weight",
        "self_attn.compressor.position_bias", "self_attn.compressor.kv_norm.weight",
        "self_attn.compressor.indexer.kv_proj.weight", "self_attn.compressor.indexer.gate_proj.weight",
        "self_attn.compressor.indexer.position_bias", "self_attn.compressor.indexer.kv_norm.weight",
        "self_attn.compressor.indexer.q_b_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.gate.tid2eid", "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj", "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    ]
    for key in examples + [f"model.layers.N.{x}" for x in layer]:
        k2 = key.replace(".N.", ".0.")
        srcs, tr = map_hf_key(k2)
        orig = next(o for rx, fn, t, o in _COMPILED_RULES if rx.fullmatch(k2))
        srcs = [s.replace("blk.0.", "blk.N.") for s in srcs]
        print(f"{' + '.join(srcs):40s} -> {key:58s} [{tr}]  ({orig})")
    print()
    for tr, doc in TRANSFORM_DOC.items():
        print(f"  {tr}: {doc}")
    print("  not mapped: blk.N.* of MTP blocks (N >= block_count - nextn), exp_probs_b_vl.bias, exp_probs_b.bias"
          " of hash layers")


# =================================================================================================
# RoPE inverse frequencies, float64 numpy (what the GGUF specifies, llama.cpp/ggml formulas)
# =================================================================================================
def rope_inv_freq_np(n_rot: int, base: float, yarn: dict | None = None) -> np.ndarray:
    i = np.arange(0, n_rot, 2, dtype=np.float64)
    inv_extrap = 1.0 / (base ** (i / n_rot))
    if not yarn:
        return inv_extrap
    factor, orig = float(yarn["factor"]), float(yarn["orig_ctx"])
    bf, bs = float(yarn["beta_fast"]), float(yarn["beta_slow"])

    def corr_dim(n_rotations):
        return n_rot * math.log(orig / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(bf)), 0)
    high = min(math.ceil(corr_dim(bs)), n_rot - 1)
    span = (high - low) if high != low else 0.001
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
    w_extrap = 1.0 - ramp
    return (inv_extrap / factor) * (1.0 - w_extrap) + inv_extrap * w_extrap


def rope_reference(hp: dict) -> dict:
    rs = hp["rope_scaling"]
    return {
        "main": rope_inv_freq_np(hp["n_rot"], hp["rope_base"]),
        "compress": rope_inv_freq_np(hp["n_rot"], hp["compress_rope_base"], rs if rs["type"] == "yarn" else None),
    }


# =================================================================================================
# torch part
# =================================================================================================
PATCH_SUMMARY = """float64 mode: float32 casts inside modeling_deepseek_v4 that are neutralised (torch function mode
F64Mode, active while building the model and during every forward; default dtype float64):
  DeepseekV4RMSNorm.forward            hidden_states.to(torch.float32)          -> stays float64
  DeepseekV4UnweightedRMSNorm.forward  x.float()                                 -> float64
  DeepseekV4RotaryEmbedding.forward    inv_freq.float(), position_ids.float(), freqs .float() -> float64
  rope init (default / yarn)           torch.arange(..., dtype=torch.float)      -> float64 inv_freq buffers
  apply_rotary_pos_emb                 rope.float() * cos, rotate_half(rope).float() * sin -> float64
  HCA/CSA compressor, indexer          gate.softmax(dim=2, dtype=torch.float32)  -> float64 softmax
  DeepseekV4IndexerScorer.forward      q.float(), compressed_kv.float(), weights_proj(..).float() -> float64
  DeepseekV4HyperConnection.forward    hidden_streams.flatten(2).float(), self.fn.float() -> float64
  DeepseekV4HyperHead.forward          x.flatten(2).float(), hc_fn/hc_scale/hc_base.float() -> float64
  (_keep_in_fp32_modules_strict only acts in from_pretrained; the model is built directly in float64)
  rule: Tensor.float()/half()/bfloat16() -> .to(float64); Tensor.to/type(float32|16|bf16) -> float64;
        dtype=float32|16|bf16 keyword on any torch call -> float64. Every torch call of the forward is
        checked for float32/16/bf16 results; any leak is an error."""


def make_f64_mode(torch):
    from collections import Counter
    from torch.overrides import TorchFunctionMode

    LOW = (torch.float32, torch.float16, torch.bfloat16)
    T = torch.Tensor
    upcast = {T.float: "Tensor.float()", T.half: "Tensor.half()", T.bfloat16: "Tensor.bfloat16()"}
    convert = {T.to: "Tensor.to", T.type: "Tensor.type"}

    def fname(func):
        return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)

    def dname(dt):
        return str(dt).replace("torch.", "")

    class F64Mode(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.rewrites = Counter()
            self.leaks = Counter()

        def reset(self):
            self.rewrites.clear()
            self.leaks.clear()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs) if kwargs else {}
            if func in upcast:
                self.rewrites[upcast[func]] += 1
                return args[0].to(torch.float64, **kwargs)
            if func in convert and len(args) > 1:
                new = list(args)
                for i in range(1, len(new)):
                    a = new[i]
                    if isinstance(a, torch.dtype) and a in LOW:
                        self.rewrites[f"{convert[func]}({dname(a)})"] += 1
                        new[i] = torch.float64
                    elif i == 1 and func is T.to and isinstance(a, torch.Tensor) and a.dtype in LOW:
                        self.rewrites[f"Tensor.to(<{dname(a.dtype)} tensor>)"] += 1
                        new[i:i + 1] = [a.device, torch.float64]
                        break
                args = tuple(new)
            dt = kwargs.get("dtype")
            if dt in LOW and getattr(func, "__name__", "") != "view":
                self.rewrites[f"{getattr(func, '__name__', fname(func))}(dtype={dname(dt)})"] += 1
                kwargs["dtype"] = torch.float64
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                if out.dtype in LOW:
                    self.leaks[fname(func)] += 1
            elif isinstance(out, (tuple, list)):
                for o in out:
                    if isinstance(o, torch.Tensor) and o.dtype in LOW:
                        self.leaks[fname(func)] += 1
            return out

    return F64Mode()


def set_precise_matmul(torch, notes: list) -> None:
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    except Exception as e:  # pragma: no cover - depends on torch build
        notes.append(f"could not set TF32/reduced-precision flags: {e}")
    try:
        torch.set_float32_matmul_precision("highest")
    except Exception as e:  # pragma: no cover
        notes.append(f"set_float32_matmul_precision failed: {e}")


def force_eager(torch, model, cfg, notes: list) -> None:
    for attr, setter in (("_attn_implementation", "set_attn_implementation"),
                         ("_experts_implementation", "set_experts_implementation")):
        cur = getattr(model.config, attr, None)
        if cur is None or cur == "eager":
            continue
        if hasattr(model, setter):
            try:
                getattr(model, setter)("eager")
            except Exception as e:
                notes.append(f"{setter}('eager') failed: {e}")
        if getattr(model.config, attr, None) != "eager":
            try:
                setattr(model.config, attr, "eager")
            except Exception as e:
                notes.append(f"setting config.{attr} failed: {e}")
    got = getattr(model.config, "_attn_implementation", None)
    if got != "eager":
        raise OracleError(f"could not force attn_implementation='eager' (have {got!r})")
    for name, mod in model.named_modules():
        c = getattr(mod, "config", None)
        if c is None:
            continue
        ei = getattr(c, "_experts_implementation", None)
        if ei not in (None, "eager"):
            raise OracleError(f"{name or 'model'}: experts implementation {ei!r}, could not force 'eager'")
        ai = getattr(c, "_attn_implementation", None)
        if ai not in (None, "eager"):
            raise OracleError(f"{name or 'model'}: attn implementation {ai!r}, could not force 'eager'")


def build_model(torch, hp, args, notes):
    try:
        import transformers
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
    except ImportError as e:
        raise OracleError(f"transformers with models.deepseek_v4 is needed ({e})") from None
    note(f"torch {torch.__version__}, transformers {transformers.__version__} ({mdl.__file__})")
    cfg_cls = getattr(mdl, "DeepseekV4Config", None)
    if cfg_cls is None:
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config as cfg_cls
    model_cls = mdl.DeepseekV4ForCausalLM

    want = hf_config_kwargs(hp)
    kwargs, cfg_notes = filter_config_kwargs(cfg_cls, want, hp)
    for s in cfg_notes:
        note("config: " + s)
    if not cfg_notes:
        note("config: no fields dropped")
    try:
        cfg = cfg_cls(**kwargs)
    except Exception as e:
        raise OracleError(f"{cfg_cls.__name__}(...) failed: {type(e).__name__}: {e}") from None
    for attr in ("_attn_implementation", "_experts_implementation"):
        try:
            setattr(cfg, attr, "eager")
        except Exception as e:
            notes.append(f"config.{attr} not settable before build: {e}")
    bad = verify_config(cfg, want, hp, notes)
    if bad:
        fail_listing("config differs from the GGUF", bad)
        raise OracleError(f"{len(bad)} config fields differ from the GGUF")

    f64 = args.dtype == "float64"
    dtype = torch.float64 if f64 else torch.float32
    mode = make_f64_mode(torch) if f64 else None
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(args.device), (mode if mode is not None else contextlib.nullcontext()):
        model = model_cls(cfg)
    if mode is not None:
        if mode.rewrites:
            note("build: rewrote " + ", ".join(f"{k} x{v}" for k, v in sorted(mode.rewrites.items())))
        mode.reset()
    model.to(dtype=dtype)
    model.eval()
    force_eager(torch, model, cfg, notes)
    note(f"built {model_cls.__name__} on {args.device} in {time.time() - t0:.1f}s "
         f"(attn={model.config._attn_implementation}, "
         f"experts={getattr(model.config, '_experts_implementation', 'n/a')})")
    return model, mode, dtype


def load_weights(torch, model, g, hp, dtype):
    sd = model.state_dict()
    emb = sd.get("model.embed_tokens.weight")
    head = sd.get("lm_head.weight")
    if emb is not None and head is not None and emb.data_ptr() == head.data_ptr():
        raise OracleError("lm_head is tied to embed_tokens; the GGUF has a separate output.weight")
    hf_shapes = {k: tuple(v.shape) for k, v in sd.items()}
    exp = expected_hf_params(hp)
    extra = sorted(set(hf_shapes) - set(exp))
    lack = sorted(set(exp) - set(hf_shapes))
    if extra or lack:
        note(f"note: HF state dict differs from this script's expectation "
             f"(+{len(extra)} / -{len(lack)} keys); the mapping rules decide")
        for k in extra[:20]:
            note(f"  only in HF: {k} {list(hf_shapes[k])}")
        for k in lack[:20]:
            note(f"  expected, not in HF: {k}")
    gshapes = {n: tuple(t.shape) for n, t in g.tensors.items()}
    plan, ignored = build_plan(hf_shapes, gshapes, hp)
    for name, why in ignored:
        note(f"GGUF tensor not used: {name} ({why})")
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    t0 = time.time()
    with torch.no_grad():
        for key, srcs, tr in plan:
            t = targets.get(key)
            if t is None:
                raise OracleError(f"state-dict key {key} is neither a parameter nor a buffer")
            arr = load_plan_array(g, srcs, tr, np_dtype)
            src = torch.from_numpy(arr)
            if t.dtype.is_floating_point:
                if t.dtype != dtype:
                    raise OracleError(f"{key} is {t.dtype}, expected {dtype}")
                src = src.to(dtype)
            else:
                src = src.to(t.dtype)
            if tuple(src.shape) != tuple(t.shape):
                raise OracleError(f"{key}: shape {tuple(t.shape)} vs loaded {tuple(src.shape)}")
            t.copy_(src.to(t.device))
    note(f"loaded {len(plan)} HF tensors from {len(g.tensors) - len(ignored)} GGUF tensors "
         f"in {time.time() - t0:.1f}s")
    persistent = set(sd)
    for name, b in model.named_buffers():
        if name in persistent:
            continue
        if not re.search(r"_(original_)?inv_freq$", name):
            note(f"note: non-persistent buffer {name} {tuple(b.shape)} {b.dtype} keeps its HF-computed value")
        elif b.dtype != dtype:
            raise OracleError(f"buffer {name} is {b.dtype}, expected {dtype}")
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dtype.is_floating_point and p.dtype != dtype:
            raise OracleError(f"{name} is {p.dtype} after loading, expected {dtype}")
    return plan


def check_rope(torch, model, hp, dtype, skip: bool):
    ref = rope_reference(hp)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    seen, bad = 0, []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        for lt in getattr(mod, "layer_types", []):
            inv = getattr(mod, f"{lt}_inv_freq", None)
            if inv is None or lt not in ref:
                bad.append(f"{name}: no {lt}_inv_freq or unknown rope type {lt}")
                continue
            got = inv.detach().to("cpu", torch.float64).numpy()
            exp = ref[lt]
            if got.shape != exp.shape:
                bad.append(f"{name}.{lt}: {got.shape[0]} frequencies, expected {exp.shape[0]}")
                continue
            rel = float(np.max(np.abs(got - exp) / np.abs(exp)))
            if rel > tol:
                j = int(np.argmax(np.abs(got - exp) / np.abs(exp)))
                bad.append(f"{name}.{lt}: max rel diff {rel:.3e} at pair {j} (HF {got[j]!r}, GGUF {exp[j]!r})")
            sc = getattr(mod, f"{lt}_attention_scaling", 1.0)
            if not math.isclose(float(sc), 1.0, rel_tol=0, abs_tol=1e-15):
                bad.append(f"{name}.{lt}: attention_scaling {sc} (YaRN magnitude scaling not cancelled)")
            seen += 1
    if not seen:
        bad.append("no rotary embedding module found")
    if bad:
        if skip:
            for s in bad:
                note("WARNING rope: " + s)
            return
        fail_listing("RoPE tables differ from what the GGUF specifies (llama.cpp formulas)", bad)
        raise OracleError("RoPE check failed (use --no-rope-check to run anyway)")
    note(f"rope: {seen} HF inv_freq tables match the GGUF (main: default base {hp['rope_base']:g}; compress: "
         f"{hp['rope_scaling']['type']} base {hp['compress_rope_base']:g}) within {tol:g}")


def run_forward(torch, model, mode, tokens: np.ndarray, n_prompt: int, how: str, device):
    n = len(tokens)
    ids = torch.tensor(tokens.astype(np.int64), device=device).unsqueeze(0)
    pos = torch.arange(n, device=device).unsqueeze(0)
    ctx = mode if mode is not None else contextlib.nullcontext()
    rows = []

    def grab(out):
        rows.append(out.logits[0].detach().to("cpu", torch.float64).numpy())

    with torch.no_grad():
        if how == "full":
            with ctx:
                out = model(input_ids=ids, position_ids=pos, use_cache=False)
            grab(out)
        else:
            p = max(1, min(n_prompt, n))
            with ctx:
                out = model(input_ids=ids[:, :p], position_ids=pos[:, :p], use_cache=True)
            grab(out)
            cache = getattr(out, "past_key_values", None)
            if cache is None and p < n:
                raise OracleError("model returned no cache; incremental decoding impossible (use --mode full)")
            if cache is not None:
                layers = getattr(cache, "layers", None)
                lts = list(model.config.layer_types)
                if layers is not None:
                    kinds = sorted(set(type(x).__name__ for x in layers))
                    note(f"incremental: cache {type(cache).__name__} with layer classes {kinds}")
                    for i, lt in enumerate(lts):
                        if lt != LT_SLIDING and i < len(layers) and not hasattr(layers[i], "store_compression_weights"):
                            raise OracleError(f"cache layer {i} ({type(layers[i]).__name__}) has no compressor state "
                                              f"for a {lt} layer; incremental decoding unsupported (use --mode full)")
            for t in range(p, n):
                with ctx:
                    out = model(input_ids=ids[:, t:t + 1], position_ids=pos[:, t:t + 1], past_key_values=cache,
                                use_cache=True)
                grab(out)
                cache = out.past_key_values
                if t == p and hasattr(cache, "get_seq_length"):
                    try:
                        sl = int(cache.get_seq_length())
                        if sl != t + 1:
                            note(f"note: cache.get_seq_length() = {sl} after {t + 1} tokens (positions are passed "
                                 "explicitly)")
                    except Exception:
                        pass
    logits = np.concatenate(rows, axis=0)
    if logits.shape[0] != n:
        raise OracleError(f"got {logits.shape[0]} logit rows for {n} tokens")
    return logits


def report_leaks(mode, allow: bool):
    if mode is None:
        return
    if mode.rewrites:
        note("forward: float32 casts rewritten to float64: "
             + ", ".join(f"{k} x{v}" for k, v in sorted(mode.rewrites.items())))
    else:
        note("forward: no float32 casts met (unexpected for this module: is F64Mode active?)")
    if mode.leaks:
        lines = [f"{k}: {v} results" for k, v in sorted(mode.leaks.items())]
        if allow:
            for s in lines:
                note("WARNING float32 leak: " + s)
        else:
            fail_listing("torch calls that returned float32/16/bf16 tensors in float64 mode", lines)
            raise OracleError("float32 leaked into the float64 forward (--allow-f32-leaks to ignore)")
    else:
        note("forward: no float32/16/bf16 tensor produced anywhere (float64 throughout)")


def compare_report(ref: ds4logit.Dump, logits64: np.ndarray, argmax: np.ndarray, label="vs REF"):
    d = np.abs(logits64 - ref.logits.astype(np.float64))
    P = ref.n_prompt
    r, v = np.unravel_index(int(np.argmax(d)), d.shape) if d.size else (0, 0)
    seg = []
    if P:
        seg.append(f"prompt rows {d[:P].max():.3e}")
    if ref.n_gen:
        seg.append(f"decode rows {d[P:].max():.3e}")
    scale = float(np.abs(ref.logits).max()) if d.size else 0.0
    note(f"max |dlogit| {label} = {d.max() if d.size else 0.0:.6e} (row {r}, token {v}; {', '.join(seg)}; "
         f"max |logit| {scale:.3g})")
    dis = np.nonzero(argmax != ref.argmax)[0]
    first = f", first at row {int(dis[0])}" if dis.size else ""
    note(f"argmax disagreements {label}: {dis.size} of {ref.n_rows}{first}")


def run_oracle(args) -> int:
    try:
        import torch
    except ImportError:
        raise OracleError("torch is not installed") from None
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OracleError("--device cuda but torch sees no CUDA device")

    ref = read_ds4logit(args.tokens_from)
    g = gguf_np.GGUFFile(args.model)
    hp = read_hparams(g)
    warns = check_hparams_for_hf(hp)
    if ref.n_vocab != hp["n_vocab"]:
        raise OracleError(f"REF n_vocab {ref.n_vocab} != model vocab {hp['n_vocab']}")
    if ref.n_rows and (ref.tokens.min() < 0 or ref.tokens.max() >= hp["n_vocab"]):
        raise OracleError("REF tokens out of the vocabulary range")
    if ref.n_rows == 0:
        raise OracleError("REF has no rows")

    notes: list[str] = []
    note(f"model {args.model}: {hp['n_layer']} layers, ratios {hp['compress_ratios']}, "
         f"{hp['hash_layers']} hash layers, vocab {hp['n_vocab']}; REF {args.tokens_from}: "
         f"P={ref.n_prompt} G={ref.n_gen}")
    note(f"mode {args.mode}, dtype {args.dtype}, device {args.device}")
    for w in warns:
        note("WARNING " + w)
    if args.dtype == "float64":
        for line in PATCH_SUMMARY.splitlines():
            note(line)
    else:
        note("float32 mode: the module runs as shipped (its internal float32 casts are no-ops); TF32 off")
    set_precise_matmul(torch, notes)
    model, mode, dtype = build_model(torch, hp, args, notes)
    for s in notes:
        note("note: " + s)
    load_weights(torch, model, g, hp, dtype)
    check_rope(torch, model, hp, dtype, args.no_rope_check)

    t0 = time.time()
    if args.mode == "both":
        full = run_forward(torch, model, mode, ref.tokens, ref.n_prompt, "full", args.device)
        logits = run_forward(torch, model, mode, ref.tokens, ref.n_prompt, "incremental", args.device)
        note(f"max |full - incremental| = {np.abs(full - logits).max():.6e}")
    else:
        logits = run_forward(torch, model, mode, ref.tokens, ref.n_prompt, args.mode, args.device)
    note(f"forward ({args.mode}) over {ref.n_rows} rows took {time.time() - t0:.1f}s")
    report_leaks(mode, args.allow_f32_leaks)
    if not np.all(np.isfinite(logits)):
        raise OracleError("non-finite logits")

    argmax = write_ds4logit(args.out, ref.n_prompt, ref.tokens, logits.astype(np.float32))
    note(f"wrote {args.out} ({ref.n_rows} rows x {hp['n_vocab']})")
    compare_report(ref, logits, argmax)
    return 0


# =================================================================================================
# self-test (numpy only)
# =================================================================================================
def _st_write_gguf(path: str, kvs: list, tensors: list, alignment: int = 32) -> None:
    """Throwaway GGUF v3 writer for the self-test. kvs: (key, type id, value[, element type id]).
    tensors: (name, numpy array in numpy order, ggml type id)."""
    G = gguf_np
    scal = {G.T_UINT8: "<B", G.T_INT8: "<b", G.T_UINT16: "<H", G.T_INT16: "<h", G.T_UINT32: "<I",
            G.T_INT32: "<i", G.T_FLOAT32: "<f", G.T_BOOL: "<B", G.T_UINT64: "<Q", G.T_INT64: "<q",
            G.T_FLOAT64: "<d"}

    def s(x: str) -> bytes:
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def val(t, v, et=None) -> bytes:
        if t in (G.T_FLOAT32, G.T_FLOAT64):
            return struct.pack(scal[t], float(v))
        if t in scal:
            return struct.pack(scal[t], int(v))
        if t == G.T_STRING:
            return s(v)
        if t == G.T_ARRAY:
            if et == G.T_ARRAY:   # nested: elements are (inner element type, inner list)
                body = b"".join(val(G.T_ARRAY, inner, inner_et) for inner_et, inner in v)
            else:
                body = b"".join(val(et, x) for x in v)
            return struct.pack("<IQ", et, len(v)) + body
        raise ValueError(t)

    def encode(arr, gt) -> bytes:
        if gt == G.GGML_F32:
            return np.ascontiguousarray(arr, "<f4").tobytes()
        if gt == G.GGML_F16:
            return np.ascontiguousarray(arr, "<f2").tobytes()
        if gt == G.GGML_F64:
            return np.ascontiguousarray(arr, "<f8").tobytes()
        if gt == G.GGML_I32:
            return np.ascontiguousarray(arr, "<i4").tobytes()
        if gt == G.GGML_I8:
            return np.ascontiguousarray(arr, "<i1").tobytes()
        if gt == G.GGML_I16:
            return np.ascontiguousarray(arr, "<i2").tobytes()
        if gt == G.GGML_I64:
            return np.ascontiguousarray(arr, "<i8").tobytes()
        if gt == G.GGML_BF16:
            u = np.ascontiguousarray(arr, "<f4").view("<u4").astype(np.uint64)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16          # round to nearest even
            return u.astype("<u2").tobytes()
        if gt == G.GGML_Q8_0:
            x = np.ascontiguousarray(arr, np.float32).reshape(-1, 32)
            dd = (np.abs(x).max(axis=1) / 127.0).astype(np.float16)
            inv = np.where(dd.astype(np.float32) > 0, 1.0 / np.maximum(dd.astype(np.float32), 1e-30), 0.0)
            q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
            out = np.empty((x.shape[0], 34), np.uint8)
            out[:, :2] = dd.astype("<f2").view(np.uint8).reshape(-1, 2)
            out[:, 2:] = q.view(np.uint8)
            return out.tobytes()
        raise ValueError(gt)

    head = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs))]
    for kv in kvs:
        key, t, v = kv[0], kv[1], kv[2]
        et = kv[3] if len(kv) > 3 else None
        head.append(s(key) + struct.pack("<I", t) + val(t, v, et))
    blobs, off = [], 0
    for name, arr, gt in tensors:
        data = encode(arr, gt)
        ne = list(reversed(arr.shape))
        head.append(s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
                    + struct.pack("<IQ", gt, off))
        pad = (-len(data)) % alignment
        blobs.append(data + b"\0" * pad)
        off += len(data) + pad
    h = b"".join(head)
    h += b"\0" * ((-len(h)) % alignment)
    with open(path, "wb") as f:
        f.write(h)
        for b in blobs:
            f.write(b)


ST_CONFIG = dict(vocab=96, n_embd=32, n_layer=5, ratios=[0, 4, 128, 4, 0], hash_layers=2, n_head=4, head_dim=32,
                 n_rot=8, q_lora=24, o_groups=2, o_lora=12, window=8, idx_heads=4, idx_dim=16, idx_topk=3,
                 n_expert=5, n_used=2, ff=20, hc=4, ctx=4096, yarn_factor=4.0, yarn_orig=256, mtp=1)


def _st_deepseek4_file(path: str, rng, c=ST_CONFIG, drop=(), extra=()):
    """A small deepseek4 GGUF following llama.cpp's tensor list (llama_model_deepseek4::load_arch_tensors),
    with one MTP block and a vision routing bias that the mapping must skip."""
    G = gguf_np
    D, V, H, d = c["n_embd"], c["vocab"], c["n_head"], c["head_dim"]
    q, g, r, hc = c["q_lora"], c["o_groups"], c["o_lora"], c["hc"]
    E, k, f = c["n_expert"], c["n_used"], c["ff"]
    Hi, di = c["idx_heads"], c["idx_dim"]
    mix = (2 + hc) * hc
    n_all = c["n_layer"] + c["mtp"]
    A = "deepseek4."
    kvs = [
        ("general.architecture", G.T_STRING, "deepseek4"), ("general.alignment", G.T_UINT32, 32),
        ("tokenizer.ggml.model", G.T_STRING, "no_vocab"),
        (A + "context_length", G.T_UINT32, c["ctx"]), (A + "embedding_length", G.T_UINT32, D),
        (A + "block_count", G.T_UINT32, n_all), (A + "nextn_predict_layers", G.T_UINT32, c["mtp"]),
        (A + "vocab_size", G.T_UINT32, V),
        (A + "attention.head_count", G.T_UINT32, H), (A + "attention.head_count_kv", G.T_UINT32, 1),
        (A + "attention.key_length", G.T_UINT32, d), (A + "attention.value_length", G.T_UINT32, d),
        (A + "attention.layer_norm_rms_epsilon", G.T_FLOAT32, 1e-6),
        (A + "attention.q_lora_rank", G.T_UINT32, q), (A + "attention.sliding_window", G.T_UINT32, c["window"]),
        (A + "attention.output_group_count", G.T_UINT32, g), (A + "attention.output_lora_rank", G.T_UINT32, r),
        (A + "attention.compress_rope_freq_base", G.T_FLOAT32, 160000.0),
        (A + "attention.compress_ratios", G.T_ARRAY, list(c["ratios"]) + [0] * c["mtp"], G.T_UINT32),
        (A + "attention.indexer.head_count", G.T_UINT32, Hi), (A + "attention.indexer.key_length", G.T_UINT32, di),
        (A + "attention.indexer.top_k", G.T_UINT32, c["idx_topk"]),
        (A + "rope.dimension_count", G.T_UINT32, c["n_rot"]), (A + "rope.freq_base", G.T_FLOAT32, 10000.0),
        (A + "rope.scaling.type", G.T_STRING, "yarn"), (A + "rope.scaling.factor", G.T_FLOAT32, c["yarn_factor"]),
        (A + "rope.scaling.original_context_length", G.T_UINT32, c["yarn_orig"]),
        (A + "expert_count", G.T_UINT32, E), (A + "expert_used_count", G.T_UINT32, k),
        (A + "expert_shared_count", G.T_UINT32, 1), (A + "expert_feed_forward_length", G.T_UINT32, f),
        (A + "expert_weights_scale", G.T_FLOAT32, 1.5), (A + "expert_weights_norm", G.T_BOOL, True),
        (A + "expert_gating_func", G.T_UINT32, 4),
        (A + "swiglu_clamp_exp", G.T_ARRAY, [10.0] * n_all, G.T_FLOAT32),
        (A + "swiglu_clamp_shexp", G.T_FLOAT32, 10.0),
        (A + "hyper_connection.count", G.T_UINT32, hc), (A + "hyper_connection.sinkhorn_iterations", G.T_UINT32, 20),
        (A + "hyper_connection.epsilon", G.T_FLOAT32, 1e-6), (A + "hash_layer_count", G.T_UINT32, c["hash_layers"]),
    ]
    T = []

    def add(name, ne, gt=G.GGML_F32):
        if name in drop:
            return
        shape = tuple(reversed(ne))
        if gt == G.GGML_I32:
            a = rng.integers(0, E, size=shape).astype(np.int32)
        else:
            a = rng.standard_normal(shape).astype(np.float32)
        T.append((name, a, gt))

    add("token_embd.weight", (D, V))
    add("output_norm.weight", (D,))
    add("output.weight", (D, V), G.GGML_Q8_0)
    add("output_hc_fn.weight", (hc * D, hc))
    add("output_hc_base.weight", (hc,))
    add("output_hc_scale.weight", (1,))
    for i in range(n_all):
        b = f"blk.{i}."
        ratio = (list(c["ratios"]) + [0] * c["mtp"])[i]
        add(b + "attn_norm.weight", (D,))
        add(b + "attn_sinks.weight", (H,))
        add(b + "attn_q_a.weight", (D, q), G.GGML_F16)
        add(b + "attn_q_a_norm.weight", (q,))
        add(b + "attn_q_b.weight", (q, H * d), G.GGML_BF16)
        add(b + "attn_kv.weight", (D, d))
        add(b + "attn_kv_a_norm.weight", (d,))
        add(b + "attn_output_a.weight", (H * d // g, g * r))
        add(b + "attn_output_b.weight", (g * r, D))
        for site in ("attn", "ffn"):
            add(b + f"hc_{site}_fn.weight", (hc * D, mix))
            add(b + f"hc_{site}_base.weight", (mix,))
            add(b + f"hc_{site}_scale.weight", (3,))
        if ratio:
            cf = 2 if ratio == 4 else 1
            add(b + "attn_compressor_kv.weight", (D, cf * d))
            add(b + "attn_compressor_gate.weight", (D, cf * d))
            add(b + "attn_compressor_ape.weight", (cf * d, ratio))
            add(b + "attn_compressor_norm.weight", (d,))
            if ratio == 4:
                add(b + "indexer.proj.weight", (D, Hi))
                add(b + "indexer.attn_q_b.weight", (q, Hi * di))
                add(b + "indexer_compressor_kv.weight", (D, 2 * di))
                add(b + "indexer_compressor_gate.weight", (D, 2 * di))
                add(b + "indexer_compressor_ape.weight", (2 * di, 4))
                add(b + "indexer_compressor_norm.weight", (di,))
        add(b + "ffn_gate_inp.weight", (D, E))
        if i < c["hash_layers"]:
            add(b + "ffn_gate_tid2eid.weight", (k, V), G.GGML_I32)
        else:
            add(b + "exp_probs_b.bias", (E,))
        add(b + "ffn_norm.weight", (D,))
        add(b + "ffn_gate_exps.weight", (D, f, E))
        add(b + "ffn_down_exps.weight", (f, D, E))
        add(b + "ffn_up_exps.weight", (D, f, E))
        add(b + "ffn_gate_shexp.weight", (D, f))
        add(b + "ffn_down_shexp.weight", (f, D))
        add(b + "ffn_up_shexp.weight", (D, f))
        if i == 1:
            add(b + "exp_probs_b_vl.bias", (E,))
        if i >= c["n_layer"]:
            add(b + "nextn.eh_proj.weight", (2 * D, D))
            add(b + "nextn.enorm.weight", (D,))
            add(b + "nextn.hnorm.weight", (D,))
            add(b + "nextn.shared_head_norm.weight", (D,))
    for name, ne in extra:
        add(name, ne)
    _st_write_gguf(path, kvs, T)
    return {n: a for n, a, _ in T}


FLOAT_GGML = {gguf_np.GGML_F32, gguf_np.GGML_F16, gguf_np.GGML_BF16, gguf_np.GGML_F64, gguf_np.GGML_Q8_0}
INT_GGML = {gguf_np.GGML_I8, gguf_np.GGML_I16, gguf_np.GGML_I32, gguf_np.GGML_I64}


def check_mapping_file(path: str) -> dict:
    """numpy-only: parse a deepseek4 GGUF, build the HF config kwargs and the mapping plan against the
    expected HF state dict, and check every source tensor's type is one this script decodes (float
    for weights, integer for tid2eid); raises on any gap. Reads no tensor data. Returns a summary."""
    g = gguf_np.GGUFFile(path)
    hp = read_hparams(g)
    warns = check_hparams_for_hf(hp)
    want = hf_config_kwargs(hp)
    exp = expected_hf_params(hp)
    plan, ignored = build_plan({k: v[0] for k, v in exp.items()}, {n: t.shape for n, t in g.tensors.items()}, hp)
    badtype = []
    for key, srcs, tr in plan:
        allowed = INT_GGML if exp[key][1] else FLOAT_GGML
        for src in srcs:
            if g.tensors[src].ggml_type not in allowed:
                badtype.append(f"{src}: {g.tensors[src].type_name} for {key}")
    if badtype:
        fail_listing("tensor types this script cannot load", badtype)
        raise OracleError(f"{len(badtype)} GGUF tensors of unsupported type")
    ref = rope_reference(hp)
    return dict(hp=hp, want=want, plan=plan, ignored=ignored, warns=warns, rope=ref, g=g)


def self_test() -> int:
    import tempfile
    G = gguf_np
    rng = np.random.default_rng(1234)
    n_ok = 0

    def ok(cond, what):
        nonlocal n_ok
        if not cond:
            raise OracleError(f"self-test failed: {what}")
        n_ok += 1

    with tempfile.TemporaryDirectory() as td:
        # --- 1. GGUF reader: every metadata type, every decoded tensor type -----------------------
        p = os.path.join(td, "types.gguf")
        kvs = [
            ("general.architecture", G.T_STRING, "test"), ("general.alignment", G.T_UINT32, 64),
            ("t.u8", G.T_UINT8, 250), ("t.i8", G.T_INT8, -100), ("t.u16", G.T_UINT16, 65000),
            ("t.i16", G.T_INT16, -32000), ("t.u32", G.T_UINT32, 4_000_000_000), ("t.i32", G.T_INT32, -2_000_000_000),
            ("t.f32", G.T_FLOAT32, 0.1), ("t.bool", G.T_BOOL, True), ("t.str", G.T_STRING, "héllo ｜ 世界"),
            ("t.u64", G.T_UINT64, 2 ** 63 + 5), ("t.i64", G.T_INT64, -(2 ** 62)), ("t.f64", G.T_FLOAT64, math.pi),
            ("t.arr_u32", G.T_ARRAY, [0, 4, 128, 4], G.T_UINT32), ("t.arr_f32", G.T_ARRAY, [1.5, -2.25], G.T_FLOAT32),
            ("t.arr_i8", G.T_ARRAY, [-1, 2, -3], G.T_INT8), ("t.arr_bool", G.T_ARRAY, [True, False], G.T_BOOL),
            ("t.arr_str", G.T_ARRAY, ["a", "", "ccc"], G.T_STRING), ("t.arr_f64", G.T_ARRAY, [1e-300], G.T_FLOAT64),
            ("t.arr_empty", G.T_ARRAY, [], G.T_INT32),
            ("t.arr_nested", G.T_ARRAY, [(G.T_UINT16, [1, 2]), (G.T_UINT16, [3])], G.T_ARRAY),
        ]
        f32 = rng.standard_normal((3, 64)).astype(np.float32)
        f16 = rng.standard_normal((2, 5, 7)).astype(np.float16)
        bf = (rng.standard_normal((4, 9)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
        i32 = rng.integers(-2 ** 31, 2 ** 31 - 1, size=(5, 3)).astype(np.int32)
        f64 = rng.standard_normal((6,))
        q8 = (rng.standard_normal((2, 96)) * 3).astype(np.float32)
        q8[1, 32:64] = 0.0   # an all-zero block
        tens = [("a.f32", f32, G.GGML_F32), ("b.f16", f16, G.GGML_F16), ("c.bf16", bf, G.GGML_BF16),
                ("d.i32", i32, G.GGML_I32), ("e.f64", f64, G.GGML_F64), ("f.q8", q8, G.GGML_Q8_0),
                ("g.scalar", np.array([7.0], np.float32), G.GGML_F32)]
        _st_write_gguf(p, kvs, tens, alignment=64)
        with G.GGUFFile(p) as gf:
            ok(gf.version == 3 and gf.alignment == 64 and gf.data_offset % 64 == 0, "header/alignment")
            for kv in kvs:
                key, t, v = kv[0], kv[1], kv[2]
                got = gf.kv[key]
                if t == G.T_FLOAT32:
                    ok(got == float(np.float32(v)), f"kv {key}")
                elif t == G.T_ARRAY and kv[3] == G.T_STRING:
                    ok(got == v, f"kv {key}")
                elif t == G.T_ARRAY and kv[3] == G.T_ARRAY:
                    ok(len(got) == 2 and got[0].tolist() == [1, 2] and got[1].tolist() == [3], f"kv {key}")
                elif t == G.T_ARRAY:
                    exp = np.array(v, dtype=np.float32 if kv[3] == G.T_FLOAT32 else None)
                    ok(np.array_equal(got, exp) and len(got) == len(v), f"kv {key}")
                else:
                    ok(got == v and type(got) is type(v), f"kv {key} ({got!r} vs {v!r})")
            ok(gf.kv_types["t.arr_u32"] == (G.T_ARRAY, G.T_UINT32), "array kv type")
            ok(np.array_equal(gf.tensor("a.f32"), f32) and gf.tensor("a.f32").dtype == np.float32, "F32")
            ok(np.array_equal(gf.tensor("b.f16"), f16) and gf.tensors["b.f16"].ne == (7, 5, 2), "F16 + ne order")
            ok(np.array_equal(gf.tensor("c.bf16"), bf) and gf.tensor("c.bf16").dtype == np.float32, "BF16")
            ok(np.array_equal(gf.tensor("d.i32"), i32), "I32")
            ok(np.array_equal(gf.tensor("e.f64"), f64), "F64")
            x = q8.reshape(-1, 32)
            dd = (np.abs(x).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
            inv = np.where(dd > 0, 1.0 / np.maximum(dd, 1e-30), 0.0)
            qq = np.clip(np.rint(x * inv[:, None]), -127, 127)
            exp = (qq * dd[:, None]).astype(np.float32).reshape(q8.shape)
            got = gf.tensor("f.q8")
            ok(got.shape == q8.shape and np.array_equal(got, exp), "Q8_0 dequant")
            ok(np.max(np.abs(got - q8)) <= np.abs(q8).max() / 127 * 0.51 + 1e-6, "Q8_0 accuracy")
            ok(np.array_equal(gf.tensor_f("b.f16", np.float64), f16.astype(np.float64)), "tensor_f widening")
            ok(gf.raw("f.q8").nbytes == 6 * 34, "raw size")
        # bad files are rejected with GGUFError
        bad = os.path.join(td, "bad.gguf")
        with open(bad, "wb") as fh:
            fh.write(b"GGUG" + b"\0" * 40)
        try:
            G.GGUFFile(bad)
            ok(False, "bad magic accepted")
        except G.GGUFError:
            ok(True, "")
        with open(p, "rb") as fh:
            whole = fh.read()
        with open(bad, "wb") as fh:
            fh.write(whole[: len(whole) - 100])
        try:
            G.GGUFFile(bad)
            ok(False, "truncated file accepted")
        except G.GGUFError:
            ok(True, "")

        # --- 2. deepseek4 GGUF -> hparams, HF config kwargs, strict mapping ----------------------
        p = os.path.join(td, "ds4.gguf")
        arrays = _st_deepseek4_file(p, rng)
        s = check_mapping_file(p)
        hp, want, plan, ignored = s["hp"], s["want"], s["plan"], s["ignored"]
        c = ST_CONFIG
        ok(hp["n_layer"] == c["n_layer"] and hp["n_layer_all"] == c["n_layer"] + 1, "MTP layer split")
        ok(hp["compress_ratios"] == c["ratios"], "ratios")
        ok(want["layer_types"] == [LT_SLIDING, LT_CSA, LT_HCA, LT_CSA, LT_SLIDING], "layer_types")
        ok(want["mlp_layer_types"] == ["hash_moe", "hash_moe", "moe", "moe", "moe"], "mlp_layer_types")
        ok(want["compress_rates"] == {LT_CSA: 4, LT_HCA: 128}, "compress_rates")
        ok(want["swiglu_limit"] == 10.0 and want["scoring_func"] == "sqrtsoftplus", "moe fields")
        ok(want["max_position_embeddings"] == 1024, "max_position_embeddings = factor * orig")
        rp = want["rope_parameters"]
        ok(rp["compress"]["rope_type"] == "yarn" and rp["compress"]["attention_factor"] == 1.0
           and rp["main"]["rope_type"] == "default" and rp["compress"]["partial_rotary_factor"] * 32 == 8,
           "rope_parameters")
        exp = expected_hf_params(hp)
        ok(len(plan) == len(exp), f"plan covers every expected HF key ({len(plan)} vs {len(exp)})")
        used = set(sum((srcs for _, srcs, _ in plan), []))
        ign = {n for n, _ in ignored}
        ok(used | ign == set(arrays) and not (used & ign), "every GGUF tensor used or knowingly skipped")
        ok(ign == {n for n in arrays if n.startswith("blk.5.")} | {"blk.1.exp_probs_b_vl.bias"},
           f"skipped set {sorted(ign)[:4]}...")
        # value checks through the plan
        byk = {k: (srcs, tr) for k, srcs, tr in plan}
        gf = s["g"]
        a = load_plan_array(gf, *byk["model.layers.3.mlp.experts.gate_up_proj"], np.float64)
        f = c["ff"]
        ok(np.array_equal(a[:, :f], arrays["blk.3.ffn_gate_exps.weight"])
           and np.array_equal(a[:, f:], arrays["blk.3.ffn_up_exps.weight"]), "gate_up concat order")
        a = load_plan_array(gf, *byk["model.layers.0.mlp.gate.tid2eid"], np.float64)
        ok(a.dtype == np.int64 and np.array_equal(a, arrays["blk.0.ffn_gate_tid2eid.weight"]), "tid2eid")
        a = load_plan_array(gf, *byk["model.layers.1.self_attn.o_a_proj.weight"], np.float64)
        ok(np.array_equal(a, arrays["blk.1.attn_output_a.weight"]) and a.shape == (2 * 12, 4 * 32 // 2), "wo_a")
        a = load_plan_array(gf, *byk["model.layers.2.self_attn.compressor.position_bias"], np.float64)
        ok(a.shape == (128, 32), "HCA ape [ratio, d]")
        a = load_plan_array(gf, *byk["model.layers.1.self_attn.compressor.indexer.position_bias"], np.float64)
        ok(a.shape == (4, 32), "indexer ape [4, 2*di]")
        a = load_plan_array(gf, *byk["model.layers.0.self_attn.q_a_proj.weight"], np.float64)
        ok(np.array_equal(a, arrays["blk.0.attn_q_a.weight"].astype(np.float16).astype(np.float64)), "F16 weight")
        ok(map_hf_key("model.hc_head.fn")[0] == ["output_hc_fn.weight"], "hc_head alias")
        ok(map_hf_key("model.layers.7.self_attn.compressor.indexer.weights_proj.weight")[0]
           == ["blk.7.indexer.proj.weight"], "indexer weights_proj alias")
        ok(map_hf_key("model.layers.0.mlp.experts.gate_up_proj")[1] == "cat_gate_up", "experts rule")
        ok(map_hf_key("model.layers.0.self_attn.rotary.inv_freq")[0] is None, "unknown key unmapped")
        # negative: a missing GGUF tensor and an unknown extra tensor must both fail loudly
        for kw, what in ((dict(drop=("blk.3.indexer.proj.weight",)), "missing tensor"),
                         (dict(extra=(("blk.2.mystery.weight", (4,)),)), "unknown tensor")):
            p2 = os.path.join(td, "neg.gguf")
            _st_deepseek4_file(p2, np.random.default_rng(5), **kw)
            try:
                import io
                with contextlib.redirect_stderr(io.StringIO()):
                    check_mapping_file(p2)
                ok(False, f"{what} not detected")
            except OracleError:
                ok(True, "")
        # HF-side unexpected key and wrong shape
        hfs = {k: v[0] for k, v in exp.items()}
        for mut, what in ((lambda d: d.__setitem__("model.layers.0.self_attn.new_thing", (3,)), "unexpected HF key"),
                          (lambda d: d.__setitem__("model.layers.0.self_attn.sinks", (5,)), "HF shape mismatch")):
            d2 = dict(hfs)
            mut(d2)
            try:
                import io
                with contextlib.redirect_stderr(io.StringIO()):
                    build_plan(d2, {n: t.shape for n, t in gf.tensors.items()}, hp)
                ok(False, f"{what} not detected")
            except OracleError:
                ok(True, "")

        # --- 3. config field filtering (legacy fallbacks) --------------------------------------------
        class NewCfg:
            def __init__(self, vocab_size=1, layer_types=None, **kwargs):
                pass

        class OldCfg:
            def __init__(self, vocab_size=1, compress_ratios=None, num_hash_layers=0):
                pass

        kw, notes_ = filter_config_kwargs(NewCfg, want, hp)
        ok("layer_types" in kw and "compress_ratios" not in kw and "num_hash_layers" in kw, "filter new-style")
        kw, notes_ = filter_config_kwargs(OldCfg, want, hp)
        ok(kw.get("compress_ratios") == c["ratios"] and kw.get("num_hash_layers") == 2 and "hidden_size" not in kw
           and any("dropped hidden_size" in n for n in notes_), "filter old-style + notes")

        # --- 4. RoPE references ------------------------------------------------------------------------
        plain = rope_inv_freq_np(64, 160000.0)
        y1 = rope_inv_freq_np(64, 160000.0, dict(factor=1.0, orig_ctx=65536, beta_fast=32.0, beta_slow=1.0))
        ok(np.allclose(y1, plain, rtol=1e-15, atol=0), "yarn factor 1 == plain")
        y = rope_inv_freq_np(64, 160000.0, dict(factor=16.0, orig_ctx=65536, beta_fast=32.0, beta_slow=1.0))
        ok(y[0] == plain[0] and math.isclose(y[-1], plain[-1] / 16, rel_tol=1e-15), "yarn ends")
        ok(np.all((y <= plain * (1 + 1e-15)) & (y >= plain / 16 * (1 - 1e-15))), "yarn between bounds")
        ok(s["rope"]["main"].shape == (4,) and s["rope"]["compress"][0] == 1.0, "model rope tables")

        # --- 5. DS4LOGIT round trip ----------------------------------------------------------------------
        p = os.path.join(td, "x.ds4logit")
        lg = rng.standard_normal((5, 11)).astype(np.float32)
        toks = np.array([3, 1, 4, 1, 5], np.int32)
        am = write_ds4logit(p, 3, toks, lg)
        back = read_ds4logit(p)
        ok(back.n_prompt == 3 and back.n_gen == 2 and back.n_vocab == 11, "ds4logit header")
        ok(np.array_equal(back.tokens, toks) and np.array_equal(back.logits, lg)
           and np.array_equal(back.argmax, am) and np.array_equal(am, lg.argmax(1)), "ds4logit body")
        with open(p, "rb") as fh:
            raw = fh.read()
        ok(raw[:8] == b"DS4LOGIT" and struct.unpack_from("<6i", raw, 8) == (1, 11, 3, 2, 5, 0)
           and len(raw) == 32 + 8 * 5 + 4 * 55, "ds4logit exact layout")
        with open(p, "wb") as fh:
            fh.write(raw[:-4])
        try:
            read_ds4logit(p)
            ok(False, "short ds4logit accepted")
        except OracleError:
            ok(True, "")
        s["g"].close()
    print(f"self-test: {n_ok} passed, 0 failed")
    return 0


# =================================================================================================
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="deepseek4 GGUF")
    ap.add_argument("--tokens-from", help="reference DS4LOGIT file: tokens, P and G are taken from it")
    ap.add_argument("-o", "--out", help="output DS4LOGIT file")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--mode", choices=("incremental", "full", "both"), default="incremental")
    ap.add_argument("--no-rope-check", action="store_true", help="warn instead of failing when HF's RoPE tables "
                    "differ from the GGUF's (llama.cpp formulas)")
    ap.add_argument("--allow-f32-leaks", action="store_true", help="float64 mode: warn instead of failing when a "
                    "torch call still returns a float32/16/bf16 tensor")
    ap.add_argument("--self-test", action="store_true", help="numpy-only tests of the reader, mapping and file I/O")
    ap.add_argument("--check-mapping", metavar="GGUF", help="numpy only: check that the mapping covers this GGUF")
    ap.add_argument("--print-mapping", action="store_true", help="print the GGUF -> HF mapping table")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    try:
        if args.self_test:
            return self_test()
        if args.print_mapping:
            print_mapping()
            return 0
        if args.check_mapping:
            s = check_mapping_file(args.check_mapping)
            for w in s["warns"]:
                note("WARNING " + w)
            note(f"{args.check_mapping}: {len(s['plan'])} HF tensors mapped, {len(s['ignored'])} GGUF tensors "
                 f"knowingly skipped; config: {s['want']['layer_types']}")
            kw = s["want"]
            note("HF config: " + ", ".join(f"{k}={kw[k]!r}" for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "index_n_heads",
                "index_head_dim", "index_topk", "sliding_window", "max_position_embeddings", "rope_parameters")))
            s["g"].close()
            return 0
        miss = [o for o, v in (("-m", args.model), ("--tokens-from", args.tokens_from), ("-o", args.out)) if not v]
        if miss:
            raise OracleError("missing " + ", ".join(miss))
        return run_oracle(args)
    except (OracleError, gguf_np.GGUFError) as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # one line for anything unexpected too
        if args.debug:
            raise
        msg = str(e).replace("\n", " | ")
        print(f"{PROG}: error: {type(e).__name__}: {msg} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
