#!/usr/bin/env python3
"""Give a ds4 synthetic model (tokenizer.ggml.model = no_vocab) a byte-level BPE vocabulary of
exactly its vocab_size tokens, so that `-p` and `--chat` can be tested end to end.

    python3 add_vocab.py --gguf-py build/oracle/gguf-py IN.gguf OUT.gguf

The vocabulary: BOS, EOS, the 256 byte symbols, the V4 chat markers (<｜User｜>, <｜Assistant｜>:
control; <think>, </think>: user-defined), then the tokens of BPE merges learned by
write_vocab_gguf.py's trainer, in merge order, until vocab_size tokens; only merges whose
result is kept are written. pre = "deepseek-v3", BOS 0, EOS 1. Tensors and every other key are
copied unchanged (gguf-py reads and writes; nothing of ds4 is involved, so this is a second
writer of the tokenizer keys too).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_vocab_gguf as wv  # noqa: E402


def build_vocab(n_vocab: int, seed: int = 1):
    tokens, types = wv.base_vocab()
    for s, t in (("<｜User｜>", wv.TT_CONTROL), ("<｜Assistant｜>", wv.TT_CONTROL),
                 ("<think>", wv.TT_USER), ("</think>", wv.TT_USER)):
        tokens.append(s)
        types.append(t)
    if len(tokens) > n_vocab:
        sys.exit(f"add_vocab.py: error: vocab_size {n_vocab} is below the {len(tokens)} base tokens")
    have = set(tokens)
    merges = []
    for a, b in wv.train_bpe(wv.gen_text(seed, 6000), 4 * n_vocab):
        if len(tokens) == n_vocab:
            break
        if a + b in have:
            continue
        have.add(a + b)
        tokens.append(a + b)
        types.append(wv.TT_NORMAL)
        merges.append(a + " " + b)
    while len(tokens) < n_vocab:          # a corpus too small for the size: unused fillers
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    return tokens, types, merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args()
    gguf = wv.import_gguf(args.gguf_py)
    r = gguf.GGUFReader(args.src)
    arch = "deepseek4"
    n_vocab = int(r.fields[f"{arch}.vocab_size"].parts[-1][0])
    tokens, types, merges = build_vocab(n_vocab)
    w = gguf.GGUFWriter(args.dst, arch)
    skip = {"general.architecture", "tokenizer.ggml.model", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, f in r.fields.items():
        if name in skip:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            et = f.types[-1]
            vals = [f.parts[i].tolist()[0] if et != gguf.GGUFValueType.STRING else bytes(f.parts[i]).decode()
                    for i in f.data]
            w.add_array(name, vals)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[f.data[0]]).decode())
        else:
            w.add_key_value(name, f.parts[f.data[0]][0], vt)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"add_vocab.py: wrote {args.dst} ({len(tokens)} tokens, {len(merges)} merges)")


if __name__ == "__main__":
    main()
