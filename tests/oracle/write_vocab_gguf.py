#!/usr/bin/env python3
"""Write a vocabulary-only GGUF (byte-level BPE, DeepSeek V3 pre-tokenizer) with llama.cpp's
gguf-py, for comparing ds4_tok with llama.cpp's tokenizer (tests/oracle/tok_oracle.c).

    python3 write_vocab_gguf.py --gguf-py build/oracle/gguf-py -o vocab.gguf
        [--pre deepseek-v3|joyai-llm|...] [--merges 3000] [--seed 1] [--large]

Default: a small vocabulary learned here. Tokens: 0 <｜begin▁of▁sentence｜> (BOS, control),
1 <｜end▁of▁sentence｜> (EOS, control), then the 256 symbols of the GPT-2 byte alphabet in
byte order, then the result of each merge learned by the small BPE trainer below over a
generated multilingual corpus (gen_text()), then special tokens: <｜User｜> and <｜Assistant｜>
(control), <think> and </think> (user-defined), a few control placeholders. One extra merge
"Q X" whose result "QX" is *not* a token sits at rank 5, to exercise the path where a merged
symbol is not in the vocabulary.

--large: a synthetic vocabulary the size of DeepSeek V4's (129280 tokens, 127741 merges):
the byte alphabet, then merges of random pairs of existing tokens (each result a new token),
for build-time and broad-agreement tests.

Architecture metadata: general.architecture = "llama" with the handful of hyperparameters
llama.cpp reads before it loads the vocabulary (vocab_only = true loads no tensors); the
tokenizer does not depend on the architecture. Same arguments = same bytes.

gen_cases(seed, n) is also the test corpus generator used by tests/test_tokenizer.py.
"""
from __future__ import annotations

import argparse
import heapq
import os
import random
import re
import sys
import types

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SPECIAL_CONTROL = ["<｜User｜>", "<｜Assistant｜>", "<｜place▁holder▁no▁0｜>", "<｜place▁holder▁no▁1｜>"]
SPECIAL_USER = ["<think>", "</think>", "<tool>", "<｜fim▁hole｜>"]
# Typed normal (or user-defined, above), but llama.cpp retypes them by their text: control
# (end-of-generation / FIM texts), user-defined (gpt-oss), or back to normal ("</s>" when
# "<|tool_response>" exists) -- ds4_tok must do the same.
LOOKALIKES_SMALL = ["</s>", "<|im_end|>", "<｜fim▁begin｜>", "<|channel|>"]
LOOKALIKES_LARGE = ["</s>", "<|tool_response>", "<|end|>", "<|return|>", "<|call|>", "<|start|>", "[EOS]"]
TT_NORMAL, TT_CONTROL, TT_USER = 1, 3, 4


def import_gguf(gguf_py: str):
    if not os.path.isfile(os.path.join(gguf_py, "gguf", "__init__.py")):
        sys.exit(f"write_vocab_gguf.py: error: {gguf_py} is not a gguf-py checkout (run fetch_llama.sh)")
    try:
        import yaml  # noqa: F401
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    try:
        import numpy  # noqa: F401
    except ImportError:
        sys.path.append("/usr/lib/python3/dist-packages")
    sys.path.insert(0, os.path.abspath(gguf_py))
    import gguf
    return gguf


def byte_alphabet():
    keep = [b for b in range(256) if 0x21 <= b <= 0x7e or 0xa1 <= b <= 0xac or b >= 0xae]
    m, n = {}, 0
    for b in range(256):
        if b in keep:
            m[b] = chr(b)
        else:
            m[b] = chr(256 + n)
            n += 1
    return m


# ---------------------------------------------------------------------------------------------
# Text generation (training text and test cases)

WORDS_EN = ("the of and to in is was that for it with as his on be at by this had not are but from "
            "or have an they which one you were her all she there would their we him been has when who "
            "will more no if out so said what up its about into than them can only other new some time "
            "could these two may then do first any my now such like our over man me even most made after "
            "also did many before must through back years where much your way well down should because "
            "Hello World Python Linux Tokenizer DeepSeek llama GPU CUDA kernel matrix tensor").split()
CONTRACT = ["don't", "it's", "I'm", "we're", "they've", "she'll", "he'd", "IT'S", "You'RE", "o'clock"]
CODE = ["def f(x):\n    return x*2", "int main(void) { return 0; }", "for (i = 0; i < n; ++i)",
        "x += y->z[3];", "#include <stdio.h>", "if a==b and c!=d: pass", "arr[i][j] = {1, 2, 3};",
        "console.log(`${a}`);", "SELECT * FROM t WHERE id=42;", "$HOME/.config", "a->b", "::std::vector<int>",
        "/* comment */", "// TODO", "0x1F3A", "1e-9", "3.14159", "foo_bar_baz", "__init__", "@decorator",
        "https://example.com/a?b=c&d=e", "user@mail.org", "C:\\Windows\\path", "\"quoted\"", "'single'"]
LATIN = ["café", "naïve", "résumé", "Ångström", "über", "straße", "niño", "façade", "crème brûlée",
         "e\u0301te\u0301", "A\u030a", "ǅemal", "ﬁnance", "Œuvre", "Ærø", "ẞ"]
GREEK_CYR = ["Αθήνα", "λόγος", "Ωμέγα", "Москва", "привет", "Ёлка", "Україна", "Ђорђе", "ΣΊΣΥΦΟΣ"]
SEMITIC = ["مرحبا", "العربية", "٠١٢٣٤٥٦٧٨٩", "عام ٢٠٢٤", "שלום", "עברית", "۱۲۳", "ﷺ", "بِسْمِ"]
INDIC = ["नमस्ते", "हिन्दी", "०१२३४५६७८९", "संस्कृतम्", "বাংলা", "৩৪৫", "தமிழ்", "௧௨௩", "ภาษาไทย", "๑๒๓",
         "ಕನ್ನಡ", "ગુજરાતી"]
CJK = ["中文", "你好世界", "漢字", "日本語", "龥龦鿐鿿", "㐀㐁", "𠀀𠀁", "北京市", "中华人民共和国"]
KANA = ["ひらがな", "カタカナ", "こんにちは", "ラーメン", "ヴァ・イ", "ｶﾀｶﾅ", "ゟ゠ヿ", "がっこう", "東京タワー"]
HANGUL = ["한국어", "안녕하세요", "ㄱㄴㄷ", "서울"]
DIGITS = ["0", "7", "42", "123", "1234", "12345678901", "３４５", "１２３４５", "²³", "Ⅻ", "½", "⑦", "𝟘𝟙𝟚",
          "3,000,000", "99.5%", "v1.2.3", "2024-01-31", "08:40"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇫🇷🇯🇵", "🤖", "✨", "1️⃣", "👩🏾‍💻", "🧑‍🚀", "☃", "⌘", "€", "£100",
         "→", "∑x²", "≤≥", "©®™"]
PUNCT = [".", ",", "!", "?", "...", "!!!", "?!", ";", ":", "—", "–", "«»", "“quoted”", "‘x’", "。", "、",
         "！", "？", "（括号）", "【】", "《》", "・", "…", "¿Qué?", "¡Hola!", "(", ")", "[", "]", "{", "}",
         "'", "\"", "-", "--", "->", "=>", "::", "''", "'''", "$", "+", "^", "`", "|", "~", "<", ">", "\\"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \t\n",
          "\u00a0", "\u00a0\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u2009", "\u200b", "\u202f",
          "\v", "\f", " \u00a0 ", "\x1c", "\x1f", "\u1680"]
SPECIALS = [BOS, EOS] + SPECIAL_CONTROL + SPECIAL_USER + LOOKALIKES_SMALL + LOOKALIKES_LARGE + ["<｜User", "think>", "<think", "<｜", "｜>",
                                                          "<<think>>", "</think></think>"]
INVALID = [b"\x80", b"\xbf", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98", b"\xf0\x9f",
           b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x80\x80\x80",
           b"\xf8\x88\x80\x80\x80", b"\xfc", b"\xfe", b"\xff", b"\xfe\xff", b"\x80\x80\x80", b"\xc2\xa0\x80",
           b"\xe3\x81", b"\xe4\xb8\xad\x80", b"\xf4\x8f\xbf\xbf", b"\x00", b"\x7f"]
POOLS = [WORDS_EN, CONTRACT, CODE, LATIN, GREEK_CYR, SEMITIC, INDIC, CJK, KANA, HANGUL, DIGITS, EMOJI,
         PUNCT, SPACES]


def random_cp(rng: random.Random) -> str:
    """A random assigned, non-surrogate code point (categories from Python's unicodedata)."""
    import unicodedata
    while True:
        r = rng.random()
        if r < 0.5:
            cp = rng.randrange(0x80, 0x800)
        elif r < 0.9:
            cp = rng.randrange(0x800, 0x10000)
        else:
            cp = rng.randrange(0x10000, 0x30000)
        if 0xd800 <= cp <= 0xdfff:
            continue
        if unicodedata.category(chr(cp)) != "Cn":
            return chr(cp)


def gen_case(rng: random.Random, allow_invalid=True, allow_special=True) -> bytes:
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if allow_special and r < 0.05:
            parts.append(rng.choice(SPECIALS).encode())
        elif allow_invalid and r < 0.10:
            parts.append(rng.choice(INVALID))
        elif r < 0.16:
            parts.append("".join(random_cp(rng) for _ in range(rng.randint(1, 4))).encode())
        else:
            pool = rng.choice(POOLS)
            s = rng.choice(pool)
            if pool is WORDS_EN and rng.random() < 0.3:
                s = s.upper() if rng.random() < 0.5 else s.capitalize()
            parts.append(s.encode())
        if rng.random() < 0.5:
            parts.append(rng.choice([b" ", b" ", b" ", b"", b"\n", b"  ", b"\t"]))
    return b"".join(parts)


def llama_decode_overflows(b: bytes) -> bool:
    """True if llama.cpp's lenient UTF-8 decoder would produce a code point above U+10FFFF
    (a 4-byte form with lead F4..F7): llama.cpp v0.4.0 then throws and aborts the process, so
    such inputs cannot be compared (ds4 turns the lead byte into U+FFFD instead)."""
    i, n = 0, len(b)
    while i < n:
        c = b[i]
        k = 1 if c < 0x80 else 0 if c < 0xc0 else 2 if c < 0xe0 else 3 if c < 0xf0 else 4 if c < 0xf8 else 0
        if k == 0 or (k > 1 and (i + k > n or any((b[i + j] & 0xc0) != 0x80 for j in range(1, k)))):
            i += 1
            continue
        if k == 4 and (((c & 7) << 18) | ((b[i + 1] & 0x3f) << 12)) > 0x10ffff:
            return True
        i += k
    return False


def gen_fuzz(rng: random.Random) -> bytes:
    """Random bytes: ASCII, UTF-8 lead and continuation bytes, fragments of valid sequences."""
    out = bytearray()
    for _ in range(rng.randint(1, 24)):
        r = rng.random()
        if r < 0.3:
            out.append(rng.randrange(0x20, 0x7f))
        elif r < 0.5:
            out.append(rng.randrange(0x80, 0x100))
        elif r < 0.6:
            out.append(rng.choice([0x09, 0x0a, 0x0d, 0x0b, 0x0c, 0x20, 0x00, 0x1c]))
        else:
            e = random_cp(rng).encode()
            out += e[:rng.randint(1, len(e))] if rng.random() < 0.3 else e
    return bytes(out)


def gen_cases(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    fixed = [b"", b" ", b"Hello world", b"Hello, world! 123456789", b"  leading and trailing  ",
             b"a\r\nb\n\nc\r\r\n", "<｜User｜>Hi<｜Assistant｜><think>\nhmm\n</think>Answer".encode(),
             (BOS + "text" + EOS).encode(), "中文English日本語ひらがなカタカナ123".encode(),
             "١٢٣٤ ०१२३ ３４５６７".encode(), "👨‍👩‍👧‍👦 family 🏳️‍🌈".encode(), b"\xff\xfe abc \x80",
             b"Quixote QX QXQX qQXx", b"x" * 300, b" " * 50 + b"y", b"\n" * 20, ("é" * 40).encode()]
    cases = list(fixed)
    while len(cases) < n:
        c = gen_fuzz(rng) if rng.random() < 0.15 else gen_case(rng)
        if not llama_decode_overflows(c):
            cases.append(c)
    return cases


def gen_text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(gen_case(rng, allow_invalid=False, allow_special=False).decode())
    return "\n".join(out)


def escape_case(b: bytes) -> str:
    """One corpus line: UTF-8 text, with \\\\ \\n \\r \\t and \\xNN (for other control bytes and
    bytes that are not valid UTF-8)."""
    s = b.decode("utf-8", errors="surrogateescape")
    o = []
    for ch in s:
        c = ord(ch)
        if ch == "\\":
            o.append("\\\\")
        elif ch == "\n":
            o.append("\\n")
        elif ch == "\r":
            o.append("\\r")
        elif ch == "\t":
            o.append("\\t")
        elif 0xdc80 <= c <= 0xdcff:
            o.append("\\x%02x" % (c - 0xdc00))
        elif c < 0x20 or c == 0x7f:
            o.append("\\x%02x" % c)
        else:
            o.append(ch)
    return "".join(o)


# ---------------------------------------------------------------------------------------------
# A small byte-level BPE trainer

PRE_RE = re.compile(r"[^\s\w]?[A-Za-z]+| ?[^\W\d_]+| ?[^\s\w]+|\d{1,3}|\s*[\r\n]+|\s+(?!\S)|\s+|\w", re.UNICODE)


def train_bpe(text: str, n_merges: int):
    alpha = byte_alphabet()
    freq = {}
    for w in PRE_RE.findall(text):
        enc = "".join(alpha[b] for b in w.encode())
        freq[enc] = freq.get(enc, 0) + 1
    words = [list(w) for w in freq]
    counts = list(freq.values())
    pair_n, where = {}, {}
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_n[(a, b)] = pair_n.get((a, b), 0) + counts[i]
            where.setdefault((a, b), set()).add(i)
    heap = [(-c, p) for p, c in pair_n.items()]
    heapq.heapify(heap)
    merges = []
    while heap and len(merges) < n_merges:
        c, p = heapq.heappop(heap)
        if pair_n.get(p, 0) != -c or -c < 2:
            continue
        merges.append(p)
        a, b = p
        changed = set()
        for i in sorted(where.get(p, ())):
            w = words[i]
            if not any(w[k] == a and w[k + 1] == b for k in range(len(w) - 1)):
                continue
            for x, y in zip(w, w[1:]):
                pair_n[(x, y)] -= counts[i]
                changed.add((x, y))
            nw, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and w[k] == a and w[k + 1] == b:
                    nw.append(a + b)
                    k += 2
                else:
                    nw.append(w[k])
                    k += 1
            words[i] = nw
            for x, y in zip(nw, nw[1:]):
                pair_n[(x, y)] = pair_n.get((x, y), 0) + counts[i]
                where.setdefault((x, y), set()).add(i)
                changed.add((x, y))
        for q in changed:
            if pair_n.get(q, 0) > 0:
                heapq.heappush(heap, (-pair_n[q], q))
    return merges


def base_vocab():
    """BOS, EOS and the 256 byte symbols, with their token types."""
    alpha = byte_alphabet()
    return [BOS, EOS] + [alpha[b] for b in range(256)], [TT_CONTROL, TT_CONTROL] + [TT_NORMAL] * 256


def add_specials(tokens, ttypes, lookalikes):
    """The control and user-defined specials, then normal-typed look-alikes llama.cpp retypes."""
    for group, tt in ((SPECIAL_CONTROL, TT_CONTROL), (SPECIAL_USER, TT_USER), (lookalikes, TT_NORMAL)):
        for s in group:
            tokens.append(s)
            ttypes.append(tt)


def build_small(seed: int, n_merges: int):
    tokens, ttypes = base_vocab()
    merges = train_bpe(gen_text(seed, 6000), n_merges)
    have = set(tokens)
    for a, b in merges:
        if a + b not in have:
            have.add(a + b)
            tokens.append(a + b)
            ttypes.append(TT_NORMAL)
    assert ("Q", "X") not in merges and "QX" not in have
    merges.insert(5, ("Q", "X"))
    add_specials(tokens, ttypes, LOOKALIKES_SMALL)
    # normal tokens with characters outside the byte alphabet: their pieces are llama.cpp's
    # "[UNK_BYTE_0x..]" text; and one unused token (empty piece)
    for s, tt in (("\u2581x", TT_NORMAL), ("a\u00adb", TT_NORMAL), ("\u0080", TT_NORMAL), ("unused0", 5)):
        tokens.append(s)
        ttypes.append(tt)
    return tokens, ttypes, [a + " " + b for a, b in merges]


def build_large(seed: int, n_tokens=129280, n_merges=127741):
    rng = random.Random(seed)
    tokens, ttypes = base_vocab()
    have = set(tokens)
    normal = list(tokens[2:])
    merges = []
    n_special = len(SPECIAL_CONTROL) + len(SPECIAL_USER) + len(LOOKALIKES_LARGE)
    assert n_tokens - n_special - len(tokens) >= n_merges   # every merge result is a token
    while len(merges) < n_merges:
        # favour short, recent tokens so that merges chain the way trained ones do
        a = normal[rng.randrange(len(normal))] if rng.random() < 0.5 else normal[-1 - rng.randrange(min(len(normal), 2000))]
        b = normal[rng.randrange(min(len(normal), 600))]
        if a + b in have or len(a + b) > 16:
            continue
        have.add(a + b)
        merges.append(a + " " + b)
        tokens.append(a + b)
        ttypes.append(TT_NORMAL)
        normal.append(a + b)
    add_specials(tokens, ttypes, LOOKALIKES_LARGE)
    while len(tokens) < n_tokens:
        tokens.append("<｜place▁holder▁no▁%d｜>" % len(tokens))
        ttypes.append(TT_CONTROL)
    return tokens, ttypes, merges


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--pre", default="deepseek-v3")
    ap.add_argument("--merges", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--write-corpus", metavar="FILE", help="also write gen_cases(seed, --cases) to FILE")
    ap.add_argument("--cases", type=int, default=4000)
    ap.add_argument("--bad-merge", choices=["nospace", "twospaces", "unknown"],
                    help="append one malformed merge (for ds4's error tests)")
    a = ap.parse_args()
    gguf = import_gguf(a.gguf_py)
    if a.large:
        tokens, ttypes, merges = build_large(a.seed)
    else:
        tokens, ttypes, merges = build_small(a.seed, a.merges)
    if a.bad_merge:
        merges = merges + [{"nospace": "ab", "twospaces": "a b c", "unknown": "a \u2603\u2603"}[a.bad_merge]]
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_string(gguf.Keys.General.NAME, "ds4-tok-oracle")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(a.pre)
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if a.write_corpus:
        with open(a.write_corpus, "w", encoding="utf-8", newline="\n") as f:
            for c in gen_cases(a.seed, a.cases):
                f.write(escape_case(c) + "\n")
    print(f"write_vocab_gguf.py: {a.out}: {len(tokens)} tokens, {len(merges)} merges, pre {a.pre}")


if __name__ == "__main__":
    main()
