#!/usr/bin/env bash
# Fetch the llama.cpp oracle (release v0.4.0) from the npm registry.
#
#   tests/oracle/fetch_llama.sh [DIR]        (default DIR: build/oracle)
#
# Result:
#   DIR/lib/      prebuilt CPU libraries (libllama, libggml, libggml-base, libggml-cpu-*)
#                 plus the unversioned symlinks the linker needs (libllama.so, libggml.so)
#   DIR/include/  llama.h, llama-cpp.h and ggml/include/*.h of the same release
#   DIR/gguf-py/  llama.cpp's own gguf Python package (used by write_gguf_ggufpy.py)
#
# Idempotent: does nothing when DIR/lib/libllama*.so and DIR/include/llama.h exist.
# Needs: npm (registry access), git, tar. The llama.cpp sources come from the git bundle
# that node-llama-cpp ships (llama/gitRelease.bundle); only headers and gguf-py are kept.
set -euo pipefail

NLC_VERSION=3.21.1
LLAMA_TAG=v0.4.0

DIR=${1:-build/oracle}

die() { echo "fetch_llama.sh: error: $*" >&2; exit 1; }

if compgen -G "$DIR/lib/libllama*.so" >/dev/null && [ -f "$DIR/include/llama.h" ]; then
    echo "fetch_llama.sh: $DIR already has libllama and llama.h; nothing to do"
    exit 0
fi

command -v npm >/dev/null 2>&1 || die "npm not found (install Node.js/npm, e.g. apt-get install -y npm)"
command -v git >/dev/null 2>&1 || die "git not found (apt-get install -y git)"
command -v tar >/dev/null 2>&1 || die "tar not found"

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

TMP=$(mktemp -d "${TMPDIR:-/tmp}/ds4-oracle.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

(
    cd "$TMP"
    npm pack --silent "node-llama-cpp@$NLC_VERSION" "@node-llama-cpp/linux-x64@$NLC_VERSION" >npm-pack.log 2>&1 \
        || { cat npm-pack.log >&2; exit 1; }
) || die "npm pack node-llama-cpp@$NLC_VERSION @node-llama-cpp/linux-x64@$NLC_VERSION failed"

NLC_TGZ=$TMP/node-llama-cpp-$NLC_VERSION.tgz
LX_TGZ=$TMP/node-llama-cpp-linux-x64-$NLC_VERSION.tgz
[ -f "$NLC_TGZ" ] || die "npm pack did not produce $(basename "$NLC_TGZ")"
[ -f "$LX_TGZ" ]  || die "npm pack did not produce $(basename "$LX_TGZ")"

mkdir -p "$TMP/nlc" "$TMP/lx"
tar -xzf "$NLC_TGZ" -C "$TMP/nlc" package/llama/gitRelease.bundle \
    || die "node-llama-cpp tarball has no llama/gitRelease.bundle"
tar -xzf "$LX_TGZ" -C "$TMP/lx" \
    || die "cannot unpack $(basename "$LX_TGZ")"

BINS=$TMP/lx/package/bins/linux-x64
compgen -G "$BINS/libllama*.so" >/dev/null || die "no libllama*.so in @node-llama-cpp/linux-x64 bins/linux-x64"

# --- libraries ---------------------------------------------------------------------------------
rm -rf "$DIR/lib"
mkdir -p "$DIR/lib"
cp "$BINS"/*.so "$DIR/lib/"
# The libraries carry versioned SONAMEs (libllama.v0.4.0.so, libggml.v0.4.0.so) and a RUNPATH of
# $ORIGIN, so they find each other at run time; `-lllama -lggml` needs unversioned names to link.
(
    cd "$DIR/lib"
    for base in llama ggml; do
        if [ ! -e "lib$base.so" ]; then
            v=$(ls "lib$base".v*.so 2>/dev/null | head -n1 || true)
            [ -n "$v" ] || { echo "fetch_llama.sh: error: no lib$base.v*.so in bins" >&2; exit 1; }
            ln -s "$v" "lib$base.so"
        fi
    done
)

# --- headers and gguf-py from the git bundle ----------------------------------------------------
BUNDLE=$TMP/nlc/package/llama/gitRelease.bundle
git init -q "$TMP/repo"
git -C "$TMP/repo" fetch -q "$BUNDLE" HEAD || die "cannot read llama.cpp git bundle"
rm -rf "$DIR/include" "$DIR/gguf-py" "$TMP/src"
mkdir -p "$TMP/src" "$DIR/include"
git -C "$TMP/repo" archive FETCH_HEAD include/llama.h include/llama-cpp.h ggml/include gguf-py \
    | tar -x -C "$TMP/src" || die "git archive of headers/gguf-py failed"
cp "$TMP/src/include/llama.h" "$TMP/src/include/llama-cpp.h" "$DIR/include/"
cp "$TMP/src"/ggml/include/*.h "$DIR/include/"
cp -r "$TMP/src/gguf-py" "$DIR/gguf-py"
COMMIT=$(git -C "$TMP/repo" rev-parse FETCH_HEAD)

cat >"$DIR/VERSION" <<EOF
node-llama-cpp $NLC_VERSION
@node-llama-cpp/linux-x64 $NLC_VERSION
llama.cpp $LLAMA_TAG (bundle commit $COMMIT)
EOF

echo "fetch_llama.sh: installed llama.cpp $LLAMA_TAG ($(ls "$DIR/lib" | wc -l) libs, $(ls "$DIR/include" | wc -l) headers, gguf-py) into $DIR"
